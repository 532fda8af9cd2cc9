"""`random`: the control: entropy's widths (and sinks) dealt to the non-sink heads in a seeded random order.

Same histogram of widths, same sinks, same bytes as `entropy` with the same settings; only which head gets
which width is random, so a gain of `entropy` over it is a gain from choosing heads by their entropy.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch

from harness.policies.base import Allocation, register
from harness.policies.entropy import Entropy


@register("random")
@dataclass(frozen=True)
class Random(Entropy):
    """`seed` (policy.seed, the grid's policy_seed): the draw."""

    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"policy.seed: {self.seed!r} is not an integer")

    def allocate(
        self,
        entropy: pd.DataFrame,
        budget: float,
        *,
        price: Callable[[int, str], float] | None = None,
        sensitivity: pd.DataFrame | None = None,
    ) -> Allocation:
        allocation = super().allocate(entropy, budget, price=price, sensitivity=sensitivity)
        free = allocation.cached & ~allocation.sinks  # [L, Hkv]
        order = torch.randperm(int(free.sum()), generator=torch.Generator().manual_seed(int(self.seed)))
        bits, continuous = allocation.bits.clone(), allocation.continuous.clone()  # [L, Hkv] each
        bits[free] = allocation.bits[free][order]
        continuous[free] = allocation.continuous[free][order]
        return Allocation.per_head(bits, allocation.sinks, continuous, self.name)

    def label(self) -> str:
        return f"{self.name} (draw {self.seed})"
