"""The frontier judged at long context: how far each point's quality moves from the frontier's short windows to
the model's whole context. `python -m harness.report.long_context RUN_DIR` writes RUN_DIR/long_context.md.

This module owns one table per model and text, read from a run's point records alone (conf/sweep/frontier_long.yaml
makes such a run): every configuration measured at more than one window length (eval.sequence_tokens, with
eval.score_from: the tokens its metrics cover) gets a row with its true compression (also counted for one
sequence of the longest length, every fitted table in full: frontier.one_sequence_compression), its ppl_ratio and
kl_mean at each length (95% bootstrap intervals over that length's sequences, n printed) and its move from the
shortest length to each longer one, with an interval of the difference (the lengths' windows differ, so the two
are resampled independently: an unpaired interval). The unquantized baseline's perplexity at each length heads the
table. Then the goal (DESIGN.md §8): the best points at 3.5x and 4.5x within +LONG_GOAL of their short ppl_ratio.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from harness import results
from harness.config import keyed_fields
from harness.metrics import MIN_PAIRED_UNITS
from harness.report.frontier import (
    METRICS,
    best_at,
    interval,
    name,
    on_text,
    one_sequence_compression,
    page_command,
    quantized_records,
    texts,
)
from harness.report.paired import default_n_boot, teacher_forced_statistics
from harness.report.sweep import provenance
from harness.report.tables import markdown_table

LENGTH_FIELDS = ("sequence_tokens", "score_from", "num_sequences")  # what a length changes in a point
LONG_GOAL = 0.01  # the 3.5x and 4.5x points' largest move in ppl_ratio from short to long windows
GOAL_TARGETS = (3.5, 4.5)  # true compression of the points the goal is about


def length_of(config: dict) -> tuple[int, int]:
    """(sequence_tokens, score_from) of a point: its windows and the first token its metrics cover."""
    return int(config["sequence_tokens"]), int(config.get("score_from", 0) or 0)


def length_label(length: tuple[int, int]) -> str:
    """'1024 tokens' or '8192 tokens, scored from 4096'."""
    tokens, start = length
    return f"{tokens} tokens" + (f", scored from {start}" if start > 1 else "")


def configuration_of(config: dict) -> tuple:
    """What a point is apart from its length: its every other field, as a hashable tuple (a field that enters keys
    only away from a default left out at it, harness.config.keyed_fields: a point recorded before the field
    existed is the same configuration as one recorded after)."""
    return tuple(sorted((k, str(v)) for k, v in keyed_fields(config).items() if k not in LENGTH_FIELDS))


def move_interval(long: dict, short: dict, metric: str, n_boot: int, seed: int) -> str:
    """'+0.004 [-0.002, +0.010]' for long's metric less short's, each resampled over its own sequences (unpaired:
    the windows differ); 'n too small' below MIN_PAIRED_UNITS sequences at either length."""
    (stat_long, n_long), (stat_short, n_short) = (teacher_forced_statistics(r)[metric] for r in (long, short))
    move = stat_long(np.arange(n_long)) - stat_short(np.arange(n_short))
    if min(n_long, n_short) < MIN_PAIRED_UNITS:
        return f"{move:+.4f} (n={min(n_long, n_short)} too small for an interval)"
    rng = np.random.default_rng(seed)
    draws = np.array(
        [
            stat_long(rng.integers(0, n_long, n_long)) - stat_short(rng.integers(0, n_short, n_short))
            for _ in range(n_boot)
        ]
    )  # (n_boot,)
    low, high = np.percentile(draws, [2.5, 97.5])
    return f"{move:+.4f} [{low:+.4f}, {high:+.4f}]"


def baseline_row(records: list[dict], model: str, lengths: list[tuple[int, int]]) -> dict:
    """The unquantized cache's perplexity at each length."""
    row = {"point": "unquantized cache (perplexity)", "true compression": "1.00x"}
    for length in lengths:
        base = [
            r
            for r in records
            if r["status"] == "ok"
            and r["config"]["model"] == model
            and r["config"]["policy"] == "baseline"
            and length_of(r["config"]) == length
        ]
        row[f"ppl_ratio, {length_label(length)}"] = f"{base[0]['metrics']['ppl']:.4g}" if base else "not run"
    return row


