"""Grouped plans: codes-only rows whose D codes fall in groups of GROUP = 16 consecutive components, each group at
its own width from 0 to 8, one plan for every head of a width bucket (a constant the decode kernel compiles:
harness/schemes/pca.py's pca_block_ugs and pca_block_ugsa). This module owns that row format and its tiles.

Row format: plan (w_0, .., w_{G-1}), G = D / 16, with 16 sum(w_g) = w D bits for a head of unit width w. A group is
made of planes, its width's binary digits (5 = 4 + 1, 7 = 4 + 2 + 1, 8 = 8: `planes`): plane p holds bits
[s, s + p) of the group's 16 codes, s the width of the planes below it (`plane_shift`), packed as
kernels.reference.pack packs 16 codes of p bits (at 1 bit, code i at bit i of two bytes). The planes lie plane-major
(`plane_starts`): every group's 8-bit plane in group order, then the 4-bit ones, the 2-bit ones and the 1-bit ones,
so that each plane of 2 bits or more starts on a 32-bit word (the kernel loads whole words) whatever the order of
the widths. A plan of 0, 1, 2, 4 and 8 bits whose widths never grow is harness/schemes/bitstream.py's row. A lower
plane (1 or 2 bits under a wider one) holds the bits of component i at `plane_position`, so that its tiles' columns
hold the components its group's widest plane's hold. The kernels take a plan as passes (`plan_code`): pass k holds
every group's k-th plane, each decoded as a group of that width (below), and a tile sums a group's planes, each
scaled by 2 ** its shift (integers below 2048: exact in fp16).

A tile (kernels/decode_attention.py's codes-only kernel) holds group g's codes at columns 16 g .. 16 g + 15, each
group a k16 block of the scores' mma, in the order that the mma's register operand reads: lane c (of the 4 threads
that share a row of it) holds the group's columns 4 c .. 4 c + 3, pairs j and j + 1 (j = 2 (c % L)) of word c // L
of the group, L = 4 / (the group's words; a 1-bit group's half word counts as one), each word loaded once and
broadcast to its L lanes in registers. A pair is two fp16 lanes h = 0, 1 made by one rotation and one lop3
(kernels.unpack's trick): codes (j, j + 2) of a word at 8 bits under exponent 1024, (j, j + 4) at 4 bits and
(j, j + 8) at 2 bits on mantissa bits [6, 10) and [8, 10) under 16 and 4, and at 1 bit (j, j + 8) of the half word on
mantissa bit 9 of the low lane under 2 and bit 1 of the high lane under 512. In a plane of 1, 2 or 4 bits (COUPLED,
but a 7-bit group's 4-bit one: `couples`) the rotation that puts pair j + 1 there puts pair j a field below it, which a second lop3 takes
under an exponent a field's ratio higher (at 4 bits mantissa bits [2, 6) under 256, at 2 bits [6, 8) under 16, at 1
bit bit 8 under 4 and the high lane's bit 0 under 1024): one rotation a lane's two pairs (kernels.unpack's two
fields a lane). Each lane is that offset + its code
(`offsets`: the scores take the offsets out, a group's planes' offsets scaled and summed); `columns` says which
component each tile column holds (its group's widest plane's order). A group of 0 bits is zeros. Value tiles
(group_value_tile, below) hold the codes themselves in an order of their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference
from kernels.unpack import _bits, _halves, _lop3, _stack2, _stack4, _stack8

GROUP = 16
GROUP_WIDTHS = tuple(range(9))  # a group's width: its planes (PLANES) sum to it
PLANES = (8, 4, 2, 1)  # the widths a plane may have: a group's planes are its width's binary digits
FIELD_BITS = (
    12  # a plane's field in a plan code: its width (4 bits), then its first 16-bit half of the row (8)
)
PASS_BITS = 16 * FIELD_BITS  # a pass's fields in a plan code: up to 16 groups'
PASSES = 3  # a group has at most three planes (7 = 4 + 2 + 1)
COUPLED = (4, 2, 1)  # plane widths whose two pairs a lane makes from one rotation (couples: `couples`)
_GROUP = tl.constexpr(GROUP)  # as the kernels read it (a field: 12 bits there, FIELD_BITS)


def planes(w: int) -> list[int]:
    """The planes of a group of w bits, widest first: w's binary digits (5 -> [4, 1], 7 -> [4, 2, 1], 8 -> [8])."""
    return [p for p in PLANES if int(w) & p]


def plane_shift(w: int, p: int) -> int:
    """Where plane p of a w-bit group lies in its codes: the width of the planes below it (5, 4 -> 1)."""
    return int(w) & (p - 1)


def couples(w: int, p: int) -> bool:
    """Whether a lane makes its two pairs of plane p of a w-bit group from one rotation (module docstring): every
    plane of 1, 2 or 4 bits but a 7-bit group's 4-bit one, whose lower pair's offset (256, scaled by 8) would leave
    the sum of its planes past 2048, fp16's last exact integer."""
    return p in COUPLED and not (int(w) == 7 and p == 4)


@triton.constexpr_function
def _fields(plan_code) -> list[tuple[int, int]]:
    """Each group's (width, first 16-bit half) of one pass of a plan code (plan_code's), up to 16 groups; 0-bit
    groups left out."""
    fields = [(int(plan_code) >> (FIELD_BITS * g)) & 4095 for g in range(16)]
    return [(f & 15, f >> 4) for f in fields if f & 15]


@triton.constexpr_function
def _has_width(plan_code, width) -> bool:
    """Whether some group of one pass of the plan is `width` bits wide (a constant of the kernel)."""
    return any(w == int(width) for w, _ in _fields(int(plan_code)))


