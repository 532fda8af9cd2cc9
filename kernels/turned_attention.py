"""Decode attention over keys coded before RoPE, each dequantized key tile turned by its tokens' positions in the
kernel (KVQuant's way): the read side of harness/schemes/pca.py's `pca_gsa` format, where no query folds the keys'
turn (a turn per token) and the basis cannot fold into the query.

This module owns that kernel (a prototype: one width bucket, every KV head at one key plan and one value plan, no
sink tokens or other 16-bit segment, token positions contiguous, the splits combined by torch) and its host call.
Its static figures (python -m kernels.gpu.inspect --turned) say what the format costs a fused kernel; the harness's
caches do not call it yet. With `uniform` it reads pca_ugsa's format (evenly spaced levels folded into the basis
and mean: no lookup).

Format read (pca's module docstring with shared grouped plans, kernels/groups.py's rows): KV head h's token t at
sequence position first + t holds grouped codes under the role's plan; component c at b_c bits stands for
level_{b_c}[code_c] (the Lloyd-Max levels of N(0, 1): harness/schemes/pca_table.level_tables) times its scale, so
with the head's mean m (D,) and basis scaled by the scales, A = U diag(s) (D, C):
    key   k_t = R(first + t) (m_k + A_k level(code_t))       R(p): each rotary pair (i, i + D / 2) turned by p theta_i
    value v_t = m_v + A_v level(code_t)
One tile of BLOCK_N tokens n0 .. n0 + BLOCK_N - 1 (positions p0 + j, p0 = first + n0):
    K_pre = level(codes) @ A_k^T + m_k                                 (BLOCK_N, D): an mma with the basis a tile
    q . R(p0 + j) K_pre[j] = (R(-p0) q) . (R(j) K_pre[j])             the tile's turn split in two:
R(j) from a table of cos / sin (j theta) that every tile shares, R(-p0) applied to the G queries of the KV head
once a tile from a table of cos / sin (p0 theta) a tile (`turn_tables`, made on the host once a call). The keys are
made 16 channels of each half at a time (an mma against 16 columns of A_k each), turned in fp16 pairs and scored.
Values need no turn: attention sums the levels, sum_t p_t level(code_t), and the host maps that sum through A_v and
m_v once a step. Levels come from a table of every width (level_tables' rows, LEVEL_ROW entries apart, passed in),
one gathered load an element.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels import groups
from kernels.groups import (
    group_columns_jit,
    group_tile,
    group_value_columns_jit,
    group_value_tile,
    group_widths_jit,
)
from kernels.host import cdiv, next_power_of_2

LOG2E = math.log2(math.e)
LEVEL_ROW = 256  # level_tables' row length: width b's levels start at b * LEVEL_ROW
_LEVEL_ROW = tl.constexpr(LEVEL_ROW)
# Tokens a tile: at 64 the sm_90a build makes the keys with wgmma, 1743 loop instructions a 4-bit tile of plans
# 5,5,4,4,4,4,3,3 (27.2 a KV byte), where a 32-token tile's mma.sync operands move register by register (1891 a
# tile, 59.1 a byte): python -m kernels.gpu.inspect --turned uniform --widths 4 --key-plans 4=5,5,4,4,4,4,3,3
# --value-plans 4=5,5,4,4,4,4,3,3 --block-n 32 64 (Triton 3.6).
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _levels(lanes, offset, width, lev_ptr, mask_n):
    """A tile of grouped lanes (R, D) fp16 (each its code plus `offset` (D,)) whose columns are at widths `width`
    (D,) int32 -> their Lloyd-Max levels (R, D) fp16 from the table at lev_ptr (LEVEL_ROW floats a width); rows
    outside mask_n read level 0 of their width."""
    code = (lanes.to(tl.float32) - offset[None, :]).to(tl.int32)
    code = tl.where(mask_n[:, None], code, 0)
    return tl.load(lev_ptr + width[None, :] * _LEVEL_ROW + code).to(tl.float16)


@triton.jit
def _turned_step(q_rows, q_mask, tile_ptr, trig_ptr, kp, vp, n0, end, m_i, l_rows, acc, w_rows, mk, koff, kwid, vwid,
                 lev_ptr, D: tl.constexpr, KPLAN: tl.constexpr, VPLAN: tl.constexpr, KNW: tl.constexpr,
                 VNW: tl.constexpr, LOOKUP: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One tile of _turned_kernel's online softmax: tokens n0 .. n0 + BLOCK_N (those from `end` on masked out when
    MASKED) -> the updated (m_i, l_rows, acc). The keys are made, turned and scored 16 channels of each half at a
    time: each an mma of the tile's rows against 16 columns of A_k, which splits the warps over the tile's rows, as
    the codes' layout wants."""
    BLOCK_N: tl.constexpr = l_rows.shape[0]
    QG_B: tl.constexpr = l_rows.shape[1]
    H2: tl.constexpr = D // 2
    rows = n0 + tl.arange(0, BLOCK_N)
    mask_n = rows < end
    lv = group_tile(kp, rows, mask_n, KPLAN, D, KNW, ASM, MASKED)  # (BLOCK_N, D) fp16, codes + offsets
    if LOOKUP:
        lv = _levels(lv, koff, kwid, lev_ptr, mask_n)
    else:  # the codes (exact in fp16): an offset left in would cost its rounding in A's fp16 rows
        lv = lv - koff.to(tl.float16)[None, :]
    turn0 = tile_ptr + tl.cast(n0 // BLOCK_N, tl.int64) * D  # cos / sin (p0 theta) of this tile
    s = tl.zeros((BLOCK_N, QG_B), tl.float32)
    c16 = tl.arange(0, 16)
    j = tl.arange(0, BLOCK_N)
    for k in tl.static_range(H2 // 16):
        col = k * 16 + c16  # (16,) channels of the low half; col + H2 their partners
        m_lo = tl.broadcast_to(
            tl.load(mk + col)[None, :], (BLOCK_N, 16)
        )  # the mean, as the mma's accumulator
        m_hi = tl.broadcast_to(tl.load(mk + H2 + col)[None, :], (BLOCK_N, 16))
        k_lo = tl.dot(lv, tl.load(w_rows + col[None, :]), m_lo)  # (BLOCK_N, 16) float32
        k_hi = tl.dot(lv, tl.load(w_rows + H2 + col[None, :]), m_hi)
        cos_j = tl.load(trig_ptr + j[:, None] * D + col[None, :])  # (BLOCK_N, 16) fp16: cos / sin (j theta)
        sin_j = tl.load(trig_ptr + j[:, None] * D + H2 + col[None, :])
        k_lo = k_lo.to(tl.float16)
        k_hi = k_hi.to(tl.float16)
        r_lo = k_lo * cos_j - k_hi * sin_j  # R(j) K_pre
        r_hi = k_hi * cos_j + k_lo * sin_j
        q_lo = tl.load(q_rows + col[:, None], mask=q_mask[None, :], other=0.0)  # (16, QG_B) float32
        q_hi = tl.load(q_rows + H2 + col[:, None], mask=q_mask[None, :], other=0.0)
        cos0 = tl.load(turn0 + col)[:, None]
        sin0 = tl.load(turn0 + H2 + col)[:, None]
        qt_lo = (q_lo * cos0 + q_hi * sin0).to(tl.float16)  # R(-p0) q
        qt_hi = (q_hi * cos0 - q_lo * sin0).to(tl.float16)
        s = tl.dot(r_hi, qt_hi, tl.dot(r_lo, qt_lo, s))
    if MASKED:
        s = tl.where(mask_n[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    p = tl.exp2(s - m_new[None, :])
    alpha = tl.exp2(m_i - m_new)
    l_rows = l_rows * alpha[None, :] + p
    lvv = group_value_tile(vp, rows, mask_n, VPLAN, D, VNW, ASM, MASKED)  # (BLOCK_N, D) fp16, the codes
    if LOOKUP:
        lvv = _levels(lvv, tl.zeros((D,), tl.float32), vwid, lev_ptr, mask_n)
    acc = acc * alpha[None, :] + tl.dot(tl.trans(lvv), p.to(tl.float16))  # (D, QG_B)
    return m_new, l_rows, acc


@triton.jit
def _turned_kernel(
    q_ptr, stride_qb, stride_qh, kp_ptr, kp_sb, kp_sh, vp_ptr, vp_sb, vp_sh, wk_ptr, mk_ptr, lev_ptr, tile_ptr,
    trig_ptr, L, m_ptr, l_ptr, o_ptr, chunk, num_splits,
    HKV: tl.constexpr, QG: tl.constexpr, QG_B: tl.constexpr, D: tl.constexpr, KPLAN: tl.constexpr,
    VPLAN: tl.constexpr, KNW: tl.constexpr, VNW: tl.constexpr, LOOKUP: tl.constexpr, BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """One program: batch row b, KV head h, split sp of `chunk` tokens (a whole number of tiles). q_ptr: the queries
    (B, Hq, D) float32, turned by their own position and scaled by log2(e) / sqrt(D); kp_ptr, vp_ptr: int32 words
    (B, Hkv, T, KNW / VNW) of the grouped rows; wk_ptr: fp16 (Hkv, C, D), row c component c's column of A_k;
    mk_ptr: float32 (Hkv, D); tile_ptr: float32 (tiles, D), tile n's cos (D / 2) then sin (D / 2) of its first
    token's position times theta; trig_ptr: fp16 (BLOCK_N, D), row j's cos then sin of j theta; L tokens stored.
    Writes the split's running max, sum and unnormalized sum of value levels (by component) to m_ptr, l_ptr (rows of
    num_splits) and o_ptr (rows of D)."""
    sp = tl.program_id(0)
    h = tl.program_id(1)
    b64 = tl.program_id(2).to(tl.int64)
    i = tl.arange(0, QG_B)
    q_rows = q_ptr + b64 * stride_qb + (h * QG + i)[None, :] * stride_qh  # (1, QG_B): the KV head's queries
    kcol, koff = group_columns_jit(KPLAN, D)  # (D,): the component each key tile column holds, its offset
    kwid = group_widths_jit(KPLAN, D)  # (D,) a column's width (its group's: columns keep their groups)
    vcol = group_value_columns_jit(VPLAN, D)
    vwid = group_widths_jit(VPLAN, D)
    w_rows = wk_ptr + h * D * D + kcol[:, None] * D  # (D, 1): A_k's rows in the key tile's column order
    mk = mk_ptr + h * D
    kp = kp_ptr + b64 * kp_sb + h.to(tl.int64) * kp_sh
    vp = vp_ptr + b64 * vp_sb + h.to(tl.int64) * vp_sh

    start = tl.minimum(sp * chunk, L)
    end = tl.minimum(start + chunk, L)
    m_i = tl.full((QG_B,), float("-inf"), tl.float32)
    l_rows = tl.zeros((BLOCK_N, QG_B), tl.float32)
    acc = tl.zeros((D, QG_B), tl.float32)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    for n0 in tl.range(start, full_end, BLOCK_N, num_stages=STAGES):
        m_i, l_rows, acc = _turned_step(
            q_rows, i < QG, tile_ptr, trig_ptr, kp, vp, n0, end, m_i, l_rows, acc, w_rows, mk, koff, kwid, vwid,
            lev_ptr, D, KPLAN, VPLAN, KNW, VNW, LOOKUP, ASM, False,
        )  # fmt: skip
    if full_end < end:
        m_i, l_rows, acc = _turned_step(
            q_rows, i < QG, tile_ptr, trig_ptr, kp, vp, full_end, end, m_i, l_rows, acc, w_rows, mk, koff, kwid,
            vwid, lev_ptr, D, KPLAN, VPLAN, KNW, VNW, LOOKUP, ASM, True,
        )  # fmt: skip
    l_i = tl.sum(l_rows, axis=0)
    row = (b64 * HKV * QG + h * QG + i) * num_splits + sp  # (QG_B,)
    tl.store(m_ptr + row, m_i, mask=i < QG)
    tl.store(l_ptr + row, l_i, mask=i < QG)
    tl.store(o_ptr + row[None, :] * D + vcol[:, None], acc, mask=(i < QG)[None, :])


def turn_tables(
    theta: torch.Tensor, first: int, length: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's turns, from theta (D / 2,) float32, token t at position first + t: per tile n, cos then sin of
    (first + n block_n) theta, float32 (tiles, D); per row j of a tile, cos then sin of j theta, fp16 (block_n, D)
    (angles in float64, as harness/schemes/rotary.TokenPositions makes them)."""
    theta = theta.double()
    starts = first + block_n * torch.arange(cdiv(length, block_n), device=theta.device, dtype=torch.float64)
    tile = (starts[:, None] * theta).float()
    rows = (torch.arange(block_n, device=theta.device, dtype=torch.float64)[:, None] * theta).float()
    both = lambda a: torch.cat([torch.cos(a), torch.sin(a)], -1)  # noqa: E731
    return both(tile).contiguous(), both(rows).to(torch.float16).contiguous()


def default_splits(length: int, block_n: int = BLOCK_N) -> int:
    """Splits of a head's tokens: one a 1024 tokens, at least one, each a whole number of tiles."""
    return max(1, min(cdiv(length, 1024), cdiv(length, block_n)))


def fold_uniform(
    basis: torch.Tensor, mean: torch.Tensor, plan: tuple[int, ...], levels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Evenly spaced levels folded into a role's basis A (H, D, C) and mean (H, D), float32: level_b(code) =
    low_b + step_b code (levels' rows, evenly spaced), so that codes @ A'^T + m' are the tokens (before RoPE, for
    keys) and m' + A' sum_t p_t code_t the attention output (values): A' = A diag(step), m' = m + A low."""
    width = torch.tensor(plan, device=basis.device).repeat_interleave(groups.GROUP)  # (C,) by component
    low = torch.where(width > 0, levels[width, 0], 0.0)
    step = torch.where(width > 0, levels[width, 1] - levels[width, 0], 0.0)
    return basis * step, mean + basis @ low


def launch(
    q: torch.Tensor, k_words: torch.Tensor, v_words: torch.Tensor, k_plan: tuple[int, ...], v_plan: tuple[int, ...],
    k_rows: torch.Tensor, k_mean: torch.Tensor, levels: torch.Tensor, tile_turns: torch.Tensor, row_turns: torch.Tensor,
    length: int, sm_scale: float, lookup: bool = True, splits: int | None = None, block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
):  # fmt: skip
    """Stage 1 over one layer's stores -> (kernel, grid, arguments, keyword arguments, partials): the launch not yet
    run (the inspector compiles it as caught) and its outputs (m, l (B Hq splits,) and o (B Hq splits, D) float32).
    Arguments as `turned_attention`'s: tile_turns, row_turns `turn_tables`', k_words, v_words the rows as int32 words (B, Hkv, T, words), k_rows the fp16
    (Hkv, C, D) rows of A_k^T (folded where not `lookup`), k_mean float32 (Hkv, D)."""
    B, Hq, D = q.shape
    Hkv = k_words.shape[1]
    splits = splits or default_splits(length, block_n)
    chunk = cdiv(cdiv(length, splits), block_n) * block_n
    dev = q.device
    qg = Hq // Hkv
    qs = (q.float() * (sm_scale * LOG2E)).contiguous()
    m = torch.empty(B * Hq * splits, dtype=torch.float32, device=dev)
    l_part = torch.empty_like(m)
    o = torch.empty(B * Hq * splits, D, dtype=torch.float32, device=dev)
    args = (qs, qs.stride(0), qs.stride(1), k_words, k_words.stride(0), k_words.stride(1), v_words,
            v_words.stride(0), v_words.stride(1), k_rows, k_mean, levels, tile_turns, row_turns, length, m, l_part, o, chunk,
            splits)  # fmt: skip
    kwargs = dict(
        HKV=Hkv, QG=qg, QG_B=max(16, next_power_of_2(qg)), D=D, KPLAN=groups.plan_code(k_plan),
        VPLAN=groups.plan_code(v_plan), KNW=k_words.shape[-1], VNW=v_words.shape[-1], LOOKUP=lookup,
        BLOCK_N=block_n, STAGES=num_stages, ASM=os.environ.get("TRITON_INTERPRET") != "1", num_warps=num_warps,
    )  # fmt: skip
    return _turned_kernel, (splits, Hkv, B), args, kwargs, (m, l_part, o)


def turned_attention(
    q: torch.Tensor, k_codes: torch.Tensor, v_codes: torch.Tensor, k_plan: tuple[int, ...], v_plan: tuple[int, ...],
    k_basis: torch.Tensor, k_mean: torch.Tensor, v_basis: torch.Tensor, v_mean: torch.Tensor, levels: torch.Tensor,
    theta: torch.Tensor, first: int, sm_scale: float, uniform: bool = False, splits: int | None = None,
    block_n: int = BLOCK_N,
) -> torch.Tensor:  # fmt: skip
    """One decode step's attention over a layer of pca_gsa-format stores (module docstring), every KV head at one
    key and one value plan; with `uniform`, pca_ugsa's (evenly spaced levels, folded into the basis: no lookup).

    q (B, Hq, D): the queries after RoPE. k_codes, v_codes: uint8 (B, Hkv, T, 2 sum(plan)), kernels.groups.pack's
    rows of the codes under k_plan / v_plan. k_basis, v_basis (Hkv, D, C) float32: A = U diag(scales), column c
    component c's; k_mean, v_mean (Hkv, D) float32. levels (9, LEVEL_ROW) float32: row b the 2**b levels of b bits
    (harness/schemes/pca_table.level_tables' levels of the format's kind). theta (D / 2,) float32: the rotary turn
    per position of each pair; token t of the stores at position first + t. -> (B, Hq, D) float32."""
    B, Hq, D = q.shape
    Hkv, T = k_codes.shape[1], k_codes.shape[2]
    if D % 32 or Hq % Hkv:
        raise ValueError(f"turned_attention: head_dim {D} (a multiple of 32) and {Hq} query / {Hkv} KV heads")
    levels = levels.float().contiguous()
    k_basis, k_mean, v_basis, v_mean = (t.float() for t in (k_basis, k_mean, v_basis, v_mean))
    if uniform:
        k_basis, k_mean = fold_uniform(k_basis, k_mean, k_plan, levels)
        v_basis, v_mean = fold_uniform(v_basis, v_mean, v_plan, levels)
    k_words = k_codes.contiguous().view(torch.int32)
    v_words = v_codes.contiguous().view(torch.int32)
    k_rows = k_basis.transpose(1, 2).to(torch.float16).contiguous()  # (Hkv, C, D)
    kernel, grid, args, kwargs, (m, l_part, o) = launch(
        q, k_words, v_words, k_plan, v_plan, k_rows, k_mean.contiguous(), levels,
        *turn_tables(theta.to(q.device), first, T, block_n), T, sm_scale, not uniform, splits, block_n,
    )  # fmt: skip
    kernel[grid](*args, **kwargs)
    n = grid[0]
    m, l_part, o = m.view(B, Hq, n), l_part.view(B, Hq, n), o.view(B, Hq, n, D)
    top = m.max(-1, keepdim=True).values
    weight = torch.exp2(m - top)  # (B, Hq, n); an empty split (m = -inf) weighs 0
    summed = (o * weight[..., None]).sum(2) / (l_part * weight).sum(
        -1, keepdim=True
    )  # (B, Hq, C): sum_t p_t level
    heads = torch.arange(Hq, device=q.device) // (Hq // Hkv)
    return v_mean[heads] + torch.einsum("bhc,hdc->bhd", summed, v_basis[heads])
