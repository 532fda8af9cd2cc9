"""`sym_token` (like llama.cpp q4_0 / q8_0): per token, groups of g along head_dim, absmax codes with one fp16
scale per group (no zero), stored in a kernels.layout.PackedStore as asym_token is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from harness.schemes.asym_token import AsymToken
from harness.schemes.base import register


@register
@dataclass(frozen=True)
class SymToken(AsymToken):
    name: str = "sym_token"

    symmetric: ClassVar[bool] = True
