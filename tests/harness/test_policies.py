"""Tests for harness.policies: hand-worked allocations, validation messages, budget properties, the invariants
every registered policy keeps (TABLE), and the kv policy (keys and values apart)."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.config import Point
from harness.policies import (
    ALLOWED_WIDTHS,
    BUDGET_MODES,
    BUDGET_UNITS,
    POLICIES,
    Allocation,
    Entropy,
    Inverted,
    KeyValue,
    Layerwise,
    MeasuredKL,
    Random,
    Sensitivity,
    Sinks,
    Uniform,
    from_point,
    kv_head_entropy,
)
from kernels.layout import FULL_WIDTH as UNQUANTIZED

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The per-head rules on entropy (kv, whose keys and values differ, has its own tests: test_policies_kv.py).
ENTROPY_POLICIES = tuple(
    name for name in POLICIES if POLICIES.get(name).measurement is None and name != KeyValue.name
)


def allocate(entropy, budget, policy="entropy", *, price=None, sensitivity=None, **fields):
    """The policy a grid point with these policy fields names (a bits budget unless told), at `budget`."""
    point = {"policy": policy, "budget_unit": "bits", **fields}
    return from_point(point).allocate(entropy, budget, price=price, sensitivity=sensitivity)


def validate(budget, **fields):
    """The checks a grid point's policy fields and budget get (harness.validate)."""
    from_point(fields).check_budget(budget)


def table(per_query_head: dict[int, list[list[float]]], num_layers: int | None = None) -> pd.DataFrame:
    """Entropy table from {layer: [[H2 of each query head] per KV head]}; H1 = H2 + 1."""
    rows = []
    for layer, kv_heads in per_query_head.items():
        group = len(kv_heads[0])
        for kv_head, values in enumerate(kv_heads):
            for offset, value in enumerate(values):
                rows.append(
                    {
                        "layer": layer,
                        "layer_type": "full",
                        "q_head": kv_head * group + offset,
                        "kv_head": kv_head,
                        "H2": value,
                        "H1": value + 1.0,
                        "n_positions": 32,
                    }
                )
    df = pd.DataFrame(rows)
    if num_layers is not None:
        df.attrs["num_layers"] = num_layers
        df.attrs["num_kv_heads"] = len(next(iter(per_query_head.values())))
    return df


def one_layer(entropies: list[float]) -> pd.DataFrame:
    return table({0: [[value] for value in entropies]})


# ------------------------------------------------------------------------------------- kv_head_entropy


def test_kv_head_entropy_mean_and_min_over_query_heads_under_gqa():
    # 3 decoder layers, layer 1 without a KV cache; 2 KV heads with 3 query heads each.
    df = table({0: [[1.0, 2.0, 6.0], [0.5, 0.5, 2.0]], 2: [[3.0, 3.0, 3.0], [4.0, 1.0, 1.0]]}, num_layers=3)
    mean = kv_head_entropy(df)
    assert mean.dtype == torch.float64 and mean.shape == (3, 2)
    assert mean[0].tolist() == [3.0, 1.0]
    assert mean[2].tolist() == [3.0, 2.0]
    assert torch.isnan(mean[1]).all()
    assert kv_head_entropy(df, aggregate="min")[[0, 2]].tolist() == [[1.0, 0.5], [3.0, 1.0]]
    assert kv_head_entropy(df, entropy_key="H1")[0].tolist() == [4.0, 2.0]


def test_kv_head_entropy_without_attrs_uses_the_rows():
    df = table({1: [[1.0], [2.0], [3.0]]})
    out = kv_head_entropy(df)
    assert out.shape == (2, 3)
    assert torch.isnan(out[0]).all() and out[1].tolist() == [1.0, 2.0, 3.0]


def test_layers_with_fewer_kv_heads_pad_their_rows():
    # Gemma 4 style: layer 0 has 2 KV heads, layer 1 (global) 1, layer 2 no cache of its own (KV sharing).
    attrs = dict(num_layers=3, num_kv_heads=2, kv_heads=[2, 1, 2])
    df = pd.concat([table({0: [[1.0, 3.0], [2.0, 2.0]]}), table({1: [[5.0, 7.0]]})], ignore_index=True)
    df.attrs.update(attrs)
    out = kv_head_entropy(df)
    assert out[0].tolist() == [2.0, 2.0] and out[1, 0].item() == 6.0
    assert torch.isnan(out[1, 1]) and torch.isnan(out[2]).all()  # padding and the uncached layer
    alloc = allocate(df, 4, "uniform")
    assert alloc.bits.tolist() == [[4, 4], [4, 0], [0, 0]]  # 3 cached heads at 4 bits: padding holds 0
    assert alloc.cached.tolist() == [[True, True], [True, False], [False, False]]
    assert alloc.mean_bits == 4 and alloc.histogram() == {4: 3}
    mixed = allocate(df, 3, "entropy", alpha=2.0)
    assert torch.equal(mixed.cached, alloc.cached) and mixed.bits.sum() <= 3 * 3

    extra = table({1: [[5.0], [7.0]]})  # a second KV head in the global layer
    extra.attrs.update(attrs)
    with pytest.raises(ValueError, match="beyond their layer's kv_heads"):
        kv_head_entropy(extra)
    missing = df[df.kv_head == 0].copy()  # layer 0 without its second KV head
    missing.attrs.update(attrs)
    with pytest.raises(ValueError, match="lacks rows for some of its KV heads"):
        kv_head_entropy(missing)
    df.attrs.update(kv_heads=[2, 1])
    with pytest.raises(ValueError, match="kv_heads"):
        kv_head_entropy(df)


