"""The sweep run's figures, each a function returning a matplotlib Figure (Agg canvas, no pyplot state), so
notebooks/analysis.ipynb shows the same objects inline:
- the Pareto plot: quality against true bytes per token with the Pareto frontier, KL on a log axis, colour by
  cache (scheme and storage options), hollow marker by policy family, peer engines' points (harness.peers:
  llama.cpp, transformers' QuantizedCache) beside with a filled marker per engine, a legend of one entry per
  colour and per marker;
- the entropy heat map (H2 per layer and query head) and the allocation (bits per layer and KV head);
- save: a figure as PNG/SVG with reproducible bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter, ScalarFormatter

from harness import results
from harness.policies import ALLOWED_WIDTHS
from harness.report.labels import (
    CLAIM_BUDGET,
    cache_label,
    category,
    configuration,
    family,
    is_harness,
    ordered,
)
from harness.report.paired import HIGHER_IS_BETTER

# Pareto plots: colour = the cache (scheme and storage options, or a peer's cache type), marker = the policy
# family (hollow) or the peer engine (filled), the same marker for a family on every plot; families not named
# here and peer engines take the next of EXTRA_MARKERS / PEER_MARKERS.
FAMILY_MARKERS = {
    "uniform": "o",
    "entropy": "^",
    "sinks": "v",
    "entropy+sinks": "D",
    "random": "X",
    "inverted": "<",
    "sensitivity": "s",
    "layerwise": "P",
}
EXTRA_MARKERS = (">", "H")
PEER_MARKERS = ("p", "*", "d", "h", "8")  # filled; shapes that differ most first
SVG_SALT = "kvbits"  # fixed ids in SVG output, so a regenerated report is byte-identical


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, independent of whatever pyplot backend the caller has
    return fig


def frontier(
    points: pd.DataFrame | Iterable[Mapping],
    metric: str,
    x: str = "bytes_per_token",
    higher_is_better: bool | None = None,
) -> pd.DataFrame:
    """The Pareto frontier: points no other point beats on metric at the same or fewer bytes, sorted by x.

    Direction defaults from HIGHER_IS_BETTER (bleu, token_match up; kl_mean, ppl_ratio down). Ties: of points
    with equal x and quality only the first is kept, so the step line has one corner per improvement.
    """
    frame = pd.DataFrame(points)
    higher = HIGHER_IS_BETTER[metric] if higher_is_better is None else higher_is_better
    frame = frame[np.isfinite(frame[x].astype(float)) & np.isfinite(frame[metric].astype(float))]
    quality = frame[metric].astype(float) * (1 if higher else -1)  # larger is better from here on
    order = np.lexsort((-quality.to_numpy(), frame[x].astype(float).to_numpy()))
    keep, best = [], -math.inf
    for i in order:
        if quality.iloc[i] > best:
            keep.append(i)
            best = quality.iloc[i]
    return frame.iloc[keep]


def _markers(names: list[str], fixed: Mapping[str, str], extra: tuple[str, ...]) -> dict[str, str]:
    """Each name's marker: its fixed one, else the next of extra (cycled) in the order given."""
    others = [n for n in names if n not in fixed]
    return {n: fixed.get(n) or extra[others.index(n) % len(extra)] for n in names}


def plot_pareto(frame: pd.DataFrame, model: str, scheme: str | None = None) -> Figure:
    """Four panels (kl_mean on a log axis, ppl_ratio, bleu, token_match) against true bytes per token, the
    harness's frontier as steps.

    Colour: the cache (cache_label); marker: the policy family, hollow, or the peer engine, filled (family).
    The legend has one entry per colour and one per marker (tables.md names every point). scheme=None: every
    scheme of the model on one plot. Peer engines' points of the model are drawn on every plot.
    """
    here = frame[(frame["model"] == model) & (frame["status"] == "ok") & (frame["policy"] != "baseline")]
    here = here[np.isfinite(here["bytes_per_token"].astype(float))]
    points, peer_points = here[is_harness(here)], here[~is_harness(here)]
    if scheme is not None:
        points = points[points["scheme"] == scheme]
    style = _Style.of(points.to_dict("records"), peer_points.to_dict("records"))
    # one collection per configuration, named after it (scheme-prefixed on the all-schemes plot)
    name_of = configuration if scheme is not None else (lambda r: f"{r['scheme']}: {configuration(r)}")
    drawn = {}
    for row in ordered(points).to_dict("records"):
        drawn.setdefault((name_of(row), False), []).append(row)
    for row in peer_points.to_dict("records"):
        drawn.setdefault((configuration(row), True), []).append(row)
    base = frame[(frame["model"] == model) & (frame["policy"] == "baseline") & (frame["status"] == "ok")]
    fig = _figure(10, 7.8)
    axes = fig.subplots(2, 2).ravel()
    for ax, metric in zip(axes, HIGHER_IS_BETTER):
        unquantized = base.iloc[0][metric] if len(base) else math.nan
        _pareto_panel(ax, metric, drawn, points, unquantized, style)
    _pareto_legends(fig, axes, style)
    fig.suptitle(f"{model} / {scheme or 'all schemes'}: quality against KV-cache bytes")
    return fig


