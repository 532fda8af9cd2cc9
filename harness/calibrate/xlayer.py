"""xlayer's predictors (harness/schemes/xlayer_table.py) fitted on a model's calibration windows, and their on-disk
cache.

Each calibration window (C, Tc) runs through the model with a transformers DynamicCache; each layer with a KV cache
of its own gives the keys (turned back before RoPE at their positions, with the model's rotary frequencies) and
values it cached, position 0 of the window left out (kept in fp16 by quant.sink_tokens=1). A layer is fitted on
the positions it and the cached layer below it both hold (a sliding-window layer holds the window's last ones).
Evaluation windows are never read.

Fit (`fit_predictor`), from calibration vectors (x (N, in), y (N, out)), least squares with a small ridge:
    W = argmin |(y - my) - (x - mx) W|**2 + RIDGE * mean(diag(Xc'Xc)) |W|**2,  bias = my - mx W
and at `rank` r the reduced-rank map: the fitted values' top r right singular vectors V_r (out, r), W V_r V_r'
stored as down = W V_r (in, r) and up = V_r' (r, out). The calibration's own K/V are the inputs here (AQUA-KV fits
on the previous layer's reconstruction; the store predicts from its reconstruction).

xlayer_pca's residual transforms (`fit_residual_pca`): per layer, role and KV head, pca's fit (harness/calibrate/
pca.py) of the residuals y - pred of the same rows, pred the fitted (fp16) full-rank predictor's.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from harness.calibrate.disk import disk_cached, model_identity, source_identity
from harness.calibrate.pca import fit_table
from harness.calibrate.windows import layer_types, rotary_frequencies, unturn
from harness.schemes.pca_table import PCA_WIDTHS, PcaCalibration, PcaLayer
from harness.schemes.xlayer_table import CrossLayerCalibration, CrossLayerLayer, Predictor
from kernels.reference import FP16_MAX

CACHE_VERSION = 1
RIDGE = 1e-4  # of the inputs' mean variance, so that a collinear input (a 16-bit copy, a dead channel) stays solvable


def fit_predictor(x: torch.Tensor, y: torch.Tensor, rank: int | None = None) -> tuple[torch.Tensor, ...]:
    """(weight (in, out) or (down (in, r), up (r, out)), bias (out,)) of the ridge least-squares map from x (N, in)
    to y (N, out), full or reduced to `rank` (module docstring); float64."""
    x, y = x.double(), y.double()
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    gram = xc.T @ xc  # (in, in)
    if gram.numel():
        gram += RIDGE * gram.diagonal().mean().clamp(min=1e-12) * torch.eye(len(gram), dtype=torch.float64)
        weight = torch.linalg.solve(gram, xc.T @ yc)  # (in, out)
    else:
        weight = torch.zeros(0, y.shape[1], dtype=torch.float64)
    bias = my - mx @ weight
    if rank is None or not gram.numel():
        return (weight, bias)
    _, _, vh = torch.linalg.svd(xc @ weight, full_matrices=False)
    basis = vh[:rank].T  # (out, r)
    return (weight @ basis, basis.T, bias)


def predictor(x: torch.Tensor, y: torch.Tensor, rank: int | None) -> Predictor:
    """The Predictor of a layer and role from inputs x (N, in) and targets y (N, H, out): one map per head."""
    fits = [fit_predictor(x, y[:, h], rank) for h in range(y.shape[1])]
    half = lambda t: t.clamp(-FP16_MAX, FP16_MAX).half()  # noqa: E731
    parts = [half(torch.stack(part)) for part in zip(*fits)]
    if rank is None or x.shape[1] == 0:
        return Predictor(parts[-1], weight=parts[0])
    return Predictor(parts[-1], down=parts[0], up=parts[1])


@torch.no_grad()
def _window_vectors(model, window: torch.Tensor, inv_freq: list[torch.Tensor]) -> list[dict | None]:
    """Per decoder layer, {position: (key before RoPE (Hkv, D), value (Hkv, Dv))} of one window (T,) (position
    0 left out); None for a layer without a KV cache of its own."""
    cache = DynamicCache(config=model.config)
    model(input_ids=window[None].to(model.device), past_key_values=cache, use_cache=True)
    out = []
    for i, kind in enumerate(layer_types(model.config)):
        if kind == "linear":
            out.append(None)
            continue
        k = cache.layers[i].keys[0].float().transpose(0, 1).cpu()  # (T_held, Hkv, D)
        v = cache.layers[i].values[0].float().transpose(0, 1).cpu()
        at = torch.arange(window.shape[0] - k.shape[0], window.shape[0])
        k = unturn(k, at, inv_freq[i])
        out.append({int(p): (k[j], v[j]) for j, p in enumerate(at.tolist()) if p > 0})
    return out


def _layer_rows(windows: list[list[dict | None]], i: int, previous: int | None) -> dict[str, tuple]:
    """Layer i's calibration rows, role -> (inputs (N, in), targets (N, H, D)), over every window's positions that
    layer i and the cached layer below it (`previous`; None: none) both hold (module docstring's inputs)."""
    rows = {"key": ([], []), "value": ([], [])}  # role -> (inputs, targets) per window
    for held in windows:
        positions = sorted(held[i] if previous is None else held[i].keys() & held[previous].keys())
        key = torch.stack([held[i][p][0] for p in positions])  # (n, H, D)
        value = torch.stack([held[i][p][1] for p in positions])
        if previous is None:  # the first cached layer: keys from nothing (a bias), values from its keys
            key_inputs, value_inputs = key.new_zeros(len(key), 0), key.flatten(1)
        else:
            below_key = torch.stack([held[previous][p][0] for p in positions]).flatten(1)  # (n, Hp D)
            below_value = torch.stack([held[previous][p][1] for p in positions]).flatten(1)
            key_inputs, value_inputs = below_key, torch.cat([key.flatten(1), below_value], -1)
        rows["key"][0].append(key_inputs)
        rows["key"][1].append(key)
        rows["value"][0].append(value_inputs)
        rows["value"][1].append(value)
    return {role: (torch.cat(x), torch.cat(y)) for role, (x, y) in rows.items()}


def fit_xlayer_calibration(model, input_ids: torch.Tensor, rank: int | None = None) -> CrossLayerCalibration:
    """Every cached layer's predictors fitted on the calibration windows input_ids (C, Tc) at `rank` (None: full)."""
    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    inv_freq = [rotary_frequencies(model, t) for t in types]
    windows = [_window_vectors(model, w, inv_freq) for w in input_ids]
    layers: list[CrossLayerLayer | None] = []
    previous = None
    for i in range(len(types)):
        if windows[0][i] is None:
            layers.append(None)
            continue
        fits = {role: predictor(x, y, rank) for role, (x, y) in _layer_rows(windows, i, previous).items()}
        half = len(inv_freq[i])
        turns = torch.zeros(fits["key"].bias.shape[1])
        turns[:half], turns[half : 2 * half] = inv_freq[i], inv_freq[i]
        layers.append(CrossLayerLayer(fits["key"], fits["value"], turns, previous))
        previous = i
    return CrossLayerCalibration(tuple(layers), rank)


@torch.no_grad()
def fit_residual_pca(model, input_ids: torch.Tensor, predictors: CrossLayerCalibration) -> PcaCalibration:
    """pca's transforms (harness/calibrate/pca.py's fit_table: a basis, Lloyd-Max scales and plans per KV head) of
    every cached layer's residuals y - pred on the calibration windows input_ids (C, Tc): the targets less what
    `predictors` (fitted on the same windows) make of their inputs, keys before RoPE (xlayer_pca's store)."""
    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    inv_freq = [rotary_frequencies(model, t) for t in types]
    windows = [_window_vectors(model, w, inv_freq) for w in input_ids]
    layers: list[PcaLayer | None] = []
    for i, layer in enumerate(predictors.layers):
        if layer is None:
            layers.append(None)
            continue
        tables = {}
        for role, (x, y) in _layer_rows(windows, i, layer.previous).items():
            residual = y - layer.role(role).apply(x[None])[0].transpose(0, 1)  # (N, H, D)
            tables[role] = fit_table(residual.clamp(-FP16_MAX, FP16_MAX))
        layers.append(PcaLayer(tables["key"], tables["value"], torch.zeros(tables["key"].mean.shape[1])))
    return PcaCalibration(tuple(layers))


def cached_xlayer_calibration(
    model, model_name: str, calib_ids: torch.Tensor, rank: int | None = None, source: str | None = None
) -> CrossLayerCalibration:
    """fit_xlayer_calibration, read from disk when the same model, calibration tokens (cut from the calibration
    `source`) and rank were fitted before."""
    identity = f"{CACHE_VERSION}|{model_identity(model, model_name)}|{rank}|{tuple(calib_ids.shape)}"
    identity += source_identity(source)
    frame = disk_cached(
        f"{model_name}-xlayer",
        identity,
        calib_ids,
        lambda: fit_xlayer_calibration(model, calib_ids, rank).to_frame(),
    )
    return CrossLayerCalibration.from_frame(frame, len(layer_types(model.config)), rank)


def cached_xlayer_pca_calibration(
    model, model_name: str, calib_ids: torch.Tensor, source: str | None = None
) -> CrossLayerCalibration:
    """The full-rank predictors (cached_xlayer_calibration) with the pca transforms of their residuals
    (fit_residual_pca) as `residual`, each read from disk when fitted before (the residuals' keyed by the
    predictors' digest)."""
    predictors = cached_xlayer_calibration(model, model_name, calib_ids, None, source)
    identity = f"{CACHE_VERSION}|{model_identity(model, model_name)}|{PCA_WIDTHS}|{tuple(calib_ids.shape)}"
    identity += source_identity(source) + f"|{predictors.digest()}"
    frame = disk_cached(
        f"{model_name}-xlayer-pca",
        identity,
        calib_ids,
        lambda: fit_residual_pca(model, calib_ids, predictors).to_frame(),
    )
    residual = PcaCalibration.from_frame(frame, len(layer_types(model.config)))
    return CrossLayerCalibration(predictors.layers, None, residual)
