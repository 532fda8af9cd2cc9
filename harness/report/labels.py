"""Point labels of the reading side: a point's category (the claim's four rows and the other policies), its
configuration in words, its cache (colour on the Pareto plots) and family (marker), and the order points are
listed in. A label reads a table row (harness.results.table) or a record's config alike."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pandas as pd

from harness import peers
from harness.config import DEFAULT_PROBE, HARNESS
from harness.policies import from_point
from harness.schemes import KMEANS, default_residual

CLAIM_BUDGET = 4
CLAIM_ALPHA = 0.25
CATEGORIES = ("uniform", "entropy", "sinks", "entropy+sinks")


def _has_sink_rule(row: Mapping) -> bool:
    return pd.notna(row.get("sink_threshold")) or pd.notna(row.get("sink_fraction"))


def category(row: Mapping) -> str:
    """baseline, uniform, entropy, sinks, entropy+sinks (entropy with a sink rule), or the policy's name."""
    policy = row["policy"]
    if policy == "entropy" and _has_sink_rule(row):
        return "entropy+sinks"
    return policy


def policy_label(row: Mapping) -> str:
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


def storage_label(row: Mapping) -> str:
    """Cache options beyond the scheme's defaults: key groups apart, key outliers, Fisher-weighted key levels, fp16
    sink tokens, residual window, token eviction."""
    parts = []
    if _positive(row.get("key_group_size")) and row["key_group_size"] != row.get("group_size"):
        parts.append(f"kg{int(row['key_group_size'])}")
    if _positive(row.get("outliers")):
        parts.append(f"{row['outliers']:g} of each key in fp16")
    if isinstance(row.get("key_levels"), str) and row["key_levels"] != KMEANS:
        parts.append(f"{row['key_levels']} key levels")
    if _positive(row.get("sink_tokens")):
        parts.append(f"{int(row['sink_tokens'])} fp16 sink tokens")
    if _positive(row.get("residual")) and not default_residual(str(row.get("scheme"))):  # kivi's is its own
        parts.append(f"fp16 residual {int(row['residual'])}")
    return "".join(f" + {p}" for p in parts) + eviction_label(row)


def probe_label(row: Mapping) -> str:
    """' + unit KLs on 4 x 256 tokens' for a point whose unit-KL probe's sizes are not the default's, ' + unit KLs
    around 2 bits' for one measured in context (every other unit at 2 bits), both in one; '' otherwise."""
    parts = []
    sizes = [row.get("probe_sequences"), row.get("probe_tokens")]
    default = [DEFAULT_PROBE["probe_sequences"], DEFAULT_PROBE["probe_tokens"]]
    if not any(v is None or pd.isna(v) for v in sizes) and sizes != default:
        parts.append(f"on {int(sizes[0])} x {int(sizes[1])} tokens")
    context = row.get("probe_context")
    if context is not None and not pd.isna(context):
        parts.append(f"around {int(context)} bits")
    return " + unit KLs " + " ".join(parts) if parts else ""


def eviction_label(row: Mapping) -> str:
    """' + h2o keep 0.33' for a point that evicts tokens, '' otherwise."""
    eviction = row.get("eviction")
    if isinstance(eviction, str) and eviction != "none":
        return f" + {eviction} keep {row['evict_keep']:g}"
    return ""


def _positive(value) -> bool:
    return value is not None and not pd.isna(value) and value > 0


def configuration(row: Mapping) -> str:
    """A point's configuration without its budget and scheme, e.g. 'entropy a=0.25 + sinks H2<0.5 + h2o keep 0.33';
    a peer engine's point is named by harness.peers.label, e.g. 'llama.cpp q4_0 + rotation'."""
    if row.get("engine", HARNESS) != HARNESS:
        return peers.label(row)
    return policy_label(row) + probe_label(row) + storage_label(row)


def is_harness(frame: pd.DataFrame) -> pd.Series:
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


def ordered(frame: pd.DataFrame) -> pd.DataFrame:
    """frame sorted by category, then claim_rank, then key (a stable, meaningful order for tables and legends)."""
    if frame.empty:
        return frame
    ranks = [(_category_rank(r), claim_rank(r), r["key"]) for r in frame.to_dict("records")]
    order = sorted(range(len(frame)), key=lambda i: ranks[i])
    return frame.iloc[order]


def groups(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """(model, scheme) of every quantized point, sorted; the baseline (scheme 'none') belongs to its model."""
    quantized = frame[(frame["policy"] != "baseline") & is_harness(frame)]
    return sorted({(m, s) for m, s in zip(quantized["model"], quantized["scheme"])})


def cache_label(row: Mapping) -> str:
    """A point's colour on the Pareto plots: its scheme with its storage options ('asym_token + h2o keep 0.5'),
    or a peer's cache type ('q4_0')."""
    if row.get("engine", HARNESS) != HARNESS:
        return str(row["scheme"])
    return f"{row['scheme']}{storage_label(row)}"


def family(row: Mapping) -> str:
    """A point's marker on the Pareto plots: its policy family (category), or a peer's engine."""
    return category(row) if row.get("engine", HARNESS) == HARNESS else peers.engine_label(row)
