"""harness.run.kept_baseline: a baseline kept on disk is read back whole and bit for bit, under a key that changes
with what its figures depend on, and an unfinished one is computed again."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from harness import evaluate
from harness.config import base_point, compose
from harness.models import load_model
from harness.run import context, kept_baseline
from harness.run.kept_baseline import LOGPROBS, SCORES, baseline_folder


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-llama")[0]  # the registry's tiny random Llama, as the context test's points use


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    return tmp_path


def tokens(rows: int, cols: int, seed: int) -> torch.Tensor:
    vocabulary = 256  # tiny-llama's byte tokens
    return torch.randint(
        0, vocabulary, (rows, cols), generator=torch.Generator().manual_seed(seed)
    )  # (rows, cols)


def test_a_second_start_reads_the_first_ones_baseline_without_running_the_model(model, monkeypatch) -> None:
    sequences = tokens(3, 29, seed=1)
    direct = evaluate.teacher_forced(model, sequences, DynamicCache, chunk=7, batch_size=2, score_from=9)
    first, kept = kept_baseline.kept_baseline(model, "tiny", sequences, 7, 2, 9)
    assert not kept
    folder = baseline_folder(model, "tiny", sequences, 7, 2, 9)
    assert sorted(p.name for p in folder.iterdir()) == [LOGPROBS, SCORES]  # no temporary left
    monkeypatch.setattr(evaluate, "teacher_forced", lambda *a, **k: pytest.fail("the model ran again"))
    second, kept = kept_baseline.kept_baseline(model, "tiny", sequences, 7, 2, 9)
    assert kept
    for run in (first, second):
        for name in ("targets", "nll", "top1", "logprobs"):
            assert torch.equal(getattr(run, name), getattr(direct, name)), name
    assert second.logprobs.shape == (3, 20, model.config.vocab_size) and second.kl is None
    # mapped read-only and shared: a copy-on-write map counts every page against memory (refused at gemma3's 34 GB)
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    permissions = {fields[1] for fields in maps if fields[-1] == str(folder / LOGPROBS)}
    # first's map of the file it wrote is rw-s: shared too
    assert "r--s" in permissions and not any(p.endswith("p") for p in permissions), permissions


def test_the_key_changes_with_what_the_figures_depend_on(model) -> None:
    sequences = tokens(2, 17, seed=2)
    other = sequences.clone()
    other[1, 5] = (other[1, 5] + 1) % model.config.vocab_size
    base = baseline_folder(model, "tiny", sequences, 4, 1, 0)
    assert baseline_folder(model, "tiny", sequences.clone(), 4, 1, 0) == base
    changed = [
        baseline_folder(model, "tiny", other, 4, 1, 0),
        baseline_folder(model, "tiny", sequences, 5, 1, 0),
        baseline_folder(model, "tiny", sequences, 4, 2, 0),
        baseline_folder(model, "tiny", sequences, 4, 1, 3),
        baseline_folder(model, "other", sequences, 4, 1, 0),
        baseline_folder(model.to(torch.bfloat16), "tiny", sequences, 4, 1, 0),
    ]
    model.float()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        changed.append(baseline_folder(model, "tiny", sequences, 4, 1, 0))
    finally:
        torch.set_num_threads(threads)
    assert len({base, *changed}) == len(changed) + 1


def test_an_unfinished_baseline_is_computed_again_and_a_dead_starts_file_dropped(model) -> None:
    sequences = tokens(2, 19, seed=4)
    folder = baseline_folder(model, "tiny", sequences, 6, 1, 0)
    folder.mkdir(parents=True)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = folder / f".{LOGPROBS}.tmp{int(dead.stdout)}"
    alive = folder / f".{LOGPROBS}.tmp{os.getppid()}"  # another start still writing
    stale.write_bytes(b"half")
    alive.write_bytes(b"half")
    (folder / LOGPROBS).write_bytes(b"from a start stopped before its scores")
    run, kept = kept_baseline.kept_baseline(model, "tiny", sequences, 6, 1, 0)
    direct = evaluate.teacher_forced(model, sequences, DynamicCache, chunk=6)
    assert not kept and torch.equal(run.logprobs, direct.logprobs)
    assert not stale.exists() and alive.exists()
    assert evaluate.file_tensor(folder / LOGPROBS, tuple(direct.logprobs.shape), "c").equal(direct.logprobs)


def test_the_context_keeps_a_baseline_over_the_memory_rule_and_reads_it_at_the_next_start(
    tmp_path, monkeypatch
) -> None:
    point = base_point(compose(["model=tiny-llama", "eval=tiny"]))
    monkeypatch.setattr(context, "LOGPROBS_IN_MEMORY", 0)
    (tmp_path / "run").mkdir()
    first = context.build_context(point, 2, "cpu", tmp_path / "run")
    second = context.build_context(point, 2, "cpu", tmp_path / "run")
    assert first.timings["baseline_kept"] is False and second.timings["baseline_kept"] is True
    assert torch.equal(first.base_tf.logprobs, second.base_tf.logprobs)
    assert torch.equal(first.base_tf.nll, second.base_tf.nll)
    monkeypatch.setattr(context, "LOGPROBS_IN_MEMORY", 1 << 40)
    memory = context.build_context(point, 2, "cpu", tmp_path / "run")
    assert "baseline_kept" not in memory.timings and torch.equal(
        memory.base_tf.logprobs, first.base_tf.logprobs
    )
