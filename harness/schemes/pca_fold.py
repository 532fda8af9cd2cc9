"""Attention over a pca-family store without dequantizing a token: the format's transforms folded into the query
before the sum and into the output after it (the arithmetic a fused decode kernel runs; kernels/).

This module owns that algebra for the stores it applies to (`foldable`): evenly spaced levels (PcaFormat.levels
UNIFORM) and plans a kernel compiles, one width for every component of a head (a flat plan, group 0) or one plan of
16-component groups at 0 to 8 bits per role and width for every head (shared grouped plans:
kernels/groups.py), keys coded after RoPE (POST) or turned back to the first position of their block of `block`
tokens (BLOCK), token positions contiguous. A component c at b_c bits then stands for offset_c + code_c * step_c
(the uniform levels of b_c bits times the component's fitted scale: `code_steps`; at 0 bits every stored code is 0,
offset_c is 0 and step_c the scale, so that a sink token's real-valued code there keeps its share), so with the
head's mean m (D,) and basis U (D, D):

    key at position p, its block starting at r:  k = R(r) (m + U (offset + step * code))
    q . k = (R(-r) q) . m + sum_c (U^T R(-r) q)_c offset_c  +  sum_c (U^T R(-r) q)_c step_c code_c
          =            bias[r]                               +        query[r] . code

one query (B, Hq, D) and one bias (B, Hq) per block of the store (`fold_queries`): the scores are the codes'
products with their block's query plus its bias, the codes as they are stored. Values carry no turn: with
probabilities p summing to 1 over the tokens, sum_t p_t v_t = m + U (offset + step * sum_t p_t code_t), so attention
accumulates the codes and `unfold_output` maps the sum out (U applied once a step, not once a token).

Tokens kept in 16 bits beside the store (sink tokens) join the same softmax expressed in the codes' domain
(`to_codes`, real-valued codes of block 0's frame: each one's score and value are exactly its own).

`decode` is one decode step of the triton backend over such stores (PcaStore with `codes_only`: the codes in
kernels.layout codes-only stores): the fold around kernels/decode_attention.py's decode_attention_blocks.
`packed_decode` is the same step on the torch backend (PcaStore: the codes in their bitstreams), the codes read and
attended block by block in float32 (the online softmax of kernels/packed_attention.py): per stored token one
unpack and two dot products of D, where reading dequantized tokens costs a level lookup and a D x D basis product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.schemes.pca_table import BLOCK, POST, PRE, UNIFORM, PcaFormat, level_tables
from harness.schemes.rotary import turn
from harness.schemes.wrappers import SinkStore
from kernels import groups
from kernels.layout import FULL_WIDTH


def format_reason(fmt: PcaFormat) -> str | None:
    """Why a store of format `fmt` cannot be folded whatever it holds, or None when it can."""
    grouped = (
        fmt.group == groups.GROUP and fmt.shared_plans and set(fmt.group_widths) <= set(groups.GROUP_WIDTHS)
    )
    if fmt.levels != UNIFORM or not (fmt.group == 0 or grouped):
        return (
            f"{fmt}: a fold needs evenly spaced levels and one width a head (levels=uniform, group=0), or plans of "
            f"{groups.GROUP} components at 0 to {max(groups.GROUP_WIDTHS)} bits shared by every head (shared_plans)"
        )
    if fmt.key_frame == PRE:
        return f"{fmt}: keys coded before RoPE turn by each token's own position; a fold needs key_frame post or block"
    if fmt.own_pairs:
        return f"{fmt}: its own pairs turn by each token's own position; a fold turns a block by its first position"
    return None


def foldable(store) -> str | None:
    """Why `store` (a harness.schemes.pca.PcaStore) cannot be folded (module docstring), or None when it can."""
    fmt = getattr(store, "fmt", None)
    if not isinstance(fmt, PcaFormat):
        return f"a {type(store).__name__} is not a pca-family store"
    reason = format_reason(fmt)
    if reason is not None:
        return reason
    if FULL_WIDTH in store.bits:
        return "a 16-bit head inside the store"
    if getattr(store, "outliers", 0):
        return "outliers kept beside the codes (quant.outliers)"
    if store.positions.kept is not None:
        return "positions left scattered by an eviction"
    turned_blocks = fmt.key_frame == BLOCK and len(store.positions.theta)
    if turned_blocks and store.positions.next - store.length != store.first:
        return "a window that has dropped the store's first keys (its blocks no longer start at token 0)"
    return None


def _check(store) -> None:
    reason = foldable(store)
    if reason is not None:
        raise ValueError(f"pca fold: {reason}")


def code_steps(store, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offset, step) (Hw, D) float32 of the heads at width w: component c stands for offset_c + code * step_c (at a
    component of 0 bits, whose stored codes are 0: 0 and the scale)."""
    levels, _ = level_tables(torch.device(store.device), UNIFORM)
    bits = store.plan[w].long()  # (Hw, D)
    coded = bits > 0
    low = torch.where(coded, levels[bits, 0], 0.0)
    # the spacing over the whole span of levels, in float64: a code of up to 255 times it stays within a rounding of
    # its level (levels[1] - levels[0] in float32 is off by up to half an ulp of levels[0], 255 times over)
    top = levels[bits, (1 << bits) - 1].double()
    spacing = torch.where(coded, (top - low.double()) / ((1 << bits) - 1).clamp(min=1), 1.0).float()
    scale = store.scale[w].float()  # (Hw, D)
    return low * scale, spacing * scale


