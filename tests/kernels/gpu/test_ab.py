"""kernels/gpu/ab.py: versions of the decode kernel timed side by side, each compiled from its own file."""

from __future__ import annotations

import csv
import os
import shutil
from pathlib import Path

import pytest

from kernels.gpu import ab

ROOT = Path(__file__).resolve().parents[3]
KERNEL = ROOT / "kernels" / "decode_attention.py"


def test_dry_run_times_every_version_on_the_same_stores(tmp_path, interpreted):
    """Under the interpreter: in the test process where Triton interprets (tests/conftest.py); kernels/gpu/check.py's
    dry run (tests/kernels/gpu/test_check.py) runs the command as a new process."""
    other = tmp_path / "copy.py"
    shutil.copy(KERNEL, other)
    out = tmp_path / "ab.csv"
    point = tmp_path / "point.json"  # 2 units at K4V4 and 1 at K8V2: on 2 KV heads, one head each
    point.write_text('{"allocation": {"key_bits": [[4, 4, 8]], "value_bits": [[4, 4, 2]]}}')
    proc = interpreted(ab.main, "kernels.gpu.ab", str(KERNEL), str(other), "--dry-run", "--batch", "2", "--context",
                      "40", "--widths", "4", "16", "--splits", "3", "--codes", "2", "--codes-allocation", str(point),
                      "--qblock", "32", "16", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows if r["method"].startswith("sdpa")] == ["sdpa_default"]
    fused = [r for r in rows if r["method"].startswith("fused:")]
    # 2 versions x 2 width maps x (default splits, 3 splits), each checked against SDPA over the stores
    assert len(fused) == 8 and {r["method"] for r in fused} == {"fused:decode_attention", "fused:copy"}
    assert all(0 < float(r["rel_err"]) < 2e-2 for r in fused)
    # each version at its default splits replayed from a CUDA graph too (none without CUDA: rows without a time)
    graph = [r for r in rows if r["method"].startswith("graph:")]
    assert sorted((r["method"], r["widths"]) for r in graph) == sorted(
        (f"graph:{v}", w) for v in ("decode_attention", "copy") for w in ("4", "16")
    )
    assert all(r["time_us"] == "nan" for r in rows if "graph:" in r["method"])
    defaults = {(r["method"][6:], r["widths"], r["note"]) for r in fused if r["note"] != "splits=3"}
    assert {(r["method"][6:], r["widths"], r["note"]) for r in graph} == defaults
    by_version = {}
    for r in fused:  # the same code on the same stores: the same outputs
        by_version.setdefault((r["widths"], r["note"]), set()).add(r["rel_err"])
    assert all(len(errs) == 1 for errs in by_version.values())
    # the codes-only path of each version at each block size (32-token blocks first), against the float64 oracle
    # over the same random codes
    codes = [r for r in rows if r["method"].startswith("codes:")]
    assert [(r["method"], r["widths"], r["note"].split("; ")[1]) for r in codes] == [
        (f"codes:{v}", w, f"qblock={q}")
        for q in (32, 16)
        for w in ("2", "4,8/4,2")
        for v in ("decode_attention", "copy")
    ]
    assert all(0 < float(r["rel_err"]) < 1e-2 for r in codes)
    assert {r["note"].split(";")[0] for r in codes} == {"2", "point"}
    assert len([r for r in rows if r["method"].startswith("codes-graph:")]) == 8


