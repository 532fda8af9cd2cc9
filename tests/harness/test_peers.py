"""Peer engines in the harness's grid, runner, table and report: points, keys, bad input, transformers'
QuantizedCache rows on tiny models, the llama.cpp adapter against a scripted context."""

import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from harness import evaluate, results
from harness.__main__ import entry
from harness.config import HARNESS, NO_EVICTION
from harness.peers import ENGINES, LLAMACPP_TYPES, label, peer_point
from harness.peers.llamacpp import LlamaCppModel
from harness.peers.quantized_cache import GROUP_SIZE, stored_bytes
from harness.protocols.sweep import expand
from harness.report import plots, sweep, tables
from harness.run import runner
from harness.validate import ConfigError, validate_config

ROOT = Path(__file__).resolve().parents[2]
# Two chunks of 128: transformers' QuantizedCache (residual 128) quantizes the first at once and flushes its
# residual with the second, so every token it holds at the end is quantized.
PEER_EVAL = ("eval.sequence_tokens=257", "eval.chunk=128")


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["+sweep=smoke", "tracking.wandb.mode=disabled", *overrides])


def test_peers_leave_every_harness_point_and_key_as_it_was():
    plain = expand(compose_cfg())
    with_peers = expand(compose_cfg("+sweep.peers=[{engine:quanto,scheme:[int2,int4]}]"))
    ours = [p for p in with_peers if p.engine == HARNESS]
    assert [p.key() for p in ours] == [p.key() for p in plain]
    peers = [p for p in with_peers if p.engine != HARNESS]
    assert [(p.engine, p.scheme, p.budget, p.policy) for p in peers] == [
        ("quanto", "int2", 2, "quanto"),
        ("quanto", "int4", 4, "quanto"),
    ]


def test_a_peer_point_gives_the_baseline_a_harness_point_gives():
    """The runner derives the baseline row from the first point of a context: a peer first must not fork it."""
    (harness_point,) = expand(compose_cfg("sweep.budgets=[4]", "sweep.policies=[{name:uniform}]"))
    peer = peer_point(harness_point, {"engine": "llamacpp", "scheme": "q4_0", "rotation": False})

    def baseline(point):
        return point.without_peer_fields().replace(
            policy="baseline",
            budget=16,
            alpha=0.0,
            sink_threshold=None,
            sink_fraction=None,
            scheme="none",
            **NO_EVICTION,
        )

    assert baseline(peer).key() == baseline(harness_point).key()


def test_llamacpp_f16_has_no_rotation_and_quantized_types_default_to_it():
    base = expand(compose_cfg())[0]
    assert peer_point(base, {"engine": "llamacpp", "scheme": "f16", "rotation": True}).rotation is False
    assert peer_point(base, {"engine": "llamacpp", "scheme": "q4_0"}).rotation is True
    assert (
        label(peer_point(base, {"engine": "llamacpp", "scheme": "q4_0"}).to_dict())
        == "llama.cpp q4_0 + rotation"
    )
    assert label(
        peer_point(base, {"engine": "llamacpp", "scheme": "iq4_nl", "rotation": False}).to_dict()
    ) == ("llama.cpp iq4_nl")
    assert set(ENGINES["llamacpp"][0]) == set(LLAMACPP_TYPES)


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            "{engine:vllm,scheme:fp8}",
            "sweep: sweep.peers.engine: unknown 'vllm'; allowed: llamacpp, quanto, hqq",
        ),
        (
            "{engine:llamacpp,scheme:q3_0}",
            "sweep: sweep.peers.scheme (engine llamacpp): unknown 'q3_0'; allowed: f16",
        ),
        (
            "{engine:quanto,scheme:int3}",
            "sweep: sweep.peers.scheme (engine quanto): unknown 'int3'; allowed: int2, int4",
        ),
        ("{engine:quanto,scheme:int4,rotation:true}", "sweep: sweep.peers.rotation: engine quanto has none"),
        (
            "{engine:llamacpp,scheme:q4_0,rotation:maybe}",
            "sweep: sweep.peers.rotation: unknown 'maybe'; allowed",
        ),
        ("{engine:llamacpp,scheme:q4_0,bits:4}", "sweep: sweep.peers: unknown field 'bits'; allowed"),
        (
            "{engine:llamacpp,scheme:q4_0}",
            "model: engine llamacpp reads a GGUF file, tiny-llama has none; allowed",
        ),
    ],
)
def test_bad_peer_entries_are_one_line_naming_the_key(entry, message):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_cfg(f"+sweep.peers=[{entry}]"))
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


