"""One invocation of the grid runner: run directory, config and environment record (written first), the grid
run, the printed table."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from harness import precision, runner
from harness.config import Point
from harness.grid import shard
from harness.io import command_line, environment, provenance, write_environment, write_text_atomic

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


def run_session(cfg: DictConfig, points: list[Point]) -> pd.DataFrame:
    """Run this process's shard of the grid into cfg.run_dir, then the report and the W&B summary.

    W&B mirrors every point as it finishes; a tracker failure only warns. Sharded jobs each write their
    points; the report (merge) runs in every job over whatever points exist, and the W&B summary run is made
    by unsharded sessions only (after a sharded sweep: python -m harness.report <run_dir>).
    """
    from harness.report.sweep import write_report
    from harness.tracking import Tracker, sync_command

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    suffix = "" if cfg.num_shards == 1 else f".shard{cfg.shard}"
    dtype = precision.resolve(cfg.model.get("dtype", precision.DEFAULT), cfg.device)
    env = environment(command_line("python -m harness"), cfg.device, cfg.allow_dirty, dtype)
    write_environment(run_dir, env, f"env{suffix}.json")  # before any model loads: what this start ran on
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
