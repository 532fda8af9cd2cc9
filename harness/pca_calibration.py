"""pca's transforms (harness/schemes/pca_table.py) fitted on a model's calibration windows, and their on-disk cache.

The calibration keys and values come as calkey's keys do (harness.key_calibration.calibration_vectors: each
layer's cached K/V, position 0 of every window left out, evaluation windows never read); keys are turned back
before RoPE at their positions with the model's own rotary frequencies, then each (layer, role, KV head) is fitted
alone (pca_table.fit_table).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from harness.calibrate import disk_cached, layer_types, model_identity, source_identity
from harness.key_calibration import calibration_vectors, rotary_frequencies
from harness.schemes.key_table import unturn
from harness.schemes.pca_table import PCA_WIDTHS, PcaCalibration, PcaLayer, fit_table

CACHE_VERSION = 1


def fit_pca_calibration(model, input_ids: torch.Tensor) -> PcaCalibration:
    """Every cached layer's PcaLayer fitted on the calibration windows input_ids (C, Tc)."""
    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    layers = []
    for found, layer_type in zip(calibration_vectors(model, input_ids), types):
        if found is None:
            layers.append(None)
            continue
        keys, values, positions = found
        inv_freq = rotary_frequencies(model, layer_type)
        half = inv_freq.shape[0]
        turns = torch.zeros(keys.shape[-1])  # (D,): radians per position of each channel's pair
        turns[:half], turns[half : 2 * half] = inv_freq, inv_freq
        before_rope = unturn(keys, positions, inv_freq)  # (N, Hkv, D)
        layers.append(PcaLayer(fit_table(before_rope), fit_table(values), turns))
    return PcaCalibration(tuple(layers))


def cached_pca_calibration(
    model, model_name: str, calib_ids: torch.Tensor, source: str | None = None
) -> PcaCalibration:
    """fit_pca_calibration, read from disk when the same model and calibration tokens (cut from the calibration
    `source`) were fitted before."""
    identity = f"{CACHE_VERSION}|{model_identity(model, model_name)}|{PCA_WIDTHS}|{tuple(calib_ids.shape)}"
    identity += source_identity(source)
    frame = disk_cached(
        f"{model_name}-pca", identity, calib_ids, lambda: fit_pca_calibration(model, calib_ids).to_frame()
    )
    return PcaCalibration.from_frame(frame, len(layer_types(model.config)))
