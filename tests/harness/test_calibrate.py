"""Attention entropy against hand-computed answers."""

import math

import pandas as pd
import pytest
import torch

from harness.calibrate import entropy
from harness.calibrate.disk import cache_dir
from harness.calibrate.entropy import _Recorder, cached_head_entropies, head_entropies
from harness.calibrate.windows import layer_types
from harness.models import load_model


def test_recorder_hand_computed_rows():
    # two query rows of one head: a one-hot row (H2 = H1 = 0) and a (0.5, 0.25, 0.25) row
    p = torch.tensor([[[[1.0, 0.0, 0.0], [0.5, 0.25, 0.25]]]])  # (B=1, H=1, Tq=2, Tk=3)
    rec = _Recorder(i0=0)
    rec.record(0, p)
    h2 = -math.log(0.25 + 0.0625 + 0.0625)
    h1 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    s = rec.sums[0][:, 0]
    assert s[0] / s[2] == pytest.approx(h2 / 2) and s[1] / s[2] == pytest.approx(h1 / 2) and s[2] == 2
    rec1 = _Recorder(i0=1)
    rec1.record(0, p)
    assert rec1.sums[0][0, 0] / rec1.sums[0][2, 0] == pytest.approx(h2)


def _zero_queries(model):
    """Zero every query projection: all scores equal, so each row is uniform over the keys its mask allows."""
    for name, param in model.named_parameters():
        if "q_proj" in name:
            param.data.zero_()
    return model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-qwen3_5"])
def test_uniform_attention_gives_ln_of_visible_keys(name):
    model, _ = load_model(name)
    _zero_queries(model)
    T, i0 = 40, 8
    table = head_entropies(model, torch.randint(0, 256, (3, T)), i0=i0)
    window = getattr(model.config, "sliding_window", None)
    for layer_type, group in table.groupby("layer_type"):
        visible = [i + 1 if layer_type == "full" else min(i + 1, window) for i in range(i0, T)]
        want = sum(math.log(n) for n in visible) / len(visible)
        assert group["H2"].to_numpy() == pytest.approx(want, rel=1e-6), layer_type
        assert group["H1"].to_numpy() == pytest.approx(want, rel=1e-6), layer_type
        assert (group["n_positions"] == 3 * (T - i0)).all()
    if name == "tiny-qwen3_5":  # linear-attention layers have no rows
        full = [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
        assert sorted(table.layer.unique()) == full
    assert table.attrs["num_layers"] == model.config.get_text_config(decoder=True).num_hidden_layers


def test_gqa_mapping_and_real_heads_differ():
    model, _ = load_model("tiny-llama")  # 6 query heads, 3 KV heads
    table = head_entropies(model, torch.randint(0, 256, (2, 48)), i0=4)
    assert table.groupby("layer").size().tolist() == [6, 6, 6]
    assert table["kv_head"].tolist()[:6] == [0, 0, 1, 1, 2, 2]
    assert table["H2"].std() > 0  # random weights: heads are not all alike
    assert (table["H2"] <= table["H1"] + 1e-12).all()  # Rényi entropy is non-increasing in its order


def test_per_layer_kv_heads_and_kv_shared_layers():
    model, _ = load_model("tiny-gemma4-kv")  # 4 query heads; KV heads 2, 2, 1 (global); 2 KV-shared layers
    assert layer_types(model.config) == ["sliding", "sliding", "full", "linear", "linear"]
    table = head_entropies(model, torch.randint(0, 256, (2, 40)), i0=8)
    assert sorted(table.layer.unique()) == [0, 1, 2]  # shared layers attend, but hold no cache of their own
    assert table.groupby("layer").kv_head.apply(list).tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]]
    assert table.attrs == {"num_layers": 5, "num_kv_heads": 2, "kv_heads": [2, 2, 1, 2, 1]}


def test_disk_cache_returns_the_same_table(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model, _ = load_model("tiny-llama")
    ids = torch.randint(0, 256, (2, 40))
    first = cached_head_entropies(model, "tiny-llama", ids, i0=8)
    assert len(list(cache_dir().glob("*.parquet"))) == 1
    calls = []
    monkeypatch.setattr(entropy, "head_entropies", lambda *a, **k: calls.append(1))
    again = cached_head_entropies(model, "tiny-llama", ids, i0=8)
    assert not calls
    pd.testing.assert_frame_equal(first, again)
    assert again.attrs["num_kv_heads"] == 3
