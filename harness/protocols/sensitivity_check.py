"""The sensitivity check (`python -m harness.sensitivity --model NAME --check-heads N [--width W] [overrides]`): does
the sensitivity proxy (harness.sensitivity) rank heads like the teacher-forced KL with only that head quantized?

The point comes from the primary config with the overrides (harness.config.compose), validated before the model
loads; the start record is written beside the output CSV (<out>.env.json); the measurement is
harness.sensitivity.proxy_check on a random sample of heads; the CSV, a JSON summary and the Spearman correlation
are the result.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import DictConfig

from harness import data, io
from harness.config import Point, base_point, compose
from harness.io import CONF_DIR, write_atomic, write_text_atomic
from harness.models import ModelUnavailable, load_model
from harness.schemes import Scheme, get_scheme
from harness.sensitivity import cached_sensitivity, measured_widths, proxy_check, sample_heads
from harness.validate import check_model_inputs, preflight_overrides, validate_config
from kernels.reference import WIDTHS as PACKED_WIDTHS


def main(argv: list[str] | None = None) -> None:
    """`python -m harness.sensitivity --model NAME --check-heads N [--width W] [--out CSV] [overrides]`."""
    parser = argparse.ArgumentParser(
        prog="python -m harness.sensitivity",
        description="Does the sensitivity proxy rank heads like the teacher-forced KL with only that head "
        "quantized? Measures both for a random sample of heads and prints their Spearman correlation.",
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--check-heads", type=int, default=12, help="how many heads to sample")
    parser.add_argument("--width", type=int, default=2, help="the width every sampled head is checked at")
    parser.add_argument("--out", type=Path, help="CSV path (default results/sensitivity/check-*.csv)")
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. eval=small quant.scheme=sym_token"
    )
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    command = io.command_line("python -m harness.sensitivity", argv)
    try:  # before the model loads: the point, threads, a clean tree for results/, <out>.env.json
        cfg, point, scheme = _check_context(args)
        out = args.out or Path("results/sensitivity") / f"check-{point.model}-{scheme.name}-w{args.width}.csv"
        io.set_threads(cfg.threads)
        io.check_writable(out.parent, key="--out")
        io.check_clean(out.parent, cfg.allow_dirty)
    except (ValueError, ModelUnavailable) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    io.start_record(out.parent, command, "cpu", cfg.allow_dirty, name=out.with_suffix(".env.json").name)
    _run_check(args, point, scheme, out, command=command)


def _check_context(args) -> tuple[DictConfig, Point, Scheme]:
    """The composed config, the point the overrides describe and its scheme, validated before any model loads."""
    overrides = [f"model={args.model}", *args.overrides]
    preflight_overrides(overrides, CONF_DIR)
    cfg = compose(overrides)
    validate_config(cfg)
    point = base_point(cfg)
    if isinstance(args.check_heads, bool) or args.check_heads < 2:
        raise ValueError(f"--check-heads: {args.check_heads} is too few; allowed: an integer >= 2")
    if args.width not in PACKED_WIDTHS:
        raise ValueError(
            f"--width: {args.width} is not a quantized width; allowed: {', '.join(map(str, PACKED_WIDTHS))}"
        )
    scheme = get_scheme(point.scheme, point.group_size, point.sink_tokens, point.residual)
    scheme.check_widths([args.width])
    check_model_inputs(cfg, [point])
    return cfg, point, scheme


def _run_check(args, point: Point, scheme: Scheme, out: Path, command: str) -> None:
    model, tokenizer = load_model(point.model, dtype=point.dtype)
    windows = data.point_windows(tokenizer, point)
    calibration, sequences = windows.calibration, windows.sequences
    widths = sorted(set(measured_widths(point.widths)) | {args.width})
    table = cached_sensitivity(model, point.model, calibration, scheme, widths)
    heads = sample_heads(table, args.check_heads, point.seed)
    rows, rho = proxy_check(model, sequences, table, heads, args.width, scheme, point.chunk)
    write_atomic(out, lambda tmp: rows.to_csv(tmp, index=False))
    summary = dict(command=command, spearman=rho, heads=len(rows), width=args.width, point=point.to_dict())
    write_text_atomic(out.with_suffix(".json"), json.dumps(summary, indent=1, default=str))
    print(rows.to_string(index=False))
    print(
        f"spearman(proxy, kl_mean) = {rho:.3f} over {len(rows)} heads "
        f"({point.model}, {scheme.name}, width {args.width}); wrote {out}"
    )
