"""The measured tables a policy may declare (`Policy.measurement`), by name, under one signature."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from harness.policies import Policy
from harness.schemes import Scheme
from harness.sensitivity.proxy import cached_sensitivity
from harness.sensitivity.unit_kl import cached_unit_kl


def _proxy(
    model,
    model_name: str,
    calib_ids: torch.Tensor,
    scheme: Scheme,
    widths: Sequence[int],
    chunk: int,
    source: str | None = None,
):
    """cached_sensitivity under the measurements' common signature (one forward pass: no chunks)."""
    return cached_sensitivity(model, model_name, calib_ids, scheme, widths, source)


# The tables a policy may declare (Policy.measurement): name -> f(model, model name, calibration ids (C, T),
# scheme, widths, chunk[, key_calibration=][, source=]) -> the table, measured once and cached on disk (source:
# the calibration source the ids were cut from, harness.calibrate.disk.source_identity).
MEASUREMENTS = {"proxy": _proxy, "unit_kl": cached_unit_kl}
# Those that measure through caches, and so take a scheme's fitted parts (key_calibration=: calkey, pca, ...); the
# proxy stores each head through the scheme alone, without them.
READS_KEY_TABLES = frozenset({"unit_kl"})
# Those measured on a probe of the calibration windows whose size a point sets (sequences=, tokens=:
# eval.calibration.probe); the proxy reads every calibration window.
READS_PROBE = frozenset({"unit_kl"})


def check_reads_fitted(policy: Policy, scheme: Scheme) -> None:
    """ValueError naming policy.name where `policy` measures its table without the fitted parts that `scheme`
    reads (its measurement is not in READS_KEY_TABLES)."""
    if scheme.key_tables and policy.measurement not in (None, *READS_KEY_TABLES):
        raise ValueError(
            f"policy.name: {policy.name} measures its table without fitted key tables, which quant.scheme "
            f"{scheme.name} needs; allowed with {scheme.name}: measured, or a policy that measures nothing"
        )
