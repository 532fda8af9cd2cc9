"""The grid's point runner: per model one context (harness.run.context), then every pending point measured
(harness.run.measure, or by its engine for a peer point, harness.peers) and recorded in points/ (harness.run.records:
a point whose file exists is skipped, when the run starts and again when its turn comes, so a killed run resumes
with no point lost or repeated, and a start skips the points another start into the same run directory has
finished by then). The model's
baseline row is recorded beside its points. results.parquet is rebuilt from points/ (atomically,
harness.results) after every point, so it is always readable.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from harness import peers, results
from harness.config import HARNESS, NO_EVICTION, Point
from harness.io import write_json_atomic
from harness.run.context import ModelContext, build_context, context_key
from harness.run.measure import baseline_record, measure_point, resolved
from harness.run.records import PointLog
from kernels.layout import FULL_WIDTH


def _write_baseline(log: PointLog, ctx: ModelContext, point: Point, provenance: dict) -> None:
    """The baseline row of `point`'s context (its unquantized model on the same windows), once per run directory."""
    base_point = point.without_peer_fields().replace(
        policy="baseline",
        budget=FULL_WIDTH,
        alpha=0.0,
        sink_threshold=None,
        sink_fraction=None,
        scheme="none",
        **NO_EVICTION,
    )
    if log.done(base_point.key()):
        return
    record = {
        "key": base_point.key(),
        "status": "ok",
        "config": base_point.to_dict(),
        "resolved": resolved(ctx),
        **provenance,
        "metrics": baseline_record(ctx),
        "tokens": ctx.base_tokens.tolist(),
    }
    log.write(base_point.key(), record)


def run(
    points: list[Point],
    run_dir: Path,
    batch_size: int = 8,
    device: str = "cpu",
    on_point=None,
    tag: str = "",
    backend: str = "auto",
    provenance: dict | None = None,
    simulate: bool = False,
) -> pd.DataFrame:
    """Evaluate every point not already in run_dir/points; returns the consolidated table.

    `tag` names this process's timings file (timings<tag>.json), so shards sharing a run_dir never race on it.
    `provenance` (harness.io.provenance: thread count, commit) goes into every point record beside its config,
    not into the config: it does not change a point's key, so a run resumed at another thread count adds no
    point, and its rows say which ran where.
    """
    provenance = provenance or {}
    run_dir = Path(run_dir)
    log = PointLog(run_dir)
    todo = [p for p in points if not log.done(p.key())]
    # Points of one context run back to back (grid order kept within it), so each model loads once.
    first_seen = {}
    for p in todo:
        first_seen.setdefault(context_key(p), len(first_seen))
    todo.sort(key=lambda p: first_seen[context_key(p)])
    timings_path = run_dir / f"timings{tag}.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {"models": {}, "points": {}}
    contexts: dict[tuple, ModelContext] = {}
    bar = tqdm(
        total=len(points), initial=len(points) - len(todo), desc="points", unit="pt", dynamic_ncols=True
    )
    for point in todo:
        key = point.key()
        if log.done(key):  # another start into this run directory finished it meanwhile
            bar.update(1)
            continue
        ckey = context_key(point)
        if ckey not in contexts:
            contexts.clear()  # one model in memory at a time
            # the load shows on this bar, the sweep's one progress display (harness.models loads quietly)
            bar.set_postfix_str(f"{point.model}: loading, calibrating, baseline")
            contexts[ckey] = ctx = build_context(point, batch_size, device, run_dir, backend, simulate)
            timings["models"][point.model] = ctx.timings
            _write_baseline(log, ctx, point, provenance)
        ctx = contexts[ckey]
        bar.set_postfix_str(f"{point.model} {point.policy} b={point.budget} {point.scheme}")
        t = time.perf_counter()
        if point.engine != HARNESS:
            result = peers.measure(ctx, point)
        else:
            result = measure_point(ctx, point, key)
        timings["points"][key] = time.perf_counter() - t
        record = {"key": key, "config": point.to_dict(), "resolved": resolved(ctx), **provenance, **result}
        log.write(key, record)
        write_json_atomic(timings_path, timings)
        results.write_parquet(run_dir)
        if on_point is not None:
            on_point(point, result)
        bar.update(1)
    bar.close()
    results.write_parquet(run_dir)
    return results.load(run_dir)
