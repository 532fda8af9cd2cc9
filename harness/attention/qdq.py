"""Quantize-then-dequantize attention with no KV cache: how the claim's own numbers were measured ("harness_claim_qdq").

Installed with a `QDQSpec` as its state (`installed(model, QDQ, spec)`), every attention layer of the model
replaces its keys and values (B, Hkv, T, D) by their quantize-dequantize at the width of each (layer, KV head)
in `spec.bits` (kernels/reference.py's packed-format oracle; 16 leaves a head untouched), then calls the model's
own eager attention, so masks, sliding windows and softcapping stay the model's. With `spec.topk_factor = f`,
each attention row then keeps only its ceil(visible / f) largest weights, renormalized (the claim's top-k mask,
counted there as f-fold eviction; it frees no memory), and the output is recomputed from those weights.
Linear-attention layers never call attention: they are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.masking_utils import eager_mask

from harness.attention.base import Implementation, eager_forward, kv_source_layer
from kernels import reference
from kernels.layout import FULL_WIDTH


@dataclass(frozen=True, eq=False)
class QDQSpec:
    """What the QDQ attention applies: widths per (layer, KV head), scheme, and the optional top-k mask."""

    bits: torch.Tensor  # int64 [num_layers, num_kv_heads]; 16 = unquantized; padded past a layer's Hkv
    group_size: int = 32
    symmetric: bool = False
    topk_factor: int | None = None  # keep ceil(visible / topk_factor) weights per attention row


def qdq_heads(x: torch.Tensor, bits: list[int], group_size: int, symmetric: bool) -> torch.Tensor:
    """x (B, Hkv, T, D) with head h replaced by its quantize-dequantize at bits[h] (16: unchanged)."""
    assert x.shape[1] == len(bits), f"{x.shape[1]} KV heads but {len(bits)} widths"
    heads = [
        x[:, h] if b == FULL_WIDTH else reference.fake_quantize(x[:, h], b, group_size, symmetric)
        for h, b in enumerate(bits)
    ]  # each (B, T, D)
    return torch.stack(heads, dim=1)


def top_k_rows(weights: torch.Tensor, visible: torch.Tensor, factor: int) -> torch.Tensor:
    """Keep the ceil(n / factor) largest weights of each row (n = its visible keys), renormalized.

    weights (B, H, Tq, Tk) post-softmax; visible bool broadcastable to it (True = the mask lets the query see
    the key). Ties go to the earlier key, so exactly that many weights survive per row.
    """
    visible = visible.expand_as(weights)
    keep = (visible.sum(-1, keepdim=True) + factor - 1) // factor  # (B, H, Tq, 1) ceil(n / factor)
    order = weights.masked_fill(~visible, -1.0).argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
    kept = weights * (ranks < keep)
    return kept / kept.sum(-1, keepdim=True)


def qdq_forward(spec: QDQSpec, module, query, key, value, attention_mask, **kwargs):
    """query (B, Hq, Tq, D), key/value (B, Hkv, Tk, D) -> (output (B, Tq, Hq, D), weights (B, Hq, Tq, Tk)).

    A KV-sharing layer receives its source layer's K/V before quantization, and quantizes them at the
    source layer's widths (its own row of widths is empty: it caches nothing)."""
    bits = spec.bits[kv_source_layer(module), : key.shape[1]].tolist()  # past its Hkv heads: padding
    key = qdq_heads(key, bits, spec.group_size, spec.symmetric)
    value = qdq_heads(value, bits, spec.group_size, spec.symmetric)
    out, weights = eager_forward(module)(module, query, key, value, attention_mask, **kwargs)
    if spec.topk_factor is None:
        return out, weights
    if attention_mask is None:
        visible = torch.ones_like(weights, dtype=torch.bool)
    else:  # eager_mask: 0 where the query sees the key, the dtype's minimum elsewhere
        visible = attention_mask[:, :, :, : key.shape[-2]] == 0  # (B, 1, Tq, Tk)
    weights = top_k_rows(weights, visible, spec.topk_factor)
    values = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)  # (B, Hq, Tk, D), as repeat_kv
    return (weights.to(values.dtype) @ values).transpose(1, 2).contiguous(), weights


QDQ = Implementation("harness_claim_qdq", qdq_forward, eager_mask)
