"""harness.schemes.pca_fold: attention over a flat, evenly spaced pca store computed on its codes with the transforms
folded into the query and the output equals attention over the store's dequantized tokens (the float64 oracle),
sink tokens included; the torch path's decode step by the fold (packed_decode) equals it too, piece by piece, under a
mask; the stores it cannot fold are refused in one line."""

from __future__ import annotations

import pytest
import torch

from harness.cache import QuantizedKVCache
from harness.calibrate.pca import fit_pca_calibration, fit_table
from harness.models import load_model
from harness.schemes import SCHEMES, get_scheme, pca_fold
from harness.schemes.bitstream import unpack
from harness.schemes.pca import Pca
from harness.schemes.pca_fold import (
    block_count,
    fold_queries,
    foldable,
    format_reason,
    packed_decode,
    to_codes,
    unfold_output,
)
from harness.schemes.pca_table import PcaCalibration, PcaLayer
from kernels.packed_attention import packed_attention
from kernels.reference import attention_reference
from tests.harness.test_pca import R, correlated, rope, theta

D = 32


def _foldable_names() -> list[str]:
    names = []
    for name in SCHEMES.names():
        scheme = get_scheme(name)
        if isinstance(scheme, Pca):
            fmt = scheme.pca_format
            if fmt.levels == "uniform" and fmt.group == 0:
                names.append(name)
    return names


