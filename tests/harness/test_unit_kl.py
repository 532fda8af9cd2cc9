"""The per-unit KL table (harness.sensitivity.unit_kl) on a tiny model, its additivity check, and the `measured`
policy: exact against brute force under a bytes budget, never above it, keys first when keys cost more."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import sensitivity
from harness.calibrate import head_entropies
from harness.config import base_point, compose
from harness.models import load_model
from harness.policies import MeasuredKL, unit_costs
from harness.protocols import sensitivity_check
from harness.run.measure import allocation, point_scheme
from harness.schemes import get_scheme
from harness.sensitivity import (
    additivity_check,
    allocation_kl,
    cached_unit_kl,
    predicted_kl,
    probe_ids,
    unit_kl_table,
)
from harness.sensitivity.unit_kl import baseline_run
from kernels.layout import FULL_WIDTH as UNQUANTIZED

PROPERTY_SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCHEME = get_scheme("asym_token", 16)


def entropy_table(entropies: list[list[float]]) -> pd.DataFrame:
    """One query head per KV head: H2 of [layer][kv_head]."""
    rows = [
        dict(layer=layer, layer_type="full", q_head=h, kv_head=h, H2=value, H1=value + 1.0, n_positions=32)
        for layer, heads in enumerate(entropies)
        for h, value in enumerate(heads)
    ]
    return pd.DataFrame(rows)


def kl_table(kl: dict[tuple[int, int, str], list[float]], widths: list[int]) -> pd.DataFrame:
    """Unit KL table from {(layer, kv_head, role): [kl at each width]}."""
    rows = [
        dict(layer=layer, kv_head=h, role=role, bits=w, kl=value)
        for (layer, h, role), values in kl.items()
        for w, value in zip(widths, values)
    ]
    return pd.DataFrame(rows)


def role_price(key_scale_bits: float, value_scale_bits: float):
    """price(width, role): bytes per element of a scheme whose keys store key_scale_bits of scales per element
    and whose values value_scale_bits (16 stores none)."""
    scales = {"key": key_scale_bits, "value": value_scale_bits}
    return lambda width, role: 2.0 if width == UNQUANTIZED else (width + scales[role]) / 8


price = role_price(1.0, 1.0)  # an fp16 scale and zero per 32 elements for both roles


@pytest.fixture(scope="module")
def tiny():
    """tiny-llama (3 layers x 3 KV heads) with its unit KL table at widths 2 and 8 on 2 x 40 random tokens."""
    model, _ = load_model("tiny-llama")
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    return model, ids, unit_kl_table(model, ids, SCHEME, (2, 8), chunk=16)


# ----------------------------------------------------------------------------------------------- the table


def test_the_table_has_one_finite_row_per_unit_and_width(tiny):
    model, _, table = tiny
    assert list(table.columns) == ["layer", "kv_head", "role", "bits", "kl"]
    units = {(layer, h, role) for layer in range(3) for h in range(3) for role in ("key", "value")}
    assert len(table) == len(units) * 2 and set(table["bits"]) == {2, 8}
    assert set(zip(table.layer, table.kv_head, table.role)) == units
    assert table["kl"].map(math.isfinite).all() and (table["kl"] >= -1e-6).all()
    kl = table.pivot_table(index=["layer", "kv_head", "role"], columns="bits", values="kl")
    assert (kl[8] < kl[2]).mean() >= 0.9  # more bits, less KL, on (nearly) every unit
    assert table.attrs == {"num_layers": 3, "num_kv_heads": 3}


def test_an_entry_is_that_unit_alone_through_the_cache(tiny):
    model, ids, table = tiny
    base = baseline_run(model, ids, 16)
    key_bits = torch.full((3, 3), UNQUANTIZED)
    value_bits = key_bits.clone()
    value_bits[1, 2] = 2
    entry = table.set_index(["layer", "kv_head", "role", "bits"]).loc[(1, 2, "value", 2), "kl"]
    assert predicted_kl(table, key_bits, value_bits) == entry
    assert allocation_kl(model, ids, SCHEME, key_bits, value_bits, base, 16) == pytest.approx(entry, rel=1e-6)
    key_bits[1, 2] = 2  # the key of the same head too: predicted adds its own entry
    both = entry + table.set_index(["layer", "kv_head", "role", "bits"]).loc[(1, 2, "key", 2), "kl"]
    assert predicted_kl(table, key_bits, value_bits) == pytest.approx(both)


def test_an_entry_in_context_is_its_marginal_kl_with_every_other_unit_at_the_context_width(tiny):
    model, ids, _ = tiny
    table = unit_kl_table(model, ids, SCHEME, (2, 3, 8), chunk=16, context=3)
    base = baseline_run(model, ids, 16)
    around = torch.full((3, 3), 3)  # every unit of tiny-llama's 3 x 3 heads at the context width
    everywhere = allocation_kl(model, ids, SCHEME, around, around, base, 16)
    assert everywhere > 0
    entry = table.set_index(["layer", "kv_head", "role", "bits"])["kl"]
    key_bits = around.clone()
    key_bits[2, 0] = 2  # layer 2's first key narrower: a positive marginal
    measured = allocation_kl(model, ids, SCHEME, key_bits, around, base, 16)
    assert entry[(2, 0, "key", 2)] == pytest.approx(measured - everywhere, rel=1e-6, abs=1e-9)
    value_bits = around.clone()
    value_bits[0, 1] = 8  # layer 0's second value wider
    measured = allocation_kl(model, ids, SCHEME, around, value_bits, base, 16)
    assert entry[(0, 1, "value", 8)] == pytest.approx(measured - everywhere, rel=1e-6, abs=1e-9)
    assert (table.loc[table["bits"] == 3, "kl"] == 0).all()  # the context width itself: no change, not run
    kl = table.pivot_table(index=["layer", "kv_head", "role"], columns="bits", values="kl")
    assert (kl[2] > 0).mean() >= 0.9 and (kl[8] < 0).mean() >= 0.75  # narrower costs, wider (mostly) gains


def test_a_context_is_one_of_the_quantized_widths_and_leaves_16_out(tiny):
    model, ids, _ = tiny
    for context, widths in ((4, (2, 3)), (2, (2, 3, UNQUANTIZED)), (True, (2, 3))):
        with pytest.raises(ValueError, match="^eval.calibration.probe.context: "):
            unit_kl_table(model, ids, SCHEME, widths, chunk=16, context=context)


def test_additivity_check_returns_its_pairs(tiny):
    model, ids, table = tiny
    rows, rho, ratio = additivity_check(model, ids, table, SCHEME, count=10, budget=5.0, chunk=16)
    assert list(rows.columns) == ["draw", "mean_bits", "predicted", "measured"] and len(rows) == 10
    assert rows[["predicted", "measured"]].map(math.isfinite).all().all() and math.isfinite(ratio)
    assert (rows["mean_bits"] <= 5.0).all() and rows["predicted"].nunique() > 1
    assert -1 <= rho <= 1 and ratio > 0
    assert ratio == pytest.approx(rows["measured"].sum() / rows["predicted"].sum())


def test_the_runner_measures_the_table_from_calibration_ids_only(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model, _ = load_model("tiny-llama")
    g = torch.Generator().manual_seed(1)
    calib = torch.randint(0, 256, (2, 24), generator=g)
    point = base_point(compose(["model=tiny-llama", "policy=measured", "policy.widths=[2,4]", "eval=tiny"]))
    entropy = head_entropies(model, calib, i0=4)

    def context(calib_ids, sequences):
        return SimpleNamespace(
            model=model,
            name="tiny-llama",
            calib_ids=calib_ids,
            sequences=sequences,
            entropy=entropy,
            sensitivity={},
            shape=None,
            calibration_source=None,
        )

    first = context(calib, torch.randint(0, 256, (2, 24), generator=g))
    other_eval = context(calib, torch.randint(0, 256, (2, 24), generator=g))
    other_calib = context(torch.randint(0, 256, (2, 24), generator=g), first.sequences)
    monkeypatch.setattr("harness.run.measure.element_price", lambda shape, scheme: price)
    tables = []
    for ctx in (first, other_eval, other_calib):
        monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / str(len(tables))))  # no disk cache between them
        alloc = allocation(ctx, point)
        assert alloc.policy == "measured"
        (table,) = ctx.sensitivity.values()
        tables.append(table)
    pd.testing.assert_frame_equal(tables[0], tables[1])
    assert not tables[0]["kl"].equals(tables[2]["kl"])


def test_probe_ids_cut_the_calibration_windows():
    calib = torch.arange(30).view(3, 10)
    assert probe_ids(calib, 2, 4).tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert probe_ids(calib, 5, 50).shape == (3, 10)
    with pytest.raises(ValueError, match="^unit KL probe tokens: 1"):
        probe_ids(calib, 2, 1)


def test_the_disk_cache_keys_on_the_sizes(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model, ids, _ = tiny
    first = cached_unit_kl(model, "tiny-llama", ids, SCHEME, (2, 16), chunk=16, sequences=1, tokens=24)
    monkeypatch.setattr(sensitivity.unit_kl, "unit_kl_table", lambda *a, **k: pytest.fail("measured again"))
    again = cached_unit_kl(model, "tiny-llama", ids, SCHEME, (2,), chunk=16, sequences=1, tokens=24)
    pd.testing.assert_frame_equal(first, again)
    with pytest.raises(pytest.fail.Exception):  # other sizes are another measurement
        cached_unit_kl(model, "tiny-llama", ids, SCHEME, (2,), chunk=16, sequences=1, tokens=20)


def test_the_disk_cache_keys_on_the_context(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model, ids, _ = tiny
    alone = cached_unit_kl(model, "tiny-llama", ids, SCHEME, (2, 4), chunk=16, sequences=1, tokens=24)
    around = cached_unit_kl(
        model, "tiny-llama", ids, SCHEME, (2, 4), chunk=16, sequences=1, tokens=24, context=4
    )
    assert not alone["kl"].equals(around["kl"]) and (around.loc[around["bits"] == 4, "kl"] == 0).all()
    monkeypatch.setattr(sensitivity.unit_kl, "unit_kl_table", lambda *a, **k: pytest.fail("measured again"))
    again = cached_unit_kl(
        model, "tiny-llama", ids, SCHEME, (2, 4), chunk=16, sequences=1, tokens=24, context=4
    )
    pd.testing.assert_frame_equal(around, again)


def test_the_runner_measures_the_table_on_the_points_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model, _ = load_model("tiny-llama")
    calib = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    base = base_point(compose(["model=tiny-llama", "policy=measured", "policy.widths=[2,4]", "eval=tiny"]))
    ctx = SimpleNamespace(
        model=model,
        name="tiny-llama",
        calib_ids=calib,
        entropy=head_entropies(model, calib, i0=4),
        sensitivity={},
        shape=None,
        calibration_source=None,
    )
    monkeypatch.setattr("harness.run.measure.element_price", lambda shape, scheme: price)
    allocation(ctx, base)  # the default probe: 2 x 128, cut to the windows (2, 40)
    allocation(ctx, base.replace(probe_sequences=1, probe_tokens=24))
    allocation(ctx, base.replace(probe_sequences=1, probe_tokens=24, probe_context=2))
    default, probed, around = ctx.sensitivity.values()  # three tables: the probe is part of the table's key
    scheme = point_scheme(base)
    expected = unit_kl_table(model, calib[:1, :24], scheme, (2, 4), chunk=base.chunk)
    pd.testing.assert_frame_equal(probed, expected, check_exact=False, rtol=1e-6)
    pd.testing.assert_frame_equal(
        default, unit_kl_table(model, calib, scheme, (2, 4), chunk=base.chunk), check_exact=False, rtol=1e-6
    )
    assert not default["kl"].equals(probed["kl"])
    expected = unit_kl_table(model, calib[:1, :24], scheme, (2, 4), chunk=base.chunk, context=2)
    pd.testing.assert_frame_equal(around, expected, check_exact=False, rtol=1e-6)


# ----------------------------------------------------------------------------------------------- the policy


def held_bytes(alloc, price=price) -> float:
    """Bytes per element the allocation's cached units hold, summed (price per unit and role)."""
    keys, values = alloc.key_bits[alloc.cached].tolist(), alloc.value_bits[alloc.cached].tolist()
    return sum(price(b, "key") for b in keys) + sum(price(b, "value") for b in values)


