"""The quality frontier of a run: how few true bytes per token each quality costs, and whether an allocation beats
the best uniform storage at equal bytes. `python -m harness.report.frontier RUN_DIR` writes RUN_DIR/frontier.md.

This module owns three tables, read from a run's point records alone (every storage scheme, group size and policy
of the run compete; peer engines are left to tables.md):
- the frontier: for each true compression target, the ok point of lowest ppl_ratio among those compressing at
  least that much, with its ppl_ratio and kl_mean and their 95% bootstrap intervals over sequences (n printed;
  none below harness.metrics.MIN_PAIRED_UNITS), and its true compression for one sequence of ONE_SEQUENCE tokens
  (a model-level fitted table is spread over the evaluation's batch of generation caches, 32 x 320 tokens by
  default; counted for one sequence instead, the frontier does not depend on the evaluation's batch);
- the goals (DESIGN.md §8: ppl_ratio <= 1.005 at >= 3.5x, <= 1.02 at >= 4.5x, <= 1.08 at >= 6x, <= 1.25 at
  >= 8x): met or missed, and by how much;
- head to head: every non-uniform point against the best uniform point (any scheme, lowest kl_mean) that holds
  no more true bytes per token than it does (within EQUAL_BYTES_TOLERANCE), paired on the same sequences:
  the difference in ppl_ratio and kl_mean with its paired bootstrap interval and n;
- peer engines (harness/peers, e.g. llama.cpp's KV cache types) on the same windows: each beside the harness
  point of lowest ppl_ratio that holds no more true bytes, paired (a peer's ppl_ratio and kl_mean are against its
  own unquantized cache, the harness's against the harness's baseline);
- the ablation (`INGREDIENTS`): what each ingredient adds near 3.5x (or at the compression it names: the new
  units at 4.5x and 6x; the pca family's steps toward a fused kernel's format at 4, 3 and 2 bits:
  `FUSED_STEPS`), as the paired difference between two named
  configurations that differ by it (the point with it minus the point without), with their bytes ratio;
- judged on other text: where a run holds points evaluated on more than one text (eval.data.path), the tables
  above read the default text's points (or, without any, the first text's), and each other text gets the best
  point at each compression there, with what calibration text it was fitted on, against uniform asym_token g32
  and the emulation of llama.cpp's q4_0 (rotate+sym_token g32) at 4 bits on the same windows (`REFERENCES`).
"""

from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path

import numpy as np
import pandas as pd

from harness import results
from harness.capacity import cache_bytes, shape_from_registry
from harness.config import CALIBRATION_FIELDS, DEFAULT_PROBE, HARNESS, KEYED_UNLESS, base_point, compose
from harness.metrics import MIN_PAIRED_UNITS, bootstrap_ci, format_difference, paired_difference_ci
from harness.models import model_names
from harness.report.labels import configuration, eviction_label, policy_label, probe_label
from harness.report.paired import (
    EQUAL_BYTES_TOLERANCE,
    default_n_boot,
    format_bytes_ratio,
    teacher_forced_statistics,
)
from harness.report.sweep import provenance
from harness.report.tables import markdown_table
from harness.schemes import KMEANS, SCHEMES, from_point

