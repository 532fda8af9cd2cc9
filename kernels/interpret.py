"""Faster kernels under Triton's CPU interpreter (TRITON_INTERPRET=1): the dry runs and the tests on CPU.

The interpreter swaps triton.language's builtins for interpreted ones when a kernel launches (`_patch_lang`, undone
when the launch ends), and again at every call of a @triton.jit helper inside it: a walk over every member of
triton.language, about 1.5 ms a call and a quarter of an interpreted decode step (the kernels call their unpacking
and dequantizing helpers once a tile). That second patch changes nothing where the helper sees no other
triton.language modules than the kernel did (their builtins are swapped already; what it sets again it sets to
the same functions), so `install` skips it there and leaves every other call to Triton. Nothing changes what a
kernel computes; outside the interpreter nothing is installed.
"""

from __future__ import annotations

import functools
import inspect

import triton.language as tl
from triton.runtime import interpreter

_LANGS = (tl, tl.core)
_PENDING = frozenset({-1})  # a launch has begun and its kernel's own patch is next


@functools.cache
def _langs(fn) -> frozenset[int]:
    """The triton.language modules fn's globals hold (those `_patch_lang` patches for fn), by identity; read once a
    function (a module's imports of triton.language do not change while it runs kernels)."""
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in _LANGS)


def install() -> bool:
    """Skip the repeated patch of triton.language by helpers inside a running kernel. False where this Triton's
    interpreter lacks what it wraps (nothing installed then: everything still runs, only slower)."""
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor, scope_type = (
        getattr(interpreter, "GridExecutor", None),
        getattr(interpreter, "_LangPatchScope", None),
    )
    if patch_lang is None or executor is None or scope_type is None:
        return False
    if getattr(patch_lang, "skips_nested", False):
        return True  # installed already
    running: list[frozenset[int] | None] = [None]  # the running kernel's modules; None between launches
    launch = executor.__call__

    def patch_once(fn):
        if running[0] is not None and running[0] is not _PENDING and _langs(fn) <= running[0]:
            # a helper's call inside the kernel: nothing left to patch (Triton drops this scope unused)
            return scope_type()
        if running[0] is _PENDING:
            running[0] = _langs(fn)
        return patch_lang(fn)

    def launch_tracked(self, *args, **kwargs):
        running[0] = _PENDING
        try:
            return launch(self, *args, **kwargs)
        finally:
            running[0] = None

    patch_once.skips_nested = True
    interpreter._patch_lang = patch_once
    executor.__call__ = launch_tracked
    return True
