"""Token eviction (harness/cache/eviction.py): freed bytes, kept positions, H2O scores, and decode steps against an
oracle that attends only the kept tokens."""

import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import DynamicCache

from harness import evaluate
from harness.__main__ import entry
from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.cache.eviction import (
    EvictingLayer,
    EvictionSpec,
    attention_for,
    h2o_index,
    kept_fraction,
    with_eviction,
)
from harness.models import load_model
from harness.run import runner
from harness.validate import ConfigError, preflight_overrides, validate_config
from kernels.layout import PackedStore, round_up

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")


@pytest.fixture(scope="module")
def llama():
    model, _ = load_model("tiny-llama")
    with installed(model, PACKED):  # quantized caches are attended from their packed form
        yield model


def forward(model, ids, start, cache):
    """Logits (B, L, V) of ids (B, L) at positions start.., through cache."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    return model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits


def evicting_layers(cache) -> list[EvictingLayer]:
    return [layer for layer in cache.layers if isinstance(layer, EvictingLayer)]


# --- PackedStore.select --------------------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [False, True])
def test_select_equals_dequantize_then_index_and_frees_bytes(symmetric):
    torch.manual_seed(3)
    B, T, D, n_keep = 3, 37, 64, 11
    store = PackedStore([4, 16, 2, 3, 8], D, B, group_size=32, symmetric=symmetric)
    store.append(torch.randn(B, 5, T, D))
    before, bytes_before = store.dequantize(), store.nbytes()  # (B, H, T, D)
    index = torch.stack(
        [torch.randperm(T)[:n_keep].sort().values for _ in range(B)]
    )  # (B, n_keep), rows differ
    store.select(index)
    want = torch.stack([before[b][:, index[b]] for b in range(B)])  # (B, H, n_keep, D)
    assert torch.equal(store.dequantize(), want)
    assert torch.equal(store._dequantized[:, :, : store.length], want)  # the torch path's working copy
    assert store.length == n_keep and store.capacity == round_up(n_keep)  # freed to within one block
    assert store.nbytes() * T == bytes_before * n_keep
    new = torch.randn(B, 5, 2, D)
    returned = store.append(new)  # appending after eviction still works, the returned copy included
    assert torch.equal(returned[:, :, :n_keep], want)
    assert torch.equal(store.dequantize(), returned)
    with pytest.raises(IndexError):
        store.select(torch.full((B, 1), n_keep + 2))


# --- policies on one layer -----------------------------------------------------------------------------------


def test_streaming_keeps_exactly_sinks_and_recent(llama):
    torch.manual_seed(4)
    spec = EvictionSpec("streaming", keep=0.25, sink_tokens=2)
    cache = with_eviction(QuantizedKVCache(llama.config, 16, simulate=True), spec)  # update returns the K/V
    layer = cache.layers[0]
    k, v = torch.randn(2, 3, 20, 32), torch.randn(2, 3, 20, 32)
    cache.update(k[:, :, :12], v[:, :, :12], 0)
    assert layer.get_mask_sizes(8) == (3 + 8, 12 - 3)  # ceil(0.25 * 12) = 3 kept, shown at columns 9..11
    keys, _ = cache.update(k[:, :, 12:], v[:, :, 12:], 0)  # evicts to [0, 1, 11], then appends 12..19
    assert layer.positions.tolist() == [[0, 1, 11, *range(12, 20)]] * 2
    assert torch.equal(keys, k[:, :, [0, 1, 11, *range(12, 20)]])  # 16 bits: the stored values themselves
    assert cache.nbytes() == layer.nbytes()  # only layer 0 holds tokens; nbytes applies the pending eviction
    assert layer.positions.tolist() == [[0, 1, 17, 18, 19]] * 2  # ceil(0.25 * 20) = 5
    assert layer.nbytes_fp16() == 4 * layer.nbytes()  # fp16 bytes of all 20 seen over 5 held, at 16 bits
    assert layer.get_seq_length() == 20


def test_budget_never_below_sinks_plus_one():
    spec = EvictionSpec("h2o", keep=0.1, sink_tokens=4)
    assert [spec.budget(s) for s in (0, 3, 5, 50, 51, 300)] == [0, 3, 5, 5, 6, 30]
    assert EvictionSpec("streaming", keep=0.33).budget(300) == 99


def test_h2o_index_keeps_sinks_recent_and_top_scores():
    scores = torch.tensor(
        [
            [9.0, 0.1, 5.0, 0.2, 3.0, 4.0, 0.3, 0.0, 7.0, 1.0],
            [0.0, 6.0, 0.1, 0.2, 0.3, 8.0, 2.0, 9.0, 0.0, 0.0],
        ]
    )
    # sink 0; recent 8, 9; the 3 largest of positions 1..7: row 0 -> 2, 4, 5; row 1 -> 1, 5, 7.
    got = h2o_index(scores, n_keep=6, sinks=1, n_recent=2)
    assert got.tolist() == [[0, 2, 4, 5, 8, 9], [0, 1, 5, 7, 8, 9]]


@torch.no_grad()
def test_h2o_scores_equal_eager_attention_column_sums(llama):
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (2, 19))
    spec = EvictionSpec("h2o", keep=1.0, sink_tokens=1)  # scores every step, evicts nothing
    cache = with_eviction(QuantizedKVCache(llama.config, 16, prefill="exact"), spec)
    before = llama.config._attn_implementation
    with attention_for(llama, spec):
        forward(llama, ids[:, :11], 0, cache)
        forward(llama, ids[:, 11:], 11, cache)  # scores accumulate over both chunks
    assert llama.config._attn_implementation == before  # restored
    llama.set_attn_implementation("eager")
    try:
        attentions = llama(input_ids=ids, output_attentions=True).attentions  # per layer (B, Hq, T, T)
    finally:
        llama.set_attn_implementation(before)
    for layer, probs in zip(cache.layers, attentions):
        want = probs.sum(dim=(1, 2))  # (B, T): summed over query heads and query positions
        torch.testing.assert_close(layer.scores, want, rtol=1e-5, atol=1e-5)


def test_h2o_refuses_a_prefilled_cache_and_unscored_steps(llama):
    ids = torch.randint(0, 256, (1, 9))
    prefilled = DynamicCache(config=llama.config)
    with torch.no_grad():
        forward(llama, ids, 0, prefilled)
    cache = QuantizedKVCache.from_prefilled(prefilled, llama.config, 4)
    with pytest.raises(ValueError, match="h2o"):
        with_eviction(cache, EvictionSpec("h2o", keep=0.5))
    cache = with_eviction(QuantizedKVCache(llama.config, 4), EvictionSpec("h2o", keep=0.5))
    with torch.no_grad(), pytest.raises(RuntimeError, match="attention_for"):
        forward(llama, ids, 0, cache)  # plain SDPA: no scores reported
        forward(llama, ids[:, :1], 9, cache)


# --- through the model ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_keep_one_generates_exactly_like_no_eviction(llama, name):
    torch.manual_seed(6)
    prompts = torch.randint(0, 256, (3, 17))
    spec = EvictionSpec(name, keep=1.0, sink_tokens=2)

    def plain():  # h2o layers keep the working copy (simulate): compare like with like
        return QuantizedKVCache(llama.config, 4, prefill="quantized", simulate=name == "h2o")

    want = evaluate.greedy_generate(llama, prompts, 9, plain)
    caches = []

    def evicting():
        caches.append(with_eviction(plain(), spec))
        return caches[-1]

    with attention_for(llama, spec):
        got = evaluate.greedy_generate(llama, prompts, 9, evicting)
    assert torch.equal(got, want)
    assert kept_fraction(caches) == 1.0 and evicting_layers(caches[0])


@pytest.mark.parametrize("name", ["streaming", "h2o"])
@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gemma3"])  # gemma3: sliding layers left alone
@torch.no_grad()
def test_decode_after_eviction_equals_attention_over_kept_tokens(model_name, name, packed):
    """16 bits, exact prefill: every later step's logits (one token or a chunk: the mask must stay causal among
    the new tokens) equal those of a DynamicCache whose full-attention layers hold only the kept tokens."""
    model, _ = load_model(model_name)
    packed(model)  # quantized caches are attended from their packed form
    torch.manual_seed(7)
    B, P, chunks = 2, 23, (1, 3, 1, 2)
    ids = torch.randint(0, 256, (B, P + sum(chunks)))
    spec = EvictionSpec(name, keep=0.4, sink_tokens=2, recent=0.5)
    cache = with_eviction(QuantizedKVCache(model.config, 16, prefill="exact"), spec)
    oracle = DynamicCache(config=model.config)
    # Per layer, the positions the oracle holds (B, n), per batch row.
    oracle_positions = [torch.arange(P).expand(B, P).contiguous()] * len(oracle.layers)
    with attention_for(model, spec):
        forward(model, ids[:, :P], 0, cache)
        forward(model, ids[:, :P], 0, oracle)
        t = P
        for n in chunks:
            got = forward(model, ids[:, t : t + n], t, cache)  # (B, n, V)
            for i, (layer, ref) in enumerate(zip(cache.layers, oracle.layers)):
                if not isinstance(layer, EvictingLayer):
                    continue
                kept = layer.positions[:, :-n].contiguous()  # (B, n_kept) before this step's tokens
                assert kept.shape[1] == spec.budget(t)
                at = torch.searchsorted(oracle_positions[i], kept)  # where the oracle holds those positions
                gather = at[:, None, :, None].expand(-1, ref.keys.shape[1], -1, ref.keys.shape[-1])
                ref.keys, ref.values = ref.keys.gather(2, gather), ref.values.gather(2, gather)
                oracle_positions[i] = torch.cat([kept, torch.arange(t, t + n).expand(B, n)], dim=1)
            want = forward(model, ids[:, t : t + n], t, oracle)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            t += n
    if (model_name, name) == (
        "tiny-llama",
        "h2o",
    ):  # per layer and batch row its own set: they must not coincide
        sets = {tuple(row) for layer in evicting_layers(cache) for row in layer.positions.tolist()}
        assert len(sets) > 1


@torch.no_grad()
def test_streaming_on_the_triton_backend_matches_torch(device, packed):
    """Eviction selects the packed stores the fused decode kernel reads; h2o layers fall back to torch."""
    model, _ = load_model("tiny-llama", device=device)
    packed(model)  # quantized caches are attended from their packed form
    torch.manual_seed(8)
    ids = torch.randint(0, 256, (2, 18), device=device)
    spec = EvictionSpec("streaming", keep=0.5, sink_tokens=2)
    logits = {}
    for backend in ("torch", "triton"):
        if backend == "triton":
            packed(model)
        cache = with_eviction(QuantizedKVCache(model.config, 4, group_size=16, backend=backend), spec)
        steps = [forward(model, ids[:, :14], 0, cache)]
        steps += [forward(model, ids[:, t : t + 1], t, cache) for t in range(14, 18)]
        logits[backend] = torch.cat(steps, dim=1)
        assert all(layer.fused == (backend == "triton") for layer in evicting_layers(cache))
        assert [layer.positions.tolist() for layer in evicting_layers(cache)] == [
            [[0, 1, *range(10, 18)]] * 2
        ] * 3
    model.set_attn_implementation("sdpa")
    err = (logits["triton"] - logits["torch"]).norm() / logits["torch"].norm()
    assert err < 1e-4, err
    h2o = with_eviction(
        QuantizedKVCache(model.config, 4, group_size=16, backend="triton"), EvictionSpec("h2o")
    )
    with attention_for(model, EvictionSpec("h2o")):
        forward(model, ids[:, :5], 0, h2o)
    assert not any(layer.fused for layer in evicting_layers(h2o))


@pytest.mark.parametrize("keep", [0.25, 0.5])
@torch.no_grad()
def test_true_compression_is_one_over_keep_at_sixteen_bits(llama, keep):
    ids = torch.randint(0, 256, (2, 40))
    spec = EvictionSpec("streaming", keep=keep, sink_tokens=4)
    cache = with_eviction(QuantizedKVCache(llama.config, 16), spec)
    for s in range(0, 40, 8):
        forward(llama, ids[:, s : s + 8], s, cache)
    assert cache.nbytes_fp16() / cache.nbytes() == pytest.approx(1 / keep)
    assert kept_fraction([cache]) == pytest.approx(keep)


# --- configuration and the runner ----------------------------------------------------------------------------


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    "override, message",
    [
        ("eviction.keep=0", r"^eviction.keep: 0 must be a number in \(0, 1\]$"),
        ("eviction.keep=1.5", r"^eviction.keep: 1.5 must be"),
        ("eviction.sink_tokens=-1", r"^eviction.sink_tokens: -1 is not a non-negative integer$"),
        ("eviction.recent=2", r"^eviction.recent: 2 must be a number in \[0, 1\]$"),
        ("eviction.name=h2", r"^eviction.name: unknown 'h2' \(did you mean h2o\?\); allowed: "),
    ],
)
def test_invalid_eviction_config_gives_one_line(override, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_cfg("eviction=h2o", override))


def test_eviction_group_and_point_fields():
    with pytest.raises(ConfigError, match=r"^eviction: unknown 'lru'"):
        preflight_overrides(["eviction=lru"], CONF)
    (plain,) = {p.eviction for p in validate_config(compose_cfg())}
    assert plain == "none"
    points = validate_config(compose_cfg("eviction=streaming", "eviction.keep=0.5"))
    assert {(p.eviction, p.evict_keep, p.evict_sinks, p.evict_recent) for p in points} == {
        ("streaming", 0.5, 4, 1.0)
    }


def test_cli_streaming_run_reports_bytes_after_eviction(tmp_path, in_process):
    """python -m harness, run in this process."""
    proc = in_process(
        entry,
        "harness",
        "model=tiny-llama",
        "eval=tiny",
        "eviction=streaming",
        "policy=uniform",
        "policy.budget=4",
        "tracking.wandb.mode=disabled",
        f"run_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = pd.read_parquet(tmp_path / "results.parquet").set_index("policy")
    assert set(rows.index) == {"baseline", "uniform"}
    assert (rows.loc["baseline", ["eviction", "tokens_kept_fraction"]] == ["none", 1.0]).all()
    uniform = rows.loc["uniform"]
    assert uniform["eviction"] == "streaming" and uniform["evict_keep"] == 0.33
    # eval=tiny: 40-token prompts, 8 new tokens, 7 of them fed: 47 seen, ceil(0.33 * 47) = 16 kept per layer.
    seen, kept = 47, math.ceil(0.33 * 47)
    assert uniform["tokens_kept_fraction"] == pytest.approx(kept / seen)
    # 4-bit asym_token, head_dim 32, one group: 16 payload bytes + fp16 scale and zero per token and head vs 64.
    assert uniform["compression_true"] == pytest.approx(64 / 20 * seen / kept)
    assert uniform["compression_nominal"] == pytest.approx(4.0)


def test_runner_h2o_prefills_through_its_cache_and_reports_kept_bytes(tmp_path):
    overrides = (
        "eviction=h2o",
        "eviction.keep=0.5",
        "policy=uniform",
        "policy.budget=8",
        "policy.widths=[8]",
    )
    (point,) = validate_config(compose_cfg("model=tiny-llama", "eval=tiny", *overrides))
    rows = runner.run([point], tmp_path, batch_size=4).set_index("policy")
    h2o = rows.loc["uniform"]
    assert h2o["eviction"] == "h2o" and h2o["status"] == "ok"
    seen, kept = 47, math.ceil(0.5 * 47)  # as in the CLI test
    assert h2o["tokens_kept_fraction"] == pytest.approx(kept / seen)
    # 8-bit asym_token, head_dim 32: 32 payload bytes + fp16 scale and zero per token and head vs 64.
    assert h2o["compression_true"] == pytest.approx(64 / 36 * seen / kept)
    assert 0 < h2o["top1_agree"] <= 1 and math.isfinite(h2o["kl_mean"])
