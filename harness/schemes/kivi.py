"""`kivi` (KIVI, Liu et al. 2024): keys quantized per channel over groups of g = key_group_size consecutive tokens
(ChannelStore; g along the sequence, so it need not divide head_dim), values per token as asym_token (groups of
group_size along head_dim). Keys move to quantized storage a whole group at a time, so up to residual + g - 1
recent keys stay unquantized; the default residual window is 32 tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.schemes.asym_token import AsymToken
from harness.schemes.base import Store, register
from harness.schemes.wrappers import BlockStore, head_index
from kernels import reference
from kernels.layout import FP16_BYTES, FULL_WIDTH


@register
@dataclass(frozen=True)
class Kivi(AsymToken):
    """Values are asym_token's; a key group of g tokens stores g codes and one fp16 scale and zero per channel, so a
    key costs head_dim * (packed g codes + 4 bytes) / g bytes per token."""

    name: str = "kivi"

    packed: ClassVar[bool] = False
    default_residual: ClassVar[int] = 32
    no_eviction: ClassVar[str | None] = "kivi's per-channel key groups"

    def __post_init__(self):
        super().__post_init__()
        if self.key_group_size % 8:
            raise ValueError(
                f"{self.group_key('key')}: {self.key_group_size} with kivi, whose key codes pack g tokens per channel into whole "
                "bytes; allowed: a multiple of 8"
            )

    def per_channel(self, role: str) -> bool:
        return role == "key"

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> float:
        if role != "key":
            return super().quantized_token_bytes(bits, head_dim, role)
        g = self.key_group_size
        return (
            head_dim * (reference.packed_dim(g, bits) + 2 * FP16_BYTES) / g
        )  # codes, scale, zero per channel

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
            return ChannelStore(bits, head_dim, batch, self.key_group_size, dtype, device, simulate)
        return super().base_store(bits, head_dim, batch, dtype, device, role, simulate)


class ChannelStore(BlockStore):
    """KIVI's keys: each group of g consecutive tokens of a quantized head is quantized per channel along the
    sequence (asym, one fp16 scale and zero per (group, channel)); 16-bit heads are kept exact.

    Tokens arrive in whole groups (ResidualStore holds the rest unquantized). A sliding window may evict part of
    the oldest group: its codes stay stored and counted until the whole group is out, and `offset` hides the
    evicted tokens from the values.
    """

    def __init__(
        self,
        bits,
        head_dim: int,
        batch: int,
        group_size: int,
        dtype: torch.dtype,
        device,
        simulate: bool = False,
    ):
        self.bits = tuple(int(b) for b in bits)
        self.head_dim, self.batch, self.group_size, self.dtype = head_dim, batch, group_size, dtype
        self.simulate, self.device = simulate, device
        self.widths = sorted({b for b in self.bits if b != FULL_WIDTH})
        for w in self.widths:
            reference.packed_dim(group_size, w)  # g codes of one channel must fill whole bytes
        heads = [[h for h, b in enumerate(self.bits) if b == w] for w in self.widths]
        self.heads = {w: torch.tensor(hs, device=device) for w, hs in zip(self.widths, heads)}
        self.packed: dict[int, reference.Packed] = {}  # width -> rows (B, Hw, n_groups, D) of g codes
        self.full_heads = head_index(self.bits, False, device)
        self.full = torch.empty(batch, len(self.full_heads), 0, head_dim, dtype=dtype, device=device)
        self.offset = 0  # evicted tokens at the start of the first group held
        self.length = 0
        # simulate only: the full-precision working copy of the dequantized tokens (not stored bytes).
        self._values = torch.empty(batch, len(self.bits), 0, head_dim, dtype=dtype, device=device)

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        B, H, Tn, D = x.shape  # Tn a multiple of g
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        new = torch.empty_like(x, dtype=self.dtype) if self.simulate else None  # (B, H, Tn, D)
        for w in self.widths:
            p, values = reference.channel_quantize_dequantize(
                x.index_select(1, self.heads[w]), w, self.group_size, self.dtype
            )
            if new is not None:
                new.index_copy_(1, self.heads[w], values)
            old = self.packed.get(w)
            if old is not None:
                p.payload = torch.cat([old.payload, p.payload], 2)
                p.scale, p.zero = torch.cat([old.scale, p.scale], 2), torch.cat([old.zero, p.zero], 2)
            self.packed[w] = p
        full = x.index_select(1, self.full_heads)
        self.full = torch.cat([self.full, full], 2)
        self.length += Tn
        if new is None:
            return None
        new.index_copy_(1, self.full_heads, full)
        self._values = torch.cat([self._values, new], 2)
        return self._values

    def block(self, start: int, end: int) -> torch.Tensor:
        """Dequantized tokens [start, end): (B, Hkv, end - start, D) in the store's dtype; only the groups that
        hold them are dequantized."""
        g = self.group_size
        first, last = (self.offset + start) // g, -(-(self.offset + end) // g)  # groups [first, last)
        skip = self.offset + start - first * g
        out = torch.empty(
            self.batch, len(self.bits), end - start, self.head_dim, dtype=self.dtype, device=self.device
        )
        for w, p in self.packed.items():
            rows = reference.Packed(
                p.payload[:, :, first:last], p.scale[:, :, first:last], p.zero[:, :, first:last],
                p.bits, p.group_size, p.symmetric, p.dim,
            )  # fmt: skip
            values = reference.channel_dequantize(rows, self.dtype)  # (B, Hw, (last - first) * g, D)
            out.index_copy_(1, self.heads[w], values[:, :, skip : skip + end - start])
        return out.index_copy_(1, self.full_heads, self.full[:, :, start:end])

    def keep_last(self, n: int) -> None:
        drop = self.length - n
        if drop <= 0:
            return
        dead = self.offset + drop
        whole, self.offset = divmod(dead, self.group_size)
        for p in self.packed.values():
            p.payload, p.scale, p.zero = (t[:, :, whole:].clone() for t in (p.payload, p.scale, p.zero))
        self.full = self.full[:, :, drop:].clone()
        if self.simulate:
            self._values = self._values[:, :, drop:].clone()
        self.length = n

    def select(self, index: torch.Tensor) -> None:
        raise NotImplementedError(
            "select: kivi keys are quantized per channel over groups of quant.key_group_size tokens; "
            "single tokens cannot be evicted from a group"
        )

    def take_rows(self, index: torch.Tensor) -> None:
        for p in self.packed.values():
            p.payload, p.scale, p.zero = (t.index_select(0, index) for t in (p.payload, p.scale, p.zero))
        self.full, self._values = self.full.index_select(0, index), self._values.index_select(0, index)
        self.batch = index.shape[0]

    def nbytes(self) -> int:
        packed = sum(
            t.numel() * t.element_size() for p in self.packed.values() for t in (p.payload, p.scale, p.zero)
        )
        return packed + self.full.numel() * FP16_BYTES

    def nbytes_fp16(self) -> int:
        return self.batch * len(self.bits) * self.length * self.head_dim * FP16_BYTES
