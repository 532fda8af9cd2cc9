"""The codebook scheme: its Lloyd-Max levels against Max (1960) and a numerical integral, its error against the
codebook's MSE and the per-token group formats, its bytes against the byte model, its store against an oracle
written from lloyd_max and the Hadamard matrix alone, and a tiny model through QuantizedKVCache against a
DynamicCache that holds the oracle's keys and values."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.models import load_model
from harness.schemes import get_scheme
from harness.schemes.codebook import quantize, rotated_values, tables
from harness.schemes.lloyd_max import lloyd_max, uniform_quantizer
from harness.validate import ConfigError, ModelInputs, _check_head_dims, validate_config
from kernels import reference
from kernels.packed_attention import packed_attention

ROOT = Path(__file__).resolve().parents[2]
CODEBOOK = get_scheme("codebook")


def oracle(x: torch.Tensor, bits: list[int]) -> torch.Tensor:
    """x (B, H, T, D) as the codebook format stores it, head h at bits[h] (16: unchanged): the nearest level by
    distance (not by boundaries), the least-squares scale, in x's dtype."""
    out = x.clone()
    D = x.shape[-1]
    h, finfo = reference.hadamard(D), torch.finfo(x.dtype)
    for head, b in enumerate(bits):
        if b == 16:
            continue
        levels = torch.tensor(lloyd_max(b).levels, dtype=torch.float32)
        r = x[:, head].float().clamp(-65504, 65504) @ h  # (B, T, D)
        rms = r.square().mean(-1, keepdim=True).sqrt()
        y = torch.where(rms > 0, r / rms, 0.0)
        c = levels[(y.unsqueeze(-1) - levels).abs().argmin(-1)]  # (B, T, D)
        scale = ((r * c).sum(-1) / (c * c).sum(-1)).clamp(max=65504).half().float()
        out[:, head] = ((c * scale.unsqueeze(-1)) @ h).clamp(finfo.min, finfo.max).to(x.dtype)
    return out


def relative_mse(got: torch.Tensor, x: torch.Tensor) -> float:
    return float((got.double() - x.double()).square().sum() / x.double().square().sum())


def codebook_mse(x: torch.Tensor, bits: int) -> float:
    """Relative MSE of x (N, D) stored at `bits` by a codebook store."""
    store = CODEBOOK.new_store([bits], x.shape[-1], 1, torch.float32, "cpu", role="value")
    store.append(x[None, None])
    return relative_mse(store.dequantize()[0, 0], x)


def feed(store, x: torch.Tensor, chunks) -> torch.Tensor | None:
    start, got = 0, None
    for n in chunks:
        got = store.append(x[:, :, start : start + n])
        start += n
    assert start == x.shape[2]
    return got


# ---------------------------------------------------------------------------------------------------------
# the Lloyd-Max codebook


def test_levels_and_mse_are_max_1960s():
    """Max's table (4 decimals; his 3-bit MSE 0.03454 is the exact 0.034548 truncated)."""
    assert lloyd_max(1).levels == pytest.approx((-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)), abs=1e-12)
    assert lloyd_max(1).mse == pytest.approx(1 - 2 / math.pi, abs=1e-12)
    assert lloyd_max(2).levels == pytest.approx((-1.5104, -0.4528, 0.4528, 1.5104), abs=5e-5)
    assert lloyd_max(3).levels[4:] == pytest.approx((0.2451, 0.7560, 1.3440, 2.1520), abs=1e-4)
    assert lloyd_max(2).mse == pytest.approx(0.1175, abs=5e-5)
    assert lloyd_max(3).mse == pytest.approx(0.03454, abs=1e-5)
    # Panter-Dite: at many levels the MSE approaches sqrt(3) pi / 2 * 4**-b from below
    assert 0.98 < lloyd_max(8).mse / (math.sqrt(3) * math.pi / 2 * 4.0**-8) < 1


