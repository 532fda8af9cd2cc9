"""Tests of kernels/reference.py: the packed KV format oracle and the float64 attention oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import reference as R

FP16_MAX = 65504.0
EPS32 = torch.finfo(torch.float32).eps
HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _gen(seed: int | None = None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))
    return g


def _random_codes(shape: tuple[int, ...], bits: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 1 << bits, shape, generator=gen, dtype=torch.int64).to(torch.uint8)


def _bitstream_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Independent slow packer from the format's definition: code j of a row at stream bits [b*j, b*j + b)."""
    rows = codes.reshape(-1, codes.shape[-1]).tolist()
    D = codes.shape[-1]
    out = []
    for row in rows:
        buf = [0] * (D * bits // 8)
        for j, c in enumerate(row):
            for t in range(bits):
                n = bits * j + t
                buf[n // 8] |= ((c >> t) & 1) << (n % 8)
        out.append(buf)
    return torch.tensor(out, dtype=torch.uint8).reshape(*codes.shape[:-1], D * bits // 8)


def _numpy_quantize(x: torch.Tensor, bits: int, g: int, symmetric: bool):
    """Independent numpy implementation of the arithmetic contract: (codes, scale fp16, zero fp16 | None)."""
    xs = np.clip(x.to(torch.float32).numpy().astype(np.float32), np.float32(-FP16_MAX), np.float32(FP16_MAX))
    xg = xs.reshape(*xs.shape[:-1], xs.shape[-1] // g, g)
    with np.errstate(divide="ignore", invalid="ignore"):
        if symmetric:
            qmax = 2 ** (bits - 1) - 1
            scale = (np.abs(xg).max(-1) / np.float32(qmax)).astype(np.float16)
            s = scale.astype(np.float32)[..., None]
            q = np.clip(np.floor(xg / s + np.float32(0.5)), -qmax, qmax)
            q = np.where(s == 0, 0, q) + 2 ** (bits - 1)
            zero = None
        else:
            qmax = 2**bits - 1
            lo, hi = xg.min(-1), xg.max(-1)
            scale = ((hi - lo) / np.float32(qmax)).astype(np.float16)
            zero = lo.astype(np.float16)
            s, z = scale.astype(np.float32)[..., None], zero.astype(np.float32)[..., None]
            q = np.clip(np.floor((xg - z) / s + np.float32(0.5)), 0, qmax)
            q = np.where(s == 0, 0, q)
    return q.reshape(xs.shape).astype(np.uint8), scale, zero


def _error_bound(x: torch.Tensor, p: R.Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element (clamped float32 x, allowed |x - deq|), derived from the stored fp16 scale and zero.

    asym: inside [z, z + qmax*s] rounding costs <= s/2; above it q saturates at qmax, costing at most
    hi - (z + qmax*s); below z (zero rounded above lo) at most z - lo. s == 0 gives q = 0, deq = z: covered.
    sym: |x| <= qmax*s costs <= s/2; beyond, at most amax - qmax*s.
    Plus float32 rounding of x - z, the division, q*s and the add: a few ulps of the magnitudes involved.
    """
    g, b = p.group_size, p.bits
    x32 = x.to(torch.float32).clamp(-FP16_MAX, FP16_MAX)
    xg = x32.reshape(*x32.shape[:-1], -1, g)
    s = p.scale.float().unsqueeze(-1)
    if p.symmetric:
        qmax = 2 ** (b - 1) - 1
        amax = xg.abs().amax(-1, keepdim=True)
        bound = torch.maximum(s / 2, amax - qmax * s)
        mag = xg.abs() + qmax * s
    else:
        qmax = 2**b - 1
        z = p.zero.float().unsqueeze(-1)
        lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
        bound = torch.maximum(torch.maximum(s / 2, hi - z - qmax * s), z - lo)
        mag = xg.abs() + z.abs() + qmax * s
    bound = bound + 4 * EPS32 * mag
    return x32, bound.reshape(x32.shape)


# --------------------------------------------------------------------------------------------------------
# pack / unpack


@pytest.mark.parametrize("bits", R.WIDTHS)
@pytest.mark.parametrize("D", [32, 64, 96, 256])
def test_pack_unpack_round_trip(bits, D):
    gen = _gen()
    codes = _random_codes((3, 5, 7, D), bits, gen)
    payload = R.pack(codes, bits)
    assert payload.dtype == torch.uint8
    assert payload.shape == (3, 5, 7, R.packed_dim(D, bits)) == (3, 5, 7, D * bits // 8)
    assert torch.equal(R.unpack(payload, bits, D), codes)


@pytest.mark.parametrize("bits", R.WIDTHS)
def test_pack_matches_bitstream_definition(bits):
    gen = _gen()
    codes = _random_codes((2, 3, 40), bits, gen)
    assert torch.equal(R.pack(codes, bits), _bitstream_pack(codes, bits))


@pytest.mark.parametrize("bits", R.WIDTHS)
def test_unpack_non_contiguous_payload(bits):
    gen = _gen()
    codes = _random_codes((4, 6, 32), bits, gen)
    wide = torch.cat([R.pack(codes, bits), torch.zeros(4, 6, 5, dtype=torch.uint8)], dim=-1)
    view = wide[..., : R.packed_dim(32, bits)].transpose(0, 1)
    assert not view.is_contiguous()
    assert torch.equal(R.unpack(view, bits, 32), codes.transpose(0, 1))


def test_pack_hand_computed_bytes():
    # 2 bits: codes [1,2,3,0] -> 01 | 10<<2 | 11<<4 | 00<<6 = 0b00111001
    assert R.pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [0b00111001] == [57]
    # 4 bits: low nibble first
    assert R.pack(torch.tensor([0x3, 0xA, 0xF, 0x1], dtype=torch.uint8), 4).tolist() == [0xA3, 0x1F]
    # 8 bits: identity
    assert R.pack(torch.tensor([0, 7, 200, 255], dtype=torch.uint8), 8).tolist() == [0, 7, 200, 255]
    # 3 bits: codes 0..7 -> stream bits; code 2 (=0b010) straddles bytes 0 and 1 (bits 6..8),
    # code 5 (=0b101) straddles bytes 1 and 2 (bits 15..17).
    # byte0 = c0 | c1<<3 | (c2 & 3)<<6 = 0 | 8 | 128 = 136
    # byte1 = c2>>2 | c3<<1 | c4<<4 | (c5 & 1)<<7 = 0 | 6 | 64 | 128 = 198
    # byte2 = c5>>1 | c6<<2 | c7<<5 = 2 | 24 | 224 = 250
    codes3 = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.uint8)
    assert R.pack(codes3, 3).tolist() == [136, 198, 250]
    assert R.unpack(torch.tensor([136, 198, 250], dtype=torch.uint8), 3, 8).tolist() == list(range(8))
    # a lone high bit of a straddling code: code 2 = 0b100 only sets stream bit 8 -> byte 1 bit 0
    only = torch.tensor([0, 0, 4, 0, 0, 0, 0, 0], dtype=torch.uint8)
    assert R.pack(only, 3).tolist() == [0, 1, 0]


def test_pack_rejects_bad_inputs():
    with pytest.raises(ValueError, match="bits"):
        R.pack(torch.zeros(8, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="dim"):
        R.pack(torch.zeros(12, dtype=torch.uint8), 3)  # 3-bit needs D % 8 == 0
    with pytest.raises(ValueError, match="dim"):
        R.pack(torch.zeros(6, dtype=torch.uint8), 2)  # 4 codes per byte
    with pytest.raises(ValueError, match="codes"):
        R.pack(torch.tensor([0, 4, 0, 0], dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="payload"):
        R.unpack(torch.zeros(5, dtype=torch.uint8), 4, 8)


# --------------------------------------------------------------------------------------------------------
# quantize / dequantize


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", R.WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_quantize_matches_independent_numpy(symmetric, bits, dtype):
    gen = _gen()
    x = (torch.randn(3, 5, 64, generator=gen) * torch.rand(3, 5, 1, generator=gen) * 10).to(dtype)
    x[0, 0, :32] = 1.25  # a constant group
    x[0, 1, :16] = 0.0
    codes, scale, zero = _numpy_quantize(x, bits, 16, symmetric)
    p = R.quantize(x, bits, 16, symmetric)
    assert torch.equal(R.unpack(p.payload, bits, 64), torch.from_numpy(codes))
    assert torch.equal(p.scale, torch.from_numpy(scale))
    if symmetric:
        assert p.zero is None
    else:
        assert torch.equal(p.zero, torch.from_numpy(zero))


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", R.WIDTHS)
def test_scale_is_a_correctly_rounded_division_on_every_device(device, symmetric, bits):
    """scale = fp16(float32 (hi - lo) / qmax) with a correctly rounded division, on CPU and CUDA alike (CUDA
    computes a division by a Python scalar as a multiplication by its reciprocal, one ulp off at times): the
    float32 quotient is float64's rounded to float32 (exact: float64 carries more than 2 * 24 + 2 bits)."""
    gen = _gen()
    n = 1 << 18
    v = torch.rand(n, generator=gen, dtype=torch.float64).mul(1000).to(torch.float32)  # (n,) distinct spans
    x = torch.zeros(n, 8)
    x[:, 1] = v  # each row one group: lo = 0 (asym) and hi = amax = v
    qmax = (1 << (bits - 1)) - 1 if symmetric else (1 << bits) - 1
    want = (v.double() / qmax).to(torch.float32).to(torch.float16)
    got = R.quantize(x.to(device), bits, 8, symmetric).scale[:, 0].cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    if device == "cuda":
        assert torch.equal(
            R.quantize(x, bits, 8, symmetric).payload, R.quantize(x.cuda(), bits, 8, symmetric).payload.cpu()
        )


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_scale_is_a_correctly_rounded_division_on_every_device(device):
    gen = _gen()
    x = torch.randn(1 << 16, 8, generator=gen) * 100
    want = (x.abs().amax(-1).double() / R.FP8_MAX).to(torch.float32).to(torch.float16)
    got = R.fp8_quantize_dequantize(x.to(device))[1].cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_quantize_hand_computed():
    # asym 2-bit: lo=0, hi=3 -> s=1, z=0; floor(t + 0.5) rounds halves up (not to even)
    p = R.quantize(torch.tensor([0.0, 0.5, 1.5, 2.5, 3.0, 1.0, 2.0, 0.49]), 2, 8)
    assert p.scale.item() == 1.0 and p.zero.item() == 0.0
    assert R.unpack(p.payload, 2, 8).tolist() == [0, 1, 2, 3, 3, 1, 2, 0]
    assert R.dequantize(p).tolist() == [0.0, 1.0, 2.0, 3.0, 3.0, 1.0, 2.0, 0.0]
    # asym 4-bit: 0..15 is exact
    x = torch.arange(16, dtype=torch.float32) - 3.0
    p = R.quantize(x, 4, 16)
    assert R.unpack(p.payload, 4, 16).tolist() == list(range(16))
    assert torch.equal(R.dequantize(p), x)
    # sym 3-bit: amax=3, qmax=3 -> s=1; code = q + 4; -0.5 -> floor(0) = 0; -1.5 -> -1
    p = R.quantize(torch.tensor([3.0, -0.5, -1.5, 2.5, 0.5, -3.0, 0.0, -2.6]), 3, 8, symmetric=True)
    assert p.zero is None and p.scale.item() == 1.0
    assert R.unpack(p.payload, 3, 8).tolist() == [7, 4, 3, 7, 5, 1, 4, 1]
    assert R.dequantize(p).tolist() == [3.0, 0.0, -1.0, 3.0, 1.0, -3.0, 0.0, -3.0]
    # scale is rounded to fp16 before use: (hi - lo) / 15 = 0.1 -> fp16 0.0999755859375
    p = R.quantize(torch.linspace(0, 1.5, 16), 4, 16)
    assert p.scale.item() == float(torch.tensor(0.1).half())


@st.composite
def _quant_case(draw):
    bits = draw(st.sampled_from(R.WIDTHS))
    symmetric = draw(st.booleans())
    g = draw(st.sampled_from([8, 16, 32]))
    D = g * draw(st.integers(1, 4))
    if bits == 3 and D % 8:
        D *= 8
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    limit = {torch.float16: FP16_MAX, torch.bfloat16: 2.0**126, torch.float32: 2.0**127}[dtype]
    n = math.prod(lead) * D
    mode = draw(st.sampled_from(["floats", "randn"]))
    if mode == "floats":
        vals = draw(
            st.lists(
                st.floats(-limit, limit, allow_nan=False, allow_infinity=False, width=32),
                min_size=n,
                max_size=n,
            )
        )
        x = torch.tensor(vals, dtype=torch.float32)
    else:
        seed = draw(st.integers(0, 2**31 - 1))
        mag = draw(st.sampled_from([1e-6, 1.0, 100.0, 3e4]))
        offset = draw(st.sampled_from([0.0, 5.0, -1000.0]))
        x = torch.randn(n, generator=_gen(seed)) * mag + offset
    return x.reshape(*lead, D).to(dtype), bits, g, symmetric


@HYP
@given(_quant_case())
def test_round_trip_error_bound(case):
    x, bits, g, symmetric = case
    p = R.quantize(x, bits, g, symmetric)
    deq = R.dequantize(p)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    assert torch.isfinite(deq).all() and torch.isfinite(p.scale).all()
    x32, bound = _error_bound(x, p)
    err = (x32 - deq).abs()
    assert (err <= bound).all(), (err - bound).max()
    # fake_quantize is the same values in x's dtype
    fq = R.fake_quantize(x, bits, g, symmetric)
    assert fq.dtype == x.dtype and torch.isfinite(fq).all()
    assert torch.equal(fq, R.dequantize(p, dtype=x.dtype))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", R.WIDTHS)
def test_error_bound_is_s_over_2_on_ordinary_data(symmetric, bits):
    """On well-scaled data the honest bound is essentially s/2 (the bound helper is not vacuous)."""
    gen = _gen()
    x = torch.randn(7, 9, 96, generator=gen)
    p = R.quantize(x, bits, 32, symmetric)
    err = (x - R.dequantize(p)).abs().reshape(7, 9, 3, 32)
    s = p.scale.float().unsqueeze(-1)
    assert (err <= s / 2 * (1 + 2e-3) + 1e-6).all()


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", R.WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_no_nan_or_inf_on_extreme_inputs(symmetric, bits, dtype):
    fmax = torch.finfo(dtype).max
    big = min(1e30, fmax)
    rows = [
        [0.0] * 16,
        [1.5] * 16,
        [-7.0] * 16,
        [big] * 8 + [-big] * 8,
        [fmax] * 8 + [-fmax] * 8,
        [1e-30] * 4 + [-1e-30] * 4 + [0.0] * 8,
        [FP16_MAX, -FP16_MAX] * 8,
        [FP16_MAX] * 15 + [-FP16_MAX],
        [min(3.0e38, fmax)] + [0.0] * 15,
    ]
    x = torch.tensor(rows, dtype=torch.float64).to(dtype)
    assert torch.isfinite(x).all()
    p = R.quantize(x, bits, 8, symmetric)
    assert torch.isfinite(p.scale).all()
    assert p.zero is None or torch.isfinite(p.zero).all()
    for out_dtype in (torch.float32, torch.float16, dtype):
        assert torch.isfinite(R.dequantize(p, dtype=out_dtype)).all()
    assert torch.isfinite(R.fake_quantize(x, bits, 8, symmetric)).all()
    # all-zero groups reconstruct exactly; asym constant groups too (s == 0, deq = z) when fp16-representable
    deq = R.dequantize(p)
    assert torch.equal(deq[0], x[0].float())
    if not symmetric:
        assert torch.equal(deq[:3], x[:3].float())
    x32, bound = _error_bound(x, p)
    assert ((x32 - deq).abs() <= bound).all()


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", R.WIDTHS)
def test_subnormal_scale_rounded_down_stays_in_range(symmetric, bits):
    """fp16 subnormal scales can round far below the true step (here to 2**-24 from 1.45 * 2**-24), so x / s
    overshoots qmax: codes must still be clamped into range and the error stays within the honest bound."""
    qmax = 2 ** (bits - 1) - 1 if symmetric else 2**bits - 1
    amax = 1.45 * 2.0**-24 * qmax
    gen = _gen()
    u = torch.rand(6, 32, generator=gen, dtype=torch.float64)
    x = (u * 2 - 1 if symmetric else u) * amax  # every group spans [-amax, amax] (sym) or [0, amax] (asym)
    x[:, 0::16], x[:, 1::16] = amax, (-amax if symmetric else 0.0)
    x = x.float()
    p = R.quantize(x, bits, 16, symmetric)
    assert (p.scale == 2.0**-24).all()
    codes = R.unpack(p.payload, bits, 32).long()
    assert codes.min() >= (1 if symmetric else 0) and codes.max() <= 2**bits - 1
    assert codes.max() == 2**bits - 1
    x32, bound = _error_bound(x, p)
    assert ((x32 - R.dequantize(p)).abs() <= bound).all()


def test_fp16_extremes_saturate_instead_of_overflowing():
    # asym 4-bit over [-65504, 65504]: fp16 scale rounds up to 8736, so 15*s + z = 65536 in float32,
    # which a plain cast to fp16 would turn into inf.
    x = torch.tensor([[-FP16_MAX] + [FP16_MAX] * 15], dtype=torch.float16)
    p = R.quantize(x, 4, 16)
    assert p.scale.item() == 8736.0
    assert R.dequantize(p)[0, -1].item() == 65536.0
    out = R.fake_quantize(x, 4, 16)
    assert out[0, -1].item() == FP16_MAX and torch.isfinite(out).all()


def test_inputs_clamped_to_fp16_range():
    x = torch.tensor([[1e30, -1e30, 7e4, 0.0, 1.0, 2.0, 3.0, 4.0]], dtype=torch.float32)
    p = R.quantize(x, 8, 8)
    assert p.zero.item() == -FP16_MAX
    assert p.scale.item() == 514.0  # fp16(131008 / 255 = 513.76...)
    assert R.dequantize(p)[0].tolist() == [65566.0, -FP16_MAX, 65566.0] + [-226.0] * 5  # 255 * 514 - 65504


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", R.WIDTHS)
def test_codes_in_range_and_spanning(symmetric, bits):
    gen = _gen()
    x = torch.randn(5, 3, 128, generator=gen) * 3 + 0.5
    p = R.quantize(x, bits, 32, symmetric)
    codes = R.unpack(p.payload, bits, 128).reshape(5, 3, 4, 32).long()
    top = 2**bits - 1
    if symmetric:
        assert codes.min() >= 1 and codes.max() <= top
        # the group's |max| element hits +-qmax
        qs = codes - 2 ** (bits - 1)
        assert torch.equal(qs.abs().amax(-1), torch.full((5, 3, 4), 2 ** (bits - 1) - 1))
    else:
        # the group min maps to code 0 and the group max to 2**b - 1
        assert torch.equal(codes.amin(-1), torch.zeros(5, 3, 4, dtype=torch.long))
        assert torch.equal(codes.amax(-1), torch.full((5, 3, 4), top))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", R.WIDTHS)
@pytest.mark.parametrize("D, g", [(64, 32), (96, 16), (256, 64), (24, 8)])
def test_shapes_dtypes_and_nbytes(symmetric, bits, D, g):
    if bits == 3 and D % 8:
        pytest.skip("3-bit needs D % 8 == 0")
    x = torch.randn(2, 3, 5, D, dtype=torch.bfloat16)
    p = R.quantize(x, bits, g, symmetric)
    assert p.payload.shape == (2, 3, 5, D * bits // 8) and p.payload.dtype == torch.uint8
    assert p.scale.shape == (2, 3, 5, D // g) and p.scale.dtype == torch.float16
    assert (p.zero is None) == symmetric
    if not symmetric:
        assert p.zero.shape == p.scale.shape and p.zero.dtype == torch.float16
    assert (p.bits, p.group_size, p.symmetric, p.dim) == (bits, g, symmetric, D)
    stored = p.payload.numel() + 2 * p.scale.numel() + (0 if symmetric else 2 * p.zero.numel())
    assert p.nbytes() == stored == 30 * (D * bits // 8 + (D // g) * 2 * (1 if symmetric else 2))


def test_nbytes_q4_1_g32_d64():
    p = R.quantize(torch.randn(1, 64), 4, 32)
    assert p.nbytes() == 40  # 32 payload + 2 scales * 2 + 2 zeros * 2
    assert 64 * 2 / p.nbytes() == pytest.approx(3.2)
    assert R.quantize(torch.randn(1, 64), 4, 32, symmetric=True).nbytes() == 36


def test_empty_leading_dims():
    x = torch.randn(0, 3, 32)
    p = R.quantize(x, 4, 16)
    assert p.payload.shape == (0, 3, 16) and p.scale.shape == (0, 3, 2)
    assert R.dequantize(p).shape == (0, 3, 32)


@pytest.mark.parametrize("bad_bits", [0, 1, 5, 6, 7, 16, -4, True])
def test_bad_bits(bad_bits):
    with pytest.raises(ValueError, match="bits"):
        R.quantize(torch.randn(2, 64), bad_bits, 32)
    with pytest.raises(ValueError, match="bits"):
        R.packed_dim(64, bad_bits)


@pytest.mark.parametrize("bad_g", [0, -32, 48, 128, 7, 32.0])
def test_bad_group_size(bad_g):
    with pytest.raises(ValueError, match="group_size"):
        R.quantize(torch.randn(2, 64), 4, bad_g)


def test_bad_dim_and_dtype():
    with pytest.raises(ValueError, match="dim"):
        R.quantize(torch.randn(2, 12), 3, 4)  # 3-bit requires D % 8 == 0
    with pytest.raises(TypeError, match="x"):
        R.quantize(torch.ones(2, 64, dtype=torch.int32), 4, 32)


# --------------------------------------------------------------------------------------------------------
# attention oracle


def _sdpa(q, k, v, scale, mask=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize(
    "B, Hq, Hkv, Tq, Tk, D", [(2, 8, 2, 5, 5, 32), (1, 6, 3, 7, 7, 48), (3, 4, 4, 1, 9, 16)]
)
def test_attention_full(B, Hq, Hkv, Tq, Tk, D):
    gen = _gen()
    q, k, v = (torch.randn(B, h, t, D, generator=gen) for h, t in [(Hq, Tq), (Hkv, Tk), (Hkv, Tk)])
    out = R.attention_reference(q, k, v, D**-0.5)
    assert out.dtype == torch.float64 and out.shape == (B, Hq, Tq, D)
    torch.testing.assert_close(out, _sdpa(q, k, v, D**-0.5), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("past", [0, 3])
def test_attention_causal(past):
    gen = _gen()
    B, Hq, Hkv, Tq, D = 2, 6, 2, 5, 24
    Tk = Tq + past
    q = torch.randn(B, Hq, Tq, D, generator=gen)
    k, v = torch.randn(2, B, Hkv, Tk, D, generator=gen)
    out = R.attention_reference(q, k, v, 0.3, causal_offset=past)
    mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(diagonal=past)
    torch.testing.assert_close(out, _sdpa(q, k, v, 0.3, mask), rtol=1e-10, atol=1e-12)
    if past == 0:
        ref = F.scaled_dot_product_attention(
            q.double(),
            k.double().repeat_interleave(3, 1),
            v.double().repeat_interleave(3, 1),
            is_causal=True,
            scale=0.3,
        )
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_attention_decode_and_gqa_head_mapping():
    gen = _gen()
    B, Hq, Hkv, Tk, D = 2, 8, 2, 11, 16
    q = torch.randn(B, Hq, 1, D, generator=gen, dtype=torch.float16)
    k, v = torch.randn(2, B, Hkv, Tk, D, generator=gen).to(torch.float16)
    out = R.attention_reference(q, k, v, D**-0.5, causal_offset=Tk - 1)
    torch.testing.assert_close(out, R.attention_reference(q, k, v, D**-0.5), rtol=0, atol=0)
    torch.testing.assert_close(out, _sdpa(q, k, v, D**-0.5), rtol=1e-10, atol=1e-12)
    # query head 5 reads KV head 5 // 4 = 1
    one = R.attention_reference(q[:, 5:6], k[:, 1:2], v[:, 1:2], D**-0.5)
    torch.testing.assert_close(out[:, 5:6], one, rtol=0, atol=0)
    # a smaller offset hides the last keys
    short = R.attention_reference(q, k, v, D**-0.5, causal_offset=Tk - 4)
    torch.testing.assert_close(short, R.attention_reference(q, k[:, :, :-3], v[:, :, :-3], D**-0.5))


def test_attention_rejects_bad_heads():
    with pytest.raises(ValueError):
        R.attention_reference(torch.randn(1, 6, 2, 8), torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8), 1.0)


@pytest.mark.parametrize("qblock, L, tx", [(4, 10, 0), (4, 12, 3), (None, 7, 2), (16, 5, 1)])
def test_attention_blocks_scores_each_token_with_its_blocks_query(qblock, L, tx):
    """Token by token in Python: token t's score is its block's query . k_t plus its block's bias, the extra
    tokens' block 0's; a softmax over them all weighs the values. Query head i reads KV head i // 3."""
    g = _gen(L + tx)
    B, Hq, Hkv, D = 2, 6, 2, 8
    nb = -(-L // qblock) if qblock else 1
    qb, bias = torch.randn(B, Hq, nb, D, generator=g).double(), torch.randn(B, Hq, nb, generator=g).double()
    k, v = (torch.randint(0, 16, (B, Hkv, L, D), generator=g).double() for _ in "kv")
    kx, vx = (torch.randn(B, Hkv, tx, D, generator=g).double() * 4 for _ in "kv")
    got = R.attention_blocks_reference(qb, bias, k, v, 0.3, qblock, kx, vx)
    for b in range(B):
        for i in range(Hq):
            h = i // 3
            keys = [(k[b, h, t], t // qblock if qblock else 0) for t in range(L)] + [(x, 0) for x in kx[b, h]]
            scores = torch.tensor(
                [float(qb[b, i, n] @ key + bias[b, i, n]) for key, n in keys], dtype=torch.float64
            )
            p = torch.softmax(scores * 0.3, 0)
            want = p @ torch.cat([v[b, h], vx[b, h]])
            torch.testing.assert_close(got[b, i], want, rtol=1e-12, atol=1e-12)


def test_attention_blocks_of_one_block_is_attention_over_the_codes():
    """One block and no bias: attention_reference over the codes (the bias of one block cancels in the softmax)."""
    g = _gen(3)
    qb = torch.randn(1, 4, 1, 16, generator=g)
    k, v = (torch.randint(0, 4, (1, 2, 9, 16), generator=g).float() for _ in "kv")
    want = R.attention_reference(qb, k, v, 0.25)[:, :, 0]
    for bias in (torch.zeros(1, 4, 1), torch.full((1, 4, 1), 7.0)):
        torch.testing.assert_close(R.attention_blocks_reference(qb, bias, k, v, 0.25, None), want)
    with pytest.raises(ValueError, match="blocks"):
        R.attention_blocks_reference(qb, torch.zeros(1, 4, 1), k, v, 0.25, 4)  # 9 tokens need 3 blocks of 4
