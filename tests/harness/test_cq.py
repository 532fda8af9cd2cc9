"""The cq schemes (coupled quantization): the k-means codebooks (Lloyd's fixed point, the exact codebook when a
group has as many distinct vectors as centroids), the frame, stores against a float64 oracle written from the
format's contract (turned back, each channel group to its nearest centroid, turned forward), packed-only and
simulated, bytes with the codebooks counted, and a tiny model's fit from its calibration windows through
QuantizedKVCache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.calibrate.cq import cached_cq_calibration, fit_codebooks, fit_cq_calibration, fit_table
from harness.calibrate.windows import calibration_vectors, rotary_frequencies, unturn
from harness.models import load_model
from harness.schemes import get_scheme
from harness.schemes.cq_table import CQ_WIDTHS, CqCalibration, CqLayer
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


def test_codebooks_are_the_vectors_when_a_group_has_as_many_as_centroids():
    values = torch.randn(16, 2, generator=torch.Generator().manual_seed(0)) * 3  # 16 distinct pairs
    x = torch.cat([values, values[torch.randint(0, 16, (300,))]]).repeat(1, 4)  # (316, 8): 4 groups alike
    books = fit_codebooks(x, 2, 2)  # (4, 16, 2)
    want = torch.tensor(sorted(map(tuple, values.tolist())))
    for g in range(4):
        torch.testing.assert_close(
            torch.tensor(sorted(map(tuple, books[g].tolist()))), want, atol=1e-5, rtol=0
        )


def test_codebooks_are_lloyds_fixed_point():
    """Each centroid the mean of the vectors nearest to it (elementwise, in float64), once settled."""
    x = torch.randn(3000, 8, generator=torch.Generator().manual_seed(1)) * torch.tensor([1.0, 0.1] * 4)
    books = fit_codebooks(x, 2, 2).double()  # (4, 16, 2)
    groups = x.double().view(-1, 4, 2)
    for g in range(4):
        nearest = ((groups[:, g, None] - books[g][None]) ** 2).sum(-1).argmin(-1)
        for k in nearest.unique():
            torch.testing.assert_close(groups[nearest == k, g].mean(0), books[g, k], atol=2e-2, rtol=2e-2)


def calibration(heads: int, channels: int, seed: int = 0) -> tuple[torch.Tensor, CqCalibration]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(400, heads, D, generator=g) * torch.logspace(-1, 0.5, D) + torch.linspace(-2, 3, D)
    turns = torch.zeros(D)
    turns[: R // 2], turns[R // 2 : R] = theta(), theta()
    table = fit_table(x, channels)
    return x, CqCalibration((CqLayer(table, table, turns),), channels)


def oracle(x, positions, bits, layer: CqLayer, role: str, channels: int) -> torch.Tensor:
    out = x.double().clone()
    for h, w in enumerate(bits):
        if w == FULL_WIDTH:
            continue
        y = x[:, h].double().clamp(-65504, 65504)
        if role == "key":
            y = rope(y, positions, -1.0, layer.rotary_frequencies)
        books = layer.role(role).codebooks[w][h].double()  # (G, K, c)
        groups = y.unflatten(-1, (-1, channels))  # (B, T, G, c)
        index = ((groups[..., None, :] - books) ** 2).sum(-1).argmin(-1)  # (B, T, G)
        restored = books[torch.arange(books.shape[0]), index].flatten(-2)
        out[:, h] = rope(restored, positions, 1.0, layer.rotary_frequencies) if role == "key" else restored
    return out


@pytest.mark.parametrize("name, bits", [("cq2", [3, 16, 2, 3]), ("cq4", [2, 16, 2])])
@pytest.mark.parametrize("role", ["key", "value"])
def test_store_is_the_oracle_packed_and_simulated(name, bits, role):
    channels = get_scheme(name).channels
    x0, cal = calibration(len(bits), channels)
    g = torch.Generator().manual_seed(7)
    T = 23
    sample = x0[torch.randint(0, len(x0), (B * T,), generator=g)].view(B, T, -1, D).transpose(1, 2)
    sample = sample + 0.1 * torch.randn(sample.shape, generator=g)
    x = (rope(sample.double(), torch.arange(T), 1.0, theta()) if role == "key" else sample.double()).float()
    bound = get_scheme(name, residual=0).for_layer(0, cal)
    packed = bound.new_store(bits, D, B, torch.float32, "cpu", role)
    start = 0
    for n in (1, 10, 12):
        assert packed.append(x[:, :, start : start + n]) is None
        start += n
    simulated = bound.new_store(bits, D, B, torch.float32, "cpu", role, simulate=True)
    simulated.append(x)
    got = packed.dequantize()
    torch.testing.assert_close(got, simulated.dequantize(), rtol=1e-5, atol=1e-5)
    want = oracle(x, torch.arange(T), bits, cal.layer(0), role, channels)
    close = ((got.double() - want).abs() <= 1e-3 + 1e-3 * want.abs()).all(-1)
    assert close.float().mean() > 0.97, (~close).nonzero()[:5]  # a group halfway between centroids: either
    assert torch.equal(got[:, 1], x[:, 1]) and (got[:, 0] != x[:, 0]).any()
    books = sum(bound.table_bytes(w, D, role) for w in bits)
    assert books == sum(D * (1 << (channels * w)) * 2 for w in bits if w != FULL_WIDTH)
    assert packed.nbytes() == B * T * sum(bound.token_bytes(w, D, role) for w in bits) + books


def test_widths_the_frame_and_an_unbound_scheme():
    assert get_scheme("cq2").widths == CQ_WIDTHS[2] == (2, 3) and get_scheme("cq4").widths == (2,)
    _, cal = calibration(2, 2)
    back = CqCalibration.from_frame(cal.to_frame(), 1, 2)
    assert back.digest() == cal.digest() and torch.equal(back.layer(0).turn, cal.layer(0).turn)
    for w in CQ_WIDTHS[2]:
        assert torch.equal(back.layer(0).key.codebooks[w], cal.layer(0).key.codebooks[w])
    with pytest.raises(ValueError, match="^quant.scheme: cq4 codes channel groups against codebooks"):
        get_scheme("cq4").for_layer(0, cal)  # fitted for pairs, not groups of 4
    with pytest.raises(
        ValueError,
        match=r"^policy.widths: \[4\] with quant.scheme cq2, which stores quantized heads at 2, 3 bits",
    ):
        get_scheme("cq2").check_widths([4])


@torch.no_grad()
def test_a_tiny_models_fit_reads_its_calibration_windows_and_runs_through_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model = load_model("tiny-llama")[0]
    g = torch.Generator().manual_seed(12)
    calib = torch.randint(0, 256, (6, 40), generator=g)
    cal = cached_cq_calibration(model, "tiny-llama", calib, 2)
    assert cal.digest() == fit_cq_calibration(model, calib, 2).digest()
    keys, values, positions = calibration_vectors(model, calib)[1]
    before_rope = unturn(keys, positions, rotary_frequencies(model, "full_attention"))
    assert torch.equal(cal.layer(1).key.codebooks[2], fit_table(before_rope, 2).codebooks[2])
    assert torch.equal(cal.layer(1).value.codebooks[3], fit_table(values, 2).codebooks[3])
    ids = torch.randint(0, 256, (2, 19), generator=g)
    exact = model(input_ids=ids, past_key_values=DynamicCache(config=model.config)).logits
    options = dict(scheme="cq2", prefill="quantized", key_calibration=cal, sink_tokens=1)
    with installed(model, PACKED):
        packed = model(input_ids=ids, past_key_values=QuantizedKVCache(model.config, 3, **options)).logits
    simulated = model(
        input_ids=ids, past_key_values=QuantizedKVCache(model.config, 3, simulate=True, **options)
    ).logits
    assert (packed - simulated).abs().amax() <= 1e-3 * exact.abs().amax()
    assert (simulated - exact).abs().amax() > 0