# ------------------------------------------------------------------------------------ hand-worked cases


def test_exact_mode_hand_worked_allocation():
    # Layers 0 and 2 are attention layers (layer 1 has no cache); 2 KV heads with 2 query heads each.
    # KV-head H2 (mean of query heads): layer 0: [1, 3], layer 2: [2, 2]; H_avg = 2, n = 4.
    # alpha = 0.5, budget 3: b = c + 0.5 * (2 - H) = c + [0.5, -0.5, 0, 0]; sum 4c = 12 -> c = 3,
    # b = [3.5, 2.5, 3, 3]. Round down: [3, 2, 3, 3] = 11 of 12 bits. Remaining fractions 0.5, 0.5, 0, 0:
    # head (0,0) first by order: 3 -> 4 (total 12); head (0,1): 2 -> 3 would make 13, skipped.
    df = table({0: [[0.5, 1.5], [3.0, 3.0]], 2: [[2.5, 1.5], [2.0, 2.0]]}, num_layers=3)
    alloc = allocate(df, budget=3, policy="entropy", alpha=0.5)
    assert alloc.bits.dtype == torch.int64 and alloc.bits.shape == (3, 2)
    assert alloc.bits.tolist() == [[4, 2], [0, 0], [3, 3]]
    assert alloc.mean_bits == 3.0
    assert torch.allclose(
        alloc.continuous[[0, 2]], torch.tensor([[3.5, 2.5], [3.0, 3.0]], dtype=torch.float64)
    )
    assert torch.isnan(alloc.continuous[1]).all() and not alloc.sinks.any()
    assert alloc.histogram() == {2: 1, 3: 2, 4: 1}
    assert alloc.policy == "entropy"


def test_exact_mode_hand_worked_clipping_and_uneven_steps():
    # KV-head H2: layer 0: [0, 4], layer 1: [2, 2]; H_avg = 2; alpha = 2 -> offsets [4, -4, 0, 0].
    # Widths (2, 4, 8), budget 4: 16 bits. With head (0,1) clipped at 2: (c + 4) + 2 + 2c = 16 -> c = 10/3,
    # b = [22/3, 2, 10/3, 10/3] (22/3 < 8, 10/3 - 4 < 2: consistent). Round down: [4, 2, 2, 2] = 10.
    # Fractions: (22/3 - 4) / 4 = 5/6, 0, (10/3 - 2) / 2 = 2/3, 2/3. Promote (0,0) 4 -> 8 (14),
    # (1,0) 2 -> 4 (16); (1,1) would make 18: skipped.
    df = table({0: [[0.0], [4.0]], 1: [[2.0], [2.0]]})
    alloc = allocate(df, budget=4, policy="entropy", alpha=2.0, widths=(2, 4, 8))
    assert alloc.bits.tolist() == [[8, 2], [4, 2]]
    expected = torch.tensor([[22 / 3, 2.0], [10 / 3, 10 / 3]], dtype=torch.float64)
    assert torch.allclose(alloc.continuous, expected, atol=1e-9)
    assert alloc.mean_bits == 4.0


def test_inverted_hand_worked_allocation():
    # The clipping case with the slope reversed: offsets [-4, 4, 0, 0], now head (0,0) clips at 2:
    # b = [2, 22/3, 10/3, 10/3]; round down [2, 4, 2, 2]; fractions 0, 5/6, 2/3, 2/3 -> (0,1) to 8, (1,0) to 4.
    df = table({0: [[0.0], [4.0]], 1: [[2.0], [2.0]]})
    alloc = allocate(df, budget=4, policy="inverted", alpha=2.0, widths=(2, 4, 8))
    assert alloc.bits.tolist() == [[2, 8], [4, 2]]


