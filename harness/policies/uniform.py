"""`uniform`: every cached head at one width, the budget's (sink rules and alpha ignored): the reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.policies.base import HeadPolicy, Heads, register
from harness.policies.budget import level_widths


@register("uniform")
@dataclass(frozen=True)
class Uniform(HeadPolicy):
    """One level c for every head, solved (exact) or the budget (claim), rounded within the budget."""

    def free_widths(self, heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
        offset = torch.zeros(len(heads.entropy), dtype=torch.float64)  # [n]: no slope, no sinks
        return level_widths(offset, heads.target, heads.budget, self.budget_mode, heads.quantized)
