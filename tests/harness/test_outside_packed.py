"""A QuantizedKVCache read outside the packed attention never hands the model unquantized K/V.

Outside `harness.attention.installed(model, PACKED)` an update either returns the stored tokens dequantized (the
default: the logits equal the packed attention's within float summation order, and one warning says memory is not
saved) or raises at the first update (outside_packed="raise"). The reference for "quantized" is the packed
attention itself, and for "not unquantized" a DynamicCache.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.cache.quantized import UnpackedReadWarning
from harness.models import load_model

TINY = ["tiny-llama", "tiny-gemma3", "tiny-qwen3_5"]  # full attention; sliding + full; linear + full


def chunked_logits(model, ids, cache, chunk):
    """Logits of ids (B, T) fed in chunks of `chunk` through `cache`: (B, T, V)."""
    return torch.cat(
        [
            model(input_ids=ids[:, s : s + chunk], past_key_values=cache, use_cache=True).logits
            for s in range(0, ids.shape[1], chunk)
        ],
        1,
    )


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("name", TINY)
@torch.no_grad()
def test_a_two_bit_cache_outside_the_block_reads_its_quantized_values(name):
    model, _ = load_model(name)
    torch.manual_seed(len(name))
    ids = torch.randint(0, 256, (2, 29))  # past tiny-gemma3's window of 16
    unquantized = chunked_logits(model, ids, DynamicCache(config=model.config), chunk=29)

    def cache():
        return QuantizedKVCache(model.config, 2, group_size=16, prefill="quantized")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        whole = chunked_logits(model, ids, cache(), chunk=29)  # one forward: the prompt attends itself
        outside = chunked_logits(model, ids, cache(), chunk=6)
    assert (whole - unquantized).abs().max() > 1e-2, name  # today's code: 0.0 (the unquantized logits)
    assert (outside - unquantized).abs().max() > 1e-2, name
    with installed(model, PACKED):
        inside_whole = chunked_logits(model, ids, cache(), chunk=29)
        inside = chunked_logits(model, ids, cache(), chunk=6)
    assert relative_error(whole, inside_whole) < 1e-4, name
    assert relative_error(outside, inside) < 1e-4, name
    unpacked = [w for w in caught if issubclass(w.category, UnpackedReadWarning)]
    assert len(unpacked) == 2, [str(w.message) for w in caught]  # one per cache, not per layer or step
    assert "memory is not saved" in str(unpacked[0].message)


@torch.no_grad()
def test_raise_stops_at_the_first_update_before_storing_anything():
    model, _ = load_model("tiny-llama")
    cache = QuantizedKVCache(model.config, 4, group_size=16, outside_packed="raise")
    ids = torch.randint(0, 256, (1, 9))
    with pytest.raises(RuntimeError, match=r"installed\(model, PACKED\)") as err:
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert "\n" not in str(err.value)
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0
    with installed(model, PACKED):  # the same cache is fine inside the block
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 9


@torch.no_grad()
def test_simulate_reads_its_working_copy_anywhere_without_a_warning():
    model, _ = load_model("tiny-llama")
    ids = torch.randint(0, 256, (1, 13))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no UnpackedReadWarning
        outside = chunked_logits(model, ids, QuantizedKVCache(model.config, 2, simulate=True), chunk=5)
    with installed(model, PACKED):
        inside = chunked_logits(model, ids, QuantizedKVCache(model.config, 2, simulate=True), chunk=5)
    assert torch.equal(outside, inside)


def test_an_unknown_outside_mode_names_the_argument():
    model, _ = load_model("tiny-llama")
    with pytest.raises(ValueError, match="outside_packed: unknown 'ignore'; allowed: dequantize, raise"):
        QuantizedKVCache(model.config, 4, outside_packed="ignore")


@torch.no_grad()
def test_a_step_posted_but_not_attended_makes_the_next_update_raise():
    """PACKED installed on another model: the cache posts steps that this model's SDPA never reads."""
    model, _ = load_model("tiny-llama")
    other, _ = load_model("tiny-llama")
    cache = QuantizedKVCache(model.config, 4, group_size=16, prefill="quantized")
    ids = torch.randint(0, 256, (1, 9))
    with installed(other, PACKED):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="did not read the packed cache"):
            model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("name", TINY)
@torch.no_grad()
def test_generate_through_the_packed_attention_equals_the_dequantized_reference(name):
    """model.generate(..., past_key_values=cache) as a user writes it: inside the block the packed attention reads
    the stores; outside it the model's own attention reads them dequantized. Same greedy tokens, mixed widths."""
    model, _ = load_model(name)
    torch.manual_seed(3 * len(name))
    grid = QuantizedKVCache(model.config, 4).key_bits.shape  # (layers, most KV heads of a layer)
    bits = torch.tensor([2, 3, 4, 8, 16])[torch.randint(0, 5, grid)]
    prompt = torch.randint(1, 256, (2, 19))  # no token 0 (eos); past tiny-gemma3's window with the new tokens
    kw = dict(max_new_tokens=9, do_sample=False, pad_token_id=0)

    def cache():
        return QuantizedKVCache(model.config, bits, group_size=16)

    with installed(model, PACKED):
        packed = model.generate(prompt, past_key_values=cache(), **kw)
    with pytest.warns(UnpackedReadWarning):
        reference = model.generate(prompt, past_key_values=cache(), **kw)
    assert packed.shape == (2, 19 + 9)
    assert torch.equal(packed, reference), name
