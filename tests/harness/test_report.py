"""The reporting layer on a real smoke run: loading, tables.md and its intervals, figures, regeneration from
points/ alone, the Pareto frontier, and the analysis notebook."""

import json
import math
import re
import shutil
import sys
from pathlib import Path

import nbformat
import numpy as np
import pandas as pd
import pytest
import scipy.stats
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from sacrebleu.metrics import BLEU

from harness import results
from harness.__main__ import entry
from harness.report import paired, passkey, plots, sweep, tables

ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = (
    "tables.md",
    "pareto-tiny-llama-asym_token.png",
    "pareto-tiny-llama-asym_token.svg",
    "entropy-tiny-llama.png",
    "allocation-tiny-llama.png",
)
N_BOOT = 300
# Committed runs whose tables.md an older report wrote; each goes when its run is redone (strict: a run that
# regenerates identically again must leave this list).
_GRID = "full grid without the resident_bytes, resident_ratio and simulate columns"
STALE_TABLES = {
    "results/perf/dtype/pareto-small-bfloat16": f"older report: {_GRID}",
    "results/perf/dtype/pareto-small-float32": f"older report: {_GRID}",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory, in_process):
    """A smoke run (python -m harness, run in this process) and the runner's own results.parquet (read before
    the report re-writes it)."""
    run_dir = tmp_path_factory.mktemp("smoke") / "run"
    proc = in_process(entry, "harness", "+sweep=smoke", f"run_dir={run_dir}", "tracking.wandb.mode=disabled")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir, pd.read_parquet(run_dir / "results.parquet")


@pytest.fixture(scope="module")
def reported(run):
    run_dir, _ = run
    sweep.write_report(run_dir)
    return run_dir


def point_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "points").glob("*.json"))


def find(records: list[dict], **config) -> dict:
    (match,) = [
        r for r in records if r["status"] == "ok" and all(r["config"][k] == v for k, v in config.items())
    ]
    return match


def test_load_has_one_row_per_point_and_matches_the_runner_table(run):
    run_dir, runner_table = run
    table = results.load(run_dir)
    keys = [json.loads(p.read_text())["key"] for p in point_files(run_dir)]
    assert sorted(table["key"]) == sorted(keys) and len(table) == len(keys)
    assert set(table["status"]) == {"ok", "infeasible"}
    assert table.loc[table["status"] == "infeasible", "error"].str.contains("budget").all()
    mine = table.sort_values("key").reset_index(drop=True)[runner_table.columns]
    pd.testing.assert_frame_equal(
        mine, runner_table.sort_values("key").reset_index(drop=True), check_dtype=False
    )
    assert len(results.load_records(run_dir)) == len(keys)
    entropy = results.load_entropy(run_dir, "tiny-llama")
    assert {"layer", "q_head", "kv_head", "H2"} <= set(entropy.columns)


def test_load_of_an_empty_or_partly_written_run(tmp_path):
    assert results.load_records(tmp_path) == []
    assert results.load(tmp_path).empty and {"key", "status", "bleu"} <= set(results.load(tmp_path).columns)
    (tmp_path / "points").mkdir()
    (tmp_path / "points" / "half.json").write_text('{"key": "half", "sta')  # a write caught mid-way
    (tmp_path / "points" / ".abc.json.tmp123").write_text("{}")  # the runner's temporary file
    assert results.load(tmp_path).empty


def test_tables_md_has_the_command_claim_rows_and_intervals(reported):
    text = (reported / "tables.md").read_text()
    env = json.loads((reported / "env.json").read_text())
    first = text.splitlines()[0]
    assert env["command"] in first and env["git_commit"] in first
    claim = text.split("claim table at budget 4")[1].split("\n## ")[0]
    for row in ("uniform", "entropy", "sinks", "entropy+sinks", "baseline"):
        assert re.search(rf"^\| {re.escape(row)} \|", claim, re.M), row
    diffs = text.split("## Differences to uniform")[1]
    interval = r"[+-][\d.e+-]+ \[[+-][\d.e+-]+, [+-][\d.e+-]+\] n=16"
    assert (
        len(re.findall(interval, diffs)) == 3 * 4
    )  # entropy at budgets 2 and 4, entropy+sinks at 4; four metrics
    infeasible = text.split("## Infeasible points")[1].split("\n## ")[0]
    assert "policy.budget: 2 bits/head" in infeasible  # entropy+sinks cannot pay for its sink at budget 2


