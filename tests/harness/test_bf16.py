"""The pipeline with model.dtype=bfloat16: every scheme's store on bf16 inputs, calibration, the cache, eviction,
teacher-forced metrics, the claim protocol, passkey, and a whole sweep on the smoke grid."""

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from harness import data, evaluate, metrics
from harness.__main__ import entry
from harness.cache import QuantizedKVCache, kv_heads
from harness.cache.eviction import EvictionSpec, attention_for, with_eviction
from harness.calibrate import entropy as calibrate
from harness.calibrate import head_entropies, layer_types
from harness.config import Point
from harness.models import load_model
from harness.protocols import claim, passkey
from harness.report.compare import main as compare_main
from harness.schemes import SCHEMES, Codebook, Fp8, Rotated, Scheme, get_scheme
from harness.schemes.lloyd_max import lloyd_max
from kernels.reference import FP8_MAX, FP16_MAX, hadamard_rotate

ROOT = Path(__file__).resolve().parents[2]
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def models():
    """name -> (float32 model, bfloat16 model) built from the same random weights."""
    return {
        name: (load_model(name)[0], load_model(name, dtype="bfloat16")[0])
        for name in ("tiny-llama", "tiny-gemma3")
    }


# --- every scheme's store on bf16 inputs ---------------------------------------------------------------------


# calkey's keys need a fitted table: tests/harness/test_calkey.py checks its bf16 keys against its own oracle
TABLE_FREE = [name for name in SCHEMES.names() if not get_scheme(name).key_tables]


def widths(name: str) -> list[int]:
    return [8, 16] if get_scheme(name).widths == (8,) else [2, 3, 16, 4, 8]


