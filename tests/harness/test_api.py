"""The library surface (harness/api.py) as a user meets it: README's code block run verbatim, each step against
the harness's own pieces, allocation files and `python -m harness.export` on committed points, and every bad
argument a one-line ValueError that names it."""

from __future__ import annotations

import contextlib
import io
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

import harness
from harness.attention import PACKED, installed
from harness.calibrate import head_entropies
from harness.capacity import element_price, shape_from_config
from harness.export import main as export_main
from harness.models import byte_tokenizer, gguf_path, model_spec
from harness.policies import Allocation, Entropy
from harness.schemes import get_scheme

ROOT = Path(__file__).resolve().parents[2]
FRONTIER = ROOT / "results" / "frontier" / "2026-11-24_frontier"


def readme_block() -> str:
    """The first python code block under README's "Use it from Python" heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use it from Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A fresh working directory and disk cache."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_the_readme_block_runs_verbatim(isolated, capsys):
    namespace: dict = {}
    exec(compile(readme_block(), "README.md", "exec"), namespace)  # noqa: S102 (the README's own code)
    out = capsys.readouterr().out
    cache, allocation, scheme = namespace["cache"], namespace["allocation"], namespace["scheme"]
    assert f"{cache.nbytes()} cache bytes" in out and 0 < cache.nbytes() < cache.nbytes_fp16()
    assert namespace["out"].shape[1] == namespace["ids"].shape[1] + 16
    saved = json.loads((isolated / "allocation.json").read_text())
    assert saved["scheme"]["scheme"] == scheme.name == "asym_token"
    assert torch.equal(allocation.key_bits, torch.tensor(saved["allocation"]["key_bits"]))
    assert list((isolated / "cache" / "calibration").glob("llama-*.parquet"))  # cached on disk


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = harness.load("tiny-llama")
    return model, tokenizer


@torch.no_grad()
def test_each_step_equals_the_harness_pieces(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model, tokenizer = tiny
    torch.manual_seed(5)
    ids = torch.randint(0, 256, (3, 67))
    calibration = harness.calibration(model, ids=ids, i0=9)
    want = head_entropies(model, ids, i0=9)
    assert calibration.entropy[["H2", "H1"]].equals(want[["H2", "H1"]])
    again = harness.calibration(model, ids=ids, i0=9)  # read from disk: the same table
    assert again.name == calibration.name and again.entropy.equals(calibration.entropy)

    scheme = harness.make_scheme("sym_token", group_size=16)
    assert scheme == get_scheme("sym_token", 16)
    allocation = harness.allocate(
        model, calibration, 4, policy="entropy", scheme=scheme, alpha=1.0, sink_fraction=0.12
    )
    price = element_price(shape_from_config(model.config), scheme)
    expected = Entropy(alpha=1.0, sink_fraction=0.12).allocate(want, 4, price=price)
    assert torch.equal(allocation.key_bits, expected.key_bits) and int(allocation.sinks.sum()) > 0
    policy = harness.make_policy("entropy", alpha=1.0, sink_fraction=0.12)
    same = harness.allocate(model, calibration, 4, policy=policy, scheme=scheme)
    assert torch.equal(same.key_bits, allocation.key_bits)

    cache = harness.quantized_cache(model, allocation, scheme)
    direct = harness.QuantizedKVCache(model.config, allocation.key_bits, "sym_token", group_size=16)
    prompt = torch.randint(1, 256, (2, 11))
    with installed(model, PACKED):
        a = model(input_ids=prompt, past_key_values=cache).logits
        b = model(input_ids=prompt, past_key_values=direct).logits
    assert torch.equal(a, b) and cache.nbytes() == direct.nbytes() > 0


def test_any_transformers_model_object_loads_and_calibrates_by_its_weights(tmp_path, monkeypatch):
    """A model the registry does not know: its disk cache is keyed by a digest of its weights, so two models of one
    config do not share entropies."""
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.2,
    )  # fmt: skip
    tables = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model, tokenizer = harness.load(LlamaForCausalLM(config), byte_tokenizer())
        assert not model.training and model.config.use_cache
        tables.append(harness.calibration(model, tokenizer, sequences=2, tokens=64))
    assert tables[0].name != tables[1].name
    assert not tables[0].entropy["H2"].equals(tables[1].entropy["H2"])


def test_allocation_files_round_trip(tiny, tmp_path):
    model, tokenizer = tiny
    torch.manual_seed(2)
    calibration = harness.calibration(model, ids=torch.randint(0, 256, (2, 48)), i0=4)
    allocation = harness.allocate(
        model, calibration, 3, policy="kv", scheme="asym_token", alpha=0.5, key_offset=2.0
    )
    assert not allocation.is_per_head  # keys and values apart
    scheme = harness.make_scheme("kivi", group_size=16, sink_tokens=2)
    path = harness.save_allocation(tmp_path / "a.json", allocation, scheme, note="test")
    loaded, loaded_scheme = harness.load_allocation(path)
    assert loaded_scheme == scheme
    for name in ("key_bits", "value_bits", "sinks"):
        assert torch.equal(getattr(loaded, name), getattr(allocation, name)), name
    for name in ("continuous", "value_continuous"):
        assert torch.allclose(getattr(loaded, name), getattr(allocation, name), equal_nan=True), name
    assert json.loads(path.read_text())["source"] == {"note": "test"}
    (tmp_path / "b.json").write_text("{}")
    with pytest.raises(ValueError, match="^path: .* is not an allocation file"):
        harness.load_allocation(tmp_path / "b.json")


@pytest.mark.parametrize("values", [
    {"policy": "x", "key_bits": [[4, 7]], "value_bits": [[4, 4]]},
    {"policy": "x", "key_bits": [[4, 4.5]], "value_bits": [[4, 4]]},
    {"policy": "x", "key_bits": [[4, 4]], "value_bits": [[4]]},
    {"policy": "x", "key_bits": [[4, 0]], "value_bits": [[4, 4]]},
    {"policy": "x", "key_bits": [[4, 4]], "value_bits": [[4, 4]], "continuous": [[1.0, "a"]]},
    {"key_bits": [[4]], "value_bits": [[4]]},
])  # fmt: skip
def test_a_malformed_allocation_names_its_entry(values):
    with pytest.raises(ValueError, match=r"^allocation\.\w+: ") as err:
        Allocation.from_dict(values)
    assert "\n" not in str(err.value)


def smollm2_config():
    """smollm2-135m's config from its GGUF's metadata (no weights)."""
    path = gguf_path(model_spec("smollm2-135m"))
    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def export(*args: str) -> tuple[int, str]:
    """python -m harness.export ARGS in this process: (exit code, stderr's text), stderr captured."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            export_main(list(args))
        except SystemExit as exit_:
            return int(exit_.code), err.getvalue()
    return 0, err.getvalue()


@pytest.mark.parametrize("key", ["997d4209ea9892a4", "0db8639600fa12bb", "841260f2be4ea139"])
def test_export_writes_a_committed_points_allocation_and_scheme(tmp_path, key):
    """The 6x nuqkey_codebook knapsack, a kivi knapsack, and a knapsack with 16 among its widths."""
    out = tmp_path / "allocation.json"
    code, stderr = export(str(FRONTIER), key, "--out", str(out))
    assert code == 0, stderr
    record = json.loads((FRONTIER / "points" / f"{key}.json").read_text())
    allocation, scheme = harness.load_allocation(out)
    assert torch.equal(allocation.key_bits, torch.tensor(record["allocation"]["key_bits"]))
    assert torch.equal(allocation.value_bits, torch.tensor(record["allocation"]["value_bits"]))
    assert allocation.mean_bits == pytest.approx(record["metrics"]["mean_bits"])
    config = record["config"]
    options = dict(
        group_size=32, sink_tokens=0, residual=None, key_group_size=None, outliers=0.0, key_levels="kmeans"
    )
    assert scheme == get_scheme(config["scheme"], **{k: config.get(k, v) for k, v in options.items()})
    assert allocation.sinks.sum() == 0  # no sink rule: the 16-bit units (if any) are the knapsack's choice
    source = json.loads(out.read_text())["source"]
    assert source["key"] == key and source["metrics"]["ppl_ratio"] == record["metrics"]["ppl_ratio"]
    if not scheme.key_tables:  # a cache for smollm2-135m from the file alone
        cache = harness.QuantizedKVCache(smollm2_config(), allocation, scheme)
        assert torch.equal(cache.key_bits, allocation.key_bits)


def test_export_is_a_command(cli, tmp_path):
    result = cli("harness.export", str(FRONTIER), "997d4209ea9892a4", "--out", str(tmp_path / "a.json"))
    assert result.returncode == 0, result.stderr
    assert "nuqkey_codebook" in result.stdout and harness.load_allocation(tmp_path / "a.json")


def test_export_of_a_sink_rule_point_marks_its_sinks(tmp_path):
    from harness.export import exported, read_point

    sweep = ROOT / "results" / "pareto"
    for path in sorted(sweep.glob("*/points/*.json")):
        record = json.loads(path.read_text())
        if record["config"].get("sink_threshold") is not None and record.get("status") == "ok":
            break
    else:
        pytest.skip("no committed point with a sink rule")
    allocation, _, source = exported(read_point(path.parent.parent, path.stem))
    assert source["sinks_recorded"]
    assert int(allocation.sinks.sum()) == record["metrics"]["n_sinks"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["results/nowhere", "abc"], "RUN_DIR: results/nowhere has no points/ folder"),
        (
            [str(FRONTIER), "997d4209ea9892a"],
            "KEY: no point '997d4209ea9892a' in .*closest: 997d4209ea9892a4",
        ),
        (
            [str(ROOT / "results" / "peers" / "2026-11-25_peers"), "0d21a86f1745402a"],
            "KEY: 0d21a86f1745402a is a point of the peer engine llamacpp, which has no allocation",
        ),
        (
            [str(FRONTIER), "1d8984e2128c16ab"],
            r"KEY: 1d8984e2128c16ab has no allocation \(the unquantized baseline\)",
        ),
    ],
)
def test_export_refuses_bad_input_in_one_line(args, message):
    code, stderr = export(*args)
    assert code == 2
    assert re.fullmatch(f"error: {message}.*\n", stderr), stderr


