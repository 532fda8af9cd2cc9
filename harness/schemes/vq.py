"""`vq2`, `vq4`, `vq8`: vector quantization on fixed grids after a Hadamard rotation (HIGGS / AQUA-KV's grids; E8
where it fits): keys turned back before RoPE and values, less their calibration mean, rotated, normalized by one
scale per token and head, and coded p coordinates at a time to the nearest point of a grid of N(0, I_p) that is
the same everywhere (harness/schemes/grids.py): 2-D and 4-D k-means grids (vq2: 2, 3, 4 bits; vq4: 2 bits) and
the E8 lattice's Voronoi code (vq8: 2, 3, 4 bits). No codebook is stored; the mean (and the keys' rotary turns) come
from pca's calibration (harness/schemes/pca_table.py's fit: the mean of each head's calibration vectors).

Format of one token of one quantized head of `role` at sequence position p, x (D,), the head's fitted mean m (D,)
fp16, H = kernels.reference.hadamard(D), at b bits:
    y    = keys: x turned back by -p theta (harness/schemes/rotary.py); values: x      (float32, clamped to fp16)
    r    = (y - float32(m)) @ H;  rms = sqrt(mean(r**2));  u = r / rms  (0 where rms = 0)
    grid (vq2, vq4): code = per group of p coordinates the index of the nearest grid point (p b bits); c = the
           points;  E8 (vq8): per candidate scale t of grids.E8_SCALES[b], the code of u / t and its points t c';
           the candidate of least squared error is kept (digits: b bits a coordinate)
    scale = fp16(min(<r, c> / <c, c>, 65504))     the least-squares scale of the chosen points (codebook's)
    out  = (c * scale) @ H + m, keys turned forward; cast to the store's dtype saturating
Bytes: codes packed_dim(D, b) (D b bits) + one fp16 scale per token and head; the mean, D fp16 per quantized head,
held once per store. head_dim must be a power of two and a multiple of p.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from harness.schemes.base import SCHEMES, Scheme, Store
from harness.schemes.bitstream import layout, pack, unpack
from harness.schemes.calkey import saturating_cast
from harness.schemes.grids import (
    E8_SCALES,
    E8_WIDTHS,
    KMEANS_GRIDS,
    e8_decode,
    e8_encode,
    grid_encode,
    kmeans_grid,
)
from harness.schemes.pca_table import PCA_FORMAT, PcaCalibration, PcaFormat, PcaLayer
from harness.schemes.rotary import TokenPositions, turn
from harness.schemes.wrappers import PositionedBlockStore, head_index
from kernels import reference
from kernels.layout import FP16_BYTES, FULL_WIDTH

DIMENSIONS = {"vq2": 2, "vq4": 4, "vq8": 8}  # registered name -> the grid's dimension p
UNBOUND = (
    "quant.scheme: {name} subtracts each head's calibration mean before its rotation; none was given "
    "(QuantizedKVCache key_calibration: harness.calibrate.cached_fit)"
)


@dataclass(frozen=True)
class Vq(Scheme):
    """Rotated, normalized groups of p coordinates coded to a fixed grid, one fp16 scale per token and head
    (VqStore). `fitted`: the layer's pca fit, whose means it subtracts (for_layer binds it)."""

    name: str = "vq2"
    fitted: PcaLayer | None = field(default=None, compare=False, repr=False)

    head_dim_groups: ClassVar[bool] = False
    rotated: ClassVar[bool] = True
    key_tables: ClassVar[bool] = True  # reads the means fitted per layer on calibration text
    fit: ClassVar[str] = "pca"
    pca_format: ClassVar[PcaFormat] = PCA_FORMAT  # the fit it reads the means of: pca's own

    def __post_init__(self):
        object.__setattr__(self, "widths", E8_WIDTHS if self.dim == 8 else KMEANS_GRIDS[self.dim])
        super().__post_init__()

    @property
    def dim(self) -> int:
        return DIMENSIONS[self.name]

    @property
    def fit_variant(self) -> PcaFormat:
        """The format of the pca fit it reads: pca's own (so pca and vq share one fit)."""
        return self.pca_format

    def for_layer(self, layer: int, key_calibration) -> Vq:
        if not isinstance(key_calibration, PcaCalibration):
            raise ValueError(UNBOUND.format(name=self.name))
        return replace(self, fitted=key_calibration.layer(layer))

    def check_head_dim(self, bits: list[int], head_dim: int, role: str) -> None:
        super().check_head_dim(bits, head_dim, role)
        if head_dim % self.dim:
            raise ValueError(f"quant.scheme: {self.name} needs a head_dim that is a multiple of {self.dim}")

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> int:
        return reference.packed_dim(head_dim, bits) + FP16_BYTES

    def table_bytes(self, bits: int, head_dim: int, role: str) -> int:
        return 0 if bits == FULL_WIDTH else head_dim * FP16_BYTES  # the fitted mean

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
        if self.fitted is None:
            raise ValueError(UNBOUND.format(name=self.name))
        keys = role == "key"
        theta = self.fitted.rotary_frequencies if keys else torch.zeros(0)
        mean = self.fitted.role(role).mean
        first = self.sink_tokens if keys else 0
        return VqStore(bits, head_dim, batch, dtype, device, self.dim, mean, theta, first, simulate)


