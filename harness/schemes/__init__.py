"""Quantization schemes by name (`quant.scheme`): how one layer's keys and values are stored, and what one stored
token costs in bytes. harness/schemes/base.py has the interface (Scheme, the Store protocol, the byte model
token_bytes, the SCHEMES registry); one file per family:
- `asym_token` (AsymToken): per token, groups of g along head_dim, min/max, fp16 scale and zero (like q4_1);
- `sym_token` (SymToken): per token, groups of g, absmax, fp16 scale (like q4_0);
- `kivi` (Kivi, ChannelStore): keys per channel over groups of g tokens, values as asym_token, residual 32;
- `fp8` (Fp8, Fp8Store): e4m3 with an fp16 absmax scale per (token, head); quantized heads 8-bit;
- `rotate+<scheme>` (Rotated, RotatedStore): a Hadamard rotation of head_dim around any of the above;
- `codebook` (Codebook, CodebookStore): a Hadamard rotation, then per (token, head) b-bit indices into the
  Lloyd-Max codebook of N(0, 1) (lloyd_max.py) and one fp16 scale (TurboQuant-style); rotated already, so
  registered after rotate (no rotate+codebook);
- `calkey` (CalKey, CalKeyStore): keys per channel against a scale and zero fitted offline per layer and KV head
  on calibration text (key_table.py; rotary pairs share a symmetric scale), optional fp16 outliers, values as
  asym_token; registered after rotate (a rotation would mix the rotary pairs its table relies on);
- `nuqkey` (NuqKey, NuqKeyStore): keys turned back to before RoPE, per channel the nearest of 2**b levels fitted
  offline (k-means on calibration keys, key_table.py), optional fp16 outliers, values as asym_token; after calkey;
- `nuqkey_codebook` (NuqKeyCodebook): nuqkey's keys with codebook's values; after nuqkey.
FullStore, SinkStore and ResidualStore (wrappers.py) keep tokens unquantized for every scheme. A new scheme is
one file here that registers a Scheme subclass, imported below (before rotate, which wraps every scheme
registered before it, unless the scheme rotates itself), and one YAML file in conf/quant.
"""

# The import order is the registration order (the order of the allowed names in errors); rotate wraps every scheme
# registered before it, so only codebook, which rotates itself, and calkey, nuqkey and nuqkey_codebook, whose key
# tables rely on the rotary pairs a rotation would mix, come after it.
# isort: off
from harness.schemes.base import (
    ROLES,
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
from harness.schemes.rotate import ROTATE, Rotated, RotatedStore
from harness.schemes.codebook import Codebook, CodebookStore
from harness.schemes.calkey import CalKey, CalKeyStore
from harness.schemes.nuqkey import NuqKey, NuqKeyStore
from harness.schemes.nuqkey_codebook import NuqKeyCodebook
from harness.schemes.key_table import FISHER, FISHER_SQRT, KEY_LEVELS, KMEANS, KeyCalibration, KeyTable
from harness.schemes.wrappers import FullStore, ResidualStore, SinkStore, starts_at

# isort: on

__all__ = [
    "FISHER",
    "FISHER_SQRT",
    "KEY_LEVELS",
    "KMEANS",
    "ROLES",
    "ROTATE",
    "SCHEMES",
    "AsymToken",
    "CalKey",
    "CalKeyStore",
    "ChannelStore",
    "Codebook",
    "CodebookStore",
    "Fp8",
    "Fp8Store",
    "FullStore",
    "KeyCalibration",
    "KeyTable",
    "Kivi",
    "NuqKey",
    "NuqKeyCodebook",
    "NuqKeyStore",
    "ResidualStore",
    "Rotated",
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