def test_sinks_are_paid_for_by_the_other_heads():
    # 8 heads, budget 4 = 32 bits; the lowest-entropy head is a sink (16 bits), so the other 7 heads share
    # 32 - 16 = 16 bits: b = 16/7 each; round down to 2 (14 bits), fractions 2/7 each: the first two heads
    # by order are promoted to 3 (16 bits).
    df = one_layer([5.0, 0.1, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0])
    for rule in ({"sink_threshold": 0.5}, {"sink_fraction": 1 / 8}):
        alloc = allocate(df, budget=4, policy="sinks", **rule)
        assert alloc.bits.tolist() == [[3, 16, 3, 2, 2, 2, 2, 2]]
        assert alloc.sinks.tolist() == [[False, True] + [False] * 6]
        free = alloc.continuous[~alloc.sinks]
        assert torch.allclose(free, torch.full_like(free, 16 / 7))
        assert math.isnan(alloc.continuous[0, 1].item())
        assert alloc.mean_bits == 4.0


def test_uniform_ignores_sink_rules_and_alpha():
    df = one_layer([5.0, 0.1, 3.0, 1.0])
    alloc = allocate(df, budget=3, policy="uniform", alpha=1.0, sink_threshold=0.5)
    assert alloc.bits.tolist() == [[3, 3, 3, 3]] and not alloc.sinks.any()


def test_budget_cannot_pay_for_the_sinks():
    # 2 sinks of 4 at 16 bits + 2 heads at 2 bits = 36 bits > 8 * 4 = 32.
    df = one_layer([0.1, 0.2, 3.0, 4.0])
    with pytest.raises(ValueError, match="cannot pay for 2 sink heads") as err:
        allocate(df, budget=8, policy="entropy", sink_fraction=0.5, widths=(2, 4, 8))
    assert "36 bits" in str(err.value) and "smallest width 2" in str(err.value)
    # the claim mode does not count the sinks, so it does not refuse
    allocate(df, budget=8, policy="entropy", sink_fraction=0.5, widths=(2, 4, 8), budget_mode="claim")


def test_claim_mode_step_down_hand_worked():
    # H = [0, 0.5, 1.9, 3.6], H_avg = 1.5, sink threshold 0.2 -> head 0 is a sink (not counted).
    # c = budget = 4, alpha = 2.2: b = 4 + 2.2 * (1.5 - H) = [-, 6.2, 3.12, -0.62 -> clipped 2].
    # Nearest widths: [8, 3, 2] = 13 > 4 * 3 = 12. Step down the head closest to an integer with width > 2:
    # |6.2 - 6| = 0.2, |3.12 - 3| = 0.12 -> head 2: 3 -> 2, total 12. No step up fits (8 is the top;
    # 2 -> 3 would make 13). Real cost: (16 + 8 + 2 + 2) / 4 = 7 bits per head.
    df = one_layer([0.0, 0.5, 1.9, 3.6])
    alloc = allocate(df, budget=4, policy="entropy", alpha=2.2, sink_threshold=0.2, budget_mode="claim")
    assert alloc.bits.tolist() == [[16, 8, 2, 2]]
    assert torch.allclose(alloc.continuous[0, 1:], torch.tensor([6.2, 3.12, 2.0], dtype=torch.float64))
    assert alloc.mean_bits == 7.0


def test_claim_mode_step_up_hand_worked():
    # H = [0, 1, 2, 3], H_avg = 1.5, head 0 a sink. c = 3, alpha = 0.8: b = [-, 3.4, 2.6, 1.8 -> 2].
    # Nearest: [3, 3, 2] = 8 < 3 * 3 = 9. Step up the head closest to an integer whose step fits:
    # distances 0.4, 0.4, 0 -> head 3: 2 -> 3, total 9; nothing else fits. Real cost 25 / 4.
    df = one_layer([0.0, 1.0, 2.0, 3.0])
    alloc = allocate(df, budget=3, policy="entropy", alpha=0.8, sink_threshold=0.5, budget_mode="claim")
    assert alloc.bits.tolist() == [[16, 3, 3, 3]]
    assert alloc.mean_bits == 6.25
    # the exact mode makes the others pay: 12 bits - 16 is impossible at width >= 2 -> refused
    with pytest.raises(ValueError, match="cannot pay"):
        allocate(df, budget=3, policy="entropy", alpha=0.8, sink_threshold=0.5)


def test_random_is_seeded_and_keeps_the_sinks():
    df = table({layer: [[0.1 * layer + 0.3 * head] for head in range(8)] for layer in range(4)})
    kwargs = {"budget": 4, "alpha": 1.0, "sink_fraction": 0.1}
    first, again = (
        allocate(df, policy="random", policy_seed=3, **kwargs),
        allocate(df, policy="random", policy_seed=3, **kwargs),
    )
    entropy = allocate(df, policy="entropy", **kwargs)
    assert torch.equal(first.bits, again.bits) and first.policy == "random"
    assert torch.equal(first.sinks, entropy.sinks)
    assert first.histogram() == entropy.histogram() and first.mean_bits == entropy.mean_bits
    others = [allocate(df, policy="random", policy_seed=seed, **kwargs).bits for seed in range(4, 8)]
    assert any(not torch.equal(first.bits, bits) for bits in others)


