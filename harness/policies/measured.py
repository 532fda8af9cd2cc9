"""`sensitivity` and `layerwise`: widths from measured errors (DESIGN.md 3.6), by a greedy within the budget.

harness/sensitivity/proxy.py measures each head's attention-output error at each quantized width
(`head_errors` reads that table). Every non-sink head starts at the smallest width; then the promotion with the
largest error reduction per extra bit that the budget still allows, until none fits
(harness.policies.budget.greedy).
`layerwise` does the same with one width per layer, on the layer's summed error. 16 is a candidate width only
when `widths` lists it; the entropy table still decides which heads are cached and which are sinks (no sink
rule by default). alpha is unused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import pandas as pd
import torch

from harness.policies.base import Heads, SinkPolicy, register
from harness.policies.budget import measured_widths
from kernels.layout import FULL_WIDTH


def head_errors(sensitivity: pd.DataFrame, shape: tuple[int, int], widths: Sequence[int]) -> torch.Tensor:
    """float64 [num_layers, num_kv_heads, |widths|]: each head's measured error at each width, 0 at 16.

    `sensitivity` has columns layer, kv_head, bits, error (harness.sensitivity); heads without rows are NaN.
    """
    missing = {"layer", "kv_head", "bits", "error"} - set(sensitivity.columns)
    if missing:
        raise ValueError(f"sensitivity table: missing columns {sorted(missing)}")
    out = torch.full((*shape, len(widths)), math.nan, dtype=torch.float64)
    for j, width in enumerate(widths):
        if width == FULL_WIDTH:
            out[..., j] = 0.0
            continue
        rows = sensitivity[sensitivity["bits"] == width]
        if rows.empty:
            measured = sorted(set(sensitivity["bits"].tolist()))
            raise ValueError(
                f"sensitivity table: no measurements at width {width}; measured widths: {measured}"
            )
        layer = torch.tensor(rows["layer"].to_numpy(dtype="int64"))  # [rows]
        kv_head = torch.tensor(rows["kv_head"].to_numpy(dtype="int64"))  # [rows]
        error = torch.tensor(rows["error"].to_numpy(dtype="float64"))  # [rows]
        inside = (layer >= 0) & (layer < shape[0]) & (kv_head >= 0) & (kv_head < shape[1])
        if not inside.all() or not (torch.isfinite(error) & (error >= 0)).all():
            raise ValueError(f"sensitivity table: rows outside {shape} heads or errors not finite and >= 0")
        out[layer, kv_head, j] = error
    return out


@dataclass(frozen=True)
class Measured(SinkPolicy):
    """The greedy on measured errors, each head its own unit or (per_layer) one unit per layer."""

    measurement: ClassVar[str | None] = "proxy"
    assigns_full_width: ClassVar[bool] = True
    per_layer: ClassVar[bool] = False

    def free_widths(self, heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
        candidates = heads.quantized + ([FULL_WIDTH] if FULL_WIDTH in self.widths else [])
        grid = head_errors(heads.sensitivity, tuple(heads.cached.shape), candidates)  # [L, Hkv, |W|]
        errors = grid[heads.cached]  # [n, |W|]
        if torch.isnan(errors).any():
            raise ValueError("sensitivity table: lacks measurements for some cached heads")
        layer = heads.cached.nonzero()[:, 0]  # [n]
        sinks, credit = heads.sinks, heads.credit
        # Costs in bits per element with the scales: a promotion to 16 also drops the head's scales.
        costs = [w + credit if w != FULL_WIDTH else float(w) for w in candidates]
        target = heads.target + credit * int((~sinks).sum())
        bits = measured_widths(errors[~sinks], layer[~sinks], self.per_layer, candidates, costs, target)
        return bits, torch.full((len(bits),), math.nan, dtype=torch.float64)  # no pre-rounding value


@register("sensitivity")
@dataclass(frozen=True)
class Sensitivity(Measured):
    """Each head its own width."""


@register("layerwise")
@dataclass(frozen=True)
class Layerwise(Measured):
    """One width per layer (all its KV heads), on the layer's summed error."""

    per_layer: ClassVar[bool] = True
