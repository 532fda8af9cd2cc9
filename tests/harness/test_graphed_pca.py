"""harness.cache.graphed over the pca family's kernel stores (pca_block32_uf on the triton backend: codes-only stores
written by kernels.quantize.quantize_codes_into at device-side positions, each decode step harness/schemes/
pca_fold.decode around decode_attention_blocks with the length on the device).

Without CUDA the steps run eagerly under Triton's interpreter: the tests check that they give what generate()
gives at host lengths, and that every decode step runs the same torch ops and launches, reading nothing back to the
host (what a CUDA graph captured at one step needs at the next). The test marked `gpu` captures and replays.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.cache.graphed import GraphedStep, graphed_decoding
from harness.calibrate.pca import fit_pca_calibration
from harness.models import load_model
from harness.schemes import get_scheme

# tiny-llama: 3 layers of 3 KV heads at the codes-only widths, keys and values apart
KEY_BITS = [[4, 2, 8], [3, 4, 4], [2, 8, 3]]
VALUE_BITS = [[4, 4, 3], [8, 2, 4], [4, 3, 2]]
SCHEME = "pca_block32_uf"
HOST_READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item", "aten.equal")


@pytest.fixture(scope="module")
def fitted():
    """tiny-llama on the CPU and pca_block32_uf's transforms fitted on random windows of it (blocks of 32 tokens:
    short prompts cross them)."""
    model, _ = load_model("tiny-llama", device="cpu")
    windows = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(3))
    return model, fit_pca_calibration(model, windows, get_scheme(SCHEME).pca_format)


def _cache(model, cal) -> QuantizedKVCache:
    return QuantizedKVCache(
        model.config, torch.tensor(KEY_BITS), SCHEME, value_bits=torch.tensor(VALUE_BITS), sink_tokens=1,
        prefill="quantized", key_calibration=cal, backend="triton",
    )  # fmt: skip


@torch.no_grad()
def test_graphed_pca_decoding_generates_what_generate_does(fitted):
    """A prompt of 29 tokens and 6 new ones: the decode steps cross from the first block of 32 codes into the
    second. The same tokens and logits as generate() at host lengths, the same stored codes and host counters."""
    model, cal = fitted
    # one batch row (the write kernel's rows: tests/kernels/test_quantize_codes.py; two here in the next test)
    ids = torch.randint(0, 256, (1, 29), generator=torch.Generator().manual_seed(5))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, pad_token_id=0,
              do_sample=False, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    graphed = _cache(model, cal)
    with graphed_decoding(model, graphed, max_tokens=29 + 6):
        got = model.generate(ids, past_key_values=graphed, **kw)
    eager = _cache(model, cal)
    with installed(model, PACKED):
        want = model.generate(ids, past_key_values=eager, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
    n = 29 + 6 - 1
    for a, b in zip(graphed.quantized_layers(), eager.quantized_layers(), strict=True):
        assert a.device_pos is None  # host lengths again
        for role in ("k_store", "v_store"):
            ours, theirs = getattr(a, role), getattr(b, role)
            assert ours.length == theirs.length == n and ours.seen == theirs.seen == n
            base, other = ours.parts[1], theirs.parts[1]
            assert base.positions.next == other.positions.next and base.packed.length == n - 1
            for w in base.widths:
                assert torch.equal(base._codes(w, 0, n - 1), other._codes(w, 0, n - 1)), (role, w)


class _Record(TorchDispatchMode):
    """Each torch op of a step with its arguments' shapes and dtypes (values of non-tensors); fails on an op that
    reads a device value back to the host (a capture cannot)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(HOST_READS):
            raise AssertionError(f"host synchronization: {func}")
        self.log.append((str(func), _shapes(args), _shapes(kwargs or {})))
        return func(*args, **(kwargs or {}))


def _shapes(x):
    """x with every tensor as its (shape, dtype, strides), every storage as its size."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype, x.stride()
    if isinstance(x, torch.UntypedStorage):  # (the interpreter's views of kernel arguments)
        return "storage", x.nbytes()
    if isinstance(x, (list, tuple)):
        return tuple(_shapes(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _shapes(v)) for k, v in sorted(x.items()))
    return x


@torch.no_grad()
def test_every_pca_decode_step_is_the_same_replay(fitted):
    """Two decode steps at device-side positions (the capture's and a replay's place) run the same torch ops on the
    same shapes with the same scalars and read nothing back to the host; at host lengths they do not (the check
    can fail)."""
    model, cal = fitted
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    cache = _cache(model, cal)
    with installed(model, PACKED):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        step = GraphedStep(model, cache, max_tokens=40, graphs=False)
        token = step.step(logits[:, -1:].argmax(-1))[:, -1:].argmax(-1)
        logs = []
        for _ in range(2):
            with _Record() as ops:
                token = step.step(token)[:, -1:].argmax(-1)
            logs.append(ops.log)
        step.close()
        assert logs[0] == logs[1] and any("index_copy" in entry[0] for entry in logs[0])
        eager = []
        for _ in range(2):
            with _Record() as ops:
                try:
                    model(input_ids=token, past_key_values=cache, use_cache=True)
                except AssertionError as error:  # host lengths: the sizes are read on the host
                    ops.log.append(str(error))
            eager.append(ops.log)
    assert eager[0] != eager[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_cuda_graph_replays_pca_decoding():
    """On CUDA: the replayed steps give generate()'s tokens at host lengths."""
    model, _ = load_model("tiny-llama", device="cuda")
    windows = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(3)).cuda()
    cal = fit_pca_calibration(model, windows, get_scheme(SCHEME).pca_format)
    ids = torch.randint(0, 256, (2, 29), generator=torch.Generator().manual_seed(5)).cuda()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, pad_token_id=0,
              do_sample=False)  # fmt: skip
    graphed = _cache(model, cal)
    with graphed_decoding(model, graphed, max_tokens=29 + 8):
        got = model.generate(ids, past_key_values=graphed, **kw)
    eager = _cache(model, cal)
    with installed(model, PACKED):
        want = model.generate(ids, past_key_values=eager, **kw)
    assert torch.equal(got, want)
