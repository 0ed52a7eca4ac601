"""Pictures of digit maps: digits per operator, the operator graph, digits over steps.

All plots use matplotlib's Agg backend (no display needed) and write PNG, SVG or PDF by the
file's extension. Every plot takes ``metric`` (None: :data:`fxstab.digitmap.DEFAULT_METRIC`,
read at call time) and sorts and colours operators by ``op.digits(metric)``. Colours encode
severity as a fraction of the format's digit cap (p·log10 2): see :func:`severity`.

The operator graph is laid out by :func:`layout_graph` (no graphviz needed): operators in
layers from the top down, one layer per step of the longest path, each run of a repeated
module (``blocks.3``, ``layers.11``) in its own labelled box, and the layers wrapped into
newspaper columns when one column would be too tall to read. ``docs/pictures.md`` shows how to
read each picture.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from ..digitmap import DigitMap, operators

PathLike = Union[str, Path]

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
def plot_digits(dm: DigitMap, path: PathLike, top: Optional[int] = None,
                metric: Optional[str] = None) -> Path:
    """Horizontal bar chart of digits per operator (worst at the top), coloured by severity.

    Bars show ``metric`` digits (default: the map's default metric), worst first; a black tick
    marks the min digits (avg digits when the metric is min). (A bar of min digits is often
    empty: one computational zero in a tensor makes it 0.) The dashed line is the format's cap.
    """
    _check_path(path)
    if top is not None and top < 1:
        raise ValueError(f"top must be >= 1 (or None for all operators), got {top}")
    metric = _metric(dm, metric)
    ops = _worst_first(dm, metric)[:top]
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
        ax.set_xlim(0, max(cap, max(vals)) * 1.05 or 1.0)
        ax.set_xlabel(f"{metric} reliable digits")
        fmt = dm.metadata.get("format", "?")
        title = (f"digits per operator ({fmt}, N={dm.metadata.get('n_samples', '?')}, "
                 f"{metric} digits, worst first)")
        missing = sum(1 for op in ops if math.isnan(op.digits(metric)))
        if missing:  # e.g. a version-1 map has no normwise or quantile digits
            title += f"\n{missing} operator(s) without {metric} digits, drawn as 0"
        ax.set_title(title)
        handles, labels = ax.get_legend_handles_labels()
        from matplotlib.patches import Patch

        for _, label, colour in SEVERITY_BANDS:
            handles.append(Patch(color=colour))
            labels.append(label)
        ax.legend(handles, labels, fontsize=7, loc="lower right")
        return _save(fig, path)
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- graph layout
# Sizes in inches: the layout's coordinates are the picture's, so a label drawn at FONT_PT
# fits its box at any graph size. 7 pt is legible at 100% on screen and in print; a row pitch
# of 0.5 in leaves a 0.17 in lane for the edges between two-line boxes of 0.33 in.
FONT_PT = 7.0
_CHAR_IN = 0.58 * FONT_PT / 72  # mean advance of DejaVu Sans, measured on operator names
_LABEL_CHARS = (12, 24)  # box width in characters: at least, at most (longer names shrink)
_BOX_H = 0.33
_ROW = 0.5
_DUMMY_W = 0.1  # the lane of an edge passing a layer
_GAP = 0.12  # between boxes of one layer
_TITLE_H = 0.26  # a module box's title above its first layer
_RUN_GAP = 0.16  # between two module boxes of one column
_PAD = 0.08  # module box around its operators
_COL_GAP = 0.55  # between columns: the lane of the edges that wrap to the next column
_MIN_WRAP_H = 9.0  # a column shorter than this is never wrapped
_ASPECT = 1.3  # width / height aimed at when wrapping


@dataclass
class NodeBox:
    """One operator in a :class:`GraphLayout`: box centre, size, layer and place."""

    name: str
    x: float
    y: float
    w: float
    h: float
    layer: int
    column: int
    group: str
    label: str


@dataclass
class GroupBox:
    """A run of consecutive layers of one module (``blocks.3``) within one column."""

    key: str
    column: int
    x0: float
    y0: float
    x1: float
    y1: float
    members: list = field(default_factory=list)
    continued: bool = False


@dataclass
class EdgeRoute:
    """An input -> consumer edge as points from the source's bottom to the target's top.

    ``pieces`` are point lists drawn as smooth curves; ``connectors`` the straight polylines
    that carry an edge from the bottom of one column, through the gap, to the top of the next.
    ``back`` marks an edge against the drawing order (only in a graph with a cycle).
    """

    source: str
    target: str
    pieces: list
    connectors: list
    back: bool = False


@dataclass
class GraphLayout:
    """Positions of a digit map's operator graph, in inches (y grows upward; the top is 0).

    ``crossings`` counts the edge crossings between adjacent layers of the order drawn.
    """

    nodes: dict
    groups: list
    edges: list
    width: float
    height: float
    columns: int
    layers: int
    crossings: int = 0


def group_key(module_path: str) -> str:
    """The repeated unit a module belongs to: the path up to its first numeric index.

    ``blocks.3.attn.qkv`` -> ``blocks.3``; ``model.layers.11.mlp`` -> ``model.layers.11``;
    a module outside any ``ModuleList``/``Sequential`` index (``tok``, ``ln_f``, the root) ->
    ``""``: the top level, drawn without a box.
    """
    parts = module_path.split(".") if module_path else []
    for i, p in enumerate(parts):
        if i and p.isdigit():
            return ".".join(parts[:i + 1])
    return ""


def _label(name: str, key: str) -> str:
    """The operator's name inside its module box (``blocks.3.attn/softmax#0`` -> ``attn/...``)."""
    if key and name.startswith(key + "."):
        return name[len(key) + 1:]
    if key and name.startswith(key + "/"):
        return name[len(key) + 1:]
    return name


def _order(names: list, preds: dict, succs: dict, key: dict) -> tuple[list, set]:
    """A topological order that finishes a module before starting the next where it can.

    Kahn's algorithm; among the ready operators, those of the module drawn last come first,
    then the map's order. A cycle (not produced by fxstab, but a hand-made map may have one)
    is broken at the earliest remaining operator; the edges it ignores are returned as back
    edges.
    """
    index = {n: i for i, n in enumerate(names)}
    missing = {n: len(preds[n]) for n in names}
    ready_all: list = []
    ready_by: dict = {}
    done: set = set()

    def push(n: str) -> None:
        heapq.heappush(ready_all, (index[n], n))
        heapq.heappush(ready_by.setdefault(key[n], []), (index[n], n))

    for n in names:
        if not missing[n]:
            push(n)
    order: list = []
    last = None
    back: set = set()
    while len(order) < len(names):
        n = None
        for heap in (ready_by.get(last, []), ready_all):
            while heap and heap[0][1] in done:
                heapq.heappop(heap)
            if heap:
                n = heapq.heappop(heap)[1]
                break
        if n is None:  # a cycle: break it at the earliest operator left
            n = min((m for m in names if m not in done), key=index.__getitem__)
            back.update((p, n) for p in preds[n] if p not in done)
        done.add(n)
        order.append(n)
        last = key[n]
        for s in succs[n]:
            if s not in done:
                missing[s] -= 1
                if missing[s] == 0:
                    push(s)
    return order, back


def _place_row(items: list, desired: dict, width: dict) -> dict:
    """x of the items of one layer, in their order, as near as possible to ``desired``.

    Least squares under the order and the minimum spacing (pool adjacent violators on
    ``desired - offset``, offset = cumulative spacing): the nearest non-overlapping placement.
    """
    offs, acc = [], 0.0
    for i, it in enumerate(items):
        if i:
            gap = _GAP if width[items[i - 1]] > _DUMMY_W or width[it] > _DUMMY_W else _GAP / 3
            acc += (width[items[i - 1]] + width[it]) / 2 + gap
        offs.append(acc)
    blocks: list = []  # [sum, count]
    for d, o in zip((desired[it] for it in items), offs):
        blocks.append([d - o, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out, i = {}, 0
    for s, c in blocks:
        for _ in range(c):
            out[items[i]] = s / c + offs[i]
            i += 1
    return out


def _crossings(upper: list, lower: list, down: dict) -> int:
    """Edge crossings between two adjacent layers (edges of one item never cross)."""
    pos = {it: i for i, it in enumerate(lower)}
    ends = [e for it in upper for e in sorted(pos[t] for t in down[it] if t in pos)]
    return sum(1 for i in range(len(ends)) for j in range(i + 1, len(ends)) if ends[j] < ends[i])


def _layer_runs(order: list, key: dict, fwd_preds: dict, succs: dict) -> tuple:
    """Runs of consecutive operators of one group, stacked, each layered inside itself.

    A run's layers follow the longest path inside the run; an operator fed only from above
    the run sits just above its first consumer in the run (an embedding read by the second
    layer of the run does not float at its top).

    Returns:
        (runs as [key, [names]], layer per name, (first layer, depth) per run)
    """
    rank = {n: i for i, n in enumerate(order)}
    runs: list = []
    for n in order:
        if runs and runs[-1][0] == key[n]:
            runs[-1][1].append(n)
        else:
            runs.append([key[n], [n]])
    layer: dict = {}
    run_layers: list = []
    first = 0
    for _, members in runs:
        inside = set(members)
        local: dict = {}
        for n in members:
            local[n] = max((local[p] + 1 for p in fwd_preds[n] if p in inside), default=0)
        for n in reversed(members):
            if not any(p in inside for p in fwd_preds[n]):
                below = [local[t] for t in succs[n] if t in inside and rank[t] > rank[n]]
                if below:
                    local[n] = max(local[n], min(below) - 1)
        depth = max(local.values()) + 1
        for n in members:
            layer[n] = first + local[n]
        run_layers.append((first, depth))
        first += depth
    return runs, layer, run_layers


def _lanes(order: list, layer: dict, fwd_preds: dict, n_layers: int) -> tuple:
    """The layered graph: operators and lanes per layer, and who connects to whom.

    An edge that spans layers gets a lane (a dummy item ``("lane", source, layer)``) in every
    layer it crosses. The edges of one source share its lanes until they leave for their
    targets: a residual stream read by q, k, v and the next norm is one line, not four.

    Returns:
        (items per layer, up and down neighbours per item, (source, target, items) per edge)
    """
    rank = {n: i for i, n in enumerate(order)}
    rows: list = [[] for _ in range(n_layers)]
    for n in order:
        rows[layer[n]].append(n)
    up: dict = {n: [] for n in order}
    down: dict = {n: [] for n in order}
    seed = {n: float(rank[n]) for n in order}
    chains = []
    for t in order:
        for s in fwd_preds[t]:
            items = [s]
            for k in range(layer[s] + 1, layer[t]):
                d = ("lane", s, k)
                if d not in up:
                    rows[k].append(d)
                    up[d], down[d] = [], []
                    seed[d] = rank[s] + 0.5
                items.append(d)
            items.append(t)
            for a, b in zip(items, items[1:]):
                if b not in down[a]:
                    down[a].append(b)
                    up[b].append(a)
            chains.append((s, t, items))
    for row in rows:
        row.sort(key=seed.__getitem__)
    return rows, up, down, chains


def _reduce_crossings(rows: list, up: dict, down: dict) -> tuple[list, int]:
    """Barycentre sweeps, alternately down and up; the order with fewest crossings wins.

    Six sweeps: on the transformer maps of docs/pictures.md the count stops falling after
    two (the 4 crossings a block keeps are its q/k/v and gate/up fan-ins, unavoidable).
    """
    n = len(rows)

    def total() -> int:
        return sum(_crossings(rows[k], rows[k + 1], down) for k in range(n - 1))

    best, best_rows = total(), [list(r) for r in rows]
    for sweep in range(6):
        downward = sweep % 2 == 0
        for k in (range(1, n) if downward else range(n - 2, -1, -1)):
            nb = up if downward else down
            ref = {it: i for i, it in enumerate(rows[k - 1 if downward else k + 1])}
            cur = {it: i for i, it in enumerate(rows[k])}

            def bary(it):
                ps = [ref[p] for p in nb[it] if p in ref]
                return (sum(ps) / len(ps) if ps else cur[it], cur[it])
            rows[k].sort(key=bary)
        c = total()
        if c < best:
            best, best_rows = c, [list(r) for r in rows]
        if best == 0:
            break
    return best_rows, best


def _x_positions(rows: list, up: dict, down: dict, width: dict) -> dict:
    """x of every item: toward the mean of its neighbours above, then below, then both
    (eight sweeps), each layer placed by :func:`_place_row`."""
    x: dict = {}
    for row in rows:
        x.update(_place_row(row, {it: 0.0 for it in row}, width))
    n = len(rows)
    for sweep in range(8):
        for k in (range(n) if sweep % 2 == 0 else range(n - 1, -1, -1)):
            want = {}
            for it in rows[k]:
                nbs = up[it] + down[it] if sweep >= 6 else (up[it] if sweep % 2 == 0 else
                                                           down[it])
                want[it] = sum(x[m] for m in nbs) / len(nbs) if nbs else x[it]
            x.update(_place_row(rows[k], want, width))
    return x


def _columns(run_layers: list, titled: list, lo: list, hi: list) -> list:
    """Layer ranges of the columns the layers are wrapped into.

    One column up to 9 inches; beyond, the number of columns (1..64) whose picture comes
    nearest to 1.3 times as wide as tall, with whole runs in a column while they fit and a
    penalty for each run cut between columns.
    """
    run_h = [depth * _ROW + (_TITLE_H if t else 0) + _RUN_GAP
             for (_, depth), t in zip(run_layers, titled)]
    total_h = sum(run_h)
    n_layers = sum(depth for _, depth in run_layers)
    if total_h <= _MIN_WRAP_H:
        return [(0, n_layers)]

    # a short run (the embeddings above the first block, the head below the last) stays
    # with its neighbour rather than open a column of its own
    short = 0.35 * sorted(run_h)[len(run_h) // 2]

    def split(target: float) -> list:
        cols, cur, h = [], [], 0.0
        for r, (f, depth) in enumerate(run_layers):
            if cur and h + run_h[r] > 1.15 * target and h >= 0.5 * target and \
                    run_h[r] >= short:
                cols.append(cur)
                cur, h = [], 0.0
            if run_h[r] > 1.3 * target:  # a run taller than a column: cut it into columns
                per = max(1, int(target / _ROW))
                for a in range(f, f + depth, per):
                    if cur:
                        cols.append(cur)
                    cur, h = [(a, min(a + per, f + depth))], min(per, f + depth - a) * _ROW
                continue
            cur.append((f, f + depth))
            h += run_h[r]
        if cur:
            cols.append(cur)
        return [(c[0][0], c[-1][1]) for c in cols]

    def height(a: int, b: int) -> float:
        h = 0.0
        for r, (f, depth) in enumerate(run_layers):
            inside = min(f + depth, b) - max(f, a)
            if inside > 0:
                h += inside * _ROW + (_TITLE_H if titled[r] else 0) + _RUN_GAP
        return h

    starts = {f for f, _ in run_layers}
    best, columns = math.inf, [(0, n_layers)]
    for c in range(1, 65):
        cand = split(total_h / c)
        w = sum(max(hi[a:b]) - min(lo[a:b]) for a, b in cand) + _COL_GAP * (len(cand) - 1)
        h = max(height(a, b) for a, b in cand)
        # a module cut between two columns is harder to read than a less ideal aspect
        score = abs(math.log(w / h / _ASPECT)) + 0.15 * sum(1 for a, _ in cand
                                                           if a not in starts)
        if score < best - 1e-9:
            best, columns = score, cand
    return columns


def layout_graph(dm: DigitMap) -> GraphLayout:
    """A layered top-down layout of the map's operator graph, grouped by module.

    Steps (after Sugiyama et al.): a topological order that keeps each module's operators
    together (:func:`_order`); runs of consecutive operators of one group (:func:`group_key`)
    stacked from the top, each layered inside itself (:func:`_layer_runs`); a lane per layer
    crossed by a long edge (:func:`_lanes`); barycentre sweeps against crossings; x by least
    squares toward the neighbours; the layers wrapped into columns (:func:`_columns`); edges
    routed through their lanes, and from a column's bottom up the gap to the next one's top.

    Raises:
        ValueError: the map has no operators.
    """
    ops = list(dm.operators.values())
    if not ops:
        raise ValueError("the digit map has no operators to draw")
    names = [op.name for op in ops]
    key = {op.name: group_key(op.module_path) for op in ops}
    preds: dict = {n: [] for n in names}
    succs: dict = {n: [] for n in names}
    for op in ops:
        for i in dict.fromkeys(op.inputs):
            if i in dm.operators and i != op.name:
                preds[op.name].append(i)
                succs[i].append(op.name)
    order, back = _order(names, preds, succs, key)
    rank = {n: i for i, n in enumerate(order)}
    fwd_preds = {n: [p for p in preds[n] if rank[p] < rank[n]] for n in names}
    layering = fwd_preds
    if not any(preds.values()):
        # A map without edges (its operators' inputs were not recorded) would put every
        # operator of a module side by side in one layer: one operator a layer, in execution
        # order, instead (no edge is drawn).
        layering = {n: [order[i - 1]] if i else [] for i, n in enumerate(order)}
    runs, layer, run_layers = _layer_runs(order, key, layering, succs)
    n_layers = sum(depth for _, depth in run_layers)
    rows, up, down, chains = _lanes(order, layer, fwd_preds, n_layers)
    rows, crossings = _reduce_crossings(rows, up, down)

    # box width: the names, within bounds (the few longer names get a smaller font)
    labels = {n: _label(n, key[n]) for n in names}
    chars = sorted(len(lb) for lb in labels.values())
    box_chars = min(max(chars[int(0.9 * (len(chars) - 1))], _LABEL_CHARS[0]), _LABEL_CHARS[1])
    box_w = box_chars * _CHAR_IN + 0.12
    width = {it: box_w if it in key else _DUMMY_W for row in rows for it in row}
    x = _x_positions(rows, up, down, width)

    lo = [min(x[it] - width[it] / 2 for it in row) for row in rows]
    hi = [max(x[it] + width[it] / 2 for it in row) for row in rows]
    titled = [bool(k) for k, _ in runs]
    columns = _columns(run_layers, titled, lo, hi)
    col_of_layer = [0] * n_layers
    for c, (a, b) in enumerate(columns):
        for k in range(a, b):
            col_of_layer[k] = c

    # y per layer: each column from the top, a title above each module box
    y_of_layer = [0.0] * n_layers
    col_left, col_bottom = [], []
    left = 0.0
    for c, (a, b) in enumerate(columns):
        cur = -_COL_GAP / 2  # room at the top for the edges that arrive from the left
        shift = left - min(lo[a:b])
        for r, (f, depth) in enumerate(run_layers):
            seg = range(max(f, a), min(f + depth, b))
            if not seg:
                continue
            if titled[r]:
                cur -= _TITLE_H
            for k in seg:
                y_of_layer[k] = cur - _ROW / 2
                cur -= _ROW
            cur -= _RUN_GAP
        for k in range(a, b):
            for it in rows[k]:
                x[it] += shift
        col_left.append(left)
        left += max(hi[a:b]) - min(lo[a:b]) + _COL_GAP
        col_bottom.append(cur)
    height_in = -min(col_bottom) + _COL_GAP / 2

    nodes = {n: NodeBox(n, x[n], y_of_layer[layer[n]], box_w, _BOX_H, layer[n],
                        col_of_layer[layer[n]], key[n], labels[n]) for n in names}

    groups = []
    for r, (f, _) in enumerate(run_layers):
        if not titled[r]:
            continue
        members = runs[r][1]
        for c, (a, b) in enumerate(columns):
            inside = [n for n in members if a <= layer[n] < b]
            if not inside:
                continue
            ys = [nodes[n].y for n in inside]
            groups.append(GroupBox(
                runs[r][0], c, min(nodes[n].x for n in inside) - box_w / 2 - _PAD,
                min(ys) - _BOX_H / 2 - _PAD, max(nodes[n].x for n in inside) + box_w / 2 + _PAD,
                max(ys) + _BOX_H / 2 + _PAD + _TITLE_H - 0.04, inside,
                continued=min(layer[n] for n in inside) > f))

    # edge routes: curves inside a column, connectors through the gap to the next one
    edges = []
    n_wrap: dict = {}
    wrap_slot: dict = {}

    def point(it, end: str) -> tuple[float, float]:
        if isinstance(it, tuple):
            return (x[it], y_of_layer[it[2]])
        b = nodes[it]
        return (b.x, b.y - b.h / 2 if end == "out" else b.y + b.h / 2)

    for s, t, items in chains:
        pieces, connectors = [], []
        piece = [point(s, "out")]
        for prev, it in zip(items, items[1:]):
            lp = layer[prev] if not isinstance(prev, tuple) else prev[2]
            li = layer[it] if not isinstance(it, tuple) else it[2]
            cp, ci = col_of_layer[lp], col_of_layer[li]
            end = point(it, "in")
            if cp != ci:  # one connector per source and column break, shared by its edges
                if (s, cp) not in wrap_slot:
                    wrap_slot[(s, cp)] = n_wrap.get(cp, 0)
                    n_wrap[cp] = wrap_slot[(s, cp)] + 1
                k = wrap_slot[(s, cp)]
                y_out = col_bottom[cp] + _RUN_GAP / 2 - 0.05 * k
                gx = col_left[ci] - _COL_GAP / 2 + 0.05 * (k % 5) - 0.1
                y_in = -0.06 - 0.05 * (k % 4)
                piece.append((piece[-1][0], y_out))
                pieces.append(piece)
                connectors.append([(piece[-1][0], y_out), (gx, y_out), (gx, y_in),
                                   (end[0], y_in)])
                piece = [(end[0], y_in)]
            piece.append(end)
        pieces.append(piece)
        edges.append(EdgeRoute(s, t, pieces, connectors))
    for s, t in sorted(back):
        a, b = nodes[s], nodes[t]
        edges.append(EdgeRoute(s, t, [[(a.x, a.y + a.h / 2), (b.x, b.y - b.h / 2)]], [],
                               back=True))

    # the picture's extent: everything drawn, with a small margin, from x = 0
    xs = [b.x - b.w / 2 for b in nodes.values()] + [g.x0 for g in groups]
    xs += [p[0] for e in edges for line in e.pieces + e.connectors for p in line]
    x_max = [b.x + b.w / 2 for b in nodes.values()] + [g.x1 for g in groups]
    x_max += [p[0] for e in edges for line in e.pieces + e.connectors for p in line]
    y_min = [b.y - b.h / 2 for b in nodes.values()] + [g.y0 for g in groups]
    y_min += [p[1] for e in edges for line in e.pieces + e.connectors for p in line]
    dx = 0.05 - min(xs)
    for b in nodes.values():
        b.x += dx
    for g in groups:
        g.x0 += dx
        g.x1 += dx
    for e in edges:
        e.pieces = [[(px + dx, py) for px, py in line] for line in e.pieces]
        e.connectors = [[(px + dx, py) for px, py in line] for line in e.connectors]
    width_in = max(x_max) + dx + 0.05
    height_in = max(height_in, 0.05 - min(y_min))
    return GraphLayout(nodes, groups, edges, width_in, height_in, len(columns), n_layers,
                       crossings)


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
            fit = min(1.0, (b.w - 0.1) / (len(b.label) * _CHAR_IN))
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
