"""The pca scheme: rows of bits of mixed widths (bitstream) against kernels.reference's packing and a bit-by-bit
oracle; the plan's dynamic program against brute force; the fit (basis, scale, plans) against what they must be;
its stores against a float64 oracle written from the format's contract (turned back at each token's position,
projected, each component to its width's Lloyd-Max level times its scale, restored, turned forward), packed-only
and simulated; positions, bytes, tiny models through QuantizedKVCache, the fit read from the calibration windows
only, and a tiny run through the runner."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.calibrate.pca import (
    SCALE_ITERATIONS,
    _fitted_scale,
    cached_pca_calibration,
    fit_components,
    fit_head,
    fit_pca_calibration,
    fit_table,
    plan_bits,
    plan_groups,
    plans_for,
)
from harness.calibrate.windows import calibration_vectors, rotary_frequencies, unturn
from harness.config import base_point
from harness.config import compose as compose_point
from harness.models import load_model
from harness.run import runner
from harness.run.measure import key_calibration
from harness.schemes import SCHEMES, Pca, bitstream, get_scheme
from harness.schemes.lloyd_max import lloyd_max, uniform_quantizer
from harness.schemes.pca import GROUP_WIDTHS
from harness.schemes.pca_fold import foldable
from harness.schemes.pca_table import (
    LLOYD,
    MAX_COMPONENT_BITS,
    PCA_FORMAT,
    PCA_WIDTHS,
    QUANTIZERS,
    SCALE_MIN,
    UNIFORM,
    PcaCalibration,
    PcaFormat,
    PcaLayer,
    component_values,
    level_tables,
    own_channels,
    quantize_codes,
)
from harness.schemes.rotary import POSITION_BYTES
from kernels import reference
from kernels.layout import FULL_WIDTH

B, D, R = 3, 32, 24  # batch, head_dim, the channels RoPE turns (the last 8 are not turned)
BITS = [3, 16, 1, 4, 6, 2]  # heads at their widths, a 16-bit head among them


def theta() -> torch.Tensor:
    return 10000.0 ** (-torch.arange(R // 2, dtype=torch.float32) / (R // 2))


def rope(x: torch.Tensor, positions: torch.Tensor, sign: float = 1.0, inv_freq: torch.Tensor | None = None):
    """x (..., T, D) float64 with pairs (i, i + R / 2) turned by sign * positions (T,) * inv_freq (R / 2,) (default
    theta()) in complex float64; channels past R unchanged."""
    inv_freq = theta() if inv_freq is None else inv_freq
    half = len(inv_freq)
    z = torch.complex(x[..., :half], x[..., half : 2 * half]) * torch.polar(
        torch.ones(len(positions), half, dtype=torch.float64),
        sign * positions.double()[:, None] * inv_freq.double(),
    )
    return torch.cat([z.real, z.imag, x[..., 2 * half :]], -1)


def correlated(n: int, heads: int, seed: int, mixing: int) -> torch.Tensor:
    """(n, heads, D) vectors drawn with `seed` from one distribution per `mixing`: correlated channels of decaying
    variance and an offset."""
    mix = torch.randn(heads, D, D, generator=torch.Generator().manual_seed(mixing)) / D**0.5
    z = torch.randn(n, heads, D, generator=torch.Generator().manual_seed(seed)) * torch.logspace(0.5, -2, D)
    return torch.einsum("nhc,hcd->nhd", z, mix) + torch.linspace(-1, 2, D)


def calibration(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, PcaCalibration]:
    """Pre-RoPE keys and values (N, H, D) and one layer's transforms fitted on them (keys turned: R channels)."""
    keys, values = correlated(400, len(BITS), seed, mixing=0), correlated(400, len(BITS), seed + 1, mixing=1)
    turns = torch.zeros(D)
    turns[: R // 2], turns[R // 2 : R] = theta(), theta()
    return keys, values, PcaCalibration((PcaLayer(fit_table(keys), fit_table(values), turns),))


def feed(store, x: torch.Tensor, chunks) -> torch.Tensor | None:
    start, got = 0, None
    for n in chunks:
        got = store.append(x[:, :, start : start + n])
        start += n
    assert start == x.shape[2]
    return got


def frame_positions(positions: torch.Tensor, key_frame: str, block: int, first: int) -> torch.Tensor:
    """Where a key at each of `positions` is turned back to, by hand: itself before RoPE, 0 after it, the first
    position of its block of `block` counted from `first`."""
    if key_frame == "pre":
        return positions
    if key_frame == "post":
        return torch.zeros_like(positions)
    return torch.tensor([first + (int(p) - first) // block * block for p in positions])


def oracle(
    x: torch.Tensor,
    positions: torch.Tensor,
    bits: list[int],
    layer: PcaLayer,
    role: str,
    fmt: PcaFormat = PCA_FORMAT,
    first: int = 0,
    outliers: int = 0,
    kept: torch.dtype = torch.float16,
) -> torch.Tensor:
    """x (B, H, T, D) at `positions` (T,) stored as the pca family stores `role` in format `fmt` (its key frame
    from the store's `first` position, its levels), head h at bits[h], in float64 from the format's contract;
    16-bit heads unchanged. With `outliers` k: each token's k components of largest |z - zq| keep z rounded to
    `kept`."""
    table = layer.role(role)
    quantizer = {"lloyd": lloyd_max, "uniform": uniform_quantizer}[fmt.levels]
    turned = frame_positions(positions, fmt.key_frame, fmt.block, first)
    out = x.double().clone()
    for h, w in enumerate(bits):
        if w == FULL_WIDTH:
            continue
        y = x[:, h].double().clamp(-65504, 65504)
        own = own_channels(len(layer.rotary_frequencies), fmt.own_pairs)  # turned by their own positions
        if role == "key":
            y, unturned = rope(y, turned, -1.0, layer.rotary_frequencies), y
            y[..., own] = rope(unturned, positions, -1.0, layer.rotary_frequencies)[..., own]
        mean, basis = table.mean[h].double(), table.basis[h].double()
        z = (y - mean) @ basis  # (B, T, D)
        plan, scale = table.plans[w][h].long(), table.scales[w][h].double()
        zq = torch.zeros_like(z)
        for c in range(D):
            if plan[c] == 0:
                continue
            q = quantizer(int(plan[c]))
            levels = torch.tensor(q.levels, dtype=torch.float64)
            code = torch.bucketize(z[..., c] / scale[c], torch.tensor(q.boundaries, dtype=torch.float64))
            zq[..., c] = levels[code] * scale[c]
        if outliers:
            index = (z - zq).abs().topk(outliers, -1).indices  # (B, T, k)
            zq.scatter_(-1, index, z.gather(-1, index).to(kept).double())
        restored = mean + zq @ basis.T
        out[:, h] = restored
        if role == "key":
            out[:, h] = rope(restored, turned, 1.0, layer.rotary_frequencies)
            out[:, h, ..., own] = rope(restored, positions, 1.0, layer.rotary_frequencies)[..., own]
    return out


# ---------------------------------------------------------------------------------------------------------
# bit rows


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_uniform_rows_are_kernels_reference_packing(bits):
    codes = torch.randint(0, 1 << bits, (2, 3, 5, 64))
    lay = bitstream.layout(torch.full((3, 64), bits))
    assert lay.width == bits
    packed = bitstream.pack_bits(codes, lay)  # the general path gives the reference's rows
    assert torch.equal(packed, reference.pack(codes.to(torch.uint8), bits))
    assert torch.equal(bitstream.unpack_bits(packed, lay), codes)
    assert torch.equal(bitstream.pack(codes, lay), packed)  # and so does the path through the reference
    assert torch.equal(bitstream.unpack(packed, lay), codes)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.sampled_from([8, 16, 24, 40]))
def test_rows_of_mixed_widths_are_the_bits_in_order(seed, heads, dim):
    """Each head's own widths (0 to 8, one total a multiple of 8): every bit where the layout says, round trip."""
    g = torch.Generator().manual_seed(seed)
    total = 8 * int(torch.randint(0, dim + 1, (1,), generator=g))
    widths = torch.stack([torch.tensor(plan(total, dim, g)) for _ in range(heads)])  # (H, D)
    codes = torch.randint(0, 256, (2, heads, 3, dim), generator=g) % (1 << widths)[None, :, None]
    lay = bitstream.layout(widths)
    packed = bitstream.pack(codes, lay)
    assert packed.shape == (2, heads, 3, total // 8) and lay.nbytes == total // 8
    for h in range(heads):  # the oracle: the row's bits one by one, element by element, LSB first
        row = [(int(c) >> i) & 1 for c, w in zip(codes[1, h, 2], widths[h]) for i in range(int(w))]
        got = [(int(byte) >> i) & 1 for byte in packed[1, h, 2] for i in range(8)]
        assert got == row
    assert torch.equal(bitstream.unpack(packed, lay), torch.where(widths[None, :, None] > 0, codes, 0))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.sampled_from([8, 16]), st.integers(1, 6))
def test_rows_of_byte_aligned_runs_are_read_run_by_run_as_bit_by_bit(seed, heads, group, groups):
    """A plan shared by every head, in groups of `group` elements at widths 0 to 8 (a grouped pca plan): pack and
    unpack go run by run (Layout.runs) and give the element-at-a-time path's rows and codes."""
    g = torch.Generator().manual_seed(seed)
    options = torch.arange(9)
    row = options[torch.randint(0, len(options), (groups,), generator=g)].repeat_interleave(group)
    widths = row.expand(heads, -1)  # (H, D)
    codes = torch.randint(0, 256, (2, heads, 3, len(row)), generator=g) % (1 << widths)[None, :, None]
    lay = bitstream.layout(widths)
    assert lay.runs is not None and sum(end - first for first, end, *_ in lay.runs) == len(row)
    packed = bitstream.pack(codes, lay)
    assert torch.equal(packed, bitstream.pack_bits(codes, lay))
    assert torch.equal(bitstream.unpack(packed, lay), bitstream.unpack_bits(packed, lay))
    assert torch.equal(bitstream.unpack(packed, lay), torch.where(widths[None, :, None] > 0, codes, 0))


def test_runs_are_only_whole_bytes_of_one_plan():
    assert bitstream.layout(torch.tensor([[4, 4, 2, 2, 2, 2]])).runs == ((0, 2, 0, 1, 4), (2, 6, 1, 2, 2))
    assert bitstream.layout(torch.tensor([[3, 5]])).runs is None  # runs that cut bytes
    assert bitstream.layout(torch.tensor([[4, 4], [8, 0]])).runs is None  # heads with their own widths
    assert bitstream.layout(torch.tensor([[3] * 4 + [6] * 2])).runs is None  # 3 bits in a run short of 8
    assert bitstream.layout(torch.tensor([[5] * 8 + [4] * 2])).runs == ((0, 8, 0, 5, 5), (8, 10, 5, 6, 4))
    assert bitstream.layout(torch.tensor([[6] * 4 + [7] * 8])).runs is None  # 6 bits in a run short of 8


def plan(total: int, dim: int, g: torch.Generator) -> list[int]:
    """Random widths 0..8 of `dim` elements summing to `total`."""
    widths = [0] * dim
    for _ in range(total):
        free = [i for i in range(dim) if widths[i] < MAX_COMPONENT_BITS]
        widths[free[int(torch.randint(0, len(free), (1,), generator=g))]] += 1
    return widths


def test_a_layout_must_hold_whole_bytes_alike():
    with pytest.raises(ValueError, match="whole number of bytes"):
        bitstream.layout(torch.tensor([[3, 4], [4, 4]]))
    with pytest.raises(ValueError, match=r"each in \[0, 8\]"):
        bitstream.layout(torch.tensor([[9, 7]]))


# ---------------------------------------------------------------------------------------------------------
# the fit


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([LLOYD, UNIFORM]), st.floats(0.0, 0.6))
def test_codes_are_the_levels_cells_ties_to_the_lower_level(seed, kind, on_boundary):
    """quantize_codes at every width 0-8 (evenly spaced levels: found without a search) against a search of the
    boundaries, with a share of the components on a boundary (to the rounding of z / scale; a tie goes to the lower
    level) and some far outside the levels at both ends; component_values of those codes against the level times
    the scale."""
    g = torch.Generator().manual_seed(seed)
    H, T, D = 3, 11, 24
    bits = torch.randint(0, MAX_COMPONENT_BITS + 1, (H, D), generator=g)
    scale = torch.rand(H, D, generator=g) + 0.05
    levels, bounds = level_tables(torch.device("cpu"), kind)
    y = torch.randn(2, H, T, D, generator=g) * 2.5  # in units of the scale
    cell = torch.randint(0, 255, y.shape, generator=g) % ((1 << bits) - 1).clamp(min=1)[None, :, None]
    edge = bounds[bits[None, :, None].expand_as(cell), cell]  # a boundary of the component's width
    pick = (torch.rand(y.shape, generator=g) < on_boundary) & (bits > 0)[None, :, None]
    y = torch.where(pick, edge, y)
    y[0, :, 0] = 1e6
    y[0, :, 1] = -1e6
    z = y * scale[None, :, None]
    got = quantize_codes(z, bits, scale, kind)
    want = torch.empty_like(got)
    for h, c in itertools.product(range(H), range(D)):
        cells = bounds[bits[h, c], : (1 << bits[h, c]) - 1]
        want[:, h, :, c] = torch.searchsorted(cells, (z[:, h, :, c] / scale[h, c]).contiguous(), side="left")
    assert torch.equal(got, want)
    values = component_values(got, bits, scale, kind)
    expected = torch.where(
        bits[None, :, None] > 0, levels[bits[None, :, None], got] * scale[None, :, None], 0.0
    )
    assert torch.equal(values, expected)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 5), st.integers(0, 3))
