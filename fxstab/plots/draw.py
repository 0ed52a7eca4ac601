"""Pictures of digit maps: digits per operator, the operator graph, digits over steps.

All plots use matplotlib's Agg backend (no display needed) and write PNG, SVG or PDF by the
file's extension. Every plot takes ``metric`` (None: :data:`fxstab.digitmap.DEFAULT_METRIC`,
read at call time) and sorts and colours operators by ``op.digits(metric)``. Colours encode
severity as a fraction of the format's digit cap (p·log10 2): see :func:`severity`.

The operator graph is drawn where :func:`fxstab.plots.layout.layout_graph` puts it.
``docs/pictures.md`` shows how to read each picture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..digitmap import DigitMap, PathLike, operators
from .layout import CHAR_IN, FONT_PT, layout_graph

# Severity bands as fractions of the digit cap. A bf16 operator (cap 2.41) under 0.6 digits
# keeps less than one reliable leading digit: that is "lost" whatever the format.
SEVERITY_BANDS = (
    (0.25, "lost", "#d62728"),
    (0.50, "poor", "#ff7f0e"),
    (0.75, "fair", "#e6c229"),
    (math.inf, "good", "#2ca02c"),
)

# NaN/inf marks of the graph: a colour outside the red-yellow-green digit scale.
NONFINITE_COLOUR = "#6a00f4"


def _or_zero(digits: float) -> float:
    """NaN digits (unknown) count as 0 reliable digits, as in the map's rankings."""
    return 0.0 if math.isnan(digits) else float(digits)


def severity(digits: float, cap: float) -> tuple[str, str]:
    """(label, colour) of ``digits`` reliable digits out of ``cap``: lost/poor/fair/good."""
    frac = _or_zero(digits) / cap if cap > 0 else 0.0
    for bound, label, colour in SEVERITY_BANDS:
        if frac < bound:
            return label, colour
    return SEVERITY_BANDS[-1][1], SEVERITY_BANDS[-1][2]


def _metric(dm: DigitMap, metric: Optional[str]) -> str:
    """``metric`` or the map's default metric (read now, so a changed default flows through).

    The map's operators validate the name (``op.digits`` raises ``ValueError`` for an unknown
    metric), so a plot accepts exactly the metrics the digit map knows.
    """
    m = operators.DEFAULT_METRIC if metric is None else metric
    if not isinstance(m, str):
        raise ValueError(f"metric must be a metric name such as {operators.DEFAULT_METRIC!r}, "
                         f"got {m!r}")
    for op in dm.operators.values():
        op.digits(m)
        break
    return m


def _worst_first(dm: DigitMap, metric: str) -> list:
    """Operators by ``metric`` digits, then min digits, then name (NaN as 0), as the map's
    tables rank them."""
    return sorted(dm.operators.values(), key=lambda op: (
        _or_zero(op.digits(metric)), _or_zero(op.min_digits), op.name))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _check_path(path: PathLike) -> Path:
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ValueError(f"plot file must end in .png, .svg or .pdf, got {str(path)!r}")
    return path


def _save(fig, path: PathLike, dpi: float = 120) -> Path:
    path = _check_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


# --------------------------------------------------------------------------- bars
ORDERS = ("lost", "worst")


