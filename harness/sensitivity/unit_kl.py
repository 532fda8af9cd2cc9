"""The teacher-forced KL of every allocation unit quantized alone (DESIGN.md 3.6), its disk cache, and the check
that unit costs add up.

A unit is one (layer, KV head, role) of a layer with a KV cache of its own, role `key` or `value`. For every
unit and every quantized width w of the point's widths, `unit_kl_table` runs the probe sequences
teacher-forced through a QuantizedKVCache that stores that unit alone at w and every other unit at 16,
quantize-on-write (prefill=quantized) and fed in chunks of `chunk` tokens as the teacher-forced metrics are,
and records `kl`: the mean over scored positions of KL(p_base || p_probe) in nats, p_base from the same
sequences through an unquantized DynamicCache. Position t predicts token t + 1, so position 0's token (BOS
where the windows carry one) is never a target, as in every metric (harness.evaluate.teacher_forced).

The probe sequences (`probe_ids`) are the first `sequences` calibration windows cut to their first `tokens` tokens
(PROBE_SEQUENCES x PROBE_TOKENS unless a point's eval.calibration.probe sets them); calibration and evaluation text
never overlap, so the table never reads evaluation text.

In context (`context` c, eval.calibration.probe.context): every other cached unit is stored at width c instead of
16, and `kl` is the unit's marginal cost there, KL(u at w, the rest at c) - KL(every unit at c), 0 at w = c (not
run). A unit alone beside an unquantized cache does not see the errors of the units below it: a cross-layer
prediction (xlayer's) reads what the stores restored, and its error grows with theirs (results/frontier, "Do unit
KLs add up?"). In context the knapsack weighs each change of width around uniform c, the point a chain fit is made
at; its summed costs predict KL(allocation) - KL(every unit at c), to first order.

Cost: one teacher-forced run of the probe sequences per (unit, width), all of a probe's sequences in one batch:
30 layers x 3 KV heads x 2 roles x 3 widths = 540 runs for smollm2-135m at widths 2, 3, 4. Probes are not
batched with each other: a cache holds one set of widths for all its rows. The baseline keeps float32 log-probs:
a unit's KL can be 1e-5 nats, where fp16 rounding of the log-probs would dominate it.

Additivity: the `measured` policy minimises the summed unit KL, which assumes that unit costs add.
`additivity_check` draws random joint allocations (every unit at a random width, the mean within a budget),
predicts each one's KL as the sum of its units' entries (`predicted_kl`), measures it on the same probe sequences
(`allocation_kl`), and reports the pairs, their Spearman correlation and the ratio measured / predicted.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import pandas as pd
import torch

from harness import evaluate
from harness.calibrate.disk import disk_cached, model_identity, source_identity
from harness.policies import quantized_widths
from harness.schemes import FittedParts, Scheme
from harness.schemes.base import ROLES
from harness.sensitivity.common import cache_shape, cached_heads, quantized_factory, spearman
from kernels.layout import FULL_WIDTH

CACHE_VERSION = 1
COLUMNS = ["layer", "kv_head", "role", "bits", "kl"]
# Probe sizes by default (eval.calibration.probe): 2 x 128 tokens (254 scored positions). Time grows linearly with sequences x tokens. An estimate,
# not a measurement of smollm2-135m: a random model of its shape took 5 to 9 s per probe (2 x 128 to 2 x 192) on
# 2 cores shared with other jobs. On a quiet machine the pareto sweep ran 16 x 1024 teacher-forced tokens (and its
# decoding) in 68 to 103 s per point, at least ~200 tokens/s: about 1.5 s per probe here, 12 to 14 minutes for
# the 540 probes at widths 2, 3, 4 (18 for 720 with 8 too).
PROBE_SEQUENCES = 2
PROBE_TOKENS = 128


def probe_ids(
    calib_ids: torch.Tensor, sequences: int = PROBE_SEQUENCES, tokens: int = PROBE_TOKENS
) -> torch.Tensor:
    """(min(sequences, C), min(tokens, Tc)): the first calibration windows (C, Tc), cut to their first tokens."""
    for name, value, least in (("sequences", sequences, 1), ("tokens", tokens, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"unit KL probe {name}: {value!r}; allowed: an integer >= {least}")
    return calib_ids[:sequences, :tokens]


def baseline_run(model, input_ids: torch.Tensor, chunk: int) -> evaluate.TeacherForced:
    """The unquantized run the probes are compared with, its log-probs in float32."""
    factory = evaluate.dynamic_cache_factory(model)
    return evaluate.teacher_forced(
        model, input_ids, factory, chunk=chunk, batch_size=len(input_ids), logprobs_dtype=torch.float32
    )


def allocation_kl(
    model,
    input_ids: torch.Tensor,
    scheme: Scheme,
    key_bits: torch.Tensor,
    value_bits: torch.Tensor,
    base: evaluate.TeacherForced,
    chunk: int,
    key_calibration: FittedParts | None = None,
) -> float:
    """Mean KL(p_base || p) per scored position (nats) of input_ids (S, T) teacher-forced through a cache storing
    keys at key_bits and values at value_bits (int64 [num_layers, num_kv_heads]); base: the unquantized run;
    key_calibration: the fitted parts of a scheme that reads them (calkey's key tables, pca's transforms, ...)."""
    factory = quantized_factory(model, scheme, key_bits, value_bits, key_calibration)
    run = evaluate.teacher_forced(
        model, input_ids, factory, chunk=chunk, batch_size=len(input_ids), baseline=base
    )
    return float(run.kl.double().mean())


def check_context(
    context: object, widths: Sequence[int], key: str = "eval.calibration.probe.context"
) -> None:
    """ValueError naming `key` unless the context is None, or one of `widths` (the policy's) and 16 is not (a unit
    at 16 is priced 0, which in context it is not)."""
    if context is None:
        return
    quantized = quantized_widths(widths)
    if isinstance(context, bool) or context not in quantized or FULL_WIDTH in widths:
        allowed = ", ".join(map(str, quantized))
        raise ValueError(
            f"{key}: {context!r} with policy.widths {list(widths)}; allowed: null, or one "
            f"of the quantized widths ({allowed}) where the widths leave out {FULL_WIDTH}"
        )


def context_bits(model, context: int | None) -> torch.Tensor:
    """int64 [num_layers, num_kv_heads]: the width of every unit but the measured one, `context` at the cached heads
    (16 elsewhere), 16 everywhere for None."""
    bits = torch.full(cache_shape(model), FULL_WIDTH, dtype=torch.int64)
    if context is not None:
        for layer, kv_head in cached_heads(model):
            bits[layer, kv_head] = context
    return bits


@torch.no_grad()
def unit_kl_table(
    model,
    input_ids: torch.Tensor,
    scheme: Scheme,
    widths: Sequence[int],
    chunk: int = 128,
    key_calibration: FittedParts | None = None,
    context: int | None = None,
) -> pd.DataFrame:
    """The KL of every cached unit alone at every quantized width in `widths`, on input_ids (S, T) (through caches
    reading key_calibration's tables, for a scheme with key_tables); with a `context` width (one of `widths`), its
    marginal KL with every other unit at that width (module docstring).

    Returns columns layer, kv_head, role, bits, kl (one row per unit and width, (layer, kv_head, role, bits)
    order; 16 is never measured: its KL is 0, so a context refuses it, where a unit at 16 would gain); attrs
    num_layers, num_kv_heads (the most of any layer).
    """
    quantized = quantized_widths(widths)
    scheme.check_widths(quantized)
    check_context(context, widths)
    shape = cache_shape(model)
    base = baseline_run(model, input_ids, chunk)
    around = context_bits(model, context)  # [num_layers, num_kv_heads]
    context_kl = 0.0
    if context is not None:
        context_kl = allocation_kl(model, input_ids, scheme, around, around, base, chunk, key_calibration)
    rows = []
    for layer, kv_head in cached_heads(model):
        for role in ROLES:
            for width in quantized:
                kl = 0.0
                if width != context:
                    bits = {r: around.clone() for r in ROLES}
                    bits[role][layer, kv_head] = width
                    kl = allocation_kl(
                        model, input_ids, scheme, bits["key"], bits["value"], base, chunk, key_calibration
                    )
                    kl -= context_kl
                rows.append(dict(layer=layer, kv_head=kv_head, role=role, bits=width, kl=kl))
    table = pd.DataFrame(rows, columns=COLUMNS)
    table.attrs.update(num_layers=shape[0], num_kv_heads=shape[1])
    return table


def cached_unit_kl(
    model,
    model_name: str,
    calib_ids: torch.Tensor,
    scheme: Scheme,
    widths: Sequence[int],
    chunk: int = 128,
    sequences: int = PROBE_SEQUENCES,
    tokens: int = PROBE_TOKENS,
    key_calibration: FittedParts | None = None,
    source: str | None = None,
    context: int | None = None,
) -> pd.DataFrame:
    """unit_kl on probe_ids(calib_ids, sequences, tokens), read from disk (calibration's cache dir) when measured
    before with the same model, model config, probe tokens (cut from the calibration `source`), scheme (name,
    group size, options), widths, chunk, fitted key tables (key_calibration, for a scheme that reads them) and
    context width (None: every other unit at 16)."""
    quantized = quantized_widths(widths)
    check_context(context, widths)
    ids = probe_ids(calib_ids, sequences, tokens)
    options = json.dumps(dataclasses.asdict(scheme), sort_keys=True)
    identity = f"{CACHE_VERSION}|{model_identity(model, model_name)}|{options}|{quantized}|{tuple(ids.shape)}|{chunk}"
    if key_calibration is not None:  # tables without one keep their keys
        identity += f"|{key_calibration.digest()}"
    identity += source_identity(source)
    if context is not None:  # tables without one keep their keys
        identity += f"|context={context}"
    table = disk_cached(
        f"{model_name}-unit-kl",
        identity,
        ids,
        lambda: unit_kl_table(model, ids, scheme, quantized, chunk, key_calibration, context),
    )
    num_layers, num_kv_heads = cache_shape(model)
    table.attrs.update(num_layers=num_layers, num_kv_heads=num_kv_heads)
    return table


# -------------------------------------------------------------------------------------------- additivity


def unit_widths(table: pd.DataFrame, key_bits: torch.Tensor, value_bits: torch.Tensor) -> pd.Series:
    """Each of the table's units' width in key_bits / value_bits (int64 [num_layers, num_kv_heads]), indexed by
    (layer, kv_head, role)."""
    units = table[["layer", "kv_head", "role"]].drop_duplicates()
    widths = [
        int((key_bits if role == "key" else value_bits)[layer, kv_head])
        for layer, kv_head, role in units.itertuples(index=False)
    ]
    return pd.Series(widths, index=pd.MultiIndex.from_frame(units), dtype="int64")


def predicted_kl(table: pd.DataFrame, key_bits: torch.Tensor, value_bits: torch.Tensor) -> float:
    """The sum of the table's KL over its units at their widths in key_bits / value_bits (16 adds 0); KeyError
    for a unit at a width the table lacks."""
    kl = table.set_index(["layer", "kv_head", "role", "bits"])["kl"]
    widths = unit_widths(table, key_bits, value_bits)
    return sum(float(kl[(*unit, width)]) for unit, width in widths.items() if width != FULL_WIDTH)


def random_allocations(
    table: pd.DataFrame, count: int, budget: float | None = None, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (key_bits, value_bits) pairs (int64 [num_layers, num_kv_heads], 16 off the table's units), every
    unit at a random width of the table's.

    Each draw first picks how often each width occurs (flat Dirichlet), so draws range from mostly narrow to
    mostly wide; with a budget (mean bits over the units), random units above the narrowest width are then
    narrowed one width at a time until the mean is within it.
    """
    widths = sorted(set(table["bits"].tolist()))
    if budget is not None and budget < widths[0]:
        raise ValueError(f"--budget: {budget} is below the narrowest measured width {widths[0]}")
    units = (
        table[["layer", "kv_head", "role"]].drop_duplicates().to_numpy().tolist()
    )  # [u] (layer, head, role)
    shape = (table.attrs["num_layers"], table.attrs["num_kv_heads"])
    generator = torch.Generator().manual_seed(seed)
    draws = []
    for _ in range(count):
        shares = -torch.log(torch.rand(len(widths), generator=generator))  # normalized Exp(1): flat Dirichlet
        index = torch.multinomial(shares / shares.sum(), len(units), replacement=True, generator=generator)
        while budget is not None and sum(widths[i] for i in index.tolist()) > budget * len(units):
            wide = (index > 0).nonzero()[:, 0]
            pick = wide[torch.randint(len(wide), (1,), generator=generator)]
            index[pick] -= 1
        bits = {role: torch.full(shape, FULL_WIDTH, dtype=torch.int64) for role in ROLES}
        for (layer, kv_head, role), i in zip(units, index.tolist()):
            bits[role][layer, kv_head] = widths[i]
        draws.append((bits["key"], bits["value"]))
    return draws


@torch.no_grad()
def additivity_check(
    model,
    input_ids: torch.Tensor,
    table: pd.DataFrame,
    scheme: Scheme,
    count: int = 10,
    budget: float | None = None,
    seed: int = 0,
    chunk: int = 128,
    key_calibration: FittedParts | None = None,
) -> tuple[pd.DataFrame, float, float]:
    """Predicted (summed unit KL) against measured KL of `count` random joint allocations (random_allocations),
    on input_ids (S, T): the probe sequences the table was measured on (with the key tables it was measured
    with, key_calibration, for a scheme that reads them).

    Returns (rows draw, mean_bits, predicted, measured; the Spearman correlation of predicted with measured; the
    ratio of summed measured to summed predicted KL).
    """
    base = baseline_run(model, input_ids, chunk)
    rows = []
    for draw, (key_bits, value_bits) in enumerate(random_allocations(table, count, budget, seed)):
        rows.append(
            dict(
                draw=draw,
                mean_bits=float(unit_widths(table, key_bits, value_bits).mean()),
                predicted=predicted_kl(table, key_bits, value_bits),
                measured=allocation_kl(
                    model, input_ids, scheme, key_bits, value_bits, base, chunk, key_calibration
                ),
            )
        )
    result = pd.DataFrame(rows, columns=["draw", "mean_bits", "predicted", "measured"])
    ratio = float(result["measured"].sum() / result["predicted"].sum())
    return result, spearman(result["predicted"], result["measured"]), ratio