def test_the_plan_is_the_least_distortion_brute_force_finds(seed, dim, options):
    g = torch.Generator().manual_seed(seed)
    distortion = torch.rand(dim, options + 1, generator=g, dtype=torch.float64)
    total = int(torch.randint(0, dim * options + 1, (1,), generator=g))
    bits = plan_bits(distortion, total)
    assert int(bits.sum()) == total
    best = min(
        float(sum(distortion[c, b] for c, b in enumerate(combo)))
        for combo in np.ndindex(*([options + 1] * dim))
        if sum(combo) == total
    )
    assert float(distortion[torch.arange(dim), bits].sum()) == pytest.approx(best)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([1, 2, 3, 4, 8, 12, 16]), st.sampled_from([2, 4, 16]))
def test_a_grouped_plan_is_the_least_distortion_over_whole_groups_of_allowed_widths(seed, dim, group):
    g = torch.Generator().manual_seed(seed)
    fmt = PcaFormat(group=group, group_widths=GROUP_WIDTHS)
    size = fmt.group_at(dim)  # a quarter of the head at most
    assert size == min(group, max(dim // 4, 1))
    groups = dim // size
    assume(groups <= 4)  # the brute force below tries every plan
    distortion = torch.rand(dim, MAX_COMPONENT_BITS + 1, generator=g, dtype=torch.float64)
    picks = torch.randint(0, len(GROUP_WIDTHS), (groups,), generator=g)
    total = size * sum(GROUP_WIDTHS[i] for i in picks.tolist())  # a total some grouped plan reaches
    bits = plan_groups(distortion, total, fmt)
    assert int(bits.sum()) == total
    per_group = bits.view(groups, size)
    assert (per_group == per_group[:, :1]).all() and set(per_group[:, 0].tolist()) <= set(GROUP_WIDTHS)
    cost = lambda combo: sum(
        float(distortion[i * size : (i + 1) * size, b].sum()) for i, b in enumerate(combo)
    )  # noqa: E731
    combos = [
        c for c in np.ndindex(*([9] * groups)) if set(c) <= set(GROUP_WIDTHS) and size * sum(c) == total
    ]
    assert cost(per_group[:, 0].tolist()) == pytest.approx(min(cost(c) for c in combos))


def test_a_head_of_four_groups_or_more_has_a_plan_at_every_unit_width():
    fmt = PcaFormat(group=16, group_widths=GROUP_WIDTHS)
    for dim in (16, 32, 64, 128, 256):
        for w in PCA_WIDTHS:
            assert int(plan_groups(torch.rand(dim, 9, dtype=torch.float64), w * dim, fmt).sum()) == w * dim


def test_a_grouped_plan_refuses_bits_it_cannot_group():
    fmt = PcaFormat(group=16, group_widths=GROUP_WIDTHS)
    with pytest.raises(ValueError, match="groups of 4"):  # 18 channels: groups of a quarter, 4, do not fit
        plan_groups(torch.rand(18, 9, dtype=torch.float64), 36, fmt)
    with pytest.raises(
        ValueError, match="at the widths allowed"
    ):  # one channel at 3 bits: no width of 0/1/2/4/8
        plan_groups(torch.rand(1, 9, dtype=torch.float64), 3, fmt)


def test_the_fit_finds_the_principal_axes_least_squares_scales_and_spends_the_width():
    g = torch.Generator().manual_seed(3)
    axes, _ = torch.linalg.qr(torch.randn(D, D, generator=g))  # orthonormal columns
    sd = torch.logspace(1, -3, D)
    x = (torch.randn(20_000, D, generator=g) * sd) @ axes.T + 5.0
    mean, basis, plans, scales = fit_head(x)
    assert (mean.float() - 5.0).abs().max() < 0.2
    # each fitted component is an axis up to its sign (fp16 rounding of the basis aside), in order of variance
    overlap = (basis.double().T @ axes.double()).abs()
    assert (overlap.diagonal()[:8] > 0.99).all()
    for i, w in enumerate(PCA_WIDTHS):
        assert int(plans[i].sum()) == w * D and int(plans[i].max()) <= MAX_COMPONENT_BITS
        assert (plans[i][:-1] >= plans[i][1:]).all()  # more variance, as many bits or more
    assert (plans[PCA_WIDTHS.index(1)][-8:] == 0).all()  # the trailing components dropped at 1 bit
    # a scale is the least-squares one for its codes (Lloyd's fixed point), within fp16 rounding
    z = (x.double() - mean.double()) @ basis.double()
    i = PCA_WIDTHS.index(4)
    for c in (0, 5):
        b = int(plans[i][c])
        q = lloyd_max(b)
        levels = torch.tensor(q.levels, dtype=torch.float64)
        chosen = levels[torch.bucketize(z[:, c] / scales[i][c].double(), torch.tensor(q.boundaries).double())]
        best = float((z[:, c] * chosen).sum() / (chosen * chosen).sum())
        assert float(scales[i][c]) == pytest.approx(best, rel=5e-3)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300),
    d=st.integers(1, 70),
    bits=st.integers(1, MAX_COMPONENT_BITS),
    kind=st.sampled_from(sorted(QUANTIZERS)),
    tail=st.floats(1.0, 3.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_scale_fit_codes_only_moving_columns_and_ends_where_every_round_would(
    n, d, bits, kind, tail, seed
):
    """_fitted_scale against Lloyd's iteration on the scale run for all SCALE_ITERATIONS rounds over every
    column: the same scales to the bit, on heavy-tailed columns of mixed spreads (some constant)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g)
    z = z.sign() * z.abs() ** tail * torch.rand(d, generator=g) * 10
    z[:, torch.rand(d, generator=g) < 0.1] = 0.0
    start = z.std(0, correction=0).clamp(SCALE_MIN, reference.FP16_MAX)
    levels = torch.tensor(QUANTIZERS[kind](bits).levels, dtype=torch.float32)
    bounds = torch.tensor(QUANTIZERS[kind](bits).boundaries, dtype=torch.float32)
    scale = start.clone()
    for _ in range(SCALE_ITERATIONS):
        chosen = levels[torch.bucketize(z / scale, bounds)]
        energy = (chosen * chosen).sum(0)
        scale = torch.where(energy > 0, (z * chosen).sum(0) / energy.clamp(min=1e-30), scale)
        scale = scale.clamp(SCALE_MIN, reference.FP16_MAX)
    assert torch.equal(_fitted_scale(z, bits, start, kind), scale.half().float())


def test_pca_beats_per_channel_levels_on_correlated_vectors():
    """What the transform is for: on correlated channels of decaying variance, w bits per element through the
    fitted basis and plan err less than w-bit Lloyd-Max levels per channel, each at its own least-squares
    scale, whose bytes are the same."""
    _, values, cal = calibration()
    x = correlated(300, len(BITS), 9, mixing=1)[:, :, None].transpose(0, 2)  # (1, H, 300, D): values' kind
    scheme = get_scheme("pca").for_layer(0, cal)
    for w in (2, 3, 4):
        store = scheme.new_store([w] * len(BITS), D, 1, torch.float32, "cpu", "value")
        store.append(x)
        pca_error = (store.dequantize() - x).square().sum()
        q = lloyd_max(w)
        channel = torch.zeros_like(x)
        for h in range(len(BITS)):
            mean = values[:, h].mean(0)
            sd = values[:, h].std(0)
            y = (x[0, h] - mean) / sd
            channel[0, h] = torch.tensor(q.levels)[torch.bucketize(y, torch.tensor(q.boundaries))] * sd + mean
        assert pca_error < (channel - x).square().sum(), w


# ---------------------------------------------------------------------------------------------------------
# the store


@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sinks, residual", [(0, 0), (1, 2)])
def test_store_is_the_oracle_packed_and_simulated(role, dtype, sinks, residual):
    keys, values, cal = calibration()
    g = torch.Generator().manual_seed(7)
    T = 37
    pool = keys if role == "key" else values
    x0 = pool[torch.randint(0, len(pool), (B * T,), generator=g)].view(B, T, -1, D).transpose(1, 2)
    x0 = x0 + 0.05 * torch.randn(x0.shape, generator=g)  # (B, H, T, D): like the calibration's
    x = (rope(x0.double(), torch.arange(T)) if role == "key" else x0.double()).to(dtype)
    bound = get_scheme("pca", sink_tokens=sinks, residual=residual).for_layer(0, cal)
    packed = bound.new_store(BITS, D, B, dtype, "cpu", role)
    assert feed(packed, x, [1, 15, 1, 20]) is None
    simulated = feed(bound.new_store(BITS, D, B, dtype, "cpu", role, simulate=True), x, [1, 15, 1, 20])
    got = packed.dequantize()
    # the same codes; the basis's matmul may sum in another order for another number of tokens (float32 ULPs)
    torch.testing.assert_close(got, simulated, rtol=1e-5, atol=1e-5)
    want = oracle(x, torch.arange(T), BITS, cal.layer(0), role)
    want[:, :, :sinks] = x[:, :, :sinks].double()  # sink tokens exact
    quantized_from = sinks + max(T - sinks - residual, 0)
    want[:, :, quantized_from:] = x[:, :, quantized_from:].double()
    # float32 against float64: a component on a cell boundary may take the neighbouring level (rare)
    close = ((got.double() - want.to(dtype).double()).abs() <= 1e-3 + 1e-2 * want.abs()).all(-1)  # (B, H, T)
    assert close.float().mean() > 0.97, (~close).nonzero()[:5]
    assert torch.equal(got[:, 1], x[:, 1])  # the 16-bit head
    assert (got[:, 0] != x[:, 0]).any()  # the quantization is felt


def _fitted_variant(name: str, seed: int):
    """Scheme `name` with one sink token bound to a layer fitted in its format on correlated keys (seed) and values
    (seed + 1) with rotary turns: (its format, keys, values, the layer, the bound scheme)."""
    fmt = get_scheme(name).pca_format
    keys, values = correlated(400, len(BITS), seed, mixing=0), correlated(400, len(BITS), seed + 1, mixing=1)
    turns = torch.zeros(D)
    turns[: R // 2], turns[R // 2 : R] = theta(), theta()
    own = own_channels(R // 2, fmt.own_pairs)
    layer = PcaLayer(fit_table(keys, fmt=fmt, own=own), fit_table(values, fmt=fmt), turns)
    return fmt, keys, values, layer, get_scheme(name, sink_tokens=1).for_layer(0, PcaCalibration((layer,)))


@pytest.mark.parametrize(
    "name", [n for n in SCHEMES.names() if n != "pca" and isinstance(get_scheme(n), Pca)]
)
@pytest.mark.parametrize("role", ["key", "value"])
def test_a_variants_store_is_the_oracle_across_blocks(name, role):
    """Each variant's store against the oracle in its format, over 300 tokens (three blocks of 128 after one sink
    token), a table fitted in that format (levels and plan groups)."""
    fmt, keys, values, layer, bound = _fitted_variant(name, 0)
    g = torch.Generator().manual_seed(3)
    T = 300
    pool = keys if role == "key" else values
    x0 = pool[torch.randint(0, len(pool), (B * T,), generator=g)].view(B, T, -1, D).transpose(1, 2)
    x = rope(x0.double(), torch.arange(T)).float() if role == "key" else x0.float()  # (B, H, T, D)
    store = bound.new_store(BITS, D, B, torch.float32, "cpu", role)
    feed(store, x, [1, 100, 1, 198])
    got = store.dequantize()
    want = oracle(x[:, :, 1:], torch.arange(1, T), BITS, layer, role, fmt, first=1)
    close = ((got[:, :, 1:].double() - want).abs() <= 1e-3 + 1e-2 * want.abs()).all(-1)  # (B, H, T - 1)
    assert close.float().mean() > 0.97, (~close).nonzero()[:5]
    assert torch.equal(got[:, :, 0], x[:, :, 0])  # the sink token exact
    if role == "key" and fmt.key_frame != "pre":  # the frame is felt: pca's own oracle disagrees
        other = oracle(
            x[:, :, 1:], torch.arange(1, T), BITS, layer, role, PcaFormat(levels=fmt.levels), first=1
        )
        assert not torch.allclose(want, other, atol=1e-2)
    if fmt.group > 1:
        for w in PCA_WIDTHS:
            plan = layer.key.plans[w].long().view(len(BITS), -1, fmt.group_at(D))
            assert (plan == plan[..., :1]).all() and set(plan.unique().tolist()) <= set(fmt.group_widths)


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in SCHEMES.names()
        if isinstance(get_scheme(n), Pca) and get_scheme(n).pca_format.levels == UNIFORM
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_evenly_spaced_levels_read_a_run_in_one_product_as_the_lookup_does(name, dtype):
    """A store of evenly spaced levels reads back a run of tokens sharing one turn (a block's keys, values) in one
    product with the steps folded into the basis: the tokens the level lookup, the basis product and the per-token
    turn give from the same codes, within float rounding, over ranges that start and end inside blocks (a sink
    token first, so the blocks start at token 1), in keys and values, fp32 and bf16 stores."""
    fmt, keys, values, layer, bound = _fitted_variant(name, 4)
    g = torch.Generator().manual_seed(5)
    T = 300
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    for role, pool in (("key", keys), ("value", values)):
        x0 = pool[torch.randint(0, len(pool), (B * T,), generator=g)].view(B, T, -1, D).transpose(1, 2)
        x = rope(x0.double(), torch.arange(T)).float() if role == "key" else x0.float()
        store = bound.new_store(BITS, D, B, dtype, "cpu", role).parts[1]  # the pca store behind the sink
        feed(store, x[:, :, 1:].to(dtype), [37, 1, 261])
        for start, end in ((0, store.length), (5, 6), (100, 260), (127, 129)):
            positions = store.positions.held(start, end, store.length)
            runs = store._frame_runs(
                positions
            )  # None: a few tokens over two blocks, read by the lookup itself
            each_own = role == "key" and (fmt.key_frame == "pre" or fmt.own_pairs)  # a turn per token
            assert runs is not None or each_own or end - start < 16
            angle = store._angle(positions)
            for w in store.widths:
                codes = store._codes(w, start, end)
                zq = component_values(codes, store.plan[w], store.scale[w].float(), fmt.levels)
                want = store._restore(zq, w, angle)  # (B, Hw, T, D) in dtype
                got = store.block(start, end).index_select(1, store.heads[w])
                torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outlier_keys_are_the_oracle_cost_their_bytes_and_follow_eviction(dtype):
    """quant.outliers on pca's keys: each token's components the codes miss most kept in a 2-byte float (fp16, bf16
    in a bfloat16 store), against the oracle with them; the same packed and simulated; 3 bytes more a key token of
    a quantized head, values untouched; after keep_last and select still the oracle's tokens; no fold, no kernel."""
    keys, _, cal = calibration()
    g = torch.Generator().manual_seed(11)
    T, k = 37, 2  # ceil(0.05 * 32)
    x0 = keys[torch.randint(0, len(keys), (B * T,), generator=g)].view(B, T, -1, D).transpose(1, 2)
    x0 = x0 + 0.05 * torch.randn(x0.shape, generator=g)
    x = rope(x0.double(), torch.arange(T)).to(dtype)  # (B, H, T, D)
    bound = get_scheme("pca", outliers=0.05, residual=0).for_layer(0, cal)
    plain = get_scheme("pca", residual=0).for_layer(0, cal)
    assert bound.outlier_count(D) == k
    packed = bound.new_store(BITS, D, B, dtype, "cpu", "key")
    feed(packed, x, [1, 15, 1, 20])
    simulated = feed(bound.new_store(BITS, D, B, dtype, "cpu", "key", simulate=True), x, [1, 15, 1, 20])
    got = packed.dequantize()
    torch.testing.assert_close(got, simulated, rtol=1e-5, atol=1e-5)
    kept = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
    want = oracle(x, torch.arange(T), BITS, cal.layer(0), "key", outliers=k, kept=kept)
    close = ((got.double() - want.to(dtype).double()).abs() <= 1e-3 + 1e-2 * want.abs()).all(-1)  # (B, H, T)
    assert close.float().mean() > 0.97, (~close).nonzero()[:5]
    # the outliers are felt: nearer x than the codes alone, on every quantized head
    alone = oracle(x, torch.arange(T), BITS, cal.layer(0), "key")
    quantized = [h for h, b in enumerate(BITS) if b != FULL_WIDTH]
    miss = lambda y: (y[:, quantized] - x[:, quantized].double()).norm(dim=-1).mean(-1)  # noqa: E731  (B, Hq)
    assert (miss(want) < miss(alone)).all()
    assert torch.equal(got[:, 1], x[:, 1])  # the 16-bit head
    # bytes: 3 k more a key token of a quantized head; values and 16-bit heads as without outliers
    for w in PCA_WIDTHS:
        assert bound.token_bytes(w, D, "key") == plain.token_bytes(w, D, "key") + 3 * k
        assert bound.token_bytes(w, D, "value") == plain.token_bytes(w, D, "value")
    assert bound.token_bytes(FULL_WIDTH, D, "key") == plain.token_bytes(FULL_WIDTH, D, "key")
    tables = sum(bound.table_bytes(b, D, "key") for b in BITS)
    positions = packed.positions.nbytes()
    assert packed.nbytes() == tables + positions + sum(B * T * bound.token_bytes(b, D, "key") for b in BITS)
    # eviction keeps each token's outliers with its codes
    packed.keep_last(12)
    torch.testing.assert_close(packed.dequantize(), got[:, :, -12:])
    index = torch.stack([torch.tensor([0, 3, 4, 9, 11]), torch.tensor([1, 2, 5, 6, 10]), torch.arange(5)])
    packed.select(index)
    torch.testing.assert_close(
        packed.dequantize(), torch.stack([got[b, :, -12:][:, index[b]] for b in range(B)])
    )
    # read by dequantizing: no fold, no triton backend
    assert (
        bound.packed_decode() is None and plain.packed_decode() is None
    )  # pca's Lloyd-Max levels fold never
    assert get_scheme("pca_block_ugs", outliers=0.05).packed_decode() is None
    assert get_scheme("pca_block_ugs").packed_decode() is not None
    uf = get_scheme("pca_block_uf", outliers=0.05)
    turns = cal.layer(0).rotary_frequencies
    fitted = PcaLayer(fit_table(keys, fmt=uf.pca_format), fit_table(keys, fmt=uf.pca_format), turns)
    flat = uf.for_layer(0, PcaCalibration((fitted,))).new_store([4] * len(BITS), D, B, dtype, "cpu", "key")
    assert foldable(flat) == "outliers kept beside the codes (quant.outliers)"
    with pytest.raises(NotImplementedError, match="quant.outliers 0.05; the kernels read no outliers"):
        get_scheme("pca_block_ugs", outliers=0.05).check_kernel([4], [4], 64, 64, False)
    with pytest.raises(ValueError, match="^quant.outliers: channel indices are stored as uint8"):
        bound.check_head_dim([4], 512, "key")


def test_positions_follow_starts_at_keep_last_and_select():
    keys, _, cal = calibration()
    bound = get_scheme("pca", residual=0).for_layer(0, cal)
    T, start = 20, 7
    x0 = keys[:T].transpose(0, 1)[None].expand(B, -1, -1, -1)  # (B, H, T, D) before RoPE
    x = rope(x0.double(), torch.arange(start, start + T)).float()
    store = bound.new_store(BITS, D, B, torch.float32, "cpu", "key")
    store.starts_at(start)
    feed(store, x, [8, 12])
    want = oracle(x, torch.arange(start, start + T), BITS, cal.layer(0), "key")
    torch.testing.assert_close(store.dequantize().double(), want.float().double(), atol=1e-3, rtol=1e-2)
    before = store.nbytes()
    store.keep_last(12)
    torch.testing.assert_close(
        store.dequantize().double(), want[:, :, -12:].float().double(), atol=1e-3, rtol=1e-2
    )
    index = torch.stack(
        [torch.tensor([0, 3, 4, 9, 11]), torch.tensor([1, 2, 5, 6, 10]), torch.tensor([0, 1, 2, 3, 4])]
    )
    store.select(index)
    kept = want[:, :, -12:]
    expected = torch.stack([kept[b, :, index[b]] for b in range(B)])
    torch.testing.assert_close(store.dequantize().double(), expected.float().double(), atol=1e-3, rtol=1e-2)
    tables = sum(bound.table_bytes(b, D, "key") for b in BITS)
    assert before == tables + sum(B * T * bound.token_bytes(b, D, "key") for b in BITS)
    assert (
        store.nbytes()
        == tables + sum(B * 5 * bound.token_bytes(b, D, "key") for b in BITS) + B * 5 * POSITION_BYTES
    )


def test_bytes_widths_and_an_unbound_scheme():
    scheme = get_scheme("pca")
    assert [scheme.token_bytes(w, 64, "value") for w in (1, 2, 3, 4, 5, 6, 8, 16)] == [
        8,
        16,
        24,
        32,
        40,
        48,
        64,
        128,
    ]
    assert scheme.table_bytes(3, 64, "key") == scheme.table_bytes(5, 64, "value") == 2 * 64 * 64 + 5 * 64
    assert scheme.table_bytes(16, 64, "key") == 0
    with pytest.raises(
        ValueError,
        match=r"^policy.widths: \[7\] with quant.scheme pca, which stores quantized heads at 1, 2, 3, 4, 5, 6, 8 bits",
    ):
        scheme.check_widths([7])
    with pytest.raises(ValueError, match="^quant.scheme: pca stores keys and values against transforms"):
        scheme.new_store([2], D, 1, torch.float32, "cpu", "value")
    with pytest.raises(ValueError, match="multiple of 8"):
        scheme.check_head_dim([2], 36, "value")


@pytest.mark.parametrize("shuffled", [False, True])
def test_the_frame_round_trips_every_fitted_number(shuffled):
    """Layers apart by one without a transform; the frame's rows in their order or in any (a table read back)."""
    _, _, cal = calibration()
    layers = (None, *cal.layers, None, *cal.layers)
    frame = PcaCalibration(layers).to_frame()
    if shuffled:
        frame = frame.sample(frac=1, random_state=int(torch.randint(0, 2**31, ())))
    back = PcaCalibration.from_frame(frame, 4)
    assert (
        back.layers[0] is None and back.layers[2] is None and back.digest() == PcaCalibration(layers).digest()
    )
    layer = cal.layer(0)
    for again in (back.layer(1), back.layer(3)):
        assert torch.equal(layer.turn, again.turn)
        for role in ("key", "value"):
            a, b = layer.role(role), again.role(role)
            assert torch.equal(a.mean, b.mean) and torch.equal(a.basis, b.basis)
            assert a.basis.stride() == b.basis.stride() and a.mean.dtype == b.mean.dtype
            for w in PCA_WIDTHS:
                assert torch.equal(a.plans[w], b.plans[w]) and torch.equal(a.scales[w], b.scales[w])


# ---------------------------------------------------------------------------------------------------------
# models


def chunked_logits(model, ids: torch.Tensor, cache, chunks) -> torch.Tensor:
    out, start = [], 0
    for n in chunks:
        out.append(model(input_ids=ids[:, start : start + n], past_key_values=cache, use_cache=True).logits)
        start += n
    return torch.cat(out, 1).float()


class OracleCache(DynamicCache):
    """A DynamicCache that holds the oracle's keys and values (each layer's transforms, every head at `bits`, each
    key with `outliers` outliers in fp16), token 0 exact (one sink token)."""

    def __init__(self, config, bits: int, cal: PcaCalibration, outliers: int = 0):
        super().__init__(config=config)
        self.bits, self.cal, self.seen, self.outliers = bits, cal, {}, outliers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        start = self.seen.get(layer_idx, 0)
        positions = torch.arange(start, start + key_states.shape[2])
        self.seen[layer_idx] = start + key_states.shape[2]
        layer, heads = self.cal.layer(layer_idx), [self.bits] * key_states.shape[1]
        keys = oracle(key_states, positions, heads, layer, "key", outliers=self.outliers)
        values = oracle(value_states, positions, heads, layer, "value")
        sink = positions == 0
        keys[:, :, sink], values[:, :, sink] = (
            key_states[:, :, sink].double(),
            value_states[:, :, sink].double(),
        )
        return super().update(
            keys.to(key_states.dtype), values.to(value_states.dtype), layer_idx, *args, **kwargs
        )


@pytest.mark.parametrize("name, outliers", [("tiny-llama", 0.0), ("tiny-gemma3", 0.0), ("tiny-llama", 0.05)])
@torch.no_grad()
def test_tiny_model_through_the_cache_is_the_oracle(name, outliers):
    model = load_model(name)[0]
    g = torch.Generator().manual_seed(12)
    cal = fit_pca_calibration(model, torch.randint(0, 256, (16, 48), generator=g))
    ids = torch.randint(0, 256, (2, 29), generator=g)  # past tiny-gemma3's sliding window of 16
    chunks = [12, 9, 1, 1, 6]
    exact = chunked_logits(model, ids, DynamicCache(config=model.config), chunks)
    options = dict(scheme="pca", prefill="quantized", key_calibration=cal, sink_tokens=1, outliers=outliers)
    with installed(model, PACKED):
        packed = chunked_logits(model, ids, QuantizedKVCache(model.config, 4, **options), chunks)
        cache = QuantizedKVCache(model.config, 4, simulate=True, **options)
        simulated = chunked_logits(model, ids, cache, chunks)
    k = cache.scheme.outlier_count(model.config.head_dim)
    want = chunked_logits(model, ids, OracleCache(model.config, 4, cal, k), chunks)
    assert (packed - simulated).abs().amax() <= 0.01 * exact.abs().amax()
    assert (simulated - want).abs().amax() <= 5e-3 * exact.abs().amax()
    assert (simulated - exact).abs().amax() > 0  # the quantization is felt
    if k:  # and so are the outliers: the oracle without them is farther
        without = chunked_logits(model, ids, OracleCache(model.config, 4, cal), chunks)
        assert (simulated - without).abs().amax() > 4 * (simulated - want).abs().amax()
    # the fitted tables (held once: more than these few tokens' fp16 bytes) aside, fewer bytes than fp16
    layers = cache.quantized_layers()
    tables = sum(
        len(layer.key_bits)
        * (cache.scheme.table_bytes(4, 32, "key") + cache.scheme.table_bytes(4, 32, "value"))
        for layer in layers
    )
    assert 0 < cache.nbytes() - tables < cache.nbytes_fp16()


@torch.no_grad()
def test_the_fit_is_each_layers_keys_before_rope_and_values_from_the_calibration_windows_only(
    tmp_path, monkeypatch
):
    model, _ = load_model("tiny-llama")
    g = torch.Generator().manual_seed(15)
    calib = torch.randint(0, 256, (2, 24), generator=g)
    point = base_point(compose_point(["model=tiny-llama", "quant=pca", "eval=tiny", "policy.widths=[2,4]"]))

    def context(calib_ids, sequences):
        return SimpleNamespace(
            model=model, name="tiny-llama", calib_ids=calib_ids, sequences=sequences, key_calibration={},
            calibration_source=None,
        )  # fmt: skip

    first = context(calib, torch.randint(0, 256, (2, 24), generator=g))
    other_eval = context(calib, torch.randint(0, 256, (2, 24), generator=g))
    other_calib = context(torch.randint(0, 256, (2, 24), generator=g), first.sequences)
    fits = []
    for ctx in (first, other_eval, other_calib):
        monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / str(len(fits))))  # no disk cache between them
        fits.append(key_calibration(ctx, point))
    assert fits[0].digest() == fits[1].digest() != fits[2].digest()
    keys, values, positions = calibration_vectors(model, calib)[1]
    before_rope = unturn(keys, positions, rotary_frequencies(model, "full_attention"))
    want = PcaLayer(fit_table(before_rope), fit_table(values), fits[0].layer(1).turn)
    assert PcaCalibration((want,)).digest() == PcaCalibration((fits[0].layer(1),)).digest()
    again = cached_pca_calibration(model, "tiny-llama", calib)  # written to disk above, read back here
    assert again.digest() == cached_pca_calibration(model, "tiny-llama", calib).digest()


