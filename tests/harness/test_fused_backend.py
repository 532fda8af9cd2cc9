"""QuantizedKVCache(backend="triton") with the fused decode attention against the torch backend.

Without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so the
models and generations are tiny; the same tests marked `gpu` run compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import kernels.decode_attention as decode_attention
from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache, resolve_backend
from harness.cache.quantized import UnpackedReadWarning
from harness.calibrate.pca import fit_pca_calibration
from harness.models import load_model
from harness.schemes import get_scheme
from kernels import groups
from kernels.unpack import fast_path_fits

# (model, bits [layers, KV heads], group size, scheme, prefill, batch, value bits (None: bits), key group size
# (None: group size)); tiny-gemma3's window is 16 and the generations below reach 25 tokens, so its sliding
# layers evict.
CASES = [
    ("tiny-llama", [[2, 4, 16], [16, 3, 8], [4, 2, 2]], 16, "asym_token", "exact", 2, None, None),
    ("tiny-gemma3", [[2, 16], [4, 8], [16, 2], [3, 4]], 32, "sym_token", "quantized", 1, None, None),
    # KV sharing: the last two layers attend the stores of the last sliding and global layers before them
    # (the global layers have one KV head, so their second entry is padding).
    ("tiny-gemma4-kv", [[2, 4], [8, 16], [4, 3], [3, 2], [2, 8]], 16, "asym_token", "exact", 1, None, None),
    # keys and values apart: their own widths and group sizes
    (
        "tiny-llama",
        [[8, 8, 16], [8, 4, 8], [8, 8, 8]],
        16,
        "asym_token",
        "quantized",
        1,
        [[4, 2, 4], [16, 4, 4], [2, 4, 3]],
        8,
    ),
]
NEW_TOKENS = 5


@pytest.mark.parametrize(
    "name, bits, group_size, scheme, prefill, batch, value_bits, key_group_size",
    CASES,
    ids=[c[0] + ("-kv-apart" if c[6] else "") for c in CASES],
)
@torch.no_grad()
def test_triton_generate_matches_torch(
    device, name, bits, group_size, scheme, prefill, batch, value_bits, key_group_size, monkeypatch, packed
):
    model, _ = load_model(name, device=device)
    bits = torch.tensor(bits)
    value_bits = None if value_bits is None else torch.tensor(value_bits)
    torch.manual_seed(5)
    prompt = torch.randint(0, 256, (batch, 20), device=device)
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, output_logits=True)
    kw.update(return_dict_in_generate=True)
    cache_kw = dict(
        group_size=group_size,
        scheme=scheme,
        prefill=prefill,
        value_bits=value_bits,
        key_group_size=key_group_size,
    )

    torch_cache = QuantizedKVCache(
        model.config, bits, backend="torch", simulate=True, **cache_kw
    )  # SDPA reads it
    want = model.generate(prompt, past_key_values=torch_cache, **kw)

    calls = []
    kernel = decode_attention.decode_attention
    spy = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    monkeypatch.setattr(decode_attention, "decode_attention", spy)
    packed(model)
    triton_cache = QuantizedKVCache(model.config, bits, backend="triton", **cache_kw)
    got = model.generate(prompt, past_key_values=triton_cache, **kw)

    layers = triton_cache.quantized_layers()
    assert all(layer.fused for layer in layers)
    assert not any(layer.fused for layer in torch_cache.quantized_layers())
    assert all(layer.k_store._dequantized is None and layer.v_store._dequantized is None for layer in layers)
    # Every decode step of every attention layer is fused, the KV-sharing layers (which hold no store) included.
    attention_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    assert len(calls) == (NEW_TOKENS - 1) * attention_layers
    assert torch.equal(got.sequences, want.sequences), name
    if device == "cpu":
        # The prefill is the same computation on both backends (quantize_into is bit-exact with the torch
        # path); on CUDA, SDPA may pick another kernel for the differently strided K/V.
        assert torch.equal(got.logits[0], want.logits[0])
    for step, (a, b) in enumerate(zip(want.logits, got.logits)):
        err = ((a - b).norm() / a.norm()).item()
        assert err < 1e-4, (name, step, err)
    assert triton_cache.nbytes() == torch_cache.nbytes() > 0
    assert triton_cache.nbytes_fp16() == torch_cache.nbytes_fp16()


@torch.no_grad()
def test_a_triton_cache_outside_the_packed_attention_reads_its_dequantized_stores(device):
    """Without the fused decode attention the model gets the stores dequantized (one warning): the logits equal
    the fused decode step's within float summation order, not the unquantized ones."""
    model, _ = load_model("tiny-llama", device=device)
    ids = torch.randint(0, 256, (1, 10), device=device)
    logits = {}
    for inside in (False, True):
        cache = QuantizedKVCache(model.config, 2, group_size=16, backend="triton")
        with installed(model, PACKED) if inside else pytest.warns(UnpackedReadWarning):
            model(input_ids=ids[:, :9], past_key_values=cache, use_cache=True)
            logits[inside] = model(input_ids=ids[:, 9:], past_key_values=cache, use_cache=True).logits
    full = model(input_ids=ids, use_cache=False).logits[:, 9:]
    assert ((logits[False] - logits[True]).norm() / logits[True].norm()).item() < 1e-4
    assert (logits[False] - full).abs().max() > 1e-2


