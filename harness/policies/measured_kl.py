"""`measured`: keys and values as separate units, widths by the exact knapsack on measured unit KLs (DESIGN.md 3.6).

harness.sensitivity's `unit_kl` table holds, per (layer, KV head, K|V) unit and quantized width, the teacher-forced
KL when that unit alone is quantized (`unit_costs` reads it). The non-sink heads' keys and values are 2m units;
together they take the widths of least summed KL within the budget, exactly (harness.policies.knapsack: not a
greedy). Summing unit KLs assumes they add; harness.sensitivity.additivity_check measures how well they do. A
table measured in context (eval.calibration.probe.context) holds marginal KLs around every unit at one width,
negative where a unit gains: the same knapsack minimizes their sum.

The budget is HeadPolicy's, counted per unit: every unit holds as many elements as its head's keys (the byte
model's price per element is one for every head, averaged over their head_dim), so a unit of role r at a
quantized width w weighs w + credit_r bits per element (credit_r: the scales a quantized unit of that role
stores, from the scheme's byte model per role; 0 under a bits budget) and at 16 weighs 16 (no scales). The 2m
units may hold 2 * heads.target + m * (credit_key + credit_value): the bytes HeadPolicy's m heads may hold, keys
and values together. 16 is a candidate (KL 0) only when `widths`
lists it; a sink rule (SinkPolicy's fields, none by default) keeps both units of its heads at 16 first; alpha is
unused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd
import torch

from harness.policies.base import Heads, UnitPolicy, register
from harness.policies.knapsack import knapsack
from harness.schemes.base import ROLES
from kernels.layout import FULL_WIDTH


def unit_costs(table: pd.DataFrame, shape: tuple[int, int], widths: Sequence[int]) -> torch.Tensor:
    """float64 [2, num_layers, num_kv_heads, |widths|]: each unit's measured KL at each width, keys then values;
    0 at 16, NaN for units without rows.

    `table` has columns layer, kv_head, role (key / value), bits, kl (harness.sensitivity.cached_unit_kl).
    """
    missing = {"layer", "kv_head", "role", "bits", "kl"} - set(table.columns)
    if missing:
        raise ValueError(f"unit KL table: missing columns {sorted(missing)}")
    out = torch.full((len(ROLES), *shape, len(widths)), math.nan, dtype=torch.float64)
    for j, width in enumerate(widths):
        if width == FULL_WIDTH:
            out[..., j] = 0.0
            continue
        rows = table[table["bits"] == width]
        if rows.empty:
            measured = sorted(set(table["bits"].tolist()))
            raise ValueError(f"unit KL table: no measurements at width {width}; measured widths: {measured}")
        role = torch.tensor([ROLES.index(r) if r in ROLES else -1 for r in rows["role"]])  # [rows]
        layer = torch.tensor(rows["layer"].to_numpy(dtype="int64"))  # [rows]
        kv_head = torch.tensor(rows["kv_head"].to_numpy(dtype="int64"))  # [rows]
        kl = torch.tensor(rows["kl"].to_numpy(dtype="float64"))  # [rows]
        inside = (role >= 0) & (layer >= 0) & (layer < shape[0]) & (kv_head >= 0) & (kv_head < shape[1])
        if not inside.all() or not torch.isfinite(kl).all():
            raise ValueError(
                f"unit KL table: rows outside {shape} heads x roles {ROLES}, or KL values that are not finite"
            )
        out[role, layer, kv_head, j] = kl
    return out


@register("measured")
@dataclass(frozen=True)
class MeasuredKL(UnitPolicy):
    """Per (head, K|V) unit, the widths of least summed unit KL within the budget (the exact knapsack)."""

    measurement: ClassVar[str | None] = "unit_kl"
    assigns_full_width: ClassVar[bool] = True

    def free_widths(self, heads: Heads) -> tuple[torch.Tensor, torch.Tensor]:
        """Widths of the 2m units of the non-sink heads (int64 [2m]: their keys, then their values) and their
        levels (NaN [2m]: there is no pre-rounding value)."""
        candidates = heads.quantized + ([FULL_WIDTH] if FULL_WIDTH in self.widths else [])
        grid = unit_costs(heads.sensitivity, tuple(heads.cached.shape), candidates)  # [2, L, Hkv, |W|]
        costs = grid[:, heads.cached][:, ~heads.sinks].flatten(0, 1)  # [2m, |W|]: keys, then values
        if torch.isnan(costs).any():
            raise ValueError("unit KL table: lacks measurements for some cached units")
        m = len(costs) // 2
        # bits per element with the scales, per role: a unit at 16 stores none
        weights = np.array(
            [
                [w + credit if w != FULL_WIDTH else float(w) for w in candidates]
                for credit in heads.role_credit
            ]
        ).repeat(m, axis=0)  # [2m, |W|]: keys, then values
        capacity = 2 * heads.target + m * sum(heads.role_credit)  # 2 * (target + m * credit)
        choice = knapsack(costs.numpy(), weights, capacity)  # [2m]
        bits = torch.tensor(candidates, dtype=torch.int64)[torch.from_numpy(choice)]
        return bits, torch.full((2 * m,), math.nan, dtype=torch.float64)