@triton.constexpr_function
def _has_narrow(plan_code, odd) -> bool:
    """Whether some 1- or 2-bit group of one pass of the plan lies in an odd (odd) or even word of its row."""
    return any(w < 4 and (half // 2) % 2 == int(odd) for w, half in _fields(int(plan_code)))


@triton.constexpr_function
def _couples(plan_code, g, k) -> bool:
    """`couples` for group g's k-th plane of a plan code (False where it has none)."""
    fields = [(int(plan_code) >> (PASS_BITS * j + FIELD_BITS * int(g))) & 15 for j in range(PASSES)]
    p = fields[int(k)]
    return p in COUPLED and not (
        sum(fields) == 7 and p == 4
    )  # (a kernel's constant may call no plain function)


@triton.constexpr_function
def plan_pass(plan_code, k):
    """Pass k's fields of a plan code (plan_code's): group g's k-th plane at bits [FIELD_BITS g, ...)."""
    return (int(plan_code) >> (PASS_BITS * int(k))) & ((1 << PASS_BITS) - 1)


@triton.constexpr_function
def _shift(plan_code, g, k):
    """Where group g's k-th plane lies in its codes (plane_shift), 0 where it has none."""
    fields = [(int(plan_code) >> (PASS_BITS * j + FIELD_BITS * int(g))) & 15 for j in range(PASSES)]
    p = fields[int(k)]
    return sum(fields) & (p - 1) if p else 0  # plane_shift (a kernel's constant may call no plain function)


def check_plan(plan: tuple[int, ...], width: int, head_dim: int) -> None:
    """ValueError naming what is wrong unless `plan` is a grouped plan the kernels read for heads of unit width
    `width` and head_dim `head_dim` (module docstring)."""
    plan = tuple(int(w) for w in plan)
    if head_dim not in (32, 64, 128, 256):
        raise ValueError(f"head_dim: {head_dim} for a grouped plan; allowed: 32, 64, 128, 256")
    if len(plan) != head_dim // GROUP or any(w not in GROUP_WIDTHS for w in plan):
        raise ValueError(
            f"plan: {plan}; allowed: {head_dim // GROUP} group widths (head_dim / {GROUP}), each 0 to 8"
        )
    if GROUP * sum(plan) != width * head_dim:
        raise ValueError(
            f"plan: {plan} holds {GROUP * sum(plan)} bits a row; a {width}-bit head holds {width * head_dim}"
        )


def plane_starts(plan: tuple[int, ...]) -> dict[tuple[int, int], int]:
    """(group, plane width) -> the plane's first 16-bit half of the row: the 8-bit planes in group order, then the
    4-bit ones, the 2-bit and the 1-bit ones (a plane of p bits holds 16 p bits, so every plane of 2 bits or more
    starts on a 32-bit word)."""
    starts, half = {}, 0
    for p in PLANES:
        for g, w in enumerate(plan):
            if int(w) & p:
                starts[g, p] = half
                half += p
    return starts


def plan_code(plan: tuple[int, ...]) -> int:
    """The plan as the kernel's compile-time constant: pass k (bits [PASS_BITS k, PASS_BITS (k + 1))) holds group
    g's k-th plane (planes(w_g)[k]) at bits [FIELD_BITS g, FIELD_BITS (g + 1)) of it: the plane's width in the low
    4, its first 16-bit half of the row above (0 where the group has no k-th plane). A plan of one plane a group
    is one pass. 0 is no plan (no head has every group at 0 bits)."""
    code, starts = 0, plane_starts(plan)
    for g, w in enumerate(plan):
        for k, p in enumerate(planes(w)):
            code |= (p | starts[g, p] << 4) << (PASS_BITS * k + FIELD_BITS * g)
    return code


def plane_position(i: int, top: int) -> int:
    """Where a lower plane (1 or 2 bits) of a group whose widest plane is `top` bits holds the bits of the group's
    component i: where its tiles read the component that the top plane's tiles read at the same column (at top 4,
    bits 2 and 3 of i swapped; else i)."""
    return (i & 3) | ((i >> 2) & 1) << 3 | ((i >> 3) & 1) << 2 if top == 4 else i


def _plane_rows(codes: torch.Tensor, p: int) -> torch.Tensor:
    """16 codes of p bits (..., 16) -> their plane's uint8 bytes (..., 2 p) (at 1 bit, code i at bit i of 2 bytes)."""
    if p == 1:
        bits = codes.to(torch.int32).reshape(*codes.shape[:-1], 2, 8) << torch.arange(8, device=codes.device)
        return bits.sum(-1).to(torch.uint8)
    return reference.pack(codes, p)


def _plane_codes(field: torch.Tensor, p: int) -> torch.Tensor:
    """Inverse of _plane_rows: uint8 (..., 2 p) -> codes (..., 16) as int64."""
    if p == 1:
        bits = (field[..., :, None].to(torch.int32) >> torch.arange(8, device=field.device)) & 1
        return bits.reshape(*field.shape[:-1], GROUP).long()
    return reference.unpack(field, p, GROUP).long()


def _lower_order(top: int) -> list[int]:
    """plane_position(i, top) for i < 16, as an index: a lower plane's positions hold components [order]."""
    order = [0] * GROUP
    for i in range(GROUP):
        order[plane_position(i, top)] = i
    return order


def pack(codes: torch.Tensor, plan: tuple[int, ...]) -> torch.Tensor:
    """codes (..., D) (integers, group g's in [0, 2**w_g)) -> uint8 (..., 2 sum(plan)): the rows of the module
    docstring."""
    parts, codes = {}, codes.long()
    for g, w in enumerate(plan):
        group = codes[..., GROUP * g : GROUP * (g + 1)]
        for k, p in enumerate(planes(w)):
            bits = (group >> plane_shift(w, p)) & ((1 << p) - 1)
            if k:
                bits = bits[..., _lower_order(planes(w)[0])]
            parts[g, p] = _plane_rows(bits, p)
    starts = plane_starts(plan)
    return torch.cat([parts[key] for key in sorted(parts, key=starts.get)], -1)


def unpack(payload: torch.Tensor, plan: tuple[int, ...]) -> torch.Tensor:
    """Inverse of pack: uint8 (..., 2 sum(plan)) -> uint8 codes (..., 16 len(plan))."""
    parts, starts = [], plane_starts(plan)
    for g, w in enumerate(plan):
        group = torch.zeros(*payload.shape[:-1], GROUP, dtype=torch.long, device=payload.device)
        for k, p in enumerate(planes(w)):
            byte = 2 * starts[g, p]
            bits = _plane_codes(payload[..., byte : byte + 2 * p], p)
            if k:
                bits = bits[..., [plane_position(i, planes(w)[0]) for i in range(GROUP)]]
            group |= bits << plane_shift(w, p)
        parts.append(group)
    return torch.cat(parts, -1).to(torch.uint8)


def _lanes_a_word(w: int) -> int:
    """L: the lanes that share one word of a group at width w."""
    return {8: 1, 4: 2}.get(w, 4)


def _code_in_group(column: int, w: int) -> int:
    """The code of its group (< 16) that a group's column (< 16) holds at width w (module docstring)."""
    c, i_lo, h = column // 4, (column // 2) % 2, column % 2
    lanes = _lanes_a_word(w)
    j, word = 2 * (c % lanes) + i_lo, c // lanes
    return {8: 4 * word + j + 2 * h, 4: 8 * word + j + 4 * h, 2: j + 8 * h, 1: j + 8 * h}.get(w, column)


def _offset_in_group(column: int, w: int, couple: bool = False) -> float:
    """What a group's column adds to its code at width w: the exponent under which the code lies (with `couple`,
    a plane that `couples`: the lower pair of a lane's couple lies a field lower, under an exponent a field's ratio
    higher)."""
    if couple and w in COUPLED and (column // 2) % 2 == 0:
        return {4: 256.0, 2: 16.0, 1: 1024.0 if column % 2 else 4.0}[w]
    return {8: 1024.0, 4: 16.0, 2: 4.0, 1: 512.0 if column % 2 else 2.0}.get(w, 0.0)


def columns(plan: tuple[int, ...]) -> list[int]:
    """The component each column of a tile holds (column 16 g + k: group g's column k, its widest plane's)."""
    tops = [(planes(w) or [0])[0] for w in plan]
    return [
        GROUP * (d // GROUP) + _code_in_group(d % GROUP, tops[d // GROUP]) for d in range(GROUP * len(plan))
    ]


def offsets(plan: tuple[int, ...]) -> list[float]:
    """What each column's lane adds to its code (module docstring): its planes' offsets, each scaled as its plane."""
    return [
        sum(
            _offset_in_group(d % GROUP, p, couples(plan[d // GROUP], p))
            * 2 ** plane_shift(plan[d // GROUP], p)
            for p in planes(plan[d // GROUP])
        )
        for d in range(GROUP * len(plan))
    ]


@triton.jit
def _rotl(x, n, ASM: tl.constexpr):
    """int32 x rotated left by n bits (an int32 tensor of x's shape, each in [0, 32): one shf.l.wrap with ASM)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "shf.l.wrap.b32 $0, $1, $1, $2;", "=r,r,r", [x, n], tl.int32, True, 1
        )
    else:
        u = x.to(tl.uint32, bitcast=True)
        k = n.to(tl.uint32)
        return ((u << k) | (u >> ((32 - k) & 31))).to(tl.int32, bitcast=True)


@triton.jit
def _field(t, W: tl.constexpr, LOWER: tl.constexpr, ASM: tl.constexpr):
    """A pair from a word t rotated so that its codes lie on the field of a W-bit pair (_pairs'), or with LOWER
    (W in COUPLED) on the field one code below it: (t & mask) | exponent, one lop3. The lower field's exponent is a
    field's ratio higher, so that its lanes too are offset + code (4 bits: 256, 2 bits: 16, 1 bit: 4 and 1024)."""
    if W == 8:
        mask: tl.constexpr = "16711935"  # 0x00FF00FF
        bits: tl.constexpr = "1677747200"  # 0x64006400 (1024, 1024)
    elif W == 4:
        mask: tl.constexpr = "3932220" if LOWER else "62915520"  # 0x003C003C, 0x03C003C0
        bits: tl.constexpr = "1543527424" if LOWER else "1275087872"  # 0x5C005C00 (256), 0x4C004C00 (16)
    elif W == 2:
        mask: tl.constexpr = "12583104" if LOWER else "50332416"  # 0x00C000C0, 0x03000300
        bits: tl.constexpr = "1275087872" if LOWER else "1140868096"  # 0x4C004C00 (16), 0x44004400 (4)
    else:
        mask: tl.constexpr = "65792" if LOWER else "131584"  # 0x00010100, 0x00020200
        # 0x64004400 (4, 1024), 0x60004000 (2, 512)
        bits: tl.constexpr = "1677739008" if LOWER else "1610629120"
    if ASM:
        t = _lop3(t, mask, bits)
    else:
        t = (t & int(mask)) | int(bits)
    return t


@triton.jit
def _rotation(j, W: tl.constexpr, HIGH: tl.constexpr):
    """The left rotation (an int32 tensor of j's shape) that puts pair j of a W-bit group's word on its field."""
    if W == 8:
        amount = (32 - 8 * j) & 31
    elif W == 4:
        amount = (6 - 4 * j) & 31
    elif W == 2:
        amount = (8 - 2 * j) & 31
    else:
        amount = (9 - j - 16 * HIGH) & 31
    return amount


@triton.jit
def _pairs(words, j, W: tl.constexpr, HIGH: tl.constexpr, ASM: tl.constexpr):
    """Pair j (an int32 tensor (4,) by lane) of each lane's word (R, 4) of a W-bit group: int32 of two fp16 lanes,
    code_offset + code. HIGH: a 1-bit group in the word's high half."""
    t = _rotl(words, tl.broadcast_to(_rotation(j, W, HIGH)[None, :], words.shape), ASM)
    return _field(t, W, False, ASM)


@triton.jit
def _couple(words, j, W: tl.constexpr, HIGH: tl.constexpr, ASM: tl.constexpr):
    """Pairs j and j + 1 of each lane's word (R, 4) of a W-bit group (W in COUPLED) from one rotation: the one that
    puts pair j + 1 on its field puts pair j on the field below it (_field's LOWER)."""
    t = _rotl(words, tl.broadcast_to(_rotation(j + 1, W, HIGH)[None, :], words.shape), ASM)
    return _field(t, W, True, ASM), _field(t, W, False, ASM)


@triton.jit
def _sub_f16x2(t, base):
    """sub.f16x2 without assembly: int32 tensors of two fp16 lanes, t's lanes less base's (exact for the codes)."""
    lo, hi = _halves(t)
    base_lo, base_hi = _halves(base)
    return _bits(
        (lo.to(tl.float32) - base_lo.to(tl.float32)).to(tl.float16),
        (hi.to(tl.float32) - base_hi.to(tl.float32)).to(tl.float16),
    )


@triton.jit
def _load_words(
    p_ptr, rows, mask_n, NW: tl.constexpr, FIRST: tl.constexpr, N: tl.constexpr, MASKED: tl.constexpr
):
    """Words FIRST .. FIRST + N of each row, (R, N) int32: p_ptr the head's words, rows of NW; rows (R,) int32 token
    indices, mask_n (R,) which are stored (read only when MASKED)."""
    w_ptr = p_ptr + rows[:, None] * NW + (FIRST + tl.arange(0, N))[None, :]
    if MASKED:
        loaded = tl.load(w_ptr, mask=mask_n[:, None], other=0)
    else:
        loaded = tl.load(w_ptr)
    return loaded


@triton.jit
def _group_codes(loaded, FIELD: tl.constexpr, COUPLE: tl.constexpr, ASM: tl.constexpr):
    """One group's codes as fp16 (R, 4, 2, 2) from its words `loaded` (R, NWG): [.., c, i_lo, h] is the group's
    column 4 c + 2 i_lo + h (module docstring); FIELD the group's plan field (not 0 bits)."""
    R: tl.constexpr = loaded.shape[0]
    W: tl.constexpr = FIELD & 15
    LANES: tl.constexpr = 1 if W == 8 else 2 if W == 4 else 4  # lanes a word
    NWG: tl.constexpr = 4 // LANES  # the group's words
    c = tl.arange(0, 4)
    # (R, 4): each lane's word, lane c reading word c // LANES (loaded once, broadcast in registers)
    words = tl.reshape(tl.broadcast_to(loaded[:, :, None], (R, NWG, LANES)), (R, 4))
    j = 2 * (c % LANES)
    if COUPLE and W != 8:
        x = tl.join(*_couple(words, j, W, (FIELD >> 4) % 2, ASM))
    else:
        x = tl.join(
            _pairs(words, j, W, (FIELD >> 4) % 2, ASM), _pairs(words, j + 1, W, (FIELD >> 4) % 2, ASM)
        )
    lo, hi = _halves(x)
    return tl.join(lo, hi)


@triton.jit
def _group(p_ptr, rows, mask_n, NW: tl.constexpr, FIELD: tl.constexpr, COUPLE: tl.constexpr, ASM: tl.constexpr,
           MASKED: tl.constexpr):  # fmt: skip
    """One group's codes as fp16 (R, 4, 2, 2) (_group_codes'), its words loaded on their own; FIELD its plan field."""
    R: tl.constexpr = rows.shape[0]
    if FIELD & 15 == 0:
        out = tl.zeros((R, 4, 2, 2), tl.float16)
    else:
        NWG: tl.constexpr = 4 // (1 if FIELD & 15 == 8 else 2 if FIELD & 15 == 4 else 4)
        words = _load_words(p_ptr, rows, mask_n, NW, (FIELD >> 4) // 2, NWG, MASKED)
        out = _group_codes(words, FIELD, COUPLE, ASM)
    return out


@triton.jit
def _lower(x, p_ptr, rows, mask_n, NW: tl.constexpr, PLAN: tl.constexpr, G_: tl.constexpr, ASM: tl.constexpr,
           MASKED: tl.constexpr):  # fmt: skip
    """Group G_'s codes (R, 4, 2, 2) fp16 from x, its widest plane's (_group's), with its lower planes added: each
    plane's lanes (offset + plane code) scaled by 2 ** its shift and summed (integers below 2048: exact), so that a
    lane holds the group's code plus the sum of its planes' scaled offsets (`offsets`). One plane: x itself."""
    F1: tl.constexpr = (plan_pass(PLAN, 1) >> (12 * G_)) & 4095
    F2: tl.constexpr = (plan_pass(PLAN, 2) >> (12 * G_)) & 4095
    if F1 & 15:
        x = x * (1 << _shift(PLAN, G_, 0)) + _group(
            p_ptr, rows, mask_n, NW, F1, _couples(PLAN, G_, 1), ASM, MASKED
        ) * (1 << _shift(PLAN, G_, 1))
    if F2 & 15:
        x = x + _group(p_ptr, rows, mask_n, NW, F2, _couples(PLAN, G_, 2), ASM, MASKED)
    return x


@triton.jit
def _group_pair(p_ptr, rows, mask_n, NW: tl.constexpr, PLAN: tl.constexpr, GA: tl.constexpr, ASM: tl.constexpr,
                MASKED: tl.constexpr):  # fmt: skip
    """Groups GA and GA + 1's codes, each as _group's with its lower planes added (_lower): two widest planes of
    one width of 2 bits or more, the second right after the first, load their words in one run and split it; two
    1-bit planes of one word load it once; others load their own."""
    FA: tl.constexpr = (PLAN >> (12 * GA)) & 4095
    FB: tl.constexpr = (PLAN >> (12 * GA + 12)) & 4095
    CA: tl.constexpr = _couples(PLAN, GA, 0)  # the widest planes' pairs in couples
    CB: tl.constexpr = _couples(PLAN, GA + 1, 0)
    if ((FA & 15) == (FB & 15)) & ((FA & 15) >= 2) & ((FB >> 4) == (FA >> 4) + (FA & 15)):
        NWG: tl.constexpr = (FA & 15) // 2  # each group's words
        run = _load_words(p_ptr, rows, mask_n, NW, (FA >> 4) // 2, 2 * NWG, MASKED)  # (R, 2 NWG)
        first, second = tl.split(tl.permute(tl.reshape(run, (run.shape[0], 2, NWG)), (0, 2, 1)))
        a = _group_codes(first, FA, CA, ASM)
        b = _group_codes(second, FB, CB, ASM)
    elif ((FA & 15) == 1) & ((FB & 15) == 1) & ((FA >> 5) == (FB >> 5)):  # one word: halves FA >> 4, FB >> 4
        word = _load_words(p_ptr, rows, mask_n, NW, FA >> 5, 1, MASKED)
        a = _group_codes(word, FA, CA, ASM)
        b = _group_codes(word, FB, CB, ASM)
    else:
        a = _group(p_ptr, rows, mask_n, NW, FA, CA, ASM, MASKED)
        b = _group(p_ptr, rows, mask_n, NW, FB, CB, ASM, MASKED)
    return (_lower(a, p_ptr, rows, mask_n, NW, PLAN, GA, ASM, MASKED),
            _lower(b, p_ptr, rows, mask_n, NW, PLAN, GA + 1, ASM, MASKED))  # fmt: skip


@triton.jit
def group_tile(p_ptr, rows, mask_n, PLAN: tl.constexpr, D: tl.constexpr, NW: tl.constexpr, ASM: tl.constexpr,
               MASKED: tl.constexpr):  # fmt: skip
    """A head's tile of grouped codes as fp16 (R, D), group g's column k at column 16 g + k: p_ptr the head's payload
    as int32 words, rows of NW; rows (R,) token indices, mask_n (R,) which are stored (read only when MASKED);
    PLAN: plan_code's. Each column holds its code plus `offsets`' offset (the scores take the offsets out)."""
    R: tl.constexpr = rows.shape[0]
    G: tl.constexpr = D // _GROUP
    tl.static_assert(G == 2 or G == 4 or G == 8 or G == 16)
    if G == 2:
        g0, g1 = _group_pair(p_ptr, rows, mask_n, NW, PLAN, 0, ASM, MASKED)
        x = tl.permute(_stack2(g0, g1), (0, 4, 1, 2, 3))
    elif G == 4:
        g0, g1 = _group_pair(p_ptr, rows, mask_n, NW, PLAN, 0, ASM, MASKED)
        g2, g3 = _group_pair(p_ptr, rows, mask_n, NW, PLAN, 2, ASM, MASKED)
        x = _stack4(g0, g1, g2, g3)  # (R, 4, 2, 2, m, j): group 2 m + j
        x = tl.permute(x, (0, 4, 5, 1, 2, 3))
    elif G == 8:
        x = _eight(p_ptr, rows, mask_n, NW, PLAN, ASM, MASKED, False)
        x = tl.permute(x, (0, 4, 5, 6, 1, 2, 3))
    else:  # groups 2 i + t at [.., i, t]
        x = _eight(p_ptr, rows, mask_n, NW, PLAN, ASM, MASKED, True)
        x = tl.permute(x, (0, 4, 5, 6, 7, 1, 2, 3))
    return tl.reshape(x, (R, D))


@triton.jit
def _eight(p_ptr, rows, mask_n, NW: tl.constexpr, PLAN: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr,
           SIXTEEN: tl.constexpr):  # fmt: skip
    """Eight groups stacked (R, 4, 2, 2, 2, 2, 2), group i at [.., m, n, j] (i = 4 m + 2 n + j); with SIXTEEN all 16
    of a plan, (R, 4, 2, 2, 2, 2, 2, 2): the even groups' stack joined with the odd ones' (group 2 i + t at [.., i, t]).
    Neighbouring groups load as pairs (_group_pair)."""
    g0, g1 = _group_pair(p_ptr, rows, mask_n, NW, PLAN, 0, ASM, MASKED)
    g2, g3 = _group_pair(p_ptr, rows, mask_n, NW, PLAN, 2, ASM, MASKED)
    g4, g5 = _group_pair(p_ptr, rows, mask_n, NW, PLAN, 4, ASM, MASKED)
    g6, g7 = _group_pair(p_ptr, rows, mask_n, NW, PLAN, 6, ASM, MASKED)
    if SIXTEEN:
        g8, g9 = _group_pair(p_ptr, rows, mask_n, NW, PLAN, 8, ASM, MASKED)
        ga, gb = _group_pair(p_ptr, rows, mask_n, NW, PLAN, 10, ASM, MASKED)
        gc, gd = _group_pair(p_ptr, rows, mask_n, NW, PLAN, 12, ASM, MASKED)
        ge, gf = _group_pair(p_ptr, rows, mask_n, NW, PLAN, 14, ASM, MASKED)
        x = tl.join(_stack8(g0, g2, g4, g6, g8, ga, gc, ge), _stack8(g1, g3, g5, g7, g9, gb, gd, gf))
    else:
        x = _stack8(g0, g1, g2, g3, g4, g5, g6, g7)
    return x


@triton.jit
def _code_in_group_jit(k, W: tl.constexpr):
    """_code_in_group at a group's columns k (an int32 tensor), in the kernel."""
    c, i_lo, h = k // 4, (k // 2) % 2, k % 2
    if W == 8:
        out = 4 * c + i_lo + 2 * h
    elif W == 4:
        out = 8 * (c // 2) + 2 * (c % 2) + i_lo + 4 * h
    elif W == 0:
        out = k
    else:
        out = 2 * c + i_lo + 8 * h
    return out


@triton.jit
def _offset_in_group_jit(k, W: tl.constexpr, COUPLE: tl.constexpr):
    """_offset_in_group at a group's columns k, as float32, in the kernel."""
    if W == 1:
        out = tl.where(k % 2 == 1, 512.0, 2.0)
    else:
        out = tl.full(k.shape, 1024.0 if W == 8 else 16.0 if W == 4 else 4.0 if W == 2 else 0.0, tl.float32)
    if COUPLE and (W == 4 or W == 2 or W == 1):  # COUPLED: the lower pair of a lane's couple
        lower = 256.0 if W == 4 else 16.0 if W == 2 else tl.where(k % 2 == 1, 1024.0, 4.0)
        out = tl.where((k // 2) % 2 == 0, lower, out)
    return out


@triton.jit
def _group_offset_jit(k, PLAN: tl.constexpr, G_: tl.constexpr):
    """`offsets` at group G_'s columns k, as float32, in the kernel: its planes' offsets, each scaled as its plane."""
    W0: tl.constexpr = (plan_pass(PLAN, 0) >> (12 * G_)) & 15
    W1: tl.constexpr = (plan_pass(PLAN, 1) >> (12 * G_)) & 15
    W2: tl.constexpr = (plan_pass(PLAN, 2) >> (12 * G_)) & 15
    out = _offset_in_group_jit(k, W0, _couples(PLAN, G_, 0)) * (1 << _shift(PLAN, G_, 0))
    out += _offset_in_group_jit(k, W1, _couples(PLAN, G_, 1)) * (1 << _shift(PLAN, G_, 1))
    return out + _offset_in_group_jit(k, W2, _couples(PLAN, G_, 2))


@triton.jit
def group_columns_jit(PLAN: tl.constexpr, D: tl.constexpr):
    """(`columns` as a (D,) int32 tensor, `offsets` as a (D,) float32 tensor), in the kernel."""
    d = tl.arange(0, D)
    g, k = d // _GROUP, d % _GROUP
    cols = tl.zeros((D,), tl.int32)
    offs = tl.zeros((D,), tl.float32)
    for i in tl.static_range(D // _GROUP):  # (a constexpr is not reassigned in a compiled loop: inline)
        cols = tl.where(g == i, _GROUP * i + _code_in_group_jit(k, (PLAN >> (12 * i)) & 15), cols)
        offs = tl.where(g == i, _group_offset_jit(k, PLAN, i), offs)
    return cols, offs


@triton.jit
def _by_component(x, D: tl.constexpr):
    """A (G,) tensor over groups as (D,): each component takes its group's."""
    return tl.reshape(tl.broadcast_to(x[:, None], (D // _GROUP, _GROUP)), (D,))


@triton.jit
def _plane_shifts(PLAN: tl.constexpr, G: tl.constexpr, K: tl.constexpr):
    """Each group's K-th plane's width and shift in the codes (plane_shift; 0 where it has none), (G,) int32 each."""
    w0, _, _ = _group_fields(plan_pass(PLAN, 0), G)
    w1, _, _ = _group_fields(plan_pass(PLAN, 1), G)
    w2, _, _ = _group_fields(plan_pass(PLAN, 2), G)
    if K == 0:
        width = w0
    elif K == 1:
        width = w1
    else:
        width = w2
    return width, (w0 + w1 + w2) & tl.maximum(width - 1, 0)


@triton.jit
def group_widths_jit(PLAN: tl.constexpr, D: tl.constexpr):
    """Each component's width (its group's, all planes), (D,) int32, in the kernel."""
    w0, _, _ = _group_fields(plan_pass(PLAN, 0), D // _GROUP)
    w1, _, _ = _group_fields(plan_pass(PLAN, 1), D // _GROUP)
    w2, _, _ = _group_fields(plan_pass(PLAN, 2), D // _GROUP)
    return _by_component(w0 + w1 + w2, D)


@triton.jit
def plane_bits_jit(PLAN: tl.constexpr, D: tl.constexpr, K: tl.constexpr):
    """Each component's K-th plane (module docstring): the plane's width (0: none), the first bit of the
    component's bits in the row (plane_position's place in its plane) and where they lie in its code (the plane's
    shift), (D,) int32 each, in the kernel."""
    G: tl.constexpr = D // _GROUP
    top, _, _ = _group_fields(plan_pass(PLAN, 0), G)
    width, shift = _plane_shifts(PLAN, G, K)
    _, half, _ = _group_fields(plan_pass(PLAN, K), G)
    i = tl.arange(0, D) % _GROUP
    if K > 0:  # plane_position: at top 4, bits 2 and 3 swapped
        i = tl.where(_by_component(top, D) == 4, (i & 3) | ((i >> 2) & 1) << 3 | ((i >> 3) & 1) << 2, i)
    width = _by_component(width, D)
    return width, _by_component(half, D) * _GROUP + width * i, _by_component(shift, D)


# Value tiles. The values' tile goes through shared memory to the output mma (its tokens are the mma's reduction),
# so its order is free and its layout is what counts: a tile built a group at a time holds each token's whole row in
# one thread, whose transpose reaches shared memory in 2-byte stores. group_value_tile instead makes every group of
# the row one element of (R, G) tensors (a thread holds one group of several tokens, its 16 values contiguous),
# each group's constants (rotation, mask, exponent) tensors over G, its words loaded two at a time from an even word
# (eight-byte copies; one word a group when the plan has no group of 4 or 8 bits). Column 16 g + 2 j + h holds lane
# h of pair j of group g, which at 8 bits is pair j % 2 of the group's word j // 2, at 4 bits pair
# j % 2 + 2 (j // 4) of word (j // 2) % 2 (so that every width's pairs 0, 1 and 4, 5 read a window's first word, 2, 3
# and 6, 7 its second), at 2 and 1 bits pair j of its word or half word (the module docstring's pairs).


def _value_code(column: int, w: int) -> int:
    """The code of its group that a group's value column (< 16) holds at width w (group_value_tile's order)."""
    j, h = column // 2, column % 2
    four = 8 * ((j // 2) % 2) + j % 2 + 2 * (j // 4) + 4 * h  # pair j % 2 + 2 (j // 4) of word (j // 2) % 2
    return {8: 4 * (j // 2) + j % 2 + 2 * h, 4: four, 0: column}.get(w, j + 8 * h)


def value_columns(plan: tuple[int, ...]) -> list[int]:
    """The component each column of a value tile (group_value_tile) holds."""
    tops = [(planes(w) or [0])[0] for w in plan]
    return [GROUP * (d // GROUP) + _value_code(d % GROUP, tops[d // GROUP]) for d in range(GROUP * len(plan))]


@triton.jit
def _value_code_jit(k, w):
    """_value_code at a group's columns k for the groups' widths w (int32 tensors of one shape), in the kernel."""
    j, h = k // 2, k % 2
    out = tl.where(w == 8, 4 * (j // 2) + j % 2 + 2 * h, j + 8 * h)
    out = tl.where(w == 4, 8 * ((j // 2) % 2) + j % 2 + 2 * (j // 4) + 4 * h, out)
    return tl.where(w == 0, k, out)


@triton.jit
def _group_fields(PLAN: tl.constexpr, G: tl.constexpr):
    """Each group's width, first 16-bit half of the row and first even word (0 at 0 bits), (G,) int32 each (the
    last built from constants alone, so that the compiler sees it even)."""
    g = tl.arange(0, G)
    width = tl.zeros((G,), tl.int32)
    half = tl.zeros((G,), tl.int32)
    start = tl.zeros((G,), tl.int32)
    for i in tl.static_range(G):  # (a constexpr is not reassigned in a compiled loop: inline)
        width = tl.where(g == i, (PLAN >> (12 * i)) & 15, width)
        half = tl.where(g == i, ((PLAN >> (12 * i)) & 4095) >> 4, half)
        # the first half's word rounded down to even (the field >> 6 << 1), 0 where the group has no bits
        start = tl.where(
            g == i, (((PLAN >> (12 * i)) & 4095) >> 6 << 1) * (((PLAN >> (12 * i)) & 15) > 0), start
        )
    return width, half, start


@triton.jit
def group_value_columns_jit(PLAN: tl.constexpr, D: tl.constexpr):
    """`value_columns` as a (D,) int32 tensor, in the kernel."""
    width, _, _ = _group_fields(PLAN, D // _GROUP)
    d = tl.arange(0, D)
    w = tl.reshape(tl.broadcast_to(width[:, None], (D // _GROUP, _GROUP)), (D,))
    return (d // _GROUP) * _GROUP + _value_code_jit(d % _GROUP, w)


@triton.jit
def _value_place(J: tl.constexpr, width, remap, LOWER: tl.constexpr):
    """Pair J's place in its word for every group (value order), (G,) int32; with LOWER, a group where `remap` (G,)
    holds reads pair place f(J) (_value_pass) at 1 and 2 bits."""
    i = tl.where(width == 8, J % 2, tl.where(width == 4, J % 2 + 2 * (J // 4), J))
    if LOWER:
        i = tl.where(remap, (J & 1) | ((J >> 2) & 1) << 1 | ((J >> 1) & 1) << 2, i)
    return i


@triton.jit
def _value_rotation(i, width, high):
    """The left rotation that puts pair place i of every group's word on its field (_rotation's), (G,) int32."""
    amount = tl.where(width == 8, 32 - 8 * i, tl.where(width == 4, 6 - 4 * i, 8 - 2 * i))
    return tl.where(width == 1, 9 - i - 16 * high, amount) & 31


@triton.jit
def _value_codes(t, mask, bits, ASM: tl.constexpr):
    """The codes of pairs in words t (R, G) rotated onto their fields: (t & mask) | bits, less bits (mask, bits
    (G,) by group), one lop3 and one sub.f16x2."""
    m = tl.broadcast_to(mask[None, :], t.shape)
    b = tl.broadcast_to(bits[None, :], t.shape)
    if ASM:
        t = tl.inline_asm_elementwise(
            "{.reg .b32 t; lop3.b32 t, $1, $2, $3, 234; sub.f16x2 $0, t, $3;}", "=r,r,r,r", [t, m, b], tl.int32,
            True, 1,
        )  # fmt: skip
    else:
        t = _sub_f16x2((t & m) | b, b)
    return t


@triton.jit
def _value_couple(words, J: tl.constexpr, width, high, fields, remap, LOWER: tl.constexpr,
                  EIGHT: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """Pairs J and J + 1 (J even) of every group (value order) from its word `words` (R, G): int32 of two fp16
    lanes each, the codes. Places J and J + 1 are neighbours in a word of 1, 2 or 4 bits (COUPLED), so that one
    rotation serves both (pair J on the field below pair J + 1's: _field's LOWER); with EIGHT (8-bit groups in the
    pass) an 8-bit group's pair J takes a rotation of its own. fields: (mask, bits, lower mask, lower bits) (G,)."""
    mask, bits, lower_mask, lower_bits = fields
    i = _value_place(J + 1, width, remap, LOWER)
    t = _rotl(words, tl.broadcast_to(_value_rotation(i, width, high)[None, :], words.shape), ASM)
    if EIGHT:
        ie = _value_place(J, width, remap, LOWER)
        amount = tl.where(width == 8, _value_rotation(ie, width, high), _value_rotation(i, width, high))
        t_low = _rotl(words, tl.broadcast_to(amount[None, :], words.shape), ASM)
    else:
        t_low = t
    return _value_codes(t_low, lower_mask, lower_bits, ASM), _value_codes(t, mask, bits, ASM)


@triton.jit
def _value_words(p_ptr, rows, mask_n, first, NW: tl.constexpr, N: tl.constexpr, MASKED: tl.constexpr):
    """Words first, first + N - 1 of each group (first (G,); N = 1, or 2 from an even word) of each row, two
    (R, G) int32 (N = 1: the word twice): loaded as (G, R, N), N words a group and row in one load (its layout then
    spreads the groups over a warp's lanes: a thread holds a group of several rows, not a row)."""
    G: tl.constexpr = first.shape[0]
    R: tl.constexpr = rows.shape[0]
    offsets = rows[None, :, None] * NW + first[:, None, None] + tl.arange(0, N)[None, None, :]  # (G, R, N)
    if MASKED:
        words = tl.load(p_ptr + offsets, mask=mask_n[None, :, None], other=0)
    else:
        words = tl.load(p_ptr + offsets)
    if N == 1:
        lo = tl.trans(tl.reshape(words, (G, R)))
        hi = lo
    else:
        lo, hi = tl.split(words)
        lo, hi = tl.trans(lo), tl.trans(hi)
    return lo, hi


@triton.jit
def _pair_words(p_ptr, rows, mask_n, PLAN: tl.constexpr, width, half, start, NW: tl.constexpr,
                MASKED: tl.constexpr):  # fmt: skip
    """The words that pairs (0, 1), (2, 3), (4, 5) and (6, 7) of every group read (group_value_tile's order), (R, G)
    int32 each; width, half, start: _group_fields'.

    A plan with 4- or 8-bit groups loads every group's first two-word window (a0, a1), one with 8-bit groups an 8-bit
    group's second (b0, b1) and the others' first again: pairs 0, 1 read a0 (a narrow group at an odd word a1),
    pairs 2, 3 a1 (a narrow group its word), pairs 4, 5 b0 and 6, 7 b1 (likewise), or without 8-bit groups pairs
    0, 1's and 2, 3's words; selects only where the plan has narrow groups. A plan of 4- and 1-bit groups without
    8-bit ones loads each group's first word and a 4-bit group's second one at a time (in two-word windows the
    selects spilled under the register cap: smollm2's 2-bit plan 4,4,2,2,1,1,1,1, Triton 3.6 and 3.9); a plan of
    narrow groups alone loads each group's word."""
    first = tl.where(width == 0, 0, half // 2)  # each group's first word
    if _has_width(PLAN, 4) and _has_width(PLAN, 1) and not _has_width(PLAN, 8):
        w01, _ = _value_words(p_ptr, rows, mask_n, first, NW, 1, MASKED)
        w23, _ = _value_words(p_ptr, rows, mask_n, first + (width == 4).to(tl.int32), NW, 1, MASKED)
        w45, w67 = w01, w23
    elif _has_width(PLAN, 8) or _has_width(PLAN, 4):
        a0, a1 = _value_words(p_ptr, rows, mask_n, start, NW, 2, MASKED)
        narrow = (width > 0) & (width < 4)
        odd = (narrow & (half // 2 % 2 == 1))[None, :]
        even = (narrow & (half // 2 % 2 == 0))[None, :]
        w01 = tl.where(odd, a1, a0) if _has_narrow(PLAN, 1) else a0
        w23 = tl.where(even, a0, a1) if _has_narrow(PLAN, 0) else a1
        if _has_width(PLAN, 8):
            b0, b1 = _value_words(p_ptr, rows, mask_n, tl.where(width == 8, start + 2, start), NW, 2, MASKED)
            w45 = tl.where(odd, b1, b0) if _has_narrow(PLAN, 1) else b0
            w67 = tl.where(even, b0, b1) if _has_narrow(PLAN, 0) else b1
        else:
            w45, w67 = w01, w23
    else:
        w01, _ = _value_words(p_ptr, rows, mask_n, first, NW, 1, MASKED)
        w23, w45, w67 = w01, w01, w01
    return w01, w23, w45, w67


@triton.jit
def _value_pass(p_ptr, rows, mask_n, PLAN: tl.constexpr, K: tl.constexpr, D: tl.constexpr, NW: tl.constexpr,
                ASM: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Every group's K-th plane as fp16 (R, D), its codes themselves (0 where a group has none), in value_columns'
    order: a lower plane (K > 0) of a group whose widest plane has 4 bits reads pair place f(j) for its pair j
    (j's bits 1 and 2 swapped), where plane_position put the bits of the component the widest plane's column holds."""
    R: tl.constexpr = rows.shape[0]
    G: tl.constexpr = D // _GROUP
    PK: tl.constexpr = plan_pass(PLAN, K)
    width, half, start = _group_fields(PK, G)
    mask = tl.where(width == 8, 0x00FF00FF, tl.where(width == 4, 0x03C003C0, 0x03000300))
    mask = tl.where(width == 1, 0x00020200, tl.where(width == 0, 0, mask))
    bits = tl.where(width == 8, 0x64006400, tl.where(width == 4, 0x4C004C00, 0x44004400))
    bits = tl.where(width == 1, 0x60004000, tl.where(width == 0, 0, bits))
    # the field a code below (_field's LOWER; an 8-bit group's pair J is on the same field, rotated on its own)
    lower_mask = tl.where(width == 4, 0x003C003C, tl.where(width == 2, 0x00C000C0, 0x00010100))
    lower_mask = tl.where(width == 8, mask, tl.where(width == 0, 0, lower_mask))
    lower_bits = tl.where(width == 4, 0x5C005C00, tl.where(width == 2, 0x4C004C00, 0x64004400))
    lower_bits = tl.where(width == 8, bits, tl.where(width == 0, 0, lower_bits))
    fields = (mask, bits, lower_mask, lower_bits)
    high = half % 2
    top, _, _ = _group_fields(plan_pass(PLAN, 0), G)
    remap = (top == 4) & (K > 0)
    EIGHT: tl.constexpr = _has_width(PK, 8)
    w01, w23, w45, w67 = _pair_words(p_ptr, rows, mask_n, PK, width, half, start, NW, MASKED)
    p0, p1 = _value_couple(w01, 0, width, high, fields, remap, K > 0, EIGHT, ASM)
    p2, p3 = _value_couple(w23, 2, width, high, fields, remap, K > 0, EIGHT, ASM)
    p4, p5 = _value_couple(w45, 4, width, high, fields, remap, K > 0, EIGHT, ASM)
    p6, p7 = _value_couple(w67, 6, width, high, fields, remap, K > 0, EIGHT, ASM)
    x = _stack8(p0, p1, p2, p3, p4, p5, p6, p7)  # (R, G, 2, 2, 2): pair 4 m + 2 n + j
    lo, hi = _halves(x)
    return tl.reshape(tl.join(lo, hi), (R, D))


@triton.jit
def group_value_tile(p_ptr, rows, mask_n, PLAN: tl.constexpr, D: tl.constexpr, NW: tl.constexpr,
                     ASM: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """A head's tile of grouped codes as fp16 (R, D), the codes themselves, in value_columns' order: p_ptr the
    head's payload as int32 words, rows of NW; rows (R,) token indices (int32 offsets: rows * NW < 2**31),
    mask_n (R,) which are stored (read only when MASKED); PLAN: plan_code's. A plan of several planes a group sums
    its passes (_value_pass), each scaled by 2 ** its plane's shift (integers below 256: exact)."""
    x = _value_pass(p_ptr, rows, mask_n, PLAN, 0, D, NW, ASM, MASKED)
    if plan_pass(PLAN, 1):
        G: tl.constexpr = D // _GROUP
        _, s0 = _plane_shifts(PLAN, G, 0)
        _, s1 = _plane_shifts(PLAN, G, 1)
        m0 = _by_component(1 << s0, D).to(tl.float16)[None, :]
        m1 = _by_component(1 << s1, D).to(tl.float16)[None, :]
        x = x * m0 + _value_pass(p_ptr, rows, mask_n, PLAN, 1, D, NW, ASM, MASKED) * m1
        if plan_pass(PLAN, 2):
            x = x + _value_pass(p_ptr, rows, mask_n, PLAN, 2, D, NW, ASM, MASKED)
    return x
