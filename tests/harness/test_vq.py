"""The vq schemes: the fixed grids (k-means of N(0, I) fitted the same way every time; E8's nearest point against
brute force, its Voronoi code round trip), stores against a float64 oracle written from the format's contract
(turned back, less the mean, rotated, normalized, the nearest grid point per group or E8's best scale, the
least-squares scale, restored), packed-only and simulated, bytes, and a tiny model through QuantizedKVCache against
an oracle cache."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from harness.cache import QuantizedKVCache
from harness.calibrate.pca import fit_pca_calibration, fit_table
from harness.models import load_model
from harness.schemes import get_scheme
from harness.schemes.grids import (
    E8_GENERATOR,
    E8_SCALES,
    E8_SHIFT,
    _fit_grid,
    e8_decode,
    e8_encode,
    kmeans_grid,
    nearest_e8,
)
from harness.schemes.pca_table import PcaCalibration, PcaLayer
from kernels import reference
from kernels.layout import FULL_WIDTH

B, D, R = 2, 32, 24


def theta() -> torch.Tensor:
    return 10000.0 ** (-torch.arange(R // 2, dtype=torch.float32) / (R // 2))


def rope(x: torch.Tensor, positions: torch.Tensor, sign: float, inv_freq: torch.Tensor) -> torch.Tensor:
    half = len(inv_freq)
    z = torch.complex(x[..., :half], x[..., half : 2 * half]) * torch.polar(
        torch.ones(len(positions), half, dtype=torch.float64),
        sign * positions.double()[:, None] * inv_freq.double(),
    )
    return torch.cat([z.real, z.imag, x[..., 2 * half :]], -1)


# ---------------------------------------------------------------------------------------------------------
# grids


def test_a_kmeans_grid_is_fitted_the_same_way_every_time_and_is_lloyds_fixed_point(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    kmeans_grid.cache_clear()
    try:
        grid = kmeans_grid(2, 2)  # written to the disk cache
        assert grid.shape == (16, 2) and torch.isfinite(grid).all()
        assert torch.equal(grid, torch.tensor(_fit_grid(2, 2), dtype=torch.float32))
        assert (tmp_path / "grids" / "kmeans-p2-b2-v1.npy").exists()
        kmeans_grid.cache_clear()
        assert torch.equal(kmeans_grid(2, 2), grid)  # read back
    finally:
        kmeans_grid.cache_clear()
    # on fresh normal samples: about the mean of what it codes (an N(0, I) quantizer)
    x = torch.randn(200_000, 2, generator=torch.Generator().manual_seed(0))
    index = ((x[:, None] - grid[None]) ** 2).sum(-1).argmin(1)
    for k in range(16):
        torch.testing.assert_close(x[index == k].mean(0), grid[k], atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match="no 4-dimensional grid at 3 bits"):
        kmeans_grid(4, 3)


def test_e8s_nearest_point_is_brute_forces():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 8, generator=g, dtype=torch.float64) * 2
    got = nearest_e8(x)
    offsets = torch.tensor(
        list(itertools.product([-1.0, 0.0, 1.0], repeat=8)), dtype=torch.float64
    )  # (6561, 8)
    for row, point in zip(x, got):
        candidates = torch.cat([torch.round(row) + offsets, torch.round(row - 0.5) + 0.5 + offsets])
        even = torch.remainder(candidates.sum(-1), 2) == 0
        candidates = candidates[even]  # D8 and D8 + 1/2 (the half-integer sums are integers: even ones)
        best = (candidates - row).square().sum(-1).min()
        assert (point - row).square().sum() <= best + 1e-12
        k = point @ torch.linalg.inv(E8_GENERATOR)
        assert torch.allclose(k, torch.round(k), atol=1e-9)  # a lattice point


@pytest.mark.parametrize("b", [2, 3, 4])
def test_e8s_voronoi_code_round_trips_and_stays_in_its_region(b):
    m = 1 << b
    g = torch.Generator().manual_seed(b)
    digits = torch.randint(0, m, (300, 8), generator=g)
    points = e8_decode(digits, b)  # (300, 8) float64
    assert torch.equal(e8_encode(points, b), digits)  # each digit string is one coset: 2**(8 b) points
    centred = points - E8_SHIFT.double()
    assert (nearest_e8(centred / m) == 0).all()  # inside the Voronoi region of m E8 around the origin
    y = torch.randn(300, 8, generator=g, dtype=torch.float64)
    code = e8_decode(e8_encode(y, b), b)
    lattice = nearest_e8(y - E8_SHIFT.double())
    coset = (code - E8_SHIFT.double() - lattice) / m  # in E8: the same coset as y's nearest point
    assert torch.allclose(nearest_e8(coset), coset, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------
# the store


def calibration(heads: int, seed: int = 0) -> tuple[torch.Tensor, PcaCalibration]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, heads, D, generator=g) * torch.logspace(-1, 0.5, D) + torch.linspace(-2, 3, D)
    turns = torch.zeros(D)
    turns[: R // 2], turns[R // 2 : R] = theta(), theta()
    return x, PcaCalibration((PcaLayer(fit_table(x), fit_table(x), turns),))


def oracle(x: torch.Tensor, positions: torch.Tensor, bits: list[int], layer: PcaLayer, role: str, p: int):
    """x (B, H, T, D) stored as vq stores it (p-dimensional grids, or E8 when p == 8), in float64 but for the
    grid's search; 16-bit heads unchanged."""
    out = x.double().clone()
    h_mat = reference.hadamard(x.shape[-1], "cpu").double()
    for h, w in enumerate(bits):
        if w == FULL_WIDTH:
            continue
        y = x[:, h].double().clamp(-65504, 65504)
        if role == "key":
            y = rope(y, positions, -1.0, layer.rotary_frequencies)
        r = (y - layer.role(role).mean[h].double()) @ h_mat  # (B, T, D)
        u = r / r.square().mean(-1, keepdim=True).sqrt()
        if p != 8:
            grid = kmeans_grid(p, w).double()
            groups = u.unflatten(-1, (-1, p))
            c = grid[((groups[..., None, :] - grid) ** 2).sum(-1).argmin(-1)].flatten(-2)
        else:
            best = None
            for t in E8_SCALES[w]:
                c_t = e8_decode(e8_encode((u / t).unflatten(-1, (-1, 8)), w), w).flatten(-2)
                s = (r * c_t).sum(-1, keepdim=True) / (c_t * c_t).sum(-1, keepdim=True)
                error = (r - s * c_t).square().sum(-1)
                if best is None:
                    best = (error, c_t)
                else:
                    better = (error < best[0])[..., None]
                    best = (torch.minimum(error, best[0]), torch.where(better, c_t, best[1]))
            c = best[1]
        scale = ((r * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True)).half().double()
        restored = (c * scale) @ h_mat + layer.role(role).mean[h].double()
        out[:, h] = rope(restored, positions, 1.0, layer.rotary_frequencies) if role == "key" else restored
    return out


