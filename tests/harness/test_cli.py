"""Bad input stops before any model loads: one line naming the key and what is allowed, exit code 2."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.validate import ConfigError, preflight_overrides, validate_config

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def compose_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    "override, message",
    [
        ("policy.name=entropyy", r"^policy.name: unknown 'entropyy' \(did you mean entropy\?\); allowed: "),
        ("policy.widths=[2,5]", r"^policy.widths: 5 is not an allowed width; allowed: 2, 3, 4, 8, 16"),
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
        ("tracking.wandb.mode=sometimes", r"^tracking.wandb.mode: unknown 'sometimes'"),
    ],
)
def test_invalid_config_gives_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate_config(compose_cfg(override))
    assert "\n" not in str(err.value)


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
    assert [p["policy"] for p in validate_config(compose_cfg())] == ["uniform", "entropy"]
    points = validate_config(compose_cfg("+sweep=pareto"))
    assert len(points) >= 30 and {p["budget"] for p in points} == {2, 3, 4, 8}
    hybrid = validate_config(compose_cfg("+sweep=hybrid"))
    assert {p["model"] for p in hybrid} == {"smollm2-135m", "gemma3-270m"}


@pytest.mark.parametrize("sweep", sorted(p.stem for p in (Path(CONF) / "sweep").glob("*.yaml")))
def test_every_shipped_sweep_validates(sweep):
    assert validate_config(compose_cfg(f"+sweep={sweep}"))


@pytest.mark.parametrize("args", [["model=nope"], ["policy.widths=[2,5]"], ["policy.alpha=abc"]])
def test_command_exits_2_with_one_line(args, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "harness", *args, f"run_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert not any(tmp_path.iterdir())  # nothing ran


def test_random_control_draws_apart_from_the_text_seed():
    points = validate_config(compose_cfg("policy.name=random", "policy.seed=5", "seed=2"))
    random_point = next(p for p in points if p["policy"] == "random")
    uniform_point = next(p for p in points if p["policy"] == "uniform")
    assert (random_point["policy_seed"], random_point["seed"]) == (5, 2)
    assert uniform_point["policy_seed"] == 0  # ignored by every other policy: one key per evaluation
    with pytest.raises(ConfigError, match=r"^policy.seed: 'x' is not an integer"):
        validate_config(compose_cfg("policy.name=random", "policy.seed=x"))
