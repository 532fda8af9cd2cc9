"""kernels/gpu/e2e.py's profile of decode steps (a dry run: CPU, the interpreter, a two-layer model). The command
runs in the test process where Triton interprets (tests/conftest.py's `interpreted`); kernels/gpu/check.py's dry
run (tests/kernels/gpu/test_check.py) runs it as a new process."""

from __future__ import annotations

import csv

import pytest

from kernels.gpu import e2e


def test_profile_writes_where_the_decode_steps_time_goes(tmp_path, interpreted):
    proc = interpreted(e2e.main, "kernels.gpu.e2e", "--dry-run", "--batch", "1", "--context", "24", "--new-tokens",
                      "3", "--caches", "4", "--profile", "2", "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(tmp_path / "e2e.csv") as f:
        (row,) = csv.DictReader(f)
    # 3 steps, 2 intervals between their logits: tokens/s is the batch over their median
    assert row["cache"] == "4" and 0 < float(row["step_ms_median"]) <= float(row["step_ms_max"])
    assert float(row["tokens_per_s"]) == pytest.approx(1e3 / float(row["step_ms_median"]), rel=1e-3)
    text = (tmp_path / "e2e-profile-4.txt").read_text()
    assert text.startswith("2 decode steps after 27 tokens, batch 1")  # 24 prompt tokens + 3 timed
    device, host = text.split("by self host time:")
    assert "by self device time:" in device
    # the operators of the two profiled steps, with their host times
    assert "aten::" in host and "Self CPU" in host


def test_graph_replayed_decoding_is_timed_step_by_step(tmp_path, interpreted):
    """A "-graph" cache: generate() within graphed_decoding (its steps eager here, without CUDA), timed alike; the
    profile is of model.generate, so none is written for it."""
    proc = interpreted(e2e.main, "kernels.gpu.e2e", "--dry-run", "--batch", "2", "--context", "12", "--new-tokens",
                      "4", "--chunk", "5", "--caches", "mixed-graph", "--profile", "2", "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(tmp_path / "e2e.csv") as f:
        (row,) = csv.DictReader(f)
    assert row["cache"] == "mixed-graph" and row["mean_bits"] == "4"
    assert float(row["tokens_per_s"]) == pytest.approx(2e3 / float(row["step_ms_median"]), rel=1e-3)
    assert float(row["kv_gib"]) > 0 and not (tmp_path / "e2e-profile-mixed-graph.txt").exists()


def test_a_failing_graph_cache_is_noted_and_the_rest_run(tmp_path, monkeypatch):
    """A "-graph" cache that raises (its capture failing on a GPU, say), or a trial cache (pca4, never yet run on a
    GPU), becomes a row with the error in its note; the caches after it still run."""
    from harness.cache import graphed

    def fail(self, ids):
        raise RuntimeError("operation not permitted when stream is capturing")

    def no_fit(model, scheme):
        raise RuntimeError("no fit")

    monkeypatch.setattr(graphed.GraphedStep, "step", fail)
    monkeypatch.setattr(e2e, "pca_fit", no_fit)
    e2e.main(["--dry-run", "--batch", "1", "--context", "10", "--new-tokens", "3", "--caches", "4-graph", "pca4",
              "4", "--out", str(tmp_path)])  # fmt: skip
    with open(tmp_path / "e2e.csv") as f:
        failed, trial, done = csv.DictReader(f)
    assert failed["cache"] == "4-graph" and not failed["tokens_per_s"]
    assert failed["note"] == "error: RuntimeError: operation not permitted when stream is capturing"
    assert trial["cache"] == "pca4" and trial["note"] == "error: RuntimeError: no fit"
    assert done["cache"] == "4" and float(done["tokens_per_s"]) > 0 and not done["note"]


def test_too_few_new_tokens_are_refused(tmp_path, interpreted):
    proc = interpreted(e2e.main, "kernels.gpu.e2e", "--dry-run", "--new-tokens", "2", "--out", str(tmp_path))
    assert proc.returncode == 2 and "--new-tokens: 2 is too few" in proc.stderr
    assert not (tmp_path / "e2e.csv").exists()


def test_the_closest_formats_cache_decodes(tmp_path, interpreted):
    """ugsa4b32 (pca_block32_ugsa at 4 bits, the cache a lease's check times beside `4`): fitted, prefilled and
    decoded through the fused path, holding fewer bytes than DynamicCache even at 43 tokens."""
    proc = interpreted(e2e.main, "kernels.gpu.e2e", "--dry-run", "--batch", "1", "--context", "40", "--new-tokens",
                      "3", "--chunk", "16", "--caches", "ugsa4b32", "dynamic", "--out", str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(tmp_path / "e2e.csv") as f:
        ugsa, dynamic = csv.DictReader(f)
    assert ugsa["cache"] == "ugsa4b32" and ugsa["mean_bits"] == "4" and not ugsa["note"]
    assert float(ugsa["tokens_per_s"]) > 0 and 0 < float(ugsa["kv_gib"]) < float(dynamic["kv_gib"])
