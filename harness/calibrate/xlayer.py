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

Fitted along the chain (`fit_chained_calibration`, the `_chain<w>` schemes: AQUA-KV's way): the inputs are the
reconstructions the stores make at width w, layer by layer from the first: a layer's key map is fitted on the
reconstructed keys below, its keys' residuals coded at w (for xlayer_pca after pca's fit of them) and restored; its
value map on those restored keys and the reconstructed values below, likewise. A map fitted on exact inputs but
applied to reconstructions amplifies their errors (measured on gemma3-270m: results/frontier/README.md); one fitted
on reconstructions weighs that noise. Every layer holds every position here (the windows run through a cache that
keeps every token; the model's masks keep its sliding windows), as the stores do.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from harness.calibrate.disk import disk_cached, model_identity, source_identity
from harness.calibrate.pca import fit_table
from harness.calibrate.windows import layer_types, rotary_frequencies, unturn
from harness.schemes.pca_table import PCA_WIDTHS, PcaCalibration, PcaLayer, PcaTable
from harness.schemes.xlayer import XlayerPcaStore, XlayerStore
from harness.schemes.xlayer_table import XLAYER_ROLES, CrossLayerCalibration, CrossLayerLayer, Predictor
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
def _window_vectors(
    model, window: torch.Tensor, inv_freq: list[torch.Tensor], every_token: bool = False
) -> list[dict | None]:
    """Per decoder layer, {position: (key before RoPE (Hkv, D), value (Hkv, Dv))} of one window (T,) (position
    0 left out); None for a layer without a KV cache of its own. A sliding layer holds the window's last ones, or
    with `every_token` every one (a cache without sliding layers: the model's masks keep the windows)."""
    cache = DynamicCache() if every_token else DynamicCache(config=model.config)
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
        below = None  # the first cached layer: keys from nothing (a bias), values from its keys
        if previous is not None:
            below = {
                role: torch.stack([held[previous][p][j] for p in positions])  # (n, Hp, D)
                for j, role in enumerate(XLAYER_ROLES)
            }
        rows["key"][0].append(chain_inputs("key", len(key), below))
        rows["key"][1].append(key)
        rows["value"][0].append(chain_inputs("value", len(key), below, key))
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
        layers.append(CrossLayerLayer(fits["key"], fits["value"], _turns(inv_freq[i], fits["key"]), previous))
        previous = i
    return CrossLayerCalibration(tuple(layers), rank)


def _turns(inv_freq: torch.Tensor, key_fit: Predictor) -> torch.Tensor:
    """A layer's rotary frequency per key channel (D,): each pair (i, i + R / 2) at its frequency, 0 past the rotary
    channels (CrossLayerLayer's `turn`)."""
    half = len(inv_freq)
    turns = torch.zeros(key_fit.bias.shape[1])
    turns[:half], turns[half : 2 * half] = inv_freq, inv_freq
    return turns


@torch.no_grad()
def chain_states(model, input_ids: torch.Tensor) -> list[dict[str, torch.Tensor] | None]:
    """Per decoder layer, its keys (before RoPE) and values {role: (N, H, D)} float32 over the windows input_ids
    (C, T), every position but 0 of every window in one order for all layers (every layer holds every position: the
    module docstring); None for a layer without a KV cache of its own."""
    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    inv_freq = [rotary_frequencies(model, t) for t in types]
    windows = [_window_vectors(model, w, inv_freq, every_token=True) for w in input_ids]
    out = []
    for i in range(len(types)):
        if windows[0][i] is None:
            out.append(None)
            continue
        rows = _layer_rows(windows, i, None)
        out.append({"key": rows["key"][1], "value": rows["value"][1]})
    return out


def chain_inputs(role: str, rows: int, below: dict | None, key: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's predictor inputs (rows, in) for `role` (xlayer.Xlayer._inputs' order): keys from the keys of the
    cached layer below (`below`, {role: (N, H, D)}; None for the first cached layer: no inputs), values from this
    layer's keys (`key` (N, H, D)) then the values below."""
    if role == "key":
        return torch.zeros(rows, 0) if below is None else below["key"].flatten(1)
    return torch.cat([key.flatten(1), *([] if below is None else [below["value"].flatten(1)])], -1)


def predict(fit: Predictor, x: torch.Tensor) -> torch.Tensor:
    """fit's prediction (N, H, D) float32 from inputs x (N, in)."""
    return fit.apply(x[None])[0].transpose(0, 1)


def restore(fit: Predictor, table: PcaTable | None, predicted: torch.Tensor, y: torch.Tensor, width: int):
    """What a store of every head at `width` restores (N, H, D) of targets y (N, H, D), given fit's prediction
    of them: the prediction plus the residual coded in pca's format against `table` (xlayer_pca) or, with no
    table, in codebook's (xlayer)."""
    store_type = XlayerStore if table is None else XlayerPcaStore
    H, D = y.shape[1:]
    store = store_type([width] * H, D, 1, torch.float32, "cpu", fit, torch.zeros(0), 0, table)
    target, predicted = y.transpose(0, 1)[None], predicted.transpose(0, 1)[None]  # (1, H, N, D)
    restored = target.clone()
    store.code(target - predicted, predicted, restored)
    return restored[0].transpose(0, 1)


@torch.no_grad()
def fit_chained_calibration(
    model, input_ids: torch.Tensor, width: int, residual_pca: bool
) -> CrossLayerCalibration:
    """Full-rank predictors fitted along the chain at `width` on the calibration windows input_ids (C, Tc) (module
    docstring), the residuals in codebook's format or, with `residual_pca`, in pca's (their transforms fitted
    along the way: the calibration's `residual`)."""
    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    layers: list[CrossLayerLayer | None] = []
    tables: list[PcaLayer | None] = []
    below, previous = None, None  # the cached layer below: what the chain restored of it, its index
    for i, states in enumerate(chain_states(model, input_ids)):
        if states is None:
            layers.append(None)
            tables.append(None)
            continue
        fits, residual, restored = {}, {}, {}
        for role in XLAYER_ROLES:
            y = states[role]
            x = chain_inputs(role, len(y), below, restored.get("key"))
            fits[role] = predictor(x, y, None)
            predicted = predict(fits[role], x)
            residual[role] = fit_table((y - predicted).clamp(-FP16_MAX, FP16_MAX)) if residual_pca else None
            restored[role] = restore(fits[role], residual[role], predicted, y, width)
        turns = _turns(rotary_frequencies(model, types[i]), fits["key"])
        layers.append(CrossLayerLayer(fits["key"], fits["value"], turns, previous))
        if residual_pca:
            tables.append(PcaLayer(residual["key"], residual["value"], torch.zeros(len(turns))))
        below, previous = restored, i
    return CrossLayerCalibration(tuple(layers), None, PcaCalibration(tuple(tables)) if residual_pca else None)


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
            residual = y - predict(layer.role(role), x)  # (N, H, D)
            tables[role] = fit_table(residual.clamp(-FP16_MAX, FP16_MAX))
        layers.append(PcaLayer(tables["key"], tables["value"], torch.zeros(tables["key"].mean.shape[1])))
    return PcaCalibration(tuple(layers))


def cached_xlayer_calibration(
    model,
    model_name: str,
    calib_ids: torch.Tensor,
    rank: int | None = None,
    source: str | None = None,
    chain: int | None = None,
) -> CrossLayerCalibration:
    """fit_xlayer_calibration (with `chain`, a width: fit_chained_calibration at it, codebook's residuals), read
    from disk when the same model, calibration tokens (cut from the calibration `source`), rank and chain were
    fitted before."""
    identity = f"{CACHE_VERSION}|{model_identity(model, model_name)}|{rank}|{tuple(calib_ids.shape)}"
    identity += source_identity(source) + _chain_identity(chain, "codebook")
    if chain is None:
        fit = lambda: fit_xlayer_calibration(model, calib_ids, rank).to_frame()  # noqa: E731
    else:
        fit = lambda: fit_chained_calibration(model, calib_ids, chain, False).to_frame()  # noqa: E731
    frame = disk_cached(f"{model_name}-xlayer", identity, calib_ids, fit)
    return CrossLayerCalibration.from_frame(frame, len(layer_types(model.config)), rank)


def _chain_identity(chain: int | None, residual: str) -> str:
    """The part of a disk cache's identity that says how the predictors were fitted (nothing for exact inputs,
    the identity of every fit before the chained ones)."""
    return "" if chain is None else f"|chain {chain} {residual}"


def cached_xlayer_pca_calibration(
    model, model_name: str, calib_ids: torch.Tensor, source: str | None = None, chain: int | None = None
) -> CrossLayerCalibration:
    """The full-rank predictors (cached_xlayer_calibration) with the pca transforms of their residuals
    (fit_residual_pca) as `residual`, or with `chain`, a width, both from fit_chained_calibration at it; each read
    from disk when fitted before (the residuals' keyed by the predictors' digest)."""
    layers = len(layer_types(model.config))
    chained: list[CrossLayerCalibration] = []  # the chained fit, made once for both frames

    def chained_fit() -> CrossLayerCalibration:
        if not chained:
            chained.append(fit_chained_calibration(model, calib_ids, chain, True))
        return chained[0]

    if chain is None:
        predictors = cached_xlayer_calibration(model, model_name, calib_ids, None, source)
    else:
        identity = f"{CACHE_VERSION}|{model_identity(model, model_name)}|None|{tuple(calib_ids.shape)}"
        identity += source_identity(source) + _chain_identity(chain, "pca")
        frame = disk_cached(f"{model_name}-xlayer", identity, calib_ids, lambda: chained_fit().to_frame())
        predictors = CrossLayerCalibration.from_frame(frame, layers, None)
    identity = f"{CACHE_VERSION}|{model_identity(model, model_name)}|{PCA_WIDTHS}|{tuple(calib_ids.shape)}"
    identity += source_identity(source) + f"|{predictors.digest()}" + _chain_identity(chain, "pca")
    if chain is None:
        fit = lambda: fit_residual_pca(model, calib_ids, predictors).to_frame()  # noqa: E731
    else:
        fit = lambda: chained_fit().residual.to_frame()  # noqa: E731
    frame = disk_cached(f"{model_name}-xlayer-pca", identity, calib_ids, fit)
    return CrossLayerCalibration(predictors.layers, None, PcaCalibration.from_frame(frame, layers))
