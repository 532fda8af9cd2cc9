"""harness.report.compare (python -m harness.compare_runs) on synthetic runs whose conclusions are known by
construction (the smoke runs in both dtypes are compared in test_bf16.py)."""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.config import key_of
from harness.report import compare

N = 20  # prompts and sequences per point: enough for a bootstrap interval


def record(config: dict, kl: np.ndarray, nll: np.ndarray, nll_base: np.ndarray, match: np.ndarray) -> dict:
    """A point record as the runner writes it, from per-item values (N,) each."""
    stats = np.tile([10, 10, 8, 6, 4, 2, 10, 9, 8, 7], (len(kl), 1))  # same BLEU everywhere: difference 0
    return {
        "key": key_of(config),
        "config": config,
        "status": "ok",
        "metrics": {
            "ppl_ratio": math.exp(nll.mean() - nll_base.mean()),
            "kl_mean": float(kl.mean()),
            "ppl": math.exp(nll.mean()),
        },
        "items": {
            "bleu_stats": stats.tolist(),
            "token_match": match.tolist(),
            "nll": nll.tolist(),
            "nll_base": nll_base.tolist(),
            "kl_mean": kl.tolist(),
        },
    }


def config(dtype: str, policy: str, budget: int = 4) -> dict:
    return {
        "model": "m",
        "dtype": dtype,
        "policy": policy,
        "budget": budget,
        "alpha": 0.0 if policy == "uniform" else 0.5,
        "sink_threshold": None,
        "sink_fraction": None,
        "scheme": "asym_token",
        "seed": 0,
    }


def write_run(run_dir: Path, records: list[dict]) -> Path:
    (run_dir / "points").mkdir(parents=True)
    for r in records:
        (run_dir / "points" / f"{r['key']}.json").write_text(json.dumps(r))
    return run_dir


@pytest.fixture
def runs(tmp_path):
    """A: entropy has clearly lower KL than uniform (better), the same PPL. B: entropy's KL is clearly higher
    (worse); its PPL gap is the same as A's. B has one more point (budget 2) than A."""
    rng = np.random.default_rng(0)
    base = rng.uniform(2.0, 3.0, N)
    kl_uniform = rng.uniform(0.1, 0.2, N)
    match = rng.uniform(0.5, 1.0, N)
    noise = lambda: rng.normal(0, 0.001, N)  # noqa: E731
    a = [
        record(config("float32", "uniform"), kl_uniform, base + 0.05 + noise(), base, match),
        record(config("float32", "entropy"), kl_uniform - 0.05 + noise(), base + 0.05 + noise(), base, match),
    ]
    b = [
        record(config("bfloat16", "uniform"), kl_uniform + 0.01, base + 0.06 + noise(), base, match),
        record(
            config("bfloat16", "entropy"), kl_uniform + 0.08 + noise(), base + 0.06 + noise(), base, match
        ),
        record(config("bfloat16", "uniform", 2), kl_uniform, base + 0.2, base, match),
    ]
    return write_run(tmp_path / "a", a), write_run(tmp_path / "b", b), a, b


def test_points_are_matched_without_the_dtype_and_differenced(runs):
    run_a, run_b, a, b = runs
    summaries, points, diffs, unmatched = compare.compare(run_a, run_b, n_boot=200)
    assert unmatched == (0, 1)
    assert len(points) == 2 and points["key_a"].tolist() != points["key_b"].tolist()
    for ra, rb in zip(a, b[:2]):
        row = points[points["key_a"] == ra["key"]].iloc[0]
        assert row["key_b"] == rb["key"]
        for metric in ("ppl_ratio", "kl_mean"):
            assert row[f"d_{metric}"] == pytest.approx(
                rb["metrics"][metric] - ra["metrics"][metric], abs=1e-12
            )
    assert [s["dtypes"] for s in summaries] == [["float32"], ["bfloat16"]]


