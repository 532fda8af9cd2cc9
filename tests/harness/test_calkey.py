"""The calkey scheme: its key tables fitted from calibration keys (pairs turned by RoPE covered at every position of
the span, channels without RoPE by their own range), its key store against an oracle written from the table alone
(one step, outliers exact, bytes as the byte model, keep_last / select, no NaN on nasty inputs), tiny models
through QuantizedKVCache against a DynamicCache holding the oracle's keys, the tables read from calibration windows
only, and its configuration errors."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import DynamicCache

from harness import capacity, data
from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.calibrate.keys import fit_key_calibration, fit_table
from harness.calibrate.windows import calibration_keys, rotary_frequencies
from harness.config import base_point
from harness.config import compose as compose_point
from harness.models import load_model
from harness.run import runner
from harness.run.measure import key_calibration, point_scheme
from harness.schemes import CalKey, KeyCalibration, get_scheme
from harness.schemes.key_table import SCALE_MIN
from harness.sensitivity import allocation_kl, probe_ids
from harness.sensitivity.unit_kl import baseline_run
from harness.validate import ConfigError, validate_config
from kernels import reference
from kernels.layout import FULL_WIDTH

ROOT = Path(__file__).resolve().parents[2]
B, D = 2, 32
BITS = [4, 16, 2, 8, 3]  # one head per stored width, a 16-bit head among them


def rope(z0: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys (N, H, R) in rotate_half layout: pairs z0 (N, H, R / 2) complex, turned by position * inv_freq."""
    turn = positions[:, None, None].float() * inv_freq  # (N, 1, R / 2)
    z = z0 * torch.polar(torch.ones_like(turn), turn)
    return torch.cat([z.real, z.imag], -1)


