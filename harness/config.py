"""The grid point: one evaluation's every setting that can change a metric, typed, frozen, and keyed.

`Point` has one field per setting (model, dtype, policy, budget, alpha, key offset, sink rule, widths, budget mode and
unit, scheme, group sizes, prefill, sink tokens, residual window, key outliers, key level fit, evaluation sizes,
calibration, the unit-KL probe, data, seed, token eviction, and the peer fields engine and rotation). Field names are
the result columns (harness.results), so stored rows, parquet columns and committed runs read back unchanged; each
field declares once the config key that sets it (`evict_keep` <- `eviction.keep`), which `config_key` gives to error
messages, and its group (policy, quant, eviction, eval, calibration, probe, peer, context), from which the field
lists below are derived.

Its key (`Point.key`; `key_of` hashes a stored record's config the same way) is a hash of `Point.to_dict()`,
so a finished point is recognized on re-run whatever order the grid lists it in:
- the model dtype enters the hash only when it is not float32, the kv policy's key_offset only when it is not
  0, quant.key_group_size only when it is set, quant.outliers only when it is not 0, quant.key_levels only
  when it is not kmeans, eval.calibration.data.path only when it is set, eval.score_from only when it is not 0
  and the unit-KL probe's sizes and context only away from 2 x 128 tokens alone (KEYED_UNLESS), so points made before those fields
  were recorded keep their keys;
- the peer fields are in the dict only for a peer point (engine not HARNESS), so the harness's own points keep
  the keys they had before peers existed;
- a point read from a record made before some field existed (`Point.from_dict`) takes today's default for it
  and remembers it as `unrecorded`: the field stays out of its dict, and so out of its key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from hydra import compose as compose_config
from hydra import initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from harness import precision
from harness.io import CONF_DIR
from harness.registry import unknown_name_message
from harness.schemes.key_table import KMEANS
from harness.sensitivity.unit_kl import PROBE_SEQUENCES, PROBE_TOKENS

HARNESS = "harness"  # the engine of every point without an `engine` field
# Fields that enter a key only away from these values (fields added after points were first keyed), so the
# points made before them keep their keys.
KEYED_UNLESS = {
    "dtype": precision.DEFAULT,
    "key_offset": 0.0,
    "key_group_size": None,
    "outliers": 0.0,
    "key_levels": KMEANS,
    "calibration_data_path": None,
    "score_from": 0,
    "probe_sequences": PROBE_SEQUENCES,
    "probe_tokens": PROBE_TOKENS,
    "probe_context": None,
}
# The eviction fields of every point that evicts nothing (configs without the eviction group included).
NO_EVICTION = {"eviction": "none", "evict_keep": 1.0, "evict_sinks": 4, "evict_recent": 0.5}


def _setting(config: str, group: str, *default: Any) -> Any:
    """A point field set by the config key `config`, in `group`; `default`: today's value where a config or an
    older record lacks it."""
    return field(metadata={"config": config, "group": group}, **({"default": default[0]} if default else {}))


@dataclass(frozen=True, kw_only=True)
class Point:
    """One grid point (harness.protocols.sweep makes them). Values are kept as the config gave them (an int budget stays an
    int): the key hashes their JSON."""

    model: str = _setting("model.name", "context")
    dtype: str = _setting("model.dtype", "context", precision.DEFAULT)  # resolved: never `auto`
    policy: str = _setting("policy.name", "policy")
    budget: float = _setting("policy.budget", "policy")
    alpha: float = _setting("policy.alpha", "policy")
    key_offset: float = _setting("policy.key_offset", "policy", 0.0)  # kv: keys' bits above values'
    sink_threshold: float | None = _setting("policy.sink_threshold", "policy")
    sink_fraction: float | None = _setting("policy.sink_fraction", "policy")
    widths: tuple[int, ...] = _setting("policy.widths", "policy")
    budget_mode: str = _setting("policy.budget_mode", "policy")
    budget_unit: str = _setting("policy.budget_unit", "policy", "bytes")
    entropy_key: str = _setting("policy.entropy_key", "policy", "H2")
    policy_seed: int = _setting("policy.seed", "policy", 0)
    scheme: str = _setting("quant.scheme", "quant")
    group_size: int = _setting("quant.group_size", "quant")
    key_group_size: int | None = _setting("quant.key_group_size", "quant", None)  # None: group_size
    prefill: str = _setting("quant.prefill", "quant")
    sink_tokens: int = _setting("quant.sink_tokens", "quant", 0)
    residual: int | None = _setting(
        "quant.residual", "quant", None
    )  # None: the scheme's default (grid resolves)
    outliers: float = _setting("quant.outliers", "quant", 0.0)  # calkey: share of each key kept in fp16
    key_levels: str = _setting("quant.key_levels", "quant", KMEANS)  # nuqkey: how its key levels are fitted
    eviction: str = _setting("eviction.name", "eviction", NO_EVICTION["eviction"])
    evict_keep: float = _setting("eviction.keep", "eviction", NO_EVICTION["evict_keep"])
    evict_sinks: int = _setting("eviction.sink_tokens", "eviction", NO_EVICTION["evict_sinks"])
    evict_recent: float = _setting("eviction.recent", "eviction", NO_EVICTION["evict_recent"])
    num_prompts: int = _setting("eval.num_prompts", "eval")
    prompt_tokens: int = _setting("eval.prompt_tokens", "eval")
    new_tokens: int = _setting("eval.new_tokens", "eval")
    num_sequences: int = _setting("eval.num_sequences", "eval")
    sequence_tokens: int = _setting("eval.sequence_tokens", "eval")
    chunk: int = _setting("eval.chunk", "eval")
    # teacher-forced: tokens before it are context only, the metrics cover tokens score_from..T-1 (0: every target)
    score_from: int = _setting("eval.score_from", "eval", 0)
    bos: str = _setting("eval.bos", "eval", "auto")
    calibration_sequences: int = _setting("eval.calibration.num_sequences", "calibration")
    calibration_tokens: int = _setting("eval.calibration.tokens", "calibration")
    i0: int = _setting("eval.calibration.i0", "calibration")
    # the calibration windows' text source; None: eval.data.path's (harness.data.calibration_source)
    calibration_data_path: str | None = _setting("eval.calibration.data.path", "calibration", None)
    # the measured policy's unit-KL probes: the first probe_sequences calibration windows, cut to probe_tokens
    # (harness.sensitivity.unit_kl); not a context field: points with other probes share their model context
    probe_sequences: int = _setting("eval.calibration.probe.num_sequences", "probe", PROBE_SEQUENCES)
    probe_tokens: int = _setting("eval.calibration.probe.tokens", "probe", PROBE_TOKENS)
    # the width of every other unit while one is measured (None: 16, each unit alone; unit_kl's docstring)
    probe_context: int | None = _setting("eval.calibration.probe.context", "probe", None)
    data_path: str | None = _setting("eval.data.path", "context")
    seed: int = _setting("seed", "context")
    engine: str = _setting("sweep.peers.engine", "peer", HARNESS)
    rotation: bool | None = _setting("sweep.peers.rotation", "peer", None)
    # Fields the record it was read from lacked (made before they existed): out of to_dict(), so out of key().
    unrecorded: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if isinstance(self.widths, list):  # one value: a tuple, so a point is hashable
            object.__setattr__(self, "widths", tuple(self.widths))

    def to_dict(self) -> dict:
        """The flat dict of the point (a JSON record's `config`, a table row's configuration columns): widths a
        list; peer fields only on a peer point; unrecorded fields left out."""
        out = {}
        for name in FIELDS:
            if name in self.unrecorded or (name in PEER_FIELDS and self.engine == HARNESS):
                continue
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, values: dict) -> Point:
        """The point of a flat dict (a record's `config`, a grid entry): fields it lacks take today's defaults and
        are remembered as unrecorded (the peer fields of a harness point are not: they are never recorded);
        TypeError for a key that is no field (one line, naming it), or a missing field that has no default."""
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            raise TypeError(unknown_name_message("point field", unknown[0], list(FIELDS)))
        missing = [n for n in FIELDS if n not in values and n not in PEER_FIELDS]
        return cls(**values, unrecorded=frozenset(missing))

    def key(self) -> str:
        """A short stable hash of the point's full configuration: key_of(to_dict())."""
        return key_of(self.to_dict())

    def group(self, name: str) -> dict:
        """The point's fields of one group (e.g. `policy`: harness.policies.from_point reads them), as in
        to_dict()."""
        return {k: v for k, v in self.to_dict().items() if k in GROUPS[name]}

    def replace(self, **changes) -> Point:
        """The point with some fields changed (a changed field counts as recorded)."""
        return replace(self, **changes, unrecorded=self.unrecorded - set(changes))

    def without_peer_fields(self) -> Point:
        """The harness point of the same settings (a harness point is returned equal)."""
        defaults = {f.name: f.default for f in fields(Point) if f.name in PEER_FIELDS}
        return replace(self, **defaults)


# The settings, in declaration order: the configuration columns of a result table (harness.results).
FIELDS = tuple(f.name for f in fields(Point) if "config" in f.metadata)
CONFIG_KEYS = {f.name: f.metadata["config"] for f in fields(Point) if "config" in f.metadata}
GROUPS = {
    g: tuple(f.name for f in fields(Point) if f.metadata.get("group") == g)
    for g in ("context", "policy", "quant", "eviction", "eval", "calibration", "probe", "peer")
}
POLICY_FIELDS = GROUPS["policy"]
QUANT_FIELDS = GROUPS["quant"]
EVICTION_FIELDS = GROUPS["eviction"]
EVAL_FIELDS = GROUPS["eval"]
CALIBRATION_FIELDS = GROUPS["calibration"]
PROBE_FIELDS = GROUPS["probe"]
DEFAULT_PROBE = {name: KEYED_UNLESS[name] for name in PROBE_FIELDS}  # the unit-KL probe a point leaves unset
PEER_FIELDS = GROUPS["peer"]


def key_of(config: Mapping) -> str:
    """The key of a flat configuration (a Point's to_dict(), a record's `config`): a short stable hash of it, the
    fields of KEYED_UNLESS left out at their values there (a float32 dtype, key_offset 0, key_group_size None,
    outliers 0, key_levels kmeans, calibration_data_path None, score_from 0, probes of 2 x 128 tokens alone; see the
    docstring)."""
    text = json.dumps(keyed_fields(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def keyed_fields(config: Mapping) -> dict:
    """A flat configuration without the fields of KEYED_UNLESS at their values there: what tells points apart, so a
    point recorded before such a field existed reads as the same point recorded after at its default."""
    return {k: v for k, v in config.items() if k not in KEYED_UNLESS or v != KEYED_UNLESS[k]}


def config_key(name: str) -> str:
    """The config key that sets point field `name` (for error messages: `evict_keep` -> `eviction.keep`)."""
    return CONFIG_KEYS[name]


def base_point(cfg: DictConfig) -> Point:
    """The point the primary config describes (no sweep): every field but the peer fields read from its config
    key (a key the config lacks gives the field's default; the model dtype resolved; residual None: the scheme's
    default, which harness.protocols.sweep resolves per point)."""
    out = {}
    for f in fields(Point):
        if "config" not in f.metadata or f.name in PEER_FIELDS:
            continue
        default = {} if f.default is MISSING else {"default": f.default}
        out[f.name] = OmegaConf.select(cfg, f.metadata["config"], **default)
    out["dtype"] = precision.resolve(out["dtype"], cfg.get("device", "cpu"))
    out["widths"] = tuple(out["widths"])
    return Point(**out)


def compose(overrides: list[str]) -> DictConfig:
    """The primary config (conf/config.yaml) with `overrides`, as `python -m harness` would compose it: for the
    commands that read configs outside it (passkey's policies, the sensitivity check's point)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose_config(config_name="config", overrides=overrides)


def group_options(group: str) -> list[str]:
    """The options of a config group: the names of conf/<group>/*.yaml, sorted."""
    return sorted(path.stem for path in (Path(CONF_DIR) / group).glob("*.yaml"))