TARGETS = (2.0, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0)  # true compression (fp16 bytes / stored bytes)
GOALS = (
    (3.5, 1.005),
    (4.5, 1.02),
    (6.0, 1.08),
    (8.0, 1.25),
)  # (at least this compression, at most this ppl_ratio)
METRICS = ("ppl_ratio", "kl_mean")
ONE_SEQUENCE = (
    4096  # tokens of the one sequence a fitted table is also counted over (one_sequence_compression)
)
CALKEY_4 = {"scheme": "calkey", "group_size": 32, "sink_tokens": 1, "policy": "uniform", "budget": 4}
NUQKEY_4 = {**CALKEY_4, "scheme": "nuqkey"}
NUQKEY_CODEBOOK_4 = {**CALKEY_4, "scheme": "nuqkey_codebook"}
# pca's formats for a fused GPU kernel (issue 45): each step from pca toward what a kernel decodes, uniform at 2, 3
# and 4 bits: (what the step changes, the scheme without it, the scheme with it).
FUSED_STEPS = (
    ("keys after RoPE instead of before", "pca", "pca_post"),
    ("keys relative to their block of 128 tokens instead of before RoPE", "pca", "pca_block"),
    ("evenly spaced levels instead of Lloyd-Max", "pca_block", "pca_block_u"),
    ("one width a group of 16 components (0, 1, 2, 4, 8 bits)", "pca_block_u", "pca_block_ug"),
    ("one plan a width for every head of the model", "pca_block_ug", "pca_block_ugs"),
    (
        "any width 0 to 8 a group of 16 instead of 0, 1, 2, 4, 8 (shared plans)",
        "pca_block_ugs",
        "pca_block_ugsa",
    ),
    ("the block-frame kernel format (pca_block_ugs) against pca", "pca", "pca_block_ugs"),
    ("the after-RoPE kernel format (pca_post_ug) against pca", "pca", "pca_post_ug"),
    ("every component at the unit's width (no plan), after RoPE", "pca_post_ug", "pca_post_uf"),
    ("every component at the unit's width (no plan), block frame", "pca_block_ug", "pca_block_uf"),
    ("today's kernel's format with pca's transform (pca_post_uf) against pca", "pca", "pca_post_uf"),
    ("blocks of 32 tokens instead of 128 (flat, evenly spaced)", "pca_block_uf", "pca_block32_uf"),
)
# ... and steps between their measured knapsacks at three budgets (about 3.5x, 4.6x, 6.3x).
KNAPSACK_STEPS = (
    ("any width 0 to 8 a group of 16 (pca_block_ugsa) against 0, 1, 2, 4, 8 (pca_block_ugs)", "pca_block_ugs",
     "pca_block_ugsa"),
    ("keys in blocks of 32 tokens instead of 128, Lloyd-Max levels, a plan per head", "pca_block", "pca_block32"),
    ("keys in blocks of 32 tokens instead of 128, the grouped format the fused path reads", "pca_block_ugsa",
     "pca_block32_ugsa"),
    ("at blocks of 32, the fused path's grouped format (even levels, one plan per width for every head) instead of"
     " Lloyd-Max levels and a plan per head", "pca_block32", "pca_block32_ugsa"),
    ("keys turned by their own position instead of their block of 32 tokens", "pca_block32", "pca"),
    ("the grouped format with keys turned by their own position instead of their block of 32 tokens",
     "pca_block32_ugsa", "pca_ugsa"),
    ("keys turned by their own position: Lloyd-Max levels and a plan per head instead of the grouped format",
     "pca_ugsa", "pca"),
    ("keys turned by their own position, grouped shared plans: Lloyd-Max levels instead of evenly spaced ones",
     "pca_ugsa", "pca_gsa"),
    ("keys turned by their own position, Lloyd-Max levels: a plan per head instead of grouped shared plans",
     "pca_gsa", "pca"),
    ("the 8 fastest-turning rotary pairs of each key turned by its own position, a basis block of their own, the rest"
     " in blocks of 32 tokens", "pca_block32_ugsa", "pca_own32_ugsa"),
    ("every pair turned by its own position and one basis, instead of 8 pairs and a basis block of their own",
     "pca_own32_ugsa", "pca_ugsa"),
)  # fmt: skip
FUSED_INGREDIENTS = tuple(
    (
        f"{budget}-bit pca family: {step}",
        {"scheme": without, "sink_tokens": 1, "policy": "uniform", "budget": budget},
        {"scheme": with_, "sink_tokens": 1, "policy": "uniform", "budget": budget},
    )
    for budget in (4, 3, 2)
    for step, without, with_ in FUSED_STEPS
) + tuple(
    (
        f"{budget}-bit knapsack: {step}",
        {"scheme": without, "sink_tokens": 1, "policy": "measured", "budget": budget},
        {"scheme": with_, "sink_tokens": 1, "policy": "measured", "budget": budget},
    )
    for step, without, with_ in KNAPSACK_STEPS
    for budget in (4.4, 3.3, 2.4)
)
# The ablation near 3.5x: (ingredient, the configuration without it, the one with it). A configuration is the
# config fields a point must match; where several points match, the one of fewest bytes (then key) is taken.
INGREDIENTS = (
    (
        "Hadamard rotation (llama.cpp's q4_0 default)",
        {"scheme": "sym_token", "group_size": 32, "policy": "uniform", "budget": 4},
        {"scheme": "rotate+sym_token", "group_size": 32, "policy": "uniform", "budget": 4},
    ),
    (
        "a zero per group, at equal bytes (g64 asym against g32 sym)",
        {"scheme": "sym_token", "group_size": 32, "policy": "uniform", "budget": 4},
        {"scheme": "asym_token", "group_size": 64, "policy": "uniform", "budget": 4},
    ),
    (
        "keys per channel over 64 tokens (KIVI), no fp16 window",
        {"scheme": "asym_token", "group_size": 64, "policy": "uniform", "budget": 4},
        {"scheme": "kivi", "group_size": 64, "key_group_size": None, "policy": "uniform", "budget": 4},
    ),
    (
        "keys against calibrated per-channel tables, BOS in fp16 (values as before)",
        {"scheme": "asym_token", "group_size": 32, "policy": "uniform", "budget": 4},
        {**CALKEY_4, "outliers": 0.0},
    ),
    (
        "1% of each key kept in fp16 (dense-and-sparse outliers)",
        {**CALKEY_4, "outliers": 0.0},
        {**CALKEY_4, "outliers": 0.01},
    ),
    (
        "keys turned back before RoPE, k-means levels per channel (nuqkey against calkey, 4 bits)",
        {**CALKEY_4, "outliers": 0.0},
        {**NUQKEY_4, "outliers": 0.0},
    ),
    (
        "the same at 3 bits, 1% of each key in fp16 in both",
        {**CALKEY_4, "budget": 3, "outliers": 0.01},
        {**NUQKEY_4, "budget": 3, "outliers": 0.01},
    ),
    (
        "nuqkey: 1% of each key kept in fp16",
        {**NUQKEY_4, "outliers": 0.0},
        {**NUQKEY_4, "outliers": 0.01},
    ),
    (
        "nuqkey's values as codebook (b + 0.25 bits) instead of asym_token g32 (b + 1), 1% of each key in fp16",
        {**NUQKEY_4, "outliers": 0.01},
        {**NUQKEY_CODEBOOK_4, "outliers": 0.01},
    ),
    (
        "nuqkey_codebook's key levels weighted by |gradient| (fisher_sqrt), 4-bit, 1% of each key in fp16",
        {**NUQKEY_CODEBOOK_4, "outliers": 0.01},
        {**NUQKEY_CODEBOOK_4, "outliers": 0.01, "key_levels": "fisher_sqrt"},
    ),
    (
        "the same weighted by gradient squared (fisher, KVQuant's Fisher information)",
        {**NUQKEY_CODEBOOK_4, "outliers": 0.01},
        {**NUQKEY_CODEBOOK_4, "outliers": 0.01, "key_levels": "fisher"},
    ),
    (
        "fisher_sqrt key levels at 3 bits",
        {**NUQKEY_CODEBOOK_4, "budget": 3, "outliers": 0.01},
        {**NUQKEY_CODEBOOK_4, "budget": 3, "outliers": 0.01, "key_levels": "fisher_sqrt"},
    ),
    (
        "nuqkey_codebook's key levels fitted on 4x the calibration text (32 x 512 tokens), 4-bit, 2% of each key in fp16",
        {**NUQKEY_CODEBOOK_4, "outliers": 0.02},
        {**NUQKEY_CODEBOOK_4, "outliers": 0.02, "calibration_sequences": 32},
    ),
    (
        "the same at 3 bits, 1% of each key in fp16",
        {**NUQKEY_CODEBOOK_4, "budget": 3, "outliers": 0.01},
        {**NUQKEY_CODEBOOK_4, "budget": 3, "outliers": 0.01, "calibration_sequences": 32},
    ),
    (
        "the same with fisher_sqrt key levels",
        {**NUQKEY_CODEBOOK_4, "budget": 3, "outliers": 0.01, "key_levels": "fisher_sqrt"},
        {
            **NUQKEY_CODEBOOK_4,
            "budget": 3,
            "outliers": 0.01,
            "key_levels": "fisher_sqrt",
            "calibration_sequences": 32,
        },
    ),
    (
        "Lloyd-Max levels and one fp16 scale per vector, after rotation",
        {"scheme": "rotate+sym_token", "group_size": 32, "policy": "uniform", "budget": 4},
        {"scheme": "codebook", "policy": "uniform", "budget": 4},
    ),
    (
        "keys wider than values: K4V3 against uniform 4-bit codebook",
        {"scheme": "codebook", "policy": "uniform", "budget": 4},
        {"scheme": "codebook", "policy": "kv", "budget": 3.5, "key_offset": 1},
    ),
    (
        "the measured knapsack against K4V3, same budget",
        {"scheme": "codebook", "policy": "kv", "budget": 3.5, "key_offset": 1},
        {"scheme": "codebook", "policy": "measured", "budget": 3.5},
    ),
    (
        "calkey: wider keys than values (K4V3 against K3V4), same budget",
        {"scheme": "calkey", "sink_tokens": 1, "policy": "kv", "budget": 3.5, "key_offset": -1},
        {"scheme": "calkey", "sink_tokens": 1, "policy": "kv", "budget": 3.5, "key_offset": 1},
    ),
    (
        "calkey: the measured knapsack against K4V3, same budget",
        {"scheme": "calkey", "sink_tokens": 1, "policy": "kv", "budget": 3.5, "key_offset": 1},
        {"scheme": "calkey", "sink_tokens": 1, "policy": "measured", "budget": 3.5},
    ),
    (
        "3.5x: a PCA basis per (layer, KV head), bits per component (pca's knapsack at 4.4 bits) against "
        "nuqkey_codebook 4-bit with 2% of each key in fp16",
        {**NUQKEY_CODEBOOK_4, "group_size": 32, "outliers": 0.02},
        {"scheme": "pca", "sink_tokens": 1, "policy": "measured", "budget": 4.4},
    ),
    (
        "4.5x: the same, pca's knapsack at 3.3 bits against nuqkey_codebook's at 3.18 (1% of each key in fp16)",
        {
            "scheme": "nuqkey_codebook",
            "sink_tokens": 1,
            "outliers": 0.01,
            "policy": "measured",
            "budget": 3.18,
        },
        {"scheme": "pca", "sink_tokens": 1, "policy": "measured", "budget": 3.3},
    ),
    (
        "6x: the same, pca's knapsack at 2.4 bits against nuqkey_codebook's at 2.3",
        {
            "scheme": "nuqkey_codebook",
            "sink_tokens": 1,
            "outliers": 0.01,
            "policy": "measured",
            "budget": 2.3,
        },
        {"scheme": "pca", "sink_tokens": 1, "policy": "measured", "budget": 2.4},
    ),
    (
        "3.5x: 1% of each key's pca components kept in 2 bytes (dense-and-sparse; pca's knapsack at 4.2 bits) "
        "against none (at 4.4 bits), about the same bytes",
        {"scheme": "pca", "sink_tokens": 1, "policy": "measured", "budget": 4.4, "outliers": 0.0},
        {"scheme": "pca", "sink_tokens": 1, "policy": "measured", "budget": 4.2, "outliers": 0.01},
    ),
    (
        "6x: the same at 2.2 bits against none at 2.4",
        {"scheme": "pca", "sink_tokens": 1, "policy": "measured", "budget": 2.4, "outliers": 0.0},
        {"scheme": "pca", "sink_tokens": 1, "policy": "measured", "budget": 2.2, "outliers": 0.01},
    ),
    (
        "cross-layer prediction (xlayer: codebook's format for the residual of the layer below's prediction), "
        "3 bits",
        {"scheme": "codebook", "policy": "uniform", "budget": 3},
        {"scheme": "xlayer", "sink_tokens": 1, "policy": "uniform", "budget": 3},
    ),
    (
        "2-D grids after rotation, keys before RoPE, calibration mean off (vq2) against codebook, 3 bits",
        {"scheme": "codebook", "policy": "uniform", "budget": 3},
        {"scheme": "vq2", "sink_tokens": 1, "policy": "uniform", "budget": 3},
    ),
    (
        "channel pairs against fitted codebooks (cq2) against pca's transform coding, 3 bits",
        {"scheme": "pca", "sink_tokens": 1, "policy": "uniform", "budget": 3},
        {"scheme": "cq2", "sink_tokens": 1, "policy": "uniform", "budget": 3},
    ),
) + FUSED_INGREDIENTS
# The points every judged-on-other-text row is set against, on the same windows: (column, configuration).
REFERENCES = (
    (
        "uniform asym_token g32, 4 bits",
        {"scheme": "asym_token", "group_size": 32, "policy": "uniform", "budget": 4},
    ),
    (
        "llama.cpp's q4_0 emulated (rotate+sym_token g32, 4 bits)",
        {"scheme": "rotate+sym_token", "group_size": 32, "policy": "uniform", "budget": 4},
    ),
)
# What must agree for two points to be paired item by item: the same model, dtype and teacher-forced windows.
PAIRING_FIELDS = ("model", "dtype", "num_sequences", "sequence_tokens", "chunk", "bos", "data_path", "seed")


