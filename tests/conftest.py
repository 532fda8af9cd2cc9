"""Session-wide test setup: one CPU thread per test process; without CUDA, Triton kernels run in Triton's CPU
interpreter; `cli` runs the project's commands (python -m MODULE) as a new process.

One thread: the tests' tensors are small, and torch's threads meet at barriers after every small operation;
with more threads than free cores (another job, or the test workers beside each other) a tiny sweep ran 5x
slower. OMP_NUM_THREADS=1 reaches the commands the tests start too (harness.io.default_threads reads it).

Triton picks interpreted or compiled builtins when a @triton.jit function is defined, i.e. when triton (and
a module defining kernels) is first imported, and transformers imports triton while test modules are being
collected. pytest loads this file before collecting any test module, so TRITON_INTERPRET is set here,
before anything imports triton (importing torch does not).
"""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts its thread pool
import torch  # noqa: E402

torch.set_num_threads(1)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[1]


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
