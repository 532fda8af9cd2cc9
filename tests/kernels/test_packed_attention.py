"""kernels/packed_attention.py against the float64 oracle (dequantize, then reference.attention_reference).

Fresh random K/V and queries per case, odd lengths and batch sizes, every width, mixed widths, GQA, decode
(one query), chunks (causal, and under a sliding-window mask), and every store of harness/schemes.
"""

from __future__ import annotations

import pytest
import torch

from harness.schemes import get_scheme
from kernels import reference
from kernels.layout import PackedStore
from kernels.packed_attention import packed_attention

TOL = 1e-4


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def filled(bits, T, B, D, g, symmetric, seed, dtype=torch.float32):
    """(keys, values) PackedStores holding T fresh random tokens, appended in a prefill and a few decode steps."""
    gen = torch.Generator().manual_seed(seed)
    stores = []
    for _ in range(2):
        store = PackedStore(bits, D, B, g, symmetric, dtype=dtype, simulate=False)
        x = torch.randn(B, len(bits), T, D, generator=gen) * torch.rand(1, len(bits), 1, D, generator=gen) * 4
        x = x.to(dtype)
        cut = max(T - 3, 1)
        store.append(x[:, :, :cut])
        for t in range(cut, T):
            store.append(x[:, :, t : t + 1])
        stores.append(store)
    return stores


CASES = [  # (bits per KV head, tokens, queries, batch, head_dim, group size, query heads per KV head)
    ([4, 4, 4], 63, 1, 3, 64, 32, 3),
    ([2, 2], 1000, 1, 3, 64, 32, 2),
    ([3, 3, 3], 63, 1, 1, 64, 16, 1),
    ([8, 8], 1000, 1, 2, 32, 32, 4),
    ([16, 16], 63, 1, 3, 32, 16, 2),
    ([2, 16, 3, 4, 8], 1000, 1, 3, 64, 32, 2),  # every width in one layer
    ([4, 2, 4], 300, 37, 2, 64, 32, 3),  # a chunk of 37 queries
    ([8, 3, 16], 63, 63, 3, 32, 8, 2),  # a prefill: queries = tokens
    ([2, 4], 1000, 300, 1, 64, 64, 1),  # a long chunk: query blocks of 256
]


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("bits, T, Tq, B, D, g, G", CASES, ids=[f"{c[0]}-T{c[1]}-q{c[2]}" for c in CASES])
def test_packed_attention_matches_the_oracle(bits, T, Tq, B, D, g, G, symmetric):
    seed = T + Tq + sum(bits) + symmetric
    k_store, v_store = filled(bits, T, B, D, g, symmetric, seed)
    q = torch.randn(B, len(bits) * G, Tq, D, generator=torch.Generator().manual_seed(seed + 1))
    scale = D**-0.5
    want = reference.attention_reference(q, k_store.dequantize(), v_store.dequantize(), scale, T - Tq)
    got = packed_attention(q, k_store, v_store, scale)
    assert got.shape == (B, len(bits) * G, Tq, D) and got.dtype == torch.float32
    assert rel_err(got, want) < TOL
    small = packed_attention(q, k_store, v_store, scale, block=16)  # many blocks: the online-softmax merge
    assert rel_err(small, want) < TOL


@pytest.mark.parametrize("block", [None, 48])
@pytest.mark.parametrize("Tq", [1, 37, 300])
def test_bfloat16_is_attended_in_bfloat16_within_twice_the_rounding_of_the_exact_answer(Tq, block):
    """bf16 queries and stores (a 16-bit head among them): bf16 products with float32 accumulation come within 2x
    the error of rounding the float64 oracle's answer itself to bf16."""
    bits, T, B, D = [4, 16, 2], 300, 2, 64
    k_store, v_store = filled(bits, T, B, D, 32, False, Tq, torch.bfloat16)
    q = torch.randn(B, 9, Tq, D, generator=torch.Generator().manual_seed(Tq + 1)).bfloat16()
    want = reference.attention_reference(q, k_store.dequantize(), v_store.dequantize(), D**-0.5, T - Tq)
    got = packed_attention(q, k_store, v_store, D**-0.5, block=block)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert rel_err(got, want) < 2 * rel_err(want.bfloat16(), want)


@pytest.mark.parametrize("as_bool", [True, False], ids=["bool", "additive"])
def test_a_sliding_window_mask_hides_what_the_oracle_hides(as_bool):
    """A sliding layer's chunk: query i sees keys (i - window, i] of the 50 stored, as the model's mask says."""
    bits, T, Tq, B, D, window = [4, 2], 50, 20, 3, 32, 16
    k_store, v_store = filled(bits, T, B, D, 16, False, 11)
    q = torch.randn(B, 4, Tq, D)
    i = torch.arange(T - Tq, T).unsqueeze(-1)  # (Tq, 1) stored position of each query
    j = torch.arange(T)  # (T,)
    visible = (j <= i) & (j > i - window)  # (Tq, T)
    mask = visible[None, None] if as_bool else torch.where(visible, 0.0, float("-inf"))[None, None]
    got = packed_attention(q, k_store, v_store, 0.2, mask=mask, block=16)
    k64 = k_store.dequantize().double().repeat_interleave(2, 1)
    v64 = v_store.dequantize().double().repeat_interleave(2, 1)
    scores = (q.double() @ k64.transpose(-1, -2) * 0.2).masked_fill(~visible, float("-inf"))
    want = torch.softmax(scores, -1) @ v64
    assert rel_err(got, want) < TOL


