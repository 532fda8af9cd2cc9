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

SHOWN = ["model", "policy", "budget", "alpha", "sink_threshold", "sink_fraction", "scheme", "mean_bits",
         "compression_nominal", "compression_true", "bleu", "bleu_tok", "token_match", "first_divergence", "ppl",
         "ppl_ratio", "kl_mean", "kl_p99", "top1_agree"]
PACKAGES = ("torch", "transformers", "accelerate", "gguf", "hydra-core", "pandas", "pyarrow", "sacrebleu", "wandb",
            "triton", "numpy")


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent).stdout.strip()
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
    return ok[cols].sort_values(["model", "budget", "policy"]).to_string(index=False, float_format=lambda x: f"{x:.4g}")


def run_session(cfg: DictConfig, points: list[dict]) -> pd.DataFrame:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    suffix = "" if cfg.num_shards == 1 else f".shard{cfg.shard}"
    (run_dir / f"env{suffix}.json").write_text(json.dumps(environment(cfg.device), indent=1))
    mine = shard(points, cfg.shard, cfg.num_shards)
    table = runner.run(mine, run_dir, batch_size=cfg.eval.batch_size, device=cfg.device, tag=suffix)
    print(format_table(table))
    print(f"\nresults: {run_dir}/results.parquet ({len(table)} rows)")
    return table
