"""How a cross-layer prediction's error grows along its chain (xlayer's schemes: each layer predicted from what the
stores restored of the layer below).

`chain_errors` walks the chain over windows' exact states (harness/calibrate/xlayer.py's chain_states: the model
run without quantization, every layer holding every position), every head of every layer at one width, and gives
per (layer, role) three squared errors over the states' squared norm: the prediction from what the chain restored
below (what a store predicts from), the prediction from the exact states below (what a fit on exact inputs saw),
and what the store restores. A map that amplifies the errors of its inputs shows as the first far above the
second; where the first passes 1 the prediction is worse than predicting zeros.
"""

from __future__ import annotations

import pandas as pd
import torch

from harness.calibrate.xlayer import chain_inputs, chain_states, predict, restore
from harness.schemes.xlayer_table import XLAYER_ROLES, CrossLayerCalibration


@torch.no_grad()
def chain_errors(model, ids: torch.Tensor, calibration: CrossLayerCalibration, width: int) -> pd.DataFrame:
    """One row per (layer, role) of windows ids (S, T) at `width` (module docstring): layer, role, predicted,
    predicted_from_exact, restored."""
    rows = []
    below = exact_below = None  # the cached layer below: what the chain restored of it, its exact states
    for i, states in enumerate(chain_states(model, ids)):
        if states is None:
            continue
        layer = calibration.layer(i)
        restored = {}
        for role in XLAYER_ROLES:
            y, fit = states[role], layer.role(role)
            predicted = predict(fit, chain_inputs(role, len(y), below, restored.get("key")))
            from_exact = predict(fit, chain_inputs(role, len(y), exact_below, states["key"]))
            table = None if calibration.residual is None else calibration.residual.layer(i).role(role)
            restored[role] = restore(fit, table, predicted, y, width)
            energy = y.pow(2).sum()
            errors = {
                name: float((estimate - y).pow(2).sum() / energy)
                for name, estimate in (
                    ("predicted", predicted),
                    ("predicted_from_exact", from_exact),
                    ("restored", restored[role]),
                )
            }
            rows.append({"layer": i, "role": role, **errors})
        below, exact_below = restored, states
    return pd.DataFrame(rows)
