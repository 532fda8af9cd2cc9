"""The claim protocol (harness/protocols/claim.py) and its QDQ attention (harness/attention/qdq.py) on tiny-llama."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness.attention import QDQ, QDQSpec, installed
from harness.attention.qdq import top_k_rows
from harness.models import load_model
from harness.protocols import claim
from harness.report import claim as claim_tables
from harness.validate import ConfigError, validate_config
from kernels import reference

CONF = str(Path(__file__).resolve().parents[2] / "conf")
TINY = [  # 2 sequences of 24 tokens, 3 new tokens, calibration at 4 positions of the first sequence
    "sweep.models=[tiny-llama]",
    "sweep.claim.num_sequences=2",
    "sweep.claim.sequence_tokens=24",
    "sweep.claim.new_tokens=3",
    "sweep.claim.calibration_sequences=1",
    "sweep.claim.calibration_positions=[5,11,17,23]",
    "sweep.claim.skip=1",
]


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=["+sweep=claim_smollm2", *overrides])


@pytest.fixture(scope="module")
def llama():
    model, _ = load_model("tiny-llama")
    return model


@torch.no_grad()
def test_sixteen_bits_is_the_plain_greedy_continuation(llama):
    torch.manual_seed(11)
    ids = torch.randint(0, 256, (2, 24))
    want = llama.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)[:, 24:]
    bits = torch.full((3, 3), 16)
    with installed(llama, QDQ, QDQSpec(bits)):
        got = claim.greedy_no_cache(llama, ids, 3)
        nll16 = claim.sequence_nll(llama, ids)
    assert torch.equal(got, want)
    assert torch.allclose(nll16, claim.sequence_nll(llama, ids), atol=1e-5)  # plain (sdpa) attention
    with installed(llama, QDQ, QDQSpec(torch.full((3, 3), 2))):
        nll2 = claim.sequence_nll(llama, ids)
    assert torch.isfinite(nll2).all() and (nll2 - nll16).abs().max() > 1e-3


@torch.no_grad()
def test_each_layer_and_head_gets_its_width(llama, monkeypatch):
    """Record the K/V that reach eager attention; compare with kernels.reference at each head's width."""
    import transformers.models.llama.modeling_llama as llama_module

    eager, seen = llama_module.eager_attention_forward, {}

    def recording(module, query, key, value, *args, **kwargs):
        seen[module.layer_idx] = (key, value)
        return eager(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(llama_module, "eager_attention_forward", recording)
    torch.manual_seed(12)
    ids = torch.randint(0, 256, (2, 19))
    with installed(llama, QDQ, QDQSpec(torch.full((3, 3), 16))):
        llama(input_ids=ids, use_cache=False)
    raw = dict(seen)
    bits = torch.tensor([[2, 16, 4], [8, 3, 2], [4, 4, 16]])  # (layer, KV head) widths
    for layer, symmetric in [(0, False), (1, True), (2, False)]:
        # Only `layer` quantized: the layers before it see raw inputs, so its incoming K/V are raw[layer].
        only = torch.full((3, 3), 16)
        only[layer] = bits[layer]
        seen.clear()
        with installed(llama, QDQ, QDQSpec(only, group_size=16, symmetric=symmetric)):
            llama(input_ids=ids, use_cache=False)
        for before in range(layer):
            assert all(torch.equal(a, b) for a, b in zip(seen[before], raw[before]))
        for got, x in zip(seen[layer], raw[layer]):  # keys, then values: (B, Hkv, T, D)
            for h, b in enumerate(bits[layer].tolist()):
                want = x[:, h] if b == 16 else reference.fake_quantize(x[:, h], b, 16, symmetric)
                assert torch.equal(got[:, h], want), (layer, h, b, symmetric)
            assert not torch.equal(got, x)


@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (1, 2, 5, 13)])
@pytest.mark.parametrize("factor", [2, 3, 5])
def test_top_k_keeps_ceil_visible_over_factor_per_row(shape, factor):
    torch.manual_seed(sum(shape) + factor)
    B, H, Tq, Tk = shape
    scores = torch.randn(shape)
    # causal with the last query aligned to the last key, and a random extra mask per batch row
    visible = torch.arange(Tk)[None, :] <= torch.arange(Tq)[:, None] + (Tk - Tq)  # (Tq, Tk)
    visible = visible & (torch.rand(B, 1, Tq, Tk) > 0.3)
    visible[..., -1] = True  # at least one visible key per row
    weights = scores.masked_fill(~visible, -math.inf).softmax(-1)
    kept = top_k_rows(weights, visible, factor)
    n_visible = visible.expand(shape).sum(-1)
    assert torch.equal((kept > 0).sum(-1), (n_visible + factor - 1) // factor)
    assert torch.allclose(kept.sum(-1), torch.ones(B, H, Tq))
    for b, h, i in [(0, 0, Tq - 1), (B - 1, H - 1, Tq // 2)]:
        row, k = weights[b, h, i], int((n_visible[b, h, i] + factor - 1) // factor)
        top = row.topk(k).indices
        assert set(kept[b, h, i].nonzero().flatten().tolist()) == set(top.tolist())
        assert torch.allclose(kept[b, h, i, top], row[top] / row[top].sum())


def test_tables_in_the_claims_format():
    s = claim.settings(compose_cfg(*TINY))
    items = {"bleu_tok": [0.5, 0.6], "token_match": [0.5, 0.5], "nll": [2.1, 2.0], "nll_base": [2.0, 2.0]}
    base = dict(model="m", architecture="hybrid (full + sliding) + GQA", first_divergence=1.0, items=items)
    measured = [
        dict(
            base,
            label="Uniform 4-bit",
            bleu_tok=0.5312,
            token_match=0.5125,
            ppl_ratio=1.1011,
            compression=4.0,
        ),
        dict(
            base,
            label="Skip 1 + adaptive 4-bit",
            bleu_tok=0.574,
            token_match=0.6,
            ppl_ratio=1.062,
            compression=3.2,
        ),
        dict(base, label="Combined 12x", bleu_tok=0.4641, token_match=0.3, ppl_ratio=1.16, compression=12.0),
    ]
    assert claim_tables.claim2_table(measured).splitlines() == [
        "| Config | BLEU | Token match | PPL ratio | Nx |",
        "|---|---|---|---|---|",
        "| Uniform 4-bit | 0.531 | 51.2% | 1.101 | 4.00x |",
        "| Skip 1 + adaptive 4-bit | 0.574 | 60.0% | 1.062 | 3.20x |",
    ]
    assert claim_tables.claim1_table(measured).splitlines()[::2] == [
        "| Model | Architecture | Combined 12x BLEU | PPL increase |",
        "| m | hybrid (full + sliding) + GQA | 0.464 | +16.0% |",
    ]
    assert claim_tables._ppl_increase(150.0) == ">150x"
    text = claim_tables.render(s, measured, "python -m harness +sweep=claim_smollm2")
    assert text.startswith(
        "# Claim protocol on tiny-llama\n\nCommand: `python -m harness +sweep=claim_smollm2`"
    )
    assert (
        "## Claim 2 (claim protocol on tiny-llama)" in text
        and "## Claim 1 (claim protocol on tiny-llama)" in text
    )


def test_rows_validate_and_bad_input_names_its_key():
    labels = [r["label"] for r in validate_config(compose_cfg())]
    assert labels == [
        "Uniform 4-bit",
        "Adaptive 4-bit (alpha 0.25)",
        "Skip 3 + adaptive 4-bit",
        "Combined 12x",
    ]
    for override, message in [
        ("sweep.claim.calibration_positions=[3,200]", r"^sweep.claim.calibration_positions: \[3, 200\]"),
        ("sweep.claim.new_tokens=0", r"^sweep.claim.new_tokens: 0 is not a positive integer"),
        ("sweep.protocol=claims", r"^sweep.protocol: unknown 'claims'; allowed: runner, claim"),
        ("sweep.models=[smollm2-135m,gpt2]", r"^sweep.models: the claim protocol runs one model per run"),
        ("sweep.claim.budget=9", r"^sweep.claim.budget: 9 is not allowed"),
        ("sweep.claim.widths=[2,7]", r"^sweep.claim.widths: 7 is not an allowed width"),
        ("policy.entropy_key=H3", r"^policy.entropy_key: unknown 'H3'"),
        (
            "quant.scheme=kivi",
            r"^quant.scheme: 'kivi' with the claim protocol; allowed: asym_token, sym_token",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_config(compose_cfg(override))


def test_protocol_end_to_end_writes_tables_and_rows(tmp_path):
    cfg = compose_cfg(*TINY, f"run_dir={tmp_path}")
    measured = claim.run(cfg)
    assert [r["label"] for r in measured][0] == "Uniform 4-bit"
    uniform, adaptive, skip, combined = measured
    assert uniform["mean_bits"] == 4 and uniform["compression"] == 4.0 and combined["compression"] == 12.0
    assert skip["n_sinks"] == 1 and skip["mean_bits"] > 4  # the skipped head counts 16 bits
    for r in measured:
        assert 0 <= r["bleu_tok"] <= 1 and math.isfinite(r["ppl_ratio"]) and len(r["tokens"]) == 2
    assert combined["ppl_ratio"] != uniform["ppl_ratio"]  # the top-k mask changes what attention reads
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert saved["settings"]["model"] == "tiny-llama" and len(saved["rows"]) == 4
    tables = (tmp_path / "tables.md").read_text()
    assert tables.startswith("# Claim protocol on tiny-llama") and "n=2 too small for an interval" in tables
    (tmp_path / "tables.md").unlink()
    claim.main([str(tmp_path)])  # rewritten from rows.json and env.json alone
    assert (tmp_path / "tables.md").read_text() == tables


def test_gpt2_without_local_weights_stops_with_the_models_message(tmp_path, cli):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    proc = cli("harness", "+sweep=claim_gpt2", f"run_dir={tmp_path / 'run'}", env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: model gpt2: weights of gpt2 are not on this machine"
    )
    assert "HF_HOME" in lines[0] and not (tmp_path / "run").exists()


def _claim_row(label: str, rng, n: int, shift: float) -> dict:
    base = rng.uniform(2.0, 3.0, n)
    return {
        "label": label,
        "items": {
            "bleu_tok": list(rng.uniform(0, 1, n)),
            "token_match": list(rng.uniform(0, 1, n)),
            "nll": list(base + shift + rng.normal(0, 0.01, n)),
            "nll_base": list(base),
        },
    }


def test_paired_differences_recover_a_known_shift_and_refuse_small_n():
    import numpy as np

    rng = np.random.default_rng(7)
    uniform = _claim_row("Uniform 4-bit", rng, 16, 0.05)
    worse = _claim_row("Worse", rng, 16, 0.25)
    base = np.asarray(uniform["items"]["nll_base"])  # the same sequences: one baseline
    worse["items"].update(nll=list(base + 0.25 + rng.normal(0, 0.01, 16)), nll_base=list(base))
    table = claim_tables.differences_table([uniform, worse])
    cell = table.splitlines()[-1].split("|")[4].strip()  # the PPL ratio column
    expected = math.exp(np.mean(worse["items"]["nll"]) - np.mean(uniform["items"]["nll_base"])) - math.exp(
        np.mean(uniform["items"]["nll"]) - np.mean(uniform["items"]["nll_base"])
    )
    assert cell.startswith("**") and "n=16" in cell  # a 0.2-nat shift with 0.01 noise is significant
    assert float(cell.strip("*").split()[0]) == pytest.approx(expected, rel=1e-2)
    small = claim_tables.differences_table([_claim_row("U", rng, 8, 0.0), _claim_row("W", rng, 8, 0.2)])
    assert small.count("n=8 too small for an interval") == 3 and "[" not in small
