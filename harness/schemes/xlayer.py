"""`xlayer` (AQUA-KV's cross-layer prediction, Shutova et al. 2025): each layer's keys (before RoPE) and values
predicted linearly, per KV head, from what the layers below already stored, and only the residual stored, in
codebook's format (a Hadamard rotation, Lloyd-Max levels of N(0, 1), one fp16 scale per token and head:
harness/schemes/codebook.py). The predictors are fitted on calibration text (harness/schemes/xlayer_table.py):
full rank (`xlayer`) or rank 32 / 8 (`xlayer_r32`, `xlayer_r8`); on exact inputs, or along the chain at width w
(`xlayer_chain<w>`, `xlayer_pca_chain<w>`, w 2, 3 or 4: on the reconstructions the stores make at w, AQUA-KV's
way; harness/calibrate/xlayer.py).

Format of the tokens [t, t + n) one layer l stores, role `key` or `value`, x (B, H, n, D), P the nearest cached
layer below l (none for the first cached layer) and K^, V^ the reconstructions (before RoPE) of the same tokens
that P and l stored just before:
    y    = keys: x turned back by -p theta at each token's position p (harness/schemes/rotary.py); values: x
    in   = keys: K^_P (every head, flattened); values: [K^_l ; V^_P]          (B, n, in)
    pred = in @ W_h + bias_h per head h (xlayer_table.Predictor)            (B, H, n, D)
    r    = y - pred, stored per head at its width in codebook's format (codes and an fp16 scale)
    y^   = pred + codebook's dequantized r   (a 16-bit head: y itself);  out = keys: y^ turned forward; values: y^
So dequantizing layer l needs P's reconstruction of the same tokens, which needs the layer below P's: the store
reads the layer below as it writes (a chain of the stores of one cache, by layer and role: `Xlayer.for_layer`
starts a new chain at the first cached layer, as QuantizedKVCache binds its layers in order) and keeps its own
reconstruction (`y^`) as its working copy, which attention reads. It runs only as a simulated cache
(quant.simulate=true): a packed-only store would have to rebuild every layer below it at every read (and a sliding
layer below a full one has dropped the tokens it would need). Every row says so (`reads_previous_layer`). A
sliding layer stores each call's tokens whole before it drops what left its window, so a prompt past the window
is predicted whole; a full-precision prefill whose sliding layers already dropped prompt tokens cannot be converted
(QuantizedKVCache.from_prefilled refuses it: harness.cache.cannot_convert; a sweep prefills such a point through
its own cache).

Bytes: a token of a quantized head at width b costs codebook's packed_dim(D, b) + 2 bytes; a quantized head's
predictor (fp16: xlayer_table's map and bias) is held once per store (Scheme.table_bytes reads the bound layer's
shapes). head_dim must be a power of two (the residual's rotation).

`xlayer_pca` stores the full-rank prediction's residual r in pca's format instead (harness/schemes/pca.py, keys'
frame the residual's: no turn), against transforms fitted on the calibration windows' residuals (harness/calibrate/
xlayer.py's fit_residual_pca): z = (r - m) @ U, each component at its plan's width against Lloyd-Max levels times
its scale, y^ = pred + m + zq @ U.T. A token of a head at width w costs w D / 8 bytes (no scale), a quantized head
its predictor and pca's table, 2 D**2 + 5 D bytes; widths pca's (1-6, 8); head_dim a multiple of 8.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from harness.schemes.base import SCHEMES, Scheme, Store, register
from harness.schemes.calkey import saturating_cast
from harness.schemes.codebook import quantize as codebook_quantize
from harness.schemes.pca import PcaStore, check_whole_bytes
from harness.schemes.pca_table import PCA_WIDTHS, PcaLayer, PcaTable, head_table_bytes
from harness.schemes.rotary import TokenPositions, turn
from harness.schemes.wrappers import PositionedBlockStore, head_index
from harness.schemes.xlayer_table import CrossLayerCalibration, CrossLayerLayer, Predictor
from kernels import reference
from kernels.layout import FP16_BYTES, FULL_WIDTH

RANKS = {"xlayer": None, "xlayer_r32": 32, "xlayer_r8": 8}  # registered name -> predictor rank (None: full)
CHAIN_WIDTHS = (2, 3, 4)  # xlayer_chain<w> and xlayer_pca_chain<w>: full rank, fitted along the chain at w
CHAIN = "_chain"
UNBOUND = (
    "quant.scheme: {name} predicts each layer's keys and values from the layer below with maps fitted on the "
    "calibration windows; none were given (QuantizedKVCache key_calibration: harness.calibrate.cached_fit)"
)
SIMULATED_ONLY = (
    "quant.simulate: {name} reconstructs each layer from the reconstruction of the layer below, which only a "
    "simulated cache keeps; allowed: true"
)


@dataclass(frozen=True)
class Xlayer(Scheme):
    """Residuals of the cross-layer prediction in codebook's format (XlayerStore). `fitted`, `chain` and `layer`:
    the layer's predictors, the cache's stores by (layer, role) and the layer's index (for_layer binds them).
    The chain refers to the stores weakly: each store's `inputs` reads the chain, so strong references would make
    every cache a reference cycle, whose tensors only a full garbage collection frees (a passkey run grew by a
    cache a trial)."""

    name: str = "xlayer"
    fitted: CrossLayerLayer | None = field(default=None, compare=False, repr=False)
    chain: weakref.WeakValueDictionary | None = field(default=None, compare=False, repr=False)
    layer: int = field(default=0, compare=False, repr=False)

    head_dim_groups: ClassVar[bool] = False
    rotated: ClassVar[bool] = True  # the residual's Hadamard rotation needs a power-of-two head_dim
    key_tables: ClassVar[bool] = True  # reads parts fitted per layer on calibration text
    fit: ClassVar[str] = "xlayer"
    reads_previous_layer: ClassVar[bool] = True
    no_eviction: ClassVar[str | None] = (
        "a cross-layer prediction's stores (each token predicted from the layer below)"
    )

    @property
    def rank(self) -> int | None:
        return RANKS.get(self.name)  # a chained fit is full rank

    @property
    def chain_width(self) -> int | None:
        """The width its predictors were fitted along the chain at (the `_chain<w>` names: harness/calibrate/
        xlayer.py's fit_chained_calibration), or None: fitted on exact inputs."""
        head, _, width = self.name.rpartition(CHAIN)
        return int(width) if head else None

    @property
    def fit_variant(self) -> tuple[int | None, int | None]:
        return self.rank, self.chain_width

    def for_layer(self, layer: int, key_calibration) -> Xlayer:
        if not isinstance(key_calibration, CrossLayerCalibration) or key_calibration.rank != self.rank:
            raise ValueError(UNBOUND.format(name=self.name))
        if layer == key_calibration.first_layer:  # a new cache binds its layers in order, its first one first
            key_calibration.chain = weakref.WeakValueDictionary()  # the cache's layers hold the stores
        return replace(self, fitted=key_calibration.layer(layer), chain=key_calibration.chain, layer=layer)

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> int:
        return reference.packed_dim(head_dim, bits) + FP16_BYTES  # the residual's codes and fp16 scale

    def table_bytes(self, bits: int, head_dim: int, role: str) -> int:
        if bits == FULL_WIDTH:
            return 0
        if self.fitted is None:
            raise ValueError(UNBOUND.format(name=self.name))
        return self.fitted.role(role).head_nbytes()

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
        if not simulate:
            raise ValueError(SIMULATED_ONLY.format(name=self.name))
        keys = role == "key"
        theta = self.fitted.rotary_frequencies if keys else torch.zeros(0)
        store_type, residual = self._residual_format(role)
        store = store_type(
            bits, head_dim, batch, dtype, device, self.fitted.role(role), theta, self.sink_tokens if keys else 0,
            residual,
        )  # fmt: skip
        self.chain[(self.layer, role)] = store
        store.inputs = functools.partial(self._inputs, role)
        return store

    def _residual_format(self, role: str) -> tuple[type, PcaTable | None]:
        """The store of the residuals' format and its fitted table of `role` (codebook's: none)."""
        return XlayerStore, None

    def _inputs(self, role: str) -> torch.Tensor:
        """The predictor's inputs (B, n, in) float32 for the tokens being stored: the reconstructions (before RoPE)
        the stores below (and, for values, this layer's keys) made of the same tokens just before."""
        if self.fitted.role(role).inputs == 0:  # a bias alone (a layer fitted without inputs)
            return torch.zeros(0)
        previous = self.fitted.previous
        sources = [] if previous is None else [(previous, "key")]
        if role == "value":
            sources = [(self.layer, "key")] + ([] if previous is None else [(previous, "value")])
        parts = []
        for source in sources:
            store = self.chain.get(source)
            if store is None or store.last is None:
                raise RuntimeError(
                    f"xlayer: layer {self.layer} stores {role}s before layer {source[0]} stored its {source[1]}s"
                )
            parts.append(store.last.transpose(1, 2).flatten(2))  # (B, n, H D)
        return torch.cat(parts, -1) if parts else torch.zeros(0)


for _name in [*RANKS, *(f"xlayer{CHAIN}{w}" for w in CHAIN_WIDTHS)]:
    SCHEMES.register(_name)(functools.partial(Xlayer, _name))


@register
@dataclass(frozen=True)
class XlayerPca(Xlayer):
    """The full-rank prediction's residuals in pca's format (XlayerPcaStore; module docstring). `residual_fit`: the
    layer's fitted transforms of them (for_layer binds them)."""

    name: str = "xlayer_pca"
    residual_fit: PcaLayer | None = field(default=None, compare=False, repr=False)

    widths: ClassVar[tuple[int, ...]] = PCA_WIDTHS
    rotated: ClassVar[bool] = False  # pca's basis: head_dim a multiple of 8
    fit: ClassVar[str] = "xlayer_pca"

    @property
    def rank(self) -> int | None:
        return None

    def for_layer(self, layer: int, key_calibration) -> XlayerPca:
        bound = super().for_layer(layer, key_calibration)
        if key_calibration.residual is None:
            raise ValueError(UNBOUND.format(name=self.name))
        return replace(bound, residual_fit=key_calibration.residual.layer(layer))

    def check_head_dim(self, bits: list[int], head_dim: int, role: str) -> None:
        super().check_head_dim(bits, head_dim, role)
        check_whole_bytes(self.name, head_dim)

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> float:
        return bits * head_dim / 8  # the residual's codes, no per-token scale

    def table_bytes(self, bits: int, head_dim: int, role: str) -> int:
        if bits == FULL_WIDTH:
            return 0
        return super().table_bytes(bits, head_dim, role) + head_table_bytes(head_dim)

    def _residual_format(self, role: str) -> tuple[type, PcaTable | None]:
        return XlayerPcaStore, self.residual_fit.role(role)


for _width in CHAIN_WIDTHS:
    SCHEMES.register(f"xlayer_pca{CHAIN}{_width}")(functools.partial(XlayerPca, f"xlayer_pca{CHAIN}{_width}"))


class XlayerStore(PositionedBlockStore):
    """One layer's keys or values as residuals of the cross-layer prediction (module docstring), each quantized head
    at its width; 16-bit heads exact. Keeps its reconstruction (the working copy attention reads) and the last
    appended tokens' reconstruction before RoPE (`last`, what the layer above predicts from)."""

    def __init__(
        self,
        bits,
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device,
        predictor: Predictor,
        theta: torch.Tensor,
        first_position: int = 0,
        residual: PcaTable | None = None,
    ):
        self.bits = tuple(int(b) for b in bits)
        if tuple(predictor.bias.shape) != (len(self.bits), head_dim):
            raise ValueError(
                f"xlayer calibration: a predictor of {tuple(predictor.bias.shape)} (KV heads, head_dim) for a layer "
                f"of {len(self.bits)} KV heads of head_dim {head_dim}"
            )
        self.head_dim, self.batch, self.dtype, self.device = head_dim, batch, dtype, device
        self.predictor = predictor
        self.widths = sorted({b for b in self.bits if b != FULL_WIDTH})
        self.heads = {
            w: torch.tensor([h for h, b in enumerate(self.bits) if b == w], device=device)
            for w in self.widths
        }
        self.quant_heads = head_index(self.bits, True, device)
        self.full_heads = head_index(self.bits, False, device)
        empty = functools.partial(torch.empty, batch, dtype=torch.uint8, device=device)
        self._coding_init(residual)
        self.full = empty(len(self.full_heads), 0, head_dim, dtype=dtype)  # (B, Hf, T, D)
        self.positions = TokenPositions(theta, batch, device, first_position)
        self._values = empty(len(self.bits), 0, head_dim, dtype=dtype)  # the reconstruction (working copy)
        self.last: torch.Tensor | None = (
            None  # (B, H, n, D) float32: the last tokens' reconstruction before RoPE
        )
        self.inputs = None  # () -> (B, n, in): set by the scheme that builds the store
        self.length = 0

    def starts_at(self, position: int) -> None:
        self.positions.starts_at(position, self.length)

    def _coding_init(self, residual: PcaTable | None) -> None:
        """codebook's format of the residuals: per width w, codes uint8 (B, Hw, T, packed_dim(D, w)) and fp16
        scales (B, Hw, T), and the rotation (D, D)."""
        empty = functools.partial(torch.empty, self.batch, dtype=torch.uint8, device=self.device)
        self.h = reference.hadamard(self.head_dim, self.device) if self.widths else None
        self.codes = {
            w: empty(len(self.heads[w]), 0, reference.packed_dim(self.head_dim, w)) for w in self.widths
        }
        self.scale = {w: empty(len(self.heads[w]), 0, dtype=torch.float16) for w in self.widths}

    def code(self, residual: torch.Tensor, predicted: torch.Tensor, restored: torch.Tensor) -> None:
        """Stores the residuals (B, H, Tn, D) float32 of the quantized heads (every head's given; 16-bit heads' are
        not read) and writes predicted + what they dequantize to into restored (B, H, Tn, D) at those heads."""
        for w in self.widths:
            heads = self.heads[w]
            codes, scale, values = codebook_quantize(
                residual.index_select(1, heads), w, torch.float32, self.h
            )
            self.codes[w] = torch.cat([self.codes[w], codes], 2)
            self.scale[w] = torch.cat([self.scale[w], scale], 2)
            restored.index_copy_(1, heads, predicted.index_select(1, heads) + values)

    def _coded_nbytes(self) -> int:
        """Bytes of the stored residuals (their codes, scales and tables)."""
        codes = sum(t.numel() for t in self.codes.values())
        return codes + sum(t.numel() for t in self.scale.values()) * FP16_BYTES

    def _each(self, change) -> None:
        for w in self.widths:
            self.codes[w], self.scale[w] = change(self.codes[w]), change(self.scale[w])
        self.full, self._values = change(self.full), change(self._values)

    def append(self, x: torch.Tensor) -> torch.Tensor:
        B, H, Tn, D = x.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        angle = self.positions.angle(self.positions.new(Tn))  # (1, 1, Tn, R / 2)
        y = turn(x.to(torch.float32).clamp(-reference.FP16_MAX, reference.FP16_MAX), -angle)  # (B, H, Tn, D)
        inputs = self.inputs()
        if inputs.numel() and inputs.shape[:2] != (B, Tn):
            raise RuntimeError(
                f"xlayer: the layer below stored {tuple(inputs.shape[:2])} (batch, tokens), not {(B, Tn)}"
            )
        predicted = self.predictor.apply(inputs if inputs.numel() else y.new_zeros(B, Tn, 0))  # (B, H, Tn, D)
        restored = y.clone()  # 16-bit heads exact
        if self.widths:
            self.code(y - predicted, predicted, restored)
        self.last = restored
        self.full = torch.cat([self.full, x.index_select(1, self.full_heads)], 2)
        out = saturating_cast(turn(restored, angle), self.dtype)
        out.index_copy_(1, self.full_heads, x.index_select(1, self.full_heads))
        self._values = torch.cat([self._values, out], 2)
        self.length += Tn
        return self._values

    def block(self, start: int, end: int) -> torch.Tensor:
        """The reconstructed tokens [start, end) (the working copy: dequantizing needs the layer below's)."""
        return self._values[:, :, start:end]

    def nbytes(self) -> int:
        tables = len(self.quant_heads) * self.predictor.head_nbytes()
        return self._coded_nbytes() + tables + self.positions.nbytes() + self.full.numel() * FP16_BYTES

    def nbytes_fp16(self) -> int:
        return self.batch * len(self.bits) * self.length * self.head_dim * FP16_BYTES


class XlayerPcaStore(XlayerStore):
    """An XlayerStore whose residuals are stored in pca's format (harness/schemes/pca.py's PcaStore over the
    quantized heads, against the residuals' own fitted transforms: no turn, their frame the prediction's)."""

    def _coding_init(self, residual: PcaTable | None) -> None:
        if residual is None:
            raise ValueError(UNBOUND.format(name="xlayer_pca"))
        quant = self.quant_heads.cpu()
        table = PcaTable(
            residual.mean.index_select(0, quant),
            residual.basis.index_select(0, quant),
            {w: plan.index_select(0, quant) for w, plan in residual.plans.items()},
            {w: scale.index_select(0, quant) for w, scale in residual.scales.items()},
        )
        quantized = [b for b in self.bits if b != FULL_WIDTH]
        self.coded = PcaStore(
            quantized, self.head_dim, self.batch, torch.float32, self.device, table, torch.zeros(0)
        )

    def code(self, residual: torch.Tensor, predicted: torch.Tensor, restored: torch.Tensor) -> None:
        start, heads = self.coded.length, self.quant_heads
        self.coded.append(residual.index_select(1, heads))
        restored.index_copy_(
            1, heads, predicted.index_select(1, heads) + self.coded.block(start, self.coded.length)
        )

    def _coded_nbytes(self) -> int:
        return self.coded.nbytes()

    def _each(self, change) -> None:  # the residuals' store keeps its own rows and tokens (below)
        self.full, self._values = change(self.full), change(self._values)

    def take_rows(self, index: torch.Tensor) -> None:
        self.coded.take_rows(index)
        super().take_rows(index)

    def keep_first(self, n: int) -> None:
        self.coded.keep_first(n)
        super().keep_first(n)

    def keep_last(self, n: int) -> None:
        self.coded.keep_last(n)
        super().keep_last(n)

    def select(self, index: torch.Tensor) -> None:
        self.coded.select(index)
        super().select(index)
