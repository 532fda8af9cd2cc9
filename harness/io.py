"""Writing what a run leaves behind: atomic file writes, the disk-cache root, and the environment record.

This module owns every write a reader may catch half-way (point JSONs, results.parquet, timings, disk-cache
tables), and the one record of where a number comes from: `environment()`, written as env.json when a run
starts (git commit and dirty flag, command, package versions, thread count, device). It also owns the rule that
committed results come from a clean tree: a run directory under the repository's results/ is refused from a
dirty tree unless allow_dirty is set, and then the record says so; and the rule that a name that becomes a
folder of a run (run_name, sweep.name) is one plain path component.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import torch

from harness import precision

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")  # the Hydra config folder

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "results"
PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "gguf",
    "hydra-core",
    "pandas",
    "pyarrow",
    "sacrebleu",
    "wandb",
    "triton",
    "numpy",
    # the peer engines (optional): their versions stand beside any figure they made
    "llama-cpp-python",
    "optimum-quanto",
    "hqq",
)
DIRTY_PATHS_SHOWN = 20


# ------------------------------------------------------------------------------------------ atomic writes


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) on a hidden temporary file beside `path`, flush it to disk, then rename it over `path`.

    Readers see the old file or the new one, never half of one (results.load_records skips the hidden
    temporaries). The temporary name carries the pid, so processes writing the same path never share one.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_dir_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) on a hidden temporary folder beside `path`, then rename it to `path`: readers see the
    whole folder or none. When another process got there first, its folder stays and this one is dropped."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(tmp)
        tmp.rename(path)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def write_json_atomic(path: str | Path, obj) -> Path:
    """JSON with indent 1; numpy and torch scalars are written as floats."""
    return write_text_atomic(path, json.dumps(obj, indent=1, default=float))


def write_parquet_atomic(path: str | Path, frame, **kwargs) -> Path:
    return write_atomic(path, lambda tmp: frame.to_parquet(tmp, **kwargs))


def cache_root() -> Path:
    """Where disk caches live: $KVBITS_CACHE, else ~/.cache/kvbits."""
    return Path(os.environ.get("KVBITS_CACHE", Path.home() / ".cache" / "kvbits"))


# -------------------------------------------------------------------------------------------- provenance


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=REPO)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout


def git_state() -> tuple[str | None, list[str]]:
    """(HEAD's commit or None outside a git checkout, paths changed or untracked outside results/).

    Results are outputs, not inputs: a run directory being written under results/ does not make the tree
    dirty, a changed source file, config or test does.
    """
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return None, []
    status = _git("status", "--porcelain", "--untracked-files=all") or ""
    paths = [line[3:].split(" -> ")[-1].strip('"') for line in status.splitlines() if line.strip()]
    return commit.strip(), [p for p in paths if not p.startswith("results/")]


def default_threads() -> int:
    """OMP_NUM_THREADS when it is a positive integer (as torch itself reads it), else every core this process may
    run on."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_threads(value, key: str = "threads") -> int:
    """The thread count a `threads` setting asks for (None: default_threads()); ValueError naming the key
    otherwise."""
    if value is None:
        return default_threads()
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{key}: {value!r} is not allowed; allowed: null (OMP_NUM_THREADS, else every core) or a positive integer"
        )
    return value


def set_threads(value, key: str = "threads") -> int:
    """Apply a `threads` setting with torch.set_num_threads before any work; returns the count applied."""
    count = check_threads(value, key)
    torch.set_num_threads(count)
    return count


def under_results(run_dir: str | Path) -> bool:
    """Whether run_dir lies inside this repository's results/ (where committed results live)."""
    return Path(run_dir).resolve().is_relative_to(RESULTS.resolve())


def check_clean(run_dir: str | Path, allow_dirty, key: str = "allow_dirty") -> None:
    """Refuse (ValueError naming `key`) a run into results/ from a tree with uncommitted changes."""
    if not isinstance(allow_dirty, bool):
        raise ValueError(f"{key}: {allow_dirty!r} is not allowed; allowed: true, false")
    if allow_dirty or not under_results(run_dir):
        return
    _, dirty = git_state()
    if dirty:
        raise ValueError(
            f"{key}: the git tree has {len(dirty)} uncommitted change(s) (e.g. {dirty[0]}) and {run_dir} is under "
            f"results/, where results come from committed code; commit first, or set {key}=true (recorded)"
        )


