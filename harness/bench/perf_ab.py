"""`python -m harness.bench.perf_ab FILE... [--contexts 2048 8192]`: versions of kernels/packed_attention.py (the CPU
read path) timed against each other in one process.

This module owns that comparison. Each FILE is a copy of kernels/packed_attention.py (an older revision, a
candidate), loaded as its own module. At each context the model prefills one batch once; then for every
version, alternating version by version so that the machine's drift falls on all of them alike:
- `call`: one decode attention call, packed_attention over a layer's 4-bit stores (the packed-only cache's,
  asym_token g32) with the query heads of one new token;
- `step`: a whole packed-only 4-bit decode step of the model (harness.bench.perf's step), each version with a cache
  of its own built from the same prefill, harness/attention/packed.py pointed at the version's packed_attention.
Medians and minima over `--repeats` (calls) and `--steps` (steps, after 2 warm-up steps); every version's call
output is checked against the first version's. A speed comparison across runs of harness.bench.perf moves with the
machine; this one does not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import harness.attention.packed as packed_path
from harness import io
from harness.attention import PACKED, installed
from harness.bench.perf import SCHEME
from harness.cache import QuantizedKVCache
from harness.models import load_model
from kernels.gpu.ab import check_version_files, load_versions


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def summary(seconds: list[float]) -> str:
    return f"median {statistics.median(seconds) * 1e3:8.2f} ms  min {min(seconds) * 1e3:8.2f} ms"


@torch.no_grad()
def compare(model, versions: dict, context: int, batch: int, steps: int, repeats: int) -> list[str]:
    """Lines of `call` and `step` timings at one context, one per version."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, context))
    prefilled = DynamicCache(config=model.config)
    first = (
        model(input_ids=ids, past_key_values=prefilled, use_cache=True, logits_to_keep=1)
        .logits[:, -1]
        .argmax(-1)
    )

    def new_cache():
        return QuantizedKVCache.from_prefilled(
            prefilled, model.config, 4, scheme=SCHEME.name, group_size=SCHEME.group_size, simulate=False
        )

    # one call: layer 0's stores, the query heads of one token (B, Hq, 1, D)
    layer = new_cache().layers[0]
    hq, d = model.config.num_attention_heads, layer.k_store.head_dim
    q = torch.randn(batch, hq, 1, d)
    call = {name: [] for name in versions}
    want = None
    for name, mod in versions.items():
        got = mod.packed_attention(q, layer.k_store, layer.v_store, d**-0.5)
        want = got if want is None else want
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            sys.exit(f"error: {name} computes another attention than {next(iter(versions))}")
    for _ in range(repeats):
        for name, mod in versions.items():
            call[name].append(
                timed(lambda m=mod: m.packed_attention(q, layer.k_store, layer.v_store, d**-0.5))
            )
    # whole steps, versions alternating step by step; every version is fed the first version's next token
    caches = {name: new_cache() for name in versions}
    step = {name: [] for name in versions}
    token, original = first[:, None], packed_path.packed_attention
    try:
        for i in range(2 + steps):
            pos = torch.full_like(token, context + i)
            logits = {}
            for name, mod in versions.items():
                packed_path.packed_attention = mod.packed_attention
                t = time.perf_counter()
                logits[name] = model(input_ids=token, position_ids=pos, cache_position=pos[0],
                                     past_key_values=caches[name], use_cache=True).logits  # fmt: skip
                if i >= 2:  # warm-up steps dropped
                    step[name].append(time.perf_counter() - t)
            token = next(iter(logits.values()))[:, -1].argmax(-1, keepdim=True)
    finally:
        packed_path.packed_attention = original
    return [f"{context:6d} call {name:24s} {summary(call[name])}" for name in versions] + [
        f"{context:6d} step {name:24s} {summary(step[name])}" for name in versions
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m harness.bench.perf_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="copies of kernels/packed_attention.py")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=40, help="timed attention calls per version")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    check_version_files(p, args.files, "kernels/packed_attention.py")
    for key, value in (("--batch", args.batch), ("--steps", args.steps), ("--repeats", args.repeats)):
        if value < 1:
            p.error(f"{key}: {value} is not allowed; allowed: a positive count")
    try:
        io.set_threads(args.threads, key="--threads")
    except ValueError as err:
        p.error(str(err))
    versions = load_versions(args.files)
    model, _ = load_model(args.model, dtype=torch.float32)
    print(
        f"# {io.command_line('python -m harness.bench.perf_ab', argv)}; batch {args.batch}, {args.threads} threads"
    )
    with installed(model, PACKED):
        for context in args.contexts:
            for line in compare(model, versions, context, args.batch, args.steps, args.repeats):
                print(line, flush=True)


if __name__ == "__main__":
    main()
