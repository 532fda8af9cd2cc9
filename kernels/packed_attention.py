"""Attention over a packed KV cache in plain torch (the CPU path): nothing of the context in full precision.

This module owns the read side of the torch path, the same split-KV algorithm as kernels/decode_attention.py:
the stored tokens are read in blocks; each block's scores and value products are computed from the stored
form, and blocks merge by online softmax (running max, running sum, rescaled accumulator), so the only
full-precision data alive at a time is one block. kernels/reference.py's attention_reference is the oracle.

A store is read through two products over its tokens [start, end):
    scores(store, q, start, end)   q (B, Hkv, M, D) float32  -> q . k   (B, Hkv, M, end - start) float32
    weighted(store, p, start, end) p (B, Hkv, M, end - start) -> p @ v  (B, Hkv, M, D) float32
For kernels.layout.PackedStore they are computed here, one pass per width bucket (the heads of one width are one
head-major tensor). A block's codes are unpacked once into a float32 matrix
C (B, Hw, Tb, D); at 2 and 4 bits the k = 8 // bits codes of a byte are taken apart with one shift-and-mask
pass each. Where the block is dequantized (many query rows) the pieces are interleaved into the codes' own
order (byte j's piece i is code j * k + i). The folded products (few query rows) take the pieces side by
side instead ("piece order": all bytes' piece 0, then piece 1, ...), which saves the interleaving copy, and
permute the few query rows and outputs instead (`_Groups` holds both layouts).
With per-group scale s and zero z (sym: z = -2**(b-1) s), a value is c s + z, so for a query row q split into
groups q_n:
    q . k = sum_n s_n (q_n . c_n) + z_n sum(q_n)          p @ v [n] = (p * s_n) @ c_n + (p @ z_n)
When a block has few query rows (decode: M = query heads per KV head) these folded products touch fewer
elements than dequantizing the block: the per-group products of all groups are one matrix product with a
block-diagonal operand (row (m, n) of the queries keeps only group n's entries; for the values, the output
block of row (m, n) keeps only group n's columns). With many query rows (a prefill chunk) the block is
dequantized once and multiplied.
Any other store (harness/schemes) provides the two products as methods `qk` and `pv`.
"""

from __future__ import annotations

import functools

import torch

from kernels import reference
from kernels.layout import FULL_WIDTH, Bucket, PackedStore

SCORE_ELEMENTS = 1 << 22  # float32 scores of one block: 16 MiB
MAX_BLOCK = 1024  # tokens per block at most
QUERY_BLOCK = 256  # query rows per pass of a long chunk (a causal chunk then skips the keys it cannot see)


