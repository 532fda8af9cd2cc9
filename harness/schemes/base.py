"""The scheme interface: `Scheme` (a named storage format with its options), the `Store` protocol its stores
satisfy, the byte model (`Scheme.token_bytes`) and the registry of names (`SCHEMES`, `quant.scheme`).

A scheme turns the new K or V tokens of a layer (B, Hkv, Tn, D), each KV head at its own width (16 = kept
unquantized), into stored form and back. A family (one file of harness/schemes) subclasses Scheme: it says how
one token of one head is stored (`base_store`, `quantized_token_bytes`) and declares what callers ask instead of
testing names (`widths`, `symmetric`, `packed`, `default_residual`, ...). Options every scheme has:
`group_size`, `key_group_size` (the keys' groups; None means group_size), `sink_tokens` (the first n tokens of
the sequence kept unquantized) and `residual` (the R most recent tokens kept unquantized; None means the
scheme's `default_residual`); `new_store` wraps the family's base store in the wrappers of
harness/schemes/wrappers.py for them. A role's group (`role_group_size`) runs along head_dim in a per-token
format, along the sequence where the role is quantized per channel (kivi's keys).

`token_bytes(bits, head_dim, role)` is THE byte model: the bytes of one stored token of one head in `role`
(keys and values may be stored apart), which the cache's nbytes() reports (tests/harness/test_schemes_table.py
checks it against every store), the capacity arithmetic (harness/capacity.py) sums and a bytes budget
(harness.policies) prices. `table_bytes(bits, head_dim, role)` is its fixed part: bytes a store holds once per
quantized KV head whatever its tokens and batch (calkey's fitted key tables; 0 for every other scheme), which
nbytes() and harness.capacity count; a bytes budget prices tokens, so it leaves them out.

A scheme that reads parts fitted offline per layer (`key_tables`: calkey's key tables, pca's transforms; `fit` says
which, harness.calibrate.FITS) is bound to its layer's part by `for_layer` (QuantizedKVCache does it from its
key_calibration); every other scheme ignores the calibration. Where
that table holds fitted key levels (`fitted_levels`: nuqkey), `key_levels` says how they were fitted (k-means, or
weighted by the loss's Fisher information) and for_layer refuses tables fitted the other way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import ClassVar, Protocol, runtime_checkable

import torch

from harness.registry import Registry, unknown_name_message
from harness.schemes.key_table import KMEANS, KeyCalibration, check_key_levels
from harness.schemes.wrappers import ResidualStore, SinkStore
from kernels import reference
from kernels.layout import FP16_BYTES, FULL_WIDTH

ROLES = ("key", "value")
OUTLIER_INDEX_LIMIT = 256  # outlier channel (or component) indices are uint8


@runtime_checkable
class Store(Protocol):
    """One layer's keys or values for a batch, each KV head at its own width (16 = unquantized).

    The torch path of harness/cache/quantized.py uses nothing else. Attention reads a store one block of tokens at
    a time through kernels.packed_attention's `values`: a kernels.layout.PackedStore directly, any other store
    through its method block(start, end) -> (B, Hkv, end - start, D), dequantized from the stored form. A store
    whose blocks are rotated (rotate+, codebook) also has turn(x): x (B, Hkv, R, D) with its quantized heads
    rotated, which attention applies to the queries of the keys and to the output of the values instead.
    """

    length: int  # tokens held
    batch: int

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        """Store new tokens x (B, Hkv, Tn, D); with `simulate` return the dequantized stored tokens
        (B, Hkv, length, D) from a full-precision working copy the store keeps, else keep only the stored form
        and return None."""

    def dequantize(self) -> torch.Tensor:
        """The stored tokens (B, Hkv, length, D), recomputed from the stored form."""

    def keep_last(self, n: int) -> None:
        """Evict all but the last n tokens (sliding-window layers)."""

    def select(self, index: torch.Tensor) -> None:
        """Keep the tokens at sorted positions index (B, n_keep), per batch row (token eviction)."""

    def take_rows(self, index: torch.Tensor) -> None:
        """Keep the batch rows at index (n,) int64, in any order and with repeats (beam search's reordering, a
        batch repeated or narrowed)."""

    def keep_first(self, n: int) -> None:
        """Drop every token from the n-th on, as if they had never been appended (a rollback: assisted generation's
        rejected draft tokens); only where the scheme allows it (Scheme.no_rollback is None)."""

    def nbytes(self) -> int:
        """Bytes of every stored tensor for the tokens held (unquantized tokens at 2 bytes per element)."""

    def nbytes_fp16(self) -> int:
        """Bytes an unquantized fp16 cache would hold for the same tokens."""


def _positive(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}: {value!r} is not a positive integer")
    return value


def _fraction(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{key}: {value!r} is not allowed; allowed: a fraction in [0, 1)")
    return value


def _non_negative(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key}: {value!r} is not a non-negative integer")
    return value


@dataclass(frozen=True)
class Scheme:
    """A named storage scheme with its options; `new_store` makes the store of one layer's keys or values.

    A family sets its `name` as the field's default and the class attributes below; rotate+<name> wraps it
    (harness/schemes/rotate.py).
    """

    name: str
    group_size: int = 32
    sink_tokens: int = 0
    residual: int | None = None  # None: default_residual
    key_group_size: int | None = None  # None: group_size
    outliers: float = 0.0  # the share of each key's channels kept in fp16 (keeps_outliers schemes only)
    key_levels: str = KMEANS  # how the fitted key levels weigh calibration keys (fitted_levels schemes only)

    widths: ClassVar[tuple[int, ...]] = (
        reference.WIDTHS
    )  # the quantized widths it stores (16 is always allowed)
    symmetric: ClassVar[bool] = False  # absmax codes, no zero (kernels.reference's symmetric flag)
    # Stored as a plain kernels.layout.PackedStore of per-token groups: what the Triton kernels
    # (kernels/quantize.py, decode_attention.py) and the claim's quantize-dequantize attention read.
    packed: ClassVar[bool] = False
    default_residual: ClassVar[int] = 0  # the recent tokens kept unquantized when residual is None
    head_dim_groups: ClassVar[bool] = (
        True  # quantizes groups of group_size along head_dim (some role at least)
    )
    rotated: ClassVar[bool] = False  # rotates head_dim by a Hadamard matrix (a power-of-two head_dim)
    no_eviction: ClassVar[str | None] = None  # what keeps single tokens from being evicted, if anything does
    keeps_outliers: ClassVar[bool] = False  # stores quant.outliers of each key in fp16 (calkey)
    key_tables: ClassVar[bool] = False  # it reads parts fitted per layer on calibration text (calkey, pca)
    fit: ClassVar[str] = "key_tables"  # which parts, when key_tables (harness.calibrate.FITS)
    # its stores predict each layer from the layer below's reconstruction (xlayer): a simulated cache only
    reads_previous_layer: ClassVar[bool] = False
    fitted_levels: ClassVar[bool] = False  # that table holds fitted key levels (nuqkey), fitted key_levels

    def __post_init__(self):
        SCHEMES.get(self.name)  # an unknown name is the registry's one-line error
        _positive("quant.group_size", self.group_size)
        if self.key_group_size is None:
            object.__setattr__(self, "key_group_size", self.group_size)
        _positive("quant.key_group_size", self.key_group_size)
        _non_negative("quant.sink_tokens", self.sink_tokens)
        if self.residual is None:
            object.__setattr__(self, "residual", self.default_residual)
        _non_negative("quant.residual", self.residual)
        _fraction("quant.outliers", self.outliers)
        if self.outliers and not self.keeps_outliers:
            keep = [name for name in SCHEMES if getattr(SCHEMES.get(name), "keeps_outliers", False)]
            raise ValueError(
                f"quant.outliers: {self.outliers!r} with quant.scheme {self.name}, which keeps no outliers; "
                f"allowed: 0, or a scheme that keeps them ({', '.join(keep)})"
            )
        check_key_levels(self.key_levels)
        if self.key_levels != KMEANS and not self.fitted_levels:
            fitted = [name for name in SCHEMES if getattr(SCHEMES.get(name), "fitted_levels", False)]
            raise ValueError(
                f"quant.key_levels: {self.key_levels} with quant.scheme {self.name}, which fits no key levels; "
                f"allowed: {KMEANS}, or a scheme with fitted levels ({', '.join(fitted)})"
            )

    # ---------------------------------------------------------------------------------------- a family's part

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
        """The store of every token of one layer's keys or values in this format (no sink or residual tokens)."""
        raise NotImplementedError

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> float:
        """Bytes of one token of one head of `role` stored at `bits` (a width of `widths`), scales and zeros
        included (per channel: a group's bytes spread over its tokens)."""
        raise NotImplementedError

    def table_bytes(self, bits: int, head_dim: int, role: str) -> int:
        """Bytes a store of `role` holds once per KV head at `bits`, whatever its tokens and batch (a fitted table);
        0 unless the family keeps one."""
        return 0

    def for_layer(self, layer: int, key_calibration: KeyCalibration | None) -> Scheme:
        """The scheme that stores decoder layer `layer`, given the model's fitted key tables (None: none were
        fitted): this scheme itself, unless its keys read a table (key_tables), which it binds or, without one,
        a one-line ValueError."""
        return self

    def per_channel(self, role: str) -> bool:
        """Whether tokens of `role` are quantized per channel over groups of role_group_size(role) tokens (moved
        to the base store a whole group at a time, so up to residual + g - 1 recent tokens stay unquantized)."""
        return False

    def role_group_size(self, role: str) -> int:
        """The group size of `role`: key_group_size for keys, group_size for values."""
        return self.key_group_size if role == "key" else self.group_size

    def group_key(self, role: str) -> str:
        """The config key that sets `role`'s group size (for error messages): quant.key_group_size for keys
        grouped apart from the values, else quant.group_size."""
        apart = role == "key" and self.key_group_size != self.group_size
        return "quant.key_group_size" if apart else "quant.group_size"

    # ------------------------------------------------------------------------------------------ what callers ask

    @property
    def fit_variant(self) -> object:
        """What distinguishes this scheme's fitted parts from another of the same `fit` (xlayer: the rank; pca's
        family: its PcaFormat); None. A run keeps one fit per fit, fit_variant, span and levels in memory."""
        return None

    @property
    def no_rollback(self) -> str | None:
        """What keeps a store from dropping its newest tokens as if they had never come (Store.keep_first), if
        anything does: a window of recent tokens kept unquantized quantizes older ones as new tokens arrive, and a
        rollback cannot give those back their full precision."""
        if any(self.per_channel(role) for role in ROLES):
            return (
                f"quant.scheme {self.name} quantizes keys per channel once a group of {self.key_group_size} has "
                "left its recent window (a per-token scheme with quant.residual=0 can)"
            )
        if self.residual:
            return (
                f"quant.residual={self.residual} quantizes the oldest recent token as each new one arrives "
                "(quant.residual=0 can)"
            )
        return None

    @property
    def fusable(self) -> bool:
        """Whether the Triton kernels can write and read this scheme (plain per-token formats, and the
        foldable pca formats: harness/schemes/pca.py)."""
        return self.packed and self.sink_tokens == 0 and self.residual == 0

    def check_kernel(self, key_bits, value_bits, k_dim: int, v_dim: int, sliding: bool) -> None:
        """NotImplementedError naming what the Triton kernels cannot store of one layer of this (fusable) scheme:
        keys and values at their widths and head_dims, `sliding` for a sliding-window layer."""
        from kernels.quantize import check_group_size, check_widths  # imports triton: the triton backend only

        for widths, dim, group in (
            (key_bits, k_dim, self.key_group_size),
            (value_bits, v_dim, self.group_size),
        ):
            check_widths(widths, dim)
            if any(b != FULL_WIDTH for b in widths):
                check_group_size(group, dim)
        if v_dim != k_dim:
            raise NotImplementedError(
                f"the Triton kernels need key and value head_dim equal; got {k_dim}, {v_dim}"
            )

    def kernel_store(self, bits, head_dim: int, batch: int, dtype: torch.dtype, device, role: str) -> Store:
        """The base store the triton backend writes and its decode kernel reads (a packed format's own)."""
        return self.base_store(bits, head_dim, batch, dtype, device, role, False)

    def decode_kernel(self):
        """The fused decode step over this scheme's triton stores, f(q (B, Hq, D), k_store, v_store, sm_scale,
        length=None) -> (B, Hq, D); None: the kernels' own (kernels.decode_attention.decode_attention)."""
        return None

    def packed_decode(self):
        """A decode step of the packed torch path over this scheme's stores that dequantizes no stored token,
        f(q (B, Hq, D), k_store, v_store, sm_scale, mask) -> (B, Hq, D) float32, or None from f for stores it cannot
        read so; None: the path's blockwise dequantizing read (kernels/packed_attention.py) always."""
        return None

    def label(self) -> str:
        """A short readable name, e.g. 'asym_token g32', 'kivi g32 kg128', 'kivi g32 sink_tokens=4 residual=16' or
        'codebook' (group sizes only where the scheme quantizes groups)."""
        parts = [self.name]
        if self.head_dim_groups:
            parts.append(f"g{self.group_size}")
            if self.key_group_size != self.group_size:
                parts.append(f"kg{self.key_group_size}")
        if self.sink_tokens:
            parts.append(f"sink_tokens={self.sink_tokens}")
        if self.residual != self.default_residual:
            parts.append(f"residual={self.residual}")
        if self.outliers:
            parts.append(f"outliers={self.outliers:g}")
        if self.key_levels != KMEANS:
            parts.append(f"{self.key_levels} levels")
        return " ".join(parts)

    def token_bytes(self, bits: int, head_dim: int, role: str) -> float:
        """Bytes of one stored token of one head of `role` at `bits` (16: unquantized, 2 bytes per element): the
        byte model of the cache's nbytes(), harness.capacity and the bytes budget. A per-channel role's group
        bytes are spread over its g tokens (a fraction where g does not divide them)."""
        if role not in ROLES:
            raise ValueError(f"role: unknown {role!r}; allowed: {', '.join(ROLES)}")
        if bits == FULL_WIDTH:
            return head_dim * FP16_BYTES
        if bits not in self.widths:
            allowed = ", ".join(map(str, [*self.widths, FULL_WIDTH]))
            raise ValueError(f"bits: {bits} with quant.scheme {self.name}; allowed: {allowed}")
        group = self.role_group_size(role)
        if self.head_dim_groups and not self.per_channel(role) and head_dim % group:
            raise ValueError(f"{self.group_key(role)}: {group} does not divide head_dim {head_dim}")
        return self.quantized_token_bytes(bits, head_dim, role)

    def check_widths(self, widths, key: str = "policy.widths") -> None:
        """ValueError naming `key` (where the widths came from) for a width this scheme does not store (fp8: 8
        bits only)."""
        bad = sorted({int(w) for w in widths} - {*self.widths, FULL_WIDTH})
        if bad:
            stored = ", ".join(map(str, self.widths))
            allowed = ", ".join(map(str, [*self.widths, FULL_WIDTH]))
            raise ValueError(
                f"{key}: {bad} with quant.scheme {self.name}, which stores quantized heads at {stored} bits; "
                f"allowed: {allowed}"
            )

    def outlier_count(self, head_dim: int) -> int:
        """k = ceil(outliers * head_dim) outliers per key token of a quantized head (keeps_outliers schemes)."""
        return math.ceil(round(self.outliers * head_dim, 9))

    def check_head_dim(self, bits: list[int], head_dim: int, role: str) -> None:
        """ValueError unless this scheme can store heads of `head_dim` at `bits` in `role`."""
        if role == "key" and self.outliers and head_dim > OUTLIER_INDEX_LIMIT:
            raise ValueError(
                f"quant.outliers: channel indices are stored as uint8, so head_dim must be <= "
                f"{OUTLIER_INDEX_LIMIT}; the model's is {head_dim}; allowed: 0"
            )
        quantized = any(b != FULL_WIDTH for b in bits)
        group = self.role_group_size(role)
        if quantized and self.head_dim_groups and not self.per_channel(role) and head_dim % group:
            raise ValueError(
                f"{self.group_key(role)}: {group} does not divide the model's head_dim {head_dim}"
            )
        if self.rotated and head_dim & (head_dim - 1):
            raise ValueError(
                f"quant.scheme: {self.name} needs a power-of-two head_dim; the model's is {head_dim}"
            )

    def new_store(
        self,
        bits: list[int],
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device,
        role: str,
        simulate: bool = False,
        kernel: bool = False,
    ) -> Store:
        """The store of one layer's keys or values (`role`): the family's base store, wrapped for sink tokens
        and the residual window.

        `simulate`: the store also keeps a full-precision working copy and append returns it (quant.simulate);
        otherwise it holds only the stored form and attention reads that (kernels/packed_attention.py).
        `kernel`: the base store is the one the Triton kernels read (kernel_store; the triton backend).
        """
        if role not in ROLES:
            raise ValueError(f"role: unknown {role!r}; allowed: {', '.join(ROLES)}")
        self.check_head_dim(bits, head_dim, role)
        self.check_widths(bits, "bits")
        if kernel:
            store = self.kernel_store(bits, head_dim, batch, dtype, device, role)
        else:
            store = self.base_store(bits, head_dim, batch, dtype, device, role, simulate)
        shape = (len(bits), head_dim, batch, dtype, device)
        per_channel = self.per_channel(role)
        if self.residual or per_channel:
            chunk = self.role_group_size(role) if per_channel else 1
            store = ResidualStore(store, self.residual, chunk, *shape, simulate=simulate)
        if self.sink_tokens:
            store = SinkStore(store, self.sink_tokens, *shape, simulate=simulate)
        return store


