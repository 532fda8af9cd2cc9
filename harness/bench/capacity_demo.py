"""Capacity, demonstrated: the longest context a model can prefill and decode under a memory cap, per cache.

`python -m harness.bench.capacity_demo --model smollm2-135m --memory-gib 6 --batch 8 --bits 16 8 4 2` runs each
trial in a child process whose address space is capped with resource.setrlimit(RLIMIT_AS) (the cap covers the
whole process: Python, torch, the weights and the cache). A trial loads the model in `--dtype`, prefills
`context` random tokens through the cache in chunks of `--chunk` and decodes `--new-tokens` greedy tokens; it
fits when the child exits cleanly. First a one-chunk trial (DynamicCache, `--chunk` tokens) measures what the
process needs besides the cache: its peak less that chunk's K/V, so the working memory of a chunk's forward
counts as overhead; harness.capacity then predicts, per width, the longest context for the rest of the cap (16 bits:
DynamicCache in the model's dtype; 8, 4, 2: QuantizedKVCache asym_token g32, packed-only). The search for the
largest multiple of `--step` that fits starts at that prediction and gallops away from it (steps doubling),
then bisects, so a close prediction costs a few trials near the answer: long prefills are what cost time.
Every trial runs with glibc's MALLOC_MMAP_THRESHOLD_ at `--malloc-mmap-threshold` bytes (64 KiB by default), so
that every buffer that large is mapped on its own and unmapped when freed. With glibc's default (a threshold
that rises to 32 MiB as buffers are freed), freed buffers stay in the heap, the address space grows with how a
cache's allocations fragment it, and the cap measures the allocator as much as the cache (0 keeps the default).
Writes a Markdown table with the command, the prediction and the trials to `--out`, and its environment record
beside it (`<out>.env.json`, the git commit and thread count).

This module owns the demonstration only; the arithmetic is harness.capacity's.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from harness import io, precision
from harness.attention import PACKED, installed
from harness.bench import procmem
from harness.bench.procmem import MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES
from harness.cache import QuantizedKVCache
from harness.capacity import cache_bytes, max_context, shape_from_registry
from harness.models import load_model, model_spec
from harness.schemes import get_scheme
from kernels.layout import FULL_WIDTH
from kernels.reference import WIDTHS as PACKED_WIDTHS

GIB = 2**30
SCHEME, GROUP_SIZE = "asym_token", 32  # the quantized cache tried (harness.schemes)


def trial(args, cap: int) -> int:
    """Run one capped trial in this process: prefill and decode; prints the peak virtual memory, returns 0."""
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    io.set_threads(args.threads, key="--threads")  # the parent's count
    torch.manual_seed(0)
    batch, context, bits, chunk = args.batch, args.context, args.bits[0], args.chunk
    with torch.no_grad():
        model, _ = load_model(args.model, dtype=args.dtype)
        with installed(model, PACKED):
            config = model.config
            if bits == FULL_WIDTH:
                cache = DynamicCache(config=config)
            else:
                cache = QuantizedKVCache(
                    config, bits, scheme=SCHEME, group_size=GROUP_SIZE, prefill="quantized"
                )
            ids = torch.randint(0, config.vocab_size, (batch, context))
            for start in range(0, context, chunk):
                piece = ids[:, start : start + chunk]
                pos = torch.arange(start, start + piece.shape[1]).expand(batch, -1)
                logits = model(
                    input_ids=piece, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1
                ).logits
            token = logits[:, -1:].argmax(-1)  # (B, 1)
            for step in range(args.new_tokens):
                pos = torch.full_like(token, context + step)
                token = model(
                    input_ids=token, position_ids=pos, past_key_values=cache, use_cache=True
                ).logits.argmax(-1)
    print(f"vm_peak {procmem.status_bytes('VmPeak')}")  # what RLIMIT_AS caps
    return 0


def trial_environment(args) -> dict[str, str]:
    """This process's environment, with glibc's mmap threshold for the trial (none set at 0)."""
    env = dict(os.environ)
    env.pop(MMAP_THRESHOLD, None)
    if args.malloc_mmap_threshold:
        env[MMAP_THRESHOLD] = str(args.malloc_mmap_threshold)
    return env


def fits(args, bits: int, context: int) -> tuple[bool, int | None]:
    """(whether a capped child prefilled `context` tokens and decoded, its peak virtual memory or None)."""
    command = [
        sys.executable, "-m", "harness.bench.capacity_demo", "--trial", "--model", args.model, "--batch", str(args.batch),
        "--context", str(context), "--bits", str(bits), "--new-tokens", str(args.new_tokens),
        "--chunk", str(args.chunk), "--memory-gib", str(args.memory_gib), "--threads", str(torch.get_num_threads()),
        *(["--dtype", args.dtype] if args.dtype else []),
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=trial_environment(args))
    seconds = time.perf_counter() - started
    peak = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("vm_peak ")]
    ok = proc.returncode == 0 and bool(peak)
    print(
        f"  {bits:2d} bits, context {context:7d}: {'fits' if ok else 'does not fit'} ({seconds:.0f} s)",
        flush=True,
    )
    if args.trials is not None:
        args.trials.append((bits, context, ok, peak[0] if peak else None, seconds))
    return ok, peak[0] if peak else None


def largest_context(args, bits: int, guess: int | None = None) -> int:
    """The largest multiple of --step up to --max-context that fits (0 if none does).

    The first trial is `guess` (harness.capacity's prediction) rounded down to a multiple of the step; from
    there trials gallop up (while they fit) or down (while they do not) by 1, 2, 4, ... steps, and bisection
    closes the bracket. Invariant: `low` fits (0 trivially), `high` does not (or lies past --max-context).
    """
    step = args.step
    top = args.max_context // step * step
    if top < step:
        return 0
    first = min(max(guess or step, step) // step * step, top)
    low, high = 0, top + step
    jump = step
    if fits(args, bits, first)[0]:
        low = first
        while low + jump <= top:
            if not fits(args, bits, low + jump)[0]:
                high = low + jump
                break
            low, jump = low + jump, 2 * jump
    else:
        high = first
        while high - jump > 0:
            if fits(args, bits, high - jump)[0]:
                low = high - jump
                break
            high, jump = high - jump, 2 * jump
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(args, bits, mid)[0] else (low, mid)
    return low


def dtype_name(args) -> str:
    """--dtype resolved: auto is bfloat16 where the CPU computes it natively; none given, the registry's."""
    return precision.resolve(
        args.dtype or model_spec(args.model).get("dtype", "float32"), "cpu", key="--dtype"
    )


def overhead_bytes(args, chunk_peak: int) -> int:
    """What a trial needs besides its cache: the peak of a one-chunk DynamicCache trial less that chunk's K/V."""
    chunk_kv = cache_bytes(shape_from_registry(args.model), args.chunk, FULL_WIDTH, batch=args.batch)
    return chunk_peak - chunk_kv.fp16_bytes * precision.torch_dtype(dtype_name(args)).itemsize // 2


def predicted(args, bits: int, overhead: int) -> int | None:
    """harness.capacity's longest context for the cap less `overhead` (16 bits at the model dtype's bytes)."""
    shape = shape_from_registry(args.model)
    budget = args.memory_gib * GIB - overhead
    if (
        bits == FULL_WIDTH
    ):  # harness.capacity counts 16-bit tokens at 2 bytes; a DynamicCache holds the model's dtype
        budget = budget * 2 // precision.torch_dtype(dtype_name(args)).itemsize
    return max_context(shape, max(budget, 0), bits, get_scheme(SCHEME, GROUP_SIZE), batch=args.batch)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness.bench.capacity_demo", description=__doc__.splitlines()[0]
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--memory-gib", type=float, default=6.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--bits", type=int, nargs="+", default=[16, 8, 4, 2])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    p.add_argument("--step", type=int, default=1024, help="context granularity of the search")
    p.add_argument("--max-context", type=int, default=131072)
    p.add_argument(
        "--dtype", default=None, help="the model's dtype: float32, bfloat16 or auto (default: the registry's)"
    )
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=MMAP_THRESHOLD_BYTES,
        help=f"glibc's {MMAP_THRESHOLD} in every trial, bytes (default {MMAP_THRESHOLD_BYTES}; 0: glibc's default)",
    )
    p.add_argument("--out", default="results/capacity/demo.md")
    io.add_run_arguments(p)
    p.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    p.set_defaults(trials=None)  # main's log of (bits, context, fits, peak bytes, seconds)
    return p


