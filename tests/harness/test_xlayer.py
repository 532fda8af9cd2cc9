"""The xlayer schemes (cross-layer prediction): the least-squares and reduced-rank fits against numpy's solutions,
the predictors' frame, tiny models through QuantizedKVCache against a float64 oracle written from the format's
contract (each layer predicted from the oracle's own reconstruction of the layer below, the residual in codebook's
format), also past a sliding window, the chain's order, a prefill that dropped prompt tokens refused, bytes
(predictors counted), the fit read from the calibration windows only, the simulated-only and no-eviction refusals,
and a tiny run whose rows say how they were measured."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import DynamicCache

from harness.cache import QuantizedKVCache
from harness.calibrate.pca import fit_pca_calibration
from harness.calibrate.windows import rotary_frequencies
from harness.calibrate.xlayer import (
    cached_xlayer_calibration,
    cached_xlayer_pca_calibration,
    fit_chained_calibration,
    fit_predictor,
    fit_residual_pca,
    fit_xlayer_calibration,
    predictor,
)
from harness.config import compose as compose_point
from harness.models import load_model
from harness.protocols import sensitivity_check
from harness.run import runner
from harness.schemes import codebook, get_scheme
from harness.schemes.pca_table import quantize_components
from harness.schemes.xlayer_table import CrossLayerCalibration, Predictor
from harness.sensitivity.chain import chain_errors
from harness.validate import ConfigError, validate_config


def test_the_fit_is_ridge_least_squares_and_its_reduced_rank():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 12, generator=g, dtype=torch.float64) @ torch.randn(
        12, 12, generator=g, dtype=torch.float64
    )
    w = torch.randn(12, 5, generator=g, dtype=torch.float64)
    y = (
        x @ w
        + torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0])
        + 0.01 * torch.randn(500, 5, generator=g, dtype=torch.float64)
    )
    weight, bias = fit_predictor(x, y)
    xc, yc = (x - x.mean(0)).numpy(), (y - y.mean(0)).numpy()
    gram = xc.T @ xc
    want = np.linalg.solve(gram + 1e-4 * np.trace(gram) / 12 * np.eye(12), xc.T @ yc)
    np.testing.assert_allclose(weight.numpy(), want, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(
        bias.numpy(), y.mean(0).numpy() - x.mean(0).numpy() @ want, rtol=1e-8, atol=1e-10
    )
    assert (weight - w).abs().max() < 0.01
    down, up, bias2 = fit_predictor(x, y, rank=2)
    assert down.shape == (12, 2) and up.shape == (2, 5) and torch.equal(bias2, bias)
    # reduced rank: the fitted values projected on their top 2 right singular vectors
    fitted = xc @ want
    _, _, vh = np.linalg.svd(fitted, full_matrices=False)
    np.testing.assert_allclose((down @ up).numpy(), want @ vh[:2].T @ vh[:2], rtol=1e-7, atol=1e-9)
    # and no rank-2 map of these inputs fits better than it does (Eckart-Young on the fitted values)
    error = ((xc @ (down @ up).numpy() - yc) ** 2).sum()
    for seed in range(20):  # the least-squares map projected on random 2-dimensional output subspaces
        q = np.linalg.qr(np.random.default_rng(seed).normal(size=(5, 2)))[0]
        assert error <= ((xc @ (want @ q @ q.T) - yc) ** 2).sum() + 1e-9


def test_a_predictor_applies_its_map_and_counts_its_bytes():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(300, 10, generator=g), torch.randn(300, 3, 4, generator=g)
    full, low = predictor(x, y, None), predictor(x, y, 2)
    inputs = torch.randn(2, 7, 10, generator=g)
    want = torch.einsum("bti,hio->bhto", inputs, full.weight.float()) + full.bias.float()[None, :, None]
    torch.testing.assert_close(full.apply(inputs), want)
    want = torch.stack(
        [inputs @ low.down[h].float() @ low.up[h].float() + low.bias[h].float() for h in range(3)], 1
    )
    torch.testing.assert_close(low.apply(inputs), want, rtol=1e-5, atol=1e-5)
    assert full.head_nbytes() == (10 * 4 + 4) * 2 and low.head_nbytes() == (10 * 2 + 2 * 4 + 4) * 2
    empty = Predictor(torch.ones(3, 4).half(), weight=torch.zeros(3, 0, 4).half())
    assert torch.equal(empty.apply(torch.zeros(2, 5, 0)), torch.ones(2, 3, 5, 4)) and empty.head_nbytes() == 8


@pytest.mark.parametrize("rank", [None, 8])
def test_the_frame_round_trips_every_predictor(rank):
    model, _ = load_model("tiny-gemma3")
    cal = fit_xlayer_calibration(
        model, torch.randint(0, 256, (4, 40), generator=torch.Generator().manual_seed(2)), rank
    )
    back = CrossLayerCalibration.from_frame(cal.to_frame(), len(cal.layers), rank)
    assert back.digest() == cal.digest() and [layer.previous for layer in back.layers] == [None, 0, 1, 2]
    for a, b in zip(cal.layers, back.layers):
        for role in ("key", "value"):
            for part in ("bias", "weight", "down", "up"):
                ta, tb = getattr(a.role(role), part), getattr(b.role(role), part)
                assert (ta is None and tb is None) or torch.equal(ta, tb)
        assert torch.equal(a.turn, b.turn)


@torch.no_grad()
def test_the_residual_transforms_are_fitted_on_the_residuals():
    """xlayer_pca's transforms are pca's fit of y - pred: a least-squares fit with a bias leaves residuals of mean
    about 0 (the fp16 predictor's rounding), where the keys and values themselves have means far from it."""
    model, _ = load_model("tiny-llama")
    calib = torch.randint(0, 256, (4, 40), generator=torch.Generator().manual_seed(5))
    predictors = fit_xlayer_calibration(model, calib)
    residual, raw = fit_residual_pca(model, calib, predictors), fit_pca_calibration(model, calib)
    for got, own in zip(residual.layers, raw.layers):
        for role in ("key", "value"):
            assert got.role(role).mean.abs().max() < 0.01 * own.role(role).mean.abs().max()
            assert got.role(role).plans[4].long().sum() == 4 * got.role(role).mean.numel()


# ---------------------------------------------------------------------------------------------------------
# models


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, sign: float) -> torch.Tensor:
    """x (..., T, D) float64 with pairs (i, i + R / 2) turned by sign * positions * inv_freq in complex float64."""
    half = len(inv_freq)
    z = torch.complex(x[..., :half], x[..., half : 2 * half]) * torch.polar(
        torch.ones(len(positions), half, dtype=torch.float64),
        sign * positions.double()[:, None] * inv_freq.double(),
    )
    return torch.cat([z.real, z.imag, x[..., 2 * half :]], -1)


