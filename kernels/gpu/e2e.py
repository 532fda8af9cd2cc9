"""End-to-end generate() on a random-weight model of Llama-3-8B's shape: decode tokens/s and peak GPU memory
with transformers' DynamicCache against QuantizedKVCache on the triton backend at 8, 4 and 2 bits, a mixed
allocation (mean 4 bits), pca's flat block format at 4 bits (pca4) and its grouped ones (ugs5, ugsa4, ugsa4b32).

This module owns that measurement. The model is built on the GPU from Llama-3-8B's configuration (32 layers,
32 query / 8 KV heads of 128, hidden 4096, MLP 14336, vocabulary 128256) in bf16 with random weights: speed
and memory do not depend on the weights. Per cache: a chunked prefill of the prompt but its last token (so no
full-prompt activations or logits are ever held), then `model.generate` of `--new-tokens` tokens from there,
timed alone and step by step: tokens/s is the batch over the median step (a steady decode step); decode_s is
the whole generate() with its first steps, which also compile the Triton kernels for the shapes they meet.
A "-graph" cache (4-graph, mixed-graph) runs the same within harness.cache.graphed.graphed_decoding: each
decode step after two eager ones replayed from one CUDA graph; one that fails (its capture, say) is a row with
the error in its note, and the caches after it still run.
Peak memory is torch.cuda.max_memory_allocated over the prefill and the generation, less the weights.
`--profile STEPS` then runs STEPS more decode steps under torch.profiler and writes where their time goes, by
device and by host time (e2e-profile-<cache>.txt). A dry run (--dry-run: CPU, TRITON_INTERPRET=1) uses a
two-layer model of the same kind at a tiny size, to check that the code runs; its times are no figure.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
DRY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False,
)  # fmt: skip
# a run cut short by its time limit still has the headline ones; "-graph": greedy decoding whose steps replay
# from a CUDA graph (harness.cache.graphed), the rest model.generate
CACHES = ("dynamic", "4", "pca4", "ugsa4b32", "ugs5", "4-graph", "mixed-graph", "mixed", "ugsa4", "2", "8")
# pca4: pca_block_uf at 4 bits with one sink token (the pca family's fused path: codes-only stores, each decode step
# folded around decode_attention_blocks); ugs5: pca_block_ugs at 5 bits (each head's components in groups of 16 at
# 0-8 bits, one plan per role: kernels/groups.py; 5 bits is no flat width, so its rows are always grouped); ugsa4:
# pca_block_ugsa at 4 bits (groups of any width 0-8, their planes summed); ugsa4b32: pca_block32_ugsa at 4 bits (the
# same with keys in blocks of 32 tokens: a query per 32 tokens). Their transforms and plans fitted on CALIBRATION
# random windows of the same model.
PCA_CACHES = {"pca4": ("pca_block_uf", 4), "ugs5": ("pca_block_ugs", 5), "ugsa4": ("pca_block_ugsa", 4),
              "ugsa4b32": ("pca_block32_ugsa", 4)}  # fmt: skip
CALIBRATION = (4, 256)  # windows x tokens
# the rest: the kind is the width
MEAN_BITS = {"dynamic": 16, "mixed": 4, **{kind: width for kind, (_, width) in PCA_CACHES.items()}}
# caches not yet run on a GPU: one that fails is a row with the error in its note, and the caches after it still run
TRIAL = tuple(PCA_CACHES)
COLUMNS = [
    "cache", "mean_bits", "batch", "context", "new_tokens", "prefill_s", "decode_s", "step_ms_median", "step_ms_max",
    "tokens_per_s",
    "peak_gib", "weights_gib", "kv_gib", "note",
]  # fmt: skip


def mixed_bits(layers: int, kv_heads: int) -> torch.Tensor:
    """[layers, kv_heads] widths with mean 4: per layer half the heads at 2, a quarter at 4, a quarter at 8."""
    n2, n4 = kv_heads // 2, kv_heads // 4
    row = [2] * n2 + [4] * n4 + [8] * (kv_heads - n2 - n4)
    return torch.tensor([row] * layers)


def build_model(config: dict, dtype: torch.dtype, device: str):
    """A LlamaForCausalLM with random weights, built on `device` (no weights file is read)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in `dtype` (no float32 copy of 8B weights)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    finally:
        torch.set_default_dtype(default)
    return model


