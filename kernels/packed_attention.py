"""Attention over a packed KV cache in plain torch (the CPU path): nothing of the context in full precision.

This module owns the read side of the torch path, the split-KV algorithm of kernels/decode_attention.py: the
stored tokens are read in blocks; each block is dequantized into the queries' dtype, attended, and the blocks merge
by their log-sum-exp (the output of each block rescaled to the running total), so the only full-precision data
alive at a time is one block. kernels/reference.py's attention_reference is the oracle.

A block's attention runs in the queries' dtype with float32 accumulation. On CPU it is torch's flash-attention
kernel, which returns the block's log-sum-exp beside its output: bf16 products (AVX512-BF16 or AMX where the CPU
has them) accumulated in float32, the softmax in float32. With logit soft-capping, or on another device, it is the
same in plain torch products in float32. GQA: the G query heads of a KV head are G x Tq rows of one product.

Reading a store: `values(store, start, end, dtype)` -> (B, Hkv, end - start, D). A kernels.layout.PackedStore is
read here, one pass per width bucket (the heads of one width are one head-major tensor): the block's codes are
unpacked (reference.unpack), then c * s + z group by group in float32, the arithmetic of reference.dequantize, and
cast to the dtype. Any other store (harness/schemes) provides `block(start, end)`; one
whose blocks are rotated (rotate+, codebook) also `turn`, which moves the queries into its domain (keys) or the
output out of it (values), so no stored token is rotated back.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.layout import FULL_WIDTH, Bucket, PackedStore

VALUE_ELEMENTS = 1 << 21  # dequantized keys (or values) of one block: 8 MiB in float32
SCORE_ELEMENTS = 1 << 22  # float32 scores of one block where they are materialized (softcap, not CPU): 16 MiB
MAX_BLOCK = 1024  # tokens per block at most
QUERY_BLOCK = 256  # query rows per pass of a long chunk (a causal chunk then skips the keys it cannot see)
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values -> dtype, saturating where dtype's range is narrower than a dequantized value's (float16:
    one can lie just past 65504), as reference.dequantize casts."""
    if torch.finfo(dtype).max < 2 * reference.FP16_MAX:
        y = y.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    return y.to(dtype)


