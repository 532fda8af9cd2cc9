"""What unit totals finer than whole bits would buy pca's measured knapsack, by the knapsack's own prediction
(`python -m harness.sensitivity --finer-widths STEP --budgets B,B,...`).

pca stores a unit (layer, KV head, K|V) at width w as a plan of component widths summing to w D bits (the dynamic
program on calibration distortions, harness/calibrate/pca.py), and the `measured` policy gives each unit one whole
width from its measured unit KLs (harness/policies/measured_kl.py). One knapsack over components across units, as
KVTC spends bits, would let a unit's total be any number of bits. This check prices finer totals before anyone
builds a store for them:
- d(w): per unit, the calibration distortion (summed component mean squared error) of the plan the dynamic program
  gives at w D bits (`plan_distortions`), from the point's own pca fit;
- a unit's KL at a width between two measured whole widths w0 < w < w1, interpolated along d (`interpolated_costs`):
      KL(w) = KL(w0) + (KL(w1) - KL(w0)) (d(w) - d(w0)) / (d(w1) - d(w0));
  `leave_one_out` checks that rule on the table itself: each inner measured width interpolated from its neighbours,
  against what was measured there;
- the exact knapsack (harness.policies.knapsack) at each budget, over the measured whole widths and over the widths
  in steps of 1 / step between the narrowest and widest of them; weights in bits per element (a pca unit stores no
  per-token scales, and its table's bytes do not depend on its width), capacity the budget times the units, no
  sink heads: the `measured` policy's knapsack for pca with sink_threshold null. Reported: each one's predicted
  summed KL, and the mean whole width whose knapsack predicts what the finer one does, less the one it takes to
  predict its own figure (the bits the finer widths save: the summed bits of whole widths are whole, so a budget's
  last fraction of a bit per unit buys whole widths nothing).

Predictions only, as the knapsack's own are: unit KLs summed (the additivity check measures how well that holds),
and between whole widths interpolated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

from harness.calibrate.pca import HeadFit, pca_head_fits, plan_groups
from harness.policies.knapsack import knapsack
from harness.policies.measured_kl import unit_costs
from harness.schemes.base import ROLES, Scheme
from harness.schemes.pca import Pca
from harness.schemes.pca_table import PcaFormat
from harness.sensitivity.common import spearman

STEPS = (1, 2, 4, 8)  # finer widths in steps of 1 / step bits


def check_step(step: int, scheme: Scheme) -> None:
    """ValueError naming the key unless `scheme` stores plans of the pca family with every total of bits planned
    per head (one width per component from 0 to 8, plans each head's own) and `step` is one of STEPS."""
    if not isinstance(scheme, Pca):
        raise ValueError(
            f"quant.scheme: {scheme.name} stores no pca plans to spread finer widths over; allowed with "
            "--finer-widths: pca"
        )
    fmt = scheme.pca_format
    if fmt.group != 1 or tuple(fmt.group_widths) != tuple(range(9)) or fmt.shared_plans:
        raise ValueError(
            f"quant.scheme: {scheme.name}'s plans group components, bar some widths or are shared by every head, "
            "so not every total of bits has a plan of its own; allowed with --finer-widths: pca"
        )
    if isinstance(step, bool) or step not in STEPS:
        raise ValueError(f"--finer-widths: {step!r}; allowed: {', '.join(map(str, STEPS))}")


def fine_widths(widths: Sequence[int], step: int) -> list[float]:
    """The widths from min(widths) to max(widths) in steps of 1 / step (exact binary fractions)."""
    low, high = min(widths), max(widths)
    return [low + k / step for k in range((high - low) * step + 1)]


def plan_distortions(fit: HeadFit, widths: Sequence[float], fmt: PcaFormat) -> np.ndarray:
    """float64 (|widths|,): the calibration distortion of the plan at w D bits for each width w (w D whole)."""
    distortion = fit.distortion  # (D, K + 1)
    D = distortion.shape[0]
    out = []
    for w in widths:
        total = w * D
        if total != int(total):
            raise ValueError(f"--finer-widths: {w} bits x {D} components is not a whole number of bits")
        plan = plan_groups(distortion, int(total), fmt)  # (D,)
        out.append(float(distortion[torch.arange(D), plan].sum()))
    return np.array(out)


def between(kl0: np.ndarray, kl1: np.ndarray, d0: np.ndarray, d: np.ndarray, d1: np.ndarray) -> np.ndarray:
    """KL at a width between w0 and w1, per unit: kl0 + (kl1 - kl0) (d - d0) / (d1 - d0), all (U,); kl0 where
    d1 == d0 (a unit whose extra bits change nothing)."""
    span = d1 - d0
    share = np.divide(d - d0, span, out=np.zeros_like(span), where=span != 0)
    return kl0 + (kl1 - kl0) * share


def interpolated_costs(
    measured: np.ndarray, whole: Sequence[int], distortion: np.ndarray, widths: Sequence[float]
) -> np.ndarray:
    """float64 [U, |widths|]: each unit's KL at each width, the measured one at a whole width and between two
    measured whole widths interpolated along the unit's distortion (`between`).

    measured [U, |whole|]: KL at the whole widths (every whole width between the ends of `widths` measured);
    distortion [U, |widths|]: d at each width of `widths`."""
    whole = list(whole)
    at = {w: j for j, w in enumerate(widths)}
    out = np.empty((measured.shape[0], len(widths)))
    for j, w in enumerate(widths):
        if w in whole:
            out[:, j] = measured[:, whole.index(w)]
            continue
        w0, w1 = math.floor(w), math.ceil(w)
        kl0, kl1 = measured[:, whole.index(w0)], measured[:, whole.index(w1)]
        out[:, j] = between(kl0, kl1, distortion[:, at[w0]], distortion[:, j], distortion[:, at[w1]])
    return out


def leave_one_out(measured: np.ndarray, whole: Sequence[int], distortion: np.ndarray) -> pd.DataFrame:
    """Per inner whole width w (w - 1 and w + 1 measured too): the units' KL at w interpolated from w - 1 and
    w + 1 along `distortion` [U, |whole|] against `measured` [U, |whole|]: the summed KL of each, their ratio,
    the median relative error per unit and the Spearman correlation over units."""
    rows = []
    for k in range(1, len(whole) - 1):
        if whole[k - 1] != whole[k] - 1 or whole[k + 1] != whole[k] + 1:
            continue
        got = between(measured[:, k - 1], measured[:, k + 1], *distortion[:, k - 1 : k + 2].T)
        want = measured[:, k]
        rows.append(
            dict(
                width=whole[k],
                measured_sum=float(want.sum()),
                interpolated_sum=float(got.sum()),
                ratio=float(got.sum() / want.sum()),
                median_relative_error=float(np.median(np.abs(got - want) / want)),
                spearman=spearman(got, want),
            )
        )
    return pd.DataFrame(rows)


def predicted_kl(costs: np.ndarray, widths: Sequence[float], budget: float) -> float:
    """The least summed cost [U, |widths|] of one width per unit with mean width at most `budget`: the exact
    knapsack's prediction."""
    weights = np.broadcast_to(np.asarray(widths, dtype=np.float64), costs.shape)
    choice = knapsack(costs, weights, budget * len(costs))  # [U]
    return float(costs[np.arange(len(costs)), choice].sum())


def matching_budget(measured: np.ndarray, whole: Sequence[int], target: float) -> float:
    """The least mean width at which the knapsack over the whole widths predicts at most `target`, from measured
    [U, |whole|]: a bisection over the units' summed bits, a whole number at whole widths (the prediction never
    rises with them); max(whole) when even that predicts more. "At most" allows float rounding (1e-12): a sum of the
    same costs in another order must not miss the target by its last bit."""
    units = len(measured)
    low, high = min(whole) * units, max(whole) * units  # summed bits
    limit = target + 1e-12
    if predicted_kl(measured, whole, max(whole)) > limit:
        return float(max(whole))
    while low < high:
        middle = (low + high) // 2
        low, high = (
            (low, middle) if predicted_kl(measured, whole, middle / units) <= limit else (middle + 1, high)
        )
    return high / units


def unit_distortions(
    model, calib_ids: torch.Tensor, fmt: PcaFormat, widths: Sequence[float], shape: tuple[int, int]
) -> np.ndarray:
    """float64 [2, num_layers, num_kv_heads, |widths|]: each unit's plan distortion at each width (keys, then
    values; NaN for layers without a KV cache of their own), from the pca fit on calib_ids (C, Tc)."""
    out = np.full((len(ROLES), *shape, len(widths)), np.nan)
    for layer, fitted in enumerate(pca_head_fits(model, calib_ids, fmt)):
        if fitted is None:
            continue
        for role, fits in enumerate(fitted[:2]):
            for head, fit in enumerate(fits):
                out[role, layer, head] = plan_distortions(fit, widths, fmt)
    return out


def finer_widths_check(
    table: pd.DataFrame,
    distortion: np.ndarray,
    whole: Sequence[int],
    step: int,
    budgets: Sequence[float],
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The check (module docstring) on a unit KL table (harness.sensitivity.cached_unit_kl's columns) at the whole
    widths `whole` and the units' distortions [2, num_layers, num_kv_heads, |fine_widths(whole, step)|]
    (unit_distortions): one row per budget (budget, step, whole_kl, finer_kl, change: finer / whole - 1;
    whole_bits and matching_budget: the least mean whole width whose knapsack predicts whole_kl, and finer_kl;
    bits_saved: their difference, what whole widths would pay for the finer prediction) and the leave-one-out
    rows."""
    whole = sorted(whole)
    widths = fine_widths(whole, step)
    shape = distortion.shape[1:3]
    measured = unit_costs(table, shape, whole).numpy()  # [2, L, Hkv, |whole|]
    units = ~np.isnan(distortion[..., 0])  # [2, L, Hkv]: the cached units
    measured, distortion = measured[units], distortion[units]  # [U, ...]
    if np.isnan(measured).any():
        raise ValueError("unit KL table: lacks measurements for some cached units")
    costs = interpolated_costs(measured, whole, distortion, widths)  # [U, |widths|]
    rows = []
    for budget in budgets:
        coarse = predicted_kl(measured, whole, budget)
        finer = predicted_kl(costs, widths, budget)
        needed = matching_budget(measured, whole, coarse)  # what whole widths use of the budget
        matched = matching_budget(measured, whole, finer)
        rows.append(
            dict(
                budget=budget,
                step=step,
                whole_kl=coarse,
                finer_kl=finer,
                change=finer / coarse - 1,
                whole_bits=needed,
                matching_budget=matched,
                bits_saved=matched - needed,
            )
        )
    at = [widths.index(w) for w in whole]
    return pd.DataFrame(rows), leave_one_out(measured, whole, distortion[:, at])
