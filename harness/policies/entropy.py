"""`entropy`: widths from each head's attention entropy, b_h = c + alpha * (H_avg - H_h) (the claim's rule).

Low-entropy (peaked) heads get more bits and high-entropy heads fewer, with an optional sink rule (heads below
a threshold, or the lowest fraction, kept at 16). H_avg is the mean over every cached head, sinks included; c is solved so that
the levels meet the budget (exact) or is the budget itself (claim), and the levels are rounded to the widths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.policies.base import Heads, SinkPolicy, is_real, register
from harness.policies.budget import level_widths


@register("entropy")
@dataclass(frozen=True)
class Entropy(SinkPolicy):
    """b_h = c + alpha * (H_avg - H_h) for the non-sink heads; `alpha` in bits per nat."""

    alpha: float = 0.25

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_real(self.alpha) or math.isinf(self.alpha):
            raise ValueError(f"policy.alpha: expected a finite real number; got {self.alpha!r}")

    def slope(self) -> float:
        return float(self.alpha)

    def free_widths(self, heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
        h = heads.entropy  # [n]
        offset = self.slope() * (h.mean() - h)[~heads.sinks]  # [m], H_avg over all n heads
        return level_widths(offset, heads.target, heads.budget, self.budget_mode, heads.quantized)

    def label(self) -> str:
        label = f"{self.name} a={self.alpha:g}"
        return f"{label} + {self.sink_label()}" if self.has_sink_rule else label
