"""`python -m harness.bench.overhead [--schemes S...] [--bits B...] [--repeats N] [--threads N] [--out CSV] [overrides]`:
what one grid point costs beyond the model's own forward, every contender in one process.

This module owns that benchmark. A grid point's work is a generation (greedy decode from the shared
full-precision prefill of the prompts, through a cache made from it) and a teacher-forced pass (the evaluation
sequences fed chunk by chunk through a fresh cache, every chunk's logits scored against the baseline). The
contenders do that same work on the same tokens: `plain` through transformers' DynamicCache (the unquantized
baseline's own path), and each packed-only QuantizedKVCache asked for (a scheme of conf/quant at a uniform width,
its options as its config file gives them). They run alternating, contender after contender, round after round,
after one untimed warm-up each on a short slice; the baseline's log-probs are computed once before.

Stages (seconds, and the ratio to the plain forward over the same tokens in the same round, the median over
rounds): `gen_cache` (each batch's cache made from its prefill), `gen_steps` (the decode steps), `generation`
(both; all three against plain's gen_steps), `tf_forward` (the model's forwards through the cache), `tf_score`
(the metrics of each chunk), `teacher_forced` (both; all three against plain's tf_forward) and `point` (all,
against plain's gen_steps + tf_forward). The overrides set the point as `python -m harness` would (model,
model.dtype, eval.* sizes); the start record goes beside the CSV (<out>.env.json).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

import torch

from harness import data, evaluate, io, precision
from harness.attention import PACKED, installed
from harness.cache import QuantizedKVCache
from harness.calibrate import cached_fit
from harness.config import Point, base_point, compose, group_options
from harness.io import CONF_DIR, git_state
from harness.models import ModelUnavailable, load_model
from harness.run.measure import key_span, point_scheme
from harness.validate import check_model_inputs, preflight_overrides, validate_config

PLAIN = "plain"
DEFAULT_SCHEMES = ("asym_token", "nuqkey_codebook", "kivi")
# stage -> (its parts, the plain stages whose seconds it is divided by)
STAGES = {
    "gen_cache": (("gen_cache",), ("gen_steps",)),
    "gen_steps": (("gen_steps",), ("gen_steps",)),
    "generation": (("gen_cache", "gen_steps"), ("gen_steps",)),
    "tf_forward": (("tf_forward",), ("tf_forward",)),
    "tf_score": (("tf_score",), ("tf_forward",)),
    "teacher_forced": (("tf_forward", "tf_score"), ("tf_forward",)),
    "point": (("gen_cache", "gen_steps", "tf_forward", "tf_score"), ("gen_steps", "tf_forward")),
}
# the speed targets: a packed-only 4-bit asym_token cache's stage -> {dtype: ratio to the plain forward at most}
TARGETS = {"tf_forward": {"bfloat16": 1.3, "float32": 1.2}, "generation": {"bfloat16": 1.5, "float32": 1.5}}


class Contender:
    """One cache the point's work runs through: the plain DynamicCache, or a packed-only QuantizedKVCache of one
    scheme at one uniform width."""

    def __init__(self, name: str, point: Point | None = None, bits: int = 0, key_calibration=None):
        self.name, self.point, self.bits = name, point, bits
        self.scheme = None if point is None else point_scheme(point)
        self.options = dict(backend="torch", simulate=False, key_calibration=key_calibration)

    def from_prefilled(self, model):
        """evaluate.decode's cache_from_prefilled: None (a copy of the DynamicCache) or a quantized copy."""
        if self.point is None:
            return None
        return lambda prefilled: QuantizedKVCache.from_prefilled(
            prefilled, model.config, self.bits, self.scheme, prefill="exact", **self.options
        )

    def factory(self, model):
        """Fresh empty caches for the teacher-forced pass (quantize-on-write, as a grid point's)."""
        if self.point is None:
            return evaluate.dynamic_cache_factory(model)
        return lambda: QuantizedKVCache(
            model.config, self.bits, self.scheme, prefill="quantized", **self.options
        )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES), help="conf/quant options")
    p.add_argument("--bits", type=int, nargs="+", default=[4, 2], help="uniform widths, every scheme at each")
    p.add_argument("--repeats", type=int, default=1, help="rounds of every contender")
    p.add_argument("--out", type=Path, help="CSV (default results/perf/overhead-<dtype>.csv)")
    io.add_run_arguments(p)
    p.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. model.dtype=bfloat16 eval.num_sequences=4"
    )
    return p


