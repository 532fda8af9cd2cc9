"""Paired differences between points of one run: every non-uniform point minus uniform at the same model,
scheme, storage and budget (or every point minus the plain cache), per metric, with the paired percentile
bootstrap 95% interval over the same prompts or sequences (harness.metrics.paired_difference_ci), the number of
paired items and the true-bytes ratio; and the wide table tables.md prints."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from harness.config import EVICTION_FIELDS, HARNESS, POLICY_FIELDS
from harness.metrics import (
    MIN_PAIRED_UNITS,
    batched,
    bleu_statistic,
    format_difference,
    mean_statistic,
    paired_difference_ci,
)
from harness.report.labels import configuration

# The metrics compared with uniform and plotted against bytes, and which way is better for each.
HIGHER_IS_BETTER = {"kl_mean": False, "ppl_ratio": False, "bleu": True, "token_match": True}
DIFF_METRICS = ("bleu", "token_match", "ppl_ratio", "kl_mean")
DEFAULT_N_BOOT = 1000
EQUAL_BYTES_TOLERANCE = 0.005  # a comparison at "equal memory" holds true bytes per token within 0.5%


def default_n_boot(run_dir: Path) -> int:
    """The run's eval.bootstrap from its config.yaml, else DEFAULT_N_BOOT."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return DEFAULT_N_BOOT
    return int(OmegaConf.select(OmegaConf.load(path), "eval.bootstrap", default=DEFAULT_N_BOOT))


def item_statistics(record: dict) -> dict[str, tuple[Callable[[np.ndarray], float], int]]:
    """Each compared metric as (statistic of item indices, number of items), from a point's items.

    bleu and token_match resample prompts; ppl_ratio and kl_mean resample teacher-forced sequences.
    """
    items = record["items"]
    stats = np.asarray(items["bleu_stats"], dtype=np.int64)  # (N, 10)
    match = np.asarray(items["token_match"], dtype=np.float64)  # (N,)
    return {
        "bleu": (bleu_statistic(stats), len(stats)),
        "token_match": (mean_statistic(match), len(match)),
        **teacher_forced_statistics(record),
    }


def teacher_forced_statistics(record: dict) -> dict[str, tuple[Callable[[np.ndarray], float], int]]:
    """ppl_ratio and kl_mean as (statistic of sequence indices, number of sequences), from a point's items (a peer
    engine's point too: it has no generation items)."""
    items = record["items"]
    nll, nll_base = (
        np.asarray(items["nll"], dtype=np.float64),
        np.asarray(items["nll_base"], dtype=np.float64),
    )  # (S,) each
    kl = np.asarray(items["kl_mean"], dtype=np.float64)  # (S,)

    def ppl_ratio(idx: np.ndarray):
        if idx.ndim > 1:  # a batch of resamples (B, S)
            return np.exp(nll[idx].mean(-1)) / np.exp(nll_base[idx].mean(-1))
        return math.exp(nll[idx].mean()) / math.exp(nll_base[idx].mean())

    return {"ppl_ratio": (batched(ppl_ratio), len(nll)), "kl_mean": (mean_statistic(kl), len(kl))}


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
        if is_reference(record["config"]):
            continue
        reference = references.get(key_of(record["config"]))
        mine = item_statistics(record)
        theirs = item_statistics(reference) if reference is not None else None
        for metric in DIFF_METRICS:
            row = _unpaired_row(record, metric)
            if theirs is not None:
                row.update(_paired(mine[metric], theirs[metric], n_boot, seed, level))
                row.update(uniform_key=reference["key"], bytes_ratio=_bytes_ratio(record, reference))
            rows.append(row)
    return pd.DataFrame(rows, columns=DIFFERENCE_COLUMNS)


DIFFERENCE_COLUMNS = [
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


def _unpaired_row(record: dict, metric: str) -> dict:
    """A differences row of `record` and `metric` before any pairing: no partner, no difference."""
    config = record["config"]
    return {
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


def _paired(mine: tuple, theirs: tuple, n_boot: int, seed: int, level: float) -> dict:
    """The difference of two points' (statistic, n items) on the same items, its n, and its interval where n
    reaches MIN_PAIRED_UNITS."""
    (stat_a, n_items), (stat_b, _) = mine, theirs
    every = np.arange(n_items)
    out = {"difference": stat_a(every) - stat_b(every), "n": n_items}
    if n_items >= MIN_PAIRED_UNITS:
        low, high = paired_difference_ci(stat_a, stat_b, n_items, n_boot=n_boot, seed=seed, level=level)
        out.update(low=low, high=high, excludes_zero=bool(low > 0 or high < 0))
    return out


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
        bytes=[format_bytes_ratio(r) for r in diffs["bytes_ratio"]],
    )
    index = ["model", "scheme", "budget", "configuration", "key"]
    wide = cells.pivot(index=index, columns="metric", values="cell")
    wide = wide.join(cells.groupby(index)["bytes"].first())
    wide = wide.reset_index().sort_values(["model", "scheme", "budget", "configuration", "key"])
    return wide[["model", "scheme", "budget", "configuration", "bytes", *DIFF_METRICS, "key"]]


def format_bytes_ratio(ratio: float) -> str:
    """The point's bytes over its reference's, flagged where equal memory does not hold (beyond 0.5%)."""
    if math.isnan(ratio):
        return "—"
    text = f"{ratio:.4f}"
    return text if abs(ratio - 1) <= EQUAL_BYTES_TOLERANCE else f"{text} (unequal bytes)"