def calibration(heads: int = len(BITS), dim: int = D, seed: int = 0) -> tuple[torch.Tensor, KeyCalibration]:
    """Calibration keys (N, H, dim) with channels of very different ranges and offsets, and one layer's table
    fitted on them (no RoPE: every channel alone)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(200, heads, dim, generator=g) * torch.logspace(-1, 1, dim) + torch.linspace(-2, 3, dim)
    table = fit_table(keys, torch.arange(1, 201), torch.zeros(0), span=256, quantile=1.0)
    return keys, KeyCalibration((table,))


def oracle(x: torch.Tensor, bits: list[int], scale: torch.Tensor, zero: torch.Tensor, k: int) -> torch.Tensor:
    """x (B, H, T, D) stored as calkey stores keys, head h at bits[h] against scale, zero (H, D), in the float32
    steps of the format's contract: the nearest of 2**b - 1 levels spaced scale / qmax around zero (clipped to
    zero +- scale), the k largest |x - zero| / scale of each token kept as 2-byte floats; 16-bit heads unchanged.
    float32."""
    out = x.float().clone()
    for h, b in enumerate(bits):
        if b == FULL_WIDTH:
            continue
        qmax = 2 ** (b - 1) - 1
        s, z = scale[h].float(), zero[h].float()
        y = (x[:, h].float().clamp(-65504, 65504) - z) / s
        deq = (torch.floor(y * qmax + 0.5).clamp(-qmax, qmax)) * (s / qmax) + z
        kept = y.abs().topk(k, -1).indices
        two_bytes = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float16  # outliers' own dtype
        out[:, h] = deq.scatter(-1, kept, x[:, h].gather(-1, kept).to(two_bytes).float())
    return out


def step(bits: list[int], scale: torch.Tensor) -> torch.Tensor:
    """The level spacing of each head and channel (H, 1, D) (0 for 16-bit heads)."""
    qmax = torch.tensor([0.0 if b == FULL_WIDTH else 2 ** (b - 1) - 1 for b in bits])
    spacing = torch.where(qmax[:, None] > 0, scale.double() / qmax.clamp(min=1)[:, None], 0.0)  # (H, D)
    return spacing[:, None]


def feed(store, x: torch.Tensor, chunks) -> torch.Tensor | None:
    start, got = 0, None
    for n in chunks:
        got = store.append(x[:, :, start : start + n])
        start += n
    assert start == x.shape[2]
    return got


def scheme(outliers: float = 0.0, **options) -> CalKey:
    return get_scheme("calkey", group_size=8, outliers=outliers, **options)


# ---------------------------------------------------------------------------------------------------------
# the tables


def test_a_pair_that_turns_is_covered_at_every_position_of_the_span():
    """Keys before RoPE with a fixed direction per pair (offsets), seen at positions 1..64 only: at any position
    of the span their channels stay inside the fitted range; a pair turning a full circle within the span has zero
    0 and the largest norm as scale; a pair that never turns has its channels' own min/max."""
    g = torch.Generator().manual_seed(3)
    half, span = 8, 4096
    inv_freq = torch.cat([torch.logspace(0, -3, half - 1), torch.zeros(1)])  # the last pair never turns
    z0 = torch.polar(
        1 + torch.rand(500, 2, half, generator=g), 0.3 * torch.randn(500, 2, half, generator=g) + 1
    )
    positions = torch.randint(1, 65, (500,), generator=g)
    table = fit_table(rope(z0, positions, inv_freq), positions, inv_freq, span, 1.0)
    anywhere = rope(z0, torch.randint(0, span, (500,), generator=g), inv_freq)
    y = (anywhere - table.zero.float()) / table.scale.float()
    assert y.abs().max() <= 1.01  # the fp16 rounding of scale and zero aside
    full = (inv_freq * (span - 1) >= 2 * math.pi).nonzero().flatten()  # pairs that turn a full circle
    assert len(full) > 0
    for i in full.tolist():
        assert (table.zero[:, [i, i + half]] == 0).all()
        norm = z0[..., i].abs().amax(0)
        torch.testing.assert_close(table.scale[:, i].float(), norm, rtol=1e-3, atol=0)
        assert torch.equal(table.scale[:, i], table.scale[:, i + half])
    still = torch.cat([z0.real[..., -1:], z0.imag[..., -1:]], -1)  # (N, H, 2): the pair that never turns
    lo, hi = still.amin(0), still.amax(0)
    torch.testing.assert_close(
        table.zero[:, [half - 1, 2 * half - 1]].float(), (hi + lo) / 2, atol=2e-3, rtol=1e-3
    )
    torch.testing.assert_close(
        table.scale[:, [half - 1, 2 * half - 1]].float(), (hi - lo) / 2, atol=2e-3, rtol=1e-3
    )


def test_the_positions_are_the_keys_own():
    """A table fitted at the wrong positions misses the turned keys: the position is what unturns them."""
    g = torch.Generator().manual_seed(4)
    inv_freq = torch.tensor([0.01, 0.002])
    z0 = torch.polar(torch.ones(300, 1, 2), 0.1 * torch.randn(300, 1, 2, generator=g))
    positions = torch.randint(1, 200, (300,), generator=g)
    keys = rope(z0, positions, inv_freq)
    right = fit_table(keys, positions, inv_freq, span=200, quantile=1.0)
    wrong = fit_table(keys, torch.zeros_like(positions), inv_freq, span=200, quantile=1.0)
    assert not torch.equal(right.zero, wrong.zero)
    y = (rope(z0, torch.full((300,), 199), inv_freq) - right.zero.float()) / right.scale.float()
    assert y.abs().max() <= 1.01


def test_a_channel_never_seen_away_from_zero_keeps_a_positive_scale():
    keys = torch.zeros(10, 1, 8)
    keys[:, :, 1] = 5.0  # constant
    table = fit_table(keys, torch.arange(1, 11), torch.zeros(0), span=16)
    assert (table.scale >= SCALE_MIN).all() and table.zero[0, 1] == 5.0 and table.zero[0, 0] == 0.0