def storage(config: dict) -> str:
    """A point's storage in words: the scheme with its options, e.g. 'kivi g64 residual=0'."""
    name = config["scheme"]
    if name not in SCHEMES:
        return str(name)
    # a table's rows hold NaN where a point made before an option existed lacks it: the option's default
    recorded = {k: v for k, v in config.items() if not (isinstance(v, float) and math.isnan(v))}
    return from_point(recorded).label()


def name(config: dict) -> str:
    """'storage, budget: policy', e.g. 'asym_token g64, 3 bits: entropy a=0.25' (the scheme's options are named
    once, by storage; a unit-KL probe other than the default's and token eviction after the policy; calibration
    text other than the primary config's, in size or source, last)."""
    parts = []
    sizes = {k: v for k, v in _default_calibration().items() if k != "calibration_data_path"}
    if any(config.get(k, v) != v for k, v in sizes.items()):
        parts.append(f"{config['calibration_sequences']} x {config['calibration_tokens']} tokens")
    if config.get("calibration_data_path") is not None:
        parts.append(f"{'of ' if parts else ''}{config['calibration_data_path']}")
    calibration = f" (calibrated on {' '.join(parts)})" if parts else ""
    policy = policy_label(config) + probe_label(config) + eviction_label(config)
    return f"{storage(config)}, {config['budget']:g} bits: {policy}{calibration}"


