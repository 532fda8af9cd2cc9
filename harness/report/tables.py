"""The sweep run's tables from its points (harness.results.table): the claim table (uniform, entropy, sinks and
entropy + sinks at budget 4 beside the baseline), the full grid, peer engines beside the nearest harness point
in true compression, the infeasible points; and markdown_table, which writes any of them (and the paired differences,
harness.report.paired) as GitHub markdown."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from harness import results
from harness.report.labels import CATEGORIES, CLAIM_BUDGET, category, configuration, is_harness, ordered

CLAIM_COLUMNS = (
    "bleu",
    "token_match",
    "ppl_ratio",
    "kl_mean",
    "mean_bits",
    "compression_nominal",
    "compression_true",
)
PEER_COLUMNS = (
    "bytes_per_token",
    "compression_true",
    "ppl",
    "ppl_base",
    "ppl_ratio",
    "kl_mean",
    "top1_agree",
)


def text_seeds(frame: pd.DataFrame) -> list:
    """The distinct text seeds of a run's points ([None] when its records carry none)."""
    seeds = sorted(set(frame["seed"].dropna()))
    return seeds or [None]


def claim_table(
    frame: pd.DataFrame, model: str, scheme: str, budget: int = CLAIM_BUDGET, seed: int | None = None
) -> pd.DataFrame:
    """uniform, entropy, sinks, entropy+sinks at budget (first of each, claim_rank order) and the baseline.

    Every row comes from one text seed (`seed`; None: the run's only seed), never a mix. A category with no
    ok point gets a row saying why (not in the run, or infeasible with its error).
    """
    rows = []
    if seed is None:
        if len(text_seeds(frame)) > 1:
            raise ValueError(f"claim_table: the run has seeds {text_seeds(frame)}; pick one (seed=)")
    else:
        frame = frame[frame["seed"] == seed]
    here = frame[(frame["model"] == model) & (frame["scheme"] == scheme) & (frame["budget"] == budget)]
    kinds = np.array([category(r) for r in here.to_dict("records")], dtype=object)
    for kind in CATEGORIES:
        candidates = ordered(here[kinds == kind])
        ok = candidates[candidates["status"] == "ok"]
        if len(ok):
            point = ok.iloc[0]
            rows.append(
                {
                    "row": kind,
                    "configuration": configuration(point),
                    **{c: point[c] for c in CLAIM_COLUMNS},
                    "key": point["key"],
                }
            )
        elif len(candidates):
            rows.append(
                {
                    "row": kind,
                    "configuration": f"infeasible: {candidates.iloc[0]['error']}",
                    "key": candidates.iloc[0]["key"],
                }
            )
        else:
            rows.append({"row": kind, "configuration": "not in this run"})
    base = frame[(frame["model"] == model) & (frame["policy"] == "baseline") & (frame["status"] == "ok")]
    if len(base):
        point = base.iloc[0]
        rows.append(
            {
                "row": "baseline",
                "configuration": "unquantized",
                **{c: point[c] for c in CLAIM_COLUMNS},
                "key": point["key"],
            }
        )
    return pd.DataFrame(rows, columns=["row", "configuration", *CLAIM_COLUMNS, "key"])


def grid_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Every ok point with every metric, sorted by model, scheme, budget, policy (then configuration)."""
    ok = frame[frame["status"] == "ok"].copy()
    ok.insert(0, "configuration", [configuration(r) for r in ok.to_dict("records")])
    ok = ok.sort_values(["model", "scheme", "budget", "policy", "configuration", "key"])
    return ok[["model", "scheme", "budget", "configuration", *results.METRICS, "key"]]


def peer_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Every ok peer point beside the harness point nearest to it in true compression (ratio closest to 1; of
    equally near points the lowest ppl_ratio), same model. Compression, not bytes per token: each engine's is its
    held bytes over the fp16 bytes of the same tokens, but a peer counts its teacher-forced windows and the harness
    its generation caches, which a model with sliding-window layers holds in different shares per token. A peer's
    ppl_ratio and KL are against its own unquantized cache (llama.cpp: its f16 cache), the harness's against the
    harness's baseline."""
    ok = frame[(frame["status"] == "ok") & np.isfinite(frame["compression_true"].astype(float))]
    ours = ok[is_harness(ok) & (ok["policy"] != "baseline")]
    rows = []
    for peer in ok[~is_harness(ok)].to_dict("records"):
        row = {"model": peer["model"], "peer": configuration(peer), **{c: peer[c] for c in PEER_COLUMNS}}
        mine = ours[ours["model"] == peer["model"]]
        if len(mine):
            distance = np.abs(np.log(mine["compression_true"].astype(float) / peer["compression_true"]))
            near = mine[np.isclose(distance, distance.min())]
            best = (
                near.loc[near["ppl_ratio"].astype(float).idxmin()]
                if near["ppl_ratio"].notna().any()
                else near.iloc[0]
            )
            row.update(
                {
                    "harness": f"{best['scheme']} b{best['budget']:g} {configuration(best)}",
                    **{
                        f"harness {c}": best[c]
                        for c in ("compression_true", "bytes_per_token", "ppl_ratio", "kl_mean", "top1_agree")
                    },
                }
            )
        rows.append({**row, "key": peer["key"]})
    columns = [
        "model",
        "peer",
        *PEER_COLUMNS,
        "harness",
        *(
            f"harness {c}"
            for c in ("compression_true", "bytes_per_token", "ppl_ratio", "kl_mean", "top1_agree")
        ),
        "key",
    ]
    table = pd.DataFrame(rows, columns=columns)
    return table.sort_values(["model", "bytes_per_token", "peer"]) if len(table) else table


def infeasible_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Every infeasible point with its error."""
    bad = frame[frame["status"] == "infeasible"].copy()
    bad.insert(0, "configuration", [configuration(r) for r in bad.to_dict("records")])
    bad = bad.sort_values(["model", "scheme", "budget", "policy", "configuration", "key"])
    return bad[["model", "scheme", "budget", "configuration", "error", "key"]]


def _cell(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float | np.floating):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub markdown table of frame (floats to 4 significant digits, missing values blank)."""
    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines)
