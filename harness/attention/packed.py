"""The attention that reads a harness.cache.QuantizedKVCache's packed K/V directly ("kv_packed").

This module owns the glue between transformers' attention interface and the packed attention kernels, and the
steps that carry a layer's stores to its attention. On the packed paths a cache layer's `update` returns the new
K/V themselves as placeholders and posts a step for them (`post_step`) on the installed `Steps`, by layer index:
- `PackedStep` (the torch backend without quant.simulate, any number of new tokens): this attention hands it
  to kernels/packed_attention.py, which reads the stores blockwise (softcapping included), or, for one new token,
  to the step the scheme gives where its stores allow (pca's fold: harness/schemes/pca_fold.py packed_decode);
- `DecodeStep` (the triton backend, one new token): this attention runs the fused split-KV kernel
  kernels/decode_attention.py over the stores (or the step the scheme gives: pca's fold around it,
  harness/schemes/pca_fold.py); nothing is dequantized into memory.
The attention of layer l reads the step of the layer whose K/V it attends (`kv_source_layer`: itself, or the
layer a KV-sharing layer reuses), and only for the very key tensor that step was posted with: every other call
(prefill, other caches, the exact-prefill first step, a step left from an earlier forward) goes to
transformers' SDPA attention, or to the model's own eager attention where it softcaps its logits (Gemma 2), and
the mask function is SDPA's. The name holds no "sdpa": transformers would refuse it for a model without SDPA. The steps live in the installed context, not on
the tensors, so the per-step path holds no Python attribute on a tensor (what a CUDA graph capture needs).

The fused kernel attends to every stored token of the layer: a sliding layer's store holds its window (the
window - 1 previous tokens and the new one, as DynamicSlidingWindowLayer), and a decode mask may only hide
nothing (no padded batches). GQA: query head i reads KV head i // (Hq // Hkv), as repeat_kv does.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from harness.attention.base import Implementation, active, additive_mask, eager_forward, kv_source_layer
from kernels.layout import PackedStore
from kernels.packed_attention import packed_attention


class DecodeStep:
    """One fused decode step of a layer: its (keys, values) stores as of this step, the new token included.

    The stores are shallow copies taken before a sliding layer evicts its oldest token (eviction rebinds the
    store's tensors, so the copies still hold the whole window this step attends). `take` hands them out to
    every layer that attends them: the owning layer, and the layers that reuse its K/V (Gemma 4's KV sharing).
    """

    def __init__(self, k_store, v_store, length: torch.Tensor | None = None, decode=None):
        self.stores = (k_store, v_store)
        self.length = length  # None, or the attended token count as an int32 device tensor (CUDA graphs)
        # the fused step over the stores: f(q (B, Hq, D), k_store, v_store, sm_scale, length=) -> (B, Hq, D);
        # None: kernels.decode_attention.decode_attention (PackedStores; a scheme's own: Scheme.decode_kernel)
        self.decode = decode
        self.attended = False

    def take(self) -> tuple[PackedStore, PackedStore]:
        self.attended = True
        return self.stores


class PackedStep:
    """One update of a layer on the packed torch path: its (keys, values) stores, the new tokens included.

    `attend` may be called by every layer that reads this layer's K/V (KV sharing); the stores stay valid until
    the layer's next update.
    """

    def __init__(self, k_store, v_store, decode=None):
        self.stores = (k_store, v_store)
        # the scheme's step for one query over these stores without dequantizing them (Scheme.packed_decode), or None
        self.decode = decode
        self.attended = False

    def attend(
        self,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """query (B, Hq, Tq, D) of the last Tq stored tokens -> attention output (B, Tq, Hq, D) in query's dtype.

        attention_mask: the model's mask over the stored tokens (B or 1, 1, Tq, length), bool or additive, or
        None (causal).
        """
        k_store, v_store = self.stores
        if attention_mask is not None and attention_mask.shape[-1] != k_store.length:
            raise ValueError(
                f"attention mask covers {attention_mask.shape[-1]} keys, the layer holds {k_store.length}"
            )
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.float()
        self.attended = True
        if self.decode is not None and query.shape[2] == 1 and softcap is None:
            out = self.decode(query[:, :, 0], k_store, v_store, scaling, attention_mask)  # (B, Hq, D) or None
            if out is not None:
                return out.to(query.dtype).unsqueeze(1)
        out = packed_attention(query, k_store, v_store, scaling, mask=attention_mask, softcap=softcap)
        return out.to(query.dtype).transpose(1, 2).contiguous()


class Steps:
    """The packed attention's state: the step each cache layer's latest update posted, by layer index, with the
    placeholder key it returned (the attention reads a step only for that very key)."""

    def __init__(self):
        self._posted: dict[int, tuple[torch.Tensor, DecodeStep | PackedStep]] = {}

    def post(self, layer_idx: int, key: torch.Tensor, step: DecodeStep | PackedStep | None) -> None:
        if step is None:
            self._posted.pop(layer_idx, None)
        else:
            self._posted[layer_idx] = (key, step)

    def step(self, layer_idx: int, key: torch.Tensor) -> DecodeStep | PackedStep | None:
        """The step posted by layer `layer_idx` with `key` (B, Hkv, Tn, D), or None (key holds real K/V)."""
        posted = self._posted.get(layer_idx)
        return posted[1] if posted is not None and posted[0] is key else None


def post_step(layer_idx: int, key: torch.Tensor, step: DecodeStep | PackedStep | None) -> None:
    """Leave `step` (None: no step) for the attention of layer `layer_idx`'s `key`, on the innermost installed
    Steps. Outside every one the step is never attended, which the layer notices at its next update."""
    steps = active(Steps)
    if steps is not None:
        steps.post(layer_idx, key, step)


def unpacked_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over K/V that hold their values (no step posted): SDPA, or, where the model softcaps its attention
    logits (which SDPA cannot), the model's own eager attention on the same mask. Shapes as packed_forward's."""
    if kwargs.get("softcap") is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    mask = additive_mask(attention_mask, query.shape[2], key.shape[2], query.dtype, query.device)
    out, _ = eager_forward(module)(module, query, key, value, mask, scaling=scaling, **kwargs)
    return out, None


def packed_forward(
    steps: Steps,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, Hq, Tq, D), key/value (B, Hkv, Tk, D) -> (attention output (B, Tq, Hq, D), None)."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            "kv_packed: attention sinks (s_aux) are not supported by the packed attention"
        )
    step = steps.step(kv_source_layer(module), key)
    if step is None:
        return unpacked_forward(module, query, key, value, attention_mask, scaling, **kwargs)
    if isinstance(step, PackedStep):  # the packed torch path: any number of queries, read blockwise
        sm_scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return step.attend(query, attention_mask, sm_scale, kwargs.get("softcap")), None
    if kwargs.get("softcap") is not None:
        raise ValueError("kv_packed: the fused decode kernel does not support attention logit softcapping")
    if step.decode is None:
        from kernels.decode_attention import decode_attention  # imports triton: only for the triton backend

        step.decode = decode_attention
    k_store, v_store = step.take()
    if attention_mask is not None and step.length is not None:
        raise ValueError(
            "kv_packed: a decode step at device-side positions attends every stored token and takes no "
            f"attention mask (got {tuple(attention_mask.shape)}): pass attention_mask=None"
        )
    if attention_mask is not None:
        # (B, 1, 1, L) over the L stored tokens: bool (True = attend) or additive float (0 = attend). The check
        # of the values runs on the device (no host synchronization): on CPU it raises here, on CUDA as a
        # device-side assertion at the next synchronization.
        if attention_mask.shape[-1] != k_store.length:
            raise NotImplementedError(
                f"kv_packed: the decode mask covers {attention_mask.shape[-1]} tokens, the stores hold "
                f"{k_store.length}; the fused decode kernel attends to every stored token"
            )
        visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        torch._assert_async(visible.all(), "kv_packed: the fused decode kernel attends to every stored token")
    sm_scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = step.decode(query[:, :, 0], k_store, v_store, sm_scale, length=step.length)  # (B, Hq, D)
    return out.unsqueeze(1), None


# Quantized caches are attended from their packed form; everything else through SDPA.
PACKED = Implementation("kv_packed", packed_forward, sdpa_mask, new_state=Steps)