def _group_bound(xg: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """Error bound per element of one group along the last dim of xg (float32): half a step, plus the fp16
    rounding of scale and zero (relative 2^-11, and their subnormal floor)."""
    if symmetric:
        amax = xg.abs().amax(-1, keepdim=True)
        step, rounding = amax / (2 ** (bits - 1) - 1), amax * 2.0**-10
    else:
        lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
        step, rounding = (hi - lo) / (2**bits - 1), (hi - lo + lo.abs()) * 2.0**-10
    return (step / 2 + rounding + 2.0**bits * 2.0**-24).expand_as(xg)


def step_bound(base: Scheme, role: str, x: torch.Tensor, bits: int, g: int) -> torch.Tensor:
    """Per-element bound (B, H, T, D) on |stored - x| for float32 x in the fp16 range stored by `base` at `bits`
    (kivi keys: the first T // g * g tokens in groups of g per channel, the rest exact)."""
    if bits == 16:
        return torch.zeros_like(x)
    if isinstance(
        base, Codebook
    ):  # x rotated; a bound on each token's L2 error (what rotated schemes check):
        # the rms times each element's distance to its nearest level (the least-squares scale does no worse than
        # the rms on the same codes), plus the fp16 rounding of the scale, 2^-11 of it, taken at 2^-9 of the rms
        levels = torch.tensor(lloyd_max(bits).levels, dtype=torch.float32)
        rms = x.square().mean(-1, keepdim=True).sqrt()
        y = torch.where(rms > 0, x / rms, 0.0)
        return rms * ((y.unsqueeze(-1) - levels).abs().amin(-1) + levels[-1] * 2.0**-9)
    if isinstance(
        base, Fp8
    ):  # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormals below 2^-6 of the scale
        scale = x.abs().amax(-1, keepdim=True) / FP8_MAX
        return x.abs() * 2.0**-4 + scale * 2.0**-9 + 2.0**-15
    B, H, T, D = x.shape
    if base.per_channel(role):
        n = T // g * g
        grouped = x[:, :, :n].reshape(B, H, n // g, g, D).transpose(-1, -2)  # (B, H, n // g, D, g)
        bound = _group_bound(grouped, bits, False).transpose(-1, -2).reshape(B, H, n, D)
        return torch.cat([bound, torch.zeros_like(x[:, :, n:])], 2)
    grouped = x.reshape(B, H, T, D // g, g)
    return _group_bound(grouped, bits, base.symmetric).reshape(x.shape)


def check_round_trip(
    name: str, role: str, x: torch.Tensor, got: torch.Tensor, bits: list[int], g: int
) -> None:
    """got (bf16) is x (bf16) stored by scheme `name`: finite, and within each head's step of x clamped to the
    fp16 range, plus bf16 rounding of the output; rotated schemes are bounded per token in the L2 norm (the
    rotation is orthonormal)."""
    assert got.dtype == BF16 and got.shape == x.shape
    assert torch.isfinite(got).all(), name
    x32, got32 = x.float().clamp(-FP16_MAX, FP16_MAX), got.float()
    scheme = get_scheme(name, group_size=g, residual=0)
    rotate = scheme.rotated
    base = (
        scheme.inner if isinstance(scheme, Rotated) else scheme
    )  # the format rotate+ stores rotated heads in
    for h, b in enumerate(bits):
        xh, gh = x32[:, h : h + 1], got32[:, h : h + 1]
        if b == 16:
            assert torch.equal(gh, x[:, h : h + 1].float()), (name, h)  # unquantized heads are exact
            continue
        domain = hadamard_rotate(xh) if rotate else xh
        if base is not scheme:  # rotate+: its inner format clamps the rotated values to the fp16 range
            domain = domain.clamp(-FP16_MAX, FP16_MAX)
        bound = step_bound(base, role, domain, b, g)
        output_rounding = (xh.abs() + bound) * 2.0**-8
        if rotate:
            err = (gh - xh).norm(dim=-1)  # (B, 1, T)
            assert (err <= bound.norm(dim=-1) + output_rounding.norm(dim=-1) + 1e-6).all(), (name, h, b)
        else:
            assert ((gh - xh).abs() <= bound + output_rounding).all(), (name, h, b, (gh - xh).abs().max())


@pytest.mark.parametrize("name", TABLE_FREE)
@pytest.mark.parametrize("role", ["key", "value"])
def test_every_scheme_round_trips_bf16_within_its_step(name, role):
    """Odd token count, channels of very different ranges, a non-zero offset; stored twice (45 tokens in one
    append, then in uneven chunks): within the step bound, and equal to the float32 path rounded to bf16."""
    g, bits = 16, widths(name)
    torch.manual_seed(SCHEMES.names().index(name) + 100 * (role == "key"))
    x = (torch.randn(3, len(bits), 45, 64) * torch.logspace(-2, 2, 64) + 0.7).to(BF16)  # (B, H, T, D)
    scheme = get_scheme(name, group_size=g, residual=0)
    got = scheme.new_store(bits, 64, 3, BF16, "cpu", role=role, simulate=True).append(x)
    check_round_trip(name, role, x, got, bits, g)
    fp32 = scheme.new_store(bits, 64, 3, torch.float32, "cpu", role=role, simulate=True).append(x.float())
    assert torch.equal(got, fp32.to(BF16)), name  # the same float32 arithmetic, one rounding at the end
    store = scheme.new_store(bits, 64, 3, BF16, "cpu", role=role, simulate=True)
    for start, stop in ((0, 5), (5, 6), (6, 29), (29, 45)):
        chunked = store.append(x[:, :, start:stop])
    check_round_trip(name, role, x, chunked, bits, g)
    assert torch.equal(store.dequantize(), chunked)


GROUP_KINDS = ("constant", "zero", "huge", "tiny", "normal")


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(TABLE_FREE),
    role=st.sampled_from(["key", "value"]),
    kinds=st.lists(st.sampled_from(GROUP_KINDS), min_size=4, max_size=4),
    magnitude=st.floats(min_value=-30, max_value=38),
    seed=st.integers(0, 2**16),
)
# a constant row of 10^4.5: inside the fp16 range, but rotated its energy lands on one channel, 32^0.5 times larger
@example(name="rotate+asym_token", role="key", kinds=["constant"] * 4, magnitude=4.5, seed=0)
def test_bf16_groups_constant_zero_huge_never_give_nan_or_inf(name, role, kinds, magnitude, seed):
    """Each of 4 blocks of 8 tokens is one kind: constant (one value 10^magnitude), zeros, huge (random signs at
    up to bf16's largest finite value), tiny (10^-30), or normal; stores never return NaN or inf, stay within
    their step (rotated schemes only where the rotated values are inside the fp16 range, which their stores clamp
    to), and keep zeros exact."""
    torch.manual_seed(seed)
    bits = widths(name)
    g = 8
    blocks = []
    for kind in kinds:
        shape = (2, len(bits), 8, 32)
        if kind == "constant":
            block = torch.full(shape, 10.0**magnitude)
        elif kind == "zero":
            block = torch.zeros(shape)
        elif kind == "huge":
            block = torch.randn(shape).sign() * torch.finfo(BF16).max * torch.rand(shape)
        elif kind == "tiny":
            block = torch.randn(shape) * 1e-30
        else:
            block = torch.randn(shape)
        blocks.append(block)
    x = torch.cat(blocks, 2).to(BF16)  # (2, H, 32, 32)
    store = get_scheme(name, group_size=g, residual=0).new_store(
        bits, 32, 2, BF16, "cpu", role=role, simulate=True
    )
    got = store.append(x)
    assert torch.isfinite(got).all() and torch.isfinite(store.dequantize()).all()
    if not get_scheme(name).rotated or hadamard_rotate(x.float()).abs().max() <= FP16_MAX:
        check_round_trip(name, role, x, got, bits, g)
    if all(kind == "zero" for kind in kinds):
        assert torch.equal(got, x)


# --- calibration -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])  # gemma3: sliding windows and its own scaling
def test_bf16_entropies_within_1e2_of_float32(models, name, monkeypatch):
    fp32, bf16 = models[name]
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (3, 96))
    seen = []
    record = calibrate._Recorder.record

    def spy(self, layer, weights):
        seen.append(weights.dtype)
        return record(self, layer, weights)

    monkeypatch.setattr(calibrate._Recorder, "record", spy)
    want = head_entropies(fp32, ids, i0=16)
    got = head_entropies(bf16, ids, i0=16)
    assert set(seen) == {torch.float32}  # bf16 scores are upcast before softmax and entropy
    pd.testing.assert_frame_equal(got.drop(columns=["H2", "H1"]), want.drop(columns=["H2", "H1"]))
    for column in ("H2", "H1"):
        diff = (got[column] - want[column]).abs()
        assert diff.max() < 1e-2, (column, diff.max())
        assert diff.max() > 0  # the models really differ: bf16 weights and activations


def test_bf16_calibration_is_cached_apart_from_float32(models, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    fp32, bf16 = models["tiny-llama"]
    ids = torch.randint(0, 256, (1, 48))
    a = calibrate.cached_head_entropies(fp32, "tiny-llama", ids, i0=8)
    b = calibrate.cached_head_entropies(bf16, "tiny-llama", ids, i0=8)
    assert len(list((tmp_path / "calibration").glob("*.parquet"))) == 2
    assert not a["H2"].equals(b["H2"])


# --- the cache, eviction and teacher-forced metrics ------------------------------------------------------------


def chunked_logits(model, ids, cache, chunk):
    out = []
    for s in range(0, ids.shape[1], chunk):
        out.append(model(input_ids=ids[:, s : s + chunk], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, 1)  # (B, T, V)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
@torch.no_grad()
def test_bf16_cache_at_16_bits_is_exactly_the_bf16_dynamic_cache(models, name):
    _, model = models[name]
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 37))  # longer than tiny-gemma3's window of 16
    dynamic = DynamicCache(config=model.config)
    ref = chunked_logits(model, ids, dynamic, chunk=7)
    assert ref.dtype == BF16
    for scheme in ("asym_token", "kivi", "rotate+sym_token"):
        cache = QuantizedKVCache(model.config, 16, prefill="quantized", scheme=scheme, simulate=True)
        assert torch.equal(chunked_logits(model, ids, cache, chunk=7), ref), scheme
    full = layer_types(model.config).index("full")  # a sliding window would drop the sinks
    bits = torch.full((len(cache.layers), max(kv_heads(model.config))), 4)
    bits[:full] = 16  # layer `full` sees exactly the hidden states the DynamicCache run saw
    cache = QuantizedKVCache(
        model.config, bits, scheme="asym_token", sink_tokens=2, residual=3, group_size=16, simulate=True
    )
    got = chunked_logits(model, ids, cache, chunk=7)
    assert torch.isfinite(got).all() and not torch.equal(got, ref)
    keys = cache.layers[full].k_store.dequantize()  # (B, Hkv, T, D)
    assert keys.dtype == BF16
    # sink tokens and the residual window are held unquantized in the model's dtype: exactly the bf16 keys
    want = dynamic.layers[full].keys
    assert torch.equal(keys[:, :, :2], want[:, :, :2]) and torch.equal(keys[:, :, -3:], want[:, :, -3:])
    assert not torch.equal(keys[:, :, 2:-3], want[:, :, 2:-3])


@torch.no_grad()
def test_bf16_teacher_forced_metrics_are_float32_and_zero_against_itself(models):
    _, model = models["tiny-llama"]
    torch.manual_seed(2)
    seqs = torch.randint(0, 256, (2, 41))
    base = evaluate.teacher_forced(model, seqs, evaluate.dynamic_cache_factory(model), chunk=9)
    same = evaluate.teacher_forced(
        model, seqs, lambda: QuantizedKVCache(model.config, 16, simulate=True), chunk=9, baseline=base
    )
    assert base.nll.dtype == torch.float32 and same.kl.dtype == torch.float32
    assert torch.isfinite(base.nll).all() and torch.equal(same.kl, torch.zeros_like(same.kl))
    two = evaluate.teacher_forced(
        model,
        seqs,
        lambda: QuantizedKVCache(model.config, 2, prefill="quantized", simulate=True),
        chunk=9,
        baseline=base,
    )
    assert torch.isfinite(two.kl).all() and two.kl.mean() > 1e-3


@pytest.mark.parametrize("name", ["streaming", "h2o"])
@torch.no_grad()
def test_bf16_eviction_scores_in_float32_and_keep_one_changes_nothing(models, name):
    _, model = models["tiny-llama"]
    torch.manual_seed(3)
    prompts = torch.randint(0, 256, (2, 21))
    want = evaluate.greedy_generate(
        model, prompts, 6, lambda: QuantizedKVCache(model.config, 16, simulate=True)
    )
    for keep, bits in ((1.0, 16), (0.4, 4)):
        spec = EvictionSpec(name, keep=keep, sink_tokens=2)
        caches = []

        def factory(spec=spec, bits=bits, caches=caches):
            caches.append(
                with_eviction(QuantizedKVCache(model.config, bits, group_size=16, simulate=True), spec)
            )
            return caches[-1]

        with attention_for(model, spec):
            got = evaluate.greedy_generate(model, prompts, 6, factory)
        if keep == 1.0:
            assert torch.equal(got, want)
        scores = [layer.scores for layer in caches[-1].layers if getattr(layer, "scores", None) is not None]
        if name == "h2o":
            assert scores and all(s.dtype == torch.float32 and torch.isfinite(s).all() for s in scores)


# --- the claim protocol and passkey ----------------------------------------------------------------------------


def test_bf16_claim_protocol_rows_are_finite_and_say_bf16(models):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "+sweep=claim_smollm2",
                "model.dtype=bfloat16",
                "sweep.models=[tiny-llama]",
                "sweep.claim.num_sequences=2",
                "sweep.claim.sequence_tokens=24",
                "sweep.claim.new_tokens=3",
                "sweep.claim.calibration_sequences=1",
                "sweep.claim.calibration_positions=[5,11,17,23]",
                "sweep.claim.skip=1",
            ],
        )
    s = claim.settings(cfg)
    assert s.dtype == "bfloat16"
    torch.manual_seed(4)
    rows = claim.measure(models["tiny-llama"][1], s, torch.randint(0, 256, (2, 24)))
    assert len(rows) == 4 and {r["dtype"] for r in rows} == {"bfloat16"}
    assert all(math.isfinite(r["ppl_ratio"]) and math.isfinite(r["bleu_tok"]) for r in rows)


