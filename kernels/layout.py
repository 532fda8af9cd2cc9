"""Per-layer packed storage of keys (or values): every KV head at its own bit width.

This module owns the memory layout that the torch path (harness/cache/quantized.py) and the Triton kernels
(kernels/quantize.py, kernels/decode_attention.py) share. The bit-level format of one packed row is
kernels/reference.py's; this file decides where the rows of all heads of one layer live.

Layout, token-major so that one kernel launch per layer can write every head of a new token:
    payload  uint8    (B, cap, row_bytes)        row_bytes = sum of packed_dim(D, w_h) over quantized heads;
                                                  head h's codes sit at bytes [byte_offset[h], + packed_dim)
    scale    float16  (B, n_quant, cap, D // g)  quantized head h uses slot[h]; head-major, so the scales of
    zero     float16  (B, n_quant, cap, D // g)  one head's consecutive tokens are contiguous; zero is None
                                                  when symmetric
    full     dtype    (B, n_full, cap, D)        heads at 16 bits (kept in the model's dtype), slot[h]
    byte_offset, slot: int32 (Hkv,)              the per-head tables the attention kernel reads
Positions >= length are unused capacity. Capacity grows by GROWTH (at least GROWTH_MIN tokens) when full, so
appending a decode token is amortized O(1) instead of a full copy per step while the slack stays under 1/4 of
what is stored (a prefill reserves exactly its tokens).
"""

from __future__ import annotations

import torch

from kernels import reference

FULL_WIDTH = 16
FP16_BYTES = 2
GROWTH = 1.25  # capacity factor when a store is full: resident bytes stay within 1.25x of the stored tokens'
GROWTH_MIN = 16  # tokens added at least, so short stores do not copy at every append


