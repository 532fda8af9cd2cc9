"""harness.sensitivity.one_exact on tiny-llama: each row is the KL of its hand-built allocation (one unit at 16, the
rest at the width), the draw is seeded and distinct, and the CLI writes its rows and summary or exits 2 on bad
input."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from harness.models import load_model
from harness.protocols import sensitivity_check
from harness.schemes import get_scheme
from harness.sensitivity import allocation_kl
from harness.sensitivity.one_exact import one_exact_check, sample_units
from harness.sensitivity.unit_kl import baseline_run
from kernels.layout import FULL_WIDTH

SCHEME = get_scheme("asym_token", 16)


@pytest.fixture(scope="module")
def tiny():
    """tiny-llama (3 layers x 3 KV heads: 18 units) and 2 x 40 random tokens."""
    model, _ = load_model("tiny-llama")
    return model, torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))


def test_every_row_is_its_own_allocation_measured_directly(tiny):
    model, ids = tiny
    rows = one_exact_check(model, ids, SCHEME, width=2, count=5, seed=7, chunk=16)
    assert list(rows.columns) == ["layer", "kv_head", "role", "kl_all", "kl_one_exact", "difference"]
    assert len(rows) == 5 and rows[["layer", "kv_head", "role"]].drop_duplicates().shape[0] == 5
    base = baseline_run(model, ids, 16)
    everywhere = torch.full((3, 3), 2)
    kl_all = allocation_kl(model, ids, SCHEME, everywhere, everywhere, base, 16)
    assert kl_all > 0 and rows["kl_all"].eq(rows["kl_all"].iloc[0]).all()
    assert rows["kl_all"].iloc[0] == pytest.approx(kl_all, rel=1e-6)
    for row in rows.itertuples(index=False):
        keys, values = everywhere.clone(), everywhere.clone()
        (keys if row.role == "key" else values)[row.layer, row.kv_head] = FULL_WIDTH
        measured = allocation_kl(model, ids, SCHEME, keys, values, base, 16)
        assert row.kl_one_exact == pytest.approx(measured, rel=1e-6)
        assert row.difference == pytest.approx(row.kl_one_exact - row.kl_all, abs=1e-12)
    assert rows["kl_one_exact"].nunique() == 5  # each row moved a different unit


def test_the_draw_is_seeded_distinct_and_bounded_by_the_model(tiny):
    model, _ = tiny
    units = sample_units(model, 18, seed=1)
    every = {(layer, h, role) for layer in range(3) for h in range(3) for role in ("key", "value")}
    assert set(units) == every and len(units) == 18
    assert sample_units(model, 6, seed=1) == units[:6]  # a prefix of the same permutation
    assert sample_units(model, 6, seed=2) != units[:6]
    for count in (0, 19):
        with pytest.raises(ValueError, match=rf"^--one-exact: {count}; allowed: 1 to 18"):
            sample_units(model, count)


def test_the_cli_writes_its_rows_and_summary_and_refuses_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "one-exact.csv"
    args = ["--model", "tiny-llama", "--one-exact", "4", "--width", "3", "--out", str(out), "eval=tiny"]
    sensitivity_check.main([*args, "quant.sink_tokens=1"])
    rows = pd.read_csv(out)
    assert len(rows) == 4 and rows["kl_one_exact"].map(math.isfinite).all()
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["units"] == 4 and summary["width"] == 3 and summary["point"]["sink_tokens"] == 1
    assert summary["mean_difference"] == pytest.approx(rows["difference"].mean())
    low, high = summary["interval"]
    assert low <= summary["mean_difference"] <= high
    assert summary["raised"] == int((rows["difference"] > 0).sum())
    assert "one unit exact, the rest at 3 bits" in capsys.readouterr().out
    sensitivity_check.main(["--probe", *args, "eval.calibration.probe.tokens=12"])  # the calibration probe
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["text"] == "calibration probe" and summary["sequences"][1] == 12
    assert summary["kl_all"] != pytest.approx(rows["kl_all"].iloc[0])  # other tokens, another KL
    capsys.readouterr()
    for bad, message in (
        (["--probe"], "error: --probe: without --one-exact"),
        (["--one-exact", "4", "--probe", "--sequences", "2"], "error: --sequences: with --probe"),
        (["--one-exact", "1"], "error: --one-exact: 1 is too few"),
        (["--one-exact", "40"], "error: --one-exact: 40; allowed: 1 to 18"),
        (["--one-exact", "4", "--sequences", "0"], "error: --sequences: 0 is too few"),
        (["--one-exact", "4", "--width", "5"], "error: --width: 5 is not a quantized width"),
    ):
        with pytest.raises(SystemExit) as exit_:
            sensitivity_check.main(["--model", "tiny-llama", *bad, "--out", str(out), "eval=tiny"])
        assert exit_.value.code == 2 and capsys.readouterr().err.startswith(message)


@pytest.mark.parametrize(
    ("flags", "name", "runner"),
    [
        ({"chain": 2}, "chain-m-s-w2", "_run_chain"),
        ({"finer_widths": 4}, "finer-widths-m-s-4", "_run_finer_widths"),
        ({"additivity": 10}, "additivity-m-s", "_run_additivity"),
        ({"one_exact": 16}, "one-exact-m-s-w3-sink1", "_run_one_exact"),
        ({"one_exact": 16, "probe": True}, "one-exact-m-s-w3-sink1-probe2x128", "_run_one_exact"),
        ({}, "check-m-s-w3", "_run_check"),
    ],
)
def test_each_check_has_its_output_name_and_runner(flags, name, runner):
    """The flags pick one check (chain first, the head check when none is asked): its CSV's default stem and the
    function that runs it."""
    args = SimpleNamespace(
        **{"chain": None, "finer_widths": None, "additivity": None, "one_exact": None, "probe": False, "width": 3,
           **flags}
    )  # fmt: skip
    point = SimpleNamespace(model="m", sink_tokens=1, probe_sequences=2, probe_tokens=128)
    got_name, got_runner = sensitivity_check._which_check(args, point, SimpleNamespace(name="s"))
    assert (got_name, got_runner) == (name, getattr(sensitivity_check, runner))
