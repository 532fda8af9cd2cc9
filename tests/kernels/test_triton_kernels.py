"""Triton kernels (kernels/quantize.py, kernels/decode_attention.py) against the torch oracle.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before
anything imports triton, so the shapes are small); the same tests marked `gpu` run compiled on CUDA.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import reference
from kernels.decode_attention import decode_attention
from kernels.layout import PackedStore
from kernels.quantize import quantize_into

B, T, HQ = 2, 63, 6
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _inputs(shape: tuple[int, ...], g: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Random values with the edge cases of the format: a constant group (scale 0), values past the fp16
    range (clamped), a group of tiny values (fp16-subnormal scale)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 3
    x[0, 0, 0, :g] = 1.5
    x[0, -1, 1, :g] = 7e4
    x[-1, 0, 2, g : 2 * g] *= 1e-6
    return x.to(dtype).to(device)


def _fill_garbage(st: PackedStore) -> None:
    """Every element a kernel must write (or must not read) starts as garbage that a check would catch."""
    for bk in st.buckets:
        for t in bk.tensors():
            t.fill_(0xA5 if t.dtype == torch.uint8 else float("nan"))


@pytest.mark.parametrize(
    "bits, head_dim, group_size, symmetric, dtype",
    [
        ((2, 4, 16), 64, 32, False, torch.float32),
        ((2, 4, 16), 64, 32, True, torch.float32),
        ((2, 4, 16), 96, 32, False, torch.float32),
        ((4, 16, 2), 96, 16, True, torch.float32),
        ((3, 8, 16), 96, 32, False, torch.bfloat16),
        ((8, 3, 2), 64, 64, True, torch.float16),
    ],
)
def test_quantize_bit_exact(device, bits, head_dim, group_size, symmetric, dtype):
    pos, tn = 5, T  # tokens land at [5, 68): several token blocks, a non-zero start
    x = _inputs((B, len(bits), tn, head_dim), group_size, dtype, device, seed=head_dim + len(bits))
    kw = dict(
        head_dim=head_dim, batch=B, group_size=group_size, symmetric=symmetric, dtype=dtype, device=device
    )
    st = PackedStore(bits, capacity=80, **kw)
    _fill_garbage(st)
    quantize_into(st, x, pos)
    _assert_written(st, _torch_quantized(x, pos, bits, capacity=80, **kw), pos, tn)


def _torch_quantized(x: torch.Tensor, pos: int, bits, **kw) -> PackedStore:
    """A store whose positions [pos, pos + Tn) hold x (B, Hkv, Tn, D) quantized by the torch path (the oracle)."""
    B, H, _, D = x.shape
    ref = PackedStore(bits, **kw)
    ref.append(torch.zeros(B, H, pos, D, dtype=x.dtype, device=x.device), keep_dequantized=False)
    ref.append(x, keep_dequantized=False)
    return ref


def _assert_written(st: PackedStore, ref: PackedStore, pos: int, tn: int) -> None:
    """st's positions [pos, pos + tn) bit for bit ref's, and every other position still _fill_garbage's."""
    new = slice(pos, pos + tn)
    for bk, want in zip(st.buckets, ref.buckets):
        for got, exp in zip(bk.tensors(), want.tensors()):
            # Compare bit patterns so that -0.0 vs 0.0 or a NaN left unwritten is caught.
            bits_of = lambda t: (
                t if t.dtype == torch.uint8 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
            )  # noqa: E731
            assert torch.equal(bits_of(got[:, :, new]), bits_of(exp[:, :, new])), bk.width
            # Nothing outside [pos, pos + Tn) was written.
            for outside in (got[:, :, :pos], got[:, :, pos + tn :]):
                assert (outside == 0xA5).all() if got.dtype == torch.uint8 else outside.isnan().all()


@pytest.mark.parametrize(
    "k_bits, v_bits, k_dim, v_dim, k_group, v_group, tn",
    [
        ((2, 4, 16, 4), (8, 3, 3, 16), 64, 96, 32, 16, 5),  # the widths, head_dims and groups of each store
        ((4, 4, 4), (4, 4, 4), 128, 128, 32, 32, 1),  # a uniform decode step
        ((16, 16), (2, 8), 64, 64, 32, 64, 19),  # a store of 16-bit heads only
    ],
)
def test_quantize_keys_and_values_in_one_launch(device, k_bits, v_bits, k_dim, v_dim, k_group, v_group, tn):
    """A layer's keys and values written by one launch: each store bit for bit what the torch path stores,
    with its own widths, head_dim, group size and symmetry; nothing else written."""
    pos = 7
    gen = torch.Generator().manual_seed(tn)
    k = (torch.randn(B, len(k_bits), tn, k_dim, generator=gen) * 2).to(device)
    v = (torch.randn(B, len(v_bits), tn, v_dim, generator=gen) * 2).to(device)
    k_kw = dict(head_dim=k_dim, batch=B, group_size=k_group, symmetric=False, device=device, capacity=48)
    v_kw = dict(head_dim=v_dim, batch=B, group_size=v_group, symmetric=True, device=device, capacity=48)
    ks, vs = PackedStore(k_bits, **k_kw), PackedStore(v_bits, **v_kw)
    _fill_garbage(ks)
    _fill_garbage(vs)
    quantize_into(ks, k, pos, v_store=vs, v=v)
    _assert_written(ks, _torch_quantized(k, pos, k_bits, **k_kw), pos, tn)
    _assert_written(vs, _torch_quantized(v, pos, v_bits, **v_kw), pos, tn)


