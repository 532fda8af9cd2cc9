"""The sensitivity checks (`python -m harness.sensitivity --model NAME [--check-heads N --width W | --additivity N
--budget B | --chain W [--sequences S] | --finer-widths STEP --budgets B,B,... | --one-exact N --width W
[--sequences S | --probe]] [overrides]`):
- proxy: does the sensitivity proxy (harness.sensitivity) rank heads like the teacher-forced KL with only that head
  quantized? (harness.sensitivity.proxy_check on a random sample of heads, evaluation text);
- additivity (`--additivity N`): do unit KLs add up? The unit KL table of the point's widths (cached), then
  harness.sensitivity.additivity_check: N random joint allocations within --budget mean bits, predicted (summed
  unit KL) against measured KL on the table's probe sequences;
- chain (`--chain W`): how a cross-layer prediction's error grows along its chain (harness.sensitivity.chain) at
  width W on the first S evaluation sequences, the point's scheme fitted as its sweep point fits it;
- finer widths (`--finer-widths STEP --budgets B,B,...`, pca): what unit totals in steps of 1 / STEP bits would buy
  the measured knapsack at each budget, by its own prediction (harness.sensitivity.finer_widths), from the unit KL
  table of the point's whole widths (cached) and the pca fit's plan distortions;
- one exact (`--one-exact N --width W`): with every unit at W, does keeping one of N random units exact lower the
  KL as separately priced unit costs assume? (harness.sensitivity.one_exact, on the first S evaluation sequences,
  all of them unless --sequences says; with --probe, on the unit-KL table's probe of the calibration windows).

The point comes from the primary config with the overrides (harness.config.compose), validated before the model
loads; the start record is written beside the output CSV (<out>.env.json); the CSV, a JSON summary and the Spearman
correlation (for additivity also the ratio measured / predicted; for one exact, instead, the mean change in KL with
its bootstrap interval over the units) are the result.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from harness import data, io
from harness.calibrate import cached_fit
from harness.config import Point, base_point, compose
from harness.io import CONF_DIR, write_atomic, write_text_atomic
from harness.metrics import bootstrap_ci, mean_statistic
from harness.models import ModelUnavailable, load_model
from harness.policies.budget import budget_range, quantized_widths
from harness.run.measure import key_span, point_scheme
from harness.schemes import SCHEMES, Scheme, get_scheme
from harness.sensitivity import (
    additivity_check,
    cached_sensitivity,
    cached_unit_kl,
    measured_widths,
    probe_ids,
    proxy_check,
    sample_heads,
)
from harness.sensitivity.chain import chain_errors
from harness.sensitivity.common import cache_shape
from harness.sensitivity.finer_widths import check_step, fine_widths, finer_widths_check, unit_distortions
from harness.sensitivity.one_exact import one_exact_check
from harness.validate import check_model_inputs, preflight_overrides, validate_config
from kernels.reference import WIDTHS as PACKED_WIDTHS

CHAIN_SEQUENCES = 4  # --chain's evaluation sequences unless --sequences says


def main(argv: list[str] | None = None) -> None:
    """`python -m harness.sensitivity --model NAME --check-heads N [--width W] [--out CSV] [overrides]`."""
    parser = _parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    command = io.command_line("python -m harness.sensitivity", argv)
    try:  # before the model loads: the point, threads, a clean tree for results/, <out>.env.json
        cfg, point, scheme = _check_context(args)
        name, run_check = _which_check(args, point, scheme)
        out = args.out or Path("results/sensitivity") / f"{name}.csv"
        io.set_threads(cfg.threads)
        io.check_writable(out.parent, key="--out")
        io.check_clean(out.parent, cfg.allow_dirty)
    except (ValueError, ModelUnavailable) as err:
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    io.start_record(out.parent, command, "cpu", cfg.allow_dirty, name=out.with_suffix(".env.json").name)
    run_check(args, point, scheme, out, command=command)


def _which_check(args: argparse.Namespace, point: Point, scheme: Scheme) -> tuple[str, Callable]:
    """The check the flags ask for: its output's default name (without .csv) and the function that runs it."""
    if args.chain is not None:
        return f"chain-{point.model}-{scheme.name}-w{args.chain}", _run_chain
    if args.finer_widths is not None:
        return f"finer-widths-{point.model}-{scheme.name}-{args.finer_widths}", _run_finer_widths
    if args.additivity:
        return f"additivity-{point.model}-{scheme.name}", _run_additivity
    if args.one_exact is not None:
        probe = f"-probe{point.probe_sequences}x{point.probe_tokens}" if args.probe else ""
        name = f"one-exact-{point.model}-{scheme.name}-w{args.width}-sink{point.sink_tokens}{probe}"
        return name, _run_one_exact
    return f"check-{point.model}-{scheme.name}-w{args.width}", _run_check


