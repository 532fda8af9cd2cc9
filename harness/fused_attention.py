"""The attention implementation that reads the packed KV cache directly on decode steps ("kv_packed_sdpa").

A key tagged with a harness.cache.PackedStep (the packed torch path, any number of queries) is attended by
kernels/packed_attention.py through the step; what follows is the triton backend's fused decode.

This module owns the glue between transformers' attention interface and kernels/decode_attention.py. With a
harness.cache.QuantizedKVCache on the triton backend, a decode step's `update` returns the new K/V as
placeholders, the key tagged with a DecodeStep holding that layer's (keys, values) stores (the layer is
found through the key the model hands over, so no global state is involved). This attention then runs the
fused split-KV kernel over those stores: nothing is dequantized into memory. Every other call (prefill,
other caches, the torch backend, the exact-prefill first step) goes to transformers' SDPA attention, and
the mask function is SDPA's.

The kernel attends to every stored token of the layer: a sliding layer's store holds its window (the
window - 1 previous tokens and the new one, as DynamicSlidingWindowLayer), and a decode mask may only hide
nothing (no padded batches). GQA: query head i reads KV head i // (Hq // Hkv), as repeat_kv does.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from harness.cache import PackedStep, decode_step
from kernels.decode_attention import decode_attention

NAME = "kv_packed_sdpa"


def kv_packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, Hq, Tq, D), key/value (B, Hkv, Tk, D) -> (attention output (B, Tq, Hq, D), None)."""
    step = decode_step(key)
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if isinstance(step, PackedStep):  # the packed torch path: any number of queries, read blockwise
        sm_scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return step.attend(query, attention_mask, sm_scale, kwargs.get("softcap")), None
    if kwargs.get("softcap") is not None:
        raise ValueError(
            "kv_packed_sdpa: the fused decode kernel does not support attention logit softcapping"
        )
    k_store, v_store = step.take()
    if attention_mask is not None:
        # (B, 1, 1, L) over the L stored tokens: bool (True = attend) or additive float (0 = attend). The check
        # of the values runs on the device (no host synchronization): on CPU it raises here, on CUDA as a
        # device-side assertion at the next synchronization.
        if attention_mask.shape[-1] != k_store.length:
            raise NotImplementedError(
                f"kv_packed_sdpa: the decode mask covers {attention_mask.shape[-1]} tokens, the stores hold "
                f"{k_store.length}; the fused decode kernel attends to every stored token"
            )
        visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        torch._assert_async(
            visible.all(), "kv_packed_sdpa: the fused decode kernel attends to every stored token"
        )
    sm_scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = decode_attention(query[:, :, 0], k_store, v_store, sm_scale)  # (B, Hq, D)
    return out.unsqueeze(1), None


AttentionInterface.register(NAME, kv_packed_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use_fused_attention(model) -> None:
    """Switch `model` to the fused decode attention (prefill and other caches still go through SDPA)."""
    model.set_attn_implementation(NAME)