def test_the_cli_stops_on_a_bad_peer_with_exit_code_2(in_process):
    """python -m harness run in this process (test_cli.py runs a refusal as a new process)."""
    proc = in_process(entry, "harness", "+sweep=peers", "sweep.peers=[{engine:llamacpp,scheme:q3_0}]")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: sweep: sweep.peers.scheme (engine llamacpp): unknown 'q3_0'; "
        "allowed: f16, q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl"
    ]


@pytest.mark.parametrize("bits, qtype", [(2, "qint2"), (4, "qint4")])
def test_stored_bytes_of_a_quanto_tensor_is_packed_codes_and_fp16_scale_and_shift(bits, qtype):
    from transformers.cache_utils import QuantoQuantizedLayer

    layer = QuantoQuantizedLayer(nbits=bits, q_group_size=GROUP_SIZE)
    x = torch.randn(2, 3, 37, 128)  # (B, H, T, D), odd T
    q = layer._quantize(x, axis=0)
    assert q.qtype.name == qtype
    groups = x.numel() // GROUP_SIZE
    assert stored_bytes(q) == x.numel() * bits // 8 + groups * 2 * 2  # codes, fp16 scale and shift per group
    assert stored_bytes(x) == x.numel() * 2  # floating: at fp16
    assert stored_bytes((torch.zeros(5, dtype=torch.uint8), {"scale": torch.zeros(3), "n": 7})) == 5 + 6


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory):
    """tiny-llama: uniform at 4 bits and transformers' quanto at 2 and 4 bits (hqq at 4 where installed), then
    tiny-gemma3 (sliding layers) with quanto; the report regenerated."""
    engines = "[{engine:quanto,scheme:[int2,int4]}" + (",{engine:hqq,scheme:[int4]}]" if _has("hqq") else "]")
    common = ("sweep.budgets=[4]", "sweep.policies=[{name:uniform}]", *PEER_EVAL)
    points = validate_config(compose_cfg(*common, f"+sweep.peers={engines}"))
    gemma = validate_config(
        compose_cfg(*common, "sweep.models=[tiny-gemma3]", "+sweep.peers=[{engine:quanto,scheme:int4}]")
    )
    run_dir = tmp_path_factory.mktemp("peers") / "run"
    peers_first = sorted(points, key=lambda p: p.engine == HARNESS)  # a peer opens the context
    runner.run(peers_first, run_dir, batch_size=2)
    runner.run(gemma, run_dir, batch_size=2)
    sweep.write_report(run_dir, n_boot=50)
    return run_dir, points + gemma


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_peer_rows_carry_their_engine_and_metrics_beside_ours(peer_run):
    run_dir, points = peer_run
    table = results.load(run_dir)
    assert set(table["key"]) >= {p.key() for p in points}
    assert (
        table["policy"] == "baseline"
    ).sum() == 2  # one per model: the peer that came first did not fork it
    ours = table[table["engine"] == HARNESS]
    assert set(ours["policy"]) == {"uniform", "baseline"}
    llama = table[(table["model"] == "tiny-llama") & (table["engine"] == "quanto")].set_index("scheme")
    assert (llama["status"] == "ok").all()
    for scheme, row in llama.iterrows():
        bits = int(scheme.removeprefix("int"))
        # per element: the code, and an fp16 scale and shift per group of 64
        assert row["compression_true"] == pytest.approx(16 / (bits + 2 * 16 / GROUP_SIZE), rel=1e-6)
        assert row["mean_bits"] == bits and row["compression_nominal"] == 16 / bits
        assert row["ppl"] == pytest.approx(row["ppl_base"] * row["ppl_ratio"], rel=1e-9)
        assert row["kl_mean"] > 0 and 0 < row["top1_agree"] <= 1
        assert math.isnan(row["bleu"])  # teacher-forced only
    assert llama.loc["int2", "kl_mean"] > llama.loc["int4", "kl_mean"]
    base = table[(table["model"] == "tiny-llama") & (table["policy"] == "baseline")].iloc[0]
    assert llama.loc["int4", "ppl_base"] == pytest.approx(base["ppl"], rel=1e-9)  # the harness's baseline


