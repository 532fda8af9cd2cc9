"""The attention implementations of this project and the one way to install them on a model.

`installed(model, implementation, state)` (base.py) is a context manager: within it `model` attends through
`implementation` with its per-run `state`; after it, everything is as before. Importing this package registers
nothing with transformers. Implementations, one file each:
- packed.py: PACKED, quantized caches attended from their packed form (torch blockwise, Triton fused decode);
- scored.py: SCORED, PACKED plus the attention probabilities H2O eviction ranks tokens by;
- probes.py: ENTROPY_PROBE (calibration entropies) and SENSITIVITY_PROBE (per-head quantization error);
- qdq.py: QDQ, the claim protocol's quantize-dequantize attention without a cache.
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