@torch.no_grad()
def test_backend_names_and_resolution(monkeypatch):
    model, _ = load_model("tiny-llama")
    with pytest.raises(ValueError, match="quant.backend: unknown 'x'; allowed: auto, torch, triton"):
        QuantizedKVCache(model.config, 4, backend="x")
    cache = QuantizedKVCache(model.config, 4, group_size=16, backend="auto")
    model(input_ids=torch.randint(0, 256, (1, 5)), past_key_values=cache, use_cache=True)
    assert not any(layer.fused for layer in cache.quantized_layers())  # auto on CPU: torch
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    g16, g48 = get_scheme("asym_token", 16), get_scheme("asym_token", 48)
    assert resolve_backend("auto", cpu, g16, [4, 16], [4, 16], 32, 32) == "torch"
    assert resolve_backend("auto", cuda, g16, [4, 16], [4, 16], 32, 32) == "triton"
    assert (
        resolve_backend("auto", cuda, g48, [4, 16], [4, 16], 96, 96) == "torch"
    )  # group size the kernels lack
    with pytest.raises(NotImplementedError, match="group_size: 48"):
        resolve_backend("triton", cuda, g48, [4, 16], [4, 16], 96, 96)
    apart = get_scheme("asym_token", 16, key_group_size=8)  # keys and values apart
    assert resolve_backend("auto", cuda, apart, [8, 16], [2, 4], 32, 32) == "triton"
    keys48 = get_scheme("asym_token", 32, key_group_size=48)
    assert resolve_backend("auto", cuda, keys48, [4, 16], [4, 4], 96, 96) == "torch"  # the keys' group
    with pytest.raises(NotImplementedError, match="group_size: 48"):
        resolve_backend("triton", cuda, keys48, [4, 16], [4, 16], 96, 96)
    # pca's flat formats: the codes-only widths, full-attention layers only
    flat = get_scheme("pca_block_uf", sink_tokens=1)
    assert resolve_backend("auto", cuda, flat, [4, 2], [8, 3], 64, 64) == "triton"
    assert resolve_backend("auto", cuda, flat, [4, 16], [4, 4], 64, 64) == "torch"
    assert resolve_backend("auto", cuda, flat, [4, 4], [4, 4], 64, 64, sliding=True) == "torch"
    with pytest.raises(
        NotImplementedError, match="a head at 5 bits; the kernels decode codes of 2, 3, 4, 8 bits"
    ):
        resolve_backend("triton", cuda, flat, [4, 4], [5, 4], 64, 64)
    with pytest.raises(NotImplementedError, match="sliding-window layers are not supported"):
        resolve_backend("triton", cuda, flat, [4, 4], [4, 4], 64, 64, sliding=True)
    with pytest.raises(NotImplementedError, match="levels=uniform, group=0"):
        get_scheme("pca_block_u").check_kernel([4], [4], 64, 64, False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton needs CUDA tensors"):
        resolve_backend("triton", cpu, g16, [4, 16], [4, 16], 32, 32)


@torch.no_grad()
def test_fused_decode_refuses_a_mask_that_hides_tokens(device, packed):
    """A padded batch hides stored tokens from a decode step; the kernel attends every one, so it refuses
    (checked on the device: raised here on CPU, a device-side assertion on CUDA, which this test leaves alone)."""
    if device == "cuda":
        pytest.skip("a device-side assertion would poison the CUDA context of the rest of the session")
    model, _ = load_model("tiny-llama", device=device)
    packed(model)
    cache = QuantizedKVCache(model.config, 4, group_size=16, backend="triton")
    ids = torch.randint(0, 256, (2, 6), device=device)
    mask = torch.ones(2, 6, dtype=torch.long, device=device)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)  # nothing hidden: fine
    model(input_ids=ids[:, :1], attention_mask=mask[:, :1].repeat(1, 7), past_key_values=cache)
    mask = torch.ones(2, 8, dtype=torch.long, device=device)
    mask[1, 0] = 0  # the second sequence's first token is padding
    with pytest.raises(RuntimeError, match="attends to every stored token"):
        model(input_ids=ids[:, :1], attention_mask=mask, past_key_values=cache, use_cache=True)