def test_bf16_passkey_points_are_named_apart_and_record_the_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "calibration"))
    argv = [
        "--models", "tiny-llama", "--contexts", "300", "--depths", "0.5", "--trials", "2", "--batch", "2",
        "--policies", "uniform", "--budgets", "4", "--calibration-sequences", "2", "--calibration-tokens", "48",
        "--root", str(tmp_path), "--run", "r",
    ]  # fmt: skip
    (fp32,) = passkey.jobs(passkey.parser().parse_args(argv))
    (bf16,) = passkey.jobs(passkey.parser().parse_args([*argv, "--dtype", "bfloat16"]))
    assert fp32.settings.dtype == "float32" and bf16.settings.dtype == "bfloat16"
    assert passkey.run_model(bf16, tmp_path / "r", progress=lambda _: None) == 2
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "r" / "points").glob("*.json"))]
    assert {r["config"]["dtype"] for r in records} == {"bfloat16"} and {r["status"] for r in records} == {
        "ok"
    }
    assert all(r["key"].endswith(bf16.settings.digest()) for r in records)
    assert fp32.settings.digest() != bf16.settings.digest()


# --- a whole sweep ----------------------------------------------------------------------------------------------


def sweep(in_process, run_dir: Path, *overrides: str) -> pd.DataFrame:
    """python -m harness +sweep=smoke into run_dir, run in this process; its results table."""
    proc = in_process(
        entry, "harness", "+sweep=smoke", f"run_dir={run_dir}", "tracking.wandb.mode=disabled", *overrides
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return pd.read_parquet(run_dir / "results.parquet")


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory, in_process):
    """The smoke grid in float32 and in bfloat16: (run dir, table) each."""
    root = tmp_path_factory.mktemp("dtypes")
    return {
        dtype: (root / dtype, sweep(in_process, root / dtype, f"model.dtype={dtype}"))
        for dtype in ("float32", "bfloat16")
    }


