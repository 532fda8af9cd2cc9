"""`cq2`, `cq4` (coupled quantization, Zhang et al. 2024): keys turned back before RoPE and values, each group of c
consecutive channels (2 or 4) coded jointly as the index of the nearest of 2**(c b) centroids fitted per layer, KV
head and group by k-means on calibration text (harness/schemes/cq_table.py). No per-token scale; the codebooks are
counted.

Format of one token of one quantized head of `role` at sequence position p, x (D,), at b bits, the head's codebooks
C (D / c, 2**(c b), c) fp16:
    y    = keys: x turned back by -p theta (harness/schemes/rotary.py); values: x       (float32, clamped to fp16)
    code = per group g, the index of the centroid of C[g] nearest y[g c : g c + c] (squared distance summed
           elementwise, ties to the lower index), packed c b bits a group (harness/schemes/bitstream.py)
    out  = C[g][code_g] for every g, keys turned forward; cast to the store's dtype saturating
Bytes: D b / 8 a token and head; the codebooks, D 2**(c b) 2 bytes per quantized head at width b, held once per
store. head_dim must be a multiple of 8.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from harness.schemes.base import SCHEMES, Scheme, Store
from harness.schemes.bitstream import layout, pack, unpack
from harness.schemes.calkey import saturating_cast
from harness.schemes.cq_table import CQ_WIDTHS, CqCalibration, CqLayer, CqTable, nearest_centroid
from harness.schemes.rotary import TokenPositions, turn
from harness.schemes.wrappers import PositionedBlockStore, head_index
from kernels import reference
from kernels.layout import FP16_BYTES, FULL_WIDTH

CHANNELS = {"cq2": 2, "cq4": 4}  # registered name -> channels per group
UNBOUND = (
    "quant.scheme: {name} codes channel groups against codebooks fitted on the calibration windows; none were "
    "given (QuantizedKVCache key_calibration: harness.calibrate.cached_fit)"
)


@dataclass(frozen=True)
class Cq(Scheme):
    """Channel groups coded jointly against fitted codebooks (CqStore). `fitted`: the layer's codebooks
    (for_layer binds them)."""

    name: str = "cq2"
    fitted: CqLayer | None = field(default=None, compare=False, repr=False)

    head_dim_groups: ClassVar[bool] = False
    key_tables: ClassVar[bool] = True
    fit: ClassVar[str] = "cq"

    def __post_init__(self):
        object.__setattr__(self, "widths", CQ_WIDTHS[self.channels])
        super().__post_init__()

    @property
    def channels(self) -> int:
        return CHANNELS[self.name]

    @property
    def fit_variant(self) -> int:
        return self.channels

    def for_layer(self, layer: int, key_calibration) -> Cq:
        if not isinstance(key_calibration, CqCalibration) or key_calibration.channels != self.channels:
            raise ValueError(UNBOUND.format(name=self.name))
        return replace(self, fitted=key_calibration.layer(layer))

    def check_head_dim(self, bits: list[int], head_dim: int, role: str) -> None:
        super().check_head_dim(bits, head_dim, role)
        if head_dim % 8:
            raise ValueError(f"quant.scheme: {self.name} needs a head_dim that is a multiple of 8")

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> float:
        return bits * head_dim / 8

    def table_bytes(self, bits: int, head_dim: int, role: str) -> int:
        return 0 if bits == FULL_WIDTH else head_dim * (1 << (self.channels * bits)) * FP16_BYTES

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
        first = self.sink_tokens if keys else 0
        table = self.fitted.role(role)
        return CqStore(bits, head_dim, batch, dtype, device, self.channels, table, theta, first, simulate)


for _name in CHANNELS:
    SCHEMES.register(_name)(functools.partial(Cq, _name))


class CqStore(PositionedBlockStore):
    """One layer's keys or values in a cq format (module docstring), each quantized head at its width; 16-bit heads
    exact. Attention reads blocks of dequantized tokens (BlockStore)."""

    def __init__(
        self,
        bits,
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device,
        channels: int,
        table: CqTable,
        theta: torch.Tensor,
        first_position: int = 0,
        simulate: bool = False,
    ):
        self.bits = tuple(int(b) for b in bits)
        self.head_dim, self.batch, self.dtype, self.device = head_dim, batch, dtype, device
        self.channels, self.simulate = channels, simulate
        self.widths = sorted({b for b in self.bits if b != FULL_WIDTH})
        self.heads = {
            w: torch.tensor([h for h, b in enumerate(self.bits) if b == w], device=device)
            for w in self.widths
        }
        for w in self.widths:
            shape = tuple(table.codebooks[w].shape[:2])
            if shape != (len(self.bits), head_dim // channels):
                raise ValueError(
                    f"cq calibration: codebooks of {shape} (KV heads, groups) for a layer of {len(self.bits)} KV "
                    f"heads of head_dim {head_dim}"
                )
        # per width w: its heads' codebooks fp16 (Hw, G, 2**(c w), c), stored bytes (counted once)
        self.books = {w: table.codebooks[w].to(device).index_select(0, self.heads[w]) for w in self.widths}
        groups = head_dim // channels
        self.layout = {w: layout(torch.full((len(self.heads[w]), groups), channels * w)) for w in self.widths}
        empty = functools.partial(torch.empty, batch, dtype=torch.uint8, device=device)
        self.codes = {w: empty(len(self.heads[w]), 0, self.layout[w].nbytes) for w in self.widths}
        self.full_heads = head_index(self.bits, False, device)
        self.full = empty(len(self.full_heads), 0, head_dim, dtype=dtype)  # (B, Hf, T, D)
        self.positions = TokenPositions(theta, batch, device, first_position)
        self._values = empty(len(self.bits), 0, head_dim, dtype=dtype)  # simulate only: the working copy
        self.length = 0

    def starts_at(self, position: int) -> None:
        self.positions.starts_at(position, self.length)

    def _each(self, change) -> None:
        for w in self.widths:
            self.codes[w] = change(self.codes[w])
        self.full = change(self.full)
        if self.simulate:
            self._values = change(self._values)

    def _restore(self, code: torch.Tensor, w: int, angle: torch.Tensor) -> torch.Tensor:
        """Codes (B, Hw, T, G) -> the tokens (B, Hw, T, D) in the store's dtype."""
        books = self.books[w].float()  # (Hw, G, K, c)
        B, Hw, T, G = code.shape
        index = code.permute(1, 3, 0, 2).reshape(Hw, G, B * T, 1).expand(-1, -1, -1, self.channels)
        y = (
            books.gather(2, index)
            .view(Hw, G, B, T, self.channels)
            .permute(2, 0, 3, 1, 4)
            .reshape(B, Hw, T, -1)
        )
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
            y = turn(part, -angle)  # (B, Hw, Tn, D)
            Hw = y.shape[1]
            groups = y.view(B, Hw, Tn, D // self.channels, self.channels)
            code = (
                torch.stack(
                    [
                        nearest_centroid(
                            groups[:, h].reshape(B * Tn, -1, self.channels), self.books[w][h].float()
                        )
                        for h in range(Hw)
                    ],
                    1,
                )
                .view(B, Tn, Hw, -1)
                .transpose(1, 2)
            )  # fmt: skip  (B, Hw, Tn, G)
            self.codes[w] = torch.cat([self.codes[w], pack(code, self.layout[w])], 2)
            if new is not None:
                new.index_copy_(1, self.heads[w], self._restore(code, w, angle))
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
            out.index_copy_(1, self.heads[w], self._restore(code, w, angle))
        return out.index_copy_(1, self.full_heads, self.full[:, :, start:end])

    def nbytes(self) -> int:
        codes = sum(t.numel() for t in self.codes.values())
        books = sum(t.numel() for t in self.books.values()) * FP16_BYTES
        return codes + books + self.positions.nbytes() + self.full.numel() * FP16_BYTES

    def nbytes_fp16(self) -> int:
        return self.batch * len(self.bits) * self.length * self.head_dim * FP16_BYTES