def test_the_uniform_quantizers_step_and_mse_are_max_1960s():
    """Max's table of the optimum uniform quantizer of N(0, 1): step to 4 decimals, MSE to 4 significant digits;
    never below Lloyd-Max's MSE, equal at 1 bit."""
    steps = {1: 1.596, 2: 0.9957, 3: 0.5860, 4: 0.3352, 5: 0.1881, 6: 0.1041, 7: 0.0569, 8: 0.0308}
    mses = {
        1: 0.3634,
        2: 0.1188,
        3: 0.03744,
        4: 0.01154,
        5: 0.003495,
        6: 0.001040,
        7: 0.0003043,
        8: 0.0000876,
    }
    for b, step in steps.items():
        q = uniform_quantizer(b)
        assert q.levels[1] - q.levels[0] == pytest.approx(step, abs=1e-3 if b == 1 else 1e-4)
        assert q.mse == pytest.approx(mses[b], rel=2e-3)
        assert q.mse >= lloyd_max(b).mse - 1e-12
        levels = torch.tensor(q.levels, dtype=torch.float64)
        assert torch.allclose(levels.diff(), levels.diff()[:1]) and torch.equal(levels, -levels.flip(0))


def test_the_uniform_quantizers_mse_by_numerical_integration():
    q = uniform_quantizer(3)
    x = torch.linspace(-9, 9, 3_600_001, dtype=torch.float64)
    w = torch.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (x[1] - x[0])
    got = torch.tensor(q.levels, dtype=torch.float64)[
        torch.bucketize(x, torch.tensor(q.boundaries, dtype=torch.float64))
    ]
    assert float((w * (x - got) ** 2).sum()) == pytest.approx(q.mse, rel=1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_each_level_is_the_mean_of_its_cell_by_numerical_integration(bits):
    q = lloyd_max(bits)
    levels, boundaries = (
        torch.tensor(q.levels, dtype=torch.float64),
        torch.tensor(q.boundaries, dtype=torch.float64),
    )
    assert torch.equal(levels, -levels.flip(0)) and bool((levels.diff() > 0).all())
    torch.testing.assert_close(boundaries, (levels[1:] + levels[:-1]) / 2, rtol=0, atol=0)
    x = torch.linspace(-9, 9, 3_600_001, dtype=torch.float64)  # steps of 5e-6
    w = torch.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (x[1] - x[0])
    cell = torch.bucketize(x, boundaries)
    mass = torch.zeros(len(levels), dtype=torch.float64).index_add_(0, cell, w)
    mean = torch.zeros(len(levels), dtype=torch.float64).index_add_(0, cell, w * x) / mass
    torch.testing.assert_close(mean, levels, rtol=0, atol=1e-5)  # a boundary is off by up to one step
    assert float(((x - levels[cell]).square() * w).sum()) == pytest.approx(q.mse, rel=1e-6)


def test_only_widths_1_to_8_have_a_codebook():
    for bad in (0, 9, 2.0, True):
        with pytest.raises(ValueError, match="^bits: .* allowed: an integer 1 to 8"):
            lloyd_max(bad)


# ---------------------------------------------------------------------------------------------------------
# the error


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_error_on_gaussian_vectors_is_the_codebooks_mse(bits):
    """A rotated Gaussian vector divided by its rms has coordinates close to N(0, 1), but with mean square exactly
    1 and lighter tails (|y| <= sqrt(D)); the least-squares scale refits each vector. So the error lies a little
    below the codebook's MSE for N(0, 1) (measured 0.93 to 0.97 of it), never above; 256K elements estimate it
    to well under 1%."""
    torch.manual_seed(bits)
    x = torch.randn(4096, 64)
    ratio = codebook_mse(x, bits) / lloyd_max(bits).mse
    assert 0.85 < ratio < 1.0, ratio


def token_group_mse(x: torch.Tensor, bits: int, symmetric: bool) -> float:
    return relative_mse(reference.fake_quantize(x, bits, 32, symmetric), x)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_against_token_groups_of_32(bits):
    """Bytes per element at head_dim 64: codebook b + 1/4, sym_token g32 b + 1/2, asym_token g32 b + 1.

    On Gaussian vectors the codebook beats sym_token at fewer bytes; asym_token, with 3/4 of a bit more per
    element for its scale and zero, is lower at 3 and 4 bits (its min/max fit 32 values, the codebook covers the
    whole normal). On heavy-tailed vectors (Student-t, 3 degrees of freedom) and on channels of unequal scales
    with an offset (as keys have) the codebook is lowest at every width."""
    torch.manual_seed(10 + bits)
    gauss = torch.randn(4096, 64)
    assert codebook_mse(gauss, bits) < token_group_mse(gauss, bits, True)
    if bits >= 3:
        assert token_group_mse(gauss, bits, False) < codebook_mse(gauss, bits)
    heavy = torch.distributions.StudentT(3.0).sample((4096, 64))
    channels = torch.randn(4096, 64) * torch.logspace(-1, 1, 64) + 0.5
    for x in (heavy, channels):
        assert codebook_mse(x, bits) < token_group_mse(x, bits, False) < token_group_mse(x, bits, True)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_least_squares_scale_beats_the_plain_norm(bits):
    """The stored scale against the two it was chosen over, on the same codes: the rms itself (||x|| / sqrt(D))
    and the scale that keeps the norm (||r|| / ||c||)."""
    torch.manual_seed(20 + bits)
    levels, boundaries = tables(bits, torch.device("cpu"))
    for x in (torch.randn(4096, 64), torch.distributions.StudentT(3.0).sample((4096, 64))):
        r = reference.hadamard_rotate(x)
        rms = r.square().mean(-1, keepdim=True).sqrt()
        c = levels[torch.bucketize(r / rms, boundaries)]
        stored = codebook_mse(x, bits)
        for scale in (rms, r.norm(dim=-1, keepdim=True) / c.norm(dim=-1, keepdim=True)):
            other = reference.hadamard_rotate(c * scale.half().float())
            assert stored < relative_mse(other, x)


# ---------------------------------------------------------------------------------------------------------
# awkward inputs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_zero_constant_and_huge_vectors(dtype):
    D = 64
    torch.manual_seed(35)
    signs = torch.randn(1, 4, 1, D).sign()
    x = torch.zeros(1, 4, 4, D)  # (B, H, T, D): zeros, a constant, 1e4s with random signs, fp16's extremes
    x[:, :, 1] = 3.0
    x[:, :, 2:3] = 1e4 * signs
    x[:, :, 3] = 65504.0 * torch.randn(4, D).sign()
    x = x.to(dtype)
    store = CODEBOOK.new_store([2, 3, 4, 8], D, 1, dtype, "cpu", simulate=True, role="value")
    got = store.append(x)
    assert got.dtype == dtype and torch.isfinite(got).all() and torch.equal(got, store.dequantize())
    assert torch.equal(got[:, :, 0], x[:, :, 0])  # zeros stay exact
    unit = CODEBOOK.new_store([2, 3, 4, 8], D, 1, torch.float32, "cpu", simulate=True, role="value").append(
        signs
    )
    torch.testing.assert_close(
        got[:, :, 2:3].float(), 1e4 * unit, rtol=1e-2, atol=1e2
    )  # 1e4 x the signs' own
    for h, bits in enumerate([2, 3, 4, 8]):  # and their error is the codebook's (one vector: 2x leaves room)
        assert relative_mse(unit[0, h], signs[0, h]) < 2 * lloyd_max(bits).mse


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    values=st.lists(
        st.sampled_from([0.0, 1e-8, -1e-8, 3.0, -3.0, 1e4, 65504.0, -65504.0, 1e30]), min_size=1, max_size=4
    ),
    seed=st.integers(0, 2**16),
)
def test_no_nan_or_inf_on_nasty_inputs(dtype, values, seed):
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(values)
    x = pool[torch.randint(0, len(values), (1, 4, 9, 16), generator=g)]
    x = x.clamp(torch.finfo(dtype).min, torch.finfo(dtype).max).to(dtype)
    store = CODEBOOK.new_store([2, 3, 16, 8], 16, 1, dtype, "cpu", simulate=True, role="value")
    got = feed(store, x, [5, 4])
    assert torch.isfinite(got).all() and torch.isfinite(store.dequantize()).all()
    assert torch.equal(got[:, 2], x[:, 2])  # the 16-bit head is exact


