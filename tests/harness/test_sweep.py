"""Sweeps end to end on the smoke grid: determinism, joblib shards, resume after SIGKILL; a kv point through the
runner."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from harness.__main__ import entry
from harness.config import Point
from harness.run import runner
from harness.validate import validate_config

ROOT = Path(__file__).resolve().parents[2]
METRICS = [
    "bleu",
    "bleu_tok",
    "token_match",
    "first_divergence",
    "ppl",
    "ppl_ratio",
    "kl_mean",
    "kl_p99",
    "top1_agree",
    "mean_bits",
    "compression_true",
]


def harness(cli, *args):
    return cli("harness", *args, "tracking.wandb.mode=disabled", timeout=600)


def harness_here(in_process, *args):
    """python -m harness ARGS, run in this process."""
    return in_process(entry, "harness", *args, "tracking.wandb.mode=disabled")


def table(run_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(run_dir / "results.parquet").sort_values("key").reset_index(drop=True)


@pytest.fixture(scope="module")
def single(tmp_path_factory, in_process):
    """The smoke grid run in this process (the sharded and the killed runs are new processes)."""
    run_dir = tmp_path_factory.mktemp("single")
    proc = harness_here(in_process, "+sweep=smoke", f"run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


def test_smoke_run_writes_every_point_once(single):
    records = [json.loads(p.read_text()) for p in (single / "points").glob("*.json")]
    assert all(r["key"] == Point.from_dict(r["config"]).key() for r in records)
    got = table(single)
    assert len(got) == len(records) == got["key"].nunique()
    assert set(got["status"]) <= {"ok", "infeasible"} and (got["status"] == "ok").sum() >= 4
    assert {"baseline", "uniform", "entropy"} <= set(got["policy"])
    for name in ("config.yaml", "env.json", "timings.json"):
        assert (single / name).exists()
    env = json.loads((single / "env.json").read_text())
    assert env["command"].startswith("python -m harness") and "torch" in env["packages"]


def test_same_config_and_seed_give_identical_metrics_and_two_shards_match(single, tmp_path, cli):
    sharded = tmp_path / "sharded"
    proc = harness(
        cli,
        "--config-dir",
        "sweeps",
        "--config-name",
        "local",
        "+sweep=smoke",
        f"run_dir={sharded}",
        "run_name=x",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (sharded / "env.shard0.json").exists() and (sharded / "env.shard1.json").exists()
    a, b = table(single), table(sharded)
    assert a["key"].tolist() == b["key"].tolist()
    pd.testing.assert_frame_equal(a[METRICS], b[METRICS], check_exact=True)


def test_sigkill_mid_sweep_then_resume(single, tmp_path, in_process):
    """The sweep killed as a process, resumed in this one."""
    run_dir = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness",
            "+sweep=smoke",
            f"run_dir={run_dir}",
            "tracking.wandb.mode=disabled",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while time.time() < deadline and len(list((run_dir / "points").glob("*.json"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = {p.name for p in (run_dir / "points").glob("*.json")}
    assert 0 < len(done_before) < len(table(single))
    if (run_dir / "results.parquet").exists():
        pd.read_parquet(run_dir / "results.parquet")  # readable whenever it exists
    mtimes = {p.name: p.stat().st_mtime_ns for p in (run_dir / "points").glob("*.json")}
    proc = harness_here(in_process, "+sweep=smoke", f"run_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = table(run_dir)
    assert resumed["key"].tolist() == table(single)["key"].tolist()  # every point exactly once
    pd.testing.assert_frame_equal(resumed[METRICS], table(single)[METRICS], check_exact=True)
    for name, mtime in mtimes.items():  # finished points were not recomputed
        assert (run_dir / "points" / name).stat().st_mtime_ns == mtime


def test_interleaved_models_load_once_each(tmp_path, monkeypatch):
    """A grid that alternates models (one policy after another) still builds each model's context once."""
    from hydra import compose, initialize_config_dir

    from harness.protocols.sweep import expand
    from harness.run import context, runner

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "config", overrides=["+sweep=smoke", "sweep.models=[tiny-llama,tiny-gpt2]", "sweep.budgets=[4]"]
        )
    points = expand(cfg)
    models = [p.model for p in points]
    assert models[:3] == ["tiny-llama", "tiny-gpt2", "tiny-llama"]  # interleaved in grid order

    loads = []
    real_load = context.load_model
    monkeypatch.setattr(context, "load_model", lambda name, **kw: loads.append(name) or real_load(name, **kw))
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    table = runner.run(points, tmp_path / "run", batch_size=4)
    assert loads == ["tiny-llama", "tiny-gpt2"]
    assert set(table.loc[table["policy"] != "baseline", "key"]) == {p.key() for p in points}


