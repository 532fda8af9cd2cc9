"""Measured sensitivity: how much quantizing each unit at each width hurts, on calibration data.

This package owns the measured tables the policies allocate from, their on-disk caches, and the checks that they
predict the real loss. `MEASUREMENTS` maps the name a policy declares (`Policy.measurement`) to the function
that gives its table (model, model name, calibration ids, scheme, widths, chunk):
- `proxy` (this module): per (layer, KV head, width) attention-output error, one forward pass for all heads;
  read by `sensitivity` and `layerwise` (harness/policies/measured.py). `proxy_check` ranks it against the KL.
- `unit_kl` (unit_kl.py): per (layer, KV head, K|V, width) teacher-forced KL with that unit alone quantized,
  one teacher-forced run per unit and width; read by `measured` (harness/policies/measured_kl.py).
  `additivity_check` tests whether unit KLs add up on random joint allocations.
common.py holds what both share (allocation shape, cached heads, a cache at chosen widths, Spearman).

The proxy. In one calibration forward, each attention layer l computes its output O (B, T, Hq, D) with the
model's own eager attention (its masks, sliding windows and softcapping), then, for every KV head h and
width w, again with the K and V of head h alone stored and dequantized through the point's scheme:
    error(l, h, w) = sqrt( sum ||O'_q - O_q||^2 / sum ||O_q||^2 )
summed over sequences, positions and the query heads q of h's group (0 when O = 0).
Why this proxy: DESIGN.md 3.6 asks for the teacher-forced KL with only that head quantized, which costs one
evaluation per (head, width) (360 for smollm2's 90 heads at 4 widths); the proxy gets all of them from one
forward pass. It reads the head's real queries, keys and values and measures the error after the softmax,
where attention consumes it (a key error that leaves the attention rows unchanged costs nothing), and being
relative it puts heads with outputs of different scale on one footing. It ignores the output projection's
weight on the head and how later layers amplify or absorb the error: `proxy_check` measures whether the
ranking survives that (Spearman correlation with the real KL); `python -m harness.sensitivity` runs it
(harness/protocols/sensitivity_check.py; `--additivity N` runs the unit-KL additivity check instead).

Each layer is measured on full-precision inputs, so errors do not compound across layers. The whole
sequence is stored at once; every shipped scheme quantizes heads independently, so all heads are stored at w
together, and only h's g query heads are recomputed, against head h's stored K/V alone (the eager function
repeats one KV head g times; no other query head reads head h). For residual-window schemes (kivi) the
window is the sequence's last R tokens, not each query's most recent R as in decoding: a rougher proxy there.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

import pandas as pd
import torch

from harness import evaluate
from harness.attention import SENSITIVITY_PROBE, installed
from harness.calibrate.disk import disk_cached, model_identity, source_identity
from harness.calibrate.windows import layer_types
from harness.policies import Policy, quantized_widths
from harness.schemes import Scheme
from harness.sensitivity.common import cache_shape, quantized_factory, spearman
from harness.sensitivity.unit_kl import (
    additivity_check,
    allocation_kl,
    cached_unit_kl,
    predicted_kl,
    probe_ids,
    random_allocations,
    unit_kl_table,
)
from kernels.layout import FULL_WIDTH
from kernels.reference import WIDTHS as PACKED_WIDTHS

CACHE_VERSION = 2  # 2: no rows for KV-shared layers
Quantizer = Callable[[torch.Tensor, int, str], torch.Tensor]  # (x (B, Hkv, T, D), width, role) -> same shape


def scheme_quantizer(scheme: Scheme) -> Quantizer:
    """Store every head of x at one width in a fresh store of `scheme`; return what the store holds, dequantized."""

    def quantize(x: torch.Tensor, width: int, role: str) -> torch.Tensor:
        B, H, _, D = x.shape  # (B, Hkv, T, D)
        store = scheme.new_store([width] * H, D, B, x.dtype, x.device, role=role)
        store.append(x)
        return store.dequantize()

    return quantize


class _Meter:
    """Squared output errors (per KV head and width) and squared outputs (per KV head), summed per layer.

    Only `layers` (those with a KV cache of their own) are measured; the others just attend.
    """

    def __init__(self, quantize: Quantizer, widths: Sequence[int], layers: set[int]):
        self.quantize, self.widths, self.layers = quantize, list(widths), layers
        self.error: dict[int, torch.Tensor] = {}  # layer -> (Hkv, |W|) float64
        self.norm: dict[int, torch.Tensor] = {}  # layer -> (Hkv,) float64

    def record(self, layer: int, attend: Callable, query, key, value) -> torch.Tensor:
        """One layer's call: query (B, Hq, T, D), key and value (B, Hkv, T, D); returns the exact output.

        attend(q (B, n * g, T, D), k, v (B, n, T, D)) -> (out (B, T, n * g, D), _), the model's eager
        attention.
        """
        out = attend(query, key, value)[0]  # (B, T, Hq, D)
        if layer not in self.layers:  # reads another layer's K/V (KV sharing): nothing of its own to store
            return out
        n_kv = key.shape[1]
        assert out.shape[2] == query.shape[1], f"attention output {tuple(out.shape)} is not (B, T, Hq, D)"
        grouped = out.double().unflatten(2, (n_kv, -1))  # (B, T, Hkv, g, D)
        norm = grouped.square().sum((0, 1, 3, 4))  # (Hkv,)
        error = torch.zeros(n_kv, len(self.widths), dtype=torch.float64)
        queries = query.unflatten(1, (n_kv, -1))  # (B, Hkv, g, T, D)
        for j, width in enumerate(self.widths):
            k_all, v_all = self.quantize(key, width, "key"), self.quantize(value, width, "value")
            for h in range(n_kv):
                # only h's group reads h's K/V: attend its g query heads to head h alone
                heads = slice(h, h + 1)
                changed = attend(queries[:, h], k_all[:, heads], v_all[:, heads])[0]  # (B, T, g, D)
                error[h, j] = (changed.double() - grouped[:, :, h]).square().sum()
        self.error[layer] = self.error.get(layer, 0) + error
        self.norm[layer] = self.norm.get(layer, 0) + norm
        return out

    def table(self, num_layers: int, num_kv_heads: int) -> pd.DataFrame:
        rows = []
        for layer in sorted(self.error):
            ratio = self.error[layer] / self.norm[layer][:, None]  # (Hkv(layer), |W|)
            relative = torch.where(self.error[layer] == 0, 0.0, ratio).sqrt()
            for h in range(len(relative)):
                for j, width in enumerate(self.widths):
                    rows.append(dict(layer=layer, kv_head=h, bits=width, error=float(relative[h, j])))
        table = pd.DataFrame(rows, columns=["layer", "kv_head", "bits", "error"])
        table.attrs.update(num_layers=num_layers, num_kv_heads=num_kv_heads)
        return table


def measured_widths(widths: Sequence[int]) -> list[int]:
    quantized = quantized_widths(widths)
    if not quantized:
        raise ValueError(
            f"policy.widths: needs at least one quantized width ({', '.join(map(str, PACKED_WIDTHS))}); got {list(widths)}"
        )
    return quantized


@torch.no_grad()
def head_sensitivity(
    model, input_ids: torch.Tensor, scheme: Scheme, widths: Sequence[int] = PACKED_WIDTHS, batch_size: int = 1
) -> pd.DataFrame:
    """The proxy error of every cached (layer, KV head) at every quantized width in `widths`, on input_ids.

    input_ids: (S, T), fed batch_size sequences at a time. Returns columns layer, kv_head, bits, error (one
    row per head and width; 16 is never measured: its error is 0); attrs num_layers, num_kv_heads (the most of
    any layer). Layers without a KV cache of their own (linear attention, KV sharing) have no rows; a layer
    has rows for its own KV heads only.
    """
    widths = measured_widths(widths)
    scheme.check_widths(widths)
    cached = {i for i, kind in enumerate(layer_types(model.config)) if kind != "linear"}
    meter = _Meter(scheme_quantizer(scheme), widths, cached)
    with installed(model, SENSITIVITY_PROBE, meter):
        for start in range(0, input_ids.shape[0], batch_size):
            model(input_ids=input_ids[start : start + batch_size].to(model.device), use_cache=False)
    return meter.table(*cache_shape(model))


def cached_sensitivity(
    model,
    model_name: str,
    input_ids: torch.Tensor,
    scheme: Scheme,
    widths: Sequence[int] = PACKED_WIDTHS,
    source: str | None = None,
) -> pd.DataFrame:
    """head_sensitivity, read from disk (calibration's cache dir) when measured before with the same model,
    model config, calibration tokens (cut from the calibration `source`), scheme (name, group size, options) and
    widths."""
    widths = measured_widths(widths)
    options = json.dumps(dataclasses.asdict(scheme), sort_keys=True)
    identity = (
        f"{CACHE_VERSION}|{model_identity(model, model_name)}|{options}|{widths}|{tuple(input_ids.shape)}"
    ) + source_identity(source)
    table = disk_cached(
        f"{model_name}-sensitivity",
        identity,
        input_ids,
        lambda: head_sensitivity(model, input_ids, scheme, widths),
    )
    num_layers, num_kv_heads = cache_shape(model)
    table.attrs.update(num_layers=num_layers, num_kv_heads=num_kv_heads)
    return table


# ------------------------------------------------------------------------------------------- proxy check


def sample_heads(table: pd.DataFrame, count: int, seed: int = 0) -> list[tuple[int, int]]:
    """`count` distinct measured (layer, kv_head) pairs drawn with `seed` (all of them when fewer), sorted."""
    heads = sorted(set(zip(table["layer"].tolist(), table["kv_head"].tolist())))
    order = torch.randperm(len(heads), generator=torch.Generator().manual_seed(seed))[:count]
    return sorted(heads[i] for i in order.tolist())


@torch.no_grad()
def proxy_check(
    model,
    sequences: torch.Tensor,
    table: pd.DataFrame,
    heads: Sequence[tuple[int, int]],
    width: int,
    scheme: Scheme,
    chunk: int = 128,
) -> tuple[pd.DataFrame, float]:
    """Teacher-forced KL on sequences (S, T) with only one head quantized at `width`, for each of `heads`.

    Returns (rows layer, kv_head, bits, proxy, kl_mean; the Spearman correlation of proxy with kl_mean). Every
    other head stays at 16 bits; the cache stores with quantize-on-write (prefill=quantized), as the runner's
    teacher-forced metrics do.
    """
    measured = table[table["bits"] == width].set_index(["layer", "kv_head"])["error"]
    if measured.empty:
        raise ValueError(f"--width: {width} was not measured; measured widths: {sorted(set(table['bits']))}")
    base = evaluate.teacher_forced(model, sequences, evaluate.dynamic_cache_factory(model), chunk=chunk)
    shape = (table.attrs["num_layers"], table.attrs["num_kv_heads"])
    rows = []
    for layer, kv_head in heads:
        bits = torch.full(shape, FULL_WIDTH, dtype=torch.long)
        bits[layer, kv_head] = width
        factory = quantized_factory(model, scheme, bits, bits)
        run = evaluate.teacher_forced(model, sequences, factory, chunk=chunk, baseline=base)
        kl = float(run.kl.double().mean())
        rows.append(
            dict(layer=layer, kv_head=kv_head, bits=width, proxy=measured[layer, kv_head], kl_mean=kl)
        )
    result = pd.DataFrame(rows, columns=["layer", "kv_head", "bits", "proxy", "kl_mean"])
    return result, spearman(result["proxy"], result["kl_mean"])


# ------------------------------------------------------------------------------------------ measurements


def _proxy(
    model,
    model_name: str,
    calib_ids: torch.Tensor,
    scheme: Scheme,
    widths: Sequence[int],
    chunk: int,
    source: str | None = None,
):
    """cached_sensitivity under the measurements' common signature (one forward pass: no chunks)."""
    return cached_sensitivity(model, model_name, calib_ids, scheme, widths, source)


# The tables a policy may declare (Policy.measurement): name -> f(model, model name, calibration ids (C, T),
# scheme, widths, chunk[, key_calibration=][, source=]) -> the table, measured once and cached on disk (source:
# the calibration source the ids were cut from, harness.calibrate.disk.source_identity).
MEASUREMENTS = {"proxy": _proxy, "unit_kl": cached_unit_kl}
# Those that measure through caches, and so take a scheme's fitted parts (key_calibration=: calkey, pca, ...); the
# proxy stores each head through the scheme alone, without them.
READS_KEY_TABLES = frozenset({"unit_kl"})


def check_reads_fitted(policy: Policy, scheme: Scheme) -> None:
    """ValueError naming policy.name where `policy` measures its table without the fitted parts that `scheme`
    reads (its measurement is not in READS_KEY_TABLES)."""
    if scheme.key_tables and policy.measurement not in (None, *READS_KEY_TABLES):
        raise ValueError(
            f"policy.name: {policy.name} measures its table without fitted key tables, which quant.scheme "
            f"{scheme.name} needs; allowed with {scheme.name}: measured, or a policy that measures nothing"
        )


__all__ = [
    "MEASUREMENTS",
    "READS_KEY_TABLES",
    "additivity_check",
    "allocation_kl",
    "cached_sensitivity",
    "cached_unit_kl",
    "check_reads_fitted",
    "head_sensitivity",
    "measured_widths",
    "predicted_kl",
    "probe_ids",
    "proxy_check",
    "random_allocations",
    "sample_heads",
    "scheme_quantizer",
    "spearman",
    "unit_kl_table",
]
