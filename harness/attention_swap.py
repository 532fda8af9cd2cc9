"""Running a model under one of this project's registered attention implementations for the length of a block.

The probes (harness/calibrate.py, harness/sensitivity.py) and the claim's quantize-dequantize attention
(harness/qdq_attention.py) register an attention function that reads its per-run state from the top of a
module-level stack; `attending_with` pushes that state, switches the model to the implementation and restores
both afterwards, exceptions included.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def attending_with(model, implementation: str, stack: list, state) -> Iterator[None]:
    """Inside the block `model` attends through `implementation`, whose function reads `state` as stack[-1]."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    stack.append(state)
    try:
        yield
    finally:
        stack.pop()
        model.set_attn_implementation(previous)