# ---------------------------------------------------------------------------------------------------------
# the store: bytes, the oracle, eviction, attention

BITS = [2, 16, 3, 4, 8, 16]  # mixed widths, two 16-bit heads


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_stored_levels_are_read_from_what_reference_packs(bits):
    """rotated_values looks packed bytes (12-bit units at 3 bits) up whole: the levels of the codes that
    reference.unpack reads."""
    torch.manual_seed(40 + bits)
    for dim in (8, 16, 64):
        codes = torch.randint(0, 1 << bits, (2, 3, 5, dim), dtype=torch.uint8)
        scale = torch.rand(2, 3, 5).half()
        levels, _ = tables(bits, torch.device("cpu"))
        want = levels[codes.long()] * scale.float().unsqueeze(-1)
        assert torch.equal(rotated_values(reference.pack(codes, bits), scale, bits, dim), want)


@pytest.mark.parametrize("tokens", [1, 63, 1000])
def test_nbytes_is_the_byte_model(tokens):
    assert [CODEBOOK.token_bytes(b, 64, role="value") for b in (2, 3, 4, 8, 16)] == [18, 26, 34, 66, 128]
    assert CODEBOOK.token_bytes(4, 64, role="value") * 8 / 64 == 4.25
    for role in ("key", "value"):
        store = CODEBOOK.new_store(BITS, 64, 2, torch.bfloat16, "cpu", role)
        feed(
            store,
            torch.randn(2, len(BITS), tokens, 64, dtype=torch.bfloat16),
            [tokens // 2, tokens - tokens // 2],
        )
        assert store.nbytes() == 2 * tokens * sum(CODEBOOK.token_bytes(b, 64, role="value") for b in BITS)
        assert store.nbytes_fp16() == 2 * tokens * len(BITS) * 64 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_returns_the_oracle_in_chunks_packed_and_simulated(dtype):
    torch.manual_seed(30)
    x = (torch.randn(2, len(BITS), 45, 32) * torch.logspace(-2, 1, 32)).to(dtype)  # (B, H, T, D)
    simulated = CODEBOOK.new_store(BITS, 32, 2, dtype, "cpu", simulate=True, role="value")
    packed = CODEBOOK.new_store(BITS, 32, 2, dtype, "cpu", role="value")
    got = feed(simulated, x, [1, 20, 24])
    assert feed(packed, x, [13, 1, 31]) is None
    want = oracle(x, BITS)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(packed.dequantize(), want, **tol)
    codes, scale, values = quantize(x[:, 0], 2, dtype)  # the format functions alone
    assert codes.shape == (2, 45, 8) and scale.dtype == torch.float16
    torch.testing.assert_close(values, want[:, 0], **tol)


def test_keep_last_and_select_keep_what_dequantize_gave():
    torch.manual_seed(31)
    x = torch.randn(2, len(BITS), 30, 32)
    for simulate in (False, True):
        store = CODEBOOK.new_store(BITS, 32, 2, torch.float32, "cpu", simulate=simulate, role="value")
        feed(store, x, [7, 23])
        full = store.dequantize()
        stored = {w: (store.codes[w].clone(), store.scale[w].clone()) for w in store.widths}  # (B, Hw, 30, .)
        per_token = store.nbytes() // 30
        store.keep_last(21)
        assert store.length == 21 and store.nbytes() == 21 * per_token
        for w, (codes, scale) in stored.items():  # the stored bytes are kept exactly
            assert torch.equal(store.codes[w], codes[:, :, 9:]) and torch.equal(
                store.scale[w], scale[:, :, 9:]
            )
        # the inverse rotation is a matmul: its last bit may depend on how many rows it is given
        close = dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(store.dequantize(), full[:, :, 9:], **close)
        index = torch.tensor([[0, 3, 4, 10, 20], [1, 2, 5, 19, 20]])
        store.select(index)
        want = torch.stack([full[b, :, 9 + index[b]] for b in range(2)])  # (B, H, 5, D)
        assert store.length == 5 and store.nbytes() == 5 * per_token
        for w, (codes, scale) in stored.items():
            for b in range(2):
                assert torch.equal(store.codes[w][b], codes[b, :, 9 + index[b]])
                assert torch.equal(store.scale[w][b], scale[b, :, 9 + index[b]])
        torch.testing.assert_close(store.dequantize(), want, **close)
        new = torch.randn(2, len(BITS), 2, 32)
        got = store.append(new)
        torch.testing.assert_close(
            store.dequantize(), torch.cat([want, oracle(new, BITS)], 2), rtol=1e-5, atol=1e-5
        )
        if simulate:
            assert torch.equal(got, store.dequantize())


def test_select_through_sinks_and_residual():
    scheme = get_scheme("codebook", sink_tokens=2, residual=3)
    torch.manual_seed(32)
    x = torch.randn(2, 2, 12, 16)
    store = scheme.new_store([4, 16], 16, 2, torch.float32, "cpu", simulate=True, role="value")
    feed(store, x, [4, 8])  # sinks 0-1, quantized 2-8, residual 9-11
    index = torch.tensor([[0, 1, 3, 6, 9, 10, 11], [0, 1, 2, 5, 9, 10, 11]])
    store.select(index)
    want = x.clone()
    want[:, :, 2:9] = oracle(x[:, :, 2:9], [4, 16])
    want = torch.stack([want[b, :, index[b]] for b in range(2)])
    torch.testing.assert_close(store.dequantize(), want, rtol=1e-5, atol=1e-6)
    assert store.nbytes() == 2 * (2 * (10 + 32) + 5 * 2 * 16 * 2)  # per row 2 quantized tokens, 5 unquantized


def test_attention_in_the_rotated_domain_equals_attention_over_dequantized_tokens():
    torch.manual_seed(33)
    B, H, G, T, D = 2, len(BITS), 2, 70, 32
    k_store = CODEBOOK.new_store(BITS, D, B, torch.float32, "cpu", "key")
    v_store = CODEBOOK.new_store(BITS, D, B, torch.float32, "cpu", "value")
    k_store.append(torch.randn(B, H, T, D))
    v_store.append(torch.randn(B, H, T, D) * 3)
    keys, values = k_store.dequantize(), v_store.dequantize()
    q = torch.randn(B, H, 5, D)
    # tokens [11, 40) read rotated: the queries turned for the keys, the output turned for the values
    scores = k_store.turn(q) @ k_store.block(11, 40).transpose(-1, -2)
    torch.testing.assert_close(scores, q @ keys[:, :, 11:40].transpose(-1, -2), rtol=1e-5, atol=1e-5)
    p = torch.rand(B, H, 5, 29)
    out = v_store.turn(p @ v_store.block(11, 40))
    torch.testing.assert_close(out, p @ values[:, :, 11:40], rtol=1e-5, atol=1e-5)
    for Tq in (1, 6):  # a decode step and a causal chunk, read in blocks of 16 tokens
        q = torch.randn(B, H * G, Tq, D)
        got = packed_attention(q, k_store, v_store, D**-0.5, block=16)
        want = reference.attention_reference(q, keys, values, D**-0.5, causal_offset=T - Tq)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# through QuantizedKVCache on tiny models


class OracleCache(DynamicCache):
    """A DynamicCache that holds the oracle's keys and values: what a codebook cache with quantized prefill
    attends, as the format is per token."""

    def __init__(self, config, bits: torch.Tensor):
        super().__init__(config=config)
        self.bits = bits  # (layers, KV heads)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        widths = self.bits[layer_idx].tolist()
        return super().update(
            oracle(key_states, widths), oracle(value_states, widths), layer_idx, *args, **kwargs
        )


def chunked_logits(model, ids, cache, chunks):
    out, start = [], 0
    for n in chunks:
        out.append(model(input_ids=ids[:, start : start + n], past_key_values=cache, use_cache=True).logits)
        start += n
    return torch.cat(out, 1)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
@torch.no_grad()
def test_tiny_model_packed_simulated_and_oracle_agree(name):
    model = load_model(name)[0]
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    bits = torch.tensor([[[2, 4, 16, 8, 3, 4][(i + j) % 6] for j in range(heads)] for i in range(layers)])
    torch.manual_seed(34)
    ids = torch.randint(0, 256, (2, 29))  # past tiny-gemma3's sliding window of 16
    chunks = [12, 9, 1, 1, 6]
    with installed(model, PACKED):
        packed = chunked_logits(
            model, ids, QuantizedKVCache(model.config, bits, scheme="codebook", prefill="quantized"), chunks
        )
        cache = QuantizedKVCache(model.config, bits, scheme="codebook", prefill="quantized", simulate=True)
        simulated = chunked_logits(model, ids, cache, chunks)
    want = chunked_logits(model, ids, OracleCache(model.config, bits), chunks)
    torch.testing.assert_close(packed, simulated, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(simulated, want, rtol=1e-4, atol=1e-4)
    exact = chunked_logits(model, ids, DynamicCache(config=model.config), chunks)
    assert (packed - exact).abs().max() > 1e-3  # the quantization is felt
    assert 0 < cache.nbytes() < cache.nbytes_fp16()


# ---------------------------------------------------------------------------------------------------------
# configuration


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_quant_codebook_validates_and_ignores_group_size():
    (point,) = {(p.scheme, p.residual) for p in validate_config(compose_cfg("quant=codebook"))}
    assert point == ("codebook", 0)
    assert validate_config(compose_cfg("quant=codebook", "quant.group_size=12"))  # unused: no kivi rule
    assert validate_config(compose_cfg("quant=codebook", "eviction=h2o"))  # single tokens can be evicted
    assert (
        CODEBOOK.label() == "codebook"
        and get_scheme("codebook", sink_tokens=4).label() == "codebook sink_tokens=4"
    )
    inputs = ModelInputs("tiny-llama", get_scheme("codebook", 48), (4, 16), ())
    _check_head_dims(inputs, {64, 128})  # a group size that divides no head_dim is not an error
    with pytest.raises(
        ConfigError,
        match=r"^quant.scheme: codebook needs a power-of-two head_dim; .*96; allowed: a scheme without rotation \(",
    ) as refused:
        _check_head_dims(inputs, {96})
    allowed = set(str(refused.value).rsplit("(", 1)[1].rstrip(")").split(", "))
    assert {"asym_token", "sym_token", "kivi", "fp8", "calkey", "nuqkey", "pca", "cq2", "cq4"} <= allowed
    assert not {name for name in allowed if get_scheme(name).rotated}  # only schemes without rotation offered
    assert "codebook" not in allowed and "rotate+asym_token" not in allowed


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["quant=codebook", "quant.backend=triton"],
            r"^quant.backend: triton supports only asym_token and sym_token",
        ),
        (
            ["quant.scheme=rotate+codebook"],
            r"^quant.scheme: unknown 'rotate\+codebook'.*allowed: asym_token, ",
        ),
    ],
)
def test_bad_codebook_options_give_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate_config(compose_cfg(*overrides))
    assert "\n" not in str(err.value)