class _Groups:
    """How one width's unpacked codes split into quantization groups, in code order and in piece order.

    k: codes per byte taken apart (1 for 3 and 8 bits, and where a group does not fill whole bytes);
    ng: groups per head; onehot (ng, D): group n's columns in code order (columns n * g to (n + 1) * g).
    Piece order, columns (D,) viewed as (k, ng, g / k): column (i, n, r) holds code (n * g / k + r) * k + i,
    of group n. perm (D,): the code in each piece-order column; inverse (D,): the column of each code;
    piece_onehot (ng, D): group n's columns in piece order.
    """

    def __init__(self, bits: int, head_dim: int, group_size: int, device: torch.device):
        self.k = k = 8 // bits if bits in (2, 4) and group_size % (8 // bits) == 0 else 1
        self.ng = ng = head_dim // group_size
        group_of_column = torch.arange(head_dim) // group_size  # (D,)
        self.onehot = (group_of_column == torch.arange(ng).unsqueeze(1)).float().to(device)  # (ng, D)
        i, n, r = torch.meshgrid(
            torch.arange(k), torch.arange(ng), torch.arange(group_size // k), indexing="ij"
        )
        self.perm = ((n * (group_size // k) + r) * k + i).flatten().to(device)  # (D,)
        self.inverse = torch.argsort(self.perm)  # (D,)
        self.piece_onehot = (n.flatten() == torch.arange(ng).unsqueeze(1)).float().to(device)  # (ng, D)


@functools.lru_cache(maxsize=64)
def _groups(bits: int, head_dim: int, group_size: int, device: torch.device) -> _Groups:
    return _Groups(bits, head_dim, group_size, device)


def _codes(raw: torch.Tensor, bits: int, groups: _Groups, head_dim: int, piece_order: bool) -> torch.Tensor:
    """uint8 packed rows raw (B, Hw, Tb, packed bytes) -> float32 codes (B, Hw, Tb, D), in piece order where
    asked and the codes take pieces of bytes apart, else in code order."""
    if groups.k == 1:
        return (raw if bits == 8 else reference.unpack(raw, bits, head_dim)).float()
    mask = (1 << bits) - 1
    last = (groups.k - 1) * bits  # the top piece needs no mask
    parts = [raw & mask, *(((raw >> (i * bits)) & mask) for i in range(1, groups.k - 1)), raw >> last]
    if piece_order:
        return torch.cat(parts, -1).float()
    return torch.stack(parts, -1).flatten(-2).float()  # (B, Hw, Tb, packed bytes, k) -> (B, Hw, Tb, D)


def _bucket(store: PackedStore, bk: Bucket, start: int, end: int, rows: int):
    """One width bucket's block of tokens [start, end) for `rows` query rows: codes float32 (B, Hw, Tb, D),
    their _Groups, whether the products fold (few rows: codes in piece order), and scale and zero float32
    (B, Hw, Tb, ng)."""
    D, w = store.head_dim, bk.width
    raw = bk.payload[:, :, start:end]  # (B, Hw, Tb, packed bytes), head-major as stored
    groups = _groups(w, D, store.group_size, raw.device)
    folded = rows * groups.ng < D  # the folded products touch fewer elements than dequantizing the block
    codes = _codes(raw, w, groups, D, folded)  # (B, Hw, Tb, D)
    s = bk.scale[:, :, start:end].float()  # (B, Hw, Tb, ng)
    z = s * -float(1 << (w - 1)) if bk.zero is None else bk.zero[:, :, start:end].float()
    return codes, groups, folded, s, z


def _dequantized(codes: torch.Tensor, groups: _Groups, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Values (B, Hw, Tb, D) of one bucket's block: codes * s + z, group by group."""
    B, Hw, Tb, D = codes.shape
    grouped = codes.view(B, Hw, Tb, groups.ng, -1)  # (B, Hw, Tb, ng, g)
    return (grouped * s.unsqueeze(-1) + z.unsqueeze(-1)).view(B, Hw, Tb, D)


def _folded_scores(q: torch.Tensor, codes: torch.Tensor, groups: _Groups, s, z) -> torch.Tensor:
    """q (B, Hw, M, D) -> q . k (B, Hw, M, Tb): sum_n s_n (q_n . c_n) + z_n sum(q_n), one block-diagonal product.
    codes in piece order."""
    B, Hw, M, D = q.shape
    qp = q if groups.k == 1 else q.index_select(-1, groups.perm)  # (B, Hw, M, D) in piece order
    # row (m, n) of the block-diagonal operand keeps group n's entries only
    block_diagonal = (qp.unsqueeze(3) * groups.piece_onehot).view(B, Hw, M * groups.ng, D)
    per_group = (block_diagonal @ codes.transpose(-1, -2)).view(B, Hw, M, groups.ng, -1)  # (B, Hw, M, ng, Tb)
    st, zt = s.transpose(-1, -2).contiguous(), z.transpose(-1, -2)  # (B, Hw, ng, Tb)
    q_sums = q.unflatten(-1, (groups.ng, -1)).sum(-1)  # (B, Hw, M, ng)
    return (per_group * st.unsqueeze(2)).sum(3) + q_sums @ zt


def _folded_weighted(p: torch.Tensor, codes: torch.Tensor, groups: _Groups, s, z) -> torch.Tensor:
    """p (B, Hw, M, Tb) -> p @ v (B, Hw, M, D): (p * s_n) @ c_n + p @ z_n, one block-diagonal product.
    codes in piece order."""
    B, Hw, M, Tb = p.shape
    D = codes.shape[-1]
    st = s.transpose(-1, -2).contiguous()  # (B, Hw, ng, Tb)
    scaled = (p.unsqueeze(3) * st.unsqueeze(2)).view(B, Hw, M * groups.ng, Tb)  # row (m, n): p * s_n
    per_group = (scaled @ codes).view(B, Hw, M, groups.ng, D)  # row (m, n) is right on group n's columns only
    out = (per_group * groups.piece_onehot).sum(3)  # (B, Hw, M, D) in piece order
    out = out.view(B, Hw, M, groups.k, groups.ng, -1) + (p @ z).view(B, Hw, M, 1, groups.ng, 1)
    out = out.view(B, Hw, M, D)
    return out if groups.k == 1 else out.index_select(-1, groups.inverse)


def _packed_scores(store: PackedStore, q: torch.Tensor, start: int, end: int) -> torch.Tensor:
    B, H, M, D = q.shape
    out = None
    whole = len(store.buckets) == 1  # one bucket holds every head, in KV-head order: nothing to gather
    for bk in store.buckets:
        heads = bk.heads
        qw = q if whole else q.index_select(1, heads)  # (B, Hw, M, D)
        if bk.width == FULL_WIDTH:
            sw = qw @ bk.values[:, :, start:end].float().transpose(-1, -2)  # (B, Hw, M, Tb)
        else:
            codes, groups, folded, s, z = _bucket(store, bk, start, end, M)
            if folded:
                sw = _folded_scores(qw, codes, groups, s, z)
            else:  # many query rows: dequantize the block once
                sw = qw @ _dequantized(codes, groups, s, z).transpose(-1, -2)
        if whole:
            return sw
        if out is None:
            out = q.new_empty(B, H, M, end - start)
        out.index_copy_(1, heads, sw)
    return out


def _packed_weighted(store: PackedStore, p: torch.Tensor, start: int, end: int) -> torch.Tensor:
    B, H, M, Tb = p.shape
    D = store.head_dim
    out = None
    whole = len(store.buckets) == 1
    for bk in store.buckets:
        heads = bk.heads
        pw = p if whole else p.index_select(1, heads)  # (B, Hw, M, Tb)
        if bk.width == FULL_WIDTH:
            ow = pw @ bk.values[:, :, start:end].float()  # (B, Hw, M, D)
        else:
            codes, groups, folded, s, z = _bucket(store, bk, start, end, M)
            if folded:
                ow = _folded_weighted(pw, codes, groups, s, z)
            else:  # many query rows: dequantize the block once
                ow = pw @ _dequantized(codes, groups, s, z)
        if whole:
            return ow
        if out is None:
            out = p.new_empty(B, H, M, D)
        out.index_copy_(1, heads, ow)
    return out


def scores(store, q: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """q . k over stored tokens [start, end): q (B, Hkv, M, D) float32 -> (B, Hkv, M, end - start) float32."""
    if isinstance(store, PackedStore):
        return _packed_scores(store, q, start, end)
    return store.qk(q, start, end)


def weighted(store, p: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """p @ v over stored tokens [start, end): p (B, Hkv, M, end - start) float32 -> (B, Hkv, M, D) float32."""
    if isinstance(store, PackedStore):
        return _packed_weighted(store, p, start, end)
    return store.pv(p, start, end)


def _block_size(rows: int) -> int:
    """Tokens per block so that one block's scores (rows x tokens) stay near SCORE_ELEMENTS."""
    return max(16, min(MAX_BLOCK, SCORE_ELEMENTS // max(rows, 1) // 16 * 16))


def _attend(q, k_store, v_store, scale, mask, causal_offset, softcap, length, block):
    """One pass of online softmax over stored tokens [0, length) for q (B, Hkv, G, Tq, D) float32."""
    B, Hkv, G, Tq, D = q.shape
    qm = q.reshape(B, Hkv, G * Tq, D)
    m = q.new_full((B, Hkv, G, Tq), float("-inf"))
    l = q.new_zeros(B, Hkv, G, Tq)  # noqa: E741
    acc = None
    rows = torch.arange(Tq, device=q.device).unsqueeze(-1)  # (Tq, 1)
    if mask is not None:  # (B or 1, 1, Tq, Tk): bool (True = attend) or additive float
        visible = mask if mask.dtype == torch.bool else mask == 0
        open_keys = visible.flatten(0, -2).all(0)  # (Tk,): keys no row hides or biases need no masking
    for start in range(0, length, block):
        end = min(start + block, length)
        # One score block is the largest tensor alive here (rows x block floats): every step on it is in place,
        # so it is allocated once per block (scores are a fresh product, never a view of a store).
        s = scores(k_store, qm, start, end).view(B, Hkv, G, Tq, end - start).mul_(scale)
        if softcap is not None:
            s.div_(softcap).tanh_().mul_(softcap)
        if mask is not None and not bool(open_keys[start:end].all()):
            part = mask[..., start:end].unsqueeze(1)  # (B or 1, 1, 1, Tq, Tb)
            s.masked_fill_(~part, float("-inf")) if part.dtype == torch.bool else s.add_(part)
        elif causal_offset is not None and end - 1 > causal_offset:  # row 0 cannot see the block's last key
            cols = torch.arange(start, end, device=q.device)  # (Tb,)
            s.masked_fill_(cols > rows + causal_offset, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows that have seen no visible key yet
        alpha = torch.exp(m - m_safe)
        p = s.sub_(m_safe.unsqueeze(-1)).exp_()  # (B, Hkv, G, Tq, Tb), the scores' buffer
        l = l * alpha + p.sum(-1)  # noqa: E741
        pv = weighted(v_store, p.view(B, Hkv, G * Tq, end - start), start, end).view(B, Hkv, G, Tq, -1)
        acc = pv if acc is None else acc.mul_(alpha.unsqueeze(-1)).add_(pv)
        m = m_new
        del s, p  # freed before the next block's scores are allocated
    return acc / l.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).tiny)


def packed_attention(
    q: torch.Tensor,
    k_store,
    v_store,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """softmax(q K^T * scale) V over every stored token of (k_store, v_store), read blockwise from the stored form.

    q: (B, Hq, Tq, D), the queries of the last Tq stored tokens; query head h reads KV head h // (Hq // Hkv).
    mask: None (Tq = 1: every stored token; Tq > 1: causal, query i sees stored tokens j <= L - Tq + i) or the
        model's mask (B or 1, 1, Tq, L), bool (True = attend) or additive float. softcap: logit soft-capping.
    block: tokens per block (default: scores of one block near SCORE_ELEMENTS floats).
    Returns (B, Hq, Tq, Dv) float32. A row with no visible token gives zeros.
    """
    B, Hq, Tq, D = q.shape
    Hkv, L = len(k_store.bits), k_store.length
    if Hq % Hkv or v_store.length != L or L < Tq:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit stores of {Hkv} KV heads and {L}, {v_store.length} tokens"
        )
    G = Hq // Hkv
    qg = q.float().reshape(B, Hkv, G, Tq, D)  # query head h = kv * G + i
    outs = []
    for qs in range(0, Tq, QUERY_BLOCK):
        qe = min(qs + QUERY_BLOCK, Tq)
        offset = L - Tq + qs  # the stored position of query row qs
        part_mask = None if mask is None else mask[..., qs:qe, :]
        causal = None if mask is not None or Tq == 1 else offset
        length = L if mask is not None else min(L, offset + qe - qs)  # a causal pass skips unreachable keys
        rows = B * Hq * (qe - qs)
        size = block or _block_size(rows)
        outs.append(
            _attend(qg[:, :, :, qs:qe], k_store, v_store, scale, part_mask, causal, softcap, length, size)
        )
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 3)  # (B, Hkv, G, Tq, Dv)
    return out.reshape(B, Hq, Tq, -1)