def total_kl(table: pd.DataFrame, alloc, widths: list[int]) -> float:
    costs = unit_costs(table, tuple(alloc.cached.shape), widths)  # [2, L, Hkv, |W|]
    total = 0.0
    for r, bits in enumerate((alloc.key_bits, alloc.value_bits)):
        for layer, h in alloc.cached.nonzero().tolist():
            total += costs[r, layer, h, widths.index(int(bits[layer, h]))].item()
    return total


@st.composite
def cases(draw):
    n_layers, n_heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    widths = sorted(draw(st.sets(st.sampled_from([2, 3, 4, 8]), min_size=1, max_size=3)))
    if draw(st.booleans()):
        widths.append(UNQUANTIZED)
    quantized = [w for w in widths if w != UNQUANTIZED]
    kl = {
        (layer, h, role): draw(st.lists(st.floats(0, 1), min_size=len(quantized), max_size=len(quantized)))
        for layer in range(n_layers)
        for h in range(n_heads)
        for role in ("key", "value")
    }
    entropies = [[draw(st.floats(0, 4)) for _ in range(n_heads)] for _ in range(n_layers)]
    budget = draw(st.floats(quantized[0], max(widths)))
    return (
        entropy_table(entropies),
        kl_table(kl, quantized),
        widths,
        budget,
        draw(st.sampled_from([None, 0.5])),
        role_price(draw(st.sampled_from([0.25, 0.5, 1.0])), draw(st.sampled_from([0.25, 1.0, 2.0]))),
    )


