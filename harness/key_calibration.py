"""calkey's key tables (harness/schemes/key_table.py) fitted on a model's calibration windows, and their on-disk
cache.

The calibration windows (C, Tc) run through the model with a transformers DynamicCache, one window at a time;
each layer with a KV cache of its own gives the keys it cached: post-RoPE, as they reach a QuantizedKVCache, at
their positions in the window. Position 0 of every window (the BOS token where the windows carry one, an attention
sink either way) is left out: its keys are unlike any other position's, and quant.sink_tokens=1 keeps it in fp16.
A sliding-window layer gives the keys its window still holds. Evaluation windows are never read.

The rotary frequencies are the model's own (the inv_freq buffer of its rotary embedding, per layer type where it
has several); a model without one (gpt2) has none, and its channels are fitted alone.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from harness.calibrate import disk_cached, layer_types, model_identity
from harness.schemes.key_table import QUANTILE, KeyCalibration, fit_table

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
def calibration_keys(model, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per decoder layer, the post-RoPE keys it cached for input_ids (C, Tc) and their positions, position 0 of each
    window left out: (float32 (N, Hkv, D), int64 (N,)); None for a layer without a KV cache of its own."""
    kinds = layer_types(model.config)
    keys: list[list[torch.Tensor]] = [[] for _ in kinds]
    positions: list[list[torch.Tensor]] = [[] for _ in kinds]
    for window in input_ids:
        cache = DynamicCache(config=model.config)
        model(input_ids=window[None].to(model.device), past_key_values=cache, use_cache=True)
        for i, kind in enumerate(kinds):
            if kind == "linear":
                continue
            k = cache.layers[i].keys[0].float()  # (Hkv, T_held, D): the last T_held positions of the window
            at = torch.arange(window.shape[0] - k.shape[1], window.shape[0])
            keys[i].append(k.transpose(0, 1)[at > 0].cpu())  # (T, Hkv, D)
            positions[i].append(at[at > 0])
    return [(torch.cat(k), torch.cat(p)) if k else None for k, p in zip(keys, positions)]


def fit_key_calibration(
    model, input_ids: torch.Tensor, span: int, quantile: float = QUANTILE
) -> KeyCalibration:
    """Every cached layer's KeyTable fitted on the calibration windows input_ids (C, Tc), for keys at positions
    in [0, span)."""
    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    tables = []
    for found, layer_type in zip(calibration_keys(model, input_ids), types):
        if found is None:
            tables.append(None)
            continue
        keys, positions = found
        tables.append(fit_table(keys, positions, rotary_frequencies(model, layer_type), span, quantile))
    return KeyCalibration(tuple(tables))


def cached_key_calibration(model, model_name: str, calib_ids: torch.Tensor, span: int) -> KeyCalibration:
    """fit_key_calibration, read from disk when the same model, calibration tokens and span were fitted before."""
    identity = (
        f"{CACHE_VERSION}|{model_identity(model, model_name)}|{QUANTILE}|{span}|{tuple(calib_ids.shape)}"
    )
    frame = disk_cached(
        f"{model_name}-calkey",
        identity,
        calib_ids,
        lambda: fit_key_calibration(model, calib_ids, span).to_frame(),
    )
    return KeyCalibration.from_frame(frame, len(layer_types(model.config)))