def _stores(name: str, bits: list[int], T: int, seed: int):
    """Key and value stores of scheme `name` (1 sink token) fed T tokens of B = 2 sequences; the keys' RoPE'd
    inputs and the values."""
    scheme = get_scheme(name, sink_tokens=1)
    fmt = scheme.pca_format
    keys, values = correlated(500, len(bits), seed, mixing=0), correlated(500, len(bits), seed + 1, mixing=1)
    turns = torch.zeros(D)
    turns[: R // 2], turns[R // 2 : R] = theta(), theta()
    layer = PcaLayer(fit_table(keys, fmt=fmt), fit_table(values, fmt=fmt), turns)
    bound = scheme.for_layer(0, PcaCalibration((layer,)))
    g = torch.Generator().manual_seed(seed + 7)
    stores = []
    for role, pool in (("key", keys), ("value", values)):
        x = pool[torch.randint(0, len(pool), (2 * T,), generator=g)].view(2, T, -1, D).transpose(1, 2)
        x = rope(x.double(), torch.arange(T)).float() if role == "key" else x.float()  # (2, H, T, D)
        store = bound.new_store(bits, D, 2, torch.float32, "cpu", role)
        start = 0
        for n in (1, 37, T - 38):  # the sink, a prefill, a chunk
            store.append(x[:, :, start : start + n])
            start += n
        stores.append(store)
    return stores


def _codes(store) -> torch.Tensor:
    """The stored codes (B, Hkv, T, D) float64 of a store whose heads are all quantized."""
    out = torch.empty(store.batch, len(store.bits), store.length, D, dtype=torch.float64)
    for w in store.widths:
        out.index_copy_(1, store.heads[w], unpack(store.codes[w], store.layout[w]).double())
    return out


def _folded_attention(k_sink, v_sink, q, scale):
    """Attention from codes alone: the fold's scores, softmax with the sink, the codes summed, mapped out."""
    k_store, v_store = k_sink.base, v_sink.base
    query, bias = fold_queries(k_store, q)  # (B, Hq, NB, D), (B, Hq, NB)
    G = q.shape[1] // len(k_store.bits)
    codes = _codes(k_store).repeat_interleave(G, 1)  # (B, Hq, T, D)
    block = torch.arange(k_store.length) // max(k_store.fmt.block, 1) if query.shape[2] > 1 else None
    per_token = query.double() if block is None else query.double()[:, :, block]  # (B, Hq, 1 or T, D)
    scores = (per_token * codes).sum(-1) + (bias.double() if block is None else bias.double()[:, :, block])
    sink_k = to_codes(k_store, k_sink.parts[0].dequantize(), "key").double().repeat_interleave(G, 1)
    sink_scores = (query.double()[:, :, :1] * sink_k).sum(-1) + bias.double()[:, :, :1]  # (B, Hq, 1)
    p = torch.softmax(torch.cat([sink_scores, scores], -1) * scale, -1)  # (B, Hq, 1 + T)
    sink_v = to_codes(v_store, v_sink.parts[0].dequantize(), "value").double().repeat_interleave(G, 1)
    v_codes = torch.cat([sink_v, _codes(v_store).repeat_interleave(G, 1)], 2)
    acc = (p[..., None] * v_codes).sum(2)  # (B, Hq, D)
    return unfold_output(v_store, acc.float())


@pytest.mark.parametrize("name", _foldable_names())
@pytest.mark.parametrize("bits, T", [([2, 4], 300), ([3, 8, 4], 129), ([4], 64)])
def test_attention_on_the_codes_is_attention_on_the_dequantized_tokens(name, bits, T):
    seed = len(bits) * 10 + T
    k_sink, v_sink = _stores(name, bits, T, seed)
    assert foldable(k_sink.base) is None and foldable(v_sink.base) is None
    q = (
        torch.randn(2, 2 * len(bits), D, generator=torch.Generator().manual_seed(seed)) * 0.3
    )  # GQA: 2 per KV head
    scale = D**-0.5
    want = attention_reference(q[:, :, None], k_sink.dequantize(), v_sink.dequantize(), scale)[:, :, 0]
    got = _folded_attention(k_sink, v_sink, q, scale)
    assert torch.allclose(got.double(), want, atol=2e-4, rtol=1e-4), (got.double() - want).abs().max()
    if k_sink.base.fmt.key_frame == "block" and T - 1 > k_sink.base.fmt.block:
        assert block_count(k_sink.base) == -(-(T - 1) // k_sink.base.fmt.block) > 1


def test_the_block_queries_differ_where_the_frame_turns():
    k_sink, _ = _stores("pca_block32_uf", [4], 100, 3)
    query, bias = fold_queries(k_sink.base, torch.randn(2, 2, D))
    assert query.shape == (2, 2, 4, D) and bias.shape == (2, 2, 4)  # 99 tokens in blocks of 32
    assert not torch.allclose(query[:, :, 0], query[:, :, 1])


@pytest.mark.parametrize(
    "name, reason",
    [
        ("pca", "levels=uniform, group=0"),
        ("pca_block_ug", "levels=uniform, group=0"),
        ("pca_block_u", "levels=uniform, group=0"),
        ("pca_ugsa", "keys coded before RoPE turn by each token's own position"),
    ],
)
def test_what_cannot_be_folded_is_refused_in_one_line(name, reason):
    k_sink, _ = _stores(name, [4], 40, 1)
    assert reason in foldable(k_sink.base)
    with pytest.raises(ValueError, match=r"^pca fold: .*" + reason):
        fold_queries(k_sink.base, torch.randn(2, 2, D))
    k16, _ = _stores("pca_block_uf", [4, 16], 40, 1)
    assert foldable(k16.base) == "a 16-bit head inside the store"
    assert foldable(k16) == "a SinkStore is not a pca-family store"


@pytest.mark.parametrize(
    "name",
    [
        n
        for n in SCHEMES.names()
        if isinstance(get_scheme(n), Pca) and format_reason(get_scheme(n).pca_format) is None
    ],
)
@pytest.mark.parametrize("bits, T, pieces", [([2, 4], 300, 3), ([3, 8, 4], 131, 2), ([4], 45, 1)])
def test_the_torch_decode_step_by_the_fold_attends_the_dequantized_tokens(monkeypatch, name, bits, T, pieces):
    k_sink, v_sink = _stores(name, bits, T, 3 * T + len(bits))
    block = k_sink.base.fmt.block if k_sink.base.fmt.key_frame == "block" else 16
    # pieces of one frame block (or 16 tokens) each: several pieces, the last one short
    monkeypatch.setattr(pca_fold, "PIECE_ELEMENTS", 2 * len(bits) * D * block)
    assert -(-(T - 1) // block) >= pieces
    gen = torch.Generator().manual_seed(T)
    q = torch.randn(2, 2 * len(bits), D, generator=gen) * 0.3  # GQA: 2 query heads per KV head
    scale = D**-0.5
    want = attention_reference(q[:, :, None], k_sink.dequantize(), v_sink.dequantize(), scale)[:, :, 0]
    got = packed_decode(q, k_sink, v_sink, scale)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=2e-5, rtol=1e-5), (
        (got.double() - want).abs().max()
    )
    hidden = torch.rand(2, 1, 1, T, generator=gen) < 0.3  # the sink and any stored token may be hidden
    hidden[..., -1] = False  # a decode step's own token stays visible
    for mask in (~hidden, torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))):
        want = packed_attention(q[:, :, None], k_sink, v_sink, scale, mask=mask)[:, :, 0]
        got = packed_decode(q, k_sink, v_sink, scale, mask)
        assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), (got - want).abs().max()