def _bucket_values(store: PackedStore, bk: Bucket, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """One width bucket's tokens [start, end), dequantized: (B, Hw, Tb, D) in dtype."""
    if bk.width == FULL_WIDTH:
        return bk.values[:, :, start:end].to(dtype)
    codes = reference.unpack(bk.payload[:, :, start:end], bk.width, store.head_dim)  # (B, Hw, Tb, D) uint8
    B, Hw, Tb, D = codes.shape
    x = codes.float().view(B, Hw, Tb, D // store.group_size, -1)  # (B, Hw, Tb, ng, g)
    s = bk.scale[:, :, start:end].float().unsqueeze(-1)  # (B, Hw, Tb, ng, 1)
    if bk.zero is None:  # symmetric
        x.sub_(1 << (bk.width - 1)).mul_(s)
    else:
        x.mul_(s).add_(bk.zero[:, :, start:end].float().unsqueeze(-1))
    return _cast(x.view(B, Hw, Tb, D), dtype)


def values(store, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored tokens [start, end) dequantized from the stored form: (B, Hkv, end - start, D) in dtype."""
    if not isinstance(store, PackedStore):
        return store.block(start, end).to(dtype)
    if len(store.buckets) == 1:  # one bucket holds every head, in KV-head order
        return _bucket_values(store, store.buckets[0], start, end, dtype)
    out = torch.empty(
        store.batch, len(store.bits), end - start, store.head_dim, dtype=dtype, device=store.device
    )
    for bk in store.buckets:
        out.index_copy_(1, bk.heads, _bucket_values(store, bk, start, end, dtype))
    return out


def turn(store, x: torch.Tensor) -> torch.Tensor:
    """x (B, Hkv, R, D) moved between the tokens' own domain and the one the store's blocks are in (and back: the
    turns are their own inverses): the store's `turn` (rotated stores), else x itself."""
    return store.turn(x) if hasattr(store, "turn") else x


def _block_attention(q, k, v, scale: float, bias, softcap: float | None):
    """One block: q (B, Hkv, R, D), k and v (B, Hkv, Tb, D) in q's dtype, bias None or additive (B or 1, 1, R, Tb)
    in q's dtype -> (output (B, Hkv, R, D), log-sum-exp (B, Hkv, R) float32) of softmax(q k^T scale + bias) v."""
    if softcap is None and q.device.type == "cpu":
        return _FLASH_CPU(q, k, v, attn_mask=bias, scale=scale)
    s = q.float() @ k.float().transpose(-1, -2) * scale  # (B, Hkv, R, Tb)
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    if bias is not None:
        s.add_(bias)
    lse = s.logsumexp(-1)  # (B, Hkv, R)
    p = s.sub_(torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1)).exp_()
    return p @ v.float(), lse


def _pieces(open_keys: torch.Tensor | None, length: int, block: int) -> list[tuple[int, int, bool]]:
    """(start, end, open) pieces of [0, length): the runs of equal open_keys (length,) bool (None: one open run),
    cut into at most `block` tokens."""
    if open_keys is None:
        bounds, flags = [0, length], [True]
    else:
        changes = (open_keys[1:] != open_keys[:-1]).nonzero().flatten() + 1
        bounds = [0, *changes.tolist(), length]
        flags = open_keys[bounds[:-1]].tolist()
    return [
        (s, min(s + block, end), flag)
        for start, end, flag in zip(bounds[:-1], bounds[1:], flags)
        for s in range(start, end, block)
    ]


def _bias(part: torch.Tensor, G: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A mask over one block, part (B or 1, 1, Tq, Tb) bool (True = attend) or additive float -> (the additive bias
    (B or 1, 1, G * Tq, Tb) in dtype for the rows of every query head, which rows see some key (B or 1, 1, G * Tq))."""
    if part.dtype == torch.bool:
        bias = torch.zeros(part.shape, dtype=dtype, device=part.device).masked_fill_(~part, float("-inf"))
        seen = part.any(-1)  # (B or 1, 1, Tq)
    else:
        bias, seen = part.to(dtype), (part > float("-inf")).any(-1)
    return bias.repeat(1, 1, G, 1), seen.repeat(1, 1, G)


def _attend(q, k_store, v_store, scale, mask, causal_offset, softcap, length, block):
    """Attention of q (B, Hkv, G, Tq, D) over stored tokens [0, length), merged block by block.

    mask: None or the model's (B or 1, 1, Tq, length), bool or additive float; without it, causal_offset: None (every
    key) or query row i sees keys j <= causal_offset + i. Returns (B, Hkv, G, Tq, D) in q's dtype; a row with no
    visible key gives zeros.
    """
    B, Hkv, G, Tq, D = q.shape
    qm = turn(k_store, q.reshape(B, Hkv, G * Tq, D))  # row g * Tq + t: query head kv * G + g, query t
    if mask is not None:
        bias_free = mask if mask.dtype == torch.bool else mask == 0
        open_keys = bias_free.flatten(0, -2).all(0)  # (length,): keys no row hides or biases
        attended = (mask if mask.dtype == torch.bool else mask > float("-inf")).flatten(0, -2).any(0)
        pieces = [p for p in _pieces(open_keys, length, block) if bool(attended[p[0] : p[1]].any())]
    elif causal_offset is not None and causal_offset + 1 < length:
        # keys up to causal_offset: every row sees them; the later ones only some rows
        pieces = _pieces(torch.arange(length) <= causal_offset, length, block)
    else:
        pieces = _pieces(None, length, block)
    rows = torch.arange(Tq, device=q.device).unsqueeze(-1)  # (Tq, 1)
    out = lse = None
    hidden_rows = False  # whether some row may see no key
    for start, end, free in pieces:
        k = values(k_store, start, end, q.dtype)  # (B, Hkv, Tb, D)
        v = values(v_store, start, end, q.dtype)
        bias = seen = None
        if not free:
            part = mask[..., start:end] if mask is not None else None  # (B or 1, 1, Tq, Tb)
            if part is None:  # causal
                part = (torch.arange(start, end, device=q.device) <= rows + causal_offset)[None, None]
            bias, seen = _bias(part, G, q.dtype)
        o, block_lse = _block_attention(qm, k, v, scale, bias, softcap)
        del k, v, bias  # freed before the next block is dequantized
        if seen is not None:  # the flash kernel gives a row that sees no key here a log-sum-exp of 0
            block_lse = block_lse.masked_fill(~seen, float("-inf"))
            hidden_rows = True
        if out is None:
            out, lse = o, block_lse
            continue
        total = torch.logaddexp(lse, block_lse)  # (B, Hkv, G * Tq)
        safe = torch.where(torch.isinf(total), 0.0, total)
        out = (
            out.float()
            .mul_(torch.exp(lse - safe).unsqueeze(-1))
            .add_(o.float().mul_(torch.exp(block_lse - safe).unsqueeze(-1)))
        )
        lse = total
    if out is None:  # no row sees any key
        return q.new_zeros(B, Hkv, G, Tq, D)
    if hidden_rows:
        out = out.masked_fill(torch.isinf(lse).unsqueeze(-1), 0.0)  # rows that saw no key
    return turn(v_store, out).to(q.dtype).view(B, Hkv, G, Tq, -1)


def _block_size(B: int, Hkv: int, D: int, rows: int, flash: bool) -> int:
    """Tokens per block: one block's dequantized keys near VALUE_ELEMENTS, and where scores are materialized
    (not the flash kernel) one block's scores (rows x tokens) near SCORE_ELEMENTS."""
    tokens = VALUE_ELEMENTS // max(B * Hkv * D, 1)
    if not flash:
        tokens = min(tokens, SCORE_ELEMENTS // max(rows, 1))
    return max(16, min(MAX_BLOCK, tokens // 16 * 16))


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
    block: tokens per block (default: one block's dequantized keys near VALUE_ELEMENTS).
    Returns (B, Hq, Tq, Dv) in q's dtype, accumulated in float32. A row with no visible token gives zeros.
    """
    B, Hq, Tq, D = q.shape
    Hkv, L = len(k_store.bits), k_store.length
    if Hq % Hkv or v_store.length != L or L < Tq:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit stores of {Hkv} KV heads and {L}, {v_store.length} tokens"
        )
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G, Tq, D)  # query head h = kv * G + i
    flash = softcap is None and q.device.type == "cpu"
    outs = []
    for qs in range(0, Tq, QUERY_BLOCK):
        qe = min(qs + QUERY_BLOCK, Tq)
        offset = L - Tq + qs  # the stored position of query row qs
        part_mask = None if mask is None else mask[..., qs:qe, :]
        causal = None if mask is not None or Tq == 1 else offset
        length = L if mask is not None else min(L, offset + qe - qs)  # a causal pass skips unreachable keys
        size = block or _block_size(B, Hkv, D, B * Hq * (qe - qs), flash)
        outs.append(
            _attend(qg[:, :, :, qs:qe], k_store, v_store, scale, part_mask, causal, softcap, length, size)
        )
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 3)  # (B, Hkv, G, Tq, Dv)
    return out.reshape(B, Hq, Tq, -1)
