"""calkey's key tables (harness/schemes/key_table.py) fitted on a model's calibration windows, and their on-disk
cache.

The calibration windows (C, Tc) run through the model with a transformers DynamicCache, one window at a time;
each layer with a KV cache of its own gives the keys (and values: `calibration_vectors`, which harness/
pca_calibration.py fits on too) it cached: post-RoPE, as they reach a QuantizedKVCache, at their positions in the
window. Position 0 of every window (the BOS token where the windows carry one, an attention
sink either way) is left out: its keys are unlike any other position's, and quant.sink_tokens=1 keeps it in fp16.
A sliding-window layer gives the keys its window still holds. Evaluation windows are never read.

The rotary frequencies are the model's own (the inv_freq buffer of its rotary embedding, per layer type where it
has several); a model without one (gpt2) has none, and its channels are fitted alone.

Fisher-weighted levels (quant.key_levels=fisher or fisher_sqrt) take one more pass per window with autograd on: the summed
next-token NLL of the window's own text, differentiated at each layer's post-RoPE keys (the graph starts at the
input embeddings, so no weight gradient is ever formed); the gradients line up with the keys kept above.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from harness.calibrate import disk_cached, layer_types, model_identity, source_identity
from harness.schemes.key_table import (
    KMEANS,
    QUANTILE,
    WEIGHT_POWER,
    KeyCalibration,
    check_key_levels,
    fit_table,
    unturn,
)

CACHE_VERSION = 2  # 2: the tables carry nuqkey's levels and the rotary turns


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


def fit_key_calibration(
    model, input_ids: torch.Tensor, span: int, quantile: float = QUANTILE, levels: str = KMEANS
) -> KeyCalibration:
    """Every cached layer's KeyTable fitted on the calibration windows input_ids (C, Tc), for keys at positions
    in [0, span); nuqkey's levels fitted `levels` (key_table.KEY_LEVELS: the Fisher fits weigh each pre-RoPE key element by
    |g| ** WEIGHT_POWER[levels], g from calibration_key_gradients)."""
    check_key_levels(levels)
    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    found = calibration_keys(model, input_ids)
    gradients = calibration_key_gradients(model, input_ids) if levels != KMEANS else [None] * len(found)
    tables = []
    for layer, gradient, layer_type in zip(found, gradients, types):
        if layer is None:
            tables.append(None)
            continue
        keys, positions = layer
        inv_freq = rotary_frequencies(model, layer_type)
        weights = None  # (N, Hkv, D): per pre-RoPE key element
        if gradient is not None:
            weights = unturn(gradient, positions, inv_freq).abs().pow(WEIGHT_POWER[levels])
        tables.append(fit_table(keys, positions, inv_freq, span, quantile, level_weights=weights))
    return KeyCalibration(tuple(tables), levels)


def cached_key_calibration(
    model,
    model_name: str,
    calib_ids: torch.Tensor,
    span: int,
    levels: str = KMEANS,
    source: str | None = None,
) -> KeyCalibration:
    """fit_key_calibration, read from disk when the same model, calibration tokens (cut from the calibration
    `source`), span and level fit were fitted before."""
    identity = (
        f"{CACHE_VERSION}|{model_identity(model, model_name)}|{QUANTILE}|{span}|{tuple(calib_ids.shape)}"
    )
    if levels != KMEANS:  # k-means tables keep the identity they had before the level fits had names
        identity += f"|{levels}"
    identity += source_identity(source)
    frame = disk_cached(
        f"{model_name}-calkey",
        identity,
        calib_ids,
        lambda: fit_key_calibration(model, calib_ids, span, levels=levels).to_frame(),
    )
    return KeyCalibration.from_frame(frame, len(layer_types(model.config)), levels)
