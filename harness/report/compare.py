"""Two runs of one grid made in different settings (float32 and bfloat16 models, say), point by point:
`python -m harness.compare_runs RUN_A RUN_B [--out DIR]`.

This module owns the comparison only; each run's own numbers and intervals come from harness.report.paired.
- Points are matched on their configuration without `dtype` (harness/config.py), so a float32 run and a bfloat16
  run of the same grid pair up point for point.
- Per matched point: ppl_ratio and kl_mean in each run and their difference (B - A).
- Per difference to uniform (harness.report.paired.differences: the paired bootstrap 95% interval over the same
  prompts or sequences, same resamples in both runs): the difference and its interval in each run, whether B
  keeps A's sign and A's significance (interval excluding zero), and each run's verdict: better, worse, n.s.
  (not significant), or "no interval" (fewer paired items than a report draws one over). The verdicts agreeing
  everywhere is what "the dtype changes no conclusion" means.
- Per run: the dtype(s) it ran in, the baseline perplexity per model, and the seconds spent per stage.
Writes DIR/compare.md (the command on top), DIR/points.csv and DIR/differences.csv; prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from harness import precision, results
from harness.config import keyed_fields
from harness.report.labels import configuration
from harness.report.paired import HIGHER_IS_BETTER, default_n_boot, differences
from harness.report.tables import markdown_table

POINT_METRICS = ("ppl_ratio", "kl_mean")
SEPARATE = ("dtype",)  # configuration fields the two runs may differ in
STAGES = ("load_s", "calibrate_s", "baseline_s")


def identity(config: dict) -> str:
    """A point's configuration without the fields the runs may differ in, as sorted JSON; a field that enters keys
    only away from a default (harness.config.KEYED_UNLESS) is left out at that default, so a point recorded before
    the field existed matches the same point recorded after."""
    kept = {k: v for k, v in keyed_fields(config).items() if k not in SEPARATE}
    return json.dumps(kept, sort_keys=True, default=str)


def _ok(records: list[dict]) -> dict[str, dict]:
    """identity -> record of every ok, non-baseline point."""
    return {
        identity(r["config"]): r
        for r in records
        if r["status"] == "ok" and r["config"]["policy"] != "baseline"
    }


def point_table(records_a: list[dict], records_b: list[dict]) -> pd.DataFrame:
    """One row per point ok in both runs: POINT_METRICS in A and B and their difference B - A."""
    a, b = _ok(records_a), _ok(records_b)
    rows = []
    for ident in sorted(a.keys() & b.keys()):
        ra, rb = a[ident], b[ident]
        config = ra["config"]
        row = {
            "model": config["model"],
            "scheme": config["scheme"],
            "budget": config["budget"],
            "configuration": configuration(config),
        }
        for metric in POINT_METRICS:
            va, vb = ra["metrics"][metric], rb["metrics"][metric]
            row.update({f"{metric}_a": va, f"{metric}_b": vb, f"d_{metric}": vb - va})
        rows.append({**row, "key_a": ra["key"], "key_b": rb["key"]})
    columns = ["model", "scheme", "budget", "configuration"]
    columns += [f"{m}_{s}" for m in POINT_METRICS for s in ("a", "b")] + [f"d_{m}" for m in POINT_METRICS]
    frame = pd.DataFrame(rows, columns=[*columns, "key_a", "key_b"])
    return frame.sort_values(["model", "scheme", "budget", "configuration"], ignore_index=True)


def verdict(metric: str, difference: float, low: float, excludes_zero: bool) -> str:
    """'better' or 'worse' than uniform when the interval excludes zero, 'n.s.' when it does not, 'no interval'
    when there is none (low is NaN)."""
    if math.isnan(difference) or math.isnan(low):
        return "no interval"
    if not excludes_zero:
        return "n.s."
    return "better" if (difference > 0) == HIGHER_IS_BETTER[metric] else "worse"


def difference_table(
    records_a: list[dict], records_b: list[dict], n_boot: int, seed: int = 0
) -> pd.DataFrame:
    """One row per (point with a uniform partner in both runs, metric): each run's difference to uniform, its
    interval and verdict, and whether B keeps A's sign, significance and verdict."""
    key_to_identity = {r["key"]: identity(r["config"]) for r in [*records_a, *records_b]}
    per_run = []
    for records in (records_a, records_b):
        diffs = differences(records, n_boot, seed)
        diffs = diffs[diffs["uniform_key"].notna()]
        per_run.append(diffs.assign(identity=diffs["key"].map(key_to_identity)))
    merged = per_run[0].merge(
        per_run[1][["identity", "metric", "difference", "low", "high", "excludes_zero", "key"]],
        on=["identity", "metric"],
        suffixes=("_a", "_b"),
    )
    for run in ("a", "b"):
        merged[f"verdict_{run}"] = [
            verdict(*args)
            for args in zip(
                merged["metric"],
                merged[f"difference_{run}"],
                merged[f"low_{run}"],
                merged[f"excludes_zero_{run}"],
            )
        ]
    merged["keeps_sign"] = np.sign(merged["difference_a"]) == np.sign(merged["difference_b"])
    merged["keeps_significance"] = merged["excludes_zero_a"] == merged["excludes_zero_b"]
    merged["keeps_verdict"] = merged["verdict_a"] == merged["verdict_b"]
    columns = ["model", "scheme", "budget", "configuration", "metric", "n"]
    columns += [f"{c}_{s}" for s in ("a", "b") for c in ("difference", "low", "high", "verdict")]
    columns += ["keeps_sign", "keeps_significance", "keeps_verdict", "key_a", "key_b"]
    return merged[columns].sort_values(columns[:5], ignore_index=True)


