"""A transformers `Cache` that stores every (layer, KV head) at its own bit width.

`QuantizedKVCache(config, bits, ...)` plugs into `model.generate(..., past_key_values=cache)` and plain forward
calls. Per decoder layer it holds:
- full attention: a `QuantizedLayer` (keys and values in kernels.layout.PackedStore, quantize-on-write);
- sliding window: a `QuantizedSlidingLayer`, which keeps the model's window, as DynamicSlidingWindowLayer does;
- linear attention (conv / recurrent state): the model's own `LinearAttentionLayer`, unquantized and
  reported apart (`linear_state_nbytes`).
Reads go through the quantized form: `update` returns the dequantized values of everything stored, the new
tokens included (quantize-on-write), except with `prefill="exact"`, where the first call (the prompt) attends
its own full-precision K/V, as a prefill computed once in full precision and then stored quantized would.
Bytes: `nbytes()` sums the stored tensors (payload, scales, zeros, 16-bit heads at 2 bytes);
`nbytes_fp16()` is what an unquantized fp16 cache would hold for the same tokens.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    DummyLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from harness.quant import Scheme, get_scheme

PREFILL_MODES = ("exact", "quantized")


class QuantizedLayer(CacheLayerMixin):
    """One full-attention layer's K/V, each KV head at its own width (16 = kept in full precision)."""

    is_sliding = False
    is_croppable = False

    def __init__(self, bits: list[int], scheme: Scheme, prefill: str = "exact"):
        super().__init__()
        self.bits, self.scheme, self.prefill = [int(b) for b in bits], scheme, prefill
        self.k_store = self.v_store = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape  # (B, Hkv, T, D)
        assert H == len(self.bits), f"layer has {H} KV heads but {len(self.bits)} widths were given"
        self.dtype, self.device = key_states.dtype, key_states.device
        self.k_store = self.scheme.new_store(self.bits, D, B, key_states.dtype, key_states.device)
        self.v_store = self.scheme.new_store(self.bits, value_states.shape[-1], B, value_states.dtype, key_states.device)
        self.is_initialized = True

    def _store(self, key_states, value_states):
        """Append new tokens; return (keys, values) to attend: (B, Hkv, T_visible, D) each."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first = self.k_store.length == 0
        keys = self.k_store.append(key_states)
        values = self.v_store.append(value_states)
        if first and self.prefill == "exact":
            return key_states, value_states
        return keys, values

    def update(self, key_states, value_states, *args, **kwargs):
        return self._store(key_states, value_states)

    def get_seq_length(self) -> int:
        return 0 if self.k_store is None else self.k_store.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.k_store = self.v_store = None
        self.is_initialized = False

    def nbytes(self) -> int:
        return 0 if self.k_store is None else self.k_store.nbytes() + self.v_store.nbytes()

    def nbytes_fp16(self) -> int:
        return 0 if self.k_store is None else self.k_store.nbytes_fp16() + self.v_store.nbytes_fp16()


class QuantizedSlidingLayer(QuantizedLayer):
    """A sliding-window layer: holds the last window - 1 tokens, like transformers' DynamicSlidingWindowLayer."""

    is_sliding = True

    def __init__(self, bits: list[int], scheme: Scheme, sliding_window: int, prefill: str = "exact"):
        super().__init__(bits, scheme, prefill)
        self.sliding_window = sliding_window
        self.cumulative_length = 0

    def update(self, key_states, value_states, *args, **kwargs):
        self.cumulative_length += key_states.shape[-2]
        keys, values = self._store(key_states, value_states)
        self.k_store.keep_last(self.sliding_window - 1)
        self.v_store.keep_last(self.sliding_window - 1)
        return keys, values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        held = min(self.cumulative_length, self.sliding_window - 1)
        return held + query_length, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def reset(self) -> None:
        super().reset()
        self.cumulative_length = 0


class QuantizedKVCache(Cache):
    """A KV cache with per-(layer, KV head) widths from `bits` ([num_layers, num_kv_heads], or one int for all)."""

    def __init__(
        self,
        config,
        bits: torch.Tensor | int,
        scheme: str = "asym_token",
        group_size: int = 32,
        prefill: str = "exact",
    ):
        if prefill not in PREFILL_MODES:
            raise ValueError(f"quant.prefill: unknown {prefill!r}; allowed: {', '.join(PREFILL_MODES)}")
        text_config = config.get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(text_config)
        n_kv = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        if isinstance(bits, int):
            bits = torch.full((len(types), n_kv), bits, dtype=torch.long)
        if tuple(bits.shape) != (len(types), n_kv):
            raise ValueError(f"bits: shape {tuple(bits.shape)} does not match the model's ({len(types)}, {n_kv})")
        self.scheme = get_scheme(scheme, group_size)
        self.prefill = prefill
        self.bits = bits.clone()
        layers = [self._layer(t, kw, bits[i].tolist()) for i, (t, kw) in enumerate(zip(types, kwargs))]
        super().__init__(layers=layers)

    def _layer(self, layer_type: str, kwargs: dict, bits: list[int]):
        if layer_type == "full_attention":
            return QuantizedLayer(bits, self.scheme, self.prefill)
        if layer_type in ("sliding_attention", "chunked_attention"):
            return QuantizedSlidingLayer(bits, self.scheme, kwargs["sliding_window"], self.prefill)
        if layer_type in ("linear_attention", "conv", "dummy"):
            return DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs)
        raise NotImplementedError(f"QuantizedKVCache: layer type {layer_type!r} is not supported yet")

    @classmethod
    def from_prefilled(cls, prefilled: Cache, config, bits, **kwargs) -> QuantizedKVCache:
        """A cache holding, quantized, what a full-precision DynamicCache `prefilled` holds (prefill=exact).

        The prompt's logits and attention came from the full-precision pass; from here on every read goes
        through the quantized form. Linear-attention state is copied unchanged.
        """
        cache = cls(config, bits, **kwargs)
        for i, (src, dst) in enumerate(zip(prefilled.layers, cache.layers)):
            if isinstance(dst, QuantizedLayer):
                if src.keys is None or src.keys.numel() == 0:
                    continue
                dst.lazy_initialization(src.keys, src.values)
                dst.k_store.append(src.keys)
                dst.v_store.append(src.values)
                if isinstance(dst, QuantizedSlidingLayer):
                    dst.cumulative_length = src.cumulative_length
            elif isinstance(src, (LinearAttentionCacheLayerMixin, DummyLayer)):
                cache.layers[i] = copy.deepcopy(src)
        return cache

    def quantized_layers(self) -> list[QuantizedLayer]:
        return [layer for layer in self.layers if isinstance(layer, QuantizedLayer)]

    def nbytes(self) -> int:
        """Bytes held by the K/V stores (payload, scales, zeros, 16-bit heads at 2 bytes per element)."""
        return sum(layer.nbytes() for layer in self.quantized_layers())

    def nbytes_fp16(self) -> int:
        """Bytes an fp16 DynamicCache would hold for the same tokens (sliding layers at their window)."""
        return sum(layer.nbytes_fp16() for layer in self.quantized_layers())

    def linear_state_nbytes(self) -> int:
        """Bytes of linear-attention (conv and recurrent) state, kept unquantized and reported apart."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                for states in (layer.conv_states, layer.recurrent_states):  # dicts: state index -> tensor or None
                    total += sum(t.numel() * 2 for t in states.values() if t is not None)
        return total
