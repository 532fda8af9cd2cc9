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
Evenly spaced levels (the pca_block and pca_post formats) read a run of tokens that share one turn back (a block's
keys, or values) in one product: zq = offset + step * code (pca_fold.code_steps), so out = R(r) (m + U offset) +
code @ (R(r) U diag(step)).T, the tokens above within float rounding (`_restore_codes`), no level lookup.
The key store knows each token's position as nuqkey's does (rotary.TokenPositions: the token after the sink tokens
starts at position sink_tokens; kept, int32, after a scattered eviction, and counted in its bytes).

Dense-and-sparse keys (quant.outliers > 0, KVQuant's idea on the components): of each key token of a quantized head,
the k = ceil(outliers * D) components whose coded value misses z most, |z_c - zq_c| largest (a 0-bit component's
miss is |z_c|), keep z_c itself in a 2-byte float (bf16 in a bfloat16 store, else fp16, saturating) with its uint8
index, and dequantize to it instead of zq_c; their codes stay in the row. Such a store is read by dequantizing its
blocks (no fold, no triton backend).

Bytes: a token of a head at width w costs w D / 8 bytes (a key 3 k more with outliers); a quantized head's table,
its mean, basis and scales (fp16) and plan (uint8 per component), 2 D**2 + 5 D bytes, is held once per store
(Scheme.table_bytes), for keys and values alike. head_dim must be a multiple of 8 (a row of w D bits is whole bytes
at every width).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from harness.schemes.base import Scheme, Store, register
from harness.schemes.bitstream import layout, pack, unpack
from harness.schemes.calkey import outlier_dtype, saturating_cast
from harness.schemes.pca_fold import code_steps, decode, format_reason, packed_decode
from harness.schemes.pca_table import (
    BLOCK,
    LLOYD,
    MIN_GROUPS,
    PCA_FORMAT,
    PCA_WIDTHS,
    PLAN_BYTES,
    POST,
    PRE,
    UNIFORM,
    PcaCalibration,
    PcaFormat,
    PcaLayer,
    PcaTable,
    component_values,
    head_table_bytes,
    level_tables,
    quantize_codes,
)
from harness.schemes.rotary import TokenPositions, turn
from harness.schemes.wrappers import PositionedBlockStore, head_index
from kernels import groups, reference
from kernels.layout import FP16_BYTES, FULL_WIDTH, PackedStore
from kernels.unpack import fast_path_fits

KERNEL_WIDTHS = (2, 3, 4, 8)  # the widths a codes-only store holds flat (kernels/layout.py); grouped: any
UNBOUND = (
    "quant.scheme: pca stores keys and values against transforms fitted on the calibration windows; none were "
    "given (QuantizedKVCache key_calibration: harness.calibrate.cached_fit)"
)


def kernel_reason(fmt: PcaFormat, bits) -> str | None:
    """Why heads at widths `bits` in format `fmt` cannot be the triton backend's (PcaCodesStore), or None."""
    reason = format_reason(fmt)
    if reason is not None:
        return reason
    other = sorted({int(b) for b in bits} - set(KERNEL_WIDTHS if fmt.group == 0 else PCA_WIDTHS))
    if other:
        return f"a head at {other[0]} bits; the kernels decode codes of {', '.join(map(str, KERNEL_WIDTHS))} bits"
    return None


def check_whole_bytes(name: str, head_dim: int) -> None:
    """ValueError unless a row of w head_dim bits is whole bytes at every width (head_dim a multiple of 8)."""
    if head_dim % 8:
        raise ValueError(
            f"quant.scheme: {name} needs a head_dim that is a multiple of 8; the model's is {head_dim}"
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
    keeps_outliers: ClassVar[bool] = True  # dense-and-sparse keys (module docstring)
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
        check_whole_bytes("pca", head_dim)

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> float:
        outliers = self.outlier_count(head_dim) if role == "key" else 0
        return bits * head_dim / 8 + outliers * (FP16_BYTES + 1)  # codes; outlier values, uint8 indices

    def table_bytes(self, bits: int, head_dim: int, role: str) -> int:
        if bits == FULL_WIDTH:
            return 0
        return head_table_bytes(head_dim)

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
        return self._store(PcaStore, bits, head_dim, batch, dtype, device, role, simulate)

    def _store(
        self, store_type: type, bits, head_dim: int, batch: int, dtype, device, role: str, simulate: bool
    ):
        """A store_type (PcaStore or PcaCodesStore) of `role` bound to the layer's fitted table."""
        if self.fitted is None:
            raise ValueError(UNBOUND)
        keys = role == "key"
        theta = self.fitted.rotary_frequencies if keys else torch.zeros(0)
        first = self.sink_tokens if keys else 0
        table = self.fitted.role(role)
        outliers = self.outlier_count(head_dim) if keys else 0
        return store_type(
            bits, head_dim, batch, dtype, device, table, theta, first, simulate, self.pca_format, outliers
        )

    @property
    def fusable(self) -> bool:
        """The flat, evenly spaced formats (pca_fold.format_reason), sink tokens beside them, no residual, no
        outliers."""
        return format_reason(self.pca_format) is None and self.residual == 0 and not self.outliers

    def check_kernel(self, key_bits, value_bits, k_dim: int, v_dim: int, sliding: bool) -> None:
        if self.outliers:
            raise NotImplementedError(
                f"pca on the triton backend: quant.outliers {self.outliers:g}; the kernels read no outliers"
            )
        for bits in (key_bits, value_bits):
            reason = kernel_reason(self.pca_format, bits)
            if reason is not None:
                raise NotImplementedError(reason)
        group = self.pca_format.group_at(k_dim)
        if self.pca_format.group and group != groups.GROUP:
            raise NotImplementedError(
                f"pca on the triton backend: {self.name}'s plans group {group} components at head_dim {k_dim}; the "
                f"kernels read groups of {groups.GROUP} (head_dim {groups.GROUP * MIN_GROUPS} or more)"
            )
        if sliding:
            raise NotImplementedError(
                "pca on the triton backend: sliding-window layers are not supported (a window drops keys from the "
                "front of the blocks the kernel's queries are turned for)"
            )
        if k_dim != v_dim:
            raise NotImplementedError(
                f"the Triton kernels need key and value head_dim equal; got {k_dim}, {v_dim}"
            )

    def kernel_store(self, bits, head_dim: int, batch: int, dtype: torch.dtype, device, role: str) -> Store:
        return self._store(PcaCodesStore, bits, head_dim, batch, dtype, device, role, False)

    def decode_kernel(self):
        return decode

    def packed_decode(self):
        return packed_decode if format_reason(self.pca_format) is None and not self.outliers else None


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
        outliers: int = 0,
    ):
        self.bits = tuple(int(b) for b in bits)
        self.outliers = outliers  # k: components of each token kept as they are (module docstring)
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
        # per width w with outliers: their uint8 indices and 2-byte float components (B, Hw, T, k)
        kept = outlier_dtype(dtype)
        self.outlier_index = {w: empty(len(self.heads[w]), 0, outliers) for w in self.widths if outliers}
        self.outlier_values = {
            w: empty(len(self.heads[w]), 0, outliers, dtype=kept) for w in self.widths if outliers
        }
        self.full_heads = head_index(self.bits, False, device)
        self.full = empty(len(self.full_heads), 0, head_dim, dtype=dtype)  # (B, Hf, T, D)
        self.positions = TokenPositions(theta, batch, device, first_position)
        # simulate only: the full-precision working copy of the dequantized tokens (not stored bytes).
        self._values = empty(len(self.bits), 0, head_dim, dtype=dtype)
        self.length = 0
        self._inverse: dict[int, torch.Tensor] = {}  # inverse_basis's, per width

    def inverse_basis(self, w: int) -> torch.Tensor:
        """float64 (Hw, D, D): the inverse of the fp16 basis of the heads at width w (nearly orthogonal, not exactly),
        computed at its first use and kept (pca_fold.to_codes maps sink tokens through it at every decode step)."""
        if w not in self._inverse:
            self._inverse[w] = torch.linalg.inv(self.basis[w].double())
        return self._inverse[w]

    def starts_at(self, position: int) -> None:
        """The next token appended sits at sequence position `position`."""
        self.positions.starts_at(position, self.length)

    def _each(self, change) -> None:
        """Replace every token-major tensor t (tokens along dim 2) by change(t)."""
        for w in self.widths:
            self.codes[w] = change(self.codes[w])
        for w in self.outlier_index:
            self.outlier_index[w] = change(self.outlier_index[w])
            self.outlier_values[w] = change(self.outlier_values[w])
        self.full = change(self.full)
        if self.simulate:
            self._values = change(self._values)

    def _restore(self, zq: torch.Tensor, w: int, angle: torch.Tensor) -> torch.Tensor:
        """Components zq (B, Hw, T, D) float32 of the heads at width w -> their tokens in the store's dtype."""
        y = self.mean[w].float()[None, :, None] + torch.einsum("bhtc,hdc->bhtd", zq, self.basis[w].float())
        return saturating_cast(turn(y, angle), self.dtype)

    def _folded_basis(self, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Of the heads at width w, float32: (U diag(step))^T (Hw, D, D) and m + U offset (Hw, D), so that codes
        stand for the tokens m + U (offset + step * code) = codes @ the first + the second (evenly spaced levels:
        pca_fold.code_steps' offset and step). Computed at each read (not kept: the store holds its bytes only)."""
        offset, step = code_steps(self, w)  # (Hw, D) each
        basis = self.basis[w].float()  # (Hw, D, C): column c is component c
        through = (basis * step[:, None]).transpose(1, 2).contiguous()  # (Hw, C, D)
        return through, self.mean[w].float() + torch.einsum("hdc,hc->hd", basis, offset)

    def _frame_runs(self, positions: torch.Tensor) -> list[tuple[int, int, torch.Tensor | None]] | None:
        """Tokens at positions (B or 1, T) as runs [s, e) that share one turn into the format's frame, each with its
        angles (1, 1, 1, R / 2) (None: no turn), where `_restore_codes` can read them: evenly spaced levels, no
        outliers, every batch row's positions alike, and at most one run per 16 tokens (keys turned back to their
        block's first position, or after RoPE; not keys before RoPE, each at its own angle, nor a format's own
        pairs). Else None."""
        turned = len(self.positions.theta) > 0
        if (
            self.fmt.levels != UNIFORM
            or self.outliers
            or positions.shape[0] != 1
            or (self.fmt.own_pairs and turned)
        ):
            return None
        T = positions.shape[1]
        if not len(self.positions.theta):
            return [(0, T, None)]
        reference = self.fmt.reference_positions(positions, self.first)[0]  # (T,)
        bounds = [0, *((reference[1:] != reference[:-1]).nonzero().flatten() + 1).tolist(), T]
        if len(bounds) - 1 > max(T // 16, 1):
            return None
        return [
            (s, e, self.positions.angle(reference[None, s : s + 1])) for s, e in zip(bounds[:-1], bounds[1:])
        ]

    def _restore_codes(
        self, code: torch.Tensor, w: int, runs: list[tuple[int, int, torch.Tensor | None]], out: torch.Tensor
    ) -> None:
        """Codes (B, Hw, T, D) float32 of the heads at width w, in `_frame_runs`' runs -> their tokens, written into
        out (B, Hkv, T, D) (the store's dtype) at those heads: a run of a head in one product with the folded basis
        turned by the run's angle (the tokens `_restore` gives from component_values' components, within float
        rounding)."""
        folded, mean = self._folded_basis(w)  # (Hw, C, D), (Hw, D)
        for s, e, angle in runs:
            through, shift = folded, mean
            if angle is not None:  # every token of the run turned: the basis' and the mean's D axis instead
                through, shift = turn(folded[None], angle)[0], turn(mean[None, :, None], angle)[0, :, 0]
            for i, head in enumerate(self.heads[w].tolist()):
                y = torch.matmul(code[:, i, s:e], through[i]).add_(shift[i])  # (B, e - s, D)
                out[:, head, s:e] = saturating_cast(y, self.dtype)

    def _angle(self, positions: torch.Tensor) -> torch.Tensor:
        """The angles (B or 1, 1, T, R / 2) keys at positions (B or 1, T) are turned by into the format's frame
        (the format's own pairs by their own positions)."""
        angle = self.positions.angle(self.fmt.reference_positions(positions, self.first))
        if self.fmt.own_pairs and angle.shape[-1]:
            angle[..., : self.fmt.own_pairs] = self.positions.angle(positions)[..., : self.fmt.own_pairs]
        return angle

    def _components(self, x: torch.Tensor, w: int, angle: torch.Tensor) -> torch.Tensor:
        """New tokens x (B, Hkv, Tn, D), their keys' angles (1, 1, Tn, R / 2) -> the components z (B, Hw, Tn, D)
        float32 of the heads at width w (the module docstring's z)."""
        part = (
            x.index_select(1, self.heads[w]).to(torch.float32).clamp(-reference.FP16_MAX, reference.FP16_MAX)
        )
        y = turn(part, -angle) - self.mean[w].float()[None, :, None]  # (B, Hw, Tn, D)
        return torch.einsum("bhtd,hdc->bhtc", y, self.basis[w].float())

    def _outliers(self, z: torch.Tensor, zq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Components z (B, Hw, Tn, D) float32 and their coded values zq -> the outliers (module docstring): uint8
        indices and 2-byte float components (B, Hw, Tn, k), the k components zq misses most."""
        index = (z - zq).abs().topk(self.outliers, -1).indices
        kept = saturating_cast(z.gather(-1, index), outlier_dtype(self.dtype))
        return index.to(torch.uint8), kept

    def _keep_outliers(self, zq: torch.Tensor, w: int, start: int, end: int) -> torch.Tensor:
        """zq (B, Hw, end - start, D) float32 of tokens [start, end) at width w with their outliers put back."""
        if not self.outliers:
            return zq
        index = self.outlier_index[w][:, :, start:end].long()
        return zq.scatter(-1, index, self.outlier_values[w][:, :, start:end].float())

    def _codes(self, w: int, start: int, end: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """The codes (B, Hw, end - start, D) of tokens [start, end) of the heads at width w, in dtype (int64 or a
        float type)."""
        return unpack(self.codes[w][:, :, start:end], self.layout[w], dtype)

    def code_block(self, start: int, end: int) -> torch.Tensor:
        """The codes of tokens [start, end) of every head, (B, Hkv, end - start, D) float32, in a store whose heads
        are all quantized (pca_fold.packed_decode's read)."""
        if len(self.widths) == 1:  # every head at one width, in order
            return unpack(
                self.codes[self.widths[0]][:, :, start:end], self.layout[self.widths[0]], torch.float32
            )
        out = torch.empty(self.batch, len(self.bits), end - start, self.head_dim, device=self.device)
        for w in self.widths:
            codes = unpack(self.codes[w][:, :, start:end], self.layout[w], torch.float32)
            out.index_copy_(1, self.heads[w], codes)
        return out

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        B, H, Tn, D = x.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        positions = self.positions.new(Tn)  # (1, Tn)
        angle = self._angle(positions)  # (1, 1, Tn, R / 2)
        new = torch.empty_like(x, dtype=self.dtype) if self.simulate else None  # (B, H, Tn, D)
        runs = self._frame_runs(positions) if new is not None else None
        for w in self.widths:
            z = self._components(x, w, angle)
            code = quantize_codes(z, self.plan[w], self.scale[w].float(), self.fmt.levels)
            self.codes[w] = torch.cat([self.codes[w], pack(code, self.layout[w])], 2)
            if runs is not None:
                self._restore_codes(code.float(), w, runs, new)
                continue
            if new is None and not self.outliers:
                continue
            zq = component_values(code, self.plan[w], self.scale[w].float(), self.fmt.levels)
            if self.outliers:
                index, kept = self._outliers(z, zq)
                self.outlier_index[w] = torch.cat([self.outlier_index[w], index], 2)
                self.outlier_values[w] = torch.cat([self.outlier_values[w], kept], 2)
                zq = self._keep_outliers(zq, w, self.length, self.length + Tn)
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
        positions = self.positions.held(start, end, self.length)  # (B or 1, end - start)
        angle = self._angle(positions)
        runs = self._frame_runs(positions)
        for w in self.widths:
            if runs is not None:
                self._restore_codes(self._codes(w, start, end, torch.float32), w, runs, out)
                continue
            zq = component_values(
                self._codes(w, start, end), self.plan[w], self.scale[w].float(), self.fmt.levels
            )
            zq = self._keep_outliers(zq, w, start, end)
            out.index_copy_(1, self.heads[w], self._restore(zq, w, angle))
        if len(self.full_heads):
            out.index_copy_(1, self.full_heads, self.full[:, :, start:end])
        return out

    def table_nbytes(self) -> int:
        """Bytes of the fitted transforms the quantized heads read (held once)."""
        fp16 = sum(self.mean[w].numel() + self.basis[w].numel() + self.scale[w].numel() for w in self.widths)
        return fp16 * FP16_BYTES + sum(self.plan[w].numel() for w in self.widths) * PLAN_BYTES

    def nbytes(self) -> int:
        codes = sum(t.numel() for t in self.codes.values())
        codes += sum(t.numel() * (1 + FP16_BYTES) for t in self.outlier_index.values())  # index, value
        return codes + self.table_nbytes() + self.positions.nbytes() + self.full.numel() * FP16_BYTES

    def nbytes_fp16(self) -> int:
        return self.batch * len(self.bits) * self.length * self.head_dim * FP16_BYTES


class PcaCodesStore(PcaStore):
    """A PcaStore of a foldable format (harness/schemes/pca_fold.py) whose codes live in a codes-only
    kernels.layout.PackedStore (`packed`), where the Triton decode kernel reads them: the triton backend's store.
    The same codes, bytes and dequantized tokens as PcaStore's, its rows kernels.reference.pack's under a flat plan
    and kernels.groups.pack's under a shared grouped one (PcaStore's bitstream rows byte for byte where every group
    is one plane: 0, 1, 2, 4 or 8 bits, widths never growing); every head quantized at a width the kernels
    decode (KERNEL_WIDTHS flat, any grouped), nothing simulated. New tokens' components are computed by torch (as
    PcaStore computes them) and coded and packed by the Triton kernel kernels.quantize.quantize_codes_into, one
    launch a store, bit for bit PcaStore's codes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        reason = kernel_reason(self.fmt, self.bits)
        if self.outliers:
            reason = "quant.outliers: the kernels read no outliers"
        if reason is not None:
            raise NotImplementedError(f"pca on the triton backend: {reason}")
        if self.simulate:
            raise ValueError(
                "quant.simulate: the triton backend's pca store keeps no working copy; allowed: false"
            )
        self.codes = None  # the codes are `packed`'s
        # grouped rows where a width's plan has groups of more than one width (a plan of one width is the flat
        # row, byte for byte, which the kernels' fast flat path reads faster where it reads that width: a bucket
        # with grouped rows on one side takes the fast kernel, which reads no other flat rows)
        plans = {w: self._group_plan(w) for w in self.widths} if self.fmt.group else {}
        plans = {
            w: plan for w, plan in plans.items()
            if set(plan) != {w} or not fast_path_fits(w, self.head_dim, self.head_dim)
        }  # fmt: skip
        self.packed = PackedStore(
            self.bits, self.head_dim, self.batch, dtype=self.dtype, device=self.device, simulate=False,
            codes_only=True, plans=plans,
        )  # fmt: skip
        from kernels.quantize import quantize_codes_into  # Triton, imported where a kernel store is made

        # what the write kernel reads: every head's component scales (H, D) and the levels' boundaries per width
        scales = torch.empty(len(self.bits), self.head_dim, dtype=torch.float32, device=self.device)
        for w in self.widths:
            scales.index_copy_(0, self.heads[w], self.scale[w].float())
        _, bounds = level_tables(torch.device(self.device), self.fmt.levels)
        self._write = functools.partial(quantize_codes_into, scale=scales, bounds=bounds)

    def _group_plan(self, w: int) -> tuple[int, ...]:
        """The grouped plan (kernels/groups.py) every head at width w shares; NotImplementedError if they do not
        share one the kernels read."""
        plan = self.plan[w].long().cpu()  # (Hw, D)
        per_group = plan.view(len(plan), -1, groups.GROUP)
        if not (bool((plan == plan[0]).all()) and bool((per_group == per_group[..., :1]).all())):
            raise NotImplementedError(
                f"pca on the triton backend: the {w}-bit heads share no plan of {groups.GROUP}-component groups"
            )
        grouped = tuple(int(b) for b in per_group[0, :, 0])
        try:
            groups.check_plan(grouped, w, self.head_dim)
        except ValueError as err:
            raise NotImplementedError(f"pca on the triton backend: {err}") from None
        return grouped

    def _all_components(self, x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
        """New tokens x (B, Hkv, Tn, D), their keys' angles -> every head's components z (B, Hkv, Tn, D) float32."""
        B, H, Tn, D = x.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        z = torch.empty(B, H, Tn, D, dtype=torch.float32, device=x.device)
        for w in self.widths:
            z.index_copy_(1, self.heads[w], self._components(x, w, angle))
        return z

    def append(self, x: torch.Tensor) -> None:
        angle = self._angle(self.positions.new(x.shape[2]))  # (1, 1, Tn, R / 2)
        self.packed.append_with(self._all_components(x, angle), self._write)
        self.length += x.shape[2]

    # Decode tokens at device-side positions (CUDA-graph decoding: harness/cache/graphed.py), counted in this
    # store's own tokens (its first at sequence position positions.next - length).
    @property
    def capacity(self) -> int:
        return self.packed.capacity

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` tokens, so that decode steps up to there never reallocate."""
        self.packed.reserve(tokens)

    def append_at(self, x: torch.Tensor, index: torch.Tensor) -> None:
        """One new token x (B, Hkv, 1, D) as the store's token `index` (an int32 tensor of one element on the store's
        device, read there: nothing on the host depends on it), into reserved capacity; `advance` counts it on
        the host."""
        assert x.shape[2] == 1 and self.positions.kept is None, (x.shape, "contiguous positions only")
        start = self.positions.next - self.length  # the sequence position of token 0
        angle = self._angle((index.long() + start).view(1, 1))  # (1, 1, 1, R / 2)
        self._write(self.packed, self._all_components(x, angle), index)

    def advance(self, n: int) -> None:
        """Count n more tokens as stored (those append_at wrote)."""
        self.length += n
        self.packed.advance(n)
        self.positions.next += n

    def _codes(self, w: int, start: int, end: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        payload = self.packed.bucket_of[w].payload[:, :, start:end]
        if w in self.packed.plans:
            return groups.unpack(payload, self.packed.plans[w]).to(dtype)
        return reference.unpack(payload, w, self.head_dim).to(dtype)

    # rows and tokens: the positions as PositionedBlockStore keeps them, the codes as the PackedStore does
    def take_rows(self, index: torch.Tensor) -> None:
        self.positions.take_rows(index)
        self.packed.take_rows(index)
        self.batch = index.shape[0]

    def keep_first(self, n: int) -> None:
        self.positions.keep_first(n, self.length)
        self.packed.keep_first(n)
        self.length = n

    def keep_last(self, n: int) -> None:
        self.positions.keep_last(n, self.length)
        self.packed.keep_last(n)
        self.length = self.packed.length

    def select(self, index: torch.Tensor) -> None:
        self.positions.select(index, self.length)
        self.packed.select(index)
        self.length = index.shape[1]

    def nbytes(self) -> int:
        return self.packed.nbytes() + self.table_nbytes() + self.positions.nbytes()


# Variants of the format, measured as candidates for a fused GPU kernel (issue: the frontier at kernel speed):
# keys as cached (a basis folds into the query once a step), keys relative to their block of 128 tokens (a kernel
# turns one query per block), evenly spaced levels (codes to values by bit operations), and plans of one width
# per group of 16 components from 0, 1, 2, 4, 8 bits (a kernel's unit of work).
BLOCK_TOKENS = 128
GROUP_WIDTHS = (0, 1, 2, 4, 8)
# pca_own32_ugsa's own pairs: a group of 16 channels; at smollm2-135m's rotary base (1e5, 32 pairs) pair 7 turns
# 2.5 rad over a 32-token block, pair 8 1.7
OWN_PAIRS = 8


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
class PcaBlockUniformSharedGroupsAllWidths(Pca):
    """pca_block_ugs with every width 0 to 8 a group may take (a kernel would read a 3-, 5-, 6- or 7-bit group as
    planes of 1, 2 and 4 bits): what the plan's power-of-two widths cost."""

    name: str = "pca_block_ugsa"
    pca_format: ClassVar[PcaFormat] = replace(
        PcaBlockUniformSharedGroups.pca_format, group_widths=PcaFormat.group_widths
    )


@register
@dataclass(frozen=True)
class PcaBlockUniformSharedGroups8(Pca):
    """pca_block_ugs with groups of 8 components: what the groups' size costs."""

    name: str = "pca_block_ugs_g8"
    pca_format: ClassVar[PcaFormat] = replace(PcaBlockUniformSharedGroups.pca_format, group=8)


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
class PcaBlock32(Pca):
    """pca_block with blocks of 32 tokens: the most a format with keys in 32-token blocks keeps of pca (Lloyd-Max
    levels, a plan per head)."""

    name: str = "pca_block32"
    pca_format: ClassVar[PcaFormat] = replace(PcaBlock.pca_format, block=BLOCK_TOKENS // 4)


@register
@dataclass(frozen=True)
class PcaBlock32UniformSharedGroupsAllWidths(Pca):
    """pca_block_ugsa with blocks of 32 tokens: the grouped format the fused path reads, keys nearer their pre-RoPE
    frame."""

    name: str = "pca_block32_ugsa"
    pca_format: ClassVar[PcaFormat] = replace(
        PcaBlockUniformSharedGroupsAllWidths.pca_format, block=BLOCK_TOKENS // 4
    )


@register
@dataclass(frozen=True)
class PcaUniformSharedGroupsAllWidths(Pca):
    """pca_block_ugsa with keys turned back by their own position (before RoPE, as pca's): the grouped format a
    kernel would read if it turned each dequantized key tile by its tokens' positions (KVQuant's way) instead of
    one query a block; what the block costs that format."""

    name: str = "pca_ugsa"
    pca_format: ClassVar[PcaFormat] = replace(
        PcaBlockUniformSharedGroupsAllWidths.pca_format, key_frame=PRE, block=0
    )


@register
@dataclass(frozen=True)
class PcaSharedGroupsAllWidths(Pca):
    """pca_ugsa with pca's Lloyd-Max levels (a level table per width) in place of evenly spaced ones: of pca_ugsa's
    distance to pca, what the levels hold and what the per-head plans do."""

    name: str = "pca_gsa"
    pca_format: ClassVar[PcaFormat] = replace(PcaUniformSharedGroupsAllWidths.pca_format, levels=LLOYD)


@register
@dataclass(frozen=True)
class PcaBlock32OwnPairs(Pca):
    """pca_block32_ugsa with the OWN_PAIRS fastest-turning rotary pairs of each key turned back by its own position and
    given a basis block of their own (PcaFormat.own_pairs): a kernel would fold the rest into a query a block and
    turn those channels a token through a small basis; what the rest's block frame costs, pair by pair."""

    name: str = "pca_own32_ugsa"
    pca_format: ClassVar[PcaFormat] = replace(
        PcaBlock32UniformSharedGroupsAllWidths.pca_format, own_pairs=OWN_PAIRS
    )


@register
@dataclass(frozen=True)
class PcaPostUniformGroups(Pca):
    """pca_post with evenly spaced levels and one width per group of 16 components, from GROUP_WIDTHS."""

    name: str = "pca_post_ug"
    pca_format: ClassVar[PcaFormat] = PcaFormat(
        key_frame=POST, levels=UNIFORM, group=16, group_widths=GROUP_WIDTHS
    )
