"""The parts a scheme fits on calibration text, by kind (`Scheme.fit` of a scheme with key_tables): `FITS` maps
the kind to the function that fits them on a model's calibration windows (cached on disk, keyed by the
calibration source), and `cached_fit` asks the one a scheme needs:
- `key_tables` (calkey, nuqkey, nuqkey_codebook): harness.key_calibration's KeyCalibration;
- `pca` (pca): harness.pca_calibration's PcaCalibration;
- `xlayer` (xlayer, xlayer_r32, xlayer_r8): harness.xlayer_calibration's CrossLayerCalibration at the scheme's rank;
- `cq` (cq2, cq4): harness.cq_calibration's CqCalibration for the scheme's channel groups.
(vq2, vq4 and vq8 read pca's fit for its means.)
"""

from __future__ import annotations

import torch

from harness.cq_calibration import cached_cq_calibration
from harness.key_calibration import cached_key_calibration
from harness.pca_calibration import cached_pca_calibration
from harness.schemes import KMEANS, Scheme
from harness.xlayer_calibration import cached_xlayer_calibration

# kind -> f(scheme, model, model name, calibration ids (C, T), span, key levels, source) -> the fitted parts
FITS = {
    "key_tables": lambda scheme, model, name, ids, span, levels, source: cached_key_calibration(
        model, name, ids, span, levels, source
    ),
    "pca": lambda scheme, model, name, ids, span, levels, source: cached_pca_calibration(
        model, name, ids, source
    ),
    "xlayer": lambda scheme, model, name, ids, span, levels, source: cached_xlayer_calibration(
        model, name, ids, scheme.rank, source
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
