"""Grid points: the flat configuration of one evaluation, how a sweep expands into them, and their keys.

A point is a flat dict of every setting that can change a metric (model, policy, budget, alpha, sink rule,
widths, budget mode, scheme, group size, prefill, sink tokens, residual window, evaluation sizes, data, seed,
token eviction, model dtype).
Its key is a hash of that dict, so a finished point is recognized on re-run whatever order the grid lists it in.
The model dtype (`model.dtype`, resolved: float32 or bfloat16) enters the hash only when it is not float32, so
points made before dtypes were recorded keep their keys and their runs still resume.

A sweep config (conf/sweep/*.yaml) lists `models`, `budgets`, `schemes` and `policies`: each policy entry sets
some point fields, and a list value expands into one point per element (a product over all list fields).
`points` adds explicit points. Anything unset comes from the primary config.

`peers` lists points measured by another implementation of a KV cache (harness/peers: llama.cpp, transformers'
QuantizedCache), one entry per engine with its storage types (a list value expands, over `models` too). A peer
point carries `engine` and `rotation` beside the fields its context needs; the harness's own points carry
neither, so their keys are what they were before peers existed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable

from omegaconf import DictConfig, OmegaConf

from harness import precision
from harness.policies import from_point

POLICY_FIELDS = (
    "policy",
    "budget",
    "alpha",
    "sink_threshold",
    "sink_fraction",
    "widths",
    "budget_mode",
    "budget_unit",
    "entropy_key",
    "policy_seed",
)
QUANT_FIELDS = ("scheme", "group_size", "prefill", "sink_tokens", "residual")
EVAL_FIELDS = (
    "num_prompts",
    "prompt_tokens",
    "new_tokens",
    "num_sequences",
    "sequence_tokens",
    "chunk",
    "bos",
)
CALIBRATION_FIELDS = ("calibration_sequences", "calibration_tokens", "i0")
EVICTION_FIELDS = ("eviction", "evict_keep", "evict_sinks", "evict_recent")
# The eviction fields of every point that evicts nothing (configs without the eviction group included).
NO_EVICTION = {"eviction": "none", "evict_keep": 1.0, "evict_sinks": 4, "evict_recent": 0.5}
PEER_FIELDS = ("engine", "rotation")
HARNESS = "harness"  # the engine of every point without an `engine` field


def engine(point) -> str:
    """The engine that measures a point: HARNESS, or a peer of harness/peers."""
    return point.get("engine", HARNESS)


def without_peer_fields(point: dict) -> dict:
    """The point with its peer fields dropped (a harness point is returned equal)."""
    return {k: v for k, v in point.items() if k not in PEER_FIELDS}


def _eviction_fields(cfg: DictConfig) -> dict:
    """A point's eviction fields from the `eviction` group (harness/eviction.py); none when the group is absent."""
    v = cfg.get("eviction")
    if v is None:
        return dict(NO_EVICTION)
    return {"eviction": v.name, "evict_keep": v.keep, "evict_sinks": v.sink_tokens, "evict_recent": v.recent}


def base_point(cfg: DictConfig) -> dict:
    """The point the primary config describes (no sweep)."""
    p, q, e = cfg.policy, cfg.quant, cfg.eval
    return {
        "model": cfg.model.name,
        "dtype": precision.resolve(cfg.model.get("dtype", precision.DEFAULT), cfg.get("device", "cpu")),
        "policy": p.name,
        "budget": p.budget,
        "alpha": p.alpha,
        "sink_threshold": p.sink_threshold,
        "sink_fraction": p.sink_fraction,
        "widths": list(p.widths),
        "budget_mode": p.budget_mode,
        "budget_unit": p.get("budget_unit", "bytes"),
        "entropy_key": p.get("entropy_key", "H2"),
        "policy_seed": p.get("seed", 0),
        "scheme": q.scheme,
        "group_size": q.group_size,
        "prefill": q.prefill,
        "sink_tokens": q.get("sink_tokens", 0),
        "residual": q.get("residual"),  # None: the scheme's default, resolved per point by _dedupe
        "num_prompts": e.num_prompts,
        "prompt_tokens": e.prompt_tokens,
        "new_tokens": e.new_tokens,
        "num_sequences": e.num_sequences,
        "sequence_tokens": e.sequence_tokens,
        "chunk": e.chunk,
        "bos": e.get("bos", "auto"),
        "calibration_sequences": e.calibration.num_sequences,
        "calibration_tokens": e.calibration.tokens,
        "i0": e.calibration.i0,
        "data_path": e.data.path,
        "seed": cfg.seed,
        **_eviction_fields(cfg),
    }


