"""The KV caches the harness measures: `QuantizedKVCache` (quantized.py: every (layer, KV head) at its own width,
holding only its stored form), token eviction composed with it (eviction.py: StreamingLLM, H2O), and its decode
steps replayed from a CUDA graph inside generate() (graphed.py)."""

from harness.cache.graphed import GraphedStep, graphed_decoding
from harness.cache.quantized import (
    BACKENDS,
    OUTSIDE_PACKED,
    PREFILL_MODES,
    QuantizedKVCache,
    QuantizedLayer,
    QuantizedSlidingLayer,
    UnpackedReadWarning,
    cannot_convert,
    check_backend_device,
    check_served,
    kv_heads,
    resident_bytes,
    resolve_backend,
    unserved_reason,
)

__all__ = [
    "BACKENDS",
    "GraphedStep",
    "OUTSIDE_PACKED",
    "PREFILL_MODES",
    "QuantizedKVCache",
    "QuantizedLayer",
    "QuantizedSlidingLayer",
    "UnpackedReadWarning",
    "cannot_convert",
    "check_backend_device",
    "check_served",
    "graphed_decoding",
    "kv_heads",
    "resident_bytes",
    "resolve_backend",
    "unserved_reason",
]
