"""Bit-allocation policies: per-KV-head statistics and a budget -> widths per (layer, KV head, K|V).

No model code and no I/O. base.py holds the interface (`Policy`, `Allocation`, `POLICIES`, `from_point`), budget.py
the budget arithmetic the rules share, knapsack.py the exact width choice, stats.py the entropy table read per KV
head; one file per family (README's layout lists them). A new policy is one file here (a registered dataclass,
imported below), conf/policy/<name>.yaml and one line in tests/harness/test_policies.py's table.
"""

from harness.policies.base import (
    ALLOWED_WIDTHS,
    BUDGET_MODES,
    BUDGET_UNITS,
    POLICIES,
    Allocation,
    HeadPolicy,
    Heads,
    Policy,
    SinkPolicy,
    UnitPolicy,
    from_point,
)
from harness.policies.budget import head_scale_bits, quantized_widths, scale_bits
from harness.policies.stats import ENTROPY_KEYS, kv_head_entropy

# isort: off
# The families, in the order POLICIES lists them (error messages name every allowed policy in this order).
from harness.policies.uniform import Uniform
from harness.policies.entropy import Entropy
from harness.policies.sinks import Sinks
from harness.policies.control import Random
from harness.policies.inverted import Inverted
from harness.policies.measured import Layerwise, Sensitivity, head_errors
from harness.policies.kv import KeyValue
from harness.policies.measured_kl import MeasuredKL, unit_costs

# isort: on

__all__ = [
    "ALLOWED_WIDTHS",
    "BUDGET_MODES",
    "BUDGET_UNITS",
    "ENTROPY_KEYS",
    "POLICIES",
    "Allocation",
    "Entropy",
    "HeadPolicy",
    "Heads",
    "Inverted",
    "KeyValue",
    "Layerwise",
    "MeasuredKL",
    "Policy",
    "Random",
    "Sensitivity",
    "SinkPolicy",
    "Sinks",
    "Uniform",
    "UnitPolicy",
    "from_point",
    "head_errors",
    "head_scale_bits",
    "kv_head_entropy",
    "quantized_widths",
    "scale_bits",
    "unit_costs",
]