class OracleCache(DynamicCache):
    """A DynamicCache holding the format's reconstruction of every layer (all heads at `bits`), in float64 for the
    prediction: keys turned back, predicted from the oracle's own reconstruction of the layer below, the residual
    through codebook's quantizer, restored and turned forward; token 0 exact (one sink token)."""

    def __init__(self, config, bits: int, cal: CrossLayerCalibration, inv_freq: list[torch.Tensor]):
        super().__init__(config=config)
        self.bits, self.cal, self.inv_freq, self.seen, self.last = bits, cal, inv_freq, {}, {}

    def residual(self, r: torch.Tensor, layer_idx: int, role: str) -> torch.Tensor:
        """What the format stores of residuals r (B, H, n, D) float64: codebook's, or with the calibration's
        residual transforms (xlayer_pca) pca's: components on the head's basis after its mean, each at the plan's
        width against its Lloyd-Max levels times its scale, and back."""
        if self.cal.residual is None:
            return codebook.quantize(r.float(), self.bits, torch.float32)[2].double()
        table = self.cal.residual.layer(layer_idx).role(role)
        mean, basis = table.mean.double()[None, :, None], table.basis.double()  # (1, H, 1, D), (H, D, D)
        z = torch.einsum("bhtd,hdc->bhtc", r - mean, basis)
        _, zq = quantize_components(z.float(), table.plans[self.bits].long(), table.scales[self.bits].float())
        return mean + torch.einsum("bhtc,hdc->bhtd", zq.double(), basis)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        start = self.seen.get(layer_idx, 0)
        positions = torch.arange(start, start + key_states.shape[2])
        self.seen[layer_idx] = start + key_states.shape[2]
        layer = self.cal.layer(layer_idx)
        sink = positions == 0
        rest = ~sink
        restored = {}
        y = {
            "key": rope(key_states.double(), positions, self.inv_freq[layer_idx], -1.0),
            "value": value_states.double(),
        }
        for role in ("key", "value"):
            p = layer.role(role)
            sources = [] if layer.previous is None else [(layer.previous, "key")]
            if role == "value":
                sources = [(layer_idx, "key")] + (
                    [] if layer.previous is None else [(layer.previous, "value")]
                )
            inputs = (
                torch.cat([self.last[s].transpose(1, 2).flatten(2) for s in sources], -1)
                if p.inputs
                else None
            )
            bias = p.bias.double()[None, :, None]
            target = y[role][:, :, rest]  # the tokens past the sink: (B, H, n, D)
            if inputs is None:
                pred = bias.expand(target.shape)
            elif p.weight is not None:
                pred = torch.einsum("bti,hio->bhto", inputs, p.weight.double()) + bias
            else:
                low = torch.einsum("bti,hir->bhtr", inputs, p.down.double())
                pred = torch.einsum("bhtr,hro->bhto", low, p.up.double()) + bias
            out = y[role].clone()
            out[:, :, rest] = pred + self.residual(target - pred, layer_idx, role)
            self.last[(layer_idx, role)] = out[:, :, rest]
            restored[role] = out
        keys = rope(restored["key"], positions, self.inv_freq[layer_idx], 1.0)
        keys[:, :, sink], restored["value"][:, :, sink] = (
            key_states[:, :, sink].double(),
            value_states[:, :, sink].double(),
        )
        return super().update(keys.float(), restored["value"].float(), layer_idx, *args, **kwargs)


