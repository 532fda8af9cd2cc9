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
- `nuqkey_codebook` (NuqKeyCodebook): nuqkey's keys with codebook's values; after nuqkey;
- `pca` (Pca, PcaStore): keys before RoPE and values on a PCA basis fitted per layer and KV head (pca_table.py),
  bits per component by a dynamic program so that trailing components may get 0; after nuqkey_codebook;
- `xlayer`, `xlayer_r32`, `xlayer_r8` (Xlayer, XlayerStore): AQUA-KV's cross-layer prediction (each layer's keys
  and values predicted from the layer below's, full rank or rank 32 / 8, xlayer_table.py), the residual in
  codebook's format; simulated caches only; after pca;
- `vq2`, `vq4`, `vq8` (Vq, VqStore): keys before RoPE and values less their calibration mean, rotated and coded p
  coordinates at a time to a fixed grid (2-D and 4-D k-means grids of N(0, I), E8's Voronoi code: grids.py), one
  fp16 scale per token and head; after xlayer;
- `cq2`, `cq4` (Cq, CqStore): keys before RoPE and values, groups of 2 or 4 channels coded jointly against k-means
  codebooks fitted per layer, KV head and group on calibration text (cq_table.py), codebooks counted; after vq.
FullStore, SinkStore and ResidualStore (wrappers.py) keep tokens unquantized for every scheme. A new scheme is
one file here that registers a Scheme subclass, imported below (before rotate, which wraps every scheme
registered before it, unless the scheme rotates itself), and one YAML file in conf/quant.
"""

# The import order is the registration order (the order of the allowed names in errors); rotate wraps every scheme
# registered before it, so only codebook, which rotates itself, and calkey, nuqkey, nuqkey_codebook and pca, whose
# fitted tables rely on the rotary pairs a rotation would mix (and pca on its own basis), come after it.
# isort: off
from harness.schemes.base import (
    ROLES,
    SCHEMES,
    Scheme,
    Store,
    check_backend,
    default_residual,
    get_scheme,
    packed_names,
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

# What a scheme with key_tables reads, fitted on calibration text (harness.fitted builds them, Scheme.fit says which)
FittedParts = KeyCalibration | PcaCalibration | CrossLayerCalibration | CqCalibration

__all__ = [
    "FISHER",
    "FittedParts",
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
    "RotatedStore",
    "Scheme",
    "SinkStore",
    "Store",
    "SymToken",
    "check_backend",
    "default_residual",
    "get_scheme",
    "packed_names",
    "starts_at",
]
