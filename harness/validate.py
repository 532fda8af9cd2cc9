"""Configuration checks that run before any model loads: one line naming the key and what is allowed."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from harness.grid import HARNESS, engine, expand
from harness.models import model_spec, unknown_name_message

GROUPS = ("model", "policy", "quant", "eviction", "eval", "tracking", "sweep")
POSITIVE_INTS = (
    "num_prompts",
    "prompt_tokens",
    "new_tokens",
    "num_sequences",
    "sequence_tokens",
    "chunk",
    "calibration_sequences",
    "calibration_tokens",
    "group_size",
)
WANDB_MODES = ("online", "offline", "disabled")
PROTOCOLS = ("runner", "claim")  # sweep.protocol: the normal grid runner, or harness/claim.py


class ConfigError(ValueError):
    """An invalid configuration; str() is the one line shown to the user."""


def preflight_overrides(args: list[str], conf_dir: str) -> None:
    """Unknown config-group choices (e.g. `model=nope`), caught before Hydra prints a multi-line error."""
    for arg in args:
        if "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        group = key.lstrip("+~")
        if group not in GROUPS or not value:
            continue
        options = sorted(p.stem for p in (Path(conf_dir) / group).glob("*.yaml"))
        for choice in value.split(","):  # multirun lists
            if choice not in options:
                raise ConfigError(unknown_name_message(group, choice, options))


def _check_point(point: dict, backend: str = "auto") -> None:
    from harness.cache import PREFILL_MODES
    from harness.eviction import EvictionSpec
    from harness.policies import validate
    from harness.quant import check_backend, get_scheme

    try:
        model_spec(point["model"])
        if engine(point) != HARNESS:
            from harness.peers import check_point

            _check_positive_ints(point)
            check_point(point)
            return
        validate(
            point["budget"],
            point["policy"],
            point["alpha"],
            point["sink_threshold"],
            point["sink_fraction"],
            point["widths"],
            point["budget_mode"],
        )
        _check_positive_ints(point)
        scheme = get_scheme(point["scheme"], point["group_size"], point["sink_tokens"], point["residual"])
        scheme.check_widths(point["widths"])
        check_backend(scheme, backend)
        if point["prefill"] not in PREFILL_MODES:
            raise ValueError(
                f"quant.prefill: unknown {point['prefill']!r}; allowed: {', '.join(PREFILL_MODES)}"
            )
        if point["entropy_key"] not in ("H2", "H1"):
            raise ValueError(f"policy.entropy_key: unknown {point['entropy_key']!r}; allowed: H1, H2")
        if not isinstance(point["seed"], int):
            raise ValueError(f"seed: {point['seed']!r} is not an integer")
        if isinstance(point["policy_seed"], bool) or not isinstance(point["policy_seed"], int):
            raise ValueError(f"policy.seed: {point['policy_seed']!r} is not an integer")
        _check_eviction_composes(EvictionSpec.from_point(point), scheme)
        if point["i0"] < 0 or point["i0"] >= point["calibration_tokens"]:
            raise ValueError(f"eval.calibration.i0: {point['i0']} must lie in [0, eval.calibration.tokens)")
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err).splitlines()[0]) from None


def _check_positive_ints(point: dict) -> None:
    for name in POSITIVE_INTS:
        value = point[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{_key(name)}: {value!r} is not a positive integer")


def _check_eviction_composes(eviction, scheme) -> None:
    """Eviction needs stores that can drop arbitrary tokens the same way in every batch row."""
    if not eviction.active:
        return
    if scheme.base == "kivi":
        raise ValueError(
            f"eviction: {eviction.name} cannot evict from kivi's per-channel key groups; "
            "allowed with kivi: eviction=none"
        )
    if eviction.needs_scores and (scheme.sink_tokens or scheme.residual):
        raise ValueError(
            "eviction: h2o keeps different tokens per batch row, which quant.sink_tokens / quant.residual "
            "stores cannot split; allowed with h2o: quant.sink_tokens=0 quant.residual=0"
        )


def _key(name: str) -> str:
    if name == "group_size":
        return "quant.group_size"
    if name.startswith("calibration_"):
        return "eval.calibration." + name.removeprefix("calibration_").replace("sequences", "num_sequences")
    return f"eval.{name}"


def protocol(cfg: DictConfig) -> str:
    """The sweep's protocol (PROTOCOLS): `runner` unless the sweep sets `protocol: claim`."""
    sweep = cfg.get("sweep")
    name = "runner" if sweep is None else sweep.get("protocol", "runner")
    if name not in PROTOCOLS:
        raise ConfigError(f"sweep.protocol: unknown {name!r}; allowed: {', '.join(PROTOCOLS)}")
    return name


def validate_config(cfg: DictConfig) -> list[dict]:
    """Check the whole configuration and every grid point; return the points."""
    mode = cfg.tracking.wandb.mode
    if mode not in WANDB_MODES:
        raise ConfigError(f"tracking.wandb.mode: unknown {mode!r}; allowed: {', '.join(WANDB_MODES)}")
    if not (
        isinstance(cfg.num_shards, int)
        and cfg.num_shards >= 1
        and isinstance(cfg.shard, int)
        and 0 <= cfg.shard < cfg.num_shards
    ):
        raise ConfigError(f"shard: {cfg.shard!r} must be an integer in [0, num_shards={cfg.num_shards!r})")
    from harness.cache import BACKENDS

    if cfg.quant.backend not in BACKENDS:
        raise ConfigError(f"quant.backend: unknown {cfg.quant.backend!r}; allowed: {', '.join(BACKENDS)}")
    if not isinstance(cfg.eval.batch_size, int) or cfg.eval.batch_size < 1:
        raise ConfigError(f"eval.batch_size: {cfg.eval.batch_size!r} is not a positive integer")
    if protocol(cfg) == "claim":
        from harness import claim

        try:
            return claim.validate(cfg)
        except ValueError as err:
            raise ConfigError(str(err).splitlines()[0]) from None
    try:
        points = expand(cfg)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"sweep: {err}") from None
    for point in points:
        _check_point(point, cfg.quant.backend)
    return points
