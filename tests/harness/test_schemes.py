"""Quantization schemes (kivi, fp8, rotate+, sink tokens, residual window) against an oracle built from
kernels/reference.py, their byte accounting by hand, and through QuantizedKVCache on tiny models."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from harness import capacity
from harness.__main__ import entry
from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache, QuantizedSlidingLayer
from harness.models import load_model
from harness.schemes import Fp8, Scheme, check_backend, get_scheme
from harness.schemes.rotate import RotatedStore
from harness.validate import ConfigError, validate_config
from kernels import reference

ROOT = Path(__file__).resolve().parents[2]
SCHEMES = ["asym_token", "sym_token", "kivi", "fp8", "rotate+asym_token", "rotate+kivi", "rotate+fp8"]


def oracle(scheme: Scheme, x: torch.Tensor, bits: list[int], role: str) -> torch.Tensor:
    """What a store of `scheme` returns after holding all of x (B, H, T, D), written from reference.py alone."""
    S = min(scheme.sink_tokens, x.shape[2])
    rest = x[:, :, S:]
    stored = scheme.inner if scheme.rotated else scheme  # the format rotate+ stores the rotated heads in
    per_channel = stored.per_channel(role)
    g = scheme.role_group_size(role)  # keys: key_group_size
    n_quant = max(rest.shape[2] - scheme.residual, 0)
    if per_channel:
        n_quant = n_quant // g * g
    out = x.clone()
    for h, b in enumerate(bits):
        if b == 16:
            continue
        q = rest[:, h, :n_quant]  # (B, n_quant, D)
        if scheme.rotated:
            q = reference.hadamard_rotate(q)
        if isinstance(stored, Fp8):
            values = reference.fp8_quantize_dequantize(q, torch.float32)[2]
        elif per_channel:
            values = reference.channel_quantize_dequantize(q, b, g)[1]
        else:
            values = reference.quantize_dequantize(q, b, g, stored.symmetric, torch.float32)[1]
        if scheme.rotated:
            values = reference.hadamard_rotate(values)
        out[:, h, S : S + n_quant] = values.to(x.dtype)
    return out


def widths_for(scheme: str) -> list[int]:
    return [8, 16, 8] if get_scheme(scheme).widths == (8,) else [2, 16, 3, 4, 8]


def feed(store, x: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Append x (B, H, T, D) in chunks of the given sizes; return the last append's values."""
    start = 0
    for n in chunks:
        got = store.append(x[:, :, start : start + n])
        start += n
    assert start == x.shape[2]
    return got


# ---------------------------------------------------------------------------------------------------------
# stores against the oracle


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("sinks, residual, key_group_size", [(0, None, None), (3, 5, None), (3, 5, 16)])
@pytest.mark.parametrize("role", ["key", "value"])
def test_store_matches_oracle(name, sinks, residual, key_group_size, role):
    scheme = get_scheme(name, 8, sink_tokens=sinks, residual=residual, key_group_size=key_group_size)
    bits = widths_for(name)
    torch.manual_seed(SCHEMES.index(name) + 10 * sinks + (role == "key"))
    x = torch.randn(2, len(bits), 45, 32) * torch.logspace(-2, 1, 32)  # channels of very different ranges
    store = scheme.new_store(bits, 32, 2, torch.float32, "cpu", role=role, simulate=True)
    unchanged = x.clone()
    got = feed(store, x, [7, 1, 1, 19, 8, 9])
    assert torch.equal(x, unchanged)  # a store never writes into its input
    want = oracle(scheme, x, bits, role)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(store.dequantize(), want, rtol=1e-5, atol=1e-5)
    assert store.length == 45 and store.nbytes_fp16() == 2 * len(bits) * 45 * 32 * 2
    assert torch.equal(got[:, :, :sinks], x[:, :, :sinks])  # sink tokens exactly preserved
    assert torch.equal(got[:, 1], x[:, 1])  # a 16-bit head is exact under every scheme


