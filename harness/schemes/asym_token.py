"""`asym_token` (like llama.cpp q4_1 / q8_1): per token, groups of g along head_dim (keys: of key_group_size),
min/max codes with an fp16 scale and zero per group, stored in a kernels.layout.PackedStore (the format the
Triton kernels read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.schemes.base import Scheme, Store, register
from kernels.layout import FP16_BYTES, PackedStore
from kernels.reference import packed_dim


@register
@dataclass(frozen=True)
class AsymToken(Scheme):
    name: str = "asym_token"

    packed: ClassVar[bool] = True

    def base_store(
        self,
        bits: list[int],
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device,
        role: str,
        simulate: bool,
    ) -> Store:
        group = self.role_group_size(role)
        return PackedStore(bits, head_dim, batch, group, self.symmetric, dtype, device, simulate=simulate)

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> float:
        groups = head_dim // self.role_group_size(role)
        return packed_dim(head_dim, bits) + groups * FP16_BYTES * (
            1 if self.symmetric else 2
        )  # codes, scale, zero
