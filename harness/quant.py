"""Quantization schemes by name: how one layer's keys and values are stored.

A scheme turns the new K or V tokens of a layer (B, Hkv, Tn, D), each KV head at its own width, into stored form
and back. The bit-level format lives in kernels/reference.py and the per-layer layout in kernels/layout.py; this
module maps a configured name (`quant.scheme`) and its options to them.
- `asym_token` (like llama.cpp q4_1 / q8_1): per token, groups of g along head_dim, min/max, fp16 scale and zero.
- `sym_token` (like q4_0 / q8_0): per token, groups of g, absmax, fp16 scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.models import unknown_name_message
from kernels.layout import PackedStore


@dataclass(frozen=True)
class Scheme:
    """A named storage scheme; `new_store` makes the store of one layer's keys or values."""

    name: str
    symmetric: bool
    group_size: int = 32

    def __post_init__(self):
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"quant.group_size: {self.group_size!r} is not a positive integer")

    def new_store(
        self, bits: list[int], head_dim: int, batch: int, dtype: torch.dtype, device
    ) -> PackedStore:
        if any(b != 16 for b in bits) and head_dim % self.group_size:
            raise ValueError(
                f"quant.group_size: {self.group_size} does not divide the model's head_dim {head_dim}"
            )
        return PackedStore(bits, head_dim, batch, self.group_size, self.symmetric, dtype, device)


SCHEMES = {
    "asym_token": dict(symmetric=False),
    "sym_token": dict(symmetric=True),
}


def get_scheme(name: str, group_size: int = 32) -> Scheme:
    if name not in SCHEMES:
        raise ValueError(unknown_name_message("quant.scheme", name, sorted(SCHEMES)))
    return Scheme(name=name, group_size=group_size, **SCHEMES[name])