def test_kivi_keys_error_is_bounded_per_channel_and_group():
    """Each (group of g tokens, channel) gets its own asym scale: the error of a channel is at most half a step
    of that channel's own range, which per-token quantization of channels this unequal would exceed."""
    g, bits = 8, 4
    torch.manual_seed(0)
    x = torch.randn(1, 1, 40, 16) * torch.logspace(-3, 2, 16)  # (B, H, T, D)
    store = get_scheme("kivi", group_size=g, residual=0).new_store(
        [bits], 16, 1, torch.float32, "cpu", "key", simulate=True
    )
    got = feed(store, x, [3, 13, 24])
    groups = x.reshape(1, 1, 5, g, 16)
    span = (groups.amax(3) - groups.amin(3)).repeat_interleave(g, 2)  # (1, 1, 40, 16)
    lo = groups.amin(3).abs().repeat_interleave(g, 2)
    bound = span / (2**bits - 1) / 2 + (span + lo) * 2.0**-10  # half a step, plus fp16 scale/zero rounding
    assert ((got - x).abs() <= bound).all()
    per_token = reference.fake_quantize(x, bits, 16)  # one group per token over all channels
    assert ((per_token - x).abs() > bound).any()


def test_hadamard_is_orthonormal_and_rotation_round_trips():
    for n in (1, 2, 8, 64):
        h = reference.hadamard(n)
        torch.testing.assert_close(h @ h.T, torch.eye(n), rtol=0, atol=1e-6)
        assert torch.equal(h, h.T) and torch.equal(h.abs(), torch.full((n, n), n**-0.5))
    for bad in (0, 3, 96):
        with pytest.raises(ValueError, match="power of two"):
            reference.hadamard(bad)
    torch.manual_seed(1)
    x = torch.randn(3, 1, 5, 32)
    x[..., 3] *= 40  # an outlier channel: what rotation spreads out
    store = get_scheme("rotate+asym_token", group_size=32).new_store(
        [2], 32, 3, torch.float32, "cpu", role="value"
    )
    assert store.append(x) is None  # packed-only: the stored form is read back below
    got = store.dequantize()
    rotated = reference.hadamard_rotate(x)
    q = reference.fake_quantize(rotated, 2, 32)
    torch.testing.assert_close(got, reference.hadamard_rotate(q), rtol=1e-5, atol=1e-5)
    # orthonormal: the error is the rotated-domain quantization error, and here smaller than without rotation
    torch.testing.assert_close((got - x).norm(), (q - rotated).norm(), rtol=1e-4, atol=0)
    assert (got - x).norm() < (reference.fake_quantize(x, 2, 32) - x).norm()
    with pytest.raises(ValueError, match="quant.scheme: rotate\\+asym_token needs a power-of-two head_dim"):
        get_scheme("rotate+asym_token", group_size=8).new_store(
            [4], 24, 1, torch.float32, "cpu", role="value"
        )


@pytest.mark.parametrize("name", ["rotate+asym_token", "rotate+sym_token", "rotate+kivi", "rotate+fp8"])
def test_rotated_working_copy_is_the_stored_form_and_kept_once(name):
    """Under simulate, rotate+'s working copy is what a packed-only twin dequantizes, bit for bit, append by append
    (kivi's keys in whole groups), while its inner store keeps no working copy of its own (one copy, not two)."""
    scheme = get_scheme(name, group_size=8, residual=0)
    bits = [8, 16, 8] if name == "rotate+fp8" else [4, 16, 2]
    for role in ("key", "value"):
        simulated = scheme.new_store(bits, 16, 3, torch.float32, "cpu", role=role, simulate=True)
        packed = scheme.new_store(bits, 16, 3, torch.float32, "cpu", role=role)
        rotated = simulated
        while not isinstance(rotated, RotatedStore):  # kivi's keys: inside the residual window's chunker
            rotated = rotated.base
        assert rotated.simulate and not rotated.base.simulate
        for tn in (8, 24, 16):
            x = torch.randn(3, 3, tn, 16) * 4
            got = simulated.append(x)
            assert packed.append(x) is None
            assert torch.equal(got, packed.dequantize())
        assert simulated.nbytes() == packed.nbytes()


