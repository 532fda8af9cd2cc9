"""What a model gives on its calibration windows, for every fit of harness.calibrate: which decoder layers hold
a KV cache of their own (`layer_types`), each cached layer's keys and values at their positions
(`calibration_vectors`), the gradient of the windows' loss at each key (`calibration_key_gradients`), the model's
rotary frequencies, and keys turned back before RoPE (`unturn`).

The calibration windows (C, Tc) run through the model with a transformers DynamicCache, one window at a time;
each layer with a KV cache of its own gives the keys and values it cached: keys post-RoPE, as they reach a
QuantizedKVCache, at their positions in the window. Position 0 of every window (the BOS token where the windows
carry one, an attention sink either way) is left out: its keys are unlike any other position's, and
quant.sink_tokens=1 keeps it in fp16. A sliding-window layer gives the keys its window still holds. Evaluation
windows are never read.

The rotary frequencies are the model's own (the inv_freq buffer of its rotary embedding, per layer type where it
has several); a model without one (gpt2) has none, and its channels are fitted alone. In transformers'
rotate_half layout the first R channels of a head form pairs (i, i + R / 2) that RoPE turns together, by
p * inv_freq[i] radians at position p.

The key gradients take one more pass per window with autograd on: the summed next-token NLL of the window's own
text, differentiated at each layer's post-RoPE keys (the graph starts at the input embeddings, so no weight
gradient is ever formed); they line up with the keys `calibration_keys` gives.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "sliding"}


def layer_types(config) -> list[str]:
    """'full', 'sliding' or 'linear' per decoder layer, from the cache layer types transformers gives it
    (get_layer_types_and_kwargs). 'linear' = any layer without a KV cache of its own: linear attention, or a
    layer that reuses another layer's K/V (KV sharing)."""
    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return [LAYER_TYPES.get(t, "linear") for t in types]


def rotary_frequencies(model, layer_type: str) -> torch.Tensor:
    """The radians per position of each rotary pair of a layer of `layer_type`: float32 (R / 2,), R the channels
    RoPE turns (pairs (i, i + R / 2), rotate_half layout); empty for a model without rotary embeddings."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            buffers = dict(module.named_buffers(recurse=False))
            inv_freq = buffers.get(f"{layer_type}_inv_freq", buffers.get("inv_freq"))
            if inv_freq is not None:
                return inv_freq.detach().float().cpu()
    return torch.zeros(0)


@torch.no_grad()
def calibration_vectors(
    model, input_ids: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Per decoder layer, the post-RoPE keys and the values it cached for input_ids (C, Tc) and their positions,
    position 0 of each window left out: (keys float32 (N, Hkv, D), values float32 (N, Hkv, Dv), positions int64
    (N,)); None for a layer without a KV cache of its own."""
    kinds = layer_types(model.config)
    found: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in kinds]
    for window in input_ids:
        cache = DynamicCache(config=model.config)
        model(input_ids=window[None].to(model.device), past_key_values=cache, use_cache=True)
        for i, kind in enumerate(kinds):
            if kind == "linear":
                continue
            k = cache.layers[i].keys[0].float()  # (Hkv, T_held, D): the last T_held positions of the window
            v = cache.layers[i].values[0].float()
            at = torch.arange(window.shape[0] - k.shape[1], window.shape[0])
            keep = at > 0
            found[i].append((k.transpose(0, 1)[keep].cpu(), v.transpose(0, 1)[keep].cpu(), at[keep]))
    return [tuple(torch.cat(part) for part in zip(*layer)) if layer else None for layer in found]


def calibration_keys(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per decoder layer, the post-RoPE keys it cached for input_ids (C, Tc) and their positions, position 0 of each
    window left out: (float32 (N, Hkv, D), int64 (N,)); None for a layer without a KV cache of its own."""
    return [
        None if layer is None else (layer[0], layer[2]) for layer in calibration_vectors(model, input_ids)
    ]


class _KeyRecorder(DynamicCache):
    """A DynamicCache that keeps the key states each layer hands it (post-RoPE, in the autograd graph)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.given: dict[int, torch.Tensor] = {}  # layer -> (1, Hkv, T, D)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.given[layer_idx] = key_states
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def calibration_key_gradients(model, input_ids: torch.Tensor) -> list[torch.Tensor | None]:
    """Per decoder layer, the gradient of the windows' summed next-token NLL at each key calibration_keys gives,
    in its order: float32 (N, Hkv, D), post-RoPE like the keys; None for a layer without a KV cache of its own.
    Each window runs alone, the weights' own gradients are never formed (the graph starts at the embeddings)."""
    kinds = layer_types(model.config)
    gradients: list[list[torch.Tensor]] = [[] for _ in kinds]
    cached = [i for i, kind in enumerate(kinds) if kind != "linear"]
    for window in input_ids:
        ids = window[None].to(model.device)  # (1, Tc)
        cache = _KeyRecorder(model.config)
        with torch.enable_grad():
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_()  # (1, Tc, hidden)
            logits = model(inputs_embeds=embeds, past_key_values=cache, use_cache=True).logits  # (1, Tc, V)
            nll = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
            found = torch.autograd.grad(nll, [cache.given[i] for i in cached])
        for i, g in zip(cached, found):
            held = cache.layers[i].keys.shape[-2]  # a sliding layer holds the window's last positions only
            at = torch.arange(window.shape[0] - held, window.shape[0])
            gradients[i].append(g[0, :, -held:].float().transpose(0, 1)[at > 0].cpu())  # (T, Hkv, D)
    return [torch.cat(g) if g else None for g in gradients]


def unturned_pairs(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The rotary pairs (i, i + R / 2) of x (N, H, D) at sequence `positions` (N,) as complex numbers turned back
    by positions * inv_freq[i] radians: complex128 (N, H, R / 2)."""
    half = inv_freq.shape[0]
    turn = positions.double()[:, None] * inv_freq.double()  # (N, half)
    z = torch.complex(x[..., :half].double(), x[..., half : 2 * half].double())
    return z * torch.polar(torch.ones_like(turn), -turn)[:, None]


def unturn(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (N, H, D) float32 at sequence `positions` (N,) turned back to position 0: a post-RoPE key to its pre-RoPE
    value, and the gradient at a post-RoPE key to the gradient at its pre-RoPE value (RoPE is a rotation); float32
    (N, H, D), channels past R unchanged."""
    half = inv_freq.shape[0]
    out = x.clone()
    if half:
        z = unturned_pairs(x, positions, inv_freq)
        out[..., :half], out[..., half : 2 * half] = z.real.float(), z.imag.float()
    return out