@torch.no_grad()
def test_one_run_keeps_a_fit_per_format(tmp_path, monkeypatch):
    """Points of pca's family measured in one context each read their own format's fit (a run once handed every
    pca variant the first one's fit); schemes of one format (pca, vq2) share one."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model, _ = load_model("tiny-llama")
    calib = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(8))
    ctx = SimpleNamespace(
        model=model,
        name="tiny-llama",
        calib_ids=calib,
        sequences=None,
        key_calibration={},
        calibration_source=None,
    )

    def fitted(scheme):
        point = base_point(compose_point(["model=tiny-llama", f"quant.scheme={scheme}", "eval=tiny"]))
        return key_calibration(ctx, point)

    got = {name: fitted(name).digest() for name in ("pca", "pca_block_u", "pca_block_uf", "pca_post", "vq2")}
    for name in ("pca", "pca_block_u", "pca_block_uf", "pca_post"):
        want = fit_pca_calibration(model, calib, get_scheme(name).pca_format).digest()
        assert got[name] == want, name
    assert len({got[n] for n in ("pca", "pca_block_u", "pca_block_uf", "pca_post")}) == 4
    assert got["vq2"] == got["pca"]


def test_shared_plans_are_one_plan_a_width_of_least_distortion_over_every_head(tmp_path, monkeypatch):
    """pca_block_ugs: every head of every layer takes one plan per role and width, the grouped plan of least
    distortion summed over them all; the block frame turns the keys back to their block's first position."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model, _ = load_model("tiny-llama")
    calib = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(4))
    fmt = get_scheme("pca_block_ugs").pca_format
    fitted = fit_pca_calibration(model, calib, fmt)
    layers = [layer for layer in fitted.layers if layer is not None]
    found = [v for v in calibration_vectors(model, calib) if v is not None]
    for role in ("key", "value"):
        heads = []
        for layer, (keys, values, positions) in zip(layers, found):
            x = keys if role == "key" else values
            if (
                role == "key"
            ):  # block frame: turned back to first + k * 128 (all of these windows: position 1)
                x = unturn(keys, torch.ones_like(positions), layer.rotary_frequencies)
            heads += [fit_components(x[:, h].float(), fmt) for h in range(x.shape[1])]
        want = plans_for(sum(fit.distortion for fit in heads), PCA_WIDTHS, fmt)  # (|W|, D)
        for layer in layers:
            for j, w in enumerate(PCA_WIDTHS):
                plans = layer.role(role).plans[w].long()  # (Hkv, D)
                assert torch.equal(plans, want[j].expand_as(plans)), (role, w)
    assert not torch.equal(layers[0].key.plans[4], fit_pca_calibration(model, calib).layers[1].key.plans[4])


