"""Attention over a packed KV cache in plain torch (the CPU path): nothing of the context in full precision.

This module owns the read side of the torch path, the same split-KV algorithm as kernels/decode_attention.py:
the stored tokens are read in blocks; each block's scores and value products are computed from the stored
form, and blocks merge by online softmax (running max, running sum, rescaled accumulator), so the only
full-precision data alive at a time is one block. kernels/reference.py's attention_reference is the oracle.

A store is read through two products over its tokens [start, end):
    scores(store, q, start, end)   q (B, Hkv, M, D) float32  -> q . k   (B, Hkv, M, end - start) float32
    weighted(store, p, start, end) p (B, Hkv, M, end - start) -> p @ v  (B, Hkv, M, D) float32
For kernels.layout.PackedStore they are computed here, one pass per width bucket (the width-major layout puts
the heads of one width in one byte range of a row). With per-group scale s and zero z (sym: z = -2**(b-1) s),
a value is c s + z, so for a query row q split into groups q_n:
    q . k = sum_n s_n (q_n . c_n) + z_n sum(q_n)          p @ v [n] = (p * s_n) @ c_n + (p @ z_n)
When a block has few query rows (decode: M = query heads per KV head) these folded products touch fewer
elements than dequantizing the block; with many (a prefill chunk) the block is dequantized once and multiplied.
Any other store (harness/schemes) provides the two products as methods `qk` and `pv`.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.layout import FULL_WIDTH, PackedStore

SCORE_ELEMENTS = 1 << 22  # float32 scores of one block: 16 MiB
MAX_BLOCK = 1024  # tokens per block at most
QUERY_BLOCK = 256  # query rows per pass of a long chunk (a causal chunk then skips the keys it cannot see)


def _pieces(raw: torch.Tensor, bits: int, g: int) -> list[torch.Tensor]:
    """float32 codes of packed groups raw (..., bytes of g codes) as k = 8 // bits pieces (..., g // k): piece i
    holds codes i, i + k, i + 2k, ... (bits [i * bits, + bits) of every byte). 3 bits: one piece, all g codes.

    Each piece is one shift-and-mask pass written contiguously; nothing is interleaved (the queries and the
    outputs, which are small, are split and joined instead).
    """
    if bits == 3:
        return [reference.unpack(raw, 3, g).float()]
    mask = (1 << bits) - 1
    return [((raw >> (i * bits)) & mask if i else raw & mask).float() for i in range(8 // bits)]


def _split(x: torch.Tensor, k: int) -> list[torch.Tensor]:
    """x (..., g) as the k pieces _pieces makes of codes: entries i, i + k, ... (views)."""
    return [x] if k == 1 else list(x.unflatten(-1, (-1, k)).unbind(-1))


def _token_major_bytes(raw: torch.Tensor) -> torch.Tensor:
    """raw (B, Tb, Hw, ng, gb) uint8 -> (B, Hw, ng, Tb, gb) contiguous, moved as the widest aligned integers."""
    gb = raw.shape[-1]
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if (
            gb % size == 0
            and raw.storage_offset() % size == 0
            and all(st % size == 0 for st in raw.stride()[:-1])
        ):
            wide = raw.view(dtype)  # (B, Tb, Hw, ng, gb // size)
            return wide.permute(0, 2, 3, 1, 4).contiguous().view(torch.uint8)
    return raw.permute(0, 2, 3, 1, 4).contiguous()


def _bucket(
    store: PackedStore, w: int, heads: torch.Tensor, first_slot: int, first_byte: int, start: int, end: int
):
    """One width bucket's block of tokens [start, end): code pieces (_pieces) float32 (B, Hw, ng, Tb, g / k) each,
    scale and zero float32 (B, Hw, ng, Tb)."""
    Hw = len(heads)
    D, g = store.head_dim, store.group_size
    ng, gb = D // g, reference.packed_dim(D, w) * g // D  # groups per row, bytes per group
    raw = store.payload[:, start:end, first_byte : first_byte + Hw * ng * gb].unflatten(-1, (Hw, ng, gb))
    pieces = _pieces(_token_major_bytes(raw), w, g)  # (B, Hw, ng, Tb, g / k) each: bytes moved, not floats
    slots = slice(first_slot, first_slot + Hw)
    # scales and zeros are head-major: (B, Hw, Tb, ng) -> (B, Hw, ng, Tb)
    s = store.scale[:, slots, start:end].transpose(2, 3).float()
    if store.symmetric:
        z = s * -float(1 << (w - 1))
    else:
        z = store.zero[:, slots, start:end].transpose(2, 3).float()
    return pieces, s, z


def _buckets(store: PackedStore):
    """(width, heads, first slot, first byte, whole) per width bucket; whole: the bucket holds every head (then
    its slots are in KV-head order and no head needs gathering)."""
    H = len(store.bits)
    for w, heads, first_slot, first_byte in store.buckets:
        yield w, heads, first_slot, first_byte, len(heads) == H


def _dequantized(pieces: list[torch.Tensor], s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Values (B, Hw, Tb, D) of one bucket's block: codes * s + z, pieces interleaved back into code order."""
    codes = torch.stack(pieces, -1).flatten(-2)  # (B, Hw, ng, Tb, g)
    B, Hw, ng, Tb, g = codes.shape
    return (codes * s.unsqueeze(-1) + z.unsqueeze(-1)).permute(0, 1, 3, 2, 4).reshape(B, Hw, Tb, ng * g)


