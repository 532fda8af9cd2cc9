"""The nuqkey scheme: its levels (1-D k-means against brute force and its fixed point, fitted on the calibration
keys turned back before RoPE), its key store against a float64 oracle written from the format's contract (turned
back at each token's position, nearest level, outliers where the levels miss most, turned forward), its
positions (sink tokens, starts_at, keep_last, select), bytes as the byte model, no NaN on nasty inputs, tiny
models through QuantizedKVCache, and the tables read from the calibration windows only. nuqkey_codebook: nuqkey's
key store and codebook's value store exactly, and tiny models through the cache against the same oracle with
codebook's values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.calibrate.keys import fit_key_calibration, fit_levels, fit_table
from harness.calibrate.windows import calibration_keys, rotary_frequencies
from harness.config import base_point
from harness.config import compose as compose_point
from harness.models import load_model
from harness.run.measure import key_calibration
from harness.schemes import KeyCalibration, NuqKey, codebook, get_scheme
from harness.schemes.key_table import LEVEL_WIDTHS
from harness.schemes.nuqkey import POSITION_BYTES
from kernels import reference
from kernels.layout import FULL_WIDTH

B, D, R = 3, 32, 24  # batch, head_dim, the channels RoPE turns (the last 8 are not turned)
BITS = [3, 16, 2, 4, 3]  # one head per width, a 16-bit head among them


def theta() -> torch.Tensor:
    """Rotary frequencies (R / 2,) from fast (1 radian per position) to slow."""
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


def calibration(heads: int = len(BITS), seed: int = 0) -> tuple[torch.Tensor, KeyCalibration]:
    """Pre-RoPE calibration keys (N, H, D) with channels of different ranges and offsets, and one layer's table
    fitted on them after RoPE at positions 1..N."""
    g = torch.Generator().manual_seed(seed)
    z0 = torch.randn(300, heads, D, generator=g) * torch.logspace(-1, 1, D) + torch.linspace(-2, 3, D)
    positions = torch.arange(1, 301)
    keys = rope(z0.double().transpose(0, 1), positions).transpose(0, 1).float()  # (N, H, D) after RoPE
    return z0, KeyCalibration((fit_table(keys, positions, theta(), span=512),))


def scheme(outliers: float = 0.0, **options) -> NuqKey:
    return get_scheme("nuqkey", group_size=8, outliers=outliers, **options)


def feed(store, x: torch.Tensor, chunks) -> torch.Tensor | None:
    start, got = 0, None
    for n in chunks:
        got = store.append(x[:, :, start : start + n])
        start += n
    assert start == x.shape[2]
    return got


def oracle(
    x: torch.Tensor, positions: torch.Tensor, bits: list[int], table, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, T, D) at `positions` (T,) stored as nuqkey stores keys, head h at bits[h], in float64: turned back,
    the nearest level, the k channels of largest |error| kept as 2-byte floats, turned forward; 16-bit heads
    unchanged. -> (float64 (B, H, T, D), bool (B, H, T): tokens whose code or outliers sit on a float32 tie)."""
    out, tie = x.double().clone(), torch.zeros(x.shape[:3], dtype=torch.bool)
    two_bytes = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float16
    for h, b in enumerate(bits):
        if b == FULL_WIDTH:
            continue
        y = rope(
            x[:, h].double().clamp(-65504, 65504), positions, -1.0, table.rotary_frequencies
        )  # (B, T, D)
        levels = table.levels[b][h].double()  # (D, n)
        distance = (y[..., None] - levels).abs()  # (B, T, D, n)
        code = distance.argmin(-1)
        two = distance.topk(2, -1, largest=False)
        apart = (
            levels.expand(*y.shape, -1).gather(-1, two.indices).diff(dim=-1)[..., 0] != 0
        )  # equal levels: no tie
        tie[:, h] = (((two.values[..., 1] - two.values[..., 0]) < 1e-5) & apart).any(-1)
        deq = levels.expand(*y.shape, -1).gather(-1, code[..., None])[..., 0]
        err = (y - deq).abs()
        if k:
            ranked = err.topk(k + 1, -1).values
            tie[:, h] |= (ranked[..., k - 1] - ranked[..., k]) < 1e-5
            kept = err.topk(k, -1).indices
            deq = deq.scatter(-1, kept, y.gather(-1, kept).to(two_bytes).double())
        out[:, h] = rope(deq, positions, 1.0, table.rotary_frequencies)
    return out, tie


