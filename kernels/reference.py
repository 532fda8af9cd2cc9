"""Torch oracle for the packed KV format: bit-exact quantize / pack / unpack / dequantize, plus a float64
attention oracle.

This module owns the *format* of one quantized tensor. The Triton kernels (kernels/quantize.py,
kernels/decode_attention.py) must reproduce it bit for bit; kernels/layout.py decides where the rows of all
heads of one layer live. Quantization runs along the last dim of x, shape (..., D), in groups of g values.

Arithmetic contract (every step in float32; the order of operations below is the contract):
    x32   = clamp(float32(x), -65504, 65504)                 finite fp16 range; NaN inputs are not supported
                                                              (they propagate into scale/zero, undefined codes)
    asym  (llama.cpp q4_1 style), per group:
        lo, hi = min(x32), max(x32)
        scale  = fp16((hi - lo) / (2**b - 1))                 IEEE float32 division (by a tensor: CUDA turns a
                                                              division by a Python scalar into a multiplication
                                                              by its reciprocal), then round-to-nearest-even
        zero   = fp16(lo)
        s, z   = float32(scale), float32(zero)
        q      = clamp(floor((x32 - z) / s + 0.5), 0, 2**b - 1);   q = 0 where s == 0
        deq    = q * s + z                                    a float32 multiply then a float32 add (no FMA)
    sym   (llama.cpp q4_0 style), per group:
        amax   = max(|x32|);  qmax = 2**(b-1) - 1
        scale  = fp16(amax / qmax);  s = float32(scale)
        qs     = clamp(floor(x32 / s + 0.5), -qmax, qmax);    qs = 0 where s == 0
        code   = qs + 2**(b-1)                                codes lie in [1, 2**b - 1]
        deq    = (code - 2**(b-1)) * s
    Casting deq to a dtype narrower than float32 in range (float16) saturates to that dtype's finite range
    first: with inputs at +-65504 the fp16-rounded scale can put q * s + z just past 65504, which a plain cast
    would turn into inf.

Packing of the codes of one row (D codes), little-endian within bytes:
    b in {2, 4, 8}: k = 8 // b codes per byte; code j -> byte j // k, bits [(j % k) * b, + b).
                    Requires D % k == 0. Payload uint8 (..., D * b // 8).
    b = 3 (dense):  code j -> bits [3j, 3j + 3) of the row's bit stream, stream bit n = bit n % 8 of byte
                    n // 8 (a code may straddle two bytes). Requires D % 8 == 0. Payload uint8 (..., 3 * D // 8).
    Both rules are the same bit stream: code j occupies stream bits [b*j, b*j + b).
scale, zero: float16 (..., D // g); zero is None for sym.

Per-channel keys (KIVI), fp8 (e4m3) and the Hadamard rotation have their own contracts in the last
quantization section below. attention_blocks_reference is the oracle of attention over codes alone (a codes-only
store: kernels/layout.py), with a query and a bias per block of tokens.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

WIDTHS = (2, 3, 4, 8)  # packed widths; 16 means "unquantized" elsewhere in the project
SCHEMES = ("asym", "sym")
FP16_MAX = 65504.0


@dataclass
class Packed:
    """One quantized tensor of shape (..., dim) in the packed format described in the module docstring."""

    payload: torch.Tensor  # uint8 (..., packed_dim(dim, bits))
    scale: torch.Tensor  # float16 (..., dim // group_size)
    zero: torch.Tensor | None  # float16 (..., dim // group_size) for asym, None for sym
    bits: int
    group_size: int
    symmetric: bool
    dim: int  # D, the unpacked last dim

    def nbytes(self) -> int:
        """Bytes actually stored: payload + scale (+ zero)."""
        tensors = [self.payload, self.scale] + ([] if self.zero is None else [self.zero])
        return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------------------------------------------------
# validation


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or bits not in WIDTHS:
        raise ValueError(f"bits: {bits!r} is not a packed width; allowed: {', '.join(map(str, WIDTHS))}")
    return int(bits)


def _check_dim(dim: int, bits: int) -> None:
    """The row length must fill whole bytes: D % (8 // b) == 0 for b in {2, 4, 8}, D % 8 == 0 for b = 3."""
    need = 8 if bits == 3 else 8 // bits
    if dim <= 0 or dim % need:
        raise ValueError(f"dim: {dim} is not allowed at bits={bits}; allowed: a positive multiple of {need}")


def _check_group_size(group_size: int, dim: int) -> int:
    try:
        g = operator.index(group_size) if not isinstance(group_size, bool) else 0
    except TypeError:
        g = 0
    if g <= 0 or dim % g:
        raise ValueError(
            f"group_size: {group_size!r} does not divide the last dim {dim}; allowed: a positive divisor of {dim}"
        )
    return g


# ---------------------------------------------------------------------------------------------------------
# packing


def packed_dim(dim: int, bits: int) -> int:
    """Bytes of one packed row of `dim` codes at `bits` bits."""
    bits = _check_bits(bits)
    _check_dim(dim, bits)
    return dim * bits // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (..., D) in [0, 2**bits) into a uint8 payload (..., packed_dim(D, bits))."""
    bits = _check_bits(bits)
    D = codes.shape[-1]
    packed_dim(D, bits)  # validates D against bits
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise ValueError(f"codes: dtype {codes.dtype} is not allowed; allowed: an integer dtype")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"codes: values must lie in [0, {(1 << bits) - 1}] at bits={bits}")
    return _pack(codes, bits)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """pack without the argument checks (codes known to be in range)."""
    D = codes.shape[-1]
    pd = D * bits // 8
    lead = codes.shape[:-1]
    if bits == 3:
        c = codes.to(torch.int32).reshape(*lead, D // 8, 8)  # 8 codes = 24 bits = 3 bytes
        word = torch.zeros(c.shape[:-1], dtype=torch.int32, device=c.device)  # (..., D // 8)
        for i in range(8):
            word |= c[..., i] << (3 * i)
        out = torch.stack([(word >> (8 * i)) & 0xFF for i in range(3)], dim=-1)  # (..., D // 8, 3)
        return out.to(torch.uint8).reshape(*lead, pd)
    c = codes.to(torch.uint8)
    if bits == 8:
        return c
    k = 8 // bits
    c = c.reshape(*lead, D // k, k)  # (..., D // k, k): code j at [j // k, j % k]
    out = c[..., k - 1] << ((k - 1) * bits)  # (..., D // k) uint8: the pieces never reach past bit 7
    for i in range(k - 1):
        out |= c[..., i] << (i * bits) if i else c[..., i]
    return out.reshape(*lead, pd)


def unpack(payload: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of pack: uint8 payload (..., packed_dim(dim, bits)) -> uint8 codes (..., dim)."""
    bits = _check_bits(bits)
    pd = packed_dim(dim, bits)
    if payload.dtype != torch.uint8 or payload.shape[-1] != pd:
        raise ValueError(
            f"payload: got {payload.dtype} with last dim {payload.shape[-1]}; "
            f"allowed: torch.uint8 with last dim {pd} (dim={dim}, bits={bits})"
        )
    lead = payload.shape[:-1]
    mask = (1 << bits) - 1
    if bits == 8:
        return payload.clone()
    if bits == 3:
        p = payload.to(torch.int32).reshape(*lead, dim // 8, 3)
        word = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16)  # (..., D // 8) 24-bit little-endian
        codes = torch.stack([(word >> (3 * i)) & mask for i in range(8)], dim=-1)  # (..., D // 8, 8)
        return codes.to(torch.uint8).reshape(*lead, dim)
    k = 8 // bits
    last = (k - 1) * bits  # the top piece needs no mask
    pieces = [payload & mask, *((payload >> (i * bits)) & mask for i in range(1, k - 1)), payload >> last]
    return torch.stack(pieces, dim=-1).reshape(
        *lead, dim
    )  # (..., D // k, k): byte j's piece i is code j * k + i


# ---------------------------------------------------------------------------------------------------------
# quantization


def _divisor(like: torch.Tensor, value: float) -> torch.Tensor:
    """`value` as a 0-dim float32 tensor on like's device: dividing by it is a correctly rounded IEEE division on
    every device (CUDA computes x / python_scalar as x * (1 / scalar), which can differ in the last bit)."""
    return torch.full((), float(value), dtype=torch.float32, device=like.device)


def _quantize_groups(
    x: torch.Tensor, bits: int, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes as float32 (..., D // g, g) (integer-valued), scale float16 (..., D // g), zero float16 or None."""
    if not x.dtype.is_floating_point:
        raise TypeError(f"x: dtype {x.dtype} is not allowed; allowed: a floating dtype")
    bits = _check_bits(bits)
    D = x.shape[-1]
    _check_dim(D, bits)
    g = _check_group_size(group_size, D)
    lead = x.shape[:-1]
    xg = x.to(torch.float32)
    # one float32 copy of x, worked on in place from here on
    xg = xg.clamp(-FP16_MAX, FP16_MAX) if xg is x else xg.clamp_(-FP16_MAX, FP16_MAX)
    xg = xg.reshape(*lead, D // g, g)  # (..., n_groups, g)
    lo, hi = torch.aminmax(xg, dim=-1)  # (..., n_groups)

    if symmetric:
        qmax = (1 << (bits - 1)) - 1
        amax = torch.maximum(-lo, hi)  # max |x|
        scale = (amax / _divisor(amax, qmax)).to(torch.float16)
        zero = None
        s = scale.float().unsqueeze(-1)  # (..., n_groups, 1)
        q = xg.div_(s).add_(0.5).floor_().clamp_(-qmax, qmax)  # s == 0 gives nan/inf here, zeroed below
        q = q.masked_fill_(s == 0, 0.0).add_(1 << (bits - 1))
    else:
        qmax = (1 << bits) - 1
        scale = ((hi - lo) / _divisor(lo, qmax)).to(torch.float16)
        zero = lo.to(torch.float16)
        s, z = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)  # (..., n_groups, 1)
        q = xg.sub_(z).div_(s).add_(0.5).floor_().clamp_(0, qmax)  # s == 0 gives nan/inf here, zeroed below
        q = q.masked_fill_(s == 0, 0.0)
    return q, scale, zero


def _packed(q: torch.Tensor, scale, zero, bits: int, group_size: int, symmetric: bool) -> Packed:
    D = q.shape[-1] * q.shape[-2]
    codes = q.to(torch.uint8).reshape(*q.shape[:-2], D)  # (..., D)
    return Packed(_pack(codes, bits), scale, zero, int(bits), int(group_size), bool(symmetric), D)


def _values(q: torch.Tensor, scale, zero, bits: int, symmetric: bool, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized values (..., D) from grouped codes q (..., n_groups, g): the arithmetic of the contract."""
    s = scale.to(torch.float32).unsqueeze(-1)  # (..., n_groups, 1)
    y = (q - (1 << (bits - 1))) * s if symmetric else q * s + zero.to(torch.float32).unsqueeze(-1)
    return _saturating_cast(y.reshape(*q.shape[:-2], q.shape[-2] * q.shape[-1]), dtype)


def quantize(x: torch.Tensor, bits: int, group_size: int, symmetric: bool = False) -> Packed:
    """Quantize x (..., D) of any float dtype along its last dim into a Packed (see module docstring)."""
    return _packed(*_quantize_groups(x, bits, group_size, symmetric), bits, group_size, symmetric)


def quantize_dequantize(
    x: torch.Tensor, bits: int, group_size: int, symmetric: bool = False, dtype: torch.dtype = torch.float32
) -> tuple[Packed, torch.Tensor]:
    """quantize(x) and dequantize() of it in one pass (no unpacking): (Packed, values (..., D) in dtype)."""
    q, scale, zero = _quantize_groups(x, bits, group_size, symmetric)
    return _packed(q, scale, zero, bits, group_size, symmetric), _values(
        q, scale, zero, bits, symmetric, dtype
    )


def _saturating_cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 y -> dtype, clamping to dtype's finite range first where it is narrower than float32's."""
    if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(torch.float32).max:
        fmax = torch.finfo(dtype).max
        y = y.clamp(-fmax, fmax)
    return y.to(dtype)


def dequantize(p: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed -> values (..., D): computed in float32, then cast (saturating) to `dtype`."""
    bits = _check_bits(p.bits)
    g = _check_group_size(p.group_size, p.dim)
    if not p.symmetric and p.zero is None:
        raise ValueError("zero: an asymmetric Packed needs a zero tensor; got None")
    codes = unpack(p.payload, bits, p.dim)
    q = codes.to(torch.float32).reshape(*codes.shape[:-1], p.dim // g, g)  # (..., n_groups, g)
    return _values(q, p.scale, p.zero, bits, p.symmetric, dtype)


def fake_quantize(x: torch.Tensor, bits: int, group_size: int, symmetric: bool = False) -> torch.Tensor:
    """dequantize(quantize(x)) in x.dtype."""
    return dequantize(quantize(x, bits, group_size, symmetric), dtype=x.dtype)


# ---------------------------------------------------------------------------------------------------------
# per-channel keys (KIVI), fp8 and the Hadamard rotation: formats of harness/schemes (torch path only)


def _check_tokens(tokens: int, group_size: int) -> int:
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size < 1
        or tokens % group_size
    ):
        raise ValueError(
            f"group_size: {group_size!r} does not divide the {tokens} tokens; allowed: a positive divisor of {tokens}"
        )
    return group_size


def channel_quantize_dequantize(
    x: torch.Tensor, bits: int, group_size: int, dtype: torch.dtype = torch.float32
) -> tuple[Packed, torch.Tensor]:
    """KIVI's keys: x (..., T, D) quantized per channel over groups of g = group_size consecutive tokens (asym).

    The contract above applied to x regrouped as (..., T // g, D, g): row (i, d) holds the g codes of channel d
    over tokens [i * g, (i + 1) * g), with one scale and zero (..., T // g, D, 1). T must be a multiple of g.
    Returns (Packed with dim g, values (..., T, D) in dtype).
    """
    *lead, T, D = x.shape
    g = _check_tokens(T, group_size)
    rows = x.reshape(*lead, T // g, g, D).transpose(-1, -2)  # (..., T // g, D, g)
    packed, values = quantize_dequantize(rows, bits, g, symmetric=False, dtype=dtype)
    return packed, values.transpose(-1, -2).reshape(*lead, T, D)


def channel_dequantize(p: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse layout of channel_quantize_dequantize: Packed rows (..., T // g, D) of g codes -> (..., T, D)."""
    values = dequantize(p, dtype)  # (..., T // g, D, g)
    *lead, n_groups, D, g = values.shape
    return values.transpose(-1, -2).reshape(*lead, n_groups * g, D)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_quantize_dequantize(
    x: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3 with one fp16 absmax scale per row of x (..., D): (payload, scale, values).

        x32   = clamp(float32(x), -65504, 65504)
        scale = fp16(max(|x32|) / 448);  s = float32(scale)
        q     = float8_e4m3fn(clamp(x32 / s, -448, 448))     torch's cast (round to nearest even); q = 0 where s == 0
        deq   = float32(q) * s                                saturating cast to dtype
    payload: uint8 (..., D), the e4m3 bit patterns; scale: float16 (...,); values (..., D) in dtype.
    """
    if not x.dtype.is_floating_point:
        raise TypeError(f"x: dtype {x.dtype} is not allowed; allowed: a floating dtype")
    x32 = x.to(torch.float32).clamp(-FP16_MAX, FP16_MAX)
    amax = x32.abs().amax(dim=-1)  # (...,)
    scale = (amax / _divisor(amax, FP8_MAX)).to(torch.float16)
    s = scale.float().unsqueeze(-1)  # (..., 1)
    q = torch.where(s == 0, 0.0, (x32 / s).clamp(-FP8_MAX, FP8_MAX)).to(torch.float8_e4m3fn)
    payload = q.view(torch.uint8)
    return payload, scale, fp8_dequantize(payload, scale, dtype)


def fp8_dequantize(
    payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 e4m3 payload (..., D) and fp16 scale (...,) -> values (..., D) in dtype."""
    y = payload.view(torch.float8_e4m3fn).to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)
    return _saturating_cast(y, dtype)


def hadamard(n: int, device=None) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix (n, n) in float32: symmetric, so H @ H = I. n a power of two."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"n: {n!r} is not allowed for a Hadamard rotation; allowed: a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(torch.float32).to(device)


def hadamard_rotate(
    x: torch.Tensor, dtype: torch.dtype = torch.float32, h: torch.Tensor | None = None
) -> torch.Tensor:
    """float32(x) @ H along the last dim (..., D), saturating cast to dtype; its own inverse (up to rounding).

    `h`: hadamard(D) when the caller keeps it (built here otherwise).
    """
    y = x.to(torch.float32) @ (hadamard(x.shape[-1], x.device) if h is None else h)
    return _saturating_cast(y, dtype)


# ---------------------------------------------------------------------------------------------------------
# attention oracle


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None = None
) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v with GQA.

    q (B, Hq, Tq, D); k, v (B, Hkv, Tk, D) with Hq a multiple of Hkv: query head h reads KV head
    h // (Hq // Hkv). With causal_offset, query i attends keys j <= i + causal_offset (decode: Tq = 1,
    causal_offset = Tk - 1). Returns (B, Hq, Tq, D) float64.
    """
    B, Hq, Tq, D = q.shape
    Bk, Hkv, Tk, Dk = k.shape
    if (Bk, Hkv, Tk) != tuple(v.shape[:3]) or Bk != B or Dk != D:
        raise ValueError(f"k, v: shapes {tuple(k.shape)}, {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if Hq % Hkv:
        raise ValueError(f"k: {Hkv} KV heads do not divide {Hq} query heads; allowed: a divisor of {Hq}")
    if causal_offset is not None and causal_offset < 0:
        raise ValueError(f"causal_offset: {causal_offset} would leave query 0 no key; allowed: >= 0 or None")
    rep = Hq // Hkv
    k64 = k.to(torch.float64).repeat_interleave(rep, dim=1)  # (B, Hq, Tk, D)
    v64 = v.to(torch.float64).repeat_interleave(rep, dim=1)  # (B, Hq, Tk, Dv)
    scores = q.to(torch.float64) @ k64.transpose(-1, -2) * scale  # (B, Hq, Tq, Tk)
    if causal_offset is not None:
        i = torch.arange(Tq, device=q.device).unsqueeze(-1)  # (Tq, 1)
        j = torch.arange(Tk, device=q.device)  # (Tk,)
        scores = scores.masked_fill(j > i + causal_offset, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v64  # (B, Hq, Tq, Dv)


def attention_blocks_reference(
    qb: torch.Tensor,
    bias: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    qblock: int | None,
    k_extra: torch.Tensor | None = None,
    v_extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 attention of one decode step over codes, with a query and a bias per block of `qblock` tokens.

    qb (B, Hq, NB, D), bias (B, Hq, NB); k, v (B, Hkv, L, D): the stored tokens' codes as numbers (query head i reads
    KV head i // (Hq // Hkv)); qblock None: one block (NB >= 1, block 0 read). Token t is scored
    qb[b, i, t // qblock] . k_t + bias[b, i, t // qblock]; the extra tokens k_extra, v_extra (B, Hkv, Tx, D) (codes'
    domain) with block 0's query and bias. Returns sum_t softmax(score * scale)_t v_t, (B, Hq, D) float64.
    """
    B, Hq, NB, D = qb.shape
    Hkv, L = k.shape[1], k.shape[2]
    if tuple(k.shape) != (B, Hkv, L, D) or k.shape != v.shape or tuple(bias.shape) != (B, Hq, NB):
        raise ValueError(
            f"shapes: qb {tuple(qb.shape)}, bias {tuple(bias.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if Hq % Hkv:
        raise ValueError(f"k: {Hkv} KV heads do not divide {Hq} query heads; allowed: a divisor of {Hq}")
    blk = (
        torch.arange(L, device=k.device) // qblock
        if qblock
        else torch.zeros(L, dtype=torch.long, device=k.device)
    )
    if L and int(blk.max()) >= NB:
        raise ValueError(f"qb: {NB} blocks for {L} tokens of {qblock} a block")
    rep = Hq // Hkv
    keys, values = k.double(), v.double()
    blocks = blk
    if k_extra is not None and k_extra.shape[2]:
        keys, values = torch.cat([keys, k_extra.double()], 2), torch.cat([values, v_extra.double()], 2)
        blocks = torch.cat([blk, torch.zeros(k_extra.shape[2], dtype=torch.long, device=k.device)])
    queries = qb.double()[:, :, blocks]  # (B, Hq, T, D): each token's block's query
    scores = (queries * keys.repeat_interleave(rep, 1)).sum(-1) + bias.double()[:, :, blocks]  # (B, Hq, T)
    return (
        torch.softmax(scores * scale, dim=-1).unsqueeze(2).matmul(values.repeat_interleave(rep, 1)).squeeze(2)
    )
