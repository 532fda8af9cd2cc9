"""Every registered scheme from a model to generate() through the library surface (harness/api.py): every committed
frontier point's allocation exported (`python -m harness.export`), read back (`load_allocation`) and stored by
`quantized_cache(..., calibration=...)`; a point of each scheme generating, inside `packed_attention`, the tokens
of the same cache built as a sweep builds it (harness/run/measure.py); what the API fits equal to what a sweep
fits on the same windows; a policy's widths defaulting to its scheme's.

The committed points are of smollm2-135m (Llama, 30 layers, 3 KV heads) and gemma3-270m (18 layers, 1 KV head,
sliding windows), and an allocation is [layers, KV heads]: they run here on random models of those architectures
and cache shapes, small enough for CI. The Llama stand-in has head_dim 64 for a scheme that groups head_dim (group
sizes up to 64), else 16, as fitting pca's transforms and cq's codebooks costs D**2 per head.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import harness
from harness import data, evaluate
from harness.cache.eviction import EvictionSpec, attention_for
from harness.capacity import shape_from_config
from harness.config import HARNESS, Point
from harness.export import main as export_main
from harness.policies import from_point as policy_of
from harness.run.context import ModelContext
from harness.run.measure import allocation as sweep_allocation
from harness.run.measure import generate as sweep_generate
from harness.run.measure import key_calibration, key_span
from harness.schemes import SCHEMES, get_scheme, point_fields

FRONTIER = Path(__file__).resolve().parents[2] / "results" / "frontier"
RUNS = {"2026-11-24_frontier": "llama", "2026-11-26_frontier_gemma3": "gemma3"}  # run -> its model's stand-in
# the frontier's headline (issue 46): pca, the measured knapsack at 4.4 bits, ppl ratio 1.009 at 3.52x
HEADLINE = ("2026-11-24_frontier", "4920dc41e55f5d07")
PROMPT_TOKENS, NEW_TOKENS = 10, 4
GEMMA3_LAYERS = (["sliding_attention"] * 5 + ["full_attention"]) * 3  # gemma3-270m's 18 layers
STAND_INS = {
    "llama": dict(
        model_type="llama", num_hidden_layers=30, num_attention_heads=3, num_key_value_heads=3, hidden_size=48
    ),
    "gemma3": dict(
        model_type="gemma3_text", num_hidden_layers=18, num_attention_heads=2, num_key_value_heads=1,
        hidden_size=32, head_dim=256, sliding_window=8, layer_types=GEMMA3_LAYERS,
    ),
}  # fmt: skip


def read_records() -> dict[tuple[str, str], dict]:
    """(run, key) -> record of every committed frontier point with an allocation (the harness's own, not the
    baseline or a peer engine's)."""
    records = {}
    for run in RUNS:
        for path in sorted((FRONTIER / run / "points").glob("*.json")):
            record = json.loads(path.read_text())
            if record["config"].get("engine", HARNESS) == HARNESS and "allocation" in record:
                records[run, path.stem] = record
    return records


RECORDS = read_records()


def representative(run: str, scheme: str) -> str | None:
    """The point of `scheme` in `run` that generates below: the headline for pca, else the one whose allocation
    holds the most distinct widths (the first key among equals); None where the run has none."""
    if (run, scheme) == (HEADLINE[0], "pca"):
        return HEADLINE[1]
    keys = [key for (r, key), rec in RECORDS.items() if r == run and rec["config"]["scheme"] == scheme]
    mixed = {key: len({*sum(RECORDS[run, key]["allocation"]["key_bits"], [])}) for key in keys}
    return max(keys, key=lambda key: mixed[key], default=None)


def cases() -> list:
    """One case per (scheme, run) with a committed point of that scheme, and one allocated through the API for a
    scheme with none: every registered scheme."""
    out = []
    for scheme in SCHEMES.names():
        keys = [(run, representative(run, scheme)) for run in RUNS]
        keys = [(run, key) for run, key in keys if key is not None] or [(None, None)]
        out += [pytest.param(scheme, run, key, id=f"{scheme}-{key or 'api'}") for run, key in keys]
    return out


class StandIns:
    """Random models of the committed points' architectures and cache shapes, each with its Calibration on random
    windows, built once."""

    def __init__(self):
        self.built = {}

    def get(self, run: str | None, scheme: str):
        family = RUNS.get(run, "llama")
        head_dim = 64 if get_scheme(scheme).head_dim_groups else 16
        key = (family, None if family == "gemma3" else head_dim)
        if key not in self.built:
            shape = {"head_dim": head_dim, **STAND_INS[family]}
            config = AutoConfig.for_model(
                shape.pop("model_type"), vocab_size=256, intermediate_size=64, max_position_embeddings=2048,
                initializer_range=0.2, eos_token_id=None, **shape,
            )  # fmt: skip
            torch.manual_seed(0)
            model, _ = harness.load(AutoModelForCausalLM.from_config(config))
            model.generation_config.eos_token_id = None  # every generation runs to NEW_TOKENS
            calibration = harness.calibration(model, ids=torch.randint(0, 256, (2, 32)), i0=4)
            self.built[key] = model, calibration
        return self.built[key]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVBITS_CACHE", str(tmp_path_factory.mktemp("kvbits-cache")))
        yield StandIns()


def export(run: str, key: str, out: Path) -> Path:
    """`python -m harness.export RUN KEY --out OUT` in this process."""
    with contextlib.redirect_stdout(io.StringIO()):
        export_main([str(FRONTIER / run), key, "--out", str(out)])
    return out


def sweep_point(run: str | None, key: str | None, scheme) -> Point:
    """The committed point `key` of `run`; for a scheme without one, the headline's settings with `scheme`."""
    if key is not None:
        return Point.from_dict(RECORDS[run, key]["config"])
    return replace(Point.from_dict(RECORDS[HEADLINE]["config"]), **point_fields(scheme))


def sweep_context(model, calibration, simulate: bool, prompts: torch.Tensor | None = None) -> ModelContext:
    """A sweep's model context over the calibration's windows, with what a point's cache is built from (the
    fitted parts are read through it as measure reads them) and, given `prompts` (N, P), their shared full-precision
    prefill; the evaluation's other parts are not needed here."""
    prefilled = None if prompts is None else evaluate.prefill(model, prompts, batch_size=prompts.shape[0])
    return ModelContext(
        name=calibration.name, model=model, tokenizer=None, entropy=calibration.entropy, prompts=prompts,
        sequences=None, base_tokens=None, base_tf=None, prefilled=prefilled, batch_size=1, backend="auto",
        simulate=simulate, calib_ids=calibration.ids, shape=shape_from_config(model.config),
    )  # fmt: skip


def sweep_tokens(ctx: ModelContext, point: Point, allocation):
    """Greedy tokens (1, NEW_TOKENS) and cache bytes of the context's prompt as a sweep decodes a point
    (harness/run/measure.py's generate, with measure's own options)."""
    spec = EvictionSpec.from_point(point)
    with attention_for(ctx.model, spec):
        tokens, caches = sweep_generate(ctx, replace(point, new_tokens=NEW_TOKENS), allocation, spec)
    return tokens, caches[0].nbytes()


@pytest.mark.parametrize(
    "run, key", sorted(RECORDS), ids=[f"{run[:10]}-{key}" for run, key in sorted(RECORDS)]
)
def test_every_committed_frontier_point_exports_loads_and_gets_its_cache(stand_ins, tmp_path, run, key):
    record = RECORDS[run, key]
    allocation, scheme = harness.load_allocation(export(run, key, tmp_path / "allocation.json"))
    assert scheme.name == record["config"]["scheme"]
    model, calibration = stand_ins.get(run, scheme.name)
    cache = harness.quantized_cache(model, allocation, scheme, calibration=calibration)
    widths = record["allocation"]
    assert cache.key_bits.tolist() == widths.get("key_bits", widths.get("bits"))
    assert cache.value_bits.tolist() == widths.get("value_bits", widths.get("bits"))


@torch.no_grad()
@pytest.mark.parametrize("name, run, key", cases())
def test_a_point_of_every_scheme_generates_the_sweeps_tokens(stand_ins, tmp_path, name, run, key):
    """export -> load_allocation -> quantized_cache(..., calibration=) -> generate() in packed attention, against
    the sweep's own cache of the same allocation on the same prompt."""
    model, calibration = stand_ins.get(run, name)
    path = tmp_path / "allocation.json"
    if key is not None:
        export(run, key, path)
    else:  # no committed point: an allocation through the API, among the scheme's own widths
        scheme = harness.make_scheme(name)
        budget = scheme.widths[(len(scheme.widths) - 1) // 2]
        allocation = harness.allocate(model, calibration, budget, policy="entropy", scheme=scheme, alpha=1.0)
        harness.save_allocation(path, allocation, scheme)
    allocation, scheme = harness.load_allocation(path)
    assert scheme.name == name
    cache = harness.quantized_cache(model, allocation, scheme, calibration=calibration)
    torch.manual_seed(1)
    prompt = torch.randint(0, 256, (1, PROMPT_TOKENS))
    with harness.packed_attention(model):
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False)

    point = sweep_point(run, key, scheme)
    ctx = sweep_context(model, calibration, cache.simulate, prompt)
    want, want_bytes = sweep_tokens(ctx, point, allocation)
    assert torch.equal(out[:, PROMPT_TOKENS:], want)
    assert cache.nbytes() == want_bytes > 0
    if scheme.key_tables:  # the same fitted parts
        assert cache.key_calibration.digest() == key_calibration(ctx, point).digest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny-llama with its tokenizer and a Calibration on random windows, in a disk cache of its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVBITS_CACHE", str(tmp_path_factory.mktemp("kvbits-cache")))
        model, tokenizer = harness.load("tiny-llama")
        torch.manual_seed(3)
        yield model, tokenizer, harness.calibration(model, ids=torch.randint(0, 256, (2, 48)), i0=4)


def tiny_point(scheme, **changes) -> Point:
    """The headline point's settings for tiny-llama with `scheme` and `changes` (calibration windows: 2 of 48)."""
    base = Point.from_dict(RECORDS[HEADLINE]["config"])
    windows = dict(calibration_sequences=2, calibration_tokens=48)
    return replace(base, model="tiny-llama", **windows, **point_fields(scheme), **changes)


@pytest.mark.parametrize(
    "name, options",
    [("calkey", {}), ("nuqkey", {"key_levels": "fisher"}), ("pca", {}), ("xlayer_r8", {}), ("cq4", {})],
)
def test_the_api_fits_what_a_sweep_fits_on_the_same_windows(tiny, name, options):
    """Fitted twice, under the API's name for the model and under the sweep's (its registry name): equal parts."""
    model, tokenizer, _ = tiny
    scheme = harness.make_scheme(name, **options)
    point = tiny_point(scheme)
    calibration = harness.calibration(model, tokenizer, sequences=2, tokens=48, i0=point.i0, seed=point.seed)
    windows = data.point_windows(tokenizer, point).calibration  # the sweep's
    assert torch.equal(calibration.ids, windows)
    ctx = sweep_context(model, calibration, simulate=False)
    ctx.name = point.model
    assert calibration.name != ctx.name  # two fits, cached apart
    got, want = calibration.fitted(model, scheme, key_span(point)), key_calibration(ctx, point)
    assert type(got) is type(want) and got.digest() == want.digest()


def test_an_exported_point_names_the_windows_its_parts_were_fitted_on(tiny, tmp_path):
    """The file's source gives harness.calibration the sweep's windows (on tiny-llama here: the same cut), and
    quantized_cache the sweep's span."""
    model, tokenizer, _ = tiny
    record = RECORDS[HEADLINE]
    source = json.loads(export(*HEADLINE, tmp_path / "allocation.json").read_text())["source"]
    calibration = harness.calibration(model, tokenizer, **source["calibration"])
    config = record["config"]
    point = replace(Point.from_dict(config), model="tiny-llama")
    assert torch.equal(calibration.ids, data.point_windows(tokenizer, point).calibration)
    assert calibration.ids.shape == (config["calibration_sequences"], config["calibration_tokens"])
    assert source["calibration_source"] == record["resolved"]["calibration_source"]
    assert source["span"] == key_span(point) == 1024
    assert source["probe"] == [point.probe_sequences, point.probe_tokens] == [2, 128]


def test_a_measured_policy_allocates_through_the_fitted_parts_as_a_sweep_does(tiny):
    """The measured knapsack over pca's units (the frontier's headline policy): the API measures each unit through
    the transforms the API fits and allocates what the sweep allocates."""
    model, _, calibration = tiny
    scheme = harness.make_scheme("pca", sink_tokens=1)
    allocation = harness.allocate(model, calibration, 3, policy="measured", scheme=scheme, widths=[2, 4])
    point = tiny_point(scheme, budget=3, widths=(2, 4))
    assert harness.make_policy("measured", widths=[2, 4]) == policy_of(point.group("policy"))
    ctx = sweep_context(model, calibration, simulate=False)
    ctx.name = point.model  # its own fits and unit errors, cached apart from the API's
    want = sweep_allocation(ctx, point)
    assert torch.equal(allocation.key_bits, want.key_bits)
    assert torch.equal(allocation.value_bits, want.value_bits)
    assert len({*allocation.key_bits.flatten().tolist(), *allocation.value_bits.flatten().tolist()}) == 2


def test_a_unit_kl_probe_reaches_the_table_as_a_sweeps_does(tiny):
    """probe=(sequences, tokens) measures the unit KLs on those calibration windows, cut, as a sweep point with
    eval.calibration.probe does; policies that measure on no probe, and probes outside the windows, are refused."""
    model, _, calibration = tiny
    scheme = harness.make_scheme("asym_token", group_size=16)
    options = dict(policy="measured", scheme=scheme, widths=[2, 4])
    allocation = harness.allocate(model, calibration, 3, **options, probe=(1, 20))
    point = tiny_point(scheme, budget=3, widths=(2, 4), probe_sequences=1, probe_tokens=20)
    ctx = sweep_context(model, calibration, simulate=False)
    ctx.name = point.model  # its own unit errors, cached apart from the API's
    want = sweep_allocation(ctx, point)
    assert torch.equal(allocation.key_bits, want.key_bits)
    assert torch.equal(allocation.value_bits, want.value_bits)
    (table,) = ctx.sensitivity.values()
    oracle = harness.sensitivity.unit_kl_table(model, calibration.ids[:1, :20], scheme, (2, 4), point.chunk)
    assert table["kl"].tolist() == pytest.approx(oracle["kl"].tolist(), rel=1e-6)
    around = harness.allocate(
        model, calibration, 3, **options, probe=(1, 20, 2)
    )  # every other unit at 2 bits
    want = sweep_allocation(ctx, point.replace(probe_context=2))
    assert torch.equal(around.key_bits, want.key_bits) and torch.equal(around.value_bits, want.value_bits)
    table = list(ctx.sensitivity.values())[-1]
    oracle = harness.sensitivity.unit_kl_table(
        model, calibration.ids[:1, :20], scheme, (2, 4), point.chunk, context=2
    )
    assert table["kl"].tolist() == pytest.approx(oracle["kl"].tolist(), rel=1e-6, abs=1e-12)
    with pytest.raises(
        ValueError, match=r"^probe's context: 3 with policy.widths \[2, 4\]; allowed: null, or one"
    ):
        harness.allocate(model, calibration, 3, **options, probe=(1, 20, 3))
    with pytest.raises(ValueError, match=r"^probe: policy entropy measures no unit-KL probe; allowed: None$"):
        harness.allocate(model, calibration, 3, policy="entropy", probe=(1, 20))
    with pytest.raises(
        ValueError, match=r"^probe: \(1, 49\); allowed: \(sequences, tokens\) with sequences in "
    ):
        harness.allocate(model, calibration, 3, **options, probe=(1, 49))


@pytest.mark.parametrize("name", SCHEMES.names())
def test_a_policys_widths_default_to_those_its_scheme_stores(tiny, name):
    model, _, calibration = tiny
    widths = get_scheme(name).widths
    assert harness.make_policy("uniform", scheme=name).widths == widths
    allocation = harness.allocate(model, calibration, budget=max(widths), policy="uniform", scheme=name)
    assert allocation.key_bits.unique().tolist() == [max(widths)]  # nuqkey_codebook at 4: issue 46's call
