"""harness/bench/perf_ab.py: versions of the CPU read path timed side by side in one process."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from harness.bench import perf_ab

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "kernels" / "packed_attention.py"


def test_every_version_is_timed_per_call_and_per_step(tmp_path, cli):
    other = tmp_path / "candidate.py"
    shutil.copy(KERNEL, other)
    proc = cli("harness.bench.perf_ab", str(KERNEL), str(other), "--model", "tiny-llama", "--batch", "2",
               "--contexts", "40", "--steps", "2", "--repeats", "3", "--threads", "1", timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if re.match(r"\s+40 (call|step) ", line)]
    assert len(lines) == 4  # 2 versions x (call, step)
    for kind in ("call", "step"):
        names = {line.split()[2] for line in lines if line.split()[1] == kind}
        assert names == {"packed_attention", "candidate"}
    assert all(float(line.split()[4]) > 0 for line in lines)


def test_a_version_that_computes_another_attention_is_refused(tmp_path, cli):
    wrong = tmp_path / "wrong.py"
    wrong.write_text(KERNEL.read_text() + "\n_right = packed_attention\n\n\ndef packed_attention(*a, **k):\n"
                     "    return _right(*a, **k) * 2\n")  # fmt: skip
    proc = cli("harness.bench.perf_ab", str(KERNEL), str(wrong), "--model", "tiny-llama", "--batch", "2",
               "--contexts", "40", "--steps", "1", "--repeats", "1", "--threads", "1", timeout=600)  # fmt: skip
    assert proc.returncode == 1 and "wrong computes another attention than packed_attention" in proc.stderr


def test_bad_arguments_stop_before_the_model_loads(tmp_path, in_process):
    """The command's entry run in this process (the tests above run it as a new process)."""
    proc = in_process(
        perf_ab.main, "harness.bench.perf_ab", str(KERNEL), str(KERNEL), "--model", "tiny-llama"
    )
    assert proc.returncode == 2 and "files: two files share a name" in proc.stderr
    proc = in_process(
        perf_ab.main, "harness.bench.perf_ab", str(KERNEL), "--steps", "0", "--model", "tiny-llama"
    )
    assert proc.returncode == 2 and "--steps: 0 is not allowed" in proc.stderr
