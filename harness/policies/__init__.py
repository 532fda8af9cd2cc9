"""Bit-allocation policies: per-KV-head statistics and a budget -> widths per (layer, KV head, K|V).

This package owns the allocation rules and nothing else (no model code, no I/O). A policy is a frozen dataclass
(base.py: `Policy`, its fields the rule's hyperparameters, checked on construction); `allocate(entropy, budget,
price=, sensitivity=)` returns an `Allocation`; `from_point` builds the policy a grid point names, and
`POLICIES` lists every registered name. One file per family:
- uniform.py `uniform` (one width everywhere); sinks.py `sinks` (sinks at 16, the rest uniform);
- entropy.py `entropy` (b_h = c + alpha * (H_avg - H_h): fewer bits for high-entropy heads, low-entropy sink
  heads kept at 16); inverted.py `inverted` (the slope reversed); control.py `random` (entropy's widths dealt
  to random heads: the control);
- kv.py `kv` (keys and values as separate units: b = c + alpha * (H_avg - H_h) +- key_offset / 2, keys above
  values, so K8V4 or K4V2 and per-head mixes within the same budget; sink heads keep both at 16);
- measured.py `sensitivity` (greedy on measured errors: every head starts at the smallest width, then the
  promotion with the largest error reduction per extra bit that the budget still allows, until none fits) and
  `layerwise` (the same greedy with one width per layer, on the layer's summed error). They take 16 as a width
  only when `widths` lists it; alpha is unused.
- measured_kl.py `measured` (keys and values as separate units; the widths of least summed teacher-forced unit KL
  within the budget, exactly: knapsack.py's integer program, not a greedy), which takes 16 the same way.
Only these three assign 16 from `widths` (`assigns_full_width`); every other policy rounds among the quantized
widths and keeps only its sink heads at 16, so a 16 in its `widths` is refused with a one-line error.
A policy that allocates from a measured table names it in `measurement` (harness.sensitivity.MEASUREMENTS).
stats.py reads the entropy table (`kv_head_entropy`); budget.py holds the budget arithmetic the rules share.

Budget units: `bytes` (the config's default) meets the budget in true bytes: `budget` bits per element is
converted to the bytes uniform at that width would hold, and the scheme's byte model (a `price` per element at
each width and role: keys and values may cost apart) prices every head's keys and values, so a 16-bit sink head, which stores no scales, is charged its real bytes and
policies compared at one budget hold equal bytes. `bits` charges every head its width alone (equal mean bits),
the claim's convention. Budget modes: `exact` (the sinks are paid for by the other heads, the total never
exceeds the budget) and `claim` (a public write-up's procedure: nearest rounding, the budget applies to the
non-sink heads only, in bits).

A new policy is one file here (a registered dataclass, imported below) plus conf/policy/<name>.yaml, and one
line in tests/harness/test_policies.py's table.
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