def _packed_scores(store: PackedStore, q: torch.Tensor, start: int, end: int) -> torch.Tensor:
    B, H, M, D = q.shape
    out = None
    for w, heads, first_slot, first_byte, whole in _buckets(store):
        qw = q if whole else q.index_select(1, heads)  # (B, Hw, M, D)
        if w == FULL_WIDTH:
            k = store.full[:, first_slot : first_slot + len(heads), start:end].float()  # (B, Hw, Tb, D)
            sw = qw @ k.transpose(-1, -2)
        else:
            pieces, s, z = _bucket(store, w, heads, first_slot, first_byte, start, end)
            ng = s.shape[2]
            if M * ng < D:  # folded: per-group products on the codes (B, Hw, ng, M, Tb), then scaled
                qn = qw.unflatten(-1, (ng, -1)).transpose(2, 3)  # (B, Hw, ng, M, g)
                raw = sum(qi @ ci.transpose(-1, -2) for qi, ci in zip(_split(qn, len(pieces)), pieces))
                sw = (raw * s.unsqueeze(3)).sum(2) + qn.sum(-1).transpose(-1, -2) @ z  # (B, Hw, M, Tb)
            else:  # many query rows: dequantize the block once
                sw = qw @ _dequantized(pieces, s, z).transpose(-1, -2)
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
    for w, heads, first_slot, first_byte, whole in _buckets(store):
        pw = p if whole else p.index_select(1, heads)  # (B, Hw, M, Tb)
        if w == FULL_WIDTH:
            ow = pw @ store.full[:, first_slot : first_slot + len(heads), start:end].float()  # (B, Hw, M, D)
        else:
            pieces, s, z = _bucket(store, w, heads, first_slot, first_byte, start, end)
            ng = s.shape[2]
            if M * ng < D:  # folded: (p * s_n) @ c_n + p @ z_n, per piece, joined back into code order
                scaled = pw.unsqueeze(2) * s.unsqueeze(3)  # (B, Hw, ng, M, Tb)
                on = torch.stack([scaled @ ci for ci in pieces], -1).flatten(-2)  # (B, Hw, ng, M, g)
                on = on + (pw @ z.transpose(-1, -2)).transpose(-1, -2).unsqueeze(-1)
                ow = on.transpose(2, 3).reshape(B, -1, M, D)  # (B, Hw, M, D)
            else:
                ow = pw @ _dequantized(pieces, s, z)
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
    for start in range(0, length, block):
        end = min(start + block, length)
        s = scores(k_store, qm, start, end).view(B, Hkv, G, Tq, end - start) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if mask is not None:  # (B or 1, 1, Tq, Tk): bool (True = attend) or additive float
            part = mask[..., start:end].unsqueeze(1)  # (B or 1, 1, 1, Tq, Tb)
            s = s.masked_fill(~part, float("-inf")) if part.dtype == torch.bool else s + part
        elif causal_offset is not None:
            cols = torch.arange(start, end, device=q.device)  # (Tb,)
            s = s.masked_fill(cols > rows + causal_offset, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows that have seen no visible key yet
        alpha = torch.exp(m - m_safe)
        p = torch.exp(s - m_safe.unsqueeze(-1))  # (B, Hkv, G, Tq, Tb)
        l = l * alpha + p.sum(-1)  # noqa: E741
        pv = weighted(v_store, p.view(B, Hkv, G * Tq, end - start), start, end).view(B, Hkv, G, Tq, -1)
        acc = pv if acc is None else acc * alpha.unsqueeze(-1) + pv
        m = m_new
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
