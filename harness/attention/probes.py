"""Attention implementations that measure the model's own attention while it runs, with no KV cache.

- ENTROPY_PROBE ("harness_entropy_probe"; harness/calibrate/entropy.py): the module's own eager attention in float32,
  its probabilities (B, Hq, T, T) handed to the state's `record(layer, weights)` and then discarded, layer by
  layer. In a bfloat16 model the queries, keys, values and additive mask are upcast first (no-ops in float32),
  and the output is rounded back to the model's dtype for the layers after it.
- SENSITIVITY_PROBE ("harness_sensitivity_probe"; harness/sensitivity/proxy.py): the module's own eager
  attention, which the state's `record(layer, attend, query, key, value)` calls on the real K/V and on
  quantized ones; its return value is the layer's output.
Both use the eager mask, so masks, sliding windows and softcapping are the model's.
"""

from __future__ import annotations

from transformers.masking_utils import eager_mask

from harness.attention.base import Implementation, eager_forward


def entropy_probe_forward(recorder, module, query, key, value, attention_mask, **kwargs):
    """query (B, Hq, T, D), key/value (B, Hkv, T, D) in the model's dtype -> (output (B, T, Hq, D) in that dtype,
    None); the float32 probabilities (B, Hq, T, T) go to recorder.record(layer, weights)."""
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()  # additive: 0 or the dtype's minimum, finite in float32
    eager = eager_forward(module)
    out, weights = eager(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    recorder.record(module.layer_idx, weights)
    return out.to(query.dtype), None


def sensitivity_probe_forward(meter, module, query, key, value, attention_mask, **kwargs):
    """The module's own eager attention; meter.record(layer, attend, query, key, value) returns the output
    (B, T, Hq, D) and reruns `attend(q, k, v)` on quantized K/V for its errors."""
    eager = eager_forward(module)
    attend = lambda q, k, v: eager(module, q, k, v, attention_mask, **kwargs)  # noqa: E731
    return meter.record(module.layer_idx, attend, query, key, value), None


ENTROPY_PROBE = Implementation("harness_entropy_probe", entropy_probe_forward, eager_mask)
SENSITIVITY_PROBE = Implementation("harness_sensitivity_probe", sensitivity_probe_forward, eager_mask)