def test_bf16_smoke_sweep_is_finite_and_keyed_apart_from_float32(smoke_runs):
    (_, fp32), (bf16_dir, bf16) = smoke_runs["float32"], smoke_runs["bfloat16"]
    assert set(fp32["dtype"]) == {"float32"} and set(bf16["dtype"]) == {"bfloat16"}
    assert not set(fp32["key"]) & set(bf16["key"])
    assert len(fp32) == len(bf16) and (bf16["status"] == "ok").sum() == (fp32["status"] == "ok").sum() > 0
    ok = bf16[bf16["status"] == "ok"]
    metrics = [
        "ppl",
        "ppl_ratio",
        "kl_mean",
        "kl_p99",
        "top1_agree",
        "bleu",
        "token_match",
        "compression_true",
    ]
    assert ok[metrics].notna().all().all() and all(ok[m].map(math.isfinite).all() for m in metrics)
    assert ok["native_bf16"].notna().all()
    for path in (bf16_dir / "points").glob("*.json"):  # keys are the hash of each point with its dtype
        record = json.loads(path.read_text())
        assert (
            record["key"] == Point.from_dict(record["config"]).key()
            and record["config"]["dtype"] == "bfloat16"
        )
    env = json.loads((bf16_dir / "env.json").read_text())
    assert env["dtype"] == "bfloat16" and isinstance(env["native_bf16"], bool)
    # fp32 keys are the keys the same points had before dtypes were recorded
    assert all(
        Point.from_dict({**c, "dtype": "float32"}).key() == k for c, k in _configs(smoke_runs["float32"][0])
    )


