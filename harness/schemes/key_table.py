"""The fitted key tables of `calkey` (harness/schemes/calkey.py): per layer, KV head and channel an fp16 scale and
zero, fitted offline on calibration keys (`fit_table`), so a stored key token carries no per-token metadata. A key
channel c is stored as x ~ zero[c] + scale[c] * y with y in [-1, 1] (calkey.py quantizes y).

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
gradient there of the calibration text's summed next-token NLL (harness/key_calibration.py). `fisher` (KVQuant's
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

import hashlib
import math
from dataclasses import dataclass

import pandas as pd
import torch

from kernels.reference import FP16_MAX

QUANTILE = 0.995  # of each channel's reach over the calibration keys (module docstring)
LEVEL_WIDTHS = (2, 3, 4)  # the widths nuqkey's levels are fitted for
# How the levels weigh each calibration key element (quant.key_levels): alike, or by a power of the calibration
# loss's gradient there (module docstring): |g| ** WEIGHT_POWER[key_levels].
KMEANS, FISHER, FISHER_SQRT = "kmeans", "fisher", "fisher_sqrt"
KEY_LEVELS = (KMEANS, FISHER, FISHER_SQRT)
WEIGHT_POWER = {FISHER: 2, FISHER_SQRT: 1}


def check_key_levels(levels: object) -> None:
    """ValueError naming quant.key_levels unless `levels` is one of KEY_LEVELS."""
    if levels not in KEY_LEVELS:
        raise ValueError(f"quant.key_levels: {levels!r} is not allowed; allowed: {', '.join(KEY_LEVELS)}")


LLOYD_ITERATIONS = 40
SCALE_MIN = 2.0**-14  # the smallest normal fp16: a channel never seen away from 0 still has a positive scale
LEVEL_COLUMNS = [f"level{b}_{i}" for b in LEVEL_WIDTHS for i in range(1 << b)]
COLUMNS = ["layer", "kv_head", "channel", "scale", "zero", "turn", *LEVEL_COLUMNS]


@dataclass(frozen=True, eq=False)
class KeyTable:
    """One layer's fitted key table, per KV head and channel: fp16 scale (> 0) and zero (calkey); the pre-RoPE
    levels of each width (nuqkey) and the radians per position of each channel's rotary pair."""

    scale: torch.Tensor  # (Hkv, D) float16
    zero: torch.Tensor  # (Hkv, D) float16
    turn: torch.Tensor  # (D,) float32: channels i and i + R / 2 turn by p * turn[i] at position p; 0 past R
    levels: dict[int, torch.Tensor]  # width b -> (Hkv, D, 2**b) float16, ascending along the last dim

    def __post_init__(self):
        assert self.scale.shape == self.zero.shape and self.scale.dim() == 2, (
            self.scale.shape,
            self.zero.shape,
        )
        assert self.scale.dtype == self.zero.dtype == torch.float16, (self.scale.dtype, self.zero.dtype)
        assert self.turn.shape == self.scale.shape[1:], (self.turn.shape, self.scale.shape)
        for b, lv in self.levels.items():
            assert lv.shape == (*self.scale.shape, 1 << b) and lv.dtype == torch.float16, (b, lv.shape)

    @property
    def rotary_frequencies(self) -> torch.Tensor:
        """inv_freq (R / 2,) float32 of the layer's rotary pairs (empty without RoPE)."""
        rotary = int((self.turn > 0).sum())
        return self.turn[: rotary // 2]


@dataclass(frozen=True, eq=False)
class KeyCalibration:
    """Every decoder layer's KeyTable (None for a layer without a KV cache of its own), fitted on one model's
    calibration windows; `levels`: how their levels were fitted (KEY_LEVELS)."""

    tables: tuple[KeyTable | None, ...]
    levels: str = KMEANS

    def layer(self, index: int) -> KeyTable:
        table = self.tables[index] if index < len(self.tables) else None
        if table is None:
            raise ValueError(f"key calibration: no fitted key table for layer {index}")
        return table

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, KV head, channel): COLUMNS (scale and zero as float32 of their fp16 values)."""
        frames = []
        for layer, table in enumerate(self.tables):
            if table is None:
                continue
            heads, dim = table.scale.shape
            head, channel = torch.meshgrid(torch.arange(heads), torch.arange(dim), indexing="ij")
            levels = torch.cat([table.levels[b].float() for b in LEVEL_WIDTHS], -1).reshape(heads * dim, -1)
            frame = pd.DataFrame(
                dict(
                    layer=layer,
                    kv_head=head.reshape(-1).numpy(),
                    channel=channel.reshape(-1).numpy(),
                    scale=table.scale.float().reshape(-1).numpy(),
                    zero=table.zero.float().reshape(-1).numpy(),
                    turn=table.turn.repeat(heads).numpy(),
                )
            )
            frames.append(pd.concat([frame, pd.DataFrame(levels.numpy(), columns=LEVEL_COLUMNS)], axis=1))
        return pd.concat(frames, ignore_index=True)[COLUMNS] if frames else pd.DataFrame(columns=COLUMNS)

    def digest(self) -> str:
        """A short hash of every fitted scale and zero with its place: equal digests, equal tables."""
        values = self.to_frame().to_numpy(dtype="float64")  # (rows, COLUMNS)
        return hashlib.sha256(values.tobytes()).hexdigest()[:16]

    @classmethod
    def from_frame(cls, frame: pd.DataFrame, num_layers: int, levels: str = KMEANS) -> KeyCalibration:
        """The inverse of to_frame for a model of num_layers decoder layers whose levels were fitted `levels`."""
        tables: list[KeyTable | None] = [None] * num_layers
        for layer, rows in frame.groupby("layer"):
            rows = rows.sort_values(["kv_head", "channel"])
            shape = (int(rows.kv_head.max()) + 1, int(rows.channel.max()) + 1)
            scale, zero = (torch.tensor(rows[c].to_numpy()).view(shape).half() for c in ("scale", "zero"))
            turn = torch.tensor(rows.turn.to_numpy(), dtype=torch.float32).view(shape)[0]
            per_width, at = {}, 0
            for b in LEVEL_WIDTHS:
                columns = LEVEL_COLUMNS[at : at + (1 << b)]
                per_width[b] = torch.tensor(rows[columns].to_numpy()).view(*shape, 1 << b).half()
                at += 1 << b
            tables[int(layer)] = KeyTable(scale, zero, turn, per_width)
        return cls(tuple(tables), levels)


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


def _unturned_pairs(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
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
        z = _unturned_pairs(x, positions, inv_freq)
        out[..., :half], out[..., half : 2 * half] = z.real.float(), z.imag.float()
    return out


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
        z = _unturned_pairs(x, positions, inv_freq)  # (N, H, half)
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
