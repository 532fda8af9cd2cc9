"""Decode-step cost and resident memory of the quantized cache against transformers' caches.

`python -m harness.bench.perf [--model smollm2-135m --batch 8 --contexts 2048 8192 --bits 4 2 --steps 12]` prefills
each context once (a full-precision DynamicCache), gives every cache the same K/V (each through its own update
path, as a prefill would), then times single-token decode steps (median after warm-up; each step appends one
token) and measures the cache's resident bytes (the storage of every tensor it keeps, shared storage counted
once). Caches: DynamicCache and StaticCache (the model's dtype), QuantizedKVCache asym_token g32 packed-only
(quant.simulate=false) and simulated (a full-precision working copy), and transformers' QuantizedCache with the
quanto and HQQ backends (those whose package is installed). Writes results/perf/decode_step.csv with the
command, machine, versions and the process's peak RSS; the ratios are to DynamicCache at the same context.
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import importlib.util
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, QuantizedCache, StaticCache

from harness import io, precision
from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache, resident_bytes
from harness.models import load_model
from harness.schemes import get_scheme

QUANTIZED_BACKENDS = {"quanto": "optimum.quanto", "hqq": "hqq"}  # QuantizedCache backend -> its package

SCHEME = get_scheme("asym_token", 32)  # the quantized cache measured


def fill(cache, prefilled: DynamicCache, **cache_kwargs):
    """Give `cache` the prefilled K/V through its own update() (what a prefill forward would call)."""
    for i, layer in enumerate(prefilled.layers):
        cache.update(layer.keys, layer.values, i, cache_kwargs or None)
    return cache


def time_steps(model, cache, first: torch.Tensor, position: int, steps: int, warmup: int) -> list[float]:
    """Seconds per single-token forward through `cache` (B tokens at a time), warm-up steps dropped."""
    token = first[:, None]  # (B, 1)
    times = []
    for step in range(warmup + steps):
        pos = torch.full_like(token, position + step)
        t = time.perf_counter()
        logits = model(
            input_ids=token, position_ids=pos, cache_position=pos[0], past_key_values=cache, use_cache=True
        ).logits
        times.append(time.perf_counter() - t)
        token = logits[:, -1].argmax(-1, keepdim=True)
    return times[warmup:]


def caches(model, prefilled: DynamicCache, context: int, bits: int, args) -> dict:
    """name -> (make the cache, timed steps) for one context and width."""
    config, ctx_len = model.config, context + args.warmup + args.steps
    positions = {"cache_position": torch.arange(context)}
    out = {
        "DynamicCache": (lambda: copy.deepcopy(prefilled), args.steps),
        "StaticCache": (
            lambda: fill(StaticCache(config=config, max_cache_len=ctx_len), prefilled, **positions),
            args.steps,
        ),
    }
    for simulate, label in ((False, "packed-only"), (True, "simulated")):
        out[f"QuantizedKVCache {SCHEME.label()} {bits}-bit {label}"] = (
            lambda s=simulate: QuantizedKVCache.from_prefilled(
                prefilled, config, bits, scheme=SCHEME.name, group_size=SCHEME.group_size, simulate=s
            ),
            args.steps,
        )
    for backend, package in QUANTIZED_BACKENDS.items():
        if backend in args.without:
            continue
        if importlib.util.find_spec(package.split(".")[0]) is None:
            print(f"QuantizedCache {backend}: {package} is not installed, skipped")
            continue
        out[f"transformers QuantizedCache {backend} {bits}-bit"] = (
            lambda b=backend: fill(QuantizedCache(b, config, nbits=bits), prefilled),
            args.quantized_steps,
        )
    return out


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.bench.perf", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--quantized-steps",
        type=int,
        default=3,
        help="transformers' QuantizedCache is slow on CPU: fewer steps",
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--without",
        nargs="*",
        default=[],
        choices=list(QUANTIZED_BACKENDS),
        help="QuantizedCache backends to skip",
    )
    p.add_argument("--out", default="results/perf/decode_step.csv")
    p.add_argument("--dtype", default="float32", help="the model's dtype: float32, bfloat16 or auto")
    io.add_run_arguments(p)
    return p


def check(args) -> None:
    for key in ("batch", "steps", "quantized_steps", "warmup"):
        if getattr(args, key) < (0 if key == "warmup" else 1):
            sys.exit(f"error: --{key.replace('_', '-')}: {getattr(args, key)} is not allowed; allowed: >= 1")
    for context in args.contexts:
        if context < 1:
            sys.exit(f"error: --contexts: {context} is not allowed; allowed: positive token counts")
    for b in args.bits:
        if b not in (2, 4, 8):
            sys.exit(f"error: --bits: {b} is not allowed; allowed: 2, 4, 8")


@torch.no_grad()
def measure(model, args) -> list[dict]:
    """Every cache's decode step at every context of args: its median and fastest step and the bytes it held,
    with ratios to DynamicCache at the same context."""
    rows = []
    with installed(model, PACKED):  # our caches are attended from their packed form; the others through SDPA
        for context in args.contexts:
            torch.manual_seed(0)
            ids = torch.randint(0, model.config.vocab_size, (args.batch, context))
            prefilled = DynamicCache(config=model.config)
            logits = model(input_ids=ids, past_key_values=prefilled, use_cache=True, logits_to_keep=1).logits
            first = logits[:, -1].argmax(-1)
            seen = set()
            for bits in args.bits:
                for name, (make, steps) in caches(model, prefilled, context, bits, args).items():
                    if name in seen:  # the unquantized caches do not depend on the width
                        continue
                    seen.add(name)
                    cache = make()
                    held = resident_bytes(cache)
                    seconds = time_steps(model, cache, first, context, steps, args.warmup)
                    rows.append(
                        {
                            "cache": name,
                            "context": context,
                            "batch": args.batch,
                            "steps": steps,
                            "median_step_s": statistics.median(seconds),
                            "min_step_s": min(seconds),
                            "resident_bytes": held,
                        }
                    )
                    print(
                        f"{context:6d} {name:55s} median {rows[-1]['median_step_s'] * 1e3:9.1f} ms  "
                        f"resident {held / 2**20:9.1f} MiB"
                    )
                    del cache
                    gc.collect()
            del prefilled
            gc.collect()
    for row in rows:
        base = next(r for r in rows if r["context"] == row["context"] and r["cache"] == "DynamicCache")
        row["step_ratio_to_dynamic"] = row["median_step_s"] / base["median_step_s"]
        row["resident_ratio_to_dynamic"] = row["resident_bytes"] / base["resident_bytes"]
        # DESIGN.md 8 compares with an fp16 DynamicCache: the same tokens at 2 bytes per element
        row["resident_ratio_to_fp16_dynamic"] = row["resident_bytes"] / (
            base["resident_bytes"] * 2 / model.dtype.itemsize
        )
    return rows


def write_csv(out: Path, rows: list[dict], model, args, argv: list[str] | None) -> None:
    """The rows as CSV under two comment lines: the command, and the model, sizes and machine."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        f.write(
            f"# command: python -m harness.bench.perf {' '.join(sys.argv[1:] if argv is None else argv)}\n"
        )
        f.write(
            f"# model {args.model} ({model.dtype}), batch {args.batch}, {args.steps} timed steps "
            f"({args.quantized_steps} for QuantizedCache) after {args.warmup} warm-up; "
            f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads; peak RSS {peak_rss_bytes() / 2**30:.2f} GiB\n"
        )
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    out = Path(args.out)
    try:
        check(args)
    except SystemExit as err:
        print(err, file=sys.stderr)
        raise SystemExit(2) from None
    try:  # before the model loads: threads applied, a clean tree for results/, <out>.env.json written
        dtype = precision.resolve(args.dtype, "cpu")
        io.set_threads(args.threads, key="--threads")
        io.check_writable(out.parent, key="--out")
        io.check_clean(out.parent, args.allow_dirty, key="--allow-dirty")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    command = io.command_line("python -m harness.bench.perf", argv)
    io.start_record(
        out.parent, command, "cpu", args.allow_dirty, dtype, name=out.with_suffix(".env.json").name
    )
    model, _ = load_model(args.model, dtype=dtype)
    rows = measure(model, args)
    write_csv(out, rows, model, args, argv)
    for row in rows:
        print(
            f"{row['context']:6d} {row['cache']:55s} {row['step_ratio_to_dynamic']:5.2f}x step  "
            f"{row['resident_ratio_to_dynamic']:5.3f}x resident of DynamicCache"
        )
    print(f"peak RSS {peak_rss_bytes() / 2**30:.2f} GiB; wrote {out}")


if __name__ == "__main__":
    main()
