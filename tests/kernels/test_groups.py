"""Grouped plans (kernels/groups.py): their rows against the bitstream format, their tiles against their column
tables, and the codes-only kernels that read and write them (kernels/decode_attention.py, kernels/quantize.py)
against the float64 oracle and torch's coding.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harness.schemes import bitstream
from harness.schemes.pca_table import UNIFORM, level_tables, quantize_components
from kernels import groups, reference
from kernels.layout import PackedStore

B = 2


def _plan_widths(plan: tuple[int, ...]) -> torch.Tensor:
    """A plan's per-component widths (D,)."""
    return torch.tensor([w for w in plan for _ in range(groups.GROUP)])


def _random_codes(plan: tuple[int, ...], lead: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Codes (*lead, D) in range for each component's group width (0 at 0 bits)."""
    parts = [torch.randint(0, 1 << w, (*lead, groups.GROUP), generator=gen) for w in plan]
    return torch.cat(parts, -1)


@st.composite
def _plans(draw, widths=groups.GROUP_WIDTHS, order=lambda plan: plan):
    """A plan the kernels read: G groups (2 to 16), each of `widths`, a whole number of words a row, in `order`."""
    n = draw(st.sampled_from([2, 4, 8, 16]))
    plan = order(tuple(draw(st.lists(st.sampled_from(widths), min_size=n, max_size=n))))
    assume(sum(plan) % 2 == 0 and sum(plan) > 0)
    return plan


@settings(max_examples=40, deadline=None)
@given(_plans((0, 1, 2, 4, 8), lambda plan: tuple(sorted(plan, reverse=True))), st.integers(0, 2**31 - 1))
def test_rows_of_one_plane_a_group_are_the_bitstream_rows(plan, seed):
    """A plan of one plane a group (0, 1, 2, 4, 8 bits) whose widths never grow: pack writes what
    harness.schemes.bitstream packs for the same per-component widths (the torch store's rows), and unpack reads the
    codes back."""
    D = groups.GROUP * len(plan)
    codes = _random_codes(plan, (2, 5, 3), torch.Generator().manual_seed(seed))  # (B, H, T, D)
    rows = groups.pack(codes, plan)
    lay = bitstream.layout(_plan_widths(plan)[None].expand(5, -1))
    assert torch.equal(rows, bitstream.pack(codes, lay))
    assert torch.equal(groups.unpack(rows, plan).long(), codes)
    assert sorted(groups.columns(plan)) == list(range(D))  # every component in one column


@settings(max_examples=60, deadline=None)
@given(_plans(), st.integers(0, 2**31 - 1))
def test_any_plan_packs_its_planes_and_reads_back(plan, seed):
    """Any plan of widths 0 to 8 in any order: rows of 16 sum(plan) bits that unpack reads back, every component in
    one key and one value column, plan_code one pass a plane of the widest group."""
    D = groups.GROUP * len(plan)
    codes = _random_codes(plan, (3, 4), torch.Generator().manual_seed(seed))
    rows = groups.pack(codes, plan)
    assert rows.shape[-1] == 2 * sum(plan) == sum(plan) * groups.GROUP // 8
    assert torch.equal(groups.unpack(rows, plan).long(), codes)
    assert sorted(groups.columns(plan)) == sorted(groups.value_columns(plan)) == list(range(D))
    passes = max(len(groups.planes(w)) for w in plan)
    assert groups.plan_code(plan) >> (groups.PASS_BITS * (passes - 1)) > 0
    assert groups.plan_code(plan) >> (groups.PASS_BITS * passes) == 0


def test_planes_lie_where_the_docstring_puts_them():
    """Hand-placed bits of plan (5, 4, 4, 3) (planes 4 + 1, 4, 4, 2 + 1): the 4-bit planes of groups 0, 1, 2 in halves
    0-11, group 3's 2-bit plane in halves 12-13, the 1-bit planes of groups 0 and 3 in halves 14 and 15; a 1-bit
    plane under a 4-bit one holds component i's bit at place i with bits 2 and 3 swapped."""
    plan = (5, 4, 4, 3)
    codes = torch.zeros(64, dtype=torch.long)
    codes[0] = 0b10110  # group 0's 4-bit plane: 0b1011 at component 0's nibble; its low bit 0
    codes[4] = 0b00001  # group 0's 1-bit plane: place 8 (4 with bits 2 and 3 swapped)
    codes[16] = 0b1001  # group 1: one 4-bit plane
    codes[48 + 5] = 0b111  # group 3: 2-bit plane 0b11 at component 5, its 1-bit plane's place 5
    rows = groups.pack(codes, plan)
    want = torch.zeros(32, dtype=torch.uint8)
    want[0] = 0x0B  # half 0: group 0's 4-bit codes 0, 1 in byte 0
    want[8] = 0x09  # half 4: group 1's
    want[24 + 1] = 0b11 << 2  # half 12: group 3's 2-bit plane, component 5 at bits 10, 11
    want[28 + 1] = 0x01  # half 14: group 0's 1-bit plane, place 8
    want[30] = 1 << 5  # half 15: group 3's 1-bit plane (under a 2-bit one: place 5)
    assert torch.equal(rows, want)
    assert groups.plane_starts(plan) == {(0, 4): 0, (1, 4): 4, (2, 4): 8, (3, 2): 12, (0, 1): 14, (3, 1): 15}


def test_offsets_by_hand():
    """What each column's lane adds to its code, by hand (a lane's columns 4 c + 2 i_lo + h: pair i_lo, fp16 lane
    h). A plane of 1, 2 or 4 bits makes a lane's two pairs from one rotation, pair 0 on the field below pair 1's,
    under an exponent a field's ratio higher (4 bits: 256 against 16, 2 bits: 16 against 4, 1 bit: 4 and 1024
    against 2 and 512), but a 7-bit group's 4-bit plane (256 x 8 would pass 2048); a group of several planes sums its
    planes' offsets, each scaled as its plane (5 = 4 + 1: 2 (256 or 16) + (4, 1024, 2 or 512); 3 = 2 + 1: 2 (16 or
    4) + ...; 6 = 4 + 2: 4 (256 or 16) + (16 or 4); 7 = 4 + 2 + 1: 8 (16) + 2 (16 or 4) + ...)."""
    lane = {
        4: [256.0, 256.0, 16.0, 16.0],
        2: [16.0, 16.0, 4.0, 4.0],
        1: [4.0, 1024.0, 2.0, 512.0],
        8: [1024.0] * 4,
        5: [516.0, 1536.0, 34.0, 544.0],
        3: [36.0, 1056.0, 10.0, 520.0],
        6: [1040.0, 1040.0, 68.0, 68.0],
        7: [164.0, 1184.0, 138.0, 648.0],
    }
    for plan in [(4, 2, 1, 1), (8, 4, 2, 1), (5, 4, 4, 3), (7, 4, 4, 1), (6, 5, 3, 2)]:
        assert groups.offsets(plan) == [x for w in plan for x in lane[w] * 4], plan
    for plan in [(7, 7, 7, 7), (5, 6, 7, 3)]:  # every lane stays an exact fp16 integer
        assert max(groups.offsets(plan)) + 127 <= 2048


def test_check_plan_refusals():
    groups.check_plan((4, 2, 1, 1), 2, 64)
    groups.check_plan((1, 2, 4, 1), 2, 64)  # any order: planes of 2 bits or more always start on a word
    groups.check_plan((3, 3, 1, 1), 2, 64)
    with pytest.raises(ValueError, match="4 group widths"):
        groups.check_plan((4, 2, 1), 2, 64)
    with pytest.raises(ValueError, match="each 0 to 8"):
        groups.check_plan((9, 1, 1, 1), 3, 64)
    with pytest.raises(ValueError, match="holds 112 bits a row; a 2-bit head holds 128"):
        groups.check_plan((4, 2, 1, 0), 2, 64)
    with pytest.raises(ValueError, match="head_dim: 96 for a grouped plan; allowed: 32, 64, 128, 256"):
        groups.check_plan((4, 2, 0, 0, 0, 0), 1, 96)
    with pytest.raises(ValueError, match="a grouped plan needs a codes-only store"):
        PackedStore((2,), 64, 1, plans={2: (4, 2, 1, 1)})


@triton.jit
def _tile_kernel(p_ptr, out_ptr, L, PLAN: tl.constexpr, D: tl.constexpr, NW: tl.constexpr, R: tl.constexpr):
    rows = tl.arange(0, R)
    mask = rows < L
    tile = groups.group_tile(p_ptr, rows, mask, PLAN, D, NW, False, True)
    tl.store(out_ptr + rows[:, None] * D + tl.arange(0, D)[None, :], tile.to(tl.float32), mask=mask[:, None])
    cols, offs = groups.group_columns_jit(PLAN, D)
    tl.store(out_ptr + R * D + tl.arange(0, D), cols.to(tl.float32))
    tl.store(out_ptr + (R + 1) * D + tl.arange(0, D), offs)


@pytest.mark.parametrize(
    "plan",
    [
        (4, 2, 1, 1),  # smollm2's 2-bit keys' plan: two 1-bit groups in one word
        (2, 1, 1, 0),
        (8, 8, 4, 4),
        (8, 4, 4, 4, 2, 2, 1, 1),
        (4, 4, 4, 1, 1, 1, 1, 0),  # 1-bit groups in the high halves of words, then nothing
        (8, 8, 8, 8, 4, 4, 4, 4, 4, 2, 2, 2, 2, 1, 1, 0),
        (5, 4, 4, 3),  # pca_block_ugsa's fitted 4-bit plan: planes 4 + 1, 4, 4, 2 + 1
        (8, 7, 7, 6),  # planes 8, 4 + 2 + 1 (three passes), 4 + 2
        (1, 2, 6, 3, 0, 5, 7, 8),  # widths growing and shrinking
    ],
)
def test_group_tile_holds_the_codes_in_its_column_order(device, plan):
    """A tile of 13 tokens (3 rows masked off) holds, at each column, the code `columns` names plus `offsets`'
    offset; the kernel's own tables are the host's."""
    D, L, R = groups.GROUP * len(plan), 13, 16
    codes = _random_codes(plan, (L,), torch.Generator().manual_seed(len(plan) + sum(plan)))
    words = groups.pack(codes, plan).contiguous().view(torch.int32).to(device)
    cols, offs = torch.tensor(groups.columns(plan)), torch.tensor(groups.offsets(plan))
    out = torch.full((R + 2, D), float("nan"), device=device)
    _tile_kernel[(1,)](words, out, L, PLAN=groups.plan_code(plan), D=D, NW=words.shape[1], R=R)
    out = out.cpu()
    assert torch.equal(out[:L], codes[:, cols].float() + offs)
    assert torch.equal(out[R].long(), cols) and torch.equal(out[R + 1], offs)


@triton.jit
def _value_tile_kernel(
    p_ptr, out_ptr, L, PLAN: tl.constexpr, D: tl.constexpr, NW: tl.constexpr, R: tl.constexpr
):
    rows = tl.arange(0, R)
    mask = rows < L
    tile = groups.group_value_tile(p_ptr, rows, mask, PLAN, D, NW, False, True)
    tl.store(out_ptr + rows[:, None] * D + tl.arange(0, D)[None, :], tile.to(tl.float32), mask=mask[:, None])
    tl.store(out_ptr + R * D + tl.arange(0, D), groups.group_value_columns_jit(PLAN, D).to(tl.float32))


@pytest.mark.parametrize(
    "plan",
    [
        (4, 2, 1, 1),
        (2, 1, 1, 0),
        (8, 8, 4, 4),
        (4, 4, 4, 1, 1, 1, 1, 0),
        (8, 8, 8, 8, 4, 4, 4, 4, 4, 2, 2, 2, 2, 1, 1, 0),
        (5, 4, 4, 3),
        (8, 7, 7, 6),
        (1, 2, 6, 3, 0, 5, 7, 8),
    ],
)
def test_value_tile_holds_the_codes_in_its_column_order(device, plan):
    """A value tile of 11 tokens (5 rows masked off) holds, at each column, the code `value_columns` names; the
    kernel's table is the host's, and every component has one column."""
    D, L, R = groups.GROUP * len(plan), 11, 16
    codes = _random_codes(plan, (L,), torch.Generator().manual_seed(7 * len(plan) + sum(plan)))
    words = groups.pack(codes, plan).contiguous().view(torch.int32).to(device)
    cols = torch.tensor(groups.value_columns(plan))
    assert sorted(cols.tolist()) == list(range(D))
    out = torch.full((R + 1, D), float("nan"), device=device)
    _value_tile_kernel[(1,)](words, out, L, PLAN=groups.plan_code(plan), D=D, NW=words.shape[1], R=R)
    out = out.cpu()
    assert torch.equal(out[:L], codes[:, cols].float())
    assert torch.equal(out[R].long(), cols)


def _stores(k_bits, v_bits, k_plans, v_plans, D, L, device, gen):
    """Codes-only K and V stores of L random tokens, some widths under grouped plans, garbage past the tokens."""
    out = []
    for bits, plans in ((k_bits, k_plans), (v_bits, v_plans)):
        st_ = PackedStore(bits, D, B, codes_only=True, device=device, capacity=L + 20, plans=plans)
        for bk in st_.buckets:
            bk.payload.fill_(0xA5)
        parts = [
            _random_codes(plans[b], (B, L), gen)
            if b in plans
            else torch.randint(0, 1 << b, (B, L, D), generator=gen)
            for b in bits
        ]
        st_.append_codes(torch.stack(parts, 1).to(device))
        out.append(st_)
    return out


@pytest.mark.parametrize(
    "k_bits, v_bits, k_plans, v_plans, head_dim, qblock, hq, q_dtype",
    [
        # smollm2-135m's plans (keys at 2 and 5 bits, values at 1 and 6): every bucket grouped, blocks of 64
        ((2, 5), (1, 6), {2: (4, 2, 1, 1), 5: (8, 4, 4, 4)}, {1: (2, 1, 1, 0), 6: (8, 8, 4, 4)}, 64, 64, 6,
         torch.float16),
        # a grouped key bucket beside flat ones, one block, float32 queries (grouped buckets take the fast kernel)
        ((2, 4), (4, 2), {2: (4, 2, 1, 1)}, {}, 64, None, 4, torch.float32),
        ((3, 3), (3, 3), {3: (8, 4, 4, 4, 2, 2, 0, 0)}, {3: (4, 4, 4, 4, 4, 2, 1, 1)}, 128, 128, 4, torch.bfloat16),
        # pca_block_ugsa's plans (any width a group: planes summed), a plan of one width 3 = 2 + 1 at head_dim 64
        ((4, 5), (3, 6), {4: (5, 4, 4, 3), 5: (6, 5, 5, 4)}, {3: (3, 3, 3, 3), 6: (7, 6, 6, 5)}, 64, 64, 6,
         torch.float16),
        ((7, 2), (1, 4), {7: (8, 8, 8, 7, 7, 7, 6, 5), 2: (3, 3, 2, 2, 2, 2, 1, 1)},
         {1: (2, 2, 1, 1, 1, 1, 0, 0), 4: (5, 5, 5, 4, 4, 4, 3, 2)}, 128, 128, 4, torch.bfloat16),
    ],
)  # fmt: skip
def test_decode_attention_blocks_reads_grouped_rows(device, k_bits, v_bits, k_plans, v_plans, head_dim, qblock, hq,
                                                    q_dtype, monkeypatch):  # fmt: skip
    """Codes-only stores whose buckets hold grouped rows: decode_attention_blocks matches the float64 oracle over
    the codes (their numbers, PackedStore.dequantize), at one split and three, with an extra segment in the codes'
    domain, every bucket in the fast kernel's one launch."""
    from kernels import decode_attention as da

    launches, kernel = [], da._decode_packed_kernel

    class Spy:  # counts the fast kernel's launches
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(da, "_decode_packed_kernel", Spy())
    gen = torch.Generator().manual_seed(head_dim + hq)
    L = 150
    ks, vs = _stores(k_bits, v_bits, k_plans, v_plans, head_dim, L, device, gen)
    blocks = -(-L // qblock) if qblock else 1
    qb = (torch.randn(B, hq, blocks, head_dim, generator=gen) * head_dim**-0.5).to(device, q_dtype)
    bias = (torch.randn(B, hq, blocks, generator=gen) * 4).to(device)
    kx, vx = ((torch.rand(B, len(k_bits), 3, head_dim, generator=gen) * 7).to(device) for _ in "kv")
    ref = reference.attention_blocks_reference(
        qb, bias, ks.dequantize(), vs.dequantize(), 0.7, qblock, kx, vx
    )
    for num_splits in (1, 3):
        out = da.decode_attention_blocks(
            qb, bias, ks, vs, 0.7, qblock, k_extra=kx, v_extra=vx, num_splits=num_splits
        )
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < (2e-3 if q_dtype != torch.float32 else 1e-2), (
            num_splits,
            err,
        )  # float32 q: rounded to fp16
    assert len(launches) == 2


def test_quantize_codes_into_writes_grouped_rows(device):
    """The write kernel codes each component at its group's width, bit for bit torch's quantize_components, and
    packs grouped rows as groups.pack does (flat buckets beside them as before), at a host and a device position."""
    from kernels.quantize import quantize_codes_into

    _, bounds = level_tables(torch.device(device), UNIFORM)
    gen = torch.Generator().manual_seed(4)
    for D, bits, plans in (
        (64, (2, 5, 1, 4), {2: (4, 2, 1, 1), 5: (8, 4, 4, 4), 1: (2, 1, 1, 0)}),
        (128, (3, 2), {3: (8, 4, 4, 4, 2, 2, 0, 0)}),
        (64, (4, 5, 1, 3), {4: (5, 4, 4, 3), 5: (6, 5, 5, 4), 1: (2, 1, 1, 0), 3: (3, 3, 3, 3)}),  # planes
        (128, (7, 2), {7: (8, 8, 8, 7, 7, 7, 6, 5), 2: (3, 3, 2, 2, 2, 2, 1, 1)}),
    ):
        H, Tn = len(bits), 21
        store = PackedStore(bits, D, B, codes_only=True, device=device, capacity=40, plans=plans)
        for bk in store.buckets:
            bk.payload.fill_(0xA5)
        z = torch.randn(B, H, Tn, D, generator=gen) * 2
        scale = torch.rand(H, D, generator=gen) + 0.5
        quantize_codes_into(store, z[:, :, :20].to(device), 3, scale.to(device), bounds.contiguous())
        quantize_codes_into(store, z[:, :, 20:].to(device), torch.tensor([23], device=device), scale.to(device),
                            bounds.contiguous())  # fmt: skip
        store.length = 3 + Tn
        widths = torch.stack([_plan_widths(plans[b]) if b in plans else torch.full((D,), b) for b in bits])
        codes, _ = quantize_components(z, widths, scale, UNIFORM)
        for h, b in enumerate(bits):
            assert torch.equal(store.head_codes(h)[:, 3:].long().cpu(), codes[:, h]), (D, b)
            if b in plans:
                payload = store.bucket_of[b].payload[:, int(store.slot[h]), 3 : 3 + Tn].cpu()
                assert torch.equal(payload, groups.pack(codes[:, h], plans[b])), (D, b)


def test_a_launch_with_grouped_buckets_is_capped_and_takes_its_tiles():
    """A codes-only launch with a grouped bucket takes GROUPS_MAXNREG (a caller's maxnreg=0 lifts it; a flat one has
    none at 4 bits), and a grouped width's tile is GROUPS_LAUNCH's: 128 tokens up to 128 channels, 64 above."""
    from kernels import decode_attention as da

    assert da._launch_options(128, ((5, 4), (4, 4)), (), True, True)[0] == {"num_stages": 2, "maxnreg": 128}
    assert "maxnreg" not in da._launch_options(128, ((4, 4),), (), True, False)[0]
    assert "maxnreg" not in da._launch_options(128, ((5, 4),), (("maxnreg", 0),), True, True)[0]
    assert [da.fast_block_n(5, 4, d, codes=True) for d in (64, 128, 256)] == [128, 128, 64]
    assert [da.fast_block_n(6, 1, d, codes=True) for d in (64, 128, 256)] == [128, 128, 64]


def test_a_grouped_bucket_beside_rows_the_fast_kernel_cannot_read_is_refused():
    """Only the fast kernel reads grouped rows: a bucket whose other side it cannot read (flat 3 bits at head_dim
    64) is refused in one line, not read by the generic kernel as flat rows."""
    from kernels.decode_attention import fast_bucket

    with pytest.raises(
        NotImplementedError, match="a bucket of 4-bit keys and 3-bit values with a grouped plan"
    ):
        fast_bucket(4, 3, torch.float16, 64, 64, 64, (4,), ())
    assert fast_bucket(4, 3, torch.float32, 128, 128, 128, (4,), ())  # flat 3 bits at 128: the fast kernel's
    assert not fast_bucket(4, 3, torch.float32, 64, 64, 64, (), ())  # no plan: the generic kernel
