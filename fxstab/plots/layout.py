"""The operator graph's layout: where each operator, module box and edge goes (no drawing).

:func:`layout_graph` lays out a digit map's operator graph (no graphviz needed): operators in
layers from the top down, one layer per step of the longest path, each run of a repeated
module (``blocks.3``, ``layers.11``) in its own labelled box, and the layers wrapped into
newspaper columns when one column would be too tall to read. A map with a backward (a
trainer's, ``backward=True``) draws it after the forward, from the top of a column of its
own, in module boxes of its own (``blocks.3 backward``). The result, a
:class:`GraphLayout`, is plain data in inches; :mod:`fxstab.plots.draw` draws it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from ..digitmap import DigitMap

# Sizes in inches: the layout's coordinates are the picture's, so a label drawn at FONT_PT
# fits its box at any graph size. 7 pt is legible at 100% on screen and in print; a row pitch
# of 0.5 in leaves a 0.17 in lane for the edges between two-line boxes of 0.33 in.
FONT_PT = 7.0
CHAR_IN = 0.58 * FONT_PT / 72  # mean advance of DejaVu Sans, measured on operator names
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
    """One operator in a :class:`GraphLayout`: box centre, size, layer and place.

    ``group``: the title of the module box it is drawn in (``blocks.3``, ``blocks.3
    backward``), ``""`` outside any."""

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


def _order(names: list, preds: dict, succs: dict, key: dict,
           backward: frozenset = frozenset()) -> tuple[list, set]:
    """A topological order that finishes a module before starting the next where it can.

    Kahn's algorithm; among the ready operators, those of the module drawn last come first,
    then the forward's before the backward's (``backward``: the names of backward operators,
    whose key differs from their forward module's), then the map's order. A cycle (not
    produced by fxstab, but a hand-made map may have one) is broken at the earliest remaining
    operator; the edges it ignores are returned as back edges.
    """
    index = {n: (n in backward, i) for i, n in enumerate(names)}
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


def _place_row(items: list, desired: dict, width: dict, weight: dict) -> dict:
    """x of the items of one layer, in their order, as near as possible to ``desired``.

    Weighted least squares under the order and the minimum spacing (pool adjacent violators
    on ``desired - offset``, offset = cumulative spacing): the nearest non-overlapping
    placement, a heavy item moved least.
    """
    offs, acc = [], 0.0
    for i, it in enumerate(items):
        if i:
            gap = _GAP if width[items[i - 1]] > _DUMMY_W or width[it] > _DUMMY_W else _GAP / 3
            acc += (width[items[i - 1]] + width[it]) / 2 + gap
        offs.append(acc)
    blocks: list = []  # [weighted sum, weight, count]
    for it, o in zip(items, offs):
        blocks.append([weight[it] * (desired[it] - o), weight[it], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w
            blocks[-1][2] += c
    out, i = {}, 0
    for s, w, c in blocks:
        for _ in range(c):
            out[items[i]] = s / w + offs[i]
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
    (eight sweeps), each layer placed by :func:`_place_row`.

    Means and placements are weighted by the length of the path below an item, plus one: a
    chain that goes on (the residual stream, the gradient flowing back through a block) runs
    straight and the branches that end soon (a weight's gradient off the input gradient) move
    aside, instead of each fan shifting the chain by half its width, a staircase across the
    page.
    """
    height: dict = {}
    for row in reversed(rows):
        for it in row:
            height[it] = max((height[d] + 1 for d in down[it]), default=0)
    weight = {it: (1.0 + h) ** 3 for it, h in height.items()}
    x: dict = {}
    for row in rows:
        x.update(_place_row(row, {it: 0.0 for it in row}, width, weight))
    n = len(rows)
    for sweep in range(8):
        for k in (range(n) if sweep % 2 == 0 else range(n - 1, -1, -1)):
            want = {}
            for it in rows[k]:
                nbs = up[it] + down[it] if sweep >= 6 else (up[it] if sweep % 2 == 0 else
                                                           down[it])
                want[it] = (sum(weight[m] * x[m] for m in nbs) / sum(weight[m] for m in nbs)
                            if nbs else x[it])
            x.update(_place_row(rows[k], want, width, weight))
    return x


def _pack_components(rows: list, up: dict, down: dict, width: dict, x: dict) -> None:
    """Move each connected part of the graph left, next to what precedes it in its layers.

    The sweeps place a part only against its own neighbours: a part not connected to the rest
    (the head's weight gradient, ``head/linear#0/grad/mm#1 -> head.weight/grad``: the loss's
    gradient that feeds it is no operator of the map) stays where the first placement put it
    while the rest moves, a box far to the right. Parts in the order of their leftmost item,
    each shifted left until one of its items is ``_GAP`` from the item before it in its layer
    (order and spacing kept; the leftmost part does not move).
    """
    part: dict = {}
    for row in rows:
        for it in row:
            if it in part:
                continue
            part[it], stack = it, [it]
            while stack:
                for m in up[stack[-1]] + down[stack.pop()]:
                    if m not in part:
                        part[m] = it
                        stack.append(m)
    members: dict = {}
    for k, row in enumerate(rows):
        for i, it in enumerate(row):
            members.setdefault(part[it], []).append((k, i))
    if len(members) < 2:
        return
    for root in sorted(members, key=lambda r: min(x[rows[k][i]] for k, i in members[r])):
        room = math.inf
        for k, i in members[root]:
            it = rows[k][i]
            if i and part[rows[k][i - 1]] != root:
                prev = rows[k][i - 1]
                room = min(room, x[it] - width[it] / 2 - x[prev] - width[prev] / 2 - _GAP)
        if 0 < room < math.inf:
            for k, i in members[root]:
                x[rows[k][i]] -= room


def _columns(run_layers: list, titled: list, lo: list, hi: list, start: int = -1) -> list:
    """Layer ranges of the columns the layers are wrapped into.

    One column up to 9 inches; beyond, the number of columns (1..64) whose picture comes
    nearest to 1.3 times as wide as tall, with whole runs in a column while they fit and a
    penalty for each run cut between columns. Run ``start`` (the backward's first) always
    opens a column: the backward is a band of its own beside the forward.
    """
    run_h = [depth * _ROW + (_TITLE_H if t else 0) + _RUN_GAP
             for (_, depth), t in zip(run_layers, titled)]
    total_h = sum(run_h)
    n_layers = sum(depth for _, depth in run_layers)
    if total_h <= _MIN_WRAP_H:
        if start > 0:
            return [(0, run_layers[start][0]), (run_layers[start][0], n_layers)]
        return [(0, n_layers)]

    # a short run (the embeddings above the first block, the head below the last) stays
    # with its neighbour rather than open a column of its own
    short = 0.35 * sorted(run_h)[len(run_h) // 2]

    def split(target: float) -> list:
        cols, cur, h = [], [], 0.0
        for r, (f, depth) in enumerate(run_layers):
            if cur and (r == start or h + run_h[r] > 1.15 * target and h >= 0.5 * target and
                        run_h[r] >= short):
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
    together, the forward's before the backward's (:func:`_order`); runs of consecutive
    operators of one group (:func:`group_key`; a backward operator's is its module's with
    `` backward``) stacked from the top, each layered inside itself (:func:`_layer_runs`); a
    lane per layer crossed by a long edge (:func:`_lanes`); barycentre sweeps against
    crossings; x by weighted least squares toward the neighbours (:func:`_x_positions`), each
    part of the graph not connected to the rest moved next to it (:func:`_pack_components`);
    the layers wrapped into columns, the backward from a new one (:func:`_columns`); edges
    routed through their lanes, and from a column's bottom up the gap to the next one's top.

    Raises:
        ValueError: the map has no operators.
    """
    ops = list(dm.operators.values())
    if not ops:
        raise ValueError("the digit map has no operators to draw")
    names = [op.name for op in ops]
    key = {op.name: group_key(op.module_path) for op in ops}
    # the backward: modules of their own (``blocks.3 backward``), after the whole forward
    bwd = frozenset(op.name for op in ops if op.direction == "backward")
    run_key = {n: f"{key[n]} backward".lstrip() if n in bwd else key[n] for n in names}
    preds: dict = {n: [] for n in names}
    succs: dict = {n: [] for n in names}
    for op in ops:
        for i in dict.fromkeys(op.inputs):
            if i in dm.operators and i != op.name:
                preds[op.name].append(i)
                succs[i].append(op.name)
    order, back = _order(names, preds, succs, run_key, bwd)
    rank = {n: i for i, n in enumerate(order)}
    fwd_preds = {n: [p for p in preds[n] if rank[p] < rank[n]] for n in names}
    layering = fwd_preds
    if not any(preds.values()):
        # A map without edges (its operators' inputs were not recorded) would put every
        # operator of a module side by side in one layer: one operator a layer, in execution
        # order, instead (no edge is drawn).
        layering = {n: [order[i - 1]] if i else [] for i, n in enumerate(order)}
    runs, layer, run_layers = _layer_runs(order, run_key, layering, succs)
    n_layers = sum(depth for _, depth in run_layers)
    rows, up, down, chains = _lanes(order, layer, fwd_preds, n_layers)
    rows, crossings = _reduce_crossings(rows, up, down)

    # box width: the names, within bounds (the few longer names get a smaller font)
    labels = {n: _label(n, key[n]) for n in names}
    chars = sorted(len(lb) for lb in labels.values())
    box_chars = min(max(chars[int(0.9 * (len(chars) - 1))], _LABEL_CHARS[0]), _LABEL_CHARS[1])
    box_w = box_chars * CHAR_IN + 0.12
    width = {it: box_w if it in key else _DUMMY_W for row in rows for it in row}
    x = _x_positions(rows, up, down, width)
    _pack_components(rows, up, down, width, x)

    lo = [min(x[it] - width[it] / 2 for it in row) for row in rows]
    hi = [max(x[it] + width[it] / 2 for it in row) for row in rows]
    titled = [bool(k) and k != "backward" for k, _ in runs]
    start = next((r for r, (_, m) in enumerate(runs) if m[0] in bwd), -1)
    columns = _columns(run_layers, titled, lo, hi, start)
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
                        col_of_layer[layer[n]], run_key[n] if key[n] else "", labels[n])
             for n in names}

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