def long_context_table(records: list[dict], model: str, n_boot: int, seed: int = 0) -> pd.DataFrame:
    """One row per configuration measured at more than one length (module docstring), by true compression."""
    mine = quantized_records(records, model)
    lengths = sorted({length_of(r["config"]) for r in mine})
    by_configuration: dict[tuple, dict[tuple[int, int], dict]] = {}
    for r in mine:
        by_configuration.setdefault(configuration_of(r["config"]), {})[length_of(r["config"])] = r
    rows = [baseline_row(records, model, lengths)] if len(lengths) > 1 else []
    measured = [at for at in by_configuration.values() if len(at) > 1]
    for at in sorted(measured, key=lambda at: min(r["metrics"]["compression_true"] for r in at.values())):
        short = at[min(at)]
        row = {
            "point": name(short["config"]),
            "true compression": f"{short['metrics']['compression_true']:.2f}x",
            f"at 1 x {max(lengths)[0]}": f"{one_sequence_compression(short, max(lengths)[0]):.2f}x",
        }
        for length in lengths:
            for metric in METRICS:
                cell = interval(at[length], metric, n_boot, seed) if length in at else "not run"
                row[f"{metric}, {length_label(length)}"] = cell
        for length in sorted(at)[1:]:
            for metric in METRICS:
                row[f"{metric} move to {length[0]}"] = move_interval(at[length], short, metric, n_boot, seed)
        rows.append(row)
    return pd.DataFrame(rows)


def goal_rows(records: list[dict], model: str) -> pd.DataFrame:
    """The best short-window point at each of GOAL_TARGETS and its move at each longer length against LONG_GOAL."""
    mine = quantized_records(records, model)
    lengths = sorted({length_of(r["config"]) for r in mine})
    if len(lengths) < 2:
        return pd.DataFrame()
    short = [r for r in mine if length_of(r["config"]) == lengths[0]]
    rows = []
    for target in GOAL_TARGETS:
        best = best_at(short, target)
        if best is None:
            rows.append({"at least": f"{target:g}x", "best short point": "none", "verdict": "no point"})
            continue
        for length in lengths[1:]:
            long = [
                r
                for r in mine
                if length_of(r["config"]) == length
                and configuration_of(r["config"]) == configuration_of(best["config"])
            ]
            move = long[0]["metrics"]["ppl_ratio"] - best["metrics"]["ppl_ratio"] if long else math.nan
            verdict = (
                "not run"
                if math.isnan(move)
                else ("met" if move <= LONG_GOAL else f"missed by {move - LONG_GOAL:.4f}")
            )
            rows.append(
                {
                    "at least": f"{target:g}x",
                    "best short point": name(best["config"]),
                    "length": length_label(length),
                    "ppl_ratio move": "—" if math.isnan(move) else f"{move:+.4f}",
                    "goal": f"<= +{LONG_GOAL}",
                    "verdict": verdict,
                }
            )
    return pd.DataFrame(rows)


def long_context_text(run_dir: Path, records: list[dict], n_boot: int | None = None, seed: int = 0) -> str:
    """The whole long_context.md of run_dir."""
    n_boot = default_n_boot(run_dir) if n_boot is None else n_boot
    parts = ["  \n".join(provenance(run_dir))]
    if any(r["metrics"].get("simulate") for r in records if r["status"] == "ok"):
        parts.append(
            "\n**Simulated memory (quant.simulate=true):** the caches also kept a full-precision working copy; "
            "metrics and true bytes are the stored format's."
        )
    parts.append(
        f"\nIntervals: percentile bootstrap 95% over each length's teacher-forced sequences, {n_boot} resamples, "
        f"seed {seed}; a move's interval resamples the two lengths' sequences independently (their windows "
        f"differ). True compression: the generation caches' bytes, every fitted table counted (the frontier's)."
    )
    for text in texts(records) or [None]:
        there = on_text(records, text)
        for model in sorted({r["config"]["model"] for r in there if r["config"]["policy"] != "baseline"}):
            parts += [
                f"\n# {model} on {text or 'the default text'}\n",
                markdown_table(long_context_table(there, model, n_boot, seed)),
                f"\n## Goal: the best points at {' and '.join(f'{t:g}x' for t in GOAL_TARGETS)} within "
                f"+{LONG_GOAL} of their short-window ppl_ratio\n",
                markdown_table(goal_rows(there, model)),
            ]
    return "\n".join(parts) + "\n"


def write_long_context(run_dir: str | Path, n_boot: int | None = None, seed: int = 0) -> Path:
    run_dir = Path(run_dir)
    path = run_dir / "long_context.md"
    path.write_text(long_context_text(run_dir, results.load_records(run_dir), n_boot, seed))
    return path


def main(argv: list[str] | None = None) -> None:
    page_command(argv, "python -m harness.report.long_context", __doc__, write_long_context)


if __name__ == "__main__":
    main()