def check_plain_name(value, key: str) -> str:
    """`value` as the one path component it becomes (run_name, sweep.name: folders under results/): a name with no
    path separator that is not `.` or `..` (an integer reads as its digits); ValueError naming `key` otherwise, so
    a name never leads a run's files out of their folder."""
    name = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(
            f"{key}: {value!r} is not a plain name; allowed: a folder name without / or \\ that is not . or .."
        )
    return name


def check_writable(run_dir: str | Path, key: str = "run_dir") -> None:
    """ValueError naming `key` when run_dir cannot be created and written, found by trying (permission bits
    say nothing for root) in its nearest existing folder, which is left as it was."""
    path = Path(run_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(
            f"{key}: {run_dir} is not writable ({existing} is not a folder); allowed: a writable path"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvbits-probe-", dir=existing))
    except OSError as err:
        raise ValueError(
            f"{key}: {run_dir} is not writable ({err.strerror} in {existing}); allowed: a writable path"
        ) from None


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """--threads and --allow-dirty, the options of every command that writes a result (set_threads, check_clean)."""
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads (torch.set_num_threads); default: OMP_NUM_THREADS, else every core",
    )
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="write into results/ from a git tree with uncommitted changes (recorded in the env record)",
    )


def command_line(program: str, argv: list[str] | None = None) -> str:
    """The command as typed: `program` and its arguments (sys.argv[1:] when argv is None)."""
    return " ".join([program, *(sys.argv[1:] if argv is None else argv)])


def environment(
    command: str, device: str = "cpu", allow_dirty: bool = False, dtype: str | None = None
) -> dict:
    """The record of a run, taken when it starts: command, time, git commit and dirty state, versions,
    thread count (as applied by set_threads), device, and precision: the model dtype (resolved) and whether
    this machine computes bfloat16 natively."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    commit, dirty = git_state()
    return {
        "command": command,
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        # "-dirty" marks a commit that is not what ran (the form readers of older env.json files know)
        "git_commit": None if commit is None else commit + ("-dirty" if dirty else ""),
        "git_dirty": bool(dirty),
        "dirty_paths": dirty[:DIRTY_PATHS_SHOWN],
        "allow_dirty": allow_dirty,
        # a copied tree's commit as its sender named it (the GPU check's HARNESS_COMMIT; its .git may be stale)
        "named_commit": os.environ.get("HARNESS_COMMIT"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        **precision.describe(device),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "packages": versions,
    }


def provenance(env: dict) -> dict:
    """What every result row of a run carries from its env record: the thread count and the commit."""
    return {"threads": env["threads"], "git_commit": env["git_commit"]}


def start_record(
    run_dir: str | Path,
    command: str,
    device: str = "cpu",
    allow_dirty: bool = False,
    dtype: str | None = None,
    config_yaml: str | None = None,
    name: str = "env.json",
) -> dict:
    """What every protocol writes when it starts, before any model loads: run_dir, its config.yaml (when given;
    an earlier start's different config.yaml is kept as config.<n>.yaml) and the environment record
    (write_environment); returns the record."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if config_yaml is not None:
        config = run_dir / "config.yaml"
        if config.exists() and config.read_text() != config_yaml:
            set_aside(config)
        write_text_atomic(config, config_yaml)
    env = environment(command, device, allow_dirty, dtype)
    write_environment(run_dir, env, name)
    return env


def write_environment(folder: str | Path, env: dict, name: str = "env.json") -> Path:
    """Write env as folder/name when a run starts. A record there from an earlier start (a resumed run) with
    another command, commit or thread count is kept as <stem>.<n>.json, so every start stays on record; one with
    the same command, commit and threads is replaced, its start times kept in `earlier_starts`."""
    path = Path(folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except json.JSONDecodeError:
            old = {}
        same = ("command", "git_commit", "threads", "device")
        if any(old.get(k) != env.get(k) for k in same):
            set_aside(path)
        elif "started_at" in old:
            env = {**env, "earlier_starts": [*old.get("earlier_starts", []), old["started_at"]]}
    return write_json_atomic(path, env)


def set_aside(path: Path) -> Path:
    """Move an earlier start's record to <stem>.<n><suffix>, the first n not taken; returns where it went."""
    n = 1
    while (kept := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    os.replace(path, kept)
    return kept