@pytest.mark.parametrize("shuffled", [False, True])
def test_the_table_frame_round_trips(shuffled):
    """Layers apart by one without a table; the frame's rows in their order or in any (a table read back)."""
    _, cal = calibration()
    tables = KeyCalibration((None, *cal.tables, None, *cal.tables))
    frame = tables.to_frame()
    if shuffled:
        frame = frame.sample(frac=1, random_state=int(torch.randint(0, 2**31, ())))
    back = KeyCalibration.from_frame(frame, 5)
    assert back.tables[0] is None and back.tables[2] is None and back.tables[4] is None
    assert back.digest() == tables.digest()
    for again in (back.tables[1], back.tables[3]):
        assert torch.equal(again.scale, cal.tables[0].scale) and torch.equal(again.zero, cal.tables[0].zero)
        assert torch.equal(again.turn, cal.tables[0].turn)
        assert all(torch.equal(again.levels[b], cal.tables[0].levels[b]) for b in cal.tables[0].levels)
    assert KeyCalibration.from_frame(KeyCalibration((None, None)).to_frame(), 2).tables == (None, None)
    with pytest.raises(ValueError, match="^key calibration: no fitted key table for layer 0$"):
        back.layer(0)


# ---------------------------------------------------------------------------------------------------------
# the store


