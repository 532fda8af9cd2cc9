"""The packed-only cache (quant.simulate=false) holds what it reports and gives what the simulated path gives.

- resident bytes (measured storage of every tensor) stay within 1.3x of the format's bytes after a 1K prefill
  and 100 decode steps, for every scheme and width; the simulated path's working copy shows in them;
- generate() through the packed path gives the simulated path's tokens, and teacher-forced metrics agree
  within 1e-4, on the tiny models (a sliding-window one and a hybrid one included);
- the runner records resident_bytes and simulate in every row, and simulate leaves the point key alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from harness import evaluate, metrics
from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache, resident_bytes
from harness.calibrate.cq import fit_cq_calibration
from harness.calibrate.keys import fit_table
from harness.calibrate.pca import fit_pca_calibration
from harness.models import load_model
from harness.schemes import SCHEMES, KeyCalibration, Rotated, get_scheme

PREFILL, DECODE = 1024, 25  # 25 decode steps grow each packed store past its prefill capacity once


def widths(scheme: str) -> list[int]:
    return [*get_scheme(scheme).widths, 16]


CASES = [
    (scheme, width)
    for scheme in SCHEMES
    for width in widths(scheme)
    if not (isinstance(get_scheme(scheme), Rotated) and width == 16)  # rotate+ keeps 16-bit heads in float32
    and not get_scheme(
        scheme
    ).reads_previous_layer  # xlayer runs only simulated (tests/harness/test_xlayer.py)
]


_FITTED: dict = {}  # (config, scheme) -> fitted_parts: one fit for every width of a scheme


def fitted_parts(config, scheme: str):
    """What `scheme` reads fitted on calibration text (harness.calibrate), fitted here on random data: calkey's and
    nuqkey's key tables on keys like the ones fed below (every rotary pair turning a full circle), pca's and vq's
    transforms and cq's codebooks on a random model of `config` over random tokens; None for other schemes."""
    key = (config.to_json_string(), scheme)
    if key not in _FITTED:
        _FITTED[key] = _fit(config, scheme)
    return _FITTED[key]