def plot_digits(dm: DigitMap, path: PathLike, top: Optional[int] = None,
                metric: Optional[str] = None, order: str = "lost") -> Path:
    """Horizontal bar chart of digits per operator, coloured by severity, the first at the top.

    ``order="lost"`` (the default) ranks the operators as the findings do
    (:meth:`DigitMap.localize`): where NaN/inf first appear, then the largest local loss, each
    bar labelled with what it loses against its least accurate input; so the picture points
    where the text does, not at the operators downstream of an overflow, which all keep 0
    digits. ``order="worst"`` sorts by the digits themselves. Bars show ``metric`` digits
    (default: the map's default metric); a black tick marks the min digits (avg digits when
    the metric is min). (A bar of min digits is often empty: one computational zero in a
    tensor makes it 0.) The dashed line is the format's cap.
    """
    _check_path(path)
    if top is not None and top < 1:
        raise ValueError(f"top must be >= 1 (or None for all operators), got {top}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    metric = _metric(dm, metric)
    if order == "lost":
        ranked = dm.localize(metric)[:top]
        ops = [dm.operators[r.name] for r in ranked]
    else:
        ranked, ops = None, _worst_first(dm, metric)[:top]
    if not ops:
        raise ValueError("the digit map has no operators to plot")
    plt = _pyplot()
    cap = dm.cap
    vals = [_or_zero(op.digits(metric)) for op in ops]
    colours = [severity(v, cap)[1] for v in vals]
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.32 * len(ops)))
    try:
        y = list(range(len(ops)))[::-1]  # worst at the top
        ax.barh(y, vals, color=colours)
        other = "avg" if metric == "min" else "min"
        ax.scatter([_or_zero(op.digits(other)) for op in ops], y, marker="|", s=120,
                   color="black", label=f"{other} digits", zorder=3)
        ax.axvline(cap, color="grey", linestyle="--", linewidth=1, label=f"cap {cap:.2f}")
        ax.set_yticks(y)
        ax.set_yticklabels([op.name for op in ops], fontsize=8)
        right = max(cap, max(vals)) * 1.05 or 1.0
        if ranked is not None:  # what each operator loses (the ranking's key)
            right *= 1.3
            for yy, r, v in zip(y, ranked, vals):
                label = "NaN/inf origin" if r.nonfinite_origin else \
                    f"loses {r.local_loss:.2f}" if r.local_loss >= 0.005 else ""
                if label:
                    ax.text(v + 0.02 * right, yy, label, va="center", fontsize=7,
                            color=NONFINITE_COLOUR if r.nonfinite_origin else "black")
        ax.set_xlim(0, right)
        ax.set_xlabel(f"{metric} reliable digits")
        fmt = dm.metadata.get("format", "?")
        how = ("ranked where digits are lost: NaN/inf origins, then local loss"
               if ranked is not None else "worst first")
        title = (f"digits per operator ({fmt}, N={dm.metadata.get('n_samples', '?')}, "
                 f"{metric} digits, {how})")
        missing = sum(1 for op in ops if math.isnan(op.digits(metric)))
        if missing:  # e.g. a version-1 map has no normwise or quantile digits
            title += f"\n{missing} operator(s) without {metric} digits, drawn as 0"
        ax.set_title(title)
        handles, labels = ax.get_legend_handles_labels()
        from matplotlib.patches import Patch

        for _, label, colour in SEVERITY_BANDS:
            handles.append(Patch(color=colour))
            labels.append(label)
        # beside the axes: the labels of the ranking fill the right of the plot
        ax.legend(handles, labels, fontsize=7, loc="lower left", bbox_to_anchor=(1.01, 0.0))
        return _save(fig, path)
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- graph picture
def _curve(points: list):
    """A path through ``points`` with vertical tangents at each (edges leave and enter
    boxes straight down, so every arrowhead points down)."""
    from matplotlib.path import Path as MPath

    verts, codes = [points[0]], [MPath.MOVETO]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        k = (y0 - y1) / 2
        verts += [(x0, y0 - k), (x1, y1 + k), (x1, y1)]
        codes += [MPath.CURVE4] * 3
    return MPath(verts, codes)


@dataclass
class NodeStyle:
    """How :func:`plot_graph` draws one operator: fill, outline and the text under its name."""

    face: tuple
    edge: str
    linewidth: float
    linestyle: str
    ink: str
    text: str
    origin: bool


_NO_DIGITS = (0.82, 0.82, 0.82, 1.0)  # an operator without digits under the metric


def _digit_scale(dm: DigitMap):
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    return colormaps["RdYlGn"], Normalize(0.0, dm.cap or 1.0)