def quantized_records(records: list[dict], model: str) -> list[dict]:
    """The model's ok harness points that quantize (no baseline, no peer engine) and report their bytes."""
    return [
        r
        for r in records
        if r["status"] == "ok"
        and r["config"]["model"] == model
        and r["config"]["policy"] != "baseline"
        and r["config"].get("engine", HARNESS) == HARNESS
        and math.isfinite(r["metrics"].get("compression_true", math.nan))
    ]


def interval(record: dict, metric: str, n_boot: int, seed: int) -> str:
    """'1.024 [1.019, 1.030] n=16' for one point's metric (bootstrap over its sequences), or 'n too small'."""
    statistic, n = teacher_forced_statistics(record)[metric]
    value = statistic(np.arange(n))
    if n < MIN_PAIRED_UNITS:
        return f"{value:.4g} (n={n} too small for an interval)"
    low, high = bootstrap_ci(statistic, n, n_boot=n_boot, seed=seed)
    return f"{value:.4g} [{low:.4g}, {high:.4g}] n={n}"


def best_at(records: list[dict], target: float) -> dict | None:
    """The point of lowest ppl_ratio among those compressing at least `target` (ties: fewer bytes, then key)."""
    candidates = [r for r in records if r["metrics"]["compression_true"] >= target * (1 - 1e-9)]
    if not candidates:
        return None
    return min(
        candidates,
        key=lambda r: (r["metrics"]["ppl_ratio"], r["metrics"]["bytes_per_token"], r["key"]),
    )