def test_to_records_is_json_ready():
    df = table({0: [[0.1], [3.0]], 2: [[2.0], [2.0]]}, num_layers=3)
    alloc = allocate(df, budget=8, policy="entropy", sink_threshold=0.5, widths=(2, 4, 8))
    records = json.loads(json.dumps(alloc.to_records()))
    assert [(r["layer"], r["kv_head"]) for r in records] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert records[0] == {
        "layer": 0,
        "kv_head": 0,
        "key_bits": 16,
        "value_bits": 16,
        "sink": True,
        "key_continuous": None,
        "value_continuous": None,
        "bits": 16,
        "continuous": None,
    }
    assert sum(r["bits"] for r in records) == alloc.bits.sum().item()


# --------------------------------------------------------------------------------------------- validate

GOOD = {
    "budget": 4,
    "policy": "entropy",
    "alpha": 0.25,
    "sink_threshold": 0.5,
    "sink_fraction": None,
    "widths": [2, 3, 4, 8],
    "budget_mode": "exact",
}


@pytest.mark.parametrize(
    ("change", "key", "fragment"),
    [
        ({"policy": "entropie"}, "policy.name", "did you mean entropy"),
        ({"policy": None}, "policy.name", "allowed: uniform"),
        ({"widths": [2, 7]}, "policy.widths", "7 is not an allowed width; allowed: 1, 2, 3, 4, 5, 6, 8, 16"),
        ({"widths": []}, "policy.widths", "quantized width"),
        ({"widths": [16]}, "policy.widths", "quantized width"),
        (
            {"widths": [2, 4, 16]},
            "policy.widths",
            "16 with policy.name entropy, which assigns only quantized widths (its sink rule keeps heads at 16); "
            "allowed: quantized widths, or 16 with sensitivity, layerwise, measured",
        ),
        ({"policy": "kv", "widths": [4, 16]}, "policy.widths", "16 with policy.name kv"),
        ({"policy": "uniform", "widths": [4, 16]}, "policy.widths", "16 with policy.name uniform"),
        ({"widths": "2,4"}, "policy.widths", "expected a list"),
        ({"widths": [True, 4]}, "policy.widths", "True is not an allowed width"),
        ({"budget": 1.5}, "policy.budget", "[2, 8]"),
        ({"budget": 9}, "policy.budget", "[2, 8]"),
        ({"budget": "4"}, "policy.budget", "'4'"),
        ({"budget": float("nan")}, "policy.budget", "nan"),
        ({"alpha": "0.3"}, "policy.alpha", "real number"),
        ({"alpha": True}, "policy.alpha", "real number"),
        ({"alpha": float("inf")}, "policy.alpha", "real number"),
        ({"sink_threshold": -0.1}, "policy.sink_threshold", ">= 0"),
        ({"sink_threshold": "low"}, "policy.sink_threshold", ">= 0"),
        ({"sink_threshold": None, "sink_fraction": 1.5}, "policy.sink_fraction", "[0, 1]"),
        ({"sink_fraction": 0.1}, "policy.sink_fraction", "at most one sink rule"),
        ({"budget_mode": "clam"}, "policy.budget_mode", "did you mean claim"),
        ({"policy": "kv", "key_offset": "2"}, "policy.key_offset", "real number"),
    ],
)
def test_validate_names_the_key_in_one_line(change, key, fragment):
    config = {**GOOD, **change}
    with pytest.raises(ValueError) as err:
        validate(**config)
    message = str(err.value)
    assert message.startswith(f"{key}:") and "\n" not in message
    assert fragment in message


def test_validate_accepts_good_configs_and_allocate_validates():
    validate(**GOOD)
    validate(
        **{
            **GOOD,
            "policy": "measured",
            "widths": (2, 16),
            "budget": 16,
            "sink_threshold": None,
            "sink_fraction": 0,
        }
    )
    with pytest.raises(ValueError, match=r"^policy\.name:"):
        allocate(one_layer([1.0, 2.0]), budget=4, policy="entropie")


# ------------------------------------------------------------------------------------------- properties


ENTROPY_VALUES = st.integers(0, 48).map(lambda k: k / 8)  # exact eighths: many ties, no precision collapse


@st.composite
def entropy_tables(draw) -> pd.DataFrame:
    """Random tables: some layers without rows, GQA groups, tied and distinct entropies, attrs or not."""
    num_layers, num_kv_heads, group = draw(st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(1, 3)))
    cached = draw(st.sets(st.integers(0, num_layers - 1), min_size=1))  # layers with rows
    size = num_kv_heads * group
    values = draw(st.lists(ENTROPY_VALUES, min_size=size * len(cached), max_size=size * len(cached)))
    per_layer = {
        layer: [values[start + kv * group : start + (kv + 1) * group] for kv in range(num_kv_heads)]
        for layer, start in zip(sorted(cached), range(0, len(values), size), strict=True)
    }
    return table(per_layer, num_layers if draw(st.booleans()) else None)


