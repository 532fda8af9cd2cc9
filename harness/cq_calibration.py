"""cq's codebooks (harness/schemes/cq_table.py) fitted on a model's calibration windows, and their on-disk cache.

The calibration keys and values come as calkey's keys do (harness.key_calibration.calibration_vectors: each
layer's cached K/V, position 0 of every window left out, evaluation windows never read); keys are turned back
before RoPE at their positions with the model's own rotary frequencies.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from harness.calibrate import disk_cached, layer_types, model_identity, source_identity
from harness.key_calibration import calibration_vectors, rotary_frequencies
from harness.schemes.cq_table import CQ_WIDTHS, KMEANS_ITERATIONS, CqCalibration, CqLayer, fit_table
from harness.schemes.key_table import unturn

CACHE_VERSION = 1


def fit_cq_calibration(model, input_ids: torch.Tensor, channels: int) -> CqCalibration:
    """Every cached layer's codebooks for groups of `channels`, fitted on the calibration windows (C, Tc)."""
    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    layers = []
    for found, layer_type in zip(calibration_vectors(model, input_ids), types):
        if found is None:
            layers.append(None)
            continue
        keys, values, positions = found
        inv_freq = rotary_frequencies(model, layer_type)
        half = inv_freq.shape[0]
        turns = torch.zeros(keys.shape[-1])
        turns[:half], turns[half : 2 * half] = inv_freq, inv_freq
        before_rope = unturn(keys, positions, inv_freq)
        layers.append(CqLayer(fit_table(before_rope, channels), fit_table(values, channels), turns))
    return CqCalibration(tuple(layers), channels)


def cached_cq_calibration(
    model, model_name: str, calib_ids: torch.Tensor, channels: int, source: str | None = None
) -> CqCalibration:
    """fit_cq_calibration, read from disk when the same model, calibration tokens (cut from the calibration
    `source`) and group size were fitted before."""
    identity = f"{CACHE_VERSION}|{model_identity(model, model_name)}|{channels}|{CQ_WIDTHS[channels]}"
    identity += f"|{KMEANS_ITERATIONS}|{tuple(calib_ids.shape)}" + source_identity(source)
    frame = disk_cached(
        f"{model_name}-cq",
        identity,
        calib_ids,
        lambda: fit_cq_calibration(model, calib_ids, channels).to_frame(),
    )
    return CqCalibration.from_frame(frame, len(layer_types(model.config)), channels)