def _configs(run_dir: Path):
    for path in (run_dir / "points").glob("*.json"):
        record = json.loads(path.read_text())
        yield {k: v for k, v in record["config"].items() if k != "dtype"}, record["key"]


def test_compare_runs_on_the_two_smoke_runs(smoke_runs, tmp_path, in_process):
    """python -m harness.compare_runs run in this process (test_compare_runs.py runs it as a new process)."""
    (a, fp32), (b, _) = smoke_runs["float32"], smoke_runs["bfloat16"]
    out = tmp_path / "cmp"
    proc = in_process(
        compare_main, "harness.compare_runs", str(a), str(b), "--out", str(out), "--n-boot", "50"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    points = pd.read_csv(out / "points.csv")
    n_ok = ((fp32["status"] == "ok") & (fp32["policy"] != "baseline")).sum()
    assert len(points) == n_ok and points["d_ppl_ratio"].map(math.isfinite).all()
    diffs = pd.read_csv(out / "differences.csv")
    assert set(diffs["metric"]) == {"bleu", "token_match", "ppl_ratio", "kl_mean"} and len(diffs) % 4 == 0
    text = (out / "compare.md").read_text()
    assert text.startswith("`python -m harness.compare_runs ") and "float32" in text and "bfloat16" in text


# --- the real model --------------------------------------------------------------------------------------------


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_in_bf16_stays_close_to_float32():
    """The GGUF's dequantized weights cast once to bf16: teacher-forced predictions close to float32's (KL about
    0.002 per token on this model)."""
    fp32, tokenizer = load_model("smollm2-135m")
    bf16, _ = load_model("smollm2-135m", dtype="bfloat16")
    assert all(p.dtype == BF16 for p in bf16.parameters())
    sequences = data.token_windows(tokenizer, data.split().evaluation, 2, 256, seed=0)
    base = evaluate.teacher_forced(
        fp32, sequences, evaluate.dynamic_cache_factory(fp32), chunk=64, batch_size=2
    )
    run = evaluate.teacher_forced(
        bf16, sequences, evaluate.dynamic_cache_factory(bf16), chunk=64, batch_size=2, baseline=base
    )
    m = metrics.teacher_forced_metrics(base, run)
    assert 0 < m["kl_mean"] < 0.01 and m["top1_agree"] > 0.85 and abs(m["ppl_ratio"] - 1) < 0.02, m