def _parser() -> argparse.ArgumentParser:
    """The command's arguments: the check to run and its sizes, then Hydra overrides."""
    parser = argparse.ArgumentParser(
        prog="python -m harness.sensitivity",
        description="Does the sensitivity proxy rank heads like the teacher-forced KL with only that head "
        "quantized? Measures both for a random sample of heads and prints their Spearman correlation. With "
        "--additivity N: do unit KLs add up on N random joint allocations?",
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--check-heads", type=int, default=12, help="how many heads to sample")
    parser.add_argument(
        "--width",
        type=int,
        default=2,
        help="the width every sampled head (--one-exact: every unit) is checked at",
    )
    parser.add_argument(
        "--additivity", type=int, help="instead: check unit-KL additivity on this many random allocations"
    )
    parser.add_argument("--budget", type=float, help="--additivity: mean bits the allocations stay within")
    parser.add_argument(
        "--chain", type=int, help="instead: a cross-layer prediction's error along its chain at this width"
    )
    parser.add_argument(
        "--sequences", type=int, help="--chain, --one-exact: how many evaluation sequences (4; all)"
    )
    parser.add_argument(
        "--finer-widths",
        type=int,
        help="instead (pca): what unit widths in steps of 1 / STEP bits would buy the measured knapsack",
    )
    parser.add_argument(
        "--budgets", type=_numbers, help="--finer-widths: the knapsack's mean bits, comma-separated (4.4,3.3)"
    )
    parser.add_argument(
        "--one-exact",
        type=int,
        help="instead: with every unit at --width, keep each of this many random units exact in turn",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="--one-exact: on the unit-KL probe (eval.calibration.probe) instead of the evaluation sequences",
    )
    parser.add_argument("--out", type=Path, help="CSV path (default results/sensitivity/*.csv)")
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides, e.g. eval=small quant.scheme=sym_token"
    )
    return parser


def _numbers(text: str) -> list[float]:
    """Comma-separated numbers (argparse type: a bad one is a usage error, exit 2)."""
    return [float(part) for part in text.split(",")]


def _check_context(args) -> tuple[DictConfig, Point, Scheme]:
    """The composed config, the point the overrides describe and its scheme, validated before any model loads."""
    overrides = [f"model={args.model}", *args.overrides, *_budget_override(args)]
    preflight_overrides(overrides, CONF_DIR)
    cfg = compose(overrides)
    _check_budget(args, cfg)
    validate_config(cfg)
    point = base_point(cfg)
    if isinstance(args.check_heads, bool) or args.check_heads < 2:
        raise ValueError(f"--check-heads: {args.check_heads} is too few; allowed: an integer >= 2")
    if args.additivity is not None and (isinstance(args.additivity, bool) or args.additivity < 2):
        raise ValueError(f"--additivity: {args.additivity} is too few; allowed: an integer >= 2")
    if args.additivity is not None and point.probe_context is not None:
        raise ValueError(
            f"eval.calibration.probe.context: {point.probe_context} with --additivity, which sums unit KLs measured "
            "alone; allowed: null"
        )
    if args.width not in PACKED_WIDTHS:
        raise ValueError(
            f"--width: {args.width} is not a quantized width; allowed: {', '.join(map(str, PACKED_WIDTHS))}"
        )
    scheme = point_scheme(point)
    if args.sequences is not None and (isinstance(args.sequences, bool) or args.sequences < 1):
        raise ValueError(f"--sequences: {args.sequences} is too few; allowed: an integer >= 1")
    if args.probe and args.one_exact is None:
        raise ValueError("--probe: without --one-exact; allowed: only with --one-exact N")
    if args.chain is not None:
        _check_chain(args, scheme)
    elif args.finer_widths is not None:
        _check_finer_widths(args, point, scheme)
    elif args.one_exact is not None:
        _check_one_exact(args)
    elif scheme.key_tables and args.additivity is None:
        raise ValueError(
            f"quant.scheme: {point.scheme} reads fitted key tables, which the proxy check does not use; "
            f"allowed with {point.scheme}: --additivity N"
        )
    scheme.check_widths([args.width], "--width")
    check_model_inputs(cfg, [point])
    return cfg, point, scheme


def _budget_override(args) -> list[str]:
    """`policy.budget=B` from `--budget B` unless the overrides set policy.budget: the additivity check reads
    --budget, and the point it records (and validates) takes the same budget instead of the default one, which
    need not lie within the point's widths (4 bits with widths 1-3)."""
    if args.budget is None or any(o.lstrip("+").startswith("policy.budget=") for o in args.overrides):
        return []
    return [f"policy.budget={args.budget}"]


