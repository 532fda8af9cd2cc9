"""`python -m kernels.gpu.check --out DIR`: check and benchmark the whole GPU path in one run of under 20 minutes.

This module owns that run. From the repository root on a CUDA machine it runs, each stage in its own process
with its own time limit (so a stage that hangs or crashes costs only its own share, and what it wrote stays):
1. install: the wheels in `.whl/` (`make gpu-wheels` downloads them) into /tmp/site, put first on PYTHONPATH
   for every later stage: for a machine that has torch, triton and transformers but not the rest (no network);
2. metadata: GPU name, driver, CUDA, Python / torch / triton / transformers versions, git commit
   (metadata.json);
3. tests: `pytest -m gpu` (kernels against the oracle, the CUDA graph replay, generate() triton == torch on
   the tiny models, mixed widths), as tests.xml;
4. ab: `python -m kernels.gpu.ab` of the kernel versions in `.ab/` (`make gpu-ab-baseline` puts the Makefile's
   AB_BASELINES there) against kernels/decode_attention.py, in one process at the headline shape, then the codes-only
   path at the frontier points' maps, a query per 128 tokens and then per 32 (ab.csv);
5. ncu: `python -m kernels.gpu.ncu` (Nsight Compute on stage 1 at 4, 2 and 8 bits: ncu.csv);
6. bench: `python -m kernels.gpu.bench` (decode.csv, decode.png);
7. e2e: `python -m kernels.gpu.e2e` of DynamicCache, 4 bits, a mixed map, and pca's flat (pca4) and grouped (ugs5)
   formats, 4 bits and the mixed map also decoded from CUDA graph replays, 24 new tokens, three more steps of
   model.generate profiled (e2e.csv, e2e.png, e2e-profile-<cache>.txt);
8. runner: `python -m kernels.gpu.runner_check` (runner.csv: the smoke grid on CUDA/triton against CPU/torch);
9. a README.md with the stage outcomes, DESIGN.md section 8's targets read off decode.csv (or ab.csv), and per
   width the measured time and share of copy bandwidth beside the static figures of results/kernels/inspect.csv
   (kernels.gpu.inspect, made with `make inspect`) and ncu's counters.
Everything goes to DIR/results/kernels/<gpu name>/ (logs in logs/). `--dry-run` runs every stage's code on
CPU under TRITON_INTERPRET=1 at tiny sizes and skips the install: a check that nothing has rotted; its
figures are no measurement.
`--minutes M` (2 to 20) scales every stage's limit by M/20, for a machine lent for less time: the bench
runs its headline shape first and stops starting shapes when its share is spent; a stage cut short says so in
the README. `--lease` is one call of at most 8 minutes for a machine lent for 15 (LEASE_BUDGET: every stage but the
bench, each with less work: issue 45's format family in the A/B and e2e beside asym_token's kernel and `4`); it
needs no older kernel in `.ab/` (the A/B then times the current kernel alone beside SDPA). Where the tree is a copy,
HARNESS_COMMIT=<commit> in the environment names its commit in metadata.json. This file imports only the
standard library: the packages come with the install stage.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

SITE = "/tmp/site"
WHEELS = Path(".whl")
# stage -> seconds: 19 1/2 minutes at most, the rest of the 20 for starting up and the README. What each stage took on
# the H200 at b6a3e8f (results/kernels/NVIDIA_H200/check-b6a3e8f): install 1 s, metadata 7, tests 88 (twelve
# processes), ncu 13, the A/B about 5 minutes with one older version (its codes rows compile on first call: about 2
# minutes for every map at 128-token blocks, more at 32), e2e two caches in 144 s (the model's build, a 32K-token
# prefill of 20 s a cache), the runner's six harness runs, side by side, over a minute. Scaled to a lease's 8 minutes
# the limits cut most stages short: there, name the stages a call owes with --stages and keep --minutes 20, each
# stage's whole limit.
BUDGET = {"install": 20, "metadata": 20, "tests": 150, "ab": 300, "ncu": 30, "bench": 120, "e2e": 360,
          "runner": 150}  # fmt: skip
# `--lease`: one call of at most 8 minutes, for a lease of 15 with its machine's start: issue 45's GPU check of the
# format family the fused path reads closest to the frontier (pca_block32_ugsa), sized from the H200 run above. The
# tests; the A/B of that family's two knapsacks at a query per 32 tokens beside asym_token's 4-bit kernel, the
# 16-bit one and cuDNN SDPA in one process (at b6a3e8f one such process, compiles included, ran inside the second
# call's few minutes); ncu; e2e of DynamicCache, `4`, the family's cache and the two graph-replayed caches, without
# profiles (about 25 s a cache: a 20 s prefill, 24 steps); the runner. No bench: the A/B holds the targets' rows.
LEASE_BUDGET = {"install": 10, "metadata": 10, "tests": 110, "ab": 100, "ncu": 20, "bench": 0, "e2e": 170,
                "runner": 60}  # fmt: skip
LEASE_STAGES = tuple(stage for stage, seconds in LEASE_BUDGET.items() if seconds)
DRY_BUDGET = {"install": 0, "metadata": 60, "tests": 120, "ab": 180, "ncu": 0, "bench": 120, "e2e": 180,
              "runner": 300}  # fmt: skip
AB_DIR = Path(".ab")  # older kernel versions to time against the current one (make gpu-ab-baseline)
KERNEL = Path("kernels/decode_attention.py")
INSPECT_CSV = Path("results/kernels/inspect.csv")
STAGES = tuple(BUDGET)
# The test files with GPU-marked tests (the others import packages a GPU machine may lack, e.g. nbclient).
GPU_TEST_FILES = (
    "tests/kernels/test_reference.py",
    "tests/kernels/test_triton_kernels.py",
    "tests/kernels/test_quantize_codes.py",
    "tests/kernels/test_groups.py",
    "tests/harness/test_fused_backend.py",
    "tests/harness/test_eviction.py",
    "tests/harness/test_graphed.py",
    "tests/harness/test_graphed_pca.py",
)
TARGETS = {"speedup_4bit": 2.5, "frac_bw_4bit": 0.60, "speedup_2bit": 4.0, "mixed_vs_uniform": 1.10}
# The codes-only path (the pca family's kernel, issue 45) at the width proportions of the frontier's measured
# knapsacks over pca_block_uf (results/frontier, section "The format the decode kernel reads"), and its targets
# against the fastest 16-bit attention
FRONTIER = Path("results/frontier/2026-11-24_frontier/points")
CODES_POINTS = {"3.5x": FRONTIER / "f7becda42284dfac.json", "6x": FRONTIER / "0ba2efcd0b14a3b4.json"}
CODES_TARGETS = {"3.5x": 2.3, "6x": 3.5}
# ... and over pca_block_ugs (grouped rows, kernels/groups.py), with smollm2-135m's fitted plans (the same for keys
# and values, every width's: harness.calibrate's pca_block_ugs fit) at the benchmark's head_dim 128 (each group of 16
# components two), and plans of the dry run's head_dim 32 (two groups); and over pca_block_ugsa (any group width 0-8,
# its planes summed), with its fitted plans the same way
GROUPED_POINTS = {"3.5x": FRONTIER / "b0a74dacb5380ec6.json", "6x": FRONTIER / "bb2384b039379b5e.json"}
GROUPED_PLANS = [
    "1=2,2,1,1,1,1,0,0",
    "2=4,4,2,2,1,1,1,1",
    "3=4,4,4,4,2,2,2,2",
    "5=8,8,4,4,4,4,4,4",
    "6=8,8,8,8,4,4,4,4",
]
GROUPED_PLANS_DRY = ["1=2,0", "2=4,0", "3=4,2", "5=8,2", "6=8,4"]
PLANES_POINTS = {"3.5x": FRONTIER / "be0dd2da55481044.json", "6x": FRONTIER / "79cf23d35e5cfa22.json"}
PLANES_PLANS = [
    "1=2,2,1,1,1,1,0,0",
    "2=3,3,2,2,2,2,1,1",
    "3=4,4,3,3,3,3,2,2",
    "4=5,5,4,4,4,4,3,3",
    "5=6,6,5,5,5,5,4,4",
    "6=7,7,6,6,6,6,5,5",
]
PLANES_PLANS_DRY = ["1=2,0", "2=3,1", "3=4,2", "4=5,3", "5=6,4", "6=7,5"]
# ... and over pca_block32_ugsa (pca_block_ugsa with keys in blocks of 32 tokens: a query per 32 tokens, read at
# `--qblock 32`), with its fitted plans: keys' and values' alike but at 1 bit
PLANES32_POINTS = {"3.5x": FRONTIER / "0e7792afc12b286e.json", "6x": FRONTIER / "29a78fc0f65772fa.json"}
PLANES32_PLANS = ["k1=3,3,1,1,0,0,0,0", "v1=2,2,1,1,1,1,0,0", *PLANES_PLANS[1:]]


def stage_arguments(dry: bool, budget: dict, lease: bool = False) -> dict[str, list[str]]:
    """The arguments of the stages that run otherwise in a dry run (tiny sizes on CPU under the interpreter)
    than on a GPU, and in a lease's call (`--lease`) than in the whole check: bench, e2e, runner, tests and ab."""
    if dry:
        bench = ["--dry-run", "--configs", "32x8", "--batch", "2", "--context", "40", "--widths", "2", "mixed",
                 "--quantize-tokens", "8"]  # fmt: skip
        e2e = ["--dry-run", "--context", "20", "--batch", "1", "--new-tokens", "3", "--chunk", "8",
               "--caches", "dynamic", "mixed", "pca4", "mixed-graph"]  # fmt: skip
        # (ugs5 and ugsa4 are pca4's code with grouped plans, whose kernel the ab stage's dry run reads: 15 and 35 s
        # more of the interpreter here, so left to the GPU run)
        runner = ["--dry-run", "--timeout", str(budget["runner"] - 10)]
        tests = ["tests/kernels/test_triton_kernels.py"]
        ab = ["--dry-run", "--batch", "2", "--context", "40", "--widths", "4", "16", "--codes", "4",
              "--codes-allocation", str(CODES_POINTS["3.5x"]),
              "--grouped", str(GROUPED_POINTS["3.5x"]), *GROUPED_PLANS_DRY,
              "--grouped", str(PLANES_POINTS["3.5x"]), *PLANES_PLANS_DRY]  # fmt: skip
        if lease:  # the lease's work at the dry run's sizes: its format's cache and map, at its block size
            e2e = [*e2e[: e2e.index("--caches") + 1], "dynamic", "4", "ugsa4b32", "mixed-graph"]
            ab = [*ab[: ab.index("--codes")], "--grouped", str(PLANES32_POINTS["3.5x"]), *PLANES_PLANS_DRY,
                  "--qblock", "32"]  # fmt: skip
    else:
        runner = ["--timeout", str(budget["runner"] - 10)]
        # twelve test processes: most of the stage is Triton compiling kernels, on the GPU machine's 16 cores (on the
        # H200 at b6a3e8f: 88 s with twelve; four had not finished in 80)
        bench, tests = [], ["-n", "12", *GPU_TEST_FILES]
        # the headline caches, with three profiled steps each (e2e-profile-<cache>.txt; not the graph replays)
        e2e = ["--caches", "dynamic", "4", "pca4", "ugsa4b32", "ugs5", "4-graph", "mixed-graph", "mixed", "ugsa4",
               "--new-tokens", "24", "--profile", "3"]  # fmt: skip
        grouped = [(path, GROUPED_PLANS) for path in GROUPED_POINTS.values()]
        grouped += [(path, PLANES_PLANS) for path in PLANES_POINTS.values()]
        grouped += [(path, PLANES32_PLANS) for path in PLANES32_POINTS.values()]
        # every codes map at blocks of 128 tokens, then at 32 (a query per 32 tokens: pca_block32_ugsa's, and what
        # the other maps would cost there), last so that nothing else waits on their compiles
        ab = ["--context", "32768", "--widths", "4", "2", "8", "mixed", "16", "3", "--codes", "4", "2",
              "--codes-allocation", *map(str, CODES_POINTS.values()),
              *(arg for path, plans in grouped for arg in ("--grouped", str(path), *plans)),
              "--qblock", "128", "32"]  # fmt: skip
        if lease:
            e2e = ["--caches", "dynamic", "4", "ugsa4b32", "4-graph", "mixed-graph", "--new-tokens", "24"]
            ab = ["--context", "32768", "--widths", "4", "16",
                  *(arg for path in PLANES32_POINTS.values() for arg in ("--grouped", str(path), *PLANES32_PLANS)),
                  "--qblock", "32"]  # fmt: skip
    return {"bench": bench, "e2e": e2e, "runner": runner, "tests": tests, "ab": ab}


