"""`nuqkey` (KVQuant's keys, Hooper et al. 2024: before RoPE, per channel, non-uniform): each key token is turned
back to position 0 (the inverse of its rotary embedding), each channel coded as the index of the nearest of 2**b
levels fitted offline per layer, KV head and channel on calibration text (harness/schemes/key_table.py,
`fit_levels`), with optional dense-and-sparse outliers (`quant.outliers`); reading turns the levels forward to the
token's position again. Values per token as asym_token. Measured on smollm2-135m's calibration and evaluation text
(keys only quantized, 3 bits, values and the first token exact), ppl ratio: per channel after RoPE 1.248, before
RoPE 1.132, before RoPE with these levels 1.095, and with 1% outliers 1.058.

Format of one key token of one quantized head at sequence position p, x (D,) in any float dtype, with its layer's
turns theta (R / 2,) (the model's rotary frequencies; rotate_half pairs (i, i + R / 2)) and the head's levels
L (D, 2**b) fp16, k = ceil(outliers * D) outliers:
    x32  = clamp(float32(x), -65504, 65504)
    y    = x32 with each pair turned by -p * theta_i (channels past R as they are)
    code = the index of the level of L[c] nearest y[c] (ties to the lower), packed as kernels.reference packs
    deq  = L[c][code]; outliers: the k channels where |y - deq| is largest keep y itself (a 2-byte float: bf16 in
           a bfloat16 model, fp16 otherwise, saturating) with their uint8 channel index
    out  = deq with each pair turned by +p * theta_i, cast to the store's dtype saturating
The store knows each token's position (harness/schemes/rotary.py's TokenPositions: the token after the sink tokens
starts at position sink_tokens; after a scattered eviction the positions are kept, int32, counted in its bytes).

Bytes: a key token costs packed_dim(D, b) + 3 k bytes, the same as calkey's; the layer's levels, 2**b fp16 per
channel of each quantized head at width b, are held once per store (Scheme.table_bytes) and counted in nbytes().
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.schemes.base import register
from harness.schemes.calkey import CalKey, CalKeyStore, Encoded, outlier_dtype, saturating_cast
from harness.schemes.key_table import LEVEL_WIDTHS, KeyTable
from harness.schemes.rotary import POSITION_BYTES, TokenPositions, turn
from kernels import reference
from kernels.layout import FP16_BYTES, FULL_WIDTH

__all__ = ["POSITION_BYTES", "NuqKey", "NuqKeyStore", "level_values", "nearest_level", "turn"]


@register
@dataclass(frozen=True)
class NuqKey(CalKey):
    """Keys before RoPE against the layer's fitted levels (NuqKeyStore), values as asym_token."""

    name: str = "nuqkey"

    widths: ClassVar[tuple[int, ...]] = LEVEL_WIDTHS
    fitted_levels: ClassVar[bool] = True

    def table_bytes(self, bits: int, head_dim: int, role: str) -> int:
        quantized = role == "key" and bits != FULL_WIDTH
        return head_dim * (1 << bits) * FP16_BYTES if quantized else 0  # 2**b fp16 levels per channel

    def key_store(
        self, bits: list[int], head_dim: int, batch: int, dtype: torch.dtype, device, simulate: bool
    ):
        k = self.outlier_count(head_dim)
        return NuqKeyStore(bits, head_dim, batch, dtype, device, self.table, k, self.sink_tokens, simulate)


def nearest_level(y: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Codes (B, H, T, D) int64 of y (B, H, T, D) float32 against ascending levels (H, D, n) float32: the nearest
    level's index (ties to the lower)."""
    B, H, T, D = y.shape
    bounds = (levels[..., 1:] + levels[..., :-1]) / 2  # (H, D, n - 1)
    flat = y.permute(1, 3, 0, 2).reshape(H, D, B * T).contiguous()
    code = torch.searchsorted(bounds.contiguous(), flat, side="left")  # (H, D, B * T)
    return code.view(H, D, B, T).permute(2, 0, 3, 1)


def level_values(code: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """levels[h, c, code[b, h, t, c]]: (B, H, T, D) float32 from codes (any integer dtype) and levels (H, D, n)."""
    H, D, n = levels.shape
    base = (
        torch.arange(H, device=code.device)[:, None] * D + torch.arange(D, device=code.device)
    ) * n  # (H, D)
    index = code.to(torch.int32, memory_format=torch.contiguous_format, copy=True)  # index_select takes int32
    index.add_(base.int()[None, :, None])
    return levels.reshape(-1).index_select(0, index.view(-1)).view(code.shape)


class NuqKeyStore(CalKeyStore):
    """One layer's keys in the nuqkey format (module docstring); 16-bit heads exact. Attention reads blocks of
    dequantized tokens (BlockStore), turned to their positions."""

    def __init__(
        self,
        bits,
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device,
        table: KeyTable,
        outliers: int,
        first_position: int = 0,
        simulate: bool = False,
    ):
        super().__init__(bits, head_dim, batch, dtype, device, table, outliers, simulate)
        # per width w: the levels of its heads, fp16 (Hw, D, 2**w) (stored bytes, counted once)
        self.levels = {w: table.levels[w].to(device).index_select(0, self.heads[w]) for w in self.widths}
        self.positions = TokenPositions(table.rotary_frequencies, batch, device, first_position)
        self._new: torch.Tensor | None = None  # during append: the positions (1, Tn) of the tokens appended

    def starts_at(self, position: int) -> None:
        """The next token appended sits at sequence position `position`."""
        self.positions.starts_at(position, self.length)

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        self._new = self.positions.new(x.shape[2])
        out = super().append(x)
        self._new = None
        return out

    def encode(self, x: torch.Tensor, w: int) -> tuple[Encoded, torch.Tensor]:
        angle = self.positions.angle(self._new)
        y = turn(x.to(torch.float32).clamp(-reference.FP16_MAX, reference.FP16_MAX), -angle)  # (B, Hw, Tn, D)
        levels = self.levels[w].float()
        code = nearest_level(y, levels)
        deq = level_values(code, levels)
        index = (y - deq).abs().topk(self.k, -1).indices  # (B, Hw, Tn, k)
        values = saturating_cast(y.gather(-1, index), outlier_dtype(self.dtype))
        encoded = Encoded(reference.pack(code.to(torch.uint8), w), values, index.to(torch.uint8))
        deq = deq.scatter(-1, index, values.float())
        return encoded, saturating_cast(turn(deq, angle), self.dtype)

    def decode(self, part: Encoded, w: int, start: int, end: int) -> torch.Tensor:
        code = reference.unpack(part.codes, w, self.head_dim)
        deq = level_values(code, self.levels[w].float())
        deq = deq.scatter(-1, part.outlier_index.long(), part.outlier_values.float())
        angle = self.positions.angle(self.positions.held(start, end, self.length))
        return saturating_cast(turn(deq, angle), self.dtype)

    def table_nbytes(self) -> int:
        return sum(lv.numel() for lv in self.levels.values()) * FP16_BYTES

    def nbytes(self) -> int:
        return super().nbytes() + self.positions.nbytes()

    def keep_last(self, n: int) -> None:
        self.positions.keep_last(n, self.length)
        super().keep_last(n)

    def select(self, index: torch.Tensor) -> None:
        self.positions.select(index, self.length)
        super().select(index)

    def take_rows(self, index: torch.Tensor) -> None:
        self.positions.take_rows(index)
        super().take_rows(index)

    def keep_first(self, n: int) -> None:
        self.positions.keep_first(n, self.length)
        super().keep_first(n)