def make_cache(kind: str, model, group_size: int):
    from transformers import DynamicCache

    from harness.cache import QuantizedKVCache

    cfg = model.config
    if kind == "dynamic":
        return DynamicCache(config=cfg)
    if kind in PCA_CACHES:
        scheme, width = PCA_CACHES[kind]
        return QuantizedKVCache(cfg, width, scheme=scheme, sink_tokens=1, backend="triton",
                                key_calibration=pca_fit(model, scheme))  # fmt: skip
    bits = mixed_bits(cfg.num_hidden_layers, cfg.num_key_value_heads) if kind == "mixed" else int(kind)
    return QuantizedKVCache(cfg, bits, group_size=group_size, backend="triton")


def pca_fit(model, scheme: str):
    """The pca `scheme`'s transforms for `model`, fitted on CALIBRATION random windows (speed does not depend on
    them)."""
    from harness.calibrate.pca import fit_pca_calibration
    from harness.schemes import get_scheme

    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, CALIBRATION, generator=gen).to(model.device)
    return fit_pca_calibration(model, ids, get_scheme(scheme).pca_format)


def cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


class StepClock:
    """A logits processor that only notes when each decode step's logits are ready (the device synchronized),
    so the steps of one generate() can be timed apart: the first steps also compile the Triton kernels for
    their shapes, which a steady decode does not repeat."""

    def __init__(self, sync):
        self.sync, self.stamps = sync, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.sync()
        self.stamps.append(time.perf_counter())
        return scores

    def step_seconds(self) -> list[float]:
        """Seconds between consecutive steps' logits: one per step after the first."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


@torch.no_grad()
def measure(model, kind: str, prompt: torch.Tensor, new_tokens: int, chunk: int, group_size: int) -> dict:
    """Chunked prefill of prompt[:, :-1], then generate() of new_tokens greedy tokens; times and memory. A "-graph"
    kind runs both within harness.cache.graphed.graphed_decoding."""
    from harness.cache.graphed import graphed_decoding

    dev = prompt.device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cache = make_cache(kind.removesuffix("-graph"), model, group_size)
    with contextlib.ExitStack() as stack:
        if kind.endswith("-graph"):
            stack.enter_context(graphed_decoding(model, cache, prompt.shape[1] + new_tokens))
        return _timed_generate(model, cache, prompt, new_tokens, chunk, sync)


def _timed_generate(model, cache, prompt: torch.Tensor, new_tokens: int, chunk: int, sync) -> dict:
    t0 = time.perf_counter()
    for s in range(0, prompt.shape[1] - 1, chunk):
        model(
            input_ids=prompt[:, s : min(s + chunk, prompt.shape[1] - 1)],
            past_key_values=cache,
            logits_to_keep=1,
        )
    sync()
    t1 = time.perf_counter()
    from transformers import LogitsProcessorList

    clock = StepClock(sync)
    out = model.generate(
        prompt, past_key_values=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
    )  # fmt: skip
    sync()
    t2 = time.perf_counter()
    assert out.shape[1] == prompt.shape[1] + new_tokens
    peak = torch.cuda.max_memory_allocated() if prompt.device.type == "cuda" else 0
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "steps": clock.step_seconds(), "peak": peak,
            "kv": cache_bytes(cache), "cache": cache, "out": out}  # fmt: skip


@torch.no_grad()
def profile_steps(model, cache, tokens: torch.Tensor, steps: int, path: Path) -> None:
    """`steps` more greedy tokens after `tokens` (whose last one the cache does not hold yet) under
    torch.profiler; writes the operators' table twice, by self device time and by self host time (top 30)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tokens.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        model.generate(
            tokens, past_key_values=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        if tokens.device.type == "cuda":
            torch.cuda.synchronize()
    table = prof.key_averages()
    by_device = "self_cuda_time_total" if tokens.device.type == "cuda" else "self_cpu_time_total"
    path.write_text(
        f"{steps} decode steps after {tokens.shape[1]} tokens, batch {tokens.shape[0]}\n\n"
        f"by self device time:\n{table.table(sort_by=by_device, row_limit=30)}\n\n"
        f"by self host time:\n{table.table(sort_by='self_cpu_time_total', row_limit=30)}\n"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kernels.gpu.e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for e2e.csv and e2e.png")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per cache (at least 3)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens per sequence)")
    p.add_argument("--caches", nargs="+", default=list(CACHES), help=f"any of {', '.join(CACHES)}")
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after each cache's timed run, STEPS more decode steps under torch.profiler "
                   "(e2e-profile-<cache>.txt: where a step's time goes)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, a tiny model")
    args = p.parse_args(argv)
    if args.new_tokens < 3:
        p.error(f"--new-tokens: {args.new_tokens} is too few; allowed: 3 or more (steps are timed apart)")
    for c in args.caches:
        if c not in CACHES:
            p.error(f"--caches: {c!r} is not allowed; allowed: {', '.join(CACHES)}")
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("error: --dry-run needs TRITON_INTERPRET=1 in the environment (set before Python starts)")
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("error: kernels.gpu.e2e needs a CUDA GPU (or --dry-run); nothing was run")
    from harness.attention import PACKED, installed

    device = "cpu" if args.dry_run else "cuda"
    args.out.mkdir(parents=True, exist_ok=True)

    # bf16 on the GPU; float32 in a dry run, as Triton's interpreter computes tl.dot on bf16 wrongly.
    model = build_model(
        DRY if args.dry_run else LLAMA3_8B, torch.float32 if args.dry_run else torch.bfloat16, device
    )
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    vocab = model.config.vocab_size
    prompt = torch.randint(
        0, vocab, (args.batch, args.context), generator=torch.Generator().manual_seed(1)
    ).to(device)
    path = args.out / "e2e.csv"
    with open(path, "w", newline="") as f:
        csv.DictWriter(f, fieldnames=COLUMNS).writeheader()
    rows = []
    for kind in args.caches:
        row = {"cache": kind, "batch": args.batch, "context": args.context, "new_tokens": args.new_tokens,
               "weights_gib": weights / 2**30, "note": ""}  # fmt: skip
        base = kind.removesuffix("-graph")
        row["mean_bits"] = MEAN_BITS.get(base) or int(base)
        try:
            # decode steps of the triton caches read the packed K/V; the rest is SDPA
            with installed(model, PACKED):
                m = measure(model, kind, prompt, args.new_tokens, args.chunk, args.group_size)
            row.update(
                prefill_s=m["prefill_s"], decode_s=m["decode_s"],
                step_ms_median=statistics.median(m["steps"]) * 1e3, step_ms_max=max(m["steps"]) * 1e3,
                tokens_per_s=args.batch / statistics.median(m["steps"]),
                peak_gib=max(m["peak"] - weights, 0) / 2**30 if m["peak"] else float("nan"), kv_gib=m["kv"] / 2**30,
            )  # fmt: skip
            if args.profile and base == kind:
                with installed(model, PACKED):
                    profile_steps(
                        model, m["cache"], m["out"], args.profile, args.out / f"e2e-profile-{kind}.txt"
                    )
            del m
        except torch.OutOfMemoryError:
            row["note"] = "oom"
        except (
            Exception
        ) as error:  # a graph-replayed or trial cache failing (its capture, say) leaves the rest
            if base == kind and kind not in TRIAL:
                raise
            traceback.print_exc()
            row["note"] = " ".join(f"error: {type(error).__name__}: {error}".split())[:300]
        rows.append(row)
        with open(path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=COLUMNS).writerow(row)
        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    plot(rows, args.out / "e2e.png")
    print(f"wrote {path}, e2e.png")


def plot(rows: list[dict], path: Path) -> None:
    """Decode tokens/s and peak memory above the weights, one bar per cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "tokens_per_s" in r]
    if not done:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["cache"] for r in done]
    a.bar(names, [r["tokens_per_s"] for r in done])
    a.set(ylabel="decode tokens/s", title=f"batch {done[0]['batch']}, context {done[0]['context']}")
    b.bar(names, [r["peak_gib"] for r in done])
    b.set(ylabel="peak GPU memory above weights (GiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
