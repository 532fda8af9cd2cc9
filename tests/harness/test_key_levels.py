"""quant.key_levels: nuqkey's levels as a k-means weighted by the calibration loss's gradient at each key (squared:
the Fisher information, KVQuant's sensitivity weighting; or its magnitude). The weighted fit against the unweighted one on repeated values, the calibration gradients against
the gradients at the model's own pre-RoPE keys (k_proj's output), the fitted tables, the on-disk cache, the point
key, and the one-line errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import get_layer_types_and_kwargs

from harness.calibrate.keys import cached_key_calibration, fit_key_calibration, fit_levels
from harness.calibrate.windows import (
    calibration_key_gradients,
    calibration_keys,
    rotary_frequencies,
    unturn,
)
from harness.config import Point, base_point
from harness.config import compose as compose_point
from harness.models import load_model
from harness.schemes import FISHER, FISHER_SQRT, KMEANS, get_scheme
from harness.schemes.key_table import LEVEL_WIDTHS


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([2, 4, 8]), st.integers(5, 80))
def test_integer_weights_are_repeated_values(seed, n, rows):
    """Weight w on a value fits the same levels as w copies of it (0: as if it were absent)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, generator=g) * torch.tensor([1.0, 4.0, 0.1])
    x[:, 2] = x[:, 2].round(decimals=1)  # ties
    weights = torch.randint(0, 4, (rows, 3), generator=g)
    weights[0] = 1  # every column keeps some weight
    got = fit_levels(x, n, weights=weights.float())
    for c in range(3):
        want = fit_levels(x[:, c].repeat_interleave(weights[:, c])[:, None], n)[0]
        torch.testing.assert_close(got[c], want, rtol=1e-6, atol=1e-6)


def test_unit_weights_are_the_unweighted_fit_exactly():
    x = torch.randn(257, 5) * torch.logspace(-2, 2, 5)
    for n in (2, 8, 16):
        assert torch.equal(fit_levels(x, n, weights=torch.ones_like(x)), fit_levels(x, n))


def test_heavy_weight_pulls_a_level_onto_its_value():
    """Two clusters and one far value: unweighted, 2 levels sit on the clusters; weighted heavily, one level moves
    to the far value."""
    x = torch.cat([torch.full((50,), -1.0), torch.full((50,), 1.0), torch.tensor([9.0])])[:, None]
    weights = torch.ones_like(x)
    weights[-1] = 1000.0
    torch.testing.assert_close(fit_levels(x, 2)[0], torch.tensor([-1.0, 1.0 + 8.0 / 51]))
    assert fit_levels(x, 2, weights=weights)[0, 1] > 8.9


def pre_rope_keys(name: str, attn) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """The module whose output is a layer's pre-RoPE keys, and how to read them as (T, Hkv, D): tiny-llama's
    k_proj (no key norm; (1, T, Hkv * D)), tiny-gemma3's k_norm ((1, Hkv, T, D))."""
    if name == "tiny-llama":
        return attn.k_proj, lambda out: out[0].view(out.shape[1], -1, attn.head_dim)
    return attn.k_norm, lambda out: out[0].transpose(0, 1)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
