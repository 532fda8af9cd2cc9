"""Rows and rollbacks of a QuantizedKVCache, for every registered scheme's stores (fitted parts fitted on the tiny
model): what generate()'s decoding modes ask of a cache besides appending (tests/harness/test_cache_modes.py runs
the modes themselves).

- Rows (reorder_cache for beam search, batch_repeat_interleave, batch_select_indices): a cache whose rows were
  taken holds what a cache fed those rows of the same tokens holds (every stored token and byte), and the next
  forward through each gives the same logits.
- Rollback (crop): a cache that stored a forward and dropped its last tokens holds what a cache that never saw them
  holds, sink tokens and positions included, and decodes on alike; where the scheme keeps recent tokens unquantized
  (kivi, a residual window) or the layer evicts tokens, crop is a one-line NotImplementedError and the cache says
  is_croppable False.
"""

from __future__ import annotations

import pytest
import torch

from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.cache.eviction import EvictingLayer, EvictionSpec, attention_for, with_eviction
from harness.calibrate import cached_fit
from harness.models import load_model
from harness.schemes import SCHEMES, get_scheme

GROUP = 16


def case(name: str, simulate: bool = False, **options) -> tuple[str, dict, bool]:
    """(scheme name, its options, simulate); kivi's residual window shortened so that the tokens here reach its
    quantized part; schemes that read the layer below only simulated (harness/schemes/xlayer.py)."""
    if get_scheme(name).per_channel("key"):
        options.setdefault("residual", 4)
    simulate = simulate or get_scheme(name).reads_previous_layer
    return name, dict(group_size=GROUP, **options), simulate


CASES = [case(name) for name in SCHEMES] + [
    case("asym_token", sink_tokens=3),  # a SinkStore around the packed store
    case("codebook", sink_tokens=2, residual=3),  # both wrappers
    case("asym_token", simulate=True),  # the working copies taken along
    case("kivi", simulate=True),
    case("codebook", simulate=True, sink_tokens=3),
]
IDS = [
    " ".join(
        [name, *(f"{k}={v}" for k, v in options.items() if k != "group_size"), *(["simulated"] * simulate)]
    )
    for name, options, simulate in CASES
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """tiny-llama attending from the packed form, and a function from a scheme to its fitted parts (fitted once
    per kind on random tokens, in a disk cache of the module's own)."""
    model, _ = load_model("tiny-llama")
    ids = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(0))
    with pytest.MonkeyPatch.context() as mp, installed(model, PACKED):
        mp.setenv("KVBITS_CACHE", str(tmp_path_factory.mktemp("fits")))
        yield model, lambda scheme: cached_fit(scheme, model, "tiny-llama", ids, span=64)


def new_cache(llama, name: str, options: dict, simulate: bool) -> QuantizedKVCache:
    """A cache of `name` with mixed widths (16 among them) on tiny-llama's 3 layers of 3 KV heads."""
    model, fit = llama
    scheme = get_scheme(name, **options)
    widths = [*scheme.widths, 16]
    bits = torch.tensor([[widths[(i + j) % len(widths)] for j in range(3)] for i in range(3)])
    return QuantizedKVCache(model.config, bits, scheme, simulate=simulate, key_calibration=fit(scheme))


