"""A transformers `Cache` that stores every (layer, KV head) at its own bit width.

`QuantizedKVCache(config, bits, ...)` plugs into `model.generate(..., past_key_values=cache)` and plain forward
calls. Per decoder layer it holds:
- full attention: a `QuantizedLayer` (keys and values in the scheme's stores (harness/schemes): a
  kernels.layout.PackedStore, or a harness.schemes store for kivi, fp8, rotation, sink tokens and a residual
  window), quantize-on-write;
- sliding window: a `QuantizedSlidingLayer`, which keeps the model's window, as DynamicSlidingWindowLayer does;
- linear attention (conv / recurrent state): the model's own `LinearAttentionLayer`, unquantized and
  reported apart (`linear_state_nbytes`);
- a layer that reuses another layer's K/V (Gemma 4's KV sharing; transformers' "dummy" type): the model's
  `DummyLayer`, which stores nothing.
Widths: `bits` (the keys') and `value_bits` (the values'; None: the same) are [num_layers, max KV heads of a
layer] (`kv_heads`); a layer with fewer KV heads (Gemma 4's global layers) uses the first entries of its row, the
rest is padding that is never stored. Keys and values may differ (K8V4, K4V2 and per-head mixes): each store is
built at its own role's widths.
Reads go through the quantized form: every query attends the stored (quantized) K/V, the new tokens included
(quantize-on-write), except with `prefill="exact"`, where the first call (the prompt) attends its own
full-precision K/V, as a prefill computed once in full precision and then stored quantized would.
Backends (`backend=`, resolved per layer from the device of its first K/V):
- `torch`: kernels.layout's torch quantizer writes; by default (`simulate=False`) the stores hold only the
  stored form and `update` returns the new K/V as placeholders and posts a `PackedStep` holding the layer's
  stores for harness/attention/packed.py's attention, which hands it to kernels/packed_attention.py (decode
  steps and prefill chunks alike, blockwise, nothing of the context dequantized into memory). With
  `simulate=True` (quant.simulate: fast quality sweeps) each store also keeps a full-precision working copy and
  `update` returns the dequantized K/V for the model's own attention: the same metrics within float summation
  order, at the memory of an unquantized cache;
- `triton`: new keys and values are written by kernels.quantize.quantize_into, one launch a layer (no
  dequantized copy is kept). A prefill (more than one new token) dequantizes the store once and attends through
  SDPA as above; a decode step (one new token) dequantizes nothing: `update` returns the new K/V as
  placeholders and posts a `DecodeStep` holding the layer's stores, which harness/attention/packed.py's
  attention hands to kernels.decode_attention;
- `auto`: triton for a layer on CUDA whose widths and group size the kernels support, torch otherwise.
The kernels store plain asym_token / sym_token (no sink tokens, residual window or rotation) and the foldable
pca formats (pca_post_uf, pca_block_uf, pca_block32_uf, pca_block_ugs; sink tokens beside them; full-attention
layers), whose decode step is
harness/schemes/pca_fold.py's `decode`: for other schemes auto is torch and an explicit triton is a ValueError
(harness.schemes.check_backend).
The placeholders of both backends need the packed attention: the model runs inside
`harness.attention.installed(model, PACKED)`, where steps are posted, by layer index, on the state installed there
(a step left unattended makes the layer's next update raise). Outside every such block no attention would read
the stores, and `outside_packed` says what an update does instead (never hand the model unquantized K/V):
- `dequantize` (default): return every stored token dequantized (B, Hkv, length, D), for the model's own
  attention, the same values the packed attention reads; one warning per cache says that memory is then not
  saved (a full-precision copy of the context exists during each forward);
- `raise`: a one-line RuntimeError at the first update, before anything is stored, naming the remedy.
quant.simulate's working copy is returned wherever the model runs, without a warning (it already holds the
memory of an unquantized cache).
Decoding modes: every mode of generate() works as with a DynamicCache, inside the packed attention and outside it.
Beam search (`reorder_cache`) and the other batch rows (`batch_repeat_interleave`, `batch_select_indices`) take the
rows of every stored tensor (payload, scales, zeros, 16-bit heads, sink and residual tokens, positions, working
copies); a cache is reused across generate() calls as it stands. Assisted generation and prompt lookup decoding
drop rejected draft tokens (`crop`) as if they had never been stored, where the scheme allows it: a scheme that
keeps recent tokens unquantized (kivi, quant.residual > 0) has quantized older ones as they arrived, and an evicting
layer has evicted by them, so those refuse the drafting modes in one line before the prompt is stored
(`activate_past_recording`, which generate() calls first; `is_croppable` says it beforehand).
Bytes: `nbytes()` sums the stored tensors (payload, scales, zeros, 16-bit heads, sink and residual tokens at
2 bytes per element);
`nbytes_fp16()` is what an unquantized fp16 cache would hold for the same tokens;
`resident_bytes()` is measured: the storage of every tensor the cache keeps (capacity slack and a simulate
working copy included, shared storage counted once).
A sliding layer evicts the tokens that left its window at the start of its next update (the attention of the
current step still reads them); the byte counts apply that pending eviction first.
"""

