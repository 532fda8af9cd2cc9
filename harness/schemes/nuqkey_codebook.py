"""`nuqkey_codebook`: nuqkey's keys (turned back before RoPE, per channel the nearest of 2**b levels fitted on
calibration text, optional fp16 outliers: harness/schemes/nuqkey.py) with codebook's values (a Hadamard rotation,
b-bit indices into the Lloyd-Max codebook of N(0, 1), one fp16 scale per token and head:
harness/schemes/codebook.py). Each role keeps its family's format exactly; only the pairing is new.

Why: under nuqkey the values (asym_token g32, an fp16 scale and zero per 32 elements) cost b + 1 bits per element
while the keys cost b. At head_dim 64 a codebook value costs b + 0.25 bits. Relative MSE per element, 20000
vectors of 64 (torch.randn, and Student-t with 3 degrees of freedom for heavy tails), asym_token g32 against
codebook at the same b = 2 / 3 / 4:
    Gaussian     asym g32 0.1546 / 0.0281 / 0.0061    codebook 0.1129 / 0.0326 / 0.0089
    Student-t 3  asym g32 0.2480 / 0.0454 / 0.0099    codebook 0.1057 / 0.0310 / 0.0083
So at 0.75 fewer bits per value element the codebook is about as good, better on heavy tails; a bytes budget can
spend what it saves on wider keys or values. What that buys in quality is the frontier sweep's to measure.

Bytes: a key token as nuqkey's (packed_dim(D, b) + 3 k), a value token as codebook's (packed_dim(D, b) + 2); the
levels held once per store as nuqkey's. head_dim must be a power of two (the values' rotation); group_size is not
used by either role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.schemes.base import Store, register
from harness.schemes.codebook import Codebook, CodebookStore
from harness.schemes.nuqkey import NuqKey


@register
@dataclass(frozen=True)
class NuqKeyCodebook(NuqKey):
    """Keys as nuqkey (NuqKeyStore), values as codebook (CodebookStore)."""

    name: str = "nuqkey_codebook"

    head_dim_groups: ClassVar[bool] = (
        False  # neither role groups head_dim: tables per channel, one scale a vector
    )
    rotated: ClassVar[bool] = True  # the values' Hadamard rotation needs a power-of-two head_dim

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
        if role == "key":
            return super().base_store(bits, head_dim, batch, dtype, device, role, simulate)
        return CodebookStore(bits, head_dim, batch, dtype, device, simulate)

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> float:
        if role == "key":
            return super().quantized_token_bytes(bits, head_dim, role)
        return Codebook.quantized_token_bytes(self, bits, head_dim, role)