def test_a_tiny_run_through_the_runner(tmp_path):
    from harness.validate import validate_config

    cfg = compose_point(["model=tiny-llama", "eval=tiny", "quant=pca", "policy=uniform", "policy.budget=3",
                         "policy.widths=[1,3,5]", "quant.sink_tokens=0"])  # fmt: skip
    (point,) = [p for p in validate_config(cfg) if p.policy == "uniform"]
    row = runner.run([point], tmp_path, batch_size=4).set_index("policy").loc["uniform"]
    assert row["status"] == "ok" and row["mean_bits"] == 3
    # 3 bits per element, no per-token bytes beside the codes; the fitted tables of 2 roles x 3 KV heads x 3
    # layers (head_dim 32: 2 * 32 * 32 + 5 * 32 bytes each) are held once by the one generation cache (4 prompts),
    # which holds each prompt and all but the last new token
    heads, dim, layers, caches = 3, 32, 3, 1
    tokens = point.num_prompts * (point.prompt_tokens + point.new_tokens - 1)
    fp16 = tokens * layers * heads * 2 * dim * 2
    stored = tokens * layers * heads * 2 * dim * 3 / 8 + caches * layers * heads * 2 * (
        2 * dim * dim + 5 * dim
    )
    assert row["compression_true"] == pytest.approx(fp16 / stored)