def _check_budget(args, cfg: DictConfig) -> None:
    """ValueError naming --budget unless it lies between the narrowest quantized and the widest of policy.widths
    (checked before the config's own checks, which would name policy.budget for it)."""
    widths = list(cfg.policy.get("widths") or ())
    if args.budget is None or not all(isinstance(w, int) for w in widths) or not quantized_widths(widths):
        return  # a malformed policy.widths is validate_config's to name
    low, high = budget_range(widths)
    if not low <= args.budget <= high:
        raise ValueError(
            f"--budget: {args.budget} is outside policy.widths {widths}; allowed: {low} to {high}"
        )


def _check_chain(args, scheme: Scheme) -> None:
    if not scheme.reads_previous_layer:
        chained = [name for name in SCHEMES.names() if get_scheme(name).reads_previous_layer]
        raise ValueError(
            f"quant.scheme: {scheme.name} predicts no layer from the layer below; allowed with --chain: "
            f"{', '.join(chained)}"
        )
    if args.chain not in scheme.widths:
        allowed = ", ".join(map(str, scheme.widths))
        raise ValueError(f"--chain: {args.chain} is not a width {scheme.name} stores; allowed: {allowed}")


def _check_one_exact(args) -> None:
    if isinstance(args.one_exact, bool) or args.one_exact < 2:
        raise ValueError(f"--one-exact: {args.one_exact} is too few; allowed: an integer >= 2")
    if args.probe and args.sequences is not None:
        raise ValueError(
            "--sequences: with --probe, which reads eval.calibration.probe.num_sequences; allowed: one of them"
        )


def _check_finer_widths(args, point: Point, scheme: Scheme) -> None:
    check_step(args.finer_widths, scheme)
    whole = measured_widths(point.widths)
    if whole != list(range(whole[0], whole[-1] + 1)) or len(whole) < 2:
        raise ValueError(
            f"policy.widths: {list(point.widths)}; --finer-widths needs every whole width between its narrowest "
            "and widest measured, e.g. [1, 2, 3, 4, 5, 6]"
        )
    if not args.budgets:
        raise ValueError(
            "--budgets: missing; --finer-widths needs the knapsack's mean bits, e.g. --budgets 4.4,3.3"
        )
    outside = [b for b in args.budgets if not whole[0] <= b <= whole[-1]]
    if outside:
        raise ValueError(f"--budgets: {outside[0]} is outside the widths; allowed: {whole[0]} to {whole[-1]}")


def _run_finer_widths(args, point: Point, scheme: Scheme, out: Path, command: str) -> None:
    model, calibration, _, table = _unit_kl_of(point, scheme)
    whole = measured_widths(point.widths)
    widths = fine_widths(whole, args.finer_widths)
    distortion = unit_distortions(model, calibration, scheme.pca_format, widths, cache_shape(model))
    rows, checked = finer_widths_check(table, distortion, whole, args.finer_widths, args.budgets)
    write_atomic(out, lambda tmp: rows.to_csv(tmp, index=False))
    summary = dict(
        command=command,
        step=args.finer_widths,
        budgets=args.budgets,
        leave_one_out=checked.to_dict(orient="records"),
        point=point.to_dict(),
    )
    write_text_atomic(out.with_suffix(".json"), json.dumps(summary, indent=1, default=str))
    print(checked.to_string(index=False))
    print(rows.to_string(index=False))
    print(
        f"predicted summed unit KL with widths in steps of 1/{args.finer_widths} bit against whole widths "
        f"({point.model}, {scheme.name}, widths {whole}); wrote {out}"
    )


def _run_chain(args, point: Point, scheme: Scheme, out: Path, command: str) -> None:
    model, windows, fitted, _ = _fitted_model(point, scheme)
    sequences = windows.sequences[: args.sequences or CHAIN_SEQUENCES]
    rows = chain_errors(model, sequences, fitted, args.chain)
    write_atomic(out, lambda tmp: rows.to_csv(tmp, index=False))
    worst = rows.loc[rows.predicted.idxmax()]
    summary = dict(
        command=command,
        width=args.chain,
        sequences=list(sequences.shape),
        worst=worst.to_dict(),
        point=point.to_dict(),
    )
    write_text_atomic(out.with_suffix(".json"), json.dumps(summary, indent=1, default=str))
    print(rows.to_string(index=False))
    print(
        f"largest prediction error from what the chain restored: {worst.predicted:.3g} of the states' squared norm "
        f"(layer {worst.layer} {worst.role}s; {worst.predicted_from_exact:.3g} from the exact states), "
        f"{point.model}, {scheme.name} at {args.chain} bits over {sequences.shape[0]} x {sequences.shape[1]} "
        f"tokens; wrote {out}"
    )


