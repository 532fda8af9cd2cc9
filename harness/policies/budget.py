"""Budget arithmetic shared by the policies: what the free heads may hold, and widths that hold it.

This module owns the numbers behind every allocation, with no policy in it:
- `scale_bits`: bits per element that a quantized unit of one role stores beside its codes, from the scheme's
  byte model; `head_scale_bits`: a head's mean over its keys and values (the credit a 16-bit head, which stores
  no scales, leaves to the others under a bytes budget);
- `free_target`: the bits the non-sink heads may hold in total, in either budget mode (`exact` refuses a
  budget that cannot pay for the sinks at the smallest width);
- `level_widths` (by `solve_levels`, `round_within`, `claim_round`): continuous levels c + offset meeting a
  target, rounded to the allowed widths (never above the target; or the claim's nearest-width procedure);
- `greedy`, `measured_widths`: the promotion greedy on measured errors (per head or per layer).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from harness.schemes.base import ROLES
from kernels.layout import FULL_WIDTH

TOLERANCE = 1e-9  # bits: float slack when comparing an integer total with budget * n


def quantized_widths(widths: Iterable[int]) -> list[int]:
    """The distinct quantized widths (all but 16), ascending."""
    return sorted({int(width) for width in widths} - {FULL_WIDTH})


def budget_range(widths: Sequence[int]) -> tuple[int, int]:
    """The budgets (mean bits) a policy over `widths` allows: its narrowest quantized width to its widest width."""
    return quantized_widths(widths)[0], max(widths)


def scale_bits(price: Callable[[int, str], float], widths: Sequence[int], role: str) -> float:
    """Bits per element that a quantized unit of `role` (a head's keys or its values) stores beside its codes
    (scales, zeros), from the byte model.

    `price(w, role)`: bytes per stored element of `role` at width w. The bytes budget needs it affine in the
    width (the same overhead at every quantized width), as every per-token and per-channel scheme here is; 16
    stores none.
    """
    overhead = {w: 8 * price(w, role) - w for w in quantized_widths(widths)}
    values = list(overhead.values())
    if max(values) - min(values) > 1e-9:
        raise ValueError(
            f"policy.budget_unit: bytes needs a byte model with the same overhead at every width; got {overhead} "
            f"for the {role}s"
        )
    full = 8 * price(FULL_WIDTH, role)
    if abs(full - FULL_WIDTH) > 1e-9:
        raise ValueError(f"policy.budget_unit: an unquantized head must cost 16 bits per element; got {full}")
    return values[0]


def head_scale_bits(price: Callable[[int, str], float], widths: Sequence[int]) -> float:
    """Bits per element of scales that a quantized head stores: the mean of its keys' and its values' (each role
    priced by its own byte model). A head at width w costs w + head_scale_bits per element of each role, so
    the one-role budget arithmetic (free_target) stays exact with this as its credit."""
    return sum(scale_bits(price, widths, role) for role in ROLES) / len(ROLES)


def _check_affordable(budget: float, n: int, n_sinks: int, low: int, credit: float = 0.0) -> None:
    needed = FULL_WIDTH * n_sinks + low * (n - n_sinks) - credit * n_sinks
    if needed > budget * n + TOLERANCE:
        raise ValueError(
            f"policy.budget: {budget} bits/head x {n} cached heads = {budget * n:g} bits cannot pay for "
            f"{n_sinks} sink heads at {FULL_WIDTH} bits with the other {n - n_sinks} at the smallest width "
            f"{low} ({needed:g} bits, {needed / n:.4g} bits/head)"
        )


def free_target(budget: float, n: int, n_sinks: int, budget_mode: str, low: int, credit: float) -> float:
    """Bits the n - n_sinks non-sink heads may hold in total at `budget` bits per cached head.

    `exact`: the total over all n heads, sinks at 16 included, meets the budget; `credit` (bits per element of
    scales, bytes budgets only) is what each sink does not store and the others may. `claim`: the budget
    applies to the non-sink heads only (the credit is unused).
    """
    if budget_mode == "exact":
        _check_affordable(budget, n, n_sinks, low, credit)
        return budget * n - FULL_WIDTH * n_sinks + credit * n_sinks
    return budget * (n - n_sinks)


def solve_levels(offset: torch.Tensor, target: float, low: int, high: int) -> torch.Tensor:
    """float64 [m]: clip(c + offset, low, high) with c bisected so that the sum is target (never above)."""
    if len(offset) == 0:
        return offset.clone()
    lo = low - offset.max().item()  # every head at `low`
    hi = high - offset.min().item()  # every head at `high`
    if target >= high * len(offset):
        return (hi + offset).clamp(low, high)
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if (mid + offset).clamp(low, high).sum().item() <= target:
            lo = mid
        else:
            hi = mid
    return (lo + offset).clamp(low, high)


def round_within(continuous: torch.Tensor, target: float, widths: list[int]) -> torch.Tensor:
    """int64 [m]: round down to a width, then one promotion pass by largest remaining fraction.

    A head whose step would push the total above target is skipped; later (smaller) steps may still fit.
    """
    grid = torch.tensor(widths, dtype=torch.float64)  # [|W|]
    index = (torch.searchsorted(grid, continuous, right=True) - 1).clamp(0, len(widths) - 1)  # [m]
    upper = (index + 1).clamp(max=len(widths) - 1)
    step = grid[upper] - grid[index]  # [m], 0 at the top width
    fraction = torch.where(step > 0, (continuous - grid[index]) / step.clamp(min=1), 0.0)
    total = grid[index].sum().item()
    for head in torch.argsort(-fraction, stable=True).tolist():
        if fraction[head] <= 0:
            break
        if total + step[head].item() <= target + TOLERANCE:
            total += step[head].item()
            index[head] += 1
    return grid[index].long()


def claim_round(continuous: torch.Tensor, target: float, widths: list[int]) -> torch.Tensor:
    """int64 [m]: the write-up's rounding: nearest width, then fix-ups by closeness to an integer."""
    grid = torch.tensor(widths, dtype=torch.float64)  # [|W|]
    index = (continuous[:, None] - grid[None, :]).abs().argmin(dim=1)  # [m], ties -> lower width
    distance = (continuous - continuous.round()).abs()  # [m]
    top = len(widths) - 1
    while grid[index].sum().item() > target + TOLERANCE:
        head = torch.where(index > 0, distance, math.inf).argmin()
        index[head] -= 1
    while True:
        step = grid[(index + 1).clamp(max=top)] - grid[index]
        fits = (index < top) & (grid[index].sum() + step <= target + TOLERANCE)
        if not fits.any():
            return grid[index].long()
        index[torch.where(fits, distance, math.inf).argmin()] += 1


def level_widths(
    offset: torch.Tensor, target: float, budget: float, budget_mode: str, widths: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 [m], float64 [m]): widths and pre-rounding levels b = c + offset of m heads (offset float64 [m]).

    `exact`: c solved so that the levels, clipped to [min W, max W], sum to target, then rounded within it;
    `claim`: c = budget, nearest widths, then the claim's fix-ups to meet target (widths: quantized, ascending).
    """
    if budget_mode == "exact":
        continuous = solve_levels(offset, target, widths[0], widths[-1])
        return round_within(continuous, target, widths), continuous
    continuous = (budget + offset).clamp(widths[0], widths[-1])
    return claim_round(continuous, target, widths), continuous


def greedy(errors: torch.Tensor, sizes: torch.Tensor, costs: list[float], target: float) -> torch.Tensor:
    """int64 [u]: a width index per unit (a head, or a layer's heads sharing one width).

    errors: float64 [u, |W|], a unit's error at each width; costs: bits per element that each width costs,
    ascending; sizes: float64 [u], its heads (one step of s bits costs s * size bits). Every unit starts at
    widths[0]; then, repeatedly, the promotion with the largest error reduction per extra bit among those that
    keep the total within target and do not raise the error (ties: lowest unit, then the cheaper promotion). A
    promotion may skip widths: measured errors need not be convex in the width, and a step that gains nothing
    may open the way to one that gains much.
    """
    grid = torch.tensor(costs, dtype=torch.float64)  # [|W|]
    index = torch.zeros(len(sizes), dtype=torch.int64)  # [u]
    units = torch.arange(len(sizes))
    total = costs[0] * sizes.sum().item()
    while True:
        cost = (grid[None, :] - grid[index][:, None]) * sizes[:, None]  # [u, |W|] extra bits
        gain = errors[units, index][:, None] - errors  # [u, |W|]
        allowed = (cost > 0) & (total + cost <= target + TOLERANCE) & (gain >= 0)
        if not allowed.any():
            return index
        rate = torch.where(allowed, gain / cost.clamp(min=1), -math.inf)
        unit, width = divmod(int(rate.argmax()), len(costs))
        index[unit] = width
        total += cost[unit, width].item()


def measured_widths(
    errors: torch.Tensor,
    layer: torch.Tensor,
    per_layer: bool,
    widths: list[int],
    costs: list[float],
    target: float,
) -> torch.Tensor:
    """int64 [m]: widths of m heads (errors float64 [m, |W|], layer int64 [m]) by `greedy` within target bits
    (each width costing `costs` bits per element), each head its own unit or (per_layer) one unit per layer on
    the layer's summed error."""
    unit = torch.unique(layer, return_inverse=True)[1] if per_layer else torch.arange(len(layer))  # [m]
    n_units = int(unit.max()) + 1 if len(unit) else 0
    unit_errors = torch.zeros(n_units, len(widths), dtype=torch.float64).index_add_(0, unit, errors)
    sizes = torch.bincount(unit, minlength=n_units).double()  # [units]
    index = greedy(unit_errors, sizes, costs, target)
    return torch.tensor(widths, dtype=torch.int64)[index[unit]]