def block_count(store) -> int:
    """The blocks of store.fmt.block tokens that the store's tokens fall in (1 in the POST frame)."""
    if store.fmt.key_frame == POST or not len(store.positions.theta):
        return 1
    return max(-(-store.length // store.fmt.block), 1)


def _block_angles(store, blocks: int) -> torch.Tensor:
    """The angles (1, 1, NB, R / 2) the keys of each block were turned back by (block b starts at first + b B)."""
    starts = torch.arange(blocks, device=store.device)[None] * max(store.fmt.block, 1) + store.first
    return store.positions.angle(store.fmt.reference_positions(starts, store.first))


def fold_queries(store, q: torch.Tensor, blocks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys' store, q (B, Hq, D) (query head i reads KV head i // (Hq / Hkv)) -> (query (B, Hq, NB, D), bias
    (B, Hq, NB)) float32 per block of the store (module docstring); NB = `blocks` or block_count(store)."""
    _check(store)
    B, Hq, D = q.shape
    Hkv = len(store.bits)
    blocks = block_count(store) if blocks is None else blocks
    angle = _block_angles(store, blocks)  # (1, 1, NB, R / 2)
    qkv = q.float().view(B, Hkv, Hq // Hkv, 1, D).expand(-1, -1, -1, blocks, -1)  # (B, Hkv, G, NB, D)
    turned = turn(qkv.reshape(B, Hkv, -1, D), -angle.repeat(1, 1, Hq // Hkv, 1))  # (B, Hkv, G NB, D)
    turned = turned.view(B, Hkv, Hq // Hkv, blocks, D)
    query = torch.empty(B, Hkv, Hq // Hkv, blocks, D, device=q.device)
    bias = torch.empty(B, Hkv, Hq // Hkv, blocks, device=q.device)
    for w in store.widths:
        heads = store.heads[w]
        offset, step = code_steps(store, w)  # (Hw, D)
        part = turned.index_select(1, heads)  # (B, Hw, G, NB, D)
        onto = torch.einsum("bhgnd,hdc->bhgnc", part, store.basis[w].float())  # U^T R(-r) q
        query.index_copy_(1, heads, onto * step[None, :, None, None])
        through_mean = torch.einsum("bhgnd,hd->bhgn", part, store.mean[w].float())
        bias.index_copy_(1, heads, through_mean + torch.einsum("bhgnc,hc->bhgn", onto, offset))
    return query.view(B, Hq, blocks, D), bias.view(B, Hq, blocks)


def unfold_output(store, acc: torch.Tensor) -> torch.Tensor:
    """Values' store, acc (B, Hq, D) float32: the probability-weighted sum of the codes (probabilities summing to
    1) -> the attention output (B, Hq, D) float32 (module docstring)."""
    _check(store)
    B, Hq, D = acc.shape
    Hkv = len(store.bits)
    grouped = acc.float().view(B, Hkv, Hq // Hkv, D)
    out = torch.empty_like(grouped)
    for w in store.widths:
        heads = store.heads[w]
        offset, step = code_steps(store, w)  # (Hw, D)
        z = grouped.index_select(1, heads) * step[None, :, None] + offset[None, :, None]  # (B, Hw, G, D)
        y = torch.einsum("bhgc,hdc->bhgd", z, store.basis[w].float()) + store.mean[w].float()[None, :, None]
        out.index_copy_(1, heads, y)
    return out.view(B, Hq, D)


def to_codes(store, x: torch.Tensor, role: str) -> torch.Tensor:
    """Tokens x (B, Hkv, T, D) kept in 16 bits beside `store` (keys turned by their own positions, as the model
    gives them) -> float32 (B, Hkv, T, D) real-valued codes of block 0's frame whose scores against fold_queries'
    block-0 query and bias, and whose values through unfold_output, are exactly x's own."""
    _check(store)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    y = x.float()
    if role == "key" and len(store.positions.theta):
        y = turn(y, -_block_angles(store, 1))
    for w in store.widths:
        heads = store.heads[w]
        offset, step = code_steps(store, w)
        centred = y.index_select(1, heads) - store.mean[w].float()[None, :, None]  # (B, Hw, T, D)
        z = torch.einsum("hcd,bhtd->bhtc", store.inverse_basis(w), centred.double())  # U z = centred
        out.index_copy_(1, heads, ((z.float() - offset[None, :, None]) / step[None, :, None]))
    return out


def split_sinks(store) -> tuple:
    """A layer's keys or values store -> (its pca store, the sink tokens (B, Hkv, S, D) kept in 16 bits beside
    it, or None)."""
    if isinstance(store, SinkStore):
        sinks, base = store.parts
        return base, (sinks.tokens if sinks.length else None)
    return store, None


def _sinks_only(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Attention of q (B, Hq, D) over 16-bit tokens alone (B, Hkv, S, D) each: (B, Hq, D) float32."""
    group = q.shape[1] // keys.shape[1]
    k, v = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    p = torch.softmax(torch.einsum("bhd,bhsd->bhs", q.float(), k) * sm_scale, -1)
    return torch.einsum("bhs,bhsd->bhd", p, v)


def decode(
    q: torch.Tensor, k_store, v_store, sm_scale: float, length: torch.Tensor | None = None
) -> torch.Tensor:
    """One decode step of a layer whose stores are the triton backend's pca stores (codes in codes-only
    kernels.layout stores; sink tokens beside them): q (B, Hq, D) -> the attention output (B, Hq, D) in q's dtype.
    `length`: the layer's stored tokens as an int32 device tensor (CUDA-graph decoding), or None (host lengths).

    The fold (fold_queries, to_codes for the sinks) around kernels.decode_attention.decode_attention_blocks, then
    unfold_output: no stored token is dequantized."""
    from kernels.decode_attention import decode_attention_blocks  # imports triton: only on the triton backend

    keys, k_sinks = split_sinks(k_store)
    values, v_sinks = split_sinks(v_store)
    if keys.length == 0:  # every token so far is a sink
        return _sinks_only(q, k_sinks, v_sinks, sm_scale).to(q.dtype)
    blocked = keys.fmt.key_frame == BLOCK and len(keys.positions.theta)
    blocks = None
    if (
        length is not None
    ):  # the layer's count on the device: the codes' is less the sinks; a query a block of room
        length = length - (k_store.length - keys.length)
        blocks = -(-keys.packed.capacity // keys.fmt.block) if blocked else 1
    query, bias = fold_queries(keys, q, blocks)  # (B, Hq, NB, D), (B, Hq, NB)
    if q.dtype in (torch.float16, torch.bfloat16):
        query = query.to(torch.float16)  # the fast kernel's mmas run in fp16
    extra = (None, None)
    if k_sinks is not None:
        extra = (to_codes(keys, k_sinks, "key"), to_codes(values, v_sinks, "value"))
    acc = decode_attention_blocks(
        query,
        bias,
        keys.packed,
        values.packed,
        sm_scale,
        keys.fmt.block if blocked else None,
        *extra,
        length=length,
    )
    return unfold_output(values, acc).to(q.dtype)


PIECE_ELEMENTS = 1 << 21  # codes of one piece of packed_decode, per role: 8 MiB in float32


def _piece_tokens(store, block: int | None) -> int:
    """Tokens per piece of packed_decode: one piece's codes near PIECE_ELEMENTS, a whole number of the keys'
    blocks of `block` tokens where they turn by block (so that a piece starts where a block does)."""
    unit = block or 16
    tokens = PIECE_ELEMENTS // max(store.batch * len(store.bits) * store.head_dim, 1)
    return max(unit, tokens // unit * unit)


def _piece_scores(
    query: torch.Tensor, bias: torch.Tensor, codes: torch.Tensor, start: int, block: int | None
):
    """Scores (B, Hkv, G, Tp) of the codes (B, Hkv, Tp, D) float32 of stored tokens [start, start + Tp) against
    the folded queries (B, Hkv, G, NB, D) and biases (B, Hkv, G, NB): each token against its block's (block None:
    one frame, NB = 1). `start` is a multiple of `block`."""
    if block is None:
        return torch.einsum("bhgd,bhtd->bhgt", query[:, :, :, 0], codes) + bias[:, :, :, :1]
    B, H, Tp, D = codes.shape
    first, blocks = start // block, -(-Tp // block)
    padded = F.pad(codes, (0, 0, 0, blocks * block - Tp)).view(B, H, blocks, block, D)
    scores = torch.einsum("bhgnd,bhnsd->bhgns", query[:, :, :, first : first + blocks], padded)
    scores = scores + bias[:, :, :, first : first + blocks, None]
    return scores.flatten(-2)[..., :Tp]


def packed_decode(
    q: torch.Tensor, k_store, v_store, sm_scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor | None:
    """One decode step of a layer whose stores are the torch backend's pca stores (sink tokens beside them), by the
    fold (module docstring): q (B, Hq, D), mask None or the model's (B or 1, 1, 1, L) over the layer's L tokens
    (bool, True = attend, or additive float) -> the attention output (B, Hq, D) float32; None where a store
    cannot be folded (`foldable`: the caller reads the dequantized tokens instead). No token is dequantized: the
    sinks become real-valued codes (to_codes), the stored codes are read piece by piece, and the output is mapped
    out of the codes once (unfold_output). A row no key is visible to gives zeros."""
    keys, k_sinks = split_sinks(k_store)
    values, v_sinks = split_sinks(v_store)
    if foldable(keys) is not None or foldable(values) is not None or (k_sinks is None) != (v_sinks is None):
        return None
    B, Hq, D = q.shape
    Hkv = len(keys.bits)
    G = Hq // Hkv
    block = keys.fmt.block if keys.fmt.key_frame == BLOCK and len(keys.positions.theta) else None
    query, bias = fold_queries(keys, q)  # (B, Hq, NB, D), (B, Hq, NB)
    query, bias = query.view(B, Hkv, G, -1, D), bias.view(B, Hkv, G, -1)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
    size = _piece_tokens(keys, block)

    def pieces():
        """(scores (B, Hkv, G, Tp) before scaling, value codes (B, Hkv, Tp, D)), sinks first; each piece read when
        its turn comes (one piece's codes alive at a time)."""
        if k_sinks is not None:
            sink_codes = to_codes(keys, k_sinks, "key")  # (B, Hkv, S, D), in block 0's frame
            yield _piece_scores(query, bias, sink_codes, 0, None), to_codes(values, v_sinks, "value")
        for start in range(0, keys.length, size):
            end = min(start + size, keys.length)
            yield (
                _piece_scores(query, bias, keys.code_block(start, end), start, block),
                values.code_block(start, end),
            )

    high = torch.full((B, Hkv, G), float("-inf"), device=q.device)  # the running maximum score
    total = torch.zeros(B, Hkv, G, device=q.device)  # the running sum of exp(score - high)
    acc = torch.zeros(B, Hkv, G, D, device=q.device)  # the running sum of exp(score - high) * value codes
    column = 0
    for scores, codes in pieces():
        scores = scores * sm_scale
        if mask is not None:
            scores = scores + mask[..., column : column + scores.shape[-1]].float().view(
                -1, 1, 1, scores.shape[-1]
            )
        column += scores.shape[-1]
        new_high = torch.maximum(high, scores.amax(-1))
        safe = torch.where(torch.isinf(new_high), 0.0, new_high)  # rows that see no key yet
        keep = torch.exp(high - safe)
        p = torch.exp(scores - safe[..., None])  # (B, Hkv, G, Tp)
        total = total * keep + p.sum(-1)
        acc = acc * keep[..., None] + p @ codes  # (B, Hkv, G, D)
        high = new_high
    out = unfold_output(values, (acc / total.clamp(min=1e-30)[..., None]).view(B, Hq, D))
    return out.masked_fill((total == 0).view(B, Hq, 1), 0.0)
