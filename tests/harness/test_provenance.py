"""Provenance of a run: the thread count applied and recorded, identical metrics at a fixed count, keys that
leave the count out (so committed runs still resume), and env.json written before any model loads."""

import json
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from harness.__main__ import entry
from harness.protocols.sweep import expand

ROOT = Path(__file__).resolve().parents[2]
METRICS = ["bleu", "token_match", "ppl", "ppl_ratio", "kl_mean", "kl_p99", "top1_agree", "compression_true"]


ARGS = ("model=tiny-llama", "eval=tiny", "tracking.wandb.mode=disabled")


def harness(in_process, *args):
    """python -m harness ARGS, run in this process."""
    proc = in_process(entry, "harness", *ARGS, *args)
    assert proc.returncode == 0, proc.stderr[-2000:]


def rows(run_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(run_dir / "results.parquet").sort_values("key").reset_index(drop=True)


def test_fixed_threads_give_identical_metrics_recorded_everywhere_and_resume_adds_nothing(
    tmp_path, cli, in_process
):
    """Run a in this process, run b as a new process (the same metrics across processes), the resume of a in
    this process again."""
    a, b = tmp_path / "a", tmp_path / "b"
    harness(in_process, "threads=1", "seed=3", f"run_dir={a}")
    proc = cli("harness", *ARGS, "threads=1", "seed=3", f"run_dir={b}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, second = rows(a), rows(b)
    assert len(first) == 3 and first["key"].tolist() == second["key"].tolist()  # baseline, uniform, entropy
    pd.testing.assert_frame_equal(first[METRICS], second[METRICS], check_exact=True)
    assert (first["threads"] == 1).all() and first["git_commit"].notna().all()
    env = json.loads((a / "env.json").read_text())
    assert env["threads"] == 1 and env["git_commit"] == first["git_commit"][0] and not env["allow_dirty"]

    # The thread count is recorded beside the configuration, never in the key: a resume at another count adds
    # no point, and keeps the first start's record.
    harness(in_process, "threads=2", "seed=3", f"run_dir={a}")
    assert rows(a)["key"].tolist() == first["key"].tolist() and (rows(a)["threads"] == 1).all()
    assert json.loads((a / "env.json").read_text())["threads"] == 2
    assert json.loads((a / "env.1.json").read_text())["threads"] == 1


def _current_schema(config: Path) -> bool:
    """Runs made since points carry eval.bos and policy.budget_unit; earlier runs were made under other rules
    (no BOS, budgets in bits) and are rerun, not resumed."""
    cfg = OmegaConf.load(config)
    return "protocol" not in (cfg.get("sweep") or {}) and "budget_unit" in cfg.policy and "bos" in cfg.eval


COMMITTED = sorted(
    path.parent
    for path in (ROOT / "results").rglob("config.yaml")
    if (path.parent / "points").is_dir() and _current_schema(path)
)


def _grid_keys(run_dir: Path) -> set[str]:
    """The keys every start of a run expands to (config.yaml is the latest start, config.N.yaml the earlier ones:
    a start may have asked for only part of the grid)."""
    keys = set()
    for config in run_dir.glob("config*.yaml"):
        cfg = OmegaConf.load(config)
        cfg.threads, cfg.allow_dirty = 1, False
        keys |= {p.key() for p in expand(cfg)}
    return keys


@pytest.mark.parametrize("run_dir", COMMITTED, ids=[str(p.relative_to(ROOT)) for p in COMMITTED])
def test_committed_runs_resume_with_the_new_keys(run_dir):
    """Every committed grid point still has the key its run's configuration expands to (now with threads and
    allow_dirty in it), so a resume finds it and adds it again never. Baselines are the runner's, not the grid's."""
    done = {
        p.stem
        for p in (run_dir / "points").glob("*.json")
        if json.loads(p.read_text())["config"]["policy"] != "baseline"
    }
    assert done and done <= _grid_keys(run_dir)
