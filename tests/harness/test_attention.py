"""harness.attention: installing an implementation leaves nothing behind, and importing registers nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from harness.attention import (
    ENTROPY_PROBE,
    PACKED,
    QDQ,
    SCORED,
    SENSITIVITY_PROBE,
    QDQSpec,
    Scores,
    Steps,
    active,
    installed,
)
from harness.cache import QuantizedKVCache
from harness.models import load_model

IMPLEMENTATIONS = [PACKED, SCORED, QDQ, ENTROPY_PROBE, SENSITIVITY_PROBE]


def registries() -> tuple[dict, dict]:
    return dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping)


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny-llama")[0]


def test_importing_the_package_and_its_users_registers_nothing():
    code = (
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import AttentionMaskInterface\n"
        "before = set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)\n"
        "import harness.attention, harness.cache, harness.cache.eviction, harness.calibrate, harness.sensitivity\n"
        "import harness.protocols.claim, harness.run.runner, harness.protocols.passkey, harness.bench.perf\n"
        "after = set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)\n"
        "assert after == before, (after[0] - before[0], after[1] - before[1])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=lambda i: i.name)
def test_the_model_and_the_registries_are_restored_after_the_block(llama, implementation):
    before, registered = llama.config._attn_implementation, registries()
    state = QDQSpec(torch.full((3, 3), 16)) if implementation is QDQ else object()
    with installed(llama, implementation, state) as got:
        assert got is state
        assert llama.config._attn_implementation == implementation.name
        assert implementation.name in AttentionInterface._global_mapping
        assert active(type(state)) is state
    assert llama.config._attn_implementation == before
    assert registries() == registered
    assert active(type(state)) is None


def test_restored_when_the_block_raises(llama):
    before, registered = llama.config._attn_implementation, registries()
    with pytest.raises(KeyError, match="inside"), installed(llama, SCORED) as scores:
        assert isinstance(scores, Scores) and active(Steps) is scores
        raise KeyError("inside")
    assert llama.config._attn_implementation == before
    assert registries() == registered
    assert active(Steps) is None


def test_nested_blocks_restore_the_outer_one(llama):
    before, registered = llama.config._attn_implementation, registries()
    with installed(llama, PACKED) as outer:
        packed_entry = AttentionInterface._global_mapping[PACKED.name]
        with installed(llama, SCORED) as inner:
            assert active(Steps) is inner
            with installed(llama, PACKED) as innermost:
                assert active(Steps) is innermost is not outer
            assert AttentionInterface._global_mapping[PACKED.name] is packed_entry
        assert llama.config._attn_implementation == PACKED.name
        assert SCORED.name not in AttentionInterface._global_mapping
        assert active(Steps) is outer
    assert llama.config._attn_implementation == before
    assert registries() == registered


@torch.no_grad()
def test_a_step_is_read_only_for_the_key_it_was_posted_with(llama):
    """After a packed forward, another cache's forward under the same installed state attends its own K/V: the
    steps left by the packed cache are not read for other keys (what a tag on the key tensor used to ensure)."""
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (1, 9))
    want = llama(input_ids=ids, past_key_values=DynamicCache(config=llama.config)).logits
    with installed(llama, PACKED):
        llama(input_ids=ids, past_key_values=QuantizedKVCache(llama.config, 2, prefill="quantized"))
        got = llama(input_ids=ids, past_key_values=DynamicCache(config=llama.config)).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_implementation_that_reads_a_state_needs_one(llama):
    before, registered = llama.config._attn_implementation, registries()
    with pytest.raises(ValueError, match="harness_claim_qdq: installed needs the state"):
        with installed(llama, QDQ):
            pass
    assert llama.config._attn_implementation == before and registries() == registered