def one_sequence_compression(record: dict, tokens: int = ONE_SEQUENCE) -> float:
    """True compression of a point's allocation and scheme for one sequence of `tokens` tokens: the byte model's
    payload (harness.capacity.cache_bytes, tables left out) plus the fitted tables the run measured in full (its held
    bytes less the byte model's payload of its generation caches), where the evaluation spread them over its batch;
    NaN for a record without an allocation or of a model that is not registered (conf/model)."""
    allocation = record.get("allocation")
    config = record["config"]
    if allocation is None or config["model"] not in model_names():
        return math.nan
    shape = shape_from_registry(config["model"])
    scheme = from_point(config)
    bits = allocation["key_bits"], allocation["value_bits"]
    per_cache, caches = config["prompt_tokens"] + config["new_tokens"], config["num_prompts"]
    held = record["metrics"]["bytes_per_token"] * caches * per_cache  # bytes_per_token's own denominator
    # the generation caches hold one token less: the last generated token is never fed back
    run = cache_bytes(shape, per_cache - 1, bits[0], scheme, caches, bits[1], count_tables=False)
    tables = held - run.true_bytes
    one = cache_bytes(shape, tokens, bits[0], scheme, 1, bits[1], count_tables=False)
    return one.fp16_bytes / (one.true_bytes + tables)


def frontier_table(records: list[dict], model: str, n_boot: int, seed: int = 0) -> pd.DataFrame:
    """One row per compression target: the best point compressing at least that much."""
    mine = quantized_records(records, model)
    rows = []
    for target in TARGETS:
        best = best_at(mine, target)
        if best is None:
            rows.append({"at least": f"{target:g}x", "point": "none in the run"})
            continue
        rows.append(
            {
                "at least": f"{target:g}x",
                "point": name(best["config"]),
                "compression_true": best["metrics"]["compression_true"],
                f"at 1 x {ONE_SEQUENCE}": one_sequence_compression(best),
                "bytes_per_token": best["metrics"]["bytes_per_token"],
                **{m: interval(best, m, n_boot, seed) for m in METRICS},
                "key": best["key"],
            }
        )
    return pd.DataFrame(rows)