def test_fp8_matches_torch_e4m3_cast():
    torch.manual_seed(2)
    x = torch.randn(2, 2, 9, 16, dtype=torch.float16) * torch.logspace(-3, 3, 9, dtype=torch.float16)[:, None]
    store = get_scheme("fp8").new_store([8, 16], 16, 2, torch.float16, "cpu", role="value")
    assert store.append(x) is None  # packed-only: nothing dequantized is returned or kept
    got = store.dequantize()
    scale = (x[:, 0].float().abs().amax(-1, keepdim=True) / 448).half().float()  # per (token, head)
    want = ((x[:, 0].float() / scale).to(torch.float8_e4m3fn).float() * scale).half()
    assert torch.equal(got[:, 0], want) and torch.equal(got[:, 1], x[:, 1])
    assert store.nbytes() == 2 * 9 * (16 + 2) + 2 * 9 * 16 * 2  # e4m3 payload + fp16 scale; 16-bit head
    with pytest.raises(
        ValueError, match=r"^bits: \[4\] with quant.scheme fp8, which stores quantized heads at 8 bits"
    ):
        get_scheme("fp8").new_store([8, 4], 16, 1, torch.float32, "cpu", role="value")


# ---------------------------------------------------------------------------------------------------------
# bytes, by hand


def test_bytes_of_kivi_with_sinks_and_residual_by_hand():
    # B=1, heads at [4, 16], D=16, g=8, 2 sinks, residual 4, 23 tokens: 21 after the sinks.
    scheme = get_scheme("kivi", group_size=8, sink_tokens=2, residual=4)
    x = torch.randn(1, 2, 23, 16)
    keys = scheme.new_store([4, 16], 16, 1, torch.float32, "cpu", role="key")
    values = scheme.new_store([4, 16], 16, 1, torch.float32, "cpu", role="value")
    feed(keys, x, [5, 1, 17])
    feed(values, x, [5, 1, 17])
    sinks, fp_token = 2 * (2 * 16 * 2), 2 * 16 * 2  # 2 tokens x 2 heads x 16 x 2 bytes; one fp16 token
    # keys: (21 - 4) // 8 = 2 groups quantized (16 tokens), 5 in the residual. A 4-bit group: 16 channels x
    # (8 codes = 4 bytes + fp16 scale + fp16 zero); the 16-bit head holds its 16 tokens at 2 bytes.
    assert keys.nbytes() == sinks + 5 * fp_token + 2 * 16 * (4 + 4) + 16 * 16 * 2 == 1216
    # values: 17 tokens quantized per token (8 payload bytes + 2 groups of 16 x (scale + zero)), 4 residual.
    assert values.nbytes() == sinks + 4 * fp_token + 17 * (8 + 2 * 4) + 17 * 16 * 2 == 1200
    assert keys.nbytes_fp16() == values.nbytes_fp16() == 23 * 2 * 16 * 2


def test_kivi_keeps_a_partly_evicted_group_and_counts_it():
    scheme = get_scheme("kivi", group_size=8, residual=0)
    x = torch.randn(1, 1, 16, 8)
    store = scheme.new_store([2], 8, 1, torch.float32, "cpu", role="key")
    store.append(x)
    want = oracle(scheme, x, [2], "key")
    group = 8 * (2 + 4)  # 8 channels x (8 2-bit codes = 2 bytes + fp16 scale and zero)
    assert store.nbytes() == 2 * group
    store.keep_last(13)  # evicts 3 tokens of the first group: the group stays stored
    assert store.length == 13 and store.nbytes() == 2 * group
    assert torch.equal(store.dequantize(), want[:, :, 3:])
    store.keep_last(7)  # the first group is gone, one token of the second evicted
    assert store.nbytes() == group and torch.equal(store.dequantize(), want[:, :, 9:])


# ---------------------------------------------------------------------------------------------------------
# nasty inputs