def stage_commands(folder: Path, dry: bool, budget: dict, lease: bool = False) -> dict[str, list[str]]:
    """Each stage's command line, writing into `folder`, for a dry run or a GPU run with `budget`'s limits (a
    lease's call with `lease`)."""
    py = sys.executable
    args = stage_arguments(dry, budget, lease)
    return {
        "install": [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            SITE,
            *map(str, sorted(WHEELS.glob("*.whl"))),
        ],  # fmt: skip
        "metadata": [py, "-m", "kernels.gpu.check", "--metadata", str(folder / "metadata.json")],
        "tests": [
            py,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            "--junitxml",
            str(folder / "tests.xml"),
            *args["tests"],
        ],
        "bench": [
            py,
            "-m",
            "kernels.gpu.bench",
            "--out",
            str(folder),
            "--time-budget",
            str(max(budget["bench"] - 45, budget["bench"] // 2)),  # the rest: plot, quantize bench
            *args["bench"],
        ],
        "ab": [
            py,
            "-m",
            "kernels.gpu.ab",
            *map(str, ab_versions(folder, dry)),
            "--out",
            str(folder / "ab.csv"),
            *args["ab"],
        ],
        "ncu": [py, "-m", "kernels.gpu.ncu", "--widths", "4", "2", "8", "--out", str(folder)],
        "e2e": [py, "-m", "kernels.gpu.e2e", "--out", str(folder), *args["e2e"]],
        "runner": [py, "-m", "kernels.gpu.runner_check", "--out", str(folder / "runner"), *args["runner"]],
    }


def ab_versions(folder: Path, dry: bool) -> list[Path]:
    """The files the ab stage times: the versions in AB_DIR, then the current kernel (alone beside SDPA where AB_DIR
    holds none). A dry run with no older version times a copy of the current one beside it, so that the code
    runs."""
    older = sorted(AB_DIR.glob("*.py"))
    if dry and not older:
        older = [folder / "copy_of_current.py"]
        if KERNEL.exists():
            older[0].write_text(KERNEL.read_text())
    return [*older, KERNEL]


def scaled_budget(budget: dict, minutes: float) -> dict:
    """Each stage's limit times minutes/20 (whole seconds, at least 10): the same shares in a shorter run."""
    return {stage: max(10, round(seconds * minutes / 20)) for stage, seconds in budget.items()}


def skip_reason(stage: str, dry: bool) -> str:
    """Why a stage does not run here ("" when it does)."""
    if stage == "install" and (dry or not list(WHEELS.glob("*.whl"))):
        return "dry run" if dry else "no wheels in .whl/"
    if stage == "ncu" and dry:
        return "dry run (no GPU counters)"
    return ""


def run_stage(cmd: list[str], timeout: float, log: Path, env: dict) -> tuple[int, float]:
    """Run cmd in its own process group with output to `log`; on timeout kill the whole group. (rc, seconds)"""
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    return rc, time.monotonic() - t0


def metadata() -> dict:
    """What the GPU run ran on: device, driver, CUDA and package versions."""
    import platform

    import torch
    import transformers
    import triton

    meta = {
        "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
        "transformers": transformers.__version__, "cuda": torch.version.cuda,
        "gpu": "dry-run-cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "no-cuda-device",
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }  # fmt: skip
    commit, named = _git("rev-parse", "HEAD"), os.environ.get("HARNESS_COMMIT")
    if named:  # the caller names the commit a copied tree came from (a .git copied with it may be stale)
        meta["commit"], meta["dirty"] = named, "unknown (HARNESS_COMMIT names the commit)"
        if commit and commit != named:
            meta["git_head"] = f"{commit} (the copied .git; not the tree's commit)"
    elif commit:
        meta["commit"] = commit
        meta["dirty"] = bool(_git("status", "--porcelain", "--untracked-files=no"))
    else:
        meta["commit"], meta["dirty"] = "unknown (no git checkout)", "unknown (no git checkout)"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}")  # fmt: skip
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)  # fmt: skip
            meta["driver"] = smi.stdout.strip().split(",")[0]
        except (OSError, subprocess.TimeoutExpired):
            meta["driver"] = "unknown (nvidia-smi did not answer)"
    return meta