def goals_table(records: list[dict], model: str) -> pd.DataFrame:
    """Each goal: the best ppl_ratio the run reaches at that compression, met or missed by how much."""
    mine = quantized_records(records, model)
    rows = []
    for target, ceiling in GOALS:
        best = best_at(mine, target)
        if best is None:
            rows.append({"goal": f"ppl_ratio <= {ceiling:g} at >= {target:g}x", "verdict": "no point"})
            continue
        ratio = best["metrics"]["ppl_ratio"]
        verdict = "met" if ratio <= ceiling else f"missed by {ratio - ceiling:+.3g}"
        rows.append(
            {
                "goal": f"ppl_ratio <= {ceiling:g} at >= {target:g}x",
                "best": f"{ratio:.4g}",
                "point": name(best["config"]),
                "compression_true": best["metrics"]["compression_true"],
                "verdict": verdict,
            }
        )
    return pd.DataFrame(rows)


def _pairable(a: dict, b: dict) -> bool:
    return all(a["config"].get(f) == b["config"].get(f) for f in PAIRING_FIELDS)


def best_uniform_within(records: list[dict], record: dict) -> dict | None:
    """The uniform point of lowest kl_mean, any scheme, holding at most `record`'s true bytes per token (within
    EQUAL_BYTES_TOLERANCE) on the same sequences; None when there is none."""
    limit = record["metrics"]["bytes_per_token"] * (1 + EQUAL_BYTES_TOLERANCE)
    uniform = [
        r
        for r in records
        if r["config"]["policy"] == "uniform"
        and r["metrics"]["bytes_per_token"] <= limit
        and _pairable(r, record)
    ]
    return min(uniform, key=lambda r: (r["metrics"]["kl_mean"], r["key"]), default=None)


def head_to_head(records: list[dict], model: str, n_boot: int, seed: int = 0) -> pd.DataFrame:
    """Every non-uniform point minus the best uniform point at no more bytes, per metric, paired."""
    mine = quantized_records(records, model)
    rows = []
    for record in sorted(mine, key=lambda r: (r["metrics"]["bytes_per_token"], name(r["config"]), r["key"])):
        if record["config"]["policy"] == "uniform":
            continue
        reference = best_uniform_within(mine, record)
        row = {
            "point": name(record["config"]),
            "compression_true": record["metrics"]["compression_true"],
            "best uniform at no more bytes": "none" if reference is None else name(reference["config"]),
        }
        for metric in METRICS:
            row[metric] = "—" if reference is None else _difference(record, reference, metric, n_boot, seed)
        if reference is not None:
            row["bytes"] = format_bytes_ratio(
                record["metrics"]["bytes_per_token"] / reference["metrics"]["bytes_per_token"]
            )
        row["key"] = record["key"]
        rows.append(row)
    return pd.DataFrame(rows)


def _difference(record: dict, reference: dict, metric: str, n_boot: int, seed: int) -> str:
    """record's metric minus reference's, paired over their sequences, formatted with its interval and n."""
    (stat_a, n), (stat_b, _) = (
        teacher_forced_statistics(record)[metric],
        teacher_forced_statistics(reference)[metric],
    )
    difference = stat_a(np.arange(n)) - stat_b(np.arange(n))
    low = high = math.nan
    if n >= MIN_PAIRED_UNITS:
        low, high = paired_difference_ci(stat_a, stat_b, n, n_boot=n_boot, seed=seed)
    return format_difference(difference, low, high, bool(low > 0 or high < 0), n)


