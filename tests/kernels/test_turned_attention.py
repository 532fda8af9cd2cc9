"""The turned-key decode kernel (kernels/turned_attention.py) against what it reads: attention over the tokens a
pca_gsa / pca_ugsa store (harness/schemes/pca.py) dequantizes, its codes repacked as kernels.groups rows; and
against a float64 oracle written from the format's contract on random codes under random grouped plans (planes
included), positions starting anywhere, GQA, split and tile sizes that leave ragged tails.

Without CUDA the kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harness.calibrate.pca import _head_fits, shared_tables
from harness.schemes import get_scheme
from harness.schemes.pca import PcaStore
from harness.schemes.pca_table import LLOYD, PCA_WIDTHS, UNIFORM, component_values, level_tables
from kernels import groups
from kernels.turned_attention import fold_uniform, turn_tables, turned_attention

CPU = torch.device("cpu")
# CPU tensors through Triton's interpreter only: the GPU check's test stage (kernels/gpu/check.py's GPU_TEST_FILES)
# does not run this prototype's compiles, and elsewhere a compiled launch needs CUDA tensors
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need TRITON_INTERPRET=1"
)


def _theta(d: int) -> torch.Tensor:
    return 10000.0 ** (-torch.arange(d // 2, dtype=torch.float32) / (d // 2))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q (B, Hq, D) over k, v (B, Hkv, T, D), float64."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q.double()[:, :, None], k, v)[:, :, 0]


def _correlated(n: int, heads: int, d: int, seed: int) -> torch.Tensor:
    """(n, heads, d) vectors of correlated channels, decaying variance and an offset (keys or values to fit)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(heads, d, d, generator=g) / d**0.5
    z = torch.randn(n, heads, d, generator=g) * torch.logspace(0.7, -1.5, d)
    return torch.einsum("nhc,hcd->nhd", z, mix) + torch.linspace(-1, 2, d)


