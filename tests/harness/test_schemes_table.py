"""Every registered scheme through the same invariants: one line of CASES per scheme (rotate+ variants included).

- a round trip stays within one step of the scheme's format on fresh random inputs of odd shapes, appended in
  uneven chunks, packed-only and simulated alike;
- token_bytes (the byte model of capacity, the bytes budget and the reports) equals what the store of each role
  reports, with and without sink tokens, a residual window and key groups apart from the values';
- every store, and every store inside it, satisfies the Store protocol;
- constant and zero groups give no NaN or inf, and zeros come back exact.
A scheme that reads fitted tables (calkey, nuqkey: key tables; pca: transforms) is bound to ones fitted on the test's
keys and values (`ready`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import harness.schemes
from harness import capacity
from harness.calibrate.cq import fit_table as fit_codebooks_table
from harness.calibrate.keys import fit_table
from harness.calibrate.pca import fit_table as fit_transform
from harness.schemes import (
    SCHEME_OPTIONS,
    SCHEMES,
    KeyCalibration,
    Pca,
    Scheme,
    Store,
    from_point,
    get_scheme,
    point_fields,
)
from harness.schemes.cq_table import CqCalibration, CqLayer
from harness.schemes.pca_table import PcaCalibration, PcaLayer
from harness.schemes.xlayer_table import CrossLayerCalibration, CrossLayerLayer, Predictor
from kernels.layout import FULL_WIDTH, PackedStore
from kernels.reference import hadamard_rotate


def integer_step(bits: int) -> float:
    """Largest error of an integer format relative to the absmax of what it quantizes: half a step of an
    absmax scale (half of asym's min/max step is at most as large)."""
    return 0.5 / (2 ** (bits - 1) - 1)


@dataclass(frozen=True)
class Case:
    name: str
    step: Callable[[int], float] = integer_step  # bits -> error bound relative to the head's absmax
    zero_keys_exact: bool = True  # whether a key of zeros comes back exact
    zero_values_exact: bool = True  # whether a value of zeros comes back exact
    simulated_only: bool = False  # its stores keep their reconstruction (xlayer): built with simulate=True


# pca and its variants (harness/schemes/pca.py): every registered scheme of the family
PCA_FAMILY = tuple(name for name in SCHEMES.names() if isinstance(get_scheme(name), Pca))
CASES = [
    Case("asym_token"),
    Case("sym_token"),
    Case("kivi"),
    Case("fp8", step=lambda bits: 2**-4),  # e4m3: 3 mantissa bits, half an ulp
    Case("rotate+asym_token"),
    Case("rotate+sym_token"),
    Case("rotate+kivi"),
    Case("rotate+fp8", step=lambda bits: 2**-4),
    # Levels of N(0, 1) scaled to each vector: past the outermost level an element is clipped to it, so the
    # error of an element stays below the head's absmax, not within an integer step.
    Case("codebook", step=lambda bits: 1.0),
    # A rotary pair's scale is the pair's largest norm: up to sqrt(2) times either channel's absmax.
    Case("calkey", step=lambda bits: math.sqrt(2) * integer_step(bits)),
    # Levels fitted on the test's keys as if at other positions (`ready`): a channel turned back can reach its pair's
    # norm (up to sqrt(2) absmax) and the nearest level lie as far on the other side, and turning forward mixes the
    # pair's two errors. A loose bound; test_nuqkey.py checks the format exactly against its oracle.
    # Its levels are k-means centres, none of them 0 in general: a key of zeros comes back as the nearest levels.
    Case("nuqkey", step=lambda bits: 4.0, zero_keys_exact=False),
    # nuqkey's keys and codebook's values: the looser of the two bounds.
    Case("nuqkey_codebook", step=lambda bits: 4.0, zero_keys_exact=False),
    # A transform fitted on the test's vectors: at 1 bit per element most components are dropped, so a bound of
    # the head's absmax a few times over (test_pca.py checks the format exactly against its oracle); a vector of
    # zeros comes back as the fitted mean and its nearest levels, not zeros.
    *(
        Case(name, step=lambda bits: 4.0, zero_keys_exact=False, zero_values_exact=False)
        for name in PCA_FAMILY
    ),
    # Cross-layer prediction with one layer and no layer below (`ready`: a bias per head, no inputs): codebook's
    # format on the residual from that bias, so codebook's bound (the residual's absmax is at most about twice the
    # head's); zeros come back as the bias plus its nearest levels. test_xlayer.py checks layers that predict.
    *(
        Case(name, step=lambda bits: 2.0, zero_keys_exact=False, zero_values_exact=False, simulated_only=True)
        for name in ("xlayer", "xlayer_r32", "xlayer_r8", "xlayer_chain2", "xlayer_chain3", "xlayer_chain4")
    ),
    # The same with the residual in pca's format, its transforms fitted on the test's vectors less the bias: pca's
    # loose bound (test_xlayer.py checks the format against its oracle).
    *(
        Case(name, step=lambda bits: 4.0, zero_keys_exact=False, zero_values_exact=False, simulated_only=True)
        for name in ("xlayer_pca", "xlayer_pca_chain2", "xlayer_pca_chain3", "xlayer_pca_chain4")
    ),
    # Fixed grids after the fitted mean and the rotation: a loose bound, as pca's (test_vq.py checks the format
    # exactly against its oracle); zeros come back as the mean plus its nearest grid points.
    *(
        Case(name, step=lambda bits: 4.0, zero_keys_exact=False, zero_values_exact=False)
        for name in ("vq2", "vq4", "vq8")
    ),
    # Codebooks fitted on the test's vectors: each group to its nearest centroid, so within the data's span (a loose
    # bound as pca's; test_cq.py checks the format against its oracle); zeros come back as their nearest centroids.
    *(
        Case(name, step=lambda bits: 4.0, zero_keys_exact=False, zero_values_exact=False)
        for name in ("cq2", "cq4")
    ),
]
IDS = [case.name for case in CASES]
G, B, D = 8, 3, 32
ROLES = ("key", "value")


def widths(scheme: Scheme) -> list[int]:
    """Every width the scheme stores, a 16-bit head among them, and an odd number of heads."""
    return [scheme.widths[0], FULL_WIDTH, *scheme.widths[1:], scheme.widths[-1], *scheme.widths[:1]][:5]


def ready(scheme: Scheme, heads: int, x: torch.Tensor | None = None) -> Scheme:
    """The scheme, ready to build stores of `heads` KV heads: a scheme whose keys read a fitted table (calkey)
    bound to a table fitted on the keys x (B, heads, T, D) (random ones without x) as a model whose rotary pairs
    all turn a full circle (zero 0, scale the pair's largest norm); any other scheme as it is."""
    if not scheme.key_tables:
        return scheme
    keys = torch.randn(64, heads, D) if x is None else x.transpose(1, 2).reshape(-1, heads, D)
    if scheme.fit == "pca":  # keys and values alike, on the same vectors; no rotary pairs
        fitted = fit_transform(keys, fmt=scheme.pca_format)
        layer = PcaLayer(fitted, fitted, torch.zeros(D))
        return scheme.for_layer(0, PcaCalibration((layer,)))
    if scheme.fit == "cq":  # keys and values alike, on the same vectors; no rotary pairs
        table = fit_codebooks_table(keys, scheme.channels)
        return scheme.for_layer(0, CqCalibration((CqLayer(table, table, torch.zeros(D)),), scheme.channels))
    if scheme.fit in ("xlayer", "xlayer_pca"):  # one layer, no layer below: each head predicted by its mean
        bias = keys.mean(0).half()  # (H, D)
        first = Predictor(bias, weight=torch.zeros(heads, 0, D).half())
        layer = CrossLayerLayer(first, first, torch.zeros(D), None)
        residual = None
        if scheme.fit == "xlayer_pca":  # the residuals' transforms, keys and values alike
            fitted = fit_transform(keys - bias.float())
            residual = PcaCalibration((PcaLayer(fitted, fitted, torch.zeros(D)),))
        return scheme.for_layer(0, CrossLayerCalibration((layer,), scheme.rank, residual))
    table = fit_table(keys, torch.arange(len(keys)), torch.ones(D // 2), span=8, quantile=1.0)
    return scheme.for_layer(0, KeyCalibration((table,)))


def feed(store, x: torch.Tensor, chunks=(1, 15, 21)):
    start, got = 0, None
    for n in chunks:
        got = store.append(x[:, :, start : start + n])
        start += n
    assert start == x.shape[2]
    return got


def parts(store) -> list:
    """The store and every store inside it (wrappers' parts, a rotation's base)."""
    inner = getattr(store, "parts", None) or ([store.base] if hasattr(store, "base") else [])
    return [store, *(p for part in inner for p in parts(part))]


def test_the_table_lists_every_registered_scheme():
    assert [case.name for case in CASES] == SCHEMES.names()


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("role", ROLES)
def test_round_trip_within_one_step(case, role):
    scheme = get_scheme(case.name, group_size=G, residual=0)
    bits = widths(scheme)
    torch.manual_seed(SCHEMES.names().index(case.name) + 10 * (role == "key"))
    x = torch.randn(B, len(bits), 37, D) * torch.logspace(-1, 1, D) + 0.3  # (B, H, T, D), odd T
    scheme = ready(scheme, len(bits), x)
    simulated = feed(scheme.new_store(bits, D, B, torch.float32, "cpu", role, simulate=True), x)
    if not case.simulated_only:
        packed = scheme.new_store(bits, D, B, torch.float32, "cpu", role)
        assert feed(packed, x) is None  # packed-only: nothing dequantized is returned or kept
        # the same stored form, read whole here and append by append there: within float summation order (pca's
        # evenly spaced levels are one product per run of tokens, whose sums a run's length may reorder)
        torch.testing.assert_close(packed.dequantize(), simulated, rtol=1e-5, atol=1e-5)
    got = simulated
    rotated = scheme.rotated and not (role == "key" and scheme.key_tables)  # nuqkey_codebook's keys are not
    if rotated:  # compare in the rotated domain, where the format quantized (H is its own inverse)
        x, got = hadamard_rotate(x), hadamard_rotate(got)
    for h, b in enumerate(bits):
        err = (got[:, h] - x[:, h]).abs()
        if b == FULL_WIDTH and not rotated:
            assert torch.equal(got[:, h], x[:, h])
            continue
        absmax = x[:, h].abs().amax()
        bound = 0 if b == FULL_WIDTH else case.step(b)
        assert err.max() <= (bound + 2**-9) * absmax + 1e-5, (case.name, role, h, b)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("sinks, residual", [(0, 0), (2, 3)])
@pytest.mark.parametrize("key_group_size", [None, 16])
def test_token_bytes_is_what_the_store_holds(case, role, sinks, residual, key_group_size):
    key_tables = get_scheme(case.name).key_tables
    key_groups = None if key_tables else key_group_size  # calkey's and nuqkey's keys have no groups
    scheme = get_scheme(case.name, G, sink_tokens=sinks, residual=residual, key_group_size=key_groups)
    bits = widths(scheme)
    scheme = ready(scheme, len(bits))
    store = scheme.new_store(bits, D, B, torch.float16, "cpu", role, simulate=case.simulated_only)
    table = sum(scheme.table_bytes(b, D, role) for b in bits)  # held once, whatever the tokens
    x = torch.randn(B, len(bits), 37, D, dtype=torch.float16)
    start = 0
    for n in (1, 15, 21):
        store.append(x[:, :, start : start + n])
        start += n
        quantized = max(start - min(sinks, start) - residual, 0)  # sinks and the newest tokens stay 16-bit
        if scheme.per_channel(role):
            g = scheme.role_group_size(role)
            quantized = quantized // g * g  # whole groups of g tokens only
        per_token = sum(scheme.token_bytes(b, D, role) for b in bits)
        fp16 = scheme.token_bytes(FULL_WIDTH, D, role) * len(bits)
        held = B * (quantized * per_token + (start - quantized) * fp16) + table
        assert store.nbytes() == held, (case.name, start)
        assert store.nbytes_fp16() == B * start * fp16


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("role", ROLES)
def test_every_store_satisfies_the_store_protocol(case, role):
    for options in (dict(residual=0), dict(sink_tokens=2, residual=3)):
        scheme = get_scheme(case.name, group_size=G, **options)
        bound = ready(scheme, len(widths(scheme)))
        store = bound.new_store(
            widths(scheme), D, 1, torch.float32, "cpu", role, simulate=case.simulated_only
        )
        for part in parts(store):
            assert isinstance(part, Store), (case.name, type(part).__name__)


def test_every_store_class_is_built_and_checked():
    """The table reaches every store class of harness.schemes and PackedStore (so the test above checks each)."""
    seen = set()
    for name in SCHEMES:
        for role in ROLES:
            scheme = get_scheme(name, group_size=G, sink_tokens=1, residual=1)
            simulate = scheme.reads_previous_layer
            store = ready(scheme, 2).new_store(
                [scheme.widths[-1], 16], D, 1, torch.float32, "cpu", role, simulate
            )
            seen |= {type(p) for p in parts(store)}
    classes = {
        c for _, c in inspect.getmembers(harness.schemes, inspect.isclass) if c.__name__.endswith("Store")
    }
    assert classes - {Store} | {PackedStore} <= seen


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_constant_and_zero_groups_give_no_nan(case, role, dtype):
    scheme = get_scheme(case.name, group_size=G, residual=0)
    bits = widths(scheme)
    x = torch.zeros(2, len(bits), 3 * G, D)  # (B, H, T, D): one group of zeros, one constant, one of both
    x[:, :, G : 2 * G] = 3.0
    x[:, :, 2 * G :, : D // 2] = -1e-8
    x = x.to(dtype)
    store = ready(scheme, len(bits), x).new_store(bits, D, 2, dtype, "cpu", role, simulate=True)
    got = feed(store, x, (5, 2 * G - 5, G))
    assert got.dtype == dtype and torch.isfinite(got).all() and torch.isfinite(store.dequantize()).all()
    if case.zero_values_exact if role == "value" else case.zero_keys_exact:
        assert torch.equal(got[:, :, :G], x[:, :, :G])  # zeros stay exact


# --- one object per configured scheme, built from names ----------------------------------------------------


OPTIONS = {  # a valid, non-default value of every Scheme option for some scheme
    "asym_token": dict(group_size=16, sink_tokens=2, residual=4, key_group_size=8),
    "kivi": dict(group_size=16, key_group_size=64, residual=16),
    "rotate+sym_token": dict(group_size=8, sink_tokens=1),
    "calkey": dict(sink_tokens=1, outliers=0.01),
    "nuqkey": dict(outliers=0.02, key_levels="fisher_sqrt"),
}


@pytest.mark.parametrize("name", [*SCHEMES])
def test_a_scheme_and_its_point_fields_round_trip(name):
    scheme = get_scheme(name, **OPTIONS.get(name, {}))
    fields = point_fields(scheme)
    assert fields["scheme"] == name and set(fields) == {"scheme", *SCHEME_OPTIONS}
    assert from_point(fields) == scheme
    assert (
        from_point({**fields, "prefill": "exact", "policy": "uniform"}) == scheme
    )  # other point keys ignored


def test_every_option_reaches_the_scheme_by_name_and_an_unknown_one_is_refused():
    for name, options in OPTIONS.items():
        scheme = get_scheme(name, **options)
        assert all(getattr(scheme, key) == value for key, value in options.items()), name
    with pytest.raises(ValueError, match=r"^group_sizee: not an option of a scheme; allowed: group_size, "):
        get_scheme("asym_token", group_sizee=16)


def test_the_capacity_command_keeps_every_scheme_option():
    args = capacity.parser().parse_args(
        [
            "--full",
            "2:1:64",
            "--context",
            "8",
            "--scheme",
            "nuqkey",
            "--outliers",
            "0.01",
            "--key-levels",
            "fisher",
        ]
    )
    assert capacity.cli_scheme(args) == get_scheme("nuqkey", residual=0, outliers=0.01, key_levels="fisher")


def test_a_byte_model_call_without_its_role_is_an_error():
    """A forgotten role would price values silently: every byte-model and store method asks for it."""
    scheme = get_scheme("kivi", 32, key_group_size=64)
    with pytest.raises(TypeError):
        scheme.token_bytes(4, 64)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        scheme.new_store([4], 64, 1, torch.float32, "cpu")  # type: ignore[call-arg]
    assert scheme.token_bytes(4, 64, "key") != scheme.token_bytes(4, 64, "value")  # per channel vs per token
