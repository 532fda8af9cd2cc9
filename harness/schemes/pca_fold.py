"""Attention over a pca-family store without dequantizing a token: the format's transforms folded into the query
before the sum and into the output after it (the arithmetic a fused decode kernel runs; kernels/).

This module owns that algebra for the stores it applies to (`foldable`): evenly spaced levels (PcaFormat.levels
UNIFORM) and one width for every component of a head (a flat plan, group 0), keys coded after RoPE (POST) or turned
back to the first position of their block of `block` tokens (BLOCK), token positions contiguous. A component c of
a head at width w then stands for offset_c + code_c * step_c (the uniform levels of w bits times the component's
fitted scale: `code_steps`), so with the head's mean m (D,) and basis U (D, D):

    key at position p, its block starting at r:  k = R(r) (m + U (offset + step * code))
    q . k = (R(-r) q) . m + sum_c (U^T R(-r) q)_c offset_c  +  sum_c (U^T R(-r) q)_c step_c code_c
          =            bias[r]                               +        query[r] . code

one query (B, Hq, D) and one bias (B, Hq) per block of the store (`fold_queries`): the scores are the codes'
products with their block's query plus its bias, the codes as they are stored. Values carry no turn: with
probabilities p summing to 1 over the tokens, sum_t p_t v_t = m + U (offset + step * sum_t p_t code_t), so attention
accumulates the codes and `unfold_output` maps the sum out (U applied once a step, not once a token).

Tokens kept in 16 bits beside the store (sink tokens) join the same softmax expressed in the codes' domain
(`to_codes`, real-valued codes of block 0's frame: each one's score and value are exactly its own).
"""

from __future__ import annotations

import torch

from harness.schemes.pca import PcaStore
from harness.schemes.pca_table import BLOCK, POST, UNIFORM, level_tables
from harness.schemes.rotary import turn
from kernels.layout import FULL_WIDTH


def foldable(store) -> str | None:
    """Why `store` cannot be folded (module docstring), or None when it can."""
    if not isinstance(store, PcaStore):
        return f"a {type(store).__name__} is not a pca-family store"
    fmt = store.fmt
    if fmt.levels != UNIFORM or fmt.group != 0:
        return f"{fmt}: a fold needs evenly spaced levels and one width a head (levels=uniform, group=0)"
    if fmt.key_frame not in (POST, BLOCK) and len(store.positions.theta):
        return "keys coded before RoPE turn by each token's own position: no query can hold that"
    if FULL_WIDTH in store.bits:
        return "a 16-bit head inside the store"
    if store.positions.kept is not None:
        return "positions left scattered by an eviction"
    return None


def _check(store) -> None:
    reason = foldable(store)
    if reason is not None:
        raise ValueError(f"pca fold: {reason}")


def code_steps(store: PcaStore, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offset, step) (Hw, D) float32 of the heads at width w: component c stands for offset_c + code * step_c."""
    levels, _ = level_tables(torch.device(store.device), UNIFORM)
    low, spacing = levels[w, 0], levels[w, 1] - levels[w, 0]
    scale = store.scale[w].float()  # (Hw, D)
    return low * scale, spacing * scale


def block_count(store: PcaStore) -> int:
    """The blocks of store.fmt.block tokens that the store's tokens fall in (1 in the POST frame)."""
    if store.fmt.key_frame == POST or not len(store.positions.theta):
        return 1
    return max(-(-store.length // store.fmt.block), 1)


def _block_angles(store: PcaStore, blocks: int) -> torch.Tensor:
    """The angles (1, 1, NB, R / 2) the keys of each block were turned back by (block b starts at first + b B)."""
    starts = torch.arange(blocks, device=store.device)[None] * max(store.fmt.block, 1) + store.first
    return store.positions.angle(store.fmt.reference_positions(starts, store.first))


def fold_queries(
    store: PcaStore, q: torch.Tensor, blocks: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
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


def unfold_output(store: PcaStore, acc: torch.Tensor) -> torch.Tensor:
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


def to_codes(store: PcaStore, x: torch.Tensor, role: str) -> torch.Tensor:
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
        basis = store.basis[w].double()  # (Hw, D, D): z solves U z = centred (U is fp16, nearly orthogonal)
        z = torch.linalg.solve(basis[None], centred.double().transpose(-1, -2)).transpose(-1, -2)
        out.index_copy_(1, heads, ((z.float() - offset[None, :, None]) / step[None, :, None]))
    return out
