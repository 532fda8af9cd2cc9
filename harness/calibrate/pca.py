"""The transforms of the pca family (harness/schemes/pca_table.py's PcaCalibration; vq2, vq4 and vq8 read their
means) fitted on a model's calibration windows, and their on-disk cache.

The calibration keys and values come as calkey's keys do (harness/calibrate/windows.py's calibration_vectors: each
layer's cached K/V, position 0 of every window left out, evaluation windows never read); keys are turned back
before RoPE at their positions with the model's own rotary frequencies (or to the positions their scheme's
PcaFormat says: the first of their block, or not at all), then each (layer, role, KV head) is fitted alone
(`fit_table`). The levels are the format's (Lloyd-Max or evenly spaced: the same scale fit either way), and a
format whose plans group components spreads each unit's bits over groups (`plan_groups`).

Fit of one (layer, role, KV head) from its calibration vectors x (N, D) (`fit_head`):
    mean   = fp16(mean of x)                                  (D,)
    basis  = fp16(eigenvectors of the covariance of x - mean), columns by descending eigenvalue   (D, D)
    z      = (x - mean) @ basis                               the components, float32 (N, D)
    per component c and b in 1..MAX_COMPONENT_BITS: the scale s[c, b] of the Lloyd-Max levels of N(0, 1) at b
      bits (harness/schemes/lloyd_max.py) of least squared error on z[:, c]: Lloyd's iteration on the scale (codes
      for the scale, then the least-squares scale for the codes) from the component's standard deviation, fp16;
      its mean squared error d[c, b]; d[c, 0] = mean z[:, c]**2 (the component dropped: 0);
    per unit width w in PCA_WIDTHS: the plan b (D,) of least summed d[c, b_c] with sum b_c = w D exactly (a
      dynamic program over components), and the scales s[c, b_c] it reads.
A unit at width w so stores w D bits per token, as a uniform w-bit one would, spread over its components as the
calibration's distortions say: a component of large variance gets more, trailing ones may get none.

Why fixed Lloyd-Max levels with a fitted scale, not levels fitted per component: the levels of every component
at every width would be a table whose bytes depend on the plan; one scale per component keeps a head's table at
2 D**2 + 5 D bytes at any width. Measured on smollm2-135m (layers 0, 3, ..., 27, all KV heads; fitted on its 8
calibration windows of 512 tokens, measured on 4 evaluation windows of 1024; relative squared error), the scale
costs 1-2% against k-means levels per component, and the transform with its plan cuts the error of per-channel
k-means levels (nuqkey's) 2.3-2.5 times on keys (0.0110 against 0.0271 at 2 bits, 0.0036 against 0.0080 at 3)
and that of codebook's rotated Lloyd-Max at b + 0.25 bits by a third on values at equal bits (0.076 against 0.113
at 2.25, 0.023 against 0.032 at 3.25). (A one-off script over this fit on the calibration keys and values.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from harness.calibrate.disk import disk_cached, model_identity, source_identity
from harness.calibrate.windows import calibration_vectors, layer_types, rotary_frequencies, unturn
from harness.schemes.pca_table import (
    LLOYD,
    MAX_COMPONENT_BITS,
    PCA_FORMAT,
    PCA_WIDTHS,
    QUANTIZERS,
    SCALE_MIN,
    PcaCalibration,
    PcaFormat,
    PcaLayer,
    PcaTable,
    own_channels,
    quantize_components,
)
from kernels.reference import FP16_MAX

CACHE_VERSION = 1
SCALE_ITERATIONS = 20
CALIBRATION_FIRST = 1  # the first position a pca store quantizes: sink_tokens=1 keeps position 0 in fp16


def _fitted_scale(z: torch.Tensor, bits: int, start: torch.Tensor, kind: str = LLOYD) -> torch.Tensor:
    """The scale (D,) of the b-bit levels of `kind` (Lloyd-Max or uniform) of least squared error on each column
    of z (N, D): Lloyd's iteration on the scale from `start` (D,) (codes for the scale; the least-squares scale
    for the codes), SCALE_ITERATIONS rounds. A round that leaves a column's scale as it was leaves its codes as
    they were, and so every later round: only the columns still moving are coded again (the codes are most of a
    round's time; a column moves for a third of the rounds on average), and the sums run over every column as
    always, so the scales are the same to the bit."""
    levels, bounds = QUANTIZERS[kind](bits).levels, QUANTIZERS[kind](bits).boundaries
    levels = torch.tensor(levels, dtype=torch.float32, device=z.device)
    bounds = torch.tensor(bounds, dtype=torch.float32, device=z.device)
    scale = start.clone()
    chosen = torch.empty_like(z)  # (N, D): each value's level at its column's scale
    moving = torch.arange(z.shape[1], device=z.device)
    for _ in range(SCALE_ITERATIONS):
        # a value on a boundary to the lower level
        chosen[:, moving] = levels[torch.bucketize(z[:, moving] / scale[moving], bounds)]
        energy = (chosen * chosen).sum(0)
        fitted = torch.where(energy > 0, (z * chosen).sum(0) / energy.clamp(min=1e-30), scale)
        fitted = fitted.clamp(SCALE_MIN, FP16_MAX)
        moving = (fitted != scale).nonzero()[:, 0]
        scale = fitted
        if len(moving) == 0:
            break
    return scale.half().float()


def plan_bits(distortion: torch.Tensor, total: int) -> torch.Tensor:
    """The widths b (D,) int64 in [0, K] of least summed distortion[c, b_c] with sum b_c == total, for
    distortion (D, K + 1) (float64); a dynamic program over components (ties: the first option found), in numpy
    (a head's plans are thousands of small steps: torch's per-call cost was most of a pca fit)."""
    D, options = distortion.shape
    if not 0 <= total <= D * (options - 1):
        raise ValueError(f"pca plan: {total} bits cannot be spread over {D} components of 0 to {options - 1}")
    cost = distortion.double().numpy()
    best = np.full(total + 1, np.inf)  # best[t]: least cost of t bits so far
    best[0] = 0.0
    choice = np.zeros((D, total + 1), dtype=np.int64)
    candidates = np.empty((options, total + 1))
    for c in range(D):
        # candidates[b, t]: the least cost of t bits with component c at b bits
        candidates.fill(np.inf)
        for b in range(min(options, total + 1)):
            candidates[b, b:] = best[: total + 1 - b] + cost[c, b]
        choice[c] = candidates.argmin(0)
        best = candidates[choice[c], np.arange(total + 1)]
    if not np.isfinite(best[total]):
        raise ValueError(f"pca plan: {total} bits cannot be spread over {D} components at the widths allowed")
    bits = np.zeros(D, dtype=np.int64)
    left = total
    for c in reversed(range(D)):
        bits[c] = choice[c, left]
        left -= int(bits[c])
    return torch.from_numpy(bits)


def plan_groups(distortion: torch.Tensor, total: int, fmt: PcaFormat) -> torch.Tensor:
    """plan_bits over groups of fmt.group_at(D) consecutive components (PcaFormat.group_at), each group one width
    of fmt.group_widths:
    the widths b (D,) int64 of least summed distortion (D, K + 1) with sum b_c == total."""
    D = distortion.shape[0]
    group = fmt.group_at(D)
    if D % group or total % group:
        raise ValueError(f"pca plan: {total} bits over {D} components cannot go in groups of {group}")
    grouped = distortion.view(D // group, group, -1).sum(1)  # (G, K + 1)
    barred = torch.ones(grouped.shape[1], dtype=torch.bool)
    barred[list(fmt.group_widths)] = False
    grouped[:, barred] = float("inf")
    return plan_bits(grouped, total // group).repeat_interleave(group)


@dataclass(frozen=True, eq=False)
class HeadFit:
    """One head's transform before its plans: fp16 mean (D,) and basis (D, D); per component c and width b the
    mean squared error distortion[c, b] (D, K + 1) float64 (b = 0: the component dropped) and the fitted scale
    scale[b, c] (K + 1, D) float32 (row 0 unused)."""

    mean: torch.Tensor
    basis: torch.Tensor
    distortion: torch.Tensor
    scale: torch.Tensor


def _eigenbasis(covariance: torch.Tensor, own: torch.Tensor | None) -> torch.Tensor:
    """The (D, D) float64 basis of a covariance's eigenvectors, columns by descending eigenvalue; with `own`
    channels (PcaFormat.own_pairs'), block-diagonal: the other channels' eigenvectors, then own's."""
    if own is None or not len(own):
        return torch.linalg.eigh(covariance)[1].flip(1)
    D = covariance.shape[0]
    mine = torch.zeros(D, dtype=torch.bool)
    mine[own] = True
    columns = []
    for block in (~mine, mine):
        index = block.nonzero().flatten()
        vectors = torch.linalg.eigh(covariance[index][:, index])[1].flip(1)
        column = torch.zeros(D, len(index), dtype=covariance.dtype)
        column[index] = vectors
        columns.append(column)
    return torch.cat(columns, 1)


def fit_components(x: torch.Tensor, fmt: PcaFormat = PCA_FORMAT, own: torch.Tensor | None = None) -> HeadFit:
    """The HeadFit of one head from its calibration vectors x (N, D), with fmt's levels (module docstring); the
    basis block-diagonal over `own` channels and the rest (keys of a format with own_pairs: own_channels')."""
    x = x.double()
    mean = x.mean(0).clamp(-FP16_MAX, FP16_MAX).half()
    centred = x - mean.double()
    basis = _eigenbasis(centred.T @ centred / max(len(x), 1), own).clamp(-1, 1).half()
    z = (centred @ basis.double()).float()  # (N, D)
    D = x.shape[1]
    start = z.std(0, correction=0).clamp(SCALE_MIN, FP16_MAX)
    distortion = torch.zeros(D, MAX_COMPONENT_BITS + 1, dtype=torch.float64)
    distortion[:, 0] = z.double().square().mean(0)
    scale = torch.zeros(MAX_COMPONENT_BITS + 1, D)
    for b in range(1, MAX_COMPONENT_BITS + 1):
        scale[b] = _fitted_scale(z, b, start, fmt.levels)
        _, got = quantize_components(z[None, None], torch.full((1, D), b), scale[b][None], fmt.levels)
        distortion[:, b] = (got[0, 0] - z).double().square().mean(0)
    return HeadFit(mean, basis, distortion, scale)


def plans_for(distortion: torch.Tensor, widths, fmt: PcaFormat) -> torch.Tensor:
    """The plan (|widths|, D) int64 of each unit width w: plan_groups of `distortion` (D, K + 1) at w D bits."""
    D = distortion.shape[0]
    return torch.stack([plan_groups(distortion, w * D, fmt) for w in widths])


def fit_head(x: torch.Tensor, widths=PCA_WIDTHS, fmt: PcaFormat = PCA_FORMAT) -> tuple[torch.Tensor, ...]:
    """One head's fit (module docstring) from x (N, D) in format `fmt` (its levels and plan groups), its plans
    its own: mean (D,) fp16, basis (D, D) fp16, plans (|widths|, D) int64 and scales (|widths|, D) fp16, in the
    order of `widths`."""
    fit = fit_components(x, fmt)
    plans = plans_for(fit.distortion, widths, fmt)
    return fit.mean, fit.basis, plans, _scales(fit, plans)


def _scales(fit: HeadFit, plans: torch.Tensor) -> torch.Tensor:
    """The fp16 scales (|W|, D) the plans (|W|, D) read (width 0 reads none)."""
    return fit.scale.gather(0, plans).clamp(min=SCALE_MIN).half()


def _table(fits: list[HeadFit], plans: torch.Tensor, widths) -> PcaTable:
    """The PcaTable of heads `fits` at plans (H, |W|, D)."""
    scales = torch.stack([_scales(fit, p) for fit, p in zip(fits, plans)])  # (H, |W|, D)
    return PcaTable(
        torch.stack([fit.mean for fit in fits]),
        torch.stack([fit.basis for fit in fits]),
        {w: plans[:, i].to(torch.uint8) for i, w in enumerate(widths)},
        {w: scales[:, i] for i, w in enumerate(widths)},
    )


def _head_fits(x: torch.Tensor, fmt: PcaFormat, own: torch.Tensor | None = None) -> list[HeadFit]:
    """Each head's HeadFit from calibration vectors x (N, Hkv, D) (`own` channels: fit_components')."""
    if len(x) == 0:
        raise ValueError("pca calibration: no calibration vectors to fit a transform on")
    return [fit_components(x[:, h].float().clamp(-FP16_MAX, FP16_MAX), fmt, own) for h in range(x.shape[1])]


def own_table(fits: list[HeadFit], widths, fmt: PcaFormat) -> PcaTable:
    """The PcaTable of heads `fits`, each at its own plans."""
    return _table(fits, torch.stack([plans_for(fit.distortion, widths, fmt) for fit in fits]), widths)


def fit_table(
    x: torch.Tensor, widths=PCA_WIDTHS, fmt: PcaFormat = PCA_FORMAT, own: torch.Tensor | None = None
) -> PcaTable:
    """The PcaTable of one layer and role from its calibration vectors x (N, Hkv, D) (keys in fmt's frame, or
    values), each head fitted alone with its own plans (fit_head; `own` channels: fit_components')."""
    return own_table(_head_fits(x, fmt, own), widths, fmt)


def shared_tables(fits: list[list[HeadFit]], widths, fmt: PcaFormat) -> list[PcaTable]:
    """Tables of one role's layers (each a list of HeadFits) whose every head takes the same plan at each width:
    the plan of least distortion summed over every head of every layer (a kernel compiles one plan per width)."""
    dims = {fit.distortion.shape[0] for layer in fits for fit in layer}
    if len(dims) != 1:
        raise ValueError(f"pca calibration: shared plans need one head_dim; the layers have {sorted(dims)}")
    total = sum(fit.distortion for layer in fits for fit in layer)  # (D, K + 1)
    plans = plans_for(total, widths, fmt)  # (|W|, D)
    return [_table(layer, plans.expand(len(layer), -1, -1), widths) for layer in fits]


def pca_head_fits(
    model, input_ids: torch.Tensor, fmt: PcaFormat = PCA_FORMAT
) -> list[tuple[list[HeadFit], list[HeadFit], torch.Tensor] | None]:
    """Per layer, its keys' and values' HeadFits (each head's transform before its plans) and its keys' rotary
    turns (D,), fitted on the calibration windows input_ids (C, Tc) in format `fmt`: keys turned back to fmt's
    reference positions (a store's first quantized position is CALIBRATION_FIRST: position 0 is the sink token the
    windows leave out); None for a layer without a KV cache of its own."""
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
        framed = unturn(keys, fmt.reference_positions(positions, CALIBRATION_FIRST), inv_freq)  # (N, Hkv, D)
        own = own_channels(half, fmt.own_pairs)
        if len(own):  # those channels turned back by each key's own position
            framed[..., own] = unturn(keys, positions, inv_freq)[..., own]
        layers.append((_head_fits(framed, fmt, own), _head_fits(values, fmt), turns))
    return layers


def fit_pca_calibration(model, input_ids: torch.Tensor, fmt: PcaFormat = PCA_FORMAT) -> PcaCalibration:
    """Every cached layer's PcaLayer fitted on the calibration windows input_ids (C, Tc) in format `fmt`
    (pca_head_fits), with plans each head's own, or one per role and width (shared_plans)."""
    layers = pca_head_fits(model, input_ids, fmt)
    fitted = [layer for layer in layers if layer is not None]
    if fmt.shared_plans:
        keys, values = (shared_tables([layer[i] for layer in fitted], PCA_WIDTHS, fmt) for i in (0, 1))
    else:
        keys, values = ([own_table(layer[i], PCA_WIDTHS, fmt) for layer in fitted] for i in (0, 1))
    tables = iter(zip(keys, values, [layer[2] for layer in fitted]))
    return PcaCalibration(tuple(None if layer is None else PcaLayer(*next(tables)) for layer in layers))


def cached_pca_calibration(
    model, model_name: str, calib_ids: torch.Tensor, source: str | None = None, fmt: PcaFormat = PCA_FORMAT
) -> PcaCalibration:
    """fit_pca_calibration, read from disk when the same model, calibration tokens (cut from the calibration
    `source`) and format were fitted before."""
    identity = f"{CACHE_VERSION}|{model_identity(model, model_name)}|{PCA_WIDTHS}|{tuple(calib_ids.shape)}"
    identity += source_identity(source) + fmt.identity()
    frame = disk_cached(
        f"{model_name}-pca",
        identity,
        calib_ids,
        lambda: fit_pca_calibration(model, calib_ids, fmt).to_frame(),
    )
    return PcaCalibration.from_frame(frame, len(layer_types(model.config)))