def test_quantize_refuses_a_codes_only_store():
    """A codes-only store has no scales to write: quantize_into would put them in its payload."""
    x = torch.zeros(1, 2, 1, 64)
    with pytest.raises(ValueError, match="append_codes"):
        quantize_into(PackedStore((4, 2), 64, 1, codes_only=True), x, 0)
    with pytest.raises(ValueError, match="append_codes"):
        quantize_into(
            PackedStore((4, 2), 64, 1), x, 0, v_store=PackedStore((4, 2), 64, 1, codes_only=True), v=x
        )


def test_quantize_rejects_unsupported_group_size():
    st = PackedStore((4, 4), head_dim=96, batch=1, group_size=48)
    x = torch.zeros(1, 2, 1, 96)
    with pytest.raises(NotImplementedError, match="group_size: 48"):
        quantize_into(st, x, 0)


def _stores(k_bits, v_bits, head_dim, group_size, symmetric, device, seed):
    """K and V stores filled through the torch path, with NaN/garbage capacity past `length`."""
    gen = torch.Generator().manual_seed(seed)
    stores = []
    for bits, sym in ((k_bits, symmetric), (v_bits, not symmetric)):
        st = PackedStore(
            bits, head_dim, B, group_size=group_size, symmetric=sym, device=device, capacity=T + 9
        )
        _fill_garbage(st)
        st.append(torch.randn(B, len(bits), T, head_dim, generator=gen).to(device), keep_dequantized=False)
        stores.append(st)
    return stores


@pytest.mark.parametrize(
    "k_bits, v_bits, head_dim, group_size, symmetric, q_dtype, n_extra",
    [
        ((2, 4, 16), (4, 16, 2), 64, 32, False, torch.float32, 5),
        ((2, 4, 16), (4, 16, 2), 64, 32, True, torch.float32, 5),
        ((2, 4, 16), (16, 2, 4), 96, 32, False, torch.float32, 0),
        ((3, 8, 16), (8, 2, 3), 96, 32, True, torch.float32, 17),
        ((4, 2, 16), (2, 4, 8), 128, 64, False, torch.float16, 5),
        pytest.param(
            (8, 4, 2),
            (2, 16, 3),
            64,
            16,
            True,
            torch.bfloat16,
            3,
            marks=pytest.mark.skipif(
                INTERPRET, reason="Triton's interpreter (3.9) computes tl.dot on bf16 wrongly"
            ),
        ),  # fmt: skip
    ],
)
def test_decode_attention(device, k_bits, v_bits, head_dim, group_size, symmetric, q_dtype, n_extra):
    ks, vs = _stores(k_bits, v_bits, head_dim, group_size, symmetric, device, seed=head_dim)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(B, HQ, head_dim, generator=gen).to(device=device, dtype=q_dtype)
    kx = torch.randn(B, 3, n_extra, head_dim, generator=gen).to(device=device, dtype=q_dtype)
    vx = torch.randn(B, 3, n_extra, head_dim, generator=gen).to(device=device, dtype=q_dtype)
    sm_scale = head_dim**-0.5

    keys = torch.cat([ks.dequantize(), kx.float()], dim=2)  # (B, Hkv, T + Tx, D)
    values = torch.cat([vs.dequantize(), vx.float()], dim=2)
    ref = reference.attention_reference(q[:, :, None], keys, values, sm_scale)[:, :, 0]  # (B, Hq, D) float64

    bound = 1e-3 if q_dtype == torch.float32 else 1e-2
    outs = []
    for num_splits in (1, 3):
        out = torch.full((B, HQ, head_dim), float("nan"), dtype=q_dtype, device=device)
        extra = dict(k_extra=kx, v_extra=vx) if n_extra else {}
        decode_attention(q, ks, vs, sm_scale, num_splits=num_splits, out=out, block_n=16, **extra)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < bound, (num_splits, err)
        outs.append(out.double())
    torch.testing.assert_close(outs[0], outs[1], rtol=bound, atol=bound)


def test_decode_attention_many_splits(device):
    """More splits than the combine merges in one step (COMBINE_BLOCK): its loop over split blocks."""
    gen = torch.Generator().manual_seed(8)
    L, D = 300, 32
    ks, vs = (PackedStore((4, 2), D, 1, group_size=16, device=device, capacity=L) for _ in range(2))
    for st in (ks, vs):
        st.append(torch.randn(1, 2, L, D, generator=gen).to(device), keep_dequantized=False)
    q = torch.randn(1, 4, D, generator=gen).to(device)
    ref = reference.attention_reference(q[:, :, None], ks.dequantize(), vs.dequantize(), 0.2)[:, :, 0]
    out = decode_attention(q, ks, vs, 0.2, num_splits=19, block_n=16)  # 19 splits of 16 tokens
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-4


def test_decode_attention_extra_only(device):
    """An empty store with an extra segment attends to the extra tokens alone."""
    ks = PackedStore((4, 16), 64, 1, device=device)
    vs = PackedStore((2, 16), 64, 1, device=device)
    gen = torch.Generator().manual_seed(2)
    q, kx, vx = (torch.randn(s, generator=gen).to(device) for s in ((1, 4, 64), (1, 2, 7, 64), (1, 2, 7, 64)))
    out = decode_attention(q, ks, vs, 0.125, k_extra=kx, v_extra=vx)
    ref = reference.attention_reference(q[:, :, None], kx, vx, 0.125)[:, :, 0]
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3