@pytest.mark.parametrize("outliers", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_store_is_the_oracle_within_a_step_packed_and_simulated(outliers, dtype):
    keys, cal = calibration(seed=5)
    table = cal.tables[0]
    g = torch.Generator().manual_seed(6)
    x = torch.randn(B, len(BITS), 37, D, generator=g) * torch.logspace(-1, 1, D) + torch.linspace(-2, 3, D)
    x = x.to(dtype)  # (B, H, T, D), odd T, mostly inside the calibration range, some beyond it (clipped)
    bound = scheme(outliers).for_layer(0, cal)
    simulated = feed(bound.new_store(BITS, D, B, dtype, "cpu", "key", simulate=True), x, (1, 15, 21))
    packed = bound.new_store(BITS, D, B, dtype, "cpu", "key")
    assert feed(packed, x, (20, 17)) is None  # packed-only: nothing dequantized is kept
    got = packed.dequantize()
    assert got.dtype == dtype
    torch.testing.assert_close(got, simulated, rtol=0, atol=0)
    k = bound.outlier_count(D)
    want = oracle(x, BITS, table.scale, table.zero, k)
    # one level apart at most (a value on a rounding boundary), plus the dtype's rounding of the result
    slack = step(BITS, table.scale) + want.abs() * torch.finfo(dtype).eps + 1e-6
    assert ((got.double() - want).abs() <= slack).all()
    assert torch.equal(got[:, 1], x[:, 1])  # the 16-bit head
    inside = ((x.double() - table.zero.double()[:, None]).abs() <= table.scale.double()[:, None]).all(
        -1
    )  # (B, H, T)
    err = (got.double() - x.double()).abs()
    half_step = step(BITS, table.scale) / 2 + x.double().abs() * torch.finfo(dtype).eps + 1e-6
    assert ((err <= half_step) | ~inside[..., None]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_outliers_are_kept_exactly(dtype):
    """The ceil(outliers * D) largest normalised values of each key come back exactly (bf16 and fp16 values are
    2-byte floats already), far outside the table's range."""
    _, cal = calibration(heads=2, seed=7)
    table = cal.tables[0]
    g = torch.Generator().manual_seed(8)
    x = table.zero.float()[None, :, None] + 0.3 * table.scale.float()[None, :, None] * torch.randn(
        3, 2, 11, D, generator=g
    )
    spots = torch.stack([torch.randperm(D, generator=g)[:2] for _ in range(3 * 2 * 11)]).view(3, 2, 11, 2)
    big = 1000.0 * (1 + torch.rand(3, 2, 11, 2, generator=g)) * torch.randn(3, 2, 11, 2, generator=g).sign()
    x = x.scatter(-1, spots, big).to(dtype)
    bound = scheme(0.05).for_layer(0, cal)  # ceil(0.05 * 32) = 2 outliers per key
    assert bound.outlier_count(D) == 2
    store = bound.new_store([3, 4], D, 3, dtype, "cpu", "key")
    feed(store, x, (4, 7))
    got = store.dequantize()
    two_bytes = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16  # float32 keys: rounded to fp16
    assert torch.equal(got.gather(-1, spots), x.gather(-1, spots).to(two_bytes).to(dtype))
    if dtype != torch.float32:
        assert torch.equal(got.gather(-1, spots), x.gather(-1, spots))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("outliers", [0.0, 0.05])
def test_constant_zero_and_huge_keys_give_no_nan(dtype, outliers):
    """Tables fitted on zeros and on huge keys, and keys of zeros, constants, the dtype's extremes and 1e30 in
    float32: every value finite, zeros exact against a centred table."""
    finfo = torch.finfo(dtype)
    for calib in (torch.zeros(20, 5, D), torch.full((20, 5, D), 1e30), torch.randn(20, 5, D) * 1e4):
        table = fit_table(calib, torch.arange(1, 21), torch.full((D // 2,), 0.7), span=64)
        bound = scheme(outliers).for_layer(0, KeyCalibration((table,)))
        x = torch.zeros(B, 5, 4, D, dtype=dtype)
        x[:, :, 1] = 3.0
        x[:, :, 2] = finfo.max
        x[:, :, 3, ::2] = -finfo.max
        if dtype == torch.float32:
            x[:, :, 3, 1::2] = 1e30
        store = bound.new_store(BITS, D, B, dtype, "cpu", "key", simulate=True)
        got = feed(store, x, (1, 3))
        assert torch.isfinite(got).all() and torch.isfinite(store.dequantize()).all()
        assert torch.isfinite(table.scale).all() and torch.isfinite(table.zero).all()
        if (table.zero == 0).all():
            assert torch.equal(got[:, :, 0], x[:, :, 0])  # zeros stay exact


@pytest.mark.parametrize("outliers", [0.0, 0.05])
@pytest.mark.parametrize("sinks, residual", [(0, 0), (1, 0), (2, 3)])
def test_bytes_are_the_byte_model(outliers, sinks, residual):
    """nbytes = quantized tokens at token_bytes + fp16 tokens + the table once (table_bytes per quantized head)."""
    _, cal = calibration(seed=9)
    bound = scheme(outliers, sink_tokens=sinks, residual=residual).for_layer(0, cal)
    x = torch.randn(B, len(BITS), 30, D, dtype=torch.float16)
    store = bound.new_store(BITS, D, B, torch.float16, "cpu", "key")
    table = sum(bound.table_bytes(b, D, "key") for b in BITS)
    assert (
        table == 4 * (2 * D * 2) and bound.table_bytes(4, D, "value") == 0
    )  # 4 quantized heads, fp16 s and z
    start = 0
    for n in (1, 12, 17):
        store.append(x[:, :, start : start + n])
        start += n
        quantized = max(start - min(sinks, start) - residual, 0)
        per_token = sum(bound.token_bytes(b, D, "key") for b in BITS)
        fp16 = D * 2 * len(BITS)
        assert store.nbytes() == B * (quantized * per_token + (start - quantized) * fp16) + table
    k = bound.outlier_count(D)
    assert (
        bound.token_bytes(4, D, "key") == D // 2 + 3 * k
        and bound.token_bytes(4, D, "value") == D // 2 + 2 * 2 * D // 8
    )


def test_keep_last_and_select_keep_the_stored_bytes_and_values():
    _, cal = calibration(seed=10)
    bound = scheme(0.05).for_layer(0, cal)
    x = torch.randn(B, len(BITS), 21, D)
    store = bound.new_store(BITS, D, B, torch.float32, "cpu", "key")
    feed(store, x, (9, 12))
    before = store.dequantize()
    per_token = B * sum(bound.token_bytes(b, D, "key") for b in BITS)
    table = sum(bound.table_bytes(b, D, "key") for b in BITS)
    store.keep_last(13)
    assert store.length == 13 and store.nbytes() == 13 * per_token + table
    assert torch.equal(store.dequantize(), before[:, :, 8:])
    index = torch.tensor([[0, 3, 4, 12], [1, 2, 5, 11]])
    store.select(index)
    assert store.length == 4 and store.nbytes() == 4 * per_token + table
    want = torch.stack([before[b, :, 8:][:, index[b]] for b in range(B)])
    assert torch.equal(store.dequantize(), want)


# ---------------------------------------------------------------------------------------------------------
# through QuantizedKVCache on tiny models


class OracleCache(DynamicCache):
    """A DynamicCache that holds the oracle's keys (the layer's table) and asym_token's values."""

    def __init__(self, config, bits: int, cal: KeyCalibration, group_size: int, outliers: float):
        super().__init__(config=config)
        self.bits, self.cal, self.group_size, self.outliers = bits, cal, group_size, outliers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        table = self.cal.layer(layer_idx)
        widths = [self.bits] * key_states.shape[1]
        k = math.ceil(self.outliers * key_states.shape[-1])
        keys = oracle(key_states, widths, table.scale, table.zero, k).to(key_states.dtype)
        values = reference.fake_quantize(value_states, self.bits, self.group_size)
        return super().update(keys, values, layer_idx, *args, **kwargs)


def chunked_logits(model, ids, cache, chunks):
    out, start = [], 0
    for n in chunks:
        out.append(model(input_ids=ids[:, start : start + n], past_key_values=cache, use_cache=True).logits)
        start += n
    return torch.cat(out, 1)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-gemma3"])
@torch.no_grad()
def test_tiny_model_through_the_cache_is_the_oracle_and_close_to_exact_at_8_bits(name):
    model = load_model(name)[0]
    g = torch.Generator().manual_seed(11)
    # 16 windows and the max: the random model's keys depend mostly on the token, so every token of the small
    # vocabulary is seen and none clipped (the table's quantile is measured on a real model: key_table.py)
    cal = fit_key_calibration(model, torch.randint(0, 256, (16, 48), generator=g), span=64, quantile=1.0)
    ids = torch.randint(0, 256, (2, 29), generator=g)  # past tiny-gemma3's sliding window of 16
    chunks = [12, 9, 1, 1, 6]
    exact = chunked_logits(model, ids, DynamicCache(config=model.config), chunks)
    for bits, outliers in ((8, 0.0), (4, 0.05)):
        options = dict(
            scheme="calkey", group_size=16, prefill="quantized", key_calibration=cal, outliers=outliers
        )
        with installed(model, PACKED):
            packed = chunked_logits(model, ids, QuantizedKVCache(model.config, bits, **options), chunks)
            cache = QuantizedKVCache(model.config, bits, simulate=True, **options)
            simulated = chunked_logits(model, ids, cache, chunks)
        want = chunked_logits(model, ids, OracleCache(model.config, bits, cal, 16, outliers), chunks)
        # The packed attention sums in another order than the model's: a later layer's key or value whose code
        # sits on a rounding boundary can round the other way (asym_token's values alike), one level apart.
        assert (packed - simulated).abs().amax() <= 0.01 * exact.abs().amax(), (name, bits)
        torch.testing.assert_close(simulated, want, rtol=1e-4, atol=1e-4)
        assert 0 < cache.nbytes() < cache.nbytes_fp16()
        if bits == 8:
            scale = exact.abs().amax()
            assert (packed - exact).abs().amax() <= 0.03 * scale, (name, (packed - exact).abs().amax(), scale)
            assert (packed - exact).abs().amax() > 0  # the quantization is felt


@torch.no_grad()
def test_capacity_counts_the_tables_as_the_cache_holds_them():
    model = load_model("tiny-llama")[0]
    cal = fit_key_calibration(
        model, torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(12)), span=64
    )
    bits = torch.tensor([[4, 16, 2], [8, 3, 16], [16, 16, 16]])
    cache = QuantizedKVCache(
        model.config, bits, scheme="calkey", group_size=16, prefill="quantized", sink_tokens=1,
        key_calibration=cal, outliers=0.05, value_bits=4,
    )  # fmt: skip
    shape = capacity.shape_from_config(model.config, "tiny-llama")
    storage = get_scheme("calkey", 16, sink_tokens=1, residual=0, outliers=0.05)
    assert capacity.cache_bytes(shape, 0, bits, storage, 2, 4).true_bytes == 0
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(13))
    with installed(model, PACKED):
        for start, end in ((0, 11), (11, 12), (12, 19)):
            model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True)
            assert capacity.cache_bytes(shape, end, bits, storage, 2, 4).true_bytes == cache.nbytes(), end


def test_the_capacity_command_prices_the_outliers():
    argv = ["--model", "tiny-llama", "--context", "100", "--scheme", "calkey", "--sink-tokens", "1", "--json"]
    shape, (bare,) = capacity.rows(capacity.parser().parse_args(argv))
    _, (kept,) = capacity.rows(capacity.parser().parse_args([*argv, "--outliers", "0.05"]))
    storage = get_scheme("calkey", 32, sink_tokens=1, residual=0, outliers=0.05)
    assert kept["true_bytes"] == capacity.cache_bytes(shape, 100, 4, storage).true_bytes > bare["true_bytes"]
    with pytest.raises(
        ValueError, match=r"^quant.outliers: 0.05 with quant.scheme asym_token, which keeps no"
    ):
        capacity.rows(capacity.parser().parse_args([*argv[:4], "--outliers", "0.05"]))


# ---------------------------------------------------------------------------------------------------------
# calibration windows only, and configuration


def test_the_tables_come_from_the_calibration_windows_only(tmp_path, monkeypatch):
    model, _ = load_model("tiny-llama")
    g = torch.Generator().manual_seed(14)
    calib = torch.randint(0, 256, (2, 24), generator=g)
    point = base_point(compose_point(["model=tiny-llama", "quant=calkey", "eval=tiny"]))

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
        monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / str(len(tables))))  # no disk cache between them
        tables.append(key_calibration(ctx, point).layer(1))
    assert torch.equal(tables[0].scale, tables[1].scale) and torch.equal(tables[0].zero, tables[1].zero)
    assert not torch.equal(tables[0].scale, tables[2].scale)
    # read back from disk, unchanged; keys of calibration position 0 never enter
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "0"))
    again = key_calibration(context(calib, None), point).layer(1)
    assert torch.equal(again.scale, tables[0].scale) and torch.equal(again.zero, tables[0].zero)
    (keys, positions), *_ = calibration_keys(model, calib)
    assert positions.min() == 1 and len(positions) == 2 * 23 and keys.shape == (46, 3, 32)
    assert rotary_frequencies(model, "full_attention").shape == (16,)
    assert key_calibration(context(calib, None), point.replace(scheme="asym_token")) is None


