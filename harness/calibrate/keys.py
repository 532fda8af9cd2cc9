"""The key tables of `calkey`, `nuqkey` and `nuqkey_codebook` (harness/schemes/key_table.py's KeyCalibration)
fitted on a model's calibration windows (harness/calibrate/windows.py: each cached layer's post-RoPE keys at
their positions, position 0 of every window left out), and their on-disk cache.

Keys reach the cache after the rotary embedding (RoPE). In transformers' rotate_half layout the first R channels of
a head form pairs (i, i + R / 2) that RoPE turns together, by p * theta_i radians at position p: as a complex number
z = k_i + 1j * k_(i+R/2), the cached key is z0 * exp(1j * p * theta_i), z0 the key before RoPE. A pair's norm is
the same at every position; its channels are not: a pair that turns slowly (low theta_i) keeps its direction over
a whole context, and its channels their offsets. So the table is fitted for keys at any position in [0, span):
each calibration key, turned back to position 0 (its position is known), could sit at any of those positions,
so its pair sweeps the arc of angles [angle(z0), angle(z0) + (span - 1) * theta_i]; a channel's range for that key
is the least and most of |z0| cos (or sin) along the arc, and the table's range for the channel is the QUANTILE-th
quantile of those over the calibration keys (the (1 - QUANTILE)-th of the least): zero its centre, scale its
half-width. A pair that turns a full circle within the span gets the symmetric range [-q, q] in both channels,
q the quantile of the pair's norms (zero 0); one that never turns gets its channels' own quantile ranges.
Channels past R (every channel of a model without RoPE, gpt2) are fitted alone, as that.

QUANTILE: chosen by measurement on calibration text only: smollm2-135m's 8 calibration windows of 512 tokens,
tables fitted on the first 4 (span 1024), the other 4 teacher-forced (chunks of 128) through caches of calkey
keys, fp16 values and one fp16 sink token; mean KL to the unquantized cache (nats) and ppl ratio:
    quantile                 4 bits            3 bits
    1 (the max)              0.0568  1.0645    0.3161  1.3910
    0.999                    0.0440  1.0469    0.2774  1.3017
    0.995 (QUANTILE)         0.0416  1.0443    0.2261  1.2741
    0.99                     0.0555  1.0584    0.2049  1.2635
    0.99, 1% outliers        0.0358  1.0341    0.1853  1.2509
(Fitting for span 8192, smollm2's context limit, instead of 1024 costs: 4 bits at quantile 1, ppl ratio 1.1510
against 1.0645.)

The same fit gives `nuqkey` (harness/schemes/nuqkey.py) its tables: the calibration keys turned back to position 0
(pre-RoPE, where a channel's distribution does not depend on the position), and per KV head, channel and width b
in LEVEL_WIDTHS the 2**b levels of a 1-D k-means (Lloyd's algorithm from the quantiles, `fit_levels`) of that
channel's pre-RoPE values (KVQuant's non-uniform datatype). `turn` records the radians per position of each
channel's rotary pair (0 past R), which the store needs to turn keys back.

Fisher-weighted levels (quant.key_levels): the k-means weighs each pre-RoPE key element by a power of g, the
gradient there of the calibration text's summed next-token NLL (windows.calibration_key_gradients). `fisher` (KVQuant's
sensitivity weighting) weighs by g**2, the diagonal of the empirical Fisher information: to second order the loss
an error e on that element adds is proportional to g**2 e**2. `fisher_sqrt` weighs by |g|, the same ranking
shrunk toward equal weights: g**2 over one calibration text is a noisy estimate, a few tokens' weights dwarf the
rest, and the levels then fit those few. The gradient at a post-RoPE key turns back to the pre-RoPE one exactly as
the key does (RoPE is a rotation, `unturn`).

Chosen by measurement on calibration text only: smollm2-135m, levels fitted on its 8 calibration windows of 512
tokens (span 1024), 8 other calibration windows of 1024 tokens (seed 11) teacher-forced in chunks of 128 through
nuqkey keys with 1% outliers, fp16 values and one fp16 sink token; mean KL to the unquantized cache (nats) and ppl
ratio:
    levels                                   4 bits            3 bits
    kmeans                                   0.0141  1.0146    0.0454  1.0622
    fisher (g**2)                            0.0171  1.0225    0.0482  1.0581
    fisher_sqrt (|g|)                        0.0126  1.0159    0.0379  1.0496
    g**2 with labels drawn from the model    0.0156  1.0193    0.0439  1.0485
      (the true Fisher, 4 draws), its root   0.0115  1.0157    0.0382  1.0472
(A one-off script over fit_table, calibration_keys and calibration_key_gradients made these rows; labels drawn
from the model, which did no better than |g| with the text's own labels, are not an option here.)
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from harness.calibrate.disk import disk_cached, model_identity, source_identity
from harness.calibrate.windows import (
    calibration_key_gradients,
    calibration_keys,
    layer_types,
    rotary_frequencies,
    unturn,
    unturned_pairs,
)
from harness.schemes.key_table import (
    FISHER,
    FISHER_SQRT,
    KMEANS,
    LEVEL_WIDTHS,
    SCALE_MIN,
    KeyCalibration,
    KeyTable,
    check_key_levels,
)
from kernels.reference import FP16_MAX

QUANTILE = 0.995  # of each channel's reach over the calibration keys (module docstring)
WEIGHT_POWER = {FISHER: 2, FISHER_SQRT: 1}  # the levels weigh each key element by |g| ** WEIGHT_POWER[levels]
LLOYD_ITERATIONS = 40
CACHE_VERSION = 2  # 2: the tables carry nuqkey's levels and the rotary turns


def _quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """The nearest-rank q-quantile of x along dim 0 (q = 1: the max): float32 x.shape[1:]."""
    n = x.shape[0]
    rank = min(max(int(-(-q * n // 1)) - 1, 0), n - 1)  # ceil(q * n) - 1
    return x.sort(0).values[rank]


def _arc_extremes(angle: torch.Tensor, sweep: torch.Tensor, at: float) -> tuple[torch.Tensor, torch.Tensor]:
    """min and max of cos(beta - at) over beta in [angle, angle + sweep] (elementwise, sweep >= 0)."""
    ends = torch.stack([torch.cos(angle - at), torch.cos(angle + sweep - at)])
    hits = lambda c: torch.remainder(c + at - angle, 2 * math.pi) <= sweep  # noqa: E731  c + at + 2 pi k inside
    return torch.where(hits(math.pi), -1.0, ends.amin(0)), torch.where(hits(0.0), 1.0, ends.amax(0))


def fit_levels(
    x: torch.Tensor, n: int, iterations: int = LLOYD_ITERATIONS, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The n levels of a 1-D k-means of each column of x (N, C), each value weighted by `weights` (N, C) >= 0
    (None: all 1): Lloyd's algorithm from the column's weighted quantiles at (i + 1/2) / n, each step on the
    sorted column (boundaries halfway between levels, a value on one taken by the upper level; a level the
    weighted mean of the values between its boundaries; a level with no weight there keeps its place): float32
    (C, n), ascending. (nuqkey's store codes a value on a boundary to the lower level: equally near, the same
    error.)"""
    order = x.double().T.sort(-1)  # (C, N)
    xs = order.values.contiguous()
    C, N = xs.shape
    w = torch.ones_like(xs) if weights is None else weights.double().T.gather(-1, order.indices)  # (C, N)
    w = torch.where(w.sum(-1, keepdim=True) > 0, w, 1.0)  # a column with no weight anywhere: unweighted
    zeros = xs.new_zeros(C, 1)
    mass = torch.cat([zeros, w.cumsum(-1)], -1)  # (C, N + 1): mass[:, j] = w[:, :j].sum()
    moment = torch.cat([zeros, (w * xs).cumsum(-1)], -1)  # (C, N + 1): the same of w * xs
    target = (torch.arange(n, dtype=torch.float64) + 0.5) / n * mass[:, -1:]  # (C, n)
    at = torch.searchsorted(mass[:, 1:].contiguous(), target, side="right").clamp(max=N - 1)
    levels = xs.gather(1, at)  # (C, n)
    for _ in range(iterations):
        bounds = (levels[:, 1:] + levels[:, :-1]) / 2  # (C, n - 1)
        edges = torch.cat(
            [xs.new_zeros(C, 1, dtype=torch.long), torch.searchsorted(xs, bounds), torch.full((C, 1), N)], -1
        )  # (C, n + 1): level i takes xs[:, edges[i]:edges[i + 1]]
        weight = mass.gather(1, edges[:, 1:]) - mass.gather(1, edges[:, :-1])
        total = moment.gather(1, edges[:, 1:]) - moment.gather(1, edges[:, :-1])
        levels = torch.where(weight > 0, total / weight.clamp(min=1e-300), levels).sort(-1).values
    return levels.float()