def report(args, command: str, overhead: int, rows: list, pending: tuple[int, ...] = ()) -> str:
    """The Markdown result: the command, the table (largest context and prediction per width), every trial; while
    widths are `pending`, a line saying the search goes on (main rewrites the file after every width)."""
    lines = [
        f"Command: `{command}` ({platform.machine()}, Python {platform.python_version()}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads).",
        "",
        f"Largest context that prefills (chunks of {args.chunk}) and decodes {args.new_tokens} tokens at batch "
        f"{args.batch} in {args.dtype} under a {args.memory_gib:g} GiB address-space cap (RLIMIT_AS), searched in "
        f"steps of {args.step} from the prediction; predicted: harness.capacity for the cap less the overhead "
        f"({overhead / GIB:.2f} GiB: a one-chunk DynamicCache trial's peak less that chunk's K/V). "
        + (
            f"glibc's {MMAP_THRESHOLD}={args.malloc_mmap_threshold} in every trial."
            if args.malloc_mmap_threshold
            else "glibc's default malloc settings in every trial."
        ),
        "",
        "| cache | bits | largest context | batch x context | predicted context |",
        "|---|---|---|---|---|",
    ]
    if pending:
        lines.insert(
            2,
            f"**Incomplete:** still searching {', '.join(map(str, pending))} bits; the trials so far are below.\n",
        )
    for bits, context, guess in rows:
        name = (
            f"DynamicCache ({args.dtype})"
            if bits == FULL_WIDTH
            else f"QuantizedKVCache {SCHEME} g{GROUP_SIZE} (packed-only)"
        )
        lines.append(f"| {name} | {bits} | {context} | {args.batch * context} | {guess} |")
    lines += [
        "",
        "Trials, in order:",
        "",
        "| bits | context | fits | peak GiB | seconds |",
        "|---|---|---|---|---|",
    ]
    for bits, context, ok, peak, seconds in args.trials:
        shown = "-" if peak is None else f"{peak / GIB:.2f}"
        lines.append(f"| {bits} | {context} | {'yes' if ok else 'no'} | {shown} | {seconds:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    bad = [b for b in args.bits if b not in (*PACKED_WIDTHS, FULL_WIDTH)]
    if args.malloc_mmap_threshold < 0:
        print(
            f"error: --malloc-mmap-threshold: {args.malloc_mmap_threshold}; allowed: 0 or more bytes",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if bad or args.memory_gib <= 0 or min(args.batch, args.step, args.chunk, args.new_tokens) < 1:
        what = (
            f"--bits: {bad[0]}; allowed: {', '.join(map(str, (*PACKED_WIDTHS, FULL_WIDTH)))}"
            if bad
            else "sizes: allowed: positive numbers"
        )
        print(f"error: {what}", file=sys.stderr)
        raise SystemExit(2)
    cap = int(args.memory_gib * GIB)
    if args.trial:
        raise SystemExit(trial(args, cap))
    out = Path(args.out)
    try:  # before any trial: dtype resolved, threads applied, a clean tree for results/
        args.dtype = dtype_name(args)
        io.set_threads(args.threads, key="--threads")
        io.check_writable(out.parent, key="--out")
        io.check_clean(out.parent, args.allow_dirty, key="--allow-dirty")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    command = io.command_line("python -m harness.bench.capacity_demo", argv)
    io.start_record(
        out.parent, command, "cpu", args.allow_dirty, args.dtype, name=out.with_suffix(".env.json").name
    )
    args.trials = []
    # what the process needs besides the cache: one chunk's trial, less that chunk's K/V in the model's dtype
    ok, peak = fits(args, FULL_WIDTH, args.chunk)
    if not ok:
        print(f"error: --memory-gib: {args.memory_gib} does not hold {args.model} itself", file=sys.stderr)
        raise SystemExit(2)
    overhead = overhead_bytes(args, peak)
    rows = []
    for i, bits in enumerate(args.bits):  # the file after every width: a stopped run keeps its trials
        io.write_text_atomic(out, report(args, command, overhead, rows, tuple(args.bits[i:])))
        guess = predicted(args, bits, overhead)
        rows.append((bits, largest_context(args, bits, guess), guess))
    text = report(args, command, overhead, rows)
    io.write_text_atomic(out, text)
    print(text)


if __name__ == "__main__":
    main()