def feed(store, x: torch.Tensor, chunks):
    start, got = 0, None
    for n in chunks:
        got = store.append(x[:, :, start : start + n])
        start += n
    return got


@pytest.mark.parametrize("name, bits", [("vq2", [3, 16, 2, 4]), ("vq4", [2, 16, 2]), ("vq8", [4, 16, 2, 3])])
@pytest.mark.parametrize("role", ["key", "value"])
def test_store_is_the_oracle_packed_and_simulated(name, bits, role):
    x0, cal = calibration(len(bits))
    g = torch.Generator().manual_seed(7)
    T = 29
    sample = x0[torch.randint(0, len(x0), (B * T,), generator=g)].view(B, T, -1, D).transpose(1, 2)
    sample = sample + 0.1 * torch.randn(sample.shape, generator=g)
    x = (rope(sample.double(), torch.arange(T), 1.0, theta()) if role == "key" else sample.double()).float()
    bound = get_scheme(name, residual=0).for_layer(0, cal)
    packed = bound.new_store(bits, D, B, torch.float32, "cpu", role)
    assert feed(packed, x, [1, 12, 16]) is None
    simulated = feed(bound.new_store(bits, D, B, torch.float32, "cpu", role, simulate=True), x, [1, 12, 16])
    got = packed.dequantize()
    torch.testing.assert_close(got, simulated, rtol=1e-5, atol=1e-5)
    want = oracle(x, torch.arange(T), bits, cal.layer(0), role, bound.dim)
    close = ((got.double() - want).abs() <= 2e-3 + 2e-3 * want.abs()).all(-1)  # (B, H, T)
    assert close.float().mean() > 0.97, (~close).nonzero()[:5]  # a group on a cell boundary may go either way
    assert torch.equal(got[:, 1], x[:, 1]) and (got[:, 0] != x[:, 0]).any()
    per_token = sum(bound.token_bytes(w, D, role) for w in bits)
    tables = sum(bound.table_bytes(w, D, role) for w in bits)
    assert packed.nbytes() == B * T * per_token + tables
    assert (
        tables == (len(bits) - 1) * D * 2 and bound.token_bytes(2, D, role) == reference.packed_dim(D, 2) + 2
    )