NASTY = [0.0, 1e-8, -1e-8, 3.0, -3.0, 1e4, 65504.0, -65504.0, 1e30, -1e30]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(SCHEMES),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    values=st.lists(st.sampled_from(NASTY), min_size=1, max_size=4),
    constant=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_no_nan_or_inf_on_nasty_inputs(name, dtype, values, constant, seed):
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(values, dtype=torch.float32)
    x = pool[torch.randint(0, len(values), (1, 3, 18, 16), generator=g)]
    if constant:
        x = x[:, :, :1, :1].expand_as(x).contiguous()
    x = x.clamp(torch.finfo(dtype).min, torch.finfo(dtype).max).to(dtype)
    bits = [8, 16, 8] if get_scheme(name).widths == (8,) else [2, 3, 8]
    for role in ("key", "value"):
        scheme = get_scheme(name, group_size=8, residual=2)
        store = scheme.new_store(bits, 16, 1, dtype, "cpu", role=role, simulate=True)
        got = feed(store, x, [11, 7])
        assert got.dtype == dtype and torch.isfinite(got).all() and torch.isfinite(store.dequantize()).all()


# ---------------------------------------------------------------------------------------------------------
# eviction support


@pytest.mark.parametrize("name", ["asym_token", "fp8", "rotate+sym_token"])
def test_select_keeps_the_chosen_tokens_through_sinks_and_residual(name):
    scheme = get_scheme(name, group_size=8, sink_tokens=2, residual=3)
    bits = [8, 16]
    torch.manual_seed(3)
    x = torch.randn(2, 2, 12, 16)
    store = scheme.new_store(bits, 16, 2, torch.float32, "cpu", simulate=True, role="value")
    feed(store, x, [4, 8])  # sinks 0-1, quantized 2-8, residual 9-11
    before = store.nbytes()
    index = torch.tensor([[0, 1, 3, 6, 9, 10, 11], [0, 1, 2, 5, 9, 10, 11]])  # each row: 2 sinks, 3 residual
    store.select(index)
    full = oracle(scheme, x, bits, "value")
    want = torch.stack([full[b, :, index[b]] for b in range(2)])  # (B, H, 7, D)
    one_token = get_scheme(name, group_size=8).new_store(bits, 16, 1, torch.float32, "cpu", role="value")
    one_token.append(x[:1, :, :1])
    assert store.length == 7 and store.nbytes() == before - 2 * 5 * one_token.nbytes()  # 5 quantized evicted
    torch.testing.assert_close(store.dequantize(), want, rtol=1e-5, atol=1e-6)
    new = torch.randn(2, 2, 1, 16)
    got = store.append(new)  # token 9 leaves the residual for quantized storage
    moved = oracle(get_scheme(name, group_size=8, sink_tokens=2, residual=2), x, bits, "value")[:, :, 9]
    torch.testing.assert_close(got[:, :, 4], moved, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[:, :, [5, 6]], x[:, :, [10, 11]]) and torch.equal(got[:, :, 7:], new)
    with pytest.raises(NotImplementedError, match="batch rows keep different numbers"):
        store.select(torch.tensor([[0, 1, 2, 3], [0, 2, 3, 4]]))


def test_kivi_keys_cannot_evict_single_tokens():
    store = get_scheme("kivi", group_size=8, residual=0).new_store([4], 16, 1, torch.float32, "cpu", "key")
    store.append(torch.randn(1, 1, 16, 16))
    with pytest.raises(NotImplementedError, match="kivi keys are quantized per channel"):
        store.select(torch.tensor([[0, 2, 5]]))


# ---------------------------------------------------------------------------------------------------------
# through QuantizedKVCache on tiny models

CACHE_CASES = [(name, {}) for name in SCHEMES] + [
    ("kivi", dict(sink_tokens=3, residual=4)),
    ("rotate+fp8", dict(sink_tokens=2, residual=1)),
    ("sym_token", dict(sink_tokens=5)),
]
CASE_IDS = [name + "".join(f"-{k}{v}" for k, v in opts.items()) for name, opts in CACHE_CASES]


