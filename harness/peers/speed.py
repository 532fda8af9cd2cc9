"""Decode speed of llama.cpp's KV cache types: `python -m harness.peers.speed [--help]`.

For each context length and cache type: one llama.cpp context (flash attention on, K and V of that type, its
rotation as asked), a prefill of `context` tokens, then `runs` timed runs of `new_tokens` single-token decodes
from that same context (each run drops the previous run's tokens first), after `warmup` untimed runs. Prints and
writes tokens/s per run as median and spread (min, max), and each type's median against f16's at the same
context, to a CSV that starts with the command, the machine and the versions; the CSV is rewritten (atomically)
after every measurement, so an interrupted run keeps what it measured. Its environment record (git commit and
dirty flag, versions, threads) goes beside it as `<out>.env.json`; into the repository's results/ only from a
clean tree unless --allow-dirty. Token ids are drawn at random (seeded): the speed of a decode step does not
depend on which tokens it sees.
"""

from __future__ import annotations

import argparse
import csv
import io as textio
import platform
import statistics
import time
from importlib import metadata
from pathlib import Path

import torch

from harness import io
from harness.models import ModelUnavailable, gguf_path, model_names, model_spec
from harness.peers.llamacpp import KV_TYPES, open_llama

PREFILL_BATCH = 512


def decode_runs(llm, context: int, new_tokens: int, runs: int, warmup: int, seed: int = 0) -> list[float]:
    """Tokens/s of `runs` decodes of `new_tokens` tokens each after a prefill of `context` random tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, llm.n_vocab(), (context + new_tokens,), generator=g).tolist()
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids[:context])  # n_batch tokens per decode
    print(f"  prefilled {context} tokens in {time.perf_counter() - start:.0f} s; timing decodes", flush=True)
    speeds = []
    for run in range(warmup + runs):
        llm.n_tokens = context  # the next eval removes the previous run's tokens from the cache
        start = time.perf_counter()
        for token in ids[context:]:
            llm.eval([token])
        seconds = time.perf_counter() - start
        if run >= warmup:
            speeds.append(new_tokens / seconds)
    return speeds


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.peers.speed", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="a registered GGUF model (default smollm2-135m)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--types", nargs="+", default=list(KV_TYPES), help=f"of {', '.join(KV_TYPES)}")
    p.add_argument("--rotation", choices=("on", "off"), default="on", help="llama.cpp's Hadamard rotation")
    p.add_argument("--new-tokens", type=int, default=32, help="decoded tokens per run")
    p.add_argument("--runs", type=int, default=5, help="timed runs per context and type")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    p.add_argument(
        "--threads", type=int, default=None, help="llama.cpp threads (default: torch's, OMP_NUM_THREADS)"
    )
    p.add_argument("--out", type=Path, default=Path("results/peers/decode_speed.csv"))
    p.add_argument(
        "--allow-dirty",
        action="store_true",
        help="write into results/ from a git tree with uncommitted changes (recorded in the env record)",
    )
    return p


def check(args, p: argparse.ArgumentParser) -> Path:
    """The GGUF path; every bad argument stops here (exit 2) before a model loads."""
    if args.model not in model_names() or model_spec(args.model)["source"] != "gguf_package":
        gguf = [n for n in model_names() if model_spec(n)["source"] == "gguf_package"]
        p.error(f"--model: {args.model!r} is not a registered GGUF model; allowed: {', '.join(gguf)}")
    for t in args.types:
        if t not in KV_TYPES:
            p.error(f"--types: unknown {t!r}; allowed: {', '.join(KV_TYPES)}")
    if args.threads is None:
        args.threads = torch.get_num_threads()
    for name in ("contexts", "new_tokens", "runs", "threads"):
        values = getattr(args, name)
        for v in values if isinstance(values, list) else [values]:
            if v < 1:
                p.error(f"--{name.replace('_', '-')}: {v} is not a positive integer")
    if args.warmup < 0:
        p.error(f"--warmup: {args.warmup} is negative")
    try:
        io.check_writable(args.out.parent, key="--out")
        io.check_clean(args.out.parent, args.allow_dirty, key="--allow-dirty")
    except ValueError as err:
        p.error(str(err))
    try:
        return gguf_path(model_spec(args.model))
    except ModelUnavailable as err:
        p.error(str(err))


def write_rows(out: Path, command: str, threads: int, rows: list[dict]) -> None:
    """The CSV: the command and the machine on top, then one row per (context, type) with its ratio to f16's
    median at the same context (nan until f16 has run there)."""
    for row in rows:
        f16 = [r for r in rows if r["context"] == row["context"] and r["kv_type"] == "f16"]
        row["ratio_to_f16"] = row["tok_s_median"] / f16[0]["tok_s_median"] if f16 else float("nan")
    text = textio.StringIO()
    text.write(f"# command: {command}\n")
    text.write(
        f"# {platform.processor() or platform.machine()}, {threads} llama.cpp threads, "
        f"llama-cpp-python {metadata.version('llama-cpp-python')}, flash attention on\n"
    )
    writer = csv.DictWriter(text, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    io.write_text_atomic(out, text.getvalue())


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    path = check(args, p)
    command = io.command_line("python -m harness.peers.speed", argv)
    io.start_record(args.out.parent, command, "cpu", args.allow_dirty, name=args.out.name + ".env.json")
    limit = model_spec(args.model).get("context_limit")
    rotation = args.rotation == "on"
    rows = []
    for context in args.contexts:
        if limit and context + args.new_tokens > limit:
            print(f"note: context {context} exceeds {args.model}'s trained {limit}: speed only, no quality")
        for kv_type in args.types:
            llm = open_llama(
                path,
                kv_type,
                rotation,
                context + args.new_tokens,
                PREFILL_BATCH,
                logits_all=False,
                threads=args.threads,
            )
            try:
                speeds = decode_runs(llm, context, args.new_tokens, args.runs, args.warmup)
            finally:
                llm.close()
            rows.append(
                {
                    "model": args.model,
                    "context": context,
                    "kv_type": kv_type,
                    "rotation": rotation and kv_type != "f16",
                    "new_tokens": args.new_tokens,
                    "runs": args.runs,
                    "tok_s_median": statistics.median(speeds),
                    "tok_s_min": min(speeds),
                    "tok_s_max": max(speeds),
                }
            )
            print(
                f"context {context:6d} {kv_type:7s} median {rows[-1]['tok_s_median']:8.2f} tok/s "
                f"[{rows[-1]['tok_s_min']:.2f}, {rows[-1]['tok_s_max']:.2f}] over {args.runs} runs",
                flush=True,
            )
            write_rows(args.out, command, args.threads, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
