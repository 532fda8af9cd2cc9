"""Split-KV (flash-decoding) attention for one decode step, reading packed K and V directly.

This module owns the read side of the fused path: for query q (B, Hq, D) it attends over the tokens of two
PackedStores (kernels/layout.py) holding one layer's keys and values, each KV head at its own width, plus an
optional full-precision extra segment per KV head (attention sinks, a residual window) inside the same
softmax. Nothing dequantized ever reaches memory: codes are unpacked and scaled in registers, tile by tile.
Stage 1 writes per-split partial results (running max, sum, unnormalized output) into a preallocated
workspace. The KV heads fall into buckets by (key width, value width): the buckets packed at 2, 3, 4 or 8 bits
run in one launch of the fast kernel, each bucket a branch compiled for its own widths, tile and pipeline, and
any other bucket (16 bits, float32 queries) in a launch of the generic kernel of its own; stage 2 merges the
splits with log-sum-exp. With `length` given as a device tensor the
launches read the token count on the device and depend on no host value that changes from step to step: a
decode step can be captured in a CUDA graph and replayed as the stores grow (within their capacity).

decode_attention_blocks does the same over codes-only stores (no scales or zeros: formats whose transforms are folded
into the query and the output), with a query and a bias per block of stored tokens, in the codes' domain: a launch of
_block_query_kernel first makes each block's query the fast kernel's operand, then each kernel runs a codes-only
branch of its own.
"""

from __future__ import annotations

import functools
import itertools
import math
import os

import torch
import triton
import triton.language as tl

from kernels.groups import group_columns_jit, group_tile, group_value_columns_jit, group_value_tile
from kernels.host import cdiv, next_power_of_2, sm_count
from kernels.quantize import check_group_size, check_widths
from kernels.unpack import (
    EXACT_CODES,
    OFFSET_CODES,
    code_of_column_jit,
    code_of_columns_jit,
    code_offsets_jit,
    dequant_tile,
    dequant_tile3,
    fast_path_fits,
    group_constants,
    pack_f16x2,
)

LOG2E = math.log2(math.e)
# The generic kernel's tokens per tile: at 64 (4 warps) the sm_90 build spills registers; 32 does not.
BLOCK_N = 32
# The fast packed kernel's launch by width (a bucket of two widths takes the one with the smaller tile:
# _fast_launch): tokens per tile (the M of its score mma), software-pipeline stages, and a register cap (ptxas's
# --maxrregcount). History, 4 warps at 32 query / 8 KV heads, batch 8, 32K (results/kernels/NVIDIA_H100_80GB_HBM3):
# with 5317e84's loop and Triton's 3 stages, uncapped (check-6e86fcf/tune), 4 bits took 154 us at 64 tokens
# against 164 at 128 (126 registers against 168: 4 blocks an SM against 3), 2 bits 130 us at 128 against 141 at
# 64, 32-token tiles were slower at every width; 8 bits (check-4515883's A/B) 215 us at 64 against 218 at 128.
# Now 2 and 4 bits take 128 tokens, 2 stages and at most 128 registers, chosen by the static figures alone
# (`python -m kernels.gpu.inspect --widths 4 --block-n 64 128 --stages 2 3 --maxnreg 128`, Triton 3.6, sm_90a):
# at 4 bits 631 loop instructions a 128-token tile (3.94 per KV byte), no spills, 128 registers (168 uncapped) and
# 54 KB of shared memory (4 blocks an SM, as at 64 tokens), against 730 for two 64-token tiles; at 2 bits 528
# instructions at 128 registers (the cap does not bind there: 525 uncapped). 3 bits take 64 tokens, 2 stages and
# the cap: 371 instructions a tile against 385 (at 128 tokens 670 against 770, but ptxas spills a register outside
# the loop, as in a bucket of 3 and 4 bits). 8 bits keep their timed setting (at 128 tokens 721 instructions
# against 810, but 70 KB of shared memory: 3 blocks an SM). Not yet timed on a GPU: kernels.gpu.bench's tuning
# grid times these settings beside the earlier ones.
FAST_LAUNCH = {
    2: {"block_n": 128, "num_stages": 2, "maxnreg": 128},
    3: {"block_n": 64, "num_stages": 2, "maxnreg": 128},
    4: {"block_n": 128, "num_stages": 2, "maxnreg": 128},
    8: {"block_n": 64, "num_stages": 3},
}
# Heads of 64 channels and fewer (smollm2-135m's and the other small models'), where the compiled code differs, by
# the static figures alone (`python -m kernels.gpu.inspect --head-dim 64 --hq 9 --hkv 3 ...`, Triton 3.6,
# sm_90a): at 2 bits a 128-token V tile goes to shared memory in 64 16-bit stores (Triton lays it out
# token-major), 438 loop instructions against 2 x 198 at 64 tokens; at 8 bits 128 tokens, 2 stages and the cap
# take 419 against 2 x 258 (and 64/3 spills 16 bytes outside the loop). 4 bits keep 128 tokens (380).
FAST_LAUNCH_SMALL_HEADS = {
    **FAST_LAUNCH,
    2: {"block_n": 64, "num_stages": 2, "maxnreg": 128},
    8: {"block_n": 128, "num_stages": 2, "maxnreg": 128},
}
# The codes-only path's launch (decode_attention_blocks; its own loop, so its own figures: `python -m
# kernels.gpu.inspect --codes --qblock 128 --widths 4 3 2 8 --block-n 64 128 --maxnreg 0`, Triton 3.6, sm_90a, 32
# query / 8 KV heads, head_dim 128, blocks of 128 tokens; kernels at 48d393a): 128-token tiles at every width (two
# 64-token tiles take 666 / 570 / 720 / 638 loop instructions against 562 / 470 / 596 / 526 at 4 / 2 / 3 / 8 bits),
# 2 stages (3: 579 at 4 bits), and no register cap but at 8 bits: capped at 128, ptxas spends 23 more instructions at
# 4 bits and at 8 (it leaves the predicates of the pipelined copies to be rebuilt before each), where uncapped it
# takes 128 registers at blocks of 128 tokens (the tiles address rows with int32 offsets) but 168 with one block's
# query held in registers (--qblock 0: 487 instructions against 489 capped). Measured before those offsets: heads of 64 channels (9 query / 3 KV heads): 2 bits at 64-token tiles (193
# instructions against 410 for 128); heads of 256 (8 / 1): the cap at 2, 3 and 4 bits (4 bits: 1070 instructions at
# 128 registers, 168 uncapped), 8 bits at 64-token tiles and no cap (154 registers; capped, 56 bytes of spills).
CODES_LAUNCH = {w: {"block_n": 128, "num_stages": 2} for w in (2, 3, 4)} | {
    8: {"block_n": 128, "num_stages": 2, "maxnreg": 128}
}
CODES_LAUNCH_SMALL_HEADS = {**CODES_LAUNCH, 2: {"block_n": 64, "num_stages": 2}}
CODES_LAUNCH_LARGE_HEADS = {w: {"block_n": 128, "num_stages": 2, "maxnreg": 128} for w in (2, 3, 4)} | {
    8: {"block_n": 64, "num_stages": 2}
}
# A codes-only bucket whose width has no entry above (a grouped plan's 1, 5, 6 or 7 bits: kernels/groups.py) takes
# this launch (`python -m kernels.gpu.inspect --codes --map 5,5,5,5,5,5,5,5 --key-plans 5=8,8,4,4,4,4,4,4
# --value-plans 5=8,8,4,4,4,4,4,4 --block-n 64 128`, Triton 3.6, sm_90a, under the cap below; kernels at 48d393a):
# 128-token tiles, 685 loop instructions against 2 x 391 at 64 (5 and 4 bits: 608 against 2 x 351; 1 and 1: 592
# against 2 x 368; heads of 64 channels, 5 and 5: 414 against 2 x 249), for 64 KB of shared memory; heads of more
# than 128 channels 64 tokens (at 128, 208 bytes of spills at 5b5d156). A launch with any grouped bucket takes
# GROUPS_MAXNREG (key and value tiles live in registers at once: uncapped, a 2-bit bucket of smollm2's plans takes
# 168 registers and 648 instructions a tile, against 681 at 128). Not yet timed on a GPU.
GROUPS_LAUNCH = {"block_n": 128, "num_stages": 2}
GROUPS_LAUNCH_LARGE_HEADS = {"block_n": 64, "num_stages": 2}
GROUPS_MAXNREG = 128
# Captured in a CUDA graph, a call's stage-1 launches run concurrently, one stream each, so that one launch fills
# the SMs that another's last wave leaves idle. Measured when every width bucket had a launch of its own (09710ae,
# the H100, 2,2,2,2,4,4,8,8, shape above): a replay took 155 us against 170 with the buckets in turn (uniform 4
# bits: 142); launched eagerly the call waited on the host, and the streams' events cost more than they saved
# (248 against 220 us), so eager launches run in turn. Since then the fast buckets share one launch (whose grid
# holds every bucket's programs); what remains concurrent is that launch beside the generic buckets' (16-bit
# heads, say).
CONCURRENT_BUCKETS = True
# split-KV target: enough programs in flight per SM to keep memory requests queued. On the H200 (32 query / 8
# KV heads, batch 8, 32K and 128K tokens) 16 made the prefetching kernel 15-19% faster than 4 at 2, 4 and 8 bits
# (results/kernels/README.md).
PROGRAMS_PER_SM = 16
MAX_SPLITS = 256
COMBINE_BLOCK = 16  # splits merged per step of the combine kernel
# rows past the end of _block_query_kernel's outputs: more than a query group's padding (QG_B - QG)
PAD_ROWS = 64
CPU_SMS = 4  # what _default_splits assumes off CUDA (the interpreter)