def bootstrap_interval(diff_of, n_items: int, n_boot: int, seed: int = 0) -> tuple[float, float]:
    """The expanded percentile interval of diff_of(idx) over seeded resamples, written out here from numpy
    and scipy: the percentile interval at level 1 - 2 Phi(-sqrt(n / (n - 1)) t_{n-1, 0.975})."""
    idx = np.random.default_rng(seed).integers(0, n_items, size=(n_boot, n_items))
    values = np.array([diff_of(i) for i in idx])
    tail = scipy.stats.norm.cdf(-math.sqrt(n_items / (n_items - 1)) * scipy.stats.t.ppf(0.975, n_items - 1))
    return tuple(np.quantile(values, [tail, 1 - tail]))


def corpus_bleu(stats: np.ndarray) -> float:
    total = stats.sum(axis=0)
    return (
        BLEU.compute_bleu(
            correct=total[2:6].tolist(),
            total=total[6:10].tolist(),
            sys_len=int(total[0]),
            ref_len=int(total[1]),
            smooth_method="exp",
        ).score
        / 100
    )


def test_a_difference_recomputed_from_the_json_items(run, tmp_path):
    """Give the 2-bit entropy point the 4-bit uniform point's items, so it differs from 2-bit uniform."""
    run_dir, _ = run
    copy = tmp_path / "run"
    shutil.copytree(run_dir / "points", copy / "points")
    records = results.load_records(copy)
    point = find(records, policy="entropy", budget=2)
    uniform = find(records, policy="uniform", budget=2)
    point["items"] = find(records, policy="uniform", budget=4)["items"]
    (copy / "points" / f"{point['key']}.json").write_text(json.dumps(point))
    sweep.write_report(copy, n_boot=N_BOOT)

    row = next(
        line
        for line in (copy / "tables.md").read_text().split("## Differences")[1].splitlines()
        if point["key"] in line
    )
    cells = dict(
        zip(
            [
                "model",
                "scheme",
                "budget",
                "configuration",
                "bytes",
                "bleu",
                "token_match",
                "ppl_ratio",
                "kl_mean",
            ],
            [c.strip() for c in row.strip("|").split("|")],
        )
    )
    a, b = point["items"], uniform["items"]
    arr = lambda items, name: np.asarray(items[name], dtype=float)
    ppl_ratio = lambda items, i: (
        math.exp(arr(items, "nll")[i].mean()) / math.exp(arr(items, "nll_base")[i].mean())
    )
    expected = {
        "bleu": (
            lambda i: (
                corpus_bleu(np.asarray(a["bleu_stats"])[i]) - corpus_bleu(np.asarray(b["bleu_stats"])[i])
            ),
            len(a["bleu_stats"]),
        ),
        "token_match": (
            lambda i: arr(a, "token_match")[i].mean() - arr(b, "token_match")[i].mean(),
            len(a["token_match"]),
        ),
        "ppl_ratio": (lambda i: ppl_ratio(a, i) - ppl_ratio(b, i), len(a["nll"])),
        "kl_mean": (lambda i: arr(a, "kl_mean")[i].mean() - arr(b, "kl_mean")[i].mean(), len(a["kl_mean"])),
    }
    nonzero = 0
    for metric, (diff_of, n) in expected.items():
        value = diff_of(np.arange(n))
        low, high = bootstrap_interval(diff_of, n, N_BOOT)
        assert cells[metric].endswith(f"n={n}") or cells[metric].endswith(f"n={n}**"), cells[metric]
        got = [float(x) for x in re.findall(r"[+-][\d.]+(?:e[+-]\d+)?", cells[metric])]
        assert got == pytest.approx([value, low, high], rel=6e-3, abs=1e-12), metric
        assert cells[metric].startswith("**") == bool(low > 0 or high < 0), metric
        nonzero += value != 0
    assert nonzero >= 3  # the swap made a real difference, not the identical-points case


def test_plots_exist_as_png_and_svg(reported):
    for name in OUTPUTS[1:]:
        data = (reported / name).read_bytes()
        assert len(data) > 1000, name
        assert data.startswith(b"\x89PNG") if name.endswith(".png") else b"<svg" in data[:2000], name