def test_a_row_that_sees_no_key_gives_zeros_and_the_others_are_unchanged():
    """A padded batch row: the model's mask hides every key from batch row 1's first two queries (and only those)."""
    bits, T, Tq, B, D = [4, 8], 90, 5, 2, 32
    k_store, v_store = filled(bits, T, B, D, 16, False, 7)
    q = torch.randn(B, 4, Tq, D)
    visible = (torch.arange(T) <= torch.arange(T - Tq, T).unsqueeze(-1)).repeat(B, 1, 1, 1)  # (B, 1, Tq, T)
    visible[1, :, :2] = False
    got = packed_attention(q, k_store, v_store, 0.3, mask=visible, block=32)
    assert torch.equal(got[1, :, :2], torch.zeros_like(got[1, :, :2]))
    want = reference.attention_reference(q, k_store.dequantize(), v_store.dequantize(), 0.3, T - Tq)
    assert rel_err(got[0], want[0]) < TOL and rel_err(got[1, :, 2:], want[1, :, 2:]) < TOL


def test_softcap_matches_the_oracle_with_capped_logits():
    k_store, v_store = filled([4, 8], 77, 2, 32, 32, False, 5)
    q = torch.randn(2, 2, 1, 32) * 10
    got = packed_attention(q, k_store, v_store, 1.0, softcap=5.0, block=32)
    scores = q.double() @ k_store.dequantize().double().transpose(-1, -2)
    want = torch.softmax(torch.tanh(scores / 5.0) * 5.0, -1) @ v_store.dequantize().double()
    assert rel_err(got, want) < TOL


SCHEME_CASES = [  # (scheme, sink tokens, residual): every store of harness/schemes and its wrappers
    ("asym_token", 0, 0),
    ("sym_token", 3, 5),
    ("kivi", 0, None),
    ("kivi", 2, 7),
    ("fp8", 0, 0),
    ("fp8", 4, 3),
    ("rotate+asym_token", 0, 0),
    ("rotate+kivi", 3, None),
    ("rotate+fp8", 0, 2),
]


@pytest.mark.parametrize(
    "name, sinks, residual", SCHEME_CASES, ids=[f"{c[0]}-s{c[1]}-r{c[2]}" for c in SCHEME_CASES]
)
@pytest.mark.parametrize("Tq", [1, 9])
def test_every_store_is_attended_from_its_stored_form(name, sinks, residual, Tq):
    scheme = get_scheme(name, group_size=8, sink_tokens=sinks, residual=residual)
    bits = [8, 16, 8] if scheme.widths == (8,) else [2, 16, 4]
    B, T, D = 3, 61, 32
    torch.manual_seed(len(name) + sinks + Tq)
    stores = []
    for role in ("key", "value"):
        store = scheme.new_store(bits, D, B, torch.float32, "cpu", role=role)
        x = torch.randn(B, 3, T, D)
        for start, end in ((0, 40), (40, 41), (41, 49), (49, 61)):
            assert store.append(x[:, :, start:end]) is None  # nothing dequantized is returned or kept
        stores.append(store)
    q = torch.randn(B, 6, Tq, D)
    want = reference.attention_reference(q, stores[0].dequantize(), stores[1].dequantize(), 0.3, T - Tq)
    assert rel_err(packed_attention(q, *stores, 0.3, block=16), want) < TOL


@pytest.mark.parametrize("name", ["codebook", "rotate+asym_token"])
def test_a_rotated_store_behind_sink_tokens_turns_queries_and_outputs_not_its_tokens(name, monkeypatch):
    """The stored tokens stay in the rotated domain: only the queries, the outputs and the unquantized sink tokens
    are turned, whatever the length of the blocks read."""
    scheme = get_scheme(name, group_size=8, sink_tokens=2, residual=0)
    B, T, D, G, Tq = 2, 70, 32, 3, 1
    torch.manual_seed(9)
    stores = [
        scheme.new_store([4, 16, 4], D, B, torch.float32, "cpu", role=role) for role in ("key", "value")
    ]
    for store in stores:
        store.append(torch.randn(B, 3, T, D))
    rows_turned = []
    rotate = reference.hadamard_rotate

    def counting(x, *args, **kwargs):
        rows_turned.append(x.shape[-2])
        return rotate(x, *args, **kwargs)

    monkeypatch.setattr(reference, "hadamard_rotate", counting)
    q = torch.randn(B, 3 * G, Tq, D)
    got = packed_attention(q, *stores, 0.3, block=16)
    assert rows_turned and max(rows_turned) <= max(G * Tq, 2), rows_turned
    monkeypatch.setattr(reference, "hadamard_rotate", rotate)
    want = reference.attention_reference(q, stores[0].dequantize(), stores[1].dequantize(), 0.3, T - Tq)
    assert rel_err(got, want) < TOL