def point_key(point: dict) -> str:
    """A short stable hash of the point's full configuration (a float32 dtype left out, see the docstring)."""
    if point.get("dtype") == precision.DEFAULT:
        point = {k: v for k, v in point.items() if k != "dtype"}
    return hashlib.sha256(json.dumps(point, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _product(fields: dict) -> Iterable[dict]:
    """One dict per combination of the list-valued fields (`widths` is one value: a list of widths)."""
    names = list(fields)
    values = [v if isinstance(v, list) and n != "widths" else [v] for n, v in fields.items()]
    for combo in itertools.product(*values):
        yield dict(zip(names, combo))


def expand(cfg: DictConfig) -> list[dict]:
    """Every point of the configured sweep (or the configured policy beside uniform when there is no sweep)."""
    base = base_point(cfg)
    sweep = cfg.get("sweep")
    if sweep is None:
        entries = [{"policy": "uniform", "alpha": 0.0, "sink_threshold": None, "sink_fraction": None}, {}]
        return _dedupe([{**base, **e} for e in entries])
    sweep = OmegaConf.to_container(sweep, resolve=True)
    axes = {
        "model": sweep.get("models") or [base["model"]],
        "budget": sweep.get("budgets") or [base["budget"]],
        "scheme": sweep.get("schemes") or [base["scheme"]],
    }
    points = []
    for entry in sweep.get("policies") or [{}]:
        fields = {**axes, **{("policy" if k == "name" else k): v for k, v in entry.items()}}
        for combo in _product(fields):
            points.append({**base, **combo})
    for entry in sweep.get("points") or []:
        points.append({**base, **{("policy" if k == "name" else k): v for k, v in entry.items()}})
    for entry in sweep.get("peers") or []:
        from harness.peers import peer_point  # the engines' storage types: only where peers are asked for

        harness_base = _dedupe([base])[0]
        for combo in _product({"model": axes["model"], **entry}):
            points.append({**peer_point(harness_base, combo), **NO_EVICTION})
    return _dedupe(points)


def _dedupe(points: list[dict]) -> list[dict]:
    """Drop repeated points, and normalize fields a policy ignores (harness.policies: Policy.normalize) so equal
    evaluations share one key."""
    seen, out = set(), []
    for p in points:
        p = _normalize_policy(p)
        if p.get("residual") is None:
            from harness.schemes import default_residual  # imports torch: only where a grid is expanded

            p = {**p, "residual": default_residual(p["scheme"])}
        if p.get("eviction") == "none":
            p = {**p, **NO_EVICTION}
        elif p.get("eviction") == "streaming":  # its whole budget after the sinks goes to recent tokens
            p = {**p, "evict_recent": 1.0}
        k = point_key(p)
        if k not in seen:
            seen.add(k)
            out.append(p)
    return out


def _normalize_policy(point: dict) -> dict:
    """The point with its policy fields as its normalized policy writes them (harness.policies: settings the policy
    ignores at their neutral values); an invalid policy is left as it is, for validation to report."""
    try:
        policy = from_point(point)
    except ValueError:
        return point
    return {**point, **policy.normalize().point_fields()}


def shard(points: list[dict], index: int, count: int) -> list[dict]:
    """Points index, index + count, ... (a stable split of the grid across jobs)."""
    return points[index::count]
