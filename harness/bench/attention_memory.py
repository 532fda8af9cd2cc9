"""Peak memory of one prefill chunk's attention: `python -m harness.bench.attention_memory [--help]`.

What the packed-only path needs beside its cache while it prefills (harness.bench.capacity_demo's "fixed extra"): one
chunk of queries attends over a context stored packed (kernels.packed_attention, blockwise from the stored form)
or over full-precision K/V with torch's scaled_dot_product_attention (what a DynamicCache prefill runs). Each
measurement runs in a fresh child process, with glibc's mmap threshold as capacity_demo sets it
(harness.bench.procmem): the K/V are built, one warm-up call runs (a prefill's later chunks are its steady state), the
peak resident set is reset, one attention call runs, and its peak above the resident set before it is reported
(VmHWM - VmRSS, Linux only); the call's output is counted, as a model holds it. Shapes are smollm2-135m's
attention (9 query heads on 3 KV heads of 64) unless given.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

from harness import io
from harness.bench import procmem

MIB = 1 << 20
MODES = ("packed", "sdpa")


def measure(
    mode: str, batch: int, q_heads: int, kv_heads: int, head_dim: int, context: int, chunk: int, bits: int
):
    """Bytes above the resident set that one attention call of `mode` peaks at (run in this process)."""
    from kernels.layout import PackedStore
    from kernels.packed_attention import packed_attention

    g = torch.Generator().manual_seed(0)
    k = torch.randn(batch, kv_heads, context, head_dim, generator=g)  # (B, Hkv, L, D)
    v = torch.randn(batch, kv_heads, context, head_dim, generator=g)
    q = torch.randn(batch, q_heads, chunk, head_dim, generator=g)  # the last `chunk` positions' queries
    if mode == "packed":
        stores = [PackedStore([bits] * kv_heads, head_dim, batch, simulate=False) for _ in range(2)]
        stores[0].append(k), stores[1].append(v)
        del k, v

        def call():
            return packed_attention(q, *stores, head_dim**-0.5)
    else:
        group = q_heads // kv_heads
        k = k.repeat_interleave(group, 1)  # (B, Hq, L, D): as transformers repeats KV heads
        v = v.repeat_interleave(group, 1)
        mask = torch.ones(chunk, context, dtype=torch.bool).tril(context - chunk)  # (Tq, L) causal

        def call():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    call()  # a warm-up chunk: one-time tables and thread pools, as a prefill's first chunk holds them
    procmem.reset_peak_resident()
    before = procmem.status_bytes("VmRSS")
    out = call()
    peak = procmem.status_bytes("VmHWM")
    del out
    return peak - before


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness.bench.attention_memory", description=__doc__.splitlines()[0]
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--chunk", type=int, default=256, help="query rows of the prefill chunk")
    p.add_argument("--bits", type=int, default=2, help="the packed store's width (asym g32)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    p.add_argument("--allow-dirty", action="store_true", help="write into results/ from an uncommitted tree")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    for key in ("batch", "q_heads", "kv_heads", "head_dim", "chunk", "threads"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}: {getattr(args, key)} is not a positive integer")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads: {args.q_heads} is not a multiple of --kv-heads {args.kv_heads}")
    if args.bits not in (2, 3, 4, 8):
        p.error(f"--bits: {args.bits}; allowed: 2, 3, 4, 8")
    if any(c < args.chunk for c in args.contexts):
        p.error(f"--contexts: each must be at least --chunk {args.chunk}")
    if not procmem.CLEAR_REFS.exists():
        p.error("this measurement needs Linux's /proc/self/clear_refs")
    shape = (args.batch, args.q_heads, args.kv_heads, args.head_dim)
    if args.child:
        torch.set_num_threads(args.threads)
        print(measure(args.child, *shape, args.context, args.chunk, args.bits))
        return
    if args.out is not None:
        try:
            io.check_writable(args.out.parent, key="--out")
            io.check_clean(args.out.parent, args.allow_dirty, key="--allow-dirty")
        except ValueError as err:
            p.error(str(err))
    command = io.command_line("python -m harness.bench.attention_memory", argv)
    if args.out is not None:
        io.start_record(args.out.parent, command, "cpu", args.allow_dirty, name=args.out.stem + ".env.json")
    env = {
        **os.environ,
        procmem.MMAP_THRESHOLD: str(procmem.MMAP_THRESHOLD_BYTES),
        "OMP_NUM_THREADS": str(args.threads),
    }
    lines = [
        f"Command: `{command}` ({args.threads} thread(s), torch {torch.__version__}"
        + ("; the commit: the environment record beside this file)." if args.out is not None else ")."),
        "",
        f"One chunk of {args.chunk} queries, batch {args.batch}, {args.q_heads} query heads on {args.kv_heads} KV "
        f"heads of {args.head_dim}; packed: asym_token g32 at {args.bits} bits, packed-only; sdpa: float32 K/V.",
        "",
        "| context | packed MiB | sdpa MiB |",
        "|---|---|---|",
    ]
    for context in args.contexts:
        peaks = []
        for mode in MODES:
            options = {
                "context": context,
                "batch": args.batch,
                "q-heads": args.q_heads,
                "kv-heads": args.kv_heads,
            }
            options |= {
                "head-dim": args.head_dim,
                "chunk": args.chunk,
                "bits": args.bits,
                "threads": args.threads,
            }
            child = [sys.executable, "-m", "harness.bench.attention_memory", "--child", mode]
            child += [f"--{key}={value}" for key, value in options.items()]
            proc = subprocess.run(child, capture_output=True, text=True, env=env, check=True)
            peaks.append(int(proc.stdout.split()[-1]) / MIB)
        lines.append(f"| {context} | {peaks[0]:.1f} | {peaks[1]:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        io.write_text_atomic(args.out, text)


if __name__ == "__main__":
    main()
