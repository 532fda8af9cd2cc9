"""QuantizedKVCache(backend="triton") with the fused decode attention against the torch backend.

Without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so the
models and generations are tiny; the same tests marked `gpu` run compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import kernels.decode_attention as decode_attention
from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache, resolve_backend
from harness.cache.quantized import UnpackedReadWarning
from harness.models import load_model

# (model, bits [layers, KV heads], group size, scheme, prefill, batch, value bits (None: bits), key group size
# (None: group size)); tiny-gemma3's window is 16 and the generations below reach 30 tokens, so its sliding
# layers evict.
CASES = [
    ("tiny-llama", [[2, 4, 16], [16, 3, 8], [4, 2, 2]], 16, "asym_token", "exact", 2, None, None),
    ("tiny-gemma3", [[2, 16], [4, 8], [16, 2], [3, 4]], 32, "sym_token", "quantized", 1, None, None),
    # KV sharing: the last two layers attend the stores of the last sliding and global layers before them
    # (the global layers have one KV head, so their second entry is padding).
    ("tiny-gemma4-kv", [[2, 4], [8, 16], [4, 3], [3, 2], [2, 8]], 16, "asym_token", "exact", 1, None, None),
    # keys and values apart: their own widths and group sizes
    (
        "tiny-llama",
        [[8, 8, 16], [8, 4, 8], [8, 8, 8]],
        16,
        "asym_token",
        "quantized",
        1,
        [[4, 2, 4], [16, 4, 4], [2, 4, 3]],
        8,
    ),
]
NEW_TOKENS = 10


@pytest.mark.parametrize(
    "name, bits, group_size, scheme, prefill, batch, value_bits, key_group_size",
    CASES,
    ids=[c[0] + ("-kv-apart" if c[6] else "") for c in CASES],
)
@torch.no_grad()
def test_triton_generate_matches_torch(
    device, name, bits, group_size, scheme, prefill, batch, value_bits, key_group_size, monkeypatch, packed
):
    model, _ = load_model(name, device=device)
    bits = torch.tensor(bits)
    value_bits = None if value_bits is None else torch.tensor(value_bits)
    torch.manual_seed(5)
    prompt = torch.randint(0, 256, (batch, 20), device=device)
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, output_logits=True)
    kw.update(return_dict_in_generate=True)
    cache_kw = dict(
        group_size=group_size,
        scheme=scheme,
        prefill=prefill,
        value_bits=value_bits,
        key_group_size=key_group_size,
    )

    torch_cache = QuantizedKVCache(
        model.config, bits, backend="torch", simulate=True, **cache_kw
    )  # SDPA reads it
    want = model.generate(prompt, past_key_values=torch_cache, **kw)

    calls = []
    kernel = decode_attention.decode_attention
    spy = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    monkeypatch.setattr(decode_attention, "decode_attention", spy)
    packed(model)
    triton_cache = QuantizedKVCache(model.config, bits, backend="triton", **cache_kw)
    got = model.generate(prompt, past_key_values=triton_cache, **kw)

    layers = triton_cache.quantized_layers()
    assert all(layer.fused for layer in layers)
    assert not any(layer.fused for layer in torch_cache.quantized_layers())
    assert all(layer.k_store._dequantized is None and layer.v_store._dequantized is None for layer in layers)
    # Every decode step of every attention layer is fused, the KV-sharing layers (which hold no store) included.
    attention_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    assert len(calls) == (NEW_TOKENS - 1) * attention_layers
    assert torch.equal(got.sequences, want.sequences), name
    if device == "cpu":
        # The prefill is the same computation on both backends (quantize_into is bit-exact with the torch
        # path); on CUDA, SDPA may pick another kernel for the differently strided K/V.
        assert torch.equal(got.logits[0], want.logits[0])
    for step, (a, b) in enumerate(zip(want.logits, got.logits)):
        err = ((a - b).norm() / a.norm()).item()
        assert err < 1e-4, (name, step, err)
    assert triton_cache.nbytes() == torch_cache.nbytes() > 0
    assert triton_cache.nbytes_fp16() == torch_cache.nbytes_fp16()


@torch.no_grad()
def test_a_triton_cache_outside_the_packed_attention_reads_its_dequantized_stores(device):
    """Without the fused decode attention the model gets the stores dequantized (one warning): the logits equal
    the fused decode step's within float summation order, not the unquantized ones."""
    model, _ = load_model("tiny-llama", device=device)
    ids = torch.randint(0, 256, (1, 10), device=device)
    logits = {}
    for inside in (False, True):
        cache = QuantizedKVCache(model.config, 2, group_size=16, backend="triton")
        with installed(model, PACKED) if inside else pytest.warns(UnpackedReadWarning):
            model(input_ids=ids[:, :9], past_key_values=cache, use_cache=True)
            logits[inside] = model(input_ids=ids[:, 9:], past_key_values=cache, use_cache=True).logits
    full = model(input_ids=ids, use_cache=False).logits[:, 9:]
    assert ((logits[False] - logits[True]).norm() / logits[True].norm()).item() < 1e-4
    assert (logits[False] - full).abs().max() > 1e-2


