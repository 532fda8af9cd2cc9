"""The report of a run directory, regenerated from its points/ alone: `python -m harness.report RUN_DIR`.

This module owns the sweep run's page, what write_report makes of a run directory:
- results.parquet re-written from points/ (the merge step after shards; harness.results does the reading);
- tables.md: the command and commit, per model and scheme the claim table (uniform, entropy, sinks and
  entropy + sinks at budget 4, beside the baseline), the full grid, the infeasible points, and every
  non-uniform point's difference to uniform at the same budget with its paired bootstrap 95% interval
  (harness.report.tables, harness.report.paired); tables.md lists each peer beside the harness point nearest
  to it in true bytes;
- pareto-<model>-<scheme>.png/.svg (and pareto-<model>-all when a run varies storage), entropy-<model>.png and
  allocation-<model>.png (harness.report.plots).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from harness import results
from harness.config import HARNESS
from harness.metrics import MIN_PAIRED_UNITS
from harness.report.labels import CLAIM_BUDGET, groups
from harness.report.paired import (
    EQUAL_BYTES_TOLERANCE,
    default_n_boot,
    difference_table,
    differences,
    is_plain,
)
from harness.report.plots import allocation_point, plot_allocation, plot_entropy, plot_pareto, save
from harness.report.tables import (
    claim_table,
    grid_table,
    infeasible_table,
    markdown_table,
    peer_table,
    text_seeds,
)


def provenance(run_dir: Path) -> list[str]:
    """One line per distinct (command, commit) among the run's env*.json (one per shard), env.json first."""
    lines = []
    for path in sorted(run_dir.glob("env*.json"), key=lambda p: (p.name != "env.json", p.name)):
        env = json.loads(path.read_text())
        line = f"`{env.get('command')}` (commit `{env.get('git_commit')}`)"
        if line not in lines:
            lines.append(line)
    return lines or ["command unknown: no env.json in this run directory"]


def tables_markdown(
    run_dir: Path,
    frame: pd.DataFrame,
    diffs: pd.DataFrame,
    n_boot: int,
    seed: int,
    plain_diffs: pd.DataFrame | None = None,
) -> str:
    """The whole tables.md: provenance first, then claim tables, grid, infeasible points, differences (to
    uniform, and to the plain cache when the run varies storage)."""
    parts = ["  \n".join(provenance(run_dir))]
    if "simulate" in frame and frame["simulate"].fillna(False).astype(bool).any():
        parts.append(
            "\n**Simulated memory (quant.simulate=true):** the quantized caches of the rows marked `simulate` also "
            "kept a full-precision working copy for the model's own attention; their metrics equal the packed-only "
            "path's within float summation order, their `resident_bytes` are not a quantized cache's."
        )
    parts += [
        f"\n# {run_dir.name}: {len(frame)} points "
        f"({(frame['status'] == 'ok').sum()} ok, {(frame['status'] == 'infeasible').sum()} infeasible)",
    ]
    seeds = text_seeds(frame)
    for model, scheme in groups(frame):
        for text_seed in seeds:  # not `seed`: that is the bootstrap's, printed below
            at_seed = f", text seed {text_seed}" if len(seeds) > 1 else ""
            parts += [
                f"\n## {model} / {scheme}: claim table at budget {CLAIM_BUDGET}{at_seed}\n",
                markdown_table(claim_table(frame, model, scheme, seed=text_seed)),
            ]
    parts += ["\n## Full grid (ok points)\n", markdown_table(grid_table(frame))]
    beside = peer_table(frame)
    if len(beside):
        parts += [
            "\n## Peer engines beside the nearest harness point in true compression\n\n"
            "A peer's ppl_ratio, kl_mean and top1_agree are against its own unquantized cache (ppl_base; llama.cpp: "
            "its f16 cache), the harness's against the harness's baseline, on the same token windows. Its bytes per "
            "token are over those windows, the harness's over its generation caches: with sliding-window layers "
            "they differ at the same compression.\n",
            markdown_table(beside),
        ]
    bad = infeasible_table(frame)
    if len(bad):
        parts += ["\n## Infeasible points\n", markdown_table(bad)]
    interval = (
        f"Point estimate [paired percentile bootstrap 95% interval] n = paired items, {n_boot} resamples of "
        f"prompts (bleu, token_match) or sequences (ppl_ratio, kl_mean), seed {seed}; no interval below "
        f"n = {MIN_PAIRED_UNITS}. Bold: the interval excludes zero. bytes: true bytes per token over the "
        f"reference's (equal memory within {EQUAL_BYTES_TOLERANCE:.1%}).\n"
    )
    parts += [
        "\n## Differences to uniform at the same model, scheme and budget\n\n" + interval,
        markdown_table(difference_table(diffs)),
    ]
    if plain_diffs is not None and len(plain_diffs):
        parts += [
            "\n## Differences to the plain cache (uniform asym_token, no fp16 tokens, no eviction) at the same "
            "model and budget\n\nCompare bytes_per_token in the full grid: storage options change the bytes at "
            "a given budget. " + interval,
            markdown_table(difference_table(plain_diffs)),
        ]
    return "\n".join(parts) + "\n"


