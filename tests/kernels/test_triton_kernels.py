"""Triton kernels (kernels/quantize.py, kernels/decode_attention.py) against the torch oracle.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before
anything imports triton, so the shapes are small); the same tests marked `gpu` run compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.decode_attention import decode_attention
from kernels.layout import PackedStore
from kernels.quantize import quantize_into

B, T, HQ = 2, 63, 6


def _inputs(shape: tuple[int, ...], g: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Random values with the edge cases of the format: a constant group (scale 0), values past the fp16
    range (clamped), a group of tiny values (fp16-subnormal scale)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 3
    x[0, 0, 0, :g] = 1.5
    x[0, -1, 1, :g] = 7e4
    x[-1, 0, 2, g : 2 * g] *= 1e-6
    return x.to(dtype).to(device)


def _fill_garbage(st: PackedStore) -> None:
    """Every element a kernel must write (or must not read) starts as garbage that a check would catch."""
    st.payload.fill_(0xA5)
    st.scale.fill_(float("nan"))
    if st.zero is not None:
        st.zero.fill_(float("nan"))
    st.full.fill_(float("nan"))


@pytest.mark.parametrize(
    "bits, head_dim, group_size, symmetric, dtype",
    [
        ((2, 4, 16), 64, 32, False, torch.float32),
        ((2, 4, 16), 64, 32, True, torch.float32),
        ((2, 4, 16), 96, 32, False, torch.float32),
        ((4, 16, 2), 96, 16, True, torch.float32),
        ((3, 8, 16), 96, 32, False, torch.bfloat16),
        ((8, 3, 2), 64, 64, True, torch.float16),
    ],
)
def test_quantize_bit_exact(device, bits, head_dim, group_size, symmetric, dtype):
    pos, tn = 5, T  # tokens land at [5, 68): several token blocks, a non-zero start
    x = _inputs((B, len(bits), tn, head_dim), group_size, dtype, device, seed=head_dim + len(bits))
    kw = dict(
        head_dim=head_dim, batch=B, group_size=group_size, symmetric=symmetric, dtype=dtype, device=device
    )
    ref = PackedStore(bits, capacity=80, **kw)
    ref.append(torch.zeros(B, len(bits), pos, head_dim, dtype=dtype, device=device), keep_dequantized=False)
    ref.append(x, keep_dequantized=False)
    st = PackedStore(bits, capacity=80, **kw)
    _fill_garbage(st)
    quantize_into(st, x, pos)

    new = slice(pos, pos + tn)
    assert torch.equal(st.payload[:, new], ref.payload[:, new])
    # Compare fp16 bit patterns so that -0.0 vs 0.0 or a NaN left unwritten is caught.
    assert torch.equal(st.scale[:, :, new].view(torch.int16), ref.scale[:, :, new].view(torch.int16))
    if not symmetric:
        assert torch.equal(st.zero[:, :, new].view(torch.int16), ref.zero[:, :, new].view(torch.int16))
    assert torch.equal(st.full[:, :, new], ref.full[:, :, new])
    # Nothing outside [pos, pos + Tn) was written.
    assert (st.payload[:, :pos] == 0xA5).all() and (st.payload[:, pos + tn :] == 0xA5).all()
    assert st.scale[:, :, :pos].isnan().all() and st.scale[:, :, pos + tn :].isnan().all()
    assert st.full[:, :, :pos].isnan().all() and st.full[:, :, pos + tn :].isnan().all()


def test_quantize_rejects_unsupported_group_size():
    st = PackedStore((4, 4), head_dim=96, batch=1, group_size=48)
    x = torch.zeros(1, 2, 1, 96)
    with pytest.raises(NotImplementedError, match="group_size: 48"):
        quantize_into(st, x, 0)


def _stores(k_bits, v_bits, head_dim, group_size, symmetric, device, seed):
    """K and V stores filled through the torch path, with NaN/garbage capacity past `length`."""
    gen = torch.Generator().manual_seed(seed)
    stores = []
    for bits, sym in ((k_bits, symmetric), (v_bits, not symmetric)):
        st = PackedStore(
            bits, head_dim, B, group_size=group_size, symmetric=sym, device=device, capacity=T + 9
        )
        _fill_garbage(st)
        st.append(torch.randn(B, len(bits), T, head_dim, generator=gen).to(device), keep_dequantized=False)
        stores.append(st)
    return stores


@pytest.mark.parametrize(
    "k_bits, v_bits, head_dim, group_size, symmetric, q_dtype, n_extra",
    [
        ((2, 4, 16), (4, 16, 2), 64, 32, False, torch.float32, 5),
        ((2, 4, 16), (4, 16, 2), 64, 32, True, torch.float32, 5),
        ((2, 4, 16), (16, 2, 4), 96, 32, False, torch.float32, 0),
        ((3, 8, 16), (8, 2, 3), 96, 32, True, torch.float32, 17),
        ((4, 2, 16), (2, 4, 8), 128, 64, False, torch.float16, 5),
    ],
)
def test_decode_attention(device, k_bits, v_bits, head_dim, group_size, symmetric, q_dtype, n_extra):
    ks, vs = _stores(k_bits, v_bits, head_dim, group_size, symmetric, device, seed=head_dim)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, HQ, head_dim, generator=gen).to(device=device, dtype=q_dtype)
    kx = torch.randn(B, 3, n_extra, head_dim, generator=gen).to(device=device, dtype=q_dtype)
    vx = torch.randn(B, 3, n_extra, head_dim, generator=gen).to(device=device, dtype=q_dtype)
    sm_scale = head_dim**-0.5

    keys = torch.cat([ks.dequantize(), kx.float()], dim=2)  # (B, Hkv, T + Tx, D)
    values = torch.cat([vs.dequantize(), vx.float()], dim=2)
    ref = reference.attention_reference(q[:, :, None], keys, values, sm_scale)[:, :, 0]  # (B, Hq, D) float64

    bound = 1e-3 if q_dtype == torch.float32 else 1e-2
    outs = []
    for num_splits in (1, 3):
        out = torch.full((B, HQ, head_dim), float("nan"), dtype=q_dtype, device=device)
        extra = dict(k_extra=kx, v_extra=vx) if n_extra else {}
        decode_attention(q, ks, vs, sm_scale, num_splits=num_splits, out=out, block_n=16, **extra)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < bound, (num_splits, err)
        outs.append(out.double())
    torch.testing.assert_close(outs[0], outs[1], rtol=bound, atol=bound)


def test_decode_attention_extra_only(device):
    """An empty store with an extra segment attends to the extra tokens alone."""
    ks = PackedStore((4, 16), 64, 1, device=device)
    vs = PackedStore((2, 16), 64, 1, device=device)
    gen = torch.Generator().manual_seed(2)
    q, kx, vx = (torch.randn(s, generator=gen).to(device) for s in ((1, 4, 64), (1, 2, 7, 64), (1, 2, 7, 64)))
    out = decode_attention(q, ks, vs, 0.125, k_extra=kx, v_extra=vx)
    ref = reference.attention_reference(q[:, :, None], kx, vx, 0.125)[:, :, 0]
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3
