"""kernels/interpret.py: under Triton's interpreter a launch patches triton.language once, however many helper
calls its kernel makes, computes what it computed before, and leaves triton.language as it found it."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's CPU interpreter")


@triton.jit
def _scaled(x, scale):
    return x * scale + 1.0


@triton.jit
def _helper_loop_kernel(src, dst, n, CALLS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=0.0)
    for _ in tl.static_range(CALLS):
        x = _scaled(x, 0.5)
    tl.store(dst + offs, x, mask=offs < n)


def _launch(calls: int, n: int) -> torch.Tensor:
    src = torch.randn(n)
    dst = torch.full((n,), float("nan"))
    _helper_loop_kernel[(triton.cdiv(n, 16),)](src, dst, n, CALLS=calls, BLOCK=16)
    want = src.clone()
    for _ in range(calls):
        want = want * 0.5 + 1.0
    torch.testing.assert_close(dst, want)
    return dst


def test_a_launch_patches_the_language_once_whatever_its_helper_calls(monkeypatch):
    from triton.runtime import interpreter

    import kernels  # noqa: F401 - installs the skip under TRITON_INTERPRET=1
    from kernels import interpret

    assert interpret.install()  # installed when kernels was imported: a second install changes nothing
    walks = []
    upstream = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: walks.append(1) or upstream(*a))
    counts = []
    for calls in (1, 9):
        walks.clear()
        _launch(calls, n=37)  # three programs, each calling the helper `calls` times
        counts.append(len(walks))
    assert counts[0] == counts[1] > 0, counts  # the kernel's own patch only
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.tensor.__add__)  # restored after the launch
