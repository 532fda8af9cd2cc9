"""harness.cache.graphed: generate() whose decode steps replay from a CUDA graph, against generate() without.

Without CUDA the kernels run in Triton's CPU interpreter and the steps run eagerly (no capture): there the
tests check what a replay relies on, that every decode step launches the same kernels with the same arguments
and runs the same torch ops on the same shapes, reading nothing back to the host. The tests marked `gpu`
capture and replay on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels.decode_attention as decode_attention
import kernels.quantize as quantize
from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.cache.eviction import EvictionSpec, with_eviction
from harness.cache.graphed import GraphedStep, graphed_decoding
from harness.models import load_model

BITS = [[2, 4, 16], [8, 3, 4], [16, 16, 2]]  # tiny-llama: 3 layers of 3 KV heads, buckets of every width
HOST_READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item", "aten.equal")


def _cache(model, bits=BITS, **kw) -> QuantizedKVCache:
    return QuantizedKVCache(model.config, torch.tensor(bits), group_size=16, backend="triton", **kw)


def _generate(model, ids, cache, new_tokens, **kw):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, pad_token_id=0, **kw,
    )  # fmt: skip


# (the greedy case's decode steps write tokens 14 to 16 into the first group of 16 and token 17 into the second)
@pytest.mark.parametrize(
    "batch, prompt, new_tokens, sample", [(2, 14, 4, False), (1, 11, 1, False), (2, 11, 3, True)]
)
@torch.no_grad()
def test_graphed_generate_matches_generate(device, batch, prompt, new_tokens, sample):
    """generate() within graphed_decoding gives the tokens it gives without (greedy, and sampling from the same
    seed), and the cache stores the same bytes; afterwards the cache is back on host lengths."""
    model, _ = load_model("tiny-llama", device=device)
    gen = torch.Generator().manual_seed(batch + new_tokens)
    ids = torch.randint(0, 256, (batch, prompt), generator=gen).to(device)
    kw = dict(do_sample=True, top_k=20) if sample else dict(do_sample=False)
    graphed = _cache(model)
    with graphed_decoding(model, graphed, max_tokens=prompt + new_tokens):
        torch.manual_seed(0)
        got = _generate(model, ids, graphed, new_tokens, **kw)
    eager = _cache(model)
    with installed(model, PACKED):
        torch.manual_seed(0)
        want = _generate(model, ids, eager, new_tokens, **kw)
    assert torch.equal(got, want)
    n = eager.get_seq_length()
    assert graphed.get_seq_length() == n == prompt + new_tokens - 1
    for a, b in zip(graphed.quantized_layers(), eager.quantized_layers()):
        assert a.device_pos is None  # host lengths again
        for st_a, st_b in ((a.k_store, b.k_store), (a.v_store, b.v_store)):
            assert st_a.length == st_b.length == n
            for bk_a, bk_b in zip(st_a.buckets, st_b.buckets):
                for ta, tb in zip(bk_a.tensors(), bk_b.tensors()):
                    assert torch.equal(ta[:, :, :n], tb[:, :, :n]), bk_a.width
    assert "forward" not in vars(model)  # the model's own forward again


class _Ops(TorchDispatchMode):
    """Records each torch op of a step with its arguments' shapes, dtypes and strides (values of non-tensors);
    fails on an op that reads a device value back to the host (a capture cannot)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(HOST_READS):
            raise AssertionError(f"host synchronization: {func}")
        self.log.append((str(func), _describe(args), _describe(kwargs or {})))
        return func(*args, **(kwargs or {}))


