"""`inverted`: the entropy rule with its slope reversed, b_h = c - |alpha| * (H_avg - H_h): the control that
asks whether the sign of the entropy rule matters (more bits for high-entropy heads)."""

from __future__ import annotations

from dataclasses import dataclass

from harness.policies.base import register
from harness.policies.entropy import Entropy


@register("inverted")
@dataclass(frozen=True)
class Inverted(Entropy):
    """The slope -|alpha|; the label names alpha only (a sink rule is not shown, as before)."""

    def slope(self) -> float:
        return -abs(self.alpha)

    def label(self) -> str:
        return f"{self.name} a={self.alpha:g}"