from __future__ import annotations

import copy
import inspect
import os
import sys
import warnings

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    Cache,
    CacheLayerMixin,
    DummyLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)
from transformers.configuration_utils import get_head_shapes
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from harness.attention.base import active
from harness.attention.packed import DecodeStep, PackedStep, Steps, post_step
from harness.policies.base import Allocation
from harness.schemes import KeyCalibration, Scheme, check_backend, get_scheme, starts_at
from kernels.layout import PackedStore

PREFILL_MODES = ("exact", "quantized")
BACKENDS = ("auto", "torch", "triton")
OUTSIDE_PACKED = ("dequantize", "raise")
REMEDY = "run the model inside `with harness.packed_attention(model):` (harness.attention.installed(model, PACKED))"


class UnpackedReadWarning(UserWarning):
    """A quantized cache was read outside the packed attention: the model got dequantized K/V, memory not saved."""


class OutsidePacked:
    """What the layers of one cache do when they are updated with no packed attention installed (`mode`, one of
    OUTSIDE_PACKED; the module docstring): warn once for the whole cache, or raise."""

    def __init__(self, mode: str = "dequantize"):
        if mode not in OUTSIDE_PACKED:
            raise ValueError(f"outside_packed: unknown {mode!r}; allowed: {', '.join(OUTSIDE_PACKED)}")
        self.mode, self.warned = mode, False

    def update(self) -> None:
        """Called by a layer's update outside the packed attention, before it stores anything."""
        if self.mode == "raise":
            raise RuntimeError(
                f"QuantizedKVCache: no packed attention is installed, so the model would attend unquantized K/V; "
                f"{REMEDY} (or build the cache with outside_packed='dequantize')"
            )
        if not self.warned:
            self.warned = True
            warnings.warn(
                f"QuantizedKVCache: no packed attention is installed; the model attends the cache's dequantized "
                f"K/V, so memory is not saved; {REMEDY}",
                UnpackedReadWarning,
                stacklevel=4,
            )


def check_backend_device(backend: str, device: str | torch.device, key: str = "quant.backend") -> None:
    """ValueError naming `key` for a backend name not in BACKENDS, or triton where its tensors would not be on
    CUDA (a CPU device runs Triton only in its interpreter, TRITON_INTERPRET=1): before any model loads."""
    if backend not in BACKENDS:
        raise ValueError(f"{key}: unknown {backend!r}; allowed: {', '.join(BACKENDS)}")
    on_cuda = torch.device(device).type == "cuda"
    if backend == "triton" and not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{key}: triton needs CUDA tensors (device=cuda) or Triton's CPU interpreter (TRITON_INTERPRET=1); "
            f"the device is {torch.device(device).type}; allowed here: auto, torch"
        )


# The cache layer types QuantizedKVCache holds (transformers' names, get_layer_types_and_kwargs): the attention
# ones quantized, the others kept as the model's own layers.
ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")
SERVED_LAYERS = (*ATTENTION_LAYERS, "linear_attention", "conv", "dummy")