# name -> the scheme's constructor (its options, SCHEME_OPTIONS, as keywords)
SCHEMES: Registry[Callable[..., Scheme]] = Registry("quant.scheme")
SCHEME_OPTIONS = tuple(f.name for f in fields(Scheme) if f.name != "name")  # every option of every scheme
POINT_KEYS = {"name": "scheme"}  # field -> grid point key, where they differ


def register(cls: type[Scheme]) -> type[Scheme]:
    """Class decorator: a scheme family joins SCHEMES under its `name` (the field's default)."""
    return SCHEMES.register(cls.name)(cls)


def get_scheme(name: str, group_size: int = 32, **options) -> Scheme:
    """The scheme `name` with its options (SCHEME_OPTIONS: group_size, the one given by position, and the others
    by keyword; a missing one takes its default); ValueError naming an unknown name or option."""
    unknown = sorted(set(options) - set(SCHEME_OPTIONS))
    if unknown:
        raise ValueError(f"{unknown[0]}: not an option of a scheme; allowed: {', '.join(SCHEME_OPTIONS)}")
    return SCHEMES.get(name)(group_size=group_size, **options)


def from_point(point: Mapping) -> Scheme:
    """The scheme of a grid point, a result row or a saved allocation (`point_fields`): `scheme` names it, its
    options come from their point keys (a missing key takes the option's default, a key it has no option for is
    ignored); ValueError naming the key."""
    name = point.get("scheme")
    if not isinstance(name, str):
        raise ValueError(unknown_name_message(SCHEMES.key, name, SCHEMES.names()))
    return SCHEMES.get(name)(**{key: point[key] for key in SCHEME_OPTIONS if key in point})