SINK_RULES = (
    st.just({})
    | st.builds(lambda t: {"sink_threshold": t}, st.floats(0, 4))
    | st.builds(lambda q: {"sink_fraction": q}, st.floats(0, 1))
)
# The entropy policies round among quantized widths only (a 16 in policy.widths is refused): sink heads take 16.
WIDTH_SETS = st.sets(st.sampled_from([w for w in ALLOWED_WIDTHS if w != UNQUANTIZED]), min_size=1)
ALPHAS = st.floats(0, 4)


@st.composite
def configs(draw) -> dict:
    widths = sorted(draw(WIDTH_SETS))
    low = min(w for w in widths if w != UNQUANTIZED)
    return {
        "budget": draw(st.floats(low, max(widths))),
        "alpha": draw(ALPHAS),
        "widths": widths,
        **draw(SINK_RULES),
    }


def expected_sinks(h: list[float], config: dict) -> set[int]:
    """Sink indices (over cached heads in (layer, kv_head) order), computed independently."""
    if "sink_threshold" in config:
        return {i for i, value in enumerate(h) if value < config["sink_threshold"]}
    if "sink_fraction" in config:
        count = math.floor(config["sink_fraction"] * len(h) + 0.5)
        return set(sorted(range(len(h)), key=lambda i: (h[i], i))[:count])
    return set()


def allocate_or_refused(df: pd.DataFrame, policy: str, config: dict):
    """The allocation, or None when the budget provably cannot pay for the sinks (and it was refused)."""
    h = kv_head_entropy(df)
    n = int((~torch.isnan(h)).sum())
    n_sinks = 0 if policy == "uniform" else len(expected_sinks(h[~torch.isnan(h)].tolist(), config))
    low = min(w for w in config["widths"] if w != UNQUANTIZED)
    exact = config.get("budget_mode", "exact") == "exact"
    if exact and UNQUANTIZED * n_sinks + low * (n - n_sinks) > config["budget"] * n + 1e-9:
        with pytest.raises(ValueError, match="cannot pay"):
            allocate(df, policy=policy, **config)
        return None
    return allocate(df, policy=policy, **config)


@PROPERTY_SETTINGS
@given(df=entropy_tables(), config=configs(), policy=st.sampled_from(ENTROPY_POLICIES))
def test_exact_mode_respects_budget_widths_and_sinks(df, config, policy):
    alloc = allocate_or_refused(df, policy, config)
    if alloc is None:
        return
    h = kv_head_entropy(df)  # [L, Hkv]
    cached = ~torch.isnan(h)
    n = int(cached.sum())
    assert alloc.bits.shape == h.shape and alloc.bits.dtype == torch.int64
    assert alloc.continuous.dtype == torch.float64 and alloc.sinks.dtype == torch.bool
    assert (alloc.bits[~cached] == 0).all() and not alloc.sinks[~cached].any()
    assert torch.isnan(alloc.continuous[~cached]).all()
    total = alloc.bits.sum().item()
    assert total <= config["budget"] * n + 1e-9
    assert alloc.mean_bits <= config["budget"] + 1e-9
    assert alloc.mean_bits == pytest.approx(total / n)
    sinks = alloc.sinks[cached].tolist()
    want = set() if policy == "uniform" else expected_sinks(h[cached].tolist(), config)
    assert {i for i, s in enumerate(sinks) if s} == want
    assert (alloc.bits[alloc.sinks] == UNQUANTIZED).all()
    assert torch.isnan(alloc.continuous[alloc.sinks]).all()
    quantized = {w for w in config["widths"] if w != UNQUANTIZED}
    assert set(alloc.bits[cached & ~alloc.sinks].tolist()) <= quantized


@PROPERTY_SETTINGS
@given(df=entropy_tables(), config=configs(), alpha=st.floats(0.05, 4), inverted=st.booleans())
def test_exact_mode_is_monotone_in_entropy(df, config, alpha, inverted):
    policy = "inverted" if inverted else "entropy"
    config = {**config, "alpha": alpha}
    alloc = allocate_or_refused(df, policy, config)
    if alloc is None:
        return
    head_entropy = kv_head_entropy(df)  # [L, Hkv]
    free = ~torch.isnan(head_entropy) & ~alloc.sinks
    h, bits = head_entropy[free].tolist(), alloc.bits[free].tolist()
    for i in range(len(h)):
        for j in range(len(h)):
            if h[i] < h[j]:
                assert (bits[i] <= bits[j]) if inverted else (bits[i] >= bits[j])