@torch.no_grad()
def test_gradients_turn_back_to_the_gradients_at_the_pre_rope_keys(name):
    """The gradient of the summed NLL at a layer's pre-RoPE keys (autograd through the model's own RoPE) equals the
    calibration gradients turned back by unturn, at the positions calibration_keys keeps (tiny-gemma3's sliding
    layers hold the last 15 of a window's 24)."""
    model, _ = load_model(name)
    g = torch.Generator().manual_seed(3)
    calib = torch.randint(0, 256, (2, 24), generator=g)
    got = calibration_key_gradients(model, calib)
    keys = calibration_keys(model, calib)
    types, _ = get_layer_types_and_kwargs(model.config)
    for layer, decoder_layer in enumerate(model.model.layers):
        module, as_tokens = pre_rope_keys(name, decoder_layer.self_attn)
        _, positions = keys[layer]
        want = []
        for window in calib:
            seen: dict[str, torch.Tensor] = {}
            hook = module.register_forward_hook(lambda m, i, out, seen=seen: seen.setdefault("k", out))
            try:
                with torch.enable_grad():
                    embeds = model.get_input_embeddings()(window[None]).requires_grad_()
                    logits = model(inputs_embeds=embeds, use_cache=False).logits[0, :-1]
                    nll = torch.nn.functional.cross_entropy(logits.float(), window[1:], reduction="sum")
                    (grad,) = torch.autograd.grad(nll, seen["k"])
            finally:
                hook.remove()
            held = positions[: len(positions) // len(calib)]  # the positions kept of each window
            want.append(as_tokens(grad)[held])  # (T_held, Hkv, D)
        want = torch.cat(want)
        assert got[layer].shape == keys[layer][0].shape == want.shape
        inv_freq = rotary_frequencies(model, types[layer])
        torch.testing.assert_close(unturn(got[layer], positions, inv_freq), want, rtol=1e-4, atol=1e-6)
    if name == "tiny-gemma3":
        assert len(keys[0][1]) == 2 * 15 and len(keys[2][1]) == 2 * 23  # a sliding layer and a full one


@pytest.mark.parametrize("levels, power", [(FISHER, 2), (FISHER_SQRT, 1)])
@torch.no_grad()
def test_fisher_tables_keep_calkeys_ranges_and_weigh_the_levels(levels, power):
    """The scales and zeros are k-means' tables'; the levels are the k-means of the pre-RoPE keys weighted by
    |gradient| ** power there."""
    model, _ = load_model("tiny-llama")
    calib = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(4))
    plain = fit_key_calibration(model, calib, span=32)
    fisher = fit_key_calibration(model, calib, span=32, levels=levels)
    assert (plain.levels, fisher.levels) == (KMEANS, levels)
    inv_freq = rotary_frequencies(model, "full_attention")
    keys, gradients = calibration_keys(model, calib), calibration_key_gradients(model, calib)
    for layer, (a, b) in enumerate(zip(plain.tables, fisher.tables)):
        assert torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero) and torch.equal(a.turn, b.turn)
        k, positions = keys[layer]
        x = unturn(k, positions, inv_freq).reshape(len(k), -1)  # (N, Hkv * D) pre-RoPE
        weights = unturn(gradients[layer], positions, inv_freq).abs().pow(power).reshape(len(k), -1)
        for w in LEVEL_WIDTHS:
            want = fit_levels(x, 1 << w, weights=weights).view_as(b.levels[w])
            torch.testing.assert_close(b.levels[w].float(), want.half().float(), atol=2e-3, rtol=2e-3)
            assert not torch.equal(a.levels[w], b.levels[w])
    with pytest.raises(
        ValueError, match=r"^quant.key_levels: 'median' is not allowed; allowed: kmeans, fisher, fisher_sqrt$"
    ):
        fit_key_calibration(model, calib, span=32, levels="median")


@torch.no_grad()
def test_the_disk_cache_keeps_the_fits_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model, _ = load_model("tiny-llama")
    calib = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    fisher = cached_key_calibration(model, "tiny-llama", calib, 32, FISHER)
    plain = cached_key_calibration(model, "tiny-llama", calib, 32)
    assert len(list(tmp_path.glob("calibration/tiny-llama-calkey-*.parquet"))) == 2
    assert plain.levels == KMEANS and fisher.levels == FISHER
    assert not torch.equal(plain.layer(0).levels[4], fisher.layer(0).levels[4])
    again = cached_key_calibration(model, "tiny-llama", calib, 32, FISHER)  # read back from disk
    assert again.levels == FISHER and torch.equal(again.layer(0).levels[4], fisher.layer(0).levels[4])


def test_a_bound_scheme_refuses_tables_fitted_the_other_way():
    model, _ = load_model("tiny-llama")
    calib = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(6))
    plain = fit_key_calibration(model, calib, span=32)
    scheme = get_scheme("nuqkey", key_levels=FISHER)
    with pytest.raises(
        ValueError, match=r"^quant.key_levels: fisher, but the key tables given were fitted with "
    ):
        scheme.for_layer(0, plain)
    assert get_scheme("nuqkey").for_layer(0, plain).table is plain.layer(0)
    assert get_scheme("calkey").for_layer(0, plain).table is plain.layer(0)  # calkey reads no levels


def test_key_levels_errors_name_the_key_and_what_is_allowed():
    with pytest.raises(
        ValueError, match=r"^quant.key_levels: 'mean' is not allowed; allowed: kmeans, fisher, fisher_sqrt$"
    ):
        get_scheme("nuqkey", key_levels="mean")
    with pytest.raises(
        ValueError,
        match=r"^quant.key_levels: fisher with quant.scheme calkey, which fits no key levels; allowed: kmeans, "
        r"or a scheme with fitted levels \(nuqkey, nuqkey_codebook\)$",
    ):
        get_scheme("calkey", key_levels=FISHER)
    assert (
        get_scheme("nuqkey_codebook", key_levels=FISHER_SQRT).label() == "nuqkey_codebook fisher_sqrt levels"
    )


def test_the_point_key_changes_only_away_from_kmeans():
    point = base_point(compose_point(["model=tiny-llama", "quant=nuqkey", "eval=tiny"]))
    assert point.key_levels == KMEANS
    before = {k: v for k, v in point.to_dict().items() if k != "key_levels"}  # a record made before the field
    assert Point.from_dict(before).key() == point.key()
    fisher = base_point(
        compose_point(["model=tiny-llama", "quant=nuqkey", "eval=tiny", f"quant.key_levels={FISHER}"])
    )
    assert fisher.key_levels == FISHER and fisher.key() != point.key()
