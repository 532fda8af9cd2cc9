"""Installing one of this project's attention implementations on a model for the length of a block.

An `Implementation` is a named attention function with transformers' attention-interface signature, its
per-run state passed first, and the mask function it wants. `installed(model, implementation, state)`
- registers the function, bound to `state`, and its mask function with transformers under the
  implementation's name (AttentionInterface, AttentionMaskInterface);
- switches the model to that name (set_attn_implementation);
- adds `state` to the installed states, which cache layers reach through `active(kind)` (a cache layer sees
  neither the model nor its attention: it leaves there, by layer index, what the attention must read);
and on exit, exceptions included, restores the model's previous implementation, the registry entries under
that name as they were (removed if there were none), and the installed states as they were.
Nothing is registered by importing this package: only inside `installed`.

This module also owns what every implementation shares: the model's own eager attention function
(`eager_forward`), the additive mask it takes (`additive_mask`) and the layer whose K/V an attention module reads
(`kv_source_layer`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

_ABSENT = object()


@dataclass(frozen=True)
class Implementation:
    """A named attention implementation.

    forward(state, module, query (B, Hq, Tq, D), key (B, Hkv, Tk, D), value (B, Hkv, Tk, D), attention_mask,
    **kwargs) -> (output (B, Tq, Hq, D), weights or None); mask: the transformers mask function it wants
    (sdpa_mask, eager_mask); new_state: makes the state `installed` uses when given none (None: no state).
    """

    name: str
    forward: Callable
    mask: Callable
    new_state: Callable[[], object] | None = None


class _Entry:
    """One `installed` block's place among the installed states (removed by identity, even out of order)."""

    def __init__(self, state):
        self.state = state


_INSTALLED: list[_Entry] = []  # the installed blocks, innermost last


def active(kind: type) -> object | None:
    """The state of type `kind` of the innermost installed block that has one, or None."""
    return next((e.state for e in reversed(_INSTALLED) if isinstance(e.state, kind)), None)


@contextmanager
def _registered(name: str, forward: Callable, mask: Callable) -> Iterator[None]:
    """`forward` and `mask` registered under `name` within the block; the entries before it restored after."""
    # transformers' registries are class-level dicts (masking_utils checks the mask one's `_global_mapping`
    # itself); register() is their public setter, and they have no public remover.
    tables = (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping)
    saved = [table.get(name, _ABSENT) for table in tables]
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, mask)
    try:
        yield
    finally:
        for table, value in zip(tables, saved):
            if value is _ABSENT:
                table.pop(name, None)
            else:
                table[name] = value


@contextmanager
def installed(model, implementation: Implementation, state=None) -> Iterator[object]:
    """Within the block `model` attends through `implementation` with `state` (None: a new_state() one, for an
    implementation that makes one); yields the state. Everything is as it was after the block, exceptions
    included."""
    if state is None:
        if implementation.new_state is None:
            raise ValueError(f"{implementation.name}: installed needs the state this implementation reads")
        state = implementation.new_state()
    previous = model.config._attn_implementation
    with _registered(implementation.name, partial(implementation.forward, state), implementation.mask):
        entry = _Entry(state)
        _INSTALLED.append(entry)
        try:
            model.set_attn_implementation(implementation.name)
            yield state
        finally:
            model.set_attn_implementation(previous)
            _INSTALLED.remove(entry)


def eager_forward(module) -> Callable:
    """The eager attention function of `module`'s own modeling file (its masks, softcapping and sinks)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def additive_mask(
    attention_mask: torch.Tensor | None, q_len: int, k_len: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """The additive float mask (B or 1, 1, Tq, Tk) eager attention adds to its logits (0 = attend), from SDPA's
    mask: bool (True = attend), additive, or None (skipped: causal, the last query aligned with the last key)."""
    if attention_mask is None:
        query = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
        attention_mask = (torch.arange(k_len, device=device)[None, :] <= query)[None, None]  # (1, 1, Tq, Tk)
    if attention_mask.dtype != torch.bool:
        return attention_mask.to(dtype)
    return torch.where(attention_mask, 0.0, torch.finfo(dtype).min).to(dtype)


def kv_source_layer(module) -> int:
    """The layer whose K/V `module` attends: its own, or, for a layer that reuses another layer's K/V (Gemma 4's
    KV sharing), the last earlier layer of its type that stores them (transformers' kv_sharing_modes)."""
    if not getattr(module, "is_kv_shared_layer", False):
        return module.layer_idx
    config = module.config
    kinds, modes = config.layer_types, config.kv_sharing_modes
    own = kinds[module.layer_idx]
    return next(i for i, (kind, mode) in enumerate(zip(kinds, modes)) if kind == own and mode == "store")
