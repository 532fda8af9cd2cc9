"""The sweep run's figures, each a function returning a matplotlib Figure (Agg canvas, no pyplot state), so
notebooks/analysis.ipynb shows the same objects inline:
- the Pareto plot: quality against true compression (fp16 bytes over stored bytes, log axis) with the Pareto
  frontier: kl_mean and ppl_ratio - 1 on log axes, bleu and token_match; one colour per scheme family (the scheme
  without its rotate+ prefix), its storage variants in shades of it, hollow marker by policy family; the frontier
  drawn thick with its points ringed; peer engines' points (harness.peers: llama.cpp, transformers'
  QuantizedCache) filled and larger, in greys by cache type, a marker per engine; one legend below the panels,
  its columns chosen so that it fits inside the figure (`legend_fits` checks it);
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
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter, ScalarFormatter

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
    storage_label,
)
from harness.report.paired import HIGHER_IS_BETTER
from harness.schemes import ROTATE

# Pareto plots: colour = the scheme family (shades: its storage variants), marker = the policy family (hollow) or
# the peer engine (filled), the same marker for a family on every plot; families not named here and peer engines
# take the next of EXTRA_MARKERS / PEER_MARKERS.
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
# A family's colour is the next of tab10's (its hues differ most), in the order families first appear; its variants
# are that colour mixed with black (darkest) to white (lightest) by these shares; peers' cache types take greys.
SHADES = (0.35, 0.55)  # the share of black in the darkest variant, of white in the lightest
PEER_GREYS = (0.0, 0.6)  # black to grey
PANELS = ("kl_mean", "ppl_ratio", "bleu", "token_match")
LOG_PANELS = {"kl_mean": "kl_mean", "ppl_ratio": "ppl_ratio - 1"}  # drawn on log axes, as labelled
X = "compression_true"
ROUND_COMPRESSIONS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
HALF_COMPRESSIONS = (1.25, 1.5, 2.5, 3.5, 4.5, 7)
FINE_STEPS = (0.25, 0.1, 0.05, 0.01)
MAX_TICKS = 10  # x tick labels per panel at most: "4.5x" labels must not touch
LEGEND_ROWS_INCH = 0.19  # the height of one legend row at fontsize small
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
    x_higher_is_better: bool = False,
) -> pd.DataFrame:
    """The Pareto frontier: points no other point beats on metric at the same or a better x (fewer bytes; more
    compression with x_higher_is_better), sorted by x from its best end (fewest bytes, most compression).

    Direction defaults from HIGHER_IS_BETTER (bleu, token_match up; kl_mean, ppl_ratio down). Ties: of points
    with equal x and quality only the first is kept, so the step line has one corner per improvement.
    """
    frame = pd.DataFrame(points)
    higher = HIGHER_IS_BETTER[metric] if higher_is_better is None else higher_is_better
    frame = frame[np.isfinite(frame[x].astype(float)) & np.isfinite(frame[metric].astype(float))]
    quality = frame[metric].astype(float) * (1 if higher else -1)  # larger is better from here on
    cost = frame[x].astype(float).to_numpy() * (-1 if x_higher_is_better else 1)  # smaller is better
    order = np.lexsort((-quality.to_numpy(), cost))
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


def scheme_family(row: Mapping) -> str:
    """A harness point's colour family on the Pareto plots: its scheme without a rotate+ prefix."""
    return str(row["scheme"]).removeprefix(ROTATE)


def variant_label(row: Mapping) -> str:
    """A harness point's shade within its family: 'rotate' for a rotate+ scheme and its storage options
    (labels.storage_label), 'plain' without either."""
    parts = ["rotate"] if str(row["scheme"]).startswith(ROTATE) else []
    options = storage_label(row).removeprefix(" + ")
    return " + ".join([*parts, options] if options else parts) or "plain"