def node_styles(dm: DigitMap, metric: Optional[str] = None) -> dict:
    """name -> :class:`NodeStyle` of every operator in :func:`plot_graph`.

    The fill is the operator's ``metric`` digits on the red (0) to green (cap) scale; grey
    with "n/a" when the map has no such digits for it (NaN: a version-1 map has no normwise
    or quantile digits). A NaN/inf origin (:meth:`DigitMap.nonfinite_sources`) gets a thick
    violet outline, an operator that only passes NaN/inf on a dashed one.
    """
    metric = _metric(dm, metric)
    cmap, norm = _digit_scale(dm)
    sources = set(dm.nonfinite_sources())
    out = {}
    for name, op in dm.operators.items():
        v = op.digits(metric)
        face = _NO_DIGITS if math.isnan(v) else tuple(cmap(norm(v)))
        text = "n/a" if math.isnan(v) else f"{v:.2f}"
        if op.non_finite:
            text += " NaN/inf"
        if name in sources:
            edge, lw, ls = NONFINITE_COLOUR, 2.6, "solid"
        elif op.non_finite:
            edge, lw, ls = NONFINITE_COLOUR, 1.3, "--"
        else:
            edge, lw, ls = "#303030", 0.5, "solid"
        lum = 0.299 * face[0] + 0.587 * face[1] + 0.114 * face[2]
        out[name] = NodeStyle(face, edge, lw, ls, "white" if lum < 0.45 else "black", text,
                              name in sources)
    return out


