"""Passkey results (results/passkey/<run>/points/*.json, written by harness/protocols/passkey.py) -> tables.md and a plot.

- Accuracy per context x (policy, budget): correct trials over all trials of all depths at that context.
- Failure context of a (policy, budget): the first context, in increasing order, where its accuracy drops below
  FAIL_RATIO x the baseline's accuracy at the same context (contexts where the baseline itself scores 0 cannot
  trigger it); "-" when it never does within the contexts run.
- Accuracy per depth x context of the baseline, and of each (policy, budget) at the longest context.
- Against the unquantized cache: each (policy, budget)'s accuracy less the baseline's at each context, paired trial
  by trial (the same prompts at every depth), with its percentile bootstrap 95% interval and n.
`python -m harness.passkey --report-only --run NAME` rebuilds them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from harness.metrics import format_difference, paired_difference_ci

BASELINE = "baseline"  # the unquantized cache's policy name in passkey records (harness/protocols/passkey.py)

FAIL_RATIO = 0.5


def load_points(run_dir: str | Path) -> pd.DataFrame:
    """One row per finished point: model, context, depth, policy, budget, label, correct, trials, status, bytes."""
    rows = []
    for path in sorted((Path(run_dir) / "points").glob("*.json")):
        record = json.loads(path.read_text())
        c = record["config"]
        ok = record["status"] == "ok"
        rows.append(
            dict(
                model=c["model"],
                context=c["context"],
                depth=c["depth"],
                policy=c["policy"],
                budget=c["budget"],
                label=label(c["policy"], c["budget"]),
                status=record["status"],
                correct=sum(record["correct"]) if ok else 0,
                answers_correct=record["correct"] if ok else [],  # by trial
                trials=len(record["correct"]) if ok else 0,
                mean_bits=record.get("mean_bits"),
                compression_true=record.get("compression_true"),
            )
        )
    return pd.DataFrame(rows)


def label(policy: str, budget: float) -> str:
    return "baseline (fp)" if policy == BASELINE else f"{policy} @ {budget:g} bits"


def _order(labels) -> list[str]:
    """The baseline first, then by policy name and budget."""
    base = label(BASELINE, 16)
    rest = sorted(
        (name for name in set(labels) if name != base),
        key=lambda name: (name.split(" @ ")[0], float(name.split()[-2])),
    )
    return ([base] if base in set(labels) else []) + rest


def accuracy_table(frame: pd.DataFrame, model: str) -> pd.DataFrame:
    """label x context: accuracy over every depth's trials."""
    ok = frame[(frame.model == model) & (frame.status == "ok")]
    sums = ok.groupby(["label", "context"])[["correct", "trials"]].sum()
    table = (sums.correct / sums.trials).unstack("context")
    return table.reindex(_order(table.index))


def paired_table(frame: pd.DataFrame, model: str, n_boot: int = 1000, seed: int = 0) -> pd.DataFrame:
    """label x context: accuracy less the baseline's, paired by (depth, trial), with its bootstrap interval and n
    (module docstring), over the depths both have; a point run at fewer depths than the baseline names its depths
    ("; depths 0.1, 0.7 only"); '—' where they share no depth or a shared depth's trial counts differ."""
    ok = frame[(frame.model == model) & (frame.status == "ok")]
    base_label = label(BASELINE, 16)
    cells: dict[str, dict[int, str]] = {}
    for context, at in ok.groupby("context"):
        base = at[at.label == base_label].set_index("depth").answers_correct
        for name, rows in at[at.label != base_label].groupby("label"):
            mine = rows.set_index("depth").answers_correct
            depths = sorted(set(mine.index) & set(base.index))
            if not depths or any(len(mine[d]) != len(base[d]) for d in depths):
                cells.setdefault(name, {})[int(context)] = "—"
                continue
            a = np.concatenate([np.asarray(mine[d], dtype=float) for d in depths])  # (n,) by (depth, trial)
            b = np.concatenate([np.asarray(base[d], dtype=float) for d in depths])
            diff = float(a.mean() - b.mean())
            low, high = paired_difference_ci(
                lambda idx, a=a: float(a[idx].mean()),
                lambda idx, b=b: float(b[idx].mean()),
                len(a),
                n_boot,
                seed,
            )
            cell = format_difference(diff, low, high, low > 0 or high < 0, len(a))
            if len(depths) < len(base):
                cell += f"; depths {', '.join(f'{d:g}' for d in depths)} only"
            cells.setdefault(name, {})[int(context)] = cell
    table = pd.DataFrame(cells).T
    return table.reindex(_order(table.index)) if len(table) else table