@torch.no_grad()
def test_backend_names_and_resolution(monkeypatch):
    model, _ = load_model("tiny-llama")
    with pytest.raises(ValueError, match="quant.backend: unknown 'x'; allowed: auto, torch, triton"):
        QuantizedKVCache(model.config, 4, backend="x")
    cache = QuantizedKVCache(model.config, 4, group_size=16, backend="auto")
    model(input_ids=torch.randint(0, 256, (1, 5)), past_key_values=cache, use_cache=True)
    assert not any(layer.fused for layer in cache.quantized_layers())  # auto on CPU: torch
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_backend("auto", cpu, [4, 16], 32, 32, 16) == "torch"
    assert resolve_backend("auto", cuda, [4, 16], 32, 32, 16) == "triton"
    assert resolve_backend("auto", cuda, [4, 16], 96, 96, 48) == "torch"  # group size the kernels lack
    with pytest.raises(NotImplementedError, match="group_size: 48"):
        resolve_backend("triton", cuda, [4, 16], 96, 96, 48)
    assert resolve_backend("auto", cuda, [8, 16], 32, 32, 16, [2, 4], 8) == "triton"  # keys and values apart
    assert resolve_backend("auto", cuda, [4, 16], 96, 96, 32, [4, 4], 48) == "torch"  # the keys' group
    with pytest.raises(NotImplementedError, match="group_size: 48"):
        resolve_backend("triton", cuda, [4, 16], 96, 96, 32, None, 48)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton needs CUDA tensors"):
        resolve_backend("triton", cpu, [4, 16], 32, 32, 16)


@torch.no_grad()
def test_fused_decode_refuses_a_mask_that_hides_tokens(device, packed):
    """A padded batch hides stored tokens from a decode step; the kernel attends every one, so it refuses
    (checked on the device: raised here on CPU, a device-side assertion on CUDA, which this test leaves alone)."""
    if device == "cuda":
        pytest.skip("a device-side assertion would poison the CUDA context of the rest of the session")
    model, _ = load_model("tiny-llama", device=device)
    packed(model)
    cache = QuantizedKVCache(model.config, 4, group_size=16, backend="triton")
    ids = torch.randint(0, 256, (2, 6), device=device)
    mask = torch.ones(2, 6, dtype=torch.long, device=device)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)  # nothing hidden: fine
    model(input_ids=ids[:, :1], attention_mask=mask[:, :1].repeat(1, 7), past_key_values=cache)
    mask = torch.ones(2, 8, dtype=torch.long, device=device)
    mask[1, 0] = 0  # the second sequence's first token is padding
    with pytest.raises(RuntimeError, match="attends to every stored token"):
        model(input_ids=ids[:, :1], attention_mask=mask, past_key_values=cache, use_cache=True)
