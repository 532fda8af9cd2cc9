"""Quantization schemes by name: how one layer's keys and values are stored.

A scheme turns the new K or V tokens of a layer (B, Hkv, Tn, D), each KV head at its own width, into stored form
and back. The bit-level formats live in kernels/reference.py, the per-layer layouts in kernels/layout.py
(PackedStore) and harness/stores.py; this module maps a configured name (`quant.scheme`) and its options to them.
- `asym_token` (like llama.cpp q4_1 / q8_1): per token, groups of g along head_dim, min/max, fp16 scale and zero.
- `sym_token` (like q4_0 / q8_0): per token, groups of g, absmax, fp16 scale.
- `kivi`: keys per channel over groups of g tokens along the sequence, values as asym_token; keys move to
  quantized storage a whole group at a time, so up to residual + g - 1 recent keys stay unquantized.
- `fp8`: e4m3 with an fp16 absmax scale per (token, head); quantized heads must be 8-bit.
- `rotate+<scheme>`: an orthonormal Hadamard rotation of head_dim before quantizing, undone after (head_dim a
  power of two).
Options of every scheme: `sink_tokens` (the first n tokens of the sequence kept unquantized) and `residual` (the
R most recent tokens kept unquantized; None means the scheme's default: 32 for kivi, 0 otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.registry import unknown_name_message
from harness.stores import ChannelStore, Fp8Store, ResidualStore, RotatedStore, SinkStore
from kernels.layout import FULL_WIDTH, PackedStore

BASE_SCHEMES = ("asym_token", "sym_token", "kivi", "fp8")
ROTATE = "rotate+"
DEFAULT_RESIDUAL = {"kivi": 32}
FUSABLE = (
    "asym_token",
    "sym_token",
)  # what the Triton kernels read (kernels/quantize.py, decode_attention.py)
FP8_WIDTHS = (8, FULL_WIDTH)
ROLES = ("key", "value")


def scheme_names() -> list[str]:
    return [*BASE_SCHEMES, *(ROTATE + name for name in BASE_SCHEMES)]


def default_residual(name: str) -> int:
    """The residual window a scheme keeps when quant.residual is None."""
    return DEFAULT_RESIDUAL.get(name.removeprefix(ROTATE), 0)


def _non_negative(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key}: {value!r} is not a non-negative integer")
    return value


@dataclass(frozen=True)
class Scheme:
    """A named storage scheme with its options; `new_store` makes the store of one layer's keys or values."""

    name: str
    group_size: int = 32
    sink_tokens: int = 0
    residual: int | None = None  # None: default_residual(name)

    def __post_init__(self):
        if self.name not in scheme_names():
            raise ValueError(unknown_name_message("quant.scheme", self.name, scheme_names()))
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"quant.group_size: {self.group_size!r} is not a positive integer")
        if self.base == "kivi" and self.group_size % 8:
            raise ValueError(
                f"quant.group_size: {self.group_size} with kivi, whose key codes pack g tokens per channel "
                "into whole bytes; allowed: a multiple of 8"
            )
        _non_negative("quant.sink_tokens", self.sink_tokens)
        if self.residual is None:
            object.__setattr__(self, "residual", default_residual(self.name))
        _non_negative("quant.residual", self.residual)

    @property
    def base(self) -> str:
        return self.name.removeprefix(ROTATE)

    @property
    def rotate(self) -> bool:
        return self.name.startswith(ROTATE)

    @property
    def fusable(self) -> bool:
        """Whether the Triton kernels can write and read this scheme (plain per-token formats only)."""
        return self.base in FUSABLE and not self.rotate and self.sink_tokens == 0 and self.residual == 0

    def check_widths(self, widths) -> None:
        """fp8 stores quantized heads at 8 bits only: any other width is a ValueError."""
        bad = sorted({int(w) for w in widths} - set(FP8_WIDTHS))
        if self.base == "fp8" and bad:
            raise ValueError(
                f"quant.scheme: {self.name} stores quantized heads at 8 bits; got widths {bad} "
                "(policy.widths or bits); allowed: 8, 16"
            )

    def new_store(
        self,
        bits: list[int],
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device,
        role: str = "value",
        simulate: bool = False,
    ):
        """The store of one layer's keys or values (`role`): PackedStore or a harness.stores store.

        `simulate`: the store also keeps a full-precision working copy and append returns it (quant.simulate);
        otherwise it holds only the stored form and attention reads that (kernels/packed_attention.py).
        """
        if role not in ROLES:
            raise ValueError(f"role: unknown {role!r}; allowed: {', '.join(ROLES)}")
        quantized = any(b != FULL_WIDTH for b in bits)
        per_channel = self.base == "kivi" and role == "key"
        if quantized and self.base != "fp8" and not per_channel and head_dim % self.group_size:
            raise ValueError(
                f"quant.group_size: {self.group_size} does not divide the model's head_dim {head_dim}"
            )
        if self.rotate and head_dim & (head_dim - 1):
            raise ValueError(
                f"quant.scheme: {self.name} needs a power-of-two head_dim; the model's is {head_dim}"
            )
        self.check_widths(bits)
        inner_dtype = torch.float32 if self.rotate else dtype  # rotated values can exceed the fp16 range
        if self.base == "fp8":
            store = Fp8Store(bits, head_dim, batch, inner_dtype, device, simulate)
        elif per_channel:
            store = ChannelStore(bits, head_dim, batch, self.group_size, inner_dtype, device, simulate)
        else:
            symmetric = self.base == "sym_token"
            store = PackedStore(
                bits, head_dim, batch, self.group_size, symmetric, inner_dtype, device, simulate=simulate
            )
        if self.rotate:
            store = RotatedStore(store, bits, head_dim, batch, dtype, device, simulate)
        shape = (len(bits), head_dim, batch, dtype, device)
        if self.residual or per_channel:
            chunk = self.group_size if per_channel else 1
            store = ResidualStore(store, self.residual, chunk, *shape, simulate=simulate)
        if self.sink_tokens:
            store = SinkStore(store, self.sink_tokens, *shape, simulate=simulate)
        return store


def get_scheme(name: str, group_size: int = 32, sink_tokens: int = 0, residual: int | None = None) -> Scheme:
    return Scheme(name=name, group_size=group_size, sink_tokens=sink_tokens, residual=residual)


def check_backend(scheme: Scheme, backend: str) -> str:
    """The backend a cache of `scheme` runs: auto falls back to torch where the Triton kernels cannot store the
    scheme; an explicit triton there is a ValueError."""
    if scheme.fusable:
        return backend
    if backend != "triton":
        return "torch"
    raise ValueError(
        f"quant.backend: triton supports only {' and '.join(FUSABLE)} without sink_tokens, residual or rotation; "
        f"got quant.scheme={scheme.name} sink_tokens={scheme.sink_tokens} residual={scheme.residual}; "
        "allowed: auto, torch"
    )
