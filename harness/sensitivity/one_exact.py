"""What keeping one unit exact does when every other unit is quantized (`--one-exact N`).

The measured knapsack prices each unit on its own: alone (every other unit at 16) or in context (its marginal cost
around every unit at one width, eval.calibration.probe.context), and adds the prices up. If costs added, keeping
one unit exact while the rest stay quantized would lower the KL by about that unit's cost. `one_exact_check`
measures it: with every cached unit at `width`, it moves one random unit at a time to 16 (unquantized) and runs the
same sequences teacher-forced again. A positive difference means the exact unit raised the model's KL: the units'
quantization errors interact, which no table of separately priced units can see.
"""

from __future__ import annotations

import pandas as pd
import torch

from harness.schemes import FittedParts, Scheme
from harness.schemes.base import ROLES
from harness.sensitivity.common import cached_heads
from harness.sensitivity.unit_kl import allocation_kl, baseline_run, context_bits
from kernels.layout import FULL_WIDTH

COLUMNS = ["layer", "kv_head", "role", "kl_all", "kl_one_exact", "difference"]


def sample_units(model, count: int, seed: int = 0) -> list[tuple[int, int, str]]:
    """`count` distinct (layer, kv_head, role) units of the model's cached heads, drawn at random (seeded), in
    draw order; ValueError naming --one-exact when the model has fewer."""
    units = [(layer, kv_head, role) for layer, kv_head in cached_heads(model) for role in ROLES]
    if not 1 <= count <= len(units):
        raise ValueError(f"--one-exact: {count}; allowed: 1 to {len(units)} (the model's cached units)")
    order = torch.randperm(len(units), generator=torch.Generator().manual_seed(seed))
    return [units[i] for i in order[:count].tolist()]


@torch.no_grad()
def one_exact_check(
    model,
    input_ids: torch.Tensor,
    scheme: Scheme,
    width: int,
    count: int,
    seed: int = 0,
    chunk: int = 128,
    key_calibration: FittedParts | None = None,
) -> pd.DataFrame:
    """On input_ids (S, T): kl_all, the KL with every cached unit at `width`, and for each of `count` random units
    (sample_units) kl_one_exact, the KL with that unit at 16 and the rest at `width`; difference = kl_one_exact -
    kl_all (> 0: keeping the unit exact raised the KL). KLs are means over scored positions in nats
    (harness.sensitivity.allocation_kl), through caches reading key_calibration's fitted parts where the scheme
    has them. One row per unit, in draw order."""
    scheme.check_widths([width], "--width")
    units = sample_units(model, count, seed)
    base = baseline_run(model, input_ids, chunk)
    everywhere = context_bits(model, width)  # int64 [num_layers, num_kv_heads]
    kl_all = allocation_kl(model, input_ids, scheme, everywhere, everywhere, base, chunk, key_calibration)
    rows = []
    for layer, kv_head, role in units:
        bits = {r: everywhere.clone() for r in ROLES}
        bits[role][layer, kv_head] = FULL_WIDTH
        kl = allocation_kl(model, input_ids, scheme, bits["key"], bits["value"], base, chunk, key_calibration)
        rows.append(
            dict(
                layer=layer,
                kv_head=kv_head,
                role=role,
                kl_all=kl_all,
                kl_one_exact=kl,
                difference=kl - kl_all,
            )
        )
    return pd.DataFrame(rows, columns=COLUMNS)