def _turn(x: torch.Tensor, positions: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """x (..., T, D) float64 with pairs (i, i + D / 2) turned by positions (T,) * theta, in complex float64."""
    half = len(theta)
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(
        torch.ones(len(positions), half, dtype=torch.float64), positions.double()[:, None] * theta.double()
    )
    return torch.cat([z.real, z.imag], -1)


@pytest.mark.parametrize(
    ("name", "d", "width", "length", "block_n", "splits"),
    [("pca_gsa", 64, 4, 77, 32, 2), ("pca_ugsa", 64, 3, 45, 16, 3)],
)
def test_attends_over_what_the_store_holds(name, d, width, length, block_n, splits):
    """A store of the format (fitted in it, two KV heads at one width sharing their plan, one sink token before
    it) holds post-RoPE keys and values; the kernel over its codes, repacked as grouped rows, gives the attention
    that its dequantized tokens (PcaStore.block) give, within the fp16 operands' rounding."""
    fmt = get_scheme(name).pca_format
    hkv, hq, batch = 2, 8, 2
    theta = _theta(d)
    pre_keys, values = _correlated(600, hkv, d, 1), _correlated(600, hkv, d, 2)
    tables = [shared_tables([_head_fits(x, fmt)], PCA_WIDTHS, fmt)[0] for x in (pre_keys, values)]
    g = torch.Generator().manual_seed(3)
    pick = torch.randint(0, 600, (batch * length,), generator=g)
    positions = torch.arange(1, length + 1)  # after the sink token
    keys = _turn(
        pre_keys[pick].view(batch, length, hkv, d).transpose(1, 2).double(), positions, theta
    ).float()
    vals = values[pick].view(batch, length, hkv, d).transpose(1, 2).contiguous()
    stores = [
        PcaStore([width] * hkv, d, batch, torch.float32, CPU, table, theta if role == "key" else torch.zeros(0),
                 1, False, fmt)
        for role, table in (("key", tables[0]), ("value", tables[1]))
    ]  # fmt: skip
    for store, x in zip(stores, (keys, vals)):
        store.append(x[:, :, :30])
        store.append(x[:, :, 30:])
    parts = []
    for store in stores:
        plan = tuple(int(b) for b in store.plan[width][0].view(-1, groups.GROUP)[:, 0])
        codes = groups.pack(store._codes(width, 0, length), plan)
        basis = store.basis[width].float() * store.scale[width].float()[:, None, :]  # A = U diag(s)
        parts.append((codes, plan, basis, store.mean[width].float()))
    (kc, kplan, ka, km), (vc, vplan, va, vm) = parts
    assert len(set(kplan)) > 1  # the fitted plans are grouped, not flat
    q = torch.randn(batch, hq, d, generator=g) * 2
    levels = level_tables(CPU, fmt.levels)[0]
    first = stores[0].positions.next - stores[0].length
    got = turned_attention(q, kc, vc, kplan, vplan, ka, km, va, vm, levels, theta, first, d**-0.5,
                           uniform=fmt.levels == UNIFORM, splits=splits, block_n=block_n)  # fmt: skip
    want = _attention(q, stores[0].block(0, length), stores[1].block(0, length))
    scale = want.abs().max()
    torch.testing.assert_close(got.double() / scale, want / scale, atol=4e-3, rtol=0)
    # the turn is felt: the same codes read unturned give another answer
    unturned = turned_attention(q, kc, vc, kplan, vplan, ka, km, va, vm, levels, torch.zeros_like(theta), first,
                                d**-0.5, uniform=fmt.levels == UNIFORM, splits=splits, block_n=block_n)  # fmt: skip
    assert (unturned - got).abs().max() > 0.05 * scale


@st.composite
def _plan(draw, d: int):
    """A grouped plan at head_dim d that the kernels read: a unit width w (1 to 6), its w d / 16 bits moved between
    the d / 16 groups (each 0 to 8 bits wide), so planes of 1, 2, 4 and 8 bits mix."""
    w = draw(st.integers(1, 6))
    plan = [w] * (d // groups.GROUP)
    for i, j in draw(
        st.lists(st.tuples(st.integers(0, len(plan) - 1), st.integers(0, len(plan) - 1)), max_size=8)
    ):
        if plan[i] > 0 and plan[j] < 8:
            plan[i], plan[j] = plan[i] - 1, plan[j] + 1
    plan = tuple(plan)
    try:
        groups.check_plan(plan, w, d)
    except ValueError:
        assume(False)
    return plan


@st.composite
def _case(draw):
    d = draw(st.sampled_from([32, 64, 128]))
    return d, draw(_plan(d)), draw(_plan(d))


@settings(max_examples=5, deadline=None)
@given(
    case=_case(), length=st.integers(1, 100),
    first=st.integers(0, 40000), block_n=st.sampled_from([16, 32]), splits=st.integers(1, 4),
    kind=st.sampled_from([LLOYD, UNIFORM]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_the_format_contract_on_random_codes(case, length, first, block_n, splits, kind, seed):
    """Random codes under random plans (groups of any width 0 to 8, so planes of 1, 2, 4 and 8 bits), a random basis
    and mean per head, tokens from any position: the kernel against the format's contract in float64 (each code to
    its width's level, through the basis, keys turned by their own position, softmax attention)."""
    d, kplan, vplan = case
    g = torch.Generator().manual_seed(seed)
    batch, hkv, hq = 2, 2, 4
    codes = [
        torch.cat(
            [torch.randint(0, 1 << w, (batch, hkv, length, groups.GROUP), generator=g) for w in plan], -1
        )
        for plan in (kplan, vplan)
    ]
    bases = [torch.linalg.qr(torch.randn(hkv, d, d, generator=g))[0] * (torch.rand(hkv, 1, d, generator=g) + 0.5)
             for _ in range(2)]  # fmt: skip
    means = [torch.randn(hkv, d, generator=g) for _ in range(2)]
    theta = _theta(d)
    q = torch.randn(batch, hq, d, generator=g) * 2
    levels = level_tables(CPU, kind)[0]
    got = turned_attention(q, groups.pack(codes[0], kplan), groups.pack(codes[1], vplan), kplan, vplan, bases[0],
                           means[0], bases[1], means[1], levels, theta, first, d**-0.5, uniform=kind == UNIFORM,
                           splits=splits, block_n=block_n)  # fmt: skip
    tokens = []
    for c, plan, basis, mean in zip(codes, (kplan, vplan), bases, means):
        widths = torch.tensor(plan).repeat_interleave(groups.GROUP).expand(hkv, d)
        z = component_values(c, widths, torch.ones(hkv, d), kind).double()  # (B, Hkv, T, D)
        tokens.append(mean.double()[None, :, None] + torch.einsum("bhtc,hdc->bhtd", z, basis.double()))
    keys = _turn(tokens[0], torch.arange(first, first + length), theta)
    want = _attention(q, keys, tokens[1])
    scale = want.abs().max()
    torch.testing.assert_close(got.double() / scale, want / scale, atol=4e-3, rtol=0)


def test_fold_uniform_gives_the_levels_through_the_basis():
    """fold_uniform's basis and mean turn codes into what the evenly spaced levels through the basis give."""
    plan, d, h = (3, 0, 8, 1), 64, 2
    g = torch.Generator().manual_seed(0)
    levels = level_tables(CPU, UNIFORM)[0]
    basis, mean = torch.randn(h, d, d, generator=g), torch.randn(h, d, generator=g)
    codes = torch.cat([torch.randint(0, 1 << w, (1, h, 5, groups.GROUP), generator=g) for w in plan], -1)
    widths = torch.tensor(plan).repeat_interleave(groups.GROUP).expand(h, d)
    want = mean[None, :, None] + torch.einsum("bhtc,hdc->bhtd", component_values(codes, widths, torch.ones(h, d),
                                                                                   UNIFORM), basis)  # fmt: skip
    folded, shifted = fold_uniform(basis, mean, plan, levels)
    got = shifted[None, :, None] + torch.einsum("bhtc,hdc->bhtd", codes.float(), folded)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_turn_tables_by_hand():
    """A tile's turns are its first token's position times theta; a row's, its place in the tile."""
    theta = torch.tensor([1.0, 0.5])
    tiles, rows = turn_tables(theta, 3, 70, 32)
    assert tiles.shape == (3, 4) and rows.shape == (32, 4) and rows.dtype == torch.float16
    angles = torch.tensor([67.0, 33.5])  # tile 2's first token: position 3 + 2 * 32
    torch.testing.assert_close(tiles[2], torch.cat([angles.cos(), angles.sin()]))
    angles = torch.tensor([5.0, 2.5])
    torch.testing.assert_close(rows[5].float(), torch.cat([angles.cos(), angles.sin()]), atol=1e-3, rtol=0)