def test_decode_attention_refuses_rows_past_int32_offsets():
    """The tiles address a head's rows with int32 word offsets: a store whose capacity holds 2**31 words a head or
    more is refused before any launch (meta tensors: nothing is allocated)."""
    ks = PackedStore((8, 4), 128, 1, device="meta", capacity=2**27)  # 2**27 rows of 32 words at 8 bits
    vs = PackedStore((4, 4), 128, 1, device="meta", capacity=2**27)
    with pytest.raises(ValueError, match="capacity: 134217728 tokens"):
        decode_attention(torch.empty(1, 2, 128, device="meta"), ks, vs, 0.1)


class _NoHostSync(TorchDispatchMode):
    """Fails on the aten ops that read a tensor's value back to the host (.item(), bool(), torch.equal)."""

    FORBIDDEN = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item", "aten.equal")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith(self.FORBIDDEN):
            raise AssertionError(f"host synchronization: {func}")
        return func(*args, **(kwargs or {}))


def _no_tolist(*_):
    raise AssertionError("host synchronization: Tensor.tolist")


def test_decode_step_reads_nothing_back_to_the_host(device, monkeypatch):
    """quantize_into, decode_attention and the fused attention's mask check launch without reading a device
    value on the host, so a decode step can run ahead of the GPU (and be captured in a CUDA graph)."""
    from harness.attention.packed import DecodeStep, Steps, packed_forward

    ks, vs = _stores((2, 4, 16), (4, 16, 2), 64, 32, False, device, seed=7)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, 3, 1, 64, generator=gen).to(device)
    q = torch.randn(B, HQ, 1, 64, generator=gen).to(device)
    mask = torch.ones(B, 1, 1, T + 1, dtype=torch.bool, device=device)
    monkeypatch.setattr(torch.Tensor, "tolist", _no_tolist)
    with _NoHostSync():
        quantize_into(ks, x, T, v_store=vs, v=x)
        ks.length = vs.length = T + 1
        steps = Steps()
        steps.post(0, x, DecodeStep(ks, vs))  # as harness.cache's triton backend posts a decode step
        packed_forward(
            steps, SimpleNamespace(layer_idx=0), q, x, x, mask, scaling=0.125
        )  # layer 0's attention


