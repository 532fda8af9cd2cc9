"""`kv`: keys and values as separate units, keys offset from values (K8V4, K4V2 and per-head mixes).

Every cached head's keys and its values are two allocation units. A unit's level is
b = c + alpha * (H_avg - H_h) + key_offset / 2 for keys, - key_offset / 2 for values, with c solved over all
2n units (exact: the total, sinks included, meets the budget; claim: c = budget) and the levels rounded to the
widths within the target as every entropy rule does (harness.policies.budget.level_widths). A sink head (the
sink rule of SinkPolicy) keeps both its keys and its values at 16. Budget 3 with key_offset 2 and alpha 0 is
K4V2 everywhere; budget 6 with key_offset 4 is K8V4.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.policies.base import Heads, UnitPolicy, is_real, register
from harness.policies.budget import level_widths


@register("kv")
@dataclass(frozen=True)
class KeyValue(UnitPolicy):
    """`alpha` in bits per nat (as entropy's), `key_offset` in bits: how many more bits a head's keys get than
    its values before clipping and rounding (negative: values get more)."""

    alpha: float = 0.0
    key_offset: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_real(self.alpha) or math.isinf(self.alpha):
            raise ValueError(f"policy.alpha: expected a finite real number; got {self.alpha!r}")
        if not is_real(self.key_offset) or math.isinf(self.key_offset):
            raise ValueError(
                f"policy.key_offset: expected a finite real number of bits; got {self.key_offset!r}"
            )

    def free_widths(self, heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
        """Widths and levels of the 2m units of the non-sink heads (int64 [2m], float64 [2m]): their keys, then
        their values, summing to at most twice heads.target (what one role may hold)."""
        h = heads.entropy  # [n]
        slope = float(self.alpha) * (h.mean() - h)[~heads.sinks]  # [m], H_avg over all n heads
        half = float(self.key_offset) / 2
        offset = torch.cat([slope + half, slope - half])  # [2m]
        # Keys and values each may hold heads.target: the 2m units together twice that.
        return level_widths(offset, 2 * heads.target, heads.budget, self.budget_mode, heads.quantized)

    def label(self) -> str:
        slope = f" a={self.alpha:g}" if self.alpha else ""
        label = f"{self.name}{slope} d={self.key_offset:g}"
        return f"{label} + {self.sink_label()}" if self.has_sink_rule else label
