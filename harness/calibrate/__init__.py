"""Everything fitted on a model's calibration windows (never its evaluation windows), each cached on disk keyed by
the model, the windows' tokens and the calibration source (`disk`):

| module    | fits                                                        | for                                   |
|-----------|-------------------------------------------------------------|---------------------------------------|
| entropy   | per-head attention entropy (H2, H1)                         | every policy: entropy, sinks, ...     |
| keys      | per-channel key scales, zeros and pre-RoPE levels (KeyCalibration) | calkey, nuqkey, nuqkey_codebook |
| pca       | per-head bases, plans and scales of keys before RoPE and values (PcaCalibration) | pca; vq2, vq4, vq8 (means) |
| xlayer    | cross-layer predictors at a rank (CrossLayerCalibration)    | xlayer, xlayer_r32, xlayer_r8         |
|           | and pca's transforms of their residuals                     | xlayer_pca                            |
|           | both fitted along the chain at a width                      | xlayer_chain<w>, xlayer_pca_chain<w>  |
| cq        | channel-group codebooks (CqCalibration)                     | cq2, cq4                              |

`windows` gives what every fit reads (each cached layer's keys, values, positions, key gradients; the model's
rotary frequencies). The fitted tables' containers live beside the schemes that read them
(harness/schemes/*_table.py). `FITS` maps a scheme's `fit` kind (Scheme.fit, for a scheme with key_tables) to the
function that fits its parts, and `cached_fit` asks the one a scheme needs. (The measured knapsack's unit-error
tables are measurements, not fits: harness.sensitivity.)
"""

from __future__ import annotations

import torch

from harness.calibrate.cq import cached_cq_calibration
from harness.calibrate.entropy import cached_head_entropies, head_entropies
from harness.calibrate.keys import cached_key_calibration
from harness.calibrate.pca import cached_pca_calibration
from harness.calibrate.windows import layer_types
from harness.calibrate.xlayer import cached_xlayer_calibration, cached_xlayer_pca_calibration
from harness.schemes import KMEANS, Scheme

__all__ = ["FITS", "cached_fit", "cached_head_entropies", "head_entropies", "layer_types"]

# kind -> f(scheme, model, model name, calibration ids (C, T), span, key levels, source) -> the fitted parts
FITS = {
    "key_tables": lambda scheme, model, name, ids, span, levels, source: cached_key_calibration(
        model, name, ids, span, levels, source
    ),
    "pca": lambda scheme, model, name, ids, span, levels, source: cached_pca_calibration(
        model, name, ids, source, scheme.pca_format
    ),
    "xlayer": lambda scheme, model, name, ids, span, levels, source: cached_xlayer_calibration(
        model, name, ids, scheme.rank, source, scheme.chain_width
    ),
    "xlayer_pca": lambda scheme, model, name, ids, span, levels, source: cached_xlayer_pca_calibration(
        model, name, ids, source, scheme.chain_width
    ),
    "cq": lambda scheme, model, name, ids, span, levels, source: cached_cq_calibration(
        model, name, ids, scheme.channels, source
    ),
}


def cached_fit(
    scheme: Scheme,
    model,
    model_name: str,
    calib_ids: torch.Tensor,
    span: int,
    levels: str = KMEANS,
    source: str | None = None,
):
    """The parts `scheme` fits (FITS[scheme.fit]) on calib_ids for positions below `span`; None for a scheme that
    fits nothing (key_tables false)."""
    if not scheme.key_tables:
        return None
    return FITS[scheme.fit](scheme, model, model_name, calib_ids, span, levels, source)
