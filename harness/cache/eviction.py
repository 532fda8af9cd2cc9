"""Token eviction that frees cache memory, composed with quantization (`eviction.*` in the config).

Policies (`eviction.name`), applied per full-attention layer of a harness.cache.QuantizedKVCache:
- `none` (default): nothing is evicted.
- `streaming` (StreamingLLM, Xiao et al. 2023): keep the first `sink_tokens` tokens and the most recent ones.
- `h2o` (Heavy-Hitter Oracle, Zhang et al. 2023): keep the sinks, a recent window, and the tokens with the largest
  accumulated attention: the sum of their attention probabilities over the layer's query heads and every query
  position so far (harness/attention/scored.py computes them; the model must run inside
  `attention_for(model, spec)`). One token set per layer and batch row, shared by all KV heads: per-head sets would
  break the token-major packed layout (kernels/layout.py), so a token stays if the layer as a whole needs it.
Budget: after eviction a layer that has seen S tokens holds n(S) = min(S, max(ceil(keep * S), sink_tokens + 1))
tokens (`eviction.keep` in (0, 1]: 0.33 keeps a third, "3x"). h2o gives floor(recent * (n - sink_tokens)) of
them to the most recent tokens (`eviction.recent` in [0, 1]) and the rest to the top-scored older ones;
streaming gives all of them to the most recent tokens.
When: a layer evicts at the start of its next update, so the step that stored a token still attended it; the
bytes reported (`nbytes`) are those held once that pending eviction is applied, and `nbytes_fp16` counts every
token seen, so the runner's compression_true is quantization times eviction, in bytes actually held.
Kept tokens keep their positions (keys are stored after RoPE) and the attention mask shows every kept token to
every new query; every full-attention layer holds the same count, so the one mask transformers builds for them
all fits each. h2o layers run the torch path with quant.simulate's full-precision working copy (the packed
attentions return no probabilities), so their resident bytes are those of an unquantized cache.
Sliding-window layers cap themselves and are left alone, as are linear-attention layers.
Beam search takes an evicting layer's rows with their kept positions and scores; dropping tokens again (crop:
assisted generation, prompt lookup decoding) is refused, since the evictions and scores counted them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.attention import PACKED, SCORED, installed, post_scorer
from harness.cache.quantized import QuantizedKVCache, QuantizedLayer
from harness.config import Point
from harness.registry import unknown_name_message

POLICIES = ("none", "streaming", "h2o")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class EvictionSpec:
    """One eviction setting: policy name, kept fraction, sink tokens, recent share of the budget (h2o)."""

    name: str = "none"
    keep: float = 1.0
    sink_tokens: int = 4
    recent: float = 0.5

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(unknown_name_message("eviction.name", self.name, list(POLICIES)))
        if not (_is_number(self.keep) and 0 < self.keep <= 1):
            raise ValueError(f"eviction.keep: {self.keep!r} must be a number in (0, 1]")
        if (
            not (isinstance(self.sink_tokens, int) and not isinstance(self.sink_tokens, bool))
            or self.sink_tokens < 0
        ):
            raise ValueError(f"eviction.sink_tokens: {self.sink_tokens!r} is not a non-negative integer")
        if not (_is_number(self.recent) and 0 <= self.recent <= 1):
            raise ValueError(f"eviction.recent: {self.recent!r} must be a number in [0, 1]")

    @classmethod
    def from_point(cls, point: Point) -> EvictionSpec:
        """The spec of a grid point (its eviction fields, harness.config)."""
        return cls(point.eviction, point.evict_keep, point.evict_sinks, point.evict_recent)

    @property
    def active(self) -> bool:
        """Whether layers are wrapped (keep=1 wraps too: it evicts nothing through the same machinery)."""
        return self.name != "none"

    @property
    def needs_scores(self) -> bool:
        return self.active and self.name == "h2o"

    def budget(self, seen: int) -> int:
        """Tokens a layer holds after eviction once it has seen `seen` tokens."""
        if not self.active:
            return seen
        # The epsilon keeps float error from adding a token: 0.33 * 300 is 99.00000000000001.
        return min(seen, max(math.ceil(self.keep * seen - 1e-9), self.sink_tokens + 1))


def streaming_index(length: int, n_keep: int, sinks: int, batch: int) -> torch.Tensor:
    """Stored-token indices (B, n_keep) StreamingLLM keeps of `length`: the first `sinks` and the most recent."""
    kept = torch.cat([torch.arange(sinks), torch.arange(length - (n_keep - sinks), length)])  # (n_keep,)
    return kept.expand(batch, n_keep)


def h2o_index(scores: torch.Tensor, n_keep: int, sinks: int, n_recent: int) -> torch.Tensor:
    """Stored-token indices (B, n_keep), sorted, H2O keeps given accumulated scores (B, length): the first
    `sinks`, the last `n_recent`, and the top-scored n_keep - sinks - n_recent of the tokens in between."""
    B, length = scores.shape
    heavy = n_keep - sinks - n_recent
    assert 0 <= heavy <= length - sinks - n_recent, (scores.shape, n_keep, sinks, n_recent)
    middle = scores[:, sinks : length - n_recent].topk(heavy, dim=1).indices + sinks  # (B, heavy)
    fixed = torch.cat([torch.arange(sinks), torch.arange(length - n_recent, length)]).to(scores.device)
    return torch.cat([fixed.expand(B, -1), middle], dim=1).sort(dim=1).values  # (B, n_keep)


class EvictingLayer(QuantizedLayer):
    """A full-attention QuantizedLayer that evicts tokens by `spec` at the start of each update.

    Tracks `seen` (tokens ever stored), `positions` (B, length): the original position of each stored token, and,
    for h2o, `scores` (B, length): its accumulated attention (float32).
    """

    @classmethod
    def wrap(cls, layer: QuantizedLayer, spec: EvictionSpec) -> EvictingLayer:
        """An evicting layer that takes over `layer`'s state (stores, options, tokens already held)."""
        if layer.is_sliding:
            raise ValueError("eviction applies to full-attention layers; sliding layers cap themselves")
        evicting = cls.__new__(cls)
        vars(evicting).update(vars(layer))  # whatever QuantizedLayer's constructor set, stores included
        evicting.spec = spec
        held = layer.get_seq_length()
        if spec.needs_scores and held:
            raise ValueError(
                "eviction=h2o needs the attention every stored token received: build the cache empty and "
                "prefill through it (not QuantizedKVCache.from_prefilled)"
            )
        if spec.needs_scores:  # the scores need probabilities: the packed attentions return none
            evicting.backend, evicting.simulate = "torch", True
        batch = 1 if layer.k_store is None else layer.k_store.batch
        evicting.seen = held
        evicting.positions = torch.arange(held).expand(batch, held)
        evicting.scores = None
        evicting._scores_due = False
        return evicting

    def update(self, key_states, value_states, *args, **kwargs):
        self.evict()
        B, _, Tn, _ = key_states.shape  # (B, Hkv, Tn, D)
        new_positions = torch.arange(self.seen, self.seen + Tn).expand(B, Tn)
        self.positions = torch.cat([self.positions.expand(B, -1), new_positions], dim=1)  # (B, length)
        self.seen += Tn
        keys, values = self._store(key_states, value_states)
        if self.spec.needs_scores:
            new_scores = torch.zeros(B, Tn, device=key_states.device)
            self.scores = new_scores if self.scores is None else torch.cat([self.scores, new_scores], dim=1)
            post_scorer(self.layer_idx, keys, self)
            self._scores_due = True
        return keys, values

    def record_attention(self, column_sums: torch.Tensor) -> None:
        """Add one attention call's probabilities summed over query heads and positions (B, length)."""
        assert column_sums.shape == self.scores.shape, (column_sums.shape, self.scores.shape)
        self.scores += column_sums
        self._scores_due = False

    def evict(self) -> None:
        """Drop the tokens the budget no longer pays for (a no-op when the layer holds no more than n(seen))."""
        if self._scores_due:
            raise RuntimeError(
                "eviction=h2o: the last update's attention reported no scores; run the model inside "
                "harness.cache.eviction.attention_for(model, spec)"
            )
        length = self._held()
        n_keep = self.spec.budget(self.seen)
        if length <= n_keep:
            return
        sinks = self.spec.sink_tokens
        if self.spec.needs_scores:
            n_recent = math.floor(self.spec.recent * (n_keep - sinks))
            index = h2o_index(self.scores, n_keep, sinks, n_recent)  # (B, n_keep)
            self.scores = self.scores.gather(1, index)
        else:
            index = streaming_index(length, n_keep, sinks, self.k_store.batch)
        self.k_store.select(index)
        self.v_store.select(index)
        self.positions = self.positions.expand(index.shape[0], -1).gather(1, index.to(self.positions.device))

    def _held(self) -> int:
        return 0 if self.k_store is None else self.k_store.length

    def take_rows(self, index: torch.Tensor) -> None:
        """Keep the batch rows at index (n,) (beam search): the stores', their positions' and scores' rows."""
        batch = 0 if self.k_store is None else self.k_store.batch
        super().take_rows(index)
        if batch:
            self.positions = self.positions.expand(batch, -1).index_select(0, index.to(self.positions.device))
            if self.scores is not None:
                self.scores = self.scores.index_select(0, index.to(self.scores.device))

    @property
    def no_rollback(self) -> str | None:
        return (
            f"eviction={self.spec.name} keeps no record of what a dropped token changed (eviction=none can)"
        )

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # What the next update attends: the tokens held after its eviction, then the new ones. The kept tokens sit
        # at mask columns seen - held .. seen - 1, before every new query, so the causal mask shows all of them.
        held = min(self.spec.budget(self.seen), self._held())
        return held + query_length, self.seen - held

    def reset(self) -> None:
        super().reset()
        self.seen, self.scores, self._scores_due = 0, None, False
        self.positions = torch.zeros(1, 0, dtype=torch.long)

    def nbytes(self) -> int:
        """Bytes held once the pending eviction is applied (the one the next update would apply)."""
        self.evict()
        return super().nbytes()

    def nbytes_fp16(self) -> int:
        """Bytes an fp16 cache without eviction would hold: every token seen."""
        length = self._held()
        return super().nbytes_fp16() * self.seen // length if length else 0

    def kept_tokens(self) -> tuple[int, int]:
        """(tokens held once the pending eviction is applied, tokens seen), summed over batch rows."""
        self.evict()
        batch = 0 if self.k_store is None else self.k_store.batch
        return self._held() * batch, self.seen * batch


def with_eviction(cache: QuantizedKVCache, spec: EvictionSpec) -> QuantizedKVCache:
    """`cache` with its full-attention layers evicting by `spec` (in place; returned for chaining).

    No-op for `none`. h2o needs the model to run inside `attention_for(model, spec)`.
    """
    if spec.active:
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, QuantizedLayer) and not layer.is_sliding:
                cache.layers[i] = EvictingLayer.wrap(layer, spec)
    return cache


def kept_fraction(caches: list[QuantizedKVCache]) -> float:
    """Share of the tokens seen by full-attention layers that they still hold (1.0 without eviction)."""
    held = seen = 0
    for cache in caches:
        for layer in cache.layers:
            if isinstance(layer, EvictingLayer):
                h, s = layer.kept_tokens()
                held, seen = held + h, seen + s
    return held / seen if seen else 1.0


def attention_for(model, spec: EvictionSpec):
    """A context in which `model` attends so that quantized caches evicting by `spec` work: the scored
    attention for h2o, the packed one otherwise (harness.attention)."""
    return installed(model, SCORED if spec.needs_scores else PACKED)
