"""cq's codebooks (harness/schemes/cq_table.py) fitted on a model's calibration windows, and their on-disk cache.

The calibration keys and values come as calkey's keys do (harness/calibrate/windows.py's calibration_vectors: each
layer's cached K/V, position 0 of every window left out, evaluation windows never read); keys are turned back
before RoPE at their positions with the model's own rotary frequencies.

The k-means: Lloyd's algorithm, KMEANS_ITERATIONS steps, from the first 2**(c b) distinct vectors of the group
in a permutation drawn with a fixed seed (a group with fewer distinct vectors than centroids repeats them), a vector's nearest centroid by |x|**2 - 2 x.C + |C|**2 (nearest_centroid, which the store
codes with too); a centroid whose cell is empty keeps its place. CQ weighs each vector by the loss's Fisher information; this fit
weighs them alike.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from harness.calibrate.disk import disk_cached, model_identity, source_identity
from harness.calibrate.windows import calibration_vectors, layer_types, rotary_frequencies, unturn
from harness.schemes.cq_table import CQ_WIDTHS, CqCalibration, CqLayer, CqTable, nearest_centroid
from kernels.reference import FP16_MAX

CACHE_VERSION = 1
KMEANS_ITERATIONS = (
    12  # Lloyd steps: enough to settle at these sizes, and a codebook fit of smollm2-135m in minutes
)
KMEANS_SEED = 7


def _first_distinct(rows: torch.Tensor, k: int) -> torch.Tensor:
    """The first k distinct rows of rows (N, c) in their order, repeated in turn when fewer are distinct: (k, c)."""
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
    first = torch.full((len(unique),), len(rows), dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(len(rows)), reduce="amin"
    )  # where each distinct row first appears
    distinct = unique[first.argsort()]
    return distinct[torch.arange(k) % len(distinct)].clone()


def fit_codebooks(x: torch.Tensor, c: int, b: int) -> torch.Tensor:
    """The centroids (G, 2**(c b), c) float32 of each group of c consecutive channels of x (N, D) (module
    docstring), G = D / c."""
    N, D = x.shape
    groups = x.float().view(N, D // c, c)  # (N, G, c)
    k = 1 << (c * b)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(KMEANS_SEED))
    centroids = torch.stack([_first_distinct(groups[order, g], k) for g in range(D // c)])  # (G, K, c)
    for _ in range(KMEANS_ITERATIONS):
        index = nearest_centroid(groups, centroids)  # (N, G)
        flat = index + torch.arange(D // c)[None] * k  # (N, G): a cell per group and centroid
        count = torch.bincount(flat.reshape(-1), minlength=D // c * k).view(D // c, k)
        total = torch.zeros(D // c * k, c, dtype=torch.float64)
        total.index_add_(0, flat.reshape(-1), groups.reshape(-1, c).double())
        mean = (total.view(D // c, k, c) / count[..., None].clamp(min=1)).float()
        centroids = torch.where(count[..., None] > 0, mean, centroids)
    return centroids


def fit_table(x: torch.Tensor, c: int) -> CqTable:
    """The CqTable of one layer and role from its calibration vectors x (N, Hkv, D), each head alone, at every width
    of CQ_WIDTHS[c]."""
    if len(x) == 0:
        raise ValueError("cq calibration: no calibration vectors to fit codebooks on")
    x = x.float().clamp(-FP16_MAX, FP16_MAX)
    return CqTable(
        {
            b: torch.stack([fit_codebooks(x[:, h], c, b) for h in range(x.shape[1])]).half()
            for b in CQ_WIDTHS[c]
        }
    )


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
