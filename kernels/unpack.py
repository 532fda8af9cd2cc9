"""Packed codes to fp16 by bit operations, in the order the tensor cores read them.

This module owns the fast path's dequantization (kernels/decode_attention.py's packed stage 1): a row of
kernels/reference.py's format, read as 32-bit words, becomes fp16 values with no int-to-float conversion.
A row splits into units: a word of CPU = 32 / W codes at W in {2, 4, 8} bits, or at 3 bits three words
(96 bits, CPU = 32 codes). A unit's CPU / 2 "pairs" are two fp16 lanes, each made exactly by shifting the code
into place and OR-ing an exponent (one lop3 for mask and OR):
- 4 bits: pair i of a word is codes i and i + 4; the codes land on the top 4 mantissa bits, [6, 10), under
  exponent 16, so a lane is exactly 16 + code, and one fma.rn.f16x2 gives the value: lane * scale + (zero - 16
  scale), where the per-group constant is rounded to fp16 once per token and group (its rounding error, at
  most 2**-11 (|zero| + 16 scale), is at most about 1% of a quantization step: below bf16's resolution of the
  value);
- 2 bits: two fields a lane, so that one shift serves two pairs: even pairs land on mantissa bits [8, 10) under
  exponent 4 (lane 4 + code), odd pairs on [6, 8) under exponent 16 (lane 16 + code). The word itself, the word
  shifted left by 4, right by 4 and rotated left by 8 hold pairs (4, 12) and (3, 11), (2, 10) and (1, 9), (6, 14)
  and (5, 13), (0, 8) and (15, 7) at those fields (PAIRS2): three shifts and eight lop3 a word (seven and eight
  with one field a lane). The fma adds zero - 4 scale to even pairs and zero - 16 scale to odd ones (symmetric:
  -6 scale, -18 scale), each rounded to fp16 once per token and group, within the 4-bit bound above;
- 3 bits: the low lane's code lands on mantissa bits [7, 10) under exponent 8 (lane 8 + code), the high lane's
  on bits [6, 9) under exponent 16 (lane 16 + code): the two fields are 15 bits = 5 codes apart, so one shift
  (a funnel shift where the pair straddles two words) and one lop3 make the pair (c, c + 5). PAIRS3 lists a
  unit's 16 pairs: (c, c + 5) for c = 10 a + b (a < 3, b < 5), and (30, 31), which takes two shifts and two
  lop3 (the chains c, c + 5, ... of residues 0 and 1 mod 5 have 7 codes each: one of each is left over). One
  fma.rn.f16x2 gives both values with the constants zero - 8 scale (low lane) and zero - 16 scale (high lane;
  symmetric: -12 scale and -20 scale), each rounded to fp16 once per token and group: their rounding error,
  at most 2**-11 (|zero| + 16 scale), is under 1% of a quantization step;
- 8 bits: pair i of a word is codes i and i + 2; they land on the low mantissa bits under exponent 1024 (lane
  1024 + code), sub.f16x2 takes the 1024 off exactly and fma.rn.f16x2 applies scale and zero: the value
  fp16(code * scale + zero) in one rounding.
The reference computes a value in float32 and rounds it to the model's dtype (fp16 keeps 11 bits of it, bf16 8).
A codes-only tile (CODES: kernels/layout.py's codes-only stores) has no fma: each lane is exactly code_offset + code
(16 + code at 4 bits, and so on; OFFSET_CODES), whose offsets the kernel takes out of the sums it makes, or one
sub.f16x2 makes the codes themselves (EXACT_CODES).

Logical order. A tile of R tokens x NU units becomes (R, D) fp16 in a permuted channel order that makes every
pair a register of the mma operand without moving it: with WL = NU / 4 units per lane and P = CPU / 2 pairs
a unit, logical column
    k = (((wt * P/2 + i_hi) * 4 + c) * 2 + i_lo) * 2 + h
holds lane h of pair 2 * i_hi + i_lo of unit c * WL + wt, so that lane c of a k16 block owns 4 consecutive
logical columns (Triton's mma operand with kWidth 4) taken from its own WL units. The queries are loaded in
the same order for the scores, and the output columns are stored through it (`code_of_column`).

With ASM (compiled for a GPU) each step is inline PTX (lop3, sub.f16x2, fma.rn.f16x2); without it (Triton's
interpreter, which runs no assembly) the same values come from plain integer and float operations.
"""