def _git(*args: str) -> str:
    """git's output for this checkout, or "" where there is no git or no repository."""
    try:
        proc = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def gpu_folder_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "gpu"


def read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def _num(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def targets(rows: list[dict]) -> list[tuple[str, float, str, str]]:
    """DESIGN.md section 8's targets from decode.csv at 32x8, batch 8, context 32K: (name, value, target, met)."""
    at = [
        r
        for r in rows
        if (r["config"], r["batch"], r["context"]) == ("32x8", "8", "32768") and _num(r["time_us"]) > 0
    ]
    base = [_num(r["time_us"]) for r in at if r["method"].startswith(("sdpa_", "flex_decode"))]
    fused = {r["widths"]: r for r in at if r["method"] == "fused"}
    if not base or "4" not in fused:
        return []
    fp16 = min(base)
    out = [
        (
            "4-bit fused vs fastest 16-bit",
            fp16 / _num(fused["4"]["time_us"]),
            f">= {TARGETS['speedup_4bit']}x",
        )
    ]
    out.append(
        (
            "4-bit fused: fraction of copy bandwidth",
            _num(fused["4"]["frac_copy_bw"]),
            f">= {TARGETS['frac_bw_4bit']}",
        )
    )
    if "2" in fused:
        out.append(
            (
                "2-bit fused vs fastest 16-bit",
                fp16 / _num(fused["2"]["time_us"]),
                f">= {TARGETS['speedup_2bit']}x",
            )
        )
    mixed = [r for w, r in fused.items() if "," in w]
    if mixed:
        out.append(
            (
                "mixed (mean 4) time / uniform 4",
                _num(mixed[0]["time_us"]) / _num(fused["4"]["time_us"]),
                f"<= {TARGETS['mixed_vs_uniform']}",
            )
        )
    met = lambda v, t: (
        (v >= float(t.split()[1].rstrip("x"))) if t.startswith(">=") else (v <= float(t.split()[1]))
    )  # noqa: E731
    return [(n, v, t, "yes" if met(v, t) else "no") for n, v, t in out]


def codes_targets(rows: list[dict], kind: str = "codes") -> list[tuple[str, float, str, str]]:
    """The codes-only path's targets from ab.csv at 32x8, batch 8, context 32K: its time at each CODES_POINTS,
    GROUPED_POINTS and PLANES_POINTS map
    (method <kind>:<KERNEL stem>, kind "codes" as launched, "codes-graph" replayed) against the fastest 16-bit
    attention, as `targets` gives them."""
    at = [r for r in rows if (r["config"], r["batch"], r["context"]) == ("32x8", "8", "32768")]
    at = [r for r in at if _num(r["time_us"]) > 0]
    base = [_num(r["time_us"]) for r in at if r["method"].startswith("sdpa_")]
    out = []
    points = [("codes-only", point, path) for point, path in CODES_POINTS.items()]
    points += [("grouped codes", point, path) for point, path in GROUPED_POINTS.items()]
    points += [("grouped codes (planes)", point, path) for point, path in PLANES_POINTS.items()]
    points += [
        ("grouped codes (planes, keys in 32-token blocks)", p, path) for p, path in PLANES32_POINTS.items()
    ]
    mine = [r for r in at if r["method"] == f"{kind}:{KERNEL.stem}"]
    if not base:
        return out
    for label, point, path in points:
        # a query per 128 tokens, then per 32 (ab's --qblock 128 32): the first row at each block size
        by_qblock: dict[str, dict] = {}
        for r in mine:
            name, qblock = r["note"].split(";")[0], _note_field(r["note"], "qblock")
            if name == path.stem and qblock not in by_qblock:
                by_qblock[qblock] = r
        for qblock, r in by_qblock.items():
            speedup, wanted = min(base) / _num(r["time_us"]), CODES_TARGETS[point]
            blocks = "" if qblock == "128" else f", a query per {qblock} tokens"
            name = f"{label} at the {point} point's widths ({r['widths']}{blocks}) vs fastest 16-bit"
            out.append((name, speedup, f">= {wanted}x", "yes" if speedup >= wanted else "no"))
    return out


def _note_field(note: str, field: str) -> str:
    """The value of `field=value` in an ab.csv note ("4; qblock=32; splits=4" -> "32" for qblock), "" if absent."""
    for part in note.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == field:
            return value
    return ""


def ab_as_decode(rows: list[dict], kind: str = "fused") -> list[dict]:
    """ab.csv's rows of the current kernel (method <kind>:<KERNEL stem>, default splits; kind "fused" as launched
    from Python, "graph" as replayed from a CUDA graph) as decode.csv's fused rows, beside its SDPA rows, so that
    `targets` reads either file."""
    current, out = f"{kind}:{KERNEL.stem}", []
    by_widths: dict[str, dict] = {}
    for r in rows:
        if r["method"].startswith("sdpa_"):
            out.append(r)
        elif r["method"] == current and r["widths"] not in by_widths:
            by_widths[r["widths"]] = {**r, "method": "fused"}  # the first row of a width map: default splits
    return out + list(by_widths.values())


def current_kernel_sha() -> str:
    """kernels.gpu.inspect's kernel_sha of the files here (standard library only, as this module): its
    KERNEL_SOURCES, in their order."""
    import hashlib

    digest = hashlib.sha256()
    for name in ("decode_attention.py", "unpack.py", "groups.py", "layout.py"):
        path = KERNEL.parent / name
        digest.update(path.read_bytes() if path.exists() else b"")
    return digest.hexdigest()[:12]


def kernel_table(ab: list[dict], static: list[dict], counters: list[dict]) -> list[str]:
    """Per kernel version and width: measured time, x SDPA, share of copy bandwidth; for the current kernel the
    static instructions per KV byte (inspect.csv rows made from these kernel files), their product with the
    share, and ncu's counters."""
    if not ab:
        return []
    sdpa = [_num(r["time_us"]) for r in ab if r["method"].startswith("sdpa_")]
    base = min(sdpa) if sdpa else float("nan")
    # figures of this kernel only, and of the formats the A/B times (not inspect --codes rows)
    fresh = [r for r in static if r.get("kernel_sha") == current_kernel_sha() and r.get("format") != "codes"]
    per_byte = {r["key_bits"]: _num(r["instr_per_byte"]) for r in fresh if r["key_bits"] == r["value_bits"]}
    ncu = {r["widths"]: r for r in counters}
    graph = {
        (r["method"][6:], r["widths"]): _num(r["time_us"]) for r in ab if r["method"].startswith("graph:")
    }
    lines = ["", "## Kernel versions (ab.csv, default splits) beside static and counter figures", "",
             "| version | widths | us | graph us | x SDPA | share of copy bw | static instr/byte | share x instr/byte | "
             "ncu: DRAM % of peak | ncu: thread-instr per DRAM byte | ncu: top stalls |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    seen = set()
    for r in ab:
        key = (r["method"], r["widths"])
        if not r["method"].startswith("fused:") or key in seen:
            continue
        seen.add(key)
        t, share = _num(r["time_us"]), _num(r["frac_copy_bw"])
        current = r["method"] == f"fused:{KERNEL.stem}"
        ipb = per_byte.get(r["widths"], float("nan")) if current else float("nan")
        c = ncu.get(r["widths"], {}) if current else {}
        g = graph.get((r["method"][6:], r["widths"]), float("nan"))
        lines.append(f"| {r['method'][6:]} | {r['widths']} | {t:.0f} | {g:.0f} | {base / t:.2f} | {share:.3f} | {ipb:.2f} | "
                     f"{share * ipb:.2f} | {c.get('dram_pct_of_peak', '')} | {c.get('thread_instr_per_dram_byte', '')} "
                     f"| {c.get('top_stalls', '')} |")  # fmt: skip
    return lines


def launch_table(launches: list[dict]) -> list[str]:
    """ab-launches.csv as one line per version and width map: each launch's kernel and device microseconds."""
    calls: dict[tuple[str, str], list[str]] = {}
    for r in launches:
        calls.setdefault((r["version"], r["widths"]), []).append(f"{r['kernel']} {_num(r['device_us']):.0f}")
    if not calls:
        return []
    lines = ["", "## Launches of one call (ab-launches.csv: kernel and device us, in launch order)", "",
             "| version | widths | launches |", "|---|---|---|"]  # fmt: skip
    return lines + [f"| {v} | {w} | {', '.join(ks)} |" for (v, w), ks in calls.items()]


def write_readme(folder: Path, meta: dict, outcomes: list[dict], dry: bool, command: str) -> None:
    lines = [f"# GPU check on {meta.get('gpu', 'unknown')}", ""]
    if dry:
        lines += ["A DRY RUN (CPU, TRITON_INTERPRET=1, tiny sizes): it shows that every stage runs; its times are "
                  "no measurement.", ""]  # fmt: skip
    lines += [f"Command: `{command}`", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in meta.items()]
    lines += ["", "## Stages", "", "| stage | exit code | seconds | limit | log |", "|---|---|---|---|---|"]
    lines += [f"| {o['stage']} | {o['rc']}{' (time limit)' if o['rc'] == 124 else ''}"
              f"{' (' + o['why'] + ')' if o.get('why') else ''} | {o['seconds']:.0f} | "
              f"{o['limit']:.0f} | logs/{o['stage']}.log |" for o in outcomes]  # fmt: skip
    decode = read_csv(folder / "decode.csv")
    ab = read_csv(folder / "ab.csv")
    # the A/B's CUDA-graph replays first (the GPU's own time: what the targets are about), then the calls as launched
    # from Python (the bench's, or the A/B's), whose host side can set the pace
    replayed = targets(ab_as_decode(ab, "graph")) + codes_targets(ab, "codes-graph")
    launched = (targets(decode) or targets(ab_as_decode(ab))) + codes_targets(ab)
    lines += ["", "## Targets (32 query / 8 KV heads, head_dim 128, batch 8, context 32K)", ""]
    if replayed:
        lines += ["Read off the A/B's CUDA-graph replays (the GPU's own time, without the host's launches; SDPA as "
                  "launched):", "", "| target | measured | wanted | met |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {n} | {v:.3g} | {t} | {m} |" for n, v, t, m in replayed]
    if launched:
        lines += ["", "The same as launched from Python (each call's host side included: where it is slower than the "
                  "replay, the host sets the pace):", "", "| target | measured | wanted | met |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {n} | {v:.3g} | {t} | {m} |" for n, v, t, m in launched]
    if not (replayed or launched):
        lines += [
            "Not measured in this run (decode.csv and ab.csv have no fused and 16-bit rows at that shape)."
        ]
    lines += kernel_table(ab, read_csv(INSPECT_CSV), read_csv(folder / "ncu.csv"))
    lines += launch_table(read_csv(folder / "ab-launches.csv"))
    e2e = read_csv(folder / "e2e.csv")
    if e2e:
        lines += [
            "",
            "## End to end (e2e.csv)",
            "",
            "| cache | tokens/s (median step) | step ms: median / max | generate() s | peak GiB above weights | "
            "KV GiB | note |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['cache']} | {_num(r['tokens_per_s']):.4g} | {_num(r.get('step_ms_median')):.4g} / "
            f"{_num(r.get('step_ms_max')):.4g} | {_num(r.get('decode_s')):.3g} | {_num(r['peak_gib']):.3g} | "
            f"{_num(r['kv_gib']):.3g} | {r['note']} |"
            for r in e2e
        ]
    runner = read_csv(folder / "runner" / "runner.csv")
    if runner:
        bad = [r for r in runner if r["ok"] == "False"]
        lines += ["", "## Runner (runner/runner.csv)", "",
                  f"{len({r['key'] for r in runner})} points compared, {len(bad)} outside tolerance "
                  "(tolerances and their reasons: kernels/gpu/runner_check.py)."]  # fmt: skip
    lines += ["", "Files: metadata.json, tests.xml, decode.csv / decode.png (kernels/gpu/bench.py says what each "
              "method and column is), e2e.csv / e2e.png (kernels/gpu/e2e.py), runner/ (kernels/gpu/runner_check.py), logs/."]  # fmt: skip
    (folder / "README.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kernels.gpu.check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="results go to OUT/results/kernels/<gpu name>/")
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny sizes, no install")
    p.add_argument("--stages", nargs="+", help=f"a subset of {', '.join(STAGES)} (default: all; with --lease, "
                   f"{', '.join(LEASE_STAGES)})")  # fmt: skip
    p.add_argument("--minutes", type=float, default=20.0, help="scale the stage limits by MINUTES/20 (<= 20)")
    p.add_argument("--lease", action="store_true",
                   help="one call of at most 8 minutes: the stages and work of LEASE_BUDGET (not with --minutes)")  # fmt: skip
    p.add_argument("--metadata", type=Path, help=argparse.SUPPRESS)  # the metadata stage's own entry point
    args = p.parse_args(argv)
    if args.metadata:
        args.metadata.write_text(json.dumps(metadata(), indent=1))
        return
    if args.out is None:
        p.error("--out is required")
    allowed = LEASE_STAGES if args.lease else STAGES
    args.stages = args.stages or list(allowed)
    for s in args.stages:
        if s not in allowed:
            p.error(
                f"--stages: {s!r} is not a stage{' of a lease' if args.lease else ''}; allowed: {', '.join(allowed)}"
            )
    if not 2 <= args.minutes <= 20:
        p.error(f"--minutes: {args.minutes:g} is not allowed; allowed: 2 to 20")
    if args.lease and args.minutes != 20:
        p.error(
            f"--minutes: {args.minutes:g} is not allowed with --lease; allowed: --lease alone (its own limits)"
        )
    if args.dry_run:
        budget = scaled_budget(DRY_BUDGET, args.minutes)
    else:
        budget = LEASE_BUDGET if args.lease else scaled_budget(BUDGET, args.minutes)
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
        env["PYTHONPATH"] = os.pathsep.join(
            [SITE, os.getcwd()] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
    staging = args.out / "results" / "kernels" / ".pending"
    (staging / "logs").mkdir(parents=True, exist_ok=True)
    command = "python -m kernels.gpu.check " + " ".join(sys.argv[1:] if argv is None else argv)
    outcomes, folder = [], staging
    for stage in [s for s in STAGES if s in args.stages]:
        skip = skip_reason(stage, args.dry_run)
        if skip:
            print(f"[{stage}] skipped: {skip}", flush=True)
            outcomes.append(
                {"stage": stage, "rc": "skipped", "seconds": 0.0, "limit": budget[stage], "why": skip}
            )
            continue
        cmd = stage_commands(folder, args.dry_run, budget, args.lease)[stage]
        print(f"[{stage}] up to {budget[stage]} s: {' '.join(cmd)}", flush=True)
        rc, secs = run_stage(cmd, budget[stage], folder / "logs" / f"{stage}.log", env)
        outcomes.append({"stage": stage, "rc": rc, "seconds": secs, "limit": budget[stage]})
        print(f"[{stage}] exit {rc} after {secs:.0f} s", flush=True)
        if stage == "metadata" and rc == 0:
            name = gpu_folder_name(json.loads((folder / "metadata.json").read_text())["gpu"])
            final = args.out / "results" / "kernels" / name
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                final.rename(final.with_name(f"{name}.previous-{int(time.time())}"))
            folder.rename(final)
            folder = final
    meta_path = folder / "metadata.json"
    meta = (
        json.loads(meta_path.read_text())
        if meta_path.exists()
        else {"gpu": "unknown (metadata stage failed)"}
    )
    write_readme(folder, meta, outcomes, args.dry_run, command)
    print(f"wrote {folder}/README.md")
    sys.exit(0 if all(o["rc"] in (0, "skipped") for o in outcomes) else 1)


if __name__ == "__main__":
    main()
