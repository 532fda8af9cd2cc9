"""What the sensitivity measurements share: a model's allocation shape and cached heads, a teacher-forced cache
at chosen widths, and the rank correlation their checks report."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import pandas as pd
import torch

from harness import evaluate
from harness.cache import QuantizedKVCache, kv_heads
from harness.calibrate.windows import layer_types
from harness.schemes import FittedParts, Scheme


def cache_shape(model) -> tuple[int, int]:
    """(num_layers, most KV heads of a layer) of the model's decoder: the shape of an allocation (layers with
    fewer KV heads pad their rows)."""
    heads = kv_heads(model.config)
    return len(heads), max(heads)


def cached_heads(model) -> list[tuple[int, int]]:
    """(layer, kv_head) of every KV head with a cache of its own (not linear attention, not KV sharing), in order."""
    heads = kv_heads(model.config)
    kinds = layer_types(model.config)
    return [(layer, h) for layer, kind in enumerate(kinds) if kind != "linear" for h in range(heads[layer])]


def quantized_factory(
    model,
    scheme: Scheme,
    key_bits: torch.Tensor,
    value_bits: torch.Tensor,
    key_calibration: FittedParts | None = None,
) -> evaluate.CacheFactory:
    """Fresh QuantizedKVCaches storing keys at key_bits and values at value_bits (int64 [num_layers,
    num_kv_heads]) in `scheme` with quantize-on-write (prefill=quantized), as the teacher-forced metrics do;
    key_calibration: the fitted parts a scheme with key_tables reads (harness.calibrate).
    simulate: the model's own attention reads a dequantized working copy (a quality measurement, the same
    numbers as the packed path within float summation order)."""
    return partial(
        QuantizedKVCache,
        model.config,
        key_bits,
        value_bits=value_bits,
        scheme=scheme.name,
        group_size=scheme.group_size,
        key_group_size=scheme.key_group_size,
        sink_tokens=scheme.sink_tokens,
        residual=scheme.residual,
        outliers=scheme.outliers,
        key_levels=scheme.key_levels,
        key_calibration=key_calibration,
        prefill="quantized",
        simulate=True,
    )


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant."""
    x, y = pd.Series(list(x), dtype="float64"), pd.Series(list(y), dtype="float64")
    return float(x.rank().corr(y.rank()))