def test_host_mode_times_each_version_with_its_launches_stubbed(tmp_path, cli, in_process):
    """--host needs no GPU: each version's call at each width map, every launch stubbed (counted: the fast
    kernel's one launch for every packed bucket, a generic one for 16 bits, the combine), alone and with the
    JIT's argument binding (a new process without TRITON_INTERPRET; refused in the test process, which has it)."""
    other = tmp_path / "copy.py"
    shutil.copy(KERNEL, other)
    out = tmp_path / "host.csv"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = cli("kernels.gpu.ab", str(KERNEL), str(other), "--host", "--batch", "2", "--context", "300",
               "--widths", "4", "mixed", "16", "--out", str(out), env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = list(csv.DictReader(open(out)))
    assert sorted((r["version"], r["widths"], r["launches"]) for r in rows) == sorted(
        (v, w, "2") for v in ("decode_attention", "copy") for w in ("4", "2,2,2,2,4,4,8,8", "16")
    )
    assert all(float(r["host_us"]) > 0 and float(r["host_bind_us"]) > 0 for r in rows)
    interp = in_process(
        ab.main, "kernels.gpu.ab", str(KERNEL), "--host", "--out", str(out), env={"TRITON_INTERPRET": "1"}
    )
    assert interp.returncode != 0 and "unset TRITON_INTERPRET" in interp.stderr


def test_two_files_with_one_name_are_refused(tmp_path, in_process):
    twin = tmp_path / "decode_attention.py"
    shutil.copy(KERNEL, twin)
    proc = in_process(ab.main, "kernels.gpu.ab", str(KERNEL), str(twin), "--out", str(tmp_path / "ab.csv"))
    assert proc.returncode == 2 and "files: two files share a name" in proc.stderr
    missing = in_process(
        ab.main, "kernels.gpu.ab", str(tmp_path / "nope.py"), "--out", str(tmp_path / "ab.csv")
    )
    assert missing.returncode == 2 and "is not a file" in missing.stderr
    assert not (tmp_path / "ab.csv").exists()


def test_a_block_size_the_kernel_cannot_take_is_refused(tmp_path, in_process):
    out = tmp_path / "ab.csv"
    proc = in_process(ab.main, "kernels.gpu.ab", str(KERNEL), "--out", str(out), "--qblock", "128", "40")
    assert (
        proc.returncode == 2
        and "--qblock: 40 tokens a block; allowed: positive multiples of 16" in proc.stderr
    )
    assert not out.exists()


def test_a_grouped_point_without_plans_is_refused(tmp_path, in_process):
    out = tmp_path / "ab.csv"
    proc = in_process(ab.main, "kernels.gpu.ab", str(KERNEL), "--out", str(out), "--grouped", "p.json")
    assert (
        proc.returncode == 2
        and "--grouped: 'p.json' is not POINT WIDTH=GROUP_WIDTHS...: no plans" in proc.stderr
    )
    assert not out.exists()


def test_token_major_store_holds_the_same_bytes_as_the_head_major_one():
    """The older layout's view of a store: each head's packed row at its byte offset, scales at its slot."""
    import torch

    from kernels.gpu.ab import TokenMajorStore
    from kernels.layout import PackedStore

    torch.manual_seed(0)
    bits = (8, 2, 16, 4, 2)
    st = PackedStore(bits, 64, 2, group_size=32, simulate=False)
    st.append(torch.randn(2, len(bits), 21, 64))
    old = TokenMajorStore.of(st)
    assert old.n_quant == 4 and old.payload.shape == (2, st.capacity, 16 + 16 + 32 + 64)
    assert old.byte_offset.tolist() == [64, 0, 0, 32, 16] and old.slot.tolist() == [3, 0, 0, 2, 1]
    for h, b in enumerate(bits):
        if b == 16:
            assert torch.equal(old.full[:, old.slot[h], :21], st.bucket_of[16].values[:, 0, :21])
            continue
        p = st.head_packed(h)
        off = int(old.byte_offset[h])
        assert torch.equal(old.payload[:, :21, off : off + p.payload.shape[-1]], p.payload)
        assert torch.equal(old.scale[:, old.slot[h], :21], p.scale) and torch.equal(
            old.zero[:, old.slot[h], :21], p.zero
        )
    assert old.nbytes() == st.nbytes()


def test_per_launch_takes_the_median_of_each_launch_over_the_calls():
    from kernels.gpu.ab import per_launch

    calls = [[("stage1", 5.0), ("stage1", 9.0), ("combine", 1.0)], [("stage1", 7.0), ("stage1", 3.0), ("combine", 2.0)],
             [("stage1", 6.0), ("stage1", 4.0), ("combine", 4.0)]]  # fmt: skip
    got = per_launch([k for call in calls for k in call], reps=3)
    assert got == [("stage1", 6.0), ("stage1", 4.0), ("combine", 2.0)]


def test_per_launch_refuses_events_that_are_not_repeats_of_one_call():
    from kernels.gpu.ab import per_launch

    with pytest.raises(ValueError, match="not 2 repeats"):
        per_launch([("stage1", 1.0), ("combine", 1.0), ("stage1", 1.0)], reps=2)
    with pytest.raises(ValueError, match="not 2 repeats"):
        per_launch([("stage1", 1.0), ("combine", 1.0), ("combine", 1.0), ("stage1", 1.0)], reps=2)


def test_a_version_loads_with_its_own_copies_of_the_kernels_modules(tmp_path):
    import sys

    import kernels.unpack
    from kernels.gpu.ab import load_versions

    (tmp_path / "old.py").write_text("from kernels.unpack import code_of_column\n")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "unpack.py").write_text("def code_of_column(*args):\n    return 'old'\n")
    (tmp_path / "new.py").write_text("from kernels.unpack import code_of_column\n")
    versions = load_versions([tmp_path / "old.py", tmp_path / "new.py"])
    assert versions["old"].code_of_column() == "old"
    assert versions["new"].code_of_column is kernels.unpack.code_of_column  # today's, once old is loaded
    assert sys.modules["kernels.unpack"] is kernels.unpack