def shades(base, count: int) -> list[tuple[float, float, float]]:
    """`count` shades of the RGB colour `base`: mixed with black (SHADES[0]) through base itself to white
    (SHADES[1]), darkest first; one shade is base itself."""
    if count == 1:
        return [tuple(base[:3])]
    rgb = np.array(base[:3])
    out = []
    for t in np.linspace(-SHADES[0], SHADES[1], count):  # < 0: towards black, > 0: towards white
        out.append(tuple(rgb * (1 + t) if t < 0 else rgb + (1 - rgb) * t))
    return out


def compression_ticks(lo: float, hi: float) -> list[float]:
    """Major ticks of a log compression axis spanning [lo, hi]: the ROUND_COMPRESSIONS inside it; where fewer than
    three are, the HALF_COMPRESSIONS too; where still fewer, the multiples of the largest of FINE_STEPS that gives
    three. Thinned so that neighbours lie at least 1/MAX_TICKS of the axis apart (labels never collide)."""
    inside = [v for v in ROUND_COMPRESSIONS if lo <= v <= hi]
    if len(inside) < 3:
        inside = sorted(inside + [v for v in HALF_COMPRESSIONS if lo <= v <= hi])
    for step in FINE_STEPS:
        if len(inside) >= 3:
            break
        inside = [round(k * step, 6) for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]
    gap = (math.log(hi) - math.log(lo)) / MAX_TICKS
    kept = [inside[0]]
    for v in inside[1:]:
        if math.log(v) - math.log(kept[-1]) >= gap:
            kept.append(v)
    return kept


def legend_fits(fig: Figure) -> bool:
    """Whether every legend of fig lies inside the figure and off every axes (after a draw)."""
    renderer = fig.canvas.get_renderer()
    fig.draw_without_rendering()
    box = fig.bbox
    for legend in fig.legends:
        extent = legend.get_window_extent(renderer)
        inside = extent.x0 >= box.x0 - 0.5 and extent.x1 <= box.x1 + 0.5
        inside &= extent.y0 >= box.y0 - 0.5 and extent.y1 <= box.y1 + 0.5
        if not inside or any(extent.overlaps(ax.get_tightbbox(renderer)) for ax in fig.axes):
            return False
    return True


@dataclass(frozen=True)
class _Style:
    """The Pareto plot's colours (a family per scheme, a shade per variant; peers' cache types in greys) and
    markers (one per policy family, then per peer engine)."""

    variants: dict  # scheme family -> its variant labels, "plain" first
    colour: dict  # (scheme family, variant) -> RGB
    grey: dict  # a peer's cache label -> RGB
    families: list[str]
    engines: list[str]
    marker: dict

    @classmethod
    def of(cls, mine: list[dict], theirs: list[dict]) -> _Style:
        """The style of the harness's points `mine` and the peer engines' points `theirs`."""
        variants: dict[str, list[str]] = {}
        for row in mine:
            names = variants.setdefault(scheme_family(row), [])
            if variant_label(row) not in names:
                names.append(variant_label(row))
        colour = {}
        palette = matplotlib.colormaps["tab10"]
        for i, (fam, names) in enumerate(variants.items()):
            names.sort(key=lambda n: (n != "plain", n))
            for name, shade in zip(names, shades(palette(i % palette.N), len(names))):
                colour[(fam, name)] = shade
        peer_caches = sorted({cache_label(r) for r in theirs})
        levels = np.linspace(*PEER_GREYS, len(peer_caches)) if len(peer_caches) > 1 else [PEER_GREYS[0]]
        grey = {name: (v, v, v) for name, v in zip(peer_caches, levels)}
        kinds = {family(r) for r in mine}
        families = [f for f in FAMILY_MARKERS if f in kinds] + sorted(kinds - FAMILY_MARKERS.keys())
        marker = _markers(families, FAMILY_MARKERS, EXTRA_MARKERS)
        engines = sorted({family(r) for r in theirs})
        marker.update(_markers(engines, {}, PEER_MARKERS))
        return cls(variants, colour, grey, families, engines, marker)

    def look(self, row: Mapping, is_peer: bool):
        """The colour of one point's collection."""
        return (
            self.grey[cache_label(row)] if is_peer else self.colour[(scheme_family(row), variant_label(row))]
        )


