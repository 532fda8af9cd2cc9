"""One invocation of the harness: run directory, environment record, the grid run, and the printed table."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from harness import runner
from harness.grid import shard

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
PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "gguf",
    "hydra-core",
    "pandas",
    "pyarrow",
    "sacrebleu",
    "wandb",
    "triton",
    "numpy",
)


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def environment(device: str) -> dict:
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "command": "python -m harness " + " ".join(sys.argv[1:]),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "cpu_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "packages": versions,
    }


def format_table(table: pd.DataFrame) -> str:
    ok = table[table["status"] == "ok"]
    cols = [c for c in SHOWN if c in ok.columns]
    return (
        ok[cols]
        .sort_values(["model", "budget", "policy"])
        .to_string(index=False, float_format=lambda x: f"{x:.4g}")
    )


def run_session(cfg: DictConfig, points: list[dict]) -> pd.DataFrame:
    """Run this process's shard of the grid into cfg.run_dir, then the report and the W&B summary.

    W&B mirrors every point as it finishes; a tracker failure only warns. Sharded jobs each write their
    points; the report (merge) runs in every job over whatever points exist, and the W&B summary run is made
    by unsharded sessions only (after a sharded sweep: python -m harness.report <run_dir>).
    """
    from harness.report import write_report
    from harness.tracking import Tracker, sync_command

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    suffix = "" if cfg.num_shards == 1 else f".shard{cfg.shard}"
    (run_dir / f"env{suffix}.json").write_text(json.dumps(environment(cfg.device), indent=1))
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
