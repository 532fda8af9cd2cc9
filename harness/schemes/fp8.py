"""`fp8`: e4m3 codes with one fp16 absmax scale per (token, head) (Fp8Store); quantized heads are 8-bit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.schemes.base import Scheme, Store, register
from harness.schemes.wrappers import BlockStore, head_index, take_tokens
from kernels import reference
from kernels.layout import FP16_BYTES, FULL_WIDTH


@register
@dataclass(frozen=True)
class Fp8(Scheme):
    name: str = "fp8"

    widths: ClassVar[tuple[int, ...]] = (8,)
    head_dim_groups: ClassVar[bool] = False

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
        return Fp8Store(bits, head_dim, batch, dtype, device, simulate)

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> float:
        return head_dim + FP16_BYTES  # one e4m3 byte per element, one fp16 scale per (token, head)


class Fp8Store(BlockStore):
    """e4m3 payload with one fp16 absmax scale per (token, head); quantized heads are 8-bit, 16-bit heads exact."""

    def __init__(self, bits, head_dim: int, batch: int, dtype: torch.dtype, device, simulate: bool = False):
        self.bits = tuple(int(b) for b in bits)
        bad = sorted({b for b in self.bits if b not in (8, FULL_WIDTH)})
        if bad:
            raise ValueError(f"quant.scheme: fp8 stores heads at 8 bits; got widths {bad}; allowed: 8, 16")
        self.head_dim, self.batch, self.dtype, self.simulate = head_dim, batch, dtype, simulate
        self.quant_heads, self.full_heads = (
            head_index(self.bits, True, device),
            head_index(self.bits, False, device),
        )
        Hq, Hf = len(self.quant_heads), len(self.full_heads)
        self.payload = torch.empty(batch, Hq, 0, head_dim, dtype=torch.uint8, device=device)  # e4m3 bits
        self.scale = torch.empty(batch, Hq, 0, dtype=torch.float16, device=device)  # (B, Hq, T)
        self.full = torch.empty(batch, Hf, 0, head_dim, dtype=dtype, device=device)  # (B, Hf, T, D)
        # simulate only: the full-precision working copy of the dequantized tokens (not stored bytes).
        self._values = torch.empty(batch, len(self.bits), 0, head_dim, dtype=dtype, device=device)
        self.length = 0

    def _fields(self) -> tuple[str, ...]:
        return (
            "payload",
            "scale",
            "full",
            *(("_values",) if self.simulate else ()),
        )  # token-major along dim 2

    def _each(self, change) -> None:
        for name in self._fields():
            setattr(self, name, change(getattr(self, name)))

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        B, H, Tn, D = x.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        payload, scale, values = reference.fp8_quantize_dequantize(
            x.index_select(1, self.quant_heads), self.dtype
        )
        full = x.index_select(1, self.full_heads)
        parts = [payload, scale, full]
        if self.simulate:
            new = torch.empty_like(x, dtype=self.dtype)  # (B, H, Tn, D)
            parts.append(new.index_copy_(1, self.quant_heads, values).index_copy_(1, self.full_heads, full))
        for name, part in zip(self._fields(), parts):
            setattr(self, name, torch.cat([getattr(self, name), part], 2))
        self.length += Tn
        return self._values if self.simulate else None

    def block(self, start: int, end: int) -> torch.Tensor:
        """Dequantized tokens [start, end): (B, Hkv, end - start, D) in the store's dtype."""
        out = torch.empty(
            self.batch, len(self.bits), end - start, self.head_dim, dtype=self.dtype, device=self.full.device
        )
        values = reference.fp8_dequantize(
            self.payload[:, :, start:end], self.scale[:, :, start:end], self.dtype
        )
        out.index_copy_(1, self.quant_heads, values)
        return out.index_copy_(1, self.full_heads, self.full[:, :, start:end])

    def keep_last(self, n: int) -> None:
        start = max(self.length - n, 0)
        for name in self._fields():
            setattr(self, name, getattr(self, name)[:, :, start:].clone())
        self.length -= start

    def select(self, index: torch.Tensor) -> None:
        for name in self._fields():
            setattr(self, name, take_tokens(getattr(self, name), index, 2))
        self.length = index.shape[1]

    def nbytes(self) -> int:
        scales = self.scale.numel() * FP16_BYTES
        return self.payload.numel() + scales + self.full.numel() * FP16_BYTES

    def nbytes_fp16(self) -> int:
        return self.batch * len(self.bits) * self.length * self.head_dim * FP16_BYTES