def test_grouped_allocations_hold_grouped_rows(tmp_path):
    """--grouped maps carry their own plans for their widths (keys' and values'; two points, two plan sets),
    and their stores hold grouped rows whose codes stay within each group's width; a width with neither a plan
    nor a flat row is refused, naming the file."""
    import json

    import torch

    point, other = tmp_path / "point.json", tmp_path / "other.json"
    point.write_text(json.dumps({"allocation": {"key_bits": [[5, 4]], "value_bits": [[1, 4]]}}))
    other.write_text(json.dumps({"allocation": {"key_bits": [[5, 5]], "value_bits": [[5, 5]]}}))
    plans = {5: (8, 2), 1: (2, 0), 2: (4, 0)}
    maps = ab.codes_maps(2, ["4"], [], [(point, plans, plans), (other, {5: (6, 4)}, {5: (4, 6)})])
    assert maps["4"] == ([4, 4], [4, 4], {}, {})
    assert maps["point"] == ([4, 5], [4, 1], {5: (8, 2)}, {1: (2, 0)})
    assert maps["other"] == ([5, 5], [5, 5], {5: (6, 4)}, {5: (4, 6)})
    st = ab.fill_codes([4, 5], 1, 20, 32, "cpu", maps["point"][2])
    assert st.plans == {5: (8, 2)}
    codes = st.head_codes(1)  # (B, L, 32): 16 codes of 8 bits, then 16 of 2
    assert int(codes[..., 16:].max()) <= 3 and int(codes[..., :16].max()) > 3
    assert torch.equal(st.head_codes(0), st.head_codes(0) & 15)
    with pytest.raises(ValueError, match="point.json: 1-bit value heads and no plan for them"):
        ab.codes_maps(2, [], [], [(point, {5: (8, 2)}, {5: (8, 2)})])
    with pytest.raises(ValueError, match="point.json: 5-bit key heads and no plan for them"):
        ab.codes_maps(2, [], [], [(point, {1: (2, 0)}, {5: (8, 2), 1: (2, 0)})])
    both = {5: (8, 2), 1: (2, 0)}
    assert ab.grouped_entry(["p.json", "5=8,2", "1=2,0"]) == (Path("p.json"), both, both)
    # a role's own plan wins over the shared one at its width, whichever comes first
    assert ab.grouped_entry(["p.json", "k1=3,1", "1=2,0", "v2=3,1"]) == (
        Path("p.json"),
        {1: (3, 1)},
        {1: (2, 0), 2: (3, 1)},
    )
    with pytest.raises(ValueError, match="no plans"):
        ab.grouped_entry(["p.json"])
    with pytest.raises(ValueError, match="'5:8,2' is not WIDTH=GROUP_WIDTHS"):
        ab.grouped_entry(["p.json", "5:8,2"])
