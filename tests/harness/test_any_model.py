"""Any causal LM through the library surface: one table of tiny random models of the architectures people serve
most, and the hybrids of the registry, each through harness.load -> calibration -> allocate -> quantized_cache ->
model.generate(), against

- a reference that attends the dequantized cache (the same cache outside the packed attention): equal greedy
  tokens;
- the byte model (harness.capacity.cache_bytes, from the scheme's token_bytes): equal bytes held and fp16 bytes.

An architecture the cache cannot serve is refused with one line saying why, before any weights load.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import harness
from harness.capacity import cache_bytes, shape_from_config
from harness.models import byte_tokenizer

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2)  # fmt: skip
CONFIGS = {
    "llama": SMALL,
    "mistral": {**SMALL, "sliding_window": 12},  # every layer sliding; the generation runs past the window
    "qwen2": SMALL,
    "qwen3": SMALL,
    "phi3": {**SMALL, "pad_token_id": 0},
    "gemma2": {**SMALL, "sliding_window": 12},  # alternating sliding and full, attention logit softcapping
    "gemma3_text": {**SMALL, "sliding_window": 12, "layer_types": ["sliding_attention", "full_attention"] * 1 + ["sliding_attention"]},
    "gpt2": dict(vocab_size=256, n_embd=64, n_layer=3, n_head=4, n_positions=256),  # no GQA
}  # fmt: skip
REGISTRY = ["tiny-qwen3_5", "tiny-gemma4", "tiny-gemma4-kv"]  # linear + full; sliding + global; KV sharing
PROMPT, NEW = 13, 6  # past the sliding windows of 12
SCHEME = dict(name="asym_token", group_size=16)


def build(arch: str):
    """(model, tokenizer): a registry name loaded, or a tiny random model of `arch` given as an object."""
    if arch.startswith("tiny-"):
        return harness.load(arch)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **CONFIGS[arch]))
    return harness.load(model, byte_tokenizer())


@pytest.mark.parametrize("arch", [*CONFIGS, *REGISTRY])
@torch.no_grad()
def test_generate_through_the_cache_equals_the_dequantized_reference_and_the_byte_model(
    arch, tmp_path, monkeypatch
):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model, _ = build(arch)
    torch.manual_seed(len(arch))
    calibration = harness.calibration(model, ids=torch.randint(0, 256, (2, 24)), i0=4)
    scheme = harness.make_scheme(SCHEME["name"], group_size=SCHEME["group_size"])
    allocation = harness.allocate(model, calibration, 3.5, policy="entropy", scheme=scheme, alpha=4.0)
    assert len(allocation.histogram()) > 1, allocation.histogram()  # mixed widths, not one
    prompt = torch.randint(1, 256, (2, PROMPT))  # no token 0
    kw = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)

    packed_cache = harness.quantized_cache(model, allocation, scheme)
    with harness.packed_attention(model):
        packed = model.generate(prompt, past_key_values=packed_cache, **kw)
    reference_cache = harness.quantized_cache(model, allocation, scheme)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = model.generate(prompt, past_key_values=reference_cache, **kw)
    assert any(issubclass(w.category, harness.UnpackedReadWarning) for w in caught)
    assert torch.equal(packed, reference), arch

    fed = PROMPT + NEW - 1  # the last new token is never fed back
    want = cache_bytes(
        shape_from_config(model.config), fed, allocation.key_bits, scheme, 2, allocation.value_bits
    )
    for cache in (packed_cache, reference_cache):
        assert (cache.nbytes(), cache.nbytes_fp16()) == (want.true_bytes, want.fp16_bytes), arch
    assert 0 < want.true_bytes < want.fp16_bytes


UNSERVED = {
    "mamba": ("mamba", dict(vocab_size=256, hidden_size=32, num_hidden_layers=2), "no layer keeps attention"),
    "bloom": ("bloom", dict(vocab_size=256, hidden_size=32, n_layer=2, n_head=4), "BloomForCausalLM computes attention in its own code"),
    "falcon_h1": ("falcon_h1", dict(vocab_size=256, hidden_size=32, num_hidden_layers=2), "its layer type 'hybrid'"),
    "gpt_oss": ("gpt_oss", dict(vocab_size=256, hidden_size=32, num_hidden_layers=2), "GptOssForCausalLM's attention adds learned sink logits"),
}  # fmt: skip


@pytest.mark.parametrize("name", UNSERVED)
def test_an_architecture_the_cache_cannot_serve_is_one_line_before_its_weights_load(
    name, tmp_path, monkeypatch
):
    arch, options, reason = UNSERVED[name]
    config = AutoConfig.for_model(arch, **options)
    config.save_pretrained(tmp_path)  # a local checkpoint folder: its config is all the check reads

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(ValueError) as err:
        harness.load(str(tmp_path))
    message = str(err.value)
    assert message.startswith(f"source: QuantizedKVCache cannot serve {arch}: {reason}"), message
    assert "\n" not in message
    with pytest.raises(ValueError, match=f"^model: QuantizedKVCache cannot serve {arch}"):
        harness.QuantizedKVCache(config, 4)