def chunked_logits(model, ids, cache, chunk):
    """Logits of ids (B, T) fed in chunks through `cache`: (B, T, V)."""
    out = []
    for s in range(0, ids.shape[1], chunk):
        out.append(model(input_ids=ids[:, s : s + chunk], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, 1)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-gemma3"])
def tiny(request):
    model = load_model(request.param)[0]
    with installed(model, PACKED):  # quantized caches are attended from their packed form
        yield model


@torch.no_grad()
def test_sixteen_bits_and_all_sink_tokens_equal_dynamic_cache(tiny):
    torch.manual_seed(4)
    ids = torch.randint(0, 256, (1, 29))  # longer than tiny-gemma3's window of 16
    ref = chunked_logits(tiny, ids, DynamicCache(config=tiny.config), chunk=10)
    for name, opts in CACHE_CASES:
        cache = QuantizedKVCache(
            tiny.config, 16, scheme=name, group_size=8, prefill="quantized", simulate=True, **opts
        )
        assert torch.equal(chunked_logits(tiny, ids, cache, chunk=10), ref), (name, opts)
        low = min(get_scheme(name).widths)
        sinks = QuantizedKVCache(
            tiny.config, low, scheme=name, group_size=8, prefill="quantized", sink_tokens=37, simulate=True
        )
        assert torch.equal(chunked_logits(tiny, ids, sinks, chunk=10), ref), (name, "sinks")


@pytest.mark.parametrize("name, opts", CACHE_CASES, ids=CASE_IDS)
@torch.no_grad()
def test_cache_returns_the_schemes_oracle_at_low_bits(name, opts, packed):
    model, _ = load_model("tiny-llama")
    packed(model)  # quantized caches are attended from their packed form
    bits = torch.tensor(
        [[8, 16, 8], [16, 8, 8], [8, 8, 16]]
        if get_scheme(name).widths == (8,)
        else [[2, 4, 16], [8, 3, 2], [16, 4, 4]]
    )
    torch.manual_seed(5)
    prompt = torch.randint(0, 256, (2, 21))
    dyn = DynamicCache(config=model.config)
    model(input_ids=prompt, past_key_values=dyn, use_cache=True)
    cache = QuantizedKVCache(
        model.config, bits, scheme=name, group_size=8, simulate=True, **opts
    )  # exact prefill
    model(input_ids=prompt, past_key_values=cache, use_cache=True)  # stores the K/V DynamicCache holds
    scheme = cache.scheme
    for i, (ref, layer) in enumerate(zip(dyn.layers, cache.layers)):
        k_new, v_new = torch.randn(2, 3, 19, 32), torch.randn(2, 3, 19, 32)  # 40 tokens: kivi quantizes 8
        keys, values = layer.update(k_new, v_new)
        widths = bits[i].tolist()
        want_k = oracle(scheme, torch.cat([ref.keys, k_new], 2), widths, "key")
        want_v = oracle(scheme, torch.cat([ref.values, v_new], 2), widths, "value")
        torch.testing.assert_close(keys, want_k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(values, want_v, rtol=1e-5, atol=1e-5)
    assert 0 < cache.nbytes() < cache.nbytes_fp16() == 3 * 2 * 2 * 40 * 3 * 32 * 2


SLIDING_CASES = [("kivi", 0), ("asym_token", 3), ("rotate+kivi", 2)]  # (scheme, sink tokens), residual 2


@pytest.mark.parametrize("name, sinks", SLIDING_CASES, ids=[c[0] for c in SLIDING_CASES])
@torch.no_grad()
def test_sliding_layers_return_the_oracle_window(name, sinks, packed):
    model, _ = load_model("tiny-gemma3")
    packed(model)  # quantized caches are attended from their packed form
    window = model.config.sliding_window  # 16: a sliding layer holds the last 15 tokens
    cache = QuantizedKVCache(
        model.config, 4, scheme=name, group_size=8, prefill="quantized", residual=2, sink_tokens=sinks,
        simulate=True,
    )  # fmt: skip
    torch.manual_seed(6)
    xk, xv = torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32)
    for layer in cache.layers:
        seen = 0
        for n in (5, 9, 1, 1, 13, 11):
            keys, values = layer.update(xk[:, :, seen : seen + n], xv[:, :, seen : seen + n])
            held = min(seen, window - 1) if isinstance(layer, QuantizedSlidingLayer) else seen
            seen += n
            assert keys.shape[2] == values.shape[2] == held + n
            want_k = oracle(cache.scheme, xk[:, :, :seen], [4, 4], "key")[:, :, seen - held - n :]
            want_v = oracle(cache.scheme, xv[:, :, :seen], [4, 4], "value")[:, :, seen - held - n :]
            torch.testing.assert_close(keys, want_k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(values, want_v, rtol=1e-5, atol=1e-5)
    if name == "kivi":
        # 40 tokens, g = 8, residual 2: keys 0-31 quantized in 4 groups, 32-39 unquantized; the window holds
        # 25-39, so one group (24-31, token 24 evicted) stays, counted whole: 2 heads x 32 channels x (8 4-bit
        # codes = 4 bytes + fp16 scale and zero), plus 8 tokens x 2 heads x 32 x 2 bytes. Values: 25-37
        # quantized per token (2 heads x (16 payload bytes + 4 groups x 4 bytes)), 38-39 unquantized.
        sliding = cache.layers[0]
        sliding.evict()  # the tokens the last update moved out of the window
        assert sliding.k_store.nbytes() == 2 * 32 * (4 + 4) + 8 * 2 * 32 * 2 == 1536
        assert sliding.v_store.nbytes() == 13 * 2 * (16 + 4 * 4) + 2 * 2 * 32 * 2 == 1088


@torch.no_grad()
def test_from_prefilled_sliding_window_past_its_sinks_matches_the_update_path(packed):
    """A prefilled sliding window that already dropped the sequence's first tokens holds no sink tokens."""
    model, _ = load_model("tiny-gemma3")
    packed(model)  # quantized caches are attended from their packed form
    torch.manual_seed(7)
    ids = torch.randint(0, 256, (1, 40))  # past tiny-gemma3's window of 16
    dyn = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=dyn, use_cache=True)
    options = dict(scheme="asym_token", group_size=8, sink_tokens=2)
    prefilled = QuantizedKVCache.from_prefilled(dyn, model.config, 4, **options)
    updated = QuantizedKVCache(model.config, 4, prefill="exact", **options)
    model(input_ids=ids, past_key_values=updated, use_cache=True)
    assert prefilled.nbytes() == updated.nbytes()
    for a, b in zip(prefilled.layers, updated.layers):
        torch.testing.assert_close(a.k_store.dequantize(), b.k_store.dequantize(), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# backends, configuration and the command line


def test_triton_only_for_plain_token_schemes(packed):
    assert check_backend(get_scheme("asym_token"), "auto") == "auto"
    for scheme in (
        get_scheme("kivi"),
        get_scheme("sym_token", sink_tokens=4),
        get_scheme("rotate+asym_token"),
    ):
        assert check_backend(scheme, "auto") == check_backend(scheme, "torch") == "torch"
        with pytest.raises(ValueError, match="^quant.backend: triton supports only asym_token and sym_token"):
            check_backend(scheme, "triton")
    model, _ = load_model("tiny-llama")
    packed(model)  # quantized caches are attended from their packed form
    assert (
        QuantizedKVCache(model.config, 4, scheme="asym_token", residual=3, backend="auto").backend == "torch"
    )


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["quant=fp8", "policy.widths=[2,4]"],
            r"^policy.widths: \[2, 4\] with quant.scheme fp8, which stores quantized heads at 8 bits",
        ),
        (["quant.sink_tokens=-1"], r"^quant.sink_tokens: -1 is not a non-negative integer"),
        (["quant.residual=1.5"], r"^quant.residual: 1.5 is not a non-negative integer"),
        (["quant.scheme=rotate+int4"], r"^quant.scheme: unknown 'rotate\+int4'.*; allowed: asym_token, "),
        (["quant=kivi", "quant.group_size=12"], r"^quant.group_size: 12 with kivi.*allowed: a multiple of 8"),
        (
            ["quant=kivi", "quant.key_group_size=12"],
            r"^quant.key_group_size: 12 with kivi.*allowed: a multiple of 8",
        ),
        (["quant.key_group_size=0"], r"^quant.key_group_size: 0 is not a positive integer"),
        (
            ["quant=kivi", "quant.backend=triton"],
            r"^quant.backend: triton supports only asym_token and sym_token",
        ),
    ],
)
def test_bad_scheme_options_give_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate_config(compose_cfg(*overrides))
    assert "\n" not in str(err.value)


