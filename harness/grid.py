"""Grid points: how a sweep expands into harness.config Points, deduplicated by key, and split across jobs.

A sweep config (conf/sweep/*.yaml) lists `models`, `budgets`, `schemes` and `policies`: each policy entry sets
some point fields, and a list value expands into one point per element (a product over all list fields).
`points` adds explicit points. Anything unset comes from the primary config (harness.config.base_point).

`peers` lists points measured by another implementation of a KV cache (harness/peers: llama.cpp, transformers'
QuantizedCache), one entry per engine with its storage types (a list value expands, over `models` too). A peer
point carries `engine` and `rotation` beside the fields its context needs; the harness's own points carry
neither, so their keys are what they were before peers existed (harness.config).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from omegaconf import DictConfig, OmegaConf

from harness.config import NO_EVICTION, Point, base_point
from harness.policies import from_point


def _product(fields: dict) -> Iterable[dict]:
    """One dict per combination of the list-valued fields (`widths` is one value: a list of widths)."""
    names = list(fields)
    values = [v if isinstance(v, list) and n != "widths" else [v] for n, v in fields.items()]
    for combo in itertools.product(*values):
        yield dict(zip(names, combo))


def expand(cfg: DictConfig) -> list[Point]:
    """Every point of the configured sweep (or the configured policy beside uniform when there is no sweep)."""
    base = base_point(cfg).to_dict()
    sweep = cfg.get("sweep")
    if sweep is None:
        entries = [{"policy": "uniform", "alpha": 0.0, "sink_threshold": None, "sink_fraction": None}, {}]
        return _dedupe([Point.from_dict({**base, **e}) for e in entries])
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
            points.append(Point.from_dict({**base, **combo}))
    for entry in sweep.get("points") or []:
        points.append(
            Point.from_dict({**base, **{("policy" if k == "name" else k): v for k, v in entry.items()}})
        )
    for entry in sweep.get("peers") or []:
        from harness.peers import peer_point  # the engines' storage types: only where peers are asked for

        harness_base = _dedupe([Point.from_dict(base)])[0]
        for combo in _product({"model": axes["model"], **entry}):
            points.append(peer_point(harness_base, combo).replace(**NO_EVICTION))
    return _dedupe(points)


def _dedupe(points: list[Point]) -> list[Point]:
    """Drop repeated points, and normalize fields a policy ignores (harness.policies: Policy.normalize) so equal
    evaluations share one key."""
    seen, out = set(), []
    for p in points:
        p = _normalize_policy(p)
        if p.residual is None:
            from harness.schemes import default_residual  # imports torch: only where a grid is expanded

            p = p.replace(residual=default_residual(p.scheme))
        if p.eviction == "none":
            p = p.replace(**NO_EVICTION)
        elif p.eviction == "streaming":  # its whole budget after the sinks goes to recent tokens
            p = p.replace(evict_recent=1.0)
        k = p.key()
        if k not in seen:
            seen.add(k)
            out.append(p)
    return out


def _normalize_policy(point: Point) -> Point:
    """The point with its policy fields as its normalized policy writes them (harness.policies: settings the policy
    ignores at their neutral values); an invalid policy is left as it is, for validation to report."""
    try:
        policy = from_point(point.group("policy"))
    except ValueError:
        return point
    return point.replace(**policy.normalize().point_fields())


def shard(points: list[Point], index: int, count: int) -> list[Point]:
    """Points index, index + count, ... (a stable split of the grid across jobs)."""
    return points[index::count]
