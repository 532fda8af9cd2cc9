"""The report of a run directory, regenerated from its points/ alone: `python -m harness.report RUN_DIR`.

This module owns what a run is turned into for reading:
- results.parquet re-written from points/ (the merge step after shards; harness.results does the reading);
- tables.md: the command and commit, per model and scheme the claim table (uniform, entropy, sinks and
  entropy + sinks at budget 4, beside the baseline), the full grid, the infeasible points, and every
  non-uniform point's difference to uniform at the same budget with its paired bootstrap 95% interval;
- pareto-<model>-<scheme>.png/.svg (and pareto-<model>-all when a run varies storage): quality against true
  bytes per token with the Pareto frontier, KL on a log axis, colour by cache (scheme and storage options),
  hollow marker by policy family, peer engines' points (harness.peers: llama.cpp, transformers' QuantizedCache)
  beside with a filled marker per engine, a legend of one entry per colour and per marker; tables.md lists each
  peer beside the harness point nearest to it in true bytes;
- entropy-<model>.png (H2 per layer and query head) and allocation-<model>.png (bits per layer and KV head).

Every table and figure is its own function returning a DataFrame or a matplotlib Figure (Agg canvas, no
pyplot state), so notebooks/analysis.ipynb shows the same objects inline.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter, ScalarFormatter
from omegaconf import OmegaConf

from harness import peers, results
from harness.config import EVICTION_FIELDS, HARNESS, POLICY_FIELDS
from harness.metrics import MIN_PAIRED_UNITS, corpus_bleu_from_stats, format_difference, paired_difference_ci
from harness.policies import ALLOWED_WIDTHS, from_point
from harness.schemes import default_residual

CLAIM_BUDGET = 4
CLAIM_ALPHA = 0.25
CATEGORIES = ("uniform", "entropy", "sinks", "entropy+sinks")
CLAIM_COLUMNS = (
    "bleu",
    "token_match",
    "ppl_ratio",
    "kl_mean",
    "mean_bits",
    "compression_nominal",
    "compression_true",
)
# The metrics compared with uniform and plotted against bytes, and which way is better for each.
HIGHER_IS_BETTER = {"kl_mean": False, "ppl_ratio": False, "bleu": True, "token_match": True}
DIFF_METRICS = ("bleu", "token_match", "ppl_ratio", "kl_mean")
DEFAULT_N_BOOT = 1000
EQUAL_BYTES_TOLERANCE = 0.005  # a comparison at "equal memory" holds true bytes per token within 0.5%
# Pareto plots: colour = the cache (scheme and storage options, or a peer's cache type), marker = the policy
# family (hollow) or the peer engine (filled), the same marker for a family on every plot; families not named
# here and peer engines take the next of EXTRA_MARKERS / PEER_MARKERS.
FAMILY_MARKERS = {
    "uniform": "o",
    "entropy": "^",
    "sinks": "v",
    "entropy+sinks": "D",
    "random": "X",
    "inverted": "<",
    "sensitivity": "s",
    "layerwise": "P",
}
EXTRA_MARKERS = (">", "H")
PEER_MARKERS = ("p", "*", "d", "h", "8")  # filled; shapes that differ most first
PEER_COLUMNS = (
    "bytes_per_token",
    "compression_true",
    "ppl",
    "ppl_base",
    "ppl_ratio",
    "kl_mean",
    "top1_agree",
)
SVG_SALT = "kvbits"  # fixed ids in SVG output, so a regenerated report is byte-identical


# --- point labels ---------------------------------------------------------------------------------------


def _has_sink_rule(row: Mapping) -> bool:
    return pd.notna(row.get("sink_threshold")) or pd.notna(row.get("sink_fraction"))


def category(row: Mapping) -> str:
    """baseline, uniform, entropy, sinks, entropy+sinks (entropy with a sink rule), or the policy's name."""
    policy = row["policy"]
    if policy == "entropy" and _has_sink_rule(row):
        return "entropy+sinks"
    return policy


