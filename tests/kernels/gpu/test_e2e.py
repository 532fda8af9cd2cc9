"""kernels/gpu/e2e.py's profile of decode steps (a dry run: CPU, the interpreter, a two-layer model)."""

from __future__ import annotations

import csv
import os


def test_profile_writes_where_the_decode_steps_time_goes(tmp_path, cli):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = cli("kernels.gpu.e2e", "--dry-run", "--batch", "1", "--context", "24", "--new-tokens", "2",
               "--caches", "4", "--profile", "2", "--out", str(tmp_path), env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(tmp_path / "e2e.csv") as f:
        assert [r["cache"] for r in csv.DictReader(f)] == ["4"]
    text = (tmp_path / "e2e-profile-4.txt").read_text()
    assert text.startswith("2 decode steps after 26 tokens, batch 1")  # 24 prompt tokens + 2 timed
    device, host = text.split("by self host time:")
    assert "by self device time:" in device
    # the operators of the two profiled steps, with their host times
    assert "aten::" in host and "Self CPU" in host
