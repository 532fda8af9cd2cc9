"""What every point of one model shares, built once per model and evaluation setup: the model (loaded once), its
token windows (harness.data.point_windows: calibration windows from the calibration source, the others from the
evaluation's), per-head attention entropies (harness.calibrate, cached on disk) and, lazily, the parts fitted on
the calibration windows (key tables, transforms: harness.calibrate, cached on disk and keyed by the
calibration source), the unquantized baseline (greedy tokens and teacher-forced logits through a DynamicCache;
log-probs too big for memory kept on disk between starts: harness.run.kept_baseline) and one full-precision
prefill of the prompts that every point with prefill=exact starts from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch

from harness import data, evaluate
from harness.cache.eviction import EvictionSpec
from harness.calibrate import cached_head_entropies
from harness.capacity import ModelShape, shape_from_config
from harness.config import CALIBRATION_FIELDS, EVAL_FIELDS, Point
from harness.io import write_parquet_atomic
from harness.models import load_model
from harness.run.kept_baseline import kept_baseline
from harness.schemes import FittedParts, Scheme

# The baseline's teacher-forced log-probs above this many bytes live on disk, kept between starts
# (harness.run.kept_baseline), instead of in memory: smollm2-135m's over the last half of 16 windows of 8K tokens
# are 6.4 GB, gemma3-270m's 34 GB.
LOGPROBS_IN_MEMORY = 4 << 30


class TableKey(NamedTuple):
    """What a measured table depends on within a model context (harness.run.measure.table_key)."""

    measurement: str  # a name in harness.sensitivity.MEASUREMENTS
    scheme: Scheme
    widths: tuple[int, ...]
    chunk: int
    # the unit-KL probe: (sequences, tokens) of the calibration windows, and the context width (None: alone)
    probe: tuple[int, int, int | None]


class KeyFit(NamedTuple):
    """What a scheme's fitted parts depend on within a model context: their kind (Scheme.fit) and its variant
    (Scheme.fit_variant: a rank, channel groups), the positions [0, span) and the level fit."""

    kind: str  # a name in harness.calibrate.FITS
    variant: object
    span: int
    levels: str  # quant.key_levels


class MeasurementKey(NamedTuple):
    """Everything a point's measurement depends on beyond its model context: equal keys, equal metrics."""

    key_bits: bytes  # the allocation's int64 grids, as bytes
    value_bits: bytes
    scheme: Scheme  # with its options resolved
    prefill: str
    eviction: EvictionSpec


@dataclass
class ModelContext:
    """What every point of one model shares: the model, its data, calibration, baseline and prefill."""

    name: str
    model: object
    tokenizer: object
    entropy: pd.DataFrame
    prompts: torch.Tensor  # (N, P)
    sequences: torch.Tensor  # (S, T)
    base_tokens: torch.Tensor  # (N, M)
    base_tf: evaluate.TeacherForced
    prefilled: list  # evaluate.Prefilled per prompt batch
    batch_size: int
    backend: str  # quant.backend: an execution choice, not part of a point's key (like the device)
    simulate: bool  # quant.simulate: likewise (the same metrics either way), recorded in every row
    timings: dict = field(default_factory=dict)
    measured: dict[MeasurementKey, tuple[str, dict]] = field(default_factory=dict)  # -> (first point, result)
    calib_ids: torch.Tensor | None = None  # (C, Tc) calibration tokens, for the measured policies
    sensitivity: dict[TableKey, pd.DataFrame] = field(default_factory=dict)  # measured tables, lazily
    shape: ModelShape | None = None  # the cache's layers and heads (harness.capacity), for the byte model
    bos: bool = False  # whether every window starts with the tokenizer's BOS token (eval.bos resolved)
    peer_state: dict = field(default_factory=dict)  # what harness.peers engines share across points, lazily
    key_calibration: dict[KeyFit, FittedParts] = field(default_factory=dict)  # fitted parts, lazily
    data_source: str | None = (
        None  # eval.data.path: where the prompts and sequences come from (None: default)
    )
    calibration_source: str | None = None  # where the calibration windows come from (harness.data)


def context_key(point: Point) -> tuple:
    """Points that share a ModelContext (same model, data, sizes, seed, calibration, prefill mode)."""
    fields = ("model", "dtype", "data_path", "seed", *EVAL_FIELDS, *CALIBRATION_FIELDS)  # both text sources
    return tuple(getattr(point, f) for f in fields)


def build_context(
    point: Point, batch_size: int, device: str, run_dir: Path, backend: str = "auto", simulate: bool = False
) -> ModelContext:
    timings = {}
    t = time.perf_counter()
    model, tokenizer = load_model(point.model, device=device, dtype=point.dtype)
    timings["load_s"] = time.perf_counter() - t

    # the point was checked (harness.validate): its windows fit the model
    windows = data.point_windows(tokenizer, point)
    bos, calib_ids, prompts, sequences = windows.bos, windows.calibration, windows.prompts, windows.sequences
    calibration_source, _ = data.calibration_source(point)

    t = time.perf_counter()
    entropy = cached_head_entropies(model, point.model, calib_ids, i0=point.i0, source=calibration_source)
    timings["calibrate_s"] = time.perf_counter() - t

    t = time.perf_counter()
    prefilled = evaluate.prefill(model, prompts, batch_size=batch_size)
    base_tokens = evaluate.decode(model, prefilled, point.new_tokens, cache_from_prefilled=None)
    scored = sequences.shape[0] * (sequences.shape[1] - max(point.score_from, 1))
    vocabulary = model.config.get_text_config(decoder=True).vocab_size
    if scored * vocabulary * 2 > LOGPROBS_IN_MEMORY:  # float16 log-probs
        base_tf, timings["baseline_kept"] = kept_baseline(
            model, point.model, sequences, point.chunk, batch_size, point.score_from
        )
    else:
        base_tf = evaluate.teacher_forced(
            model,
            sequences,
            evaluate.dynamic_cache_factory(model),
            chunk=point.chunk,
            batch_size=batch_size,
            score_from=point.score_from,
        )
    timings["baseline_s"] = time.perf_counter() - t
    entropy_path = Path(run_dir) / f"entropy-{point.model}.parquet"
    if not entropy_path.exists():  # shards may race here: write atomically
        write_parquet_atomic(entropy_path, entropy)
    return ModelContext(
        point.model,
        model,
        tokenizer,
        entropy,
        prompts,
        sequences,
        base_tokens,
        base_tf,
        prefilled,
        batch_size,
        backend,
        simulate,
        timings,
        calib_ids=calib_ids,
        shape=shape_from_config(model.config, point.model),
        bos=bos,
        data_source=point.data_path,
        calibration_source=calibration_source,
    )
