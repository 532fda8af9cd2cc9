"""Configuration checks that run before any model loads: one line naming the key and what is allowed.

Three stages, cheapest first: `validate_config` (the composed config and every grid point, no file read),
`check_run_dir` (run_dir writable; a clean git tree for results/), `check_model_inputs` (what the model's
config and tokenizer say about the point: group size against head_dim, text long enough for the windows;
seconds, never the weights).

This is the one place a grid point (harness.config.Point) is checked: `_check_point` runs every check of its
fields, asking the types it names (policy, scheme, eviction, peer engine) to check their own settings, and
names a bad field by its config key (harness.config.config_key). The runner trusts the points it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from harness import capacity, data, io, precision, preload
from harness.cache import PREFILL_MODES, check_backend_device
from harness.cache.eviction import EvictionSpec
from harness.config import DEFAULT_PROBE, HARNESS, Point, config_key
from harness.data import BOS_RULES
from harness.models import check_device, model_spec
from harness.peers import check_point
from harness.policies import from_point
from harness.protocols import PROTOCOLS, claim
from harness.protocols.claim import settings
from harness.protocols.sweep import expand
from harness.registry import unknown_name_message
from harness.run.measure import point_scheme
from harness.schemes import ROLES, SCHEMES, Scheme, check_backend, get_scheme
from harness.sensitivity import check_context, check_reads_fitted
from kernels.layout import FULL_WIDTH

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


def _check_point(point: Point, backend: str = "auto") -> None:

    try:
        model_spec(point.model)
        if point.engine != HARNESS:
            _check_positive_ints(point)
            _check_score_from(point)
            check_point(point)
            return
        if point.dtype not in precision.DTYPES:  # a sweep entry may set it; `auto` is resolved before here
            raise ValueError(
                f"model.dtype: {point.dtype!r} in a grid point; allowed: {', '.join(precision.DTYPES)}"
            )
        policy = from_point(point.group("policy"))
        _check_positive_ints(point)
        _check_score_from(point)
        scheme = point_scheme(point)
        scheme.check_widths(point.widths)  # before the budget, which lies between the widths
        policy.check_budget(point.budget)
        check_reads_fitted(policy, scheme)
        _check_probe(point)
        check_backend(scheme, backend)
        if point.prefill not in PREFILL_MODES:
            raise ValueError(f"quant.prefill: unknown {point.prefill!r}; allowed: {', '.join(PREFILL_MODES)}")
        if point.bos not in BOS_RULES:
            raise ValueError(f"eval.bos: unknown {point.bos!r}; allowed: {', '.join(BOS_RULES)}")
        if not isinstance(point.seed, int):
            raise ValueError(f"seed: {point.seed!r} is not an integer")
        _check_eviction_composes(EvictionSpec.from_point(point), scheme)
        limit = model_spec(point.model).get("context_limit", 2048)
        if point.prompt_tokens + point.new_tokens > limit:
            raise ValueError(
                f"eval.prompt_tokens / eval.new_tokens: {point.prompt_tokens} + {point.new_tokens} exceeds "
                f"{point.model}'s context limit; allowed: a sum up to {limit}"
            )
        if point.sequence_tokens > limit:
            raise ValueError(
                f"eval.sequence_tokens: {point.sequence_tokens} exceeds {point.model}'s context limit; "
                f"allowed: up to {limit}"
            )
        if point.i0 < 0 or point.i0 >= point.calibration_tokens:
            raise ValueError(f"eval.calibration.i0: {point.i0} must lie in [0, eval.calibration.tokens)")
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err).splitlines()[0]) from None


def _check_positive_ints(point: Point) -> None:
    for name in POSITIVE_INTS:
        value = getattr(point, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{config_key(name)}: {value!r} is not a positive integer")


def _check_probe(point: Point) -> None:
    """A unit-KL probe set away from its default (the sweep resets it where a policy measures none): positive
    sizes, at least 2 tokens, inside the calibration windows; a context width among the point's widths."""
    if all(getattr(point, name) == value for name, value in DEFAULT_PROBE.items()):
        return
    for name, least, most in (
        ("probe_sequences", 1, point.calibration_sequences),
        ("probe_tokens", 2, point.calibration_tokens),
    ):
        value = getattr(point, name)
        if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
            raise ValueError(
                f"{config_key(name)}: {value!r}; allowed: an integer in [{least}, {most}] (the calibration "
                "windows' size)"
            )
    check_context(point.probe_context, point.widths)


