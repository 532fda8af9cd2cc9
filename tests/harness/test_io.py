"""harness.io: atomic writes, the environment record, the clean-tree rule for results/, writable run dirs."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness import io


def test_atomic_write_replaces_whole_or_leaves_the_old_file(tmp_path):
    path = tmp_path / "point.json"
    io.write_json_atomic(path, {"a": torch.tensor(1.5).item(), "b": [1, 2]})
    assert json.loads(path.read_text()) == {"a": 1.5, "b": [1, 2]}

    def broken(tmp: Path) -> None:
        tmp.write_text('{"half": ')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        io.write_atomic(path, broken)
    assert json.loads(path.read_text()) == {"a": 1.5, "b": [1, 2]}  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["point.json"]  # no temporary left behind


@given(st.one_of(st.none(), st.integers(-3, 64), st.booleans(), st.text(max_size=3), st.floats(0, 8)))
def test_threads_setting_is_a_positive_integer_or_every_core(value):
    if value is None:
        assert io.check_threads(value) == io.default_threads() >= 1
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        assert io.check_threads(value) == value
    else:
        with pytest.raises(
            ValueError, match=r"^threads: .* allowed: null \(OMP_NUM_THREADS, else every core\) or a positive"
        ):
            io.check_threads(value)


@pytest.mark.parametrize(
    "omp, expected", [("3", 3), ("1", 1), (None, "cores"), ("0", "cores"), ("x", "cores")]
)
def test_null_threads_follow_omp_num_threads_else_every_core(monkeypatch, omp, expected):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    cores = len(os.sched_getaffinity(0))
    assert io.check_threads(None) == (cores if expected == "cores" else expected)


def test_set_threads_applies_the_count():
    before = torch.get_num_threads()
    try:
        assert io.set_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_environment_records_what_ran_and_resumes_keep_earlier_records(tmp_path):
    env = io.environment("python -m harness x=1", "cpu", allow_dirty=True)
    assert env["command"] == "python -m harness x=1" and env["threads"] == torch.get_num_threads()
    assert env["allow_dirty"] is True and isinstance(env["git_dirty"], bool) and env["packages"]["torch"]
    assert env["git_commit"] is None or env["git_commit"].endswith("-dirty") == env["git_dirty"]
    assert io.provenance(env) == {"threads": env["threads"], "git_commit": env["git_commit"]}
    io.write_environment(tmp_path, env)
    io.write_environment(tmp_path, {**env, "started_at": "later"})  # same run again: one record
    io.write_environment(tmp_path, {**env, "started_at": "latest"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.json"]
    record = json.loads((tmp_path / "env.json").read_text())
    assert record["started_at"] == "latest" and record["earlier_starts"] == [env["started_at"], "later"]
    io.write_environment(tmp_path, {**env, "threads": env["threads"] + 1})  # resumed elsewhere: both kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.1.json", "env.json"]
    assert json.loads((tmp_path / "env.1.json").read_text())["threads"] == env["threads"]
    assert json.loads((tmp_path / "env.json").read_text())["threads"] == env["threads"] + 1


def test_a_start_with_other_overrides_keeps_the_earlier_config(tmp_path):
    io.start_record(tmp_path, "python -m harness shard=0", allow_dirty=True, config_yaml="shard: 0\n")
    io.start_record(tmp_path, "python -m harness shard=0", allow_dirty=True, config_yaml="shard: 0\n")
    assert not (tmp_path / "config.1.yaml").exists()  # the same start again: one record
    io.start_record(tmp_path, "python -m harness shard=1", allow_dirty=True, config_yaml="shard: 1\n")
    io.start_record(tmp_path, "python -m harness shard=2", allow_dirty=True, config_yaml="shard: 2\n")
    assert (tmp_path / "config.1.yaml").read_text() == "shard: 0\n"
    assert (tmp_path / "config.2.yaml").read_text() == "shard: 1\n"
    assert (tmp_path / "config.yaml").read_text() == "shard: 2\n"


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A committed git repository standing in for this one (io.REPO / io.RESULTS point at it)."""
    repo = tmp_path / "repo"
    (repo / "harness").mkdir(parents=True)
    (repo / "harness" / "a.py").write_text("x = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    monkeypatch.setattr(io, "REPO", repo)
    monkeypatch.setattr(io, "RESULTS", repo / "results")
    return repo


def test_a_dirty_tree_may_not_write_into_results(repo):
    run_dir = repo / "results" / "pareto" / "run"
    (repo / "results" / "pareto" / "old").mkdir(parents=True)
    (repo / "results" / "pareto" / "old" / "points.json").write_text("{}")  # outputs are not inputs
    commit, dirty = io.git_state()
    assert len(commit) == 40 and dirty == []
    io.check_clean(run_dir, allow_dirty=False)

    (repo / "harness" / "a.py").write_text("x = 2\n")  # a changed source file
    (repo / "harness" / "new.py").write_text("")  # and an untracked one
    assert sorted(io.git_state()[1]) == ["harness/a.py", "harness/new.py"]
    with pytest.raises(ValueError, match=r"^allow_dirty: the git tree has 2 uncommitted change\(s\)") as err:
        io.check_clean(run_dir, allow_dirty=False)
    assert "\n" not in str(err.value)
    io.check_clean(run_dir, allow_dirty=True)  # allowed, and then recorded
    io.check_clean(repo.parent / "elsewhere", allow_dirty=False)  # outside results/: not refused
    env = io.environment("cmd", allow_dirty=True)
    assert env["git_dirty"] and env["git_commit"] == commit + "-dirty"
    assert sorted(env["dirty_paths"]) == ["harness/a.py", "harness/new.py"]
    with pytest.raises(ValueError, match=r"^allow_dirty: 'yes' is not allowed; allowed: true, false"):
        io.check_clean(run_dir, allow_dirty="yes")


def test_run_dir_must_be_writable_and_the_probe_leaves_nothing(tmp_path):
    io.check_writable(tmp_path / "new" / "deeper")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"^run_dir: .*file/run is not writable \(.*file is not a folder\)"):
        io.check_writable(tmp_path / "file" / "run")
    with pytest.raises(ValueError, match=r"^run_dir: /proc/nope is not writable"):
        io.check_writable("/proc/nope")


def test_atomic_folder_appears_whole_and_a_folder_saved_first_stays(tmp_path):
    def save(words: str):
        def write(tmp: Path) -> None:
            for i, word in enumerate(words.split()):
                (tmp / f"{i}.txt").write_text(word)

        return write

    target = tmp_path / "cache" / "tokenizer"
    io.write_dir_atomic(target, save("a b c"))
    assert sorted(p.read_text() for p in target.iterdir()) == ["a", "b", "c"]
    io.write_dir_atomic(target, save("x y"))  # another process saved it first: its folder stays whole
    assert sorted(p.read_text() for p in target.iterdir()) == ["a", "b", "c"]
    assert [p.name for p in target.parent.iterdir()] == ["tokenizer"]  # no temporary folder left


def test_environment_records_the_commit_a_copied_tree_was_named(monkeypatch):
    monkeypatch.delenv("HARNESS_COMMIT", raising=False)
    assert io.environment("cmd", allow_dirty=True)["named_commit"] is None
    monkeypatch.setenv("HARNESS_COMMIT", "5317e84")
    env = io.environment("cmd", allow_dirty=True)
    assert env["named_commit"] == "5317e84" and "git_commit" in env  # beside what the tree's .git says