def _describe(x, pointers=frozenset()):
    """x with every tensor as (shape, dtype, strides, its address if it is one of `pointers`)."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.stride(), x.data_ptr() if x.data_ptr() in pointers else None)
    if isinstance(x, torch.UntypedStorage):  # (the interpreter's views of kernel arguments)
        return ("storage", x.nbytes())
    if isinstance(x, (list, tuple)):
        return tuple(_describe(v, pointers) for v in x)
    if isinstance(x, dict):
        return tuple((k, _describe(v, pointers)) for k, v in sorted(x.items()))
    return x


class _Launches:
    """Records each Triton launch of the kernels the decode step runs (and runs it)."""

    NAMES = ((quantize, "_quantize_kernel"), (decode_attention, "_decode_packed_kernel"),
             (decode_attention, "_decode_split_kernel"), (decode_attention, "_combine_kernel"))  # fmt: skip

    def __init__(self, monkeypatch):
        self.log, self.pointers = [], frozenset()
        for module, name in self.NAMES:
            monkeypatch.setattr(module, name, self._proxy(name, getattr(module, name)))

    def _proxy(self, name, kernel):
        recorder = self

        class Proxy:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    recorder.log.append((name, grid, _describe(args, recorder.pointers), _describe(kwargs)))
                    return kernel[grid](*args, **kwargs)

                return launch

        return Proxy()


def _store_pointers(cache) -> frozenset:
    """Addresses of every tensor of every store: a replayed launch must find them where the capture did."""
    out = set()
    for layer in cache.quantized_layers():
        for st in (layer.k_store, layer.v_store):
            out |= {st.slot.data_ptr(), st.bucket_heads.data_ptr()}
            for bk in st.buckets:
                out |= {t.data_ptr() for t in (*bk.tensors(), bk.heads)}
    return frozenset(out)


@torch.no_grad()
def test_every_decode_step_is_the_same_replay(monkeypatch):
    """Steps 2 and 3 (the capture's and a replay's place) launch the same Triton kernels with the same grids,
    scalars and store addresses, run the same torch ops on the same shapes, and read nothing back to the host:
    what a CUDA graph captured at one step needs to be right at the next. With host lengths (the eager path)
    the launches change from step to step, so the check can fail."""
    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    launches = _Launches(monkeypatch)
    cache = _cache(model)
    with installed(model, PACKED):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        step = GraphedStep(model, cache, max_tokens=40, graphs=False)
        token = logits[:, -1:].argmax(-1)
        token = step.step(token)[:, -1:].argmax(-1)
        launches.pointers = _store_pointers(cache)
        steps = []
        for _ in range(2):
            launches.log = []
            with _Ops() as ops:
                token = step.step(token)[:, -1:].argmax(-1)
            steps.append((launches.log, ops.log))
        step.close()
    (launch_a, ops_a), (launch_b, ops_b) = steps
    assert [entry[0] for entry in launch_a].count("_quantize_kernel") == 3  # one a layer: keys and values
    assert launch_a == launch_b
    assert ops_a == ops_b
    assert any(p is not None for entry in launch_a for p in _flat_pointers(entry[2]))  # stores were matched

    # The eager decode step (host lengths) changes its launches as the context grows: the check sees it.
    eager = _cache(model)
    with installed(model, PACKED):
        model(input_ids=ids, past_key_values=eager, use_cache=True)
        logs = []
        for _ in range(2):
            launches.log = []
            model(input_ids=ids[:, :1], past_key_values=eager, use_cache=True)
            logs.append(launches.log)
    assert logs[0] != logs[1]


def _flat_pointers(described):
    for item in described:
        if isinstance(item, tuple) and len(item) == 4 and isinstance(item[0], tuple):
            yield item[3]
        elif isinstance(item, tuple):
            yield from _flat_pointers(item)


@torch.no_grad()
def test_graphed_decoding_refuses_what_it_cannot_replay():
    """One-line errors: a torch-backend cache, an evicting one, a padded batch, a context past max_tokens, a mask
    at device-side positions; the model's forward is its own again after each."""
    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    torch_cache = QuantizedKVCache(model.config, 4, group_size=16, backend="torch")
    with pytest.raises(ValueError, match="not on the triton backend"):
        with graphed_decoding(model, torch_cache, max_tokens=9):
            _generate(model, ids, torch_cache, 3)
    evicting = with_eviction(_cache(model), EvictionSpec("streaming", keep=0.5, sink_tokens=2))
    with pytest.raises(NotImplementedError, match="is a EvictingLayer, whose stores are rebuilt"):
        with graphed_decoding(model, evicting, max_tokens=9):
            _generate(model, ids, evicting, 3)
    padded = torch.ones_like(ids)
    padded[0, 0] = 0
    with pytest.raises(NotImplementedError, match="a padded batch"):
        with graphed_decoding(model, cache := _cache(model), max_tokens=9):
            model.generate(
                ids, attention_mask=padded, past_key_values=cache, max_new_tokens=3, pad_token_id=0
            )
    with pytest.raises(RuntimeError, match="max_tokens 8"):
        with graphed_decoding(model, cache := _cache(model), max_tokens=8):
            _generate(model, ids, cache, 4, do_sample=False)  # the 4th token's step would store the 9th
    assert "forward" not in vars(model)
    cache = _cache(model)
    with installed(model, PACKED):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        step = GraphedStep(model, cache, max_tokens=20, graphs=False)
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[0, 0] = 0  # a padded token: the model builds a mask, which a replayed step could not follow
        with pytest.raises(ValueError, match="takes no attention mask"):
            model(input_ids=ids[:, :1], attention_mask=mask, past_key_values=cache, use_cache=True)
        step.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_cuda_graph_replays_match_generate(monkeypatch):
    """On CUDA: decode steps after the warm-up replay one captured graph, with generate()'s tokens without it."""
    model, _ = load_model("tiny-llama", device="cuda")
    ids = torch.randint(0, 256, (3, 13), generator=torch.Generator().manual_seed(2)).cuda()
    replays = []
    monkeypatch.setattr(
        torch.cuda.CUDAGraph,
        "replay",
        lambda self, f=torch.cuda.CUDAGraph.replay: (replays.append(1), f(self))[1],
    )
    cache = _cache(model)
    with graphed_decoding(model, cache, max_tokens=13 + 12):
        got = _generate(model, ids, cache, 12, do_sample=False)
    assert (
        len(replays) == 12 - 1 - 2
    )  # the steps after the prompt's and two eager ones (the capture replays once)
    eager = _cache(model)
    with installed(model, PACKED):
        want = _generate(model, ids, eager, 12, do_sample=False)
    assert torch.equal(got, want)