def peer_rows(records: list[dict], model: str, n_boot: int, seed: int = 0) -> pd.DataFrame:
    """Each quantized peer point beside the harness point of lowest ppl_ratio at no less true compression.

    Compression, not bytes per token: each engine's compression_true is its held bytes over the fp16 bytes of the
    same tokens, but a peer counts its teacher-forced windows and the harness its generation caches, and a model
    with sliding-window layers holds a different share of those tokens per token (gemma3-270m: 1023-token windows
    past its 512-token window against 320-token caches inside it)."""
    mine = quantized_records(records, model)
    peers = [
        r
        for r in records
        if r["status"] == "ok"
        and r["config"]["model"] == model
        and r["config"].get("engine", HARNESS) != HARNESS
        and r["metrics"].get("compression_true", 1.0) > 1.0  # not an unquantized reference
    ]
    rows = []
    for peer in sorted(peers, key=lambda r: (r["metrics"]["bytes_per_token"], r["key"])):
        floor = peer["metrics"]["compression_true"] / (1 + EQUAL_BYTES_TOLERANCE)
        fits = [r for r in mine if r["metrics"]["compression_true"] >= floor and _pairable(r, peer)]
        best = min(fits, key=lambda r: (r["metrics"]["ppl_ratio"], r["key"]), default=None)
        row = {
            "peer": configuration(peer["config"]),
            "compression_true": peer["metrics"]["compression_true"],
            "ppl_ratio": interval(peer, "ppl_ratio", n_boot, seed),
            "best harness point at no less compression": "none" if best is None else name(best["config"]),
            "its compression_true": math.nan if best is None else best["metrics"]["compression_true"],
            "its ppl_ratio": "—" if best is None else interval(best, "ppl_ratio", n_boot, seed),
            "harness minus peer, ppl_ratio": "—"
            if best is None
            else _difference(best, peer, "ppl_ratio", n_boot, seed),
            "key": peer["key"],
        }
        rows.append(row)
    return pd.DataFrame(rows)


def matching(records: list[dict], fields: dict) -> dict | None:
    """The point whose config has every field of `fields` (fewest bytes, then key), or None. A field a config
    lacks (made before it existed) reads as its KEYED_UNLESS value; key_levels and the calibration text, unless
    `fields` names them, must be kmeans and the primary config's (so an ingredient about something else never
    picks a Fisher-weighted point, or one whose levels were fitted on more text)."""
    want = {"key_levels": KMEANS, **_default_calibration(), **DEFAULT_PROBE, **fields}
    found = [r for r in records if all(r["config"].get(k, KEYED_UNLESS.get(k)) == v for k, v in want.items())]
    return min(found, key=lambda r: (r["metrics"]["bytes_per_token"], r["key"]), default=None)


@functools.cache
def _default_calibration() -> dict:
    """The calibration fields (text size, first window) of the primary config (conf/eval/default.yaml)."""
    point = base_point(compose([]))
    return {field: getattr(point, field) for field in CALIBRATION_FIELDS}


def ablation_table(records: list[dict], model: str, n_boot: int, seed: int = 0) -> pd.DataFrame:
    """One row per ingredient: the point with it minus the point without it, paired, with their bytes ratio."""
    mine = quantized_records(records, model)
    rows = []
    for ingredient, without_fields, with_fields in INGREDIENTS:
        without, with_ = matching(mine, without_fields), matching(mine, with_fields)
        row = {
            "ingredient": ingredient,
            "without": "not in the run" if without is None else name(without["config"]),
            "with": "not in the run" if with_ is None else name(with_["config"]),
        }
        if without is not None and with_ is not None and _pairable(without, with_):
            row.update(
                {
                    "its compression_true": without["metrics"]["compression_true"],
                    "compression_true": with_["metrics"]["compression_true"],
                    **{m: _difference(with_, without, m, n_boot, seed) for m in METRICS},
                    "bytes": format_bytes_ratio(
                        with_["metrics"]["bytes_per_token"] / without["metrics"]["bytes_per_token"]
                    ),
                }
            )
        rows.append(row)
    return pd.DataFrame(rows)


def texts(records: list[dict]) -> list:
    """The evaluation texts (eval.data.path) of the run's harness points that quantize, the default (None) first,
    then the others by name."""
    found = {r["config"].get("data_path") for r in records if r["config"]["policy"] != "baseline"}
    return sorted(found, key=lambda t: (t is not None, str(t)))


def on_text(records: list[dict], text) -> list[dict]:
    """The records (peers and baselines too) evaluated on text `text` (eval.data.path)."""
    return [r for r in records if r["config"].get("data_path") == text]