def test_missing_calibration_is_a_one_line_error():
    model = load_model("tiny-llama")[0]
    with pytest.raises(ValueError, match="^quant.scheme: calkey stores keys against tables fitted") as err:
        QuantizedKVCache(model.config, 4, scheme="calkey")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="^quant.scheme: calkey stores keys against tables fitted"):
        scheme().new_store([4], D, 1, torch.float32, "cpu", "key")
    assert scheme().new_store([4], D, 1, torch.float32, "cpu", "value").length == 0  # values need no table
    point = base_point(compose_point(["model=tiny-llama", "quant=calkey", "eval=tiny"]))
    ctx = SimpleNamespace(
        model=model, name="tiny-llama", calib_ids=None, key_calibration={}, calibration_source=None
    )
    with pytest.raises(
        ValueError, match="^quant.scheme: calkey fits its key tables on the calibration windows"
    ):
        key_calibration(ctx, point)


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_quant_calkey_validates_and_keys_outliers_only_when_set():
    points = validate_config(compose_cfg("quant=calkey", "quant.outliers=0.01"))
    # the first token (BOS) is kept in fp16 by default
    assert {(p.scheme, p.outliers, p.sink_tokens) for p in points} == {("calkey", 0.01, 1)}
    assert (
        get_scheme("calkey", 32, sink_tokens=1, outliers=0.01).label()
        == "calkey g32 sink_tokens=1 outliers=0.01"
    )
    plain = validate_config(compose_cfg())[0]
    assert plain.key() == plain.replace(outliers=0.0).key()  # 0 outliers stay out of the key
    assert plain.key() != plain.replace(outliers=0.01, scheme="calkey").key()
    # single tokens can be evicted once no sink store has to be split per row
    assert validate_config(compose_cfg("quant=calkey", "quant.sink_tokens=0", "eviction=h2o"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["quant.outliers=0.01"],
            r"^quant.outliers: 0.01 with quant.scheme asym_token, which keeps no outliers; allowed: 0, or a scheme that keeps them \(calkey, nuqkey, nuqkey_codebook, pca, pca_post, pca_block, .*pca_post_ug\)$",
        ),
        (
            ["quant=calkey", "quant.outliers=1.5"],
            r"^quant.outliers: 1.5 is not allowed; allowed: a fraction in \[0, 1\)$",
        ),
        (["quant=calkey", "quant.outliers=true"], r"^quant.outliers: True is not allowed"),
        (
            ["quant=calkey", "quant.key_group_size=16"],
            r"^quant.key_group_size: 16 with calkey, whose keys have no groups",
        ),
        (
            ["quant=calkey", "policy=sensitivity"],
            r"^policy.name: sensitivity measures its table without fitted key tables, which quant.scheme calkey "
            r"needs; allowed with calkey: measured, or a policy that measures nothing$",
        ),
        (
            ["quant=calkey", "quant.backend=triton"],
            r"^quant.backend: triton supports only asym_token and sym_token",
        ),
    ],
)
def test_bad_calkey_options_give_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate_config(compose_cfg(*overrides))
    assert "\n" not in str(err.value)


