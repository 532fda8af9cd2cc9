"""The attention implementations of this project and the one way to install them on a model:
`with installed(model, implementation, state): ...` (base.py); importing this package registers nothing. One file
per implementation: packed.py (PACKED), scored.py (SCORED), probes.py (ENTROPY_PROBE, SENSITIVITY_PROBE), qdq.py
(QDQ).
"""

from harness.attention.base import Implementation, active, eager_forward, installed, kv_source_layer
from harness.attention.packed import PACKED, DecodeStep, PackedStep, Steps, post_step
from harness.attention.probes import ENTROPY_PROBE, SENSITIVITY_PROBE
from harness.attention.qdq import QDQ, QDQSpec
from harness.attention.scored import SCORED, Scores, post_scorer

__all__ = [
    "ENTROPY_PROBE",
    "PACKED",
    "QDQ",
    "SCORED",
    "SENSITIVITY_PROBE",
    "DecodeStep",
    "Implementation",
    "PackedStep",
    "QDQSpec",
    "Scores",
    "Steps",
    "active",
    "eager_forward",
    "installed",
    "kv_source_layer",
    "post_scorer",
    "post_step",
]