def _check_score_from(point: Point) -> None:
    value = point.score_from
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < point.sequence_tokens:
        raise ValueError(
            f"eval.score_from: {value!r}; allowed: an integer in [0, eval.sequence_tokens = {point.sequence_tokens})"
        )


def _check_eviction_composes(eviction, scheme) -> None:
    """Eviction needs stores that can drop arbitrary tokens the same way in every batch row."""
    if not eviction.active:
        return
    if scheme.no_eviction:
        raise ValueError(
            f"eviction: {eviction.name} cannot evict from {scheme.no_eviction}; "
            f"allowed with {scheme.name}: eviction=none"
        )
    if eviction.needs_scores and (scheme.sink_tokens or scheme.residual):
        raise ValueError(
            "eviction: h2o keeps different tokens per batch row, which quant.sink_tokens / quant.residual "
            "stores cannot split; allowed with h2o: quant.sink_tokens=0 quant.residual=0"
        )


def protocol(cfg: DictConfig) -> str:
    """The sweep's protocol (PROTOCOLS): `runner` unless the sweep sets `protocol: claim`."""
    sweep = cfg.get("sweep")
    name = "runner" if sweep is None else sweep.get("protocol", "runner")
    if name not in PROTOCOLS:
        raise ConfigError(f"sweep.protocol: unknown {name!r}; allowed: {', '.join(PROTOCOLS)}")
    return name