def test_a_hybrid_model_gets_an_infeasible_quantized_cache_row_that_says_why(peer_run):
    run_dir, _ = peer_run
    table = results.load(run_dir)
    (row,) = table[(table["model"] == "tiny-gemma3") & (table["engine"] == "quanto")].to_dict("records")
    assert row["status"] == "infeasible"
    assert "only supported for models with only full attention layers" in row["error"]
    assert "sliding_attention" in row["error"]
    assert "transformers quanto int4" in (run_dir / "tables.md").read_text().split("## Infeasible points")[1]


def test_tables_list_each_peer_beside_the_nearest_harness_point_in_compression(peer_run):
    run_dir, _ = peer_run
    frame = results.load(run_dir)
    beside = tables.peer_table(frame)
    assert len(beside) == ((frame["engine"] != HARNESS) & (frame["status"] == "ok")).sum()
    ours = frame[(frame["engine"] == HARNESS) & (frame["policy"] != "baseline") & (frame["status"] == "ok")]
    for row in beside.to_dict("records"):
        mine = ours[ours["model"] == row["model"]]
        distance = np.abs(np.log(mine["compression_true"] / row["compression_true"]))
        assert np.log(row["harness compression_true"] / row["compression_true"]) == pytest.approx(
            distance.min() * np.sign(np.log(row["harness compression_true"] / row["compression_true"]))
        )
    text = (run_dir / "tables.md").read_text()
    assert "## Peer engines beside the nearest harness point" in text
    assert f"transformers quanto int4 (g{GROUP_SIZE}, residual 128)" in text
    # peers are not compared with uniform (they have no generation items), nor given their own plot
    assert "quanto" not in text.split("## Differences to uniform")[1]
    assert not list(run_dir.glob("pareto-*-int*.png"))


def test_the_pareto_plot_draws_peers_with_their_own_filled_markers(peer_run):
    run_dir, _ = peer_run
    frame = results.load(run_dir)
    fig = plots.plot_pareto(frame, "tiny-llama", "asym_token")
    ax = fig.axes[0]  # kl_mean
    by_label = {c.get_label(): c for c in ax.collections}
    peers = {k: v for k, v in by_label.items() if k.startswith("transformers ")}
    drawn = frame[(frame["engine"] != HARNESS) & (frame["model"] == "tiny-llama") & (frame["status"] == "ok")]
    assert set(peers) == {label(r) for r in drawn.to_dict("records")}
    for collection in peers.values():
        assert collection.get_facecolors()[0][3] > 0  # filled
    assert len(by_label["uniform"].get_facecolors()) == 0  # the harness's markers are hollow
    # marker: the engine, colour: the cache type, so no two peers share both
    looks = [
        (tuple(c.get_paths()[0].vertices.round(3).ravel()), tuple(c.get_facecolors()[0].round(3)))
        for c in peers.values()
    ]
    assert len(set(looks)) == len(looks)
    assert (run_dir / "pareto-tiny-llama-asym_token.png").exists()


