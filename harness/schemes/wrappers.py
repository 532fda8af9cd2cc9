"""What every scheme shares: FullStore (tokens kept unquantized), the wrappers that keep the sequence's first
tokens (SinkStore) and a recent window (ResidualStore) of a base store unquantized, and the small helpers the
stores of harness/schemes use. Every store here satisfies harness.schemes.base.Store.

Wrappers compose around a scheme's base store, outermost first: SinkStore(ResidualStore(base))
(Scheme.new_store builds them); rotate+ puts a RotatedStore (harness/schemes/rotate.py) inside as the base.
"""

from __future__ import annotations

import torch

from kernels.layout import FP16_BYTES, FULL_WIDTH
from kernels.packed_attention import turn, values


def take_tokens(t: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
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


def starts_at(store, position: int) -> None:
    """Tell an empty store that the next token appended sits at sequence position `position`, where the store
    (or a store inside it) needs positions (SinkStore, nuqkey's keys); any other store needs nothing."""
    if hasattr(store, "starts_at"):
        store.starts_at(position)


def head_index(bits: tuple[int, ...], quantized: bool, device) -> torch.Tensor:
    """Indices of the quantized (or the 16-bit) heads."""
    heads = [h for h, b in enumerate(bits) if (b != FULL_WIDTH) == quantized]
    return torch.tensor(heads, dtype=torch.long, device=device)


class BlockStore:
    """The common reading of stores that dequantize a block of tokens (fp8, KIVI's keys, calkey's, nuqkey's,
    codebook's): the store implements `block(start, end)` -> (B, Hkv, end - start, D) and `length`. Rows and
    rollbacks go through `_each(change)`, which replaces every per-token tensor t (batch along dim 0, tokens along
    dim 2) by change(t)."""

    def block(self, start: int, end: int) -> torch.Tensor:
        raise NotImplementedError

    def _each(self, change) -> None:
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        return self.block(0, self.length)

    def take_rows(self, index: torch.Tensor) -> None:
        self._each(lambda t: t.index_select(0, index))
        self.batch = index.shape[0]

    def keep_first(self, n: int) -> None:
        self._each(lambda t: t[:, :, :n])
        self.length = n


class PositionedBlockStore(BlockStore):
    """A BlockStore whose per-token tensors (token axis 2) are all visited by `_each(change)` and whose tokens'
    sequence positions are `positions` (schemes/rotary.py's TokenPositions), with `length` tokens held: eviction
    for pca's, xlayer's, vq's and cq's stores."""

    def keep_last(self, n: int) -> None:
        start = max(self.length - n, 0)
        self.positions.keep_last(n, self.length)
        self._each(lambda t: t[:, :, start:].clone())
        self.length -= start

    def select(self, index: torch.Tensor) -> None:
        self.positions.select(index, self.length)
        self._each(lambda t: take_tokens(t, index, 2))
        self.length = index.shape[1]

    def take_rows(self, index: torch.Tensor) -> None:
        self.positions.take_rows(index)
        super().take_rows(index)

    def keep_first(self, n: int) -> None:
        self.positions.keep_first(n, self.length)
        super().keep_first(n)


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

    def block(self, start: int, end: int) -> torch.Tensor:
        return self.tokens[:, :, start:end]

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
        self.tokens = take_tokens(self.tokens, index, 2)

    def take_rows(self, index: torch.Tensor) -> None:
        self.tokens = self.tokens.index_select(0, index)

    def keep_first(self, n: int) -> None:
        self.tokens = self.tokens[:, :, :n]

    def nbytes(self) -> int:
        return self.nbytes_fp16()

    def nbytes_fp16(self) -> int:
        B, H, T, D = self.tokens.shape
        return B * H * T * D * FP16_BYTES


class _TwoPart:
    """Tokens [0, front.length) in store `front`, the later ones in store `back`, one of them the quantized `base`
    and the other a FullStore. With `simulate` each part's dequantized values are kept as the part last returned
    them, so an append costs one concatenation."""

    def __init__(self, front, back, base, empty: torch.Tensor, simulate: bool = False):
        self.parts, self.base, self.batch, self.simulate = [front, back], base, front.batch, simulate
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

    def block(self, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) of both parts (B, Hkv, end - start, D) in the dtype of the unquantized part and in the
        domain of the base's blocks: the unquantized tokens (a few) turned into it, the base's never turned back."""
        dtype = self.values[0].dtype
        pieces = [
            values(part, s, e, dtype) if part is self.base else turn(self.base, values(part, s, e, dtype))
            for part, s, e, _ in self._ranges(start, end)
        ]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 2)

    def turn(self, x: torch.Tensor) -> torch.Tensor:
        """The base's turn (kernels.packed_attention.turn): x moved between the tokens' domain and the blocks'."""
        return turn(self.base, x)

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
                self.values[i] = take_tokens(self.values[i], idx, 2)

    def take_rows(self, index: torch.Tensor) -> None:
        for part in self.parts:
            part.take_rows(index)
        self.values = [v.index_select(0, index) for v in self.values]
        self.batch = index.shape[0]

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
        super().__init__(sinks, base, base, sinks.tokens, simulate)
        self.bits = base.bits
        self.n_sinks, self.seen = n_sinks, 0  # tokens appended so far

    def starts_at(self, position: int) -> None:
        """The next token appended sits at sequence position `position` (a sliding window that has already
        dropped the sequence's first tokens holds no sinks)."""
        self.seen = position
        starts_at(self.parts[1], max(position, self.n_sinks))

    def keep_first(self, n: int) -> None:
        """Drop every token from the n-th on; a rollback into the sinks empties the base, which then starts again
        after the sinks."""
        self.seen -= self.length - n
        for i, part in enumerate(self.parts):
            kept = min(n, part.length)
            part.keep_first(kept)
            if self.simulate:
                self.values[i] = self.values[i][:, :, :kept]
            n -= kept

    # Decode tokens at device-side positions (CUDA-graph decoding), for a base that writes there (`append_at`: the
    # pca family's kernel stores): every such token comes after the sinks, so it is the base's, its index there
    # the store's less the sinks held.
    @property
    def capacity(self) -> int:
        return self.parts[0].length + self.base.capacity

    def reserve(self, tokens: int) -> None:
        self.base.reserve(tokens - self.parts[0].length)

    def append_at(self, x: torch.Tensor, index: torch.Tensor) -> None:
        assert self.seen >= self.n_sinks, "append_at: the sink tokens come first"
        self.base.append_at(x, index - self.parts[0].length)

    def advance(self, n: int) -> None:
        self.seen += n
        self.base.advance(n)

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
        super().__init__(base, recent, base, recent.tokens, simulate)
        self.bits = base.bits
        self.window, self.chunk = window, chunk

    def starts_at(self, position: int) -> None:
        """The next token appended sits at sequence position `position` (the base receives tokens in order)."""
        starts_at(self.parts[0], position)

    def keep_first(self, n: int) -> None:
        raise NotImplementedError(
            f"keep_first: the window of {self.window} recent tokens has moved older ones to the quantized part as "
            "new ones arrived; dropping the newest cannot give those their full precision back"
        )

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
