"""kernels/gpu/check.py and its stages (kernels/gpu/bench.py, kernels/gpu/e2e.py, kernels/gpu/runner_check.py).

The dry run executes every stage's code on CPU under TRITON_INTERPRET=1 at tiny sizes, so that the one GPU
command cannot rot between the runs on a GPU machine.
"""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path

import pytest

from kernels.gpu import bench
from kernels.gpu import check as gpu_check

ROOT = Path(__file__).resolve().parents[3]


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_dry_run_exercises_every_stage(tmp_path, cli):
    proc = cli("kernels.gpu.check", "--dry-run", "--out", str(tmp_path), timeout=900)
    folder = tmp_path / "results" / "kernels" / "dry-run-cpu"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["gpu"] == "dry-run-cpu" and meta["triton_interpret"] is True
    assert {"torch", "triton", "transformers", "python", "commit", "dirty"} <= set(meta)
    readme = (folder / "README.md").read_text()
    assert "DRY RUN" in readme
    for stage in ("metadata", "tests", "ab", "bench", "e2e", "runner"):
        assert re.search(rf"\| {stage} \| 0 \|", readme), stage
    assert re.search(r"\| ncu \| skipped \(dry run", readme)
    ab = _rows(folder / "ab.csv")
    versions = {r["method"] for r in ab if r["method"].startswith("fused:")}
    assert "fused:decode_attention" in versions and len(versions) >= 2
    assert all(float(r["rel_err"]) < 2e-2 for r in ab if r["method"].startswith("fused:"))
    assert "## Kernel versions" in readme
    codes = [r for r in ab if r["method"] == "codes:decode_attention"]  # the pca family's path, at its maps
    points = {gpu_check.CODES_POINTS["3.5x"].stem, gpu_check.GROUPED_POINTS["3.5x"].stem,
              gpu_check.PLANES_POINTS["3.5x"].stem}  # fmt: skip
    assert {r["note"].split(";")[0] for r in codes} == {"4", *points}  # flat and grouped rows, two plan sets
    grouped = {r["note"].split(";")[0] for r in codes if "; grouped [" in r["note"]}
    assert grouped == points - {gpu_check.CODES_POINTS["3.5x"].stem}
    assert all(float(r["rel_err"]) < 1e-2 for r in codes)
    methods = {r["method"] for r in _rows(folder / "decode.csv")}
    assert {"sdpa_default", "flex_decode", "fp8_dequant_sdpa", "fused", "dequant_sdpa", "step_fused", "step_bf16",
            "fused_tuned", "quantize"} <= methods  # fmt: skip
    fused = [r for r in _rows(folder / "decode.csv") if r["method"] == "fused"]
    assert {r["widths"] for r in fused} == {"2", "2,8"} and all(float(r["rel_err"]) < 2e-2 for r in fused)
    e2e = _rows(folder / "e2e.csv")
    assert [r["cache"] for r in e2e] == ["dynamic", "mixed", "pca4", "mixed-graph"] and all(
        float(r["tokens_per_s"]) > 0 for r in e2e
    )
    runner = _rows(folder / "runner" / "runner.csv")
    assert runner and all(r["ok"] != "False" for r in runner)
    assert {"asym_token uniform b=4", "pca_block_uf uniform b=4"} <= {r["point"] for r in runner}
    assert (
        (folder / "tests.xml").exists() and (folder / "decode.png").exists() and (folder / "e2e.png").exists()
    )


def test_stage_budgets_fit_twenty_minutes():
    assert sum(gpu_check.BUDGET.values()) <= 19.5 * 60