for _name in DIMENSIONS:
    SCHEMES.register(_name)(functools.partial(Vq, _name))


def vq_quantize(u: torch.Tensor, r: torch.Tensor, p: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized rotated vectors u (..., D) (and r, the same unnormalized) -> (codes (..., D // p) int64 (a grid
    point's index) or (..., D) (E8's digits), the chosen points (..., D) float32 on u's scale)."""
    groups = u.unflatten(-1, (-1, p))  # (..., G, p)
    if p != 8:
        points = kmeans_grid(p, b).to(u.device)
        code = grid_encode(groups, points)
        return code, points[code].flatten(-2)
    best_code, best_c, best_error = None, None, None
    for t in E8_SCALES[b]:
        digits = e8_encode(groups / t, b).flatten(-2)  # (..., D)
        c = e8_decode(digits.unflatten(-1, (-1, 8)), b).float().flatten(-2)  # (..., D): the points, unscaled
        scale = (r * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True).clamp(min=1e-30)
        error = (r - scale * c).square().sum(-1)  # (...,): with the least-squares scale the store keeps
        if best_error is None:
            best_code, best_c, best_error = digits, c, error
            continue
        better = (error < best_error)[..., None]
        best_code, best_c = torch.where(better, digits, best_code), torch.where(better, c, best_c)
        best_error = torch.minimum(error, best_error)
    return best_code, best_c


def vq_points(code: torch.Tensor, p: int, b: int) -> torch.Tensor:
    """The points (..., D) float32 (unscaled) that codes stand for."""
    if p != 8:
        return kmeans_grid(p, b).to(code.device)[code].flatten(-2)
    return e8_decode(code.unflatten(-1, (-1, 8)), b).float().flatten(-2)


class VqStore(PositionedBlockStore):
    """One layer's keys or values in a vq format (module docstring), each quantized head at its width; 16-bit heads
    exact. Attention reads blocks of dequantized tokens (BlockStore)."""

    def __init__(
        self,
        bits,
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device,
        dim: int,
        mean: torch.Tensor,
        theta: torch.Tensor,
        first_position: int = 0,
        simulate: bool = False,
    ):
        self.bits = tuple(int(b) for b in bits)
        if tuple(mean.shape) != (len(self.bits), head_dim):
            raise ValueError(
                f"vq calibration: means of {tuple(mean.shape)} (KV heads, head_dim) for a layer of "
                f"{len(self.bits)} KV heads of head_dim {head_dim}"
            )
        self.head_dim, self.batch, self.dtype, self.device = head_dim, batch, dtype, device
        self.dim, self.simulate = dim, simulate
        self.widths = sorted({b for b in self.bits if b != FULL_WIDTH})
        self.heads = {
            w: torch.tensor([h for h, b in enumerate(self.bits) if b == w], device=device)
            for w in self.widths
        }
        self.mean = {w: mean.to(device).index_select(0, self.heads[w]) for w in self.widths}  # fp16 (Hw, D)
        self.h = reference.hadamard(head_dim, device) if self.widths else None
        # a row of codes: D / p indices of p b bits (a grid) or D digits of b bits (E8): D b bits, whole bytes
        per_code = lambda w: dim * w if dim != 8 else w  # noqa: E731
        count = lambda w: head_dim // dim if dim != 8 else head_dim  # noqa: E731
        self.layout = {
            w: layout(torch.full((len(self.heads[w]), count(w)), per_code(w))) for w in self.widths
        }
        empty = functools.partial(torch.empty, batch, dtype=torch.uint8, device=device)
        self.codes = {w: empty(len(self.heads[w]), 0, self.layout[w].nbytes) for w in self.widths}
        self.scale = {w: empty(len(self.heads[w]), 0, dtype=torch.float16) for w in self.widths}
        self.full_heads = head_index(self.bits, False, device)
        self.full = empty(len(self.full_heads), 0, head_dim, dtype=dtype)  # (B, Hf, T, D)
        self.positions = TokenPositions(theta, batch, device, first_position)
        self._values = empty(len(self.bits), 0, head_dim, dtype=dtype)  # simulate only: the working copy
        self.length = 0

    def starts_at(self, position: int) -> None:
        self.positions.starts_at(position, self.length)

    def _each(self, change) -> None:
        for w in self.widths:
            self.codes[w], self.scale[w] = change(self.codes[w]), change(self.scale[w])
        self.full = change(self.full)
        if self.simulate:
            self._values = change(self._values)

    def _restore(self, c: torch.Tensor, scale: torch.Tensor, w: int, angle: torch.Tensor) -> torch.Tensor:
        """Points c (B, Hw, T, D) float32 and fp16 scales (B, Hw, T) -> the tokens in the store's dtype."""
        r = c * scale.float()[..., None]
        y = reference.hadamard_rotate(r, h=self.h) + self.mean[w].float()[None, :, None]
        return saturating_cast(turn(y, angle), self.dtype)

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        B, H, Tn, D = x.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        angle = self.positions.angle(self.positions.new(Tn))
        new = torch.empty_like(x, dtype=self.dtype) if self.simulate else None
        for w in self.widths:
            part = (
                x.index_select(1, self.heads[w])
                .to(torch.float32)
                .clamp(-reference.FP16_MAX, reference.FP16_MAX)
            )
            y = turn(part, -angle) - self.mean[w].float()[None, :, None]
            r = reference.hadamard_rotate(y, h=self.h)  # (B, Hw, Tn, D)
            rms = r.square().mean(-1, keepdim=True).sqrt()
            u = torch.where(rms > 0, r / rms, 0.0)
            code, c = vq_quantize(u, r, self.dim, w)
            scale = ((r * c).sum(-1) / (c * c).sum(-1).clamp(min=1e-30)).clamp(max=reference.FP16_MAX).half()
            self.codes[w] = torch.cat([self.codes[w], pack(code, self.layout[w])], 2)
            self.scale[w] = torch.cat([self.scale[w], scale], 2)
            if new is not None:
                new.index_copy_(1, self.heads[w], self._restore(c, scale, w, angle))
        full = x.index_select(1, self.full_heads)
        self.full = torch.cat([self.full, full], 2)
        self.length += Tn
        if new is None:
            return None
        self._values = torch.cat([self._values, new.index_copy_(1, self.full_heads, full)], 2)
        return self._values

    def block(self, start: int, end: int) -> torch.Tensor:
        out = torch.empty(
            self.batch, len(self.bits), end - start, self.head_dim, dtype=self.dtype, device=self.device
        )
        angle = self.positions.angle(self.positions.held(start, end, self.length))
        for w in self.widths:
            code = unpack(self.codes[w][:, :, start:end], self.layout[w])
            c = vq_points(code, self.dim, w)
            out.index_copy_(1, self.heads[w], self._restore(c, self.scale[w][:, :, start:end], w, angle))
        return out.index_copy_(1, self.full_heads, self.full[:, :, start:end])

    def nbytes(self) -> int:
        codes = sum(t.numel() for t in self.codes.values())
        scales = sum(t.numel() for t in self.scale.values()) * FP16_BYTES
        means = sum(m.numel() for m in self.mean.values()) * FP16_BYTES
        return codes + scales + means + self.positions.nbytes() + self.full.numel() * FP16_BYTES

    def nbytes_fp16(self) -> int:
        return self.batch * len(self.bits) * self.length * self.head_dim * FP16_BYTES