def test_report_regenerates_identically_from_points_alone(reported, tmp_path, cli):
    copy = tmp_path / reported.name  # same name: tables.md's title names the run directory
    shutil.copytree(reported, copy)
    before = {name: (copy / name).read_bytes() for name in OUTPUTS}
    table = pd.read_parquet(copy / "results.parquet")
    for name in (*OUTPUTS, "results.parquet"):
        (copy / name).unlink()
    proc = cli("harness.report", str(copy))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name, data in before.items():
        assert (copy / name).read_bytes() == data, name
    pd.testing.assert_frame_equal(pd.read_parquet(copy / "results.parquet"), table)


def test_frontier_in_both_directions():
    records = [
        {"key": "a", "bytes_per_token": 100, "kl_mean": 0.5, "bleu": 0.6},
        {"key": "a2", "bytes_per_token": 100, "kl_mean": 0.4, "bleu": 0.55},  # same bytes, better kl than a
        {"key": "b", "bytes_per_token": 150, "kl_mean": 0.6, "bleu": 0.7},
        {"key": "c", "bytes_per_token": 200, "kl_mean": 0.3, "bleu": 0.5},
        {"key": "d", "bytes_per_token": 250, "kl_mean": 0.35, "bleu": 0.8},
        {"key": "e", "bytes_per_token": 300, "kl_mean": 0.1, "bleu": 0.9},
        {
            "key": "f",
            "bytes_per_token": 120,
            "kl_mean": math.nan,
            "bleu": math.nan,
        },  # no measurement: ignored
    ]
    assert plots.frontier(records, "kl_mean")["key"].tolist() == ["a2", "c", "e"]
    assert plots.frontier(records, "bleu")["key"].tolist() == ["a", "b", "d", "e"]
    assert plots.frontier(pd.DataFrame(records), "kl_mean", higher_is_better=True)["key"].tolist() == [
        "a",
        "b",
    ]


def test_notebook_is_stripped_and_executes_against_the_run(reported, tmp_path, monkeypatch):
    path = ROOT / "notebooks" / "analysis.ipynb"
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    if "python3" not in KernelSpecManager().find_kernel_specs():
        # no registered python3 kernel: register one for this interpreter in a private Jupyter path
        spec = tmp_path / "kernels" / "python3"
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(
            json.dumps(
                {
                    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "Python 3",
                    "language": "python",
                }
            )
        )
        monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("KVBITS_RUN_DIR", str(reported))
    before = {name: (reported / name).read_bytes() for name in OUTPUTS}
    NotebookClient(
        nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    images = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})
    ]
    assert len(images) >= 3  # the Pareto figure and both heat maps, inline
    assert {name: (reported / name).read_bytes() for name in OUTPUTS} == before  # it only reads


def synthetic(key: str, policy: str, budget: int, alpha: float = 0.0, threshold=None, fraction=None) -> dict:
    config = {
        "model": "m",
        "policy": policy,
        "budget": budget,
        "alpha": alpha,
        "sink_threshold": threshold,
        "sink_fraction": fraction,
        "scheme": "asym_token",
    }
    return {
        "key": key,
        "status": "ok",
        "config": config,
        "metrics": {"bleu": 0.5, "bytes_per_token": 10.0 * budget, "compression_true": 16 / budget},
        "allocation": {"bits": [[budget]]},
    }


def test_claim_table_and_allocation_point_pick_the_claimed_configurations():
    records = [
        synthetic("e1", "entropy", 4, alpha=1.0),
        synthetic("e025", "entropy", 4, alpha=0.25),
        synthetic("e05", "entropy", 4, alpha=0.5),
        synthetic("esf", "entropy", 4, alpha=0.25, fraction=0.02),
        synthetic("est", "entropy", 4, alpha=0.25, threshold=0.5),
        synthetic("s", "sinks", 4, threshold=0.5),
        synthetic("u", "uniform", 4),
        synthetic("u2", "uniform", 2),
        synthetic("e2", "entropy", 2, alpha=0.25, threshold=0.5),
    ]
    claim = tables.claim_table(results.table(records), "m", "asym_token")
    assert claim.set_index("row")["key"].to_dict() == {
        "uniform": "u",
        "entropy": "e025",
        "sinks": "s",
        "entropy+sinks": "est",
    }
    assert plots.allocation_point(records, "m")["key"] == "est"
    without_sinks = [r for r in records if r["key"] not in ("est", "esf")]
    assert plots.allocation_point(without_sinks, "m")["key"] == "e025"
    assert plots.allocation_point([records[6], records[7]], "m")["key"] == "u"