def varies_storage(records: list[dict]) -> bool:
    """Whether a harness point of the run stores its cache other than the plain cache does (PLAIN, any policy):
    then tables.md compares with the plain cache too and each model gets an all-schemes Pareto plot."""
    return any(
        not is_plain({**r["config"], "policy": "uniform"})
        for r in records
        if r["config"]["policy"] != "baseline" and r["config"].get("engine", HARNESS) == HARNESS
    )


def tables_text(run_dir: Path, records: list[dict], n_boot: int | None = None, seed: int = 0) -> str:
    """The tables.md of run_dir from its point records (n_boot: default_n_boot's choice when None)."""
    n_boot = default_n_boot(run_dir) if n_boot is None else n_boot
    plain_diffs = differences(records, n_boot, seed, against="plain") if varies_storage(records) else None
    diffs = differences(records, n_boot, seed)
    return tables_markdown(run_dir, results.table(records), diffs, n_boot, seed, plain_diffs)


def write_report(
    run_dir: str | Path, n_boot: int | None = None, seed: int = 0, allocation_key: str | None = None
) -> list[Path]:
    """Regenerate results.parquet, tables.md and every figure of run_dir from points/; returns the paths.

    n_boot: bootstrap resamples (default: the run's eval.bootstrap, else 1000); allocation_key: the point
    drawn in allocation-<model>.png (default: allocation_point's choice per model).
    """
    run_dir = Path(run_dir)
    records = results.load_records(run_dir)
    frame = results.table(records)
    written = [results.write_parquet(run_dir)]
    tables = run_dir / "tables.md"
    tables.write_text(tables_text(run_dir, records, n_boot, seed))
    written.append(tables)
    for model, scheme in groups(frame):
        written += save(
            plot_pareto(frame, model, scheme), run_dir / f"pareto-{model}-{scheme}", ("png", "svg")
        )
    if varies_storage(
        records
    ):  # every scheme and storage option of a model on one plot: equal true bytes line up
        for model in sorted({m for m, _ in groups(frame)}):
            written += save(plot_pareto(frame, model), run_dir / f"pareto-{model}-all", ("png", "svg"))
    for model in sorted(set(frame["model"].dropna())):
        if (run_dir / f"entropy-{model}.parquet").exists():
            entropy = results.load_entropy(run_dir, model)
            written += save(plot_entropy(entropy, model), run_dir / f"entropy-{model}")
        chosen = [r for r in records if r["key"] == allocation_key and r["config"]["model"] == model]
        point = chosen[0] if chosen else allocation_point(records, model)
        if point is not None:
            written += save(plot_allocation(point), run_dir / f"allocation-{model}")
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harness.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (results/<sweep>/<run>) with points/")
    parser.add_argument(
        "--n-boot",
        type=int,
        default=None,
        help="bootstrap resamples (default: the run's eval.bootstrap, else 1000)",
    )
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    parser.add_argument("--allocation-key", default=None, help="point key drawn in allocation-<model>.png")
    args = parser.parse_args(argv)
    if not (args.run_dir / "points").is_dir():
        parser.error(f"{args.run_dir}: no points/ directory")
    for path in write_report(args.run_dir, args.n_boot, args.seed, args.allocation_key):
        print(path)