@torch.no_grad()
def test_model_decode_step_reads_nothing_back_to_the_host(device, monkeypatch, packed):
    """A whole decode step of a model on a triton cache (cache update, quantize, fused attention, the model's
    own ops) reads no device value on the host."""
    from harness.cache import QuantizedKVCache
    from harness.models import load_model

    model, _ = load_model("tiny-llama", device=device)
    packed(model)
    cache = QuantizedKVCache(
        model.config, torch.tensor([[2, 4, 16], [8, 3, 4], [16, 16, 2]]), group_size=16, backend="triton"
    )
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(9)).to(device)
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    monkeypatch.setattr(torch.Tensor, "tolist", _no_tolist)
    with _NoHostSync():
        model(input_ids=ids[:, 1:2], past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 11


def test_device_side_position_and_length_match_host_ones(device):
    """pos and length as device tensors (what a CUDA graph replays) give what the host ints give, with the
    splits planned over the whole capacity (most of it empty)."""
    bits, D, g = (2, 16, 3), 64, 16
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(B, 3, T, D, generator=gen).to(device)
    q = torch.randn(B, HQ, D, generator=gen).to(device)
    stores = []
    for pos in (9, torch.tensor([9], dtype=torch.int32, device=device)):
        pair = [PackedStore(bits, D, B, group_size=g, device=device, capacity=4 * T) for _ in range(2)]
        for st in pair:
            _fill_garbage(st)
        zeros = torch.zeros(B, 3, 9, D, device=device)
        quantize_into(pair[0], zeros, 0, v_store=pair[1], v=zeros)
        quantize_into(pair[0], x, pos, v_store=pair[1], v=x)  # one launch, as the cache does
        for st in pair:
            st.length = 9 + T
        stores.append(pair)
    for a, b in zip(*stores):
        for bk_a, bk_b in zip(a.buckets, b.buckets):
            for ta, tb in zip(bk_a.tensors(), bk_b.tensors()):
                assert torch.equal(ta[:, :, : 9 + T], tb[:, :, : 9 + T])
    want = decode_attention(q, *stores[0], 0.125, num_splits=1)
    length = torch.tensor([9 + T], dtype=torch.int32, device=device)
    got = decode_attention(q, *stores[1], 0.125, length=length, block_n=16)
    assert stores[1][0].capacity > 2 * (9 + T)  # splits past the stored tokens exist and must weigh 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA, compiled Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_step_replays_in_a_cuda_graph(dtype):
    """One decode step (quantize the new K/V token at a device-side position, attend over a device-side
    length) captured once in a CUDA graph and replayed as the stores grow: each replay matches the oracle."""
    bits, D, hq, cap, steps = (2, 4, 8, 16), 128, 16, 512, 6
    hkv, batch = len(bits), 3
    gen = torch.Generator().manual_seed(6)
    ks, vs = (
        PackedStore(bits, D, batch, group_size=32, dtype=dtype, device="cuda", capacity=cap) for _ in range(2)
    )
    prefix = 100
    keys = torch.randn(batch, hkv, prefix + steps, D, generator=gen).to("cuda", dtype)
    values = torch.randn(batch, hkv, prefix + steps, D, generator=gen).to("cuda", dtype)
    for st, t in ((ks, keys), (vs, values)):
        quantize_into(st, t[:, :, :prefix], 0)
        st.length = prefix
    pos = torch.tensor([prefix], dtype=torch.int32, device="cuda")
    length = pos + 1
    k_new, v_new = keys[:, :, :1].clone(), values[:, :, :1].clone()
    q = torch.empty(batch, hq, D, dtype=dtype, device="cuda")
    out = torch.empty_like(q)

    def step():
        quantize_into(ks, k_new, pos, v_store=vs, v=v_new)
        decode_attention(q, ks, vs, D**-0.5, out=out, length=length)
        pos.add_(1)
        length.add_(1)

    side = torch.cuda.Stream()  # warm-up (compiles the kernels, allocates the workspace) outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    pos.fill_(prefix)
    length.fill_(prefix + 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    pos.fill_(prefix)
    length.fill_(prefix + 1)
    for i in range(steps):
        t = prefix + i
        k_new.copy_(keys[:, :, t : t + 1])
        v_new.copy_(values[:, :, t : t + 1])
        q.copy_(torch.randn(batch, hq, D, generator=gen).to("cuda", dtype))
        graph.replay()
        ks.length = vs.length = t + 1
        ref = reference.attention_reference(q[:, :, None], ks.dequantize(), vs.dequantize(), D**-0.5)[:, :, 0]
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (i, err)
    assert int(pos) == prefix + steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA, compiled Triton")
def test_mixed_map_buckets_run_concurrently_in_a_cuda_graph(monkeypatch):
    """Captured in a CUDA graph, a mixed map's buckets run on side streams: the replay's output is bit for bit
    the one with the buckets in turn on one stream, it matches the oracle, and the capturing stream is current
    again after the call."""
    from kernels import decode_attention as da

    bits, D, hq, batch, tokens = (2, 2, 4, 8, 4, 16), 128, 12, 3, 3000
    gen = torch.Generator().manual_seed(11)
    ks, vs = (
        PackedStore(bits, D, batch, group_size=32, dtype=torch.bfloat16, device="cuda", capacity=tokens)
        for _ in "kv"
    )
    for st in (ks, vs):
        quantize_into(
            st, torch.randn(batch, len(bits), tokens, D, generator=gen).to("cuda", torch.bfloat16), 0
        )
        st.length = tokens
    q = torch.randn(batch, hq, D, generator=gen).to("cuda", torch.bfloat16)
    outs = {}
    for concurrent in (True, False):
        monkeypatch.setattr(da, "CONCURRENT_BUCKETS", concurrent)
        monkeypatch.setattr(da, "_SIDE_STREAMS", {})
        out = torch.empty_like(q)
        decode_attention(q, ks, vs, D**-0.5, out=out)  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            capturing = torch.cuda.current_stream()
            decode_attention(q, ks, vs, D**-0.5, out=out)
            assert torch.cuda.current_stream() == capturing
        assert bool(da._SIDE_STREAMS) == concurrent  # side streams were taken only when asked for
        out.fill_(float("nan"))
        graph.replay()
        outs[concurrent] = out.clone()
    torch.cuda.synchronize()
    assert torch.equal(outs[True], outs[False])
    ref = reference.attention_reference(q[:, :, None], ks.dequantize(), vs.dequantize(), D**-0.5)[:, :, 0]
    assert ((outs[True].double() - ref).norm() / ref.norm()).item() < 2e-2


class _LaunchSpy:
    """Counts the launches of a Triton kernel and forwards them."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize(
    "k_bits, v_bits, head_dim, group_size, symmetric, q_dtype, n_extra",
    [
        ((4, 4, 4), (4, 4, 4), 64, 32, False, torch.float16, 0),  # a uniform map
        ((2, 4, 8), (8, 2, 4), 64, 16, True, torch.bfloat16, 5),  # K, V widths apart; 16-channel groups
        ((4, 2, 4), (2, 2, 8), 128, 32, False, torch.bfloat16, 0),
        ((8, 8, 2), (4, 4, 4), 128, 64, True, torch.float16, 17),
        ((4, 4, 4), (2, 4, 2), 256, 32, False, torch.bfloat16, 3),  # D 256: q through shared memory
        ((3, 2, 3), (3, 3, 8), 128, 64, True, torch.bfloat16, 5),  # 3 bits beside other widths
        ((4, 3, 3), (3, 4, 2), 128, 128, False, torch.bfloat16, 17),  # one group a head
        ((3, 3, 8), (2, 3, 3), 256, 32, True, torch.float16, 3),  # 3 bits at D 256
    ],
)  # uniform 2, 3, 4 and 8 bits at their own tiles: test_fast_kernel_whole_tiles_at_each_launch
def test_decode_attention_fast_path(device, k_bits, v_bits, head_dim, group_size, symmetric, q_dtype, n_extra,
                                    monkeypatch):  # fmt: skip
    """Buckets packed at 2, 3, 4 and 8 bits with fp16/bf16 queries take the fast kernel (kernels/unpack.py's
    dequantization, tokens on the mma's M), every bucket a branch of one launch: the output matches the float64
    oracle over the dequantized stores at any split count, with and without an extra segment."""
    from kernels import decode_attention as da

    spy = _LaunchSpy(da._decode_packed_kernel)
    monkeypatch.setattr(da, "_decode_packed_kernel", spy)
    ks, vs = _stores(k_bits, v_bits, head_dim, group_size, symmetric, device, seed=head_dim + group_size)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, HQ, head_dim, generator=gen).to(device=device, dtype=q_dtype)
    kx, vx = (torch.randn(B, 3, n_extra, head_dim, generator=gen).to(device, q_dtype) for _ in range(2))
    keys = torch.cat([ks.dequantize(), kx.float()], dim=2)
    values = torch.cat([vs.dequantize(), vx.float()], dim=2)
    ref = reference.attention_reference(q[:, :, None], keys, values, head_dim**-0.5)[:, :, 0]
    for num_splits, block_n in ((1, None), (3, 16)):
        out = torch.full((B, HQ, head_dim), float("nan"), dtype=q_dtype, device=device)
        extra = dict(k_extra=kx, v_extra=vx) if n_extra else {}
        decode_attention(q, ks, vs, head_dim**-0.5, num_splits=num_splits, out=out, block_n=block_n, **extra)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (num_splits, err)
    assert spy.launches == 2  # every bucket took the fast kernel, all of them in one launch a call


@pytest.mark.parametrize(
    "bits, head_dim, block_n",
    [(2, 128, None), (2, 128, 256), (4, 128, None), (8, 128, None), (3, 128, None), (2, 64, None)],
)
def test_fast_kernel_whole_tiles_at_each_launch(device, bits, head_dim, block_n):
    """Whole unmasked tiles of each width's own launch (FAST_LAUNCH; and the 256-token tiles the tuning grid
    tries at 2 bits) then a masked last one, at 4 query heads a KV head (the benchmark's grouping): the output
    matches the float64 oracle over the dequantized stores, in one split and in three."""
    from kernels import decode_attention as da

    tile = block_n or da.fast_block_n(bits, bits, head_dim)
    length = 2 * tile + 88  # two whole tiles and a part (600 tokens at 256-token tiles)
    gen = torch.Generator().manual_seed(bits * head_dim)
    ks, vs = (
        PackedStore([bits] * 2, head_dim, 1, group_size=32, symmetric=sym, device=device, capacity=length + 5)
        for sym in (False, True)
    )
    for st in (ks, vs):
        _fill_garbage(st)
        st.append(torch.randn(1, 2, length, head_dim, generator=gen).to(device) * 2, keep_dequantized=False)
    q = torch.randn(1, 8, head_dim, generator=gen).to(device=device, dtype=torch.float16)
    keys, values = ks.dequantize(), vs.dequantize()
    ref = reference.attention_reference(q[:, :, None], keys, values, head_dim**-0.5)[:, :, 0]
    assert length // tile >= 2  # whole tiles first
    for num_splits in (1, 3):
        out = decode_attention(q, ks, vs, head_dim**-0.5, num_splits=num_splits, block_n=block_n)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (num_splits, err)


def test_fast_kernel_tiles_default_to_its_own_launch(device, monkeypatch):
    """Without block_n the fast kernel runs its width's tiles, stages and register cap (FAST_LAUNCH) and the
    generic one BLOCK_N with Triton's defaults (a 4-bit bucket and a 16-bit one in the same call); options the
    caller gives win."""
    from kernels import decode_attention as da

    launches = {}

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                opts = ("BLOCK_N", "BLOCK_NS", "STAGES", "num_stages", "maxnreg", "num_warps")
                launches[self.name] = {k: kwargs[k] for k in opts if k in kwargs}
                return self.kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(da, "_decode_packed_kernel", Recorder("fast", da._decode_packed_kernel))
    monkeypatch.setattr(da, "_decode_split_kernel", Recorder("generic", da._decode_split_kernel))
    ks, vs = _stores((4, 16, 4), (4, 16, 4), 64, 32, False, device, seed=5)
    q = torch.randn(B, HQ, 64).to(device=device, dtype=torch.float16)
    want = da.decode_attention(q, ks, vs, 0.125)
    assert launches == {
        "fast": {"BLOCK_NS": (128,), "STAGES": (2,), "num_stages": 2, "maxnreg": 128},
        "generic": {"BLOCK_N": da.BLOCK_N},
    }
    tile = {
        (kw, vw, d): da.fast_block_n(kw, vw, d)
        for kw in (2, 3, 4, 8)
        for vw in (2, 3, 4, 8)
        for d in (64, 128)
    }
    assert tile[4, 4, 128] == tile[2, 2, 128] == 128 and tile[8, 8, 128] == 64
    assert tile[2, 2, 64] == 64 and tile[8, 8, 64] == tile[4, 4, 64] == 128  # heads of 64 channels: own table
    # a bucket takes the launch of its width with the smaller tile (at equal tiles the wider width's)
    assert tile[2, 8, 128] == tile[3, 3, 128] == tile[2, 3, 128] == tile[4, 3, 128] == 64
    assert tile[2, 8, 64] == 64 and tile[4, 8, 64] == 128
    assert da.fast_options(3, 4, 128) == da.fast_options(3, 3, 128)
    assert da.fast_options(3, 8, 128) == da.fast_options(8, 8, 128) == {"num_stages": 3}
    assert da.fast_options(2, 3, 128) == da.fast_options(8, 8, 64) == {"num_stages": 2, "maxnreg": 128}
    got = da.decode_attention(q, ks, vs, 0.125, num_stages=3, maxnreg=168, num_warps=4)
    assert launches["fast"] == {
        "BLOCK_NS": (128,),
        "STAGES": (3,),
        "num_stages": 3,
        "maxnreg": 168,
        "num_warps": 4,
    }
    assert launches["generic"] == {"BLOCK_N": da.BLOCK_N, "num_stages": 3, "maxnreg": 168, "num_warps": 4}
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)  # launch options do not change the result


def test_fast_buckets_of_a_mixed_map_share_one_launch(device, monkeypatch):
    """A mixed map's fast buckets are branches of one launch, each with its own widths, tile and pipeline stages
    (FAST_LAUNCH); the launch takes the tightest register cap and the fewest stages; the heads go in bucket
    order; caller options win for every branch. The output matches the float64 oracle."""
    from kernels import decode_attention as da

    calls, kernel = [], da._decode_packed_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append((grid, args, kwargs))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(da, "_decode_packed_kernel", Recorder())
    bits = (8, 2, 3, 2)
    ks, vs = _stores(bits, bits, 128, 32, False, device, seed=9)
    q = torch.randn(B, 2 * len(bits), 128).to(device=device, dtype=torch.bfloat16)
    out = da.decode_attention(q, ks, vs, 128**-0.5, num_splits=2)
    ref = reference.attention_reference(q[:, :, None], ks.dequantize(), vs.dequantize(), 128**-0.5)[:, :, 0]
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    ((grid, args, kwargs),) = calls
    assert (kwargs["KWS"], kwargs["VWS"]) == ((2, 3, 8), (2, 3, 8))
    assert kwargs["BLOCK_NS"] == tuple(da.fast_block_n(w, w, 128) for w in (2, 3, 8)) == (128, 64, 64)
    assert kwargs["STAGES"] == (2, 2, 3) and kwargs["num_stages"] == 2 and kwargs["maxnreg"] == 128
    *_, heads, starts = da._store_map_plan(ks, vs, q.device, q.dtype)
    assert heads.tolist() == [1, 3, 2, 0] and starts == (0, 2, 3, 4) and grid[0] == B * 4
    assert any(a is heads for a in args) and any(a is starts for a in args)
    calls.clear()
    da.decode_attention(q, ks, vs, 128**-0.5, num_stages=3, maxnreg=0)
    ((_, _, kwargs),) = calls
    assert kwargs["STAGES"] == (3, 3, 3) and kwargs["num_stages"] == 3 and "maxnreg" not in kwargs


def test_fast_buckets_of_a_mixed_map_split_as_long_as_a_uniform_map():
    """A fast bucket of few heads is split as if it held every head (the generic ones for their own count),
    each at its own width's tile."""
    from kernels.decode_attention import fast_block_n, plan_splits

    uniform = [PackedStore([4] * 8, 64, 2) for _ in range(2)]
    mixed = [PackedStore([2, 2, 2, 2, 4, 4, 8, 3], 64, 2) for _ in range(2)]
    _, (plan,), _ = plan_splits(*uniform, 8192, None, torch.device("cpu"), q_dtype=torch.float16)
    _, plans, _ = plan_splits(*mixed, 8192, None, torch.device("cpu"), q_dtype=torch.float16)
    assert plan[0] == fast_block_n(4, 4, 64)
    fast = {w: plans[i] for i, w in ((0, 2), (2, 4), (3, 8))}  # buckets in width order: 2, 3, 4, 8 bits
    assert {w: tile for w, (tile, _) in fast.items()} == {w: fast_block_n(w, w, 64) for w in fast}
    # fast buckets: splits as long as the uniform map's
    assert {chunk for _, chunk in fast.values()} == {plan[1]}
    tile, chunk = plans[1]  # (3, 3): the generic kernel, one head: more, shorter splits
    assert tile == 32 and chunk < plan[1]


def _codes_stores(k_bits, v_bits, head_dim, length, capacity, device, seed):
    """Codes-only K and V stores of `length` random tokens each (B batch rows), garbage in the capacity past them."""
    gen = torch.Generator().manual_seed(seed)
    stores = []
    for bits in (k_bits, v_bits):
        st = PackedStore(bits, head_dim, B, codes_only=True, device=device, capacity=capacity)
        _fill_garbage(st)
        codes = torch.stack([torch.randint(0, 1 << b, (B, length, head_dim), generator=gen) for b in bits], 1)
        st.append_codes(codes.to(device))
        stores.append(st)
    return stores


def _block_queries(hq, blocks, head_dim, dtype, device, seed):
    """A query (B, hq, blocks, D) in `dtype` and a float32 bias (B, hq, blocks) per block, of the sizes the codes'
    domain gives them (scores of a few units over codes up to 255)."""
    gen = torch.Generator().manual_seed(seed)
    qb = torch.randn(B, hq, blocks, head_dim, generator=gen) * head_dim**-0.5
    return qb.to(device, dtype), (torch.randn(B, hq, blocks, generator=gen) * 4).to(device)


@pytest.mark.parametrize(
    "k_bits, v_bits, head_dim, qblock, hq, q_dtype, n_extra, fast",
    [
        ((4, 4, 4), (4, 4, 4), 128, 128, 12, torch.float16, 5, True),  # the default tile, 4 queries a KV head
        ((2, 4, 8), (8, 2, 4), 128, 64, 6, torch.bfloat16, 17, True),  # widths mixed per head and role
        ((3, 3), (3, 4), 128, 32, 8, torch.float16, 0, True),  # 128-token tiles of four 32-token blocks
        ((2, 2), (4, 2), 64, 16, 2, torch.float16, 3, True),  # one query a KV head, 16-token blocks, 4 a tile
        ((8,), (4,), 256, None, 3, torch.bfloat16, 2, True),  # one block; a group of 3
        (
            (2, 4, 3),
            (4, 3, 2),
            64,
            48,
            6,
            torch.float32,
            5,
            False,
        ),  # the generic kernel: float32, 3 bits at D 64
        ((4, 2), (4, 3), 96, 32, 4, torch.float16, 5, False),  # a head_dim the fast kernel does not tile
    ],
)
def test_decode_attention_blocks(device, k_bits, v_bits, head_dim, qblock, hq, q_dtype, n_extra, fast,
                                 monkeypatch):  # fmt: skip
    """Codes-only stores, a query and a bias per block of qblock tokens: the output matches the float64 oracle over
    the codes at one split and at several (301 tokens: no whole number of blocks), with and without an extra
    segment in the codes' domain, each bucket in the kernel its widths and dtype take."""
    from kernels import decode_attention as da

    spy = _LaunchSpy(da._decode_packed_kernel)
    monkeypatch.setattr(da, "_decode_packed_kernel", spy)
    L = 301
    ks, vs = _codes_stores(k_bits, v_bits, head_dim, L, L + 20, device, seed=head_dim + hq)
    blocks = -(-L // qblock) if qblock else 1
    qb, bias = _block_queries(hq, blocks, head_dim, q_dtype, device, seed=hq)
    gen = torch.Generator().manual_seed(5)
    kx, vx = (torch.rand(B, len(k_bits), n_extra, head_dim, generator=gen).to(device) * 15 for _ in "kv")
    ref = reference.attention_blocks_reference(
        qb, bias, ks.dequantize(), vs.dequantize(), 0.7, qblock, kx, vx
    )
    extra = dict(k_extra=kx, v_extra=vx) if n_extra else {}
    bound = 1e-5 if q_dtype == torch.float32 else 2e-3
    for num_splits in (1, 3):
        out = torch.full((B, hq, head_dim), float("nan"), device=device)
        da.decode_attention_blocks(qb, bias, ks, vs, 0.7, qblock, num_splits=num_splits, out=out, **extra)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < bound, (num_splits, err)
    assert spy.launches == (2 if fast else 0)


@pytest.mark.parametrize("qblock, block_n", [(32, None), (16, 64), (64, 32), (128, None)])
def test_decode_attention_blocks_tiles_of_several_blocks(device, qblock, block_n):
    """The fast kernel keeps its tile where the tile holds whole query blocks (each block's query read in the step)
    and the generic kernel's tiles divide the block; either way the output is the float64 oracle's, with the last
    tile's padding past the last block (301 tokens) and splits that start inside no block."""
    from kernels import decode_attention as da

    L, head_dim = 301, 128
    ks, vs = _codes_stores((4, 2), (4, 3), head_dim, L, L + 20, device, seed=qblock)
    for q_dtype, fast in ((torch.float16, True), (torch.float32, False)):
        qb, bias = _block_queries(8, -(-L // qblock), head_dim, q_dtype, device, seed=qblock + 1)
        map_plan = da._store_map_plan(ks, vs, qb.device, q_dtype)
        tiles = [tile for tile, _ in da._split_plans(map_plan, ks, L, block_n, qb.device, None, qblock)[0]]
        want = block_n or (da.fast_block_n(4, 4, head_dim, True) if fast else da.BLOCK_N)
        assert tiles == [want if fast else min(want, qblock)] * 2, (q_dtype, tiles)
        ref = reference.attention_blocks_reference(qb, bias, ks.dequantize(), vs.dequantize(), 0.6, qblock)
        for num_splits in (1, 2):
            out = da.decode_attention_blocks(
                qb, bias, ks, vs, 0.6, qblock, num_splits=num_splits, block_n=block_n
            )
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < (2e-3 if fast else 1e-5), (q_dtype, num_splits, err)


def test_decode_attention_blocks_length_on_device(device):
    """length as a device tensor (a CUDA graph's): the splits cover the capacity (its blocks in qb), most of it
    garbage past the stored tokens, and the output is the host length's."""
    from kernels.decode_attention import decode_attention_blocks

    L, cap, qblock = 150, 400, 32
    ks, vs = _codes_stores((4, 2), (2, 4), 128, L, cap, device, seed=8)
    assert ks.capacity >= cap
    qb, bias = _block_queries(8, -(-ks.capacity // qblock), 128, torch.float16, device, seed=8)
    want = decode_attention_blocks(qb, bias, ks, vs, 1.0, qblock, num_splits=1)
    length = torch.tensor([L], dtype=torch.int32, device=device)
    got = decode_attention_blocks(qb, bias, ks, vs, 1.0, qblock, length=length)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ref = reference.attention_blocks_reference(qb, bias, ks.dequantize(), vs.dequantize(), 1.0, qblock)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 2e-3


def test_decode_attention_blocks_extra_only_and_refusals(device):
    """Empty codes-only stores with an extra segment attend to it alone, with block 0's query and bias; stores of
    the other kind, a block of no whole number of 16 tokens and a tile that neither divides the block nor holds whole
    blocks are refused."""
    from kernels.decode_attention import decode_attention, decode_attention_blocks

    ks, vs = (PackedStore((4, 2), 64, B, codes_only=True, device=device) for _ in "kv")
    qb, bias = _block_queries(4, 1, 64, torch.float16, device, seed=2)
    gen = torch.Generator().manual_seed(2)
    kx, vx = (torch.randn(B, 2, 7, 64, generator=gen).to(device) * 3 for _ in "kv")
    out = decode_attention_blocks(qb, bias, ks, vs, 0.5, 128, k_extra=kx, v_extra=vx)
    ref = reference.attention_blocks_reference(qb, bias, ks.dequantize(), vs.dequantize(), 0.5, 128, kx, vx)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3
    with pytest.raises(AssertionError, match="decode_attention_blocks"):
        decode_attention(qb[:, :, 0], ks, vs, 0.5)
    plain = PackedStore((4, 2), 64, B, device=device)
    with pytest.raises(AssertionError, match="codes-only"):
        decode_attention_blocks(qb, bias, plain, plain, 0.5, 128)
    with pytest.raises(ValueError, match="qblock: 40"):
        decode_attention_blocks(qb, bias, ks, vs, 0.5, 40, k_extra=kx, v_extra=vx)
    with pytest.raises(ValueError, match="block_n: 32; allowed: a divisor or a multiple of qblock 48"):
        decode_attention_blocks(qb, bias, ks, vs, 0.5, 48, block_n=32, k_extra=kx, v_extra=vx)
    for st in (ks, vs):
        st.append_codes(torch.zeros(B, 2, 33, 64, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="qb: 1 blocks for 33 stored tokens of 32 a block"):
        decode_attention_blocks(qb, bias, ks, vs, 0.5, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA, compiled Triton")
@pytest.mark.parametrize(
    "bits, qblock",
    [((4,) * 8, 128), ((4,) * 8, None), ((2,) * 8, 32), ((3,) * 8, 128), ((8,) * 8, None),
     ((2, 2, 2, 2, 4, 4, 8, 8), 128)],
)  # fmt: skip
def test_decode_attention_blocks_compiled_at_the_benchmark_grouping(bits, qblock):
    """Codes-only stores at the benchmark's grouping (32 query / 8 KV heads, head_dim 128), bf16 queries, every width
    at its own default launch (CODES_LAUNCH): the compiled fast kernel (inline PTX: the lanes' code offsets, the
    values' sub.f16x2, the unmasked reads of a block's records) matches the float64 oracle, whole tiles and a part."""
    from kernels.decode_attention import decode_attention_blocks

    L, hq, D = 4099, 32, 128
    gen = torch.Generator().manual_seed(sum(bits) + (qblock or 0))
    ks, vs = (PackedStore(bits, D, 2, codes_only=True, device="cuda", capacity=L) for _ in "kv")
    for st in (ks, vs):
        st.append_codes(
            torch.stack([torch.randint(0, 1 << b, (2, L, D), generator=gen) for b in bits], 1).cuda()
        )
    blocks = -(-L // qblock) if qblock else 1
    qb = (torch.randn(2, hq, blocks, D, generator=gen) * D**-0.5).to("cuda", torch.bfloat16)
    bias = (torch.randn(2, hq, blocks, generator=gen) * 4).cuda()
    kx, vx = (torch.rand(2, len(bits), 4, D, generator=gen).cuda() * 7 for _ in "kv")
    out = decode_attention_blocks(qb, bias, ks, vs, 0.5, qblock, k_extra=kx, v_extra=vx)
    ref = reference.attention_blocks_reference(
        qb, bias, ks.dequantize(), vs.dequantize(), 0.5, qblock, kx, vx
    )
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA, compiled Triton")
def test_decode_attention_blocks_replays_in_a_cuda_graph():
    """decode_attention_blocks at a device-side length, captured once and replayed as the stores grow within their
    capacity (qb holds the capacity's blocks): each replay matches the oracle over the tokens stored."""
    from kernels.decode_attention import decode_attention_blocks

    bits, D, hq, cap, qblock, batch = (2, 4, 8, 3), 128, 16, 512, 128, 2
    gen = torch.Generator().manual_seed(12)
    ks, vs = (PackedStore(bits, D, batch, codes_only=True, device="cuda", capacity=cap) for _ in "kv")
    codes = [
        torch.stack([torch.randint(0, 1 << b, (batch, cap, D), generator=gen) for b in bits], 1) for _ in "kv"
    ]
    for st, c in zip((ks, vs), codes):
        st.append_codes(c[:, :, :200].cuda())
    blocks = -(-ks.capacity // qblock)
    qb = torch.empty(batch, hq, blocks, D, dtype=torch.bfloat16, device="cuda")
    bias = torch.empty(batch, hq, blocks, device="cuda")
    out = torch.empty(batch, hq, D, device="cuda")
    length = torch.tensor([200], dtype=torch.int32, device="cuda")

    def step():
        decode_attention_blocks(qb, bias, ks, vs, D**-0.5, qblock, out=out, length=length)

    side = torch.cuda.Stream()  # warm-up (compiles, allocates the workspaces) outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for n in (201, 260, 384, 385):
        for st, c in zip((ks, vs), codes):
            st.append_codes(c[:, :, st.length : n].cuda())
        length.fill_(n)
        qb.copy_((torch.randn(batch, hq, blocks, D, generator=gen) * D**-0.5).to("cuda", torch.bfloat16))
        bias.copy_(torch.randn(batch, hq, blocks, generator=gen) * 4)
        graph.replay()
        ref = reference.attention_blocks_reference(
            qb, bias, ks.dequantize(), vs.dequantize(), D**-0.5, qblock
        )
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-3, n
