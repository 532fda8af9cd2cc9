"""kernels/unpack.py: packed rows to fp16 by bit operations, against kernels/reference.py.

Under Triton's interpreter the plain-integer fallback runs (no inline assembly). At 8 bits it computes a value as
the reference does (float32 multiply, then add) and rounds to fp16: bit for bit the reference's. At 2, 3 and 4 bits
the per-group constant zero - 2**W * scale (at 3 bits zero - 8 scale and zero - 16 scale, one a lane; at 2 bits
zero - 4 scale and zero - 16 scale, one a pair) is rounded to fp16 first (as on the GPU), so a value may differ
from the reference by that rounding and its own: at most 2**-11 (|zero| + 2**W |scale|) + 2**-11 |value| (2**W:
16 at 2 and 3 bits), about 1% of a quantization step.
Compiled, the PTX rounds each value once (fma).
"""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.unpack import (
    EXACT_CODES,
    OFFSET_CODES,
    PAIRS2,
    PAIRS3,
    code_of_column,
    code_of_column_jit,
    code_offset,
    dequant_tile,
    dequant_tile3,
    fast_path_fits,
    group_constants,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile_kernel(p_ptr, s_ptr, z_ptr, out_ptr, R: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                 G: tl.constexpr, SYM: tl.constexpr, ASM: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
    # One (R, D) tile: rows of D W / 32 words in units (a word; at 3 bits words 3 j .. 3 j + 2), scales/zeros
    # (R, NG) fp16 -> out (R, D) fp16 in code order.
    NW: tl.constexpr = D * W // 32
    NU: tl.constexpr = D // 32 if W == 3 else NW
    NG: tl.constexpr = D // G
    r = tl.arange(0, R)
    g = tl.arange(0, NG)
    s2, z2, z2o = group_constants(
        tl.load(s_ptr + r[:, None] * NG + g[None, :]),
        tl.load(z_ptr + r[:, None] * NG + g[None, :]),
        W,
        SYM,
        ASM,
    )
    s2 = tl.reshape(tl.broadcast_to(s2[:, :, None], (R, NG, NU // NG)), (R, NU))
    z2 = tl.reshape(tl.broadcast_to(z2[:, :, None], (R, NG, NU // NG)), (R, NU))
    z2o = tl.reshape(tl.broadcast_to(z2o[:, :, None], (R, NG, NU // NG)), (R, NU))
    if W == 3:
        u = p_ptr + r[:, None] * NW + 3 * tl.arange(0, NU)[None, :]
        tile = dequant_tile3(tl.load(u), tl.load(u + 1), tl.load(u + 2), s2, z2, SYM, ASM, LANES)
    else:
        words = tl.load(p_ptr + r[:, None] * NW + tl.arange(0, NW)[None, :])
        tile = dequant_tile(words, s2, z2, z2o, W, SYM, ASM, LANES)  # (R, D) in lane or unit order
    tl.store(out_ptr + r[:, None] * D + code_of_column_jit(W, D, LANES)[None, :], tile)


@triton.jit
def _codes_kernel(p_ptr, out_ptr, R: tl.constexpr, D: tl.constexpr, W: tl.constexpr, CODES: tl.constexpr,
                  LANES: tl.constexpr):  # fmt: skip
    # One (R, D) codes-only tile, as _tile_kernel's but with no scale or zero: out (R, D) fp16 in column order.
    NW: tl.constexpr = D * W // 32
    r = tl.arange(0, R)
    if W == 3:
        u = p_ptr + r[:, None] * NW + 3 * tl.arange(0, D // 32)[None, :]
        u0 = tl.load(u)
        tile = dequant_tile3(u0, tl.load(u + 1), tl.load(u + 2), u0, u0, False, False, LANES, CODES)
    else:
        words = tl.load(p_ptr + r[:, None] * NW + tl.arange(0, NW)[None, :])
        tile = dequant_tile(words, words, words, words, W, False, False, LANES, CODES)
    tl.store(out_ptr + r[:, None] * D + tl.arange(0, D)[None, :], tile)


@triton.jit
def _columns_kernel(out_ptr, W: tl.constexpr, D: tl.constexpr, LANES: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, D), code_of_column_jit(W, D, LANES))


@pytest.mark.parametrize("width, head_dim", [(2, 64), (3, 128), (3, 256), (4, 128), (8, 64)])
@pytest.mark.parametrize("lanes", [True, False])
def test_code_of_column_jit_is_code_of_column(width, head_dim, lanes):
    out = torch.full((head_dim,), -1, dtype=torch.int32)
    _columns_kernel[(1,)](out, W=width, D=head_dim, LANES=lanes)
    assert out.tolist() == code_of_column(width, head_dim, lanes)


def test_3bit_pairs_are_five_codes_apart_but_the_last():
    """Codes c and c + 5 (15 bits apart: the two fp16 fields' distance) pair up, all but codes 30 and 31 (the
    chains c, c + 5, ... of residues 0 and 1 mod 5 have 7 codes each: one code of each is left over)."""
    assert PAIRS3 == (
        (0, 5), (1, 6), (2, 7), (3, 8), (4, 9), (10, 15), (11, 16), (12, 17), (13, 18), (14, 19),
        (20, 25), (21, 26), (22, 27), (23, 28), (24, 29), (30, 31),
    )  # fmt: skip


def test_2bit_pairs_take_two_fields_from_each_of_four_sources():
    """A word w's pairs (i, i + 8) sit at lane bits 8 (even pairs) and 6 (odd pairs) of w << 4, w, w >> 4 and w
    rotated left by 8, which also brings (15, 7) to bits 6 and 22: three shifts serve eight pairs."""
    assert PAIRS2 == ((0, 8), (1, 9), (2, 10), (3, 11), (4, 12), (5, 13), (6, 14), (15, 7))
    rotl = {0: 8, 7: 8, 1: 4, 2: 4, 3: 0, 4: 0, 5: -4, 6: -4}  # each pair's source: w rotated left by r
    for i, (lo, hi) in enumerate(PAIRS2):
        field = 8 if i % 2 == 0 else 6  # the low lane's field; the high lane's 16 bits up
        assert (field - rotl[i]) % 32 == 2 * lo and (field + 16 - rotl[i]) % 32 == 2 * hi


def test_2bit_column_orders_hand_computed():
    lanes, words = code_of_column(2, 64), code_of_column(2, 64, lanes=False)
    # column k: h = k % 2, pair 2 (k // 16 % 4) + k // 2 % 2 of lane c = k // 4 % 4's word (one word a lane)
    assert lanes[:8] == [0, 8, 1, 9, 16, 24, 17, 25]
    assert lanes[16:20] == [2, 10, 3, 11] and lanes[60:64] == [54, 62, 63, 55]
    assert words[:16] == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 15, 7]


def test_3bit_column_orders_hand_computed():
    lanes, units = code_of_column(3, 128), code_of_column(3, 128, lanes=False)
    # column k: h = k % 2, pair 2 (k // 16 % 8) + k // 2 % 2 of lane c = k // 4 % 4's unit
    assert lanes[:8] == [0, 5, 1, 6, 32, 37, 33, 38]
    assert lanes[12:20] == [96, 101, 97, 102, 2, 7, 3, 8]
    assert lanes[124:128] == [120, 125, 126, 127]  # lane 3 (unit 3: codes 96 ..), pairs 14 and 15
    assert units[:6] == [0, 5, 1, 6, 2, 7] and units[28:34] == [24, 29, 30, 31, 32, 37]


@pytest.mark.parametrize("head_dim", [128, 256])
def test_3bit_lanes_read_their_own_units(head_dim):
    """Lane c of every k16 block reads only units c * U .. c * U + U - 1 (U = head_dim / 128), each a run of 3
    words; in unit order a unit's 32 values are contiguous."""
    cols = code_of_column(3, head_dim)
    assert sorted(cols) == list(range(head_dim))
    for k, code in enumerate(cols):
        assert (code // 32) // (head_dim // 128) == (k // 4) % 4
    by_unit = code_of_column(3, head_dim, lanes=False)
    assert sorted(by_unit) == list(range(head_dim))
    assert all(code // 32 == k // 32 for k, code in enumerate(by_unit))


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_code_of_column_is_a_permutation_that_lanes_read_from_their_own_words(width, head_dim):
    cols = code_of_column(width, head_dim)
    assert sorted(cols) == list(range(head_dim))
    by_word = code_of_column(width, head_dim, lanes=False)
    cpw = 32 // width
    assert sorted(by_word) == list(range(head_dim))
    assert all(code // cpw == k // cpw for k, code in enumerate(by_word))  # a word's values stay together
    words, cpw = head_dim * width // 32, 32 // width
    for k, code in enumerate(cols):
        lane = (k // 4) % 4  # lane c of the mma operand owns columns 16 kb + 4 c .. + 3
        assert (code // cpw) // (words // 4) == lane  # ... all from words c * WL .. c * WL + WL - 1


@pytest.mark.parametrize(
    "width, head_dim, group_size, symmetric",
    [(2, 64, 32, False), (2, 128, 16, True), (4, 64, 32, True), (4, 128, 32, False), (4, 256, 64, False),
     (8, 64, 16, False), (8, 128, 32, True), (8, 32, 32, False), (3, 128, 32, False), (3, 128, 128, True),
     (3, 256, 64, False), (3, 256, 32, True)],
)  # fmt: skip
@pytest.mark.skipif(
    not INTERPRET, reason="the fallback is bit-exact; the compiled path is checked by the decode tests"
)
@pytest.mark.parametrize("lanes", [True, False])
def test_dequant_tile_equals_the_reference(width, head_dim, group_size, symmetric, lanes):
    assert fast_path_fits(width, head_dim, group_size)
    gen = torch.Generator().manual_seed(width * head_dim + group_size)
    R = 16
    x = torch.randn(R, head_dim, generator=gen) * torch.logspace(-3, 2, head_dim)  # groups of many ranges
    x[3, :group_size] = 0.25  # a constant group: scale 0
    p = reference.quantize(x, width, group_size, symmetric=symmetric)
    zero = p.scale if symmetric else p.zero  # unused when symmetric
    out = torch.full((R, head_dim), float("nan"), dtype=torch.float16)
    _tile_kernel[(1,)](p.payload.view(torch.int32), p.scale, zero, out, R=R, D=head_dim, W=width, G=group_size,
                       SYM=symmetric, ASM=False, LANES=lanes)  # fmt: skip
    want = reference.dequantize(p, dtype=torch.float16)
    if width == 8:
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
        return
    # the folded constant's fp16 rounding and the value's: 2**-11 relative each, plus a subnormal's unit
    s = p.scale.float().repeat_interleave(group_size, -1)
    z = 0.0 if symmetric else p.zero.float().repeat_interleave(group_size, -1)
    # the fma's offset: 2**W, at 3 bits 8 in the low lane and 16 in the high one, at 2 bits 4 in even pairs and
    # 16 in odd ones (the larger bounds both)
    offset = (16 if width in (2, 3) else 1 << width) + ((1 << (width - 1)) if symmetric else 0)
    bound = 2.0**-11 * ((z - offset * s).abs() + want.float().abs()) + 2.0**-24
    err = (out.float() - want.float()).abs()
    assert (err <= bound).all(), (err - bound).max()
    step = s.clamp_min(1e-30)
    assert (err / step).max() < 0.02  # at most 2% of a quantization step


@pytest.mark.parametrize("width, head_dim", [(2, 64), (3, 128), (4, 128), (8, 64), (4, 256)])
@pytest.mark.parametrize("lanes", [True, False])
def test_codes_only_tiles_hold_the_codes(width, head_dim, lanes):
    """A codes-only tile: with OFFSET_CODES logical column k holds code_offset(width, k) + its code exactly (the
    bit trick's exponent, no fma), with EXACT_CODES the code itself (every code of the width appears)."""
    gen = torch.Generator().manual_seed(width + head_dim)
    R = 16
    codes = torch.randint(0, 1 << width, (R, head_dim), generator=gen)
    codes[0] = torch.arange(head_dim) % (1 << width)
    payload = reference.pack(codes, width).view(torch.int32)
    cols = code_of_column(width, head_dim, lanes)
    want = codes[:, cols].float()  # (R, D) in column order
    offset = torch.tensor([code_offset(width, k) for k in range(head_dim)])
    for mode, shift in ((OFFSET_CODES, offset), (EXACT_CODES, 0.0)):
        out = torch.full((R, head_dim), float("nan"), dtype=torch.float16)
        _codes_kernel[(1,)](payload, out, R=R, D=head_dim, W=width, CODES=mode, LANES=lanes)
        assert torch.equal(out.float(), want + shift), mode


@pytest.mark.parametrize(
    "width, head_dim, group_size",
    [(2, 32, 32), (2, 64, 8), (3, 64, 32), (3, 128, 16), (3, 96, 32), (16, 64, 32), (4, 96, 32), (8, 48, 16)],
)
def test_rows_the_fast_path_cannot_split_are_refused(width, head_dim, group_size):
    """Fewer than 4 units a row (a word; 3 words at 3 bits), a unit spanning groups, 16 bits, a head_dim not a
    power of two."""
    assert not fast_path_fits(width, head_dim, group_size)