def _check(args) -> tuple[Point, dict[str, Point], int]:
    """The point of the overrides, the point with each scheme's config, and the batch size (eval.batch_size);
    ValueError naming the key for anything not allowed (before any model loads)."""
    if args.repeats < 1:
        raise ValueError(f"--repeats: {args.repeats} is not allowed; allowed: a positive count")
    allowed = group_options("quant")
    for scheme in args.schemes:
        if scheme not in allowed:
            raise ValueError(f"--schemes: unknown {scheme!r}; allowed: {', '.join(allowed)}")
    preflight_overrides(args.overrides, CONF_DIR)
    cfg = compose(args.overrides)
    validate_config(cfg)
    point = base_point(cfg)
    check_model_inputs(cfg, [point])
    points = {}
    for scheme in args.schemes:
        points[scheme] = base_point(compose([*args.overrides, f"quant={scheme}"]))
        for bits in args.bits:
            try:
                point_scheme(points[scheme]).check_widths([bits])
            except ValueError as err:
                raise ValueError(f"--bits: {bits} is not allowed for {scheme} ({err})") from None
    return point, points, int(cfg.eval.batch_size)


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown CPU"


def _contenders(args, model, point: Point, points: dict[str, Point], calib_ids) -> list[Contender]:
    out = [Contender(PLAIN)]
    for scheme, p in points.items():
        # the parts a scheme fits (key tables, pca's transforms): once on the calibration windows (cached on disk),
        # as a sweep fits them (harness.run.measure.key_calibration)
        parts = cached_fit(point_scheme(p), model, p.model, calib_ids, key_span(p), p.key_levels,
                           data.calibration_source(p)[0])  # fmt: skip
        name = scheme if p.scheme == scheme else f"{scheme} ({p.scheme})"
        out += [Contender(f"{name} {bits}-bit", p, bits, parts) for bits in args.bits]
    return out


def _run(model, contender: Contender, prefilled, sequences, point: Point, base_tf, batch: int) -> dict:
    """One contender's generation and teacher-forced pass: seconds per stage part."""
    gen, tf = {}, {}
    evaluate.decode(model, prefilled, point.new_tokens, contender.from_prefilled(model), clock=gen)
    evaluate.teacher_forced(
        model, sequences, contender.factory(model), point.chunk, batch, baseline=base_tf, clock=tf
    )
    return {
        "gen_cache": gen["cache_s"],
        "gen_steps": gen["steps_s"],
        "tf_forward": tf["forward_s"],
        "tf_score": tf["score_s"],
    }


@torch.no_grad()
def measure(args, point: Point, points: dict[str, Point], batch: int) -> tuple[list[dict], list[str], dict]:
    """Rows (contender, round, part, seconds) of every round, the contenders' names in order, and the sizes run."""
    model, tokenizer = load_model(point.model, dtype=point.dtype)
    windows = data.point_windows(tokenizer, point)
    contenders = _contenders(args, model, point, points, windows.calibration)
    prefilled = evaluate.prefill(model, windows.prompts, batch_size=batch)
    base_tf = evaluate.teacher_forced(model, windows.sequences, evaluate.dynamic_cache_factory(model),
                                      point.chunk, batch)  # fmt: skip
    # untimed warm-up of every contender on a short slice (first calls set up kernels and tables per shape)
    short = windows.sequences[:1, : 2 * point.chunk + 1]
    short_base = evaluate.teacher_forced(model, short, evaluate.dynamic_cache_factory(model), point.chunk, 1)
    rows = []
    # the quantized caches are attended from their packed form, the DynamicCache through SDPA
    with installed(model, PACKED):
        for c in contenders:
            evaluate.teacher_forced(model, short, c.factory(model), point.chunk, 1, baseline=short_base)
            evaluate.decode(model, prefilled[:1], 3, c.from_prefilled(model))
        for r in range(args.repeats):
            for c in contenders:
                seconds = _run(model, c, prefilled, windows.sequences, point, base_tf, batch)
                print(
                    f"round {r}: {c.name:24s} " + "  ".join(f"{k} {v:7.2f} s" for k, v in seconds.items()),
                    flush=True,
                )
                rows += [dict(contender=c.name, round=r, part=k, seconds=v) for k, v in seconds.items()]
    sizes = {
        "prompts": tuple(windows.prompts.shape),
        "new_tokens": point.new_tokens,
        "sequences": tuple(windows.sequences.shape),
        "chunk": point.chunk,
        "batch": batch,
        "model_dtype": str(model.dtype),
    }
    return rows, [c.name for c in contenders], sizes