def test_a_flipped_conclusion_is_caught_and_a_kept_one_is_not(runs):
    run_a, run_b, _, _ = runs
    _, _, diffs, _ = compare.compare(run_a, run_b, n_boot=200)
    kl = diffs[diffs["metric"] == "kl_mean"].iloc[0]
    assert kl["difference_a"] < 0 < kl["difference_b"]
    assert (kl["verdict_a"], kl["verdict_b"]) == ("better", "worse")
    assert not kl["keeps_sign"] and kl["keeps_significance"] and not kl["keeps_verdict"]
    bleu = diffs[diffs["metric"] == "bleu"].iloc[0]  # identical BLEU statistics: 0, not significant, in both
    assert bleu["difference_a"] == bleu["difference_b"] == 0 and bleu["keeps_verdict"] and bleu["keeps_sign"]
    assert set(diffs["metric"]) == {"bleu", "token_match", "ppl_ratio", "kl_mean"}


def test_verdict_follows_the_metric_direction():
    assert compare.verdict("kl_mean", -0.1, -0.2, True) == "better"
    assert compare.verdict("kl_mean", 0.1, 0.05, True) == "worse"
    assert compare.verdict("bleu", 0.1, 0.05, True) == "better"
    assert compare.verdict("bleu", -0.1, -0.3, False) == "n.s."
    assert compare.verdict("ppl_ratio", 0.1, math.nan, False) == "no interval"  # fewer than 16 items
    assert compare.verdict("ppl_ratio", math.nan, math.nan, False) == "no interval"


def test_points_with_too_few_items_get_no_verdict(tmp_path):
    rng = np.random.default_rng(1)
    few = 8
    runs = []
    for dtype in ("float32", "bfloat16"):
        base = rng.uniform(2, 3, few)
        runs.append(
            write_run(
                tmp_path / dtype,
                [
                    record(config(dtype, p), rng.uniform(0, 1, few), base + 0.1, base, np.ones(few))
                    for p in ("uniform", "entropy")
                ],
            )
        )
    _, _, diffs, _ = compare.compare(*runs, n_boot=50)
    assert set(diffs["verdict_a"]) == set(diffs["verdict_b"]) == {"no interval"} and (diffs["n"] == few).all()


def test_cli_writes_the_report_and_refuses_runs_with_nothing_in_common(runs, tmp_path, cli, in_process):
    """The report through a real python -m harness.compare_runs process; the refusals run its entry in this
    process."""
    run_a, run_b, _, _ = runs
    out = tmp_path / "out"
    proc = cli("harness.compare_runs", str(run_a), str(run_b), "--out", str(out), "--n-boot", "100")
    assert proc.returncode == 0, proc.stderr
    text = (out / "compare.md").read_text()
    assert text.startswith(f"`python -m harness.compare_runs {run_a} {run_b}")
    assert "**Verdicts differ**" in text and "1 only in B" in text
    assert len(pd.read_csv(out / "points.csv")) == 2 and len(pd.read_csv(out / "differences.csv")) == 4

    other = write_run(tmp_path / "other", [record(config("float32", "uniform", 8), *[np.ones(N)] * 4)])
    for args, message in (
        ([str(run_a), str(other)], "share no ok point"),
        ([str(run_a), str(tmp_path / "none")], "has no points/ directory"),
        ([str(run_a), str(run_b), "--n-boot", "0"], "--n-boot: 0 is not a positive integer"),
    ):
        proc = in_process(compare.main, "harness.compare_runs", *args)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert message in proc.stderr


def test_a_point_recorded_before_a_field_existed_matches_it_at_its_default_and_not_away_from_it():
    old = config("float32", "uniform")  # made before key_levels, outliers, key_group_size, key_offset existed
    new = {**old, "key_levels": "kmeans", "outliers": 0.0, "key_group_size": None, "key_offset": 0.0}
    assert compare.identity(old) == compare.identity(new)
    assert compare.identity(old) == compare.identity({**new, "dtype": "bfloat16"})  # dtype may differ
    for field, value in (
        ("key_levels", "fisher"),
        ("outliers", 0.01),
        ("key_group_size", 64),
        ("key_offset", 1.0),
    ):
        assert compare.identity(old) != compare.identity({**new, field: value}), field