def point_fields(scheme: Scheme) -> dict:
    """A scheme as a grid point's quant fields (the inverse of from_point): `scheme` and every option."""
    return {POINT_KEYS.get(f.name, f.name): getattr(scheme, f.name) for f in fields(Scheme)}


def default_residual(name: str) -> int:
    """The residual window scheme `name` keeps when quant.residual is None (0 for a name that is not registered:
    validation reports it)."""
    return get_scheme(name).residual if name in SCHEMES else 0


def packed_names() -> list[str]:
    """The schemes stored as a plain PackedStore (Scheme.packed)."""
    return [name for name in SCHEMES if get_scheme(name).packed]


def check_backend(scheme: Scheme, backend: str) -> str:
    """The backend a cache of `scheme` runs: auto falls back to torch where the Triton kernels cannot store the
    scheme; an explicit triton there is a ValueError."""
    if scheme.fusable:
        return backend
    if backend != "triton":
        return "torch"
    fused = [name for name in SCHEMES.names() if get_scheme(name).fusable and not get_scheme(name).packed]
    raise ValueError(
        f"quant.backend: triton supports only {' and '.join(packed_names())} without sink_tokens, residual or "
        f"rotation, and {', '.join(fused)} without residual; got quant.scheme={scheme.name} "
        f"sink_tokens={scheme.sink_tokens} residual={scheme.residual}; allowed: auto, torch"
    )
