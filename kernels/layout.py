"""Per-layer packed storage of keys (or values): every KV head at its own bit width.

This module owns the memory layout that the torch path (harness/cache/quantized.py) and the Triton kernels
(kernels/quantize.py, kernels/decode_attention.py) share. The bit-level format of one packed row is
kernels/reference.py's; this file decides where the rows of all heads of one layer live.

Layout: the KV heads of one width form a `Bucket`, held head-major, so that each head's packed rows are one
contiguous block of memory (a tile of tokens is one run of bytes that a kernel reads in 16-byte vectors):
    payload  uint8    (B, Hw, cap, packed_dim(D, w))   the Hw heads stored at width w, in KV-head order
    scale    float16  (B, Hw, cap, D // g)              None in a codes-only store
    zero     float16  (B, Hw, cap, D // g)              None when symmetric or codes-only
    values   dtype    (B, Hw, cap, D)                   the bucket of 16-bit heads (kept in the model's dtype)
    slot     int32 (Hkv,)                               head h's index inside its bucket, read by the kernels
    bucket_heads int32 (Hkv,)                           the heads in bucket order (the quantize kernel's jobs)
Positions >= length are unused capacity. Capacity is a whole number of TOKEN_BLOCK tokens, so every head's block
and every tile of a multiple of TOKEN_BLOCK tokens starts 16-byte aligned. A full store grows by
max(TOKEN_BLOCK, length / GROWTH_DIVISOR) tokens, rounded up to whole blocks: appending a decode token is
amortized O(1) (a copy of the store every length / 32 steps), and from 1K tokens on the capacity stays within
1.05x of the stored tokens (a prefill reserves its tokens rounded up to a block).

A codes-only store (`codes_only=True`) holds each token's unsigned codes at its head's width and nothing else: no
scale or zero, no 16-bit heads. What makes the codes keys or values (a per-head basis, steps and offsets, a frame per
block of tokens) lives with its caller (harness/schemes/pca_fold.py), folded into the query and the output; the
kernels attend over the codes as numbers (kernels/decode_attention.py's decode_attention_blocks). Its heads of a
width may share a grouped plan (`plans`: kernels/groups.py), their rows groups of 16 codes at their own widths: then
the width may be any of 1 to 8 bits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kernels import groups, reference

FULL_WIDTH = 16
FP16_BYTES = 2
TOKEN_BLOCK = 16  # capacity granularity in tokens: 16 x any packed row length is a multiple of 16 bytes
GROWTH_DIVISOR = 32  # a full store grows by 1/32 of its tokens (at least one block)


def round_up(tokens: int) -> int:
    """`tokens` rounded up to whole TOKEN_BLOCKs."""
    return -(-tokens // TOKEN_BLOCK) * TOKEN_BLOCK


def _resized(t: torch.Tensor | None, cap: int, keep: int) -> torch.Tensor | None:
    """A tensor like `t` (B, Hw, cap_old, ...) with capacity `cap` whose first `keep` tokens are t's."""
    if t is None:
        return None
    out = torch.empty(t.shape[0], t.shape[1], cap, *t.shape[3:], dtype=t.dtype, device=t.device)
    out[:, :, :keep] = t[:, :, :keep]
    return out