@PROPERTY_SETTINGS
@given(case=cases())
def test_the_policy_is_the_brute_force_optimum_within_the_bytes_budget(case):
    entropy, table, widths, budget, fraction, price = case
    policy = MeasuredKL(widths=widths, sink_fraction=fraction)
    try:
        alloc = policy.allocate(entropy, budget, price=price, sensitivity=table)
    except ValueError as err:
        assert "cannot pay" in str(err)
        return
    n_units = 2 * int(alloc.cached.sum())
    quantized = [w for w in widths if w != UNQUANTIZED]
    # uniform's bytes at `budget` bits per element, keys and values each with their own scales
    heads = n_units // 2
    allowed = heads * sum(
        price(quantized[0], role) + (budget - quantized[0]) / 8 for role in ("key", "value")
    )
    assert held_bytes(alloc, price) <= allowed + 1e-9
    assert (alloc.key_bits[alloc.sinks] == UNQUANTIZED).all() and (
        alloc.value_bits[alloc.sinks] == UNQUANTIZED
    ).all()
    # brute force over every unit's width (sinks at 16): the least summed KL that fits. Each unit adds its own bytes
    # and KL, so a choice's totals are the sinks' (fixed) plus the sums of the free units' own.
    every = widths + ([] if UNQUANTIZED in widths else [UNQUANTIZED])
    got = total_kl(table, alloc, every)
    costs = unit_costs(table, tuple(alloc.cached.shape), every)  # [2, L, Hkv, |W|]
    free = [(r, layer, h) for r in range(2) for layer, h in (alloc.cached & ~alloc.sinks).nonzero().tolist()]
    role = ("key", "value")
    chosen = [int((alloc.key_bits, alloc.value_bits)[r][layer, h]) for r, layer, h in free]
    fixed_bytes = held_bytes(alloc, price) - sum(price(w, role[u[0]]) for u, w in zip(free, chosen))
    fixed_kl = got - sum(costs[r, layer, h, every.index(w)].item() for (r, layer, h), w in zip(free, chosen))
    options = [
        [(price(w, role[r]), costs[r, layer, h, every.index(w)].item()) for w in widths]
        for r, layer, h in free
    ]
    best = math.inf
    for choice in itertools.product(*options):
        if fixed_bytes + sum(b for b, _ in choice) <= allowed + 1e-9:
            best = min(best, fixed_kl + sum(kl for _, kl in choice))
    assert got == pytest.approx(best, rel=1e-6, abs=1e-6)


