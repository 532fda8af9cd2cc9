"""transformers' QuantizedCache (quanto or HQQ backend) as a peer, at the settings a transformers user gets.

The cache runs through harness.evaluate.teacher_forced on the harness's model and sequences, against the
harness's unquantized baseline. Its own semantics, not the harness's, decide what a query reads: the tokens of
the chunk being fed, and up to `residual_length` recent tokens, are read in full precision; when the residual
fills, everything is quantized again (per channel, groups of `q_group_size`). transformers refuses models with
layers other than full attention (sliding windows, linear attention), so a hybrid model gets an infeasible row
that says so.

True bytes: every tensor the cache holds after a sequence (quantized payload, scales, zero points, the
full-precision residual), floating-point tensors counted at 2 bytes per element as an fp16 deployment holds
them (the harness runs fp32 on CPU), integer payload at its size.
"""

from __future__ import annotations

import torch
import transformers

from harness import evaluate
from harness.config import Point
from harness.peers.record import fp16_bytes, record
from kernels.layout import FP16_BYTES

GROUP_SIZE = 64  # QuantizedCache's q_group_size default
RESIDUAL = 128  # its residual_length default


def stored_bytes(obj) -> int:
    """Bytes of a stored tensor, or of the tensors in a tuple / list / dict (HQQ keeps (payload, meta))."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):  # quanto's packed subclasses
            names, _ = obj.__tensor_flatten__()
            return sum(stored_bytes(getattr(obj, name)) for name in names)
        return obj.numel() * (FP16_BYTES if obj.is_floating_point() else obj.element_size())
    if isinstance(obj, tuple | list):
        return sum(stored_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(stored_bytes(o) for o in obj.values())
    return 0


def cache_bytes(cache: transformers.QuantizedCache) -> int:
    """True bytes of the K/V a QuantizedCache holds, over every layer."""
    return sum(
        stored_bytes(quantized) + stored_bytes(residual)
        for layer in cache.layers
        for quantized, residual in (
            (layer._quantized_keys, layer.keys),
            (layer._quantized_values, layer.values),
        )
    )


def make_cache(backend: str, config, bits: int) -> transformers.QuantizedCache:
    return transformers.QuantizedCache(
        backend, config, nbits=bits, q_group_size=GROUP_SIZE, residual_length=RESIDUAL
    )


def measure(ctx, point: Point) -> dict:
    """A quanto / hqq point's record body on ctx's teacher-forced sequences, against ctx's baseline."""
    backend, bits = point.engine, point.budget
    try:
        make_cache(backend, ctx.model.config, bits)
    except ValueError as err:  # layer types QuantizedCache refuses
        return {"status": "infeasible", "error": f"transformers QuantizedCache: {str(err).splitlines()[0]}"}
    caches = []

    def factory():
        caches.append(make_cache(backend, ctx.model.config, bits))
        return caches[-1]

    run = evaluate.teacher_forced(
        ctx.model,
        ctx.sequences,
        factory,
        chunk=point.chunk,
        batch_size=ctx.batch_size,
        baseline=ctx.base_tf,
        score_from=point.score_from,
    )
    sequences, tokens = ctx.sequences.shape[0], ctx.sequences.shape[1] - 1  # token T-1 is never fed
    held = sum(cache_bytes(c) for c in caches)
    return record(ctx.base_tf, run, bits, held, fp16_bytes(ctx.name, tokens, sequences), sequences * tokens)
