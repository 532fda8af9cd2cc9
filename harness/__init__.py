"""kvbits: per-head mixed-precision KV caches for Hugging Face causal LMs, and the harness that measures them.

The library surface (harness/api.py, harness/allocation_file.py, harness/cache/graphed.py), importable from
here: `load`, `calibration`, `make_policy`, `make_scheme`, `allocate`, `quantized_cache`, `packed_attention`,
`graphed_decoding`, `save_allocation`, `load_allocation`, `advise` (harness/protocols/advise.py), and the objects they hand out (`Allocation`,
`Calibration`, `Policy`, `QuantizedKVCache`, `Scheme`). They are imported on first use,
so `python -m harness` and the submodules start without them.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Allocation": "harness.policies",
    "Calibration": "harness.api",
    "Policy": "harness.policies",
    "QuantizedKVCache": "harness.cache",
    "Scheme": "harness.schemes",
    "UnpackedReadWarning": "harness.cache",
    "advise": "harness.protocols.advise",
    "allocate": "harness.api",
    "calibration": "harness.api",
    "graphed_decoding": "harness.cache.graphed",
    "load": "harness.api",
    "load_allocation": "harness.allocation_file",
    "make_policy": "harness.api",
    "make_scheme": "harness.api",
    "packed_attention": "harness.api",
    "quantized_cache": "harness.api",
    "save_allocation": "harness.allocation_file",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
