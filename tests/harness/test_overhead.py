"""harness.bench.overhead at a tiny size (the real run is smollm2-135m at default sizes), its ratios against hand-computed
values, its bad-input errors, and the stage clocks of harness.evaluate it reads."""

from __future__ import annotations

import csv

import pytest
import torch

from harness import evaluate
from harness.bench import overhead
from harness.models import load_model


def test_the_benchmark_writes_every_contender_and_stage(tmp_path, capsys):
    out = tmp_path / "overhead.csv"
    overhead.main(
        ["--schemes", "asym_token", "kivi", "pca", "--bits", "4", "--repeats", "2", "--threads", "1",
         "--out", str(out), "model=tiny-llama", "eval=tiny"]
    )  # fmt: skip
    lines = out.read_text().splitlines()
    assert lines[0].startswith("# command: python -m harness.bench.overhead --schemes asym_token kivi pca")
    assert "commit " in lines[1] and "1 threads" in lines[1]
    assert "model tiny-llama (torch.float32)" in lines[2] and "2 round(s)" in lines[2]
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    contenders = ["plain", "asym_token 4-bit", "kivi 4-bit", "pca 4-bit"]  # pca: its transforms fitted first
    assert [(r["contender"], r["stage"]) for r in rows] == [
        (c, s) for c in contenders for s in overhead.STAGES
    ]
    by = {(r["contender"], r["stage"]): r for r in rows}
    for stage in ("gen_steps", "tf_forward"):  # plain against itself
        assert float(by["plain", stage]["ratio"]) == 1.0
    for row in rows:
        assert float(row["median_s"]) > 0 and float(row["ratio"]) > 0 and row["rounds"] == "2"
    # every round of every contender's four parts, alternating
    rounds = list(csv.DictReader(out.with_suffix(".rounds.csv").open()))
    assert [(r["round"], r["contender"]) for r in rounds[::4]] == [
        (str(i), c) for i in range(2) for c in contenders
    ]
    assert (tmp_path / "overhead.env.json").exists()
    assert "seconds (median over rounds)" in capsys.readouterr().out


def test_ratios_are_medians_of_each_rounds_ratio_to_plain():
    parts = ("gen_cache", "gen_steps", "tf_forward", "tf_score")
    seconds = {  # (contender, round) -> seconds of the four parts
        ("plain", 0): (0.5, 10.0, 20.0, 2.0),
        ("plain", 1): (0.5, 20.0, 40.0, 2.0),
        ("plain", 2): (0.5, 10.0, 10.0, 2.0),
        ("x", 0): (1.0, 12.0, 30.0, 3.0),
        ("x", 1): (1.0, 30.0, 40.0, 3.0),
        ("x", 2): (4.0, 11.0, 30.0, 3.0),
    }
    rows = [dict(contender=c, round=r, part=p, seconds=s)
            for (c, r), values in seconds.items() for p, s in zip(parts, values)]  # fmt: skip
    got = {(s["contender"], s["stage"]): s for s in overhead.ratios(rows, ["plain", "x"])}
    assert got["x", "tf_forward"]["ratio"] == pytest.approx(1.5)  # rounds: 1.5, 1.0, 3.0
    assert got["x", "tf_forward"]["median_s"] == pytest.approx(30.0)
    assert got["x", "generation"]["ratio"] == pytest.approx(1.5)  # 13 / 10, 31 / 20, 15 / 10
    assert got["x", "tf_score"]["ratio"] == pytest.approx(0.15)  # 3 / 20, 3 / 40, 3 / 10
    assert got["x", "point"]["ratio"] == pytest.approx(46 / 30)  # 46 / 30, 74 / 60, 48 / 20
    assert got["plain", "gen_cache"]["ratio"] == pytest.approx(0.05)


@pytest.mark.parametrize(
    "args, key",
    [
        (["--schemes", "nope"], "--schemes: unknown 'nope'"),
        (["--schemes", "asym_token", "--bits", "5"], "--bits: 5 is not allowed for asym_token"),
        (["--repeats", "0"], "--repeats: 0 is not allowed"),
        (["eval.num_sequences=0"], "eval.num_sequences"),
    ],
)
def test_bad_input_is_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch, args, key):
    monkeypatch.setattr(overhead, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_:
        overhead.main([*args, "--out", str(tmp_path / "x.csv"), "model=tiny-llama", "eval=tiny"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and key in err, err
    assert not (tmp_path / "x.csv").exists()


def test_the_stage_clocks_change_nothing_and_add_up():
    model, _ = load_model("tiny-llama")
    torch.manual_seed(3)
    sequences = torch.randint(0, model.config.vocab_size, (2, 41))
    factory = evaluate.dynamic_cache_factory(model)
    base = evaluate.teacher_forced(model, sequences, factory, chunk=16, batch_size=2)
    clock = {}
    timed = evaluate.teacher_forced(model, sequences, factory, chunk=16, batch_size=2, clock=clock)
    assert torch.equal(base.nll, timed.nll) and torch.equal(base.logprobs, timed.logprobs)
    assert set(clock) == {"forward_s", "score_s"} and min(clock.values()) > 0
    prefilled = evaluate.prefill(model, sequences[:, :20], batch_size=2)
    gen_clock = {}
    tokens = evaluate.decode(model, prefilled, 5, clock=gen_clock)
    assert torch.equal(tokens, evaluate.decode(model, prefilled, 5))
    assert set(gen_clock) == {"cache_s", "steps_s"} and min(gen_clock.values()) > 0
