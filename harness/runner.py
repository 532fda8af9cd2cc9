"""Runs grid points: per model one load, one calibration (cached on disk), one baseline and one shared
full-precision prefill; then every point's allocation, quantized cache and metrics; one JSON per point.
A peer point (another engine's cache, harness.peers) is measured by its engine on the same context.

Resumability: a point's JSON is written atomically under <run_dir>/points/<key>.json and a point whose file
exists is skipped, so a run killed at any moment (SIGKILL included) resumes with no point lost or repeated.
results.parquet is rebuilt from points/ (atomically, harness.results) after every point, so it is always readable.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from harness import data, evaluate, metrics, peers, precision, results
from harness.cache import QuantizedKVCache
from harness.cache.eviction import EvictionSpec, attention_for, kept_fraction, with_eviction
from harness.calibrate import cached_head_entropies
from harness.capacity import ModelShape, element_price, shape_from_config
from harness.config import CALIBRATION_FIELDS, EVAL_FIELDS, HARNESS, NO_EVICTION, Point
from harness.io import write_json_atomic, write_parquet_atomic
from harness.models import load_model
from harness.policies import from_point
from harness.schemes import get_scheme
from harness.sensitivity import cached_sensitivity


@dataclass
class ModelContext:
    """What every point of one model shares: the model, its data, calibration, baseline and prefill."""

    name: str
    model: object
    tokenizer: object
    entropy: pd.DataFrame
    prompts: torch.Tensor  # (N, P)
    sequences: torch.Tensor  # (S, T)
    base_tokens: torch.Tensor  # (N, M)
    base_tf: evaluate.TeacherForced
    prefilled: list  # evaluate.Prefilled per prompt batch
    batch_size: int
    backend: str  # quant.backend: an execution choice, not part of a point's key (like the device)
    simulate: bool  # quant.simulate: likewise (the same metrics either way), recorded in every row
    timings: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)  # measurement_key -> (first point key, measurement)
    calib_ids: torch.Tensor | None = None  # (C, Tc) calibration tokens, for the measured policies
    sensitivity: dict = field(default_factory=dict)  # (scheme, widths) -> harness.sensitivity table, lazily
    shape: ModelShape | None = None  # the cache's layers and heads (harness.capacity), for the byte model
    bos: bool = False  # whether every window starts with the tokenizer's BOS token (eval.bos resolved)
    peer_state: dict = field(default_factory=dict)  # what harness.peers engines share across points, lazily


def context_key(point: Point) -> tuple:
    """Points that share a ModelContext (same model, data, sizes, seed, calibration, prefill mode)."""
    fields = ("model", "dtype", "data_path", "seed", *EVAL_FIELDS, *CALIBRATION_FIELDS)
    return tuple(getattr(point, f) for f in fields)


def build_context(
    point: Point, batch_size: int, device: str, run_dir: Path, backend: str = "auto", simulate: bool = False
) -> ModelContext:
    timings = {}
    t = time.perf_counter()
    model, tokenizer = load_model(point.model, device=device, dtype=point.dtype)
    timings["load_s"] = time.perf_counter() - t

    # the point was checked (harness.validate): its windows fit the model
    windows = data.point_windows(tokenizer, point)
    bos, calib_ids, prompts, sequences = windows.bos, windows.calibration, windows.prompts, windows.sequences

    t = time.perf_counter()
    entropy = cached_head_entropies(model, point.model, calib_ids, i0=point.i0)
    timings["calibrate_s"] = time.perf_counter() - t

    t = time.perf_counter()
    prefilled = evaluate.prefill(model, prompts, batch_size=batch_size)
    base_tokens = evaluate.decode(model, prefilled, point.new_tokens, cache_from_prefilled=None)
    base_tf = evaluate.teacher_forced(
        model, sequences, evaluate.dynamic_cache_factory(model), chunk=point.chunk, batch_size=batch_size
    )
    timings["baseline_s"] = time.perf_counter() - t
    entropy_path = Path(run_dir) / f"entropy-{point.model}.parquet"
    if not entropy_path.exists():  # shards may race here: write atomically
        write_parquet_atomic(entropy_path, entropy)
    return ModelContext(
        point.model,
        model,
        tokenizer,
        entropy,
        prompts,
        sequences,
        base_tokens,
        base_tf,
        prefilled,
        batch_size,
        backend,
        simulate,
        timings,
        calib_ids=calib_ids,
        shape=shape_from_config(model.config, point.model),
        bos=bos,
    )


def allocation(ctx: ModelContext, point: Point):
    """The point's widths per (layer, KV head); ValueError when its budget cannot pay for its sinks.

    The measured policies' table is measured once per model, scheme (with its options) and widths.
    """
    policy = from_point(point.group("policy"))
    scheme = get_scheme(point.scheme, point.group_size, point.sink_tokens, point.residual)
    table = None
    if policy.needs_sensitivity:
        key = (scheme, tuple(point.widths))
        if key not in ctx.sensitivity:
            ctx.sensitivity[key] = cached_sensitivity(ctx.model, ctx.name, ctx.calib_ids, *key)
        table = ctx.sensitivity[key]
    price = element_price(ctx.shape, scheme)
    return policy.allocate(ctx.entropy, point.budget, price=price, sensitivity=table)


def measurement_key(point: Point, alloc) -> tuple:
    """Everything a measurement depends on beyond the shared context: equal keys give equal metrics."""
    return (
        alloc.bits.numpy().tobytes(),
        point.scheme,
        point.group_size,
        point.sink_tokens,
        point.residual,  # None: the scheme's default (grid points carry it resolved)
        point.prefill,
        EvictionSpec.from_point(point),
    )


def cache_options(point: Point, backend: str, simulate: bool = False) -> dict:
    """QuantizedKVCache keyword arguments (besides bits and prefill) for a point."""
    return dict(
        scheme=point.scheme,
        group_size=point.group_size,
        sink_tokens=point.sink_tokens,
        residual=point.residual,
        backend=backend,
        simulate=simulate,
    )


def measure(ctx: ModelContext, point: Point, alloc) -> dict:
    """Run generation and teacher-forced evaluation through the quantized (and evicting) cache; measure."""
    spec = EvictionSpec.from_point(point)
    # quantized caches are attended from their packed form (h2o: with the scores), restored after
    with attention_for(ctx.model, spec):
        return _measure(ctx, point, alloc, spec)


def _measure(ctx: ModelContext, point: Point, alloc, spec: EvictionSpec) -> dict:
    config = ctx.model.config
    cache_kwargs = cache_options(point, ctx.backend, ctx.simulate)
    caches = []

    def from_prefilled(prefilled_cache):
        cache = QuantizedKVCache.from_prefilled(
            prefilled_cache, config, alloc.bits, prefill="exact", **cache_kwargs
        )
        caches.append(with_eviction(cache, spec))
        return caches[-1]

    # h2o scores the prompt's own attention, so it prefills through its cache instead of sharing the prefill.
    if point.prefill == "exact" and not spec.needs_scores:
        tokens = evaluate.decode(
            ctx.model, ctx.prefilled, point.new_tokens, cache_from_prefilled=from_prefilled
        )
    else:

        def factory():
            cache = QuantizedKVCache(config, alloc.bits, prefill=point.prefill, **cache_kwargs)
            caches.append(with_eviction(cache, spec))
            return caches[-1]

        tokens = evaluate.greedy_generate(
            ctx.model, ctx.prompts, point.new_tokens, factory, batch_size=ctx.batch_size
        )
    # Bytes held after eviction (evicting layers apply their pending eviction first), against fp16 bytes of
    # every token seen; and what the caches really kept in memory (measured).
    held = sum(c.nbytes() for c in caches)
    fp16 = sum(c.nbytes_fp16() for c in caches)
    resident = sum(c.resident_bytes() for c in caches)

    tf = evaluate.teacher_forced(
        ctx.model,
        ctx.sequences,
        lambda: with_eviction(
            QuantizedKVCache(config, alloc.bits, prefill="quantized", **cache_kwargs), spec
        ),
        chunk=point.chunk,
        batch_size=ctx.batch_size,
        baseline=ctx.base_tf,
    )
    gen = metrics.generation_metrics(ctx.base_tokens, tokens, ctx.tokenizer.decode)
    tfm = metrics.teacher_forced_metrics(ctx.base_tf, tf)
    result_metrics = {
        **gen,
        **tfm,
        "mean_bits": alloc.mean_bits,
        "compression_nominal": 16.0 / alloc.mean_bits,
        "compression_true": fp16 / held,
        "bytes_per_token": held / (ctx.prompts.shape[0] * (ctx.prompts.shape[1] + point.new_tokens)),
        "resident_bytes": resident,
        "resident_ratio": resident / held,
        "simulate": ctx.simulate,
        "n_sinks": int(alloc.sinks.sum()),
        "tokens_kept_fraction": kept_fraction(caches),
    }
    items = {k: np.asarray(v).tolist() for k, v in metrics.generation_items(ctx.base_tokens, tokens).items()}
    items.update(
        {k: np.asarray(v).tolist() for k, v in metrics.teacher_forced_items(ctx.base_tf, tf).items()}
    )
    decode = ctx.tokenizer.decode
    items["bleu_stats"] = metrics.bleu_sufficient_stats(
        [decode(row) for row in tokens.tolist()], [decode(row) for row in ctx.base_tokens.tolist()]
    ).tolist()  # (N, 10) per-prompt sacrebleu statistics: corpus BLEU of any resample of prompts
    return {
        "metrics": result_metrics,
        "items": items,
        "tokens": tokens.tolist(),
        "allocation": {"bits": alloc.bits.tolist(), "histogram": alloc.histogram()},
    }


def resolved(ctx: ModelContext) -> dict:
    """What a point's configuration resolved to when it ran (rules that depend on the model or the machine, such
    as whether the CPU computes bf16 natively): its row records it."""
    return {"bos_used": ctx.bos, **precision.describe(ctx.model.device.type)}


def baseline_record(ctx: ModelContext) -> dict:
    """The unquantized-cache reference row of a model: its perplexity, every comparison at identity."""
    ppl = float(torch.exp(ctx.base_tf.nll.double().mean()))
    gen = metrics.generation_metrics(ctx.base_tokens, ctx.base_tokens, ctx.tokenizer.decode)
    return {
        **gen,
        "ppl": ppl,
        "ppl_base": ppl,
        "ppl_ratio": 1.0,
        "kl_mean": 0.0,
        "kl_p99": 0.0,
        "top1_agree": 1.0,
        "mean_bits": 16.0,
        "compression_nominal": 1.0,
        "compression_true": 1.0,
        "tokens_kept_fraction": 1.0,
        "simulate": False,  # a DynamicCache: no working copy beside a stored form
    }


def _measure_harness_point(ctx: ModelContext, point: Point, key: str) -> dict:
    """A harness point's record body: its allocation, then its measurement (or infeasible, with the reason)."""
    try:
        alloc = allocation(ctx, point)
    except ValueError as err:  # an allocation the budget cannot pay for: recorded, not fatal
        return {"status": "infeasible", "error": str(err)}
    # Points whose allocations coincide (e.g. every policy at the largest width) share one measurement.
    mkey = measurement_key(point, alloc)
    if mkey not in ctx.measured:
        ctx.measured[mkey] = (key, measure(ctx, point, alloc))
    first_key, result = ctx.measured[mkey]
    return {
        "status": "ok",
        **result,
        **({"same_measurement_as": first_key} if first_key != key else {}),
    }


