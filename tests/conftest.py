"""Session-wide test setup: one CPU thread per test process; without CUDA, Triton kernels run in Triton's CPU
interpreter; `cli` runs the project's commands (python -m MODULE) as a new process, `in_process` runs a
command's entry function in the test process (without the 15-30 s a new process spends on its imports),
`interpreted` a command's dry run under the interpreter (in this process where it interprets already).

One thread: the tests' tensors are small, and torch's threads meet at barriers after every small operation;
with more threads than free cores (another job, or the test workers beside each other) a tiny sweep ran 5x
slower. OMP_NUM_THREADS=1 reaches the commands the tests start too (harness.io.default_threads reads it).

Triton picks interpreted or compiled builtins when a @triton.jit function is defined, i.e. when triton (and
a module defining kernels) is first imported, and transformers imports triton while test modules are being
collected. pytest loads this file before collecting any test module, so TRITON_INTERPRET is set here,
before anything imports triton (importing torch does not).
"""

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts its thread pool
import torch  # noqa: E402

torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[1]
# The test files that take longest on the 2-core CPU (40 s to two minutes each: commands run as new processes, Triton's
# interpreter, fits, real models), longest first, as measured (the sum of their tests' times in a full run's junit
# report, 2026-12-02 at 10e02cb). `make test` keeps a file's tests on one worker (--dist loadfile) and hands the files out
# in collection order (--no-loadscope-reorder): these first, so that the short files even out the two workers at the
# end (xdist's own order, most tests first, handed out the 2-minute test_hub 62nd of 81 files).
LONGEST_FIRST = (
    "tests/harness/test_api_schemes.py",
    "tests/kernels/gpu/test_check.py",
    "tests/harness/test_hub.py",
    "tests/harness/test_fused_backend.py",
    "tests/kernels/test_triton_kernels.py",
    "tests/harness/test_report.py",
    "tests/harness/test_sweep.py",
    "tests/harness/test_packed_cache.py",
    "tests/harness/test_peers_llamacpp.py",
    "tests/harness/test_pca.py",
    "tests/harness/test_cache_rows.py",
    "tests/harness/test_slurm.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """LONGEST_FIRST's files first, in its order; the rest after them in collection order (each file's tests
    together, as collected)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def run_module(
    module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`python -m MODULE ARGS` from the repository root, stdout and stderr captured as text; env replaces the
    environment when given (else the process inherits this one's); TimeoutExpired after `timeout` seconds."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def cli():
    """run_module for tests and fixtures of any scope: cli("harness", "+sweep=smoke", ...)."""
    return run_module


def run_in_process(
    entry: Callable[[], object], program: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`entry()` (a command's entry function, e.g. harness.__main__.entry) run in this process as `python -m
    PROGRAM ARGS` runs it: sys.argv is [PROGRAM, *ARGS], env's variables are set on top of this process's,
    stdout and stderr are captured as text, the exit code comes from SystemExit (a message: printed to stderr,
    code 1, as Python does). What a command changes of the process is restored afterwards: sys.argv, the
    environment, torch's thread count (a command applies `threads`) and its random state."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    argv, environ, threads = sys.argv, dict(os.environ), torch.get_num_threads()
    sys.argv = [program, *args]
    os.environ.update(env or {})
    try:
        with (
            torch.random.fork_rng(devices=[]),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            entry()
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) or done.code is None else 1
        if isinstance(done.code, str):
            print(done.code, file=err)
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess([program, *args], code or 0, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def in_process():
    """run_in_process for tests and fixtures of any scope: in_process(harness.__main__.entry, "harness", ...)."""
    return run_in_process


@pytest.fixture(scope="session")
def interpreted():
    """interpreted(entry, MODULE, *ARGS): a command's run under Triton's interpreter (a dry run on CPU): in this
    process where Triton interprets here (no CUDA), else as a new process with TRITON_INTERPRET=1."""

    def run(entry: Callable[[], object], module: str, *args: str) -> subprocess.CompletedProcess[str]:
        if INTERPRET:
            return run_in_process(entry, module, *args)
        return run_module(module, *args, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)

    return run


@pytest.fixture(
    params=[
        pytest.param(
            "cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")
        ),
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available() or INTERPRET, reason="needs CUDA, compiled Triton"
                ),
            ],
        ),
    ]
)
def device(request) -> str:
    """Where a Triton test runs: the CPU interpreter here, a CUDA GPU (tests marked gpu) where there is one."""
    return request.param


@pytest.fixture
def packed():
    """packed(model): `model` attends quantized caches from their packed form until the test ends (then its
    previous attention is back)."""
    from harness.attention import PACKED, installed

    with contextlib.ExitStack() as stack:
        yield lambda model: stack.enter_context(installed(model, PACKED))
