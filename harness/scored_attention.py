"""The attention implementation that reports attention probabilities to score-based eviction ("kv_scored_sdpa").

This module owns the glue between transformers' attention interface and harness/eviction.py's H2O-style
scores. An evicting layer that needs scores tags the key tensor its `update` returns with itself (attribute
SCORER_ATTR); this attention then
- computes the output exactly as the model's usual attention would (harness/fused_attention.py's
  kv_packed_attention: SDPA, or the fused packed decode for triton-backed decode steps), so eviction that
  evicts nothing changes no logit;
- for a tagged key, also runs the model's own eager attention over the same K/V and mask (softcapping and
  the model's other details included) for its probabilities p (B, Hq, Tq, Tk), and hands the layer their
  column sums over query heads and query positions, sum_{h, i} p[b, h, i, j] (B, Tk).
The probabilities are computed on top of the output: scoring costs one more attention pass per scored layer.
That pass runs in float32 whatever the model's dtype (bfloat16 queries and keys are upcast), so the scores that
rank tokens are not rounded to bfloat16.
The mask function is SDPA's; where SDPA's mask is skipped (None: causal or a single query), the eager pass gets
the causal mask aligned to the last key, which is what SDPA then applies.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from harness.fused_attention import kv_packed_attention

# The attribute of a key tensor returned by an h2o layer's update (harness/eviction.py): the layer, which this
# attention hands the attention probabilities' column sums to.
SCORER_ATTR = "_kv_eviction_scorer"

NAME = "kv_scored_sdpa"


def _additive_mask(
    attention_mask: torch.Tensor | None, q_len: int, k_len: int, dtype, device
) -> torch.Tensor:
    """The additive float mask (B or 1, 1, Tq, Tk) eager attention adds to its logits (0 = attend)."""
    if attention_mask is None:  # SDPA's skipped mask: causal, the last query aligned with the last key
        query = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
        attention_mask = (torch.arange(k_len, device=device)[None, :] <= query)[None, None]  # (1, 1, Tq, Tk)
    if attention_mask.dtype != torch.bool:
        return attention_mask.to(dtype)
    return torch.where(attention_mask, 0.0, torch.finfo(dtype).min).to(dtype)


def scored_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, Hq, Tq, D), key/value (B, Hkv, Tk, D) -> (attention output (B, Tq, Hq, D), None)."""
    out, _ = kv_packed_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    scorer = getattr(key, SCORER_ATTR, None)
    if scorer is not None:
        eager = sys.modules[type(module).__module__].eager_attention_forward
        mask = _additive_mask(attention_mask, query.shape[2], key.shape[2], torch.float32, query.device)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        kwargs.pop("dropout", None)
        q, k, v = query.float(), key.float(), value.float()  # no-ops in a float32 model
        _, weights = eager(module, q, k, v, mask, scaling=scaling, dropout=0.0, **kwargs)
        scorer.record_attention(weights.sum(dim=(1, 2)))  # (B, Hq, Tq, Tk) float32 -> (B, Tk)
    return out, None


AttentionInterface.register(NAME, scored_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


@contextlib.contextmanager
def scoring_attention(model, enabled: bool = True):
    """Within the block, `model` attends through kv_scored_sdpa (when `enabled`); its previous one after."""
    previous = model.config._attn_implementation
    if enabled:
        model.set_attn_implementation(NAME)
    try:
        yield model
    finally:
        if enabled:
            model.set_attn_implementation(previous)
