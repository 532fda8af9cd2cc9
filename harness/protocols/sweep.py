"""The sweep protocol (`python -m harness [+sweep=NAME]`): the grid's points, then one run of them.

Points. A sweep config (conf/sweep/*.yaml) lists `models`, `budgets`, `schemes` and `policies`: each policy entry
sets some point fields, and a list value expands into one point per element (a product over all list fields).
`points` adds explicit points. Anything unset comes from the primary config (harness.config.base_point). Without
a sweep, the configured policy is evaluated beside uniform. Points are deduplicated by key and split across jobs
(`shard`).

`peers` lists points measured by another implementation of a KV cache (harness/peers: llama.cpp, transformers'
QuantizedCache), one entry per engine with its storage types (a list value expands, over `models` too). A peer
point carries `engine` and `rotation` beside the fields its context needs; the harness's own points carry
neither, so their keys are what they were before peers existed (harness.config).

Run. The start record (config.yaml, env.json) before any model loads, this process's shard through the point
runner (harness.run.runner), the printed table, the report (harness.report) and the W&B summary.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from harness import precision
from harness.config import DEFAULT_PROBE, NO_EVICTION, Point, base_point
from harness.io import command_line, provenance, start_record
from harness.peers import peer_point
from harness.policies import from_point
from harness.report.sweep import write_report
from harness.run import runner
from harness.run.context import context_key
from harness.run.measure import table_key
from harness.schemes import default_residual
from harness.sensitivity import READS_PROBE
from harness.tracking import Tracker, sync_command

# ------------------------------------------------------------------------------------------------ points


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
    ignores at their neutral values), and the unit-KL probe at its default unless its policy measures on one; an
    invalid policy is left as it is, for validation to report."""
    try:
        policy = from_point(point.group("policy"))
    except ValueError:
        return point
    if policy.measurement not in READS_PROBE:
        point = point.replace(**DEFAULT_PROBE)
    return point.replace(**policy.normalize().point_fields())


def shard(points: list[Point], index: int, count: int) -> list[Point]:
    """Job `index` of `count`'s points: a stable split of the grid in which each point goes to the job holding the
    fewest so far (the first of them on a tie: points index, index + count, ... when no policy is measured),
    except that the points reading one measured table (harness.run.measure.table_key, per model context) all go
    to the job of the first of them, so that no two jobs measure the same table."""
    loads = [0] * count
    table_job: dict[tuple, int] = {}
    mine = []
    for point in points:
        table = _table_key(point)
        job = table_job.get(table) if table is not None else None
        if job is None:
            job = loads.index(min(loads))
            if table is not None:
                table_job[table] = job
        loads[job] += 1
        if job == index:
            mine.append(point)
    return mine


def _table_key(point: Point) -> tuple | None:
    """The measured table a point reads, within its model context; None if it reads none."""
    key = table_key(point)
    return None if key is None else (context_key(point), *key)


# --------------------------------------------------------------------------------------------------- run


SHOWN = [
    "model",
    "policy",
    "budget",
    "alpha",
    "sink_threshold",
    "sink_fraction",
    "scheme",
    "mean_bits",
    "compression_nominal",
    "compression_true",
    "bleu",
    "bleu_tok",
    "token_match",
    "first_divergence",
    "ppl",
    "ppl_ratio",
    "kl_mean",
    "kl_p99",
    "top1_agree",
]


def format_table(table: pd.DataFrame) -> str:
    ok = table[table["status"] == "ok"]
    cols = [c for c in SHOWN if c in ok.columns]
    return (
        ok[cols]
        .sort_values(["model", "budget", "policy"])
        .to_string(index=False, float_format=lambda x: f"{x:.4g}")
    )


def run(cfg: DictConfig, points: list[Point]) -> pd.DataFrame:
    """Run this process's shard of the grid into cfg.run_dir, then the report and the W&B summary.

    W&B mirrors every point as it finishes; a tracker failure only warns. Sharded jobs each write their
    points; the report (merge) runs in every job over whatever points exist, and the W&B summary run is made
    by unsharded sessions only (after a sharded sweep: python -m harness.report <run_dir>).
    """
    run_dir = Path(cfg.run_dir)
    suffix = "" if cfg.num_shards == 1 else f".shard{cfg.shard}"
    dtype = precision.resolve(cfg.model.get("dtype", precision.DEFAULT), cfg.device)
    env = start_record(  # before any model loads: what this start ran on
        run_dir,
        command_line("python -m harness"),
        cfg.device,
        cfg.allow_dirty,
        dtype,
        config_yaml=OmegaConf.to_yaml(cfg, resolve=True),
        name=f"env{suffix}.json",
    )
    wandb_cfg = cfg.tracking.wandb
    tracker = Tracker(
        wandb_cfg.mode,
        wandb_cfg.project,
        wandb_cfg.entity,
        run_dir=run_dir,
        group=f"{run_dir.parent.name}/{run_dir.name}",
    )
    table, written = None, []
    try:
        mine = shard(points, cfg.shard, cfg.num_shards)
        table = runner.run(
            mine,
            run_dir,
            batch_size=cfg.eval.batch_size,
            device=cfg.device,
            tag=suffix,
            on_point=tracker.log_point,
            backend=cfg.quant.backend,
            provenance=provenance(env),
            simulate=cfg.quant.get("simulate", False),
        )
        print(format_table(table))
        written = write_report(run_dir)
        print(f"\nresults: {run_dir}/results.parquet ({len(table)} rows), {run_dir}/tables.md and plots")
    finally:
        if cfg.num_shards == 1 and table is not None:
            images = {p.stem: p for p in written if p.suffix == ".png"}
            tracker.finish(table, images)
            if wandb_cfg.mode == "offline":
                print(f"W&B (offline): upload later with: {sync_command(run_dir)}")
    return table