def _policy_label(row: Mapping) -> str:
    """The row's policy as harness.policies labels it. A table's row holds widths as JSON text
    (harness.results.flatten), NaN where its records lack a value (the policy's default then), and integers as
    floats in a column that also holds NaN (policy_seed)."""
    if row["policy"] == "baseline":
        return "baseline"
    point = {k: v for k, v in row.items() if not (pd.api.types.is_scalar(v) and pd.isna(v))}
    if isinstance(point.get("widths"), str):
        point["widths"] = json.loads(point["widths"])
    if isinstance(point.get("policy_seed"), float) and point["policy_seed"].is_integer():
        point["policy_seed"] = int(point["policy_seed"])
    return from_point(point).label()


def _storage_label(row: Mapping) -> str:
    """Cache options beyond the scheme's defaults: fp16 sink tokens, residual window, token eviction."""
    parts = []
    if _positive(row.get("sink_tokens")):
        parts.append(f"{int(row['sink_tokens'])} fp16 sink tokens")
    if _positive(row.get("residual")) and not default_residual(str(row.get("scheme"))):  # kivi's is its own
        parts.append(f"fp16 residual {int(row['residual'])}")
    eviction = row.get("eviction")
    if isinstance(eviction, str) and eviction != "none":
        parts.append(f"{eviction} keep {row['evict_keep']:g}")
    return "".join(f" + {p}" for p in parts)


def _positive(value) -> bool:
    return value is not None and not pd.isna(value) and value > 0


def configuration(row: Mapping) -> str:
    """A point's configuration without its budget and scheme, e.g. 'entropy a=0.25 + sinks H2<0.5 + h2o keep 0.33';
    a peer engine's point is named by harness.peers.label, e.g. 'llama.cpp q4_0 + rotation'."""
    if row.get("engine", HARNESS) != HARNESS:
        return peers.label(row)
    return _policy_label(row) + _storage_label(row)


def _is_harness(frame: pd.DataFrame) -> pd.Series:
    """Rows of the harness's own points (a table without an engine column has no other)."""
    if "engine" not in frame:
        return pd.Series(True, index=frame.index)
    return frame["engine"].fillna(HARNESS) == HARNESS


def claim_rank(row: Mapping) -> tuple:
    """Order among points of one category: the claim's alpha first, then by alpha, threshold rules first."""
    alpha = row.get("alpha")
    alpha = 0.0 if pd.isna(alpha) else float(alpha)
    threshold, fraction = row.get("sink_threshold"), row.get("sink_fraction")
    return (
        alpha != CLAIM_ALPHA,
        alpha,
        pd.isna(threshold),
        0.0 if pd.isna(threshold) else threshold,
        0.0 if pd.isna(fraction) else fraction,
    )


def _category_rank(row: Mapping) -> int:
    kind = category(row)
    order = ("baseline", *CATEGORIES)
    return order.index(kind) if kind in order else len(order)


def _ordered(frame: pd.DataFrame) -> pd.DataFrame:
    """frame sorted by category, then claim_rank, then key (a stable, meaningful order for tables and legends)."""
    if frame.empty:
        return frame
    ranks = [(_category_rank(r), claim_rank(r), r["key"]) for r in frame.to_dict("records")]
    order = sorted(range(len(frame)), key=lambda i: ranks[i])
    return frame.iloc[order]


