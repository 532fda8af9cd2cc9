"""llama.cpp as a peer: its type sizes against ggml's, and, on the real SmolLM2 GGUF (one 512-token window), the
cross-check with the harness, q8_0 against f16, the rotation switch and the bytes its cache really holds."""

import csv
import ctypes
import json
import os

import pytest
import torch

from harness import data, evaluate, metrics
from harness.models import gguf_path, load_model, model_spec
from harness.peers import LLAMACPP_TYPES
from harness.peers.llamacpp import KV_TYPES, ROTATION_ENV, cache_bytes, open_llama, teacher_forced

CHUNK = 128
# llama.cpp's f16 perplexity against the harness's unquantized baseline on the same window: the same GGUF weights,
# different kernels (llama.cpp multiplies its Q4_1 weights with activations quantized to 8 bits and stores K/V in
# f16; transformers dequantizes the weights to fp32 and keeps fp32 activations and K/V). Measured on this window:
# ppl ratio 0.99987, KL 0.0031 nats per token, top-1 agreement 97.5%; on the first two windows of seed 0: 1.00066,
# 0.0032, 96.1%, and the per-token NLL difference has a standard deviation of 0.080 nats, so the mean over one
# window's 511 tokens moves by about 0.080 / sqrt(511) = 0.35% of ppl from kernel noise alone. The tolerance is
# three times that; far below what separates KV types (q4_0 against f16 on this window: +8% rotated, +26% not).
CROSS_PPL_TOLERANCE = 0.01
CROSS_KL_LIMIT = 0.01  # three times the measured KL; q8_0 against llama.cpp's own f16 is 0.004, q4_0 0.05


def test_the_type_table_is_ggmls():
    from llama_cpp._ggml import libggml

    libggml.ggml_type_size.restype = ctypes.c_size_t
    libggml.ggml_type_size.argtypes = [ctypes.c_int]
    libggml.ggml_blck_size.restype = ctypes.c_int64
    libggml.ggml_blck_size.argtypes = [ctypes.c_int]
    libggml.ggml_type_name.restype = ctypes.c_char_p
    libggml.ggml_type_name.argtypes = [ctypes.c_int]
    assert list(KV_TYPES) == list(LLAMACPP_TYPES)
    for name, kind in KV_TYPES.items():
        assert libggml.ggml_type_name(kind.ggml_type).decode() == name
        assert (libggml.ggml_blck_size(kind.ggml_type), libggml.ggml_type_size(kind.ggml_type)) == (
            kind.block,
            kind.block_bytes,
        )


def test_row_bytes_refuses_a_head_dim_off_the_block():
    assert KV_TYPES["q4_0"].row_bytes(64) == 36 and KV_TYPES["f16"].row_bytes(7) == 14
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        KV_TYPES["q8_0"].row_bytes(48)


@pytest.fixture(scope="module")
def window():
    model, tokenizer = load_model("smollm2-135m")
    sequences = data.token_windows(tokenizer, data.split().evaluation, 1, 512, seed=0)  # (1, 512)
    base = evaluate.teacher_forced(model, sequences, evaluate.dynamic_cache_factory(model), chunk=CHUNK)
    return gguf_path(model_spec("smollm2-135m")), sequences, base


@pytest.fixture(scope="module")
def f16(window):
    path, sequences, _ = window
    return teacher_forced(path, sequences, "f16", False, CHUNK)


def ppl(run) -> float:
    return float(torch.exp(run.nll.double().mean()))


@pytest.mark.slow
def test_llamacpp_f16_agrees_with_the_harness_baseline(window, f16):
    _, _, base = window
    ratio = ppl(f16) / ppl(base)
    assert abs(ratio - 1) < CROSS_PPL_TOLERANCE, ratio
    kl = evaluate._kl(base.logprobs, f16.logprobs.float())  # (1, T-1): same window, different kernels
    assert 0 < float(kl.mean()) < CROSS_KL_LIMIT
    assert (f16.top1 == base.top1).double().mean() > 0.9


@pytest.mark.slow
@pytest.mark.parametrize(
    "rotation",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.xfail(
                strict=True,
                reason="measured: rotated q8_0 is 0.59% above f16 on this window (+1.14%, -0.39%, +0.32% on three "
                "others), unrotated 0.27%; its KL is the lower of the two (0.0042 against 0.0052): one window's ppl "
                "moves by about 0.35% from noise alone",
            ),
        ),
    ],
    ids=["rotation off", "rotation on"],
)
def test_q8_0_stays_within_half_a_percent_of_f16(window, f16, rotation):
    path, sequences, _ = window
    q8 = teacher_forced(path, sequences, "q8_0", rotation, CHUNK, baseline=f16)
    m = metrics.teacher_forced_metrics(f16, q8)
    assert 0 < m["kl_mean"] < 0.01
    assert abs(m["ppl_ratio"] - 1) < 0.005, m


