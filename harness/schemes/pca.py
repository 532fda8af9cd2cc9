"""`pca` (KVTC-style transform coding, per (layer, KV head)): keys turned back before RoPE and values, each
projected on a decorrelating basis fitted on calibration text, each component quantized to the Lloyd-Max levels
of N(0, 1) at its own width times a fitted scale, the widths of a head's components chosen per unit width by a
dynamic program on calibration distortions so that trailing components may get 0 bits (harness/schemes/
pca_table.py fits them). A unit at width w (1 to 6, or 8: PCA_WIDTHS) stores w D bits per token, no per-token
scale.

Format of one token of one quantized head of `role` at sequence position p, x (D,) in any float dtype, with the
head's fitted mean m (D,) fp16, basis U (D, D) fp16, and at its width w the plan b (D,) (component widths, summing
to w D) and scales s (D,) fp16; keys also the layer's rotary turns theta (R / 2,):
    x32  = clamp(float32(x), -65504, 65504)
    y    = keys: x32 with each rotary pair turned by -p * theta_i (harness/schemes/rotary.py); values: x32
    z    = (y - float32(m)) @ float32(U)                                        (D,) components
    code = per component c: the index of the Lloyd-Max level of b_c bits whose cell holds z_c / s_c (a value on a
           boundary to the lower level; 0 when b_c = 0), packed into w D / 8 bytes (harness/schemes/bitstream.py)
    zq_c = level_{b_c}[code_c] * float32(s_c)   (0 when b_c = 0)
    out  = float32(m) + zq @ float32(U).T, keys turned by +p * theta_i; cast to the store's dtype saturating
The key store knows each token's position as nuqkey's does (rotary.TokenPositions: the token after the sink tokens
starts at position sink_tokens; kept, int32, after a scattered eviction, and counted in its bytes).

Bytes: a token of a head at width w costs w D / 8 bytes; a quantized head's table, its mean, basis and scales (fp16)
and plan (uint8 per component), 2 D**2 + 5 D bytes, is held once per store (Scheme.table_bytes), for keys and values
alike. head_dim must be a multiple of 8 (a row of w D bits is whole bytes at every width).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from harness.schemes.base import Scheme, Store, register
from harness.schemes.bitstream import layout, pack, unpack
from harness.schemes.calkey import saturating_cast
from harness.schemes.pca_table import (
    BLOCK,
    PCA_FORMAT,
    PCA_WIDTHS,
    POST,
    UNIFORM,
    PcaCalibration,
    PcaFormat,
    PcaLayer,
    PcaTable,
    component_values,
    quantize_components,
)
from harness.schemes.rotary import TokenPositions, turn
from harness.schemes.wrappers import PositionedBlockStore, head_index
from kernels import reference
from kernels.layout import FP16_BYTES, FULL_WIDTH

PLAN_BYTES = 1  # a component's width, uint8
UNBOUND = (
    "quant.scheme: pca stores keys and values against transforms fitted on the calibration windows; none were "
    "given (QuantizedKVCache key_calibration: harness.calibrate.cached_fit)"
)


@register
@dataclass(frozen=True)
class Pca(Scheme):
    """Keys (before RoPE) and values on the layer's fitted PCA bases, bits per component by the fitted plan
    (PcaStore). `fitted`: the layer's transforms (for_layer binds them; not part of the scheme's identity)."""

    name: str = "pca"
    fitted: PcaLayer | None = field(default=None, compare=False, repr=False)

    widths: ClassVar[tuple[int, ...]] = PCA_WIDTHS
    head_dim_groups: ClassVar[bool] = False  # a basis per head: no groups along head_dim
    key_tables: ClassVar[bool] = True  # reads parts fitted per layer on calibration text
    fit: ClassVar[str] = "pca"  # which: harness.calibrate.FITS
    pca_format: ClassVar[PcaFormat] = PCA_FORMAT  # what the fit and the store code against

    @property
    def fit_variant(self) -> PcaFormat:
        """The format its fit codes against: schemes of one format share a fit, others never do."""
        return self.pca_format

    def for_layer(self, layer: int, key_calibration) -> Pca:
        if not isinstance(key_calibration, PcaCalibration):
            raise ValueError(UNBOUND)
        return replace(self, fitted=key_calibration.layer(layer))

    def check_head_dim(self, bits: list[int], head_dim: int, role: str) -> None:
        super().check_head_dim(bits, head_dim, role)
        if head_dim % 8:
            raise ValueError(
                f"quant.scheme: pca needs a head_dim that is a multiple of 8; the model's is {head_dim}"
            )

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> float:
        return bits * head_dim / 8

    def table_bytes(self, bits: int, head_dim: int, role: str) -> int:
        if bits == FULL_WIDTH:
            return 0
        return (
            head_dim * head_dim + 2 * head_dim
        ) * FP16_BYTES + head_dim * PLAN_BYTES  # basis, mean, scales; plan

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
            raise ValueError(UNBOUND)
        keys = role == "key"
        theta = self.fitted.rotary_frequencies if keys else torch.zeros(0)
        first = self.sink_tokens if keys else 0
        table = self.fitted.role(role)
        return PcaStore(bits, head_dim, batch, dtype, device, table, theta, first, simulate, self.pca_format)


class PcaStore(PositionedBlockStore):
    """One layer's keys or values in the pca format (module docstring), each quantized head at its width against
    its fitted transform; 16-bit heads exact. Attention reads blocks of dequantized tokens (BlockStore)."""

    def __init__(
        self,
        bits,
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device,
        table: PcaTable,
        theta: torch.Tensor,
        first_position: int = 0,
        simulate: bool = False,
        fmt: PcaFormat = PCA_FORMAT,
    ):
        self.bits = tuple(int(b) for b in bits)
        self.fmt, self.first = fmt, first_position
        if tuple(table.mean.shape) != (len(self.bits), head_dim):
            raise ValueError(
                f"pca calibration: a transform of {tuple(table.mean.shape)} (KV heads, head_dim) for a layer of "
                f"{len(self.bits)} KV heads of head_dim {head_dim}"
            )
        self.head_dim, self.batch, self.dtype, self.device = head_dim, batch, dtype, device
        self.simulate = simulate
        self.widths = sorted({b for b in self.bits if b != FULL_WIDTH})
        self.heads = {
            w: torch.tensor([h for h, b in enumerate(self.bits) if b == w], device=device)
            for w in self.widths
        }
        pick = lambda t, w: t.to(device).index_select(0, self.heads[w])  # noqa: E731  the rows of w's heads
        # per width w, of its heads: fp16 mean (Hw, D), basis (Hw, D, D), scales (Hw, D); plan (Hw, D) (stored)
        self.mean = {w: pick(table.mean, w) for w in self.widths}
        self.basis = {w: pick(table.basis, w) for w in self.widths}
        self.scale = {w: pick(table.scales[w], w) for w in self.widths}
        self.plan = {w: pick(table.plans[w], w) for w in self.widths}
        self.layout = {w: layout(self.plan[w]) for w in self.widths}
        empty = functools.partial(torch.empty, batch, dtype=torch.uint8, device=device)
        # per width w: codes uint8 (B, Hw, T, w D / 8), tokens along dim 2
        self.codes = {w: empty(len(self.heads[w]), 0, self.layout[w].nbytes) for w in self.widths}
        self.full_heads = head_index(self.bits, False, device)
        self.full = empty(len(self.full_heads), 0, head_dim, dtype=dtype)  # (B, Hf, T, D)
        self.positions = TokenPositions(theta, batch, device, first_position)
        # simulate only: the full-precision working copy of the dequantized tokens (not stored bytes).
        self._values = empty(len(self.bits), 0, head_dim, dtype=dtype)
        self.length = 0

    def starts_at(self, position: int) -> None:
        """The next token appended sits at sequence position `position`."""
        self.positions.starts_at(position, self.length)

    def _each(self, change) -> None:
        """Replace every token-major tensor t (tokens along dim 2) by change(t)."""
        for w in self.widths:
            self.codes[w] = change(self.codes[w])
        self.full = change(self.full)
        if self.simulate:
            self._values = change(self._values)

    def _restore(self, zq: torch.Tensor, w: int, angle: torch.Tensor) -> torch.Tensor:
        """Components zq (B, Hw, T, D) float32 of the heads at width w -> their tokens in the store's dtype."""
        y = self.mean[w].float()[None, :, None] + torch.einsum("bhtc,hdc->bhtd", zq, self.basis[w].float())
        return saturating_cast(turn(y, angle), self.dtype)

    def _angle(self, positions: torch.Tensor) -> torch.Tensor:
        """The angles (B or 1, 1, T, R / 2) keys at positions (B or 1, T) are turned by into the format's frame."""
        return self.positions.angle(self.fmt.reference_positions(positions, self.first))

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        B, H, Tn, D = x.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        angle = self._angle(self.positions.new(Tn))  # (1, 1, Tn, R / 2)
        new = torch.empty_like(x, dtype=self.dtype) if self.simulate else None  # (B, H, Tn, D)
        for w in self.widths:
            part = (
                x.index_select(1, self.heads[w])
                .to(torch.float32)
                .clamp(-reference.FP16_MAX, reference.FP16_MAX)
            )
            y = turn(part, -angle) - self.mean[w].float()[None, :, None]  # (B, Hw, Tn, D)
            z = torch.einsum("bhtd,hdc->bhtc", y, self.basis[w].float())
            code, zq = quantize_components(z, self.plan[w], self.scale[w].float(), self.fmt.levels)
            self.codes[w] = torch.cat([self.codes[w], pack(code, self.layout[w])], 2)
            if new is not None:
                new.index_copy_(1, self.heads[w], self._restore(zq, w, angle))
        full = x.index_select(1, self.full_heads)
        self.full = torch.cat([self.full, full], 2)
        self.length += Tn
        if new is None:
            return None
        self._values = torch.cat([self._values, new.index_copy_(1, self.full_heads, full)], 2)
        return self._values

    def block(self, start: int, end: int) -> torch.Tensor:
        """Dequantized tokens [start, end): (B, Hkv, end - start, D) in the store's dtype."""
        out = torch.empty(
            self.batch, len(self.bits), end - start, self.head_dim, dtype=self.dtype, device=self.device
        )
        angle = self._angle(self.positions.held(start, end, self.length))
        for w in self.widths:
            code = unpack(self.codes[w][:, :, start:end], self.layout[w])
            zq = component_values(code, self.plan[w], self.scale[w].float(), self.fmt.levels)
            out.index_copy_(1, self.heads[w], self._restore(zq, w, angle))
        return out.index_copy_(1, self.full_heads, self.full[:, :, start:end])

    def table_nbytes(self) -> int:
        """Bytes of the fitted transforms the quantized heads read (held once)."""
        fp16 = sum(self.mean[w].numel() + self.basis[w].numel() + self.scale[w].numel() for w in self.widths)
        return fp16 * FP16_BYTES + sum(self.plan[w].numel() for w in self.widths) * PLAN_BYTES

    def nbytes(self) -> int:
        codes = sum(t.numel() for t in self.codes.values())
        return codes + self.table_nbytes() + self.positions.nbytes() + self.full.numel() * FP16_BYTES

    def nbytes_fp16(self) -> int:
        return self.batch * len(self.bits) * self.length * self.head_dim * FP16_BYTES


