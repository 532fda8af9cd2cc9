"""Measured sensitivity: the proxy against a direct torch computation, the greedy against brute force and its
budget invariants, the disk cache, the KL check, and the policies end to end through the CLI."""

from __future__ import annotations

import itertools
import json
import math
import re

import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from harness import sensitivity
from harness.__main__ import entry
from harness.calibrate import head_entropies
from harness.models import load_model
from harness.policies import POLICIES, Layerwise, Sensitivity, head_errors
from harness.protocols import sensitivity_check
from harness.schemes import get_scheme
from harness.sensitivity import (
    cached_sensitivity,
    head_sensitivity,
    proxy_check,
    sample_heads,
    spearman,
)
from kernels import reference
from kernels.layout import FULL_WIDTH as UNQUANTIZED

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def entropy_table(num_layers: int, num_kv_heads: int, values: list[float] | None = None) -> pd.DataFrame:
    """One query head per KV head; H2 from `values` (layer-major) or 3.0 everywhere (no sinks at 0.5)."""
    values = values or [3.0] * (num_layers * num_kv_heads)
    rows = [
        dict(layer=layer, layer_type="full", q_head=h, kv_head=h, H2=values[layer * num_kv_heads + h])
        for layer in range(num_layers)
        for h in range(num_kv_heads)
    ]
    return pd.DataFrame(rows).assign(H1=lambda df: df.H2 + 1.0, n_positions=32)


def error_table(errors: dict[tuple[int, int], list[float]], widths: list[int]) -> pd.DataFrame:
    """Sensitivity table from {(layer, kv_head): [error at each width]}."""
    rows = [
        dict(layer=layer, kv_head=h, bits=w, error=e)
        for (layer, h), values in errors.items()
        for w, e in zip(widths, values)
    ]
    return pd.DataFrame(rows)


def total_error(table: pd.DataFrame, bits: torch.Tensor, widths: list[int]) -> float:
    """Summed measured error of an allocation (0 for 16-bit heads)."""
    errors = head_errors(table, tuple(bits.shape), widths)  # [L, Hkv, |W|]
    index = torch.tensor([[widths.index(b) for b in row] for row in bits.tolist()])
    return errors.gather(2, index[..., None]).sum().item()


# -------------------------------------------------------------------------------------------------- proxy


