"""`python -m kernels.gpu.ncu --out DIR`: Nsight Compute on the decode kernel's stage 1 at the headline shape.

This module owns the hardware-counter view of stage 1. It runs itself under `ncu` (`--target`: packed stores of
32 query / 8 KV heads, head_dim 128, batch 8, 32K tokens, bf16, uniform widths; decode_attention called twice
per width, the second stage-1 launch profiled) with the SpeedOfLight, Occupancy, WarpStateStats and
MemoryWorkloadAnalysis sections and the clocks as found (`--clock-control none`), and reads the raw page:
duration, DRAM bytes and share of peak DRAM throughput, instructions issued as a share of peak, achieved
occupancy, registers, warp instructions
executed (so thread-instructions per DRAM byte as measured, beside the static count of kernels.gpu.inspect),
and the three largest stall reasons per issued instruction. It writes ncu.csv (one row per width) and the
raw output to ncu-raw.csv.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

SHAPE = {"hq": 32, "hkv": 8, "head_dim": 128, "batch": 8, "context": 32768}
KERNELS = "regex:_decode_(packed|split)_kernel"
SECTIONS = ("SpeedOfLight", "Occupancy", "WarpStateStats", "MemoryWorkloadAnalysis")
STALL = "smsp__average_warps_issue_stalled_"  # + reason + "_per_issue_active.ratio"
COLUMNS = ["widths", "duration_us", "dram_bytes_read", "dram_pct_of_peak", "issue_pct_of_peak", "achieved_occupancy_pct",
           "registers", "warp_instructions", "thread_instr_per_dram_byte", "top_stalls"]  # fmt: skip


def find_ncu() -> str | None:
    """The ncu binary: on PATH, or in the usual CUDA and Nsight Compute folders."""
    found = shutil.which("ncu")
    if found:
        return found
    candidates = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")) + sorted(
        glob.glob("/usr/local/cuda*/bin/ncu")
    )
    return candidates[-1] if candidates else None


def target(widths: list[int]) -> None:
    """The profiled program: per width, packed stores at SHAPE and two decode_attention calls."""
    from kernels.decode_attention import decode_attention
    from kernels.gpu.bench import fill

    B, hq, hkv, D, L = (SHAPE[k] for k in ("batch", "hq", "hkv", "head_dim", "context"))
    torch.manual_seed(0)
    q = torch.randn(B, hq, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, hkv, L, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, hkv, L, D, dtype=torch.bfloat16, device="cuda")
    for w in widths:
        kst, vst = fill([w] * hkv, k, 32), fill([w] * hkv, v, 32)
        for _ in range(2):
            decode_attention(q, kst, vst, D**-0.5)
        torch.cuda.synchronize()
        del kst, vst


def _number(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return float("nan")


def parse_raw(text: str) -> list[dict[str, str]]:
    """ncu's `--page raw --csv` output -> one {metric name: value} per profiled kernel (units row dropped)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    rows = list(csv.reader(lines))
    if len(rows) < 3:
        return []
    header, records = rows[0], rows[2:]  # rows[1] holds the units
    return [dict(zip(header, r)) for r in records]


def summarize(record: dict[str, str], widths: str) -> dict:
    """The figures of one profiled launch; thread-instructions per DRAM byte = 32 x warp instructions / bytes."""
    read = _number(record.get("dram__bytes_read.sum", "nan"))
    inst = _number(record.get("smsp__inst_executed.sum", "nan"))
    stalls = {
        name[len(STALL) :].removesuffix("_per_issue_active.ratio"): _number(value)
        for name, value in record.items()
        if name.startswith(STALL) and name.endswith("_per_issue_active.ratio")
    }
    top = sorted(((v, k) for k, v in stalls.items() if v == v), reverse=True)[:3]
    return {
        "widths": widths,
        "duration_us": _number(record.get("gpu__time_duration.sum", "nan")) / 1e3,  # base unit: ns
        "dram_bytes_read": read,
        "dram_pct_of_peak": _number(
            record.get("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "nan")
        ),
        "issue_pct_of_peak": _number(
            record.get("sm__inst_executed.sum.pct_of_peak_sustained_elapsed", "nan")
        ),
        "achieved_occupancy_pct": _number(
            record.get("sm__warps_active.avg.pct_of_peak_sustained_active", "nan")
        ),
        "registers": _number(record.get("launch__registers_per_thread", "nan")),
        "warp_instructions": inst,
        "thread_instr_per_dram_byte": round(32 * inst / read, 2) if read > 0 else float("nan"),
        "top_stalls": " ".join(f"{k}={v:.2f}" for v, k in top),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kernels.gpu.ncu", description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", nargs="+", type=int, default=[4, 2, 8])
    p.add_argument("--out", type=Path, help="folder for ncu.csv and ncu-raw.csv")
    p.add_argument("--target", action="store_true", help=argparse.SUPPRESS)  # the profiled program itself
    args = p.parse_args(argv)
    if args.target:
        target(args.widths)
        return
    if args.out is None:
        p.error("--out is required")
    ncu = find_ncu()
    if ncu is None or not torch.cuda.is_available():
        sys.exit("error: kernels.gpu.ncu needs Nsight Compute (ncu) and a CUDA GPU; nothing was run")
    args.out.mkdir(parents=True, exist_ok=True)
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "--kernel-name", KERNELS,
           "--launch-skip", "1", "--launch-count", str(2 * len(args.widths) - 1), "--print-units", "base",
           *[a for s in SECTIONS for a in ("--section", s)], "--metrics", "smsp__inst_executed.sum,dram__bytes_read.sum",
           "--csv", "--page", "raw", sys.executable, "-m", "kernels.gpu.ncu", "--target", "--widths",
           *map(str, args.widths)]  # fmt: skip
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (args.out / "ncu-raw.csv").write_text(proc.stdout + "\n# stderr\n" + proc.stderr)
    records = parse_raw(proc.stdout)
    # launches after the first: (second call of width 0), (first, second of width 1), ...: keep the second calls
    kept = records[0::2]
    rows = [summarize(r, str(w)) for r, w in zip(kept, args.widths)]
    with open(args.out / "ncu.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    for r in rows:
        print(r, flush=True)
    if proc.returncode != 0 or not rows:
        sys.exit(
            f"error: ncu exited {proc.returncode} with {len(records)} profiled launches; see ncu-raw.csv"
        )


if __name__ == "__main__":
    main()
