"""QuantizedKVCache against transformers' DynamicCache and the packed-format oracle."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache, QuantizedLayer, QuantizedSlidingLayer
from harness.models import load_model
from kernels import reference

TINY = ["tiny-llama", "tiny-gpt2", "tiny-qwen2", "tiny-qwen3_5", "tiny-gemma3"]


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    model, _ = load_model(request.param)
    with installed(model, PACKED):  # quantized caches are attended from their packed form
        yield request.param, model


def n_kv(model) -> int:
    c = model.config.get_text_config(decoder=True)
    return getattr(c, "num_key_value_heads", None) or c.num_attention_heads


def chunked_logits(model, ids, cache, chunk):
    """Logits of ids (B, T) fed in chunks through `cache`: (B, T, V)."""
    out = []
    for s in range(0, ids.shape[1], chunk):
        out.append(model(input_ids=ids[:, s : s + chunk], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, 1)


@torch.no_grad()
def test_sixteen_bits_is_exactly_dynamic_cache(tiny):
    """simulate=True returns the stored K/V to the model's own attention: bit-identical to DynamicCache. The
    packed path attends them blockwise (kernels/packed_attention.py): equal within float summation order."""
    name, model = tiny
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 37))  # longer than tiny-gemma3's window of 16
    ref = chunked_logits(model, ids, DynamicCache(config=model.config), chunk=7)
    for simulate in (True, False):
        for prefill in ("exact", "quantized"):
            cache = QuantizedKVCache(model.config, 16, prefill=prefill, simulate=simulate)
            got = chunked_logits(model, ids, cache, chunk=7)
            if simulate:
                assert torch.equal(got, ref), f"{name} prefill={prefill}: max diff {(got - ref).abs().max()}"
            else:
                err = ((got - ref).norm() / ref.norm()).item()
                assert err < 1e-5, f"{name} prefill={prefill} packed: relative error {err}"
        prompt = ids[:, :21]
        kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
        want = model.generate(prompt, past_key_values=DynamicCache(config=model.config), **kw)
        got = model.generate(
            prompt, past_key_values=QuantizedKVCache(model.config, 16, simulate=simulate), **kw
        )
        assert torch.equal(got, want), (name, simulate)


@torch.no_grad()
def test_eight_bits_close_two_bits_moves(tiny):
    name, model = tiny
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (2, 33))
    ref = chunked_logits(model, ids, DynamicCache(config=model.config), chunk=11)
    err = {}
    for b in (8, 2):
        got = chunked_logits(model, ids, QuantizedKVCache(model.config, b, prefill="quantized"), chunk=11)
        assert torch.isfinite(got).all()
        err[b] = ((got - ref).norm() / ref.norm()).item()
    assert err[8] < 3e-2, (name, err)
    assert err[2] > 10 * err[8] and err[2] > 1e-3, (name, err)


@torch.no_grad()
def test_mixed_widths_store_each_head_at_its_width(packed):
    model, _ = load_model("tiny-llama")
    packed(model)  # quantized caches are attended from their packed form
    bits = torch.tensor([[2, 4, 16], [8, 3, 2], [16, 16, 4]])
    torch.manual_seed(3)
    ids = torch.randint(0, 256, (3, 29))
    ref_cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=ref_cache, use_cache=True)
    cache = QuantizedKVCache(model.config, bits, group_size=16)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    for layer, (ref_layer, q_layer) in enumerate(zip(ref_cache.layers, cache.layers)):
        for store, ref in ((q_layer.k_store, ref_layer.keys), (q_layer.v_store, ref_layer.values)):
            got = store.dequantize()  # (B, Hkv, T, D)
            for h, b in enumerate(bits[layer].tolist()):
                want = ref[:, h] if b == 16 else reference.fake_quantize(ref[:, h], b, 16)
                assert torch.equal(got[:, h], want), (layer, h, b)


@torch.no_grad()
def test_per_layer_kv_heads_pad_the_bits_and_shared_layers_hold_nothing(packed):
    model, _ = load_model("tiny-gemma4-kv")  # KV heads 2, 2, 1 (global); layers 3, 4 reuse layers 1, 2's K/V
    packed(model)  # quantized caches are attended from their packed form
    bits = torch.tensor([[2, 16], [4, 8], [3, 0], [0, 0], [0, 0]])  # 0: padding, no cache
    with pytest.raises(ValueError, match=r"bits: shape \(5, 1\)"):
        QuantizedKVCache(model.config, bits[:, :1])
    QuantizedKVCache(model.config, torch.where(bits > 0, 8, 0), scheme="fp8")  # checks stored widths only
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (2, 29))  # past the window of 16
    ref_cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=ref_cache, use_cache=True)
    cache = QuantizedKVCache(model.config, bits, group_size=16)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["QuantizedSlidingLayer"] * 2 + ["QuantizedLayer"] + ["DummyLayer"] * 2
    for layer, heads in enumerate([2, 2, 1]):
        ref_layer, q_layer = ref_cache.layers[layer], cache.layers[layer]
        if isinstance(q_layer, QuantizedSlidingLayer):
            q_layer.evict()  # the tokens the forward moved out of the window (evicted at the next update)
        assert q_layer.key_bits == q_layer.value_bits == bits[layer, :heads].tolist()
        for store, ref in ((q_layer.k_store, ref_layer.keys), (q_layer.v_store, ref_layer.values)):
            got = store.dequantize()  # (B, Hkv, T, D)
            assert got.shape == ref.shape, layer
            for h, b in enumerate(q_layer.key_bits):
                want = ref[:, h] if b == 16 else reference.fake_quantize(ref[:, h], b, 16)
                assert torch.equal(got[:, h], want), (layer, h, b)


def test_true_compression_asym4_g32_head_dim_64_is_3_2():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = QuantizedKVCache(config, 4, scheme="asym_token", group_size=32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (2, 19)), past_key_values=cache, use_cache=True)
    assert cache.nbytes_fp16() == 2 * 2 * 2 * 19 * 2 * 64 * 2  # layers * (K,V) * B * T * heads * D * 2 bytes
    assert cache.nbytes_fp16() / cache.nbytes() == pytest.approx(3.2)
    sym = QuantizedKVCache(config, 4, scheme="sym_token", group_size=32)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (2, 19)), past_key_values=sym, use_cache=True)
    assert sym.nbytes_fp16() / sym.nbytes() == pytest.approx(128 / 36)  # no zeros stored


@torch.no_grad()
def test_sliding_layers_hold_their_window_and_linear_layers_are_not_quantized(packed):
    model, _ = load_model("tiny-gemma3")
    packed(model)  # quantized caches are attended from their packed form
    cache = QuantizedKVCache(model.config, 4, group_size=16)
    model(input_ids=torch.randint(0, 256, (1, 40)), past_key_values=cache, use_cache=True)
    window = model.config.sliding_window
    cache.nbytes()  # applies the sliding layers' pending eviction
    for layer in cache.layers:
        held = layer.k_store.length
        assert held == (window - 1 if isinstance(layer, QuantizedSlidingLayer) else 40)
    hybrid, _ = load_model("tiny-qwen3_5")
    packed(hybrid)  # quantized caches are attended from their packed form
    cache = QuantizedKVCache(hybrid.config, 4, group_size=16)
    hybrid(input_ids=torch.randint(0, 256, (1, 12)), past_key_values=cache, use_cache=True)
    kinds = [isinstance(layer, QuantizedLayer) for layer in cache.layers]
    assert kinds == [t == "full_attention" for t in hybrid.config.layer_types]
    assert cache.linear_state_nbytes() > 0


@torch.no_grad()
def test_from_prefilled_equals_an_exact_prefill_cache(tiny):
    name, model = tiny
    torch.manual_seed(4)
    prompt = torch.randint(0, 256, (2, 23))
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    bits = torch.tensor([2, 4, 8, 16])[torch.randint(0, 4, (layers, n_kv(model)))]

    def decode(cache, first_logits, steps=6):
        tokens = [first_logits[:, -1].argmax(-1, keepdim=True)]
        for _ in range(steps):
            logits = model(input_ids=tokens[-1], past_key_values=cache, use_cache=True).logits
            tokens.append(logits[:, -1].argmax(-1, keepdim=True))
        return torch.cat(tokens, 1)

    fresh = QuantizedKVCache(model.config, bits, group_size=16, prefill="exact")
    first = model(input_ids=prompt, past_key_values=fresh, use_cache=True).logits
    want = decode(fresh, first)
    dyn = DynamicCache(config=model.config)
    first_dyn = model(input_ids=prompt, past_key_values=dyn, use_cache=True).logits
    assert torch.equal(first, first_dyn)
    got = decode(QuantizedKVCache.from_prefilled(dyn, model.config, bits, group_size=16), first_dyn)
    assert torch.equal(got, want), name


class FakeQuantizedCache(DynamicCache):
    """The oracle of a K/V-asymmetric cache: a DynamicCache that quantize-dequantizes every new key at its head's
    key width and every new value at its value width (kernels.reference, asym_token groups) before storing it."""

    def __init__(self, config, key_bits: torch.Tensor, value_bits: torch.Tensor, group_size: int):
        super().__init__(config=config)
        self.widths, self.group_size = (key_bits, value_bits), group_size

    def _quantized(self, x: torch.Tensor, bits: list[int]) -> torch.Tensor:
        heads = [
            x[:, h] if b == 16 else reference.fake_quantize(x[:, h], b, self.group_size)
            for h, b in enumerate(bits)
        ]
        return torch.stack(heads, 1)  # (B, Hkv, Tn, D)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys = self._quantized(key_states, self.widths[0][layer_idx].tolist())
        values = self._quantized(value_states, self.widths[1][layer_idx].tolist())
        return super().update(keys, values, layer_idx, *args, **kwargs)


@torch.no_grad()
def test_keys_and_values_at_different_widths_match_the_oracle_and_the_byte_model(packed):
    model, _ = load_model("tiny-llama")
    packed(model)  # quantized caches are attended from their packed form
    torch.manual_seed(6)
    layers, heads = model.config.num_hidden_layers, n_kv(model)
    key_bits = torch.full((layers, heads), 8)
    key_bits[0, 0], key_bits[-1, -1] = 4, 16  # K8V4 with per-head exceptions
    value_bits = torch.full((layers, heads), 4)
    value_bits[0, 1], value_bits[-1, 0] = 2, 16
    ids = torch.randint(0, 256, (2, 31))
    want = chunked_logits(model, ids, FakeQuantizedCache(model.config, key_bits, value_bits, 16), chunk=9)
    caches = {}
    for simulate in (True, False):
        caches[simulate] = QuantizedKVCache(
            model.config,
            key_bits,
            group_size=16,
            prefill="quantized",
            simulate=simulate,
            value_bits=value_bits,
        )
        got = chunked_logits(model, ids, caches[simulate], chunk=9)
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-5, (simulate, err)
    uniform = chunked_logits(
        model, ids, QuantizedKVCache(model.config, 4, group_size=16, prefill="quantized"), 9
    )
    assert ((uniform - want).norm() / want.norm()).item() > 1e-4  # the oracle tells the widths apart
    cache = caches[False]
    layer = cache.layers[0]
    assert (layer.key_bits, layer.value_bits) == (key_bits[0].tolist(), value_bits[0].tolist())
    D = model.config.head_dim
    per_token = sum(
        cache.scheme.token_bytes(b, D, role="value")
        for grid in (key_bits, value_bits)
        for b in grid.flatten().tolist()
    )
    assert cache.nbytes() == 2 * 31 * per_token  # batch x tokens x (every head's key + value bytes)
    with pytest.raises(ValueError, match=r"^value_bits: shape \(1, 1\)"):
        QuantizedKVCache(model.config, key_bits, value_bits=torch.tensor([[4]]))
    with pytest.raises(
        ValueError, match=r"^bits: \[[\d, ]+\] with quant.scheme fp8, which stores quantized heads at 8"
    ):
        QuantizedKVCache(model.config, 8, scheme="fp8", value_bits=value_bits)
