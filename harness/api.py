"""The library surface: from a causal LM and a byte budget to a quantized KV cache in generate().

    model, tokenizer = load("smollm2-135m")        # a registry name, a local model folder, or a model object
    calibration = calibration(model, tokenizer)    # per-head attention entropy on calibration text, cached on disk
    allocation = allocate(model, calibration, budget=3, policy="entropy", scheme="asym_token")
    cache = quantized_cache(model, allocation, "asym_token", calibration)  # any registered scheme
    with packed_attention(model):                  # attend the packed form: memory saved
        out = model.generate(ids, past_key_values=cache, max_new_tokens=32)

An allocation and its scheme travel as one JSON file (harness/allocation_file.py: `save_allocation`,
`load_allocation`; `python -m harness.export` writes a committed point's). Arguments are checked before any work: a bad one is a
one-line ValueError that names it (`budget: ...`, `widths: ...`, `device: ...`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import pandas as pd
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from harness import data
from harness.attention import PACKED, installed
from harness.cache import OUTSIDE_PACKED, QuantizedKVCache, check_backend_device, check_served
from harness.calibrate import cached_fit, cached_head_entropies
from harness.capacity import element_price, shape_from_config
from harness.models import (
    DOWNLOAD_FLAG,
    ModelUnavailable,
    check_device,
    fetch,
    fetch_missing,
    load_model,
    model_names,
    model_spec,
    quiet_loading,
)
from harness.policies import POLICIES, Allocation, Policy
from harness.precision import torch_dtype
from harness.registry import unknown_name_message
from harness.schemes import SCHEMES, FittedParts, Scheme, get_scheme
from harness.sensitivity import MEASUREMENTS, READS_KEY_TABLES, READS_PROBE, check_context, check_reads_fitted

# the positions [0, span) that fitted key tables cover by default: every committed point's longest window
KEY_SPAN = 1024
# An option's config key less its group is its argument here (policy.budget -> budget; policy.name -> policy).
_CONFIG_KEY = re.compile(r"^(?:policy|quant|model)\.\w+")
_RENAMED = {"policy.name": "policy"}


def _argument_error(err: ValueError) -> ValueError:
    """The error of a config check, its leading config key (policy.budget) named as this module's argument
    (budget); the first line only."""
    line = str(err).splitlines()[0]
    return ValueError(_CONFIG_KEY.sub(lambda m: _RENAMED.get(m[0], m[0].split(".", 1)[1]), line, count=1))


# ------------------------------------------------------------------------------------------------ models


def load(
    source: str | PreTrainedModel,
    tokenizer=None,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
    download: bool = False,
):
    """(model, tokenizer): a causal LM in eval mode, checked to be one QuantizedKVCache can serve.

    `source`: a registry name (conf/model: `smollm2-135m`, `tiny-llama`, ...), a local folder or a Hugging
    Face id, or a transformers model object (returned with `tokenizer` as given). A Hugging Face model
    (registered or by id) loads from the local Hugging Face cache; with download=True one missing there is
    fetched from the Hub first (harness.models.fetch: HF_ENDPOINT, HF_TOKEN, HF_HUB_CACHE; a refused or broken
    download is a one-line ModelUnavailable). `device` (None: cpu, or where a given model is) and `dtype`
    (float32, bfloat16; None: the registry file's, the checkpoint's, or the given model's) move and cast it.
    Code from a model's own files runs only with trust_remote_code=True. An architecture the cache cannot serve
    is a ValueError saying why, before any weights load.
    """
    if device is not None:
        check_device(device)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        dtype = torch_dtype(dtype)
    if not isinstance(download, bool):
        raise ValueError(f"download: {download!r} is not allowed; allowed: True, False")
    if isinstance(source, torch.nn.Module):
        if not isinstance(source, PreTrainedModel):
            raise ValueError(f"source: a {type(source).__name__} is not a transformers model")
        check_served(source.config, type(source), key="source")
        model = source
    elif isinstance(source, str) and source in model_names():
        spec = model_spec(source)
        if spec["source"] == "tiny":
            check_served(AutoConfig.for_model(spec["arch"], **spec["config"]), key="source")
        with _download_named_as_argument():
            if download:
                fetch_missing([source])
            model, tokenizer = load_model(source, device=device or "cpu", dtype=dtype)
        return model, tokenizer
    elif isinstance(source, str):
        if download and not Path(source).exists():  # a Hugging Face id, not a local folder
            with _download_named_as_argument():
                source = fetch(source, source)
        model, tokenizer = _load_local(source, tokenizer, dtype, trust_remote_code)
    else:
        raise ValueError(
            f"source: expected a model name, a local model folder or a model object; got {source!r}"
        )
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    model.config.use_cache = True
    return model.eval(), tokenizer


def _load_local(where: str, tokenizer, dtype: torch.dtype | None, trust_remote_code: bool):
    """A model (and its tokenizer, unless given) from a local folder or a Hugging Face id already cached here."""
    options = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(where, **options)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"source: {where!r} is neither a registered model ({', '.join(model_names())}) nor a transformers "
            f"model on this machine ({type(err).__name__}); download=True fetches a Hugging Face id from the "
            "Hub"
        ) from None
    check_served(config, key="source")
    with quiet_loading():
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype or "auto", **options)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(where, **options)
    return model, tokenizer


@contextmanager
def _download_named_as_argument() -> Iterator[None]:
    """A missing model's error names this function's argument (download=True), not the command line's flag."""
    try:
        yield
    except ModelUnavailable as err:
        raise ModelUnavailable(str(err).replace(DOWNLOAD_FLAG, "download=True")) from None


@contextmanager
def packed_attention(model) -> Iterator[None]:
    """Within the block `model` attends quantized caches from their packed form (harness.attention's PACKED);
    outside it a QuantizedKVCache hands the model dequantized K/V (QuantizedKVCache's outside_packed)."""
    with installed(model, PACKED):
        yield


# ----------------------------------------------------------------------------------------------- calibrate


@dataclass(frozen=True)
class Calibration:
    """What allocation and every scheme's fitted parts read about a model, measured on calibration text.

    `name`: the model's name in the on-disk caches (its type and a digest of its weights); `ids`: the calibration
    windows, int64 (C, T); `entropy`: one row per (layer, query head) with H2, H1 (nats), kv_head, layer_type,
    n_positions (harness.calibrate.head_entropies).
    """

    name: str
    ids: torch.Tensor
    entropy: pd.DataFrame

    def fitted(self, model, scheme: str | Scheme, span: int = KEY_SPAN) -> FittedParts | None:
        """The parts `scheme` reads, fitted on these windows as a sweep fits them (harness.calibrate.cached_fit,
        cached on disk): calkey's and nuqkey's key tables for positions [0, span) with the scheme's key_levels,
        pca's and vq's transforms, xlayer's predictors, cq's codebooks; None for a scheme that reads none."""
        if isinstance(span, bool) or not isinstance(span, int) or span < 1:
            raise ValueError(f"span: {span!r} is not a positive integer")
        scheme = _as_scheme(scheme)
        return cached_fit(scheme, model, self.name, self.ids, span, scheme.key_levels)


def weights_digest(model) -> str:
    """A digest of every parameter's name, shape, dtype and first 4096 values: two models of one config (a
    fine-tune and its base) get different calibration caches."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}|{tuple(param.shape)}|{param.dtype}".encode())
        digest.update(param.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def calibration(
    model,
    tokenizer=None,
    *,
    ids: torch.Tensor | None = None,
    text: str | None = None,
    sequences: int = 8,
    tokens: int = 512,
    i0: int = 32,
    seed: int = 0,
    bos: str = "auto",
) -> Calibration:
    """Per-head attention entropy of `model` on calibration windows, read from disk when measured before.

    The windows: `ids` (int64 (C, T)) as given, or `sequences` windows of `tokens` tokens cut with `tokenizer`
    (seeded by `seed`) from `text` (None: the calibration split of the default corpus, pydoc_data.topics, which
    never overlaps its evaluation split), each starting with BOS under `bos` (auto, always, never). Query positions
    i >= i0 are averaged.
    """
    for key, value in (("sequences", sequences), ("tokens", tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}: {value!r} is not a positive integer")
    if ids is None:
        if tokenizer is None:
            raise ValueError("tokenizer: needed to cut calibration windows from text; or pass ids=")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"text: expected a str; got {type(text).__name__}")
        corpus = data.split().calibration if text is None else text
        try:
            ids = data.token_windows(
                tokenizer, corpus, sequences, tokens, seed, data.uses_bos(tokenizer, bos)
            )
        except ValueError as err:
            raise ValueError(f"text: {str(err).splitlines()[0].split(': ', 1)[1]}") from None
    elif not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.dtype == torch.long):
        raise ValueError("ids: expected an int64 tensor (C, T) of calibration windows")
    if isinstance(i0, bool) or not isinstance(i0, int) or not 0 <= i0 < ids.shape[1]:
        raise ValueError(f"i0: {i0!r} must be an integer in [0, {ids.shape[1]}) (the windows' length)")
    name = f"{model.config.model_type}-{weights_digest(model)}"
    return Calibration(name, ids, cached_head_entropies(model, name, ids, i0=i0))


# ------------------------------------------------------------------------------------------------ allocate


def make_policy(name: str = "entropy", scheme: str | Scheme | None = None, **options) -> Policy:
    """A registered allocation policy (harness.policies.POLICIES) with its options (alpha, widths, sink_threshold,
    budget_unit, ... as in conf/policy); ValueError naming a bad one. Without `widths` it may assign every width
    `scheme` stores (Scheme.widths), or 2, 3, 4, 8 where no scheme is given."""
    if name not in POLICIES:
        raise ValueError(unknown_name_message("policy", name, POLICIES.names()))
    cls = POLICIES.get(name)
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"{unknown[0]}: not an option of policy {name}; allowed: {', '.join(known)}")
    if scheme is not None and "widths" not in options:
        options["widths"] = _as_scheme(scheme).widths
    try:
        return cls(**options)
    except ValueError as err:
        raise _argument_error(err) from None


def make_scheme(name: str = "asym_token", **options) -> Scheme:
    """A registered storage scheme (harness.schemes.SCHEMES) with its options (SCHEME_OPTIONS: group_size,
    sink_tokens, residual, key_group_size, outliers, key_levels); ValueError naming a bad one."""
    if name not in SCHEMES:
        raise ValueError(unknown_name_message("scheme", name, SCHEMES.names()))
    try:
        return get_scheme(name, **options)
    except ValueError as err:
        raise _argument_error(err) from None


def _as_scheme(value: str | Scheme) -> Scheme:
    return value if isinstance(value, Scheme) else make_scheme(value)


def allocate(
    model,
    calibration: Calibration,
    budget: float,
    *,
    policy: str | Policy = "entropy",
    scheme: str | Scheme = "asym_token",
    chunk: int = 128,
    span: int = KEY_SPAN,
    probe: tuple[int, ...] | None = None,
    **options,
) -> Allocation:
    """Widths per (layer, KV head, K|V) for `model` under `budget`: bits per element, met in the true bytes of
    `scheme` (its byte model prices every head; budget_unit="bits" for equal mean bits instead).

    `policy`: a registered name with its `options` (alpha, widths, sink_threshold, ...; widths default to those
    `scheme` stores), or a Policy object (then no options). A policy that allocates from measured errors measures
    them once on the calibration windows (cached on disk; `chunk`: teacher-forced chunk), through the parts the
    scheme fits there (Calibration.fitted; `span`: the key tables' positions; `probe`: (sequences, tokens) of
    the calibration windows the measured policy's unit KLs are measured on, None for 2 x 128, and optionally a
    third, the context width every other unit is stored at while one is measured). Returns an
    Allocation: key_bits and value_bits int64 [num_layers, num_kv_heads] (16: unquantized, 0: no cache), sinks
    bool, continuous float64 levels.
    """
    scheme = _as_scheme(scheme)
    if isinstance(policy, Policy):
        if options:
            raise ValueError(f"{sorted(options)[0]}: a Policy object carries its options; leave it out")
    else:
        policy = make_policy(policy, scheme, **options)
    try:
        scheme.check_widths(policy.widths)
        policy.check_budget(budget)
        check_reads_fitted(policy, scheme)
        if probe is not None:
            _check_probe(probe, policy, calibration.ids)
    except ValueError as err:
        raise _argument_error(err) from None
    table = None
    if policy.measurement is not None:
        extra = {}
        if policy.measurement in READS_KEY_TABLES:
            extra["key_calibration"] = calibration.fitted(model, scheme, span)
        if probe is not None:
            extra["sequences"], extra["tokens"] = probe[:2]
            extra["context"] = probe[2] if len(probe) == 3 else None
        measure = MEASUREMENTS[policy.measurement]
        table = measure(model, calibration.name, calibration.ids, scheme, policy.widths, chunk, **extra)
    price = element_price(shape_from_config(model.config), scheme)
    try:
        return policy.allocate(calibration.entropy, budget, price=price, sensitivity=table)
    except ValueError as err:
        raise _argument_error(err) from None


def _check_probe(probe: object, policy: Policy, ids: torch.Tensor) -> None:
    """ValueError naming `probe` unless it is (sequences, tokens) inside the calibration windows ids (C, T), and
    optionally a context width among the policy's (check_context), for a policy that measures on a probe."""
    if policy.measurement not in READS_PROBE:
        raise ValueError(f"probe: policy {policy.name} measures no unit-KL probe; allowed: None")
    limits = ((1, ids.shape[0]), (2, ids.shape[1]))
    if not (isinstance(probe, tuple | list) and len(probe) in (2, 3)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and low <= v <= high
        for v, (low, high) in zip(probe, limits)
    ):
        raise ValueError(
            f"probe: {probe!r}; allowed: (sequences, tokens) with sequences in [1, {ids.shape[0]}] and tokens in "
            f"[2, {ids.shape[1]}] (the calibration windows), and optionally a context width"
        )
    if len(probe) == 3:
        check_context(probe[2], policy.widths, "probe's context")


# ---------------------------------------------------------------------------------------------- the cache


def quantized_cache(
    model,
    allocation: Allocation,
    scheme: str | Scheme = "asym_token",
    calibration: Calibration | None = None,
    *,
    span: int = KEY_SPAN,
    prefill: str = "exact",
    backend: str = "auto",
    outside_packed: str = "dequantize",
    simulate: bool | None = None,
) -> QuantizedKVCache:
    """An empty QuantizedKVCache for `model` storing `allocation`'s widths in `scheme`; pass it to generate() or a
    forward call as past_key_values (inside `packed_attention(model)` to save memory).

    `calibration`: needed by a scheme that reads parts fitted on calibration windows (Scheme.key_tables: calkey,
    nuqkey, nuqkey_codebook, pca, xlayer, vq, cq), fitted there as a sweep fits them (Calibration.fitted; key
    tables for positions [0, span)). `prefill`: exact (the prompt attends its own full-precision K/V, then is
    stored quantized) or quantized; `backend`: auto, torch, triton; `outside_packed`: dequantize or raise
    (QuantizedKVCache);
    `simulate`: keep a full-precision working copy beside the stored form (quant.simulate: the memory of an
    unquantized cache); None: only for a scheme that runs nowhere else (xlayer, which reads the layer below's
    reconstruction).
    """
    scheme = _as_scheme(scheme)
    if not isinstance(allocation, Allocation):
        raise ValueError(f"allocation: expected an Allocation; got {type(allocation).__name__}")
    if outside_packed not in OUTSIDE_PACKED:
        raise ValueError(f"outside_packed: unknown {outside_packed!r}; allowed: {', '.join(OUTSIDE_PACKED)}")
    simulate = _simulate(simulate, scheme)
    parts = None
    if scheme.key_tables:
        if not isinstance(calibration, Calibration):
            raise ValueError(
                f"calibration: scheme {scheme.name} reads parts fitted on calibration windows ({scheme.fit}); "
                "pass calibration=harness.calibration(model, tokenizer)"
            )
        parts = calibration.fitted(model, scheme, span)
    try:
        check_backend_device(backend, model.device, key="backend")
        return QuantizedKVCache(
            model.config,
            allocation,
            scheme,
            prefill=prefill,
            backend=backend,
            simulate=simulate,
            key_calibration=parts,
            outside_packed=outside_packed,
        )
    except ValueError as err:
        raise _argument_error(err) from None


def _simulate(simulate: bool | None, scheme: Scheme) -> bool:
    """quantized_cache's `simulate` resolved for `scheme`; ValueError naming it where the scheme cannot run so."""
    if simulate is None:
        return scheme.reads_previous_layer
    if not isinstance(simulate, bool):
        raise ValueError(f"simulate: {simulate!r} is not allowed; allowed: True, False, None")
    if scheme.reads_previous_layer and not simulate:
        raise ValueError(
            f"simulate: False with scheme {scheme.name}, whose layers are predicted from the reconstruction of "
            "the layer below, which only a simulated cache keeps; allowed: True, None"
        )
    return simulate