def test_own_pairs_take_a_basis_block_of_their_own_after_the_rest():
    """With own channels (PcaFormat.own_pairs' key channels), the fitted basis is block-diagonal: the other channels'
    components first, each by descending variance, then the own channels' (so they fill whole groups at the end of a
    row); each block the eigenvectors of its own channels' covariance alone."""
    x = correlated(500, 1, 7, mixing=0)[:, 0]  # (N, D): every channel correlated with every other
    own = own_channels(R // 2, 4)  # pairs 0-3: channels 0-3 and 12-15
    fit = fit_components(x, get_scheme("pca_own32_ugsa").pca_format, own)
    basis = fit.basis.double()
    mine = torch.zeros(D, dtype=torch.bool)
    mine[own] = True
    assert torch.equal(basis[mine][:, : D - 8], torch.zeros(8, D - 8, dtype=torch.float64))
    assert torch.equal(basis[~mine][:, D - 8 :], torch.zeros(D - 8, 8, dtype=torch.float64))
    centred = x.double() - x.double().mean(0)
    for index, columns in ((~mine, slice(0, D - 8)), (mine, slice(D - 8, D))):
        block = centred[:, index]
        values = torch.linalg.eigvalsh(block.T @ block / len(x)).flip(0)
        variance = ((block @ basis[index][:, columns]) ** 2).mean(0)
        torch.testing.assert_close(variance, values, rtol=2e-2, atol=1e-6)
    whole = fit_components(x, get_scheme("pca_own32_ugsa").pca_format)  # no own channels: one block
    assert (whole.basis[mine][:, : D - 8] != 0).any()
