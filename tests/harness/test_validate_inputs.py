"""harness.validate.check_model_inputs against what would fail later: harness.data.token_windows cutting the
windows, and the scheme's stores refusing a group size (the checks must refuse exactly those, before a load)."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import capacity, data, preload
from harness.cache.quantized import resolve_backend
from harness.schemes import get_scheme
from harness.validate import ConfigError, check_model_inputs, validate_config

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(scope="module", autouse=True)
def fresh_cache(tmp_path_factory):
    old = os.environ.get("KVBITS_CACHE")
    os.environ["KVBITS_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        del os.environ["KVBITS_CACHE"]
    else:
        os.environ["KVBITS_CACHE"] = old


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A random text file of 40 documents (both splits get some), fresh on every run."""
    rng = np.random.default_rng()
    words = ["".join(chr(c) for c in rng.integers(97, 123, rng.integers(1, 9))) for _ in range(200)]
    docs = [" ".join(rng.choice(words, rng.integers(20, 400))) for _ in range(40)]
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n\n".join(docs))
    return path


@settings(max_examples=25, deadline=None)
@given(
    calibration=st.tuples(st.integers(1, 30), st.integers(9, 700)),  # tokens > i0 (8)
    prompts=st.tuples(st.integers(1, 30), st.integers(1, 700)),
    sequences=st.tuples(st.integers(1, 30), st.integers(1, 700)),
)
def test_text_check_refuses_exactly_what_token_windows_cannot_cut(corpus, calibration, prompts, sequences):
    cfg = compose_cfg(
        "model=tiny-llama",
        "eval=tiny",
        f"eval.data.path={corpus}",
        f"eval.calibration.num_sequences={calibration[0]}",
        f"eval.calibration.tokens={calibration[1]}",
        f"eval.num_prompts={prompts[0]}",
        f"eval.prompt_tokens={prompts[1]}",
        f"eval.num_sequences={sequences[0]}",
        f"eval.sequence_tokens={sequences[1]}",
    )
    points = validate_config(cfg)
    text, tok = data.split(str(corpus)), preload.tokenizer("tiny-llama")
    failing = []
    for split, (count, length), keys in [
        (text.calibration, calibration, "eval.calibration.num_sequences"),
        (text.evaluation, prompts, "eval.num_prompts"),
        (text.evaluation, sequences, "eval.num_sequences"),
    ]:
        try:
            data.token_windows(tok, split, count, length)
        except ValueError:
            failing.append(keys)
    if not failing:
        check_model_inputs(cfg, points)
        return
    with pytest.raises(ConfigError) as err:
        check_model_inputs(cfg, points)
    line = str(err.value)
    assert "\n" not in line and line.startswith(failing[0])
    assert all(key in line for key in failing) and "calibration split" in line and "evaluation split" in line


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma4"])
@pytest.mark.parametrize("group_size", [1, 8, 24, 32, 48, 64, 96, 128])
def test_group_size_check_refuses_exactly_what_the_stores_refuse(model, group_size):
    cfg = compose_cfg(f"model={model}", "eval=tiny", f"quant.group_size={group_size}")
    points = validate_config(cfg)
    scheme = get_scheme("asym_token", group_size)
    refused = []
    for head_dim in preload.head_dims(model):
        try:
            scheme.new_store([4], head_dim, 1, torch.float32, "cpu", role="value")
        except ValueError:
            refused.append(head_dim)
    if not refused:
        check_model_inputs(cfg, points)
        return
    with pytest.raises(
        ConfigError, match=rf"^quant.group_size: {group_size} does not divide {model}'s head_dim"
    ):
        check_model_inputs(cfg, points)


@pytest.mark.parametrize("scheme", ["asym_token", "kivi"])
@pytest.mark.parametrize("key_group_size", [8, 12, 24, 64, 128])
def test_key_group_size_check_refuses_exactly_what_the_key_stores_refuse(scheme, key_group_size):
    """Per-token keys group along head_dim (must divide it); kivi's along the sequence (a multiple of 8, any
    head_dim): kivi g16 kg128 runs on tiny-gemma4's head_dims 32 and 64."""
    overrides = (f"quant={scheme}", "quant.group_size=16", f"quant.key_group_size={key_group_size}")
    cfg = compose_cfg("model=tiny-gemma4", "eval=tiny", *overrides)
    try:
        storage = get_scheme(scheme, 16, key_group_size=key_group_size)
    except ValueError:  # kivi: not a multiple of 8
        with pytest.raises(ConfigError, match=rf"^quant.key_group_size: {key_group_size} with kivi"):
            validate_config(cfg)
        return
    points = validate_config(cfg)
    assert {p.key_group_size for p in points} == {key_group_size}
    refused = []
    for head_dim in preload.head_dims("tiny-gemma4"):
        try:
            storage.new_store([4], head_dim, 1, torch.float32, "cpu", "key")
        except ValueError:
            refused.append(head_dim)
    if not refused:
        check_model_inputs(cfg, points)
        return
    with pytest.raises(
        ConfigError, match=rf"^quant.key_group_size: {key_group_size} does not divide tiny-gemma4's head_dim"
    ):
        check_model_inputs(cfg, points)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-llama-d64", "tiny-gemma3", "tiny-gemma4"])
@pytest.mark.parametrize("scheme", ["asym_token", "pca_block_uf", "pca_block_ugs"])
def test_an_explicit_triton_backend_refuses_exactly_the_layers_the_caches_refuse(model, scheme):
    """quant.backend=triton: check_model_inputs refuses a model whose cached layers (head_dim, sliding window) a
    triton cache would refuse when made (harness.cache.quantized.resolve_backend, layer by layer), and nothing
    else; quant.backend=auto never."""
    overrides = ("quant=pca", f"quant.scheme={scheme}") if scheme != "asym_token" else ("quant=asym_token",)
    refused = []
    storage = get_scheme(scheme, 16, sink_tokens=1 if scheme != "asym_token" else 0)
    for layer in capacity.shape_from_registry(model).layers:
        try:
            resolve_backend("triton", torch.device("cpu"), storage, [4], [4], layer.head_dim, layer.head_dim,
                            layer.kind == "sliding")  # fmt: skip
        except NotImplementedError as err:
            refused.append((layer.kind, str(err)))
    cfg = compose_cfg(
        f"model={model}", "eval=tiny", *overrides, "quant.group_size=16", "quant.backend=triton"
    )
    points = validate_config(cfg)
    if not refused:
        check_model_inputs(cfg, points)
    else:
        with pytest.raises(ConfigError, match=r"^quant.backend: triton cannot store " + model) as err:
            check_model_inputs(cfg, points)
        message = str(err.value)
        assert message.endswith("allowed: auto (those layers on torch), torch") and "\n" not in message
        assert any(
            reason in message and ("sliding-window" if kind == "sliding" else "full-attention") in message
            for kind, reason in refused
        )  # one of the refused layers, by its kind and the kernels' reason
    auto = compose_cfg(f"model={model}", "eval=tiny", *overrides, "quant.group_size=16", "quant.backend=auto")
    check_model_inputs(auto, validate_config(auto))