def test_a_lease_is_one_call_of_eight_minutes_at_most():
    """--lease: every stage but the bench, limits summing to 8 minutes at most; its ab stage times the closest
    format's two knapsacks (pca_block32_ugsa, a query per 32 tokens) beside asym_token's 4-bit kernel and the 16-bit
    one, its e2e stage that format's cache beside `4`, DynamicCache and the graph-replayed caches, every one a cache
    e2e knows; the other stages as in the whole check."""
    from kernels.gpu import ab, e2e

    assert sum(gpu_check.LEASE_BUDGET.values()) <= 8 * 60
    assert gpu_check.LEASE_STAGES == tuple(s for s in gpu_check.STAGES if s != "bench")
    lease = gpu_check.stage_arguments(False, gpu_check.LEASE_BUDGET, lease=True)
    whole = gpu_check.stage_arguments(False, gpu_check.LEASE_BUDGET)
    assert lease["tests"] == whole["tests"] and lease["runner"] == whole["runner"]
    caches = _flags(lease["e2e"])["--caches"][0]
    assert {"dynamic", "4", "ugsa4b32"} <= set(caches) <= set(e2e.CACHES) and "--profile" not in lease["e2e"]
    flags = _flags(lease["ab"])
    assert flags["--widths"] == [["4", "16"]] and flags["--qblock"] == [["32"]] and "--codes" not in flags
    grouped = [ab.grouped_entry(values) for values in flags["--grouped"]]
    assert [path for path, *_ in grouped] == list(gpu_check.PLANES32_POINTS.values())
    maps = ab.codes_maps(8, [], [], [(ROOT / path, *plans) for path, *plans in grouped])
    assert set(maps) == {p.stem for p in gpu_check.PLANES32_POINTS.values()}


def test_a_lease_refuses_minutes_and_stages_it_does_not_run(capsys):
    for argv, said in (
        (["--lease", "--minutes", "8"], "--minutes: 8 is not allowed with --lease"),
        (["--lease", "--stages", "bench"], "--stages: 'bench' is not a stage of a lease; allowed: install,"),
    ):
        with pytest.raises(SystemExit) as err:
            gpu_check.main(["--out", "x", *argv])
        assert err.value.code == 2 and said in capsys.readouterr().err


def test_minutes_scale_every_stage_limit():
    short = gpu_check.scaled_budget(gpu_check.BUDGET, 8.5)
    assert short.keys() == gpu_check.BUDGET.keys()
    assert sum(short.values()) <= 8.5 * 60 * 19.5 / 20 + len(short)  # rounding: at most a second a stage
    assert all(short[s] < gpu_check.BUDGET[s] for s in short)
    assert gpu_check.scaled_budget(gpu_check.BUDGET, 20) == gpu_check.BUDGET


def test_minutes_out_of_range_is_refused(tmp_path, cli):
    proc = cli("kernels.gpu.check", "--out", str(tmp_path), "--minutes", "40")
    assert proc.returncode == 2 and "--minutes: 40 is not allowed; allowed: 2 to 20" in proc.stderr
    assert not (tmp_path / "results").exists()


