"""kernels/gpu/inspect.py: the static inspection of stage 1 compiled for sm_90a on a machine without a GPU."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.gpu import inspect as insp

ROOT = Path(__file__).resolve().parents[3]


# In this process, as compiled: the inspector refuses only TRITON_INTERPRET=1 (the tests run under the interpreter)
COMPILED = {"TRITON_INTERPRET": "0"}

SASS = """
        /*0100*/                   MOV R1, c[0x0][0x28] ;
        /*0110*/                   LDG.E.U8 R2, desc[UR4][R4.64] ;
        /*0120*/                   BRA 0x140 ;
        /*0130*/                   NOP ;
        /*0140*/                   LDG.E.128 R8, desc[UR4][R6.64] ;
        /*0150*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64] ;
        /*0160*/                   HMMA.16816.F32 R12, R8, R10, R12 ;
        /*0170*/              @!P0 BRA 0x140 ;
        /*0180*/                   SHF.R.U32.HI R2, RZ, 0x8, R2 ;
        /*0190*/                   BRA 0x180 ;
        /*01a0*/                   EXIT ;
"""


def test_main_loop_is_the_backward_branch_around_an_mma():
    """The loop at 0x140..0x170 holds the HMMA; the one at 0x180 does not; the forward branch is no loop."""
    loop = insp.main_loop(insp.instructions(SASS))
    assert [addr for addr, _, _ in loop] == [0x140, 0x150, 0x160, 0x170]
    assert [insp.load_width(op) for _, op, _ in loop] == [16, 16, None, None]
    assert (
        insp.load_width("LDG.E.U8") == 1
        and insp.load_width("LDG.E.64") == 8
        and insp.load_width("LDG.E") == 4
    )


def test_loop_mix_counts_spill_code_as_local():
    """A spilled register's reload and store inside the loop count in `local`; the loop's other columns as MIX."""
    sass = SASS.replace("HMMA.16816.F32 R12, R8, R10, R12 ;", "LDL.LU R9, [R1+0x4] ;").replace(
        "LDG.E.128 R8, desc[UR4][R6.64] ;", "STL [R1+0x8], R2 ;"
    )
    assert insp.loop_mix(insp.main_loop(insp.instructions(SASS))) == {
        "ldg": 1,
        "ldgsts": 1,
        "mma": 1,
        None: 1,
    }
    mix = insp.loop_mix([(0, "LDL.LU", ""), (1, "STL.64", ""), (2, "LDS.U", ""), (3, "FADD", "")])
    assert mix == {"local": 2, "lds": 1, None: 1} and "local" in insp.COLUMNS
    assert (
        insp.loop_mix([(a, op, x) for a, op, x in insp.instructions(sass) if 0x140 <= a <= 0x170])["local"]
        == 2
    )


def test_kv_bytes_per_token_counts_payload_scales_and_zeros():
    assert insp.kv_bytes_per_token(4, 128) == 64 + 4 * 2 * 2
    assert insp.kv_bytes_per_token(2, 64, group_size=16) == 16 + 4 * 2 * 2
    assert insp.kv_bytes_per_token(16, 128) == 256


def test_inspector_compiles_one_variant_for_hopper(cli, tmp_path):
    """The 4-bit fast kernel compiled for sm_90a with this machine's Triton: its resources, loop and loads."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "inspect.csv"
    proc = cli("kernels.gpu.inspect", "--widths", "4", "--out", str(out), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = list(csv.DictReader(open(out)))
    from kernels.decode_attention import FAST_LAUNCH, fast_block_n

    assert (
        row["kernel"] == "_decode_packed_kernel"
        and row["key_bits"] == "4"
        and row["block_n"] == str(fast_block_n(4, 4, 128))
    )
    # the default launch reaches the compiler: its stages, and its register cap (which Triton 3.6, the GPU
    # machines', meets without spilling; later Tritons may spill under it, so spills are only reported here)
    assert row["num_stages"] == str(FAST_LAUNCH[4]["num_stages"])
    assert 0 < int(row["registers"]) <= FAST_LAUNCH[4]["maxnreg"] and int(row["spill_bytes"]) >= 0
    assert int(row["loop_instr"]) > 0 and int(row["mma"]) > 0
    assert float(row["instr_per_byte"]) == pytest.approx(
        int(row["loop_instr"]) * 32 * 4 / (fast_block_n(4, 4, 128) * 2 * (64 + 16)), rel=1e-2
    )
    assert "1" not in row["payload_load_bytes"].split()  # no byte-wide load in the loop
    assert int(row["i2f"]) == 0  # codes become fp16 by bit operations


SPECIALIZATIONS = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
from kernels.gpu import inspect as insp

backend = make_backend(GPUTarget("cuda", insp.TARGET_ARCH, 32))
keys = set()
for length in map(int, sys.argv[1:]):
    launch = insp.catch_stage1(4, 4, None, 4, None, insp.SHAPE, length=length)
    bind = create_function_from_signature(launch.fn.signature, launch.fn.params, backend)
    keys.add(repr(bind(*launch.args, **launch.kwargs)[1]))
print(len(keys))
"""


def test_a_growing_cache_reuses_one_compiled_fast_kernel(tmp_path):
    """The fast kernel is specialized on nothing that changes from one eager decode step to the next: the stored
    length (a multiple of 16 or not) gives the JIT one specialization key, so a bucket compiles once."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "keys.py"
    script.write_text(SPECIALIZATIONS)
    proc = subprocess.run(
        [sys.executable, str(script), "32768", "32767", "32753", "32001"],
        env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1"]


def test_inspector_refuses_interpreter_mode(in_process):
    proc = in_process(insp.main, "kernels.gpu.inspect", "--widths", "4", env={"TRITON_INTERPRET": "1"})
    assert proc.returncode != 0 and "TRITON_INTERPRET=1 is set" in proc.stderr


def test_static_targets_name_what_a_variant_misses():
    row = {"key_bits": "4", "value_bits": "4", "instr_per_byte": "5.41", "registers": "168", "spill_bytes": "0",
           "payload_load_bytes": "8 16", "i2f": "0"}  # fmt: skip
    assert insp.static_targets(row) == "missed: instr/byte 5.41 > 4; registers 168 > 128"
    ok = {**row, "instr_per_byte": "3.9", "registers": "128"}
    assert insp.static_targets(ok) == "met"
    assert (
        insp.static_targets({**ok, "payload_load_bytes": "1 16", "i2f": "64"})
        == "missed: byte-wide loads; 64 I2F"
    )
    three = {
        **ok,
        "key_bits": "3",
        "value_bits": "3",
        "instr_per_byte": "6.0",
    }  # no instr/byte target at 3 bits
    assert insp.static_targets(three) == "met"
    assert insp.static_targets({**three, "spill_bytes": "8"}) == "missed: spills 8 B"
    assert insp.static_targets({**ok, "key_bits": "16", "value_bits": "16"}) == ""
    assert insp.static_targets({**ok, "value_bits": "8"}) == ""  # mixed widths


def test_inspector_reads_each_bucket_of_a_mixed_map(cli, tmp_path):
    """--map compiles a per-head map's launches: the fast kernel's, a row per bucket from its branch's loop (2 and
    4 bits here, at their own tiles), and the 16-bit bucket's own launch of the generic kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "map.csv"
    proc = cli("kernels.gpu.inspect", "--map", "4,16,2,4", "--hkv", "4", "--hq", "16", "--out", str(out), env=env,
               timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(open(out)))
    from kernels.decode_attention import fast_block_n

    assert [(r["kernel"], r["key_bits"], r["block_n"]) for r in rows] == [
        ("_decode_packed_kernel", "2", str(fast_block_n(2, 2, 128))),
        ("_decode_packed_kernel", "4", str(fast_block_n(4, 4, 128))),
        ("_decode_split_kernel", "16", "32"),
    ]
    fast = rows[:2]
    # one kernel's resources; the loops in bucket order: a 4-bit tile has twice the words of a 2-bit one
    assert fast[0]["registers"] == fast[1]["registers"] and int(fast[0]["loop_instr"]) < int(
        fast[1]["loop_instr"]
    )
    assert all(int(r["loop_instr"]) > 0 and int(r["mma"]) > 0 for r in rows)
    assert (
        fast[1]["note"] == "map 4,16,2,4, branch 2 of 2"
        and rows[2]["note"] == "map 4,16,2,4, a launch of its own"
    )


def test_inspector_refuses_a_map_of_the_wrong_length(in_process):
    proc = in_process(insp.main, "kernels.gpu.inspect", "--map", "4,4,2", env=COMPILED)
    assert proc.returncode == 2 and "--map: 3 widths for --hkv 8 KV heads" in proc.stderr


def test_inspector_compiles_the_codes_only_path(cli, in_process, tmp_path):
    """--codes compiles decode_attention_blocks' stage 1 over codes-only stores (blocks of --qblock tokens): its
    default tile and launch (CODES_LAUNCH), and instructions per KV byte over the payload alone."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "codes.csv"
    proc = cli("kernels.gpu.inspect", "--codes", "--qblock", "128", "--widths", "4", "--out", str(out), env=env,
               timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = list(csv.DictReader(open(out)))
    from kernels.decode_attention import CODES_LAUNCH

    assert (row["format"], row["qblock"], row["kernel"]) == ("codes", "128", "_decode_packed_kernel")
    assert row["block_n"] == str(CODES_LAUNCH[4]["block_n"]) and int(row["mma"]) > 0
    assert float(row["instr_per_byte"]) == pytest.approx(
        int(row["loop_instr"]) * 32 * 4 / (CODES_LAUNCH[4]["block_n"] * 2 * 64), rel=1e-2
    )
    assert "1" not in row["payload_load_bytes"].split() and int(row["i2f"]) == 0
    proc = in_process(insp.main, "kernels.gpu.inspect", "--codes", "--widths", "16", env=COMPILED)
    assert proc.returncode == 2 and "no 16-bit heads" in proc.stderr


def test_codes_rows_count_the_payload_and_take_their_own_targets():
    assert (
        insp.kv_bytes_per_token(4, 128, codes=True) == 64 and insp.kv_bytes_per_token(2, 64, codes=True) == 16
    )
    row = {"key_bits": "2", "value_bits": "2", "instr_per_byte": "5.9", "registers": "120", "spill_bytes": "0",
           "payload_load_bytes": "8 16", "i2f": "0"}  # fmt: skip
    assert insp.static_targets(row) == "missed: instr/byte 5.9 > 5"
    assert insp.static_targets({**row, "format": "codes"}) == "met"
    assert (
        insp.static_targets({**row, "format": "codes", "instr_per_byte": "6.2"})
        == "missed: instr/byte 6.2 > 6"
    )


def test_an_allocation_weighs_each_branch_by_the_heads_that_hold_its_widths(in_process, tmp_path):
    """--allocation: the (key, value) width pairs of a recorded point, counted over its (layer, KV head) units,
    and the launch's thread-instructions per KV byte over them (by hand: 3 units of a 4-bit pair, 568
    instructions a 128-token tile of 128 bytes a token; 1 unit of a 2-bit pair, 470 a tile of 64 bytes a token)."""
    point = tmp_path / "point.json"
    point.write_text('{"allocation": {"key_bits": [[4, 2], [4, 4]], "value_bits": [[4, 2], [4, 4]]}}')
    pairs = insp.allocation_pairs(point)
    assert pairs == {(4, 4): 3, (2, 2): 1}
    row = {"block_n": "128", "num_warps": "4"}
    rows = [
        {**row, "key_bits": "4", "value_bits": "4", "loop_instr": "568", "kv_bytes_per_tile": str(128 * 128)},
        {**row, "key_bits": "2", "value_bits": "2", "loop_instr": "470", "kv_bytes_per_tile": str(128 * 64)},
    ]
    assert insp.mix_instr_per_byte(rows, pairs) == round((3 * 568 + 470) * 128 / (128 * (3 * 128 + 64)), 2)
    point.write_text('{"allocation": {"key_bits": [[4, 2]], "value_bits": [[4]]}}')
    with pytest.raises(ValueError, match="holds no allocation"):
        insp.allocation_pairs(point)
    proc = in_process(insp.main, "kernels.gpu.inspect", "--codes", "--allocation", str(point), env=COMPILED)
    assert (
        proc.returncode == 2 and "point.json holds no allocation with key_bits and value_bits" in proc.stderr
    )


def test_inspector_compiles_grouped_plans(in_process, tmp_path):
    """--key-plans/--value-plans give a --codes map's widths grouped rows (kernels/groups.py): the branch compiles
    for sm_90a under the register cap, without spills where the Triton that compiles is 3.6, the GPU machines' (how
    its tiles are laid out depends on the Triton: results/kernels has 3.6's; 3.9 spills 16 B here), checked with
    3.6 too where `make inspect`'s environment is there; a plan without --codes, a width with neither plan nor flat
    kernel and a malformed plan are refused."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    plan = ["--key-plans", "2=4,4,2,2,1,1,1,1", "--value-plans", "2=4,4,2,2,1,1,1,1"]  # smollm2-135m's
    args = ["-m", "kernels.gpu.inspect", "--codes", "--map", "2,2,2,2,2,2,2,2", *plan, "--out"]
    triton36 = ROOT / ".venv-triton36" / "bin" / "python"
    for python in [sys.executable] + ([str(triton36)] if triton36.exists() else []):
        out = tmp_path / "groups.csv"
        proc = subprocess.run([python, *args, str(out)], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        (row,) = list(csv.DictReader(open(out)))
        assert row["format"] == "codes" and int(row["mma"]) > 0
        assert int(row["spill_bytes"]) == 0 or not row["triton"].startswith("3.6.")
        assert int(row["registers"]) <= 128  # a launch with a grouped bucket is capped (GROUPS_MAXNREG)
    proc = in_process(insp.main, "kernels.gpu.inspect", "--map", "2,2,2,2,2,2,2,2", *plan, env=COMPILED)
    assert proc.returncode == 2 and "add --codes" in proc.stderr
    proc = in_process(insp.main, "kernels.gpu.inspect", "--codes", "--map", "5,5,5,5,5,5,5,5", env=COMPILED)
    assert proc.returncode == 2 and "one with a grouped plan" in proc.stderr
    proc = in_process(insp.main, "kernels.gpu.inspect", "--codes", "--key-plans", "2:4,4", env=COMPILED)
    assert proc.returncode == 2 and "is not WIDTH=GROUP_WIDTHS" in proc.stderr


def test_inspector_compiles_the_turned_kernel(cli, in_process, tmp_path):
    """--turned compiles kernels/turned_attention.py's kernel for sm_90a at each width's key and value plans: rows of
    its own format and digest, the grouped rows' bytes counted (2 bits: 32 bytes a token and role at head_dim 128);
    a width without a plan, and --codes beside it, are refused."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "turned.csv"
    plans = [
        "--key-plans",
        "2=4,4,2,2,2,2,0,0",
        "--value-plans",
        "2=3,3,2,2,2,2,1,1",
    ]  # pca_gsa's, smollm2-135m
    proc = cli("kernels.gpu.inspect", "--turned", "lloyd", "--widths", "2", *plans, "--block-n", "32", "--out",
               str(out), env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = list(csv.DictReader(open(out)))
    assert (row["format"], row["kernel"], row["block_n"]) == ("turned-lloyd", "_turned_kernel", "32")
    assert int(row["kv_bytes_per_tile"]) == 32 * (32 + 32) and int(row["mma"]) > 0
    assert row["kernel_sha"] == insp.kernel_sha(insp.TURNED_SOURCES) != insp.kernel_sha()
    assert "(4, 4, 2, 2, 2, 2, 0, 0)" in row["note"]
    proc = in_process(
        insp.main, "kernels.gpu.inspect", "--turned", "lloyd", "--widths", "3", *plans, env=COMPILED
    )
    assert proc.returncode == 2 and "width 3 has no plan" in proc.stderr
    proc = in_process(
        insp.main, "kernels.gpu.inspect", "--turned", "uniform", "--codes", *plans, env=COMPILED
    )
    assert proc.returncode == 2 and "no --codes or --map" in proc.stderr


WRITE_KERNEL = """
import torch
from kernels import quantize as q
from kernels.gpu import inspect as ins
from kernels.layout import PackedStore
caught = []
q._quantize_codes_kernel.run = lambda *a, grid, warmup, **k: caught.append(ins.Launch(q._quantize_codes_kernel, a, k))
plans = {1: (2, 2, 1, 1, 1, 1, 0, 0), 2: (4, 4, 2, 2, 1, 1, 1, 1), 5: (8, 8, 4, 4, 4, 4, 4, 4)}
st = PackedStore([1, 2, 5, 4], 128, 8, device="meta", capacity=64, codes_only=True, plans=plans)
z = torch.empty(8, 4, 1, 128, device="meta")
q.quantize_codes_into(st, z, 3, torch.empty(4, 128, device="meta"), torch.empty(9, 255, device="meta"))
_, resources = ins.sass_and_resources(ins.compile_for_hopper(caught[0])[0])
print("LOCAL", resources["LOCAL"])
"""


def test_the_write_kernel_compiles_grouped_branches_for_hopper(cli, tmp_path):
    """The codes-only write kernel (quantize_codes_into) with grouped buckets beside a flat one compiles for sm_90a
    (the interpreter runs code the compiler refuses, such as a constexpr assigned twice in an unrolled loop), without
    local memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", WRITE_KERNEL], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "LOCAL 0" in proc.stdout