def fit_table(
    keys: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    span: int,
    quantile: float = QUANTILE,
    level_weights: torch.Tensor | None = None,
) -> KeyTable:
    """The KeyTable of one layer from its calibration keys (N, Hkv, D) (post-RoPE, any float dtype) at sequence
    `positions` (N,), for keys at any position in [0, span): rotary pairs turn at inv_freq (R / 2,) radians per
    position (R = 0: no RoPE), each channel's range is the quantile of what its pair can reach (module docstring).
    level_weights (N, Hkv, D) >= 0: the weight of each pre-RoPE key element in the levels' k-means (None: all
    alike; Fisher weights, module docstring)."""
    N, H, D = keys.shape
    half = inv_freq.shape[0]
    R = 2 * half
    if N == 0:
        raise ValueError("key calibration: no calibration keys to fit a table on")
    if R > D:
        raise ValueError(f"key calibration: {half} rotary frequencies for head_dim {D}")
    x = keys.float().clamp(-FP16_MAX, FP16_MAX)
    lo, hi = x.clone(), x.clone()  # (N, H, D): the least and most each channel reaches
    unturned = x.clone()  # (N, H, D): the keys at position 0 (pre-RoPE)
    turns = torch.zeros(D)  # (D,): radians per position of each channel's pair
    if half:
        turns[:half], turns[half:R] = inv_freq.float(), inv_freq.float()
        z = unturned_pairs(x, positions, inv_freq)  # (N, H, half)
        unturned[..., :half], unturned[..., half:R] = z.real.float(), z.imag.float()
        r, angle = z.abs().float(), z.angle().float()
        sweep = (inv_freq.double() * (span - 1)).float().expand_as(angle)
        for part, at in ((slice(0, half), 0.0), (slice(half, R), math.pi / 2)):  # cos, then sin
            low, high = _arc_extremes(angle, sweep, at)
            lo[..., part], hi[..., part] = r * low, r * high
    low, high = _quantile(-lo, quantile).neg(), _quantile(hi, quantile)  # (H, D)
    zero, scale = (high + low) / 2, (high - low) / 2
    weights = None if level_weights is None else level_weights.reshape(N, H * D)
    levels = {
        b: fit_levels(unturned.reshape(N, H * D), 1 << b, weights=weights)
        .view(H, D, 1 << b)
        .clamp(-FP16_MAX, FP16_MAX)
        .half()
        for b in LEVEL_WIDTHS
    }
    return KeyTable(
        scale.clamp(SCALE_MIN, FP16_MAX).half(), zero.clamp(-FP16_MAX, FP16_MAX).half(), turns, levels
    )


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