def test_keys_that_cost_more_get_more_bits():
    entropy = entropy_table([[3.0, 3.0], [3.0, 3.0]])
    widths = [2, 4, 8]
    kl = {(layer, h, "key"): [10.0, 1.0, 0.1] for layer in range(2) for h in range(2)}
    kl |= {(layer, h, "value"): [0.1, 0.01, 0.001] for layer in range(2) for h in range(2)}
    alloc = MeasuredKL(widths=widths).allocate(entropy, 4, price=price, sensitivity=kl_table(kl, widths))
    assert (alloc.key_bits > alloc.value_bits).all()
    # 8 units x 5 bits (uniform 4 with a 1-bit scale): values at 2 (3 bits), keys at 4 (5 bits), and the 8 bits
    # left buy two keys 4 -> 8 (0.9 KL each), not four values 2 -> 4 (0.09 each)
    assert alloc.value_bits.tolist() == [[2, 2], [2, 2]]
    assert sorted(alloc.key_bits.flatten().tolist()) == [4, 4, 8, 8] and held_bytes(alloc) == 8 * 5 / 8


def test_the_policy_refuses_a_short_table():
    entropy = entropy_table([[3.0, 3.0]])
    table = kl_table({(0, 0, "key"): [1.0], (0, 0, "value"): [1.0], (0, 1, "key"): [1.0]}, [2])
    with pytest.raises(ValueError, match="lacks measurements for some cached units"):
        MeasuredKL(widths=(2,)).allocate(entropy, 2, price=price, sensitivity=table)
    with pytest.raises(ValueError, match=r"no measurements at width 4"):
        MeasuredKL(widths=(2, 4)).allocate(entropy, 2, price=price, sensitivity=table)
    with pytest.raises(ValueError, match="^policy.name: measured allocates from measured errors"):
        MeasuredKL().allocate(entropy, 2, price=price)


