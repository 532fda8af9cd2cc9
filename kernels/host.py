"""Integer arithmetic of the kernels' launchers, in plain Python.

This module owns the small integer helpers that the host code of kernels/decode_attention.py and
kernels/quantize.py runs on every call (split plans, block sizes). triton.cdiv and triton.next_power_of_2 go
through Triton's constexpr-function wrapper, a few microseconds each: some twenty of them made up about 40% of a
decode call's host time before a launch. `sm_count` caches the device query that the split plan needs.
"""

from __future__ import annotations

import functools

import torch


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (asked once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count
