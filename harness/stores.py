"""Per-layer KV stores beyond kernels.layout.PackedStore: fp8 and per-channel (KIVI) keys, and the wrappers
that keep attention-sink tokens and a recent residual window unquantized or rotate head_dim.

A store holds one layer's keys or values for a batch, each KV head at its own width (16 = unquantized), with
PackedStore's interface (the torch path of harness/cache.py uses nothing else):
    append(x)      store new tokens x (B, Hkv, Tn, D); with `simulate` return the dequantized stored tokens
                   (B, Hkv, length, D) from a full-precision working copy the store keeps, else keep only the
                   stored form and return None
    qk(q, s, e), pv(p, s, e)   the products kernels/packed_attention.py reads tokens [s, e) through (its
                   `scores` and `weighted`): computed from the stored form, one block at a time
    dequantize()   the dequantized stored tokens, recomputed from the stored form
    keep_last(n)   evict all but the last n tokens (sliding-window layers)
    select(index)  keep the tokens at sorted positions index (B, n_keep), per batch row (token eviction)
    length, batch, nbytes() (every stored tensor; unquantized tokens at 2 bytes per element), nbytes_fp16()
Formats are kernels/reference.py's. Wrappers compose around a base store, outermost first:
SinkStore(ResidualStore(RotatedStore(base))) (harness/quant.py builds them).
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.layout import FP16_BYTES, FULL_WIDTH
from kernels.packed_attention import scores, weighted


def _take(t: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """Per batch row, the entries of t (B, ..., T at `dim`, ...) at positions index (B, n) along dim."""
    view = [1] * t.dim()
    view[0], view[dim] = index.shape
    size = list(t.shape)
    size[dim] = index.shape[1]
    return torch.gather(t, dim, index.view(view).expand(size))


def _rows_split(index: torch.Tensor, boundary: int, what: str) -> int:
    """How many kept positions of each batch row lie below `boundary`; rows must agree (segments stay dense)."""
    below = (index < boundary).sum(1)  # (B,)
    if below.numel() and bool((below != below[0]).any()):
        raise NotImplementedError(
            f"select: batch rows keep different numbers of {what}; allowed: equal counts"
        )
    return int(below[0]) if below.numel() else 0


def _heads(bits: tuple[int, ...], quantized: bool, device) -> torch.Tensor:
    """Indices of the quantized (or the 16-bit) heads."""
    heads = [h for h, b in enumerate(bits) if (b != FULL_WIDTH) == quantized]
    return torch.tensor(heads, dtype=torch.long, device=device)


def _dense_qk(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q (B, H, M, D) float32 . k (B, H, Tb, D) -> (B, H, M, Tb) float32."""
    return q @ k.float().transpose(-1, -2)