@PROPERTY_SETTINGS
@given(df=entropy_tables(), config=configs(), alpha=st.floats(0, 4), data=st.data())
def test_no_slope_and_no_sinks_is_uniform_at_a_width_budget(df, config, alpha, data):
    budget = data.draw(st.sampled_from([w for w in config["widths"]]))
    plain = {"budget": budget, "widths": config["widths"]}
    runs = [
        allocate(df, policy="entropy", alpha=0.0, **plain),
        allocate(df, policy="sinks", alpha=alpha, **plain),
        allocate(df, policy="uniform", **{**config, **plain}),
    ]
    top = max(w for w in config["widths"] if w != UNQUANTIZED)
    cached = ~torch.isnan(kv_head_entropy(df))
    for alloc in runs:
        assert set(alloc.bits[cached].tolist()) == {min(budget, top)}


@PROPERTY_SETTINGS
@given(df=entropy_tables(), config=configs(), seed=st.integers(0, 2**31), mode=st.sampled_from(BUDGET_MODES))
def test_random_has_the_entropy_histogram(df, config, seed, mode):
    config = {**config, "budget_mode": mode}
    entropy = allocate_or_refused(df, "entropy", config)
    if entropy is None:
        return
    shuffled = allocate(df, policy="random", policy_seed=seed, **config)
    assert shuffled.histogram() == entropy.histogram()
    assert torch.equal(shuffled.sinks, entropy.sinks)
    assert (shuffled.bits[shuffled.sinks] == UNQUANTIZED).all()
    assert shuffled.mean_bits == entropy.mean_bits


@PROPERTY_SETTINGS
@given(df=entropy_tables(), config=configs(), policy=st.sampled_from(ENTROPY_POLICIES))
def test_claim_mode_budgets_the_non_sink_heads(df, config, policy):
    alloc = allocate(df, policy=policy, budget_mode="claim", **config)
    cached = ~torch.isnan(kv_head_entropy(df))
    free = cached & ~alloc.sinks
    assert alloc.bits[free].sum().item() <= config["budget"] * int(free.sum()) + 1e-9
    assert set(alloc.bits[free].tolist()) <= set(config["widths"]) - {UNQUANTIZED}
    assert (alloc.bits[alloc.sinks] == UNQUANTIZED).all()
    assert alloc.mean_bits == pytest.approx(alloc.bits[cached].sum().item() / int(cached.sum()))


# ----------------------------------------------------------------------------------- every registered policy

# One line per registered policy, with representative settings: a new policy is tested by adding its line.
TABLE = [
    Uniform(),
    Entropy(alpha=0.5, sink_threshold=0.5),
    Sinks(sink_fraction=0.1),
    Random(alpha=0.5, sink_fraction=0.1, seed=3),
    Inverted(alpha=0.5, widths=(2, 4, 8)),
    Sensitivity(sink_fraction=0.1),
    Layerwise(widths=(2, 3, 4, 8, 16)),
    KeyValue(alpha=0.5, key_offset=3.0, sink_fraction=0.1),
    MeasuredKL(sink_fraction=0.1, widths=(2, 3, 4, 16)),
]
TABLE_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def price(width: int, role: str = "value") -> float:
    """Bytes per element of a per-token scheme with an fp16 scale and zero per 16 elements (2 bits)."""
    return 2.0 if width == UNQUANTIZED else (width + 2) / 8


def sensitivity_for(df: pd.DataFrame, widths, measurement: str | None) -> pd.DataFrame | None:
    """The measured table a policy reads (its `measurement`) for every cached head of df at every quantized
    width, errors falling with the width: per head (proxy) or per head and role (unit_kl, keys costlier)."""
    h = kv_head_entropy(df)  # [L, Hkv]
    heads = (~torch.isnan(h)).nonzero().tolist()
    quantized = sorted(set(widths) - {UNQUANTIZED})
    if measurement == "unit_kl":
        rows = [
            {
                "layer": layer,
                "kv_head": kv_head,
                "role": role,
                "bits": w,
                "kl": scale * (1 + h[layer, kv_head].item()) / w,
            }
            for layer, kv_head in heads
            for role, scale in (("key", 2.0), ("value", 1.0))
            for w in quantized
        ]
        return pd.DataFrame(rows)
    rows = [
        {"layer": layer, "kv_head": kv_head, "bits": w, "error": (1 + h[layer, kv_head].item()) / w}
        for layer, kv_head in heads
        for w in quantized
    ]
    return pd.DataFrame(rows) if measurement == "proxy" else None


def test_the_table_lists_every_registered_policy_once():
    assert [policy.name for policy in TABLE] == POLICIES.names()
    labels = [policy.label() for policy in TABLE]
    assert all(labels) and len(set(labels)) == len(labels)


@pytest.mark.parametrize("policy", TABLE, ids=lambda p: p.name)
def test_a_policy_survives_its_grid_point_and_normalizes_idempotently(policy):
    fields = policy.point_fields()
    assert from_point(fields) == policy and from_point(fields).label() == policy.label()
    normal = policy.normalize()
    assert normal.normalize() == normal and from_point(normal.point_fields()) == normal
    claim = from_point({**fields, "budget_mode": "claim"}).normalize()
    assert claim.budget_unit == "bits" and claim.normalize() == claim


