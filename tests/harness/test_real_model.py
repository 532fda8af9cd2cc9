"""The real default model (SmolLM2-135M from its GGUF package): quantization error behaves as it must."""

import pytest
import torch

from harness import data, evaluate, metrics
from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.models import load_model


@pytest.fixture(scope="module")
def smollm():
    model, tokenizer = load_model("smollm2-135m")
    with installed(model, PACKED):  # quantized caches are attended from their packed form
        sequences = data.token_windows(tokenizer, data.split().evaluation, 2, 256, seed=0)
        base = evaluate.teacher_forced(
            model, sequences, evaluate.dynamic_cache_factory(model), chunk=64, batch_size=2
        )
        yield model, sequences, base


@pytest.mark.slow
def test_architecture_is_what_the_design_says(smollm):
    config = smollm[0].config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.hidden_size // config.num_attention_heads == 64


@pytest.mark.slow
@pytest.mark.parametrize("bits, low, high", [(8, 1.0 - 1e-3, 1.01), (2, 1.3, float("inf"))])
def test_uniform_ppl_ratio_at_8_and_2_bits(smollm, bits, low, high):
    model, sequences, base = smollm
    run = evaluate.teacher_forced(
        model,
        sequences,
        lambda: QuantizedKVCache(model.config, bits, prefill="quantized"),
        chunk=64,
        batch_size=2,
        baseline=base,
    )
    m = metrics.teacher_forced_metrics(base, run)
    assert low < m["ppl_ratio"] < high, m
    assert m["kl_mean"] > 0


@pytest.mark.slow
def test_sixteen_bits_matches_the_unquantized_cache(smollm):
    model, sequences, base = smollm

    def score(simulate: bool):
        return evaluate.teacher_forced(
            model,
            sequences,
            lambda: QuantizedKVCache(model.config, 16, prefill="quantized", simulate=simulate),
            chunk=64,
            batch_size=2,
            baseline=base,
        )

    run = score(simulate=True)  # the model's own attention over the working copy: exactly the baseline
    assert torch.equal(run.nll, base.nll) and torch.equal(run.top1, base.top1)
    packed = score(simulate=False)  # attention over the stored form: equal within float summation order
    torch.testing.assert_close(packed.nll, base.nll, rtol=1e-4, atol=1e-4)
