"""Bad input stops before any model loads: one line naming the key and what is allowed, exit code 2."""

import re
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness.validate import ConfigError, preflight_overrides, validate_config

ROOT = Path(__file__).resolve().parents[2]
CONF = str(ROOT / "conf")
REFUSED_LOAD = 99  # the exit code of a guarded process that tried to load model weights


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    "override, message",
    [
        ("policy.name=entropyy", r"^policy.name: unknown 'entropyy' \(did you mean entropy\?\); allowed: "),
        (
            "policy.widths=[2,7]",
            r"^policy.widths: 7 is not an allowed width; allowed: 1, 2, 3, 4, 5, 6, 8, 16",
        ),
        ("policy.budget=9", r"^policy.budget: .*9"),
        ("policy.budget=1.5", r"^policy.budget: .*1.5"),
        ("policy.alpha=abc", r"^policy.alpha: .*'abc'"),
        ("policy.sink_fraction=1.5", r"^policy.sink_fraction: .*1.5"),
        ("policy.budget_mode=loose", r"^policy.budget_mode: unknown 'loose'"),
        ("quant.scheme=int4", r"^quant.scheme: unknown 'int4'; allowed: "),
        ("quant.prefill=maybe", r"^quant.prefill: unknown 'maybe'"),
        ("quant.backend=cuda", r"^quant.backend: unknown 'cuda'; allowed: auto, torch, triton"),
        ("quant.group_size=0", r"^quant.group_size: 0 is not a positive integer"),
        ("eval.num_prompts=-3", r"^eval.num_prompts: -3 is not a positive integer"),
        ("eval.sequence_tokens=9000", r"^eval.sequence_tokens: 9000 exceeds .*; allowed: up to 8192"),
        ("eval.new_tokens=8000", r"^eval.prompt_tokens / eval.new_tokens: 256 \+ 8000 exceeds .* up to 8192"),
        ("eval.score_from=1024", r"^eval.score_from: 1024; allowed: an integer in \[0, eval.sequence_tokens = 1024\)"),
        ("eval.score_from=-1", r"^eval.score_from: -1; allowed: "),
        ("eval.score_from=half", r"^eval.score_from: 'half'; allowed: "),
        ("policy=measured eval.calibration.probe.tokens=513",
         r"^eval.calibration.probe.tokens: 513; allowed: an integer in \[2, 512\] \(the calibration windows' size\)"),
        ("policy=measured eval.calibration.probe.num_sequences=0",
         r"^eval.calibration.probe.num_sequences: 0; allowed: an integer in \[1, 8\]"),
        ("policy=measured policy.widths=[2,4] eval.calibration.probe.context=3",
         r"^eval.calibration.probe.context: 3 with policy.widths \[2, 4\]; allowed: null, or one of the quantized "
         r"widths \(2, 4\) where the widths leave out 16$"),
        ("tracking.wandb.mode=sometimes", r"^tracking.wandb.mode: unknown 'sometimes'"),
        ("device=tpu", r"^device: 'tpu' is not allowed; allowed here: cpu"),
        ("policy.widths=[4,4]", r"^policy.widths: 4 appears twice in \[4, 4\]; allowed: each width once"),
        ("run_name=../../escape", r"^run_name: '../../escape' is not a plain name; allowed: a folder name without /"),
        ("run_name=a/b", r"^run_name: 'a/b' is not a plain name"),
        ("run_name=..", r"^run_name: '..' is not a plain name"),
        ("run_name=???", r"^run_name: missing; allowed: a plain name, given as run_name=NAME"),
        ("+sweep=smoke sweep.name=../x", r"^sweep.name: '../x' is not a plain name"),
        ("model.download=yes", r"^model.download: 'yes' is not allowed; allowed: true, false"),
        ("quant=nuqkey policy.widths=[8]",
         r"^policy.widths: \[8\] with quant.scheme nuqkey, which stores quantized heads at 2, 3, 4 bits; allowed: "
         r"2, 3, 4, 16"),
    ],
)  # fmt: skip
def test_invalid_config_gives_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate_config(compose_cfg(*override.split()))
    assert "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_and_triton_without_cuda_are_refused(monkeypatch):
    with pytest.raises(
        ConfigError, match=r"^device: cuda but this machine has no CUDA device.*; allowed here: cpu$"
    ):
        validate_config(compose_cfg("device=cuda"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(
        ConfigError, match=r"^quant.backend: triton needs CUDA tensors .*; allowed here: auto, torch$"
    ):
        validate_config(compose_cfg("quant.backend=triton"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton's CPU interpreter: allowed
    assert validate_config(compose_cfg("quant.backend=triton"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["quant=kivi", "eviction=streaming"], r"^eviction: streaming cannot evict from kivi's"),
        (["eviction=h2o", "quant.residual=8"], r"^eviction: h2o keeps different tokens per batch row"),
    ],
)
def test_eviction_that_a_scheme_cannot_hold_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_cfg(*overrides))
    validate_config(
        compose_cfg("eviction=streaming", "quant.sink_tokens=4")
    )  # composes: same tokens every row


def test_unknown_group_choice_is_caught_before_hydra():
    with pytest.raises(
        ConfigError, match=r"^model: unknown 'smollm' \(did you mean smollm2-135m\?\); allowed: "
    ):
        preflight_overrides(["model=smollm"], CONF)
    with pytest.raises(ConfigError, match=r"^sweep: unknown 'paretoo'"):
        preflight_overrides(["+sweep=paretoo"], CONF)
    preflight_overrides(["model=tiny-llama", "+sweep=smoke", "policy.alpha=1"], CONF)


def test_valid_default_and_sweep_configs_expand():
    assert [p.policy for p in validate_config(compose_cfg())] == ["uniform", "entropy"]
    points = validate_config(compose_cfg("+sweep=pareto"))
    assert len(points) >= 30 and {p.budget for p in points} == {2, 3, 4, 8}
    hybrid = validate_config(compose_cfg("+sweep=hybrid"))
    assert {p.model for p in hybrid} == {"smollm2-135m", "gemma3-270m"}


@pytest.mark.parametrize("sweep", sorted(p.stem for p in (Path(CONF) / "sweep").glob("*.yaml")))
def test_every_shipped_sweep_validates(sweep):
    assert validate_config(compose_cfg(f"+sweep={sweep}"))


def test_random_control_draws_apart_from_the_text_seed():
    points = validate_config(compose_cfg("policy.name=random", "policy.seed=5", "seed=2"))
    random_point = next(p for p in points if p.policy == "random")
    uniform_point = next(p for p in points if p.policy == "uniform")
    assert (random_point.policy_seed, random_point.seed) == (5, 2)
    assert uniform_point.policy_seed == 0  # ignored by every other policy: one key per evaluation
    with pytest.raises(ConfigError, match=r"^policy.seed: 'x' is not an integer"):
        validate_config(compose_cfg("policy.name=random", "policy.seed=x"))


# --------------------------------------------------------------------------- bad input through the real CLI


class LoadAttempted(BaseException):
    """Raised by the guard where a model load was attempted (a BaseException: Hydra's handler lets it through)."""


@pytest.fixture
def guarded(monkeypatch, tmp_path, capsys):
    """guarded(*ARGS) -> (exit code, stderr): `python -m harness ARGS` run in this process (harness.__main__.entry)
    with every model load the command can reach (harness.run.context's, the claim protocol's) raising
    LoadAttempted, disk caches in a fresh folder, and TRITON_INTERPRET unset as a user's shell has it
    (tests/conftest.py sets it for this process). test_the_command_line_exits_2_with_one_line runs one case as a
    real process."""
    from harness import __main__ as cli_main
    from harness.protocols import claim
    from harness.run import context

    def refuse(*args, **kwargs):
        raise LoadAttempted("a model load was attempted")

    for module in (context, claim):
        monkeypatch.setattr(module, "load_model", refuse)
    monkeypatch.setenv("KVBITS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    threads = torch.get_num_threads()

    def run(*args):
        monkeypatch.setattr("sys.argv", ["harness", "tracking.wandb.mode=disabled", *args])
        capsys.readouterr()
        try:
            cli_main.entry()
            code = 0
        except SystemExit as done:
            code = done.code
        finally:
            torch.set_num_threads(threads)  # the command sets `threads`
        return code, capsys.readouterr().err

    return run


@pytest.fixture(scope="module")
def short_text(tmp_path_factory):
    """35 KB of prose: too little for the default calibration windows (8 x 512 tokens)."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("text") / "short.txt"
    path.write_text("\n\n".join(topics.values())[:35_000])
    return path


# The checks a config alone decides are test_invalid_config_gives_one_line_naming_the_key's; these are the ones
# that read the data, the model's config, the file system or the machine, and one config check
# (policy.widths=[2,5]) for the command's path.
BAD_INPUT = [  # (overrides, the key the one line must start with, other keys it must name)
    (["eval.data.path={short}", "eval.num_prompts=4"], "eval.calibration.num_sequences",
     ["eval.calibration.tokens", "calibration split", "evaluation split"]),
    (["model=tiny-llama", "eval=tiny", "eval.data.path={short}", "eval.num_sequences=500"], "eval.num_sequences",
     ["eval.sequence_tokens", "evaluation split"]),
    (["+sweep=claim_smollm2", "sweep.models=[tiny-llama]", "sweep.claim.num_sequences=999",
      "sweep.claim.sequence_tokens=999"], "sweep.claim.num_sequences", ["sweep.claim.sequence_tokens"]),
    (["quant.group_size=48"], "quant.group_size", ["head_dim 64"]),
    (["model=gemma3-270m", "quant.group_size=512"], "quant.group_size", ["head_dim 256"]),
    (["eviction.keep=1.5"], "eviction.keep", ["(0, 1]"]),
    (["run_dir=/proc/nope"], "run_dir", ["not writable"]),
    (["threads=0"], "threads", ["positive integer"]),
    (["model=nope"], "model", ["allowed: "]),
    (["policy.widths=[2,5]"], "policy.widths", ["asym_token", "2, 3, 4, 8 bits", "allowed: 2, 3, 4, 8, 16"]),
    *([] if torch.cuda.is_available() else [
        (["device=cuda"], "device", ["no CUDA device", "allowed here: cpu"]),
        (["quant.backend=triton"], "quant.backend", ["TRITON_INTERPRET=1", "allowed here: auto, torch"]),
    ]),
]  # fmt: skip


@pytest.mark.parametrize("args, key, names", BAD_INPUT, ids=[" ".join(case[0]) for case in BAD_INPUT])
def test_bad_input_stops_before_any_weights_load(guarded, short_text, tmp_path, args, key, names):
    run_dir = tmp_path / "run"
    args = [a.format(short=short_text) for a in args]
    if not any(a.startswith("run_dir=") for a in args):
        args.append(f"run_dir={run_dir}")
    code, err = guarded(*args)
    assert code == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"error: {re.escape(key)}( / [\w.]+)*: ", lines[0]), err
    assert all(name in lines[0] for name in names), lines[0]
    assert not run_dir.exists()  # nothing ran


def test_the_command_line_exits_2_with_one_line(cli, tmp_path):
    """The same refusal through a real `python -m harness` process: exit code 2, one line on stderr."""
    proc = cli(
        "harness", "tracking.wandb.mode=disabled", "policy.widths=[2,5]", f"run_dir={tmp_path / 'run'}"
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: policy.widths: [5] with quant.scheme asym_token, which stores quantized heads at 2, 3, 4, 8 bits; "
        "allowed: 2, 3, 4, 8, 16"
    ]
    assert not (tmp_path / "run").exists()


def test_a_run_name_that_leads_out_of_results_is_refused_before_anything_is_written(guarded):
    name = f"escaped-{uuid.uuid4().hex[:8]}"  # results/single/../../NAME is the repository root's NAME
    escaped = ROOT / name
    try:
        code, err = guarded("model=tiny-llama", "eval=tiny", f"run_name=../../{name}")
        assert code == 2, err[-2000:]
        assert err.strip().splitlines() == [
            f"error: run_name: '../../{name}' is not a plain name; allowed: a folder name without / or \\ that "
            "is not . or .."
        ]
        assert not escaped.exists()
    finally:
        shutil.rmtree(escaped, ignore_errors=True)


def test_the_guard_catches_a_model_load(guarded, tmp_path):
    with pytest.raises(LoadAttempted):
        guarded("model=tiny-llama", "eval=tiny", f"run_dir={tmp_path / 'run'}")
    # The run's record was written when it started, before the (refused) load.
    assert (tmp_path / "run" / "env.json").exists() and (tmp_path / "run" / "config.yaml").exists()