def test_settings_a_policy_ignores_normalize_away():
    ignored = {"alpha": 1.0, "sink_threshold": 0.5, "sink_fraction": None, "policy_seed": 7}
    assert from_point({"policy": "uniform", **ignored}) == Uniform()
    assert from_point({"policy": "sinks", **ignored}) == Sinks(sink_threshold=0.5)
    assert from_point({"policy": "entropy", **ignored}).point_fields()["policy_seed"] == 0
    assert from_point({"policy": "random", **ignored}).point_fields()["policy_seed"] == 7


@TABLE_SETTINGS
@given(
    df=entropy_tables(),
    unit=st.sampled_from(BUDGET_UNITS),
    mode=st.sampled_from(BUDGET_MODES),
    fraction=st.floats(0, 1),
    index=st.integers(0, len(TABLE) - 1),
)
def test_every_policy_keeps_its_budget_in_its_unit_and_is_deterministic(df, unit, mode, fraction, index):
    policy = from_point({**TABLE[index].point_fields(), "budget_unit": unit, "budget_mode": mode})
    quantized = sorted(set(policy.widths) - {UNQUANTIZED})
    budget = quantized[0] + fraction * (max(policy.widths) - quantized[0])
    inputs = dict(price=price, sensitivity=sensitivity_for(df, policy.widths, policy.measurement))
    try:
        alloc = policy.allocate(df, budget, **inputs)
    except ValueError as err:
        assert "cannot pay" in str(err) and mode == "exact"
        return
    again = policy.allocate(df, budget, **inputs)
    assert torch.equal(alloc.key_bits, again.key_bits) and torch.equal(alloc.value_bits, again.value_bits)
    assert torch.equal(alloc.sinks, again.sinks) and alloc.policy == policy.name
    cached = ~torch.isnan(kv_head_entropy(df))  # [L, Hkv]
    assert torch.equal(alloc.cached, cached)
    for bits in (alloc.key_bits, alloc.value_bits):
        assert (bits[~cached] == 0).all() and (bits[alloc.sinks] == UNQUANTIZED).all()
        assert set(bits[cached & ~alloc.sinks].tolist()) <= set(policy.widths)
    units = torch.cat([alloc.key_bits[cached], alloc.value_bits[cached]])  # [2n]: every (head, K|V) unit
    assert alloc.mean_bits == pytest.approx(units.double().mean().item())
    free = torch.cat([(~alloc.sinks)[cached]] * 2)  # [2n]
    if mode == "claim":  # the budget applies to the non-sink units, in bits
        assert units[free].sum().item() <= budget * int(free.sum()) + 1e-9
    elif unit == "bits":
        assert units.sum().item() <= budget * len(units) + 1e-9
    else:  # the bytes uniform at `budget` bits would hold
        held = sum(price(int(b), role="value") for b in units.tolist())
        assert (
            held
            <= price(quantized[0], role="value") * len(units)
            + (budget - quantized[0]) / 8 * len(units)
            + 1e-9
        )


def test_an_allocation_with_different_key_and_value_widths_has_no_single_width():
    bits = torch.tensor([[4, 2]])
    values = torch.tensor([[4, 4]])
    alloc = Allocation(
        bits, values, torch.zeros(1, 2, dtype=torch.bool), torch.full((1, 2), math.nan), "k4v2"
    )
    assert alloc.mean_bits == 3.5 and alloc.cached.all()
    with pytest.raises(ValueError, match="keys and values different widths"):
        _ = alloc.bits
    same = Allocation.per_head(values, alloc.sinks, alloc.continuous, "uniform")
    assert torch.equal(same.bits, values) and same.histogram() == {4: 2}


# ------------------------------------------------------------------------------- kv: keys and values apart


def role_price(width: int, role: str = "value") -> float:
    """Bytes per element of a unit of `role` at `width`: a per-token scheme with an fp16 scale and zero per 8
    elements for keys (4 bits), per 16 for values (2 bits), as key_group_size 8 beside group_size 16."""
    overhead = 4 if role == "key" else 2
    return 2.0 if width == UNQUANTIZED else (width + overhead) / 8


def units(alloc) -> dict[str, torch.Tensor]:
    """Each role's widths over the cached heads, (layer, kv_head) order."""
    return {"key": alloc.key_bits[alloc.cached], "value": alloc.value_bits[alloc.cached]}


