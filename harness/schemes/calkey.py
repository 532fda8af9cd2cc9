"""`calkey` (KVQuant-style calibrated keys, Hooper et al. 2024, after RoPE): keys quantized per channel with a scale
and zero fitted offline on calibration text (harness/schemes/key_table.py: a KeyTable per layer, each rotary pair
fitted for every position it may take), so a stored key is its codes only, plus optional dense-and-sparse outliers
(`quant.outliers`); values per token as asym_token (groups of group_size along head_dim, fp16 scale and zero).

Format of one key token of one quantized head, x (D,) in any float dtype, with its layer's table (s, z) for the
head (fp16 (D,) each) and k = ceil(outliers * D) outliers:
    x32  = clamp(float32(x), -65504, 65504)
    y    = (x32 - float32(z)) / float32(s)      the channel's range is y in [-1, 1]
    qmax = 2**(b-1) - 1
    code = clamp(floor(y * qmax + 0.5), -qmax, qmax) + qmax        in [0, 2 qmax]: 2**b - 1 levels, 0 exact
    deq  = (code - qmax) * (float32(s) / qmax) + float32(z)
    outliers: the k channels of largest |y| keep x itself (a 2-byte float: bf16 in a bfloat16 model, exact;
    fp16 otherwise, saturating) with their uint8 channel index; deq there is that value.
deq is cast to the store's dtype saturating to its finite range. codes are packed as kernels.reference packs
integer codes (b = 2, 3, 4, 8).

Bytes: a key token costs packed_dim(D, b) + 3 k bytes; the layer's table, an fp16 scale and zero per channel
of each quantized KV head (4 D bytes a head), is held once per store whatever its tokens and batch
(Scheme.table_bytes), and counted in nbytes(). The table reaches a store through the scheme: QuantizedKVCache
binds each layer's scheme to its layer's table (`for_layer`); an unbound calkey scheme cannot build a key store.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from harness.schemes.asym_token import AsymToken
from harness.schemes.base import Store, register
from harness.schemes.key_table import KeyCalibration, KeyTable
from harness.schemes.wrappers import BlockStore, head_index, take_tokens
from kernels import reference
from kernels.layout import FP16_BYTES, FULL_WIDTH

UNBOUND = (  # .format(name=the scheme's name)
    "quant.scheme: {name} stores keys against tables fitted on the calibration windows; none were given "
    "(QuantizedKVCache key_calibration: harness.calibrate.keys.cached_key_calibration)"
)


@register
@dataclass(frozen=True)
class CalKey(AsymToken):
    """Keys against the layer's fitted KeyTable (CalKeyStore), values as asym_token. `table`: the layer's table
    (for_layer binds it; not part of the scheme's identity)."""

    name: str = "calkey"
    table: KeyTable | None = field(default=None, compare=False, repr=False)

    packed: ClassVar[bool] = False
    keeps_outliers: ClassVar[bool] = True
    key_tables: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.key_group_size != self.group_size:
            raise ValueError(
                f"quant.key_group_size: {self.key_group_size} with calkey, whose keys have no groups (a fitted "
                "scale and zero per channel); allowed: null"
            )

    def for_layer(self, layer: int, key_calibration: KeyCalibration | None) -> CalKey:
        if key_calibration is None:
            raise ValueError(UNBOUND.format(name=self.name))
        if self.fitted_levels and key_calibration.levels != self.key_levels:
            raise ValueError(
                f"quant.key_levels: {self.key_levels}, but the key tables given were fitted with "
                f"{key_calibration.levels} levels (harness.calibrate.keys.cached_key_calibration levels=)"
            )
        return replace(self, table=key_calibration.layer(layer))

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> float:
        if role != "key":
            return super().quantized_token_bytes(bits, head_dim, role)
        codes = reference.packed_dim(head_dim, bits)
        return codes + self.outlier_count(head_dim) * (FP16_BYTES + 1)  # outlier values, uint8 indices

    def table_bytes(self, bits: int, head_dim: int, role: str) -> int:
        quantized = role == "key" and bits != FULL_WIDTH
        return 2 * head_dim * FP16_BYTES if quantized else 0  # fp16 scale and zero per channel

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
        if role != "key":
            return super().base_store(bits, head_dim, batch, dtype, device, role, simulate)
        if self.table is None:
            raise ValueError(UNBOUND.format(name=self.name))
        return self.key_store(bits, head_dim, batch, dtype, device, simulate)

    def key_store(
        self, bits: list[int], head_dim: int, batch: int, dtype: torch.dtype, device, simulate: bool
    ):
        """The store of one layer's keys against the bound table."""
        k = self.outlier_count(head_dim)
        return CalKeyStore(bits, head_dim, batch, dtype, device, self.table, k, simulate)


# ---------------------------------------------------------------------------------------------------------
# the format


def outlier_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 2-byte float outliers are kept in: bf16 for a bfloat16 store (its values exactly), fp16 otherwise."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


def saturating_cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 y -> dtype, clamped first to dtype's finite range."""
    fmax = torch.finfo(dtype).max
    return y.clamp(-fmax, fmax).to(dtype)


@dataclass
class Encoded:
    """Key tokens (..., D) of heads at one width in the format of the module docstring."""

    codes: torch.Tensor  # uint8 (..., packed_dim(D, bits))
    outlier_values: torch.Tensor  # 2-byte float (..., k)
    outlier_index: torch.Tensor  # uint8 (..., k)


def quantize(
    x: torch.Tensor, bits: int, scale: torch.Tensor, zero: torch.Tensor, k: int, dtype: torch.dtype
) -> tuple[Encoded, torch.Tensor]:
    """x (B, H, T, D) with the heads' table scale, zero (H, D) fp16 -> (Encoded, its dequantized values
    (B, H, T, D) in dtype)."""
    qmax = (1 << (bits - 1)) - 1
    s, z = scale.float()[:, None], zero.float()[:, None]  # (H, 1, D)
    x32 = x.to(torch.float32).clamp(-reference.FP16_MAX, reference.FP16_MAX)
    y = (x32 - z) / s
    code = torch.floor(y * qmax + 0.5).clamp_(-qmax, qmax).add_(qmax)  # (B, H, T, D), integer-valued
    index = y.abs().topk(k, -1).indices  # (B, H, T, k)
    values = saturating_cast(x.to(torch.float32).gather(-1, index), outlier_dtype(dtype))  # (B, H, T, k)
    encoded = Encoded(reference.pack(code.to(torch.uint8), bits), values, index.to(torch.uint8))
    return encoded, _values(code, encoded, bits, scale, zero, dtype)


def _values(
    code: torch.Tensor,
    encoded: Encoded,
    bits: int,
    scale: torch.Tensor,
    zero: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Dequantized (B, H, T, D) in dtype from integer codes (B, H, T, D) (any dtype) and the outliers."""
    qmax = (1 << (bits - 1)) - 1
    step = scale.float()[:, None] / torch.full((), float(qmax))  # (H, 1, D)
    y = (code.float() - qmax) * step + zero.float()[:, None]
    y = y.scatter(-1, encoded.outlier_index.long(), encoded.outlier_values.float())
    return saturating_cast(y, dtype)


def dequantize(
    encoded: Encoded, bits: int, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The stored key tokens (B, H, T, D) in dtype."""
    code = reference.unpack(encoded.codes, bits, scale.shape[-1])
    return _values(code, encoded, bits, scale, zero, dtype)


# ---------------------------------------------------------------------------------------------------------
# the store


class CalKeyStore(BlockStore):
    """One layer's keys in the calkey format, each quantized head at its width against the layer's table (kept
    for the quantized heads only); 16-bit heads exact. Attention reads blocks of dequantized tokens
    (BlockStore)."""

    def __init__(
        self,
        bits,
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device,
        table: KeyTable,
        outliers: int,
        simulate: bool = False,
    ):
        self.bits = tuple(int(b) for b in bits)
        if tuple(table.scale.shape) != (len(self.bits), head_dim):
            raise ValueError(
                f"key calibration: a table of {tuple(table.scale.shape)} (KV heads, head_dim) for a layer of "
                f"{len(self.bits)} KV heads of head_dim {head_dim}"
            )
        self.head_dim, self.batch, self.dtype, self.device = head_dim, batch, dtype, device
        self.simulate, self.k = simulate, outliers
        self.widths = sorted({b for b in self.bits if b != FULL_WIDTH})
        self.heads = {
            w: torch.tensor([h for h, b in enumerate(self.bits) if b == w], device=device)
            for w in self.widths
        }
        # per width w: the table of its heads, fp16 (Hw, D) each (stored bytes, counted once)
        self.scale = {w: table.scale.to(device).index_select(0, self.heads[w]) for w in self.widths}
        self.zero = {w: table.zero.to(device).index_select(0, self.heads[w]) for w in self.widths}
        empty = functools.partial(torch.empty, batch, dtype=torch.uint8, device=device)
        # per width w, tokens along dim 2: Encoded(codes (B, Hw, T, packed_dim(D, w)), outliers (B, Hw, T, k) x2)
        self.encoded = {
            w: Encoded(
                empty(len(self.heads[w]), 0, reference.packed_dim(head_dim, w)),
                empty(len(self.heads[w]), 0, outliers, dtype=outlier_dtype(dtype)),
                empty(len(self.heads[w]), 0, outliers),
            )
            for w in self.widths
        }
        self.full_heads = head_index(self.bits, False, device)
        self.full = empty(len(self.full_heads), 0, head_dim, dtype=dtype)  # (B, Hf, T, D)
        # simulate only: the full-precision working copy of the dequantized tokens (not stored bytes).
        self._values = empty(len(self.bits), 0, head_dim, dtype=dtype)
        self.length = 0

    def _each(self, change) -> None:
        """Replace every token-major tensor t (tokens along dim 2) by change(t)."""
        for e in self.encoded.values():
            e.codes, e.outlier_values, e.outlier_index = map(
                change, (e.codes, e.outlier_values, e.outlier_index)
            )
        self.full = change(self.full)
        if self.simulate:
            self._values = change(self._values)

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        B, H, Tn, D = x.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        new = torch.empty_like(x, dtype=self.dtype) if self.simulate else None  # (B, H, Tn, D)
        for w in self.widths:
            encoded, values = self.encode(x.index_select(1, self.heads[w]), w)
            old = self.encoded[w]
            old.codes = torch.cat([old.codes, encoded.codes], 2)
            old.outlier_values = torch.cat([old.outlier_values, encoded.outlier_values], 2)
            old.outlier_index = torch.cat([old.outlier_index, encoded.outlier_index], 2)
            if new is not None:
                new.index_copy_(1, self.heads[w], values)
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
        for w, e in self.encoded.items():
            part = Encoded(*(t[:, :, start:end] for t in (e.codes, e.outlier_values, e.outlier_index)))
            out.index_copy_(1, self.heads[w], self.decode(part, w, start, end))
        return out.index_copy_(1, self.full_heads, self.full[:, :, start:end])

    def encode(self, x: torch.Tensor, w: int) -> tuple[Encoded, torch.Tensor]:
        """New key tokens x (B, Hw, Tn, D) of the heads at width w -> (Encoded, their dequantized values)."""
        return quantize(x, w, self.scale[w], self.zero[w], self.k, self.dtype)

    def decode(self, part: Encoded, w: int, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) of the heads at width w, `part` their Encoded -> (B, Hw, end - start, D)."""
        return dequantize(part, w, self.scale[w], self.zero[w], self.dtype)

    def table_nbytes(self) -> int:
        """Bytes of the fitted table the quantized heads read (held once)."""
        return sum(self.scale[w].numel() + self.zero[w].numel() for w in self.widths) * FP16_BYTES

    def keep_last(self, n: int) -> None:
        start = max(self.length - n, 0)
        self._each(lambda t: t[:, :, start:].clone())
        self.length -= start

    def select(self, index: torch.Tensor) -> None:
        self._each(lambda t: take_tokens(t, index, 2))
        self.length = index.shape[1]

    def nbytes(self) -> int:
        tokens = sum(t.numel() * t.element_size() for e in self.encoded.values() for t in vars(e).values())
        return tokens + self.table_nbytes() + self.full.numel() * FP16_BYTES

    def nbytes_fp16(self) -> int:
        return self.batch * len(self.bits) * self.length * self.head_dim * FP16_BYTES
