"""Sharded sweeps through Hydra's submitit launchers (sweeps/slurm.yaml), checked against one process.

The configs compose with both submitit launchers; submitit_local runs the smoke grid as local processes;
tests marked `slurm` run it as SLURM jobs on a real one-node cluster (sweeps/localhost-slurm.sh, started
here when it is not running, which needs root; `make test-slurm`), including a job cancelled mid-way with
scancel and the sweep resubmitted. Where the cluster cannot start, those tests fail with the reason.
"""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from harness.__main__ import entry
from harness.protocols.sweep import expand, shard
from harness.report.sweep import main as report_main
from harness.results import CONFIG_FIELDS, METRICS
from harness.validate import validate_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "sweeps" / "localhost-slurm.sh"
SLURM_DIR = Path(os.environ.get("KVBITS_SLURM_DIR", "/tmp/kvbits-slurm"))
# Each job: one CPU, 1 GB; three jobs on the test cluster's CPUs (two run at once on a 2-core machine).
JOB = ["hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10"]
SETTLED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED")


def sweep_args(launcher: str, run_dir: Path, *extra: str) -> list[str]:
    """python -m harness arguments of the smoke grid through sweeps/slurm.yaml into run_dir."""
    return [
        "harness",
        "--config-dir",
        "sweeps",
        "--config-name",
        "slurm",
        f"hydra/launcher={launcher}",
        "+sweep=smoke",
        f"run_name={run_dir.name}",
        f"run_dir={run_dir}",
        *JOB,
        *extra,
        "tracking.wandb.mode=disabled",
    ]


def with_cache(env: dict, run_dir: Path) -> dict:
    """env with a calibration cache of the run's own, so every run computes (and shares) it afresh."""
    return {**env, "KVBITS_CACHE": str(run_dir.parent / f"cache-{run_dir.name}")}


