"""kernels/quantize.py's quantize_codes_into (the codes-only write kernel) against torch: searchsorted over the same
boundaries, packed by PackedStore.append_codes (kernels.reference.pack), bit for bit.

Without CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, tests/conftest.py); marked `gpu`
runs compile it on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from harness.schemes.pca_table import LLOYD, UNIFORM, level_tables
from kernels.layout import PackedStore
from kernels.quantize import quantize_codes_into


def _components(
    shape: tuple[int, ...], bounds: torch.Tensor, bits, scale: torch.Tensor, seed: int
) -> torch.Tensor:
    """Random components (B, H, T, D) float32 whose quotients by `scale` cover every cell of each head's width, with
    the cases a search can get wrong: quotients exactly on a boundary (its lower cell), a float32 step either side
    of one, and far beyond the outermost levels both ways."""
    gen = torch.Generator().manual_seed(seed)
    B, H, T, D = shape
    y = torch.randn(shape, generator=gen) * 2
    for h, w in enumerate(bits):
        edges = bounds[w, : (1 << w) - 1]
        pick = edges[torch.randint(len(edges), (B, T, 8), generator=gen)]
        y[:, h, :, :8] = pick  # on a boundary
        y[:, h, :, 8:16] = torch.nextafter(pick, torch.tensor(float("inf")))
        y[:, h, :, 16:24] = torch.nextafter(pick, torch.tensor(float("-inf")))
    y[0, :, 0, -2:] = torch.tensor([1e30, -1e30])
    # z = y * scale rounds, so quotients of the kernel's and torch's division both come from z, not y
    return (y * scale[None, :, None]).contiguous()


def _torch_codes(z: torch.Tensor, scale: torch.Tensor, bounds: torch.Tensor, bits) -> torch.Tensor:
    """The oracle: per head, searchsorted (side left) of z / scale over its width's boundaries."""
    codes = torch.empty(z.shape, dtype=torch.int64)
    for h, w in enumerate(bits):
        y = (z[:, h] / scale[h]).contiguous()
        codes[:, h] = torch.searchsorted(bounds[w, : (1 << w) - 1].contiguous(), y, side="left")
    return codes


@pytest.mark.parametrize(
    "bits, head_dim, kind, tn, pos",
    [
        ((2, 4, 3, 8), 64, UNIFORM, 37, 5),
        ((8, 3, 3, 2, 4), 96, UNIFORM, 1, 16),  # one decode token, at a token block's start
        ((4, 2), 32, LLOYD, 19, 0),  # uneven boundaries: the search is not a step count
    ],
)
def test_codes_are_searchsorted_and_packed_bit_for_bit(device, bits, head_dim, kind, tn, pos):
    B = 2
    gen = torch.Generator().manual_seed(head_dim + tn)
    scale = (torch.rand(len(bits), head_dim, generator=gen) + 0.05).to(torch.float16).float()
    _, bounds = level_tables(torch.device("cpu"), kind)
    z = _components((B, len(bits), tn, head_dim), bounds, bits, scale, seed=tn)
    want = PackedStore(bits, head_dim, B, device=device, capacity=64, codes_only=True, simulate=False)
    want.length = pos
    want.append_codes(_torch_codes(z, scale, bounds, bits).to(device))
    got = PackedStore(bits, head_dim, B, device=device, capacity=64, codes_only=True, simulate=False)
    for bk in got.buckets:
        bk.payload.fill_(0xA5)  # garbage a missed or stray write shows
    # z as a strided view (the kernel takes any strides)
    z_view = z.to(device).transpose(1, 2).contiguous().transpose(1, 2)
    quantize_codes_into(got, z_view, pos, scale.to(device), bounds.to(device))
    for g, w in zip(got.buckets, want.buckets, strict=True):
        assert torch.equal(g.payload[:, :, pos : pos + tn], w.payload[:, :, pos : pos + tn]), g.width
        assert (g.payload[:, :, :pos] == 0xA5).all() and (g.payload[:, :, pos + tn :] == 0xA5).all()


def test_codes_at_a_device_side_position(device):
    """pos as a one-element tensor (a CUDA graph's decode step) writes where an int would."""
    bits, D, B = (4, 2, 8), 64, 3
    scale = torch.full((3, D), 0.5)
    _, bounds = level_tables(torch.device("cpu"), UNIFORM)
    z = _components((B, 3, 1, D), bounds, bits, scale, seed=3).to(device)
    stores = [
        PackedStore(bits, D, B, device=device, capacity=32, codes_only=True, simulate=False) for _ in "ab"
    ]
    quantize_codes_into(stores[0], z, 17, scale.to(device), bounds.to(device))
    quantize_codes_into(stores[1], z, torch.tensor([17], device=device), scale.to(device), bounds.to(device))
    for a, b in zip(stores[0].buckets, stores[1].buckets, strict=True):
        assert torch.equal(a.payload[:, :, 17], b.payload[:, :, 17]) and a.payload[:, :, 17].any()


def test_codes_refuse_a_store_of_values_and_a_position_past_capacity():
    _, bounds = level_tables(torch.device("cpu"), UNIFORM)
    z, scale = torch.zeros(1, 1, 4, 32), torch.ones(1, 32)
    values = PackedStore((4,), 32, 1, capacity=16)
    with pytest.raises(ValueError, match="codes need codes_only=True"):
        quantize_codes_into(values, z, 0, scale, bounds)
    codes = PackedStore((4,), 32, 1, capacity=16, codes_only=True, simulate=False)
    with pytest.raises(ValueError, match="exceeds capacity 16"):
        quantize_codes_into(codes, z, 13, scale, bounds)