def plot_pareto(frame: pd.DataFrame, model: str, scheme: str | None = None) -> Figure:
    """Four panels (kl_mean and ppl_ratio - 1 on log axes, bleu, token_match) against true compression (log axis),
    the harness's frontier as thick steps with its points ringed.

    Colour: the scheme family, its variants (rotation, storage options) in shades; marker: the policy family,
    hollow, or the peer engine, filled and larger (greys by cache type). scheme=None: every scheme of the model
    on one plot. Peer engines' points of the model are drawn on every plot, except an engine's own unquantized
    reference (compression 1: llama.cpp's f16). A value a log panel cannot show (ppl_ratio at or below 1,
    kl_mean 0) is left out, and the panel's title says how many were.
    """
    here = frame[(frame["model"] == model) & (frame["status"] == "ok") & (frame["policy"] != "baseline")]
    here = here[np.isfinite(here[X].astype(float)) & (here[X].astype(float) > 0)]
    points, peer_points = here[is_harness(here)], here[~is_harness(here)]
    # an engine's own reference (llama.cpp's f16, compression 1) is not drawn
    peer_points = peer_points[peer_points[X].astype(float) > 1]
    if scheme is not None:
        points = points[points["scheme"] == scheme]
    mine, theirs = ordered(points).to_dict("records"), peer_points.to_dict("records")
    style = _Style.of(mine, theirs)
    # one collection per configuration, named after it (scheme-prefixed on the all-schemes plot)
    name_of = configuration if scheme is not None else (lambda r: f"{r['scheme']}: {configuration(r)}")
    drawn: dict[tuple[str, bool], list[dict]] = {}
    for row in mine:
        drawn.setdefault((name_of(row), False), []).append(row)
    for row in theirs:
        drawn.setdefault((configuration(row), True), []).append(row)
    base = frame[(frame["model"] == model) & (frame["policy"] == "baseline") & (frame["status"] == "ok")]
    xs = pd.concat([points[X], peer_points[X]]).astype(float)
    lo, hi = (float(xs.min()), float(xs.max())) if len(xs) else (1.0, 2.0)

    fig = _figure(11, 8)
    axes = fig.subplots(2, 2).ravel()
    for ax, metric in zip(axes, PANELS):
        unquantized = base.iloc[0][metric] if len(base) else math.nan
        _pareto_panel(ax, metric, drawn, points, unquantized, style, (lo / 1.08, hi * 1.08))
    _pareto_legend(fig, axes, style)
    fig.suptitle(f"{model} / {scheme or 'all schemes'}: quality against true compression")
    return fig