@torch.no_grad()
def test_the_measured_policy_measures_calkey_units_through_the_points_key_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    overrides = ["model=tiny-llama", "eval=tiny", "quant=calkey", "policy=measured", "policy.budget=3"]
    (point,) = [p for p in validate_config(compose_cfg(*overrides)) if p.policy == "measured"]
    row = runner.run([point], tmp_path / "run", batch_size=4).set_index("policy").loc["measured"]
    assert row["status"] == "ok" and row["mean_bits"] <= 3 + 1e-9
    (path,) = (tmp_path / "cache").rglob("tiny-llama-unit-kl-*.parquet")
    table = pd.read_parquet(path).set_index(["layer", "kv_head", "role", "bits"])["kl"]
    assert (table > 0).all()

    model, tokenizer = load_model("tiny-llama")
    calib = data.point_windows(tokenizer, point).calibration
    ctx = SimpleNamespace(
        model=model, name="tiny-llama", calib_ids=calib, key_calibration={}, calibration_source=None
    )
    fitted = key_calibration(ctx, point)
    other = fit_key_calibration(
        model, torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3)), 64
    )
    ids = probe_ids(calib)
    base = baseline_run(model, ids, point.chunk)
    bits = {r: torch.full((3, 3), FULL_WIDTH) for r in ("key", "value")}
    bits["key"][1, 2] = 2
    kl = lambda tables: allocation_kl(
        model, ids, point_scheme(point), bits["key"], bits["value"], base, 128, tables
    )  # noqa: E731
    assert kl(fitted) == pytest.approx(table[(1, 2, "key", 2)], rel=1e-6)
    assert kl(other) != pytest.approx(table[(1, 2, "key", 2)], rel=1e-3)  # other tables: another KL
    with pytest.raises(ValueError, match="^quant.scheme: calkey stores keys against tables fitted"):
        kl(None)