BAD_ARGUMENTS = [
    (lambda m, c: harness.allocate(m, c, 9), "budget: 9 is not allowed"),
    (lambda m, c: harness.allocate(m, c, 3, policy="entropyy"), "policy: unknown 'entropyy' (did you mean entropy?)"),
    (lambda m, c: harness.allocate(m, c, 3, alpha="x"), "alpha: expected a finite real number; got 'x'"),
    (lambda m, c: harness.allocate(m, c, 3, bogus=1), "bogus: not an option of policy entropy"),
    (lambda m, c: harness.allocate(m, c, 3, scheme="asym"), "scheme: unknown 'asym'"),
    (lambda m, c: harness.allocate(m, c, 3, policy=harness.make_policy("uniform"), alpha=1), "alpha: a Policy object"),
    (lambda m, c: harness.make_scheme("asym_token", group_size=0), "group_size: 0 is not a positive integer"),
    (lambda m, c: harness.make_scheme("asym_token", bits=4), "bits: not an option of a scheme"),
    (lambda m, c: harness.quantized_cache(m, c, "asym_token"), "allocation: expected an Allocation"),
    (lambda m, c: harness.quantized_cache(m, harness.allocate(m, c, 3), "nuqkey"), "calibration: scheme nuqkey"),
    (lambda m, c: harness.quantized_cache(m, harness.allocate(m, c, 3), "pca"), "calibration: scheme pca reads parts fitted on calibration windows (pca)"),
    (lambda m, c: harness.quantized_cache(m, harness.allocate(m, c, 3), "xlayer", c, simulate=False), "simulate: False with scheme xlayer"),
    (lambda m, c: harness.quantized_cache(m, harness.allocate(m, c, 3), simulate="yes"), "simulate: 'yes' is not allowed; allowed: True, False, None"),
    (lambda m, c: c.fitted(m, "calkey", span=0), "span: 0 is not a positive integer"),
    (lambda m, c: harness.allocate(m, c, 3, policy="sensitivity", scheme="calkey"), "policy: sensitivity measures its table without fitted key tables, which quant.scheme calkey needs"),
    (lambda m, c: harness.quantized_cache(m, harness.allocate(m, c, 3), outside_packed="x"), "outside_packed: unknown"),
    (lambda m, c: harness.calibration(m), "tokenizer: needed"),
    (lambda m, c: harness.calibration(m, ids=torch.zeros(2, 8, dtype=torch.long), i0=8), "i0: 8 must be"),
    (lambda m, c: harness.load("nope"), "source: 'nope' is neither a registered model"),
    (lambda m, c: harness.load(torch.nn.Linear(2, 2)), "source: a Linear is not a transformers model"),
    # the command line's bad inputs, as arguments
    (lambda m, c: harness.allocate(m, c, 4, widths=[4, 4]), "widths: 4 appears twice in [4, 4]; allowed: each width once"),
    (lambda m, c: harness.allocate(m, c, 4, scheme="nuqkey", widths=[8]), "widths: [8] with quant.scheme nuqkey, which stores quantized heads at 2, 3, 4 bits; allowed: 2, 3, 4, 16"),
    (lambda m, c: harness.allocate(m, c, 4, policy="uniform", scheme="nuqkey_codebook", widths=[2, 8]), "widths: [8] with quant.scheme nuqkey_codebook"),
    # a Policy object carries its widths (2, 3, 4, 8 unless made with the scheme): none is replaced
    (lambda m, c: harness.allocate(m, c, 4, policy=harness.make_policy("uniform"), scheme="nuqkey_codebook"), "widths: [8] with quant.scheme nuqkey_codebook"),
    (lambda m, c: harness.load("tiny-llama", device="tpu"), "device: 'tpu' is not allowed; allowed here: cpu"),
    *([] if torch.cuda.is_available() else [
        (lambda m, c: harness.load("tiny-llama", device="cuda"), "device: cuda but this machine has no CUDA device"),
        (lambda m, c: harness.quantized_cache(m, harness.allocate(m, c, 4), backend="triton"), "backend: triton needs CUDA tensors"),
    ]),
]  # fmt: skip


@pytest.mark.parametrize("call, message", BAD_ARGUMENTS)
def test_bad_arguments_are_one_line_errors_naming_the_argument(tiny, tmp_path, monkeypatch, call, message):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as a user's shell has it
    model, _ = tiny
    calibration = harness.calibration(model, ids=torch.randint(0, 256, (2, 40)), i0=4)
    with pytest.raises(ValueError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        call(model, calibration)
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_the_top_level_lists_what_it_exports():
    assert {"load", "calibration", "allocate", "quantized_cache", "packed_attention"} <= set(dir(harness))
    with pytest.raises(AttributeError):
        harness.nothing_here  # noqa: B018
