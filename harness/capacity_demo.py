"""Capacity, demonstrated: the longest context a model can prefill and decode under a memory cap, per cache.

`python -m harness.capacity_demo --model smollm2-135m --memory-gib 6 --batch 8 --bits 16 8 4 2` runs each
trial in a child process whose address space is capped with resource.setrlimit(RLIMIT_AS) (the cap covers the
whole process: Python, torch, the weights and the cache). A trial loads the model, prefills `context` random
tokens through the cache in chunks of `--chunk` and decodes `--new-tokens` greedy tokens; it fits when the child
exits cleanly. Per width (16: DynamicCache in the model's dtype; 8, 4, 2: QuantizedKVCache asym_token g32,
packed-only) the context is searched in steps of `--step` tokens (doubling, then bisection). Beside each
result: harness.capacity's prediction for the memory left once an empty-cache trial's peak is taken off the
cap (16 bits counted at the model dtype's bytes). Writes a Markdown table with the command to `--out`.

This module owns the demonstration only; the arithmetic is harness.capacity's.
"""

from __future__ import annotations

import argparse
import platform
import resource
import subprocess
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.capacity import max_context, shape_from_registry
from harness.models import load_model, model_spec
from harness.precision import torch_dtype
from harness.schemes import get_scheme
from kernels.layout import FULL_WIDTH
from kernels.reference import WIDTHS as PACKED_WIDTHS

GIB = 2**30
SCHEME, GROUP_SIZE = "asym_token", 32  # the quantized cache tried (harness.schemes)


def vm_peak_bytes() -> int:
    """The process's peak virtual memory (what RLIMIT_AS caps), from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmPeak:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmPeak in /proc/self/status")


def trial(model_name: str, batch: int, context: int, bits: int, new_tokens: int, chunk: int, cap: int) -> int:
    """Run one capped trial in this process: prefill and decode; prints the peak virtual memory, returns 0."""
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.manual_seed(0)
    with torch.no_grad():
        model, _ = load_model(model_name)
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
            for step in range(new_tokens):
                pos = torch.full_like(token, context + step)
                token = model(
                    input_ids=token, position_ids=pos, past_key_values=cache, use_cache=True
                ).logits.argmax(-1)
    print(f"vm_peak {vm_peak_bytes()}")
    return 0


def fits(args, bits: int, context: int) -> tuple[bool, int | None]:
    """(whether a capped child prefilled `context` tokens and decoded, its peak virtual memory or None)."""
    command = [
        sys.executable, "-m", "harness.capacity_demo", "--trial", "--model", args.model, "--batch", str(args.batch),
        "--context", str(context), "--bits", str(bits), "--new-tokens", str(args.new_tokens),
        "--chunk", str(args.chunk), "--memory-gib", str(args.memory_gib),
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    peak = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("vm_peak ")]
    ok = proc.returncode == 0 and bool(peak)
    print(f"  {bits:2d} bits, context {context:7d}: {'fits' if ok else 'does not fit'}", flush=True)
    return ok, peak[0] if peak else None


def largest_context(args, bits: int) -> int:
    """The largest multiple of --step that fits (0 if none does): doubling, then bisection."""
    low, high = 0, args.step
    while high <= args.max_context and fits(args, bits, high)[0]:
        low, high = high, 2 * high
    high = min(high, args.max_context + args.step)
    while high - low > args.step:
        mid = (low + high) // 2 // args.step * args.step
        low, high = (mid, high) if fits(args, bits, mid)[0] else (low, mid)
    return low


def predicted(args, bits: int, overhead: int) -> int | None:
    """harness.capacity's longest context for the cap less `overhead` (16 bits at the model dtype's bytes)."""
    shape = shape_from_registry(args.model)
    budget = args.memory_gib * GIB - overhead
    if (
        bits == FULL_WIDTH
    ):  # harness.capacity counts 16-bit tokens at 2 bytes; a DynamicCache holds the model's dtype
        budget = budget * 2 // torch_dtype(model_spec(args.model)["dtype"]).itemsize
    return max_context(shape, max(budget, 0), bits, get_scheme(SCHEME, GROUP_SIZE), batch=args.batch)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.capacity_demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--memory-gib", type=float, default=6.0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--bits", type=int, nargs="+", default=[16, 8, 4, 2])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    p.add_argument("--step", type=int, default=1024, help="context granularity of the search")
    p.add_argument("--max-context", type=int, default=131072)
    p.add_argument("--out", default="results/capacity/demo.md")
    p.add_argument("--trial", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    bad = [b for b in args.bits if b not in (*PACKED_WIDTHS, FULL_WIDTH)]
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
        bits = args.bits[0]
        raise SystemExit(trial(args.model, args.batch, args.context, bits, args.new_tokens, args.chunk, cap))
    ok, overhead = fits(
        args, FULL_WIDTH, 1
    )  # an (almost) empty cache: what the process needs besides the cache
    if not ok:
        print(f"error: --memory-gib: {args.memory_gib} does not hold {args.model} itself", file=sys.stderr)
        raise SystemExit(2)
    rows = []
    for bits in args.bits:
        context = largest_context(args, bits)
        rows.append((bits, context, predicted(args, bits, overhead)))
    command = "python -m harness.capacity_demo " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"Command: `{command}` ({platform.machine()}, Python {platform.python_version()}).",
        "",
        f"Largest context that prefills (chunks of {args.chunk}) and decodes {args.new_tokens} tokens at batch "
        f"{args.batch} under a {args.memory_gib:g} GiB address-space cap (RLIMIT_AS), searched in steps of "
        f"{args.step}; predicted: harness.capacity for the cap less an empty-cache trial's peak "
        f"({overhead / GIB:.2f} GiB).",
        "",
        "| cache | bits | largest context | batch x context | predicted context |",
        "|---|---|---|---|---|",
    ]
    for bits, context, guess in rows:
        name = (
            "DynamicCache" if bits == FULL_WIDTH else f"QuantizedKVCache {SCHEME} g{GROUP_SIZE} (packed-only)"
        )
        lines.append(f"| {name} | {bits} | {context} | {args.batch * context} | {guess} |")
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