def ratios(rows: list[dict], names: list[str]) -> list[dict]:
    """Per contender and stage: median seconds over rounds and the median of each round's ratio to plain."""
    seconds = {(r["contender"], r["round"], r["part"]): r["seconds"] for r in rows}
    rounds = sorted({r["round"] for r in rows})
    out = []
    for name in names:
        for stage, (parts, reference) in STAGES.items():
            own = [sum(seconds[name, r, p] for p in parts) for r in rounds]
            ref = [sum(seconds[PLAIN, r, p] for p in reference) for r in rounds]
            out.append(
                {
                    "contender": name,
                    "stage": stage,
                    "reference": "plain " + " + ".join(reference),
                    "rounds": len(rounds),
                    "median_s": statistics.median(own),
                    "ratio": statistics.median(o / f for o, f in zip(own, ref)),
                }
            )
    return out


def _header(command: str, point: Point, sizes: dict, repeats: int) -> list[str]:
    commit, dirty = git_state()
    flags = ", ".join(precision.describe("cpu")["bf16_cpu_flags"]) or "none"
    return [
        f"command: {command}",
        f"commit {commit}{' (dirty tree)' if dirty else ''}; {_cpu_name()} (bf16 flags: {flags}); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        f"model {point.model} ({sizes['model_dtype']}); generation: prompts {sizes['prompts']} + "
        f"{sizes['new_tokens']} new tokens; teacher-forced: sequences {sizes['sequences']} in chunks of "
        f"{sizes['chunk']}; batch {sizes['batch']}; {repeats} round(s), contenders alternating",
    ]


def _table(summary: list[dict], names: list[str], dtype: str) -> list[str]:
    by = {(s["contender"], s["stage"]): s for s in summary}
    lines = [f"{'contender':24s}" + "".join(f"{stage:>16s}" for stage in STAGES)]
    for name in names:
        cells = [f"{by[name, st]['median_s']:7.2f}s {by[name, st]['ratio']:5.2f}x" for st in STAGES]
        lines.append(f"{name:24s}" + "".join(f"{c:>16s}" for c in cells))
    for stage, limits in TARGETS.items():
        row = by.get(("asym_token 4-bit", stage))
        if row is not None:
            verdict = "met" if row["ratio"] <= limits[dtype] else "missed"
            lines.append(f"target: asym_token 4-bit {stage} at most {limits[dtype]}x in {dtype}: "
                         f"{row['ratio']:.2f}x, {verdict}")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_intermixed_args(argv)  # overrides may stand between options
    command = io.command_line("python -m harness.bench.overhead", argv)
    try:  # before the model loads: the points, threads, a writable and clean output folder, the start record
        point, points, batch = _check(args)
        out = args.out or Path("results/perf") / f"overhead-{point.dtype}.csv"
        io.set_threads(args.threads, key="--threads")
        io.check_writable(out.parent, key="--out")
        io.check_clean(out.parent, args.allow_dirty, key="--allow-dirty")
    except (ValueError, ModelUnavailable) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    io.start_record(out.parent, command, "cpu", args.allow_dirty, point.dtype,
                    name=out.with_suffix(".env.json").name)  # fmt: skip
    rows, names, sizes = measure(args, point, points, batch)
    summary = ratios(rows, names)
    header = _header(command, point, sizes, args.repeats)
    with open(out, "w", newline="") as f:
        f.writelines(f"# {line}\n" for line in header)
        writer = csv.DictWriter(f, fieldnames=list(summary[0]))
        writer.writeheader()
        writer.writerows(summary)
    with open(out.with_suffix(".rounds.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("\n".join([*header, "seconds (median over rounds) and ratio to the plain forward:",
                     *_table(summary, names, point.dtype), f"wrote {out}"]))  # fmt: skip


if __name__ == "__main__":
    main()
