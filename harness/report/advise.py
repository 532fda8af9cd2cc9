"""The page of an advise run (harness/protocols/advise.py): RUN_DIR/advice.md, advice.png and, when a point meets the
target, RUN_DIR/allocation.json (harness.load_allocation's file).

advice.md says the target and the answer first (the chosen point with its held-out intervals, its true compression
at the target's context, and whether it meets the target only within its interval; or that no family meets it, with
the closest point), then every confirmed point (the candidates rejected, and why), then every proxy point of the
bisection, and the command that reproduces the run. advice.png: each family's points, compression against the
target's metric (proxy hollow, confirmed filled with intervals), the target as a line, the chosen point ringed.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.allocation_file import save_allocation
from harness.protocols.advise import Advice, Candidate, confirmed_meets
from harness.report.tables import markdown_table

QUALITY = ("ppl_ratio", "kl_mean")


def _interval(point: Candidate, metric: str) -> str:
    value, low, high = point.confirmed[metric]
    return f"{value:.4g} [{low:.4g}, {high:.4g}] n={point.confirmed['n']}"


def _why(advice: Advice, point: Candidate) -> str:
    if point is advice.chosen:
        return "chosen"
    meets, surely = confirmed_meets(advice.target, point)
    if not meets:
        return "misses the target"
    if advice.target.metric == "compression":
        return "meets the size at a higher ppl_ratio"
    return "meets it at less compression" + ("" if surely else " (only within its interval)")


def confirmed_table(advice: Advice) -> pd.DataFrame:
    rows = [
        {
            "family": p.family,
            "budget (bits)": f"{p.budget:g}",
            "true compression": f"{p.compression:.2f}x",
            "ppl_ratio": _interval(p, "ppl_ratio"),
            "kl_mean": _interval(p, "kl_mean"),
            "verdict": _why(advice, p),
        }
        for p in sorted(advice.confirmed, key=lambda p: (p.family, p.budget))
    ]
    return pd.DataFrame(rows)


def proxy_table(advice: Advice) -> pd.DataFrame:
    rows = [
        {
            "family": p.family,
            "budget (bits)": f"{p.budget:g}",
            "true compression": f"{p.compression:.2f}x",
            "proxy ppl_ratio": f"{p.proxy['ppl_ratio']:.4g}",
            "proxy kl_mean": f"{p.proxy['kl_mean']:.4g}",
        }
        for p in advice.proxies
    ]
    return pd.DataFrame(rows).drop_duplicates()


def answer_lines(advice: Advice) -> list[str]:
    t = advice.target
    sign = ">=" if t.metric == "compression" else "<="
    lines = [
        f"**Target:** {t.metric} {sign} {t.value:g} at one sequence of {t.context} tokens, backend {t.backend}."
    ]
    if advice.chosen is None:
        p = advice.closest
        lines.append(
            "**No family meets it.** The closest confirmed point: "
            + ("none" if p is None else f"{p.family} at {p.budget:g} bits, {p.compression:.2f}x, ppl_ratio "
               f"{_interval(p, 'ppl_ratio')}, kl_mean {_interval(p, 'kl_mean')}.")
        )  # fmt: skip
        return lines
    p = advice.chosen
    lines.append(
        f"**Answer:** {p.family}, the measured knapsack at {p.budget:g} bits: {p.compression:.2f}x true compression, "
        f"ppl_ratio {_interval(p, 'ppl_ratio')}, kl_mean {_interval(p, 'kl_mean')} (held-out windows)."
    )
    if advice.within_interval_only:
        lines.append("It meets the target at its point value but not across its whole interval.")
    lines.append("The allocation: `allocation.json` (`harness.load_allocation`).")
    return lines


def plot(advice: Advice):
    from matplotlib.figure import Figure

    metric = advice.target.metric if advice.target.metric in QUALITY else "ppl_ratio"
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    for i, family in enumerate(sorted({p.family for p in advice.proxies})):
        color = f"C{i}"
        mine = [p for p in advice.proxies if p.family == family]
        ax.scatter([p.compression for p in mine], [p.proxy[metric] for p in mine], facecolors="none",
                   edgecolors=color, label=f"{family} (proxy)")  # fmt: skip
        for p in (p for p in advice.confirmed if p.family == family):
            value, low, high = p.confirmed[metric]
            ax.errorbar(p.compression, value, yerr=[[value - low], [high - value]], fmt="o", color=color)
    if advice.target.metric in QUALITY:
        ax.axhline(advice.target.value, color="k", ls="--", lw=1, label="target")
    else:
        ax.axvline(advice.target.value, color="k", ls="--", lw=1, label="target")
    if advice.chosen is not None:
        ax.scatter([advice.chosen.compression], [advice.chosen.confirmed[metric][0]], s=200, facecolors="none",
                   edgecolors="k", label="chosen")  # fmt: skip
    ax.set(xlabel=f"true compression at {advice.target.context} tokens", ylabel=metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def write_advice(run_dir: str | Path, advice: Advice, command: str, model_name: str) -> list[Path]:
    """advice.md, advice.png and (when a point was chosen) allocation.json in run_dir."""
    run_dir = Path(run_dir)
    written = []
    if advice.allocation is not None:
        written.append(
            save_allocation(
                run_dir / "allocation.json", advice.allocation, advice.family.make_scheme(), model=model_name,
                command=command, **advice.summary(),
            )
        )  # fmt: skip
    parts = [
        f"# Advice for {model_name}",
        "",
        *answer_lines(advice),
        "",
        "## Confirmed points (held-out windows, bootstrap 95% intervals)",
        "",
        markdown_table(confirmed_table(advice)) if advice.confirmed else "none",
        "",
        "## The search's proxy points (calibration windows)",
        "",
        markdown_table(proxy_table(advice)),
        "",
        "Reproduce (resumes from the step files in this folder):",
        "",
        f"```bash\n{command}\n```",
        "",
    ]
    page = run_dir / "advice.md"
    page.write_text("\n".join(parts))
    png = run_dir / "advice.png"
    plot(advice).savefig(png, dpi=120)
    return [page, png, *written]