@dataclass(frozen=True)
class _Style:
    """The Pareto plot's colours (one per cache, harness caches first) and markers (one per policy family, then
    per peer engine)."""

    caches: list[str]
    colour: dict
    families: list[str]
    engines: list[str]
    marker: dict

    @classmethod
    def of(cls, mine: list[dict], theirs: list[dict]) -> _Style:
        """The style of the harness's points `mine` and the peer engines' points `theirs`."""
        caches = sorted({cache_label(r) for r in mine}) + sorted(
            {cache_label(r) for r in theirs} - {*map(cache_label, mine)}
        )
        palette = matplotlib.colormaps["tab10" if len(caches) <= 10 else "tab20"]
        colour = {c: palette(i % palette.N) for i, c in enumerate(caches)}
        kinds = {family(r) for r in mine}
        families = [f for f in FAMILY_MARKERS if f in kinds] + sorted(kinds - FAMILY_MARKERS.keys())
        marker = _markers(families, FAMILY_MARKERS, EXTRA_MARKERS)
        engines = sorted({family(r) for r in theirs})
        marker.update(_markers(engines, {}, PEER_MARKERS))
        return cls(caches, colour, families, engines, marker)


def _pareto_panel(
    ax, metric: str, drawn: dict, points: pd.DataFrame, unquantized: float, style: _Style
) -> None:
    """One panel: every collection of `drawn` ((name, is_peer) -> rows) at its bytes per token, the harness's
    frontier as steps and the unquantized value as a dotted line."""
    log_y = metric == "kl_mean"  # KL spans decades between 2 and 8 bits
    if log_y:
        ax.set_yscale("log", nonpositive="mask")
    for (name, is_peer), rows in drawn.items():
        first = rows[0]
        ax.scatter(
            [r["bytes_per_token"] for r in rows],
            [r[metric] for r in rows],
            marker=style.marker[family(first)],
            facecolors=style.colour[cache_label(first)] if is_peer else "none",
            edgecolors="black" if is_peer else style.colour[cache_label(first)],
            linewidths=0.5 if is_peer else 1.0,
            label=name,
            zorder=4 if is_peer else 3,
        )
    edge = frontier(points, metric)
    if len(edge):
        # extend the last step to the largest x so the frontier spans every point
        xs = [*edge["bytes_per_token"], points["bytes_per_token"].max()]
        ys = [*edge[metric], edge[metric].iloc[-1]]
        ax.step(xs, ys, where="post", color="black", linewidth=1, label="Pareto frontier", zorder=2)
    if pd.notna(unquantized) and not (log_y and unquantized <= 0):  # KL 0 has no place on a log axis
        ax.axhline(unquantized, color="grey", linestyle=":", linewidth=1, label="unquantized")
    ax.set_xscale("log")
    # budgets span about a decade at most: linear-spaced ticks in plain numbers read better than powers
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("bytes per token (true, KV cache)")
    ax.set_ylabel(f"{metric} ({'higher' if HIGHER_IS_BETTER[metric] else 'lower'} is better)")
    ax.grid(True, which="both", alpha=0.3)