def _layer_qkv(model, ids: torch.Tensor, layer: int):
    """Layer `layer`'s post-RoPE q (B, Hq, T, D), k, v (B, Hkv, T, D) of a Llama, from its hidden states."""
    hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[layer]  # (B, T, hidden)
    block = model.model.layers[layer]
    attn, x = block.self_attn, block.input_layernorm(hidden)
    B, T, _ = x.shape
    split = lambda t: t.view(B, T, -1, attn.head_dim).transpose(1, 2)  # noqa: E731
    q, k, v = split(attn.q_proj(x)), split(attn.k_proj(x)), split(attn.v_proj(x))
    cos, sin = model.model.rotary_emb(hidden, torch.arange(T)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def _attention(q, k, v):
    """Causal softmax attention with GQA: q (B, Hq, T, D), k/v (B, Hkv, T, D) -> (B, Hq, T, D)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, Hq, T, T)
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return scores.masked_fill(~causal, -math.inf).softmax(-1) @ v


@pytest.mark.parametrize("scheme, width, layer, kv_head", [("asym_token", 3, 1, 2), ("sym_token", 2, 0, 1)])
@torch.no_grad()
def test_proxy_of_one_head_matches_a_direct_torch_computation(scheme, width, layer, kv_head, packed):
    model, _ = load_model("tiny-llama")  # 3 layers, 6 query / 3 KV heads, head_dim 32
    packed(model)  # quantized caches are attended from their packed form
    ids = torch.randint(0, 256, (2, 37))
    table = head_sensitivity(model, ids, get_scheme(scheme, 16), widths=(width, 8))
    q, k, v = _layer_qkv(model, ids, layer)
    symmetric = scheme == "sym_token"
    k_q, v_q = k.clone(), v.clone()
    k_q[:, kv_head] = reference.fake_quantize(k[:, kv_head], width, 16, symmetric)
    v_q[:, kv_head] = reference.fake_quantize(v[:, kv_head], width, 16, symmetric)
    group = slice(2 * kv_head, 2 * kv_head + 2)
    exact, changed = _attention(q, k, v)[:, group], _attention(q, k_q, v_q)[:, group]
    want = ((changed - exact).norm() / exact.norm()).item()
    got = table.set_index(["layer", "kv_head", "bits"]).loc[(layer, kv_head, width), "error"]
    assert got == pytest.approx(want, rel=1e-4)
    assert len(table) == 3 * 3 * 2 and (table["error"] > 0).all()
    errors = table.pivot_table(index=["layer", "kv_head"], columns="bits", values="error")
    assert (errors[width] > errors[8]).all()  # more bits, less error, on every head


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3_5", "tiny-gpt2", "tiny-gemma4-kv"])
def test_other_architectures_measure_exactly_their_attention_heads(name, packed):
    # sliding + full layers; linear + full layers; no GQA; fewer global KV heads and KV-shared layers
    model, _ = load_model(name)
    packed(model)  # quantized caches are attended from their packed form
    ids = torch.randint(0, 256, (1, 40))
    table = head_sensitivity(model, ids, get_scheme("asym_token", 16), widths=(2, 8))
    entropy = head_entropies(model, ids, i0=4)
    heads = sorted(set(zip(entropy.layer, entropy.kv_head)))
    assert sorted(set(zip(table.layer, table.kv_head))) == heads
    errors = table.pivot_table(index=["layer", "kv_head"], columns="bits", values="error")
    assert (errors[2] > errors[8]).all() and (errors[8] > 0).all()
    alloc = Sensitivity(widths=(2, 8), budget_unit="bits").allocate(entropy, 4, sensitivity=table)
    assert sorted(map(tuple, alloc.cached.nonzero().tolist())) == heads


# ------------------------------------------------------------------------------------------------- greedy

WIDTHS = [2, 3, 4, 8]
HAND = {  # error at widths 2, 3, 4, 8; head (1, 0) is not convex: 2 -> 4 gains more per bit than 2 -> 3
    (0, 0): [8.0, 4.0, 2.0, 0.5],
    (0, 1): [2.0, 1.0, 0.5, 0.1],
    (1, 0): [6.0, 5.0, 1.0, 0.0],
    (1, 1): [1.0, 0.9, 0.8, 0.7],
}


def brute_force(table: pd.DataFrame, n_layers: int, n_heads: int, budget: float, per_layer: bool) -> float:
    """The least summed error over every allocation of WIDTHS within budget (per head or per layer)."""
    units, size = (n_layers, n_heads) if per_layer else (n_layers * n_heads, 1)
    best = math.inf
    for choice in itertools.product(WIDTHS, repeat=units):
        if sum(choice) * size > budget * n_layers * n_heads:
            continue
        bits = torch.tensor(choice).repeat_interleave(size).view(n_layers, n_heads)
        best = min(best, total_error(table, bits, WIDTHS))
    return best


def test_greedy_hand_worked_and_equal_to_brute_force():
    entropy, table = entropy_table(2, 2), error_table(HAND, WIDTHS)
    # 4 extra bits over 2-bit heads: (0,0) 2->3 (4/bit), (1,0) 2->4 (2.5/bit), (0,0) 3->4 (2/bit)
    alloc = Sensitivity(budget_unit="bits").allocate(entropy, 3, sensitivity=table)
    assert (
        alloc.bits.tolist() == [[4, 2], [4, 2]] and alloc.mean_bits == 3.0 and alloc.policy == "sensitivity"
    )
    assert total_error(table, alloc.bits, WIDTHS) == brute_force(table, 2, 2, 3, per_layer=False) == 6.0
    # per layer (steps cost 2 bits): layer 0 2->3 (5 / 2 bits), then 3->4 (2.5 / 2 bits); layer 1 stays at 2
    layers = Layerwise(budget_unit="bits").allocate(entropy, 3, sensitivity=table)
    assert layers.bits.tolist() == [[4, 4], [2, 2]] and layers.mean_bits == 3.0
    assert total_error(table, layers.bits, WIDTHS) == brute_force(table, 2, 2, 3, per_layer=True) == 9.5
    assert torch.isnan(alloc.continuous).all() and not alloc.sinks.any()


def test_sinks_first_and_sixteen_only_when_listed():
    entropy = entropy_table(2, 2, [0.1, 3.0, 3.0, 3.0])  # (0, 0) is a sink at threshold 0.5
    table = error_table(HAND, WIDTHS)
    alloc = Sensitivity(budget_unit="bits", sink_threshold=0.5).allocate(entropy, 6, sensitivity=table)
    assert alloc.bits[0, 0] == UNQUANTIZED and alloc.sinks.tolist() == [[True, False], [False, False]]
    assert alloc.bits.sum() <= 6 * 4 and UNQUANTIZED not in alloc.bits.flatten().tolist()[1:]
    # 16 in widths: a non-sink head may be promoted to 16 (error 0) when it pays most per bit
    table16 = error_table({head: [*values[:3], 9.0] for head, values in HAND.items()}, [2, 3, 4, 8])
    wide = Sensitivity(widths=(2, 3, 4, 8, 16), budget_unit="bits").allocate(
        entropy_table(2, 2), 8, sensitivity=table16
    )
    assert UNQUANTIZED in wide.bits.flatten().tolist() and wide.bits.sum() <= 8 * 4
    with pytest.raises(ValueError, match="cannot pay"):
        Sensitivity(budget_unit="bits", sink_threshold=0.5).allocate(entropy, 2, sensitivity=table)


def test_measured_policies_refuse_a_missing_or_short_table():
    entropy, table = entropy_table(2, 2), error_table(HAND, WIDTHS)
    with pytest.raises(ValueError, match="^policy.name: layerwise allocates from measured errors"):
        Layerwise(budget_unit="bits").allocate(entropy, 3)
    with pytest.raises(ValueError, match=r"no measurements at width 3; measured widths: \[2, 4, 8\]"):
        Sensitivity(budget_unit="bits").allocate(entropy, 3, sensitivity=table[table["bits"] != 3])
    with pytest.raises(ValueError, match="lacks measurements for some cached heads"):
        Sensitivity(budget_unit="bits").allocate(entropy, 3, sensitivity=table[table["layer"] == 0])


@st.composite
def measured_cases(draw):
    n_layers, n_heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    widths = sorted(draw(st.sets(st.sampled_from([2, 3, 4, 8]), min_size=1)))
    if draw(st.booleans()):
        widths.append(UNQUANTIZED)
    quantized = [w for w in widths if w != UNQUANTIZED]
    errors = {
        (layer, h): draw(st.lists(st.floats(0, 10), min_size=len(quantized), max_size=len(quantized)))
        for layer in range(n_layers)
        for h in range(n_heads)
    }
    entropies = draw(st.lists(st.floats(0, 4), min_size=n_layers * n_heads, max_size=n_layers * n_heads))
    fraction = draw(st.sampled_from([None, 0.0, 0.2, 0.5]))
    return entropy_table(n_layers, n_heads, entropies), error_table(errors, quantized), widths, fraction


@PROPERTY_SETTINGS
@given(case=measured_cases(), policy=st.sampled_from(["sensitivity", "layerwise"]), data=st.data())
def test_greedy_never_exceeds_the_budget_and_gains_with_it(case, policy, data):
    entropy, table, widths, fraction = case
    quantized = [w for w in widths if w != UNQUANTIZED]
    low, high = quantized[0], widths[-1]
    budgets = sorted(data.draw(st.lists(st.floats(low, high), min_size=2, max_size=4)))
    n = len(entropy)
    previous = math.inf
    for budget in budgets:
        try:
            measured = POLICIES.get(policy)(sink_fraction=fraction, widths=widths, budget_unit="bits")
            alloc = measured.allocate(entropy, budget, sensitivity=table)
        except ValueError as err:  # the sinks alone cost more than the budget
            assert "cannot pay" in str(err)
            continue
        assert alloc.bits.sum().item() <= budget * n + 1e-9 and alloc.mean_bits == alloc.bits.sum().item() / n
        assert (alloc.bits[alloc.sinks] == UNQUANTIZED).all()
        free = ~alloc.sinks
        assert set(alloc.bits[free].tolist()) <= set(widths)
        if policy == "layerwise":
            for layer in range(alloc.bits.shape[0]):
                assert len(set(alloc.bits[layer][free[layer]].tolist())) <= 1
        # the sinks are fixed by the entropy table, so errors of different budgets compare
        error = total_error(table, alloc.bits, quantized + [UNQUANTIZED])
        assert error <= previous + 1e-9  # more budget never raises the greedy's error
        previous = error


# ----------------------------------------------------------------------------------------- cache and check


def test_disk_cache_returns_the_same_table(tmp_path, monkeypatch, packed):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path))
    model, _ = load_model("tiny-llama")
    packed(model)  # quantized caches are attended from their packed form
    ids, scheme = torch.randint(0, 256, (2, 33)), get_scheme("asym_token", 32)
    first = cached_sensitivity(model, "tiny-llama", ids, scheme, (2, 4))
    monkeypatch.setattr(sensitivity.proxy, "head_sensitivity", lambda *a, **k: pytest.fail("measured again"))
    again = cached_sensitivity(model, "tiny-llama", ids, scheme, (4, 16, 2))  # same quantized widths
    pd.testing.assert_frame_equal(first, again)
    assert again.attrs == {"num_layers": 3, "num_kv_heads": 3}
    with pytest.raises(pytest.fail.Exception):  # another scheme is another measurement
        cached_sensitivity(model, "tiny-llama", ids, get_scheme("sym_token", 32), (2, 4))


def test_spearman_hand_worked():
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert spearman([0.1, 0.5, 0.2], [3, 9, 4]) == pytest.approx(1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


@torch.no_grad()
def test_proxy_check_zero_value_head_costs_nothing_and_ranks_agree(packed):
    model, _ = load_model("tiny-llama")
    packed(model)  # quantized caches are attended from their packed form
    head_dim = 32
    model.model.layers[0].self_attn.v_proj.weight[head_dim : 2 * head_dim] = 0  # layer 0, KV head 1: V = 0
    g = torch.Generator().manual_seed(0)
    calibration, evaluation = (
        torch.randint(0, 256, (2, 48), generator=g),
        torch.randint(0, 256, (2, 48), generator=g),
    )
    scheme = get_scheme("asym_token", 32)
    table = head_sensitivity(model, calibration, scheme, widths=(2,))
    heads = sample_heads(table, 20)
    assert len(heads) == 9 and heads == sorted(set(heads))
    rows, rho = proxy_check(model, evaluation, table, heads, 2, scheme, chunk=16)
    zero = rows[(rows.layer == 0) & (rows.kv_head == 1)].iloc[0]
    assert zero.proxy == 0.0 and abs(zero.kl_mean) < 1e-7  # a head that contributes nothing costs nothing
    others = rows.drop(zero.name)
    assert (others.proxy > 0).all() and (others.kl_mean > 0).all()
    assert rho == pytest.approx(spearman(rows.proxy, rows.kl_mean))
    assert rho > 0.5  # 0.87 to 0.9 on three data seeds here: ranks agree on this model


def test_check_cli_writes_the_csv_and_refuses_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "check.csv"
    args = [
        "--model",
        "tiny-llama",
        "--check-heads",
        "3",
        "--out",
        str(out),
        "eval=tiny",
        "eval.num_sequences=1",
    ]
    sensitivity_check.main(args)
    rows = pd.read_csv(out)
    assert len(rows) == 3 and list(rows.columns) == ["layer", "kv_head", "bits", "proxy", "kl_mean"]
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["command"] == "python -m harness.sensitivity " + " ".join(args) and summary["heads"] == 3
    assert "spearman(proxy, kl_mean) = " in capsys.readouterr().out
    for bad, message in [
        ("--check-heads=1", "^error: --check-heads: 1"),
        ("--width=5", "^error: --width: 5"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            sensitivity_check.main(["--model", "tiny-llama", bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.match(message, err), err


# ------------------------------------------------------------------------------------------------ runner


def test_sweep_runs_the_measured_policies_end_to_end(tmp_path, in_process):
    """python -m harness, run in this process."""
    run_dir = tmp_path / "run"
    entries = (
        "{name:sensitivity,sink_threshold:null},{name:layerwise,alpha:0.7,sink_threshold:null},"
        "{name:measured,sink_threshold:null}"
    )
    policies = f"sweep.policies=[{entries}]"
    proc = in_process(
        entry,
        "harness",
        "+sweep=smoke",
        policies,
        "sweep.budgets=[3.5]",
        f"run_dir={run_dir}",
        "tracking.wandb.mode=disabled",
        env={"KVBITS_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(p.read_text()) for p in (run_dir / "points").glob("*.json")]
    by_policy = {r["config"]["policy"]: r for r in records}
    assert set(by_policy) == {"sensitivity", "layerwise", "measured", "baseline"}
    assert by_policy["layerwise"]["config"]["alpha"] == 0.0  # ignored, so normalized
    for policy in ("sensitivity", "layerwise", "measured"):
        record = by_policy[policy]
        bits = torch.tensor([record["allocation"]["key_bits"], record["allocation"]["value_bits"]])
        assert record["status"] == "ok"
        assert record["metrics"]["mean_bits"] == pytest.approx(bits.double().mean().item())
        assert record["metrics"]["mean_bits"] <= 3.5 + 1e-9
    assert all(len(set(row)) == 1 for row in by_policy["layerwise"]["allocation"]["bits"])
    calibration = tmp_path / "cache" / "calibration"
    assert len(list(calibration.glob("tiny-llama-sensitivity-*.parquet"))) == 1
    assert len(list(calibration.glob("tiny-llama-unit-kl-*.parquet"))) == 1