@triton.jit
def _fetch(
    payload_ptr,
    p_off,
    scale_ptr,
    zero_ptr,
    s_off,
    full_ptr,
    f_off,
    mask_n,
    W: tl.constexpr,
    D: tl.constexpr,
    D_B: tl.constexpr,
    G: tl.constexpr,
    SYM: tl.constexpr,
    CODES: tl.constexpr = False,
):
    """One KV head's tile as stored, loaded into registers: (raw, scales, zeros), for `_dequant` (CODES: a
    codes-only store's, whose scales and zeros are placeholders, raw again).

    raw: at W 16 the values (BLOCK_N, D_B); else the packed bytes as int32 (BLOCK_N, D_B // codes per unit),
    a unit being a byte (2, 4, 8 bits) or a 3-byte little-endian word of 8 codes (3 bits); bytes are loaded as
    contiguous vectors, one load per byte, not per code. scales, zeros: (BLOCK_N, D_B // G) float32 (at W 16,
    zeros of (BLOCK_N, 1), unused). p_off, s_off, f_off (BLOCK_N, 1): element offsets of each token's packed
    row, scale row and full row; masked rows and columns past D load 0.
    """
    BLOCK_N: tl.constexpr = p_off.shape[0]
    if W == 16:
        d = tl.arange(0, D_B)
        raw = tl.load(full_ptr + f_off + d[None, :], mask=mask_n & (d[None, :] < D), other=0.0)
        s = tl.zeros((BLOCK_N, 1), tl.float32)
        z = s
    else:
        prow = payload_ptr + p_off
        if W == 8:
            d = tl.arange(0, D_B)
            raw = tl.load(prow + d[None, :], mask=mask_n & (d[None, :] < D), other=0).to(tl.int32)
        elif W == 3:
            k = tl.arange(0, D_B // 8)
            m = mask_n & (k[None, :] < D // 8)
            p = prow + k[None, :] * 3
            raw = (
                tl.load(p, mask=m, other=0).to(tl.int32)
                | (tl.load(p + 1, mask=m, other=0).to(tl.int32) << 8)
                | (tl.load(p + 2, mask=m, other=0).to(tl.int32) << 16)
            )
        else:
            k = tl.arange(0, D_B // (8 // W))
            raw = tl.load(prow + k[None, :], mask=mask_n & (k[None, :] < D // (8 // W)), other=0).to(tl.int32)
        if CODES:
            s = raw
            z = raw
        else:
            grp = tl.arange(0, D_B // G)
            gm = mask_n & (grp[None, :] < D // G)
            s = tl.load(scale_ptr + s_off + grp[None, :], mask=gm, other=0.0).to(tl.float32)
            if SYM:
                # (code - 2**(W-1)) * s == code * s + z with z = -2**(W-1) * s: one FMA per element either way.
                z = s * -(1 << (W - 1))
            else:
                z = tl.load(zero_ptr + s_off + grp[None, :], mask=gm, other=0.0).to(tl.float32)
    return raw, s, z


@triton.jit
def _dequant(raw, s, z, W: tl.constexpr, D_B: tl.constexpr, G: tl.constexpr, CODES: tl.constexpr = False):
    """float32 values (BLOCK_N, D_B) of a tile `_fetch` loaded: codes split out of their units (code
    j * per + i is piece i of unit j), times the group's scale plus its zero (CODES: the codes themselves)."""
    BLOCK_N: tl.constexpr = raw.shape[0]
    if W == 16:
        x = raw.to(tl.float32)
    else:
        if W == 8:
            codes = raw
        elif W == 3:
            codes = tl.reshape((raw[:, :, None] >> (tl.arange(0, 8) * 3)[None, None, :]) & 7, (BLOCK_N, D_B))
        else:
            PER: tl.constexpr = 8 // W
            c = (raw[:, :, None] >> (tl.arange(0, PER) * W)[None, None, :]) & ((1 << W) - 1)
            codes = tl.reshape(c, (BLOCK_N, D_B))
        if CODES:
            x = codes.to(tl.float32)
        else:
            NG_B: tl.constexpr = D_B // G
            # Per-group scale/zero are broadcast in registers to their G lanes. With the scale applied per
            # element, the zero point rides along in the same FMA; folding it into a per-group sum of q instead
            # would add a (queries x tokens x groups) term and save nothing per element.
            s_e = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, NG_B, G)), (BLOCK_N, D_B))
            z_e = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, NG_B, G)), (BLOCK_N, D_B))
            x = codes.to(tl.float32) * s_e + z_e
    return x


@triton.jit
def _scores(q, k, mask_n, m_i, qk_scale, INPUT_PRECISION: tl.constexpr):
    """Online-softmax half step with a K tile (BLOCK_N, D_B): probabilities p, new max m_new, rescale alpha.

    Scores are in log2 units. Every tile holds at least one valid token, so m_new is finite (no inf - inf).
    """
    s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # (QG_B, BLOCK_N)
    s = tl.where(mask_n, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    return tl.exp2(s - m_new[:, None]), m_new, tl.exp2(m_i - m_new)


@triton.jit
def _attend(q, k_raw, k_s, k_z, v_raw, v_s, v_z, mask_n, m_i, l_i, acc, qk_scale, KW: tl.constexpr,
            VW: tl.constexpr, D_B: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
            INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """One tile of the online softmax from `_fetch`ed K and V: (m_i, l_i, acc) after it. mask_n (BLOCK_N, 1).

    V is dequantized only after the scores, so the K and V tiles are never live together.
    """
    k = _dequant(k_raw, k_s, k_z, KW, D_B, KG).to(q.dtype)
    p, m_i, alpha = _scores(q, k, tl.trans(mask_n), m_i, qk_scale, INPUT_PRECISION)
    v = _dequant(v_raw, v_s, v_z, VW, D_B, VG).to(q.dtype)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=INPUT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _program(heads_ptr, len_ptr, L_arg, NH: tl.constexpr, L_FROM_PTR: tl.constexpr):
    """A stage-1 program of grid (B * NH, splits) -> (its split, batch row as int64, index j into heads_ptr, its
    KV head heads_ptr[j], the stored length L: read at len_ptr, or L_arg)."""
    pid = tl.program_id(0)
    j = pid % NH
    h = tl.load(heads_ptr + j)
    if L_FROM_PTR:
        L = tl.load(len_ptr)
    else:
        L = L_arg
    return tl.program_id(1), (pid // NH).to(tl.int64), j, h, L


@triton.jit
def _fetch_rows(p_ptr, p_base, p_st, s_ptr, z_ptr, s_base, s_st, n, end, W: tl.constexpr, D: tl.constexpr,
                D_B: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr):  # fmt: skip
    """`_fetch` of one head's tokens n (BLOCK_N, 1) int64, those from `end` on masked out. p_base, s_base:
    element offsets of the head's rows in its payload (or 16-bit values) and in its scales and zeros; p_st,
    s_st: their token strides."""
    return _fetch(p_ptr, p_base + n * p_st, s_ptr, z_ptr, s_base + n * s_st, p_ptr, p_base + n * p_st,
                  n < end, W, D, D_B, G, SYM)  # fmt: skip


@triton.jit
def _split_tiles(q, m_i, l_i, acc, start, end, qk_scale, kp_ptr, kp_base, kp_st, ks_ptr, kz_ptr, ks_base,
                 ks_st, vp_ptr, vp_base, vp_st, vs_ptr, vz_ptr, vs_base, vs_st, KW: tl.constexpr,
                 VW: tl.constexpr, D: tl.constexpr, D_B: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
                 K_SYM: tl.constexpr, V_SYM: tl.constexpr, BLOCK_N: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    """_decode_split_kernel's online softmax over one KV head's stored tokens [start, end), BLOCK_N a tile:
    (m_i, l_i, acc) after them. q (QG_B, D_B); the head's K and V rows as `_fetch_rows` takes them."""
    if PREFETCH:
        # A tile's K and V bytes are requested one iteration ahead, so they are in flight while the tile
        # before is dequantized and attended. Loads that are dequantized before a dot are not staged by
        # Triton's pipeliner, and without this each program waited on every tile's loads.
        n = (start + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]  # (BLOCK_N, 1)
        k_raw, k_s, k_z = _fetch_rows(kp_ptr, kp_base, kp_st, ks_ptr, kz_ptr, ks_base, ks_st, n, end, KW, D,
                                      D_B, KG, K_SYM)  # fmt: skip
        v_raw, v_s, v_z = _fetch_rows(vp_ptr, vp_base, vp_st, vs_ptr, vz_ptr, vs_base, vs_st, n, end, VW, D,
                                      D_B, VG, V_SYM)  # fmt: skip
        for n0 in range(start, end, BLOCK_N):
            n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
            nx = n + BLOCK_N  # the next tile (masked out past the split's end)
            k_raw_nx, k_s_nx, k_z_nx = _fetch_rows(kp_ptr, kp_base, kp_st, ks_ptr, kz_ptr, ks_base, ks_st, nx,
                                                   end, KW, D, D_B, KG, K_SYM)  # fmt: skip
            v_raw_nx, v_s_nx, v_z_nx = _fetch_rows(vp_ptr, vp_base, vp_st, vs_ptr, vz_ptr, vs_base, vs_st, nx,
                                                   end, VW, D, D_B, VG, V_SYM)  # fmt: skip
            m_i, l_i, acc = _attend(q, k_raw, k_s, k_z, v_raw, v_s, v_z, n < end, m_i, l_i, acc, qk_scale,
                                    KW, VW, D_B, KG, VG, INPUT_PRECISION)  # fmt: skip
            k_raw, k_s, k_z, v_raw, v_s, v_z = k_raw_nx, k_s_nx, k_z_nx, v_raw_nx, v_s_nx, v_z_nx
    else:
        # 16-bit K and V go to the dots as loaded, and Triton's pipeliner stages those loads itself.
        for n0 in range(start, end, BLOCK_N):
            n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
            k_raw, k_s, k_z = _fetch_rows(kp_ptr, kp_base, kp_st, ks_ptr, kz_ptr, ks_base, ks_st, n, end, KW,
                                          D, D_B, KG, K_SYM)  # fmt: skip
            v_raw, v_s, v_z = _fetch_rows(vp_ptr, vp_base, vp_st, vs_ptr, vz_ptr, vs_base, vs_st, n, end, VW,
                                          D, D_B, VG, V_SYM)  # fmt: skip
            m_i, l_i, acc = _attend(q, k_raw, k_s, k_z, v_raw, v_s, v_z, n < end, m_i, l_i, acc, qk_scale,
                                    KW, VW, D_B, KG, VG, INPUT_PRECISION)  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _extra_tiles(q, m_i, l_i, acc, x_end, b64, h, kx_ptr, kx_sb, kx_sh, kx_st, vx_ptr, vx_sb, vx_sh, vx_st,
                 qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """_decode_split_kernel's online softmax over the first x_end tokens of KV head h's full-precision extra
    segment in batch row b64: (m_i, l_i, acc) after them. kx_ptr, vx_ptr (B, Hkv, Tx, D), with strides."""
    D_B: tl.constexpr = acc.shape[1]
    d = tl.arange(0, D_B)
    for n0 in range(0, x_end, BLOCK_N):
        n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
        mask_n = n < x_end
        xm = mask_n & (d[None, :] < D)
        k = tl.load(kx_ptr + b64 * kx_sb + h * kx_sh + n * kx_st + d[None, :], mask=xm, other=0.0)
        v = tl.load(vx_ptr + b64 * vx_sb + h * vx_sh + n * vx_st + d[None, :], mask=xm, other=0.0)
        p, m_i, alpha = _scores(q, k.to(q.dtype), tl.trans(mask_n), m_i, qk_scale, INPUT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=INPUT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _store_split(m_ptr, l_ptr, o_ptr, m_i, l_i, acc, b64, h, sp, S, HKV: tl.constexpr, QG: tl.constexpr):
    """Write one program's partials: m_i, l_i (QG_B,) and acc (QG_B, D_B) of the QG query heads reading KV
    head h, at split column sp of S. m, l (B, Hq, S); o (B, Hq, S, D_B), all contiguous. A split past the
    stored tokens writes m = -inf, l = 0, o = 0, which the combine weighs 0."""
    QG_B: tl.constexpr = m_i.shape[0]
    D_B: tl.constexpr = acc.shape[1]
    i = tl.arange(0, QG_B)
    d = tl.arange(0, D_B)
    row = (b64 * HKV * QG + h * QG + i) * S + sp  # (QG_B,)
    tl.store(m_ptr + row, m_i, mask=i < QG)
    tl.store(l_ptr + row, l_i, mask=i < QG)
    tl.store(o_ptr + row[:, None] * D_B + d[None, :], acc, mask=i[:, None] < QG)


@triton.jit
def _codes_tile(q, b, k, v, mask_n, m_i, l_i, acc, qk_scale, INPUT_PRECISION: tl.constexpr):
    """One tile of _codes_program's online softmax: codes-domain k, v (BLOCK_N, D_B) in q's dtype, scores
    q k^T + b (q (QG_B, D_B), b (QG_B,)) times qk_scale; mask_n (BLOCK_N, 1) -> (m_i, l_i, acc) after it."""
    s = (tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) + b[:, None]) * qk_scale  # (QG_B, BLOCK_N)
    s = tl.where(tl.trans(mask_n), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=INPUT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _codes_program(q_ptr, stride_qb, stride_qh, stride_qn, bias_ptr, stride_bb, stride_bh, b64, h, sp, L, kp_ptr,
                   kp_sb, kp_sh, kp_st, kslot_ptr, vp_ptr, vp_sb, vp_sh, vp_st, vslot_ptr, kx_ptr, kx_sb, kx_sh,
                   kx_st, vx_ptr, vx_sb, vx_sh, vx_st, Tx, m_ptr, l_ptr, o_ptr, chunk, qk_scale, num_splits,
                   HKV: tl.constexpr, QG: tl.constexpr, QG_B: tl.constexpr, D: tl.constexpr, D_B: tl.constexpr,
                   KW: tl.constexpr, VW: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK_N: tl.constexpr,
                   QBLOCK: tl.constexpr, INPUT_PRECISION: tl.constexpr):  # fmt: skip
    """One program of _decode_split_kernel over codes-only stores (decode_attention_blocks), for any width, head
    dim and query dtype: each tile's codes as numbers, scored against its block's query q_ptr (B, Hq, NB, D) plus
    its bias bias_ptr (B, Hq, NB) (QBLOCK tokens a block; 0: one block); the extra segment with block 0's."""
    i = tl.arange(0, QG_B)
    d = tl.arange(0, D_B)
    imask = i < QG
    qmask = imask[:, None] & (d[None, :] < D)
    q_rows = q_ptr + b64 * stride_qb + (h * QG + i[:, None]) * stride_qh + d[None, :]  # (QG_B, D_B): block 0
    b_rows = bias_ptr + b64 * stride_bb + (h * QG + i) * stride_bh  # (QG_B,)
    m_i = tl.full((QG_B,), float("-inf"), tl.float32)
    l_i = tl.zeros((QG_B,), tl.float32)
    acc = tl.zeros((QG_B, D_B), tl.float32)
    kp_base = b64 * kp_sb + tl.load(kslot_ptr + h).to(tl.int64) * kp_sh
    vp_base = b64 * vp_sb + tl.load(vslot_ptr + h).to(tl.int64) * vp_sh
    start = tl.minimum(sp * chunk, L)
    end = tl.minimum(start + chunk, L)
    for n0 in range(start, end, BLOCK_N):
        if QBLOCK > 0:
            blk = n0 // QBLOCK
        else:
            blk = 0
        q = tl.load(q_rows + blk * stride_qn, mask=qmask, other=0.0)
        b = tl.load(b_rows + blk, mask=imask, other=0.0)
        n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]  # (BLOCK_N, 1)
        k, _, _ = _fetch(kp_ptr, kp_base + n * kp_st, kp_ptr, kp_ptr, 0, kp_ptr, 0, n < end, KW, D, D_B, D_B, False,
                         True)  # fmt: skip
        v, _, _ = _fetch(vp_ptr, vp_base + n * vp_st, vp_ptr, vp_ptr, 0, vp_ptr, 0, n < end, VW, D, D_B, D_B, False,
                         True)  # fmt: skip
        k = _dequant(k, k, k, KW, D_B, D_B, True).to(q.dtype)
        v = _dequant(v, v, v, VW, D_B, D_B, True).to(q.dtype)
        m_i, l_i, acc = _codes_tile(q, b, k, v, n < end, m_i, l_i, acc, qk_scale, INPUT_PRECISION)
    if HAS_EXTRA:
        if sp == num_splits:
            q = tl.load(q_rows, mask=qmask, other=0.0)
            b = tl.load(b_rows, mask=imask, other=0.0)
            for n0 in range(0, Tx, BLOCK_N):
                n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)[:, None]
                xm = (n < Tx) & (d[None, :] < D)
                k = tl.load(kx_ptr + b64 * kx_sb + h * kx_sh + n * kx_st + d[None, :], mask=xm, other=0.0)
                v = tl.load(vx_ptr + b64 * vx_sb + h * vx_sh + n * vx_st + d[None, :], mask=xm, other=0.0)
                m_i, l_i, acc = _codes_tile(q, b, k.to(q.dtype), v.to(q.dtype), n < Tx, m_i, l_i, acc, qk_scale,
                                            INPUT_PRECISION)  # fmt: skip
    _store_split(m_ptr, l_ptr, o_ptr, m_i, l_i, acc, b64, h, sp, num_splits + HAS_EXTRA, HKV, QG)


@triton.jit
def _decode_split_kernel(
    q_ptr, stride_qb, stride_qh, stride_qn, bias_ptr, stride_bb, stride_bh,
    kp_ptr, kp_sb, kp_sh, kp_st, ks_ptr, kz_ptr, ks_sb, ks_sh, ks_st, kslot_ptr,
    vp_ptr, vp_sb, vp_sh, vp_st, vs_ptr, vz_ptr, vs_sb, vs_sh, vs_st, vslot_ptr,
    kx_ptr, kx_sb, kx_sh, kx_st, vx_ptr, vx_sb, vx_sh, vx_st, Tx,
    heads_ptr, m_ptr, l_ptr, o_ptr, L_arg, len_ptr, chunk, qk_scale, num_splits,
    NH: tl.constexpr, HKV: tl.constexpr, QG: tl.constexpr, QG_B: tl.constexpr, D: tl.constexpr,
    D_B: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
    K_SYM: tl.constexpr, V_SYM: tl.constexpr, HAS_EXTRA: tl.constexpr, L_FROM_PTR: tl.constexpr,
    BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr, CODES: tl.constexpr = False,
    QBLOCK: tl.constexpr = 0,
):  # fmt: skip
    # Arguments by line: q and its strides; the key store (payload or 16-bit values with batch, head and token
    # strides; scales, zeros and their strides; slot table); the value store, likewise; the extra segments and
    # their length Tx; the bucket's heads, the partials, the length and the split.
    # grid: (B * NH, num_splits + HAS_EXTRA) over the NH KV heads whose keys are stored at KW bits and values
    # at VW bits (heads_ptr lists them). A program owns one KV head and all QG query heads reading it (their
    # K/V bytes are loaded once), over one chunk of stored tokens; the last split column, when there is an
    # extra segment, attends over that segment instead. With CODES (codes-only stores) q_ptr holds a query per
    # block of QBLOCK tokens and bias_ptr a bias each (_codes_program).
    sp, b64, _, h, L = _program(heads_ptr, len_ptr, L_arg, NH, L_FROM_PTR)
    if CODES:
        _codes_program(q_ptr, stride_qb, stride_qh, stride_qn, bias_ptr, stride_bb, stride_bh, b64, h, sp, L, kp_ptr,
                       kp_sb, kp_sh, kp_st, kslot_ptr, vp_ptr, vp_sb, vp_sh, vp_st, vslot_ptr, kx_ptr, kx_sb, kx_sh,
                       kx_st, vx_ptr, vx_sb, vx_sh, vx_st, Tx, m_ptr, l_ptr, o_ptr, chunk, qk_scale, num_splits, HKV,
                       QG, QG_B, D, D_B, KW, VW, HAS_EXTRA, BLOCK_N, QBLOCK, INPUT_PRECISION)  # fmt: skip
    else:
        _split_program(q_ptr, stride_qb, stride_qh, b64, h, sp, L, kp_ptr, kp_sb, kp_sh, kp_st, ks_ptr, kz_ptr, ks_sb,
                       ks_sh, ks_st, kslot_ptr, vp_ptr, vp_sb, vp_sh, vp_st, vs_ptr, vz_ptr, vs_sb, vs_sh, vs_st,
                       vslot_ptr, kx_ptr, kx_sb, kx_sh, kx_st, vx_ptr, vx_sb, vx_sh, vx_st, Tx, m_ptr, l_ptr, o_ptr,
                       chunk, qk_scale, num_splits, HKV, QG, QG_B, D, D_B, KW, VW, KG, VG, K_SYM, V_SYM, HAS_EXTRA,
                       BLOCK_N, INPUT_PRECISION, PREFETCH)  # fmt: skip


@triton.jit
def _split_program(q_ptr, stride_qb, stride_qh, b64, h, sp, L, kp_ptr, kp_sb, kp_sh, kp_st, ks_ptr, kz_ptr, ks_sb,
                   ks_sh, ks_st, kslot_ptr, vp_ptr, vp_sb, vp_sh, vp_st, vs_ptr, vz_ptr, vs_sb, vs_sh, vs_st,
                   vslot_ptr, kx_ptr, kx_sb, kx_sh, kx_st, vx_ptr, vx_sb, vx_sh, vx_st, Tx, m_ptr, l_ptr, o_ptr, chunk,
                   qk_scale, num_splits, HKV: tl.constexpr, QG: tl.constexpr, QG_B: tl.constexpr, D: tl.constexpr,
                   D_B: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr,
                   K_SYM: tl.constexpr, V_SYM: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK_N: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    """One program of _decode_split_kernel over packed (or 16-bit) stores: KV head h of batch row b64 over split
    sp (L stored tokens), and the extra segment in the last split column."""
    i = tl.arange(0, QG_B)
    d = tl.arange(0, D_B)
    qmask = (i[:, None] < QG) & (d[None, :] < D)
    q = tl.load(
        q_ptr + b64 * stride_qb + (h * QG + i[:, None]) * stride_qh + d[None, :], mask=qmask, other=0.0
    )

    m_i = tl.full((QG_B,), float("-inf"), tl.float32)
    l_i = tl.zeros((QG_B,), tl.float32)
    acc = tl.zeros((QG_B, D_B), tl.float32)

    kslot = tl.load(kslot_ptr + h).to(tl.int64)
    vslot = tl.load(vslot_ptr + h).to(tl.int64)
    kp_base = b64 * kp_sb + kslot * kp_sh
    vp_base = b64 * vp_sb + vslot * vp_sh
    ks_base = b64 * ks_sb + kslot * ks_sh
    vs_base = b64 * vs_sb + vslot * vs_sh

    start = tl.minimum(sp * chunk, L)
    end = tl.minimum(start + chunk, L)
    m_i, l_i, acc = _split_tiles(q, m_i, l_i, acc, start, end, qk_scale, kp_ptr, kp_base, kp_st, ks_ptr,
                                 kz_ptr, ks_base, ks_st, vp_ptr, vp_base, vp_st, vs_ptr, vz_ptr, vs_base,
                                 vs_st, KW, VW, D, D_B, KG, VG, K_SYM, V_SYM, BLOCK_N, INPUT_PRECISION,
                                 PREFETCH)  # fmt: skip
    if HAS_EXTRA:
        x_end = tl.where(sp == num_splits, Tx, 0)
        m_i, l_i, acc = _extra_tiles(q, m_i, l_i, acc, x_end, b64, h, kx_ptr, kx_sb, kx_sh, kx_st, vx_ptr,
                                     vx_sb, vx_sh, vx_st, qk_scale, D, BLOCK_N, INPUT_PRECISION)  # fmt: skip
    _store_split(m_ptr, l_ptr, o_ptr, m_i, l_i, acc, b64, h, sp, num_splits + HAS_EXTRA, HKV, QG)


@triton.jit
def _load_fp16(ptr, offsets, mask):
    """A load of q, K or V in full precision as fp16 operands, clamped to fp16's finite range."""
    x = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16)


@triton.jit
def _q_half(row_ptr, cols, mask, scale, ROWS: tl.constexpr = True):
    """q at columns `cols` (n,) of each row times `scale` as float32, clamped to fp16's finite range: rows
    row_ptr (QG_B, 1) -> (QG_B, n), or with ROWS=False row_ptr (1, QG_B) -> (n, QG_B)."""
    c = cols[None, :] if ROWS else cols[:, None]
    x = tl.load(row_ptr + c, mask=mask, other=0.0).to(tl.float32) * scale
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0)


@triton.jit
def _q_piece(row_ptr, mask, scale, W: tl.constexpr, D: tl.constexpr, REV: tl.constexpr, ASM: tl.constexpr,
             READY: tl.constexpr):  # fmt: skip
    """The column pairs m = 8 j + REV (j < D / 16) of the scores operand, as int32 (QG_B, D / 16) of two fp16
    lanes: column 2m in the low, 2m + 1 in the high half (READY: read as they are, row_ptr int32 rows of D / 2
    pairs in that order)."""
    m = 8 * tl.arange(0, D // 16) + REV
    if READY:
        pairs = _load_words(row_ptr + m[None, :], mask, ASM)
    else:
        lo = _q_half(row_ptr, code_of_columns_jit(2 * m, W, D, True), mask, scale)
        hi = _q_half(row_ptr, code_of_columns_jit(2 * m + 1, W, D, True), mask, scale)
        pairs = pack_f16x2(lo, hi, ASM)
    return pairs


@triton.jit
def _load_words(ptr, mask, ASM: tl.constexpr):
    """int32 words at ptr: with ASM unmasked, each one a plain ld.global (which Triton lays out as the registers of
    the mma operand it makes, as _load_q_pairs' loads); in the interpreter those under `mask` (0 elsewhere)."""
    if ASM:
        words = tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], tl.int32, True, 1)
    else:
        words = tl.load(ptr, mask=mask, other=0)
    return words


@triton.jit
def _load_q_pairs(row_ptr, mask, scale, W: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr,
                  READY: tl.constexpr = False):  # fmt: skip
    """The queries times `scale` as the scores mma's operand qT (D, QG_B) fp16 in kernels.unpack's lane order for
    width W, clamped to fp16's finite range: row_ptr (QG_B, 1) each query's row, mask (QG_B, 1). READY: the rows
    hold that operand already (int32 pairs, _block_query_kernel's), read as they are, unmasked when compiled
    (_load_words).

    Each pair of logical columns (2m, 2m + 1) is made as one int32 of two fp16 lanes and split by bitcasts, a
    chain that Triton lays out as the mma operand itself, so q stays in registers across the loop, each pair
    where the mma reads it, instead of coming back from shared memory (and being copied into register pairs)
    every tile. The loads are 8 small pieces (fewer elements than threads at QG_B 8) so that Triton does not
    pin their layout and the chain's keeps no layout conversion."""
    QG_B: tl.constexpr = row_ptr.shape[0]
    # join^3 puts piece 4 s2 + 2 s1 + s0 at pair column 8 j + 4 s0 + 2 s1 + s2: piece p holds REV = bitreverse(p)
    x = tl.join(
        tl.join(
            tl.join(
                _q_piece(row_ptr, mask, scale, W, D, 0, ASM, READY),
                _q_piece(row_ptr, mask, scale, W, D, 4, ASM, READY),
            ),
            tl.join(
                _q_piece(row_ptr, mask, scale, W, D, 2, ASM, READY),
                _q_piece(row_ptr, mask, scale, W, D, 6, ASM, READY),
            ),
        ),
        tl.join(
            tl.join(
                _q_piece(row_ptr, mask, scale, W, D, 1, ASM, READY),
                _q_piece(row_ptr, mask, scale, W, D, 5, ASM, READY),
            ),
            tl.join(
                _q_piece(row_ptr, mask, scale, W, D, 3, ASM, READY),
                _q_piece(row_ptr, mask, scale, W, D, 7, ASM, READY),
            ),
        ),
    )  # (QG_B, D / 16, 2, 2, 2)
    pairs = tl.reshape(x, (QG_B, D // 2))
    q_lo = pairs.to(tl.int16).to(tl.float16, bitcast=True)
    q_hi = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.trans(tl.reshape(tl.join(q_lo, q_hi), (QG_B, D)))  # (D, QG_B)


@triton.jit
def _opaque(x):
    """x (fp16) unchanged, through an inline mov that ptxas removes. Triton picks an mma operand's register
    layout from the narrowest type it can trace back to a load, halving it behind a join: past the joins of
    kernels.unpack the V tile would make the output mma's operands kWidth 4, whose shared-memory loads
    (ldmatrix) land in registers that ptxas then copies into the HMMA's register quads (about 90 moves a
    tile at 4 bits). A side-effecting asm stops that trace, so the operands are kWidth 2 and ldmatrix fills
    the quads directly."""
    return tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [x], tl.float16, False, 1)


@triton.jit
def _packed_tile(p_ptr, s_ptr, z_ptr, rows, mask_n, W: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
                 SYM: tl.constexpr, ASM: tl.constexpr, LANES: tl.constexpr, MASKED: tl.constexpr,
                 CODES: tl.constexpr = 0):  # fmt: skip
    """One head's tile of BLOCK_N tokens as fp16 (BLOCK_N, D) in kernels.unpack's lane order (LANES) or word order.

    p_ptr: the head's payload as int32 words, rows of NW = D * W / 32 words; s_ptr, z_ptr: its fp16 scales
    and zeros, rows of D / G; rows (BLOCK_N,) int32 token indices (offsets rows * NW < 2**31), mask_n (BLOCK_N,)
    which of them are stored (read only when MASKED; a tile without it loads every row). With CODES (a codes-only
    store: kernels.unpack's OFFSET_CODES or EXACT_CODES) s_ptr and z_ptr are not read and the tile holds the codes.
    """
    NW: tl.constexpr = D * W // 32
    NU: tl.constexpr = D // 32 if W == 3 else NW  # units: words, or at 3 bits 3 words of 32 codes
    NG: tl.constexpr = D // G
    g = tl.arange(0, NG)
    if W == 3:
        # word t of each unit j as a (BLOCK_N, NU) tensor (12 words a row are no power of two), loaded as its
        # transpose: the layout Triton picks then spreads the units over lanes, and the word-order V tile
        # goes to shared memory in 16-byte stores (loaded as (BLOCK_N, NU), 64 16-bit stores a 64-token tile)
        u_ptr = p_ptr + 3 * tl.arange(0, NU)[:, None] + rows[None, :] * NW  # (NU, BLOCK_N)
        if MASKED:
            u0 = tl.trans(tl.load(u_ptr, mask=mask_n[None, :], other=0))
            u1 = tl.trans(tl.load(u_ptr + 1, mask=mask_n[None, :], other=0))
            u2 = tl.trans(tl.load(u_ptr + 2, mask=mask_n[None, :], other=0))
        else:
            u0 = tl.trans(tl.load(u_ptr))
            u1 = tl.trans(tl.load(u_ptr + 1))
            u2 = tl.trans(tl.load(u_ptr + 2))
    else:
        w_ptr = p_ptr + rows[:, None] * NW + tl.arange(0, NW)[None, :]
        if MASKED:
            words = tl.load(w_ptr, mask=mask_n[:, None], other=0)
        else:
            words = tl.load(w_ptr)
    if CODES:  # the lanes as unpacked: no scale or zero to read
        if W == 3:
            tile = dequant_tile3(u0, u1, u2, u0, u0, False, ASM, LANES, CODES)
        else:
            tile = dequant_tile(words, words, words, words, W, False, ASM, LANES, CODES)
    else:
        sc_ptr = s_ptr + rows[:, None] * NG + g[None, :]  # (BLOCK_N, NG)
        zc_ptr = z_ptr + rows[:, None] * NG + g[None, :]
        if MASKED:
            s = tl.load(sc_ptr, mask=mask_n[:, None], other=0.0)
            z = s if SYM else tl.load(zc_ptr, mask=mask_n[:, None], other=0.0)  # symmetric: unused
        else:
            s = tl.load(sc_ptr)
            z = s if SYM else tl.load(zc_ptr)
        s2, z2, z2o = group_constants(s, z, W, SYM, ASM)  # (BLOCK_N, NG) int32 each
        s2, z2 = _per_unit(s2, NU), _per_unit(z2, NU)
        if W == 3:
            tile = dequant_tile3(u0, u1, u2, s2, z2, SYM, ASM, LANES)
        else:
            z2o = _per_unit(z2o, NU) if W == 2 else z2  # odd pairs' constant (else the same as z2)
            tile = dequant_tile(words, s2, z2, z2o, W, SYM, ASM, LANES)
    return tile


@triton.jit
def _per_unit(c, NU: tl.constexpr):
    """Group constants c (BLOCK_N, NG) -> each unit's (BLOCK_N, NU): a group's constant over its NU / NG units."""
    BLOCK_N: tl.constexpr = c.shape[0]
    NG: tl.constexpr = c.shape[1]
    return tl.reshape(tl.broadcast_to(c[:, :, None], (BLOCK_N, NG, NU // NG)), (BLOCK_N, NU))


@triton.jit
def _packed_step(qT, kp, ks, kz, vp, vs, vz, n0, end, m_i, l_rows, acc, KW: tl.constexpr, VW: tl.constexpr,
                 D: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr, K_SYM: tl.constexpr, V_SYM: tl.constexpr,
                 ASM: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One tile of _decode_packed_kernel's online softmax: tokens n0 .. n0 + BLOCK_N (those from `end` on
    masked out when MASKED; without it every token is below `end`) -> the updated (m_i, l_rows, acc)."""
    BLOCK_N: tl.constexpr = l_rows.shape[0]
    rows = n0 + tl.arange(0, BLOCK_N)
    mask_n = rows < end
    k = _packed_tile(kp, ks, kz, rows, mask_n, KW, D, KG, K_SYM, ASM, True, MASKED)  # (BLOCK_N, D) fp16
    s = tl.dot(k, qT)  # (BLOCK_N, QG_B), log2 units (qT holds q * qk_scale)
    if MASKED:
        s = tl.where(mask_n[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    p = tl.exp2(s - m_new[None, :])
    alpha = tl.exp2(m_i - m_new)
    l_rows = l_rows * alpha[None, :] + p
    v = _packed_tile(vp, vs, vz, rows, mask_n, VW, D, VG, V_SYM, ASM, False, MASKED)
    vT = tl.trans(v)
    if ASM:  # an identity Triton cannot look through: see _opaque
        vT = _opaque(vT)
    acc = acc * alpha[None, :] + tl.dot(vT, p.to(tl.float16))
    return m_new, l_rows, acc


@triton.jit
def _packed_head(q_ptr, stride_qb, stride_qh, b64, h, sp, L, kp, kp_sb, kp_sh, ks, kz, ks_sb, ks_sh, kslot_ptr,
                 vp, vp_sb, vp_sh, vs, vz, vs_sb, vs_sh, vslot_ptr, kx_ptr, kx_sb, kx_sh, kx_st, vx_ptr, vx_sb, vx_sh,
                 vx_st, Tx, m_ptr, l_ptr, o_ptr, chunk, qk_scale, num_splits, HKV: tl.constexpr, QG: tl.constexpr,
                 QG_B: tl.constexpr, D: tl.constexpr, D_B: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr,
                 KG: tl.constexpr, VG: tl.constexpr, K_SYM: tl.constexpr, V_SYM: tl.constexpr,
                 HAS_EXTRA: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """One program of _decode_packed_kernel: KV head h of batch row b64 over split sp (L stored tokens), its keys
    packed at KW bits and its values at VW (kp/vp: that width's bucket as int32 words, ks/kz, vs/vz: its scales
    and zeros, with their batch and head strides; the slot tables give the head's row in them). Tokens sit on
    the mma's M dimension and the query group on N: scores S^T = K q^T (BLOCK_N, QG_B) and output O^T = V^T P^T
    (D, QG_B), fp16 operands, fp32 accumulation. K and V tiles are dequantized in registers by kernels.unpack,
    their columns in its logical order, so q is loaded in K's order and O^T stored through V's."""
    i = tl.arange(0, QG_B)
    # (D,): the code each logical column holds. K tiles are mma operands straight from registers (lane order);
    # V tiles are transposed through shared memory for the second mma, so they keep each word's values together
    # (word order: 16-byte stores).
    kcol = code_of_column_jit(KW, D, True)
    vcol = code_of_column_jit(VW, D, False)
    if QG_B * D <= 1024:  # _load_q_pairs' pieces have at most 64 elements: the operand stays in registers
        qT = _load_q_pairs(
            q_ptr + b64 * stride_qb + (h * QG + i)[:, None] * stride_qh,
            (i < QG)[:, None],
            qk_scale,
            KW,
            D,
            ASM,
        )
    else:  # larger query groups: q through shared memory (the pairs' chain fails Triton's shared layout there)
        q_rows = q_ptr + b64 * stride_qb + (h * QG + i)[None, :] * stride_qh
        qT = _q_half(q_rows, kcol, (i < QG)[None, :], qk_scale, False).to(tl.float16)  # (D, QG_B)

    m_i = tl.full((QG_B,), float("-inf"), tl.float32)
    # the softmax denominators, kept per token row of the tile and summed over rows once after the loops (a sum
    # over the tile's rows each iteration crosses warps: shuffles, shared memory and barriers every tile)
    l_rows = tl.zeros((BLOCK_N, QG_B), tl.float32)
    acc = tl.zeros((D, QG_B), tl.float32)

    kslot = tl.load(kslot_ptr + h).to(tl.int64)
    vslot = tl.load(vslot_ptr + h).to(tl.int64)
    kp = kp + b64 * kp_sb + kslot * kp_sh
    vp = vp + b64 * vp_sb + vslot * vp_sh
    ks_h = ks + b64 * ks_sb + kslot * ks_sh
    kz_h = kz + b64 * ks_sb + kslot * ks_sh
    vs_h = vs + b64 * vs_sb + vslot * vs_sh
    vz_h = vz + b64 * vs_sb + vslot * vs_sh

    start = tl.minimum(sp * chunk, L)
    end = tl.minimum(start + chunk, L)
    # whole tiles without masks, then the split's last partial tile (if any) with them
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    for n0 in tl.range(start, full_end, BLOCK_N, num_stages=STAGES):
        m_i, l_rows, acc = _packed_step(qT, kp, ks_h, kz_h, vp, vs_h, vz_h, n0, end, m_i, l_rows, acc, KW, VW, D,
                                        KG, VG, K_SYM, V_SYM, ASM, False)  # fmt: skip
    if full_end < end:
        m_i, l_rows, acc = _packed_step(qT, kp, ks_h, kz_h, vp, vs_h, vz_h, full_end, end, m_i, l_rows, acc, KW, VW,
                                        D, KG, VG, K_SYM, V_SYM, ASM, True)  # fmt: skip

    if HAS_EXTRA:
        x_end = tl.where(sp == num_splits, Tx, 0)
        for n0 in range(0, x_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            mask_n = n < x_end
            n64 = n.to(tl.int64)[:, None]
            k = _load_fp16(kx_ptr + b64 * kx_sb + h * kx_sh, n64 * kx_st + kcol[None, :], mask_n[:, None])
            v = _load_fp16(vx_ptr + b64 * vx_sb + h * vx_sh, n64 * vx_st + vcol[None, :], mask_n[:, None])
            s = tl.where(mask_n[:, None], tl.dot(k, qT), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            p = tl.exp2(s - m_new[None, :])
            alpha = tl.exp2(m_i - m_new)
            l_rows = l_rows * alpha[None, :] + p
            m_i = m_new
            acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(tl.float16))

    l_i = tl.sum(l_rows, axis=0)
    # partials as _decode_split_kernel writes them: m, l (B, Hq, S); o (B, Hq, S, D_B)
    S = num_splits + HAS_EXTRA
    row = (b64 * HKV * QG + h * QG + i) * S + sp  # (QG_B,)
    tl.store(m_ptr + row, m_i, mask=i < QG)
    tl.store(l_ptr + row, l_i, mask=i < QG)
    tl.store(o_ptr + row[None, :] * D_B + vcol[:, None], acc, mask=(i < QG)[None, :])


@triton.jit
def _block_query(head, blk, QG: tl.constexpr, QG_B: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr):
    """Block blk's scores operand qT (D, QG_B) fp16 and bias (QG_B,) float32 from a KV head's records (head: an int32
    pointer to its block 0), as _block_query_kernel wrote them. Rows past the QG heads are read unmasked (the
    record's bias and the next record, or the buffer's padding): their columns of the scores are never stored
    (the interpreter, without ASM, masks them: numpy warns of the NaNs that garbage may make)."""
    rec = head + blk * _record_words(QG, D)
    i = tl.arange(0, QG_B)
    rows = rec + i[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
    if ASM:
        pairs = tl.load(rows)  # (QG_B, D / 2)
    else:
        pairs = tl.load(rows, mask=(i < QG)[:, None], other=0)
    q_lo = pairs.to(tl.int16).to(tl.float16, bitcast=True)
    q_hi = (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    qT = tl.trans(tl.reshape(tl.join(q_lo, q_hi), (QG_B, D)))  # (D, QG_B)
    return qT, tl.load((rec + QG * D // 2 + i).to(tl.pointer_type(tl.float32), bitcast=True))


@triton.jit
def _record_words(QG: tl.constexpr, D: tl.constexpr):
    """int32 words of one block's record of a KV head: QG rows of D / 2 query pairs, then QG float32 biases,
    rounded up to 16 bytes."""
    return QG * D // 2 + (QG + 3) // 4 * 4


@triton.jit(do_not_specialize=["NB"])
def _block_query_kernel(qb_ptr, stride_qb, stride_qh, stride_qn, bias_ptr, stride_bb, stride_bh, widths_ptr, out, NB,
                        qk_scale, HQ: tl.constexpr, QG: tl.constexpr, D: tl.constexpr, KWS: tl.constexpr,
                        KPLANS: tl.constexpr, BLOCK_NB: tl.constexpr):  # fmt: skip
    """decode_attention_blocks' queries and biases made into what the fast kernel's codes-only tiles read, for
    query head i = h QG + g of batch row b over blocks n: out (B, Hkv, NB) records of _record_words int32 words,
    block n's of KV head h one run of memory: row g holds qb times qk_scale as fp16, clamped to fp16's finite
    range, in the lane order of the head's key width (widths_ptr: int32 per KV head; the widths KWS; at a width whose
    KPLANS entry is a grouped plan's code, in kernels.groups' column order), and after
    the QG rows bias g the bias times qk_scale less that row . code_offset, the share of every score that the
    tiles' code offsets add (kernels.unpack). qb (B, Hq, NB, D), bias (B, Hq, NB) with their strides.
    grid: (B * Hq, cdiv(NB, BLOCK_NB))."""
    pid = tl.program_id(0)
    b64, i = (pid // HQ).to(tl.int64), pid % HQ
    n = tl.program_id(1) * BLOCK_NB + tl.arange(0, BLOCK_NB)
    nmask = n < NB
    rec = ((b64 * (HQ // QG) + i // QG) * NB + n) * _record_words(QG, D)  # (BLOCK_NB,) in words
    d = tl.arange(0, D)
    kw = tl.load(widths_ptr + i // QG)
    for k in tl.static_range(len(KWS)):
        if kw == KWS[k]:
            if KPLANS[k]:
                cols, code_offsets = group_columns_jit(KPLANS[k], D)
            else:
                cols = code_of_column_jit(KWS[k], D, True)
                code_offsets = code_offsets_jit(d, KWS[k])
            x = tl.load(qb_ptr + b64 * stride_qb + i * stride_qh + n[:, None] * stride_qn + cols[None, :],
                        mask=nmask[:, None], other=0.0)  # fmt: skip
            q16 = tl.minimum(tl.maximum(x.to(tl.float32) * qk_scale, -65504.0), 65504.0).to(tl.float16)
            rows = (out + rec + (i % QG) * (D // 2)).to(tl.pointer_type(tl.float16), bitcast=True)
            tl.store(rows[:, None] + d[None, :], q16, mask=nmask[:, None])
            offsets = tl.sum(q16.to(tl.float32) * code_offsets[None, :], axis=1)  # (BLOCK_NB,)
            bias = tl.load(bias_ptr + b64 * stride_bb + i * stride_bh + n, mask=nmask, other=0.0)
            biases = (out + rec + QG * D // 2 + i % QG).to(tl.pointer_type(tl.float32), bitcast=True)
            tl.store(biases, bias.to(tl.float32) * qk_scale - offsets, mask=nmask)


@triton.jit
def _sub_block_scores(k, head, n0, end, QSUB: tl.constexpr, QG: tl.constexpr, QG_B: tl.constexpr, D: tl.constexpr,
                      ASM: tl.constexpr):  # fmt: skip
    """The scores (BLOCK_N, QG_B) float32, biases added, of a tile k (BLOCK_N, D) fp16 of tokens n0 .. n0 + BLOCK_N
    that holds BLOCK_N / QSUB query blocks (n0 a multiple of BLOCK_N): each row against its own block's qT and bias
    (_block_query), one mma a block over the whole tile, each row taking its block's. A block from `end` on (the
    last tile's padding) reads the last block's record instead: its rows are masked out."""
    BLOCK_N: tl.constexpr = k.shape[0]
    part = tl.arange(0, BLOCK_N) // QSUB  # (BLOCK_N,) the block of the tile each row is in
    first = tl.cast(n0, tl.uint32) // QSUB
    last = (tl.cast(end, tl.uint32) - 1) // QSUB
    s = tl.zeros((BLOCK_N, QG_B), tl.float32)
    for j in tl.static_range(BLOCK_N // QSUB):
        qT, bias = _block_query(head, tl.minimum(first + j, last), QG, QG_B, D, ASM)
        s = tl.where((part == j)[:, None], tl.dot(k, qT) + bias[None, :], s)
    return s


@triton.jit
def _codes_step(qT, bias, head, kp, vp, n0, end, m_i, l_rows, acc, KW: tl.constexpr, VW: tl.constexpr,
                D: tl.constexpr, KPLAN: tl.constexpr, VPLAN: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr,
                QG: tl.constexpr, QSUB: tl.constexpr):  # fmt: skip
    """One tile of _codes_head's online softmax over codes-only K and V (kp, vp: the head's words): tokens
    n0 .. n0 + BLOCK_N (those from `end` on masked out when MASKED) with the block's qT and bias (_block_query),
    or, where the tile holds several query blocks of QSUB tokens (QSUB > 0), each block's from the head's records
    (head; _sub_block_scores) -> the updated (m_i, l_rows, acc). K's lanes keep their code offsets (the bias takes them out of the scores);
    V's are the codes themselves (one sub.f16x2 a pair, which costs what the moves into the shared-memory stores'
    register quads cost with the offsets left in: ptxas puts lop3 results elsewhere, sm_90a). A side whose plan
    (KPLAN, VPLAN) is not 0 holds grouped rows (kernels/groups.py), in that module's column orders (keys' group_tile,
    values' group_value_tile)."""
    BLOCK_N: tl.constexpr = l_rows.shape[0]
    rows = n0 + tl.arange(0, BLOCK_N)
    mask_n = rows < end
    # (BLOCK_N, D) fp16
    if KPLAN:
        k = group_tile(kp, rows, mask_n, KPLAN, D, D * KW // 32, ASM, MASKED)
    else:
        k = _packed_tile(kp, kp, kp, rows, mask_n, KW, D, D, False, ASM, True, MASKED, OFFSET_CODES)
    if QSUB:  # (BLOCK_N, QG_B), log2 units, each row's bias added: no column bias
        s = _sub_block_scores(k, head, n0, end, QSUB, QG, bias.shape[0], D, ASM)
        bias = tl.zeros_like(bias)
    else:
        s = tl.dot(k, qT)  # (BLOCK_N, QG_B), log2 units, without the bias
    if MASKED:
        s = tl.where(mask_n[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0) + bias)
    p = tl.exp2(s - (m_new - bias)[None, :])
    alpha = tl.exp2(m_i - m_new)
    l_rows = l_rows * alpha[None, :] + p
    if VPLAN:
        v = group_value_tile(vp, rows, mask_n, VPLAN, D, D * VW // 32, ASM, MASKED)
    else:
        v = _packed_tile(vp, vp, vp, rows, mask_n, VW, D, D, False, ASM, False, MASKED, EXACT_CODES)
    vT = tl.trans(v)
    if ASM:  # an identity Triton cannot look through: see _opaque
        vT = _opaque(vT)
    acc = acc * alpha[None, :] + tl.dot(vT, p.to(tl.float16))
    return m_new, l_rows, acc


@triton.jit
def _codes_extra(qT, bias, m_i, l_rows, acc, x_end, kx_h, kx_st, vx_h, vx_st, kcol, koff, vcol):
    """The online softmax over the first x_end tokens of a KV head's extra segment, floats in the codes' domain
    (kx_h, vx_h its rows, token strides kx_st, vx_st), with block 0's qT and bias -> the updated (m_i, l_rows, acc).
    The bias takes the stored tiles' code offsets out of the scores (koff by column): the extra keys' scores get
    q . koff back once, in float32, rather than each key its offsets in fp16 (at an offset of 512 fp16 keeps half
    a code)."""
    BLOCK_N: tl.constexpr = l_rows.shape[0]
    q_off = tl.sum(qT.to(tl.float32) * koff[:, None], axis=0)  # (QG_B,)
    for n0 in range(0, x_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        mask_n = n < x_end
        n64 = n.to(tl.int64)[:, None]
        k = _load_fp16(kx_h, n64 * kx_st + kcol[None, :], mask_n[:, None])
        v = _load_fp16(vx_h, n64 * vx_st + vcol[None, :], mask_n[:, None])
        s = tl.where(mask_n[:, None], tl.dot(k, qT) + q_off[None, :], float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0) + bias)
        p = tl.exp2(s - (m_new - bias)[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_rows = l_rows * alpha[None, :] + p
        m_i = m_new
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(tl.float16))
    return m_i, l_rows, acc


@triton.jit
def _codes_head(q_ptr, stride_qb, stride_qh, stride_qn, bias_ptr, stride_bb, stride_bh, b64, h, sp, L, kp, kp_sb,
                kp_sh, kslot_ptr, vp, vp_sb, vp_sh, vslot_ptr, kx_ptr, kx_sb, kx_sh, kx_st, vx_ptr, vx_sb, vx_sh,
                vx_st, Tx, m_ptr, l_ptr, o_ptr, chunk, qk_scale, num_splits, HKV: tl.constexpr, QG: tl.constexpr,
                QG_B: tl.constexpr, D: tl.constexpr, D_B: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr,
                KPLAN: tl.constexpr, VPLAN: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK_N: tl.constexpr,
                STAGES: tl.constexpr, QBLOCK: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """One program of _decode_packed_kernel over codes-only stores (decode_attention_blocks): as _packed_head, but
    the tiles hold the codes (no scale or zero read; K's with their code offsets), and the scores take the query
    and bias of the tile's block of QBLOCK tokens (0: one block, loaded once) from q_ptr's records
    (_block_query_kernel's; stride_qb, stride_qh: a batch row's and a KV head's strides). KPLAN, VPLAN: grouped
    plans (kernels/groups.py), or 0."""
    i = tl.arange(0, QG_B)
    if KPLAN:
        kcol, koff = group_columns_jit(KPLAN, D)
    else:
        kcol = code_of_column_jit(KW, D, True)
        koff = code_offsets_jit(tl.arange(0, D), KW)  # (D,) by logical column
    if VPLAN:
        vcol = group_value_columns_jit(VPLAN, D)
    else:
        vcol = code_of_column_jit(VW, D, False)
    head = q_ptr + b64 * stride_qb + h * stride_qh  # int32: the head's record of block 0
    m_i = tl.full((QG_B,), float("-inf"), tl.float32)
    l_rows = tl.zeros((BLOCK_N, QG_B), tl.float32)
    acc = tl.zeros((D, QG_B), tl.float32)
    kp = kp + b64 * kp_sb + tl.load(kslot_ptr + h).to(tl.int64) * kp_sh
    vp = vp + b64 * vp_sb + tl.load(vslot_ptr + h).to(tl.int64) * vp_sh

    start = tl.minimum(sp * chunk, L)
    end = tl.minimum(start + chunk, L)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    # a tile of several query blocks (QBLOCK < BLOCK_N, which it divides) reads each block's query in the step
    QSUB: tl.constexpr = QBLOCK if QBLOCK < BLOCK_N else 0
    if QBLOCK == 0:  # one block: its query for every tile, held in registers as the mma's operand
        qT = _load_q_pairs(head + i[:, None] * (D // 2), (i < QG)[:, None], 1.0, 0, D, ASM, True)
        bias = tl.load((head + QG * D // 2 + i).to(tl.pointer_type(tl.float32), bitcast=True))
    elif QSUB:  # placeholders: the step reads its blocks' queries
        qT = tl.zeros((D, QG_B), tl.float16)
        bias = tl.zeros((QG_B,), tl.float32)
    for n0 in tl.range(start, full_end, BLOCK_N, num_stages=STAGES):
        if QBLOCK >= BLOCK_N:
            qT, bias = _block_query(head, tl.cast(n0, tl.uint32) // QBLOCK, QG, QG_B, D, ASM)
        m_i, l_rows, acc = _codes_step(qT, bias, head, kp, vp, n0, end, m_i, l_rows, acc, KW, VW, D, KPLAN, VPLAN,
                                       ASM, False, QG, QSUB)  # fmt: skip
    if full_end < end:
        if QBLOCK >= BLOCK_N:
            qT, bias = _block_query(head, tl.cast(full_end, tl.uint32) // QBLOCK, QG, QG_B, D, ASM)
        m_i, l_rows, acc = _codes_step(qT, bias, head, kp, vp, full_end, end, m_i, l_rows, acc, KW, VW, D, KPLAN,
                                       VPLAN, ASM, True, QG, QSUB)  # fmt: skip
    if HAS_EXTRA:
        if sp == num_splits:
            if QBLOCK > 0:
                qT, bias = _block_query(head, 0, QG, QG_B, D, ASM)
            m_i, l_rows, acc = _codes_extra(qT, bias, m_i, l_rows, acc, Tx, kx_ptr + b64 * kx_sb + h * kx_sh, kx_st,
                                            vx_ptr + b64 * vx_sb + h * vx_sh, vx_st, kcol, koff, vcol)  # fmt: skip

    l_i = tl.sum(l_rows, axis=0)
    row = (b64 * HKV * QG + h * QG + i) * (num_splits + HAS_EXTRA) + sp  # (QG_B,)
    tl.store(m_ptr + row, m_i, mask=i < QG)
    tl.store(l_ptr + row, l_i, mask=i < QG)
    tl.store(o_ptr + row[None, :] * D_B + vcol[:, None], acc, mask=(i < QG)[None, :])


# L_arg, the stored length of an eager step, is not specialized on divisibility by 16: it changes every step, and
# so each bucket compiled twice in a generation's first 16 steps (a compiling 4-bit step took 2.2 s on the H100,
# check-5317e84). The main loop compiles to the same instructions either way (make inspect, sm_90a); the single
# specialization key is checked in tests/kernels/gpu/test_inspect.py.
@triton.jit(do_not_specialize=["L_arg"])
def _decode_packed_kernel(
    q_ptr, stride_qb, stride_qh, stride_qn, bias_ptr, stride_bb, stride_bh, k_words, k_words_sb, k_words_sh,
    k_scales, k_zeros, k_scales_sb, k_scales_sh, kslot_ptr, v_words, v_words_sb, v_words_sh, v_scales, v_zeros,
    v_scales_sb, v_scales_sh, vslot_ptr, kx_ptr, kx_sb, kx_sh, kx_st, vx_ptr, vx_sb, vx_sh, vx_st, Tx, heads_ptr,
    starts, chunks, m_ptr, l_ptr, o_ptr, L_arg, len_ptr, qk_scale, num_splits, NH: tl.constexpr,
    HKV: tl.constexpr, QG: tl.constexpr, QG_B: tl.constexpr, D: tl.constexpr, D_B: tl.constexpr,
    KWS: tl.constexpr, VWS: tl.constexpr, KG: tl.constexpr, VG: tl.constexpr, K_SYM: tl.constexpr,
    V_SYM: tl.constexpr, HAS_EXTRA: tl.constexpr, L_FROM_PTR: tl.constexpr, BLOCK_NS: tl.constexpr,
    STAGES: tl.constexpr, ASM: tl.constexpr, CODES: tl.constexpr = False, QBLOCK: tl.constexpr = 0,
    KPLANS: tl.constexpr = (), VPLANS: tl.constexpr = (),
):  # fmt: skip
    # grid: (B * NH, num_splits + HAS_EXTRA) over the NH KV heads of every width bucket whose keys and values are
    # both packed at 2, 3, 4 or 8 bits, as _decode_split_kernel's for one bucket: heads_ptr lists them in bucket
    # order, bucket i's at [starts[i], starts[i + 1]). Bucket i is a branch of its own, compiled for its widths
    # KWS[i] (keys) and VWS[i] (values), its tile BLOCK_NS[i] and pipeline STAGES[i], reading tuple entry i of the
    # store arguments (that width's words, scales, zeros and strides) and splitting its tokens into chunks[i].
    # With CODES (codes-only stores, decode_attention_blocks) q_ptr holds _block_query_kernel's records, a query and
    # a bias per block of QBLOCK tokens (QBLOCK 0: one block), stride_qb and stride_qh apart by batch row and KV head;
    # bias_ptr and the scales and zeros are placeholders; KPLANS[i], VPLANS[i] bucket i's grouped plans
    # (kernels/groups.py's plan_code, 0 for none).
    sp, b64, j, h, L = _program(heads_ptr, len_ptr, L_arg, NH, L_FROM_PTR)
    for k in tl.static_range(len(KWS)):
        if (j >= starts[k]) & (j < starts[k + 1]):
            if CODES:
                _codes_head(
                    q_ptr, stride_qb, stride_qh, stride_qn, bias_ptr, stride_bb, stride_bh, b64, h, sp, L, k_words[k],
                    k_words_sb[k], k_words_sh[k], kslot_ptr, v_words[k], v_words_sb[k], v_words_sh[k], vslot_ptr, kx_ptr,
                    kx_sb, kx_sh, kx_st, vx_ptr, vx_sb, vx_sh, vx_st, Tx, m_ptr, l_ptr, o_ptr, chunks[k], qk_scale,
                    num_splits, HKV, QG, QG_B, D, D_B, KWS[k], VWS[k], KPLANS[k], VPLANS[k], HAS_EXTRA, BLOCK_NS[k],
                    STAGES[k], QBLOCK, ASM,
                )  # fmt: skip
            else:
                _packed_head(
                    q_ptr, stride_qb, stride_qh, b64, h, sp, L, k_words[k], k_words_sb[k], k_words_sh[k], k_scales[k],
                    k_zeros[k], k_scales_sb[k], k_scales_sh[k], kslot_ptr, v_words[k], v_words_sb[k], v_words_sh[k],
                    v_scales[k], v_zeros[k], v_scales_sb[k], v_scales_sh[k], vslot_ptr, kx_ptr, kx_sb, kx_sh, kx_st,
                    vx_ptr, vx_sb, vx_sh, vx_st, Tx, m_ptr, l_ptr, o_ptr, chunks[k], qk_scale, num_splits, HKV, QG,
                    QG_B, D, D_B, KWS[k], VWS[k], KG, VG, K_SYM, V_SYM, HAS_EXTRA, BLOCK_NS[k], STAGES[k], ASM,
                )  # fmt: skip


@triton.jit
def _combine_kernel(
    m_ptr,
    l_ptr,
    o_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    S,
    HQ: tl.constexpr,
    S_B: tl.constexpr,
    SC: tl.constexpr,
    D: tl.constexpr,
    D_B: tl.constexpr,
):
    # grid: (B * HQ,); merges the S split partials of one query head with log-sum-exp (log2 units), SC splits
    # of the (S, D_B) partial outputs at a time so that many splits do not take many registers.
    pid = tl.program_id(0)
    s = tl.arange(0, S_B)
    d = tl.arange(0, D_B)
    m = tl.load(m_ptr + pid * S + s, mask=s < S, other=float("-inf"))
    lsum = tl.load(l_ptr + pid * S + s, mask=s < S, other=0.0)
    m_max = tl.max(m, axis=0)
    denom = tl.sum(lsum * tl.exp2(m - m_max), axis=0)  # empty splits have m = -inf and weigh 0
    acc = tl.zeros((D_B,), tl.float32)
    for s0 in range(0, S, SC):
        sc = s0 + tl.arange(0, SC)
        wgt = tl.exp2(tl.load(m_ptr + pid * S + sc, mask=sc < S, other=float("-inf")) - m_max)
        o = tl.load(o_ptr + (pid * S + sc[:, None]) * D_B + d[None, :], mask=sc[:, None] < S, other=0.0)
        acc += tl.sum(o * wgt[:, None], axis=0)
    b = pid // HQ
    hq = pid % HQ
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + hq * stride_oh + d,
        (acc / denom).to(out_ptr.dtype.element_ty),
        mask=d < D,
    )


def _default_splits(length: int, n_programs: int, block_n: int, device: torch.device) -> int:
    """Splits of `length` tokens for PROGRAMS_PER_SM programs per SM over n_programs (batch x KV heads),
    no split shorter than one tile, at most MAX_SPLITS."""
    sms = sm_count(device) if device.type == "cuda" else CPU_SMS
    want = cdiv(PROGRAMS_PER_SM * sms, n_programs)
    return max(1, min(cdiv(max(length, 1), block_n), want, MAX_SPLITS))


def _fast_launch(kw: int, vw: int, head_dim: int, codes: bool = False) -> dict:
    """The launch (FAST_LAUNCH, FAST_LAUNCH_SMALL_HEADS at head_dim 64 and below; for codes-only stores
    CODES_LAUNCH, and its tables for heads of 64 channels and fewer and of more than 128) of a bucket of kw-bit keys
    and vw-bit values: that of the width with the smaller tile (at equal tiles, the wider width's), so that a 3-bit
    side keeps its 64-token tile (3 and 4 bits at 128 tokens under the cap spill a register, sm_90a); a width with
    no entry (a grouped plan's) GROUPS_LAUNCH, or GROUPS_LAUNCH_LARGE_HEADS above 128 channels."""
    small, large = head_dim <= 64, head_dim > 128
    if codes:
        table = CODES_LAUNCH_SMALL_HEADS if small else CODES_LAUNCH_LARGE_HEADS if large else CODES_LAUNCH
    else:
        table = FAST_LAUNCH_SMALL_HEADS if small else FAST_LAUNCH
    grouped = GROUPS_LAUNCH_LARGE_HEADS if large else GROUPS_LAUNCH
    narrow, wide = table.get(min(kw, vw), grouped), table.get(max(kw, vw), grouped)
    return narrow if narrow["block_n"] < wide["block_n"] else wide


def fast_block_n(kw: int, vw: int, head_dim: int, codes: bool = False) -> int:
    """The fast kernel's default tokens per tile for a bucket of keys at kw bits and values at vw (codes: of
    codes-only stores)."""
    return _fast_launch(kw, vw, head_dim, codes)["block_n"]


def fast_options(kw: int, vw: int, head_dim: int, codes: bool = False) -> dict:
    """The fast kernel's default Triton launch options (num_stages, maxnreg) for a bucket of kw-bit keys and vw-bit
    values (codes: of codes-only stores)."""
    return {k: v for k, v in _fast_launch(kw, vw, head_dim, codes).items() if k != "block_n"}


@functools.lru_cache(maxsize=256)
def _launch_options(
    head_dim: int, fast_pairs: tuple, given: tuple, codes: bool = False, grouped: bool = False
) -> tuple[dict, tuple]:
    """Stage 1's Triton launch options and each fast bucket's pipeline stages, for one launch: the generic
    kernel's (fast_pairs empty) or the fast kernel's over its (key width, value width) buckets.

    A fast bucket's loop over tiles takes its own stages (fast_options); the launch takes the tightest register
    cap any of its buckets asks for (the caps bind where a width's tile would need more: one compiled kernel
    holds every bucket's branch; `grouped`, a bucket holding grouped plans: GROUPS_MAXNREG) and the fewest stages.
    The caller's `given` ((name, value) pairs) wins over all of them, maxnreg 0 meaning no cap. Cached: built once per map and call signature (the eager decode step is
    host-bound); read-only."""
    defaults = [fast_options(kw, vw, head_dim, codes) for kw, vw in fast_pairs]
    merged = {}
    if defaults:
        merged["num_stages"] = min(d["num_stages"] for d in defaults)
        caps = [d["maxnreg"] for d in defaults if "maxnreg" in d] + ([GROUPS_MAXNREG] if grouped else [])
        if caps:
            merged["maxnreg"] = min(caps)
    merged.update(given)
    stages = tuple(dict(given).get("num_stages") or d["num_stages"] for d in defaults)
    return {k: v for k, v in merged.items() if not (k == "maxnreg" and v == 0)}, stages


def fast_bucket(kw: int, vw: int, q_dtype: torch.dtype, head_dim: int, k_group: int, v_group: int,
                k_planned: tuple = (), v_planned: tuple = ()) -> bool:  # fmt: skip
    """Whether a (key width, value width) bucket takes the fast packed kernel: fp16 or bf16 queries, each width
    2, 3, 4 or 8 with rows that kernels.unpack splits into lanes, or one of the widths with a grouped plan
    (k_planned, v_planned: a codes-only store's). A bucket with a grouped plan takes it at any query dtype (only
    it reads such rows; its mmas run in fp16)."""
    grouped = kw in k_planned or vw in v_planned
    readable = (kw in k_planned or fast_path_fits(kw, head_dim, k_group)) and (
        vw in v_planned or fast_path_fits(vw, head_dim, v_group)
    )
    if grouped and not readable:  # the generic kernel reads no grouped rows
        raise NotImplementedError(
            f"a bucket of {kw}-bit keys and {vw}-bit values with a grouped plan: its other side's rows are not ones "
            f"the fast kernel reads at head_dim {head_dim}; allowed: a grouped plan there too"
        )
    return (grouped or q_dtype in (torch.float16, torch.bfloat16)) and readable


@functools.lru_cache(maxsize=256)
def _map_plan(k_bits: tuple[int, ...], v_bits: tuple[int, ...], device: torch.device, q_dtype: torch.dtype,
              head_dim: int, k_group: int, v_group: int, k_planned: tuple = (), v_planned: tuple = ()) -> tuple:  # fmt: skip
    """(width buckets, whether each takes the fast kernel, the fast buckets' (key width, value width) pairs, their
    KV heads in bucket order (int32 on `device`, None without fast buckets), the fast buckets' starts in it).
    Cached per map and query dtype: the eager decode step is host-bound."""
    buckets = width_buckets(k_bits, v_bits, device)
    fast = tuple(
        fast_bucket(kw, vw, q_dtype, head_dim, k_group, v_group, k_planned, v_planned)
        for kw, vw, _ in buckets
    )
    pairs = tuple((kw, vw) for (kw, vw, _), f in zip(buckets, fast) if f)
    heads = [h for (_, _, h), f in zip(buckets, fast) if f]  # each fast bucket's heads, in bucket order
    starts = tuple(itertools.accumulate((len(h) for h in heads), initial=0))
    return buckets, fast, pairs, torch.cat(heads) if heads else None, starts


def _store_map_plan(k_store, v_store, device: torch.device, q_dtype: torch.dtype) -> tuple:
    """_map_plan of two stores."""
    return _map_plan(k_store.bits, v_store.bits, device, q_dtype, k_store.head_dim, k_store.group_size,
                     v_store.group_size, _planned(k_store), _planned(v_store))  # fmt: skip


def _planned(st) -> tuple[int, ...]:
    """The widths of a store that hold grouped plans (kernels/groups.py), ascending."""
    return tuple(st.plan_codes)


def _plan_codes(st, widths) -> tuple[int, ...]:
    """kernels.groups.plan_code of a store's plan at each of `widths` (0 where it has none)."""
    return tuple(st.plan_code(w) for w in widths)


def _split_plans(map_plan, k_store, span: int, block_n: int | None, device: torch.device,
                 num_splits: int | None, qblock: int | None = None) -> tuple[list, int]:  # fmt: skip
    """((tokens per tile, tokens per split) of each bucket, split columns of the partials table): plan_splits'.
    With `qblock` (tokens a query block of decode_attention_blocks; 0: one block) a tile divides the block, or, in
    the fast kernel, holds whole blocks (its step reads each block's query), and a split holds whole blocks."""
    plans = []
    for (kw, vw, heads), fast in zip(map_plan[0], map_plan[1]):
        tile = block_n or (fast_block_n(kw, vw, k_store.head_dim, qblock is not None) if fast else BLOCK_N)
        # else the largest power of two below the default that divides the block
        while qblock and qblock % tile and not (fast and tile % qblock == 0):
            tile //= 2
        programs = k_store.batch * (len(k_store.bits) if fast else len(heads))
        n = num_splits or _default_splits(span, programs, tile, device)
        step = max(tile, qblock or 0)
        plans.append((tile, cdiv(cdiv(max(span, 1), n), step) * step))  # whole tiles (and blocks)
    return plans, max(cdiv(max(span, 1), chunk) for _, chunk in plans)


def plan_splits(
    k_store, v_store, span: int, block_n: int | None, device: torch.device, num_splits: int | None = None,
    q_dtype: torch.dtype = torch.float32,
):  # fmt: skip
    """(width buckets, (tokens per tile, tokens per split) of each bucket, split columns of the partials table).

    A bucket's tile is `block_n`, or its kernel's default (fast_block_n for the fast kernel, BLOCK_N else).
    A generic bucket's launch is split for its own program count (a bucket of few heads gets more splits, so
    that it fills the GPU alone). A fast bucket's is split as if it held every head, so its splits are as long as
    a uniform map's: on the H100 the fast kernel ran slower with every split count above the default at 32K
    (33, 66, 132 splits: 176, 185, 211 us at 4 bits), and a mixed map whose buckets took 132 splits each ran
    2.9x slower than uniform 4 bits. All launches write one partials table with the largest split count, where
    a program past its own bucket's splits finds no token and writes an empty partial (weight 0 in the combine).
    """
    map_plan = _store_map_plan(k_store, v_store, device, q_dtype)
    return (map_plan[0], *_split_plans(map_plan, k_store, span, block_n, device, num_splits))


def _bucket_args(st, width: int) -> list:
    """The kernel arguments of one store's bucket at `width`: its payload (or 16-bit values), scales and zeros
    (placeholders where absent) with their strides, and the store's slot table."""
    data, scale, zero = st.bucket_of[width].kernel_tensors()
    assert data.stride(-1) == 1 and scale.stride(-1) == 1 and zero.stride() == scale.stride()
    return [data, *data.stride()[:3], scale, zero, *scale.stride()[:3], st.slot]


def _packed_args(st, widths: tuple[int, ...]) -> list:
    """The fast kernel's arguments for one store at the buckets of `widths` (one entry per fast launch bucket,
    repeated where two buckets share a width): tuples of payloads as int32 words, their batch and head strides,
    scales, zeros (scales again where symmetric) and their batch and head strides; then the store's slot table."""
    fields = []
    for width in widths:
        payload, scale, zero = st.bucket_of[width].kernel_tensors()
        words = payload.view(torch.int32)  # (B, Hw, cap, NW)
        assert words.is_contiguous() and scale.is_contiguous() and zero.stride() == scale.stride()
        fields.append((words, *words.stride()[:2], scale, zero, *scale.stride()[:2]))
    return [*zip(*fields), st.slot]


def _kernel_group(st, d_b: int) -> int:
    """The group size the kernel is compiled with (any power of two <= D_B when no head is quantized)."""
    if all(w == 16 for w in st.bits) or st.codes_only:
        return d_b
    check_group_size(st.group_size, st.head_dim)
    return st.group_size


@functools.lru_cache(maxsize=256)
def width_buckets(k_bits: tuple[int, ...], v_bits: tuple[int, ...], device: torch.device) -> tuple:
    """((key width, value width, KV heads int32 tensor on `device`), ...): the KV heads grouped by their pair of
    widths, one stage-1 launch each. Cached, so the tables are built (and copied to the device) once per map."""
    pairs = sorted(set(zip(k_bits, v_bits)))
    return tuple(
        (
            kw,
            vw,
            torch.tensor(
                [h for h, p in enumerate(zip(k_bits, v_bits)) if p == (kw, vw)],
                dtype=torch.int32,
                device=device,
            ),
        )
        for kw, vw in pairs
    )


@functools.lru_cache(maxsize=64)
def _width_table(bits: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 (Hkv,) on `device`: each KV head's width (made and copied once per map)."""
    return torch.tensor(bits, dtype=torch.int32, device=device)


_BLOCK_WORKSPACE: dict[tuple, torch.Tensor] = {}


def _block_workspace(device: torch.device, B: int, Hkv: int, NB: int, QG: int, D: int) -> torch.Tensor:
    """_block_query_kernel's output, int32 (B, Hkv, NB, record_words(QG, D)), a view of a buffer kept per (device,
    B, Hkv, QG, D) and grown to the largest NB asked for (a growing cache adds a block now and then; a CUDA graph's
    calls ask for one NB). PAD_ROWS query rows of padding follow, which the fast kernel's unmasked loads of a block's
    rows may read."""
    key, words = (device, B, Hkv, QG, D), B * Hkv * NB * record_words(QG, D)
    buf = _BLOCK_WORKSPACE.get(key)
    pad = PAD_ROWS * D // 2
    if buf is None or buf.numel() < words + pad:
        grown = 0 if buf is None else 2 * (buf.numel() - pad)
        buf = torch.zeros(max(words, grown) + pad, dtype=torch.int32, device=device)
        _BLOCK_WORKSPACE[key] = buf
    return buf[:words].view(B, Hkv, NB, record_words(QG, D))


def record_words(qg: int, head_dim: int) -> int:
    """_record_words on the host: int32 words of one block's queries and biases of a KV head."""
    return qg * head_dim // 2 + -(-qg // 4) * 4


def _block_queries(qb: torch.Tensor, bias: torch.Tensor, k_store, map_plan, qk_scale: float) -> torch.Tensor:
    """decode_attention_blocks' qb (B, Hq, NB, D) and bias (B, Hq, NB) as the fast kernel's codes-only tiles read
    them (_block_query_kernel, one launch): int32 (B, Hkv, NB, record_words) records, each block's queries (fp16 in
    its KV head's lane order, times qk_scale) and biases (float32, less the code offsets' share)."""
    B, Hq, NB, D = qb.shape
    Hkv = len(k_store.bits)
    out = _block_workspace(qb.device, B, Hkv, NB, Hq // Hkv, D)
    block_nb = min(16, next_power_of_2(NB))
    widths = tuple(sorted({kw for kw, _ in map_plan[2]}))
    _block_query_kernel[(B * Hq, cdiv(NB, block_nb))](
        qb, *qb.stride()[:3], bias, *bias.stride()[:2], _width_table(k_store.bits, qb.device), out, NB, qk_scale,
        HQ=Hq, QG=Hq // Hkv, D=D, KWS=widths, KPLANS=_plan_codes(k_store, widths), BLOCK_NB=block_nb,
    )  # fmt: skip
    return out


_SIDE_STREAMS: dict[torch.device, tuple] = {}


def _side_streams(device: torch.device, n: int) -> tuple:
    """(fork event, ((side stream, its join event), ...)): n streams of `device` besides the current one for the
    width buckets after the first, made once per device and reused (an event re-recorded only moves forward)."""
    fork, sides = _SIDE_STREAMS.get(device, (None, ()))
    if len(sides) < n:
        fork = torch.cuda.Event()
        sides = tuple((torch.cuda.Stream(device), torch.cuda.Event()) for _ in range(n))
        _SIDE_STREAMS[device] = (fork, sides)
    return fork, sides[:n]


_WORKSPACE: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, B: int, Hq: int, n_cols: int, d_b: int) -> tuple:
    """The split partials (m, l (B, Hq, S) float32; o (B, Hq, S, D_B) float32), allocated once per shape and
    reused: every element a launch reads is written by the same step's stage 1."""
    key = (device, B, Hq, n_cols, d_b)
    if key not in _WORKSPACE:
        m = torch.empty(B, Hq, n_cols, dtype=torch.float32, device=device)
        _WORKSPACE[key] = (
            m,
            torch.empty_like(m),
            torch.empty(B, Hq, n_cols, d_b, dtype=torch.float32, device=device),
        )
    return _WORKSPACE[key]


@functools.lru_cache(maxsize=256)
def _fast_constants(pairs: tuple, n_heads: int, qg: int, tiles: tuple, head_dim: int, given: tuple,
                    common: tuple, asm: bool, plans: tuple = ((), ())) -> dict:  # fmt: skip
    """The fast launch's compile-time constants and options: its buckets' widths `pairs`, tiles and stages (and
    with codes-only stores their grouped plans, `plans`: key and value plan codes per bucket), on top of the
    constants `common` ((name, value) pairs) to both kernels. Cached per map and call signature; read-only."""
    grouped = any(plans[0]) or any(plans[1])
    launch, stages = _launch_options(head_dim, pairs, given, dict(common).get("CODES", False), grouped)
    return dict(NH=n_heads, QG_B=max(8, next_power_of_2(qg)),  # the N of an mma: at least 8
                KWS=tuple(kw for kw, _ in pairs), VWS=tuple(vw for _, vw in pairs), BLOCK_NS=tiles, STAGES=stages,
                ASM=asm, **dict(common), **launch,
                **(dict(KPLANS=plans[0], VPLANS=plans[1]) if dict(common).get("CODES") else {}))  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_store,
    v_store,
    sm_scale: float,
    k_extra: torch.Tensor | None = None,
    v_extra: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    length: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """softmax(q K^T * sm_scale) V for one decode step over packed K/V plus an optional extra segment.

    Args (B batch, Hq query heads, Hkv KV heads with Hq % Hkv == 0, D head_dim, L stored tokens):
        q: float32/float16/bfloat16 (B, Hq, D), last dim contiguous. Query head i reads KV head i // (Hq // Hkv).
        k_store, v_store: kernels.layout.PackedStore (keys, values) of one layer, same B, Hkv, D and length;
            each may use its own widths, group size (a power of two) and symmetry.
        sm_scale: softmax scale (e.g. D ** -0.5).
        k_extra, v_extra: optional float (B, Hkv, Tx, D), last dim contiguous: full-precision tokens attended
            in the same softmax as the stored ones (order does not matter; no masking is applied).
        num_splits: KV splits of the stored tokens (default: PROGRAMS_PER_SM programs per SM in each width
            bucket's launch).
        out: optional (B, Hq, D) output tensor, last dim contiguous; default a new tensor of q's dtype.
        block_n: tokens per tile, a power of two >= 16 (default: each kernel's own, fast_block_n or BLOCK_N); a
            split holds a whole number of tiles.
        length: None (L = the stores' length), or an int32 tensor of one element on q's device holding L, read
            by the kernels: the splits then cover the stores' capacity, so the launches stay the same while L
            grows (CUDA graphs). The caller guarantees 0 < L <= capacity (or an extra segment).
        num_warps, num_stages, maxnreg: Triton launch options of stage 1 (default: the fast kernel's FAST_LAUNCH,
            else Triton's); maxnreg 0 sets no register cap.
    Returns out (B, Hq, D). The matmuls run in q's dtype (fp32: IEEE, no TF32), accumulation in fp32.
    """
    assert not k_store.codes_only and not v_store.codes_only, "codes-only stores: decode_attention_blocks"
    options = (("num_warps", num_warps), ("num_stages", num_stages), ("maxnreg", maxnreg))
    given = tuple((k, v) for k, v in options if v is not None)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return _decode(
        q, None, k_store, v_store, sm_scale, (k_extra, v_extra), num_splits, out, block_n, length, given
    )


def decode_attention_blocks(
    qb: torch.Tensor,
    bias: torch.Tensor,
    k_store,
    v_store,
    sm_scale: float,
    qblock: int | None,
    k_extra: torch.Tensor | None = None,
    v_extra: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    length: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """One decode step over codes-only stores (kernels/layout.py), in the codes' domain, with a query and a bias
    per block of `qblock` stored tokens (kernels/reference.py's attention_blocks_reference):

        score_t = qb[b, i, t // qblock] . c_t + bias[b, i, t // qblock],  out[b, i] = sum_t softmax(score * sm_scale)_t c_t

    c_t the codes of token t as numbers (keys and values each at their head's width); the extra segment's tokens
    are scored with block 0's query and bias.

    Args (B batch, Hq query heads, Hkv KV heads with Hq % Hkv == 0, D head_dim, L stored tokens):
        qb: float32/float16/bfloat16 (B, Hq, NB, D), last dim contiguous: NB >= ceil(L / qblock) (with `length`
            a device tensor, the blocks of the stores' capacity). fp16 and bf16 take the fast kernel (the mmas
            in fp16, qb clamped to its finite range); float32 the generic one (IEEE fp32 products).
        bias: float32 (B, Hq, NB), last dim contiguous.
        k_store, v_store: codes-only PackedStores (codes_only=True) of one layer, same B, Hkv, D and length.
        sm_scale: softmax scale.
        qblock: tokens per block, a multiple of 16; None: one block (qb and bias hold block 0 only).
        k_extra, v_extra: optional float (B, Hkv, Tx, D), last dim contiguous: tokens in the codes' domain.
        num_splits, block_n, length, num_warps, num_stages, maxnreg: as decode_attention's; a tile divides
            qblock or, in the fast kernel, is a multiple of it (default: the kernel's tile where it is either, else
            the largest power of two dividing qblock below it; the generic kernel's tiles always divide qblock), and
            a split holds whole blocks.
        out: optional float32 (B, Hq, D), last dim contiguous.
    Returns out (B, Hq, D) float32.
    """
    B, Hq, NB, D = qb.shape
    assert k_store.codes_only and v_store.codes_only, "decode_attention_blocks reads codes-only stores"
    assert bias.shape == (B, Hq, NB) and bias.dtype == torch.float32 and bias.stride(-1) == 1, bias.shape
    if qblock is not None and (qblock <= 0 or qblock % 16):
        raise ValueError(f"qblock: {qblock} tokens a block; allowed: a positive multiple of 16, or None")
    if qblock is not None and block_n is not None and qblock % block_n and block_n % qblock:
        raise ValueError(f"block_n: {block_n}; allowed: a divisor or a multiple of qblock {qblock}")
    if length is None and qblock and NB < cdiv(k_store.length, qblock):
        raise ValueError(f"qb: {NB} blocks for {k_store.length} stored tokens of {qblock} a block")
    options = (("num_warps", num_warps), ("num_stages", num_stages), ("maxnreg", maxnreg))
    given = tuple((k, v) for k, v in options if v is not None)
    if out is None:
        out = torch.empty(B, Hq, D, dtype=torch.float32, device=qb.device)
    assert out.dtype == torch.float32, out.dtype
    return _decode(qb[:, :, 0], (qb, bias, qblock or 0), k_store, v_store, sm_scale, (k_extra, v_extra), num_splits,
                   out, block_n, length, given)  # fmt: skip


def _decode(q, blocks, k_store, v_store, sm_scale: float, extra: tuple, num_splits, out, block_n, length,
            given: tuple) -> torch.Tensor:  # fmt: skip
    """decode_attention's and decode_attention_blocks' step: q (B, Hq, D) (block 0's queries with `blocks`, else
    None: (qb (B, Hq, NB, D), bias (B, Hq, NB), tokens a block or 0)) -> out (B, Hq, D)."""
    B, Hq, D = q.shape
    has_extra, span = _check_inputs(q, k_store, v_store, *extra, length)
    map_plan = _store_map_plan(k_store, v_store, q.device, q.dtype)
    qblock = None if blocks is None else blocks[2]
    plans, splits = _split_plans(map_plan, k_store, span, block_n, q.device, num_splits, qblock)
    n_cols = splits + int(has_extra)
    workspace = _workspace(q.device, B, Hq, n_cols, next_power_of_2(D))
    qk_scale = sm_scale * LOG2E  # scores in log2 units
    ready = (
        None
        if blocks is None or not map_plan[2]
        else _block_queries(*blocks[:2], k_store, map_plan, qk_scale)
    )
    shared = _stage1_args(q, blocks, ready, k_store, v_store, extra if has_extra else None, length, workspace)
    launches = _stage1_launches(q, k_store, v_store, map_plan, plans, shared, length, qk_scale, splits, given)
    _run_launches(launches, q)
    assert out.shape == (B, Hq, D) and out.stride(-1) == 1
    _combine(workspace, out)
    return out


def _check_inputs(q, k_store, v_store, k_extra, v_extra, length) -> tuple[bool, int]:
    """decode_attention's arguments checked against each other -> (whether there is an extra segment, the
    token range the splits cover: the stored tokens, or the whole capacity when L is read on the device)."""
    B, Hq, D = q.shape
    Hkv = len(k_store.bits)
    assert len(v_store.bits) == Hkv and Hq % Hkv == 0, (Hq, k_store.bits, v_store.bits)
    assert v_store.length == k_store.length and k_store.head_dim == v_store.head_dim == D
    assert k_store.batch == v_store.batch == B
    assert q.stride(-1) == 1
    check_widths([b for b in k_store.bits if b not in _planned(k_store)], D)
    check_widths([b for b in v_store.bits if b not in _planned(v_store)], D)
    if (k_extra is None) != (v_extra is None):
        raise ValueError("k_extra and v_extra must be given together")
    has_extra = k_extra is not None and k_extra.shape[2] > 0
    if has_extra:
        assert k_extra.shape == v_extra.shape and k_extra.shape[:2] == (B, Hkv) and k_extra.shape[3] == D
        assert k_extra.stride(-1) == 1 and v_extra.stride(-1) == 1
    for st in (k_store, v_store):  # the tiles address a head's rows with int32 offsets (_packed_tile)
        if st.capacity * max(st.bits) * D // 32 >= 2**31:
            raise ValueError(f"capacity: {st.capacity} tokens; allowed: under 2**31 words a head's rows")
    span = k_store.length if length is None else min(k_store.capacity, v_store.capacity)
    if span == 0 and not has_extra:
        raise ValueError("nothing to attend to: the stores are empty and there is no extra segment")
    return has_extra, span


def _query_args(qb: torch.Tensor, bias: torch.Tensor | None) -> list:
    """A launch's query arguments: qb (B, Hq, NB, D) (or (B, Hq, D), one block) and bias (B, Hq, NB) with their
    strides (bias None: placeholders the kernels do not read)."""
    if bias is None:
        return [qb, qb.stride(0), qb.stride(1), 0, qb, 0, 0]
    return [qb, *qb.stride()[:3], bias, *bias.stride()[:2]]


def _stage1_args(
    q, blocks, ready, k_store, v_store, extra, length, workspace: tuple
) -> tuple[tuple, list, list, tuple]:
    """What every stage-1 launch of a call takes: (the queries' arguments of the fast and of the generic kernel:
    q's, or with `blocks` (qb, bias, qblock) the fast kernel's from `ready` (_block_queries') and the generic
    one's from qb and bias; the extra segments', from `extra` (k_extra, v_extra) or placeholders; the partials'
    (the workspace and L_arg); the compile-time constants as (name, value) pairs)."""
    Hq, D = q.shape[1:]
    if blocks is None:
        queries = (_query_args(q, None),) * 2
    else:
        generic = _query_args(*blocks[:2])
        if ready is not None:  # the fast kernel's: records (B, Hkv, NB, words), the biases inside them
            ready = [ready, *ready.stride()[:3], ready, 0, 0]
        queries = (generic if ready is None else ready, generic)
    Hkv, d_b = len(k_store.bits), workspace[2].shape[3]
    kx, vx = extra if extra is not None else (q.unsqueeze(2), q.unsqueeze(2))  # unused placeholders
    extra_args = [kx, *kx.stride()[:3], vx, *vx.stride()[:3], kx.shape[2] if extra is not None else 0]
    # L_arg is 0 where the kernel reads the length (a replayed launch must not change with the host's)
    partials = [*workspace, k_store.length if length is None else 0]
    common = (("HKV", Hkv), ("QG", Hq // Hkv), ("D", D), ("D_B", d_b), ("KG", _kernel_group(k_store, d_b)),
              ("VG", _kernel_group(v_store, d_b)), ("K_SYM", k_store.symmetric), ("V_SYM", v_store.symmetric),
              ("HAS_EXTRA", extra is not None), ("L_FROM_PTR", length is not None))  # fmt: skip
    if blocks is not None:
        common += (("CODES", True), ("QBLOCK", blocks[2]))
    return queries, extra_args, partials, common


def _stage1_launches(q, k_store, v_store, map_plan, plans, shared, length, qk_scale: float, splits: int,
                     given: tuple) -> list:  # fmt: skip
    """(kernel, grid, arguments, keyword arguments) of every stage-1 launch: every fast bucket in one launch
    of _decode_packed_kernel, each other bucket in one of _decode_split_kernel. shared: _stage1_args'."""
    B, Hq, D = q.shape
    buckets, fast, fast_pairs, fast_heads, starts = map_plan
    (fast_queries, queries), extra, partials, common = shared
    n_cols, qg = partials[0].shape[2], dict(common)["QG"]
    launches = []
    if fast_pairs:
        chunks = tuple(chunk for (_, chunk), f in zip(plans, fast) if f)
        tiles = tuple(tile for (tile, _), f in zip(plans, fast) if f)
        args = [*fast_queries, *_packed_args(k_store, tuple(kw for kw, _ in fast_pairs)),
                *_packed_args(v_store, tuple(vw for _, vw in fast_pairs)), *extra, fast_heads, starts, chunks,
                *partials, fast_heads if length is None else length, qk_scale, splits]  # fmt: skip
        grouped = (
            _plan_codes(k_store, (kw for kw, _ in fast_pairs)),
            _plan_codes(v_store, (vw for _, vw in fast_pairs)),
        )
        launches.append((_decode_packed_kernel, (B * starts[-1], n_cols), args,
                         _fast_constants(fast_pairs, starts[-1], qg, tiles, D, given, common,
                                         os.environ.get("TRITON_INTERPRET") != "1", grouped)))  # fmt: skip
    for (kw, vw, heads), (tile, chunk), f in zip(buckets, plans, fast):
        if not f:
            args = [*queries, *_bucket_args(k_store, kw), *_bucket_args(v_store, vw), *extra,
                    heads, *partials, heads if length is None else length, chunk, qk_scale, splits]  # fmt: skip
            kwargs = dict(NH=len(heads), KW=kw, VW=vw, BLOCK_N=tile,
                          QG_B=max(16, next_power_of_2(qg)),  # tl.dot needs at least 16 rows
                          INPUT_PRECISION="ieee" if q.dtype == torch.float32 else None,
                          PREFETCH=(kw, vw) != (16, 16), **dict(common), **_launch_options(D, (), given)[0])  # fmt: skip
            launches.append((_decode_split_kernel, (B * len(heads), n_cols), args, kwargs))
    return launches


def _run_launches(launches: list, q: torch.Tensor) -> None:
    """Run the stage-1 launches: in turn, or concurrently while a CUDA graph captures them
    (CONCURRENT_BUCKETS)."""
    concurrent = (
        CONCURRENT_BUCKETS and len(launches) > 1 and q.is_cuda and torch.cuda.is_current_stream_capturing()
    )
    if concurrent:  # the launches after the first on side streams, which wait for the current stream's work
        main = torch.cuda.current_stream(q.device)
        fork, sides = _side_streams(q.device, len(launches) - 1)
        fork.record(main)
        for side, _ in sides:
            side.wait_event(fork)
    try:
        for i, (kernel, grid, args, kwargs) in enumerate(launches):
            if concurrent and i:
                torch.cuda.set_stream(sides[i - 1][0])
            kernel[grid](*args, **kwargs)
    finally:
        if concurrent:  # the combine waits for every launch
            torch.cuda.set_stream(main)
            for side, done in sides:
                done.record(side)
                main.wait_event(done)


def _combine(workspace: tuple, out: torch.Tensor) -> None:
    """Stage 2: merge the split partials of `workspace` (_workspace's) into out (B, Hq, D)."""
    m_part, l_part, o_part = workspace
    B, Hq, D = out.shape
    n_cols, d_b = o_part.shape[2:]
    _combine_kernel[(B * Hq,)](
        m_part,
        l_part,
        o_part,
        out,
        out.stride(0),
        out.stride(1),
        n_cols,
        HQ=Hq,
        S_B=next_power_of_2(n_cols),
        SC=min(COMBINE_BLOCK, next_power_of_2(n_cols)),
        D=D,
        D_B=d_b,
    )