def plot_graph(dm: DigitMap, path: PathLike, metric: Optional[str] = None) -> Path:
    """The graph of instrumented operators, laid out by :func:`layout_graph`.

    Each box is an operator (its name inside its module box, its ``metric`` digits below),
    filled by digits on a red (0) to green (the format's cap) scale. An operator where NaN/inf
    first appear (:meth:`DigitMap.nonfinite_sources`, also named in the title) has a thick
    violet outline and a halo; one that only passes non-finite values on has a dashed violet
    outline. Edges run from an input's
    bottom to its consumer's top; an edge that leaves the bottom of a column continues at the
    top of the next one through the gap between them.
    """
    _check_path(path)
    metric = _metric(dm, metric)
    lay = layout_graph(dm)
    plt = _pyplot()
    from matplotlib.collections import PatchCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyBboxPatch, Patch, PathPatch

    cap = dm.cap
    cmap, norm = _digit_scale(dm)
    sources = set(dm.nonfinite_sources())
    # The header (title, scale, legend) grows with the picture so that it stays readable
    # when a 27-inch, 300-operator picture is fitted to a screen: x2 at 36 inches.
    margin = 0.25
    fig_w = max(lay.width, 7.0) + 2 * margin
    hs = min(2.0, max(1.0, math.sqrt(fig_w / 9.0)))
    header = 0.95 * hs
    fig_h = lay.height + header + margin
    fig = plt.figure(figsize=(fig_w, fig_h))
    try:
        ax = fig.add_axes([(fig_w - lay.width) / 2 / fig_w, margin / fig_h, lay.width / fig_w,
                           lay.height / fig_h])
        ax.set_xlim(0, lay.width)
        ax.set_ylim(-lay.height, 0)
        ax.axis("off")

        groups = [FancyBboxPatch((g.x0, g.y0), g.x1 - g.x0, g.y1 - g.y0,
                                 boxstyle="round,pad=0,rounding_size=0.06") for g in lay.groups]
        ax.add_collection(PatchCollection(groups, facecolor="#f2f2f7", edgecolor="#9a9ab0",
                                          linewidth=0.8, zorder=0))
        for g in lay.groups:
            ax.text(g.x0 + 0.06, g.y1 - 0.05, g.key + (" (continued)" if g.continued else ""),
                    fontsize=(FONT_PT + 1) * min(hs, 1.4), fontweight="bold", color="#3a3a5a",
                    ha="left",
                    va="top", zorder=1)

        curves = [PathPatch(_curve(p)) for e in lay.edges if not e.back for p in e.pieces]
        ax.add_collection(PatchCollection(curves, facecolor="none", edgecolor="#6b6b6b",
                                          linewidth=0.7, zorder=2))
        for e in lay.edges:
            for c in e.connectors:
                ax.plot(*zip(*c), color="#a0a0a0", linewidth=0.7, zorder=2)
            if e.back:
                (x0, y0), (x1, y1) = e.pieces[0]
                ax.annotate("", (x1, y1), (x0, y0), zorder=2, arrowprops=dict(
                    arrowstyle="-|>", linestyle="--", color="#6b6b6b", linewidth=0.7,
                    connectionstyle="arc3,rad=0.4"))
        heads = [(lay.nodes[e.target].x, lay.nodes[e.target].y + lay.nodes[e.target].h / 2)
                 for e in lay.edges if not e.back]
        if heads:
            ax.scatter(*zip(*heads), marker="v", s=9, color="#6b6b6b", zorder=3, linewidths=0)

        style = node_styles(dm, metric)
        boxes = []
        for name, b in lay.nodes.items():
            st = style[name]
            boxes.append(FancyBboxPatch((b.x - b.w / 2, b.y - b.h / 2), b.w, b.h,
                                        boxstyle="round,pad=0,rounding_size=0.04"))
            fit = min(1.0, (b.w - 0.1) / (len(b.label) * CHAR_IN))
            ax.text(b.x, b.y + 0.075, b.label, fontsize=FONT_PT * fit, ha="center",
                    va="center", color=st.ink, zorder=5)
            ax.text(b.x, b.y - 0.085, st.text, fontsize=FONT_PT, ha="center", va="center",
                    color=st.ink, zorder=5, fontweight="bold" if st.origin else "normal")
        # a halo around each NaN/inf origin: found at a glance in a 300-operator picture
        halos = [FancyBboxPatch((b.x - b.w / 2 - 0.07, b.y - b.h / 2 - 0.07), b.w + 0.14,
                                b.h + 0.14, boxstyle="round,pad=0,rounding_size=0.08")
                 for b in (lay.nodes[n] for n in sorted(sources))]
        ax.add_collection(PatchCollection(halos, facecolor=NONFINITE_COLOUR, alpha=0.35,
                                          edgecolor="none", zorder=3.5))
        styles = [style[n] for n in lay.nodes]
        ax.add_collection(PatchCollection(
            boxes, facecolor=[st.face for st in styles], edgecolor=[st.edge for st in styles],
            linewidths=[st.linewidth for st in styles],
            linestyles=[st.linestyle for st in styles], zorder=4))

        fmt = dm.metadata.get("format", "?")
        title = (f"operator graph: {len(dm)} operator{'s' if len(dm) != 1 else ''}, {fmt}, "
                 f"{metric} digits (cap {cap:.2f})")
        if sources:
            title += f"; NaN/inf first appear at {', '.join(sorted(sources))}"
        elif not any(op.non_finite for op in dm.operators.values()):
            title += "; no NaN/inf"
        missing = sum(1 for op in dm.operators.values() if math.isnan(op.digits(metric)))
        if missing:  # e.g. a version-1 map has no normwise or quantile digits
            title += f"; grey: {missing} without {metric} digits"
        fig.text(margin / fig_w, 1 - 0.12 * hs / fig_h, title, fontsize=10 * hs, ha="left",
                 va="top", fontweight="bold")
        cax = fig.add_axes([margin / fig_w, 1 - 0.62 * hs / fig_h, 2.6 * hs / fig_w,
                            0.12 * hs / fig_h])
        sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
        cb = fig.colorbar(sm, cax=cax, orientation="horizontal")
        cb.ax.tick_params(labelsize=FONT_PT * hs)
        cb.set_label(f"{metric} reliable digits", fontsize=FONT_PT * hs, labelpad=1)
        handles = [Patch(facecolor="white", edgecolor=NONFINITE_COLOUR, linewidth=2.6,
                         label="NaN/inf origin"),
                   Patch(facecolor="white", edgecolor=NONFINITE_COLOUR, linewidth=1.3,
                         linestyle="--", label="passes NaN/inf on"),
                   Patch(facecolor="#f2f2f7", edgecolor="#9a9ab0", label="module"),
                   Line2D([], [], color="#6b6b6b", marker="v", markersize=4 * hs, linewidth=0.7,
                          label="input -> consumer")]
        if not lay.groups:
            handles = [h for h in handles if h.get_label() != "module"]
        fig.legend(handles=handles, loc="upper left", ncol=4, fontsize=FONT_PT * hs,
                   frameon=False, bbox_to_anchor=((margin + 3.0 * hs) / fig_w,
                                                  1 - 0.33 * hs / fig_h))
        # 36 Mpixel at most: a 2000-operator graph still saves in seconds
        dpi = min(120.0, math.sqrt(36e6 / (fig_w * fig_h)))
        return _save(fig, path, dpi=dpi)
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- series
def plot_series(dm: DigitMap, path: PathLike, top: int = 5,
                metric: Optional[str] = None) -> Path:
    """``metric`` digits over steps of the ``top`` worst operators, one line per operator
    and phase.

    Only points with a step (calls made inside ``be.phase(..., step=i)``) are plotted. A point
    where the operator's output had NaN/inf is marked with a violet cross. A one-step map
    (``fxstab record`` with one call) has no trend to draw: it is drawn as the digits of each
    of the ``top`` operators at that step (one marker per phase), said in the title.

    Raises:
        ValueError: the map has no per-step points, ``top`` < 1, or an unknown metric.
    """
    _check_path(path)
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be an integer >= 1, got {top!r}")
    metric = _metric(dm, metric)
    if not any(s.step is not None for s in dm.steps):
        raise ValueError("the digit map has no per-step entries to plot (record calls inside "
                         "`with be.phase(name, step=i)`)")
    phases = list(dict.fromkeys(p for p, _ in dm.step_keys()))
    worst = _worst_first(dm, metric)[:top]
    points = {}  # (operator, phase) -> the points drawn
    for op in worst:
        for phase in phases:
            pts = [s for s in dm.series(op.name, phase) if s.step is not None]
            if pts:
                points[(op.name, phase)] = pts
    steps = sorted({s.step for pts in points.values() for s in pts})
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        from matplotlib.ticker import MaxNLocator

        bad_x, bad_y = [], []
        if len(steps) == 1:
            # one step: operators side by side (worst first), one marker per phase
            markers = "osD^v"
            for i, phase in enumerate(phases):
                xs, ys = [], []
                for j, op in enumerate(worst):
                    for s in points.get((op.name, phase), []):
                        xs.append(j)
                        ys.append(_or_zero(s.digits(metric)))
                        if s.non_finite:
                            bad_x.append(j)
                            bad_y.append(ys[-1])
                if xs:
                    ax.plot(xs, ys, linestyle="none", marker=markers[i % len(markers)],
                            markersize=6, label=phase if len(phases) > 1 else None)
            ax.set_xticks(range(len(worst)))
            ax.set_xticklabels([op.name for op in worst], rotation=35, ha="right", fontsize=7)
            ax.set_xlim(-0.6, len(worst) - 0.4)
            ax.set_title(f"{metric} digits at one step (step {steps[0]}): {len(worst)} worst "
                         f"operator(s), no trend to draw")
        else:
            styles = ["-", "--", ":", "-."]
            for op in worst:
                colour = None
                for i, phase in enumerate(phases):
                    pts = points.get((op.name, phase))
                    if not pts:
                        continue
                    xs = [s.step for s in pts]
                    ys = [_or_zero(s.digits(metric)) for s in pts]
                    label = op.name if len(phases) == 1 else f"{op.name} [{phase}]"
                    (line,) = ax.plot(xs, ys, styles[i % len(styles)], marker="o",
                                      markersize=3, color=colour, label=label)
                    colour = line.get_color()
                    for s, xv, yv in zip(pts, xs, ys):
                        if s.non_finite:
                            bad_x.append(xv)
                            bad_y.append(yv)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_title(f"{metric} digits over {len(steps)} steps, {len(worst)} worst "
                         f"operator(s)")
        if bad_x:
            ax.scatter(bad_x, bad_y, marker="x", s=40, color=NONFINITE_COLOUR, zorder=4,
                       label="NaN/inf output")
        ax.axhline(dm.cap, color="grey", linestyle="--", linewidth=1,
                   label=f"cap {dm.cap:.2f}")
        ax.set_ylabel(f"{metric} reliable digits")
        top_y = dm.cap if dm.cap > 0 else 1.0
        ax.set_ylim(-0.04 * top_y, 1.08 * top_y)  # points at 0 digits stay visible
        ax.legend(fontsize=7, loc="best")
        return _save(fig, path)
    finally:
        plt.close(fig)
