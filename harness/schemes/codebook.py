"""`codebook` (TurboQuant-style): a Hadamard rotation of head_dim, then each rotated vector (one token of one KV
head) stored as b-bit indices into the Lloyd-Max codebook of N(0, 1) (harness/schemes/lloyd_max.py) and one fp16
scale: packed_dim(D, b) + 2 bytes, so 4 bits cost 4.25 bits per element at head_dim 64. head_dim must be a power
of two; group_size is not used. The rotation is applied here, so rotate+ does not wrap this scheme.

Format of one token of one quantized head, x (D,) in any float dtype (keys and values alike):
    x32   = clamp(float32(x), -65504, 65504)
    r     = x32 @ H                            H = kernels.reference.hadamard(D) (hadamard_rotate)
    rms   = sqrt(mean(r**2))                   = ||x32|| / sqrt(D)
    y     = r / rms   (0 where rms == 0)       a rotated unit vector times sqrt(D): coordinates close to N(0, 1)
    code  = bucketize(y, boundaries)           the index of the level whose cell holds y
    c     = levels[code]                       (D,) float32
    scale = fp16(min(<r, c> / <c, c>, 65504))  the least-squares scale of the chosen levels
    deq   = (c * float32(scale)) @ H           saturating cast to the store's dtype
codes are packed as kernels.reference packs integer codes (b = 2, 3, 4, 8).

The scale: with the codes fixed, <r, c> / <c, c> is the scale of least squared error: the rms (||x|| / sqrt(D))
corrected for the norm the chosen levels happen to have. Relative MSE per element at 2 / 3 / 4 bits, 20000
vectors of head_dim 64 (tests/harness/test_codebook.py::test_least_squares_scale_beats_the_plain_norm checks the
order):
    scale                      Gaussian                   Student-t, 3 degrees of freedom
    least squares (stored)     0.1130 / 0.0326 / 0.0089   0.1057 / 0.0310 / 0.0083
    rms                        0.1145 / 0.0335 / 0.0092   0.1137 / 0.0327 / 0.0086
    ||r|| / ||c|| (keeps norm)  0.1165 / 0.0329 / 0.0089   0.1088 / 0.0312 / 0.0083
    ||r||**2 / <r, c>          0.1280 / 0.0337 / 0.0090   (makes <deq, x> = ||x||**2)
A scale near the rms (rather than the norm) stays inside fp16's range for every finite fp16 input, where ||x||
of a head of 1e4s would not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.schemes.base import Scheme, Store, register
from harness.schemes.lloyd_max import lloyd_max
from harness.schemes.wrappers import BlockStore, head_index, take_tokens
from kernels import reference
from kernels.layout import FP16_BYTES, FULL_WIDTH


@register
@dataclass(frozen=True)
class Codebook(Scheme):
    """Rotated vectors as indices into the Lloyd-Max codebook with one fp16 scale each (CodebookStore)."""

    name: str = "codebook"

    head_dim_groups: ClassVar[bool] = False
    rotated: ClassVar[bool] = True

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
        return CodebookStore(bits, head_dim, batch, dtype, device, simulate)

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> int:
        return reference.packed_dim(head_dim, bits) + FP16_BYTES  # codes, one fp16 scale per (token, head)


# ---------------------------------------------------------------------------------------------------------
# the format


@functools.cache
def tables(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """lloyd_max(bits) as float32 tensors on `device`: levels (2**b,), boundaries (2**b - 1,). Read only."""
    q = lloyd_max(bits)
    as_tensor = functools.partial(torch.tensor, dtype=torch.float32, device=device)
    return as_tensor(q.levels), as_tensor(q.boundaries)


def quantize(
    x: torch.Tensor, bits: int, dtype: torch.dtype, h: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., D) in the format of the module docstring: (codes uint8 (..., packed_dim(D, bits)), scale fp16
    (...,), values (..., D) in dtype, the dequantized x). `h`: hadamard(D) when the caller keeps it."""
    levels, boundaries = tables(bits, torch.device(x.device))
    r = reference.hadamard_rotate(x.to(torch.float32).clamp(-reference.FP16_MAX, reference.FP16_MAX), h=h)
    rms = r.square().mean(-1, keepdim=True).sqrt()  # (..., 1)
    y = torch.where(rms > 0, r / rms, 0.0)
    code = torch.bucketize(y, boundaries)  # (..., D) int64 in [0, 2**bits)
    c = levels[code]
    scale = ((r * c).sum(-1) / (c * c).sum(-1)).clamp(max=reference.FP16_MAX).half()
    values = reference.hadamard_rotate(c * scale.float().unsqueeze(-1), dtype, h)
    return reference.pack(code.to(torch.uint8), bits), scale, values