def chunked_logits(model, ids: torch.Tensor, cache, chunks) -> torch.Tensor:
    out, start = [], 0
    for n in chunks:
        out.append(model(input_ids=ids[:, start : start + n], past_key_values=cache, use_cache=True).logits)
        start += n
    return torch.cat(out, 1).float()


def fitted(model, scheme: str, g: torch.Generator) -> CrossLayerCalibration:
    """`scheme`'s fitted parts on 16 random calibration windows of 48 tokens drawn from `g`."""
    calib = torch.randint(0, 256, (16, 48), generator=g)
    cal = fit_xlayer_calibration(model, calib, get_scheme(scheme).rank)
    if scheme == "xlayer_pca":
        cal = CrossLayerCalibration(cal.layers, None, fit_residual_pca(model, calib, cal))
    return cal


def oracle_frequencies(model) -> list[torch.Tensor]:
    """Each layer's rotary frequencies (its layer type's), as the oracle turns its keys."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    return [rotary_frequencies(model, t) for t in types]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
@pytest.mark.parametrize("scheme", ["xlayer", "xlayer_r8", "xlayer_pca"])
@torch.no_grad()
def test_tiny_model_through_the_cache_is_the_oracle(name, scheme):
    model = load_model(name)[0]
    g = torch.Generator().manual_seed(12)
    cal = fitted(model, scheme, g)
    pca = scheme == "xlayer_pca"
    ids = torch.randint(0, 256, (2, 15), generator=g)  # inside tiny-gemma3's sliding window of 16
    chunks = [6, 5, 1, 1, 2]
    exact = chunked_logits(model, ids, DynamicCache(config=model.config), chunks)
    cache = QuantizedKVCache(
        model.config, 4, scheme=scheme, prefill="quantized", key_calibration=cal, sink_tokens=1, simulate=True
    )
    got = chunked_logits(model, ids, cache, chunks)
    want = chunked_logits(model, ids, OracleCache(model.config, 4, cal, oracle_frequencies(model)), chunks)
    # The oracle predicts in float64, the store in float32: a residual on a level boundary can take the other level.
    assert (got - want).abs().amax() <= 5e-3 * exact.abs().amax()
    assert (got - exact).abs().amax() > 0  # the quantization is felt
    layers = cache.quantized_layers()
    tokens = ids.shape[1] - 1  # the sink token is kept in fp16
    heads = [len(layer.key_bits) for layer in layers]
    # keys and values, batch 2, head_dim 32 at 4 bits: codebook's codes and fp16 scale, or pca's codes alone
    codes = sum(2 * 2 * h * tokens * (16 if pca else 16 + 2) for h in heads)
    tables = sum(
        h * (cal.layer(i).key.head_nbytes() + cal.layer(i).value.head_nbytes()) for i, h in enumerate(heads)
    )
    tables += sum(2 * h * (2 * 32 * 32 + 5 * 32) for h in heads) if pca else 0  # the residuals' transforms
    sinks = sum(2 * 2 * h * 32 * 2 for h in heads)
    assert cache.nbytes() == codes + tables + sinks


@pytest.mark.parametrize("scheme", ["xlayer", "xlayer_pca"])
@torch.no_grad()
def test_past_the_sliding_window_it_is_the_oracle_and_a_prefill_that_dropped_tokens_is_refused(scheme):
    """tiny-gemma3 past its window of 16: a first chunk longer than the window, then steps and a chunk. A sliding
    layer stores a whole chunk before it drops what left its window, so the full layer above predicts every token
    from it, as the oracle does. A DynamicCache's prefill whose sliding layers already dropped prompt tokens cannot
    be converted (the full layers above would predict them from nothing): a one-line error before anything is
    stored. Within the window it converts to what the same prompt stored through the cache holds."""
    model = load_model("tiny-gemma3")[0]
    g = torch.Generator().manual_seed(14)
    cal = fitted(model, scheme, g)
    ids = torch.randint(0, 256, (2, 40), generator=g)
    chunks = [23, 1, 1, 6, 9]
    exact = chunked_logits(model, ids, DynamicCache(config=model.config), chunks)
    options = dict(scheme=scheme, key_calibration=cal, sink_tokens=1, simulate=True)
    cache = QuantizedKVCache(model.config, 4, prefill="quantized", **options)
    got = chunked_logits(model, ids, cache, chunks)
    want = chunked_logits(model, ids, OracleCache(model.config, 4, cal, oracle_frequencies(model)), chunks)
    assert (got - want).abs().amax() <= 5e-3 * exact.abs().amax()
    assert (got - exact).abs().amax() > 0

    dropped = DynamicCache(config=model.config)
    model(input_ids=ids[:, :23], past_key_values=dropped, use_cache=True)
    message = (
        f"^QuantizedKVCache.from_prefilled: {scheme} predicts each layer's tokens from the layer below's, and "
        r"layer 0's sliding window holds 15 of the prompt's 23 tokens; prefill through the QuantizedKVCache itself"
    )
    with pytest.raises(ValueError, match=message):
        QuantizedKVCache.from_prefilled(dropped, model.config, 4, **options)

    within = DynamicCache(config=model.config)
    model(input_ids=ids[:, :15], past_key_values=within, use_cache=True)
    converted = QuantizedKVCache.from_prefilled(within, model.config, 4, **options)
    stored = QuantizedKVCache(model.config, 4, prefill="exact", **options)
    model(input_ids=ids[:, :15], past_key_values=stored, use_cache=True)
    assert converted.nbytes() == stored.nbytes() > 0
    for a, b in zip(converted.layers, stored.layers):
        torch.testing.assert_close(a.k_store.block(0, 15), b.k_store.block(0, 15), rtol=0, atol=0)
        torch.testing.assert_close(a.v_store.block(0, 15), b.v_store.block(0, 15), rtol=0, atol=0)


def exact_states(model, ids: torch.Tensor, layers: int) -> list[dict[str, torch.Tensor]]:
    """The first `layers` layers' keys before RoPE and values {role: (H, N, D)} float64 over windows ids (C, T),
    position 0 of each left out, each window through a DynamicCache that keeps every token."""
    inv_freq = oracle_frequencies(model)
    states = []
    for layer in range(layers):
        keys, values = [], []
        for window in ids:
            cache = DynamicCache()
            model(input_ids=window[None], past_key_values=cache, use_cache=True)
            k, v = cache.layers[layer].keys[0].double(), cache.layers[layer].values[0].double()  # (H, T, D)
            keys.append(rope(k, torch.arange(k.shape[1]), inv_freq[layer], -1.0)[:, 1:])
            values.append(v[:, 1:])
        states.append({"key": torch.cat(keys, 1), "value": torch.cat(values, 1)})
    return states


def flat(x: torch.Tensor) -> torch.Tensor:
    """(H, N, D) -> (N, H D): a layer's heads as a predictor's inputs."""
    return x.transpose(0, 1).flatten(1)


def oracle_predict(
    cal: CrossLayerCalibration, layer: int, role: str, inputs: torch.Tensor | None
) -> torch.Tensor:
    """The calibration's prediction (H, N, D) float64 of layer's role from inputs (N, in) (None: none)."""
    fit = cal.layer(layer).role(role)
    bias = fit.bias.double()[:, None]
    return bias if inputs is None else bias + torch.einsum("ni,hio->hno", inputs, fit.weight.double())


def oracle_inputs(role: str, below: dict | None, key: torch.Tensor | None) -> torch.Tensor | None:
    """A layer's inputs (N, in) for `role` from the layer below's {role: (H, N, D)} (None: none) and, for values,
    this layer's keys (H, N, D): xlayer's order."""
    if role == "key":
        return None if below is None else flat(below["key"])
    return torch.cat([flat(key), *([] if below is None else [flat(below["value"])])], -1)


@pytest.mark.parametrize("scheme", ["xlayer_chain2", "xlayer_pca_chain3"])
@torch.no_grad()
def test_the_chained_fit_predicts_from_what_the_stores_restore(scheme):
    """Along the chain (fit_chained_calibration), layer 1's maps are the least-squares maps from what the oracle's
    coder restores of layer 0 (and, for values, of layer 1's keys) at the chain's width, to the exact states; on
    those inputs they predict better than the maps fitted on exact inputs do."""
    model = load_model("tiny-llama")[0]
    g = torch.Generator().manual_seed(21)
    calib = torch.randint(0, 256, (4, 40), generator=g)
    width, pca = get_scheme(scheme).chain_width, scheme.startswith("xlayer_pca")
    cal = fit_chained_calibration(model, calib, width, pca)
    exact_fit = fit_xlayer_calibration(model, calib)
    states = exact_states(model, calib, 2)
    oracle = OracleCache(model.config, width, cal, oracle_frequencies(model))

    def restore(layer: int, role: str, inputs: torch.Tensor | None) -> torch.Tensor:
        """What the chain restores of layer's role (H, N, D) from inputs (N, in), through the chained map."""
        predicted, y = oracle_predict(cal, layer, role, inputs), states[layer][role]
        return predicted + oracle.residual((y - predicted)[None], layer, role)[0]

    key0, value0 = restore(0, "key", None), restore(0, "value", flat(restore(0, "key", None)))
    key1 = restore(1, "key", flat(key0))
    inputs = {"key": flat(key0), "value": torch.cat([flat(key1), flat(value0)], -1)}
    for role, x in inputs.items():
        y = states[1][role]  # (H, N, D)
        want = torch.stack([fit_predictor(x, y[h])[0] for h in range(len(y))])  # (H, in, out)
        got = cal.layer(1).role(role).weight.double()
        assert (got - want).norm() <= 2e-2 * want.norm(), role
        errors = [(y - oracle_predict(fit, 1, role, x)).pow(2).sum() for fit in (cal, exact_fit)]
        assert errors[0] < errors[1], role


@torch.no_grad()
def test_the_chain_errors_are_the_oracles():
    """harness.sensitivity.chain at 2 bits on tiny-llama's exact-input fit: each of layers 0 and 1's three errors
    (the prediction from what the chain restored below, from the exact states below, and what is restored) as the
    oracle computes them; and the command writes every layer's, or refuses a scheme without a chain."""
    model = load_model("tiny-llama")[0]
    g = torch.Generator().manual_seed(22)
    cal = fit_xlayer_calibration(model, torch.randint(0, 256, (4, 40), generator=g))
    ids = torch.randint(0, 256, (3, 30), generator=g)
    rows = chain_errors(model, ids, cal, 2).set_index(["layer", "role"])
    states = exact_states(model, ids, 2)
    oracle = OracleCache(model.config, 2, cal, oracle_frequencies(model))
    below = exact_below = None
    for layer in range(2):
        restored = {}
        for role in ("key", "value"):
            y = states[layer][role]
            predicted = oracle_predict(cal, layer, role, oracle_inputs(role, below, restored.get("key")))
            from_exact = oracle_predict(
                cal, layer, role, oracle_inputs(role, exact_below, states[layer]["key"])
            )
            restored[role] = predicted + oracle.residual((y - predicted)[None], layer, role)[0]
            want = [(e - y).pow(2).sum() / y.pow(2).sum() for e in (predicted, from_exact, restored[role])]
            got = rows.loc[(layer, role), ["predicted", "predicted_from_exact", "restored"]].tolist()
            assert got == pytest.approx([float(w) for w in want], rel=2e-2), (layer, role)
        below, exact_below = restored, states[layer]
    assert rows["predicted"].gt(rows["restored"]).all()  # the coded residual is felt, and it helps


def test_the_chain_command_writes_every_layers_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "chain.csv"
    args = ["--model", "tiny-llama", "--chain", "3", "--sequences", "2", "--out", str(out), "eval=tiny"]
    sensitivity_check.main([*args, "quant=xlayer", "quant.sink_tokens=1", "quant.simulate=true"])
    rows = pd.read_csv(out)
    layers = load_model("tiny-llama")[0].config.num_hidden_layers
    assert (
        len(rows) == 2 * layers and (rows[["predicted", "predicted_from_exact", "restored"]] > 0).all().all()
    )
    assert json.loads(out.with_suffix(".json").read_text())["sequences"][0] == 2
    assert "largest prediction error from what the chain restored" in capsys.readouterr().out
    for bad, message in (
        (
            ["quant=asym_token"],
            "error: quant.scheme: asym_token predicts no layer from the layer below; allowed",
        ),
        (
            ["quant=xlayer", "--chain", "5"],
            "error: --chain: 5 is not a width xlayer stores; allowed: 2, 3, 4, 8",
        ),
    ):
        with pytest.raises(SystemExit) as exit_:
            sensitivity_check.main(["--model", "tiny-llama", "--chain", "2", "eval=tiny", *bad])
        assert exit_.value.code == 2 and capsys.readouterr().err.startswith(message)


@torch.no_grad()
def test_a_layer_stores_only_after_the_layer_below_and_only_simulated():
    model = load_model("tiny-llama")[0]
    cal = fit_xlayer_calibration(
        model, torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
    )
    cache = QuantizedKVCache(model.config, 4, scheme="xlayer", key_calibration=cal, simulate=True)
    x = torch.randn(1, 3, 2, 32)
    with pytest.raises(RuntimeError, match="^xlayer: layer 1 stores keys before layer 0 stored its keys"):
        cache.layers[1].append(x, x)
    cache = QuantizedKVCache(model.config, 4, scheme="xlayer", key_calibration=cal)
    with pytest.raises(ValueError, match="^quant.simulate: xlayer reconstructs each layer"):
        cache.layers[0].append(x, x)
    with pytest.raises(ValueError, match="^quant.scheme: xlayer_r8 predicts each layer"):
        QuantizedKVCache(
            model.config, 4, scheme="xlayer_r8", key_calibration=cal, simulate=True
        )  # a full-rank fit


@torch.no_grad()
def test_a_dropped_cache_is_freed_at_once_and_the_next_one_reads_its_own_chain():
    """No reference cycle holds a cache's stores: with the garbage collector off, dropping a filled cache frees
    them (neither the stores' chain nor the shared calibration keeps them), and a second cache on the same
    calibration gives the first one's logits on the same tokens."""
    import gc
    import weakref

    model = load_model("tiny-llama")[0]
    cal = fitted(model, "xlayer_pca", torch.Generator().manual_seed(4))
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(5))

    def run():
        cache = QuantizedKVCache(model.config, 3, scheme="xlayer_pca", key_calibration=cal, simulate=True)
        logits = chunked_logits(model, ids, cache, [7, 1, 3])
        return logits, weakref.ref(cache.quantized_layers()[-1].v_store)

    gc.disable()
    try:
        first, store = run()
        assert store() is None and len(cal.chain) == 0
        second, _ = run()
    finally:
        gc.enable()
    assert torch.equal(first, second)