def _pareto_panel(
    ax, metric: str, drawn: dict, points: pd.DataFrame, unquantized: float, style: _Style, xlim: tuple
) -> None:
    """One panel: every collection of `drawn` ((name, is_peer) -> rows) at its true compression, the harness's
    frontier as thick steps with its points ringed, and the unquantized value as a dotted line (linear panels)."""
    shown = LOG_PANELS.get(metric)

    def y(rows: list[dict]) -> np.ndarray:
        values = np.array([r[metric] for r in rows], dtype=float)
        return values - 1 if metric == "ppl_ratio" else values

    hidden = kept = 0
    for (name, is_peer), rows in drawn.items():
        values = y(rows)
        keep = values > 0 if shown else np.isfinite(values)
        hidden += int((~keep & np.isfinite(values)).sum())
        kept += int(keep.sum())
        look = style.look(rows[0], is_peer)
        ax.scatter(
            np.array([r[X] for r in rows], dtype=float)[keep],
            values[keep],
            marker=style.marker[family(rows[0])],
            s=70 if is_peer else 30,
            facecolors=look if is_peer else "none",
            edgecolors="black" if is_peer else look,
            linewidths=0.8 if is_peer else 1.1,
            label=name,
            zorder=5 if is_peer else 3,
        )
    edge = frontier(points, metric, x=X, x_higher_is_better=True)
    edge_y = y(edge.to_dict("records")) if len(edge) else np.zeros(0)
    if shown:
        edge, edge_y = edge[edge_y > 0], edge_y[edge_y > 0]
    if len(edge):
        # from the most compressed frontier point to the least: at compression c the best quality of any point
        # at c or more, held until the next point
        ax.step(
            edge[X].astype(float), edge_y, where="post", color="black", linewidth=1.8,
            label="Pareto frontier", zorder=2,
        )  # fmt: skip
        ax.scatter(
            edge[X].astype(float), edge_y, s=110, facecolors="none", edgecolors="black", linewidths=1.0,
            label="on the frontier", zorder=4,
        )  # fmt: skip
    if pd.notna(unquantized) and not shown:
        ax.axhline(unquantized, color="grey", linestyle=":", linewidth=1, label="unquantized")
    if shown and kept:  # (a log axis over nothing positive cannot be drawn: every point hidden, say so)
        ax.set_yscale("log")
    ax.set_xscale("log")
    ax.set_xlim(*xlim)
    ax.xaxis.set_major_locator(FixedLocator(compression_ticks(*xlim)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("true compression (fp16 bytes / stored bytes)")
    ax.set_ylabel(f"{shown or metric} ({'higher' if HIGHER_IS_BETTER[metric] else 'lower'} is better)")
    if hidden:
        ax.set_title(f"{hidden} point(s) at {shown} <= 0 not drawn", fontsize="small")
    ax.grid(True, which="both", alpha=0.3)


def _pareto_legend(fig, axes, style: _Style) -> None:
    """One legend below the panels: each scheme family (bold) with its variants' shades, the peers' cache types,
    then the markers and lines; the fewest rows whose width fits the figure, the figure as tall as it needs."""
    handles, bold = [], []
    for fam, names in style.variants.items():
        bold.append(len(handles))
        if names == ["plain"]:  # one entry: the family's colour
            handles.append(Patch(facecolor=style.colour[(fam, "plain")], label=fam))
            continue
        handles.append(Patch(facecolor="none", edgecolor="none", label=fam))
        handles += [Patch(facecolor=style.colour[(fam, n)], label=f"  {n}") for n in names]
    if style.grey:
        bold.append(len(handles))
        handles.append(Patch(facecolor="none", edgecolor="none", label="peers (filled)"))
        handles += [
            Patch(facecolor=c, edgecolor="black", label=f"  {name}") for name, c in style.grey.items()
        ]
    handles += [
        Line2D(
            [], [], linestyle="none", marker=style.marker[f], markerfacecolor="none", color="black", label=f
        )
        for f in style.families
    ]
    handles += [
        Line2D(
            [], [], linestyle="none", marker=style.marker[e], markerfacecolor="grey", color="black", label=e
        )
        for e in style.engines
    ]
    lines = {}
    for ax in axes:  # the frontier, its rings and the unquantized line, once each
        for handle, name in zip(*ax.get_legend_handles_labels()):
            if name in ("Pareto frontier", "on the frontier", "unquantized"):
                lines.setdefault(name, handle)
    handles += lines.values()
    width, panels = fig.get_size_inches()
    for columns in range(min(4, len(handles)), 0, -1):
        rows = -(-len(handles) // columns)
        fig.set_size_inches(width, panels + rows * LEGEND_ROWS_INCH + 0.4)
        legend = fig.legend(
            handles=handles, loc="outside lower center", ncols=columns, fontsize="small",
            title="colour: scheme family (shade: variant); marker: policy or peer engine", title_fontsize="small",
        )  # fmt: skip
        for i in bold:
            legend.get_texts()[i].set_fontweight("bold")
        if columns == 1 or legend_fits(fig):
            return
        legend.remove()


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