@pytest.mark.parametrize("name, bits", [("vq4", 2), ("vq8", 4)])
def test_the_grids_err_less_than_codebooks_scalar_levels(name, bits):
    """What a grid is for: on Gaussian vectors (no mean) fewer squared errors than codebook's Lloyd-Max levels at
    the same bytes (a 4-D grid at 2 bits, E8 at 4; module docstring of grids.py)."""
    x = torch.randn(1, 2, 2000, D, generator=torch.Generator().manual_seed(3))
    layer = PcaLayer(fit_table(torch.zeros(10, 2, D)), fit_table(torch.zeros(10, 2, D)), torch.zeros(D))
    errors = {}
    for scheme in (get_scheme(name).for_layer(0, PcaCalibration((layer,))), get_scheme("codebook")):
        store = scheme.new_store([bits, bits], D, 1, torch.float32, "cpu", "value")
        store.append(x)
        errors[scheme.name] = float((store.dequantize() - x).square().sum())
    assert errors[name] < 0.95 * errors["codebook"], errors


@torch.no_grad()
def test_tiny_model_through_the_cache_is_the_oracle():
    model = load_model("tiny-llama")[0]
    g = torch.Generator().manual_seed(12)
    cal = fit_pca_calibration(model, torch.randint(0, 256, (8, 40), generator=g))
    ids = torch.randint(0, 256, (2, 21), generator=g)

    class OracleCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            start = self.get_seq_length(layer_idx) if self.layers and len(self.layers) > layer_idx else 0
            positions = torch.arange(start, start + key_states.shape[2])
            heads = [3] * key_states.shape[1]
            layer = cal.layer(layer_idx)
            keys = oracle(key_states, positions, heads, layer, "key", 2)
            values = oracle(value_states, positions, heads, layer, "value", 2)
            sink = positions == 0
            keys[:, :, sink], values[:, :, sink] = (
                key_states[:, :, sink].double(),
                value_states[:, :, sink].double(),
            )
            return super().update(keys.float(), values.float(), layer_idx, *args, **kwargs)

    def logits(cache):
        return torch.cat(
            [model(input_ids=ids[:, a:b], past_key_values=cache).logits for a, b in ((0, 9), (9, 21))], 1
        )

    exact = logits(DynamicCache(config=model.config))
    cache = QuantizedKVCache(
        model.config, 3, scheme="vq2", prefill="quantized", key_calibration=cal, sink_tokens=1
    )
    from harness.attention import PACKED, installed

    with installed(model, PACKED):
        got = logits(cache)
    want = logits(OracleCache(config=model.config))
    assert (got - want).abs().amax() <= 5e-3 * exact.abs().amax()
    assert (got - exact).abs().amax() > 0
    assert np.isfinite(cache.nbytes())