def _run_one_exact(args, point: Point, scheme: Scheme, out: Path, command: str) -> None:
    model, windows, fitted, _ = _fitted_model(point, scheme)
    if args.probe:  # the unit-KL table's probe: calibration text
        sequences = probe_ids(windows.calibration, point.probe_sequences, point.probe_tokens)  # (S, T)
    else:
        sequences = windows.sequences[: args.sequences]  # (S, T)
    try:
        rows = one_exact_check(
            model, sequences, scheme, args.width, args.one_exact, point.seed, point.chunk, fitted
        )
    except ValueError as err:  # more units asked for than the model caches: known once it has loaded
        print(f"error: {str(err).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    write_atomic(out, lambda tmp: rows.to_csv(tmp, index=False))
    difference = rows["difference"].to_numpy()
    low, high = bootstrap_ci(mean_statistic(difference), len(difference), seed=point.seed)
    summary = dict(
        command=command,
        width=args.width,
        sequences=list(sequences.shape),
        text="calibration probe" if args.probe else "evaluation",
        kl_all=float(rows["kl_all"].iloc[0]),
        mean_difference=float(difference.mean()),
        interval=[low, high],
        units=len(rows),
        raised=int((difference > 0).sum()),
        point=point.to_dict(),
    )
    write_text_atomic(out.with_suffix(".json"), json.dumps(summary, indent=1, default=str))
    print(rows.to_string(index=False))
    print(
        f"one unit exact, the rest at {args.width} bits: KL {summary['mean_difference']:+.3g} [{low:+.3g}, "
        f"{high:+.3g}] nats against all at {args.width} ({summary['kl_all']:.4g}), raised for {summary['raised']} "
        f"of {len(rows)} units ({point.model}, {scheme.name}, sink_tokens={point.sink_tokens}, "
        f"{sequences.shape[0]} x {sequences.shape[1]} tokens of {summary['text']} text); wrote {out}"
    )


def _run_check(args, point: Point, scheme: Scheme, out: Path, command: str) -> None:
    model, tokenizer = load_model(point.model, dtype=point.dtype)
    windows = data.point_windows(tokenizer, point)
    calibration, sequences = windows.calibration, windows.sequences
    widths = sorted(set(measured_widths(point.widths)) | {args.width})
    source, _ = data.calibration_source(point)
    table = cached_sensitivity(model, point.model, calibration, scheme, widths, source)
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


def _fitted_model(point: Point, scheme: Scheme):
    """The point's model, its windows (harness.data.point_windows), the parts its scheme fits on the calibration
    windows as its sweep point fits them (None for a scheme without any) and the calibration source."""
    model, tokenizer = load_model(point.model, dtype=point.dtype)
    windows = data.point_windows(tokenizer, point)
    source, _ = data.calibration_source(point)
    fitted = cached_fit(
        scheme, model, point.model, windows.calibration, key_span(point), point.key_levels, source
    )
    return model, windows, fitted, source


def _unit_kl_of(point: Point, scheme: Scheme):
    """The point's model, its calibration windows (C, Tc), the fitted parts its scheme reads (a calkey or pca
    point's key tables, as its sweep point fits them: the unit KLs are measured through them; None for others)
    and its unit KL table (cached)."""
    model, windows, tables, source = _fitted_model(point, scheme)
    calibration = windows.calibration
    table = cached_unit_kl(
        model,
        point.model,
        calibration,
        scheme,
        point.widths,
        point.chunk,
        point.probe_sequences,
        point.probe_tokens,
        key_calibration=tables,
        source=source,
        context=point.probe_context,
    )
    return model, calibration, tables, table


def _run_additivity(args, point: Point, scheme: Scheme, out: Path, command: str) -> None:
    model, calibration, tables, table = _unit_kl_of(point, scheme)
    ids = probe_ids(calibration, point.probe_sequences, point.probe_tokens)  # the table's sequences
    rows, rho, ratio = additivity_check(
        model, ids, table, scheme, args.additivity, args.budget, point.seed, point.chunk, tables
    )
    write_atomic(out, lambda tmp: rows.to_csv(tmp, index=False))
    summary = dict(
        command=command, spearman=rho, ratio=ratio, draws=len(rows), budget=args.budget, point=point.to_dict()
    )
    write_text_atomic(out.with_suffix(".json"), json.dumps(summary, indent=1, default=str))
    print(rows.to_string(index=False))
    print(
        f"spearman(predicted, measured) = {rho:.3f}, measured / predicted = {ratio:.3f} over {len(rows)} "
        f"allocations ({point.model}, {scheme.name}, widths {list(point.widths)}); wrote {out}"
    )