def test_storage_variants_are_compared_with_the_plain_cache(run, tmp_path):
    """A kivi copy of a uniform point pairs with the plain uniform point at its budget; the report adds the
    plain-cache section and an all-schemes Pareto plot."""
    run_dir, _ = run
    copy_dir = tmp_path / "run"
    shutil.copytree(run_dir, copy_dir)
    records = results.load_records(copy_dir)
    plain = find(records, policy="uniform", budget=4)
    variant = json.loads(json.dumps(plain))
    variant["config"].update(scheme="kivi", residual=32)
    variant["key"] = "kivi-variant"
    rng = np.random.default_rng(0)
    kl_items = np.asarray(plain["items"]["kl_mean"])
    variant["items"]["kl_mean"] = (kl_items + rng.uniform(0.1, 0.2, len(kl_items))).tolist()
    (copy_dir / "points" / "kivi-variant.json").write_text(json.dumps(variant))

    diffs = paired.differences([*records, variant], n_boot=50, against="plain")
    kl = diffs[(diffs["key"] == "kivi-variant") & (diffs["metric"] == "kl_mean")].iloc[0]
    assert kl["uniform_key"] == plain["key"]
    expected = np.mean(variant["items"]["kl_mean"]) - np.mean(plain["items"]["kl_mean"])
    assert math.isclose(kl["difference"], expected, rel_tol=1e-12) and kl["excludes_zero"]
    assert plain["key"] not in set(diffs["key"])  # the reference is not compared with itself

    written = {p.name for p in sweep.write_report(copy_dir, n_boot=50)}
    assert {"pareto-tiny-llama-all.png", "pareto-tiny-llama-kivi.png"} <= written
    text = (copy_dir / "tables.md").read_text()
    assert "## Differences to the plain cache" in text.split("## Differences to uniform")[1]
    with pytest.raises(ValueError, match="against: unknown"):
        paired.differences(records, against="dense")


def committed_runs() -> list:
    """Every committed run directory with points/ and tables.md, stale ones marked (STALE_TABLES)."""
    runs = sorted(p.parent for p in (ROOT / "results").rglob("points") if (p.parent / "tables.md").exists())
    params = []
    for run_dir in runs:
        name = run_dir.relative_to(ROOT).as_posix()
        stale = STALE_TABLES.get(name)
        marks = [pytest.mark.xfail(strict=True, reason=stale)] if stale else []
        params.append(pytest.param(run_dir, id=name, marks=marks))
    return params


def test_every_stale_entry_is_a_committed_run():
    assert set(STALE_TABLES) <= {p.id for p in committed_runs()}


@pytest.mark.parametrize("run_dir", committed_runs())
def test_committed_tables_regenerate_identically(run_dir, tmp_path):
    """tables.md from points/ alone, byte for byte: harness.report.sweep for sweep runs, harness.report.passkey for
    passkey runs (their records carry accuracy, not metrics). Tables only: plots are tested on the smoke run."""
    first = json.loads(next((run_dir / "points").glob("*.json")).read_text())
    if "metrics" in first:
        text = sweep.tables_text(run_dir, results.load_records(run_dir))
    else:
        text = passkey.tables_markdown(run_dir, passkey.load_points(run_dir))
    (tmp_path / "tables.md").write_text(text)
    assert (tmp_path / "tables.md").read_bytes() == (run_dir / "tables.md").read_bytes()