def test_the_additivity_cli_writes_its_pairs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "additivity.csv"
    args = ["--model", "tiny-llama", "--additivity", "3", "--budget", "4", "--out", str(out), "eval=tiny"]
    sensitivity_check.main(args)
    rows = pd.read_csv(out)
    assert len(rows) == 3 and list(rows.columns) == ["draw", "mean_bits", "predicted", "measured"]
    assert (rows["mean_bits"] <= 4).all()
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["draws"] == 3 and math.isfinite(summary["ratio"])
    assert "measured / predicted = " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        sensitivity_check.main(["--model", "tiny-llama", "--additivity", "1"])
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith("error: --additivity: 1")
    with pytest.raises(SystemExit) as exit_:  # unit KLs in context are marginals: their sum predicts no KL
        sensitivity_check.main([*args, "policy.widths=[2,4]", "eval.calibration.probe.context=2"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(
        "error: eval.calibration.probe.context: 2 with --additivity"
    )


def test_the_additivity_budget_is_the_points_budget(capsys):
    """--budget becomes the point's policy.budget (the default 4 lies outside widths 2-3), an explicit
    policy.budget stays, and a --budget outside the widths exits 2 naming --budget."""

    def point_of(*argv):
        args = sensitivity_check._parser().parse_args(["--model", "tiny-llama", *argv])
        return sensitivity_check._check_context(args)[1]

    narrow = ["--additivity", "3", "eval=tiny", "policy.widths=[2,3]"]
    assert point_of(*narrow, "--budget", "2.5").budget == 2.5
    assert point_of("--budget", "2.5", *narrow, "policy.budget=3").budget == 3
    assert point_of("--additivity", "3", "--budget", "3.25", "eval=tiny").budget == 3.25
    for budget, allowed in (("3.5", "2 to 3"), ("1.5", "2 to 3")):
        with pytest.raises(SystemExit) as exit_:
            sensitivity_check.main(["--model", "tiny-llama", *narrow, "--budget", budget])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(f"error: --budget: {budget} is outside policy.widths")
        assert f"allowed: {allowed}" in err
    # without --budget the default policy.budget is checked as before
    with pytest.raises(SystemExit) as exit_:
        sensitivity_check.main(["--model", "tiny-llama", *narrow])
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith("error: policy.budget: 4")


def test_the_additivity_cli_measures_calkey_through_its_fitted_key_tables(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "additivity.csv"
    args = ["--model", "tiny-llama", "--additivity", "3", "--budget", "4", "--out", str(out), "eval=tiny"]
    sensitivity_check.main([*args, "quant=calkey"])
    rows = pd.read_csv(out)
    assert len(rows) == 3 and (rows["measured"] > 0).all() and (rows["predicted"] > 0).all()
    assert len(list((tmp_path / "cache").rglob("tiny-llama-calkey-*.parquet"))) == 1  # fitted, then read
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        sensitivity_check.main(["--model", "tiny-llama", "eval=tiny", "quant=calkey"])  # the proxy check
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(
        "error: quant.scheme: calkey reads fitted key tables, which"
    )
