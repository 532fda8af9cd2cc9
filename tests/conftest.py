"""Session-wide test setup: without CUDA, Triton kernels run in Triton's CPU interpreter.

Triton picks interpreted or compiled builtins when a @triton.jit function is defined, i.e. when triton (and
a module defining kernels) is first imported, and transformers imports triton while test modules are being
collected. pytest loads this file before collecting any test module, so TRITON_INTERPRET is set here,
before anything imports triton (importing torch does not).
"""

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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