@dataclass
class Bucket:
    """The KV heads of one store held at one width, head-major (each head's tokens contiguous)."""

    width: int
    heads: torch.Tensor  # int64 (Hw,): the KV heads stored at this width, ascending
    payload: torch.Tensor | None  # uint8 (B, Hw, cap, packed_dim); None at 16 bits
    scale: torch.Tensor | None  # float16 (B, Hw, cap, D // g); None at 16 bits or codes-only
    zero: torch.Tensor | None  # float16 (B, Hw, cap, D // g); None when symmetric, codes-only or at 16 bits
    values: torch.Tensor | None  # dtype (B, Hw, cap, D) at 16 bits, else None

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.payload, self.scale, self.zero, self.values) if t is not None]

    def kernel_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(data, scale, zero) as the kernels take them: the payload (the values at 16 bits), the scales and the
        zeros, each one absent replaced by the one before it, a placeholder the kernel does not read."""
        data = self.values if self.width == FULL_WIDTH else self.payload
        scale = data if self.scale is None else self.scale
        return data, scale, scale if self.zero is None else self.zero

    def resize(self, cap: int, keep: int) -> None:
        """Move the first `keep` tokens into tensors of capacity `cap`."""
        self.payload, self.scale = _resized(self.payload, cap, keep), _resized(self.scale, cap, keep)
        self.zero, self.values = _resized(self.zero, cap, keep), _resized(self.values, cap, keep)

    def take(self, index: torch.Tensor) -> None:
        """Keep the tokens at `index` (B, n) of each batch row, in tensors of capacity round_up(n)."""
        B, n = index.shape

        def gathered(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            out = torch.empty(B, t.shape[1], round_up(n), *t.shape[3:], dtype=t.dtype, device=t.device)
            idx = index.view(B, 1, n, *[1] * (t.dim() - 3)).expand(B, t.shape[1], n, *t.shape[3:])
            out[:, :, :n] = t.gather(2, idx)
            return out

        self.payload, self.scale = gathered(self.payload), gathered(self.scale)
        self.zero, self.values = gathered(self.zero), gathered(self.values)

    def take_rows(self, index: torch.Tensor, in_place: bool) -> None:
        """Keep the batch rows at `index` (n,) int64; `in_place` (n equal to the batch) rewrites the tensors
        themselves, so a captured CUDA graph that reads them stays valid."""
        for name in ("payload", "scale", "zero", "values"):
            t = getattr(self, name)
            if t is None:
                continue
            rows = t.index_select(0, index)  # (n, Hw, cap, ...)
            if in_place:
                t.copy_(rows)
            else:
                setattr(self, name, rows)


def _checked_plans(
    plans: dict[int, tuple[int, ...]], head_dim: int, codes_only: bool
) -> dict[int, tuple[int, ...]]:
    """The grouped plans as ints, each checked (kernels.groups.check_plan); only a codes-only store takes them."""
    plans = {int(w): tuple(int(g) for g in plan) for w, plan in plans.items()}
    if plans and not codes_only:
        raise ValueError("plans: a grouped plan needs a codes-only store (codes_only=True)")
    for w, plan in plans.items():
        groups.check_plan(plan, w, head_dim)
    return plans


def _checked_group_size(
    bits: list[int],
    plans: dict[int, tuple[int, ...]],
    head_dim: int,
    group_size: int,
    symmetric: bool,
    codes_only: bool,
) -> int:
    """Check the heads' widths against the store's kind; return the scale group size the store uses."""
    for b in bits:
        if b not in plans and b != FULL_WIDTH and b not in reference.WIDTHS:
            raise ValueError(f"bits: {b} is not an allowed width; allowed: 2, 3, 4, 8, 16")
    if codes_only:
        # the codes alone: no group holds a scale, so the whole row is one group (what the kernels compile)
        if FULL_WIDTH in bits:
            raise ValueError("bits: a codes-only store holds no 16-bit head; allowed: 2, 3, 4, 8")
        if symmetric:
            raise ValueError("symmetric: a codes-only store has no scales; allowed: False")
        group_size = head_dim
    if any(b != FULL_WIDTH for b in bits) and head_dim % group_size:
        raise ValueError(f"quant.group_size: {group_size} does not divide head_dim {head_dim}")
    return group_size


class PackedStore:
    """One layer's keys or values for a batch, each KV head stored at its own width (2, 3, 4, 8 or 16)."""

    def __init__(
        self,
        bits: list[int] | tuple[int, ...],
        head_dim: int,
        batch: int,
        group_size: int = 32,
        symmetric: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        capacity: int = 0,
        simulate: bool = True,
        codes_only: bool = False,
        plans: dict[int, tuple[int, ...]] | None = None,
    ):
        bits = [int(b) for b in bits]
        self.plans = _checked_plans(plans or {}, head_dim, codes_only)
        # the kernels' constant per planned width (kernels.groups.plan_code), made once: read at every decode step
        self.plan_codes = {w: groups.plan_code(plan) for w, plan in sorted(self.plans.items())}
        group_size = _checked_group_size(bits, self.plans, head_dim, group_size, symmetric, codes_only)
        quantized = [b for b in bits if b != FULL_WIDTH]
        self.bits, self.codes_only = tuple(bits), codes_only
        self.head_dim, self.batch, self.group_size, self.symmetric = head_dim, batch, group_size, symmetric
        self.dtype, self.device = dtype, torch.device(device)
        self.length, self.simulate = 0, simulate

        # One bucket per width, in width order; the torch path quantizes each bucket with one call, and the
        # kernels compile each width's code apart (the width a compile-time constant), finding a head in its
        # bucket by `slot`.
        cap = round_up(max(0, capacity))
        ng = head_dim // group_size if quantized else 0
        slot = [0] * len(bits)
        self.buckets: list[Bucket] = []
        for w in sorted(set(bits)):
            heads = [h for h, b in enumerate(bits) if b == w]
            for j, h in enumerate(heads):
                slot[h] = j
            full = w == FULL_WIDTH

            def empty(*tail: int, dt: torch.dtype, n: int = len(heads)) -> torch.Tensor:
                return torch.empty(batch, n, cap, *tail, dtype=dt, device=self.device)

            self.buckets.append(
                Bucket(
                    width=w,
                    heads=torch.tensor(heads, device=self.device),
                    payload=None if full else empty(self.row_bytes(w), dt=torch.uint8),
                    scale=None if full or codes_only else empty(ng, dt=torch.float16),
                    zero=None if full or symmetric or codes_only else empty(ng, dt=torch.float16),
                    values=empty(head_dim, dt=dtype) if full else None,
                )
            )
        self.bucket_of = {bk.width: bk for bk in self.buckets}
        self.slot = torch.tensor(slot, dtype=torch.int32, device=self.device)
        # The heads in bucket order (width order, heads ascending in each), and where each bucket's run of them
        # starts (the last entry: Hkv): the quantize kernel's program j writes head bucket_heads[j].
        order = sorted(range(len(bits)), key=lambda h: (bits[h], h))
        self.bucket_heads = torch.tensor(order, dtype=torch.int32, device=self.device)
        self.bucket_starts = tuple(itertools.accumulate((len(bk.heads) for bk in self.buckets), initial=0))
        self._capacity = cap
        # With `simulate` (quant.simulate=true, fast quality sweeps) the store also keeps the dequantized values
        # of what it stored, appended once per token: a full-precision working copy, not stored bytes (nbytes()
        # counts the packed form). Without it, attention reads the packed form (kernels/packed_attention.py, or
        # the fused kernel kernels/decode_attention.py) and nothing dequantized is kept.
        self._dequantized: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self._capacity

    def row_bytes(self, width: int) -> int:
        """Bytes of one packed row of a head at `width` (a grouped plan's, or kernels.reference's)."""
        if width in self.plans:
            return width * self.head_dim // 8
        return reference.packed_dim(self.head_dim, width)

    def plan_code(self, width: int) -> int:
        """The kernels' constant for the heads at `width`: kernels.groups.plan_code of their plan, 0 without one."""
        return self.plan_codes.get(width, 0)

    def advance(self, n: int) -> None:
        """Count n more tokens as stored: those a replayed CUDA graph wrote at device-side positions (its Python,
        which counts them otherwise, does not run)."""
        self.length += n

    def reserve(self, needed: int) -> None:
        """Capacity for at least `needed` tokens: a full store grows by the amortized step of the module docstring
        (a store about to hold a known number of tokens, e.g. before CUDA-graph decoding, reserves it at once)."""
        if needed <= self._capacity:
            return
        grown = self._capacity and max(TOKEN_BLOCK, self.length // GROWTH_DIVISOR)  # a prefill: exact
        cap = round_up(max(needed, self._capacity + grown))
        for bk in self.buckets:
            bk.resize(cap, self.length)
        self._capacity = cap

    def append_with(self, x: torch.Tensor, write, v_store: PackedStore | None = None, v=None) -> None:
        """Store new tokens x (B, Hkv, Tn, D) through `write(store, x, start)`, which fills positions
        [start, start + Tn) of every bucket, as kernels.quantize.quantize_into does in one launch; with
        v_store and v (a layer's values, as long as this store), `write(store, x, start, v_store=v_store, v=v)`
        stores both. No dequantized copy is kept."""
        start, end = self.length, self.length + x.shape[2]
        stores = (self,) if v_store is None else (self, v_store)
        assert all(st.length == start for st in stores), [st.length for st in stores]
        for st in stores:
            st.reserve(end)
        if v_store is None:
            write(self, x, start)
        else:
            write(self, x, start, v_store=v_store, v=v)
        for st in stores:
            st.length = end

    def append(self, x: torch.Tensor, keep_dequantized: bool | None = None) -> torch.Tensor | None:
        """Quantize and store new tokens x (B, Hkv, Tn, D); return the dequantized stored values of all tokens.

        Returns (B, Hkv, length, D) in the store's dtype when `keep_dequantized` (default: `simulate`), else None.
        """
        if self.codes_only:
            raise ValueError("append: a codes-only store takes codes, not values; use append_codes")
        if keep_dequantized is None:
            keep_dequantized = self.simulate
        B, H, Tn, D = x.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        start, end = self.length, self.length + Tn
        self.reserve(end)
        new_deq = torch.empty(B, H, Tn, D, dtype=self.dtype, device=self.device) if keep_dequantized else None
        for bk in self.buckets:
            xw = x.index_select(1, bk.heads)  # (B, Hw, Tn, D)
            if bk.width == FULL_WIDTH:
                bk.values[:, :, start:end] = xw
                if new_deq is not None:
                    new_deq.index_copy_(1, bk.heads, xw)
                continue
            if new_deq is None:
                p = reference.quantize(xw, bk.width, self.group_size, symmetric=self.symmetric)
            else:
                p, values = reference.quantize_dequantize(
                    xw, bk.width, self.group_size, self.symmetric, self.dtype
                )
                new_deq.index_copy_(1, bk.heads, values)
            bk.payload[:, :, start:end] = p.payload  # (B, Hw, Tn, packed_dim)
            bk.scale[:, :, start:end] = p.scale
            if bk.zero is not None:
                bk.zero[:, :, start:end] = p.zero
        self.length = end
        if new_deq is None:
            return None
        self._append_dequantized(new_deq)
        return self._dequantized[:, :, : self.length]

    def append_codes(self, codes: torch.Tensor) -> None:
        """Store new tokens of a codes-only store: codes (B, Hkv, Tn, D), an integer tensor, head h's in [0, 2**w)
        at its width w (a grouped plan's: each component at its group's width), packed as kernels.reference.pack
        packs them (kernels.groups.pack under a plan)."""
        if not self.codes_only:
            raise ValueError("append_codes: this store quantizes values (append); codes need codes_only=True")
        B, H, Tn, D = codes.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (
            codes.shape,
            self.bits,
            self.head_dim,
        )
        start, end = self.length, self.length + Tn
        self.reserve(end)
        for bk in self.buckets:
            part = codes.index_select(1, bk.heads)
            plan = self.plans.get(bk.width)
            bk.payload[:, :, start:end] = (
                reference.pack(part, bk.width) if plan is None else groups.pack(part, plan)
            )
        self.length = end

    def head_codes(self, h: int) -> torch.Tensor:
        """The stored codes of quantized KV head h, uint8 (B, length, D) (a codes-only store's tokens)."""
        bk = self.bucket_of[self.bits[h]]
        assert bk.width != FULL_WIDTH, "head is stored unquantized"
        payload = bk.payload[:, int(self.slot[h]), : self.length]
        if bk.width in self.plans:
            return groups.unpack(payload, self.plans[bk.width])
        return reference.unpack(payload, bk.width, self.head_dim)

    def _append_dequantized(self, new: torch.Tensor) -> None:
        if self._dequantized is None:
            self._dequantized = torch.empty(
                self.batch, len(self.bits), self.capacity, self.head_dim, dtype=self.dtype, device=self.device
            )
        elif self._dequantized.shape[2] < self.length:
            self._dequantized = _resized(self._dequantized, self.capacity, self.length - new.shape[2])
        self._dequantized[:, :, self.length - new.shape[2] : self.length] = new

    def head_packed(self, h: int) -> reference.Packed:
        """The stored tokens of quantized KV head h as a reference.Packed (payload (B, length, packed_dim))."""
        bk = self.bucket_of[self.bits[h]]
        assert bk.width != FULL_WIDTH, "head is stored unquantized"
        assert not self.codes_only, "a codes-only store has no scales: head_codes"
        j, n = int(self.slot[h]), self.length
        return reference.Packed(
            payload=bk.payload[:, j, :n],
            scale=bk.scale[:, j, :n],
            zero=None if bk.zero is None else bk.zero[:, j, :n],
            bits=bk.width,
            group_size=self.group_size,
            symmetric=self.symmetric,
            dim=self.head_dim,
        )

    def dequantize(self) -> torch.Tensor:
        """Dequantize every stored token from the packed form: (B, Hkv, length, D) in the store's dtype (a
        codes-only store's codes, as numbers)."""
        out = torch.empty(
            self.batch, len(self.bits), self.length, self.head_dim, dtype=self.dtype, device=self.device
        )
        for bk in self.buckets:
            for j, h in enumerate(bk.heads.tolist()):
                if bk.width == FULL_WIDTH:
                    out[:, h] = bk.values[:, j, : self.length]
                elif self.codes_only:
                    out[:, h] = self.head_codes(h).to(self.dtype)
                else:
                    out[:, h] = reference.dequantize(self.head_packed(h), dtype=self.dtype)
        return out

    def keep_last(self, n: int) -> None:
        """Evict all but the last n tokens (sliding-window layers); frees the evicted capacity."""
        drop = self.length - n
        if drop <= 0:
            return
        cap = round_up(n)
        for bk in self.buckets:
            for name in ("payload", "scale", "zero", "values"):
                t = getattr(bk, name)
                if t is not None:
                    kept = torch.empty(*t.shape[:2], cap, *t.shape[3:], dtype=t.dtype, device=t.device)
                    kept[:, :, :n] = t[:, :, drop : self.length]
                    setattr(bk, name, kept)
        if self._dequantized is not None:
            self._dequantized = self._dequantized[:, :, drop : self.length].clone()
        self.length, self._capacity = n, cap

    def select(self, index: torch.Tensor) -> None:
        """Keep only the stored tokens at `index` (B, n_keep) int64, sorted per batch row (token eviction).

        Every row keeps n_keep tokens (the layout is rectangular), in the order given. The kept tokens are copied
        into tensors of capacity n_keep rounded up to a block, so the evicted ones are freed and nbytes() drops.
        The dequantized copy (torch path) is selected alike.
        """
        B, n = index.shape
        if B != self.batch:
            raise ValueError(f"select: index has {B} batch rows, the store {self.batch}")
        index = index.to(self.device)
        if n and (int(index.min()) < 0 or int(index.max()) >= self.length):
            raise IndexError(f"select: token index outside [0, {self.length})")
        for bk in self.buckets:
            bk.take(index)
        if self._dequantized is not None:
            H, D = self._dequantized.shape[1], self._dequantized.shape[3]
            self._dequantized = self._dequantized.gather(2, index.view(B, 1, n, 1).expand(B, H, n, D))
        self.length, self._capacity = n, round_up(n)

    def take_rows(self, index: torch.Tensor) -> None:
        """Keep the batch rows at `index` (n,) int64, in any order and with repeats (beam search reorders its
        beams, a batch is repeated or narrowed). With the batch size unchanged every tensor is rewritten in place
        (capacity and addresses kept: CUDA-graph decoding replays reads of them); otherwise they are replaced."""
        index = index.to(self.device)
        in_place = index.shape[0] == self.batch
        for bk in self.buckets:
            bk.take_rows(index, in_place)
        if self._dequantized is not None:
            self._dequantized = self._dequantized.index_select(0, index)
        self.batch = index.shape[0]

    def keep_first(self, n: int) -> None:
        """Drop every token from the n-th on (a rollback of the last appends: assisted generation's rejected draft
        tokens); they become unused capacity, overwritten by the next append."""
        if not 0 <= n <= self.length:
            raise ValueError(f"keep_first: {n} tokens of the {self.length} held")
        self.length = n

    def token_bytes(self) -> int:
        """Bytes of one stored token of one batch row: packed rows, scales, zeros and 16-bit heads at 2 bytes."""
        total = 0
        for bk in self.buckets:
            if bk.width == FULL_WIDTH:
                total += len(bk.heads) * self.head_dim * FP16_BYTES
            else:
                fields = sum(t.shape[-1] for t in (bk.scale, bk.zero) if t is not None)  # none: codes-only
                total += len(bk.heads) * (bk.payload.shape[-1] + fields * FP16_BYTES)
        return total

    def nbytes(self) -> int:
        """Bytes held for the stored tokens: payload, scales, zeros and 16-bit heads (counted at 2 bytes)."""
        return self.batch * self.length * self.token_bytes()

    def nbytes_fp16(self) -> int:
        """Bytes an unquantized fp16 cache would hold for the same tokens."""
        return self.batch * self.length * len(self.bits) * self.head_dim * FP16_BYTES
