"""The exact multiple-choice knapsack: one option per unit, the least summed cost within a capacity.

`knapsack(cost, weight, capacity)`: unit u takes one option j (a width), which costs cost[u, j] (its measured
loss) and weighs weight[u, j] (what it holds: its price per element at that width times its elements); the
answer is the options of least summed cost whose summed weight stays within the capacity.

Solved as a 0/1 integer program by scipy.optimize.milp (HiGHS, relative gap 0): binary x[u, j], one equality
row per unit (exactly one option), one budget row. An integer program rather than a dynamic program over
integer weights: the weights here are bits per element plus the scheme's scale overhead, which is a multiple of
a common quantum only for some group sizes (16 bits of scale per 48 elements is 1/3 bit); the integer program
takes real weights as they are, and HiGHS proves the optimum (the LP relaxation of a multiple-choice knapsack has
at most two fractional variables, so branch and bound closes in milliseconds at hundreds of units). Each unit's
costs are shifted to start at 0 and all are scaled to at most 1 before solving (no argmin changes), so the
solver's absolute tolerances (1e-6) act on costs of order 1 whatever their unit.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from harness.policies.budget import TOLERANCE


def knapsack(cost: np.ndarray, weight: np.ndarray, capacity: float) -> np.ndarray:
    """int64 [u]: the option of each unit (cost, weight: float64 [u, k], finite) of least summed cost with
    summed weight at most capacity (+ TOLERANCE, float slack); ValueError when even the lightest options of
    every unit weigh more."""
    cost, weight = np.asarray(cost, dtype=np.float64), np.asarray(weight, dtype=np.float64)
    if cost.shape != weight.shape or cost.ndim != 2 or cost.shape[1] == 0:
        raise ValueError(
            f"knapsack: cost {cost.shape} and weight {weight.shape} must be one [units, options]"
        )
    if not (np.isfinite(cost).all() and np.isfinite(weight).all()):
        raise ValueError("knapsack: costs and weights must be finite")
    units, options = cost.shape
    lightest = weight.min(axis=1).sum() if units else 0.0
    if lightest > capacity + TOLERANCE:
        raise ValueError(
            f"knapsack: capacity {capacity:g} is below {lightest:g}, what the lightest option of every unit "
            "weighs together"
        )
    if units == 0:
        return np.zeros(0, dtype=np.int64)
    shifted = cost - cost.min(axis=1, keepdims=True)  # [u, k], >= 0, one 0 per unit
    scale = shifted.max()
    objective = (shifted / scale if scale > 0 else shifted).ravel()  # [u * k], x[u, j] at u * k + j
    one_hot = np.kron(np.eye(units), np.ones(options))  # [u, u * k]: each unit's options sum to 1
    constraints = [
        LinearConstraint(one_hot, 1, 1),
        LinearConstraint(weight.ravel()[None, :], -np.inf, capacity + TOLERANCE),
    ]
    result = milp(
        objective,
        constraints=constraints,
        integrality=np.ones(units * options),
        bounds=Bounds(0, 1),
        options={"mip_rel_gap": 0},
    )
    if result.x is None:
        raise RuntimeError(f"knapsack: the solver found no solution ({result.message})")
    choice = result.x.reshape(units, options).argmax(axis=1)  # [u]
    held = weight[np.arange(units), choice].sum()
    if held > capacity + TOLERANCE:  # the solver's feasibility tolerance, never seen at these sizes
        raise RuntimeError(f"knapsack: the solver's options weigh {held!r}, above the capacity {capacity!r}")
    return choice.astype(np.int64)