UNIT_BITS = 12  # 3-bit codes are read 4 at a time: each 3 bytes of a row hold two 12-bit units


@functools.cache
def decoder(bits: int, device: torch.device) -> torch.Tensor:
    """The levels of every code one unit of packed bits holds, in code order (kernels.reference's bit stream:
    code j at bits [b * j, + b)): float32 (256, 8 // b) for a byte at b = 2, 4, 8; (4096, 4) for a 12-bit unit
    at b = 3. Shared: read only."""
    levels, _ = tables(bits, device)
    unit = UNIT_BITS if bits == 3 else 8
    value = torch.arange(1 << unit, device=device)
    return torch.stack([levels[(value >> (i * bits)) & ((1 << bits) - 1)] for i in range(unit // bits)], -1)


def rotated_values(codes: torch.Tensor, scale: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The stored vectors in the rotated domain, levels[code] * scale: float32 (..., dim). Each unit of packed
    bits is looked up whole in `decoder` (no unpacking to one code per element)."""
    lead = codes.shape[:-1]
    units = codes
    if bits == 3:
        b = codes.unflatten(-1, (-1, 3)).int()  # (..., dim // 8, 3): 24 bits, 8 codes
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        units = torch.stack([word & ((1 << UNIT_BITS) - 1), word >> UNIT_BITS], -1)  # (..., dim // 8, 2)
    table = decoder(bits, torch.device(codes.device))
    values = table.index_select(0, units.reshape(-1).int()).view(*lead, dim)
    return values * scale.float().unsqueeze(-1)


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype, h: torch.Tensor | None = None
) -> torch.Tensor:
    """codes uint8 (..., packed_dim(D, bits)) and scale fp16 (...,) -> values (..., D) in dtype."""
    dim = codes.shape[-1] * 8 // bits
    return reference.hadamard_rotate(rotated_values(codes, scale, bits, dim), dtype, h)


# ---------------------------------------------------------------------------------------------------------
# the store


class CodebookStore(BlockStore):
    """One layer's keys or values in the codebook format, each quantized head at its width; 16-bit heads exact.

    Attention stays in the rotated domain: H is orthonormal and symmetric, so q . k = (q H) . (k H) and
    p @ v = (p @ (v H)) H; the queries and the outputs (a few rows) are rotated, never the stored tokens.
    """

    def __init__(self, bits, head_dim: int, batch: int, dtype: torch.dtype, device, simulate: bool = False):
        self.bits = tuple(int(b) for b in bits)
        self.head_dim, self.batch, self.dtype, self.device = head_dim, batch, dtype, device
        self.simulate = simulate
        self.widths = sorted({b for b in self.bits if b != FULL_WIDTH})
        self.heads = {
            w: torch.tensor([h for h, b in enumerate(self.bits) if b == w], device=device)
            for w in self.widths
        }
        self.quant_heads, self.full_heads = (
            head_index(self.bits, True, device),
            head_index(self.bits, False, device),
        )
        self.h = reference.hadamard(head_dim, device) if self.widths else None  # (D, D)
        empty = functools.partial(torch.empty, batch, dtype=torch.uint8, device=device)
        # per width w: codes uint8 (B, Hw, T, packed_dim(D, w)), scales fp16 (B, Hw, T)
        self.codes = {w: empty(len(self.heads[w]), 0, reference.packed_dim(head_dim, w)) for w in self.widths}
        self.scale = {w: empty(len(self.heads[w]), 0, dtype=torch.float16) for w in self.widths}
        self.full = empty(len(self.full_heads), 0, head_dim, dtype=dtype)  # (B, Hf, T, D)
        # simulate only: the full-precision working copy of the dequantized tokens (not stored bytes).
        self._values = empty(len(self.bits), 0, head_dim, dtype=dtype)
        self.length = 0

    def _each(self, change) -> None:
        """Replace every token-major tensor t (tokens along dim 2) by change(t)."""
        for w in self.widths:
            self.codes[w], self.scale[w] = change(self.codes[w]), change(self.scale[w])
        self.full = change(self.full)
        if self.simulate:
            self._values = change(self._values)

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        B, H, Tn, D = x.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        new = torch.empty_like(x, dtype=self.dtype) if self.simulate else None  # (B, H, Tn, D)
        for w in self.widths:
            codes, scale, values = quantize(x.index_select(1, self.heads[w]), w, self.dtype, self.h)
            self.codes[w] = torch.cat([self.codes[w], codes], 2)
            self.scale[w] = torch.cat([self.scale[w], scale], 2)
            if new is not None:
                new.index_copy_(1, self.heads[w], values)
        full = x.index_select(1, self.full_heads)
        self.full = torch.cat([self.full, full], 2)
        self.length += Tn
        if new is None:
            return None
        self._values = torch.cat([self._values, new.index_copy_(1, self.full_heads, full)], 2)
        return self._values

    def _rotated(self, w: int, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) of the heads at width w in the rotated domain: float32 (B, Hw, end - start, D)."""
        return rotated_values(
            self.codes[w][:, :, start:end], self.scale[w][:, :, start:end], w, self.head_dim
        )

    def dequantize(self) -> torch.Tensor:
        """Every stored token dequantized: (B, Hkv, length, D) in the store's dtype."""
        out = torch.empty(
            self.batch, len(self.bits), self.length, self.head_dim, dtype=self.dtype, device=self.device
        )
        for w in self.widths:
            out.index_copy_(1, self.heads[w], dequantize(self.codes[w], self.scale[w], w, self.dtype, self.h))
        return out.index_copy_(1, self.full_heads, self.full)

    def block(self, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) in the rotated domain (quantized heads levels * scale, 16-bit heads as stored):
        (B, Hkv, end - start, D) float32."""
        out = torch.empty(self.batch, len(self.bits), end - start, self.head_dim, device=self.device)
        for w in self.widths:
            out.index_copy_(1, self.heads[w], self._rotated(w, start, end))
        return out.index_copy_(1, self.full_heads, self.full[:, :, start:end].float())

    def turn(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, Hkv, R, D) with its quantized heads rotated by H (its own inverse): between the rotated domain and
        the tokens' own."""
        if not self.widths:
            return x
        rotated = reference.hadamard_rotate(x.index_select(1, self.quant_heads), x.dtype, self.h)
        return x.index_copy(1, self.quant_heads, rotated)

    def keep_last(self, n: int) -> None:
        start = max(self.length - n, 0)
        self._each(lambda t: t[:, :, start:].clone())
        self.length -= start

    def select(self, index: torch.Tensor) -> None:
        self._each(lambda t: take_tokens(t, index, 2))
        self.length = index.shape[1]

    def nbytes(self) -> int:
        codes = sum(t.numel() for t in self.codes.values())
        scales = sum(t.numel() for t in self.scale.values()) * FP16_BYTES
        return codes + scales + self.full.numel() * FP16_BYTES

    def nbytes_fp16(self) -> int:
        return self.batch * len(self.bits) * self.length * self.head_dim * FP16_BYTES