def validate_config(cfg: DictConfig) -> list[Point] | list[dict]:
    """Check the whole configuration and every grid point; return the points (the claim protocol: its rows,
    harness.protocols.claim.validate)."""
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
    try:
        io.check_threads(cfg.get("threads"))
        _check_eviction_group(cfg)
        _check_names(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for key in ("allow_dirty", "model.download"):
        if not isinstance(OmegaConf.select(cfg, key, default=False), bool):
            raise ConfigError(f"{key}: {OmegaConf.select(cfg, key)!r} is not allowed; allowed: true, false")

    try:  # the machine: a device it has, a backend that runs there
        check_device(cfg.device)
        check_backend_device(cfg.quant.backend, cfg.device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not isinstance(cfg.quant.get("simulate", False), bool):
        raise ConfigError(f"quant.simulate: {cfg.quant.simulate!r} is not allowed; allowed: true, false")
    if not isinstance(cfg.eval.batch_size, int) or cfg.eval.batch_size < 1:
        raise ConfigError(f"eval.batch_size: {cfg.eval.batch_size!r} is not a positive integer")
    try:
        precision.resolve(cfg.model.get("dtype", precision.DEFAULT), cfg.device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if protocol(cfg) == "claim":
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
        if (
            point.engine == HARNESS
            and point_scheme(point).reads_previous_layer
            and not cfg.quant.get("simulate")
        ):
            raise ConfigError(
                f"quant.simulate: {point.scheme} reconstructs each layer from the reconstruction of the layer "
                "below, which only a simulated cache keeps; allowed: true"
            )
    return points


def _check_eviction_group(cfg: DictConfig) -> None:
    """The eviction group's values, whichever eviction is chosen: with eviction=none a point forgets them, so a
    mistyped share would otherwise pass unseen."""
    e = cfg.get("eviction")
    if e is not None:
        EvictionSpec(e.name, e.keep, e.sink_tokens, e.recent)


def _check_names(cfg: DictConfig) -> None:
    """The names that become folders of run_dir's default (results/<sweep.name>/<run_name>) are plain names, checked
    even when run_dir is given: a path-like name is a mistake either way. run_dir itself is a path. (Model names
    are checked against the registry: harness.models.model_spec.)"""
    # `run_name: ???` (sweeps/local.yaml): the jobs of a sweep must be told their one shared folder
    if OmegaConf.is_missing(cfg, "run_name"):
        raise ValueError("run_name: missing; allowed: a plain name, given as run_name=NAME")
    io.check_plain_name(cfg.get("run_name"), "run_name")
    sweep = cfg.get("sweep")
    if sweep is not None and sweep.get("name") is not None:
        io.check_plain_name(sweep.name, "sweep.name")


def check_run_dir(cfg: DictConfig) -> None:
    """run_dir can be written, and a run into results/ comes from a clean tree unless allow_dirty=true."""
    try:
        io.check_writable(cfg.run_dir)
        io.check_clean(cfg.run_dir, cfg.get("allow_dirty", False))
    except ValueError as err:
        raise ConfigError(str(err)) from None


# ------------------------------------------------------------------------------------ what the model says


@dataclass(frozen=True)
class Windows:
    """`count` token windows of `length` cut from one split of a text source, and the keys that set them."""

    split: str  # "calibration" | "evaluation"
    count: int
    length: int
    keys: tuple[str, str]  # (count key, length key)
    what: str
    source: str | None  # the text source (harness.data: a corpus name or a path; None: the default)
    source_key: str = "eval.data.path"  # the config key that names the source


@dataclass(frozen=True)
class ModelInputs:
    """What one point asks of its model: a storage scheme at some widths, and windows of its text."""

    model: str
    scheme: Scheme | None  # None: a peer engine's point, stored by that engine
    widths: tuple[int, ...]
    windows: tuple[Windows, ...]


def _inputs_of_point(point: Point) -> ModelInputs:
    calibration, key = data.calibration_source(point)
    windows = (
        Windows("calibration", point.calibration_sequences, point.calibration_tokens,
                ("eval.calibration.num_sequences", "eval.calibration.tokens"), "calibration windows",
                calibration, key),
        Windows("evaluation", point.num_prompts, point.prompt_tokens,
                ("eval.num_prompts", "eval.prompt_tokens"), "prompts", point.data_path),
        Windows("evaluation", point.num_sequences, point.sequence_tokens,
                ("eval.num_sequences", "eval.sequence_tokens"), "sequences", point.data_path),
    )  # fmt: skip
    widths = tuple(point.widths)
    scheme = point_scheme(point) if point.engine == HARNESS else None  # a peer engine stores K/V its own way
    return ModelInputs(point.model, scheme, widths, windows)


def _inputs_of_claim(cfg: DictConfig) -> ModelInputs:

    s = settings(cfg)
    keys = ("sweep.claim.num_sequences", "sweep.claim.sequence_tokens")
    windows = (Windows("evaluation", s.num_sequences, s.sequence_tokens, keys, "sequences", s.data_path),)
    return ModelInputs(s.model, get_scheme(s.scheme, s.group_size), s.widths, windows)


def _check_head_dims(inputs: ModelInputs, dims: set[int]) -> None:
    """A scheme that quantizes a role in groups along head_dim needs that role's group size dividing every
    head_dim (values: quant.group_size; keys: quant.key_group_size, unless quantized per channel as kivi's). A peer
    engine's point (scheme None) has no harness storage to check."""
    scheme = inputs.scheme
    if scheme is None:
        return
    if all(w == FULL_WIDTH for w in inputs.widths):
        return
    if scheme.rotated and any(d & (d - 1) for d in dims):
        raise ConfigError(
            f"quant.scheme: {scheme.name} needs a power-of-two head_dim; {inputs.model}'s is "
            f"{', '.join(map(str, sorted(dims)))}; allowed: a scheme without rotation "
            f"({', '.join(name for name in SCHEMES if not get_scheme(name).rotated)})"
        )
    if not scheme.head_dim_groups:
        return
    for role in reversed(ROLES):  # values first: their group is quant.group_size, the key named first
        group = scheme.role_group_size(role)
        if scheme.per_channel(role) or all(d % group == 0 for d in dims):
            continue
        common = [g for g in range(1, min(dims) + 1) if all(d % g == 0 for d in dims)]
        raise ConfigError(
            f"{scheme.group_key(role)}: {group} does not divide {inputs.model}'s head_dim "
            f"{', '.join(map(str, sorted(dims)))}; allowed: {', '.join(map(str, common))}"
        )


def _check_text(model: str, data_path: str | None, windows: list[Windows]) -> None:
    """Every window set fits its split of the text source `data_path`, counted with the model's own tokenizer."""
    try:
        text = data.split(data_path, windows[0].source_key)
    except ValueError as err:
        raise ConfigError(str(err).splitlines()[0]) from None
    available = preload.token_counts(model, {"calibration": text.calibration, "evaluation": text.evaluation})
    # A window set fits when its split holds count whole windows (harness.data.token_windows cuts them so).
    short = [w for w in dict.fromkeys(windows) if available[w.split] // w.length < w.count]
    if not short:
        return
    parts = []
    for split in ("calibration", "evaluation"):
        needs = [w for w in dict.fromkeys(windows) if w.split == split]
        asked = ", ".join(f"{w.count} x {w.length} = {w.count * w.length} ({w.what})" for w in needs)
        parts.append(f"{split} split {available[split]} tokens, " + (f"needs {asked}" if needs else "unused"))
    keys = list(dict.fromkeys(k for w in short for k in w.keys))
    source_keys = " or ".join(dict.fromkeys(w.source_key for w in short))
    raise ConfigError(
        f"{' / '.join(keys)}: the text ({data.source_name(data_path)}) is too short for {model}'s windows: "
        f"{'; '.join(parts)}; lower {' or '.join(keys)}, or give more text with {source_keys}"
    )


def run_models(cfg: DictConfig, points: list[Point]) -> list[str]:
    """The registered models a validated run loads, each once, in grid order (what model.download fetches)."""
    if protocol(cfg) == "claim":
        return [settings(cfg).model]
    return list(dict.fromkeys(p.model for p in points))


def _check_kernel_layers(inputs: ModelInputs, shape: capacity.ModelShape) -> None:
    """On an explicit quant.backend=triton, what the Triton kernels cannot store of the model's cached layers
    (their head_dim, a sliding window: Scheme.check_kernel) stops the run here, not when the first cache is made."""
    scheme = inputs.scheme
    if scheme is None or not scheme.fusable or all(w == FULL_WIDTH for w in inputs.widths):
        return
    for dim, sliding in sorted(
        {(layer.head_dim, layer.kind == "sliding") for layer in shape.layers if layer.cached}
    ):
        try:
            scheme.check_kernel([], [], dim, dim, sliding)
        except NotImplementedError as err:
            raise ConfigError(
                f"quant.backend: triton cannot store {inputs.model}'s "
                f"{'sliding-window' if sliding else 'full-attention'} layers in {scheme.name}: {err}; allowed: "
                "auto (those layers on torch), torch"
            ) from None


def check_model_inputs(cfg: DictConfig, points: list[Point]) -> None:
    """Checks that need the model's config or tokenizer, never its weights (harness.preload): the group size
    against every head_dim, what an explicit triton backend cannot store of the model's layers, then the text
    against the windows asked for."""
    inputs = [_inputs_of_claim(cfg)] if protocol(cfg) == "claim" else [_inputs_of_point(p) for p in points]
    dims: dict[str, set[int]] = {}
    for item in inputs:
        if item.model not in dims:
            dims[item.model] = preload.head_dims(item.model)
        _check_head_dims(item, dims[item.model])
    if cfg.quant.backend == "triton":
        shapes: dict[str, capacity.ModelShape] = {}
        for item in inputs:
            if item.model not in shapes:
                shapes[item.model] = capacity.shape_from_registry(item.model)
            _check_kernel_layers(item, shapes[item.model])
    texts: dict[tuple, list[Windows]] = {}
    for item in inputs:
        for w in item.windows:
            texts.setdefault((item.model, w.source or data.DEFAULT_CORPUS), []).append(w)
    for (model, data_path), windows in texts.items():
        _check_text(model, data_path, windows)