from __future__ import annotations

import triton
import triton.language as tl

FAST_WIDTHS = (2, 3, 4, 8)  # packed widths the fast path reads; 16 takes the generic path
# What a codes-only tile holds (dequant_tile's CODES; 0: scale and zero applied): each lane's code_offset + code as
# the bit trick makes it (the offsets then leave the sums the kernel makes), or the code itself (one sub.f16x2 a pair)
OFFSET_CODES = tl.constexpr(1)
EXACT_CODES = tl.constexpr(2)
# 2 bits: the pairs (low code, high code) of a word (16 codes), in their order in the word's tile
PAIRS2 = tuple((i, i + 8) for i in range(7)) + ((15, 7),)
# 3 bits: the pairs (low code, high code) of a 96-bit unit (32 codes), in their order in the unit's tile
PAIRS3 = tuple((10 * (j // 5) + j % 5, 10 * (j // 5) + j % 5 + 5) for j in range(15)) + ((30, 31),)


def fast_path_fits(width: int, head_dim: int, group_size: int) -> bool:
    """Whether rows of `width` split into 4 lanes of whole units (a word; at 3 bits 3 words, 32 codes), each
    unit in one group, at a power-of-two head_dim (the kernel's tile shapes)."""
    if width not in FAST_WIDTHS or head_dim & (head_dim - 1):
        return False
    if width == 3:
        return head_dim % 128 == 0 and group_size % 32 == 0
    words, codes_per_word = head_dim * width // 32, 32 // width
    return head_dim * width % 32 == 0 and words % 4 == 0 and group_size % codes_per_word == 0


def code_of_column(width: int, head_dim: int, lanes: bool = True) -> list[int]:
    """The code (channel) index each logical column holds: the lane order of the module docstring, or with
    lanes=False the unit order (column CPU * unit + 2 * i + h holds code CPU * unit + code i, h of the unit)."""
    cpu = 32 if width == 3 else 32 // width  # codes per unit (a word; 3 words at 3 bits)
    pairs, units = cpu // 2, head_dim // cpu
    wl = units // 4

    def code(i, h):  # the unit's code in lane h of pair i
        if width in (2, 3):
            return (PAIRS2 if width == 2 else PAIRS3)[i][h]
        return i + pairs * h

    out = []
    for k in range(head_dim):
        if not lanes:
            unit, i, h = k // cpu, (k % cpu) // 2, k % 2
            out.append(cpu * unit + code(i, h))
            continue
        h, i_lo, c = k % 2, (k // 2) % 2, (k // 4) % 4
        i_hi, wt = (k // 16) % (pairs // 2), k // (16 * (pairs // 2))
        out.append(cpu * (c * wl + wt) + code(2 * i_hi + i_lo, h))
    return out


@triton.jit
def code_of_column_jit(W: tl.constexpr, D: tl.constexpr, LANES: tl.constexpr):
    """`code_of_column` as a (D,) int32 tensor, in the kernel."""
    return code_of_columns_jit(tl.arange(0, D), W, D, LANES)


@triton.jit
def code_of_columns_jit(k, W: tl.constexpr, D: tl.constexpr, LANES: tl.constexpr):
    """`code_of_column` at the logical columns k (an int32 tensor), in the kernel."""
    if W == 3:
        return _code_of_columns3(k, D, LANES)
    P: tl.constexpr = 16 // W
    WL: tl.constexpr = D * W // 128
    h = k % 2
    if LANES:
        c = (k // 4) % 4
        i = 2 * ((k // 16) % (P // 2)) + (k // 2) % 2
        word = c * WL + k // (16 * (P // 2))
    else:
        i = (k % (32 // W)) // 2
        word = k // (32 // W)
    if W == 2:  # PAIRS2: pair i is codes i, i + 8, but the last: 15, 7
        code = tl.where(i < 7, i + 8 * h, 15 - 8 * h)
    else:
        code = i + P * h
    return (32 // W) * word + code


def code_offset(width: int, column: int) -> float:
    """What a lane adds to its code before any scale (the exponent's value under which the code lies), at
    logical column `column` of either order: 16 at 4 bits, 1024 at 8, at 2 bits 4 (even pairs) or 16 (odd ones),
    at 3 bits 8 (low lanes) or 16 (high ones). A codes-only tile (CODES) holds code_offset + code exactly."""
    h, odd_pair = column % 2, (column // 2) % 2
    return {2: 16.0 if odd_pair else 4.0, 3: 16.0 if h else 8.0, 4: 16.0, 8: 1024.0}[width]


@triton.jit
def code_offsets_jit(k, W: tl.constexpr):
    """`code_offset` at the logical columns k (an int32 tensor) as float32, in the kernel."""
    if W == 2:
        return tl.where((k // 2) % 2 == 1, 16.0, 4.0)
    elif W == 3:
        return tl.where(k % 2 == 1, 16.0, 8.0)
    else:
        return tl.full(k.shape, 16.0 if W == 4 else 1024.0, tl.float32)


@triton.jit
def _code_of_columns3(k, D: tl.constexpr, LANES: tl.constexpr):
    """`code_of_column` at 3 bits: pair i of a unit holds codes PAIRS3[i]."""
    h = k % 2
    if LANES:
        c = (k // 4) % 4
        i = 2 * ((k // 16) % 8) + (k // 2) % 2
        unit = c * (D // 128) + k // 128
    else:
        i = (k % 32) // 2
        unit = k // 32
    low = 10 * (i // 5) + i % 5
    return 32 * unit + low + tl.where(i < 15, 5, 1) * h


@triton.jit
def _lop3(x, MASK: tl.constexpr, OR: tl.constexpr):
    """(x & MASK) | OR in one lop3 (immLut 0xEA = (a & b) | c); MASK and OR as decimal strings."""
    return tl.inline_asm_elementwise(
        "lop3.b32 $0, $1, " + MASK + ", " + OR + ", 234;", "=r,r", [x], tl.int32, True, 1
    )


@triton.jit
def _rotl8(x, ASM: tl.constexpr):
    """x rotated left by 8 bits (one shf.l.wrap with ASM)."""
    if ASM:
        return tl.inline_asm_elementwise("shf.l.wrap.b32 $0, $1, $1, 8;", "=r,r", [x], tl.int32, True, 1)
    else:
        return (x << 8) | ((x >> 24) & 0xFF)


@triton.jit
def _pair(words, PAIR: tl.constexpr, W: tl.constexpr, ASM: tl.constexpr):
    """Pair PAIR of every word: int32 of two fp16 lanes, 16 + code at 4 bits, 1024 + code at 8, at 2 bits
    4 + code (even pairs) or 16 + code (odd pairs)."""
    if W == 2:  # PAIRS2: pairs 2 j and 2 j + 1 come from one source, on bits [8, 10) and [6, 8) of each lane
        if PAIR == 0 or PAIR == 7:
            src = _rotl8(words, ASM)
        elif PAIR <= 2:
            src = words << 4
        elif PAIR <= 4:
            src = words
        else:
            src = words >> 4
        if PAIR % 2 == 0:
            if ASM:
                return _lop3(src, "50332416", "1140868096")  # 0x03000300, 0x44004400 (4.0)
            else:
                return (src & 0x03000300) | 0x44004400
        else:
            if ASM:
                return _lop3(src, "12583104", "1275087872")  # 0x00C000C0, 0x4C004C00 (16.0)
            else:
                return (src & 0x00C000C0) | 0x4C004C00
    if W == 8:
        shifted = words >> (W * PAIR) if PAIR > 0 else words
    else:  # 4 bits: the field at bit 4 PAIR moves to the top 4 mantissa bits, [6, 10)
        SHIFT: tl.constexpr = 6 - 4 * PAIR
        if SHIFT > 0:
            shifted = words << SHIFT
        else:
            shifted = words >> (-SHIFT)
    if ASM:
        if W == 4:
            return _lop3(shifted, "62915520", "1275087872")  # 0x03C003C0, 0x4C004C00 (16.0)
        else:
            return _lop3(shifted, "16711935", "1677747200")  # 0x00FF00FF, 0x64006400 (1024.0)
    else:
        if W == 4:
            return (shifted & 0x03C003C0) | 0x4C004C00
        else:
            return (shifted & 0x00FF00FF) | 0x64006400


@triton.jit
def _funnel(lo, hi, N: tl.constexpr, ASM: tl.constexpr):
    """The 32 bits from bit N of the 64-bit hi:lo (one shf.r.clamp with ASM)."""
    if ASM:  # the shifts of PAIRS3's pairs that straddle words: codes 10, 20 and 21
        tl.static_assert(N == 21 or N == 23 or N == 24)
        if N == 21:
            asm: tl.constexpr = "shf.r.clamp.b32 $0, $1, $2, 21;"
        elif N == 23:
            asm: tl.constexpr = "shf.r.clamp.b32 $0, $1, $2, 23;"
        else:
            asm: tl.constexpr = "shf.r.clamp.b32 $0, $1, $2, 24;"
        return tl.inline_asm_elementwise(asm, "=r,r,r", [lo, hi], tl.int32, True, 1)
    else:
        return ((lo >> N) & ((1 << (32 - N)) - 1)) | (hi << (32 - N))


@triton.jit
def _pair3(u0, u1, u2, PAIR: tl.constexpr, ASM: tl.constexpr):
    """Pair PAIR (PAIRS3) of every 3-bit unit (words u0, u1, u2): int32 of two fp16 lanes, 8 + low code and
    16 + high code (the codes on mantissa bits [7, 10) under exponent 8 and [6, 9) under 16)."""
    if PAIR == 15:  # codes 30, 31 (bits 26 and 29 of u2): each shifted into its own field
        if ASM:
            out = tl.inline_asm_elementwise(
                "{.reg .b32 a, b, t; shr.b32 a, $1, 19; shr.b32 b, $1, 7; "
                "lop3.b32 t, a, 896, 1275086848, 234; lop3.b32 $0, b, 29360128, t, 234;}",
                "=r,r",
                [u2],
                tl.int32,
                True,
                1,
            )  # 0x380, 0x4C004800; 0x01C00000
        else:
            out = ((u2 >> 19) & 0x380) | ((u2 >> 7) & 0x01C00000) | 0x4C004800
    else:  # codes c and c + 5, 15 bits apart: one shift brings c to bit 7 and c + 5 to bit 22
        C: tl.constexpr = 10 * (PAIR // 5) + PAIR % 5
        WORD: tl.constexpr = 3 * C // 32
        OFF: tl.constexpr = 3 * C % 32
        if WORD == 0:
            lo, hi = u0, u1
        elif WORD == 1:
            lo, hi = u1, u2
        else:
            lo, hi = u2, u2
        if OFF + 18 > 32:  # the pair straddles two words
            shifted = _funnel(lo, hi, OFF - 7, ASM)
        elif OFF < 7:
            shifted = lo << (7 - OFF)
        elif OFF > 7:
            shifted = lo >> (OFF - 7)
        else:
            shifted = lo
        if ASM:
            out = _lop3(shifted, "29361024", "1275086848")  # 0x01C00380, 0x4C004800 (8.0, 16.0)
        else:
            out = (shifted & 0x01C00380) | 0x4C004800
    return out


@triton.jit
def group_constants(s, z, W: tl.constexpr, SYM: tl.constexpr, ASM: tl.constexpr):
    """Per token and group, fp16 scale s and zero z (R, NG) -> the `dequant_tile` operands s2, z2, z2o (R, NG)
    int32: s in both lanes, and the constants the fma adds to even pairs (z2) and to odd ones (z2o), each rounded
    to fp16 once (exact before rounding: with ASM one fma.rn.f16, without it float64): at 4 bits zero - 16 s in
    both lanes of both (symmetric: -24 s); at 2 bits zero - 4 s (even) and zero - 16 s (odd) (symmetric: -6 s,
    -18 s); at 3 bits zero - 8 s in the low lane and zero - 16 s in the high one (symmetric: -12 s, -20 s); at 8
    bits the zero itself (symmetric: unused)."""
    if W == 2:  # fp16 bits of -4, -16 (symmetric: -6, -18)
        z2 = _offsets(s, z, -6.0 if SYM else -4.0, "0xC600" if SYM else "0xC400", None, None, SYM, ASM)
        z2o = _offsets(s, z, -18.0 if SYM else -16.0, "0xCC80" if SYM else "0xCC00", None, None, SYM, ASM)
    elif W == 4:  # -16 (symmetric: -24)
        z2 = _offsets(s, z, -24.0 if SYM else -16.0, "0xCE00" if SYM else "0xCC00", None, None, SYM, ASM)
        z2o = z2
    elif W == 8:
        z2 = splat2(z, ASM)
        z2o = z2
    else:  # 3 bits: -8 low, -16 high (symmetric: -12, -20)
        z2 = _offsets(
            s, z, -12.0 if SYM else -8.0, "0xCA00" if SYM else "0xC800", -20.0 if SYM else -16.0,
            "0xCD00" if SYM else "0xCC00", SYM, ASM,
        )  # fmt: skip
        z2o = z2
    return splat2(s, ASM), z2, z2o


@triton.jit
def _offsets(s, z, K: tl.constexpr, K_BITS: tl.constexpr, K_HI: tl.constexpr, K_HI_BITS: tl.constexpr,
             SYM: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """fp16 z + K s in the low lane of an int32 and z + K_HI s in the high one (K_HI None: K in both; symmetric:
    K s, K_HI s), each rounded once; K_BITS, K_HI_BITS: the constants' fp16 bits."""
    if ASM:
        if K_HI is None:
            pack: tl.constexpr = "mov.b32 $0, {c, c};}"
        else:
            pack: tl.constexpr = "fma.rn.f16 d, $1, l, $2; mov.b32 $0, {c, d};}"
        high: tl.constexpr = "" if K_HI is None else " mov.b16 l, " + K_HI_BITS + ";"
        return tl.inline_asm_elementwise(
            "{.reg .b16 c, d, k, l; mov.b16 k, " + K_BITS + ";" + high + " fma.rn.f16 c, $1, k, $2; " + pack,
            "=r,h,h",
            [s, tl.zeros_like(s) if SYM else z],
            tl.int32,
            True,
            1,
        )
    else:
        base = 0.0 if SYM else z.to(tl.float64)
        s64 = s.to(tl.float64)
        lo = (base + K * s64).to(tl.float16)
        hi = lo if K_HI is None else (base + K_HI * s64).to(tl.float16)
        return _bits(lo, hi)


@triton.jit
def _halves(x):
    """int32 -> its low and high 16 bits as fp16."""
    lo = x.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _bits(lo, hi):
    """Two fp16 tensors -> int32 with lo in the low and hi in the high 16 bits."""
    lo_b = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_b = hi.to(tl.int16, bitcast=True).to(tl.int32)
    return lo_b | (hi_b << 16)


@triton.jit
def pack_f16x2(lo, hi, ASM: tl.constexpr):
    """Two float32 tensors -> int32 of two fp16 lanes, lo in the low and hi in the high half, each rounded to
    nearest (one cvt.rn.f16x2.f32 with ASM)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], tl.int32, True, 1
        )
    else:
        return _bits(lo.to(tl.float16), hi.to(tl.float16))


@triton.jit
def splat2(x, ASM: tl.constexpr):
    """fp16 tensor -> int32 with x in both 16-bit lanes (one mov with ASM)."""
    if ASM:
        return tl.inline_asm_elementwise("mov.b32 $0, {$1, $1};", "=r,h", [x], tl.int32, True, 1)
    else:
        return _bits(x, x)


@triton.jit
def _fma(t, s2, z2):
    return tl.inline_asm_elementwise(
        "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [t, s2, z2], tl.int32, True, 1
    )


@triton.jit
def _sub_fma(t, s2, z2, BIAS: tl.constexpr):
    """PTX for (t - BIAS) * s + z on f16x2 lanes; BIAS names the fp16x2 bits subtracted."""
    return tl.inline_asm_elementwise(
        "{.reg .b32 c, k; mov.b32 k, " + BIAS + "; sub.f16x2 c, $1, k; fma.rn.f16x2 $0, c, $2, $3;}",
        "=r,r,r,r",
        [t, s2, z2],
        tl.int32,
        True,
        1,
    )


@triton.jit
def _affine(t, s2, z2, W: tl.constexpr, SYM: tl.constexpr, ASM: tl.constexpr):
    """Both fp16 lanes of a pair t to their values, one rounding each (s2, z2 from `group_constants`): at 2, 3 and
    4 bits t * s + z2 (lane by lane); at 8 bits (t - 1024) * s + z (symmetric: (t - 1024 - 128) * s)."""
    if ASM:
        if W != 8:
            return _fma(t, s2, z2)
        elif not SYM:
            return _sub_fma(t, s2, z2, "1677747200")  # 0x64006400: 1024
        else:
            return _sub_fma(t, s2, tl.zeros_like(t), "1686135936")  # 0x64806480: 1152
    else:
        bias = 0.0 if W != 8 else (1152.0 if SYM else 1024.0)
        t_lo, t_hi = _halves(t)
        s, _ = _halves(s2)
        s = s.to(tl.float32)
        if W == 8 and SYM:
            z_lo = 0.0
            z_hi = 0.0
        else:
            z_lo, z_hi = _halves(z2)  # equal but at 3 bits
            z_lo = z_lo.to(tl.float32)
            z_hi = z_hi.to(tl.float32)
        lo = ((t_lo.to(tl.float32) - bias) * s + z_lo).to(tl.float16)
        hi = ((t_hi.to(tl.float32) - bias) * s + z_hi).to(tl.float16)
        return _bits(lo, hi)


@triton.jit
def _values(words, PAIR: tl.constexpr, s2, z2, z2o, W: tl.constexpr, SYM: tl.constexpr, ASM: tl.constexpr,
            CODES: tl.constexpr = 0):  # fmt: skip
    """Pair PAIR of every word as two fp16 values (int32 bits): the constant z2 for even pairs, z2o for odd; with
    CODES (s2, z2, z2o unused) OFFSET_CODES: the lanes as `_pair` makes them, code_offset + code; EXACT_CODES: the
    codes themselves."""
    if CODES == EXACT_CODES:
        return _minus_offsets(_pair(words, PAIR, W, ASM), W, PAIR, ASM)
    if CODES == OFFSET_CODES:
        return _pair(words, PAIR, W, ASM)
    return _affine(_pair(words, PAIR, W, ASM), s2, z2 if PAIR % 2 == 0 else z2o, W, SYM, ASM)


@triton.jit
def _minus_offsets(t, W: tl.constexpr, PAIR: tl.constexpr, ASM: tl.constexpr):
    """A pair of lanes code_offset + code (pair PAIR of a W-bit unit) -> the codes themselves as fp16, exactly (one
    sub.f16x2 with ASM)."""
    if W == 2:  # even pairs 4 + code, odd ones 16 + code
        lo: tl.constexpr = 16.0 if PAIR % 2 else 4.0
        hi: tl.constexpr = lo
        bits: tl.constexpr = "1275087872" if PAIR % 2 else "1140868096"  # 0x4C004C00, 0x44004400
    elif W == 3:  # low lanes 8 + code, high ones 16 + code
        lo: tl.constexpr = 8.0
        hi: tl.constexpr = 16.0
        bits: tl.constexpr = "1275086848"  # 0x4C004800
    else:
        lo: tl.constexpr = 16.0 if W == 4 else 1024.0
        hi: tl.constexpr = lo
        bits: tl.constexpr = "1275087872" if W == 4 else "1677747200"  # 0x4C004C00, 0x64006400
    if ASM:
        return tl.inline_asm_elementwise(
            "{.reg .b32 k; mov.b32 k, " + bits + "; sub.f16x2 $0, $1, k;}", "=r,r", [t], tl.int32, True, 1
        )
    else:
        t_lo, t_hi = _halves(t)
        return _bits((t_lo.to(tl.float32) - lo).to(tl.float16), (t_hi.to(tl.float32) - hi).to(tl.float16))


@triton.jit
def _stack2(a, b):
    return tl.join(a, b)  # (..., 2): [a, b]


@triton.jit
def _stack4(a, b, c, d):
    return tl.join(tl.join(a, c), tl.join(b, d))  # (..., 2, 2): index (m, j) holds item 2m + j


@triton.jit
def _stack8(a, b, c, d, e, f, g, h):
    return tl.join(_stack4(a, c, e, g), _stack4(b, d, f, h))  # (..., 2, 2, 2): item 4m + 2n + j


@triton.jit
def dequant_tile(words, s2, z2, z2o, W: tl.constexpr, SYM: tl.constexpr, ASM: tl.constexpr,
                 LANES: tl.constexpr, CODES: tl.constexpr = 0):  # fmt: skip
    """words int32 (R, NW) of W-bit codes; s2, z2, z2o int32 (R, NW): `group_constants` of each word's group (with
    CODES unused: the tile holds the codes, OFFSET_CODES or EXACT_CODES as `_values`, no scale or zero applied).

    Returns fp16 (R, NW * 32 / W) in the lane order of the module docstring (LANES: an mma operand read from
    registers), or in word order (a tile that goes through shared memory: each word's values contiguous).
    """
    P: tl.constexpr = 16 // W
    if P == 2:
        x = _stack2(
            _values(words, 0, s2, z2, z2o, W, SYM, ASM, CODES),
            _values(words, 1, s2, z2, z2o, W, SYM, ASM, CODES),
        )
    elif P == 4:
        x = _stack4(
            _values(words, 0, s2, z2, z2o, W, SYM, ASM, CODES),
            _values(words, 1, s2, z2, z2o, W, SYM, ASM, CODES),
            _values(words, 2, s2, z2, z2o, W, SYM, ASM, CODES),
            _values(words, 3, s2, z2, z2o, W, SYM, ASM, CODES),
        )
    else:
        x = _stack8(
            _values(words, 0, s2, z2, z2o, W, SYM, ASM, CODES),
            _values(words, 1, s2, z2, z2o, W, SYM, ASM, CODES),
            _values(words, 2, s2, z2, z2o, W, SYM, ASM, CODES),
            _values(words, 3, s2, z2, z2o, W, SYM, ASM, CODES),
            _values(words, 4, s2, z2, z2o, W, SYM, ASM, CODES),
            _values(words, 5, s2, z2, z2o, W, SYM, ASM, CODES),
            _values(words, 6, s2, z2, z2o, W, SYM, ASM, CODES),
            _values(words, 7, s2, z2, z2o, W, SYM, ASM, CODES),
        )
    return _in_order(x, P, LANES)


@triton.jit
def _in_order(x, P: tl.constexpr, LANES: tl.constexpr):
    """x int32 (R, NU, pair dims...): the P pairs of each unit in row-major order -> fp16 (R, NU * 2 P) in the
    lane order of the module docstring (LANES) or in unit order."""
    R: tl.constexpr = x.shape[0]
    NU: tl.constexpr = x.shape[1]
    lo, hi = _halves(x)
    if not LANES:  # (one return: the compiler builds a branch's code after a return, unlike the interpreter)
        out = tl.reshape(tl.join(lo, hi), (R, NU * 2 * P))  # (R, unit, i, h)
    else:
        # (R, c, wt, i_hi, i_lo, h): unit = c * WL + wt (WL = NU / 4), pair i = 2 * i_hi + i_lo, lane h
        y = tl.reshape(tl.join(lo, hi), (R, 4, NU // 4, P // 2, 2, 2))
        y = tl.permute(y, (0, 2, 3, 1, 4, 5))  # (R, wt, i_hi, c, i_lo, h)
        out = tl.reshape(y, (R, NU * 2 * P))
    return out


@triton.jit
def _values3(
    u0, u1, u2, PAIR: tl.constexpr, s2, z2, SYM: tl.constexpr, ASM: tl.constexpr, CODES: tl.constexpr
):
    """Pair PAIR of every 3-bit unit as two fp16 values (int32 bits; CODES as `_values`)."""
    if CODES == EXACT_CODES:
        return _minus_offsets(_pair3(u0, u1, u2, PAIR, ASM), 3, PAIR, ASM)
    if CODES == OFFSET_CODES:
        return _pair3(u0, u1, u2, PAIR, ASM)
    return _affine(_pair3(u0, u1, u2, PAIR, ASM), s2, z2, 3, SYM, ASM)


@triton.jit
def _every_other3(u0, u1, u2, FIRST: tl.constexpr, s2, z2, SYM: tl.constexpr, ASM: tl.constexpr,
                  CODES: tl.constexpr):  # fmt: skip
    """Pairs FIRST, FIRST + 2, .., FIRST + 14 of every 3-bit unit as fp16 values, stacked (R, NU, 2, 2, 2)."""
    return _stack8(
        _values3(u0, u1, u2, FIRST, s2, z2, SYM, ASM, CODES),
        _values3(u0, u1, u2, FIRST + 2, s2, z2, SYM, ASM, CODES),
        _values3(u0, u1, u2, FIRST + 4, s2, z2, SYM, ASM, CODES),
        _values3(u0, u1, u2, FIRST + 6, s2, z2, SYM, ASM, CODES),
        _values3(u0, u1, u2, FIRST + 8, s2, z2, SYM, ASM, CODES),
        _values3(u0, u1, u2, FIRST + 10, s2, z2, SYM, ASM, CODES),
        _values3(u0, u1, u2, FIRST + 12, s2, z2, SYM, ASM, CODES),
        _values3(u0, u1, u2, FIRST + 14, s2, z2, SYM, ASM, CODES),
    )


@triton.jit
def dequant_tile3(u0, u1, u2, s2, z2, SYM: tl.constexpr, ASM: tl.constexpr, LANES: tl.constexpr,
                  CODES: tl.constexpr = 0):  # fmt: skip
    """u0, u1, u2 int32 (R, NU): words 3 j, 3 j + 1, 3 j + 2 of each row's 3-bit unit j (32 codes); s2, z2 int32
    (R, NU) from `group_constants` (W = 3) of each unit's group (with CODES unused: the codes, as `dequant_tile`).

    Returns fp16 (R, 32 * NU) in the lane order of the module docstring (LANES) or in unit order.
    """
    x = tl.join(
        _every_other3(u0, u1, u2, 0, s2, z2, SYM, ASM, CODES),
        _every_other3(u0, u1, u2, 1, s2, z2, SYM, ASM, CODES),
    )  # (R, NU, 2, 2, 2, 2): pair 8 m + 4 n + 2 o + j
    return _in_order(x, 16, LANES)
