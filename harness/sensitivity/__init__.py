"""Measured sensitivity: how much quantizing each unit at each width hurts, on calibration data.

This package owns the measured tables the policies allocate from, their on-disk caches, and the checks that
they predict the real loss. `MEASUREMENTS` (measurements.py) maps the name a policy declares
(`Policy.measurement`) to the function that gives its table (model, model name, calibration ids, scheme,
widths, chunk):
- `proxy` (proxy.py): per (layer, KV head, width) attention-output error, one forward pass for all heads;
  read by `sensitivity` and `layerwise` (harness/policies/measured.py). `proxy_check` (proxy_check.py) ranks
  it against the KL; `python -m harness.sensitivity` runs it (harness/protocols/sensitivity_check.py).
- `unit_kl` (unit_kl.py): per (layer, KV head, K|V, width) teacher-forced KL with that unit alone quantized,
  one teacher-forced run per unit and width on a probe of the calibration windows (2 x 128 tokens unless a
  point's eval.calibration.probe says otherwise), each unit alone or in a context of every other unit at one
  width; read by `measured` (harness/policies/measured_kl.py).
  `additivity_check` tests whether unit KLs add up on random joint allocations (`--additivity N`).
chain.py measures how a cross-layer prediction's error grows along its chain of layers (`--chain W`); finer_widths.py
predicts what unit widths finer than whole bits would buy pca's knapsack (`--finer-widths STEP`); one_exact.py
measures whether keeping one unit exact, the rest quantized, lowers the KL as priced units assume (`--one-exact N`).
common.py holds what they share (allocation shape, cached heads, a cache at chosen widths, Spearman).
"""

from __future__ import annotations

from harness.sensitivity.common import spearman
from harness.sensitivity.measurements import MEASUREMENTS, READS_KEY_TABLES, READS_PROBE, check_reads_fitted
from harness.sensitivity.proxy import cached_sensitivity, head_sensitivity, measured_widths, scheme_quantizer
from harness.sensitivity.proxy_check import proxy_check, sample_heads
from harness.sensitivity.unit_kl import (
    additivity_check,
    allocation_kl,
    cached_unit_kl,
    check_context,
    predicted_kl,
    probe_ids,
    random_allocations,
    unit_kl_table,
)

__all__ = [
    "MEASUREMENTS",
    "READS_KEY_TABLES",
    "READS_PROBE",
    "additivity_check",
    "allocation_kl",
    "cached_sensitivity",
    "cached_unit_kl",
    "check_context",
    "check_reads_fitted",
    "head_sensitivity",
    "measured_widths",
    "predicted_kl",
    "probe_ids",
    "proxy_check",
    "random_allocations",
    "sample_heads",
    "scheme_quantizer",
    "spearman",
    "unit_kl_table",
]