def unserved_reason(config, model_class: type | None = None) -> str | None:
    """Why QuantizedKVCache cannot serve a causal LM of `config` (None: it can), from the config and the model's
    class alone (no weights): `model_class` or, when None, transformers' causal LM class for the config."""
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model keeps a cross-attention cache, which this cache does not hold"
    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    other = [t for t in types if t not in SERVED_LAYERS]
    if other:
        return f"its layer type {other[0]!r} is none this cache holds ({', '.join(SERVED_LAYERS)})"
    if not any(t in ATTENTION_LAYERS for t in types):
        return "no layer keeps attention keys and values (only recurrent state): nothing to quantize"
    if model_class is None and type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    modeling = sys.modules.get(getattr(model_class, "__module__", ""))
    if modeling is None:
        return None
    if not hasattr(modeling, "ALL_ATTENTION_FUNCTIONS"):
        return (
            f"{model_class.__name__} computes attention in its own code, not through transformers' attention "
            "interface, where the packed attention plugs in"
        )
    if "s_aux=" in inspect.getsource(modeling):
        return f"{model_class.__name__}'s attention adds learned sink logits (s_aux), which the packed attention lacks"
    return None


def check_served(config, model_class: type | None = None, key: str = "model") -> None:
    """ValueError naming `key`, one line saying why, for a model QuantizedKVCache cannot serve (unserved_reason)."""
    reason = unserved_reason(config, model_class)
    if reason is not None:
        kind = getattr(config, "model_type", type(config).__name__)
        raise ValueError(f"{key}: QuantizedKVCache cannot serve {kind}: {reason}")


def resolve_backend(
    backend: str,
    device: torch.device,
    scheme: Scheme,
    key_bits: list[int],
    value_bits: list[int],
    k_dim: int,
    v_dim: int,
    sliding: bool = False,
) -> str:
    """'torch' or 'triton' for one layer on `device`; auto takes triton on CUDA when the kernels support the layer.

    The layer: its keys' and values' widths per KV head and head_dims, a sliding window or not; what the kernels
    support of it the scheme says (Scheme.check_kernel: each store at its own widths and group size, so keys and
    values may differ in both).

    An explicit triton raises NotImplementedError for what the kernels cannot do, and ValueError for CPU tensors
    unless Triton runs in its interpreter (TRITON_INTERPRET=1).
    """
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return "torch"
    try:
        scheme.check_kernel(key_bits, value_bits, k_dim, v_dim, sliding)
    except NotImplementedError:
        if backend == "auto":
            return "torch"
        raise
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"quant.backend: triton needs CUDA tensors (or TRITON_INTERPRET=1); got {device.type}"
        )
    return "triton"


def _width_grid(name: str, bits: torch.Tensor | int, shape: tuple[int, int]) -> torch.Tensor:
    """int64 `shape` (layers, most KV heads of a layer): `bits` as given, or one int everywhere; ValueError
    naming `name` for another shape."""
    if isinstance(bits, int) and not isinstance(bits, bool):
        return torch.full(shape, bits, dtype=torch.long)
    if not isinstance(bits, torch.Tensor) or tuple(bits.shape) != shape:
        got = tuple(bits.shape) if isinstance(bits, torch.Tensor) else repr(bits)
        raise ValueError(
            f"{name}: shape {got} does not match the model's {shape} (layers, most KV heads of a layer)"
        )
    return bits.long()


def kv_heads(config) -> list[int]:
    """KV heads of each decoder layer, from its per-layer config as transformers reads it (get_head_shapes).

    Layers without a KV cache of their own (linear attention, KV sharing) still report their config's count.
    """
    text_config = config.get_text_config(decoder=True)
    counts, _ = get_head_shapes(text_config)
    return counts if isinstance(counts, list) else [counts] * text_config.num_hidden_layers


