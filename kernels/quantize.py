"""Triton kernel that quantizes and packs new tokens of one layer into a PackedStore's tensors.

This module owns the write side of the fused path: each decode step quantizes Tn new tokens of every KV head
of a layer, keys and values in one launch (a decode step's host time is per launch): each width bucket of
kernels/layout.py is a branch of its own, its width a compile-time constant, so a program runs only its head's
width's code: 2, 3, 4 or 8 bits packed into the bucket's `payload`, with fp16 `scale`/`zero`; 16-bit heads
copied into the 16-bit bucket's `values`. The bit format is
kernels/reference.py's (the kernel is bit-exact with reference.quantize); where rows live is
kernels/layout.py's. quantize_codes_into does the same for a codes-only store from components a transform made
(the pca family's, harness/schemes/pca.py): each code the index of its cell among a table of boundaries, at its
head's width or, under a grouped plan (kernels/groups.py), at its group's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.groups import PASSES, group_widths_jit, plan_pass, plane_bits_jit
from kernels.host import cdiv, next_power_of_2
from kernels.layout import FULL_WIDTH
from kernels.reference import WIDTHS

_PASSES = tl.constexpr(PASSES)  # as the write kernel reads it

FP16_MAX = tl.constexpr(65504.0)  # reference.FP16_MAX, as a constant the kernel can read
KERNEL_WIDTHS = (*WIDTHS, FULL_WIDTH)


@triton.jit
def _store_packed(codes, out_ptrs_row, mask_t, D: tl.constexpr, D_B: tl.constexpr, BITS: tl.constexpr):
    """Pack int32 codes (BLOCK_T, D_B) at BITS in {2, 4} and store bytes [0, D * BITS // 8) of each row.

    `out_ptrs_row` (BLOCK_T, 1) points at byte 0 of the head's packed row of each token.
    """
    PER: tl.constexpr = 8 // BITS
    BLOCK_T: tl.constexpr = codes.shape[0]
    c3 = tl.reshape(codes, (BLOCK_T, D_B // PER, PER))  # code j at [j // PER, j % PER]
    shifts = tl.arange(0, PER) * BITS
    # The fields of one byte are disjoint, so summing the shifted codes is the bitwise OR.
    packed = tl.sum(c3 << shifts[None, None, :], axis=2)  # (BLOCK_T, D_B // PER)
    k = tl.arange(0, D_B // PER)
    tl.store(out_ptrs_row + k[None, :], packed.to(tl.uint8), mask=mask_t & (k[None, :] < D // PER))


@triton.jit
def _store_packed3(codes, out_ptrs_row, mask_t, D: tl.constexpr, D_B: tl.constexpr):
    """Dense 3-bit packing: every 8 codes form a 24-bit little-endian word stored as 3 bytes."""
    BLOCK_T: tl.constexpr = codes.shape[0]
    c3 = tl.reshape(codes, (BLOCK_T, D_B // 8, 8))
    word = tl.sum(c3 << (tl.arange(0, 8) * 3)[None, None, :], axis=2)  # (BLOCK_T, D_B // 8)
    # 4 byte lanes per word (a power of two, as Triton needs); lane 3 is always masked off.
    lane = tl.arange(0, 4)
    b = (word[:, :, None] >> (lane * 8)[None, None, :]) & 0xFF  # (BLOCK_T, D_B // 8, 4)
    idx = tl.arange(0, D_B // 8)[None, :, None] * 3 + lane[None, None, :]
    mask = mask_t[:, :, None] & (lane[None, None, :] < 3) & (idx < D * 3 // 8)
    tl.store(out_ptrs_row[:, :, None] + idx, b.to(tl.uint8), mask=mask)


@triton.jit
def _store_codes(codes, prow, pmask, W: tl.constexpr, D: tl.constexpr, D_B: tl.constexpr):
    """Pack int32 codes (BLOCK_T, D_B) at W in {2, 3, 4, 8} and store each token's packed row: prow
    (BLOCK_T, 1) points at byte 0 of the rows, pmask (BLOCK_T, 1) says which tokens are written."""
    if W == 8:
        d = tl.arange(0, D_B)
        tl.store(prow + d[None, :], codes.to(tl.uint8), mask=pmask & (d[None, :] < D))
    elif W == 3:
        _store_packed3(codes, prow, pmask, D, D_B)
    else:
        _store_packed(codes, prow, pmask, D, D_B, W)


@triton.jit
def _sym_codes(x, mask3, W: tl.constexpr):
    """Symmetric (absmax) quantization of x (BLOCK_T, NG_B, G) float32 per group: (fp16 scales
    (BLOCK_T, NG_B), float codes of x's shape in [1, 2**W - 1]: q + 2**(W-1) for q in
    [-(2**(W-1) - 1), 2**(W-1) - 1])."""
    qmax: tl.constexpr = (1 << (W - 1)) - 1
    amax = tl.max(tl.where(mask3, tl.abs(x), 0.0), axis=2)  # (BLOCK_T, NG_B)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, qmax, tl.float32)).to(tl.float16)
    s = scale.to(tl.float32)[:, :, None]
    safe = tl.where(s == 0.0, 1.0, s)
    q = tl.floor(tl.math.div_rn(x, safe) + 0.5)
    q = tl.minimum(tl.maximum(q, -qmax), qmax)
    q = tl.where(s == 0.0, 0.0, q) + (qmax + 1.0)
    return scale, q


@triton.jit
def _asym_codes(x, mask3, valid, W: tl.constexpr):
    """Asymmetric (min/max) quantization of x (BLOCK_T, NG_B, G) float32 per group: (fp16 scales and zeros
    (BLOCK_T, NG_B), float codes of x's shape in [0, 2**W - 1]). valid (BLOCK_T, NG_B): the groups of stored
    tokens within D."""
    qmax: tl.constexpr = (1 << W) - 1
    # Padding lanes (tokens >= Tn, groups past D) get lo = hi = 0 so no inf - inf arithmetic happens.
    lo = tl.min(tl.where(mask3, x, float("inf")), axis=2)
    hi = tl.max(tl.where(mask3, x, float("-inf")), axis=2)
    lo = tl.where(valid, lo, 0.0)
    hi = tl.where(valid, hi, 0.0)
    scale = tl.math.div_rn(hi - lo, tl.full(lo.shape, qmax, tl.float32)).to(tl.float16)
    zero = lo.to(tl.float16)
    s = scale.to(tl.float32)[:, :, None]
    z = zero.to(tl.float32)[:, :, None]
    safe = tl.where(s == 0.0, 1.0, s)
    q = tl.floor(tl.math.div_rn(x - z, safe) + 0.5)
    q = tl.minimum(tl.maximum(q, 0.0), qmax)
    q = tl.where(s == 0.0, 0.0, q)
    return scale, zero, q


@triton.jit
def _quantize_head(
    x_ptr,
    stride_xb,
    stride_xh,
    stride_xt,
    stride_xd,
    h,
    b,
    j,
    n_heads,
    cap,
    pos,
    Tn,
    pid_t,
    out_ptr,
    scale_ptr,
    zero_ptr,
    W: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    NG_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SYM: tl.constexpr,
):
    """Tokens [pid_t * BLOCK_T, + BLOCK_T) of x's KV head h in batch row b into slot j of a bucket of n_heads
    heads at width W: out_ptr its payload (uint8 (B, n_heads, cap, D * W // 8)), or its values (B, n_heads, cap,
    D) at W 16; scale_ptr and zero_ptr its (B, n_heads, cap, D // G) fp16 tensors. All contiguous (layout.py)."""
    ROW: tl.constexpr = D if W == 16 else D * W // 8  # elements of one token's row in out_ptr
    NG: tl.constexpr = D // G
    D_B: tl.constexpr = NG_B * G  # next power of two >= D, as G is a power of two dividing D
    bj = b.to(tl.int64) * n_heads + j  # (batch row, slot) of the bucket's head-major tensors
    orow = out_ptr + bj * cap * ROW

    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    grp = tl.arange(0, NG_B)
    i = tl.arange(0, G)
    mask_t = t < Tn
    d3 = grp[None, :, None] * G + i[None, None, :]  # (1, NG_B, G): element index along D
    mask3 = mask_t[:, None, None] & (d3 < D)
    x_raw = tl.load(
        x_ptr
        + b.to(tl.int64) * stride_xb
        + h * stride_xh
        + t[:, None, None].to(tl.int64) * stride_xt
        + d3 * stride_xd,
        mask=mask3,
        other=0.0,
    )
    row = (pos + t).to(tl.int64)  # destination positions; int64 as cap * row stride can exceed 2**31

    if W == 16:
        dst = orow + row[:, None, None] * ROW + d3
        tl.store(dst, x_raw.to(out_ptr.dtype.element_ty), mask=mask3)
    else:
        x = tl.minimum(tl.maximum(x_raw.to(tl.float32), -FP16_MAX), FP16_MAX)
        if SYM:
            scale, q = _sym_codes(x, mask3, W)
        else:
            scale, zero, q = _asym_codes(x, mask3, mask_t[:, None] & (grp[None, :] < NG), W)
        codes = tl.reshape(tl.where(mask3, q, 0.0).to(tl.int32), (BLOCK_T, D_B))

        soff = bj * cap * NG + row[:, None] * NG + grp[None, :]
        smask = mask_t[:, None] & (grp[None, :] < NG)
        tl.store(scale_ptr + soff, scale, mask=smask)
        if not SYM:
            tl.store(zero_ptr + soff, zero, mask=smask)
        prow = orow + row[:, None] * ROW  # (BLOCK_T, 1): byte 0 of each token's packed row
        _store_codes(codes, prow, mask_t[:, None], W, D, D_B)


@triton.jit
def _quantize_store(
    x_ptr,
    stride_xb,
    stride_xh,
    stride_xt,
    stride_xd,
    outs,
    scales,
    zeros,
    heads_ptr,
    starts,
    cap,
    job,
    b,
    pos,
    Tn,
    pid_t,
    WIDTHS: tl.constexpr,
    D: tl.constexpr,
    G: tl.constexpr,
    NG_B: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SYM: tl.constexpr,
):
    """Job `job` of one store: the KV head heads_ptr[job], in the bucket i whose jobs are [starts[i],
    starts[i + 1]), each bucket's width a compile-time constant of its own branch."""
    h = tl.load(heads_ptr + job)
    for i in tl.static_range(len(WIDTHS)):
        if (job >= starts[i]) & (job < starts[i + 1]):
            _quantize_head(
                x_ptr, stride_xb, stride_xh, stride_xt, stride_xd, h, b, job - starts[i],
                starts[i + 1] - starts[i], cap, pos, Tn, pid_t, outs[i], scales[i], zeros[i],
                WIDTHS[i], D, G, NG_B, BLOCK_T, SYM,
            )  # fmt: skip


@triton.jit
def _quantize_kernel(
    k_ptr,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    k_outs,
    k_scales,
    k_zeros,
    k_heads,
    k_starts,
    k_cap,
    v_ptr,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    v_outs,
    v_scales,
    v_zeros,
    v_heads,
    v_starts,
    v_cap,
    Tn,
    pos_arg,
    pos_ptr,
    K_WIDTHS: tl.constexpr,
    V_WIDTHS: tl.constexpr,
    K_D: tl.constexpr,
    V_D: tl.constexpr,
    K_G: tl.constexpr,
    V_G: tl.constexpr,
    K_NG_B: tl.constexpr,
    V_NG_B: tl.constexpr,
    K_SYM: tl.constexpr,
    V_SYM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    POS_FROM_PTR: tl.constexpr,
):
    # grid: (cdiv(Tn, BLOCK_T), B, Hk + Hv); a program handles BLOCK_T tokens of one KV head: jobs [0, Hk) the
    # first store's heads, in bucket order, then the second store's (V_WIDTHS empty: one store).
    pid_t = tl.program_id(0)
    b = tl.program_id(1)
    job = tl.program_id(2)
    if POS_FROM_PTR:
        pos = tl.load(pos_ptr)
    else:
        pos = pos_arg
    n_k = k_starts[len(K_WIDTHS)]
    if job < n_k:
        _quantize_store(
            k_ptr, stride_kb, stride_kh, stride_kt, stride_kd, k_outs, k_scales, k_zeros, k_heads, k_starts,
            k_cap, job, b, pos, Tn, pid_t, K_WIDTHS, K_D, K_G, K_NG_B, BLOCK_T, K_SYM,
        )  # fmt: skip
    elif len(V_WIDTHS) > 0:
        _quantize_store(
            v_ptr, stride_vb, stride_vh, stride_vt, stride_vd, v_outs, v_scales, v_zeros, v_heads, v_starts,
            v_cap, job - n_k, b, pos, Tn, pid_t, V_WIDTHS, V_D, V_G, V_NG_B, BLOCK_T, V_SYM,
        )  # fmt: skip


@triton.jit
def _codes_head(z_ptr, stride_zb, stride_zh, stride_zt, stride_zd, scale_ptr, bounds_ptr, stride_bounds, h, b, j,
                n_heads, cap, pos, Tn, pid_t, out_ptr, W: tl.constexpr, D: tl.constexpr, D_B: tl.constexpr,
                BLOCK_T: tl.constexpr):  # fmt: skip
    """Tokens [pid_t * BLOCK_T, + BLOCK_T) of KV head h's components z in batch row b into slot j of a codes-only
    bucket of n_heads heads at width W (out_ptr: its payload, uint8 (B, n_heads, cap, D * W // 8)). A component's
    code is the number of width W's boundaries (bounds_ptr's row W, sorted, 2**W - 1 of them) below z / scale
    (scale_ptr: float32 (H, D)), found by a binary search of W steps: exactly what searchsorted(side="left")
    returns for finite and infinite quotients."""
    ROW: tl.constexpr = D * W // 8
    orow = out_ptr + (b.to(tl.int64) * n_heads + j) * cap * ROW
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D_B)
    mask_t = t < Tn
    mask = mask_t[:, None] & (d[None, :] < D)
    z = tl.load(z_ptr + b.to(tl.int64) * stride_zb + h * stride_zh + t[:, None].to(tl.int64) * stride_zt
                + d[None, :] * stride_zd, mask=mask, other=0.0)  # fmt: skip
    s = tl.load(scale_ptr + h * D + d, mask=d < D, other=1.0)
    y = tl.math.div_rn(z, s[None, :])  # (BLOCK_T, D_B), as torch divides
    code = tl.zeros((BLOCK_T, D_B), tl.int32)
    row_bounds = bounds_ptr + W * stride_bounds
    for k in tl.static_range(W):  # bit W - 1 - k of the code: is the boundary below that half's first level?
        probe = code + (1 << (W - 1 - k))
        code = tl.where(tl.load(row_bounds + probe - 1) < y, probe, code)
    prow = orow + (pos + t).to(tl.int64)[:, None] * ROW  # (BLOCK_T, 1): byte 0 of each token's packed row
    _store_codes(tl.where(mask, code, 0), prow, mask_t[:, None], W, D, D_B)


@triton.jit
def _grouped_codes_head(z_ptr, stride_zb, stride_zh, stride_zt, stride_zd, scale_ptr, bounds_ptr, stride_bounds, h,
                        b, j, n_heads, cap, pos, Tn, pid_t, out_ptr, W: tl.constexpr, PLAN: tl.constexpr,
                        D: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """_codes_head for a bucket of unit width W whose rows follow the grouped plan PLAN (kernels/groups.py): each
    component coded at its group's width (the same search, over that width's boundaries; 0 bits: code 0), each of
    its planes' bits of the code shifted to their place in the row and the row's int32 words summed from the fields
    they hold (disjoint: a sum is their OR)."""
    NW: tl.constexpr = D * W // 32
    NW_B: tl.constexpr = D // 4  # a power of two at least NW (W <= 8)
    orow = (out_ptr + (b.to(tl.int64) * n_heads + j) * cap * (NW * 4)).to(tl.pointer_type(tl.int32))
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D)
    mask_t = t < Tn
    z = tl.load(z_ptr + b.to(tl.int64) * stride_zb + h * stride_zh + t[:, None].to(tl.int64) * stride_zt
                + d[None, :] * stride_zd, mask=mask_t[:, None], other=0.0)  # fmt: skip
    y = tl.math.div_rn(z, tl.load(scale_ptr + h * D + d)[None, :])  # (BLOCK_T, D)
    width = group_widths_jit(PLAN, D)  # (D,) each component's width
    row_bounds = bounds_ptr + width * stride_bounds  # (D,)
    code = tl.zeros((BLOCK_T, D), tl.int32)
    for k in tl.static_range(8):  # bit width - 1 - k of the code, for the components of more than k bits
        live = (k < width)[None, :]
        probe = code + tl.where(live, 1 << tl.maximum(width - 1 - k, 0)[None, :], 0)
        bound = tl.load(row_bounds[None, :] + probe - 1, mask=live, other=0.0)
        code = tl.where(live & (bound < y), probe, code)
    word = tl.arange(0, NW_B)
    words = tl.zeros((BLOCK_T, NW_B), tl.int32)
    for k in tl.static_range(_PASSES):  # each plane's bits of the code at its place in the row
        if plan_pass(PLAN, k) != 0:
            plane, bit, shift = plane_bits_jit(PLAN, D, k)  # (D,) each
            fields = ((code >> shift[None, :]) & ((1 << plane) - 1)[None, :]) << (bit % 32)[
                None, :
            ]  # (BLOCK_T, D)
            words += tl.sum(
                tl.where((bit // 32)[None, None, :] == word[None, :, None], fields[:, None, :], 0), 2
            )
    prow = orow + (pos + t).to(tl.int64)[:, None] * NW + word[None, :]  # (BLOCK_T, NW_B)
    tl.store(prow, words, mask=mask_t[:, None] & (word[None, :] < NW))


@triton.jit
def _quantize_codes_kernel(z_ptr, stride_zb, stride_zh, stride_zt, stride_zd, scale_ptr, bounds_ptr,
                           stride_bounds, outs, heads_ptr, starts, cap, Tn, pos_arg, pos_ptr,
                           WIDTHS: tl.constexpr, D: tl.constexpr, D_B: tl.constexpr, BLOCK_T: tl.constexpr,
                           POS_FROM_PTR: tl.constexpr, PLANS: tl.constexpr):  # fmt: skip
    # grid: (cdiv(Tn, BLOCK_T), B, H); a program codes BLOCK_T tokens of one KV head, job j the head heads_ptr[j]
    # in the bucket i whose jobs are [starts[i], starts[i + 1]), each bucket's width (and grouped plan PLANS[i],
    # 0 for none) a branch of its own.
    pid_t, b, job = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pos = tl.load(pos_ptr) if POS_FROM_PTR else pos_arg
    h = tl.load(heads_ptr + job)
    for i in tl.static_range(len(WIDTHS)):
        if PLANS[i] != 0:
            if (job >= starts[i]) & (job < starts[i + 1]):
                _grouped_codes_head(z_ptr, stride_zb, stride_zh, stride_zt, stride_zd, scale_ptr, bounds_ptr,
                                    stride_bounds, h, b, job - starts[i], starts[i + 1] - starts[i], cap, pos, Tn,
                                    pid_t, outs[i], WIDTHS[i], PLANS[i], D, BLOCK_T)  # fmt: skip
        elif (job >= starts[i]) & (job < starts[i + 1]):
            _codes_head(z_ptr, stride_zb, stride_zh, stride_zt, stride_zd, scale_ptr, bounds_ptr, stride_bounds, h, b,
                        job - starts[i], starts[i + 1] - starts[i], cap, pos, Tn, pid_t, outs[i], WIDTHS[i], D, D_B,
                        BLOCK_T)  # fmt: skip


def quantize_codes_into(
    store, z: torch.Tensor, pos: int | torch.Tensor, scale: torch.Tensor, bounds: torch.Tensor,
    block_t: int | None = None,
) -> None:  # fmt: skip
    """Code components z into positions [pos, pos + Tn) of a codes-only PackedStore, every width bucket in one
    launch: component d of head h stored at its head's width w is the number of bounds[w]'s boundaries below
    z / scale[h, d] (searchsorted(bounds[w], z / scale, side="left") bit for bit), packed as
    kernels.reference.pack packs codes (what PackedStore.append_codes stores); under the store's grouped plan at
    w (kernels/groups.py) w is the component's group's width, packed as kernels.groups.pack packs them.

    Args (B batch, H KV heads, Tn new tokens, D head_dim):
        store: a kernels.layout.PackedStore with codes_only (its buckets' payloads are written in place).
        z: float32 (B, H, Tn, D), any strides: the components (a transform's outputs, as the caller computes them).
        pos: the first destination position, an int with pos + Tn <= capacity or an int32/int64 tensor of one
            element on z's device (read by the kernel; the caller guarantees the capacity).
        scale: float32 (H, D): each head's component scales.
        bounds: float32 (R, N), contiguous: row w the 2**w - 1 sorted boundaries of width w (entries past them
            unread), for every width the store holds.
        block_t: tokens per program (a power of two); default min(16, next_pow2(Tn)).
    """
    if not store.codes_only:
        raise ValueError(
            "quantize_codes_into: the store quantizes values (quantize_into); codes need codes_only=True"
        )
    B, H, Tn, D = z.shape
    assert (B, H, D) == (store.batch, len(store.bits), store.head_dim), (z.shape, store.bits, store.head_dim)
    assert z.dtype == scale.dtype == bounds.dtype == torch.float32, (z.dtype, scale.dtype, bounds.dtype)
    assert scale.shape == (H, D) and scale.is_contiguous(), scale.shape
    assert bounds.is_contiguous(), bounds.stride()
    plans = {w: plan for w, plan in store.plans.items() if w in store.bits}
    top = max((*(max(plan) for plan in plans.values()), *(b for b in store.bits if b not in plans)))
    assert bounds.shape[0] > top and bounds.shape[1] >= (1 << top) - 1, bounds.shape
    check_widths([b for b in store.bits if b not in plans], D)
    if not isinstance(pos, torch.Tensor) and (pos < 0 or pos + Tn > store.capacity):
        raise ValueError(f"pos: {pos} + Tn {Tn} exceeds capacity {store.capacity}")
    if Tn == 0:
        return
    pos_from_ptr = isinstance(pos, torch.Tensor)
    bt = block_t or min(16, next_power_of_2(Tn))
    _quantize_codes_kernel[(cdiv(Tn, bt), B, H)](
        z, *z.stride(), scale, bounds, bounds.stride(0), tuple(bk.payload for bk in store.buckets),
        store.bucket_heads, store.bucket_starts, store.capacity, Tn, 0 if pos_from_ptr else pos,
        pos if pos_from_ptr else store.bucket_heads,  # unused when the position is an int
        WIDTHS=tuple(bk.width for bk in store.buckets), D=D, D_B=next_power_of_2(D), BLOCK_T=bt,
        POS_FROM_PTR=pos_from_ptr, PLANS=tuple(store.plan_code(bk.width) for bk in store.buckets),
    )  # fmt: skip


def check_group_size(group_size: int, head_dim: int) -> None:
    """Raise NotImplementedError unless group_size is a power of two dividing head_dim (the kernels' tiling)."""
    if group_size <= 0 or group_size & (group_size - 1) or head_dim % group_size:
        raise NotImplementedError(
            f"group_size: {group_size} is not supported by the Triton kernels; "
            f"allowed: a power of two dividing head_dim {head_dim}"
        )


def check_widths(bits: list[int] | tuple[int, ...], head_dim: int) -> None:
    """Raise NotImplementedError naming the first per-head width (or row length) the kernels cannot handle."""
    for b in bits:
        if b not in KERNEL_WIDTHS:
            raise NotImplementedError(
                f"width {b} is not supported by the Triton kernels; allowed: {KERNEL_WIDTHS}"
            )
        need = 8 if b == 3 else 8 // b if b != FULL_WIDTH else 1
        if head_dim % need:
            raise NotImplementedError(f"width {b} needs head_dim a multiple of {need}; got {head_dim}")


def _store_args(store, x: torch.Tensor, pos: int | torch.Tensor) -> tuple[list, dict]:
    """One store's runtime arguments (x and its strides, each bucket's output tensors, the heads in bucket
    order, the buckets' job ranges, the capacity) and compile-time constants (widths, head_dim, group, symmetry)
    for _quantize_kernel, after checking x and the position against the store."""
    B, H, Tn, D = x.shape
    assert (B, H, D) == (store.batch, len(store.bits), store.head_dim), (x.shape, store.bits, store.head_dim)
    check_widths(store.bits, D)
    quantized = any(w != FULL_WIDTH for w in store.bits)
    if quantized:
        check_group_size(store.group_size, D)
    if not isinstance(pos, torch.Tensor) and (pos < 0 or pos + Tn > store.capacity):
        raise ValueError(f"pos: {pos} + Tn {Tn} exceeds capacity {store.capacity}")
    outs, scales, zeros = [], [], []
    for bk in store.buckets:
        out, scale, zero = bk.kernel_tensors()
        assert out.is_contiguous() and scale.is_contiguous() and zero.is_contiguous()
        outs.append(out)
        scales.append(scale)
        zeros.append(zero)
    g = store.group_size if quantized else next_power_of_2(D)
    runtime = [x, *x.stride(), tuple(outs), tuple(scales), tuple(zeros), store.bucket_heads,
               store.bucket_starts, store.capacity]  # fmt: skip
    constants = dict(WIDTHS=tuple(bk.width for bk in store.buckets), D=D, G=g, NG_B=next_power_of_2(D // g),
                     SYM=store.symmetric)  # fmt: skip
    return runtime, constants


def quantize_into(
    store,
    x: torch.Tensor,
    pos: int | torch.Tensor,
    block_t: int | None = None,
    v_store=None,
    v: torch.Tensor | None = None,
) -> None:
    """Quantize x into positions [pos, pos + Tn) of one layer's PackedStore, every width bucket in one launch;
    with v_store and v, also v into v_store (a layer's keys and values: still one launch).

    Args (B batch, Hkv KV heads, Tn new tokens, D head_dim, cap = store.capacity):
        store: kernels.layout.PackedStore (its buckets' tensors are written in place).
        x: float (B, Hkv, Tn, D), any strides.
        pos: first destination position, an int with pos + Tn <= cap, or an int32/int64 tensor of one element
            on x's device that the kernel reads (no host synchronization; a CUDA graph can replay the launch
            as the position advances); the caller then guarantees pos + Tn <= cap.
        block_t: tokens per program (a power of two); default min(16, next_pow2(Tn)).
        v_store, v: a second store and its new tokens (B, Hkv', Tn, D'), written at the same positions; each
            store keeps its own widths, head_dim, group size and symmetry.
    Positions outside [pos, pos + Tn) are untouched. The widths come from the stores' Python `bits`, so
    nothing is read back from the device. Each store's buckets are branches of one kernel, compiled once per
    set of widths (a store's widths and group size are compile-time constants).
    """
    if (v_store is None) != (v is None):
        raise ValueError("v_store and v must be given together")
    if any(st is not None and st.codes_only for st in (store, v_store)):
        raise ValueError(
            "quantize_into: a codes-only store holds codes, not values (PackedStore.append_codes)"
        )
    Tn = x.shape[2]
    k_args, k_const = _store_args(store, x, pos)
    if v_store is None:
        v_args, v_const = k_args, {**k_const, "WIDTHS": ()}  # placeholders: no job reaches them
        n_jobs = len(store.bits)
    else:
        assert v.shape[0] == x.shape[0] and v.shape[2] == Tn, (x.shape, v.shape)
        v_args, v_const = _store_args(v_store, v, pos)
        n_jobs = len(store.bits) + len(v_store.bits)
    if Tn == 0:
        return
    pos_from_ptr = isinstance(pos, torch.Tensor)
    bt = block_t or min(16, next_power_of_2(Tn))
    _quantize_kernel[(cdiv(Tn, bt), x.shape[0], n_jobs)](
        *k_args,
        *v_args,
        Tn,
        0 if pos_from_ptr else pos,
        pos if pos_from_ptr else store.bucket_heads,  # unused when the position is an int
        **{"K_" + k: c for k, c in k_const.items()},
        **{"V_" + k: c for k, c in v_const.items()},
        BLOCK_T=bt,
        POS_FROM_PTR=pos_from_ptr,
        # The contract is per-op IEEE float32; never let the compiler contract a multiply-add into an FMA.
        enable_fp_fusion=False,
    )