def run_summary(run_dir: Path, records: list[dict]) -> dict:
    """The dtype(s) a run ran in, its baseline perplexity per model, and its seconds per stage."""
    dtypes = sorted({r["config"].get("dtype", precision.DEFAULT) for r in records})
    baselines = {
        r["config"]["model"]: r["metrics"]["ppl"]
        for r in records
        if r["status"] == "ok" and r["config"]["policy"] == "baseline"
    }
    seconds = dict.fromkeys([*STAGES, "points_s"], 0.0)
    for path in sorted(run_dir.glob("timings*.json")):
        timings = json.loads(path.read_text())
        for stages in timings.get("models", {}).values():
            for stage in STAGES:
                seconds[stage] += stages.get(stage, 0.0)
        seconds["points_s"] += sum(timings.get("points", {}).values())
    return {"run": str(run_dir), "dtypes": dtypes, "baseline_ppl": baselines, "seconds": seconds}


def _count(frame: pd.DataFrame, column: str) -> str:
    return f"{int(frame[column].sum())} of {len(frame)}"


def render(
    command: str, summaries: list[dict], points: pd.DataFrame, diffs: pd.DataFrame, unmatched: tuple[int, int]
) -> str:
    """compare.md: the command, both runs, the verdict summary, the per-point and per-difference tables."""
    lines = [f"`{command}`", "", "## Runs", ""]
    runs = pd.DataFrame(
        [
            {
                "run": label,
                "directory": s["run"],
                "dtype": ", ".join(s["dtypes"]),
                "baseline ppl": ", ".join(f"{m} {p:.4f}" for m, p in sorted(s["baseline_ppl"].items())),
                **{stage: round(v, 1) for stage, v in s["seconds"].items()},
            }
            for label, s in zip("AB", summaries)
        ]
    )
    lines += [markdown_table(runs), ""]
    lines += [
        f"{len(points)} points in both runs ({unmatched[0]} only in A, {unmatched[1]} only in B).",
        "",
        "## Differences to uniform: does B keep A's conclusions?",
        "",
    ]
    if diffs.empty:
        lines += ["No point has a uniform partner in both runs.", ""]
    else:
        by_metric = pd.DataFrame(
            [
                {
                    "metric": metric,
                    "differences": len(group),
                    "keep sign": _count(group, "keeps_sign"),
                    "keep significance": _count(group, "keeps_significance"),
                    "keep verdict": _count(group, "keeps_verdict"),
                }
                for metric, group in diffs.groupby("metric", sort=False)
            ]
        )
        agree = bool(diffs["keeps_verdict"].all())
        lines += [
            markdown_table(by_metric),
            "",
            f"**Verdicts {'agree' if agree else 'differ'}**: {_count(diffs, 'keeps_verdict')} differences to "
            "uniform have the same verdict (better, worse, n.s. at 95%, or no interval) in both runs.",
            "",
        ]
        changed = diffs[~(diffs["keeps_verdict"] & diffs["keeps_sign"] & diffs["keeps_significance"])]
        if not changed.empty:
            lines += [
                "Differences whose sign, significance or verdict changes:",
                "",
                markdown_table(changed),
                "",
            ]
    lines += ["## Per point (B - A)", "", markdown_table(points), ""]
    return "\n".join(lines)


def compare(run_a: Path, run_b: Path, n_boot: int | None = None, seed: int = 0) -> tuple:
    """(summaries, points, differences, unmatched counts) of two run directories; ValueError when they share
    no point."""
    records_a, records_b = results.load_records(run_a), results.load_records(run_b)
    a, b = _ok(records_a), _ok(records_b)
    if not a.keys() & b.keys():
        raise ValueError(
            f"runs: {run_a} and {run_b} share no ok point (configurations equal but for {', '.join(SEPARATE)})"
        )
    n_boot = default_n_boot(run_a) if n_boot is None else n_boot
    points = point_table(records_a, records_b)
    diffs = difference_table(records_a, records_b, n_boot, seed)
    summaries = [run_summary(run_a, records_a), run_summary(run_b, records_b)]
    return summaries, points, diffs, (len(a.keys() - b.keys()), len(b.keys() - a.keys()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m harness.compare_runs", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_a", type=Path, help="the reference run directory (e.g. float32)")
    parser.add_argument("run_b", type=Path, help="the run compared with it (e.g. bfloat16)")
    parser.add_argument("--out", type=Path, default=None, help="write compare.md and the CSVs here")
    parser.add_argument("--n-boot", type=int, default=None, help="bootstrap resamples (default: run A's)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default 0)")
    args = parser.parse_args(argv)
    command = "python -m harness.compare_runs " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        for run in (args.run_a, args.run_b):
            if not (run / "points").is_dir():
                raise ValueError(f"runs: {run} has no points/ directory")
        if args.n_boot is not None and args.n_boot < 1:
            raise ValueError(f"--n-boot: {args.n_boot} is not a positive integer")
        summaries, points, diffs, unmatched = compare(args.run_a, args.run_b, args.n_boot, args.seed)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    text = render(command, summaries, points, diffs, unmatched)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compare.md").write_text(text)
        points.to_csv(args.out / "points.csv", index=False)
        diffs.to_csv(args.out / "differences.csv", index=False)