def test_the_config_asks_for_a_simulated_cache_and_no_eviction():
    base = ["model=tiny-llama", "eval=tiny", "quant.scheme=xlayer", "quant.group_size=32", "policy=uniform"]
    with pytest.raises(ConfigError, match="^quant.simulate: xlayer reconstructs each layer"):
        validate_config(compose_point(base))
    with pytest.raises(ConfigError, match="^eviction: streaming cannot evict from a cross-layer"):
        validate_config(compose_point([*base, "quant.simulate=true", "eviction=streaming"]))
    assert validate_config(compose_point([*base, "quant.simulate=true"]))


@torch.no_grad()
def test_the_fit_reads_the_calibration_windows_and_the_disk_cache_keys_rank_and_source(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model, _ = load_model("tiny-llama")
    calib = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(4))
    full = cached_xlayer_calibration(model, "tiny-llama", calib)
    assert full.digest() == fit_xlayer_calibration(model, calib).digest()
    assert cached_xlayer_calibration(model, "tiny-llama", calib).digest() == full.digest()  # from disk
    low = cached_xlayer_calibration(model, "tiny-llama", calib, rank=8)
    other = cached_xlayer_calibration(model, "tiny-llama", calib, source="stdlib_docstrings")
    assert low.digest() != full.digest() and other.digest() == full.digest()
    assert len(list((tmp_path / "calibration").glob("tiny-llama-xlayer-*.parquet"))) == 3  # keyed apart
    # xlayer_pca: the full-rank predictors read back, and the pca transforms of their residuals cached beside them
    both = cached_xlayer_pca_calibration(model, "tiny-llama", calib)
    want = CrossLayerCalibration(full.layers, None, fit_residual_pca(model, calib, full))
    assert both.digest() == want.digest() != full.digest()
    assert cached_xlayer_pca_calibration(model, "tiny-llama", calib).digest() == both.digest()  # from disk
    assert len(list((tmp_path / "calibration").glob("tiny-llama-xlayer-pca-*.parquet"))) == 1


@pytest.mark.parametrize("scheme", ["xlayer_r8", "xlayer_pca"])
def test_a_tiny_run_says_how_it_was_measured(tmp_path, scheme):
    overrides = ["model=tiny-llama", "eval=tiny", f"quant.scheme={scheme}", "quant.sink_tokens=1", "policy=uniform",
                 "policy.budget=4", "quant.simulate=true"]  # fmt: skip
    (point,) = [p for p in validate_config(compose_point(overrides)) if p.policy == "uniform"]
    row = runner.run([point], tmp_path, batch_size=4, simulate=True).set_index("policy").loc["uniform"]
    assert row["status"] == "ok" and row["simulate"] and row["reads_previous_layer"]
    if (
        scheme == "xlayer_r8"
    ):  # (xlayer_pca's tables, 2 D**2 + 5 D bytes a head, outweigh eval=tiny's tokens: the
        # oracle test counts its bytes exactly)
        assert 1 < row["compression_true"] < 16 / 4.5