# Variants of the format, measured as candidates for a fused GPU kernel (issue: the frontier at kernel speed):
# keys as cached (a basis folds into the query once a step), keys relative to their block of 128 tokens (a kernel
# turns one query per block), evenly spaced levels (codes to values by bit operations), and plans of one width
# per group of 16 components from 0, 1, 2, 4, 8 bits (a kernel's unit of work).
BLOCK_TOKENS = 128
GROUP_WIDTHS = (0, 1, 2, 4, 8)


@register
@dataclass(frozen=True)
class PcaPost(Pca):
    """pca with keys coded as cached, after RoPE."""

    name: str = "pca_post"
    pca_format: ClassVar[PcaFormat] = PcaFormat(key_frame=POST)


@register
@dataclass(frozen=True)
class PcaBlock(Pca):
    """pca with keys turned back to the first position of their block of BLOCK_TOKENS tokens."""

    name: str = "pca_block"
    pca_format: ClassVar[PcaFormat] = PcaFormat(key_frame=BLOCK, block=BLOCK_TOKENS)


@register
@dataclass(frozen=True)
class PcaBlockUniform(Pca):
    """pca_block with evenly spaced levels."""

    name: str = "pca_block_u"
    pca_format: ClassVar[PcaFormat] = PcaFormat(key_frame=BLOCK, block=BLOCK_TOKENS, levels=UNIFORM)