def _tensors(obj, seen: set[int], out: list[torch.Tensor]) -> None:
    """Every plain tensor reachable from obj through attributes, dicts, lists and tuples (each object once);
    a tensor subclass that wraps others (quantized tensors of other libraries) is opened into its parts."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            for name in obj.__tensor_flatten__()[0]:
                _tensors(getattr(obj, name), seen, out)
        else:
            out.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, seen, out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors(value, seen, out)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        for value in vars(obj).values():
            _tensors(value, seen, out)


def resident_bytes(objects) -> int:
    """Bytes of the storage behind every tensor reachable from `objects`, each storage counted once."""
    tensors: list[torch.Tensor] = []
    _tensors(objects, set(), tensors)
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[(storage.data_ptr(), t.device)] = storage.nbytes()
    return sum(storages.values())


class QuantizedLayer(CacheLayerMixin):
    """One full-attention layer's K/V, each KV head's keys at its width of `key_bits` and its values at its width
    of `value_bits` (16 = kept in full precision)."""

    is_sliding = False

    def __init__(
        self,
        key_bits: list[int],
        value_bits: list[int],
        scheme: Scheme,
        prefill: str = "exact",
        backend: str = "torch",
        simulate: bool = False,
        layer_idx: int = 0,
        outside: OutsidePacked | None = None,
    ):
        super().__init__()
        self.key_bits, self.value_bits = [int(b) for b in key_bits], [int(b) for b in value_bits]
        assert len(self.key_bits) == len(self.value_bits), (key_bits, value_bits)
        self.scheme, self.prefill, self.backend = scheme, prefill, backend
        self.simulate = simulate
        self.layer_idx = layer_idx  # the decoder layer: where its steps are posted for its attention
        self.outside = OutsidePacked() if outside is None else outside  # shared by the cache's layers
        self.k_store = self.v_store = None
        self.fused = False  # resolved at lazy initialization: the Triton kernels write and attend this layer
        # (write position, attended length): int32 tensors of one element on the device, set by
        # QuantizedKVCache.device_positions; a fused decode step then writes and attends where they say, so its
        # launches do not change as the context grows (a CUDA graph replays them). None: host lengths.
        self.device_pos: tuple[torch.Tensor, torch.Tensor] | None = None
        self._step: DecodeStep | PackedStep | None = (
            None  # the last placeholder step, checked at the next update
        )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape  # (B, Hkv, T, D)
        assert H == len(self.key_bits), f"layer has {H} KV heads but {len(self.key_bits)} widths were given"
        self.dtype, self.device = key_states.dtype, key_states.device
        widths = (self.key_bits, self.value_bits, D, value_states.shape[-1], self.is_sliding)
        self.fused = resolve_backend(self.backend, key_states.device, self.scheme, *widths) == "triton"
        simulate = self.simulate and not self.fused
        self.k_store = self.scheme.new_store(
            self.key_bits, D, B, key_states.dtype, key_states.device, "key", simulate, self.fused
        )
        self.v_store = self.scheme.new_store(
            self.value_bits, value_states.shape[-1], B, value_states.dtype, key_states.device, "value", simulate,
            self.fused,
        )  # fmt: skip
        self.is_initialized = True

    def append(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Store new tokens (B, Hkv, Tn, D) each; simulate (torch backend): return (keys, values) of all stored
        tokens, dequantized, (B, Hkv, length, D) each; otherwise None."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.fused:
            keys, values = self.k_store.append(key_states), self.v_store.append(value_states)
            return (keys, values) if self.simulate else None
        if self.device_pos is not None and key_states.shape[-2] == 1:
            self._append_at_device_position(key_states, value_states)
            return None
        if not isinstance(self.k_store, PackedStore):  # a scheme's own kernel stores (pca)
            self.k_store.append(key_states)
            self.v_store.append(value_states)
            return None
        from kernels.quantize import quantize_into

        # keys and values in one launch, no dequantized copy
        self.k_store.append_with(key_states, quantize_into, self.v_store, value_states)
        return None

    def _append_at_device_position(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one decode token at the device-side position (`device_pos`) into reserved capacity; the host
        length advances as the device position does (the caller keeps them equal). PackedStores take keys and
        values in one launch of kernels.quantize.quantize_into; a scheme's own kernel stores (pca) write each
        through their `append_at`."""
        from kernels.quantize import quantize_into

        if self.k_store.length + 1 > min(self.k_store.capacity, self.v_store.capacity):
            raise RuntimeError(
                f"QuantizedKVCache: layer {self.layer_idx} holds {self.k_store.length} tokens in a capacity of "
                f"{self.k_store.capacity}; reserve() room for every decode step before device-side positions"
            )
        if isinstance(self.k_store, PackedStore):
            quantize_into(self.k_store, key_states, self.device_pos[0], v_store=self.v_store, v=value_states)
        else:
            self.k_store.append_at(key_states, self.device_pos[0])
            self.v_store.append_at(value_states, self.device_pos[0])
        self.k_store.advance(1)
        self.v_store.advance(1)

    def _store(self, key_states, value_states):
        """Append new tokens; return (keys, values) to attend: (B, Hkv, T_visible, D) each, or placeholders.

        Placeholders are the new tokens themselves (B, Hkv, Tn, D), posted for the attention with a step
        (harness.attention.packed.post_step): a DecodeStep on a fused decode step (triton backend, one new token),
        a PackedStep on the packed torch path (any Tn); not on an exact prefill's first call, which attends its
        own full-precision K/V. Outside the packed attention there are no placeholders: `self.outside` raises, or
        the stored tokens come back dequantized.
        """
        if self._step is not None and not self._step.attended:
            raise RuntimeError(f"the last update's attention did not read the packed cache; {REMEDY}")
        self._step = None
        packed = active(Steps) is not None
        if not packed and not self.simulate:
            self.outside.update()
        first = not self.is_initialized or self.k_store.length == 0
        stored = self.append(key_states, value_states)
        if first and self.prefill == "exact":
            keys, values = key_states, value_states
        elif stored is not None:
            keys, values = stored
        elif not packed:
            keys, values = self.k_store.dequantize(), self.v_store.dequantize()
        elif not self.fused:
            self._step = PackedStep(self.k_store, self.v_store, self.scheme.packed_decode())
            keys, values = key_states, value_states
        elif key_states.shape[-2] > 1:
            keys, values = self.k_store.dequantize(), self.v_store.dequantize()
        else:
            length = None if self.device_pos is None else self.device_pos[1]
            stores = copy.copy(self.k_store), copy.copy(self.v_store)
            self._step = DecodeStep(*stores, length, self.scheme.decode_kernel())
            keys, values = key_states, value_states
        post_step(self.layer_idx, keys, self._step)
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
        self.fused, self._step, self.device_pos = False, None, None
        self.is_initialized = False

    # Batch rows and rollbacks: what generate()'s decoding modes ask of a cache (transformers' names).

    def take_rows(self, index: torch.Tensor) -> None:
        """Keep the batch rows at index (n,) int64 of both stores, in any order and with repeats (nothing to do
        before the first update)."""
        if self.k_store is None:
            return
        if self.device_pos is not None and index.shape[0] != self.k_store.batch:
            raise NotImplementedError(
                f"QuantizedKVCache: {index.shape[0]} batch rows instead of {self.k_store.batch} inside "
                "graphed_decoding, whose replayed decode step keeps its batch; run generate() outside it"
            )
        index = index.to(self.device)
        self.k_store.take_rows(index)
        self.v_store.take_rows(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i continues beam beam_idx[i]."""
        self.take_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.k_store is not None:
            self.take_rows(torch.arange(self.k_store.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` selects (integer indices or a boolean mask, as DynamicLayer indexes)."""
        if self.k_store is not None:
            self.take_rows(torch.arange(self.k_store.batch, device=self.device)[indices])

    @property
    def no_rollback(self) -> str | None:
        """What keeps this layer from dropping its newest tokens as if they had never come (crop), if anything."""
        return self.scheme.no_rollback

    @property
    def is_croppable(self) -> bool:
        return self.no_rollback is None

    def check_rollback(self) -> None:
        """A one-line error where this layer cannot drop its newest tokens exactly (crop), else nothing."""
        if self.no_rollback is not None:
            raise NotImplementedError(
                f"QuantizedKVCache: assisted generation and prompt lookup decoding drop rejected draft tokens "
                f"(Cache.crop), which layer {self.layer_idx} cannot do exactly: {self.no_rollback}; or generate "
                "without drafts (greedy, sampling, beam search)"
            )
        if self.device_pos is not None:
            raise NotImplementedError(
                "QuantizedKVCache: crop (assisted generation, prompt lookup decoding) inside graphed_decoding, "
                "whose replayed decode step keeps its positions on the device; run generate() outside it"
            )

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens (transformers' convention: a count <= 0) as if they had never
        been stored; a one-line error where the scheme cannot (no_rollback)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop: {tokens_to_remove}; QuantizedKVCache drops the last n tokens with crop(-n), a final "
                "length is not accepted"
            )
        if tokens_to_remove == 0 or self.k_store is None:
            return
        self.check_rollback()
        self._drop_last(-tokens_to_remove)

    def _drop_last(self, n: int) -> None:
        held = self.k_store.length
        if n > held:
            raise ValueError(f"crop: {n} tokens to drop; layer {self.layer_idx} holds {held}")
        self.k_store.keep_first(held - n)
        self.v_store.keep_first(held - n)

    def nbytes(self) -> int:
        return 0 if self.k_store is None else self.k_store.nbytes() + self.v_store.nbytes()

    def nbytes_fp16(self) -> int:
        return 0 if self.k_store is None else self.k_store.nbytes_fp16() + self.v_store.nbytes_fp16()


class QuantizedSlidingLayer(QuantizedLayer):
    """A sliding-window layer: holds the last window - 1 tokens, like transformers' DynamicSlidingWindowLayer."""

    is_sliding = True

    def __init__(
        self,
        key_bits: list[int],
        value_bits: list[int],
        scheme: Scheme,
        sliding_window: int,
        prefill: str = "exact",
        backend: str = "torch",
        simulate: bool = False,
        layer_idx: int = 0,
        outside: OutsidePacked | None = None,
    ):
        super().__init__(key_bits, value_bits, scheme, prefill, backend, simulate, layer_idx, outside)
        self.sliding_window = sliding_window
        self.cumulative_length = 0

    def evict(self) -> None:
        """Drop the tokens the last update moved out of the window (kept until now: that update attended them)."""
        if self.k_store is not None:
            self.k_store.keep_last(self.sliding_window - 1)
            self.v_store.keep_last(self.sliding_window - 1)

    def update(self, key_states, value_states, *args, **kwargs):
        self.evict()
        self.cumulative_length += key_states.shape[-2]
        return self._store(key_states, value_states)

    def nbytes(self) -> int:
        self.evict()
        return super().nbytes()

    def nbytes_fp16(self) -> int:
        self.evict()
        return super().nbytes_fp16()

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

    def _drop_last(self, n: int) -> None:
        """A sliding layer evicts at its next update (module docstring), so it still holds the window - 1 tokens
        before the last forward's: dropping up to that forward's tokens leaves what a layer that never saw them
        holds; dropping more would need tokens already evicted."""
        needed = min(self.cumulative_length - n, self.sliding_window - 1)
        if self.k_store.length - n < needed:
            raise ValueError(
                f"crop: dropping {n} tokens would leave layer {self.layer_idx}'s window {self.k_store.length - n} "
                f"of the {needed} it must hold (older ones are evicted); drop at most the last forward's tokens"
            )
        super()._drop_last(n)
        self.cumulative_length -= n


def cannot_convert(prefilled: Cache, scheme: Scheme) -> str | None:
    """Why QuantizedKVCache.from_prefilled cannot hold what `prefilled` holds in `scheme`, or None. A scheme that
    predicts each layer's tokens from the layer below's (Scheme.reads_previous_layer: xlayer) needs every layer to
    hold every prompt token, which a sliding-window layer past its window no longer does."""
    if not scheme.reads_previous_layer:
        return None
    for index, layer in enumerate(prefilled.layers):
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            continue
        held, seen = keys.shape[-2], layer.get_seq_length()
        if held < seen:
            return (
                f"{scheme.name} predicts each layer's tokens from the layer below's, and layer {index}'s sliding "
                f"window holds {held} of the prompt's {seen} tokens; prefill through the QuantizedKVCache itself "
                "(prefill='exact')"
            )
    return None


class QuantizedKVCache(Cache):
    """A KV cache with per-(layer, KV head) widths from `bits`: an Allocation (harness.policies: its key_bits and
    value_bits), or int64 [num_layers, max(kv_heads(config))] (rows of layers with fewer KV heads padded) or one int
    for all: the keys' widths, and the values' too unless `value_bits` (the same shape or one int; None: `bits`)
    gives theirs.

    `scheme`: a harness.schemes.Scheme, or its name with its `options` (harness.schemes.SCHEME_OPTIONS:
    group_size, sink_tokens, residual, ... as keywords).
    `backend`: "torch", "triton" or "auto" (see the module docstring). `simulate`: keep a full-precision working copy for the model's own attention (torch
    backend; see the module docstring). `outside_packed`: "dequantize" or "raise", what an update does outside the
    packed attention (see the module docstring). `key_calibration`: the model's fitted key tables
    (harness.calibrate.keys), which a scheme whose keys read them (calkey) needs: each layer's scheme is bound to
    its layer's table (Scheme.for_layer); without them such a scheme is a one-line ValueError.
    """

    def __init__(
        self,
        config,
        bits: torch.Tensor | int | Allocation,
        scheme: Scheme | str = "asym_token",
        *,
        value_bits: torch.Tensor | int | None = None,
        prefill: str = "exact",
        backend: str = "torch",
        simulate: bool = False,
        key_calibration: KeyCalibration | None = None,
        outside_packed: str = "dequantize",
        **options,
    ):
        if prefill not in PREFILL_MODES:
            raise ValueError(f"quant.prefill: unknown {prefill!r}; allowed: {', '.join(PREFILL_MODES)}")
        if backend not in BACKENDS:
            raise ValueError(f"quant.backend: unknown {backend!r}; allowed: {', '.join(BACKENDS)}")
        check_served(config)
        text_config = config.get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(text_config)
        heads = kv_heads(config)
        shape = (len(types), max(heads))  # (layers, most KV heads of a layer)
        if isinstance(bits, Allocation):
            if value_bits is not None:
                raise ValueError("value_bits: the allocation gives the values' widths; leave value_bits out")
            bits, value_bits = bits.key_bits, bits.value_bits
        bits = _width_grid("bits", bits, shape)
        value_bits = bits if value_bits is None else _width_grid("value_bits", value_bits, shape)
        if isinstance(scheme, Scheme):
            if options:
                raise ValueError(f"{sorted(options)[0]}: the Scheme object carries its options; leave it out")
            self.scheme = scheme
        else:
            self.scheme = get_scheme(scheme, **options)
        self.key_calibration = key_calibration
        self.prefill, self.backend = prefill, check_backend(self.scheme, backend)
        if not isinstance(simulate, bool):
            raise ValueError(f"quant.simulate: {simulate!r} is not allowed; allowed: true, false")
        self.simulate = simulate
        self.outside = OutsidePacked(outside_packed)
        self.key_bits, self.value_bits = bits.clone(), value_bits.clone()
        layers = [
            self._layer(i, t, kw, bits[i, : heads[i]].tolist(), value_bits[i, : heads[i]].tolist())
            for i, (t, kw) in enumerate(zip(types, kwargs))
        ]  # each layer's own KV heads: the rest of its row is padding
        self.scheme.check_widths(
            [
                b
                for layer in layers
                if isinstance(layer, QuantizedLayer)
                for b in (*layer.key_bits, *layer.value_bits)
            ],
            "bits",
        )
        super().__init__(layers=layers)

    def _layer(self, index: int, layer_type: str, kwargs: dict, key_bits: list[int], value_bits: list[int]):
        if layer_type not in ATTENTION_LAYERS:  # recurrent state or a shared layer: the model's own layer
            return DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs)
        widths = (key_bits, value_bits, self.scheme.for_layer(index, self.key_calibration))
        options = (self.prefill, self.backend, self.simulate, index, self.outside)
        if layer_type == "full_attention":
            return QuantizedLayer(*widths, *options)
        return QuantizedSlidingLayer(*widths, kwargs["sliding_window"], *options)

    @classmethod
    def from_prefilled(cls, prefilled: Cache, config, bits, *args, **kwargs) -> QuantizedKVCache:
        """A cache holding, quantized, what a full-precision DynamicCache `prefilled` holds (prefill=exact);
        `bits`, `args` (the scheme) and `kwargs` as the constructor's.

        The prompt's logits and attention came from the full-precision pass; from here on every read goes
        through the quantized form. Linear-attention state is copied unchanged.
        """
        cache = cls(config, bits, *args, **kwargs)
        refusal = cannot_convert(prefilled, cache.scheme)
        if refusal is not None:
            raise ValueError(f"QuantizedKVCache.from_prefilled: {refusal}")
        for i, (src, dst) in enumerate(zip(prefilled.layers, cache.layers)):
            if isinstance(dst, QuantizedLayer):
                if src.keys is None or src.keys.numel() == 0:
                    continue
                if isinstance(dst, QuantizedSlidingLayer):
                    dst.cumulative_length = src.cumulative_length
                    dst.lazy_initialization(src.keys, src.values)
                    dropped = src.cumulative_length - src.keys.shape[-2]  # tokens already out of the window
                    for store in (dst.k_store, dst.v_store):
                        starts_at(store, dropped)
                dst.append(src.keys, src.values)
            elif isinstance(src, (LinearAttentionCacheLayerMixin, DummyLayer)):
                cache.layers[i] = copy.deepcopy(src)
        return cache

    def activate_past_recording(self) -> None:
        """Called by assisted generation and prompt lookup decoding before they drop rejected draft tokens (crop):
        a one-line error, before any token is generated, where a layer cannot drop them exactly (a quantized
        layer's no_rollback); the model's own layers (linear attention) record as in any transformers Cache."""
        for layer in self.quantized_layers():
            layer.check_rollback()
        super().activate_past_recording()

    def quantized_layers(self) -> list[QuantizedLayer]:
        return [layer for layer in self.layers if isinstance(layer, QuantizedLayer)]

    def _graph_layers(self) -> list[QuantizedLayer]:
        """The quantized layers, each a plain full-attention QuantizedLayer initialized on the triton backend (what
        device-side positions need), else a one-line error saying which layer is not."""
        layers = self.quantized_layers()
        for layer in layers:
            if type(layer) is not QuantizedLayer:  # a sliding window or eviction rebuilds the stores
                raise NotImplementedError(
                    f"QuantizedKVCache: layer {layer.layer_idx} is a {type(layer).__name__}, whose stores are "
                    "rebuilt as tokens leave it; device-side positions need plain full-attention layers"
                )
            if (
                layer.fused
                and not isinstance(layer.k_store, PackedStore)
                and not hasattr(layer.k_store, "append_at")
            ):
                raise NotImplementedError(
                    f"QuantizedKVCache: layer {layer.layer_idx} holds {self.scheme.name}'s stores, which the Triton "
                    "kernels do not yet write at device-side positions; decode without graphed_decoding"
                )
            if not layer.fused:
                raise ValueError(
                    f"QuantizedKVCache: layer {layer.layer_idx} is not on the triton backend (or holds no tokens "
                    "yet: prefill first); device-side positions are for the fused decode path"
                )
        if len(layers) != len(self.layers):
            raise NotImplementedError("QuantizedKVCache: device-side positions need every layer quantized")
        return layers

    def reserve(self, tokens: int) -> None:
        """Capacity for `tokens` tokens in every layer's stores (triton backend, after the prefill), so that the
        decode steps up to there never reallocate (what CUDA-graph decoding needs)."""
        for layer in self._graph_layers():
            layer.k_store.reserve(tokens)
            layer.v_store.reserve(tokens)

    def device_positions(self, positions: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Decode steps at device-side positions: (write position, attended length), int32 tensors of one element
        on the cache's device that the caller advances with every step (length = position + 1), or None to go back
        to host lengths. Every layer's host length must equal the position; the steps must fit the reserved
        capacity (`reserve`). The step's launches then do not change from one step to the next."""
        for layer in self.quantized_layers() if positions is None else self._graph_layers():
            layer.device_pos = positions

    def nbytes(self) -> int:
        """Bytes held by the K/V stores (payload, scales, zeros, 16-bit heads at 2 bytes per element)."""
        return sum(layer.nbytes() for layer in self.quantized_layers())

    def nbytes_fp16(self) -> int:
        """Bytes an fp16 DynamicCache would hold for the same tokens (sliding layers at their window)."""
        return sum(layer.nbytes_fp16() for layer in self.quantized_layers())

    def resident_bytes(self) -> int:
        """Measured bytes the cache keeps: the storage of every tensor of every layer (K/V stores with their
        capacity slack and any simulate working copy, linear-attention state), each storage counted once."""
        for layer in self.quantized_layers():
            if isinstance(layer, QuantizedSlidingLayer):
                layer.evict()
        return resident_bytes(self.layers)

    def linear_state_nbytes(self) -> int:
        """Bytes of linear-attention (conv and recurrent) state, kept unquantized and reported apart."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                # dicts: state index -> tensor or None
                for states in (layer.conv_states, layer.recurrent_states):
                    total += sum(t.numel() * 2 for t in states.values() if t is not None)
        return total
