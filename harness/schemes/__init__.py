"""Quantization schemes by name (`quant.scheme`): how one layer's keys and values are stored, and what one stored
token costs in bytes.

base.py holds the interface (Scheme, the Store protocol, the byte model token_bytes, the SCHEMES registry,
from_point); one file per family (README's layout lists them); wrappers.py keeps sink and residual tokens
unquantized for every scheme. A new scheme is one file here that registers a Scheme subclass, imported below, and
one YAML file in conf/quant.
"""

# The import order is the order of the allowed names in errors, nothing more: rotate registers rotate+<name> for
# its explicit list (rotate.ROTATABLE), whichever families are imported before it.
# isort: off
from harness.schemes.base import (
    ROLES,
    SCHEME_OPTIONS,
    SCHEMES,
    Scheme,
    Store,
    check_backend,
    default_residual,
    from_point,
    get_scheme,
    packed_names,
    point_fields,
)
from harness.schemes.asym_token import AsymToken
from harness.schemes.sym_token import SymToken
from harness.schemes.kivi import ChannelStore, Kivi
from harness.schemes.fp8 import Fp8, Fp8Store
from harness.schemes.rotate import ROTATABLE, ROTATE, Rotated, RotatedStore, rotate
from harness.schemes.codebook import Codebook, CodebookStore
from harness.schemes.calkey import CalKey, CalKeyStore
from harness.schemes.nuqkey import NuqKey, NuqKeyStore
from harness.schemes.nuqkey_codebook import NuqKeyCodebook
from harness.schemes.pca import Pca, PcaStore
from harness.schemes.xlayer import Xlayer, XlayerStore
from harness.schemes.vq import Vq, VqStore
from harness.schemes.cq import Cq, CqStore
from harness.schemes.key_table import FISHER, FISHER_SQRT, KEY_LEVELS, KMEANS, KeyCalibration, KeyTable
from harness.schemes.wrappers import FullStore, ResidualStore, SinkStore, starts_at
from harness.schemes.pca_table import PcaCalibration
from harness.schemes.xlayer_table import CrossLayerCalibration
from harness.schemes.cq_table import CqCalibration

# isort: on

# What a scheme with key_tables reads, fitted on calibration text (harness.calibrate fits them, Scheme.fit says which)
FittedParts = KeyCalibration | PcaCalibration | CrossLayerCalibration | CqCalibration

__all__ = [
    "FISHER",
    "FittedParts",
    "FISHER_SQRT",
    "KEY_LEVELS",
    "KMEANS",
    "ROLES",
    "ROTATABLE",
    "ROTATE",
    "SCHEME_OPTIONS",
    "SCHEMES",
    "AsymToken",
    "CalKey",
    "CalKeyStore",
    "ChannelStore",
    "Codebook",
    "CodebookStore",
    "Cq",
    "CqStore",
    "Fp8",
    "Fp8Store",
    "FullStore",
    "KeyCalibration",
    "KeyTable",
    "Kivi",
    "NuqKey",
    "NuqKeyCodebook",
    "NuqKeyStore",
    "Pca",
    "PcaStore",
    "Vq",
    "VqStore",
    "Xlayer",
    "XlayerStore",
    "ResidualStore",
    "Rotated",
    "rotate",
    "RotatedStore",
    "Scheme",
    "SinkStore",
    "Store",
    "SymToken",
    "check_backend",
    "default_residual",
    "from_point",
    "get_scheme",
    "packed_names",
    "point_fields",
    "starts_at",
]
