"""One grid point measured on its model's context (harness.run.context): the point's allocation (its policy on the
context's entropies, priced by its scheme's byte model), generation and teacher-forced evaluation through its
quantized (and evicting) cache, and the metrics of its row; the baseline row of a context.
"""

from __future__ import annotations

import numpy as np
import torch

from harness import evaluate, metrics, precision
from harness.cache import QuantizedKVCache, cannot_convert
from harness.cache.eviction import EvictionSpec, attention_for, kept_fraction, with_eviction
from harness.calibrate import cached_fit
from harness.capacity import element_price
from harness.config import HARNESS, Point
from harness.data import source_name
from harness.policies import from_point as policy_of
from harness.run.context import KeyFit, MeasurementKey, ModelContext, TableKey
from harness.schemes import FittedParts, Scheme
from harness.schemes import from_point as scheme_of
from harness.sensitivity import MEASUREMENTS, READS_PROBE
from kernels.layout import FULL_WIDTH


def allocation(ctx: ModelContext, point: Point):
    """The point's widths per (layer, KV head); ValueError when its budget cannot pay for its sinks.

    A measured policy's table (its `measurement`, harness.sensitivity.MEASUREMENTS) is measured once per model,
    scheme (with its options), widths, chunk and probe.
    """
    policy = policy_of(point.group("policy"))
    key = table_key(point)
    table = None
    if key is not None:
        if key not in ctx.sensitivity:
            measure_table = MEASUREMENTS[key.measurement]
            tables = key_calibration(ctx, point)  # a calkey point's table measures through its key tables
            extra = {"source": ctx.calibration_source}
            if tables is not None:
                extra["key_calibration"] = tables
            if key.measurement in READS_PROBE:
                extra["sequences"], extra["tokens"], extra["context"] = key.probe
            ctx.sensitivity[key] = measure_table(
                ctx.model, ctx.name, ctx.calib_ids, key.scheme, key.widths, key.chunk, **extra
            )
        table = ctx.sensitivity[key]
    price = element_price(ctx.shape, point_scheme(point))
    return policy.allocate(ctx.entropy, point.budget, price=price, sensitivity=table)


def table_key(point: Point) -> TableKey | None:
    """What the table of the point's measured policy depends on within its model context; None when its policy
    reads no table, or when another engine measures it."""
    if point.engine != HARNESS:
        return None
    measurement = policy_of(point.group("policy")).measurement
    if measurement is None:
        return None
    probe = (point.probe_sequences, point.probe_tokens, point.probe_context)
    return TableKey(measurement, point_scheme(point), tuple(point.widths), point.chunk, probe)


def point_scheme(point: Point) -> Scheme:
    """The point's storage scheme with its options (its quant fields)."""
    return scheme_of(point.group("quant"))


def key_calibration(ctx: ModelContext, point: Point) -> FittedParts | None:
    """The parts fitted on calibration text that a point's scheme reads (harness.calibrate: calkey's key tables for
    positions below the point's longest window, its levels fitted as quant.key_levels says; pca's transforms):
    fitted on the context's calibration windows once per kind, span and level fit (cached on disk); None for
    other schemes."""
    scheme = point_scheme(point)
    if not scheme.key_tables:
        return None
    if ctx.calib_ids is None:
        raise ValueError(
            f"quant.scheme: {point.scheme} fits its key tables on the calibration windows; this context has none"
        )
    fit = KeyFit(scheme.fit, scheme.fit_variant, key_span(point), point.key_levels)
    if fit not in ctx.key_calibration:
        ctx.key_calibration[fit] = cached_fit(
            scheme, ctx.model, ctx.name, ctx.calib_ids, fit.span, fit.levels, ctx.calibration_source
        )
    return ctx.key_calibration[fit]


def key_span(point: Point) -> int:
    """The positions [0, span) a point's fitted key tables cover: its longest window."""
    return max(point.sequence_tokens, point.prompt_tokens + point.new_tokens)


def measurement_key(point: Point, alloc) -> MeasurementKey:
    """Everything a measurement depends on beyond the shared context: equal keys give equal metrics."""
    return MeasurementKey(
        alloc.key_bits.numpy().tobytes(),
        alloc.value_bits.numpy().tobytes(),
        point_scheme(point),
        point.prefill,
        EvictionSpec.from_point(point),
    )


def measure(ctx: ModelContext, point: Point, alloc) -> dict:
    """Run generation and teacher-forced evaluation through the quantized (and evicting) cache; measure."""
    spec = EvictionSpec.from_point(point)
    # quantized caches are attended from their packed form (h2o: with the scores), restored after
    with attention_for(ctx.model, spec):
        return _measure(ctx, point, alloc, spec)


def cache_options(ctx: ModelContext, point: Point) -> dict:
    """What every cache of a point is built with besides its allocation, scheme and prefill mode (keywords of
    QuantizedKVCache): the context's backend and simulate flag, and the parts the point's scheme fitted."""
    return dict(backend=ctx.backend, simulate=ctx.simulate, key_calibration=key_calibration(ctx, point))