def run(
    points: list[Point],
    run_dir: Path,
    batch_size: int = 8,
    device: str = "cpu",
    on_point=None,
    tag: str = "",
    backend: str = "auto",
    provenance: dict | None = None,
    simulate: bool = False,
) -> pd.DataFrame:
    """Evaluate every point not already in run_dir/points; returns the consolidated table.

    `tag` names this process's timings file (timings<tag>.json), so shards sharing a run_dir never race on it.
    `provenance` (harness.io.provenance: thread count, commit) goes into every point record beside its config,
    not into the config: it does not change a point's key, so a run resumed at another thread count adds no
    point, and its rows say which ran where.
    """
    provenance = provenance or {}
    run_dir = Path(run_dir)
    (run_dir / "points").mkdir(parents=True, exist_ok=True)
    todo = [p for p in points if not (run_dir / "points" / f"{p.key()}.json").exists()]
    # Points of one context run back to back (grid order kept within it), so each model loads once.
    first_seen = {}
    for p in todo:
        first_seen.setdefault(context_key(p), len(first_seen))
    todo.sort(key=lambda p: first_seen[context_key(p)])
    timings_path = run_dir / f"timings{tag}.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {"models": {}, "points": {}}
    contexts: dict[tuple, ModelContext] = {}
    bar = tqdm(
        total=len(points), initial=len(points) - len(todo), desc="points", unit="pt", dynamic_ncols=True
    )
    for point in todo:
        key = point.key()
        ckey = context_key(point)
        if ckey not in contexts:
            contexts.clear()  # one model in memory at a time
            # the load shows on this bar, the sweep's one progress display (harness.models loads quietly)
            bar.set_postfix_str(f"{point.model}: loading, calibrating, baseline")
            contexts[ckey] = ctx = build_context(point, batch_size, device, run_dir, backend, simulate)
            timings["models"][point.model] = ctx.timings
            base_point = point.without_peer_fields().replace(
                policy="baseline",
                budget=16,
                alpha=0.0,
                sink_threshold=None,
                sink_fraction=None,
                scheme="none",
                **NO_EVICTION,
            )
            base_path = run_dir / "points" / f"{base_point.key()}.json"
            if not base_path.exists():
                write_json_atomic(
                    base_path,
                    {
                        "key": base_point.key(),
                        "status": "ok",
                        "config": base_point.to_dict(),
                        "resolved": resolved(ctx),
                        **provenance,
                        "metrics": baseline_record(ctx),
                        "tokens": ctx.base_tokens.tolist(),
                    },
                )
        ctx = contexts[ckey]
        bar.set_postfix_str(f"{point.model} {point.policy} b={point.budget} {point.scheme}")
        t = time.perf_counter()
        if point.engine != HARNESS:
            result = peers.measure(ctx, point)
        else:
            result = _measure_harness_point(ctx, point, key)
        timings["points"][key] = time.perf_counter() - t
        record = {"key": key, "config": point.to_dict(), "resolved": resolved(ctx), **provenance, **result}
        write_json_atomic(run_dir / "points" / f"{key}.json", record)
        write_json_atomic(timings_path, timings)
        results.write_parquet(run_dir)
        if on_point is not None:
            on_point(point, result)
        bar.update(1)
    bar.close()
    results.write_parquet(run_dir)
    return results.load(run_dir)