def test_a_pareto_plot_of_many_policies_has_one_legend_entry_per_scheme_and_family():
    """39 configurations (13 policies x 3 schemes) over 3 budgets: colours are schemes, markers policy families,
    the legend lists each once (and the frontier, its rings and the unquantized line); kl_mean and ppl_ratio - 1
    are on log axes, x is true compression on a log axis."""
    rng = np.random.default_rng(0)
    policies = [
        ("uniform", {}),
        ("entropy", {"alpha": 0.25}),
        ("entropy", {"alpha": 0.5}),
        ("entropy", {"alpha": 1.0}),
        ("sinks", {"threshold": 0.5}),
        ("sinks", {"fraction": 0.02}),
        ("entropy", {"alpha": 0.25, "threshold": 0.5}),
        ("entropy", {"alpha": 0.25, "fraction": 0.02}),
        ("random", {"alpha": 0.25}),
        ("inverted", {"alpha": -0.5}),
        ("sensitivity", {}),
        ("layerwise", {}),
    ]
    schemes = ("asym_token", "kivi", "sym_token")
    records = []
    for scheme in schemes:
        for budget in (2, 3, 4):
            for i, (policy, options) in enumerate([*policies, ("random", {"alpha": 0.25})]):
                record = synthetic(f"{scheme}-{budget}-{i}", policy, budget, **options)
                record["config"].update(scheme=scheme, policy_seed=i)
                record["metrics"].update(
                    kl_mean=float(rng.uniform(0.01, 2.0) / budget**2),
                    ppl_ratio=float(1 + rng.uniform(0, 1) / budget),
                    token_match=float(rng.uniform(0.2, 0.9)),
                )
                records.append(record)
    base = synthetic("base", "baseline", 16)
    base["config"]["scheme"] = "none"
    base["metrics"].update(bleu=1.0, kl_mean=0.0, ppl_ratio=1.0, token_match=1.0)
    frame = results.table([*records, base])
    families = {
        "uniform",
        "entropy",
        "sinks",
        "entropy+sinks",
        "random",
        "inverted",
        "sensitivity",
        "layerwise",
    }
    lines = {"Pareto frontier", "on the frontier", "unquantized"}

    fig = plots.plot_pareto(frame, "m")
    kl = fig.axes[0]
    drawn = [c for c in kl.collections if c.get_label() != "on the frontier"]
    assert len(drawn) == len(schemes) * 13  # every configuration drawn, one collection each
    legend = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert sorted(legend) == sorted({*schemes, *families, *lines})
    assert kl.get_ylabel().startswith("kl_mean") and fig.axes[1].get_ylabel().startswith("ppl_ratio - 1")
    assert [ax.get_yscale() for ax in fig.axes] == ["log", "log", "linear", "linear"]
    assert {ax.get_xscale() for ax in fig.axes} == {"log"}
    assert kl.get_xlabel().startswith("true compression")
    # x is true compression: uniform's budget-2 point (8x) lies right of its budget-4 point (4x)
    offsets = {c.get_label(): c.get_offsets() for c in drawn}
    assert sorted(offsets["asym_token: uniform"][:, 0].tolist()) == [4.0, 16 / 3, 8.0]

    one = plots.plot_pareto(frame, "m", "kivi")
    legend = [t.get_text() for legend in one.legends for t in legend.get_texts()]
    assert sorted(legend) == sorted({"kivi", *families, *lines})
    by_label = {c.get_label(): c for c in one.axes[0].collections}
    shape = {k: tuple(c.get_paths()[0].vertices.round(3).ravel()) for k, c in by_label.items()}
    assert shape["entropy a=0.25"] == shape["entropy a=1"] != shape["uniform"]  # a marker per family


def test_a_log_panel_with_no_positive_value_is_drawn_and_says_why_it_is_empty():
    """Every point below the unquantized perplexity (ppl_ratio < 1: a random tiny model) leaves the ppl_ratio - 1
    panel nothing to draw on a log axis; the figure still draws (it raised in matplotlib's tick locator), that
    panel on a linear axis with its title counting the points left out, kl_mean's panel on its log axis."""
    records = []
    for scheme, ratio in (("pca_block_ugs", 0.95), ("pca_block_ugsa", 0.99)):
        record = synthetic(scheme, "uniform", 5)
        record["config"]["scheme"] = scheme
        record["metrics"].update(ppl_ratio=ratio, kl_mean=0.02)
        records.append(record)
    fig = plots.plot_pareto(results.table(records), "m")
    fig.draw_without_rendering()
    kl, ppl = fig.axes[:2]
    assert (kl.get_yscale(), ppl.get_yscale()) == ("log", "linear")
    assert ppl.get_title() == "2 point(s) at ppl_ratio - 1 <= 0 not drawn" and kl.get_title() == ""


