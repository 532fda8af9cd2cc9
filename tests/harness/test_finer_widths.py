"""The finer-widths check (harness.sensitivity.finer_widths): interpolation by hand, plan distortions against the
fit's own plans, the knapsack's predictions against brute force, and its command on a tiny model."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.calibrate.pca import fit_components, plans_for
from harness.protocols import sensitivity_check
from harness.schemes import get_scheme
from harness.schemes.pca_table import PCA_FORMAT
from harness.sensitivity.finer_widths import (
    between,
    check_step,
    fine_widths,
    finer_widths_check,
    interpolated_costs,
    leave_one_out,
    matching_budget,
    plan_distortions,
    predicted_kl,
)


def brute_force(costs: np.ndarray, widths, budget: float) -> float:
    """The least summed cost of one width per unit with mean width at most budget, by enumeration."""
    units = len(costs)
    best = np.inf
    for choice in itertools.product(range(len(widths)), repeat=units):
        if sum(widths[j] for j in choice) <= budget * units + 1e-9:
            best = min(best, sum(costs[u, j] for u, j in enumerate(choice)))
    return best


def test_between_interpolates_along_the_distortion_by_hand():
    kl0, kl1 = np.array([1.0, 2.0, 3.0]), np.array([0.5, 1.0, 1.0])
    d0, d, d1 = np.array([4.0, 10.0, 5.0]), np.array([3.0, 9.0, 5.0]), np.array([2.0, 6.0, 5.0])
    # a quarter of the way along unit 1's distortion; unit 2's extra bits change nothing: its KL at w0
    assert np.allclose(between(kl0, kl1, d0, d, d1), [0.75, 1.75, 3.0])


def test_interpolated_costs_keep_every_measured_width_and_stay_between_its_neighbours():
    g = torch.Generator().manual_seed(7)
    measured = np.sort(np.random.default_rng(7).uniform(0.01, 1, (5, 3)), axis=1)[:, ::-1].copy()  # falls
    widths = fine_widths([2, 3, 4], 4)
    assert widths == [2, 2.25, 2.5, 2.75, 3, 3.25, 3.5, 3.75, 4]
    fit = fit_components(torch.randn(300, 16, generator=g) * torch.linspace(3, 0.1, 16))
    distortion = np.stack([plan_distortions(fit, widths, PCA_FORMAT)] * 5)  # [5, 9]
    costs = interpolated_costs(measured, [2, 3, 4], distortion, widths)
    assert np.array_equal(costs[:, [0, 4, 8]], measured)
    assert (np.diff(costs, axis=1) <= 1e-12).all()  # between falling ends, along a falling distortion


def test_plan_distortions_are_those_of_the_fits_own_plans():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(400, 24, generator=g) * torch.linspace(2, 0.05, 24)
    fit = fit_components(x)
    plans = plans_for(fit.distortion, (1, 2, 3, 4), PCA_FORMAT)  # (4, D)
    want = [float(fit.distortion[torch.arange(24), plan].sum()) for plan in plans]
    got = plan_distortions(fit, [1, 2, 3, 4], PCA_FORMAT)
    assert np.allclose(got, want, rtol=0, atol=1e-12)
    finer = plan_distortions(fit, fine_widths([1, 4], 8), PCA_FORMAT)
    assert (np.diff(finer) <= 1e-12).all() and finer[0] > finer[-1]
    with pytest.raises(ValueError, match="not a whole number of bits"):
        plan_distortions(fit, [1.01], PCA_FORMAT)


# costs in hundredths: the solver's tolerances (1e-6 of the largest cost) never decide between them
COSTS = st.lists(st.lists(st.integers(0, 100), min_size=3, max_size=3), min_size=2, max_size=4)


@settings(max_examples=40, deadline=None)
@given(COSTS, st.floats(1, 3))
def test_the_knapsacks_prediction_is_brute_forces(rows, budget):
    costs = np.array(rows) / 100
    widths = [1, 1.5, 3]
    assert predicted_kl(costs, widths, budget) == pytest.approx(brute_force(costs, widths, budget), abs=1e-9)


@settings(max_examples=30, deadline=None)
@given(COSTS, st.integers(0, 200))
def test_the_matching_budget_is_the_least_whole_total_that_predicts_the_target(rows, target):
    costs = np.sort(np.array(rows) / 100, axis=1)[:, ::-1].copy()  # KL falls with width
    target /= 100
    whole, units = [1, 2, 3], len(rows)
    got = matching_budget(costs, whole, target)
    reaching = [
        t for t in range(units, 3 * units + 1) if brute_force(costs, whole, t / units) <= target + 1e-9
    ]
    assert got == (min(reaching) / units if reaching else 3.0)


def test_the_check_gains_nothing_at_whole_steps_and_never_loses_at_finer_ones():
    rng = np.random.default_rng(11)
    whole = [1, 2, 3, 4]
    shape = (2, 3)  # layers, KV heads
    measured = np.sort(rng.uniform(1e-4, 1, (2, *shape, 4)), axis=-1)[..., ::-1]
    table = pd.DataFrame(
        [
            dict(layer=layer, kv_head=h, role=role, bits=w, kl=measured[r, layer, h, j])
            for r, role in enumerate(("key", "value"))
            for layer in range(2)
            for h in range(3)
            for j, w in enumerate(whole)
        ]
    )
    for step in (1, 4):
        widths = fine_widths(whole, step)
        # each unit's distortion falls as 2 ** -w: a smooth curve the finer widths sit on
        distortion = np.broadcast_to(2.0 ** -np.array(widths), (2, *shape, len(widths))).copy()
        distortion[1, 1, 2] = np.nan  # a head without a cache of its own: left out with its rows
        rows, checked = finer_widths_check(table, distortion, whole, step, [1.5, 2.5])
        assert list(rows["budget"]) == [1.5, 2.5] and (rows["step"] == step).all()
        if step == 1:
            assert (rows["change"] == 0).all() and (rows["bits_saved"] == 0).all()
        else:
            assert (rows["finer_kl"] <= rows["whole_kl"] + 1e-12).all()
            assert (rows["bits_saved"] >= 0).all()
        assert list(checked["width"]) == [2, 3]


def test_leave_one_out_is_exact_where_the_kl_follows_the_distortion():
    rng = np.random.default_rng(5)
    distortion = np.sort(rng.uniform(0.1, 1, (6, 4)), axis=1)[:, ::-1].copy()  # [U, |whole|]
    measured = 0.3 * distortion + 0.01  # KL affine in d: interpolation along d is exact
    checked = leave_one_out(measured, [1, 2, 3, 4], distortion)
    assert list(checked["width"]) == [2, 3]
    assert np.allclose(checked["ratio"], 1) and np.allclose(checked["median_relative_error"], 0)
    assert np.allclose(checked["spearman"], 1)


def test_check_step_refuses_other_steps_and_schemes_without_a_plan_at_every_total():
    check_step(4, get_scheme("pca"))
    with pytest.raises(ValueError, match=r"^--finer-widths: 3; allowed: 1, 2, 4, 8"):
        check_step(3, get_scheme("pca"))
    for name in ("pca_gsa", "pca_block_ugs"):  # grouped plans, shared by every head
        with pytest.raises(ValueError, match=f"^quant.scheme: {name}'s plans group components"):
            check_step(4, get_scheme(name))
    with pytest.raises(ValueError, match="^quant.scheme: vq2 stores no pca plans"):
        check_step(4, get_scheme("vq2"))  # reads pca's means, codes no plan


def test_the_finer_widths_cli_writes_its_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "finer.csv"
    point = ["eval=tiny", "quant=pca", "quant.sink_tokens=1", "policy.widths=[1,2,3,4]"]
    sensitivity_check.main(
        ["--model", "tiny-llama", "--finer-widths", "2", "--budgets", "2.5,3", "--out", str(out), *point]
    )
    rows = pd.read_csv(out)
    assert list(rows["budget"]) == [2.5, 3.0] and (rows["finer_kl"] <= rows["whole_kl"]).all()
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["step"] == 2 and [r["width"] for r in summary["leave_one_out"]] == [2, 3]
    assert "steps of 1/2 bit" in capsys.readouterr().out
    for args, start in (
        (
            ["--finer-widths", "2", "--budgets", "3", "eval=tiny"],
            "error: quant.scheme: asym_token stores no pca",
        ),
        (["--finer-widths", "3", "--budgets", "3", *point], "error: --finer-widths: 3; allowed"),
        (["--finer-widths", "2", *point], "error: --budgets: missing"),
        (["--finer-widths", "2", "--budgets", "5", *point], "error: --budgets: 5.0 is outside the widths"),
        (
            ["--finer-widths", "2", "--budgets", "3", *point[:3], "policy.widths=[2,4]"],
            "error: policy.widths",
        ),
    ):
        with pytest.raises(SystemExit) as exit_:
            sensitivity_check.main(["--model", "tiny-llama", *args])
        assert exit_.value.code == 2 and capsys.readouterr().err.startswith(start)


def test_the_matching_budget_takes_a_target_met_to_the_last_bit():
    costs = np.array([[0.26, 0.0, 0.0], [0.56, 0.0, 0.0]])  # 0.26 + 0.56 is 0.8200000000000001 in float64
    assert matching_budget(costs, [1, 2, 3], 0.82) == 1.0
