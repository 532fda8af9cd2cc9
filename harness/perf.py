"""Decode-step cost of the quantized cache against DynamicCache and transformers' QuantizedCache (quanto).

`python -m harness.perf [--model smollm2-135m --batch 8 --context 2048 --bits 4 --steps 12]` prefills one
context, gives every cache the same K/V (each through its own update path, as a prefill would), then times
single-token decode steps (median after warm-up; each step appends one token) and writes
results/perf/decode_step.csv with the command, machine and versions beside the numbers (and the full record,
written before the model loads, in decode_step.env.json).
"""

from __future__ import annotations

import argparse
import copy
import csv
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, QuantizedCache

from harness import io
from harness.cache import QuantizedKVCache
from harness.models import load_model


def fill(cache, prefilled: DynamicCache):
    """Give `cache` the prefilled K/V through its own update() (what a prefill forward would call)."""
    for i, layer in enumerate(prefilled.layers):
        cache.update(layer.keys, layer.values, i)
    return cache


def time_steps(model, cache, first: torch.Tensor, position: int, steps: int, warmup: int = 2) -> list[float]:
    """Seconds per single-token forward through `cache` (B tokens at a time), warm-up steps dropped."""
    token = first[:, None]  # (B, 1)
    times = []
    for step in range(warmup + steps):
        pos = torch.full_like(token, position + step)
        t = time.perf_counter()
        logits = model(input_ids=token, position_ids=pos, past_key_values=cache, use_cache=True).logits
        times.append(time.perf_counter() - t)
        token = logits[:, -1].argmax(-1, keepdim=True)
    return times[warmup:]


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quanto-steps", type=int, default=3, help="quanto's CPU path is slow: fewer steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="results/perf/decode_step.csv")
    parser.add_argument(
        "--threads", type=int, help="CPU threads (torch.set_num_threads); default: every core"
    )
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="write into results/ from a git tree with uncommitted changes (recorded in the env record)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    command = io.command_line("python -m harness.perf", argv)
    try:  # before the model loads: threads applied, a clean tree for results/, <out>.env.json written
        io.set_threads(args.threads, key="--threads")
        io.check_writable(out.parent, key="--out")
        io.check_clean(out.parent, args.allow_dirty, key="--allow-dirty")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    env = io.environment(command, "cpu", args.allow_dirty)
    io.write_environment(out.parent, env, out.with_suffix(".env.json").name)

    model, _ = load_model(args.model)
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.context))
    prefilled = DynamicCache(config=model.config)
    first = (
        model(input_ids=ids, past_key_values=prefilled, use_cache=True, logits_to_keep=1)
        .logits[:, -1]
        .argmax(-1)
    )

    caches = {  # name -> (make the cache, timed steps)
        "DynamicCache (fp32)": (lambda: copy.deepcopy(prefilled), args.steps),
        f"QuantizedKVCache asym_token g32 {args.bits}-bit": (
            lambda: QuantizedKVCache.from_prefilled(prefilled, model.config, args.bits, group_size=32),
            args.steps,
        ),
        f"transformers QuantizedCache quanto {args.bits}-bit": (
            lambda: fill(QuantizedCache("quanto", model.config, nbits=args.bits), prefilled),
            args.quanto_steps,
        ),
    }
    rows = []
    for name, (make, steps) in caches.items():
        cache = make()
        seconds = time_steps(model, cache, first, args.context, steps, warmup=args.warmup)
        rows.append(
            {
                "cache": name,
                "steps": steps,
                "median_step_s": statistics.median(seconds),
                "min_step_s": min(seconds),
            }
        )
        print(
            f"{name:45s} median {rows[-1]['median_step_s'] * 1e3:8.1f} ms  min {rows[-1]['min_step_s'] * 1e3:8.1f} ms"
        )
        del cache
    base = rows[0]["median_step_s"]
    for row in rows:
        row["ratio_to_dynamic"] = row["median_step_s"] / base

    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            f.write(f"# command: {command} (environment: {out.with_suffix('.env.json').name})\n")
            f.write(
                f"# model {args.model}, batch {args.batch}, context {args.context}, {args.steps} timed steps; "
                f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
                f"{env['threads']} threads, commit {env['git_commit']}\n"
            )
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)

    io.write_atomic(out, write)
    for row in rows:
        print(f"{row['cache']:45s} {row['ratio_to_dynamic']:.2f}x DynamicCache")


if __name__ == "__main__":
    main()
