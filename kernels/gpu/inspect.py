"""`python -m kernels.gpu.inspect`: compile the fused decode kernel's stage 1 for Hopper (sm_90a) on a machine with
no GPU, and read its machine code.

This module owns the static inspection of stage 1 (kernels/decode_attention.py). For each variant (key width,
value width, BLOCK_N, warps) it calls `decode_attention` on packed stores of the real launch's shape (32 query /
8 KV heads, head_dim 128, batch 8, 32K tokens by default, on the `meta` device: nothing is allocated), catches the
stage-1 launch instead of running it, and compiles that launch exactly as Triton's JIT would on an H100 or H200:
the same argument types, the same divisibility-16 specialization of pointers and integers, the same options.
ptxas and cuobjdump (both ship in Triton's wheel) then give:
- registers per thread, spilled bytes (the stack frame and local memory: these kernels keep no arrays there, so
  what is there is ptxas's spills), shared memory;
- the main loop: the SASS between the target and the source of the backward branch that closes the loop over
  tiles (the largest loop holding a tensor-core instruction), its instruction count per tile, and its
  instruction mix (HMMA / HGMMA, int-to-float I2F / I2FP, float conversions F2F / F2FP, shared-memory LDS / STS,
  barriers BAR, global loads by width, and `local`: the loop's local-memory loads and stores LDL / STL, the spill
  code that runs every tile);
- `instr_per_byte`: thread-instructions per KV byte, i.e. loop instructions x 32 x warps / (BLOCK_N x the K and V
  bytes of one token of one head: packed rows, scales and zeros), the quantity whose product with the achieved
  share of copy bandwidth measured about 3.1 on the H200 (kernel issue);
- `payload_load_bytes`: the widths of the loop's global loads (16 is LDG.E.128 or a 16-byte cp.async; 1 is a
  byte-wide load).
With --map (per-KV-head widths) it reads the launches of one mixed map instead: the fast kernel runs every
packed bucket in one launch, a branch each, so the figures of a row are its branch's loop's beside the whole
kernel's registers and shared memory. --allocation FILE... (recorded points or allocation files) inspects, for
each, the map of its (key, value) width pairs, one KV head each, and gives the thread-instructions per KV byte over
the whole allocation, each pair's branch weighted by the (layer, KV head) units that hold it. With --codes it
compiles the codes-only path (decode_attention_blocks over
codes-only stores: no scales or zeros, a query and a bias per block of --qblock tokens, 0 for one block), whose
KV bytes are the payload alone. Its figures at the default shape, each width at CODES_LAUNCH (kernels at 48d393a,
Triton 3.6, sm_90a; the 32 row with --block-n 32;
loop instructions a tile / thread-instructions per KV byte, registers; no spills, no byte-wide loads anywhere):

    qblock   4 bits            3 bits            2 bits            8 bits
    128      562 / 4.39, 127   596 / 6.21, 96    470 / 7.34, 126   549 / 2.14, 128    (128-token tiles)
    0        517 / 4.04, 128   555 / 5.78, 96    427 / 6.67, 126   489 / 1.91, 128    (one block: q held)
    32       255 / 7.97, 80    274 / 11.4, 80    222 / 13.9, 91    242 / 3.78, 95     (32-token tiles)

DESIGN.md's static targets (4.5 at 4 bits, 6 at 2) hold at 4 bits, not at 2: a 2-bit tile of 128 tokens has 64
bytes a token to spend 384 instructions on, and its dequantization (8 lop3 and 3 shifts a word for K; the same and
a sub.f16x2 a pair for V, or as many moves into the shared-memory stores' register quads without it), the mmas,
V's transpose and the softmax take about 430 of them before a block's query (40-50 more a tile) is read.
With --turned LEVELS it compiles kernels/turned_attention.py's kernel instead (keys coded before RoPE, each key tile
made through the basis and turned in the kernel: pca_gsa's format with LEVELS lloyd, pca_ugsa's with uniform), at
the --key-plans / --value-plans of each --widths width or of each width pair of --allocation.
It prints a table and writes a CSV. The Triton that compiles is the one imported: `make inspect-env` makes
.venv-triton36 with the GPU machine's Triton (3.6.0), and every row names the version that compiled it.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

SHAPE = {"hq": 32, "hkv": 8, "head_dim": 128, "batch": 8, "context": 32768}
TARGET_ARCH = 90  # Hopper; compiled as sm_90a
ROOT = Path(__file__).resolve().parents[2]
KERNEL_SOURCES = tuple(
    ROOT / "kernels" / f for f in ("decode_attention.py", "unpack.py", "groups.py", "layout.py")
)
TURNED_SOURCES = tuple(ROOT / "kernels" / f for f in ("turned_attention.py", "unpack.py", "groups.py"))
# --turned's levels -> the rows' format column
TURNED_FORMATS = {"lloyd": "turned-lloyd", "uniform": "turned-uniform"}
COLUMNS = [
    "triton", "kernel_sha", "kernel", "key_bits", "value_bits", "block_n", "num_warps", "num_stages", "registers", "spill_bytes",
    "shared_bytes", "loop_instr", "kv_bytes_per_tile", "instr_per_byte", "payload_load_bytes", "mma", "i2f",
    "f2f", "lds", "sts", "bar", "lop3", "shf", "prmt", "ffma", "ldg", "ldgsts", "local", "static_targets", "note",
    "format", "qblock",
]  # fmt: skip
# DESIGN.md section 8's static targets: main-loop thread-instructions per KV byte by width (uniform K and V)
INSTR_PER_BYTE_TARGET = {4: 4.0, 2: 5.0, 8: 3.0}
# the codes-only path's (the frontier formats' kernel: 3.5x point at 4 bits, 6x point at 2 bits)
CODES_INSTR_PER_BYTE_TARGET = {4: 4.5, 2: 6.0}
MAX_REGISTERS = 128
# SASS opcode (before the first dot) -> the mix column that counts it
MIX = {
    "HMMA": "mma", "HGMMA": "mma", "I2F": "i2f", "I2FP": "i2f", "F2F": "f2f", "F2FP": "f2f", "LDS": "lds",
    "LDSM": "lds", "STS": "sts", "BAR": "bar", "LOP3": "lop3", "SHF": "shf", "PRMT": "prmt", "FFMA": "ffma",
    "LDG": "ldg", "LDGSTS": "ldgsts", "LDL": "local", "STL": "local",  # local: spill code in the loop
}  # fmt: skip
LOAD_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}  # SASS load suffix -> bytes (else 4)


@dataclass
class Launch:
    """One caught kernel launch: the JIT function, its positional arguments and its keyword arguments."""

    fn: object
    args: tuple
    kwargs: dict


def catch_launches(
    k_bits: tuple[int, ...], v_bits: tuple[int, ...], block_n: int | None, num_warps: int, num_stages: int | None,
    shape: dict, length: int | None = None, maxnreg: int | None = None, qblock: int | None = None,
    plans: tuple[dict, dict] = ({}, {}),
) -> list[Launch]:  # fmt: skip
    """The stage-1 launches that decode_attention makes for per-head widths k_bits (keys) and v_bits (values) at
    `shape` (its hkv taken from the maps), stores of shape["context"] tokens' capacity holding `length` of them
    (default: full): one for the map's packed buckets, one for each generic bucket. With `qblock` (0: one block)
    decode_attention_blocks' over codes-only stores instead, the widths in `plans` (keys', values': width ->
    grouped plan, kernels/groups.py) holding grouped rows."""
    from kernels import decode_attention as da
    from kernels.layout import PackedStore

    B, hq, D, L = (shape[k] for k in ("batch", "hq", "head_dim", "context"))
    dev = torch.device("meta")
    codes = qblock is not None
    stores = [
        PackedStore(list(b), D, B, dtype=torch.bfloat16, device=dev, capacity=L, codes_only=codes, plans=plan)
        for b, plan in zip((k_bits, v_bits), plans)
    ]
    for st in stores:
        st.length = L if length is None else length
    caught: list[Launch] = []

    def catcher(kernel):
        return lambda *args, grid, warmup, **kwargs: caught.append(Launch(kernel, args, kwargs))

    stage1 = (da._decode_split_kernel, da._decode_packed_kernel)
    for kernel in stage1:
        kernel.run = catcher(kernel)
    helpers = (da._combine_kernel, da._block_query_kernel)  # launches around stage 1, not inspected
    for kernel in helpers:
        kernel.run = lambda *args, grid, warmup, **kwargs: None
    try:
        options = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)
        if codes:
            nb = -(-L // qblock) if qblock else 1
            qb = torch.empty(B, hq, nb, D, dtype=torch.bfloat16, device=dev)
            bias = torch.empty(B, hq, nb, dtype=torch.float32, device=dev)
            da.decode_attention_blocks(qb, bias, *stores, D**-0.5, qblock or None, **options)
        else:
            q = torch.empty(B, hq, D, dtype=torch.bfloat16, device=dev)
            da.decode_attention(q, *stores, D**-0.5, **options)
    finally:
        for kernel in (*stage1, *helpers):
            del kernel.run
    return caught


def catch_stage1(
    kw: int, vw: int, block_n: int | None, num_warps: int, num_stages: int | None, shape: dict,
    length: int | None = None, maxnreg: int | None = None, qblock: int | None = None,
) -> Launch:  # fmt: skip
    """The one stage-1 launch that decode_attention makes for uniform widths kw (keys) and vw (values) (with
    `qblock`, decode_attention_blocks' over codes-only stores)."""
    hkv = shape["hkv"]
    caught = catch_launches((kw,) * hkv, (vw,) * hkv, block_n, num_warps, num_stages, shape, length, maxnreg,
                            qblock)  # fmt: skip
    assert len(caught) == 1, f"expected one stage-1 launch, caught {len(caught)}"
    return caught[0]


def compile_for_hopper(launch: Launch):
    """Compile a caught launch for sm_90a as the JIT would on a Hopper GPU: (cubin bytes, metadata, asm dict)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", TARGET_ARCH, 32)
    backend = make_backend(target)
    fn = launch.fn
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    kernel = compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    return kernel.asm["cubin"], kernel.metadata, kernel.asm


def _tool(name: str) -> str:
    """Path of a CUDA binary that ships in Triton's wheel (ptxas, cuobjdump)."""
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"{name} not found at {path}: this Triton wheel does not carry it")
    return str(path)


