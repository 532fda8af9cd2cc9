"""Reading a run directory: its point records, their flat table, and its calibration tables.

This module owns reading only (harness.run writes; harness.report and notebooks read through here). The
point JSONs under <run_dir>/points are the source of truth: results.parquet is a derived copy. Every finished
JSON counts, whichever process (shard) wrote it; a file that does not parse (a write from a tool that is not
atomic, caught mid-way) is skipped, as are the runner's hidden temporary files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from harness.config import FIELDS, HARNESS
from harness.io import write_parquet_atomic
from harness.precision import DEFAULT as DEFAULT_DTYPE

CONFIG_FIELDS = FIELDS  # harness.config.Point's fields, in its order
METRICS = (
    "bleu",
    "bleu_tok",
    "token_match",
    "first_divergence",
    "ppl",
    "ppl_base",
    "ppl_ratio",
    "kl_mean",
    "kl_p99",
    "top1_agree",
    "mean_bits",
    "compression_nominal",
    "compression_true",
    "bytes_per_token",
    "resident_bytes",
    "resident_ratio",
    "simulate",
    "tokens_kept_fraction",
    "n_sinks",
)
# Where a row was measured (harness.io.provenance), beside its configuration but outside its key.
PROVENANCE = ("threads", "git_commit")
# Columns every table has, even an empty one, so callers can filter on them without checking.
COLUMNS = ("key", "status", "error", *CONFIG_FIELDS, *PROVENANCE, *METRICS)


def load_records(run_dir: str | Path) -> list[dict]:
    """Every finished point record under run_dir/points, in file-name (key) order; [] when there are none."""
    records = []
    for path in sorted((Path(run_dir) / "points").glob("*.json")):
        if path.name.startswith("."):
            continue
        try:
            records.append(json.loads(path.read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
    return records


def flatten(record: dict) -> dict:
    """One table row of a point record: key, status, error, its configuration, what it resolved to when it ran
    (`resolved`, e.g. bos_used, native_bf16) and its metrics.

    List-valued configuration (widths) is stored as its JSON text, as in the runner's results.parquet, so the
    column has one type. Records made before the model dtype was recorded ran in float32 and say so here. `engine` is HARNESS for the
    harness's own points (their configs have none).
    """
    config = {"engine": HARNESS, **record["config"]}
    config = {k: (json.dumps(v) if isinstance(v, list) else v) for k, v in config.items()}
    return {
        "key": record["key"],
        "status": record["status"],
        "error": record.get("error"),
        **config,
        "dtype": record["config"].get("dtype", DEFAULT_DTYPE),
        **record.get("resolved", {}),
        **{k: record.get(k) for k in PROVENANCE},
        **record.get("metrics", {}),
    }


def table(records: list[dict]) -> pd.DataFrame:
    """The flat table of records: the known columns first, then any others the records carry."""
    frame = pd.DataFrame([flatten(r) for r in records])
    extra = [c for c in frame.columns if c not in COLUMNS]
    frame = frame.reindex(columns=[*COLUMNS, *extra])
    for flag in ("simulate", "reads_previous_layer"):  # nullable: infeasible points have no value
        if flag in frame:  # reads_previous_layer: in runs made since the xlayer schemes exist
            frame[flag] = frame[flag].astype("boolean")
    return frame


def load(run_dir: str | Path) -> pd.DataFrame:
    """One row per finished point of run_dir (flattened configuration, metrics, status, error)."""
    return table(load_records(run_dir))


def write_parquet(run_dir: str | Path) -> Path:
    """Rebuild run_dir/results.parquet from points/ (the shard merge step); atomic, so readers never see half."""
    return write_parquet_atomic(Path(run_dir) / "results.parquet", load(run_dir), index=False)


def load_entropy(run_dir: str | Path, model: str) -> pd.DataFrame:
    """The calibration table of model: layer, layer_type, q_head, kv_head, H2, H1, n_positions (attrs kept)."""
    return pd.read_parquet(Path(run_dir) / f"entropy-{model}.parquet")
