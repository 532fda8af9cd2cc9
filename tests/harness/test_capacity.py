"""harness.capacity against real caches (QuantizedKVCache.nbytes on tiny models) and against hand arithmetic."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import capacity
from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache, kv_heads
from harness.models import load_model
from harness.schemes import get_scheme

GIB = 2**30


@pytest.fixture(scope="module")
def models():
    loaded = {
        name: load_model(name)[0]
        for name in ("tiny-llama", "tiny-gemma3", "tiny-gemma4", "tiny-gemma4-kv", "tiny-qwen3_5")
    }
    with contextlib.ExitStack() as stack:
        for model in loaded.values():
            stack.enter_context(
                installed(model, PACKED)
            )  # quantized caches are attended from their packed form
        yield loaded


def _random_bits(model, seed: int) -> torch.Tensor:
    """Mixed widths [L, max Hkv] from {2, 3, 4, 8, 16}, padding included (both sides must ignore it)."""
    heads = kv_heads(model.config)
    g = torch.Generator().manual_seed(seed)
    widths = torch.tensor([2, 3, 4, 8, 16])
    return widths[torch.randint(0, 5, (len(heads), max(heads)), generator=g)]


CASES = [
    # model, scheme, sink_tokens, residual, prompt tokens, batch
    ("tiny-llama", "asym_token", 0, 0, 37, 2),
    ("tiny-llama", "sym_token", 3, 5, 29, 1),
    ("tiny-gemma3", "asym_token", 0, 0, 23, 2),  # past the window of 16: sliding layers hold 15
    ("tiny-gemma3", "sym_token", 2, 4, 9, 1),  # inside the window, sinks still held, then pushed out
    ("tiny-gemma3", "rotate+asym_token", 4, 0, 13, 1),
    ("tiny-gemma4", "asym_token", 0, 3, 21, 1),  # global layers with head_dim 64, sliding ones 32
    ("tiny-gemma4-kv", "asym_token", 2, 0, 19, 2),  # global 1 KV head, sliding 2; KV-shared layers
    ("tiny-qwen3_5", "asym_token", 0, 0, 19, 2),  # linear-attention state reported apart
]


@pytest.mark.parametrize(
    "name,scheme,sinks,residual,prompt,batch", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES]
)
def test_true_bytes_equal_cache_nbytes(models, name, scheme, sinks, residual, prompt, batch):
    model = models[name]
    bits, value_bits = _random_bits(model, seed=prompt), _random_bits(model, seed=prompt + 1)  # keys, values
    cache = QuantizedKVCache(
        model.config,
        bits,
        scheme=scheme,
        group_size=16,
        prefill="quantized",
        sink_tokens=sinks,
        residual=residual,
        value_bits=value_bits,
    )
    shape = capacity.shape_from_config(model.config, name)
    storage = get_scheme(scheme, 16, sink_tokens=sinks, residual=residual)
    ids = torch.randint(0, 256, (batch, prompt + 10), generator=torch.Generator().manual_seed(prompt))
    steps = [(0, prompt)] + [(t, t + 1) for t in range(prompt, prompt + 10)]  # prefill, then 10 decode steps
    with torch.no_grad():
        for start, end in steps:
            positions = torch.arange(start, end).expand(batch, -1)
            model(input_ids=ids[:, start:end], position_ids=positions, past_key_values=cache, use_cache=True)
            held = capacity.cache_bytes(shape, end, bits, storage, batch, value_bits)
            assert held.true_bytes == cache.nbytes(), (start, end)
            assert held.fp16_bytes == cache.nbytes_fp16(), (start, end)
            assert held.linear_state_bytes == cache.linear_state_nbytes(), (start, end)


def test_nominal_is_sixteen_over_mean_bits(models):
    model = models["tiny-gemma3"]
    bits = _random_bits(model, seed=5)
    shape = capacity.shape_from_config(model.config)
    held = capacity.cache_bytes(shape, 100, bits)
    mean = bits.double().mean().item()  # every layer of tiny-gemma3 is cached
    assert held.mean_bits == pytest.approx(mean)
    assert held.compression_nominal == pytest.approx(16 / mean)
    assert held.nominal_bytes == pytest.approx(held.fp16_bytes * mean / 16)
    uniform = capacity.cache_bytes(shape, 100, 16)
    assert uniform.true_bytes == uniform.fp16_bytes == uniform.nominal_bytes


SHAPE = capacity.explicit_shape(full=(2, 3, 64), sliding=(3, 2, 32, 40), linear=(1, 1000))


@settings(max_examples=40, deadline=None)
@given(
    memory=st.integers(min_value=0, max_value=2_000_000),
    bits=st.sampled_from([2, 3, 4, 8, 16]),
    sinks=st.integers(0, 50),
    residual=st.integers(0, 50),
    batch=st.integers(1, 3),
)
def test_max_context_exact_at_the_boundary(memory, bits, sinks, residual, batch):
    storage = get_scheme("asym_token", 32, sink_tokens=sinks, residual=residual)
    longest = capacity.max_context(SHAPE, memory, bits, storage, batch)
    peak = lambda t: max(
        capacity.cache_bytes(SHAPE, u, bits, storage, batch).total_bytes for u in range(t + 1)
    )  # noqa: E731
    if longest == -1:
        assert capacity.cache_bytes(SHAPE, 0, bits, storage, batch).total_bytes > memory
        return
    assert peak(longest) <= memory < peak(longest + 1)
    assert capacity.max_context(SHAPE, memory + 5000, bits, storage, batch) >= longest  # monotone in memory


def test_max_context_unbounded_without_full_layers():
    shape = capacity.explicit_shape(sliding=(4, 2, 32, 64))
    assert capacity.max_context(shape, 10**6, 4) is None


def test_gemma4_31b_by_hand():
    """Claim 4: 10 global layers, 256K tokens. K and V are both stored, 2 bytes per element at 16 bits."""
    shape = capacity.shape_from_preset("gemma4-31b")
    tokens = 262144
    full = [layer for layer in shape.layers if layer.kind == "full"]
    sliding = [layer for layer in shape.layers if layer.kind == "sliding"]
    assert (len(full), len(sliding)) == (10, 50)
    assert {(layer.kv_heads, layer.head_dim) for layer in full} == {(4, 512)}
    assert {(layer.kv_heads, layer.head_dim, layer.window) for layer in sliding} == {(16, 256, 1024)}

    bf16 = capacity.cache_bytes(shape, tokens, 16)
    global_bf16 = 10 * 4 * 512 * 2 * 2 * tokens  # layers x heads x dim x (K, V) x bytes x tokens
    sliding_bf16 = 50 * 16 * 256 * 2 * 2 * 1023  # a sliding layer holds window - 1 tokens
    assert global_bf16 == 20 * GIB
    assert bf16.by_kind == {"full": global_bf16, "sliding": sliding_bf16}

    q4 = capacity.cache_bytes(shape, tokens, 4)  # asym_token, g=32: 4-bit codes plus fp16 scale and zero
    global_q4 = 10 * 4 * (512 // 2 + (512 // 32) * 4) * 2 * tokens
    sliding_q4 = 50 * 16 * (256 // 2 + (256 // 32) * 4) * 2 * 1023
    assert global_q4 == int(6.25 * GIB)  # 5 bits per element, not 4
    assert q4.true_bytes == global_q4 + sliding_q4
    assert q4.nominal_bytes == (global_bf16 + sliding_bf16) / 4

    sym = capacity.cache_bytes(shape, tokens, 4, get_scheme("sym_token"))
    assert sym.by_kind["full"] == 10 * 4 * (256 + 16 * 2) * 2 * tokens  # 4.5 bits per element

    literal = capacity.explicit_shape(full=(10, 16, 512))  # the claim's words: 16 KV heads of 512
    assert capacity.cache_bytes(literal, tokens, 16).true_bytes == 80 * GIB


def test_kivi_keys_cost_what_per_token_groups_cost_over_a_whole_key_group():
    # per channel, one fp16 scale and zero per 32 tokens: 64 channels * 4 bytes / 32 tokens = 8 bytes per token
    kivi, asym = get_scheme("kivi", 32), get_scheme("asym_token", 32)
    assert kivi.token_bytes(4, 64, role="value") == asym.token_bytes(4, 64, role="value") == 32 + 8


def test_bad_input_names_the_key():
    with pytest.raises(ValueError, match="quant.scheme"):
        get_scheme("kivi2")
    with pytest.raises(ValueError, match="quant.group_size"):
        capacity.cache_bytes(capacity.explicit_shape(full=(1, 1, 48)), 10, 4)
    with pytest.raises(ValueError, match="bits: layer 0"):
        capacity.cache_bytes(capacity.explicit_shape(full=(1, 2, 64)), 10, [[4]])
    with pytest.raises(ValueError, match="capacity.context"):
        capacity.cache_bytes(SHAPE, -1, 4)