@PROPERTY_SETTINGS
@given(df=entropy_tables(), unit=st.sampled_from(["bits", "bytes"]))
def test_budget_3_offset_2_is_k4v2_and_budget_6_offset_4_is_k8v4(df, unit):
    for budget, offset, key, value in ((3, 2.0, 4, 2), (6, 4.0, 8, 4)):
        alloc = KeyValue(key_offset=offset, budget_unit=unit).allocate(df, budget, price=role_price)
        widths = units(alloc)
        assert set(widths["key"].tolist()) == {key} and set(widths["value"].tolist()) == {value}
        assert alloc.histogram() == {"key": {key: len(widths["key"])}, "value": {value: len(widths["value"])}}
        assert alloc.mean_bits == budget


def test_alpha_mixes_widths_per_head_and_sinks_keep_keys_and_values_at_16():
    df = one_layer([0.1, 1.0, 2.0, 3.0, 4.0])
    alloc = KeyValue(alpha=1.0, key_offset=2.0, sink_threshold=0.5, budget_unit="bits").allocate(df, 6)
    assert alloc.sinks.tolist() == [[True, False, False, False, False]]
    assert alloc.key_bits[0, 0] == alloc.value_bits[0, 0] == UNQUANTIZED
    keys, values = alloc.key_bits[0, 1:].tolist(), alloc.value_bits[0, 1:].tolist()
    assert keys == sorted(keys, reverse=True) and values == sorted(values, reverse=True)  # peaked heads more
    assert all(k >= v for k, v in zip(keys, values)) and len(set(keys + values)) > 2
    assert alloc.key_bits.sum() + alloc.value_bits.sum() <= 6 * 2 * 5
    records = alloc.to_records()
    assert "bits" not in records[1] and records[1]["key_bits"] == keys[0]
    with pytest.raises(ValueError, match="keys and values different widths"):
        _ = alloc.bits


@PROPERTY_SETTINGS
@given(
    df=entropy_tables(),
    fraction=st.floats(0, 1),
    offset=st.floats(-8, 8),
    alpha=st.floats(-4, 4),
    sinks=SINK_RULES,
    widths=st.sampled_from([(2, 3, 4, 8), (2, 4, 8), (3, 8), (4, 8)]),
)
def test_kv_never_exceeds_its_byte_budget(df, fraction, offset, alpha, sinks, widths):
    policy = KeyValue(alpha=alpha, key_offset=offset, widths=widths, **sinks)
    low = min(widths)
    budget = low + fraction * (max(widths) - low)
    try:
        alloc = policy.allocate(df, budget, price=role_price)
    except ValueError as err:
        assert "cannot pay" in str(err)
        return
    held = sum(role_price(int(w), role) for role, grid in units(alloc).items() for w in grid.tolist())
    n = int(alloc.cached.sum())
    allowed = n * (
        role_price(low, "key") + role_price(low, "value") + 2 * (budget - low) / 8
    )  # uniform at budget
    assert held <= allowed + 1e-9
    for grid in (alloc.key_bits, alloc.value_bits):
        assert (grid[alloc.sinks] == UNQUANTIZED).all()
        assert set(grid[alloc.cached & ~alloc.sinks].tolist()) <= set(widths) - {UNQUANTIZED}
    assert torch.equal(alloc.cached, ~torch.isnan(kv_head_entropy(df)))


@pytest.mark.parametrize("offset", ["2", True, math.nan, math.inf, None])
def test_a_bad_key_offset_is_one_line_naming_the_key(offset):
    with pytest.raises(ValueError) as err:
        KeyValue(key_offset=offset)
    assert str(err.value).startswith("policy.key_offset:") and "\n" not in str(err.value)


def test_label_grid_point_and_key():
    assert KeyValue().label() == "kv d=2"
    assert KeyValue(alpha=0.25, key_offset=4, sink_threshold=0.5).label() == "kv a=0.25 d=4 + sinks H2<0.5"
    fields = KeyValue(key_offset=4.0).point_fields()
    assert fields["key_offset"] == 4.0 and from_point(fields) == KeyValue(key_offset=4.0)
    assert from_point({"policy": "entropy", "key_offset": 4.0}).point_fields()["key_offset"] == 0.0
    base = dict(
        model="tiny-llama", policy="kv", budget=3, alpha=0.0, sink_threshold=None, sink_fraction=None,
        widths=(2, 3, 4, 8), budget_mode="exact", scheme="asym_token", group_size=32, prefill="exact",
        num_prompts=1, prompt_tokens=8, new_tokens=2, num_sequences=1, sequence_tokens=8, chunk=8,
        calibration_sequences=1, calibration_tokens=8, i0=1, data_path=None, seed=0,
    )  # fmt: skip
    keys = {Point(**base, key_offset=d).key() for d in (0.0, 2.0, 4.0)}
    assert len(keys) == 3
    # key_offset 0 stays out of the key: points made before the field existed keep theirs.
    assert (
        Point(**base, key_offset=0.0).key()
        == Point.from_dict({k: v for k, v in Point(**base).to_dict().items() if k != "key_offset"}).key()
    )