def feed(model, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits (B, T, V) of ids (B, T) at positions start.. through cache."""
    positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
    return model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True).logits


class Tokens:
    """Fixed random keys, values and queries of tiny-llama's shapes for up to 3 batch rows and 32 tokens, given to
    a cache the way a model's layers would (`store`): the same rows and tokens are the same numbers in every cache,
    so what two caches store of them can be compared exactly."""

    def __init__(self, config, seed: int):
        gen = torch.Generator().manual_seed(seed)
        layers, heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        self.k, self.v = torch.randn(2, layers, 3, heads, 32, dim, generator=gen)  # (layers, B, Hkv, T, D)
        self.q = torch.randn(layers, 3, config.num_attention_heads, 32, dim, generator=gen)  # (.., Hq, T, D)

    def store(self, model, cache, rows: list[int], start: int, end: int) -> list[torch.Tensor]:
        """Every layer of cache updated with tokens [start, end) of `rows`, each update read as the model's
        attention reads it: the attention output of the tokens' queries through the posted packed step (B, T, Hq,
        D), or (simulate) the K/V handed back."""
        out = []
        with installed(model, PACKED) as steps:
            for i in range(len(self.k)):
                k, v = self.k[i, rows, :, start:end], self.v[i, rows, :, start:end]
                keys, values = cache.update(k, v, i)
                step = steps.step(i, keys)
                if step is None:
                    out += [keys, values]
                else:
                    out.append(step.attend(self.q[i, rows, :, start:end], None, k.shape[-1] ** -0.5))
        return out


def assert_same(got: QuantizedKVCache, want: QuantizedKVCache) -> None:
    """Every quantized layer holds the same tokens (dequantized from the stored form, within float error: xlayer's
    predictions are products over the batch and chunk), bytes and lengths."""
    assert got.get_seq_length() == want.get_seq_length()
    assert got.nbytes() == want.nbytes()  # sliding layers drop what left their window first
    for a, b in zip(got.quantized_layers(), want.quantized_layers()):
        for store_a, store_b in ((a.k_store, b.k_store), (a.v_store, b.v_store)):
            assert store_a.batch == store_b.batch and store_a.length == store_b.length
            torch.testing.assert_close(store_a.dequantize(), store_b.dequantize(), rtol=1e-4, atol=1e-4)
            assert store_a.nbytes() == store_b.nbytes(), a.layer_idx


ROWS = {  # operation -> (its argument, the rows of a batch of 3 it leaves)
    "reorder_cache": (torch.tensor([2, 0, 0]), [2, 0, 0]),
    "batch_repeat_interleave": (2, [0, 0, 1, 1, 2, 2]),
    "batch_select_indices": (torch.tensor([False, True, True]), [1, 2]),
}


@pytest.mark.parametrize("operation", ROWS)
@pytest.mark.parametrize("name, options, simulate", CASES, ids=IDS)
@torch.no_grad()
def test_taking_rows_equals_storing_those_rows(llama, name, options, simulate, operation):
    model = llama[0]
    tokens = Tokens(model.config, seed=1)
    argument, rows = ROWS[operation]
    got, want = new_cache(llama, name, options, simulate), new_cache(llama, name, options, simulate)
    for start, end in ((0, 20), (20, 21)):  # a prompt, a decode step
        tokens.store(model, got, [0, 1, 2], start, end)
        tokens.store(model, want, rows, start, end)
    getattr(got, operation)(argument)
    assert_same(got, want)
    for a, b in zip(tokens.store(model, got, rows, 21, 24), tokens.store(model, want, rows, 21, 24)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert_same(got, want)


CROPS = [(20, 6, 4), (20, 6, 6), (1, 4, 3)]  # (tokens stored first, then a forward of, of which dropped)


@pytest.mark.parametrize("stored, forward, dropped", CROPS, ids=[f"{s}+{f}-{d}" for s, f, d in CROPS])
@pytest.mark.parametrize("name, options, simulate", CASES, ids=IDS)
@torch.no_grad()
def test_a_crop_leaves_what_a_cache_that_never_saw_the_tokens_holds(
    llama, name, options, simulate, stored, forward, dropped
):
    """(1, 4, 3) drops into the first tokens: sink tokens, and the positions a rotary store counts from."""
    model = llama[0]
    tokens = Tokens(model.config, seed=2)
    got, want = new_cache(llama, name, options, simulate), new_cache(llama, name, options, simulate)
    tokens.store(model, got, [0, 1], 0, stored)
    tokens.store(model, got, [0, 1], stored, stored + forward)
    kept = stored + forward - dropped
    if not got.is_croppable:
        with pytest.raises(NotImplementedError, match=r"^QuantizedKVCache: .*cannot do exactly: [^\n]*$"):
            got.crop(-dropped)
        assert get_scheme(name, **options).no_rollback is not None
        return
    got.crop(-dropped)
    tokens.store(model, want, [0, 1], 0, stored)
    if kept > stored:
        tokens.store(model, want, [0, 1], stored, kept)
    assert_same(got, want)
    for a, b in zip(
        tokens.store(model, got, [0, 1], kept, kept + 3), tokens.store(model, want, [0, 1], kept, kept + 3)
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert_same(got, want)


@torch.no_grad()
def test_a_crop_counts_in_negative_tokens_and_not_past_what_is_held(llama):
    model = llama[0]
    cache = new_cache(llama, "asym_token", dict(group_size=GROUP), False)
    feed(model, cache, torch.randint(1, 256, (1, 5)), 0)
    with pytest.raises(
        ValueError, match=r"^crop: 3; QuantizedKVCache drops the last n tokens with crop\(-n\)"
    ):
        cache.crop(3)
    with pytest.raises(ValueError, match="^crop: 6 tokens to drop; layer 0 holds 5$"):
        cache.crop(-6)
    cache.crop(0)
    assert cache.get_seq_length() == 5


@torch.no_grad()
def test_a_sliding_window_drops_only_what_it_still_holds(packed):
    """tiny-gemma3's window of 16 holds 15 tokens and the last forward's: a crop within those is exact, one past
    them would need tokens the window has evicted."""
    model, _ = load_model("tiny-gemma3")
    packed(model)
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    got, want = (QuantizedKVCache(model.config, 4, group_size=GROUP) for _ in range(2))
    feed(model, got, ids[:, :30], 0)
    feed(model, got, ids[:, 30:35], 30)
    got.crop(-5)
    feed(model, want, ids[:, :30], 0)
    assert_same(got, want)
    torch.testing.assert_close(feed(model, got, ids[:, 30:33], 30), feed(model, want, ids[:, 30:33], 30))
    with pytest.raises(
        ValueError, match=r"^crop: dropping 6 tokens would leave layer 0's window 12 of the 15"
    ):
        got.crop(-6)


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
@torch.no_grad()
def test_evicting_layers_take_rows_and_refuse_a_crop(llama, policy):
    """An evicting layer's rows carry their kept positions and (h2o) accumulated scores along; a crop would have
    to undo evictions and scores, and is refused in one line."""
    model = llama[0]
    spec = EvictionSpec(policy, keep=0.5, sink_tokens=2)
    ids = torch.randint(1, 256, (3, 20), generator=torch.Generator().manual_seed(4))
    rows = [2, 0, 0]

    def fed(batch: torch.Tensor) -> QuantizedKVCache:
        cache = with_eviction(QuantizedKVCache(model.config, 4, group_size=GROUP), spec)
        with attention_for(model, spec):
            feed(model, cache, batch[:, :16], 0)
            for t in range(16, 19):  # decode steps, each evicting first
                feed(model, cache, batch[:, t : t + 1], t)
        return cache

    got, want = fed(ids), fed(ids[rows])
    got.reorder_cache(torch.tensor(rows))
    assert_same(got, want)
    for a, b in zip(got.layers, want.layers):
        assert isinstance(a, EvictingLayer)
        assert torch.equal(a.positions.expand(3, -1), b.positions.expand(3, -1))
        if policy == "h2o":
            torch.testing.assert_close(a.scores, b.scores)
    with attention_for(model, spec):
        torch.testing.assert_close(
            feed(model, got, ids[rows, 19:], 19), feed(model, want, ids[rows, 19:], 19)
        )
    assert_same(got, want)
    assert not got.is_croppable
    with pytest.raises(
        NotImplementedError, match=rf"^QuantizedKVCache: .*: eviction={policy} keeps no record"
    ):
        got.crop(-1)