@pytest.mark.slow
def test_the_rotation_switch_reaches_the_cache_and_is_restored(window, f16):
    path, sequences, _ = window
    before = os.environ.get(ROTATION_ENV)
    on = teacher_forced(path, sequences, "q4_0", True, CHUNK, baseline=f16)
    off = teacher_forced(path, sequences, "q4_0", False, CHUNK, baseline=f16)
    assert os.environ.get(ROTATION_ENV) == before
    assert not torch.equal(on.nll, off.nll)
    # the rotation spreads outlier channels over the block: q4_0 loses less with it
    assert float(on.kl.mean()) < float(off.kl.mean())


@pytest.mark.slow
@pytest.mark.parametrize("kv_type", [t for t in KV_TYPES if t != "f16"])
def test_bytes_per_token_match_what_the_cache_holds(window, kv_type):
    """llama.cpp's saved state of a sequence holds its K/V rows (ggml_row_size each) plus metadata that does not
    depend on the type: the difference to f16 is the difference of the type-size formula."""
    import llama_cpp

    path, sequences, _ = window
    tokens = 96
    held = {}
    for name in ("f16", kv_type):
        llm = open_llama(path, name, True, n_ctx=256, chunk=CHUNK, logits_all=False)
        try:
            llm.eval(sequences[0, :tokens].tolist())
            held[name] = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
        finally:
            llm.close()
    assert held[kv_type] - held["f16"] == cache_bytes("smollm2-135m", kv_type, tokens) - cache_bytes(
        "smollm2-135m", "f16", tokens
    )
    # and the formula: 30 layers x 3 KV heads x (K and V) x head_dim 64 in blocks of 32
    kind = KV_TYPES[kv_type]
    assert cache_bytes("smollm2-135m", kv_type, tokens) == tokens * 30 * 3 * 2 * (64 // 32) * kind.block_bytes


def test_the_speed_command_refuses_bad_arguments_before_loading(capsys, monkeypatch):
    from harness.peers import speed

    monkeypatch.setattr(speed, "open_llama", lambda *a, **kw: pytest.fail("a model was loaded"))
    for args, message in (
        (["--types", "q3_0"], "--types: unknown 'q3_0'; allowed: f16, q8_0"),
        (
            ["--model", "tiny-llama"],
            "--model: 'tiny-llama' is not a registered GGUF model; allowed: gemma3-270m",
        ),
        (["--runs", "0"], "--runs: 0 is not a positive integer"),
        (["--threads", "0"], "--threads: 0 is not a positive integer"),
    ):
        with pytest.raises(SystemExit) as stop:
            speed.main(args)
        assert stop.value.code == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_speed_command_keeps_every_measurement_of_an_interrupted_run(tmp_path, monkeypatch):
    """The CSV is rewritten after each (context, type), with its environment record beside it from the start."""
    from harness.peers import speed

    class Closed:
        def close(self):
            pass

    done = []

    def fake_runs(llm, context, new_tokens, runs, warmup):
        if len(done) == 3:
            raise KeyboardInterrupt  # the fourth measurement is cut off
        done.append(context)
        return [10.0 * len(done), 20.0 * len(done), 15.0 * len(done)][:runs]

    monkeypatch.setattr(speed, "open_llama", lambda *a, **kw: Closed())
    monkeypatch.setattr(speed, "decode_runs", fake_runs)
    out = tmp_path / "speed.csv"
    with pytest.raises(KeyboardInterrupt):
        speed.main(["--contexts", "64", "128", "--types", "f16", "q4_0", "--runs", "3", "--out", str(out)])
    rows = list(csv.DictReader(out.read_text().splitlines()[2:]))
    assert [(r["context"], r["kv_type"]) for r in rows] == [("64", "f16"), ("64", "q4_0"), ("128", "f16")]
    assert [float(r["tok_s_median"]) for r in rows] == [15.0, 30.0, 45.0]
    assert [float(r["ratio_to_f16"]) for r in rows] == [1.0, 2.0, 1.0]
    env = json.loads((tmp_path / "speed.csv.env.json").read_text())
    assert env["command"].startswith("python -m harness.peers.speed --contexts 64 128")


@pytest.mark.slow
def test_the_speed_command_writes_median_and_spread_per_type(tmp_path, cli):
    out = tmp_path / "speed.csv"
    args = [
        "--contexts",
        "48",
        "--types",
        "f16",
        "q4_0",
        "--new-tokens",
        "3",
        "--runs",
        "2",
        "--threads",
        "1",
    ]
    proc = cli("harness.peers.speed", *args, "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = out.read_text().splitlines()
    assert lines[0] == "# command: python -m harness.peers.speed " + " ".join([*args, "--out", str(out)])
    rows = list(csv.DictReader(lines[2:]))
    assert [(r["context"], r["kv_type"], r["rotation"]) for r in rows] == [
        ("48", "f16", "False"),
        ("48", "q4_0", "True"),
    ]
    for r in rows:
        assert 0 < float(r["tok_s_min"]) <= float(r["tok_s_median"]) <= float(r["tok_s_max"])
    assert float(rows[0]["ratio_to_f16"]) == 1.0
    assert float(rows[1]["ratio_to_f16"]) == pytest.approx(
        float(rows[1]["tok_s_median"]) / float(rows[0]["tok_s_median"])
    )