def fail_contexts(accuracy: pd.DataFrame, ratio: float = FAIL_RATIO) -> dict[str, int | None]:
    """label -> first context where accuracy < ratio x baseline accuracy (None: never)."""
    base_label = label(BASELINE, 16)
    if base_label not in accuracy.index:
        return {}
    base = accuracy.loc[base_label]
    out = {}
    for name, row in accuracy.drop(index=base_label).iterrows():
        failing = [c for c in accuracy.columns if pd.notna(row[c]) and row[c] < ratio * base[c]]
        out[name] = min(failing) if failing else None
    return out


def depth_table(frame: pd.DataFrame, model: str, name: str) -> pd.DataFrame:
    """depth x context accuracy of one label."""
    rows = frame[(frame.model == model) & (frame.label == name) & (frame.status == "ok")]
    return (
        rows.set_index(["depth", "context"]).correct / rows.set_index(["depth", "context"]).trials
    ).unstack()


def _markdown(table: pd.DataFrame, index_name: str) -> str:
    table = table.copy()
    header = [index_name] + [str(c) for c in table.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for idx, row in table.iterrows():
        cells = ["" if pd.isna(v) else (f"{v:.2f}" if isinstance(v, float) else str(v)) for v in row]
        lines.append("| " + " | ".join([str(idx)] + cells) + " |")
    return "\n".join(lines)


def tables_markdown(run_dir: Path, frame: pd.DataFrame) -> str:
    commands = run_dir / "commands.txt"
    out = ["# Passkey retrieval", ""]
    if commands.exists():
        out += ["Commands:", "", "```", commands.read_text().strip(), "```", ""]
    out += [
        f"Accuracy: exact match of the 5-digit key, over all trials of all depths at each context. A policy "
        f"fails at the first context where its accuracy is below {FAIL_RATIO:g} x the baseline's.",
        "",
    ]
    for model in sorted(frame.model.unique()):
        accuracy = accuracy_table(frame, model)
        trials = frame[(frame.model == model) & (frame.status == "ok")].groupby("context").trials.max()
        trials = {int(c): int(n) for c, n in trials.items()}
        out += [
            f"## {model}",
            "",
            f"Trials per (context, depth): {trials}",
            "",
            "### Accuracy by context",
            "",
        ]
        out += [_markdown(accuracy, "policy"), ""]
        fails = fail_contexts(accuracy)
        fail = pd.DataFrame({"fails at context": {k: "-" if v is None else v for k, v in fails.items()}})
        out += ["### Failure context", "", _markdown(fail, "policy"), ""]
        paired = paired_table(frame, model)
        if len(paired):
            out += [
                "### Accuracy less the unquantized cache's, paired by trial (bold: the interval excludes 0)",
                "",
                _markdown(paired, "policy"),
                "",
            ]
        infeasible = frame[(frame.model == model) & (frame.status == "infeasible")].label.unique()
        if len(infeasible):
            out += [f"Infeasible (budget cannot pay for the sinks): {', '.join(sorted(infeasible))}", ""]
        out += [
            "### Baseline accuracy by depth",
            "",
            _markdown(depth_table(frame, model, label(BASELINE, 16)), "depth"),
            "",
        ]
        longest = max(accuracy.columns)
        by_label = {name: depth_table(frame, model, name)[longest] for name in accuracy.index}
        out += [
            f"### Accuracy by depth at context {longest}",
            "",
            _markdown(pd.DataFrame(by_label), "depth"),
            "",
        ]
    return "\n".join(out)


def plot(frame: pd.DataFrame):
    """Accuracy vs context, one panel per model, one line per (policy, budget); the baseline dashed."""
    from matplotlib.figure import Figure

    models = sorted(frame.model.unique())
    fig = Figure(figsize=(5.5 * len(models), 4), layout="constrained")
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models):
        accuracy = accuracy_table(frame, model)
        for name, row in accuracy.iterrows():
            base = name == label(BASELINE, 16)
            ax.plot(row.index, row.values, "k--" if base else "-o", label=name, lw=2 if base else 1.2, ms=4)
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            list(accuracy.columns), [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in accuracy.columns]
        )
        ax.set(title=model, xlabel="context (tokens)", ylabel="passkey accuracy", ylim=(-0.03, 1.03))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def write_report(run_dir: str | Path) -> list[Path]:
    run_dir = Path(run_dir)
    frame = load_points(run_dir)
    if frame.empty:
        return []
    tables = run_dir / "tables.md"
    tables.write_text(tables_markdown(run_dir, frame))
    png = run_dir / "passkey.png"
    plot(frame).savefig(png, dpi=120)
    return [tables, png]
