"""The KV caches the harness measures: `QuantizedKVCache` (quantized.py: every (layer, KV head) at its own width,
holding only its stored form) and token eviction composed with it (eviction.py: StreamingLLM, H2O)."""

from harness.cache.quantized import (
    BACKENDS,
    PREFILL_MODES,
    QuantizedKVCache,
    QuantizedLayer,
    QuantizedSlidingLayer,
    kv_heads,
    resident_bytes,
    resolve_backend,
)

__all__ = [
    "BACKENDS",
    "PREFILL_MODES",
    "QuantizedKVCache",
    "QuantizedLayer",
    "QuantizedSlidingLayer",
    "kv_heads",
    "resident_bytes",
    "resolve_backend",
]