def test_a_kv_point_runs_end_to_end_with_keys_and_values_apart(tmp_path):
    overrides = ["model=tiny-llama", "eval=tiny", "policy=kv", "policy.budget=3", "policy.key_offset=2"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        points = validate_config(compose(config_name="config", overrides=overrides))
    (point,) = [p for p in points if p.policy == "kv"]
    assert point.key_offset == 2 and point.key() != point.replace(key_offset=4.0).key()
    row = runner.run([point], tmp_path, batch_size=4).set_index("policy").loc["kv"]
    assert row["status"] == "ok" and row["mean_bits"] == 3
    # asym_token g32, head_dim 32: keys 4-bit (16 + 4 bytes), values 2-bit (8 + 4 bytes) against 2 x 64 bytes.
    assert row["compression_true"] == pytest.approx(128 / 32)
    record = json.loads((tmp_path / "points" / f"{point.key()}.json").read_text())
    allocation = record["allocation"]
    assert "bits" not in allocation and {w for r in allocation["key_bits"] for w in r} == {4}
    assert {w for r in allocation["value_bits"] for w in r} == {2}
    assert allocation["histogram"] == {"key": {"4": 9}, "value": {"2": 9}}


def compose_points(*overrides) -> list[Point]:
    from harness.protocols.sweep import expand

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return expand(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize("count", [2, 3])
def test_shards_split_the_grid_and_one_job_measures_each_table(count):
    from harness.protocols.sweep import shard
    from harness.run.context import context_key
    from harness.run.measure import table_key

    smoke = compose_points("+sweep=smoke")
    for i in range(count):  # no measured policy: job i takes points i, i + count, ...
        assert shard(smoke, i, count) == smoke[i::count]

    grid = compose_points("+sweep=frontier")
    tables = {p.key(): (context_key(p), table_key(p)) for p in grid if table_key(p) is not None}
    assert len(set(tables.values())) >= 2 and len(tables) >= 4  # kivi and codebook, two budgets each
    jobs = [shard(grid, i, count) for i in range(count)]
    assert sorted(p.key() for job in jobs for p in job) == sorted(p.key() for p in grid)  # each point once
    for job in jobs:
        assert job == [p for p in grid if p in job]  # grid order kept
    job_of = {p.key(): i for i, job in enumerate(jobs) for p in job}
    for table in set(tables.values()):
        assert len({job_of[k] for k, t in tables.items() if t == table}) == 1
    sizes = [len(job) for job in jobs]
    assert max(sizes) - min(sizes) <= max(
        sum(t == table for t in tables.values()) for table in tables.values()
    )


def test_a_point_another_start_finished_meanwhile_is_not_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    points = compose_points("+sweep=smoke", "sweep.budgets=[4]")
    assert len(points) >= 3
    measured = []
    measure_point = runner.measure_point

    def measure(ctx, point, key):
        measured.append(key)
        if len(measured) == 1:  # meanwhile, another start into the same run directory finishes the last point
            runner.run(points[-1:], tmp_path / "run", batch_size=4)
        return measure_point(ctx, point, key)

    monkeypatch.setattr(runner, "measure_point", measure)
    table = runner.run(points, tmp_path / "run", batch_size=4)
    # the nested start measured the last point (second call); the first start skipped it when its turn came
    assert measured == [points[0].key(), points[-1].key(), *(p.key() for p in points[1:-1])]
    assert set(table.loc[table["policy"] != "baseline", "key"]) == {p.key() for p in points}
