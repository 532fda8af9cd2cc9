"""`python -m harness.export RUN_DIR KEY --out allocation.json`: a recorded point's allocation and scheme, as the
file harness.load_allocation reads (harness/api.py), for one's own generate() call.

The point's record (RUN_DIR/points/KEY.json) holds its widths (key_bits, value_bits) and its configuration, from
which the scheme is rebuilt (harness.schemes.from_point). Which 16-bit heads are sinks follows from the policy:
with no 16 among its widths only a sink is kept at 16; with 16 among them and no sink rule there are none; with both,
the record does not say (sinks null). Pre-rounding levels are not recorded (null). `source` in the file names the
run, the point, its commit and its headline metrics, and where the parts its scheme reads were fitted:
`calibration` (harness.calibration's keywords for the point's calibration windows), `calibration_source` (their
text), `span` (quantized_cache's: the key tables' positions) and `probe` (the measured policy's unit-KL probe,
harness.allocate's probe=: sequences, tokens and, where set, the context width), so that the same model fits the
same parts and measures the same table.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

import torch

from harness.allocation_file import save_allocation
from harness.config import HARNESS, Point
from harness.data import calibration_source, source_name
from harness.policies import Allocation, SinkPolicy, from_point
from harness.run.measure import key_span
from harness.schemes import from_point as scheme_from_point
from kernels.layout import FULL_WIDTH

METRICS = ("ppl_ratio", "kl_mean", "top1_agree", "compression_true", "bytes_per_token", "mean_bits")


def read_point(run_dir: Path, key: str) -> dict:
    """The record of point `key` in run_dir/points; ValueError naming RUN_DIR or KEY (with the closest keys)."""
    points = run_dir / "points"
    if not points.is_dir():
        raise ValueError(f"RUN_DIR: {run_dir} has no points/ folder (a run directory of python -m harness)")
    path = points / f"{key}.json"
    if not path.exists():
        keys = sorted(p.stem for p in points.glob("*.json"))
        close = difflib.get_close_matches(key, keys, n=3, cutoff=0.3)
        hint = f"; closest: {', '.join(close)}" if close else f"; {len(keys)} points there"
        raise ValueError(f"KEY: no point {key!r} in {points}{hint}")
    return json.loads(path.read_text())


def exported(record: dict) -> tuple[Allocation, object, dict]:
    """(allocation, scheme, source) of a finished harness point's record; ValueError naming KEY otherwise."""
    config, key = record["config"], record.get("key")
    if config.get("engine", HARNESS) != HARNESS:
        raise ValueError(
            f"KEY: {key} is a point of the peer engine {config['engine']}, which has no allocation"
        )
    if record.get("status") != "ok" or "allocation" not in record:
        what = (
            "the unquantized baseline"
            if config.get("policy") == "baseline"
            else f"status {record.get('status')}"
        )
        raise ValueError(f"KEY: {key} has no allocation ({what})")
    point = Point.from_dict(config)
    widths = record["allocation"]
    # records made before keys and values could differ hold one width per head: `bits`
    key_bits = torch.tensor(widths.get("key_bits", widths.get("bits")))
    value_bits = torch.tensor(widths.get("value_bits", widths.get("bits")))
    policy = from_point(point.group("policy"))
    sinks = (key_bits == FULL_WIDTH) & (value_bits == FULL_WIDTH)  # only sinks at 16 without 16 in the widths
    if FULL_WIDTH in policy.widths:
        has_rule = isinstance(policy, SinkPolicy) and policy.has_sink_rule
        sinks = None if has_rule else torch.zeros_like(sinks)
    allocation = Allocation.from_dict(
        {
            "policy": point.policy,
            "key_bits": key_bits.tolist(),
            "value_bits": value_bits.tolist(),
            "sinks": None if sinks is None else sinks.tolist(),
        }
    )
    source = {
        "key": key,
        "model": point.model,
        "dtype": point.dtype,
        "policy": policy.label(),
        "budget": point.budget,
        "prefill": point.prefill,
        "git_commit": record.get("git_commit"),
        "sinks_recorded": sinks is not None,
        "metrics": {m: record["metrics"][m] for m in METRICS if m in record.get("metrics", {})},
        "calibration": {
            "sequences": point.calibration_sequences,
            "tokens": point.calibration_tokens,
            "i0": point.i0,
            "seed": point.seed,
            "bos": point.bos,
        },
        "calibration_source": source_name(calibration_source(point)[0]),
        "span": key_span(point),
        "probe": [point.probe_sequences, point.probe_tokens]
        + ([point.probe_context] if point.probe_context is not None else []),
    }
    return allocation, scheme_from_point(point.group("quant")), source


def main(argv: list[str] | None = None) -> None:
    """The command: argv as after `python -m harness.export`; exit code 2 with one line for bad input."""
    parser = argparse.ArgumentParser(prog="python -m harness.export", description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", type=Path, help="a run directory, e.g. results/frontier/RUN"
    )
    parser.add_argument("key", metavar="KEY", help="the point's key (the stem of points/KEY.json)")
    parser.add_argument("--out", type=Path, default=Path("allocation.json"), help="the file written")
    args = parser.parse_args(argv)
    try:
        allocation, scheme, source = exported(read_point(args.run_dir, args.key))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    path = save_allocation(args.out, allocation, scheme, run_dir=str(args.run_dir), **source)
    print(f"{path}: {scheme.label()}, {source['policy']} at budget {source['budget']} ({source['model']})")


if __name__ == "__main__":
    main()