def test_a_named_commit_wins_over_a_copied_git_head(tmp_path, cli):
    path = tmp_path / "metadata.json"
    env = {**os.environ, "HARNESS_COMMIT": "0123abc", "TRITON_INTERPRET": "1"}
    proc = cli("kernels.gpu.check", "--metadata", str(path), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads(path.read_text())
    assert meta["commit"] == "0123abc" and meta["dirty"].startswith("unknown")
    assert meta.get("git_head", "none").split()[0] != "0123abc"  # a checkout's HEAD is recorded apart


def test_gpu_test_files_are_those_with_gpu_tests():
    """Every test file that can run on a GPU (the `device` fixture or a gpu mark) is in the GPU stage's list."""
    found = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        if path == Path(__file__).resolve():
            continue  # this file names the mark in its own check
        text = path.read_text()
        if "mark.gpu" in text or re.search(r"def test_\w+\([^)]*\bdevice\b", text):
            found.add(str(path.relative_to(ROOT)))
    assert found == set(gpu_check.GPU_TEST_FILES)


def _decode_row(method: str, widths: str, us: float, frac: float = 0.5, context: str = "32768") -> dict:
    return {"config": "32x8", "batch": "8", "context": context, "method": method, "widths": widths,
            "time_us": str(us), "frac_copy_bw": str(frac)}  # fmt: skip


def test_targets_read_off_the_headline_shape():
    rows = [
        _decode_row("sdpa_flash", "16", 300.0),
        _decode_row("flex_decode", "16", 250.0),  # the fastest 16-bit method is the baseline
        _decode_row("fused", "4", 100.0, frac=0.65),
        _decode_row("fused", "2", 70.0),
        _decode_row("fused", "2,2,2,2,4,4,8,8", 112.0),
        _decode_row("fused", "4", 1.0, context="65536"),  # another shape: ignored
    ]
    got = {name: (value, met) for name, value, _, met in gpu_check.targets(rows)}
    assert got["4-bit fused vs fastest 16-bit"] == (2.5, "yes")
    assert got["4-bit fused: fraction of copy bandwidth"] == (0.65, "yes")
    assert got["2-bit fused vs fastest 16-bit"] == (pytest.approx(250 / 70), "no")
    assert got["mixed (mean 4) time / uniform 4"] == (pytest.approx(1.12), "no")
    assert gpu_check.targets(rows[2:]) == []  # no 16-bit baseline: nothing to compare


@pytest.mark.parametrize("hkv", [1, 2, 3, 4, 8, 12])
def test_mixed_width_map(hkv):
    """Mean 4 bits over 2, 4 and 8 where the head count allows it (a multiple of 4), else 2 and 8 alternating
    (plus one 4-bit head for an odd count)."""
    bits = bench.width_maps(hkv, ["mixed"])["mixed"]
    assert len(bits) == hkv and set(bits) <= {2, 4, 8}
    if hkv % 4 == 0:
        assert sum(bits) == 4 * hkv and set(bits) == {2, 4, 8}
    else:
        assert sorted(bits) == sorted([2, 8] * (hkv // 2) + [4] * (hkv % 2))


def test_bad_arguments_exit_2_with_the_key(capsys):
    with pytest.raises(SystemExit) as err:
        gpu_check.main(["--out", "x", "--stages", "nope"])
    assert err.value.code == 2 and "--stages: 'nope' is not a stage" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        bench.parse_args(["--out", "x", "--widths", "5"])
    assert err.value.code == 2 and "--widths: '5' is not allowed" in capsys.readouterr().err


def test_ab_rows_stand_in_for_the_bench_in_the_targets():
    """Without the bench's rows at the headline shape the targets come from the A/B's current-kernel rows."""
    rows = [
        {**_decode_row("sdpa_default", "16", 300.0), "method": "sdpa_default"},
        _decode_row("fused:baf9cf7", "4", 600.0),
        _decode_row("fused:decode_attention", "4", 120.0, frac=0.7),
        _decode_row("fused:decode_attention", "4", 90.0, frac=0.9),  # another split count: not the default
        _decode_row("fused:decode_attention", "2", 75.0),
        _decode_row("graph:decode_attention", "4", 110.0),  # the same call replayed from a CUDA graph
    ]
    got = {name: value for name, value, _, _ in gpu_check.targets(gpu_check.ab_as_decode(rows))}
    assert got["4-bit fused vs fastest 16-bit"] == pytest.approx(2.5)
    replayed = {name: value for name, value, _, _ in gpu_check.targets(gpu_check.ab_as_decode(rows, "graph"))}
    assert replayed["4-bit fused vs fastest 16-bit"] == pytest.approx(
        300 / 110
    )  # the graph row, not the launched
    assert got["4-bit fused: fraction of copy bandwidth"] == pytest.approx(0.7)
    assert got["2-bit fused vs fastest 16-bit"] == pytest.approx(4.0)
    static = [
        {
            "key_bits": "4",
            "value_bits": "4",
            "instr_per_byte": "4.0",
            "kernel_sha": gpu_check.current_kernel_sha(),
        },
        {"key_bits": "2", "value_bits": "2", "instr_per_byte": "9.0", "kernel_sha": "stale0000000"},
        {"key_bits": "4", "value_bits": "4", "instr_per_byte": "4.4", "kernel_sha": gpu_check.current_kernel_sha(),
         "format": "codes"},  # inspect --codes: not the format the A/B times
    ]  # fmt: skip
    counters = [
        {"widths": "4", "dram_pct_of_peak": "71", "thread_instr_per_dram_byte": "4.2", "top_stalls": "wait=1"}
    ]
    table = "\n".join(gpu_check.kernel_table(rows, static, counters))
    assert "| decode_attention | 4 | 120 | 110 | 2.50 | 0.700 | 4.00 | 2.80 | 71 | 4.2 | wait=1 |" in table
    assert "| baf9cf7 | 4 | 600 | nan | 0.50 |" in table
    assert (
        "| decode_attention | 2 | 75 | nan | 4.00 | 0.500 | nan |" in table
    )  # static figures of another kernel: left out


def test_current_kernel_sha_is_the_inspectors(monkeypatch):
    """The check picks inspect.csv's rows of the kernel it times by kernel_sha: its own digest (standard library
    only) must be the inspector's over the same files (before this test, groups.py was missing from it)."""
    from kernels.gpu import inspect as insp

    monkeypatch.chdir(ROOT)
    assert gpu_check.current_kernel_sha() == insp.kernel_sha()


def test_codes_targets_read_the_frontier_points_maps_off_the_ab():
    """The codes-only path's rows at the frontier points' maps (named in each row's note) against the fastest
    16-bit row: 300 / 120 = 2.5 >= 2.3 met at 3.5x, 300 / 100 = 3.0 < 3.5 missed at 6x, pca_block_ugsa's 6x point
    300 / 80 = 3.75 met; other maps and kinds ignored."""
    points = {k: p.stem for k, p in gpu_check.CODES_POINTS.items()}
    rows = [
        {**_decode_row("sdpa_default", "16", 300.0), "note": "flash_attention"},
        {**_decode_row("codes:decode_attention", "4", 90.0), "note": "4; qblock=128; splits=4"},
        {**_decode_row("codes:decode_attention", "4,4/4,3", 120.0), "note": f"{points['3.5x']}; qblock=128"},
        {
            **_decode_row("codes-graph:decode_attention", "4,4/4,3", 80.0),
            "note": f"{points['3.5x']}; qblock=128",
        },
        {**_decode_row("codes:decode_attention", "2,3/2,2", 100.0), "note": f"{points['6x']}; qblock=128"},
        {
            **_decode_row("codes:decode_attention", "5,5/4,5", 150.0),
            "note": f"{gpu_check.GROUPED_POINTS['3.5x'].stem}; qblock=128; splits=4; grouped [5]",
        },
        {
            **_decode_row("codes:decode_attention", "2,2/2,1", 80.0),
            "note": f"{gpu_check.PLANES_POINTS['6x'].stem}; qblock=128; splits=4; grouped [1, 2]",
        },
    ]
    got = gpu_check.codes_targets(rows)
    assert [(v, t, m) for _, v, t, m in got] == [
        (2.5, ">= 2.3x", "yes"),
        (3.0, ">= 3.5x", "no"),
        (2.0, ">= 2.3x", "no"),
        (3.75, ">= 3.5x", "yes"),
    ]
    assert got[2][0].startswith("grouped codes at the 3.5x point's widths (5,5/4,5)")
    assert got[3][0].startswith("grouped codes (planes) at the 6x point's widths (2,2/2,1)")
    assert "3.5x point's widths (4,4/4,3)" in got[0][0]
    ((_, replayed, _, met),) = gpu_check.codes_targets(rows, "codes-graph")
    assert replayed == 300 / 80 and met == "yes"


def test_codes_targets_read_each_block_size_of_a_point_apart():
    """ab --qblock 128 32 times every codes map at both block sizes: each point's first row at each size is its
    own target line (a query per 32 tokens said in the name), a second row at a size (other splits) ignored;
    pca_block32_ugsa's points are read as the others."""
    grouped, planes32 = gpu_check.GROUPED_POINTS["3.5x"].stem, gpu_check.PLANES32_POINTS["6x"].stem
    rows = [
        {**_decode_row("sdpa_default", "16", 300.0), "note": "flash_attention"},
        {
            **_decode_row("codes:decode_attention", "4,4/4,3", 150.0),
            "note": f"{grouped}; qblock=128; splits=4",
        },
        {
            **_decode_row("codes:decode_attention", "4,4/4,3", 200.0),
            "note": f"{grouped}; qblock=32; splits=4",
        },
        {
            **_decode_row("codes:decode_attention", "4,4/4,3", 100.0),
            "note": f"{grouped}; qblock=32; splits=8",
        },
        {
            **_decode_row("codes:decode_attention", "2,3/2,2", 60.0),
            "note": f"{planes32}; qblock=32; splits=4",
        },
    ]
    got = gpu_check.codes_targets(rows)
    assert [(v, t, m) for _, v, t, m in got] == [
        (2.0, ">= 2.3x", "no"),
        (1.5, ">= 2.3x", "no"),
        (5.0, ">= 3.5x", "yes"),
    ]
    assert got[0][0] == "grouped codes at the 3.5x point's widths (4,4/4,3) vs fastest 16-bit"
    assert (
        got[1][0]
        == "grouped codes at the 3.5x point's widths (4,4/4,3, a query per 32 tokens) vs fastest 16-bit"
    )
    assert got[2][0].startswith(
        "grouped codes (planes, keys in 32-token blocks) at the 6x point's widths (2,3/2,2, a"
    )


def _flags(args: list[str]) -> dict[str, list[list[str]]]:
    """A command line's flags: flag -> the values after each time it is given."""
    flags: dict[str, list[list[str]]] = {}
    values: list[str] = []
    for arg in args:
        if arg.startswith("--"):
            values = []
            flags.setdefault(arg, []).append(values)
        else:
            values.append(arg)
    return flags


def test_the_gpu_runs_ab_arguments_load(monkeypatch):
    """The GPU run's ab stage reads every point and plan it names (a missing file or a width without a plan would
    end the stage before its first row): the maps kernels.gpu.ab builds from them, each grouped point's plans, and
    both block sizes."""
    from kernels.gpu import ab

    monkeypatch.chdir(ROOT)
    flags = _flags(gpu_check.stage_arguments(False, gpu_check.BUDGET)["ab"])
    grouped = [ab.grouped_entry(values) for values in flags["--grouped"]]
    allocations = [Path(p) for p in flags["--codes-allocation"][0]]
    maps = ab.codes_maps(8, flags["--codes"][0], allocations, grouped)
    stems = {p.stem for p in (*gpu_check.CODES_POINTS.values(), *gpu_check.GROUPED_POINTS.values(),
                              *gpu_check.PLANES_POINTS.values(), *gpu_check.PLANES32_POINTS.values())}  # fmt: skip
    grouped = stems - {p.stem for p in gpu_check.CODES_POINTS.values()}
    assert stems <= set(maps) and all(maps[s][2] and maps[s][3] for s in grouped)
    key_plans, value_plans = maps[gpu_check.PLANES32_POINTS["6x"].stem][2:]
    assert (key_plans[1], value_plans[1]) == ((3, 3, 1, 1, 0, 0, 0, 0), (2, 2, 1, 1, 1, 1, 0, 0))
    assert flags["--qblock"] == [["128", "32"]]


def test_launch_table_lists_each_calls_launches_in_order():
    rows = [
        {"version": "decode_attention", "widths": "2,4", "launch": "0", "kernel": "_decode_packed_kernel",
         "device_us": "80.4"},
        {"version": "decode_attention", "widths": "2,4", "launch": "1", "kernel": "_decode_packed_kernel",
         "device_us": "51.0"},
        {"version": "decode_attention", "widths": "2,4", "launch": "2", "kernel": "_combine_kernel",
         "device_us": "4.6"},
    ]  # fmt: skip
    table = gpu_check.launch_table(rows)
    assert table[-1] == (
        "| decode_attention | 2,4 | _decode_packed_kernel 80, _decode_packed_kernel 51, _combine_kernel 5 |"
    )
    assert gpu_check.launch_table([]) == []


def test_the_readme_reads_the_targets_off_the_replays_first(tmp_path):
    """The README's target table is the graph replays' (the GPU's own time); the launched calls' follows it."""
    rows = [
        {**_decode_row("sdpa_default", "16", 300.0), "method": "sdpa_default"},
        _decode_row("fused:decode_attention", "4", 150.0),
        _decode_row("graph:decode_attention", "4", 100.0),
    ]
    fields = sorted({k for r in rows for k in r})
    with open(tmp_path / "ab.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    gpu_check.write_readme(tmp_path, {"gpu": "test"}, [], False, "python -m kernels.gpu.check")
    text = (tmp_path / "README.md").read_text()
    replayed, launched = (
        text.index("| 4-bit fused vs fastest 16-bit | 3 |"),
        text.index("| 4-bit fused vs fastest 16-bit | 2 |"),
    )
    assert (
        text.index("Read off the A/B's CUDA-graph replays")
        < replayed
        < text.index("as launched from Python")
        < launched
    )