def other_text_table(records: list[dict], model: str, n_boot: int, seed: int = 0) -> pd.DataFrame:
    """One row per compression target: the best point on these records' text (all of one eval.data.path), the text
    it was calibrated on, and its paired difference to each REFERENCES point on the same windows."""
    mine = quantized_records(records, model)
    rows = []
    for target in TARGETS:
        best = best_at(mine, target)
        if best is None:
            rows.append({"at least": f"{target:g}x", "point": "none in the run"})
            continue
        calibrated = {"calibration_data_path": best["config"].get("calibration_data_path")}  # the same run's
        references = [(column, matching(mine, {**fields, **calibrated})) for column, fields in REFERENCES]
        row = {
            "at least": f"{target:g}x",
            "point": name(best["config"]),
            "calibrated on": best.get("resolved", {}).get("calibration_source", "not recorded"),
            "compression_true": best["metrics"]["compression_true"],
            "ppl_ratio": interval(best, "ppl_ratio", n_boot, seed),
            "kl_mean": interval(best, "kl_mean", n_boot, seed),
        }
        for column, reference in references:
            paired = reference is not None and _pairable(best, reference)
            row[f"minus {column}, ppl_ratio"] = (
                _difference(best, reference, "ppl_ratio", n_boot, seed) if paired else "not in the run"
            )
        row["key"] = best["key"]
        rows.append(row)
    return pd.DataFrame(rows)


def frontier_text(run_dir: Path, records: list[dict], n_boot: int | None = None, seed: int = 0) -> str:
    """The whole frontier.md of run_dir."""
    n_boot = default_n_boot(run_dir) if n_boot is None else n_boot
    frame = results.table(records)
    parts = ["  \n".join(provenance(run_dir))]
    if "simulate" in frame and frame["simulate"].fillna(False).astype(bool).any():
        parts.append(
            "\n**Simulated memory (quant.simulate=true):** these caches also kept a full-precision working copy; "
            "metrics and true bytes are the stored format's, resident bytes are not."
        )
    note = (
        f"Intervals: percentile bootstrap 95% over teacher-forced sequences, {n_boot} resamples, seed {seed}; "
        f"none below n = {MIN_PAIRED_UNITS}. Bold: a paired interval that excludes zero (negative is better). "
        f"bytes: the point's true bytes per token over the reference's."
    )
    home, *others = texts(records) or [None]
    everything, records = records, on_text(records, home)
    models = sorted({r["config"]["model"] for r in records if r["config"]["policy"] != "baseline"})
    for model in models:
        parts += [
            f"\n# {model}\n\n## Frontier: lowest ppl_ratio at each true compression\n\n{note}\n",
            markdown_table(frontier_table(records, model, n_boot, seed)),
            "\n## Goals (DESIGN.md §8)\n",
            markdown_table(goals_table(records, model)),
            "\n## Each allocation against the best uniform storage at no more true bytes\n",
            markdown_table(head_to_head(records, model, n_boot, seed)),
            "\n## Ablation: what each ingredient adds, near 3.5x unless it names another compression (with it minus "
            "without it, paired)\n",
            markdown_table(ablation_table(records, model, n_boot, seed)),
        ]
        peers = peer_rows(records, model, n_boot, seed)
        if len(peers):
            parts += [
                "\n## Peer engines beside the best harness point at no less true compression\n",
                markdown_table(peers),
            ]
    for text in others:
        there = on_text(everything, text)
        for model in sorted({r["config"]["model"] for r in there if r["config"]["policy"] != "baseline"}):
            parts += [
                f"\n# {model}: judged on other text ({text})\n\nThe best point at each true compression on the "
                f"windows of {text} (`calibrated on`: the text its fitted parts were fitted on), and its paired "
                "difference to uniform asym_token and to the emulation of llama.cpp's q4_0 on the same windows.\n",
                markdown_table(other_text_table(there, model, n_boot, seed)),
            ]
            peers = peer_rows(there, model, n_boot, seed)
            if len(peers):
                parts += [f"\n## Peer engines on {text}\n", markdown_table(peers)]
    return "\n".join(parts) + "\n"


def write_frontier(run_dir: str | Path, n_boot: int | None = None, seed: int = 0) -> Path:
    run_dir = Path(run_dir)
    path = run_dir / "frontier.md"
    path.write_text(frontier_text(run_dir, results.load_records(run_dir), n_boot, seed))
    return path


def page_command(argv: list[str] | None, program: str, doc: str, write) -> None:
    """A run page's command: RUN_DIR and --n-boot from argv, then write(run_dir, n_boot) (its path printed)."""
    parser = argparse.ArgumentParser(prog=program, description=doc.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--n-boot", type=int, default=None, help="bootstrap resamples (default: the run's)")
    args = parser.parse_args(argv)
    if not (args.run_dir / "points").is_dir():
        parser.error(f"run_dir: {args.run_dir} has no points/ folder")
    print(write(args.run_dir, args.n_boot))


def main(argv: list[str] | None = None) -> None:
    page_command(argv, "python -m harness.report.frontier", __doc__, write_frontier)


if __name__ == "__main__":
    main()