def crowded_frame(variants: int, seed: int) -> pd.DataFrame:
    """A frontier-like run: `variants` storage variants of 6 scheme families (long option labels), each at 3
    budgets under uniform and measured, a ppl_ratio spanning 1.001 to 61, and two llama.cpp peers."""
    rng = np.random.default_rng(seed)
    schemes = ("asym_token", "rotate+asym_token", "kivi", "codebook", "calkey", "nuqkey", "nuqkey_codebook")
    records = []
    for v in range(variants):
        scheme = schemes[v % len(schemes)]
        options = dict(
            outliers=[0.0, 0.01, 0.02][v % 3],
            sink_tokens=v % 2,
            key_levels=["kmeans", "fisher", "fisher_sqrt"][(v // 3) % 3],
            key_group_size=[None, 128][(v // 7) % 2],
            group_size=32,
        )
        for budget in (2, 3, 4):
            for policy in ("uniform", "measured"):
                record = synthetic(f"{v}-{budget}-{policy}", policy, budget)
                record["config"].update(scheme=scheme, **options)
                compression = 16 / (budget + rng.uniform(0.1, 1.0))
                record["metrics"].update(
                    compression_true=compression,
                    kl_mean=float(np.exp(rng.uniform(-7, 1.5))),
                    ppl_ratio=float(1 + np.exp(rng.uniform(-7, 4.1))),
                    token_match=float(rng.uniform(0.1, 0.9)),
                )
                records.append(record)
    for cache, rotation, compression in (("q4_0", True, 3.56), ("q8_0", False, 1.88), ("f16", False, 1.0)):
        peer = synthetic(cache, "llamacpp", 4)
        peer["config"].update(engine="llamacpp", scheme=cache, rotation=rotation)
        peer["metrics"].update(compression_true=compression, kl_mean=0.05, ppl_ratio=1.06, bleu=None)
        records.append(peer)
    return results.table(records)


def inside(box, outer, slack: float = 0.5) -> bool:
    return (
        box.x0 >= outer.x0 - slack
        and box.x1 <= outer.x1 + slack
        and box.y0 >= outer.y0 - slack
        and box.y1 <= outer.y1 + slack
    )


@pytest.mark.parametrize("variants", [1, 9, 30])
def test_the_pareto_legend_stays_inside_the_figure_and_off_the_panels(variants):
    """However many storage variants a run has, its one legend lies inside the figure and overlaps no panel
    (the plot before this test ran two legends off the figure's right edge); x tick labels never touch."""
    frame = crowded_frame(variants, seed=variants)
    for scheme in (None, "nuqkey_codebook" if variants > 6 else "asym_token"):
        fig = plots.plot_pareto(frame, "m", scheme)
        fig.draw_without_rendering()
        renderer = fig.canvas.get_renderer()
        assert len(fig.legends) == 1
        box = fig.legends[0].get_window_extent(renderer)
        assert inside(box, fig.bbox), (box, fig.bbox)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_tightbbox(renderer)), ax.get_ylabel()
            labels = [t for t in ax.get_xticklabels() if t.get_text() and t.get_visible()]
            extents = sorted((t.get_window_extent(renderer) for t in labels), key=lambda b: b.x0)
            assert all(a.x1 < b.x0 for a, b in zip(extents, extents[1:])), [t.get_text() for t in labels]
            assert all(t.get_text().endswith("x") for t in labels)


def test_the_frontier_is_ringed_and_peers_are_filled_and_larger():
    frame = crowded_frame(9, seed=3)
    fig = plots.plot_pareto(frame, "m")
    ppl = fig.axes[1]  # ppl_ratio - 1
    rings = next(c for c in ppl.collections if c.get_label() == "on the frontier")
    ours = frame[(frame["engine"] == "harness") & (frame["policy"] != "baseline")]
    # the frontier by hand: no other point at the same or more compression has a lower ppl_ratio
    best = [
        r
        for r in ours.to_dict("records")
        if not any(
            o["compression_true"] >= r["compression_true"] and o["ppl_ratio"] < r["ppl_ratio"]
            for o in ours.to_dict("records")
            if o is not r
        )
    ]
    expected = sorted((r["compression_true"], r["ppl_ratio"] - 1) for r in best)
    got = sorted(map(tuple, rings.get_offsets().tolist()))
    np.testing.assert_allclose(got, expected)
    peers = [c for c in ppl.collections if c.get_label().startswith("llama.cpp")]
    assert {c.get_label() for c in peers} == {"llama.cpp q4_0 + rotation", "llama.cpp q8_0"}  # not f16 (1x)
    mine = [c for c in ppl.collections if c not in peers and c is not rings]
    assert all(c.get_facecolors()[0][3] > 0 for c in peers)  # filled
    assert all(len(c.get_facecolors()) == 0 for c in mine)  # hollow
    assert min(c.get_sizes()[0] for c in peers) > max(c.get_sizes()[0] for c in mine)
