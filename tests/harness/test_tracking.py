"""harness.tracking: what the offline runs hold (read back from their .wandb transaction logs), where W&B
writes, and that a failing or missing wandb costs one warning and nothing else."""

from __future__ import annotations

import json
import struct
import sys
import warnings
import zlib
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

from harness.config import Point
from harness.tracking import Tracker, run_name, sync_command

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

BASE = {
    "model": "tiny-gpt2", "budget": 3, "alpha": 0.5, "sink_threshold": None, "sink_fraction": None,
    "widths": [2, 4, 8], "budget_mode": "mean", "entropy_key": "H2", "scheme": "asym_token", "group_size": 32,
    "prefill": "quantized", "num_prompts": 4, "prompt_tokens": 16, "new_tokens": 8, "num_sequences": 2,
    "sequence_tokens": 32, "chunk": 16, "calibration_sequences": 2, "calibration_tokens": 32, "i0": 4,
    "data_path": "data/wiki.txt", "seed": 0,
}  # fmt: skip
POINTS = [
    (Point.from_dict({**BASE, "policy": "uniform", "alpha": 0.0}), {"status": "ok", "metrics": {"ppl": 12.25, "bleu": 87.5, "n_sinks": 0}}),
    (Point.from_dict({**BASE, "policy": "entropy", "sink_threshold": 0.9}), {"status": "ok", "metrics": {"ppl": 11.75, "bleu": 91.0}}),
    (Point.from_dict({**BASE, "policy": "sinks", "budget": 2, "alpha": 0.0, "sink_fraction": 0.5}),
     {"status": "infeasible", "error": "budget 2 cannot pay for 50% sinks"}),
]  # fmt: skip


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_DATA_DIR", "WANDB_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)


# --- reading an offline run back -------------------------------------------------------------------------
# A .wandb file is a LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks
# of chunks, each `crc32 (seeded with the chunk type byte), length, type` + payload; a record larger than
# what is left of a block is split into FIRST/MIDDLE/LAST chunks. Each record is a wandb_internal.Record.
BLOCK, CHUNK_HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    records, parts, pos = [], b"", 7
    while pos + CHUNK_HEADER <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER:  # block tail too short for a chunk header: zero padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        payload = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind == 0:  # preallocated zeros at the end of the file
            continue
        assert crc == zlib.crc32(payload, zlib.crc32(bytes([kind]))), f"bad chunk checksum in {path}"
        parts = payload if kind in (FULL, FIRST) else parts + payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
    return records


def read_run(run_dir: Path) -> dict:
    """A run's identity, config, final summary, artifacts and exit code, as its transaction log has them."""
    (log,) = run_dir.glob("run-*.wandb")
    run: dict = {"dir": run_dir, "summary": {}, "artifacts": [], "exit_code": None}
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run |= {
                "group": r.run_group,
                "job_type": r.job_type,
                "name": r.display_name,
                "project": r.project,
            }
            run["config"] = {u.key: json.loads(u.value_json) for u in r.config.update if u.key != "_wandb"}
        elif kind == "summary":
            for u in record.summary.update:
                run["summary"][".".join(u.nested_key) or u.key] = json.loads(u.value_json)
        elif kind == "artifact":
            run["artifacts"].append(record.artifact)
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def read_runs(run_dir: Path) -> dict[str, dict]:
    """Every offline run under run_dir/wandb, by job type + name (unique in these tests)."""
    runs = [read_run(d) for d in sorted((run_dir / "wandb").glob("offline-run-*"))]
    return {f"{r['job_type']}/{r['name']}": r for r in runs}