def _dense_pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p (B, H, M, Tb) float32 @ v (B, H, Tb, D) -> (B, H, M, D) float32."""
    return p @ v.float()


class FullStore:
    """Tokens kept unquantized in the model's dtype (counted at 2 bytes per element, as an fp16 cache)."""

    def __init__(self, heads: int, head_dim: int, batch: int, dtype: torch.dtype, device):
        self.tokens = torch.empty(batch, heads, 0, head_dim, dtype=dtype, device=device)  # (B, H, T, D)

    @property
    def length(self) -> int:
        return self.tokens.shape[2]

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    def append(self, x: torch.Tensor) -> torch.Tensor:
        self.tokens = torch.cat([self.tokens, x], 2)
        return self.tokens

    def dequantize(self) -> torch.Tensor:
        return self.tokens

    def qk(self, q: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return _dense_qk(q, self.tokens[:, :, start:end])

    def pv(self, p: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return _dense_pv(p, self.tokens[:, :, start:end])

    def pop_front(self, n: int) -> torch.Tensor:
        """Remove and return the oldest n tokens (B, H, n, D)."""
        front, self.tokens = (
            self.tokens[:, :, :n],
            self.tokens[:, :, n:].clone(),
        )  # the rest, freed of the front
        return front

    def keep_last(self, n: int) -> None:
        self.tokens = self.tokens[:, :, max(self.length - n, 0) :].clone()

    def select(self, index: torch.Tensor) -> None:
        self.tokens = _take(self.tokens, index, 2)

    def nbytes(self) -> int:
        return self.nbytes_fp16()

    def nbytes_fp16(self) -> int:
        B, H, T, D = self.tokens.shape
        return B * H * T * D * FP16_BYTES


class Fp8Store:
    """e4m3 payload with one fp16 absmax scale per (token, head); quantized heads are 8-bit, 16-bit heads exact."""

    def __init__(self, bits, head_dim: int, batch: int, dtype: torch.dtype, device, simulate: bool = False):
        self.bits = tuple(int(b) for b in bits)
        bad = sorted({b for b in self.bits if b not in (8, FULL_WIDTH)})
        if bad:
            raise ValueError(f"quant.scheme: fp8 stores heads at 8 bits; got widths {bad}; allowed: 8, 16")
        self.head_dim, self.batch, self.dtype, self.simulate = head_dim, batch, dtype, simulate
        self.quant_heads, self.full_heads = _heads(self.bits, True, device), _heads(self.bits, False, device)
        Hq, Hf = len(self.quant_heads), len(self.full_heads)
        self.payload = torch.empty(batch, Hq, 0, head_dim, dtype=torch.uint8, device=device)  # e4m3 bits
        self.scale = torch.empty(batch, Hq, 0, dtype=torch.float16, device=device)  # (B, Hq, T)
        self.full = torch.empty(batch, Hf, 0, head_dim, dtype=dtype, device=device)  # (B, Hf, T, D)
        # simulate only: the full-precision working copy of the dequantized tokens (not stored bytes).
        self._values = torch.empty(batch, len(self.bits), 0, head_dim, dtype=dtype, device=device)
        self.length = 0

    def _fields(self) -> tuple[str, ...]:
        return (
            "payload",
            "scale",
            "full",
            *(("_values",) if self.simulate else ()),
        )  # token-major along dim 2

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        B, H, Tn, D = x.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        payload, scale, values = reference.fp8_quantize_dequantize(
            x.index_select(1, self.quant_heads), self.dtype
        )
        full = x.index_select(1, self.full_heads)
        parts = [payload, scale, full]
        if self.simulate:
            new = torch.empty_like(x, dtype=self.dtype)  # (B, H, Tn, D)
            parts.append(new.index_copy_(1, self.quant_heads, values).index_copy_(1, self.full_heads, full))
        for name, part in zip(self._fields(), parts):
            setattr(self, name, torch.cat([getattr(self, name), part], 2))
        self.length += Tn
        return self._values if self.simulate else None

    def block(self, start: int, end: int) -> torch.Tensor:
        """Dequantized tokens [start, end): (B, Hkv, end - start, D) in the store's dtype."""
        out = torch.empty(
            self.batch, len(self.bits), end - start, self.head_dim, dtype=self.dtype, device=self.full.device
        )
        values = reference.fp8_dequantize(
            self.payload[:, :, start:end], self.scale[:, :, start:end], self.dtype
        )
        out.index_copy_(1, self.quant_heads, values)
        return out.index_copy_(1, self.full_heads, self.full[:, :, start:end])

    def dequantize(self) -> torch.Tensor:
        return self.block(0, self.length)

    def qk(self, q: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return _dense_qk(q, self.block(start, end))

    def pv(self, p: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return _dense_pv(p, self.block(start, end))

    def keep_last(self, n: int) -> None:
        start = max(self.length - n, 0)
        for name in self._fields():
            setattr(self, name, getattr(self, name)[:, :, start:].clone())
        self.length -= start

    def select(self, index: torch.Tensor) -> None:
        for name in self._fields():
            setattr(self, name, _take(getattr(self, name), index, 2))
        self.length = index.shape[1]

    def nbytes(self) -> int:
        scales = self.scale.numel() * FP16_BYTES
        return self.payload.numel() + scales + self.full.numel() * FP16_BYTES

    def nbytes_fp16(self) -> int:
        return self.batch * len(self.bits) * self.length * self.head_dim * FP16_BYTES


class ChannelStore:
    """KIVI's keys: each group of g consecutive tokens of a quantized head is quantized per channel along the
    sequence (asym, one fp16 scale and zero per (group, channel)); 16-bit heads are kept exact.

    Tokens arrive in whole groups (ResidualStore holds the rest unquantized). A sliding window may evict part of
    the oldest group: its codes stay stored and counted until the whole group is out, and `offset` hides the
    evicted tokens from the values.
    """

    def __init__(
        self,
        bits,
        head_dim: int,
        batch: int,
        group_size: int,
        dtype: torch.dtype,
        device,
        simulate: bool = False,
    ):
        self.bits = tuple(int(b) for b in bits)
        self.head_dim, self.batch, self.group_size, self.dtype = head_dim, batch, group_size, dtype
        self.simulate, self.device = simulate, device
        self.widths = sorted({b for b in self.bits if b != FULL_WIDTH})
        for w in self.widths:
            reference.packed_dim(group_size, w)  # g codes of one channel must fill whole bytes
        heads = [[h for h, b in enumerate(self.bits) if b == w] for w in self.widths]
        self.heads = {w: torch.tensor(hs, device=device) for w, hs in zip(self.widths, heads)}
        self.packed: dict[int, reference.Packed] = {}  # width -> rows (B, Hw, n_groups, D) of g codes
        self.full_heads = _heads(self.bits, False, device)
        self.full = torch.empty(batch, len(self.full_heads), 0, head_dim, dtype=dtype, device=device)
        self.offset = 0  # evicted tokens at the start of the first group held
        self.length = 0
        # simulate only: the full-precision working copy of the dequantized tokens (not stored bytes).
        self._values = torch.empty(batch, len(self.bits), 0, head_dim, dtype=dtype, device=device)

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        B, H, Tn, D = x.shape  # Tn a multiple of g
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        new = torch.empty_like(x, dtype=self.dtype) if self.simulate else None  # (B, H, Tn, D)
        for w in self.widths:
            p, values = reference.channel_quantize_dequantize(
                x.index_select(1, self.heads[w]), w, self.group_size, self.dtype
            )
            if new is not None:
                new.index_copy_(1, self.heads[w], values)
            old = self.packed.get(w)
            if old is not None:
                p.payload = torch.cat([old.payload, p.payload], 2)
                p.scale, p.zero = torch.cat([old.scale, p.scale], 2), torch.cat([old.zero, p.zero], 2)
            self.packed[w] = p
        full = x.index_select(1, self.full_heads)
        self.full = torch.cat([self.full, full], 2)
        self.length += Tn
        if new is None:
            return None
        new.index_copy_(1, self.full_heads, full)
        self._values = torch.cat([self._values, new], 2)
        return self._values

    def block(self, start: int, end: int) -> torch.Tensor:
        """Dequantized tokens [start, end): (B, Hkv, end - start, D) in the store's dtype; only the groups that
        hold them are dequantized."""
        g = self.group_size
        first, last = (self.offset + start) // g, -(-(self.offset + end) // g)  # groups [first, last)
        skip = self.offset + start - first * g
        out = torch.empty(
            self.batch, len(self.bits), end - start, self.head_dim, dtype=self.dtype, device=self.device
        )
        for w, p in self.packed.items():
            rows = reference.Packed(
                p.payload[:, :, first:last], p.scale[:, :, first:last], p.zero[:, :, first:last],
                p.bits, p.group_size, p.symmetric, p.dim,
            )  # fmt: skip
            values = reference.channel_dequantize(rows, self.dtype)  # (B, Hw, (last - first) * g, D)
            out.index_copy_(1, self.heads[w], values[:, :, skip : skip + end - start])
        return out.index_copy_(1, self.full_heads, self.full[:, :, start:end])

    def dequantize(self) -> torch.Tensor:
        return self.block(0, self.length)

    def qk(self, q: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return _dense_qk(q, self.block(start, end))

    def pv(self, p: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return _dense_pv(p, self.block(start, end))

    def keep_last(self, n: int) -> None:
        drop = self.length - n
        if drop <= 0:
            return
        dead = self.offset + drop
        whole, self.offset = divmod(dead, self.group_size)
        for p in self.packed.values():
            p.payload, p.scale, p.zero = (t[:, :, whole:].clone() for t in (p.payload, p.scale, p.zero))
        self.full = self.full[:, :, drop:].clone()
        if self.simulate:
            self._values = self._values[:, :, drop:].clone()
        self.length = n

    def select(self, index: torch.Tensor) -> None:
        raise NotImplementedError(
            "select: kivi keys are quantized per channel over groups of quant.group_size tokens; "
            "single tokens cannot be evicted from a group"
        )

    def nbytes(self) -> int:
        packed = sum(
            t.numel() * t.element_size() for p in self.packed.values() for t in (p.payload, p.scale, p.zero)
        )
        return packed + self.full.numel() * FP16_BYTES

    def nbytes_fp16(self) -> int:
        return self.batch * len(self.bits) * self.length * self.head_dim * FP16_BYTES


class RotatedStore:
    """Rotates head_dim of the quantized heads by an orthonormal Hadamard matrix before `base` (built in float32)
    quantizes them, and back after dequantization; 16-bit heads pass unrotated, so they stay exact.

    Attention never rotates the stored keys and values back: the rotation moves to the small side of each
    product, q . (k' H) = (q H) . k' and p @ (v' H) = (p @ v') H.
    """

    def __init__(
        self, base, bits, head_dim: int, batch: int, dtype: torch.dtype, device, simulate: bool = False
    ):
        self.base, self.batch, self.dtype, self.simulate = base, batch, dtype, simulate
        self.bits = base.bits
        self.h = reference.hadamard(head_dim, device)  # (D, D), H @ H = I
        self.quant_heads = _heads(tuple(int(b) for b in bits), True, device)
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
        stored = self.base.append(self._turn(x, torch.float32))  # (B, Hkv, length, D) float32, rotated
        if not self.simulate:
            return None
        new = self._turn(stored[:, :, stored.shape[2] - Tn :], self.dtype)
        self._values = torch.cat([self._values, new], 2)
        return self._values

    def dequantize(self) -> torch.Tensor:
        return self._turn(self.base.dequantize(), self.dtype)

    def qk(self, q: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return scores(self.base, self._turn(q, torch.float32), start, end)

    def pv(self, p: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return self._turn(weighted(self.base, p, start, end), torch.float32)

    def keep_last(self, n: int) -> None:
        self.base.keep_last(n)
        if self.simulate:
            self._values = self._values[:, :, self._values.shape[2] - self.base.length :].clone()

    def select(self, index: torch.Tensor) -> None:
        self.base.select(index)
        if self.simulate:
            self._values = _take(self._values, index, 2)

    def nbytes(self) -> int:
        return self.base.nbytes()

    def nbytes_fp16(self) -> int:
        return self.base.nbytes_fp16()


class _TwoPart:
    """Tokens [0, front.length) in store `front`, the later ones in store `back`. With `simulate` each part's
    dequantized values are kept as the part last returned them, so an append costs one concatenation."""

    def __init__(self, front, back, empty: torch.Tensor, simulate: bool = False):
        self.parts, self.batch, self.simulate = [front, back], front.batch, simulate
        self.values = [empty, empty]  # simulate only: (B, Hkv, part length, D) each

    @property
    def length(self) -> int:
        return self.parts[0].length + self.parts[1].length

    def _joined(self) -> torch.Tensor | None:
        return torch.cat(self.values, 2) if self.simulate else None

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts], 2)

    def _ranges(self, start: int, end: int):
        """(part, its start, its end, offset in [start, end)) for each part that holds some of tokens [start, end)."""
        n0 = self.parts[0].length
        if start < n0:
            yield self.parts[0], start, min(end, n0), 0
        if end > n0:
            yield self.parts[1], max(start, n0) - n0, end - n0, max(n0 - start, 0)

    def qk(self, q: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return torch.cat([scores(part, q, s, e) for part, s, e, _ in self._ranges(start, end)], -1)

    def pv(self, p: torch.Tensor, start: int, end: int) -> torch.Tensor:
        out = None
        for part, s, e, at in self._ranges(start, end):
            o = weighted(part, p[..., at : at + e - s], s, e)
            out = o if out is None else out + o
        return out

    def keep_last(self, n: int) -> None:
        for i in (1, 0):  # the back part holds the newest tokens
            part = self.parts[i]
            part.keep_last(n)
            if self.simulate:
                self.values[i] = self.values[i][:, :, self.values[i].shape[2] - part.length :]
            n = max(n - part.length, 0)

    def select(self, index: torch.Tensor) -> None:
        front = self.parts[0]
        k = _rows_split(
            index, front.length, f"tokens in {type(front).__name__} and {type(self.parts[1]).__name__}"
        )
        for i, idx in ((0, index[:, :k]), (1, index[:, k:] - front.length)):
            part, n_before = self.parts[i], self.parts[i].length
            if idx.shape[1] == n_before:
                continue  # sorted distinct positions that keep every token: nothing to evict
            if idx.shape[1] == 0:
                part.keep_last(0)
            else:
                part.select(idx)
            if self.simulate:
                self.values[i] = _take(self.values[i], idx, 2)

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.parts)

    def nbytes_fp16(self) -> int:
        return sum(part.nbytes_fp16() for part in self.parts)


class SinkStore(_TwoPart):
    """The first `n_sinks` tokens of the sequence unquantized (attention sinks), every later token in `base`.

    A sliding window evicts sinks like any token once they leave it (the model's mask would hide them anyway).
    """

    def __init__(
        self,
        base,
        n_sinks: int,
        heads: int,
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device,
        simulate=False,
    ):
        sinks = FullStore(heads, head_dim, batch, dtype, device)
        super().__init__(sinks, base, sinks.tokens, simulate)
        self.bits = base.bits
        self.n_sinks, self.seen = n_sinks, 0  # tokens appended so far

    def starts_at(self, position: int) -> None:
        """The next token appended sits at sequence position `position` (a sliding window that has already
        dropped the sequence's first tokens holds no sinks)."""
        self.seen = position

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        take = min(max(self.n_sinks - self.seen, 0), x.shape[2])
        self.seen += x.shape[2]
        for i, new in ((0, x[:, :, :take]), (1, x[:, :, take:])):
            if new.shape[2]:
                values = self.parts[i].append(new)
                if self.simulate:
                    self.values[i] = values
        return self._joined()


class ResidualStore(_TwoPart):
    """The most recent tokens unquantized: at least `window` of them; older ones go to `base` in multiples of
    `chunk` (1 for per-token formats, g for kivi keys, which leaves up to window + g - 1 tokens unquantized).

    Groups of g start at the first token after the sinks, unless a sliding window shorter than window + g trims
    the unquantized tokens themselves: later groups then start at the oldest token held.
    """

    def __init__(
        self,
        base,
        window: int,
        chunk: int,
        heads: int,
        head_dim: int,
        batch: int,
        dtype: torch.dtype,
        device,
        simulate: bool = False,
    ):
        recent = FullStore(heads, head_dim, batch, dtype, device)
        super().__init__(base, recent, recent.tokens, simulate)
        self.bits = base.bits
        self.window, self.chunk = window, chunk

    def append(self, x: torch.Tensor) -> torch.Tensor | None:
        base, recent = self.parts
        recent.append(x)
        move = (recent.length - self.window) // self.chunk * self.chunk
        if move > 0:
            moved = base.append(recent.pop_front(move))
            if self.simulate:
                self.values[0] = moved
        if self.simulate:
            self.values[1] = recent.tokens
        return self._joined()
