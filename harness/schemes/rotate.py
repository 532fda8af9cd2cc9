"""`rotate+<scheme>`: an orthonormal Hadamard rotation of head_dim before another scheme quantizes (QuaRot-style),
undone after (RotatedStore); head_dim must be a power of two. Rotated is a wrapper scheme: it stores and costs
what its base stores, in float32 inside (rotated values can exceed the fp16 range). `rotate(inner)` wraps a
scheme object; the registry holds rotate+<name> for each name of ROTATABLE, whatever the order the families are
imported in (the base is looked up when a rotated scheme is built)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from harness.schemes.base import SCHEME_OPTIONS, SCHEMES, Scheme, Store, get_scheme
from harness.schemes.wrappers import head_index, take_tokens
from kernels import reference
from kernels.packed_attention import values

ROTATE = "rotate+"
# The schemes a rotation may wrap. Not codebook, vq, xlayer and nuqkey_codebook, which rotate already, nor calkey,
# nuqkey, pca and cq, whose parts are fitted on the unrotated channels (a rotation would mix the rotary pairs and
# the bases they rely on).
ROTATABLE = ("asym_token", "sym_token", "kivi", "fp8")


@dataclass(frozen=True)
class Rotated(Scheme):
    """rotate+<base>: the base scheme on rotated heads. `inner` is that scheme, with this scheme's group sizes and
    no sink or residual tokens (this scheme keeps those, unrotated)."""

    rotated: ClassVar[bool] = True

    def __post_init__(self):
        options = {key: getattr(self, key) for key in SCHEME_OPTIONS}
        inner = get_scheme(self.name.removeprefix(ROTATE), **{**options, "sink_tokens": 0, "residual": 0})
        object.__setattr__(self, "inner", inner)
        super().__post_init__()

    @property
    def widths(self) -> tuple[int, ...]:
        return self.inner.widths

    @property
    def symmetric(self) -> bool:
        return self.inner.symmetric

    @property
    def default_residual(self) -> int:
        return self.inner.default_residual

    @property
    def head_dim_groups(self) -> bool:
        return self.inner.head_dim_groups

    @property
    def no_eviction(self) -> str | None:
        return self.inner.no_eviction

    def per_channel(self, role: str) -> bool:
        return self.inner.per_channel(role)

    def quantized_token_bytes(self, bits: int, head_dim: int, role: str) -> float:
        return self.inner.quantized_token_bytes(bits, head_dim, role)

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
        # The inner store keeps only its stored form: under simulate the wrapper's working copy is read from it
        # (the same values its own working copy would hold, bit for bit), so one copy is kept, not two.
        inner = self.inner.base_store(bits, head_dim, batch, torch.float32, device, role, False)
        return RotatedStore(inner, bits, head_dim, batch, dtype, device, simulate)


def rotate(inner: Scheme) -> Rotated:
    """rotate+<inner's name> around the scheme object `inner`, with every option of it; its sink and residual
    tokens are kept by the wrapper, unrotated. ValueError naming quant.scheme for a scheme not in ROTATABLE."""
    if inner.name not in ROTATABLE:
        raise ValueError(
            f"quant.scheme: {ROTATE}{inner.name} is not a scheme; allowed: {', '.join(ROTATE + n for n in ROTATABLE)}"
        )
    return Rotated(ROTATE + inner.name, **{key: getattr(inner, key) for key in SCHEME_OPTIONS})


for _name in ROTATABLE:
    SCHEMES.register(ROTATE + _name)(functools.partial(Rotated, ROTATE + _name))


class RotatedStore:
    """Rotates head_dim of the quantized heads by an orthonormal Hadamard matrix before `base` (built in float32)
    quantizes them, and back after dequantization; 16-bit heads pass unrotated, so they stay exact.

    Attention never rotates the stored keys and values back: it reads them rotated (`block`) and the rotation moves
    to the small side of each product (`turn`), q . (k' H) = (q H) . k' and p @ (v' H) = (p @ v') H.
    """

    def __init__(
        self, base, bits, head_dim: int, batch: int, dtype: torch.dtype, device, simulate: bool = False
    ):
        self.base, self.batch, self.dtype, self.simulate = base, batch, dtype, simulate
        self.bits = base.bits
        self.h = reference.hadamard(head_dim, device)  # (D, D), H @ H = I
        self.quant_heads = head_index(tuple(int(b) for b in bits), True, device)
        # simulate only: the full-precision working copy, rotated back (not stored bytes).
        self._values = torch.empty(batch, len(bits), 0, head_dim, dtype=dtype, device=device)

    @property
    def length(self) -> int:
        return self.base.length

    def _turn(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x (B, Hkv, T, D) with its quantized heads rotated (the rotation is its own inverse), in dtype."""
        out = x.to(dtype, copy=True)  # never write into the caller's tensor
        rotated = reference.hadamard_rotate(x.index_select(1, self.quant_heads), dtype, self.h)
        return out.index_copy_(1, self.quant_heads, rotated)

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        Tn = x.shape[2]
        self.base.append(self._turn(x, torch.float32))
        if not self.simulate:
            return None
        stored = self.block(self.length - Tn, self.length)  # (B, Hkv, Tn, D) float32, rotated
        self._values = torch.cat([self._values, self._turn(stored, self.dtype)], 2)
        return self._values

    def dequantize(self) -> torch.Tensor:
        return self._turn(self.base.dequantize(), self.dtype)

    def block(self, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) as stored, quantized heads rotated: (B, Hkv, end - start, D) float32."""
        return values(self.base, start, end, torch.float32)

    def turn(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, Hkv, R, D) with its quantized heads rotated: between the stored (rotated) form and the tokens' own."""
        return self._turn(x, x.dtype)

    def keep_last(self, n: int) -> None:
        self.base.keep_last(n)
        if self.simulate:
            self._values = self._values[:, :, self._values.shape[2] - self.base.length :].clone()

    def select(self, index: torch.Tensor) -> None:
        self.base.select(index)
        if self.simulate:
            self._values = take_tokens(self._values, index, 2)

    def take_rows(self, index: torch.Tensor) -> None:
        self.base.take_rows(index)
        self._values = self._values.index_select(0, index)
        self.batch = index.shape[0]

    def keep_first(self, n: int) -> None:
        self.base.keep_first(n)
        self._values = self._values[:, :, :n]

    def nbytes(self) -> int:
        return self.base.nbytes()

    def nbytes_fp16(self) -> int:
        return self.base.nbytes_fp16()