def test_the_torch_decode_step_leaves_what_it_cannot_fold_to_the_dequantizing_read():
    k16, v16 = _stores("pca_block_uf", [4, 16], 40, 1)
    assert packed_decode(torch.randn(2, 4, D), k16, v16, D**-0.5) is None
    k, v = _stores("pca_block_u", [4], 40, 1)
    assert packed_decode(torch.randn(2, 2, D), k, v, D**-0.5) is None
    assert get_scheme("pca_block_u").packed_decode() is None and get_scheme("pca_block_uf").packed_decode()


@pytest.mark.parametrize("name", ["pca_block_uf", "pca_block_ugs"])
@torch.no_grad()
def test_a_model_decodes_through_the_fold_what_its_simulated_cache_gives(monkeypatch, packed, name):
    """tiny-llama-d64 (heads of 64 channels: 4 groups of 16) at 5 bits, 1 sink token: greedy generation on the
    packed path, whose decode steps go through packed_decode (counted), gives the tokens of the simulated cache
    (dequantized tokens through SDPA) and the same codes but where float32 noise moved a value across the edge of
    its cell (each such code one level off, a few of them: the decode steps quantize keys computed from attention
    outputs that differ by that noise); its first decode step's logits are within float32 noise of the simulated
    cache's where no code differs, else within what one level of an 8-bit group moves them."""
    import harness.schemes.pca as pca_module

    model, _ = load_model("tiny-llama-d64")
    packed(model)
    fmt = get_scheme(name).pca_format
    fit = fit_pca_calibration(model, torch.randint(0, model.config.vocab_size, (4, 64)), fmt)
    calls = []
    monkeypatch.setattr(pca_module, "packed_decode", lambda *a: calls.append(1) or packed_decode(*a))
    prompts = torch.randint(0, model.config.vocab_size, (3, 21))
    logits, codes = {}, {}
    for simulate in (True, False):
        cache = QuantizedKVCache(
            model.config, 5, scheme=name, sink_tokens=1, key_calibration=fit, simulate=simulate
        )
        out = model.generate(prompts, max_new_tokens=6, do_sample=False, past_key_values=cache,
                             output_logits=True, return_dict_in_generate=True)  # fmt: skip
        logits[simulate] = (out.sequences, torch.stack(out.logits, 1))
        codes[simulate] = torch.cat([unpack(s.parts[1].codes[w], s.parts[1].layout[w]).flatten()
                                     for layer in cache.layers for s in (layer.k_store, layer.v_store)
                                     for w in s.parts[1].widths])  # fmt: skip
    assert (
        len(calls) == 5 * model.config.num_hidden_layers
    )  # every decode step of every layer, none of the prefill
    assert torch.equal(logits[True][0], logits[False][0])
    moved = codes[True] != codes[False]
    assert (codes[True] - codes[False]).abs().max() <= 1 and moved.sum() <= 1e-3 * moved.numel(), moved.sum()
    first_step = logits[True][1][:, 1], logits[False][1][:, 1]
    tolerance = 1e-4 if not moved.any() else 5e-3
    assert torch.allclose(*first_step, atol=tolerance, rtol=tolerance), (
        (first_step[0] - first_step[1]).abs().max()
    )