# ---------------------------------------------------------------------------------------------------------
# the levels


def test_levels_are_the_values_when_a_column_has_as_many_as_levels():
    values = torch.tensor([[-3.0, 10.0], [-1.0, 11.0], [0.5, 20.0], [7.0, 21.0]])  # (4 distinct, 2 columns)
    x = values[torch.randint(0, 4, (500,))]
    x = torch.cat([values, x])  # every value present
    torch.testing.assert_close(fit_levels(x, 4), values.T)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([2, 4, 8, 16]), st.integers(20, 300))
@example(685, 8, 20)  # a value (2) exactly halfway between two levels (1, 3): the upper level's in the fit
def test_levels_are_a_fixed_point_of_lloyd_and_inside_the_data(seed, n, rows):
    """Sorted, inside [min, max] of the column, and each level the mean of the values nearest to it (Lloyd's
    fixed point, checked by brute force) once iterated enough."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, generator=g) * torch.tensor([1.0, 5.0, 0.01]) + torch.tensor([0.0, -3.0, 2.0])
    x[:, 0] = x[:, 0].round()  # a column of few distinct values: some levels hold nothing
    levels = fit_levels(x, n, iterations=300)
    assert levels.shape == (3, n) and (levels[:, 1:] >= levels[:, :-1]).all()
    assert (levels >= x.min(0).values[:, None] - 1e-6).all() and (
        levels <= x.max(0).values[:, None] + 1e-6
    ).all()
    for c in range(3):
        # the nearest level, ties to the upper one as the fit's bounds take them (the store codes a tie to the
        # lower one: equally near, the same error)
        nearest = n - 1 - (x[:, c, None] - levels[c].flip(0)).abs().argmin(-1)
        # in the continuous columns a value within float32 rounding of a boundary may fall either side of the
        # fit's float64 one: the two levels beside it are not checked (column 0's ties are exact in both)
        off = (x[:, c, None] - (levels[c, 1:] + levels[c, :-1]) / 2).abs()  # (rows, n - 1)
        unsure = ((off < 1e-5) & (c > 0)).any(0).nonzero().flatten()
        unsure = set(unsure.tolist()) | set((unsure + 1).tolist())
        for i in nearest.unique():
            if int(i) in unsure:
                continue
            mean = x[nearest == i, c].double().mean()
            assert abs(levels[c, i] - mean) <= 1e-5 * (1 + abs(mean)), (c, i)


def test_levels_are_fitted_on_the_keys_before_rope():
    z0, cal = calibration()
    table = cal.layer(0)
    torch.testing.assert_close(table.rotary_frequencies, theta())
    assert torch.equal(table.turn[R:], torch.zeros(D - R))
    for b in LEVEL_WIDTHS:
        want = fit_levels(z0.reshape(len(z0), -1), 1 << b).view(len(BITS), D, 1 << b)
        torch.testing.assert_close(table.levels[b].float(), want.half().float(), atol=2e-3, rtol=2e-3)


def test_the_frame_round_trips_levels_and_turns():
    _, cal = calibration()
    back = KeyCalibration.from_frame(KeyCalibration((None, *cal.tables)).to_frame(), 2).layer(1)
    assert torch.equal(back.turn, cal.layer(0).turn)
    for b in LEVEL_WIDTHS:
        assert torch.equal(back.levels[b], cal.layer(0).levels[b])


# ---------------------------------------------------------------------------------------------------------
# the store


@pytest.mark.parametrize("outliers", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sinks, residual", [(0, 0), (1, 2)])
def test_store_is_the_oracle_packed_and_simulated(outliers, dtype, sinks, residual):
    z0, cal = calibration()
    g = torch.Generator().manual_seed(7)
    T = 37
    x0 = z0[torch.randint(0, len(z0), (B * T,), generator=g)].view(B, T, -1, D).transpose(1, 2)
    x0 = x0 + 0.3 * torch.randn(
        x0.shape, generator=g
    )  # (B, H, T, D): keys like the calibration's, before RoPE
    x = rope(x0.double(), torch.arange(T)).to(dtype)  # after RoPE at positions 0..T-1
    bound = scheme(outliers, sink_tokens=sinks, residual=residual).for_layer(0, cal)
    k = bound.outlier_count(D)
    packed = bound.new_store(BITS, D, B, dtype, "cpu", "key")
    assert feed(packed, x, [1, 15, 1, 20]) is None
    simulated = feed(bound.new_store(BITS, D, B, dtype, "cpu", "key", simulate=True), x, [1, 15, 1, 20])
    got = packed.dequantize()
    torch.testing.assert_close(got, simulated, rtol=0, atol=0)
    want, tie = oracle(x, torch.arange(T), BITS, cal.layer(0), k)
    want[:, :, :sinks], tie[:, :, :sinks] = x[:, :, :sinks].double(), False  # sink tokens exact
    quantized_from = sinks + max(T - sinks - residual, 0)
    want[:, :, quantized_from:], tie[:, :, quantized_from:] = x[:, :, quantized_from:].double(), False
    assert tie.float().mean() < 0.1
    close = ((got.double() - want.to(dtype).double()).abs() <= 2e-5 + 1e-2 * want.abs()).all(-1)  # (B, H, T)
    assert (close | tie).all(), (~close & ~tie).nonzero()[:5]
    assert torch.equal(got[:, 1], x[:, 1])  # the 16-bit head
    assert (got[:, 0] != x[:, 0]).any()  # the quantization is felt


def test_positions_follow_starts_at_keep_last_and_select():
    """Tokens appended after starts_at(p) sit at p, p + 1, ...; keep_last keeps the newest tokens' positions;
    select keeps each row's chosen tokens with their own positions (stored as int32 and counted)."""
    _, cal = calibration()
    bound = scheme(sink_tokens=2).for_layer(0, cal)
    T, start = 20, 100
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, len(BITS), T, D, generator=g, dtype=torch.float64) * 2
    store = bound.new_store(BITS, D, B, torch.float32, "cpu", "key")
    store.starts_at(start)  # a sliding window that already dropped the first 100 tokens: no sinks held
    feed(store, x.float(), [7, 13])
    positions = torch.arange(start, start + T)
    want, tie = oracle(x.float(), positions, BITS, cal.layer(0), 0)
    assert not tie.any()
    torch.testing.assert_close(store.dequantize().double(), want.float().double(), atol=1e-4, rtol=1e-4)
    before = store.nbytes()
    store.keep_last(12)
    torch.testing.assert_close(
        store.dequantize().double(), want[:, :, -12:].float().double(), atol=1e-4, rtol=1e-4
    )
    index = torch.stack(
        [torch.tensor([0, 3, 4, 9, 11]), torch.tensor([1, 2, 5, 6, 10]), torch.tensor([0, 1, 2, 3, 4])]
    )
    store.select(index)
    kept = want[:, :, -12:]
    expected = torch.stack([kept[b, :, index[b]] for b in range(B)])
    torch.testing.assert_close(store.dequantize().double(), expected.float().double(), atol=1e-4, rtol=1e-4)
    base = store.parts[1]
    assert base.positions.kept.dtype == torch.int32 and base.positions.kept.shape == (B, 5)
    assert torch.equal(base.positions.kept[0].long(), start + 8 + index[0])
    tables = sum(bound.table_bytes(b, D, "key") for b in BITS)
    assert before == pytest.approx(tables + sum(B * T * bound.token_bytes(b, D, "key") for b in BITS))
    assert store.nbytes() == pytest.approx(
        tables + sum(B * 5 * bound.token_bytes(b, D, "key") for b in BITS) + B * 5 * POSITION_BYTES
    )
    x2 = torch.randn(B, len(BITS), 2, D, generator=g, dtype=torch.float64)
    store.append(x2.float())  # appended after the selection: positions 120 and 121
    want2, _ = oracle(x2.float(), torch.arange(start + T, start + T + 2), BITS, cal.layer(0), 0)
    torch.testing.assert_close(
        store.dequantize()[:, :, -2:].double(), want2.float().double(), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("outliers", [0.0, 0.05])
@pytest.mark.parametrize("sinks, residual", [(0, 0), (2, 3)])
def test_bytes_are_the_byte_model(outliers, sinks, residual):
    _, cal = calibration()
    bound = scheme(outliers, sink_tokens=sinks, residual=residual).for_layer(0, cal)
    store = bound.new_store(BITS, D, B, torch.float16, "cpu", "key")
    T = 29
    feed(store, torch.randn(B, len(BITS), T, D, dtype=torch.float16), [3, 26])
    quantized = T - sinks - residual
    want = sum(
        bound.table_bytes(b, D, "key")
        + B * (quantized * bound.token_bytes(b, D, "key") + (T - quantized) * D * 2)
        for b in BITS
    )
    assert store.nbytes() == pytest.approx(want)
    assert bound.table_bytes(3, D, "key") == D * 8 * 2 and bound.table_bytes(3, D, "value") == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_constant_zero_and_huge_keys_give_no_nan(dtype):
    _, cal = calibration()
    bound = scheme(0.05).for_layer(0, cal)
    x = torch.zeros(B, len(BITS), 12, D)
    x[:, :, 4:8] = 3.0
    x[:, :, 8:] = 1e30
    x = x.to(dtype) if dtype != torch.float16 else x.clamp(-65504, 65504).to(dtype)
    for simulate in (False, True):
        store = bound.new_store(BITS, D, B, dtype, "cpu", "key", simulate=simulate)
        feed(store, x, [5, 7])
        got = store.dequantize()
        assert got.dtype == dtype and torch.isfinite(got).all()


def test_widths_and_an_unbound_scheme_are_one_line_errors():
    with pytest.raises(
        ValueError,
        match=r"^bits: \[8\] with quant.scheme nuqkey, which stores quantized heads at 2, 3, 4 bits",
    ):
        scheme().for_layer(0, calibration()[1]).new_store([8, 16], D, 1, torch.float32, "cpu", "key")
    with pytest.raises(ValueError, match="^quant.scheme: nuqkey stores keys against tables fitted"):
        scheme().new_store([4], D, 1, torch.float32, "cpu", "key")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sinks, residual", [(0, 0), (1, 2)])
def test_nuqkey_codebook_is_nuqkeys_keys_and_codebooks_values(dtype, sinks, residual):
    """Each role in its family's format exactly: keys as nuqkey's store holds them, values as codebook's, and the
    quantized values as codebook.quantize makes them; bytes per role as that family's byte model."""
    z0, cal = calibration()
    g = torch.Generator().manual_seed(21)
    T = 23
    x = rope(z0[:T].transpose(0, 1).double(), torch.arange(T))[None].expand(B, -1, -1, -1)  # (B, H, T, D)
    x = (x + 0.2 * torch.randn(x.shape, generator=g, dtype=torch.float64)).to(dtype)
    options = dict(group_size=8, outliers=0.05, sink_tokens=sinks, residual=residual)
    paired = get_scheme("nuqkey_codebook", **options).for_layer(0, cal)
    keys = get_scheme("nuqkey", **options).for_layer(0, cal)
    values = get_scheme("codebook", **{**options, "outliers": 0.0})
    for role, family in (("key", keys), ("value", values)):
        for simulate in (False, True):
            got = paired.new_store(BITS, D, B, dtype, "cpu", role, simulate=simulate)
            want = family.new_store(BITS, D, B, dtype, "cpu", role, simulate=simulate)
            feed(got, x, [2, 9, 12])
            feed(want, x, [2, 9, 12])
            assert torch.equal(got.dequantize(), want.dequantize()), (role, simulate)
            assert got.nbytes() == want.nbytes(), (role, simulate)
        for b in (2, 3, 4):
            assert paired.token_bytes(b, D, role) == family.token_bytes(b, D, role)
    store = paired.new_store(BITS, D, B, dtype, "cpu", "value")
    feed(store, x, [T])
    quantized = slice(sinks, T - residual)
    for h, b in enumerate(BITS):
        if b != FULL_WIDTH:
            want = codebook.quantize(x[:, h, quantized], b, dtype)[2]
            assert torch.equal(store.dequantize()[:, h, quantized], want), h
    assert paired.token_bytes(4, D, "value") == reference.packed_dim(D, 4) + 2  # b + 0.5 bits at D = 32
    held = (f" sink_tokens={sinks}" if sinks else "") + (f" residual={residual}" if residual else "")
    assert paired.label() == f"nuqkey_codebook{held} outliers=0.05"  # no group size: neither role has groups


def test_nuqkey_codebook_needs_a_power_of_two_head_dim():
    _, cal = calibration()
    paired = get_scheme("nuqkey_codebook").for_layer(0, cal)
    with pytest.raises(
        ValueError, match=r"^quant.scheme: nuqkey_codebook needs a power-of-two head_dim; .* 48$"
    ):
        paired.new_store([4], 48, 1, torch.float32, "cpu", "value")


# ---------------------------------------------------------------------------------------------------------
# models


def chunked_logits(model, ids: torch.Tensor, cache, chunks) -> torch.Tensor:
    out, start = [], 0
    for n in chunks:
        out.append(model(input_ids=ids[:, start : start + n], past_key_values=cache, use_cache=True).logits)
        start += n
    return torch.cat(out, 1).float()


def asym_values(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """nuqkey's values: asym_token's groups along head_dim (kernels.reference's quantize-dequantize)."""
    return reference.fake_quantize(x, bits, group_size)


def codebook_values(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """nuqkey_codebook's values: codebook's format (harness.schemes.codebook.quantize)."""
    return codebook.quantize(x, bits, x.dtype)[2]


class OracleCache(DynamicCache):
    """A DynamicCache that holds the oracle's keys (the others at their positions against the layer's levels) and
    `values(x, bits, group_size)`'s values, token 0 exact (one sink token)."""

    def __init__(self, config, bits: int, cal: KeyCalibration, group_size: int, values=asym_values):
        super().__init__(config=config)
        self.bits, self.cal, self.group_size, self.seen = bits, cal, group_size, {}
        self.values = values

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        start = self.seen.get(layer_idx, 0)
        positions = torch.arange(start, start + key_states.shape[2])
        self.seen[layer_idx] = start + key_states.shape[2]
        keys, _ = oracle(
            key_states, positions, [self.bits] * key_states.shape[1], self.cal.layer(layer_idx), 0
        )
        values = self.values(value_states, self.bits, self.group_size)
        sink = positions == 0  # the sink token, keys and values exact
        keys[:, :, sink], values[:, :, sink] = key_states[:, :, sink].double(), value_states[:, :, sink]
        return super().update(keys.to(key_states.dtype), values, layer_idx, *args, **kwargs)


@pytest.mark.parametrize(
    "name, scheme_name, values",
    [
        ("tiny-llama", "nuqkey", asym_values),
        ("tiny-gemma3", "nuqkey", asym_values),
        ("tiny-llama", "nuqkey_codebook", codebook_values),
        ("tiny-gemma3", "nuqkey_codebook", codebook_values),
    ],
)
@torch.no_grad()
def test_tiny_model_through_the_cache_is_the_oracle(name, scheme_name, values):
    model = load_model(name)[0]
    g = torch.Generator().manual_seed(12)
    cal = fit_key_calibration(model, torch.randint(0, 256, (16, 48), generator=g), span=64)
    ids = torch.randint(0, 256, (2, 29), generator=g)  # past tiny-gemma3's sliding window of 16
    chunks = [12, 9, 1, 1, 6]
    exact = chunked_logits(model, ids, DynamicCache(config=model.config), chunks)
    options = dict(scheme=scheme_name, group_size=16, prefill="quantized", key_calibration=cal, sink_tokens=1)
    with installed(model, PACKED):
        packed = chunked_logits(model, ids, QuantizedKVCache(model.config, 4, **options), chunks)
        cache = QuantizedKVCache(model.config, 4, simulate=True, **options)
        simulated = chunked_logits(model, ids, cache, chunks)
    want = chunked_logits(model, ids, OracleCache(model.config, 4, cal, 16, values), chunks)
    # The packed attention sums in another order than the model's: a later layer's key or value on a rounding
    # boundary can round the other way, one level apart.
    assert (packed - simulated).abs().amax() <= 0.01 * exact.abs().amax()
    # The oracle rounds in float64, the store in float32: a channel on a level boundary can take the other level.
    assert (simulated - want).abs().amax() <= 2e-3 * exact.abs().amax()
    assert (simulated - exact).abs().amax() > 0  # the quantization is felt
    assert 0 < cache.nbytes() < cache.nbytes_fp16()


@torch.no_grad()
def test_the_levels_come_from_the_calibration_windows_only(tmp_path, monkeypatch):
    model, _ = load_model("tiny-llama")
    g = torch.Generator().manual_seed(15)
    calib = torch.randint(0, 256, (2, 24), generator=g)
    point = base_point(compose_point(["model=tiny-llama", "quant=nuqkey", "eval=tiny"]))

    def context(calib_ids, sequences):
        return SimpleNamespace(
            model=model,
            name="tiny-llama",
            calib_ids=calib_ids,
            sequences=sequences,
            key_calibration={},
            calibration_source=None,
        )

    first = context(calib, torch.randint(0, 256, (2, 24), generator=g))
    other_eval = context(calib, torch.randint(0, 256, (2, 24), generator=g))
    other_calib = context(torch.randint(0, 256, (2, 24), generator=g), first.sequences)
    tables = []
    for ctx in (first, other_eval, other_calib):
        monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / str(len(tables))))
        tables.append(key_calibration(ctx, point).layer(1))
    assert torch.equal(tables[0].levels[3], tables[1].levels[3])
    assert not torch.equal(tables[0].levels[3], tables[2].levels[3])
    keys, positions = calibration_keys(model, calib)[1]  # layer 1's keys after RoPE, turned back below
    inv_freq = rotary_frequencies(model, "full_attention")
    half = len(inv_freq)
    z = torch.complex(keys[..., :half].double(), keys[..., half : 2 * half].double()) * torch.polar(
        torch.ones(len(positions), 1, half, dtype=torch.float64),
        -positions.double()[:, None, None] * inv_freq.double(),
    )
    unturned = torch.cat([z.real, z.imag, keys[..., 2 * half :].double()], -1).float()  # (N, H, D)
    want = fit_levels(unturned.reshape(len(unturned), -1), 8).view(*unturned.shape[1:], 8)
    torch.testing.assert_close(tables[0].levels[3].float(), want.half().float(), atol=2e-3, rtol=2e-3)
