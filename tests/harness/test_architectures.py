"""Every architecture of the claim, as a tiny random model, through calibrate -> allocate -> cache -> metrics.

gpt2 (no GQA), qwen2 (GQA), qwen3_5 (linear + full attention: only full layers are cached), gemma3 (sliding +
full), gemma4 (sliding + global, the global layers with a wider head) and gemma4-kv (global layers with fewer
KV heads than sliding ones, and KV-shared layers without a cache of their own). test_cache.py and
test_calibrate.py check each piece in depth; here each model runs the whole chain with an entropy + sinks
allocation, greedy generate() through QuantizedKVCache, the bytes it holds counted by hand, and the generation
metrics.
"""

import pytest
import torch
from transformers import DynamicCache

from harness import metrics
from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache, QuantizedLayer, kv_heads
from harness.calibrate import head_entropies, layer_types
from harness.models import load_model
from harness.policies import Entropy

ARCHS = ["tiny-gpt2", "tiny-qwen2", "tiny-qwen3_5", "tiny-gemma3", "tiny-gemma4", "tiny-gemma4-kv"]
PROMPT, NEW, GROUP = 18, 8, 16  # prompt + new tokens run past the sliding window of 16
GENERATE = dict(
    max_new_tokens=NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True
)


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    model, tokenizer = load_model(request.param)
    with installed(model, PACKED):  # quantized caches are attended from their packed form
        yield request.param, model, tokenizer


def head_dims(model) -> dict[int, int]:
    """Layer -> K/V head size, from the attention modules (Gemma 4's global layers have their own)."""
    return {
        m.layer_idx: m.head_dim for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "head_dim")
    }


def store_bytes(bits: list[int], dim: int, tokens: int, batch: int) -> int:
    """Hand count of one K or V store: packed codes + fp16 scale and zero per group (asym), fp16 16-bit heads."""
    per_head = [dim * 2 if b == 16 else dim * b // 8 + (dim // GROUP) * 2 * 2 for b in bits]
    return batch * tokens * sum(per_head)


@torch.no_grad()
def test_calibrate_allocate_generate_and_measure(arch):
    name, model, tokenizer = arch
    kinds = layer_types(model.config)
    cached = [i for i, k in enumerate(kinds) if k != "linear"]
    n_q, n_kv = model.config.get_text_config(decoder=True).num_attention_heads, kv_heads(model.config)
    if name == "tiny-gemma4-kv":  # the config does what it says: fewer global KV heads, two KV-shared layers
        assert n_kv == [2, 2, 1, 2, 1] and kinds == ["sliding", "sliding", "full", "linear", "linear"]
    torch.manual_seed(len(name))

    table = head_entropies(model, torch.randint(0, 256, (2, 40)), i0=8)
    assert sorted(table.layer.unique()) == cached, name  # rows only for layers with a KV cache of their own
    assert (table.groupby("layer").size() == n_q).all()
    assert table.layer_type.tolist() == [kinds[i] for i in table.layer]
    assert (table.kv_head == table.q_head // (n_q // table.layer.map(n_kv.__getitem__))).all()

    # One sink head; budget_mode=claim puts the 3-bit budget on the others, so even 2 cached heads can pay for it.
    n = sum(n_kv[i] for i in cached)
    policy = Entropy(
        alpha=2.0, sink_fraction=1 / n, widths=(2, 3, 4, 8), budget_mode="claim", budget_unit="bits"
    )
    alloc = policy.allocate(table, 3)
    assert alloc.bits.shape == (len(kinds), max(n_kv))
    # a layer's own KV heads are cached, the padding of a layer with fewer is not, nor layers without a cache
    assert alloc.cached.sum(1).tolist() == [n_kv[i] if k != "linear" else 0 for i, k in enumerate(kinds)]
    assert all(alloc.cached[i, : n_kv[i]].all() for i in cached)
    assert int(alloc.sinks.sum()) == 1 and (alloc.bits[alloc.sinks] == 16).all()
    lowest = table.groupby(["layer", "kv_head"]).H2.mean().idxmin()  # the sink is the lowest-entropy KV head
    assert alloc.sinks[lowest].item()
    assert alloc.bits[alloc.cached & ~alloc.sinks].double().mean() <= 3

    prompt = torch.randint(1, 256, (2, PROMPT))  # no token 0 (eos)
    base = model.generate(prompt, past_key_values=DynamicCache(config=model.config), **GENERATE)
    cache = QuantizedKVCache(model.config, alloc.bits, group_size=GROUP)
    quant = model.generate(prompt, past_key_values=cache, **GENERATE)
    assert all(torch.isfinite(step).all() for step in quant.logits)

    # The cache holds PROMPT + NEW - 1 tokens (the last one is never fed back); sliding layers their window - 1,
    # once the eviction that the last update left pending (its attention still read the whole window) is applied.
    fed = PROMPT + NEW - 1
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.evict()
    want = want_fp16 = 0
    for layer, kind in enumerate(kinds):
        if kind == "linear":
            continue
        held = (
            min(fed, model.config.get_text_config(decoder=True).sliding_window - 1)
            if kind == "sliding"
            else fed
        )
        assert cache.layers[layer].k_store.length == held, (name, layer)
        dim = head_dims(model)[layer]
        want += 2 * store_bytes(alloc.bits[layer, : n_kv[layer]].tolist(), dim, held, batch=2)
        want_fp16 += 2 * 2 * held * n_kv[layer] * dim * 2
    assert cache.nbytes() == want and cache.nbytes_fp16() == want_fp16, name
    assert [isinstance(layer, QuantizedLayer) for layer in cache.layers] == [k != "linear" for k in kinds]

    base_tokens, quant_tokens = base.sequences[:, PROMPT:], quant.sequences[:, PROMPT:]
    got = metrics.generation_metrics(base_tokens, quant_tokens, tokenizer.decode)
    assert got["token_match"] == pytest.approx((base_tokens == quant_tokens).double().mean().item())
    assert (
        0 <= min(got["bleu"], got["bleu_tok"]) and max(got["bleu"], got["bleu_tok"]) <= 1 + 1e-12
    )  # rounding
    # (random bytes decode to fewer than 4 words per row: corpus BLEU has no 4-grams, so only the id metrics)
    same = metrics.generation_metrics(base_tokens, base_tokens, tokenizer.decode)
    assert (same["bleu_tok"], same["token_match"], same["first_divergence"]) == (1.0, 1.0, NEW)


@torch.no_grad()
def test_sixteen_bits_is_dynamic_cache_and_two_bits_moves(arch):
    name, model, _ = arch
    torch.manual_seed(7)
    prompt = torch.randint(1, 256, (2, PROMPT))  # no token 0 (eos)
    base = model.generate(prompt, past_key_values=DynamicCache(config=model.config), **GENERATE)
    # the simulated path attends exactly what DynamicCache holds; the packed path agrees within float summation
    # order (tests/harness/test_packed_cache.py)
    full = model.generate(
        prompt, past_key_values=QuantizedKVCache(model.config, 16, simulate=True), **GENERATE
    )
    assert torch.equal(full.sequences, base.sequences), name
    assert all(torch.equal(a, b) for a, b in zip(full.logits, base.logits)), name
    low = model.generate(
        prompt, past_key_values=QuantizedKVCache(model.config, 2, group_size=GROUP), **GENERATE
    )
    assert all(torch.isfinite(step).all() for step in low.logits), name
    # the first new token's logits come from the exact prefill; every later step reads the 2-bit cache
    moved = max((a - b).abs().max().item() for a, b in zip(low.logits[1:], base.logits[1:]))
    assert moved > 1e-3, name
