"""`sinks`: the sink rule's heads at 16 bits, every other head at one width, paid for at the same budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.policies.base import Heads, SinkPolicy, register
from harness.policies.budget import level_widths


@register("sinks")
@dataclass(frozen=True)
class Sinks(SinkPolicy):
    """Uniform over the non-sink heads (alpha ignored)."""

    def free_widths(self, heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
        offset = torch.zeros(int((~heads.sinks).sum()), dtype=torch.float64)  # [m]: no slope
        return level_widths(offset, heads.target, heads.budget, self.budget_mode, heads.quantized)

    def label(self) -> str:
        return self.sink_label()