def test_points_carry_each_schemes_residual():
    points = validate_config(compose_cfg("+sweep=smoke", "sweep.schemes=[asym_token,kivi,rotate+kivi]"))
    assert {(p.scheme, p.residual, p.sink_tokens) for p in points} == {
        ("asym_token", 0, 0),
        ("kivi", 32, 0),
        ("rotate+kivi", 32, 0),
    }
    assert {p.residual for p in validate_config(compose_cfg("quant=kivi", "quant.residual=4"))} == {4}
    point = validate_config(
        compose_cfg("quant=fp8", "policy=uniform", "policy.budget=8", "policy.widths=[8]")
    )[0]
    assert (point.scheme, point.residual) == ("fp8", 0)


def harness(in_process, *args, run_dir):
    """python -m harness ARGS run_dir=RUN_DIR, run in this process."""
    return in_process(entry, "harness", *args, f"run_dir={run_dir}", "tracking.wandb.mode=disabled")


def test_command_runs_kivi_with_sinks(tmp_path, in_process):
    proc = harness(
        in_process,
        "model=tiny-llama",
        "eval=tiny",
        "quant=kivi",
        "quant.group_size=8",
        "quant.residual=4",
        "quant.sink_tokens=2",
        "policy=uniform",
        "policy.budget=2",
        "eval.num_prompts=2",
        "eval.new_tokens=4",
        "eval.num_sequences=1",
        "eval.sequence_tokens=32",
        run_dir=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    import pandas as pd

    rows = pd.read_parquet(tmp_path / "results.parquet").set_index("policy")
    row = rows.loc["uniform"]
    assert (row["status"], row["scheme"], row["residual"], row["sink_tokens"]) == ("ok", "kivi", 4, 2)
    # fp16 sinks, residual and the partial key group cost bytes: true compression stays below nominal (8x)
    assert 1 < row["compression_true"] < row["compression_nominal"] == 8


def test_command_rejects_fp8_with_other_widths(tmp_path, in_process):
    proc = harness(in_process, "quant=fp8", "policy.widths=[2,4]", run_dir=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: policy.widths: [2, 4] with quant.scheme fp8"), (
        proc.stderr
    )
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------------
# key groups apart from the values' (quant.key_group_size)


def _head_dim_64():
    config = LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(config).eval()


@torch.no_grad()
def test_kivi_key_groups_of_128_tokens_on_head_dim_64(packed):
    """kivi g32 kg128: keys per channel over 128 tokens (g need not divide head_dim), values per token in groups
    of 32; after 300 tokens 256 keys are quantized (the residual of 32 holds the other 44), the values 268."""
    config, model = _head_dim_64()
    packed(model)
    with pytest.raises(ValueError, match=r"^quant.group_size: 128 does not divide"):  # values: along head_dim
        get_scheme("kivi", 128).new_store([4], 64, 1, torch.float32, "cpu", "value")
    cache = QuantizedKVCache(config, 4, scheme="kivi", group_size=32, key_group_size=128, prefill="quantized")
    assert cache.scheme.label() == "kivi g32 kg128"
    ids = torch.randint(0, 64, (2, 300))
    for start in range(0, 300, 50):
        logits = model(input_ids=ids[:, start : start + 50], past_key_values=cache, use_cache=True).logits
        assert torch.isfinite(logits).all()
    scheme, held = cache.scheme, {"key": 256, "value": 268}
    want = sum(
        2 * 2 * (held[role] * scheme.token_bytes(4, 64, role) + (300 - held[role]) * 64 * 2)
        for role in ("key", "value")
    )  # per layer: batch x heads x (quantized + fp16 tokens)
    assert cache.nbytes() == 2 * want and scheme.token_bytes(4, 64, "key") == 64 * (64 + 4) / 128
    shape = capacity.shape_from_config(config)
    assert capacity.cache_bytes(shape, 300, 4, scheme, batch=2).true_bytes == cache.nbytes()
    ref = DynamicCache(config=config)
    model(input_ids=ids, past_key_values=ref, use_cache=True)
    layer = cache.layers[0]
    keys, values = ref.layers[0].keys, ref.layers[0].values  # (B, Hkv, 300, D)
    want_keys = keys.clone()
    want_keys[:, :, :256] = reference.channel_quantize_dequantize(keys[:, :, :256], 4, 128)[1]
    want_values = values.clone()
    want_values[:, :, :268] = reference.fake_quantize(values[:, :, :268], 4, 32)
    torch.testing.assert_close(layer.k_store.dequantize(), want_keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.v_store.dequantize(), want_values, rtol=1e-5, atol=1e-5)


def test_per_token_keys_are_stored_in_their_own_groups():
    """asym_token g32 kg16: the keys' stored scales and zeros are kernels.reference's at g16, the values' at g32."""
    scheme = get_scheme("asym_token", 32, key_group_size=16)
    torch.manual_seed(7)
    x = torch.randn(2, 3, 11, 64) * torch.logspace(-2, 1, 64)  # (B, Hkv, T, D), channels of different ranges
    for role, g in (("key", 16), ("value", 32)):
        store = scheme.new_store([4, 4, 4], 64, 2, torch.float32, "cpu", role)
        store.append(x)
        want = reference.quantize(x, 4, g)  # scale (B, Hkv, T, 64 // g)
        bucket = store.bucket_of[4]  # every head at 4 bits: one bucket, KV heads in order
        assert bucket.scale.shape[-1] == 64 // g, role
        assert torch.equal(bucket.scale[:, :, :11], want.scale) and torch.equal(
            bucket.zero[:, :, :11], want.zero
        )
        assert store.nbytes() == 2 * 3 * 11 * scheme.token_bytes(4, 64, role)
    assert scheme.token_bytes(4, 64, "key") == 32 + 4 * 4 and scheme.token_bytes(4, 64, "value") == 32 + 2 * 4
    with pytest.raises(
        ValueError, match=r"^quant.key_group_size: 48 does not divide the model's head_dim 64"
    ):
        get_scheme("asym_token", 32, key_group_size=48).new_store([4], 64, 1, torch.float32, "cpu", "key")


def test_rotate_wraps_a_scheme_object_and_the_registry_holds_its_explicit_list():
    from harness.schemes import ROTATABLE, SCHEMES, rotate

    inner = get_scheme("kivi", 16, key_group_size=64, residual=8, sink_tokens=2)
    wrapped = rotate(inner)
    assert wrapped == get_scheme("rotate+kivi", 16, key_group_size=64, residual=8, sink_tokens=2)
    # the wrapper keeps the sink and residual tokens; the inner scheme gets every other option
    assert (wrapped.inner.group_size, wrapped.inner.key_group_size) == (16, 64)
    assert (wrapped.inner.sink_tokens, wrapped.inner.residual) == (0, 0)
    assert [n for n in SCHEMES if n.startswith("rotate+")] == [f"rotate+{n}" for n in ROTATABLE]
    with pytest.raises(
        ValueError, match=r"^quant.scheme: rotate\+codebook is not a scheme; allowed: rotate\+asym"
    ):
        rotate(get_scheme("codebook"))