# --- tests -----------------------------------------------------------------------------------------------
def plot(path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    fig.savefig(path)
    plt.close(fig)
    return path


def table() -> pd.DataFrame:
    frame = pd.DataFrame(
        [{"key": p.key(), "status": r["status"], **p.to_dict(), "widths": json.dumps(p.widths), **r.get("metrics", {})}
         for p, r in POINTS]
    )  # fmt: skip
    # A nullable column as harness.results gives one: NA where a point has no measurement (infeasible)
    frame["simulate"] = pd.array(
        [False if r["status"] == "ok" else pd.NA for _, r in POINTS], dtype="boolean"
    )
    return frame


def test_offline_runs_hold_points_and_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fresh wandb-core service (none left from other tests) and an empty HOME: nothing may land outside run_dir.
    wandb.teardown()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME"):
        monkeypatch.delenv(var, raising=False)
    run_dir = tmp_path / "run"
    images = {"pareto_ppl": plot(tmp_path / "pareto.png"), "entropy": plot(tmp_path / "entropy.png")}

    tracker = Tracker("offline", run_dir=run_dir, group="pareto-test")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a swallowed wandb failure would fail the test here
        for point, record in POINTS:
            tracker.log_point(point, record)
        tracker.finish(table(), images)

    assert sorted(p.name for p in run_dir.iterdir()) == ["wandb"]
    assert [str(p.relative_to(home)) for p in home.rglob("*")] == []
    runs = read_runs(run_dir)
    assert len(runs) == len(POINTS) + 1
    for point, record in POINTS:
        run = runs[f"{point.policy}/{run_name(point)}"]
        assert (run["group"], run["project"], run["exit_code"]) == ("pareto-test", "kv-bits", 0)
        assert run["config"] == point.to_dict()
        expected = {"status": record["status"], "key": point.key()}
        if record["status"] == "ok":
            expected |= record["metrics"]
        else:
            expected["error"] = record["error"]
            assert not set(run["summary"]) & {"ppl", "bleu"}
        assert {k: run["summary"][k] for k in expected} == expected

    summary = runs["summary/pareto-test summary"]
    assert (summary["group"], summary["exit_code"], summary["config"]) == ("pareto-test", 0, {"points": 3})
    assert summary["summary"]["results.nrows"] == len(POINTS)
    (artifact,) = [a for a in summary["artifacts"] if a.type == "run_table"]
    (entry,) = artifact.manifest.contents
    staged = Path(entry.local_path)  # what `wandb sync` uploads the table from: must survive in run_dir
    assert staged.is_relative_to(run_dir / "wandb") and staged.exists()
    rows = json.loads(staged.read_text())
    assert len(rows["data"]) == len(POINTS)
    assert rows["data"][1][rows["columns"].index("ppl")] == 11.75
    simulate = [row[rows["columns"].index("simulate")] for row in rows["data"]]
    assert simulate == [False if r["status"] == "ok" else None for _, r in POINTS]
    for name in images:
        assert summary["summary"][f"{name}._type"] == "image-file"
        assert (summary["dir"] / "files" / summary["summary"][f"{name}.path"]).exists()


def test_sync_command_names_the_offline_runs(tmp_path: Path) -> None:
    assert sync_command(tmp_path / "run") == f"wandb sync {tmp_path}/run/wandb/offline-run-*"


def test_failing_init_warns_once_then_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def broken_init(*args: object, **kwargs: object) -> None:
        calls.append(kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(wandb, "init", broken_init)
    tracker = Tracker("offline", run_dir=tmp_path, group="g")
    with pytest.warns(RuntimeWarning, match="logging a point failed.*No space left") as caught:
        for point, record in POINTS:
            tracker.log_point(point, record)
        tracker.finish(table(), {})
    assert len(caught) == 1 and len(calls) == 1
    assert not tracker.enabled


def test_error_inside_a_run_warns_and_finishes_it(tmp_path: Path) -> None:
    # An image that cannot be read (wandb raises inside the summary run): the table already logged survives.
    wandb.teardown()
    tracker = Tracker("offline", run_dir=tmp_path, group="g")
    with pytest.warns(RuntimeWarning, match="writing the summary run failed") as caught:
        tracker.finish(table(), {"pareto": tmp_path / "missing.png"})
    assert len(caught) == 1 and not tracker.enabled
    wandb.teardown()  # finish() did not get to it
    (run,) = read_runs(tmp_path).values()
    assert run["exit_code"] != 0 and run["summary"]["results.nrows"] == len(POINTS)


def test_missing_wandb_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    tracker = Tracker("offline", run_dir=tmp_path, group="g")
    with pytest.warns(RuntimeWarning, match="import of wandb") as caught:
        tracker.log_point(*POINTS[0])
        tracker.log_point(*POINTS[1])
    assert len(caught) == 1 and not tracker.enabled


def test_disabled_never_imports_wandb_nor_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # any import attempt would warn
    tracker = Tracker("disabled", run_dir=tmp_path, group="g")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for point, record in POINTS:
            tracker.log_point(point, record)
        tracker.finish(table(), {"pareto": tmp_path / "missing.png"})
    assert list(tmp_path.iterdir()) == []


def test_unknown_mode_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="allowed: online, offline, disabled"):
        Tracker("sometimes", run_dir=tmp_path, group="g")