def merged(in_process, run_dir: Path, env: dict) -> pd.DataFrame:
    """Merge the shards with python -m harness.report (run in this process); the table sorted by key."""
    proc = in_process(report_main, "harness.report", str(run_dir), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return pd.read_parquet(run_dir / "results.parquet").sort_values("key").reset_index(drop=True)


def assert_same_rows(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """Same keys, each once, same configuration and the same metrics, bit for bit."""
    assert got["key"].is_unique
    assert got["key"].tolist() == want["key"].tolist()
    cols = ["status", *CONFIG_FIELDS, *[m for m in METRICS if m in want.columns]]
    pd.testing.assert_frame_equal(got[cols], want[cols], check_exact=True)


def point_files(run_dir: Path) -> dict[str, int]:
    """Finished point files (name -> mtime in ns); the runner's hidden temporary files excluded."""
    return {
        p.name: p.stat().st_mtime_ns
        for p in (run_dir / "points").glob("*.json")
        if not p.name.startswith(".")
    }


def smoke_points(num_shards: int) -> list[list[str]]:
    """The point keys each shard of the smoke grid evaluates."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        points = expand(compose("config", overrides=["+sweep=smoke"]))
    return [[p.key() for p in shard(points, i, num_shards)] for i in range(num_shards)]


def compose_sweep(name: str, *overrides: str):
    """The resolved configuration (hydra node included) python -m harness --config-dir sweeps uses."""
    with initialize_config_dir(config_dir=str(ROOT / "sweeps"), version_base="1.3"):
        return compose(
            name,
            overrides=[
                f"hydra.searchpath=[file://{ROOT / 'conf'}]",
                "+sweep=smoke",
                "run_name=x",
                *overrides,
            ],
            return_hydra_config=True,
        )


@pytest.fixture(scope="module")
def single(tmp_path_factory, in_process):
    """The smoke grid in one process (this one): the reference every sharded run must reproduce."""
    run_dir = tmp_path_factory.mktemp("single") / "single"
    proc = in_process(
        entry,
        "harness",
        "+sweep=smoke",
        f"run_dir={run_dir}",
        "tracking.wandb.mode=disabled",
        env=with_cache({}, run_dir),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return pd.read_parquet(run_dir / "results.parquet").sort_values("key").reset_index(drop=True)


def test_slurm_config_composes_with_both_launchers(monkeypatch):
    slurm = compose_sweep(
        "slurm",
        "num_shards=3",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.account=lab",
        "hydra.launcher.timeout_min=30",
        "hydra.launcher.cpus_per_task=2",
        "hydra.launcher.mem_gb=8",
    )
    launcher = slurm.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.partition, launcher.account) == ("gpu", "lab")
    assert (launcher.timeout_min, launcher.cpus_per_task, launcher.mem_gb) == (30, 2, 8)
    assert slurm.hydra.sweeper.params.shard == "range(0,3)"  # num_shards alone sets the job count
    assert launcher.submitit_folder == "results/smoke/x/.jobs/submitit/%j"  # inside the shared run dir

    local = compose_sweep("slurm", "hydra/launcher=submitit_local", "hydra.launcher.mem_gb=8")
    assert local.hydra.launcher._target_.endswith("LocalLauncher")
    assert not {"partition", "account", "additional_parameters"} & set(local.hydra.launcher)
    assert (local.hydra.launcher.mem_gb, local.hydra.launcher.cpus_per_task) == (8, 4)
    assert local.hydra.sweeper.params.shard == "range(0,4)"

    joblib = compose_sweep("local", "num_shards=3")
    assert joblib.hydra.launcher._target_.endswith("JoblibLauncher")
    assert joblib.hydra.sweeper.params.shard == "range(0,3)"

    # slurm_gpu's jobs validate on their GPU node (device=cuda): a machine with one CUDA device here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for launcher in ("slurm_cluster", "submitit_local"):
        gpu = compose_sweep("slurm_gpu", f"hydra/launcher={launcher}")
        assert gpu.hydra.launcher.gpus_per_node == 1
        assert (gpu.quant.backend, gpu.device) == ("triton", "cuda")
        assert len(validate_config(gpu)) == len(smoke_points(1)[0])  # every point storable by the kernels
        assert gpu.run_dir == "results/smoke/x"


def test_submitit_local_shards_match_single_run(single, tmp_path, cli, in_process):
    run_dir = tmp_path / "local"
    env = with_cache(os.environ, run_dir)
    proc = cli(*sweep_args("submitit_local", run_dir, "num_shards=2"), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run_dir / "env.shard0.json").exists() and (run_dir / "env.shard1.json").exists()
    assert_same_rows(merged(in_process, run_dir, env), single)


# ---- a real SLURM cluster ----


@pytest.fixture(scope="module")
def cluster():
    """The environment that talks to the one-node cluster of sweeps/localhost-slurm.sh.

    Uses the cluster under $KVBITS_SLURM_DIR when it answers, else starts it (and stops it afterwards).
    """
    env = {**os.environ, "SLURM_CONF": str(SLURM_DIR / "etc" / "slurm.conf")}
    started = False
    if not _answers(env):
        proc = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.fail(f"SLURM did not start ({SCRIPT.name} start): {proc.stderr.strip()}", pytrace=False)
        started = True
        if not _answers(env):
            pytest.fail(f"SLURM started but does not answer: {_squeue(env)}", pytrace=False)
    yield env
    if started:
        subprocess.run([str(SCRIPT), "stop"], capture_output=True, timeout=300)


def _answers(env: dict) -> bool:
    try:
        proc = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and "UP" in proc.stdout


def _squeue(env: dict) -> str:
    proc = subprocess.run(["squeue"], env=env, capture_output=True, text=True, timeout=30)
    return (proc.stdout + proc.stderr).strip()


def array_id(run_dir: Path) -> str | None:
    """The SLURM array job id of the run's latest submission (submitit names a folder after it)."""
    scripts = sorted(
        (run_dir / ".jobs" / "submitit").glob("*/*_submission.sh"), key=lambda p: p.stat().st_mtime
    )
    return scripts[-1].parent.name if scripts else None


def accounting(job: str, env: dict) -> dict[str, dict]:
    """sacct's record of every task of an array job: task id -> State, Partition, Account, CPUs, time limit."""
    fields = "JobID,State,Partition,Account,AllocCPUS,Timelimit,ReqMem"
    proc = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", job, "-o", fields],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows = [dict(zip(fields.split(","), line.split("|"))) for line in proc.stdout.splitlines() if line]
    return {r["JobID"]: r for r in rows}


def settle(job: str, env: dict, count: int, timeout: float = 600) -> dict[str, dict]:
    """Wait until all `count` tasks of the array have ended; their accounting records."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        tasks = accounting(job, env)
        if len(tasks) == count and all(t["State"].split()[0] in SETTLED for t in tasks.values()):
            return tasks
        time.sleep(1)
    raise AssertionError(f"array {job} did not end in {timeout}s: {accounting(job, env)}\n{_squeue(env)}")


def wait_until(check, timeout: float = 60) -> bool:
    deadline = time.time() + timeout
    while not check():
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


def stopped_pids(task: str, env: dict) -> list[int]:
    """The processes of a suspended job (scontrol listpids), once every one of them has stopped."""
    job = subprocess.run(
        ["squeue", "-h", "-j", task, "-o", "%A"], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    out = subprocess.run(["scontrol", "listpids", job], env=env, capture_output=True, text=True, check=True)
    pids = [int(line.split()[0]) for line in out.stdout.splitlines()[1:] if line.strip()]
    assert pids, f"no processes for {task}: {out.stdout}"

    def state(pid: int) -> str:  # /proc/PID/stat: "pid (comm) STATE ..."; gone counts as stopped
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return "T"

    assert wait_until(lambda: all(state(p) == "T" for p in pids)), {p: state(p) for p in pids}
    return pids


def run_id() -> str:
    """A run name no earlier test session used (the cluster's accounting keeps old jobs)."""
    return f"slurm-{uuid.uuid4().hex[:8]}"


@pytest.mark.slurm
def test_three_slurm_jobs_match_single_run(cluster, single, tmp_path, cli, in_process):
    run_dir = tmp_path / run_id()
    env = with_cache(cluster, run_dir)
    args = sweep_args(
        "slurm_cluster",
        run_dir,
        "num_shards=3",
        "hydra.launcher.partition=local",
        "hydra.launcher.account=root",
    )
    proc = cli(*args, env=env, timeout=600)
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{_squeue(env)}"
    job = array_id(run_dir)
    tasks = settle(job, env, 3)
    assert sorted(tasks) == [f"{job}_{i}" for i in range(3)]  # three SLURM jobs, one per shard
    for t in tasks.values():  # the overrides reached sbatch: partition, account, CPUs, time limit, memory
        assert (t["State"], t["Partition"], t["Account"]) == ("COMPLETED", "local", "root"), t
        assert (t["AllocCPUS"], t["Timelimit"], t["ReqMem"]) == ("1", "00:10:00", "1G"), t
    for i in range(3):
        env_record = json.loads((run_dir / f"env.shard{i}.json").read_text())
        assert env_record["command"].startswith("python -m")
        assert (run_dir / ".jobs" / "submitit" / f"{job}_{i}" / f"{job}_{i}_0_result.pkl").exists()
    assert_same_rows(merged(in_process, run_dir, env), single)


@pytest.mark.slurm
def test_cancelled_job_then_resubmitted_sweep_runs_every_point_once(
    cluster, single, tmp_path, cli, in_process
):
    run_dir = tmp_path / run_id()
    env = with_cache(cluster, run_dir)
    args = sweep_args("slurm_cluster", run_dir, "num_shards=3")
    shard0 = smoke_points(3)[0]
    assert len(shard0) >= 2  # so that the job can be caught between two points
    submitter = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 600
        job = None
        while time.time() < deadline and submitter.poll() is None:  # shard 0 mid-way: >= 1 point written
            job = job or array_id(run_dir)
            if job and any(f"{k}.json" in point_files(run_dir) for k in shard0):
                break
            time.sleep(0.05)
        assert job is not None and submitter.poll() is None, f"no job to cancel\n{_squeue(env)}"
        # Suspended first (every process of the job stopped), so the check below sees the job between two
        # points; then cancelled: SLURM kills a suspended job outright (a running one gets SIGTERM, which
        # submitit ignores, and runs on until KillWait ends).
        subprocess.run(["scontrol", "suspend", f"{job}_0"], env=env, check=True, timeout=60)
        pids = stopped_pids(f"{job}_0", env)
        frozen = point_files(run_dir)
        assert 0 < sum(f"{k}.json" in frozen for k in shard0) < len(shard0), "shard 0 is not mid-way"
        subprocess.run(["scancel", f"{job}_0"], env=env, check=True, timeout=60)
        _, err = submitter.communicate(timeout=600)
    finally:
        if submitter.poll() is None:
            submitter.kill()
    assert submitter.returncode != 0, err[-2000:]  # the launcher reports the cancelled job
    tasks = settle(job, env, 3)
    assert tasks[f"{job}_0"]["State"].startswith("CANCELLED"), tasks
    assert {tasks[f"{job}_{i}"]["State"] for i in (1, 2)} == {"COMPLETED"}, tasks

    assert wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in pids)), f"left running: {pids}"
    done = point_files(run_dir)
    assert [k for k in shard0 if f"{k}.json" in done] == [k for k in shard0 if f"{k}.json" in frozen]
    partial = pd.read_parquet(run_dir / "results.parquet")  # readable after the cancel
    assert partial["key"].is_unique and len(partial) < len(single)

    proc = cli(*args, env=env, timeout=600)  # the same sweep resubmitted: finished points are skipped
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{_squeue(env)}"
    assert all(t["State"] == "COMPLETED" for t in settle(array_id(run_dir), env, 3).values())
    assert_same_rows(merged(in_process, run_dir, env), single)  # every point exactly once
    after = point_files(run_dir)
    assert {name: after[name] for name in done} == done  # finished points were not recomputed
    assert len(after) == len(single)