def _fit(config, scheme: str):
    bound = get_scheme(scheme)
    if not bound.key_tables:
        return None
    heads, dim = config.num_key_value_heads, config.head_dim
    if bound.fit == "key_tables":
        table = fit_table(torch.randn(64, heads, dim), torch.arange(64), torch.ones(dim // 2), span=8)
        return KeyCalibration((table,) * config.num_hidden_layers)
    torch.manual_seed(0)
    model, ids = LlamaForCausalLM(config), torch.randint(0, config.vocab_size, (2, 64))
    if bound.fit == "pca":
        return fit_pca_calibration(model, ids)
    assert bound.fit == "cq", bound.fit  # a new kind of fitted part: fit it here
    return fit_cq_calibration(model, ids, bound.channels)


def filled_cache(config, scheme: str, width: int, simulate: bool) -> QuantizedKVCache:
    """A cache of `config` after a PREFILL-token update and DECODE one-token updates of fp16 K/V (2 bytes per
    element, the format's convention for 16-bit parts), each update attended as a model would."""
    heads, dim = config.num_key_value_heads, config.head_dim
    cache = QuantizedKVCache(
        config, width, scheme=scheme, group_size=16, prefill="quantized", simulate=simulate,
        key_calibration=fitted_parts(config, scheme),
    )  # fmt: skip
    torch.manual_seed(width)
    with installed(LlamaForCausalLM(config), PACKED) as steps:
        for i in range(config.num_hidden_layers):
            k, v = torch.randn(2, 2, heads, PREFILL + DECODE, dim, dtype=torch.float16)
            for start, end in [(0, PREFILL)] + [(t, t + 1) for t in range(PREFILL, PREFILL + DECODE)]:
                keys, _ = cache.update(k[:, :, start:end], v[:, :, start:end], i)
                step = steps.step(i, keys)
                if step is not None:
                    q = torch.randn(2, config.num_attention_heads, end - start, dim, dtype=torch.float16)
                    assert torch.isfinite(step.attend(q, None, dim**-0.5)).all()
    return cache


ONE_LAYER = LlamaConfig(  # one full-attention layer with GQA, tiny-llama's head shapes
    vocab_size=256,
    hidden_size=96,
    num_hidden_layers=1,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=32,
)


@pytest.mark.parametrize("scheme, width", CASES, ids=[f"{s}-{w}" for s, w in CASES])
def test_resident_bytes_are_the_formats_bytes(scheme, width):
    cache = filled_cache(ONE_LAYER, scheme, width, simulate=False)
    # the fitted parts the caller passed (one per model, shared by its caches; each store keeps and counts its
    # own copy of its heads') are the caller's memory: what the cache holds beyond them
    fitted = cache.key_calibration
    stored, resident = cache.nbytes(), resident_bytes([cache.layers, fitted]) - resident_bytes([fitted])
    assert 0 < stored <= resident <= 1.3 * stored, (scheme, width, resident / stored)


def test_the_simulated_working_copy_is_counted():
    """Same tokens, same stored form: the full-precision copy of simulate=True shows in resident bytes only."""
    packed = filled_cache(ONE_LAYER, "asym_token", 4, simulate=False)
    simulated = filled_cache(ONE_LAYER, "asym_token", 4, simulate=True)
    assert packed.nbytes() == simulated.nbytes()
    assert (
        simulated.resident_bytes() > packed.resident_bytes() + packed.nbytes_fp16()
    )  # at least the fp16 copy


def test_resident_bytes_count_shared_storage_once():
    x = torch.zeros(10, 4)
    assert resident_bytes([x, x[2:], {"again": x.view(40)}]) == 160
    assert resident_bytes([x, x.clone()]) == 320


def test_a_growing_store_keeps_its_slack_under_a_quarter():
    """Decode appends grow capacity by 1.25x: at any length the slack is under 1.25x (plus 16 tokens)."""
    from kernels.layout import PackedStore

    store = PackedStore([4, 4], 32, 1, 16, simulate=False)
    for t in range(1, 700):
        store.append(torch.randn(1, 2, 1, 32))
        assert store.capacity <= max(int(1.25 * t) + 1, t + 16), (t, store.capacity)


TINY = ["tiny-llama", "tiny-gemma3", "tiny-qwen3_5"]


@pytest.mark.parametrize("name", TINY)
@torch.no_grad()
def test_packed_generation_and_metrics_equal_the_simulated_ones(name, packed):
    model, _ = load_model(name)
    packed(model)
    heads = QuantizedKVCache(model.config, 4).key_bits.shape[1]
    layers = QuantizedKVCache(model.config, 4).key_bits.shape[0]
    torch.manual_seed(len(name))
    bits = torch.tensor([2, 4, 8, 16, 3])[torch.randint(0, 5, (layers, heads))]  # mixed widths
    prompts = torch.randint(0, 256, (3, 23))  # past tiny-gemma3's window of 16
    sequences = torch.randint(0, 256, (2, 61))
    factory = {
        simulate: (lambda s=simulate: QuantizedKVCache(model.config, bits, group_size=16, simulate=s))
        for simulate in (True, False)
    }
    tokens = {s: evaluate.greedy_generate(model, prompts, 12, f, batch_size=3) for s, f in factory.items()}
    assert torch.equal(tokens[True], tokens[False]), name

    base = evaluate.teacher_forced(model, sequences, lambda: DynamicCache(config=model.config), chunk=16)
    results = {
        s: metrics.teacher_forced_metrics(
            base, evaluate.teacher_forced(model, sequences, f, chunk=16, batch_size=2, baseline=base)
        )
        for s, f in factory.items()
    }
    for key in ("ppl", "ppl_ratio", "kl_mean", "kl_p99", "top1_agree"):
        a, b = results[True][key], results[False][key]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (name, key, a, b)
