"""The attention that reports attention probabilities to score-based eviction ("kv_scored").

This module owns the glue between transformers' attention interface and harness/cache/eviction.py's H2O-style
scores. An evicting layer that needs scores posts itself, with the key tensor its `update` returns, on the
installed `Scores` (`post_scorer`, by layer index); this attention then
- computes the output exactly as the model's usual attention would (harness/attention/packed.py's
  packed_forward: SDPA, or the packed attentions for the steps posted on the same state), so eviction that
  evicts nothing changes no logit;
- for that key, also runs the model's own eager attention over the same K/V and mask (softcapping and the
  model's other details included) for its probabilities p (B, Hq, Tq, Tk), and hands the layer their column
  sums over query heads and query positions, sum_{h, i} p[b, h, i, j] (B, Tk).
The probabilities are computed on top of the output: scoring costs one more attention pass per scored layer.
That pass runs in float32 whatever the model's dtype (bfloat16 queries and keys are upcast), so the scores that
rank tokens are not rounded to bfloat16.
The mask function is SDPA's; where SDPA's mask is skipped (None: causal or a single query), the eager pass gets
the causal mask aligned to the last key, which is what SDPA then applies.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import sdpa_mask

from harness.attention.base import Implementation, active, additive_mask, eager_forward, kv_source_layer
from harness.attention.packed import Steps, packed_forward


class Scores(Steps):
    """The scored attention's state: the packed steps, and the layer each scoring layer's latest update posted
    (by layer index, with the key it returned) to receive its attention's column sums (`record_attention`)."""

    def __init__(self):
        super().__init__()
        self._scorers: dict[int, tuple[torch.Tensor, object]] = {}

    def post_scorer(self, layer_idx: int, key: torch.Tensor, scorer) -> None:
        self._scorers[layer_idx] = (key, scorer)

    def scorer(self, layer_idx: int, key: torch.Tensor):
        """The layer that posted `key` (B, Hkv, Tk, D) for scores, or None."""
        posted = self._scorers.get(layer_idx)
        return posted[1] if posted is not None and posted[0] is key else None


def post_scorer(layer_idx: int, key: torch.Tensor, scorer) -> None:
    """Ask for the attention probabilities of layer `layer_idx`'s `key` on the innermost installed Scores.
    Outside every one no scores come, which the scoring layer notices at its next update."""
    scores = active(Scores)
    if scores is not None:
        scores.post_scorer(layer_idx, key, scorer)


def scored_forward(
    scores: Scores,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query (B, Hq, Tq, D), key/value (B, Hkv, Tk, D) -> (attention output (B, Tq, Hq, D), None)."""
    out, _ = packed_forward(scores, module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    scorer = scores.scorer(kv_source_layer(module), key)
    if scorer is not None:
        mask = additive_mask(attention_mask, query.shape[2], key.shape[2], torch.float32, query.device)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        kwargs.pop("dropout", None)
        q, k, v = query.float(), key.float(), value.float()  # no-ops in a float32 model
        _, weights = eager_forward(module)(module, q, k, v, mask, scaling=scaling, dropout=0.0, **kwargs)
        scorer.record_attention(weights.sum(dim=(1, 2)))  # (B, Hq, Tq, Tk) float32 -> (B, Tk)
    return out, None


SCORED = Implementation("kv_scored", scored_forward, sdpa_mask, new_state=Scores)