def _pareto_legends(fig: Figure, axes, style: _Style) -> None:
    """Two legends side by side: the colours, then the markers and the frontier and unquantized lines."""
    swatches = [Patch(facecolor=style.colour[c], label=c) for c in style.caches]
    shapes = [
        Line2D(
            [], [], linestyle="none", marker=style.marker[f], markerfacecolor="none", color="black", label=f
        )
        for f in style.families
    ]
    shapes += [
        Line2D(
            [], [], linestyle="none", marker=style.marker[e], markerfacecolor="grey", color="black", label=e
        )
        for e in style.engines
    ]
    lines = {}
    for ax in axes:  # the frontier and the unquantized line, once each
        for handle, name in zip(*ax.get_legend_handles_labels()):
            if isinstance(handle, Line2D) and name in ("Pareto frontier", "unquantized"):
                lines.setdefault(name, handle)
    shapes += lines.values()
    for where, handles, title in (
        ("outside lower left", swatches, "cache (colour)"),
        ("outside lower right", shapes, "policy or engine (marker)"),
    ):
        fig.legend(
            handles=handles,
            loc=where,
            ncols=-(-len(handles) // 5),  # at most five rows
            fontsize="small",
            title=title,
            title_fontsize="small",
        )


def _integer_axes(ax, xlabel: str, ylabel: str) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def plot_entropy(entropy: pd.DataFrame, model: str) -> Figure:
    """Heat map of H2 per layer (rows) and query head (columns); layers without KV cache (no rows) blank."""
    num_layers = int(entropy.attrs.get("num_layers", entropy["layer"].max() + 1))
    grid = entropy.pivot_table(index="layer", columns="q_head", values="H2").reindex(range(num_layers))
    fig = _figure(max(4.0, 0.25 * grid.shape[1] + 2), max(3.0, 0.25 * num_layers + 1.5))
    ax = fig.subplots()
    image = ax.imshow(
        np.ma.masked_invalid(grid.to_numpy(dtype=float)),
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
    )
    fig.colorbar(image, ax=ax, label="H2 (nats)", format=ScalarFormatter(useOffset=False))
    _integer_axes(ax, "query head", "layer")
    ax.set_title(f"{model}: Rényi-2 attention entropy")
    return fig


def allocation_point(records: list[dict], model: str) -> dict | None:
    """The point whose allocation is drawn: the first entropy+sinks point at budget 4, else the first entropy
    point (budget 4 first, with or without a sink rule), else the first point with an allocation."""
    frame = results.table(records)
    mask = (frame["model"] == model) & (frame["status"] == "ok") & (frame["policy"] != "baseline")
    mask &= is_harness(frame)
    if not mask.any():
        return None

    def preference(row: dict) -> tuple[int, bool]:
        at_claim = row["budget"] == CLAIM_BUDGET
        if category(row) == "entropy+sinks" and at_claim:
            return 0, False
        return (1 if row["policy"] == "entropy" else 2), not at_claim

    best = min(ordered(frame[mask]).to_dict("records"), key=preference)  # min keeps the first of equals
    return next(r for r in records if r["key"] == best["key"])


def plot_allocation(record: dict) -> Figure:
    """Bits per layer (rows) and KV head (columns) of one point, discrete colours; uncached layers blank. An
    allocation whose keys and values differ gets one panel per role."""
    allocation = record["allocation"]
    if "bits" in allocation:
        panels = {"bits": allocation["bits"]}
    else:
        panels = {"key bits": allocation["key_bits"], "value bits": allocation["value_bits"]}
    grids = {
        name: np.asarray(grid, dtype=np.int64) for name, grid in panels.items()
    }  # (L, Hkv); 0 = no cache
    stored = sorted({w for bits in grids.values() for w in bits[bits > 0].tolist()})
    levels = sorted(set(ALLOWED_WIDTHS) | set(stored))
    cmap = ListedColormap(matplotlib.colormaps["viridis"](np.linspace(0, 1, len(levels))))
    norm = BoundaryNorm(np.arange(len(levels) + 1) - 0.5, len(levels))
    rows, cols = next(iter(grids.values())).shape
    fig = _figure(len(grids) * max(4.0, 0.4 * cols + 2.5), max(3.0, 0.25 * rows + 1.5))
    axes = np.atleast_1d(fig.subplots(1, len(grids)))
    for ax, (name, bits) in zip(axes, grids.items()):
        codes = np.ma.masked_where(bits == 0, np.searchsorted(levels, bits))
        image = ax.imshow(codes, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
        bar = fig.colorbar(image, ax=ax, ticks=range(len(levels)), label=name)
        bar.ax.set_yticklabels([str(w) for w in levels])
        if bits.size <= 400:  # small grids: the width in each cell too
            for (layer, head), width in np.ndenumerate(bits):
                if width:
                    ax.text(
                        head, layer, str(width), ha="center", va="center", fontsize="x-small", color="white"
                    )
        _integer_axes(ax, "KV head", "layer")
    config = record["config"]
    title = f"{config['model']}: {configuration(config)}, budget {config['budget']}, {config['scheme']}"
    (axes[0].set_title if len(grids) == 1 else fig.suptitle)(title, fontsize="medium")
    return fig


def save(fig: Figure, path: Path, formats: Iterable[str] = ("png",)) -> list[Path]:
    """fig as path.<format> for each format, with no timestamps or random ids (reproducible bytes)."""
    written = []
    with matplotlib.rc_context({"svg.hashsalt": SVG_SALT}):
        for fmt in formats:
            out = path.with_suffix(f".{fmt}")
            metadata = {"Date": None} if fmt in ("svg", "pdf") else None
            fig.savefig(out, format=fmt, dpi=120, metadata=metadata)
            written.append(out)
    return written
