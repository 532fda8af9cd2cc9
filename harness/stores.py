"""Per-layer KV stores beyond kernels.layout.PackedStore: fp8 and per-channel (KIVI) keys, and the wrappers
that keep attention-sink tokens and a recent residual window unquantized or rotate head_dim.

A store holds one layer's keys or values for a batch, each KV head at its own width (16 = unquantized), with
PackedStore's interface (the torch path of harness/cache.py uses nothing else):
    append(x)      store new tokens x (B, Hkv, Tn, D); return the dequantized stored tokens (B, Hkv, length, D)
    dequantize()   the same values, recomputed from the stored form
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

    def pop_front(self, n: int) -> torch.Tensor:
        """Remove and return the oldest n tokens (B, H, n, D)."""
        front, self.tokens = self.tokens[:, :, :n], self.tokens[:, :, n:]
        return front

    def keep_last(self, n: int) -> None:
        self.tokens = self.tokens[:, :, max(self.length - n, 0) :]

    def select(self, index: torch.Tensor) -> None:
        self.tokens = _take(self.tokens, index, 2)

    def nbytes(self) -> int:
        return self.nbytes_fp16()

    def nbytes_fp16(self) -> int:
        B, H, T, D = self.tokens.shape
        return B * H * T * D * FP16_BYTES


class Fp8Store:
    """e4m3 payload with one fp16 absmax scale per (token, head); quantized heads are 8-bit, 16-bit heads exact."""

    def __init__(self, bits, head_dim: int, batch: int, dtype: torch.dtype, device):
        self.bits = tuple(int(b) for b in bits)
        bad = sorted({b for b in self.bits if b not in (8, FULL_WIDTH)})
        if bad:
            raise ValueError(f"quant.scheme: fp8 stores heads at 8 bits; got widths {bad}; allowed: 8, 16")
        self.head_dim, self.batch, self.dtype = head_dim, batch, dtype
        self.quant_heads, self.full_heads = _heads(self.bits, True, device), _heads(self.bits, False, device)
        Hq, Hf = len(self.quant_heads), len(self.full_heads)
        self.payload = torch.empty(batch, Hq, 0, head_dim, dtype=torch.uint8, device=device)  # e4m3 bits
        self.scale = torch.empty(batch, Hq, 0, dtype=torch.float16, device=device)  # (B, Hq, T)
        self.full = torch.empty(batch, Hf, 0, head_dim, dtype=dtype, device=device)  # (B, Hf, T, D)
        # A compute buffer of the torch path (as PackedStore's): the dequantized tokens, not stored bytes.
        self._values = torch.empty(batch, len(self.bits), 0, head_dim, dtype=dtype, device=device)

    @property
    def length(self) -> int:
        return self._values.shape[2]

    def _fields(self) -> tuple[str, ...]:
        return ("payload", "scale", "full", "_values")  # all token-major along dim 2

    def append(self, x: torch.Tensor) -> torch.Tensor:
        B, H, Tn, D = x.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        payload, scale, values = reference.fp8_quantize_dequantize(
            x.index_select(1, self.quant_heads), self.dtype
        )
        full = x.index_select(1, self.full_heads)
        new = torch.empty_like(x, dtype=self.dtype)  # (B, H, Tn, D)
        new.index_copy_(1, self.quant_heads, values).index_copy_(1, self.full_heads, full)
        for name, part in zip(self._fields(), (payload, scale, full, new)):
            setattr(self, name, torch.cat([getattr(self, name), part], 2))
        return self._values

    def dequantize(self) -> torch.Tensor:
        out = torch.empty_like(self._values)
        out.index_copy_(1, self.quant_heads, reference.fp8_dequantize(self.payload, self.scale, self.dtype))
        return out.index_copy_(1, self.full_heads, self.full)

    def keep_last(self, n: int) -> None:
        start = max(self.length - n, 0)
        for name in self._fields():
            setattr(self, name, getattr(self, name)[:, :, start:])

    def select(self, index: torch.Tensor) -> None:
        for name in self._fields():
            setattr(self, name, _take(getattr(self, name), index, 2))

    def nbytes(self) -> int:
        scales = self.scale.numel() * FP16_BYTES
        return self.payload.numel() + scales + self.full.numel() * FP16_BYTES

    def nbytes_fp16(self) -> int:
        return self._values.numel() * FP16_BYTES


class ChannelStore:
    """KIVI's keys: each group of g consecutive tokens of a quantized head is quantized per channel along the
    sequence (asym, one fp16 scale and zero per (group, channel)); 16-bit heads are kept exact.

    Tokens arrive in whole groups (ResidualStore holds the rest unquantized). A sliding window may evict part of
    the oldest group: its codes stay stored and counted until the whole group is out, and `offset` hides the
    evicted tokens from the values.
    """

    def __init__(self, bits, head_dim: int, batch: int, group_size: int, dtype: torch.dtype, device):
        self.bits = tuple(int(b) for b in bits)
        self.head_dim, self.batch, self.group_size, self.dtype = head_dim, batch, group_size, dtype
        self.widths = sorted({b for b in self.bits if b != FULL_WIDTH})
        for w in self.widths:
            reference.packed_dim(group_size, w)  # g codes of one channel must fill whole bytes
        heads = [[h for h, b in enumerate(self.bits) if b == w] for w in self.widths]
        self.heads = {w: torch.tensor(hs, device=device) for w, hs in zip(self.widths, heads)}
        self.packed: dict[int, reference.Packed] = {}  # width -> rows (B, Hw, n_groups, D) of g codes
        self.full_heads = _heads(self.bits, False, device)
        self.full = torch.empty(batch, len(self.full_heads), 0, head_dim, dtype=dtype, device=device)
        self.offset = 0  # evicted tokens at the start of the first group held
        self._values = torch.empty(batch, len(self.bits), 0, head_dim, dtype=dtype, device=device)

    @property
    def length(self) -> int:
        return self._values.shape[2]

    def append(self, x: torch.Tensor) -> torch.Tensor:
        B, H, Tn, D = x.shape  # Tn a multiple of g
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        new = torch.empty_like(x, dtype=self.dtype)  # (B, H, Tn, D)
        for w in self.widths:
            p, values = reference.channel_quantize_dequantize(
                x.index_select(1, self.heads[w]), w, self.group_size, self.dtype
            )
            new.index_copy_(1, self.heads[w], values)
            old = self.packed.get(w)
            if old is not None:
                p.payload = torch.cat([old.payload, p.payload], 2)
                p.scale, p.zero = torch.cat([old.scale, p.scale], 2), torch.cat([old.zero, p.zero], 2)
            self.packed[w] = p
        full = x.index_select(1, self.full_heads)
        new.index_copy_(1, self.full_heads, full)
        self.full = torch.cat([self.full, full], 2)
        self._values = torch.cat([self._values, new], 2)
        return self._values

    def dequantize(self) -> torch.Tensor:
        out = torch.empty_like(self._values)
        for w, p in self.packed.items():
            out.index_copy_(
                1, self.heads[w], reference.channel_dequantize(p, self.dtype)[:, :, self.offset :]
            )
        return out.index_copy_(1, self.full_heads, self.full)

    def keep_last(self, n: int) -> None:
        drop = self.length - n
        if drop <= 0:
            return
        dead = self.offset + drop
        whole, self.offset = divmod(dead, self.group_size)
        for p in self.packed.values():
            p.payload, p.scale, p.zero = (t[:, :, whole:] for t in (p.payload, p.scale, p.zero))
        self.full, self._values = self.full[:, :, drop:], self._values[:, :, drop:]

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
        return self._values.numel() * FP16_BYTES


class RotatedStore:
    """Rotates head_dim of the quantized heads by an orthonormal Hadamard matrix before `base` (built in float32)
    quantizes them, and back after dequantization; 16-bit heads pass unrotated, so they stay exact."""

    def __init__(self, base, bits, head_dim: int, batch: int, dtype: torch.dtype, device):
        self.base, self.batch, self.dtype = base, batch, dtype
        self.h = reference.hadamard(head_dim, device)  # (D, D), H @ H = I
        self.quant_heads = _heads(tuple(int(b) for b in bits), True, device)
        self._values = torch.empty(batch, len(bits), 0, head_dim, dtype=dtype, device=device)

    @property
    def length(self) -> int:
        return self.base.length

    def _turn(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """x (B, Hkv, T, D) with its quantized heads rotated (the rotation is its own inverse), in dtype."""
        out = x.to(dtype, copy=True)  # never write into the caller's tensor
        rotated = reference.hadamard_rotate(x.index_select(1, self.quant_heads), dtype, self.h)
        return out.index_copy_(1, self.quant_heads, rotated)

    def append(self, x: torch.Tensor) -> torch.Tensor:
        Tn = x.shape[2]
        stored = self.base.append(self._turn(x, torch.float32))  # (B, Hkv, length, D) float32, rotated
        new = self._turn(stored[:, :, stored.shape[2] - Tn :], self.dtype)
        self._values = torch.cat([self._values, new], 2)
        return self._values

    def dequantize(self) -> torch.Tensor:
        return self._turn(self.base.dequantize(), self.dtype)

    def keep_last(self, n: int) -> None:
        self.base.keep_last(n)
        self._values = self._values[:, :, self._values.shape[2] - self.base.length :]

    def select(self, index: torch.Tensor) -> None:
        self.base.select(index)
        self._values = _take(self._values, index, 2)

    def nbytes(self) -> int:
        return self.base.nbytes()

    def nbytes_fp16(self) -> int:
        return self.base.nbytes_fp16()


class _TwoPart:
    """Tokens [0, front.length) in store `front`, the later ones in store `back`; each part's dequantized values
    are kept as the part last returned them, so an append costs one concatenation."""

    def __init__(self, front, back, empty: torch.Tensor):
        self.parts, self.batch = [front, back], front.batch
        self.values = [empty, empty]  # (B, Hkv, part length, D) each

    @property
    def length(self) -> int:
        return self.parts[0].length + self.parts[1].length

    def _joined(self) -> torch.Tensor:
        return torch.cat(self.values, 2)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts], 2)

    def keep_last(self, n: int) -> None:
        for i in (1, 0):  # the back part holds the newest tokens
            part = self.parts[i]
            part.keep_last(n)
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
            self.values[i] = _take(self.values[i], idx, 2)

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.parts)

    def nbytes_fp16(self) -> int:
        return sum(part.nbytes_fp16() for part in self.parts)


class SinkStore(_TwoPart):
    """The first `n_sinks` tokens of the sequence unquantized (attention sinks), every later token in `base`.

    A sliding window evicts sinks like any token once they leave it (the model's mask would hide them anyway).
    """

    def __init__(self, base, n_sinks: int, heads: int, head_dim: int, batch: int, dtype: torch.dtype, device):
        sinks = FullStore(heads, head_dim, batch, dtype, device)
        super().__init__(sinks, base, sinks.tokens)
        self.n_sinks, self.seen = n_sinks, 0  # tokens appended so far

    def starts_at(self, position: int) -> None:
        """The next token appended sits at sequence position `position` (a sliding window that has already
        dropped the sequence's first tokens holds no sinks)."""
        self.seen = position

    def append(self, x: torch.Tensor) -> torch.Tensor:
        take = min(max(self.n_sinks - self.seen, 0), x.shape[2])
        self.seen += x.shape[2]
        if take:
            self.values[0] = self.parts[0].append(x[:, :, :take])
        if take < x.shape[2]:
            self.values[1] = self.parts[1].append(x[:, :, take:])
        return self._joined()


class ResidualStore(_TwoPart):
    """The most recent tokens unquantized: at least `window` of them; older ones go to `base` in multiples of
    `chunk` (1 for per-token formats, g for kivi keys, which leaves up to window + g - 1 tokens unquantized).

    Groups of g start at the first token after the sinks, unless a sliding window shorter than window + g trims
    the unquantized tokens themselves: later groups then start at the oldest token held.
    """

    def __init__(
        self, base, window: int, chunk: int, heads: int, head_dim: int, batch: int, dtype: torch.dtype, device
    ):
        recent = FullStore(heads, head_dim, batch, dtype, device)
        super().__init__(base, recent, recent.tokens)
        self.window, self.chunk = window, chunk

    def append(self, x: torch.Tensor) -> torch.Tensor:
        base, recent = self.parts
        recent.append(x)
        move = (recent.length - self.window) // self.chunk * self.chunk
        if move > 0:
            self.values[0] = base.append(recent.pop_front(move))
        self.values[1] = recent.tokens
        return self._joined()