@register
@dataclass(frozen=True)
class PcaBlockUniformGroups(Pca):
    """pca_block_u with one width per group of 16 components, from GROUP_WIDTHS."""

    name: str = "pca_block_ug"
    pca_format: ClassVar[PcaFormat] = PcaFormat(
        key_frame=BLOCK, block=BLOCK_TOKENS, levels=UNIFORM, group=16, group_widths=GROUP_WIDTHS
    )


@register
@dataclass(frozen=True)
class PcaBlockUniformSharedGroups(Pca):
    """pca_block_ug with one plan per role and width for every head of the model (a kernel compiles it)."""

    name: str = "pca_block_ugs"
    pca_format: ClassVar[PcaFormat] = PcaFormat(
        key_frame=BLOCK,
        block=BLOCK_TOKENS,
        levels=UNIFORM,
        group=16,
        group_widths=GROUP_WIDTHS,
        shared_plans=True,
    )


@register
@dataclass(frozen=True)
class PcaPostUniformFlat(Pca):
    """pca_post with evenly spaced levels and every component of a head at the unit's width (no plan): the
    format of today's fused kernel with one scale and zero a token traded for one a component, folded into the
    query and the output (the mean and the codes' offset add one constant to every score)."""

    name: str = "pca_post_uf"
    pca_format: ClassVar[PcaFormat] = PcaFormat(key_frame=POST, levels=UNIFORM, group=0)


@register
@dataclass(frozen=True)
class PcaBlockUniformFlat(Pca):
    """pca_block_u with every component of a head at the unit's width (no plan)."""

    name: str = "pca_block_uf"
    pca_format: ClassVar[PcaFormat] = PcaFormat(key_frame=BLOCK, block=BLOCK_TOKENS, levels=UNIFORM, group=0)


@register
@dataclass(frozen=True)
class PcaBlock32UniformFlat(Pca):
    """pca_block_uf with blocks of 32 tokens (BLOCK_TOKENS // 4): keys nearer their pre-RoPE frame, four times the
    queries a kernel turns."""

    name: str = "pca_block32_uf"
    pca_format: ClassVar[PcaFormat] = PcaFormat(
        key_frame=BLOCK, block=BLOCK_TOKENS // 4, levels=UNIFORM, group=0
    )


@register
@dataclass(frozen=True)
class PcaPostUniformGroups(Pca):
    """pca_post with evenly spaced levels and one width per group of 16 components, from GROUP_WIDTHS."""

    name: str = "pca_post_ug"
    pca_format: ClassVar[PcaFormat] = PcaFormat(
        key_frame=POST, levels=UNIFORM, group=16, group_widths=GROUP_WIDTHS
    )