def generate(ctx: ModelContext, point: Point, alloc, spec: EvictionSpec) -> tuple[torch.Tensor, list]:
    """Greedy tokens (N, new_tokens) of the context's prompts through the point's caches, and those caches (one per
    prompt batch), inside the attention `spec` installs (harness.cache.eviction.attention_for).

    prefill=exact caches are made from the context's shared full-precision prefill, except where they cannot be:
    h2o scores the prompt's own attention, and a scheme that predicts each layer from the layer below (xlayer)
    cannot be made from sliding-window layers that already dropped prompt tokens (harness.cache.cannot_convert);
    those prefill through their own cache, in one call, as prefill=exact does."""
    config = ctx.model.config
    cache_kwargs = cache_options(ctx, point)
    scheme = point_scheme(point)
    caches = []

    def from_prefilled(prefilled_cache):
        cache = QuantizedKVCache.from_prefilled(
            prefilled_cache, config, alloc, scheme, prefill="exact", **cache_kwargs
        )
        caches.append(with_eviction(cache, spec))
        return caches[-1]

    shared = point.prefill == "exact" and not spec.needs_scores
    if shared and all(cannot_convert(p.cache, scheme) is None for p in ctx.prefilled):
        tokens = evaluate.decode(
            ctx.model, ctx.prefilled, point.new_tokens, cache_from_prefilled=from_prefilled
        )
    else:

        def factory():
            cache = QuantizedKVCache(config, alloc, scheme, prefill=point.prefill, **cache_kwargs)
            caches.append(with_eviction(cache, spec))
            return caches[-1]

        tokens = evaluate.greedy_generate(
            ctx.model, ctx.prompts, point.new_tokens, factory, batch_size=ctx.batch_size
        )
    return tokens, caches


def _measure(ctx: ModelContext, point: Point, alloc, spec: EvictionSpec) -> dict:
    config = ctx.model.config
    cache_kwargs = cache_options(ctx, point)
    scheme = point_scheme(point)
    tokens, caches = generate(ctx, point, alloc, spec)
    # Bytes held after eviction (evicting layers apply their pending eviction first), against fp16 bytes of
    # every token seen; and what the caches really kept in memory (measured).
    held = sum(c.nbytes() for c in caches)
    fp16 = sum(c.nbytes_fp16() for c in caches)
    resident = sum(c.resident_bytes() for c in caches)

    tf = evaluate.teacher_forced(
        ctx.model,
        ctx.sequences,
        lambda: with_eviction(
            QuantizedKVCache(config, alloc, scheme, prefill="quantized", **cache_kwargs), spec
        ),
        chunk=point.chunk,
        batch_size=ctx.batch_size,
        baseline=ctx.base_tf,
        score_from=point.score_from,
    )
    gen = metrics.generation_metrics(ctx.base_tokens, tokens, ctx.tokenizer.decode)
    tfm = metrics.teacher_forced_metrics(ctx.base_tf, tf)
    result_metrics = {
        **gen,
        **tfm,
        "mean_bits": alloc.mean_bits,
        "compression_nominal": FULL_WIDTH / alloc.mean_bits,
        "compression_true": fp16 / held,
        "bytes_per_token": held / (ctx.prompts.shape[0] * (ctx.prompts.shape[1] + point.new_tokens)),
        "resident_bytes": resident,
        "resident_ratio": resident / held,
        "simulate": ctx.simulate,
        # the measurement mode: each layer reconstructed from the layer below's reconstruction (xlayer)
        "reads_previous_layer": point_scheme(point).reads_previous_layer,
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
        "allocation": allocation_record(alloc),
    }


def allocation_record(alloc) -> dict:
    """A row's `allocation`: the keys' and values' widths ([L, Hkv] lists), `bits` too when they are one width
    per head (as rows before K/V-asymmetric allocations had it), and the histogram (Allocation.histogram)."""
    record = {"key_bits": alloc.key_bits.tolist(), "value_bits": alloc.value_bits.tolist()}
    if alloc.is_per_head:
        record["bits"] = alloc.bits.tolist()
    return {**record, "histogram": alloc.histogram()}


def resolved(ctx: ModelContext) -> dict:
    """What a point's configuration resolved to when it ran (rules that depend on the model or the machine, such
    as whether the CPU computes bf16 natively), and the text its windows came from (harness.data.source_name):
    its row records it."""
    return {
        "bos_used": ctx.bos,
        "data_source": source_name(ctx.data_source),
        "calibration_source": source_name(ctx.calibration_source),
        **precision.describe(ctx.model.device.type),
    }


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
        "mean_bits": float(FULL_WIDTH),
        "compression_nominal": 1.0,
        "compression_true": 1.0,
        "tokens_kept_fraction": 1.0,
        "simulate": False,  # a DynamicCache: no working copy beside a stored form
        "reads_previous_layer": False,
    }


def measure_point(ctx: ModelContext, point: Point, key: str) -> dict:
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