def test_wandb_logs_a_peer_like_any_point_under_its_engine(tmp_path, monkeypatch):
    from harness.tracking import Tracker, run_name

    base = expand(compose_cfg())[0]
    point = peer_point(base, {"engine": "llamacpp", "scheme": "q8_0", "rotation": False})
    assert run_name(point) == "tiny-llama llama.cpp q8_0"
    assert run_name(base).startswith("tiny-llama uniform b2")

    runs = []

    class Run:
        def __init__(self, **kw):
            self.init, self.summary = kw, {}
            runs.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake = types.SimpleNamespace(init=lambda **kw: Run(**kw), Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    record = {"status": "ok", "metrics": {"ppl_ratio": 1.002, "bytes_per_token": 12240.0}}
    Tracker("offline", run_dir=tmp_path, group="peers/run").log_point(point, record)
    (run,) = runs
    assert (run.init["job_type"], run.init["name"], run.init["config"]) == (
        "llamacpp",
        run_name(point),
        point.to_dict(),
    )
    assert run.summary == {"status": "ok", **record["metrics"], "key": point.key()}


# --- the llama.cpp adapter, against a scripted context ---------------------------------------------------------


class ScriptedLlama:
    """Stands in for llama_cpp.Llama: logits at a position are a fixed function of every token fed before and at
    it, so a chunk fed at the wrong place or a context not emptied between sequences changes them."""

    vocab = 11

    def __init__(self, n_ctx: int):
        self.n_tokens = 0
        self.fed: list[int] = []
        self.scores = np.zeros((n_ctx, self.vocab), dtype=np.float32)

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        del self.fed[self.n_tokens :]
        for t in tokens:
            self.fed.append(t)
            self.scores[len(self.fed) - 1] = logits_after(self.fed)
            self.n_tokens += 1


def logits_after(prefix: list[int]) -> np.ndarray:
    v = np.arange(ScriptedLlama.vocab)
    return np.cos(v * (1 + sum(prefix) % 7) + len(prefix)).astype(np.float32)


@pytest.mark.parametrize("length, chunk", [(2, 1), (19, 4), (33, 32), (40, 64)])
def test_the_adapter_gives_teacher_forced_what_a_whole_sequence_gives(length, chunk):
    g = torch.Generator().manual_seed(length)
    sequences = torch.randint(0, ScriptedLlama.vocab, (3, length), generator=g)
    model = LlamaCppModel(ScriptedLlama(length))
    run = evaluate.teacher_forced(model, sequences, model.fresh_cache, chunk=chunk, batch_size=1)
    for s, seq in enumerate(sequences.tolist()):
        logits = torch.tensor(np.stack([logits_after(seq[: t + 1]) for t in range(length - 1)]))  # (T-1, V)
        logprobs = torch.log_softmax(logits, dim=-1)
        expected = -logprobs.gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
        torch.testing.assert_close(run.nll[s], expected)
        assert torch.equal(run.top1[s], logprobs.argmax(-1))


def test_the_adapter_refuses_batches_and_positions_its_context_does_not_hold():
    model = LlamaCppModel(ScriptedLlama(8))
    model.fresh_cache()
    with pytest.raises(ValueError, match="one sequence"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    model(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None])
    with pytest.raises(ValueError, match="chunk at position 5, the context holds 3 tokens"):
        model(torch.zeros(1, 2, dtype=torch.long), torch.arange(5, 7)[None])


def test_the_peers_sweep_validates_with_every_engine_installed():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+sweep=peers"])
    points = validate_config(cfg)
    peers = [p for p in points if p.engine != HARNESS]
    assert {p.engine for p in peers} == set(ENGINES)
    assert len([p for p in peers if p.engine == "llamacpp"]) == 1 + 2 * 6  # f16, six types x rotation
    assert {p.model for p in points} == {"smollm2-135m"}


def test_the_model_checks_leave_a_peers_storage_to_its_engine():
    from harness.validate import check_model_inputs

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+sweep=peers"])
    points = validate_config(cfg)
    check_model_inputs(cfg, points)  # llama.cpp's f16 or q4_0 is no harness scheme: not checked as one