@torch.no_grad()
def test_beams_reorder_in_place_at_device_side_positions_and_crops_are_refused():
    """A replayed step reads the stores' tensors where the capture found them: beam search's reordering rewrites
    them in place (the same tensors, rows swapped); a batch of another size, or a crop (drafting modes), which
    would move the device-side positions, is a one-line error naming graphed_decoding."""
    model, _ = load_model("tiny-llama", device="cpu")
    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    cache = _cache(model)
    with installed(model, PACKED):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    step = GraphedStep(model, cache, max_tokens=20, graphs=False)
    tensors = [t for layer in cache.quantized_layers() for bk in layer.k_store.buckets for t in bk.tensors()]
    before = [t.clone() for t in tensors]
    cache.reorder_cache(torch.tensor([1, 0]))
    after = [t for layer in cache.quantized_layers() for bk in layer.k_store.buckets for t in bk.tensors()]
    n = cache.get_seq_length()  # the capacity past it is unwritten
    assert all(
        a is t and torch.equal(a[:, :, :n], b[[1, 0], :, :n]) for a, t, b in zip(after, tensors, before)
    )
    with pytest.raises(
        NotImplementedError, match=r"^QuantizedKVCache: 4 batch rows instead of 2 inside graphed_"
    ):
        cache.batch_repeat_interleave(2)
    with pytest.raises(
        NotImplementedError, match=r"^QuantizedKVCache: crop \(assisted generation, prompt look"
    ):
        cache.crop(-1)
    cache.crop(0)  # generate() calls it after every accepted draft: nothing to drop
    step.close()
    phrase = ids[:1, :4].repeat(1, 3)  # drafts for prompt lookup to find
    with pytest.raises(NotImplementedError, match="inside graphed_decoding"):
        with graphed_decoding(model, cache := _cache(model), max_tokens=30):
            _generate(model, phrase, cache, 5, prompt_lookup_num_tokens=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_cuda_graph_replays_beam_search():
    """On CUDA: beam search within graphed_decoding (its beams reordered between replays) gives the tokens of beam
    search through the same fused kernels without the graph."""
    model, _ = load_model("tiny-llama", device="cuda")
    ids = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(3)).cuda()
    cache = _cache(model)
    with graphed_decoding(model, cache, max_tokens=13 + 10):
        got = _generate(model, ids, cache, 10, num_beams=3, num_return_sequences=2, do_sample=False)
    eager = _cache(model)
    with installed(model, PACKED):
        want = _generate(model, ids, eager, 10, num_beams=3, num_return_sequences=2, do_sample=False)
    assert got.shape == (4, 23) and torch.equal(got, want)
