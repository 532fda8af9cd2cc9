"""kernels/gpu/runner_check.py's comparison, with the grids' runs stood in for (their tables written by the test):
a run that fails is said, and the grids that ran are still compared. (tests/kernels/gpu/test_check.py's dry run
runs the harness for real.)"""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from kernels.gpu import runner_check


def _row(key: str, scheme: str, ppl: float) -> dict:
    """One point of a run's table, every column the comparison reads."""
    row = {"key": key, "scheme": scheme, "policy": "uniform", "budget": 4, "status": "ok", "mean_bits": 4.0,
           "compression_nominal": 4.0, "compression_true": 3.2, "bytes_per_token": 96, "ppl": ppl, "ppl_base": 9.0,
           "ppl_ratio": ppl / 9.0, "kl_mean": 0.01, "kl_p99": 0.1, "top1_agree": 0.9}  # fmt: skip
    return {**row, **{c: 1.0 for c in runner_check.REPORTED}}


def test_a_failed_grid_is_said_and_the_others_are_still_compared(tmp_path, monkeypatch, capsys):
    """Three grids a side; the GPU side's grouped run fails: the smoke and pca points are compared (one GPU value
    off by 5%: a mismatch), the grouped points are rows saying they are missing on the GPU side, the failure is
    an error line, the exit code 1."""
    points = {
        "smoke": [("a", "asym_token")],
        "pca": [("b", "pca_block_uf")],
        "grouped": [("c", "pca_block_ugs")],
    }

    def start(run_dir, device, backend, extra, threads):
        assert threads >= 1
        grid = next(g for g, overrides in runner_check.GRIDS.items() if overrides == extra)
        if backend == "triton" and grid == "grouped":
            return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        run_dir.mkdir(parents=True)
        ppl = 9.45 if (backend, grid) == ("triton", "pca") else 9.0
        rows = [_row(key, scheme, ppl) for key, scheme in points[grid]]
        pd.DataFrame(rows).to_parquet(run_dir / "results.parquet")
        return subprocess.Popen([sys.executable, "-c", "pass"])

    monkeypatch.setattr(runner_check, "start_grid", start)
    with pytest.raises(SystemExit) as done:
        runner_check.main(["--out", str(tmp_path), "--timeout", "60"])
    assert done.value.code == 1
    out, err = capsys.readouterr()
    assert "error: the cuda triton grouped run exited with 3; see" in err
    rows = pd.read_csv(tmp_path / "runner.csv", dtype=str, keep_default_na=False)
    by_point = {key: group for key, group in rows.groupby("key")}
    assert set(by_point["a"]["ok"]) == {"True", ""}  # the same values (reported columns: no verdict)
    off = by_point["b"][by_point["b"]["ok"] == "False"]
    assert set(off["column"]) == {"ppl", "ppl_ratio"}  # 5% off: outside 1%
    (missing,) = by_point["c"].to_dict("records")
    assert (missing["column"], missing["cpu"], missing["gpu"], missing["ok"]) == (
        "present",
        "True",
        "False",
        "False",
    )
    assert "MISMATCH pca_block_ugs uniform b=4 present" in out


def test_every_side_failing_is_one_error(tmp_path, monkeypatch):
    monkeypatch.setattr(
        runner_check, "start_grid", lambda *a: subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])
    )
    with pytest.raises(SystemExit) as done:
        runner_check.main(["--out", str(tmp_path), "--timeout", "60"])
    assert str(done.value.code).startswith("error: the cpu torch smoke run exited with 2; see")
    assert not (tmp_path / "runner.csv").exists()


def test_each_run_gets_its_share_of_the_cores(tmp_path, monkeypatch):
    """Six runs side by side on 16 cores: two threads each (left to take every core, they starved each other on the
    H200 machine), and the setting reaches the harness command line."""
    seen, start_grid = [], runner_check.start_grid

    def start(run_dir, device, backend, extra, threads):
        seen.append(threads)
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])

    monkeypatch.setattr(runner_check.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(runner_check, "start_grid", start)
    with pytest.raises(SystemExit):
        runner_check.main(["--out", str(tmp_path), "--timeout", "60"])
    assert seen == [2] * 6

    started = []
    monkeypatch.setattr(runner_check.subprocess, "Popen", lambda cmd, **kw: started.append(cmd))
    start_grid(tmp_path / "run", "cuda", "triton", ["sweep.budgets=[5]"], 3)
    assert "threads=3" in started[0] and started[0][-1] == "sweep.budgets=[5]"