def _pca_generation(model, scheme: str, value_bits: torch.Tensor, device) -> tuple:
    """The pca generation tests' (prompt, cache options, generate() keywords): `scheme`'s transforms fitted on 8
    random windows of 64 tokens, one sink token, values at `value_bits`, a random prompt of 131 tokens (its decode
    steps in the second block of 128) and 3 greedy tokens with their logits."""
    g = torch.Generator().manual_seed(3)
    fmt = get_scheme(scheme).pca_format
    cal = fit_pca_calibration(model, torch.randint(0, 256, (8, 64), generator=g).to(device), fmt)
    prompt = torch.randint(0, 256, (1, 131), generator=g).to(device)
    options = dict(
        scheme=scheme, sink_tokens=1, prefill="quantized", key_calibration=cal, value_bits=value_bits
    )
    kw = dict(
        max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    return prompt, options, kw


@torch.no_grad()
def test_pca_flat_format_decodes_through_the_fold_and_the_blocks_kernel(device, monkeypatch, packed):
    """pca_block_uf on the triton backend (codes in codes-only stores, each decode step pca_fold.decode around
    decode_attention_blocks, the sink token beside the codes) generates what the torch backend's packed path
    does: the same tokens, logits within float summation order, the same bytes, layer 0's codes (written by the
    Triton kernel) bit for bit. A prompt of 131 tokens puts the decode steps in the second block of 128 (two
    queries a head); heads at 2, 3, 4 and 8 bits, keys and values apart. The layers above see inputs that differ
    by that summation order (the prefill attends all its tokens dequantized at once here, block by block there),
    so a few of their codes may lie one level apart (a value on the edge of its cell), and the logits then move
    by what such a level moves them."""
    model, _ = load_model("tiny-llama", device=device)
    bits, value_bits = (
        torch.tensor([[4, 2, 8], [3, 4, 4], [2, 8, 3]]),
        torch.tensor([[4, 4, 3], [8, 2, 4], [4, 3, 2]]),
    )
    prompt, options, kw = _pca_generation(model, "pca_block_uf", value_bits, device)
    packed(model)
    torch_cache = QuantizedKVCache(model.config, bits, backend="torch", **options)
    want = model.generate(prompt, past_key_values=torch_cache, **kw)

    calls = []
    blocks = decode_attention.decode_attention_blocks
    spy = lambda *a, **k: calls.append(a[5]) or blocks(*a, **k)  # noqa: E731  a[5]: qblock
    monkeypatch.setattr(decode_attention, "decode_attention_blocks", spy)
    triton_cache = QuantizedKVCache(model.config, bits, backend="triton", **options)
    got = model.generate(prompt, past_key_values=triton_cache, **kw)

    assert all(layer.fused for layer in triton_cache.quantized_layers())
    steps = kw["max_new_tokens"] - 1  # the first token comes from the prefill
    assert calls == [128] * steps * model.config.num_hidden_layers  # every decode step of every layer
    assert torch.equal(got.sequences, want.sequences)
    pairs = [
        (getattr(ours, role).parts[1], getattr(theirs, role).parts[1], w)
        for ours, theirs in zip(triton_cache.quantized_layers(), torch_cache.quantized_layers())
        for role in ("k_store", "v_store")
        for w in getattr(ours, role).parts[1].widths
    ]
    apart = torch.cat([(a._codes(w, 0, a.length) - b._codes(w, 0, b.length)).flatten() for a, b, w in pairs])
    assert apart.abs().max() <= 1 and (apart != 0).sum() <= 1e-3 * apart.numel(), (apart != 0).sum()
    tolerance = 1e-3 if apart.any() else 1e-4
    for step, (a, b) in enumerate(zip(want.logits, got.logits)):
        err = ((a - b).norm() / a.norm()).item()
        assert err < tolerance, (step, err)
    assert triton_cache.nbytes() == torch_cache.nbytes() > 0
    k_store = triton_cache.quantized_layers()[0].k_store.parts[1]
    assert k_store.packed.codes_only and k_store.length == 131 + steps - 1  # the sink token apart
    # the write kernel's codes are torch's, bit for bit, where both saw the same inputs: layer 0's every token
    first_layers = (triton_cache.quantized_layers()[0], torch_cache.quantized_layers()[0])
    for role in ("k_store", "v_store"):
        ours, theirs = (getattr(layer, role).parts[1] for layer in first_layers)
        for w in ours.widths:
            assert torch.equal(ours._codes(w, 0, ours.length), theirs._codes(w, 0, theirs.length)), (role, w)


@torch.no_grad()
@pytest.mark.parametrize("scheme", ["pca_block_ugs", "pca_block_ugsa", "pca_block32_ugsa"])
def test_pca_grouped_format_decodes_through_the_fold_and_the_blocks_kernel(device, packed, scheme):
    """pca_block_ugs and pca_block_ugsa (and the latter in 32-token blocks) on the triton backend: each width's
    heads share a plan of 16-component groups (at 0, 1, 2, 4 or 8 bits; at any of 0-8, planes summed:
    kernels/groups.py), which the write kernel codes
    and packs and the blocks kernel reads. It generates what the torch backend's packed path does: the same tokens,
    logits within the fast kernel's fp16 products, the same bytes, layer 0's codes equal, its stored rows byte for
    byte the torch store's bitstream rows where every group is one plane. A random Llama with heads of 64 channels
    (groups of 16 need 64: tiny-llama's 32 take groups of 8); heads at 1, 2, 3, 4, 5, 6 and 8 bits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, initializer_range=0.1,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval().to(device)
    bits, value_bits = torch.tensor([[4, 1], [6, 5]]), torch.tensor([[2, 3], [1, 8]])
    prompt, options, kw = _pca_generation(model, scheme, value_bits, device)
    packed(model)
    torch_cache = QuantizedKVCache(model.config, bits, backend="torch", **options)
    want = model.generate(prompt, past_key_values=torch_cache, **kw)
    triton_cache = QuantizedKVCache(model.config, bits, backend="triton", **options)
    got = model.generate(prompt, past_key_values=triton_cache, **kw)

    assert all(layer.fused for layer in triton_cache.quantized_layers())
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(want.logits, got.logits)):
        err = ((a - b).norm() / a.norm()).item()
        assert err < 1e-2, (step, err)
    assert triton_cache.nbytes() == torch_cache.nbytes() > 0
    first_layers = (triton_cache.quantized_layers()[0], torch_cache.quantized_layers()[0])
    planes = 1
    for role in ("k_store", "v_store"):
        ours, theirs = (getattr(layer, role).parts[1] for layer in first_layers)
        # grouped rows where a width's plan mixes group widths or the fast kernel reads no flat row of its width:
        # here one bucket of each role at least
        mixed = {
            w for w in ours.widths
            if len(set(theirs.plan[w].flatten().tolist())) > 1 or not fast_path_fits(w, 64, 64)
        }  # fmt: skip
        assert set(ours.packed.plans) == mixed and mixed
        for w in ours.widths:
            assert torch.equal(ours._codes(w, 0, ours.length), theirs._codes(w, 0, theirs.length)), (role, w)
            plan = ours.packed.plans.get(w, (w,))
            planes = max(planes, *(len(groups.planes(b)) for b in plan))
            if all(len(groups.planes(b)) <= 1 for b in plan):  # one plane a group: the torch store's rows
                stored = ours.packed.bucket_of[w].payload[:, :, : ours.length]
                assert torch.equal(stored, theirs.codes[w]), (role, w)
    assert (planes > 1) == scheme.endswith("ugsa")  # ugsa's fitted plans hold groups of several planes


def test_pca_grouped_format_on_the_triton_backend_needs_shared_plans():
    """resolve_backend: pca_block_ugs and pca_block_ugsa (shared grouped plans) take the kernels at any of pca's
    widths where a head has 64 channels or more; pca_block_ug (a plan per head), pca_block_u (a width per
    component) and pca_ugsa (keys before RoPE) do not."""
    cuda = torch.device("cuda")
    for name in ("pca_block_ugs", "pca_block_ugsa", "pca_block32_ugsa"):
        grouped = get_scheme(name, sink_tokens=1)
        assert resolve_backend("auto", cuda, grouped, [1, 5], [6, 3], 64, 64) == "triton", name
    for name in ("pca_block_ug", "pca_block_u"):
        with pytest.raises(NotImplementedError, match="shared by every head"):
            get_scheme(name).check_kernel([4], [4], 64, 64, False)
    # the same grouped format with keys before RoPE (each key turned by its own position): no query folds it
    assert resolve_backend("auto", cuda, get_scheme("pca_ugsa", sink_tokens=1), [4], [4], 64, 64) == "torch"
    with pytest.raises(NotImplementedError, match="keys coded before RoPE"):
        get_scheme("pca_ugsa").check_kernel([4], [4], 64, 64, False)
    # below 64 channels a plan's groups hold fewer than 16 components (a quarter of the head): auto takes torch
    for name in ("pca_block_ugs", "pca_block_ugsa"):
        grouped = get_scheme(name, sink_tokens=1)
        assert resolve_backend("auto", cuda, grouped, [4, 4], [4, 4], 32, 32) == "torch", name
        with pytest.raises(
            NotImplementedError, match=f"{name}'s plans group 8 components at head_dim 32; the"
        ):
            grouped.check_kernel([4], [4], 32, 32, False)
    assert (
        resolve_backend("auto", cuda, get_scheme("pca_block_uf", sink_tokens=1), [4], [4], 32, 32) == "triton"
    )
