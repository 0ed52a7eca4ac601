"""Pictures of digit maps: digits per operator, the operator graph, digits over steps.

All plots use matplotlib's Agg backend (no display needed) and write PNG, SVG or PDF by the
file's extension. Colours encode severity as a fraction of the format's digit cap (p·log10 2):
see :func:`severity`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Union

from .digitmap import DigitMap, _as_digits

PathLike = Union[str, Path]

# Severity bands as fractions of the digit cap. A bf16 operator (cap 2.41) under 0.6 digits
# keeps less than one reliable leading digit: that is "lost" whatever the format.
SEVERITY_BANDS = (
    (0.25, "lost", "#d62728"),
    (0.50, "poor", "#ff7f0e"),
    (0.75, "fair", "#e6c229"),
    (math.inf, "good", "#2ca02c"),
)


def severity(digits: float, cap: float) -> tuple[str, str]:
    """(label, colour) of ``digits`` reliable digits out of ``cap``: lost/poor/fair/good."""
    frac = _as_digits(digits) / cap if cap > 0 else 0.0
    for bound, label, colour in SEVERITY_BANDS:
        if frac < bound:
            return label, colour
    return SEVERITY_BANDS[-1][1], SEVERITY_BANDS[-1][2]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: PathLike) -> Path:
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ValueError(f"plot file must end in .png, .svg or .pdf, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def plot_digits(dm: DigitMap, path: PathLike, top: Optional[int] = None,
                metric: str = "avg") -> Path:
    """Horizontal bar chart of digits per operator (worst at the top), coloured by severity.

    Operators are ordered worst first as in :meth:`DigitMap.table` (min, then avg digits).
    Bars show ``metric`` digits ("avg", default, or "min"); a black tick marks the other
    statistic. (A bar of min digits is often empty: one computational zero in a tensor makes
    it 0.) The dashed line is the format's cap.
    """
    if metric not in ("min", "avg"):
        raise ValueError(f"metric must be 'min' or 'avg', got {metric!r}")
    plt = _pyplot()
    ops = dm.sorted_worst_first() if top is None else dm.worst(top)
    if not ops:
        raise ValueError("the digit map has no operators to plot")
    cap = dm.cap
    vals = [_as_digits(op.digits(metric)) for op in ops]
    colours = [severity(v, cap)[1] for v in vals]
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.32 * len(ops)))
    try:
        y = list(range(len(ops)))[::-1]  # worst at the top
        ax.barh(y, vals, color=colours)
        other = "avg" if metric == "min" else "min"
        ax.scatter([_as_digits(op.digits(other)) for op in ops], y, marker="|", s=120,
                   color="black", label=f"{other} digits", zorder=3)
        ax.axvline(cap, color="grey", linestyle="--", linewidth=1, label=f"cap {cap:.2f}")
        ax.set_yticks(y)
        ax.set_yticklabels([op.name for op in ops], fontsize=8)
        ax.set_xlim(0, max(cap, max(vals)) * 1.05 or 1.0)
        ax.set_xlabel(f"{metric} reliable digits")
        fmt = dm.metadata.get("format", "?")
        ax.set_title(f"digits per operator ({fmt}, N={dm.metadata.get('n_samples', '?')})")
        handles, labels = ax.get_legend_handles_labels()
        from matplotlib.patches import Patch

        for _, label, colour in SEVERITY_BANDS:
            handles.append(Patch(color=colour))
            labels.append(label)
        ax.legend(handles, labels, fontsize=7, loc="lower right")
        return _save(fig, path)
    finally:
        plt.close(fig)


def _layered_positions(g) -> dict:
    """Left-to-right layers by longest path from the sources (a DAG); spring layout otherwise."""
    import networkx as nx

    if g.number_of_nodes() and nx.is_directed_acyclic_graph(g):
        layer: dict[str, int] = {}
        for n in nx.topological_sort(g):
            layer[n] = max((layer[p] + 1 for p in g.predecessors(n)), default=0)
        h = g.copy()
        nx.set_node_attributes(h, layer, "layer")
        return nx.multipartite_layout(h, subset_key="layer")
    return nx.spring_layout(g, seed=0)


def plot_graph(dm: DigitMap, path: PathLike, metric: str = "avg") -> Path:
    """The graph of instrumented operators, nodes coloured by digits (red = few, green = cap)."""
    import networkx as nx

    plt = _pyplot()
    g = dm.graph()
    if g.number_of_nodes() == 0:
        raise ValueError("the digit map has no operators to draw")
    if metric not in ("min", "avg"):
        raise ValueError(f"metric must be 'min' or 'avg', got {metric!r}")
    cap = dm.cap
    key = "min_digits" if metric == "min" else "avg_digits"
    pos = _layered_positions(g)
    nodes = list(g.nodes)
    vals = [_as_digits(g.nodes[n][key]) for n in nodes]
    n = len(nodes)
    fig, ax = plt.subplots(figsize=(min(4 + 0.9 * n, 24), min(3 + 0.35 * n, 16)))
    try:
        cmap = plt.get_cmap("RdYlGn")
        nx.draw_networkx_edges(g, pos, ax=ax, arrows=True, arrowsize=10, edge_color="#888888",
                               node_size=600)
        drawn = nx.draw_networkx_nodes(g, pos, ax=ax, nodelist=nodes, node_color=vals,
                                       cmap=cmap, vmin=0.0, vmax=cap or 1.0, node_size=600,
                                       edgecolors="black", linewidths=0.5)
        labels = {node: f"{node}\n{v:.2f}" for node, v in zip(nodes, vals)}
        xs, ys = [p[0] for p in pos.values()], [p[1] for p in pos.values()]
        xr, yr = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
        # names under the nodes, alternately higher and lower from one layer (x) to the next
        # so that long names of neighbouring layers do not overprint each other
        rank = {x: i for i, x in enumerate(sorted(set(round(x, 9) for x in xs)))}
        drop = 0.07 * yr
        label_pos = {k: (x, y - drop * (1 + 1.6 * (rank[round(x, 9)] % 2)))
                     for k, (x, y) in pos.items()}
        nx.draw_networkx_labels(g, label_pos, labels=labels, ax=ax, font_size=7,
                                verticalalignment="top")
        ax.set_xlim(min(xs) - 0.15 * xr, max(xs) + 0.15 * xr)
        ax.set_ylim(min(ys) - 0.25 * yr, max(ys) + 0.1 * yr)
        fig.colorbar(drawn, ax=ax, label=f"{metric} reliable digits (cap {cap:.2f})")
        ax.set_title(f"operator graph ({dm.metadata.get('format', '?')}, {metric} digits)")
        ax.axis("off")
        return _save(fig, path)
    finally:
        plt.close(fig)


def plot_series(dm: DigitMap, path: PathLike, top: int = 5, metric: str = "min") -> Path:
    """Digits over steps of the ``top`` worst operators, one line per operator and phase.

    Only points with a step (calls made inside ``be.phase(..., step=i)``) are plotted.

    Raises:
        ValueError: the map has no per-step points.
    """
    if metric not in ("min", "avg"):
        raise ValueError(f"metric must be 'min' or 'avg', got {metric!r}")
    if not any(s.step is not None for s in dm.steps):
        raise ValueError("the digit map has no per-step entries to plot (record calls inside "
                         "`with be.phase(name, step=i)`)")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    try:
        styles = ["-", "--", ":", "-."]
        phases = list(dict.fromkeys(p for p, _ in dm.step_keys()))
        worst = dm.worst(top)
        for op in worst:
            colour = None
            for i, phase in enumerate(phases):
                pts = [s for s in dm.series(op.name, phase) if s.step is not None]
                if not pts:
                    continue
                label = op.name if len(phases) == 1 else f"{op.name} [{phase}]"
                (line,) = ax.plot([s.step for s in pts], [_as_digits(s.digits(metric))
                                                          for s in pts],
                                  styles[i % len(styles)], marker="o", markersize=3,
                                  color=colour, label=label)
                colour = line.get_color()
        ax.axhline(dm.cap, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel(f"{metric} reliable digits")
        ax.set_ylim(bottom=0)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"digits over steps, {len(worst)} worst operator(s)")
        ax.legend(fontsize=7)
        return _save(fig, path)
    finally:
        plt.close(fig)