def sass_and_resources(cubin: bytes) -> tuple[str, dict]:
    """cuobjdump's SASS listing and resource usage (REG, STACK, SHARED, LOCAL) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True
        )
        res = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True
        )
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", res.stdout)}
    return sass.stdout, usage


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode with modifiers, operands) of every SASS instruction, in order."""
    return [(int(a, 16), op, rest.strip()) for a, _, op, rest in _INSTR.findall(sass)]


def mma_loops(instrs: list[tuple[int, str, str]]) -> list[list[tuple[int, str, str]]]:
    """The instructions of each loop (a backward branch's target to the branch) that holds an mma, in address
    order, loops inside another left out."""
    loops: list = []
    for i, (addr, op, rest) in enumerate(instrs):
        if not op.startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)", rest)
        if not m or int(m.group(1), 16) >= addr:
            continue
        start = int(m.group(1), 16)
        body = [x for x in instrs[: i + 1] if x[0] >= start]
        if any(x[1].split(".")[0] in ("HMMA", "HGMMA") for x in body):
            loops = [lp for lp in loops if lp[0][0] < start] + [
                body
            ]  # an enclosing loop replaces those inside
    return sorted(loops, key=lambda lp: lp[0][0])


def main_loop(instrs: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The instructions of the largest loop (a backward branch's target to the branch) that holds an mma."""
    return max(mma_loops(instrs), key=len, default=[])


def loop_mix(loop: list[tuple[int, str, str]]) -> Counter:
    """The loop's instruction mix: MIX's column -> how many of its instructions count there (None: the rest)."""
    return Counter(MIX.get(op.split(".")[0]) for _, op, _ in loop)


def load_width(op: str) -> int | None:
    """Bytes per thread of a global load (LDG or cp.async LDGSTS), None for any other instruction."""
    parts = op.split(".")
    if parts[0] not in ("LDG", "LDGSTS"):
        return None
    for p in reversed(parts[1:]):
        if p in LOAD_WIDTH:
            return LOAD_WIDTH[p]
    return 4


def kv_bytes_per_token(bits: int, head_dim: int, group_size: int = 32, codes: bool = False) -> int:
    """Bytes of one token of one head as stored: packed row and fp16 scale and zero per group (16 bits: 2/elem;
    a codes-only store's: the packed row)."""
    if bits == 16:
        return 2 * head_dim
    return head_dim * bits // 8 + (0 if codes else 2 * 2 * head_dim // group_size)


def inspect_variant(
    kw: int,
    vw: int,
    block_n: int | None,
    num_warps: int,
    num_stages: int | None,
    shape: dict,
    maxnreg: int | None = None,
    qblock: int | None = None,
) -> dict:
    """One row of the table: the compiled variant's resources, main loop and instruction mix (block_n None:
    the kernel's default tile; qblock: the codes-only path's, 0 for one block)."""
    launch = catch_stage1(kw, vw, block_n, num_warps, num_stages, shape, maxnreg=maxnreg, qblock=qblock)
    return inspect_launch(launch, num_warps, shape)[0]


def inspect_launch(launch: Launch, num_warps: int, shape: dict, label: str = "") -> list[dict]:
    """The rows of one caught stage-1 launch: the generic kernel's one bucket, or one per bucket of the fast
    kernel, each from its branch's loop over tiles (the branches' loops lie in bucket order in the machine code:
    a branch is compiled where tl.static_range unrolls it). `label` (a map's) goes into each row's note."""
    cubin, meta, _ = compile_for_hopper(launch)
    sass, usage = sass_and_resources(cubin)
    kwargs, instrs = launch.kwargs, instructions(sass)
    codes = bool(kwargs.get("CODES"))
    fast = "KWS" in kwargs
    if fast:
        buckets = list(zip(kwargs["KWS"], kwargs["VWS"], kwargs["BLOCK_NS"], kwargs["STAGES"]))
    else:
        buckets = [(kwargs["KW"], kwargs["VW"], kwargs["BLOCK_N"], meta.num_stages)]
    loops = [main_loop(instrs)] if len(buckets) == 1 else mma_loops(instrs)
    if len(loops) != len(buckets):
        raise RuntimeError(f"{len(buckets)} buckets but {len(loops)} loops with an mma in the machine code")
    rows = []
    for i, ((kw, vw, block_n, stages), loop) in enumerate(zip(buckets, loops)):
        notes = []
        if label:
            notes.append(
                f"{label}, branch {i + 1} of {len(buckets)}" if fast else f"{label}, a launch of its own"
            )
        fmt = ("codes", kwargs.get("QBLOCK", "")) if codes else ("affine", "")
        rows.append(
            loop_row(launch, usage, meta, loop, (kw, vw, block_n, num_warps, stages), shape, notes, fmt)
        )
    return rows


def loop_row(
    launch: Launch, usage: dict, meta, loop: list, variant: tuple, shape: dict, notes: list[str],
    fmt: tuple[str, object], sha: str | None = None,
) -> dict:  # fmt: skip
    """One row of the table from a compiled launch's resources (usage, meta) and its loop over tiles: variant (key
    bits, value bits, BLOCK_N, warps, stages), fmt (the format column, the qblock column), sha the kernel's digest
    (default kernel_sha())."""
    kw, vw, block_n, num_warps, stages = variant
    codes = fmt[0] != "affine"
    mix = loop_mix(loop)
    widths = sorted({w for _, op, _ in loop if (w := load_width(op)) is not None})
    tile = block_n * (
        kv_bytes_per_token(kw, shape["head_dim"], codes=codes)
        + kv_bytes_per_token(vw, shape["head_dim"], codes=codes)
    )
    if not loop:
        notes = [*notes, "no loop with an mma found"]
    row = {
        "triton": triton.__version__, "kernel_sha": sha or kernel_sha(), "kernel": launch.fn.fn.__name__, "key_bits": kw, "value_bits": vw, "block_n": block_n, "num_warps": num_warps,
        "num_stages": stages, "registers": usage.get("REG", 0), "spill_bytes": usage.get("STACK", 0) + usage.get("LOCAL", 0),
        "shared_bytes": meta.shared, "loop_instr": len(loop), "kv_bytes_per_tile": tile,
        "instr_per_byte": round(len(loop) * 32 * num_warps / tile, 2) if loop else float("nan"),
        "payload_load_bytes": " ".join(map(str, widths)), "note": "; ".join(notes), "format": fmt[0], "qblock": fmt[1],
    }  # fmt: skip
    row.update({col: mix.get(col, 0) for col in set(MIX.values())})
    row["static_targets"] = static_targets(row)
    return row


def catch_turned(
    kw: int, vw: int, plans: tuple[dict, dict], block_n: int, num_warps: int, num_stages: int, shape: dict,
    lookup: bool,
) -> Launch:  # fmt: skip
    """The launch of kernels/turned_attention.py's kernel at `shape` for every KV head's keys at width kw and values
    at vw under plans (keys', values': width -> grouped plan), the stores full, on the meta device."""
    from kernels import turned_attention as ta
    from kernels.host import cdiv

    B, hq, hkv, D, L = (shape[k] for k in ("batch", "hq", "hkv", "head_dim", "context"))
    dev = torch.device("meta")
    kplan, vplan = plans[0][kw], plans[1][vw]
    words = lambda plan: torch.empty(B, hkv, L, sum(plan) * 2 // 4, dtype=torch.int32, device=dev)  # noqa: E731
    kernel, grid, args, kwargs, _ = ta.launch(
        torch.empty(B, hq, D, device=dev), words(kplan), words(vplan), kplan, vplan,
        torch.empty(hkv, D, D, dtype=torch.float16, device=dev), torch.empty(hkv, D, device=dev),
        torch.empty(9, ta.LEVEL_ROW, device=dev), torch.empty(cdiv(L, block_n), D, device=dev),
        torch.empty(block_n, D, dtype=torch.float16, device=dev), L, D**-0.5, lookup=lookup, block_n=block_n,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return Launch(kernel, args, kwargs)


def inspect_turned(
    kw: int, vw: int, plans: tuple[dict, dict], block_n: int, num_warps: int, num_stages: int, shape: dict,
    levels: str,
) -> dict:  # fmt: skip
    """One row: the turned kernel (catch_turned) compiled for sm_90a, its levels `levels` (TURNED_FORMATS' keys:
    a table lookup an element, or evenly spaced levels folded into the basis)."""
    launch = catch_turned(kw, vw, plans, block_n, num_warps, num_stages, shape, levels == "lloyd")
    cubin, meta, _ = compile_for_hopper(launch)
    sass, usage = sass_and_resources(cubin)
    loop = main_loop(instructions(sass))
    notes = [f"plans {plans[0][kw]} / {plans[1][vw]}"]
    return loop_row(launch, usage, meta, loop, (kw, vw, block_n, num_warps, num_stages), shape, notes,
                    (TURNED_FORMATS[levels], ""), kernel_sha(TURNED_SOURCES))  # fmt: skip


def inspect_map(
    k_bits: tuple[int, ...], v_bits: tuple[int, ...], num_warps: int, shape: dict, qblock: int | None = None,
    plans: tuple[dict, dict] = ({}, {}), block_n: int | None = None, maxnreg: int | None = None,
) -> list[dict]:  # fmt: skip
    """The rows of every stage-1 launch of one per-head map (default stages; tiles `block_n` and register cap
    `maxnreg`, default the kernels'): the fast kernel's one launch, a row per bucket, and each generic bucket's
    launch (with `qblock`, the codes-only path's one launch, `plans` as catch_launches')."""
    label = (
        "map " + ",".join(map(str, k_bits)) + ("" if v_bits == k_bits else " / " + ",".join(map(str, v_bits)))
    )
    launches = catch_launches(
        k_bits, v_bits, block_n, num_warps, None, shape, maxnreg=maxnreg, qblock=qblock, plans=plans
    )
    return [row for launch in launches for row in inspect_launch(launch, num_warps, shape, label)]


def allocation_pairs(path: Path) -> Counter:
    """(key width, value width) -> how many (layer, KV head) units hold that pair in the allocation of `path`: a
    recorded point (results/.../points/*.json) or an allocation file (python -m harness.export), both
    {"allocation": {"key_bits": per layer a width per KV head, "value_bits": the same}}. ValueError naming the
    file for anything else."""
    try:
        alloc = json.loads(Path(path).read_text())["allocation"]
        pairs = Counter(
            (int(kw), int(vw))
            for k_layer, v_layer in zip(alloc["key_bits"], alloc["value_bits"], strict=True)
            for kw, vw in zip(k_layer, v_layer, strict=True)
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"--allocation: {path} holds no allocation with key_bits and value_bits ({type(err).__name__})"
        ) from None
    if not pairs:
        raise ValueError(f"--allocation: {path} allocates no KV head")
    return pairs


def inspect_allocation(
    path: Path,
    pairs: Counter,
    num_warps: int,
    shape: dict,
    qblock: int | None,
    plans: tuple[dict, dict] = ({}, {}),
) -> list[dict]:
    """The rows of the launch of one allocation's map (allocation_pairs: a KV head each pair, shape's query heads
    per KV head kept), each row's note naming the file, its pair's share of the units and the whole allocation's
    thread-instructions per KV byte (mix_instr_per_byte), which is also printed."""
    qg = shape["hq"] // shape["hkv"]
    k_bits, v_bits = tuple(k for k, _ in sorted(pairs)), tuple(v for _, v in sorted(pairs))
    rows = inspect_map(
        k_bits, v_bits, num_warps, {**shape, "hkv": len(pairs), "hq": len(pairs) * qg}, qblock, plans
    )
    mix, total = mix_instr_per_byte(rows, pairs), sum(pairs.values())
    for row in rows:
        units = pairs[(int(row["key_bits"]), int(row["value_bits"]))]
        row["note"] = (
            f"{path.name}: {units} of {total} units; allocation {mix} thread-instructions per KV byte"
        )
    print(f"{path}: {total} (layer, KV head) units, warps={num_warps}: {mix} thread-instructions per KV byte")
    return rows


def mix_instr_per_byte(rows: list[dict], pairs: Counter) -> float:
    """Thread-instructions per KV byte over a whole allocation: each bucket's loop instructions per token and KV
    bytes per token (its row's, at its own tile), weighted by the units that hold its widths (`pairs`), summed
    and divided. A program decodes its head's bucket alone, so this is the launch's count per byte of the
    allocation's bytes."""
    instr = nbytes = 0.0
    for row in rows:
        n = pairs[(int(row["key_bits"]), int(row["value_bits"]))]
        block_n = int(row["block_n"])
        instr += n * int(row["loop_instr"]) * 32 * int(row["num_warps"]) / block_n
        nbytes += n * int(row["kv_bytes_per_tile"]) / block_n
    return round(instr / nbytes, 2)


def kernel_sha(sources: tuple[Path, ...] = KERNEL_SOURCES) -> str:
    """The first 12 hex digits of sha256 over the kernel sources the figures describe (KERNEL_SOURCES, or the
    turned kernel's TURNED_SOURCES)."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def variants(widths: list[int], block_ns: list[int], warps: list[int]) -> list[tuple[int, int, int, int]]:
    """(key bits, value bits, BLOCK_N, warps) for every uniform width and setting asked for."""
    return [(w, w, n, nw) for w in widths for n in block_ns for nw in warps]


def static_targets(row: dict) -> str:
    """ "met", or the static targets a uniform packed variant misses (instructions per byte where its width has a
    target, registers, spills, byte-wide payload loads, I2F in the loop); "" for 16 bits and mixed widths."""
    width = int(row["key_bits"])
    if width == 16 or row["key_bits"] != row["value_bits"]:
        return ""
    missed = []
    codes = row.get("format") == "codes" or str(row.get("format", "")).startswith("turned")
    targets = CODES_INSTR_PER_BYTE_TARGET if codes else INSTR_PER_BYTE_TARGET
    if width in targets and not float(row["instr_per_byte"]) <= targets[width]:
        missed.append(f"instr/byte {row['instr_per_byte']} > {targets[width]:g}")
    if int(row["registers"]) > MAX_REGISTERS:
        missed.append(f"registers {row['registers']} > {MAX_REGISTERS}")
    if int(row["spill_bytes"]):
        missed.append(f"spills {row['spill_bytes']} B")
    if "1" in str(row["payload_load_bytes"]).split():
        missed.append("byte-wide loads")
    if int(row["i2f"]):
        missed.append(f"{row['i2f']} I2F")
    return "missed: " + "; ".join(missed) if missed else "met"


def format_table(rows: list[dict]) -> str:
    cols = ["format", "qblock", "key_bits", "value_bits", "block_n", "num_warps", "registers", "spill_bytes", "shared_bytes",
            "loop_instr", "instr_per_byte", "payload_load_bytes", "mma", "i2f", "lds", "sts", "bar",
            "static_targets"]  # fmt: skip
    lines = [" ".join(f"{c:>10}" for c in cols)]
    lines += [" ".join(f"{str(r[c]):>10}" for c in cols) for r in rows]
    return "\n".join(lines)


def plan_entry(text: str) -> tuple[int, tuple[int, ...]]:
    """ "2=4,4,2,2,1,1,1,1" -> (2, (4, 4, 2, 2, 1, 1, 1, 1)) (argparse's type for --key-plans, --value-plans)."""
    width, sep, plan = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(width), _widths_list(plan)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not WIDTH=GROUP_WIDTHS (e.g. 2=4,4,2,2,1,1,1,1)"
        ) from None


def _widths_list(text: str) -> tuple[int, ...]:
    """ "2,2,4,8" -> (2, 2, 4, 8) (argparse's type for --map)."""
    try:
        return tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of widths") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kernels.gpu.inspect", description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", nargs="+", type=int, default=[16, 8, 4, 3, 2], help="uniform K and V widths")
    p.add_argument(
        "--block-n", nargs="+", type=int, default=None, help="tokens per tile (default: the kernel's)"
    )
    p.add_argument("--warps", nargs="+", type=int, default=[4])
    p.add_argument("--stages", type=int, default=None, help="num_stages (default: the kernel's)")
    p.add_argument("--maxnreg", type=int, default=None, help="register cap (default: the kernel's; 0: none)")
    p.add_argument(
        "--map", type=_widths_list, default=None,
        help="per-KV-head key widths, comma-separated (one per --hkv head): inspect that map's launches instead",
    )  # fmt: skip
    p.add_argument(
        "--value-map", type=_widths_list, default=None, help="per-head value widths (default: --map)"
    )
    p.add_argument(
        "--codes", action="store_true", help="the codes-only path (decode_attention_blocks) at --qblock"
    )
    p.add_argument("--qblock", type=int, default=128, help="tokens a query block with --codes (0: one block)")
    p.add_argument(
        "--turned", choices=sorted(TURNED_FORMATS), default=None,
        help="compile kernels/turned_attention.py's kernel instead (keys before RoPE turned in the kernel, levels "
        "looked up or evenly spaced) for every width --key-plans/--value-plans give, or each pair of --allocation",
    )  # fmt: skip
    for role in ("key", "value"):
        p.add_argument(
            f"--{role}-plans", type=plan_entry, nargs="+", default=[],
            help=f"with --codes: the {role}s' grouped plans, WIDTH=GROUP_WIDTHS (a width of 16 components each; "
            "kernels/groups.py), the heads at WIDTH holding grouped rows",
        )  # fmt: skip
    p.add_argument(
        "--allocation", type=Path, nargs="+", default=None,
        help="recorded points' or allocation files' JSON: inspect, for each, a map of its (key, value) width pairs, "
        "one KV head each, and print thread-instructions per KV byte over the whole allocation",
    )  # fmt: skip
    p.add_argument("--out", type=Path, help="CSV to write")
    for k, v in SHAPE.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    return p


def _write_csv(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("error: TRITON_INTERPRET=1 is set; the inspector compiles, so unset it")
    allocations = {}  # path -> its width pairs' unit counts
    if args.allocation is not None:
        if args.map is not None:
            p.error("--allocation: the map is the allocation's; give --map or --allocation, not both")
        try:
            allocations = {path: allocation_pairs(path) for path in args.allocation}
        except ValueError as err:
            p.error(str(err))
        args.map = args.value_map = ()  # the allocations' maps, checked here and inspected below
        for pairs in allocations.values():
            args.map, args.value_map = (
                (*args.map, *(k for k, _ in pairs)),
                (*args.value_map, *(v for _, v in pairs)),
            )
    plans = (dict(args.key_plans), dict(args.value_plans))
    if args.turned:
        _main_turned(p, args, plans, allocations)
        return
    if (plans[0] or plans[1]) and not args.codes:
        p.error("--key-plans/--value-plans: grouped plans are codes-only stores'; add --codes")
    for w in (*args.widths, *(args.map or ()), *(args.value_map or ())):
        if w not in (2, 3, 4, 8, 16) and w not in {**plans[0], **plans[1]}:
            p.error(
                f"--widths/--map: {w} is not a width; allowed: 2, 3, 4, 8, 16, or one with a grouped plan"
            )
    v_map = args.value_map or args.map
    for name, m in (("--map", args.map), ("--value-map", v_map)):
        if m is not None and not allocations and len(m) != args.hkv:
            p.error(f"{name}: {len(m)} widths for --hkv {args.hkv} KV heads; give one width a KV head")
    shape = {k: getattr(args, k) for k in SHAPE}
    qblock = args.qblock if args.codes else None
    if args.codes and 16 in (args.widths if args.map is None else (*args.map, *v_map)):
        p.error("--codes: a codes-only store holds no 16-bit heads; give widths from 2, 3, 4, 8")
    rows = []
    for path, pairs in allocations.items():
        for nw in args.warps:
            rows += inspect_allocation(path, pairs, nw, shape, qblock, plans)
    if args.map is not None and not allocations:
        for nw, n in itertools.product(args.warps, args.block_n or [None]):
            rows += inspect_map(args.map, v_map, nw, shape, qblock, plans, n, args.maxnreg)
            print(f"compiled map warps={nw} BLOCK_N={n or 'default'}", file=sys.stderr, flush=True)
    for kw, vw, n, nw in (
        [] if args.map is not None else variants(args.widths, args.block_n or [None], args.warps)
    ):
        rows.append(inspect_variant(kw, vw, n, nw, args.stages, shape, args.maxnreg, qblock))
        print(f"compiled K{kw}V{vw} BLOCK_N={rows[-1]['block_n']} warps={nw}", file=sys.stderr, flush=True)
    print(f"Triton {triton.__version__}, sm_{TARGET_ARCH}a, shape {shape}")
    print(format_table(rows))
    if args.out:
        _write_csv(rows, args.out)


def _main_turned(p: argparse.ArgumentParser, args, plans: tuple[dict, dict], allocations: dict) -> None:
    """--turned: the turned kernel's rows, one a width (--widths) or a width pair of each allocation, and each
    allocation's thread-instructions per KV byte over its units."""
    from kernels import turned_attention as ta

    if args.codes or (args.map and not allocations):
        p.error("--turned: the turned kernel reads grouped rows of its own; give it no --codes or --map")
    wanted = (
        {pair for pairs in allocations.values() for pair in pairs}
        if allocations
        else {(w, w) for w in args.widths}
    )
    for kw, vw in sorted(wanted):
        if kw not in plans[0] or vw not in plans[1]:
            p.error(f"--turned: width {kw if kw not in plans[0] else vw} has no plan; give --key-plans and "
                    "--value-plans for every width")  # fmt: skip
    shape = {k: getattr(args, k) for k in SHAPE}
    stages = args.stages or ta.NUM_STAGES
    rows, mixes = [], []
    for n, nw in itertools.product(args.block_n or [ta.BLOCK_N], args.warps):
        done = {
            pair: inspect_turned(*pair, plans, n, nw, stages, shape, args.turned) for pair in sorted(wanted)
        }
        if not allocations:  # else each allocation's rows below, its units in their notes
            rows += done.values()
        print(f"compiled {len(done)} turned variants BLOCK_N={n} warps={nw}", file=sys.stderr, flush=True)
        for path, pairs in allocations.items():
            mix, total = mix_instr_per_byte(list(done.values()), pairs), sum(pairs.values())
            mixes.append(
                f"{path}: {total} units, BLOCK_N={n} warps={nw}: {mix} thread-instructions per KV byte"
            )
            for pair, units in pairs.items():
                rows.append({**done[pair], "note": f"{done[pair]['note']}; {path.name}: {units} of {total} units; "
                             f"allocation {mix} thread-instructions per KV byte"})  # fmt: skip
    print(f"Triton {triton.__version__}, sm_{TARGET_ARCH}a, shape {shape}")
    print(format_table(rows))
    print("\n".join(mixes))
    if args.out:
        _write_csv(rows, args.out)


if __name__ == "__main__":
    main()