def _grow(t: torch.Tensor | None, dim: int, new_cap: int) -> torch.Tensor | None:
    """Return `t` with its `dim` extended to `new_cap` (new positions uninitialized)."""
    if t is None:
        return None
    shape = list(t.shape)
    shape[dim] = new_cap
    out = torch.empty(shape, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


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
    ):
        bits = [int(b) for b in bits]
        for b in bits:
            if b != FULL_WIDTH and b not in reference.WIDTHS:
                raise ValueError(f"bits: {b} is not an allowed width; allowed: 2, 3, 4, 8, 16")
        quantized = [b for b in bits if b != FULL_WIDTH]
        if quantized and head_dim % group_size:
            raise ValueError(f"quant.group_size: {group_size} does not divide head_dim {head_dim}")
        self.bits = tuple(bits)
        self.head_dim, self.batch, self.group_size, self.symmetric = head_dim, batch, group_size, symmetric
        self.dtype, self.device = dtype, torch.device(device)
        self.length, self.simulate = 0, simulate

        # Heads are laid out width-major (all 2-bit heads, then 3-bit, ...; KV-head order within a width), so the
        # heads of one width form one contiguous byte range of a row and one contiguous slot range: the torch
        # path quantizes each width with one call, and the kernels launch once per width (`buckets`), the width a
        # compile-time constant. The attention kernel finds each head's bytes and slot in the per-head tables.
        offset, slot = [0] * len(bits), [0] * len(bits)
        self.buckets: list[tuple[int, torch.Tensor, int, int]] = []  # (width, heads, first slot, first byte)
        row_bytes = n_quant = n_full = 0
        for w in sorted(set(bits)):
            heads = [h for h, b in enumerate(bits) if b == w]
            if w == FULL_WIDTH:
                self.buckets.append((w, torch.tensor(heads, device=self.device), n_full, 0))
                for h in heads:
                    slot[h], n_full = n_full, n_full + 1
                continue
            self.buckets.append((w, torch.tensor(heads, device=self.device), n_quant, row_bytes))
            for h in heads:
                offset[h], slot[h] = row_bytes, n_quant
                row_bytes += reference.packed_dim(head_dim, w)
                n_quant += 1
        self.row_bytes, self.n_quant, self.n_full = row_bytes, n_quant, n_full
        as_table = lambda xs: torch.tensor(xs, dtype=torch.int32, device=self.device)  # noqa: E731
        self.byte_offset, self.slot = as_table(offset), as_table(slot)

        n_groups = head_dim // group_size if n_quant else 0
        cap = max(0, capacity)
        self.payload = torch.empty(batch, cap, row_bytes, dtype=torch.uint8, device=self.device)
        self.scale = torch.empty(batch, n_quant, cap, n_groups, dtype=torch.float16, device=self.device)
        self.zero = None if symmetric else torch.empty_like(self.scale)
        self.full = torch.empty(batch, n_full, cap, head_dim, dtype=dtype, device=self.device)
        # With `simulate` (quant.simulate=true, fast quality sweeps) the store also keeps the dequantized values
        # of what it stored, appended once per token: a full-precision working copy, not stored bytes (nbytes()
        # counts the packed form). Without it, attention reads the packed form (kernels/packed_attention.py, or
        # the fused kernel kernels/decode_attention.py) and nothing dequantized is kept.
        self._dequantized: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.payload.shape[1]

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        cap = max(needed, int(self.capacity * GROWTH), self.capacity + GROWTH_MIN)
        self.payload = _grow(self.payload, 1, cap)
        self.scale = _grow(self.scale, 2, cap)
        self.zero = _grow(self.zero, 2, cap)
        self.full = _grow(self.full, 2, cap)

    def append_with(self, x: torch.Tensor, write) -> None:
        """Store new tokens x (B, Hkv, Tn, D) through `write(store, x, start)`, which fills positions
        [start, start + Tn) of payload, scale, zero and full, as kernels.quantize.quantize_into does with one
        launch per width; no dequantized copy is kept."""
        start, end = self.length, self.length + x.shape[2]
        self._reserve(end)
        write(self, x, start)
        self.length = end

    def append(self, x: torch.Tensor, keep_dequantized: bool | None = None) -> torch.Tensor | None:
        """Quantize and store new tokens x (B, Hkv, Tn, D); return the dequantized stored values of all tokens.

        Returns (B, Hkv, length, D) in the store's dtype when `keep_dequantized` (default: `simulate`), else None.
        """
        if keep_dequantized is None:
            keep_dequantized = self.simulate
        B, H, Tn, D = x.shape
        assert (B, H, D) == (self.batch, len(self.bits), self.head_dim), (x.shape, self.bits, self.head_dim)
        start, end = self.length, self.length + Tn
        self._reserve(end)
        new_deq = torch.empty(B, H, Tn, D, dtype=self.dtype, device=self.device) if keep_dequantized else None
        for w, index, first_slot, first_byte in self.buckets:
            heads = index.tolist()
            xw = x.index_select(1, index)  # (B, Hw, Tn, D)
            slots = slice(first_slot, first_slot + len(heads))
            if w == FULL_WIDTH:
                self.full[:, slots, start:end] = xw
                if new_deq is not None:
                    new_deq.index_copy_(1, index, xw)
                continue
            if new_deq is None:
                p = reference.quantize(
                    xw, w, self.group_size, symmetric=self.symmetric
                )  # payload (B, Hw, Tn, pd)
            else:
                p, values = reference.quantize_dequantize(xw, w, self.group_size, self.symmetric, self.dtype)
                new_deq.index_copy_(1, index, values)
            nbytes = len(heads) * p.payload.shape[-1]
            self.payload[:, start:end, first_byte : first_byte + nbytes] = p.payload.transpose(1, 2).reshape(
                B, Tn, -1
            )
            self.scale[:, slots, start:end] = p.scale
            if self.zero is not None:
                self.zero[:, slots, start:end] = p.zero
        self.length = end
        if new_deq is None:
            return None
        self._append_dequantized(new_deq)
        return self._dequantized[:, :, : self.length]

    def _append_dequantized(self, new: torch.Tensor) -> None:
        if self._dequantized is None:
            self._dequantized = torch.empty(
                self.batch, len(self.bits), self.capacity, self.head_dim, dtype=self.dtype, device=self.device
            )
        elif self._dequantized.shape[2] < self.length:
            self._dequantized = _grow(self._dequantized, 2, self.capacity)
        self._dequantized[:, :, self.length - new.shape[2] : self.length] = new

    def head_packed(self, h: int) -> reference.Packed:
        """The stored tokens of quantized KV head h as a reference.Packed (payload (B, length, packed_dim))."""
        b = self.bits[h]
        assert b != FULL_WIDTH, "head is stored unquantized"
        slot, off = int(self.slot[h]), int(self.byte_offset[h])
        n = self.length
        return reference.Packed(
            payload=self.payload[:, :n, off : off + reference.packed_dim(self.head_dim, b)],
            scale=self.scale[:, slot, :n],
            zero=None if self.zero is None else self.zero[:, slot, :n],
            bits=b,
            group_size=self.group_size,
            symmetric=self.symmetric,
            dim=self.head_dim,
        )

    def dequantize(self) -> torch.Tensor:
        """Dequantize every stored token from the packed form: (B, Hkv, length, D) in the store's dtype."""
        out = torch.empty(
            self.batch, len(self.bits), self.length, self.head_dim, dtype=self.dtype, device=self.device
        )
        for h, b in enumerate(self.bits):
            if b == FULL_WIDTH:
                out[:, h] = self.full[:, int(self.slot[h]), : self.length]
            else:
                out[:, h] = reference.dequantize(self.head_packed(h), dtype=self.dtype)
        return out

    def keep_last(self, n: int) -> None:
        """Evict all but the last n tokens (sliding-window layers); frees the evicted capacity."""
        drop = self.length - n
        if drop <= 0:
            return
        self.payload = self.payload[:, drop : self.length].clone()
        self.scale = self.scale[:, :, drop : self.length].clone()
        self.zero = None if self.zero is None else self.zero[:, :, drop : self.length].clone()
        self.full = self.full[:, :, drop : self.length].clone()
        if self._dequantized is not None:
            self._dequantized = self._dequantized[:, :, drop : self.length].clone()
        self.length = n

    def select(self, index: torch.Tensor) -> None:
        """Keep only the stored tokens at `index` (B, n_keep) int64, sorted per batch row (token eviction).

        Every row keeps n_keep tokens (the layout is rectangular), in the order given. The kept tokens are copied
        into tensors of capacity n_keep, so the evicted ones are freed and nbytes() drops. The dequantized copy
        (torch path) is selected alike.
        """
        B, n = index.shape
        if B != self.batch:
            raise ValueError(f"select: index has {B} batch rows, the store {self.batch}")
        index = index.to(self.device)
        if n and (int(index.min()) < 0 or int(index.max()) >= self.length):
            raise IndexError(f"select: token index outside [0, {self.length})")

        def take(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
            """t (B, ..., cap at `dim`, ...) -> (B, ..., n_keep, ...): the indexed tokens of each batch row."""
            if t is None:
                return None
            view = [B] + [1] * (t.dim() - 1)
            view[dim] = n
            shape = list(t.shape)
            shape[dim] = n
            return t.gather(dim, index.view(view).expand(shape))

        self.payload, self.scale, self.zero = take(self.payload, 1), take(self.scale, 2), take(self.zero, 2)
        self.full = take(self.full, 2)
        self._dequantized = take(self._dequantized, 2)
        self.length = n

    def nbytes(self) -> int:
        """Bytes held for the stored tokens: payload, scales, zeros and 16-bit heads (counted at 2 bytes)."""
        n = self.batch * self.length
        per_token = self.row_bytes + self.n_quant * (self.head_dim // self.group_size) * FP16_BYTES * (
            1 if self.zero is None else 2
        )
        return n * (per_token + self.n_full * self.head_dim * FP16_BYTES)

    def nbytes_fp16(self) -> int:
        """Bytes an unquantized fp16 cache would hold for the same tokens."""
        return self.batch * self.length * len(self.bits) * self.head_dim * FP16_BYTES