def groups(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """(model, scheme) of every quantized point, sorted; the baseline (scheme 'none') belongs to its model."""
    quantized = frame[(frame["policy"] != "baseline") & _is_harness(frame)]
    return sorted({(m, s) for m, s in zip(quantized["model"], quantized["scheme"])})


# --- tables ---------------------------------------------------------------------------------------------


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
        candidates = _ordered(here[kinds == kind])
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
    """Every ok peer point beside the harness point nearest to it in true bytes per token (ratio of bytes closest
    to 1; of equally near points the lowest ppl_ratio), same model. A peer's ppl_ratio and KL are against its own
    unquantized cache (llama.cpp: its f16 cache), the harness's against the harness's baseline."""
    ok = frame[(frame["status"] == "ok") & np.isfinite(frame["bytes_per_token"].astype(float))]
    ours = ok[_is_harness(ok) & (ok["policy"] != "baseline")]
    rows = []
    for peer in ok[~_is_harness(ok)].to_dict("records"):
        row = {"model": peer["model"], "peer": configuration(peer), **{c: peer[c] for c in PEER_COLUMNS}}
        mine = ours[ours["model"] == peer["model"]]
        if len(mine):
            distance = np.abs(np.log(mine["bytes_per_token"].astype(float) / peer["bytes_per_token"]))
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
                        for c in ("bytes_per_token", "ppl_ratio", "kl_mean", "top1_agree")
                    },
                }
            )
        rows.append({**row, "key": peer["key"]})
    columns = [
        "model",
        "peer",
        *PEER_COLUMNS,
        "harness",
        *(f"harness {c}" for c in ("bytes_per_token", "ppl_ratio", "kl_mean", "top1_agree")),
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


# --- differences to uniform -----------------------------------------------------------------------------


def item_statistics(record: dict) -> dict[str, tuple[Callable[[np.ndarray], float], int]]:
    """Each compared metric as (statistic of item indices, number of items), from a point's items.

    bleu and token_match resample prompts; ppl_ratio and kl_mean resample teacher-forced sequences.
    """
    items = record["items"]
    stats = np.asarray(items["bleu_stats"], dtype=np.int64)  # (N, 10)
    match = np.asarray(items["token_match"], dtype=np.float64)  # (N,)
    nll, nll_base = (
        np.asarray(items["nll"], dtype=np.float64),
        np.asarray(items["nll_base"], dtype=np.float64),
    )
    kl = np.asarray(items["kl_mean"], dtype=np.float64)  # (S,)
    return {
        "bleu": (lambda idx: corpus_bleu_from_stats(stats[idx]), len(stats)),
        "token_match": (lambda idx: float(match[idx].mean()), len(match)),
        "ppl_ratio": (lambda idx: math.exp(nll[idx].mean()) / math.exp(nll_base[idx].mean()), len(nll)),
        "kl_mean": (lambda idx: float(kl[idx].mean()), len(kl)),
    }


def pairing_key(config: Mapping) -> tuple:
    """Points with equal keys differ only in their allocation policy: same model, scheme, budget, data, sizes."""
    return (config["budget"],) + tuple((k, str(config[k])) for k in sorted(config) if k not in POLICY_FIELDS)


# The plain cache every storage variant is also compared with: uniform widths, per-token asymmetric groups,
# no fp16 sink or residual tokens, no eviction (fields absent from older records take these values).
PLAIN = {"policy": "uniform", "scheme": "asym_token", "sink_tokens": 0, "residual": 0, "eviction": "none"}
STORAGE_FIELDS = ("scheme", "sink_tokens", "residual", *EVICTION_FIELDS)


def is_plain(config: Mapping) -> bool:
    return all(config.get(k, v) == v for k, v in PLAIN.items())


def plain_pairing_key(config: Mapping) -> tuple:
    """Points with equal keys differ only in policy and storage (scheme, fp16 tokens, eviction)."""
    ignored = {*POLICY_FIELDS, *STORAGE_FIELDS}
    return (config["budget"],) + tuple((k, str(config[k])) for k in sorted(config) if k not in ignored)


def differences(
    records: list[dict],
    n_boot: int = DEFAULT_N_BOOT,
    seed: int = 0,
    level: float = 0.95,
    against: str = "uniform",
) -> pd.DataFrame:
    """Every ok point minus its reference at the same model and budget, per metric, with its interval.

    against="uniform": the reference is uniform at the same scheme and storage options (every non-uniform point
    is compared); against="plain": the reference is the plain cache (PLAIN) and every point whose policy or
    storage differs from it is compared, so schemes, fp16 tokens and eviction meet on the same prompts.
    One row per (point, metric): difference on all items, its n (paired prompts or sequences), and the paired
    percentile bootstrap interval (harness.metrics.paired_difference_ci: both points on the same resampled
    prompts or sequences, seeded). Below MIN_PAIRED_UNITS items there is no interval (NaN) and no verdict.
    excludes_zero marks intervals that lie entirely on one side of zero. A point with no partner gets NaN.
    bytes_ratio is the point's true bytes per token over its reference's: equal memory holds within 0.5%.
    """
    if against == "uniform":
        key_of, is_reference = pairing_key, lambda c: c["policy"] == "uniform"
    elif against == "plain":
        key_of, is_reference = plain_pairing_key, is_plain
    else:
        raise ValueError(f"against: unknown {against!r}; allowed: uniform, plain")
    ok = [
        r
        for r in records
        if r["status"] == "ok"
        and r["config"]["policy"] != "baseline"
        and r["config"].get("engine", HARNESS) == HARNESS
    ]
    references = {key_of(r["config"]): r for r in ok if is_reference(r["config"])}
    rows = []
    for record in ok:
        config = record["config"]
        if is_reference(config):
            continue
        reference = references.get(key_of(config))
        mine = item_statistics(record)
        theirs = item_statistics(reference) if reference is not None else None
        for metric in DIFF_METRICS:
            row = {
                "model": config["model"],
                "scheme": config["scheme"],
                "budget": config["budget"],
                "configuration": configuration(config),
                "metric": metric,
                "key": record["key"],
                "uniform_key": None,
                "difference": math.nan,
                "n": 0,
                "low": math.nan,
                "high": math.nan,
                "excludes_zero": False,
                "bytes_ratio": math.nan,
            }
            if theirs is not None:
                (stat_a, n_items), (stat_b, _) = mine[metric], theirs[metric]
                every = np.arange(n_items)
                row.update(
                    uniform_key=reference["key"],
                    difference=stat_a(every) - stat_b(every),
                    n=n_items,
                    bytes_ratio=_bytes_ratio(record, reference),
                )
                if n_items >= MIN_PAIRED_UNITS:
                    low, high = paired_difference_ci(
                        stat_a, stat_b, n_items, n_boot=n_boot, seed=seed, level=level
                    )
                    row.update(low=low, high=high, excludes_zero=bool(low > 0 or high < 0))
            rows.append(row)
    columns = [
        "model",
        "scheme",
        "budget",
        "configuration",
        "metric",
        "difference",
        "n",
        "low",
        "high",
        "excludes_zero",
        "bytes_ratio",
        "key",
        "uniform_key",
    ]
    return pd.DataFrame(rows, columns=columns)


def _bytes_ratio(record: dict, reference: dict) -> float:
    mine, theirs = record["metrics"].get("bytes_per_token"), reference["metrics"].get("bytes_per_token")
    return mine / theirs if mine and theirs else math.nan


def difference_table(diffs: pd.DataFrame) -> pd.DataFrame:
    """One row per compared point, one formatted column per metric (wide form of differences())."""
    if diffs.empty:
        return pd.DataFrame(
            columns=["model", "scheme", "budget", "configuration", "bytes", *DIFF_METRICS, "key"]
        )
    cells = diffs.assign(
        cell=[
            format_difference(d, lo, hi, ex, n)
            for d, lo, hi, ex, n in zip(
                diffs["difference"], diffs["low"], diffs["high"], diffs["excludes_zero"], diffs["n"]
            )
        ],
        bytes=[_format_bytes_ratio(r) for r in diffs["bytes_ratio"]],
    )
    index = ["model", "scheme", "budget", "configuration", "key"]
    wide = cells.pivot(index=index, columns="metric", values="cell")
    wide = wide.join(cells.groupby(index)["bytes"].first())
    wide = wide.reset_index().sort_values(["model", "scheme", "budget", "configuration", "key"])
    return wide[["model", "scheme", "budget", "configuration", "bytes", *DIFF_METRICS, "key"]]


def _format_bytes_ratio(ratio: float) -> str:
    """The point's bytes over its reference's, flagged where equal memory does not hold (beyond 0.5%)."""
    if math.isnan(ratio):
        return "—"
    text = f"{ratio:.4f}"
    return text if abs(ratio - 1) <= EQUAL_BYTES_TOLERANCE else f"{text} (unequal bytes)"


# --- markdown -------------------------------------------------------------------------------------------


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
            "\n## Peer engines beside the nearest harness point in true bytes per token\n\n"
            "A peer's ppl_ratio, kl_mean and top1_agree are against its own unquantized cache (ppl_base; llama.cpp: "
            "its f16 cache), the harness's against the harness's baseline, on the same token windows.\n",
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


# --- figures --------------------------------------------------------------------------------------------


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, independent of whatever pyplot backend the caller has
    return fig


def frontier(
    points: pd.DataFrame | Iterable[Mapping],
    metric: str,
    x: str = "bytes_per_token",
    higher_is_better: bool | None = None,
) -> pd.DataFrame:
    """The Pareto frontier: points no other point beats on metric at the same or fewer bytes, sorted by x.

    Direction defaults from HIGHER_IS_BETTER (bleu, token_match up; kl_mean, ppl_ratio down). Ties: of points
    with equal x and quality only the first is kept, so the step line has one corner per improvement.
    """
    frame = pd.DataFrame(points)
    higher = HIGHER_IS_BETTER[metric] if higher_is_better is None else higher_is_better
    frame = frame[np.isfinite(frame[x].astype(float)) & np.isfinite(frame[metric].astype(float))]
    quality = frame[metric].astype(float) * (1 if higher else -1)  # larger is better from here on
    order = np.lexsort((-quality.to_numpy(), frame[x].astype(float).to_numpy()))
    keep, best = [], -math.inf
    for i in order:
        if quality.iloc[i] > best:
            keep.append(i)
            best = quality.iloc[i]
    return frame.iloc[keep]


def cache_label(row: Mapping) -> str:
    """A point's colour on the Pareto plots: its scheme with its storage options ('asym_token + h2o keep 0.5'),
    or a peer's cache type ('q4_0')."""
    if row.get("engine", HARNESS) != HARNESS:
        return str(row["scheme"])
    return f"{row['scheme']}{_storage_label(row)}"


def family(row: Mapping) -> str:
    """A point's marker on the Pareto plots: its policy family (category), or a peer's engine."""
    return category(row) if row.get("engine", HARNESS) == HARNESS else peers.engine_label(row)


def _markers(names: list[str], fixed: Mapping[str, str], extra: tuple[str, ...]) -> dict[str, str]:
    """Each name's marker: its fixed one, else the next of extra (cycled) in the order given."""
    others = [n for n in names if n not in fixed]
    return {n: fixed.get(n) or extra[others.index(n) % len(extra)] for n in names}


def plot_pareto(frame: pd.DataFrame, model: str, scheme: str | None = None) -> Figure:
    """Four panels (kl_mean on a log axis, ppl_ratio, bleu, token_match) against true bytes per token, the
    harness's frontier as steps.

    Colour: the cache (cache_label); marker: the policy family, hollow, or the peer engine, filled (family).
    The legend has one entry per colour and one per marker (tables.md names every point). scheme=None: every
    scheme of the model on one plot. Peer engines' points of the model are drawn on every plot.
    """
    here = frame[(frame["model"] == model) & (frame["status"] == "ok") & (frame["policy"] != "baseline")]
    here = here[np.isfinite(here["bytes_per_token"].astype(float))]
    points, peer_points = here[_is_harness(here)], here[~_is_harness(here)]
    if scheme is not None:
        points = points[points["scheme"] == scheme]
    mine, theirs = points.to_dict("records"), peer_points.to_dict("records")
    caches = sorted({cache_label(r) for r in mine}) + sorted(
        {cache_label(r) for r in theirs} - {*map(cache_label, mine)}
    )
    palette = matplotlib.colormaps["tab10" if len(caches) <= 10 else "tab20"]
    colour = {c: palette(i % palette.N) for i, c in enumerate(caches)}
    kinds = {family(r) for r in mine}
    families = [f for f in FAMILY_MARKERS if f in kinds] + sorted(kinds - FAMILY_MARKERS.keys())
    marker = _markers(families, FAMILY_MARKERS, EXTRA_MARKERS)
    engines = sorted({family(r) for r in theirs})
    marker.update(_markers(engines, {}, PEER_MARKERS))
    # one collection per configuration, named after it (scheme-prefixed on the all-schemes plot)
    name_of = configuration if scheme is not None else (lambda r: f"{r['scheme']}: {configuration(r)}")
    drawn = {}
    for row in _ordered(points).to_dict("records"):
        drawn.setdefault((name_of(row), False), []).append(row)
    for row in theirs:
        drawn.setdefault((configuration(row), True), []).append(row)
    base = frame[(frame["model"] == model) & (frame["policy"] == "baseline") & (frame["status"] == "ok")]
    fig = _figure(10, 7.8)
    axes = fig.subplots(2, 2).ravel()
    for ax, metric in zip(axes, HIGHER_IS_BETTER):
        log_y = metric == "kl_mean"  # KL spans decades between 2 and 8 bits
        if log_y:
            ax.set_yscale("log", nonpositive="mask")
        for (name, is_peer), rows in drawn.items():
            first = rows[0]
            ax.scatter(
                [r["bytes_per_token"] for r in rows],
                [r[metric] for r in rows],
                marker=marker[family(first)],
                facecolors=colour[cache_label(first)] if is_peer else "none",
                edgecolors="black" if is_peer else colour[cache_label(first)],
                linewidths=0.5 if is_peer else 1.0,
                label=name,
                zorder=4 if is_peer else 3,
            )
        edge = frontier(points, metric)
        if len(edge):
            # extend the last step to the largest x so the frontier spans every point
            xs = [*edge["bytes_per_token"], points["bytes_per_token"].max()]
            ys = [*edge[metric], edge[metric].iloc[-1]]
            ax.step(xs, ys, where="post", color="black", linewidth=1, label="Pareto frontier", zorder=2)
        unquantized = base.iloc[0][metric] if len(base) else math.nan
        if pd.notna(unquantized) and not (log_y and unquantized <= 0):  # KL 0 has no place on a log axis
            ax.axhline(unquantized, color="grey", linestyle=":", linewidth=1, label="unquantized")
        ax.set_xscale("log")
        # budgets span about a decade at most: linear-spaced ticks in plain numbers read better than powers
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("bytes per token (true, KV cache)")
        ax.set_ylabel(f"{metric} ({'higher' if HIGHER_IS_BETTER[metric] else 'lower'} is better)")
        ax.grid(True, which="both", alpha=0.3)
    # two legends side by side: the colours, then the markers and lines
    swatches = [Patch(facecolor=colour[c], label=c) for c in caches]
    shapes = [
        Line2D([], [], linestyle="none", marker=marker[f], markerfacecolor="none", color="black", label=f)
        for f in families
    ]
    shapes += [
        Line2D([], [], linestyle="none", marker=marker[e], markerfacecolor="grey", color="black", label=e)
        for e in engines
    ]
    lines = {}
    for ax in axes:  # the frontier and the unquantized line, once each
        for handle, name in zip(*ax.get_legend_handles_labels()):
            if isinstance(handle, Line2D) and name in ("Pareto frontier", "unquantized"):
                lines.setdefault(name, handle)
    shapes += lines.values()
    for where, handles, title in (
        ("outside lower left", swatches, "cache (colour)"),
        ("outside lower right", shapes, "policy or engine (marker)"),
    ):
        fig.legend(
            handles=handles,
            loc=where,
            ncols=-(-len(handles) // 5),  # at most five rows
            fontsize="small",
            title=title,
            title_fontsize="small",
        )
    fig.suptitle(f"{model} / {scheme or 'all schemes'}: quality against KV-cache bytes")
    return fig


def _integer_axes(ax, xlabel: str, ylabel: str) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def plot_entropy(entropy: pd.DataFrame, model: str) -> Figure:
    """Heat map of H2 per layer (rows) and query head (columns); layers without KV cache (no rows) blank."""
    num_layers = int(entropy.attrs.get("num_layers", entropy["layer"].max() + 1))
    grid = entropy.pivot_table(index="layer", columns="q_head", values="H2").reindex(range(num_layers))
    fig = _figure(max(4.0, 0.25 * grid.shape[1] + 2), max(3.0, 0.25 * num_layers + 1.5))
    ax = fig.subplots()
    image = ax.imshow(
        np.ma.masked_invalid(grid.to_numpy(dtype=float)),
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
    )
    fig.colorbar(image, ax=ax, label="H2 (nats)", format=ScalarFormatter(useOffset=False))
    _integer_axes(ax, "query head", "layer")
    ax.set_title(f"{model}: Rényi-2 attention entropy")
    return fig


def allocation_point(records: list[dict], model: str) -> dict | None:
    """The point whose allocation is drawn: the first entropy+sinks point at budget 4, else the first entropy
    point (budget 4 first, with or without a sink rule), else the first point with an allocation."""
    frame = results.table(records)
    mask = (frame["model"] == model) & (frame["status"] == "ok") & (frame["policy"] != "baseline")
    mask &= _is_harness(frame)
    if not mask.any():
        return None

    def preference(row: dict) -> tuple[int, bool]:
        at_claim = row["budget"] == CLAIM_BUDGET
        if category(row) == "entropy+sinks" and at_claim:
            return 0, False
        return (1 if row["policy"] == "entropy" else 2), not at_claim

    best = min(_ordered(frame[mask]).to_dict("records"), key=preference)  # min keeps the first of equals
    return next(r for r in records if r["key"] == best["key"])


def plot_allocation(record: dict) -> Figure:
    """Bits per layer (rows) and KV head (columns) of one point, discrete colours; uncached layers blank."""
    bits = np.asarray(record["allocation"]["bits"], dtype=np.int64)  # (L, Hkv); 0 = no KV cache
    levels = sorted(set(ALLOWED_WIDTHS) | set(bits[bits > 0].tolist()))
    codes = np.ma.masked_where(bits == 0, np.searchsorted(levels, bits))
    cmap = ListedColormap(matplotlib.colormaps["viridis"](np.linspace(0, 1, len(levels))))
    norm = BoundaryNorm(np.arange(len(levels) + 1) - 0.5, len(levels))
    fig = _figure(max(4.0, 0.4 * bits.shape[1] + 2.5), max(3.0, 0.25 * bits.shape[0] + 1.5))
    ax = fig.subplots()
    image = ax.imshow(codes, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    bar = fig.colorbar(image, ax=ax, ticks=range(len(levels)), label="bits")
    bar.ax.set_yticklabels([str(w) for w in levels])
    if bits.size <= 400:  # small grids: the width in each cell too
        for (layer, head), width in np.ndenumerate(bits):
            if width:
                ax.text(head, layer, str(width), ha="center", va="center", fontsize="x-small", color="white")
    _integer_axes(ax, "KV head", "layer")
    config = record["config"]
    ax.set_title(
        f"{config['model']}: {configuration(config)}, budget {config['budget']}, {config['scheme']}",
        fontsize="medium",
    )
    return fig


def save(fig: Figure, path: Path, formats: Iterable[str] = ("png",)) -> list[Path]:
    """fig as path.<format> for each format, with no timestamps or random ids (reproducible bytes)."""
    written = []
    with matplotlib.rc_context({"svg.hashsalt": SVG_SALT}):
        for fmt in formats:
            out = path.with_suffix(f".{fmt}")
            metadata = {"Date": None} if fmt in ("svg", "pdf") else None
            fig.savefig(out, format=fmt, dpi=120, metadata=metadata)
            written.append(out)
    return written


# --- the report -----------------------------------------------------------------------------------------


def default_n_boot(run_dir: Path) -> int:
    """The run's eval.bootstrap from its config.yaml, else DEFAULT_N_BOOT."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return DEFAULT_N_BOOT
    return int(OmegaConf.select(OmegaConf.load(path), "eval.bootstrap", default=DEFAULT_N_BOOT))


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


if __name__ == "__main__":
    main()
