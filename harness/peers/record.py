"""A peer measurement as a point record: its teacher-forced metrics against a baseline and the bytes its cache
held, beside the fp16 bytes of the same tokens (harness.capacity's model shapes, no weights loaded)."""

from __future__ import annotations

from functools import cache

from harness import metrics
from harness.capacity import cache_bytes, shape_from_registry
from kernels.layout import FULL_WIDTH


@cache
def model_shape(model: str):
    """harness.capacity's layer shapes of a registered model (from its config; no weights loaded)."""
    return shape_from_registry(model)


def fp16_bytes(model: str, tokens: int, sequences: int) -> int:
    """Bytes of an unquantized 2-byte K/V cache of `sequences` sequences of `tokens` tokens."""
    return cache_bytes(model_shape(model), tokens, 16, batch=sequences).fp16_bytes


def record(base, run, bits: int, held_bytes: float, fp16_bytes: float, tokens: int) -> dict:
    """A peer's record body from its teacher-forced run against `base` (harness.evaluate.TeacherForced, same
    sequences) and the bytes its cache held (true and at fp16) for `tokens` tokens in all."""
    items = {k: v.tolist() for k, v in metrics.teacher_forced_items(base, run).items()}
    return {
        "status": "ok",
        "metrics": {
            **metrics.teacher_forced_metrics(base, run),
            "mean_bits": float(bits),
            "compression_nominal": FULL_WIDTH / bits,
            "compression_true": fp16_bytes / held_bytes,
            "bytes_per_token": held_bytes / tokens,
            "n_sinks": 0,
            "tokens_kept_fraction": 1.0,
        },
        "items": items,
    }
