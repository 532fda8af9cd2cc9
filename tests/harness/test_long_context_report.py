"""The long-context report (harness.report.long_context) on synthetic records whose answers are known, and the
shipped sweep that makes such a run."""

import math

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from harness.config import key_of
from harness.io import CONF_DIR
from harness.report import long_context
from harness.validate import validate_config


def _record(key, budget, compression, ppl_shift, tokens=1024, score_from=0, policy="measured", n=16, seed=0):
    """A pca point at `tokens`-token windows whose ppl_ratio is exp(ppl_shift) exactly (its items' nll less the
    baseline's, plus noise of mean 0) and whose kl_mean is ppl_shift / 2 plus noise."""
    rng = np.random.default_rng(seed)
    nll_base = rng.normal(3.0, 0.2, n)
    noise = rng.normal(0, 0.01, n)
    nll = nll_base + ppl_shift + noise - noise.mean()
    kl = rng.uniform(0, 0.01, n) + ppl_shift / 2
    return {
        "key": key,
        "status": "ok",
        "config": {"model": "m", "scheme": "pca", "group_size": 32, "sink_tokens": 1, "residual": 0,
                   "budget": budget, "policy": policy, "alpha": 0.0, "sink_threshold": None, "sink_fraction": None,
                   "widths": [1, 2, 3, 4, 5, 6], "seed": 0, "dtype": "float32", "num_sequences": n,
                   "sequence_tokens": tokens, "score_from": score_from, "chunk": 128, "bos": "auto",
                   "data_path": "stdlib_docstrings", "calibration_data_path": "pydoc_topics",
                   "calibration_sequences": 8, "calibration_tokens": 512, "i0": 32},
        "metrics": {"compression_true": compression, "bytes_per_token": 1000.0 / compression,
                    "ppl_ratio": math.exp(ppl_shift), "kl_mean": float(kl.mean()), "simulate": True},
        "items": {"nll": list(nll), "nll_base": list(nll_base), "kl_mean": list(kl)},
    }  # fmt: skip


def _baseline(tokens, score_from, ppl):
    record = _record(f"base{tokens}", 16, 1.0, 0.0, tokens, score_from, policy="baseline")
    record["metrics"] = {"ppl": ppl, "simulate": False}
    return record


LONG = {"tokens": 8192, "score_from": 4096, "seed": 1}
RECORDS = [
    _baseline(1024, 0, 11.0),
    _baseline(8192, 4096, 9.5),
    _record("a", 4.4, 3.52, 0.009),
    _record("a8", 4.4, 3.52, 0.015, **LONG),  # moves +0.006 in ratio: within the goal
    _record("b", 3.3, 4.65, 0.040),
    _record("b8", 3.3, 4.65, 0.070, **LONG),  # moves about +0.03: misses it
    _record("c", 2.4, 6.28, 0.12),  # no long-window partner: no row
]


def test_each_configuration_gets_its_ratio_at_each_length_and_its_move():
    table = long_context.long_context_table(RECORDS, "m", n_boot=200)
    assert list(table["point"])[0] == "unquantized cache (perplexity)"
    assert (
        table.iloc[0]["ppl_ratio, 1024 tokens"] == "11"
        and table.iloc[0]["ppl_ratio, 8192 tokens, scored from 4096"] == "9.5"
    )
    rows = table.iloc[1:].set_index("true compression")
    assert list(rows.index) == ["3.52x", "4.65x"]  # 6.28x has one length only
    cell = rows.loc["3.52x", "ppl_ratio, 8192 tokens, scored from 4096"]
    assert cell.startswith(f"{math.exp(0.015):.4g} [") and cell.endswith("n=16")
    move = rows.loc["4.65x", "ppl_ratio move to 8192"]
    expected = math.exp(0.070) - math.exp(0.040)
    assert move.startswith(f"{expected:+.4f} [")
    low, high = (float(x) for x in move[move.index("[") + 1 : -1].split(", "))
    assert low < expected < high and high - low > 0.002  # the noise spreads the resampled ratios


def test_the_goal_holds_the_short_frontier_points_moves_to_one_hundredth():
    goals = long_context.goal_rows(RECORDS, "m").set_index("at least")
    assert goals.loc["3.5x", "verdict"] == "met"
    assert goals.loc["3.5x", "ppl_ratio move"] == f"{math.exp(0.015) - math.exp(0.009):+.4f}"
    missed = math.exp(0.070) - math.exp(0.040) - long_context.LONG_GOAL
    assert goals.loc["4.5x", "verdict"] == f"missed by {missed:.4f}"


def test_no_interval_below_sixteen_sequences():
    short = [_record("a", 4.4, 3.52, 0.009, n=8), _record("a8", 4.4, 3.52, 0.015, n=8, **LONG)]
    row = long_context.long_context_table(short, "m", n_boot=50).iloc[-1]
    assert "too small" in row["ppl_ratio, 1024 tokens"] and "too small" in row["ppl_ratio move to 8192"]


def test_the_page_is_written_per_text_and_model(tmp_path):
    (tmp_path / "points").mkdir()
    text = long_context.long_context_text(tmp_path, RECORDS, n_boot=50)
    assert "# m on stdlib_docstrings" in text and "## Goal" in text and "Simulated memory" in text


def test_the_shipped_sweep_judges_each_point_at_both_lengths():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        points = validate_config(compose(config_name="config", overrides=["+sweep=frontier_long"]))
    lengths = {}
    for p in points:
        configuration = (p.policy, p.scheme, p.budget)
        lengths.setdefault(configuration, set()).add((p.sequence_tokens, p.score_from))
    assert len(lengths) == 14 and all(v == {(1024, 0), (8192, 4096)} for v in lengths.values())
    assert {p.data_path for p in points} == {"stdlib_docstrings"} and {p.num_sequences for p in points} == {
        16
    }
    assert {p.calibration_data_path for p in points} == {"pydoc_topics"}


@pytest.mark.parametrize("score_from", [0, 1])
def test_a_point_scored_from_its_start_keeps_its_key(score_from):
    """eval.score_from enters a point's key only away from 0 (points made before it existed keep theirs)."""
    record = _record("a", 4.4, 3.52, 0.009)["config"]
    without = {k: v for k, v in record.items() if k != "score_from"}
    same = key_of({**without, "score_from": 0}) == key_of(without)
    assert same and (key_of({**without, "score_from": score_from}) == key_of(without)) == (score_from == 0)


def test_a_point_recorded_before_a_keyed_unless_field_pairs_with_one_recorded_at_its_default():
    old = _record("c", 2.4, 6.28, 0.12)  # no probe fields: recorded before they existed
    at_default = _record("c8", 2.4, 6.28, 0.15, **LONG)
    at_default["config"].update(probe_sequences=2, probe_tokens=128)
    other_probe = _record("d8", 2.4, 6.28, 0.13, tokens=8192, score_from=4096, seed=2)
    other_probe["config"].update(probe_sequences=2, probe_tokens=512)
    table = long_context.long_context_table([*RECORDS, old, at_default, other_probe], "m", n_boot=200)
    rows = table.iloc[1:].set_index("true compression")
    assert list(rows.index) == ["3.52x", "4.65x", "6.28x"]  # the 512-token probe has no 1K partner: no row
    assert rows.loc["6.28x", "ppl_ratio, 8192 tokens, scored from 4096"].startswith(f"{math.exp(0.15):.4g} [")
