"""fxstab/plots/ (bars, the operator graph and its layout, series) and the monitor
experiment's loss plot and data lookup (benchmarks/exp_monitor_wikitext2.py)."""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import pytest

from fxstab import digitmap, plots
from fxstab.digitmap import DigitMap
from fxstab.plots import draw
from fxstab.records.report import OpReport

BF16_CAP = 8 * math.log10(2.0)


def rep(name: str, avg: float, mn: float, inputs=(), **kw) -> OpReport:
    module, _, op = name.rpartition("/")
    kw.setdefault("format", "bf16")
    kw.setdefault("n_samples", 3)
    kw.setdefault("numel", 100)
    return OpReport(name=name, kind=op.split("#")[0], module_path=module, avg_digits=avg,
                    min_digits=mn, max_digits=BF16_CAP, inputs=tuple(inputs), **kw)


def transformer_map(blocks: int = 3, nan_block: int | None = None, steps=(None,)) -> DigitMap:
    """A pre-norm transformer's graph: embedding, ``blocks`` blocks of 12 operators with two
    residual joins each, final norm and head. ``nan_block``'s softmax is a NaN origin and
    everything after it carries NaN/inf."""
    reports = []
    for si, step in enumerate(steps):
        def add(name, avg, mn, inputs=(), bad=False):
            reports.append(rep(name, avg - 0.1 * si, mn, inputs, non_finite=10 if bad else 0,
                               phase="train", step=step, call=si))

        add("tok/embedding#0", 2.4, 2.0)
        x = "tok/embedding#0"
        bad = False
        for b in range(blocks):
            p = f"blocks.{b}"
            d = 2.3 - 0.15 * b
            add(f"{p}.ln1/layer_norm#0", d, 1.0, [x], bad)
            add(f"{p}.attn.qkv/linear#0", d, 0.9, [f"{p}.ln1/layer_norm#0"], bad)
            add(f"{p}.attn/matmul#0", d - 0.2, 0.5, [f"{p}.attn.qkv/linear#0"], bad)
            bad = bad or b == nan_block
            add(f"{p}.attn/softmax#0", d - 0.5, 0.0, [f"{p}.attn/matmul#0"], bad)
            add(f"{p}.attn/matmul#1", d, 0.4, [f"{p}.attn.qkv/linear#0",
                                                f"{p}.attn/softmax#0"], bad)
            add(f"{p}.attn.proj/linear#0", d, 0.4, [f"{p}.attn/matmul#1"], bad)
            add(f"{p}/add#0", d, 0.3, [x, f"{p}.attn.proj/linear#0"], bad)
            add(f"{p}.ln2/layer_norm#0", d, 0.8, [f"{p}/add#0"], bad)
            add(f"{p}.mlp.0/linear#0", d, 0.7, [f"{p}.ln2/layer_norm#0"], bad)
            add(f"{p}.mlp.1/gelu#0", d, 0.7, [f"{p}.mlp.0/linear#0"], bad)
            add(f"{p}.mlp.2/linear#0", d, 0.6, [f"{p}.mlp.1/gelu#0"], bad)
            add(f"{p}/add#1", d, 0.6, [f"{p}/add#0", f"{p}.mlp.2/linear#0"], bad)
            x = f"{p}/add#1"
        add("ln_f/layer_norm#0", 1.5, 0.5, [x], bad)
        add("head/linear#0", 1.4, 0.4, ["ln_f/layer_norm#0"], bad)
    return DigitMap.from_reports(reports, metadata={"seed": 0})


def training_step_map(blocks: int = 6) -> DigitMap:
    """:func:`transformer_map`'s forward and its backward as a trainer's page records it
    (``backward=True``): each backward operator named after the forward one it belongs to
    (``blocks.5.mlp.2/linear#0/grad/mm#0``, in that module), the gradient's residual joins
    ``grad/add#k`` at the top level, a ``<parameter>/grad`` per parameter (listed last), the
    backward's first operators without inputs in the map (the loss's gradient is not one),
    as in a map recorded from a small GPT (fxstab/integrations/core.py: StepAnalysis)."""
    fwd = list(transformer_map(blocks).operators.values())
    reports = [rep(op.name, op.avg_digits, op.min_digits, op.inputs) for op in fwd]
    params: list = []
    n_add = 0

    def bw(name, module, inputs, kind=None):
        reports.append(OpReport(
            name=name, kind=kind or name.rsplit("/", 1)[1].split("#")[0], module_path=module,
            avg_digits=1.8, min_digits=0.5, max_digits=BF16_CAP, inputs=tuple(inputs),
            format="bf16", n_samples=3, numel=100, direction="backward"))
        return name

    def linear(mod, g):  # input, weight and bias gradients of mod/linear#0
        grads = [bw(f"{mod}/linear#0/grad/{k}", mod, [g] if g else [])
                 for k in ("mm#0", "mm#1", "sum#0")]
        params.extend([(f"{mod}.weight/grad", mod, [grads[1]]),
                       (f"{mod}.bias/grad", mod, [grads[2]])])
        return grads[0]

    def join(a, b):
        nonlocal n_add
        n_add += 1
        return bw(f"grad/add#{n_add - 1}", "", [a, b])

    g = linear("head", None)
    params[:0] = [(f"ln_f.{w}/grad", "ln_f", [g]) for w in ("weight", "bias")]
    for b in reversed(range(blocks)):
        p = f"blocks.{b}"
        h = linear(f"{p}.mlp.2", g)
        h = bw(f"{p}.mlp.1/gelu#0/grad/gelu_backward#0", f"{p}.mlp.1", [h])
        h = linear(f"{p}.mlp.0", h)
        params.extend((f"{p}.ln2.{w}/grad", f"{p}.ln2", [h]) for w in ("weight", "bias"))
        g = join(h, g)
        h = linear(f"{p}.attn.proj", g)
        v = bw(f"{p}.attn/matmul#1/grad/bmm#0", f"{p}.attn", [h])
        s = bw(f"{p}.attn/matmul#1/grad/bmm#1", f"{p}.attn", [h])
        s = bw(f"{p}.attn/softmax#0/grad/softmax_backward_data#0", f"{p}.attn", [s])
        q, k = (bw(f"{p}.attn/matmul#0/grad/bmm#{i}", f"{p}.attn", [s]) for i in (0, 1))
        grads = [bw(f"{p}.attn.qkv/linear#0/grad/{n}", f"{p}.attn.qkv", [q, k, v])
                 for n in ("mm#0", "mm#1", "sum#0")]
        params.extend([(f"{p}.attn.qkv.weight/grad", f"{p}.attn.qkv", [grads[1]]),
                       (f"{p}.attn.qkv.bias/grad", f"{p}.attn.qkv", [grads[2]])])
        params.extend((f"{p}.ln1.{w}/grad", f"{p}.ln1", [grads[0]]) for w in ("weight", "bias"))
        g = join(grads[0], g)
    e = bw("tok/embedding#0/grad/embedding_dense_backward#0", "tok", [g])
    params.append(("tok.weight/grad", "tok", [e]))
    for name, module, inputs in params:
        bw(name, module, inputs, "param_grad")
    return DigitMap.from_reports(reports, metadata={"seed": 0})


def _is_png(path: Path) -> bool:
    return path.stat().st_size > 0 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def figures(monkeypatch):
    """What each plot drew, read off its figure just before it is saved."""
    drawn = []
    save = draw._save

    def spy(fig, path, **kw):
        ax = fig.axes[0]
        drawn.append({
            "title": ax.get_title(),
            "xticklabels": [t.get_text() for t in ax.get_xticklabels()],
            # top to bottom, whatever order the ticks were set in
            "yticklabels": [t.get_text() for _, t in sorted(
                zip(ax.get_yticks(), ax.get_yticklabels()), key=lambda p: -p[0])],
            "lines": {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
                      for ln in ax.get_lines()},
            "texts": [t.get_text() for t in fig.texts],
            "axtexts": [t.get_text() for t in ax.texts],
        })
        return save(fig, path, **kw)

    monkeypatch.setattr(draw, "_save", spy)
    return drawn


# --------------------------------------------------------------------------- layout
def test_group_key_is_the_repeated_unit():
    assert plots.group_key("blocks.3.attn.qkv") == "blocks.3"
    assert plots.group_key("blocks.3") == "blocks.3"
    assert plots.group_key("model.layers.11.mlp.0") == "model.layers.11"
    assert plots.group_key("tok") == ""
    assert plots.group_key("") == ""
    assert plots.group_key("3.attn") == ""  # a root Sequential's index is no unit name


def _boxes_overlap(a, b) -> bool:
    return (abs(a.x - b.x) < (a.w + b.w) / 2 - 1e-9) and (abs(a.y - b.y) < (a.h + b.h) / 2 - 1e-9)


def _inside(b, g) -> bool:
    return (g.x0 <= b.x - b.w / 2 and b.x + b.w / 2 <= g.x1 and g.y0 <= b.y - b.h / 2
            and b.y + b.h / 2 <= g.y1)


def check_layout(dm: DigitMap, lay: plots.GraphLayout) -> None:
    nodes = lay.nodes
    assert set(nodes) == set(dm.operators)
    for op in dm.operators.values():
        for i in op.inputs:  # top-down: every consumer below each of its inputs
            assert nodes[op.name].layer > nodes[i].layer, (i, op.name)
            if nodes[op.name].column == nodes[i].column:
                assert nodes[op.name].y < nodes[i].y
    by_col_layer = {}
    for b in nodes.values():  # a layer is one row of its column
        by_col_layer.setdefault((b.column, b.layer), set()).add(round(b.y, 9))
    assert all(len(ys) == 1 for ys in by_col_layer.values())
    for (c1, l1), (c2, l2) in itertools.combinations(by_col_layer, 2):
        if c1 == c2 and l1 < l2:
            assert next(iter(by_col_layer[(c1, l1)])) > next(iter(by_col_layer[(c2, l2)]))
    for a, b in itertools.combinations(nodes.values(), 2):
        assert not _boxes_overlap(a, b), (a.name, b.name)
    for b in nodes.values():
        assert 0 <= b.x - b.w / 2 and b.x + b.w / 2 <= lay.width
        assert -lay.height <= b.y - b.h / 2 and b.y + b.h / 2 <= 0
    # module boxes: hold exactly their module's operators, and no other module's box
    for g in lay.groups:
        assert g.key and all(nodes[n].group == g.key for n in g.members)
        assert all(_inside(nodes[n], g) for n in g.members)
        assert all(not _inside(b, g) for b in nodes.values() if b.name not in g.members)
    for g, h in itertools.combinations(lay.groups, 2):
        assert g.x1 <= h.x0 or h.x1 <= g.x0 or g.y1 <= h.y0 or h.y1 <= g.y0
    grouped = {n for g in lay.groups for n in g.members}
    assert grouped == {n for n, b in nodes.items() if b.group}
    # edges: from the source's bottom to the target's top, downward inside a column
    for e in lay.edges:
        s, t = nodes[e.source], nodes[e.target]
        assert e.pieces[0][0] == pytest.approx((s.x, s.y - s.h / 2))
        assert e.pieces[-1][-1] == pytest.approx((t.x, t.y + t.h / 2))
        for piece in e.pieces:
            ys = [p[1] for p in piece]
            assert all(a >= b - 1e-9 for a, b in zip(ys, ys[1:]))
        assert len(e.pieces) == len(e.connectors) + 1
    assert {(e.source, e.target) for e in lay.edges} == {
        (i, op.name) for op in dm.operators.values() for i in op.inputs}


def test_layout_is_layered_top_down_and_grouped_by_module():
    dm = transformer_map(blocks=3)
    lay = plots.layout_graph(dm)
    check_layout(dm, lay)
    nodes = lay.nodes
    layers = {b: sorted(n.layer for n in nodes.values() if n.group == f"blocks.{b}")
              for b in range(3)}
    for b in range(3):  # each block a band of consecutive layers, in model order
        assert set(layers[b]) == set(range(layers[b][0], layers[b][-1] + 1))
        if b:
            assert layers[b - 1][-1] < layers[b][0]
    assert nodes["tok/embedding#0"].layer == 0 and not nodes["tok/embedding#0"].group
    assert nodes["head/linear#0"].layer == lay.layers - 1
    # labels inside a module box drop the module's own prefix
    assert nodes["blocks.1.attn/softmax#0"].label == "attn/softmax#0"
    assert nodes["blocks.1/add#0"].label == "add#0"
    assert nodes["ln_f/layer_norm#0"].label == "ln_f/layer_norm#0"
    assert lay.crossings == 0  # a pre-norm transformer draws without crossings
    # q/k/v fan-out: the two matmuls of one attention are in different layers
    assert nodes["blocks.0.attn/matmul#0"].layer < nodes["blocks.0.attn/matmul#1"].layer


@pytest.mark.parametrize("blocks", [12, 80])
def test_a_deep_model_wraps_into_columns_between_blocks(blocks):
    dm = transformer_map(blocks=blocks)  # 147 and 963 operators
    lay = plots.layout_graph(dm)
    check_layout(dm, lay)
    assert lay.columns > 1 and lay.crossings == 0
    assert 0.6 < lay.width / lay.height < 2.5
    assert not any(g.continued for g in lay.groups)  # columns break between blocks
    cols = [lay.nodes[f"blocks.{b}/add#1"].column for b in range(blocks)]
    assert cols == sorted(cols) and cols[0] == 0 and cols[-1] == lay.columns - 1
    # the residual stream that leaves a column's bottom continues at the next column's top
    for b in range(1, blocks):
        e = next(e for e in lay.edges
                 if (e.source, e.target) == (f"blocks.{b - 1}/add#1", f"blocks.{b}/add#0"))
        gap = lay.nodes[e.target].column - lay.nodes[e.source].column
        assert len(e.connectors) == gap
        for c in e.connectors:
            assert c[0][1] < c[2][1]  # up the gap between the columns


@pytest.mark.parametrize("blocks", [2, 6, 12])
def test_a_training_map_draws_its_backward_as_a_band_beside_the_forward(blocks):
    # issue 56 item 14: the backward's operators shared the forward's modules and layers
    # (blocks.5's gradients inside the forward's blocks.5 box, the head's beside the
    # embedding), and each backward block stood a fan's width right of the one before, a
    # staircase 57 x 46 in at 6 blocks with the long edges of the residual gradient across it
    dm = training_step_map(blocks)
    lay = plots.layout_graph(dm)
    check_layout(dm, lay)
    nodes, box = lay.nodes, next(iter(lay.nodes.values())).w
    bwd = {n for n, op in dm.operators.items() if op.direction == "backward"}
    # a band of its own: the backward's columns right of the forward's, its own module boxes
    assert max(nodes[n].column for n in dm.operators if n not in bwd) < \
        min(nodes[n].column for n in bwd)
    for g in lay.groups:
        assert len({n in bwd for n in g.members}) == 1, g.key
        assert g.key.endswith(" backward") == (g.members[0] in bwd)
    assert {g.key for g in lay.groups} >= {f"blocks.{b} backward" for b in range(blocks)}
    # the gradient flows straight down the band: its residual joins stand in a line in
    # each column, and no column is wider than its widest fan (5 boxes and the lanes)
    joins = [nodes[n] for n in dm.operators if n.startswith("grad/add#")]
    for c in {j.column for j in joins}:
        xs = [j.x for j in joins if j.column == c]
        assert max(xs) - min(xs) < 1.5 * box, (c, xs)
    for c in range(lay.columns):
        xs = [(b.x - b.w / 2, b.x + b.w / 2) for b in nodes.values() if b.column == c]
        assert max(x for _, x in xs) - min(x for x, _ in xs) < 7 * box, c
    # the head's weight gradient (no input in the map: its own part of the graph) stands
    # beside the loss's other gradients, not where the first placement left it
    first = nodes["head/linear#0/grad/mm#0"]
    assert 0 < nodes["head/linear#0/grad/mm#1"].x - first.x < 4 * box
    assert 0.6 < lay.width / lay.height < 2.5


def test_a_short_chain_stays_one_column():
    dm = transformer_map(blocks=1)
    lay = plots.layout_graph(dm)
    check_layout(dm, lay)
    assert lay.columns == 1 and len(lay.groups) == 1 and lay.groups[0].key == "blocks.0"


def test_a_long_chain_without_modules_wraps_by_height():
    dm = DigitMap.from_reports([rep(f"fc{i}/linear#0", 2.0, 1.0,
                                    [f"fc{i - 1}/linear#0"] if i else []) for i in range(120)])
    lay = plots.layout_graph(dm)
    check_layout(dm, lay)
    assert not lay.groups and lay.layers == 120
    assert lay.columns > 1 and 0.6 < lay.width / lay.height < 2.5


def test_a_map_without_edges_is_drawn_in_execution_order():
    dm = DigitMap.from_reports([rep(f"blocks.{i // 10}.l{i % 10}/linear#0", 2.0, 1.0)
                                for i in range(40)])
    lay = plots.layout_graph(dm)
    check_layout(dm, lay)
    assert [lay.nodes[n].layer for n in dm.operators] == list(range(40))
    assert not lay.edges and lay.columns > 1


def test_layout_breaks_a_cycle_and_draws_it_as_a_back_edge():
    dm = DigitMap.from_reports([rep("a/relu#0", 2.0, 1.0, ["c/relu#0"]),
                                rep("b/relu#0", 2.0, 1.0, ["a/relu#0"]),
                                rep("c/relu#0", 2.0, 1.0, ["b/relu#0"])])
    lay = plots.layout_graph(dm)
    back = [e for e in lay.edges if e.back]
    assert [(e.source, e.target) for e in back] == [("c/relu#0", "a/relu#0")]
    assert [lay.nodes[n].layer for n in ("a/relu#0", "b/relu#0", "c/relu#0")] == [0, 1, 2]


def test_layout_of_an_empty_map_is_a_clear_error():
    with pytest.raises(ValueError, match="no operators"):
        plots.layout_graph(DigitMap(metadata={}))


# --------------------------------------------------------------------------- graph picture
def test_node_styles_mark_nonfinite_origins_and_colour_by_metric():
    dm = transformer_map(blocks=3, nan_block=1)
    assert dm.nonfinite_sources() == ["blocks.1.attn/softmax#0"]
    st = plots.node_styles(dm, "avg")
    origin = st["blocks.1.attn/softmax#0"]
    assert origin.origin and origin.edge == plots.NONFINITE_COLOUR
    assert origin.linestyle == "solid" and origin.linewidth > 2
    downstream = st["head/linear#0"]
    assert not downstream.origin and downstream.edge == plots.NONFINITE_COLOUR
    assert downstream.linestyle == "--" and "NaN/inf" in downstream.text
    clean = st["blocks.0.attn/softmax#0"]
    assert not clean.origin and clean.edge != plots.NONFINITE_COLOUR
    assert clean.text == f"{dm['blocks.0.attn/softmax#0'].avg_digits:.2f}"
    # fill by the metric's digits: the min digits of a softmax are 0, red at the scale's end
    cmap, norm = draw._digit_scale(dm)
    assert st["blocks.0.ln1/layer_norm#0"].face == pytest.approx(cmap(norm(2.3)))
    assert plots.node_styles(dm, "min")["blocks.0.attn/softmax#0"].face == \
        pytest.approx(cmap(norm(0.0)))
    assert plots.node_styles(dm, "min")["blocks.0.attn/softmax#0"].face != clean.face


def test_operator_without_digits_under_the_metric_is_grey_not_red(tmp_path, figures):
    dm = DigitMap.from_reports([rep("a/linear#0", math.nan, 1.0), rep("b/linear#0", 0.0, 0.0)])
    st = plots.node_styles(dm, "avg")
    assert st["a/linear#0"].text == "n/a" and st["a/linear#0"].face != st["b/linear#0"].face
    plots.plot_graph(dm, tmp_path / "g.png", metric="avg")
    plots.plot_digits(dm, tmp_path / "d.png", metric="avg")
    assert "grey: 1 without avg digits" in figures[0]["texts"][0]
    assert "1 operator(s) without avg digits, drawn as 0" in figures[1]["title"]


def test_plot_graph_writes_pictures_that_name_the_origin(tmp_path, figures):
    dm = transformer_map(blocks=3, nan_block=1)
    assert _is_png(plots.plot_graph(dm, tmp_path / "graph.png"))
    svg = plots.plot_graph(dm, tmp_path / "graph.svg", metric="min").read_text()
    assert svg.lstrip().startswith("<?xml")
    assert "NaN/inf origin" in svg and "blocks.1.attn/softmax#0" in svg
    title = figures[-1]["texts"][0]
    assert "min digits" in title and "NaN/inf first appear at blocks.1.attn/softmax#0" in title
    assert _is_png(plots.plot_graph(transformer_map(blocks=12), tmp_path / "deep.png"))


def test_default_metric_is_read_when_plotting(tmp_path, monkeypatch, figures):
    dm = transformer_map(blocks=1)
    monkeypatch.setattr(digitmap.operators, "DEFAULT_METRIC", "min")
    assert plots.node_styles(dm) == plots.node_styles(dm, "min")
    assert plots.node_styles(dm) != plots.node_styles(dm, "avg")
    plots.plot_graph(dm, tmp_path / "g.png")
    plots.plot_digits(dm, tmp_path / "d.png")
    assert "min digits" in figures[0]["texts"][0]
    assert figures[0]["texts"][0].endswith("; no NaN/inf")  # the clean map says so
    assert "min digits" in figures[1]["title"]


# --------------------------------------------------------------------------- bars
def test_bars_sort_by_the_chosen_metric(tmp_path, figures):
    dm = DigitMap.from_reports([rep("a/linear#0", 2.0, 0.1), rep("b/linear#0", 1.0, 0.9),
                                rep("c/linear#0", 1.5, 0.5)])
    plots.plot_digits(dm, tmp_path / "avg.png", metric="avg", order="worst")
    plots.plot_digits(dm, tmp_path / "min.png", metric="min", top=2, order="worst")
    # worst at the top
    assert figures[0]["yticklabels"] == ["b/linear#0", "c/linear#0", "a/linear#0"]
    assert figures[1]["yticklabels"] == ["a/linear#0", "c/linear#0"]
    assert "avg digits" in figures[0]["title"] and "min digits" in figures[1]["title"]
    assert _is_png(tmp_path / "avg.png")


def test_bars_rank_where_digits_are_lost_as_the_findings_do(tmp_path, figures):
    """After an overflow every operator downstream keeps few digits: worst first, the bars
    would show them; ranked as the findings rank, the origin and the real losses lead."""
    dm = transformer_map(blocks=3, nan_block=1)
    assert _is_png(plots.plot_digits(dm, tmp_path / "lost.png", top=5))
    fig = figures[0]
    assert fig["yticklabels"] == [r.name for r in dm.localize()][:5]
    assert fig["yticklabels"][0] == "blocks.1.attn/softmax#0" == dm.nonfinite_sources()[0]
    assert fig["axtexts"][0] == "NaN/inf origin"
    assert all(t.startswith("loses ") for t in fig["axtexts"][1:])
    assert "ranked where digits are lost" in fig["title"]
    plots.plot_digits(dm, tmp_path / "worst.png", top=5, order="worst")
    assert figures[1]["yticklabels"] == [op.name for op in draw._worst_first(dm, "avg")][:5]
    assert figures[1]["yticklabels"] != fig["yticklabels"] and not figures[1]["axtexts"]
    with pytest.raises(ValueError, match="order must be one of lost, worst"):
        plots.plot_digits(dm, tmp_path / "x.png", order="best")


# --------------------------------------------------------------------------- series
def test_series_draws_the_chosen_metric_over_steps(tmp_path, figures):
    dm = transformer_map(blocks=1, steps=(0, 1, 2))
    plots.plot_series(dm, tmp_path / "avg.png", top=3, metric="avg")
    plots.plot_series(dm, tmp_path / "min.png", top=3, metric="min")
    for fig, metric in zip(figures, ("avg", "min")):
        worst = draw._worst_first(dm, metric)[:3]
        assert "3 steps" in fig["title"] and metric in fig["title"]
        for op in worst:
            xs, ys = fig["lines"][op.name]
            assert xs == [0, 1, 2]
            assert ys == pytest.approx([s.digits(metric) for s in dm.series(op.name)])
    assert _is_png(tmp_path / "min.png")


def test_series_of_a_one_step_map(tmp_path, figures):
    dm = transformer_map(blocks=2, nan_block=0, steps=(4,))  # `fxstab record --calls 1`
    assert _is_png(plots.plot_series(dm, tmp_path / "one.png", top=4))
    fig = figures[-1]
    worst = draw._worst_first(dm, digitmap.DEFAULT_METRIC)[:4]
    assert "one step (step 4)" in fig["title"]
    assert fig["xticklabels"] == [op.name for op in worst]  # side by side, worst first
    (xs, ys), = [v for k, v in fig["lines"].items() if not k.startswith("cap")]
    assert xs == [0, 1, 2, 3]
    assert ys == pytest.approx([op.digits(digitmap.DEFAULT_METRIC) for op in worst])
    plots.plot_series(dm, tmp_path / "min.png", top=2, metric="min")
    (xs, ys), = [v for k, v in figures[-1]["lines"].items() if not k.startswith("cap")]
    assert ys == pytest.approx([op.min_digits for op in draw._worst_first(dm, "min")[:2]])


def test_plot_errors(tmp_path):
    empty = DigitMap(metadata={})
    with pytest.raises(ValueError, match="no per-step"):
        plots.plot_series(empty, tmp_path / "s.png")
    with pytest.raises(ValueError, match=r"no per-step.*be\.phase"):  # calls without a step
        plots.plot_series(transformer_map(blocks=1), tmp_path / "s.png")
    with pytest.raises(ValueError, match="no operators"):
        plots.plot_digits(empty, tmp_path / "e.png")
    with pytest.raises(ValueError, match="no operators"):
        plots.plot_graph(empty, tmp_path / "e.png")
    dm = transformer_map(blocks=1)
    with pytest.raises(ValueError, match=r"\.png, \.svg"):
        plots.plot_graph(dm, tmp_path / "x.jpg")
    for fn in (plots.plot_digits, plots.plot_graph, plots.plot_series):
        with pytest.raises(ValueError, match="metric"):
            fn(dm, tmp_path / "m.png", metric="median-ish")
    with pytest.raises(ValueError, match="top"):
        plots.plot_series(dm, tmp_path / "t.png", top=0)
    with pytest.raises(ValueError, match="top"):
        plots.plot_digits(dm, tmp_path / "t.png", top=0)
    assert not list(tmp_path.iterdir())


def test_severity_bands():
    from fxstab.plots import severity

    assert severity(0.0, BF16_CAP)[0] == "lost"
    assert severity(1.0, BF16_CAP)[0] == "poor"
    assert severity(1.5, BF16_CAP)[0] == "fair"
    assert severity(BF16_CAP, BF16_CAP)[0] == "good"
    assert severity(math.nan, BF16_CAP)[0] == "lost"


# --------------------------------------------------------------------------- monitor experiment
@pytest.fixture
def exp():
    from benchmarks import exp_monitor_wikitext2

    return exp_monitor_wikitext2


def _arm(arm: str, losses, nonfinite_at=None, skipped_at=None, promotions=()):
    r = {"scenario": "naive_softmax", "arm": arm, "train_loss": list(losses),
         "promotions": list(promotions)}
    if nonfinite_at is not None:
        r["nonfinite_at"], r["skipped_at"] = nonfinite_at, skipped_at or []
    return r


def _marks(fig, gid: str) -> list:
    return [float(x) for c in fig.axes[0].collections if c.get_gid() == gid
            for x in c.get_offsets()[:, 0]]


def test_loss_plot_marks_nonfinite_steps_and_promotions(exp, tmp_path):
    import matplotlib.pyplot as plt

    nan = math.nan
    results = [
        _arm("bf16", [5.0, 4.8, 4.6, nan, 4.5, math.inf, 4.4, 4.3], [3, 5], [3, 5]),
        _arm("fp32", [5.0, 4.7, 4.5, 4.4, 4.3, 4.2, 4.1, 4.0], [], [],
             [{"step": 0, "op": "x/linear#0", "old": "NORMAL", "new": "STABLE_KERNEL",
               "reason": "forced"}]),
        _arm("monitor", [5.0, 4.8, 4.6, 4.5, 4.4, 4.3, 4.2, 4.1], [3], [],
             [{"step": 2, "op": "blocks.1.attn.softmax", "old": "NORMAL",
               "new": "FP32_ACCUMULATION", "reason": "score 0.2 > tau_warn = 0.1"},
              {"step": 6, "op": "blocks.1.attn.softmax", "old": "FP32_ACCUMULATION",
               "new": "NORMAL", "reason": "recheck"}]),
    ]
    fig = exp.loss_figure(results)
    try:
        assert _marks(fig, "nonfinite:bf16") == [3.0, 5.0]
        assert _marks(fig, "skipped:bf16") == [3.0, 5.0]
        assert _marks(fig, "nonfinite:monitor") == [3.0]  # retried: not skipped
        assert _marks(fig, "skipped:monitor") == []
        assert _marks(fig, "promotion:monitor") == [2.0]  # a demotion is no promotion
        assert _marks(fig, "promotion:fp32") == []  # the fp32 arm's forced modes are set-up
        smooth = {ln.get_label(): ln.get_ydata() for ln in fig.axes[0].get_lines()}
        raw = results[0]["train_loss"]
        # the curve has a gap at a non-finite step (window 1 here) and goes on after it
        assert [math.isfinite(v) for v in smooth["bf16"]] == [math.isfinite(v) for v in raw]
        assert fig.axes[0].get_ylim()[1] == pytest.approx(5.0 * 1.2)  # inf does not scale it
        labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        assert {"non-finite step (top)", "promotion (bottom)", "update skipped (top)"} <= \
            set(labels)
    finally:
        plt.close(fig)
    exp.plot(results, tmp_path / "loss.png")
    assert _is_png(tmp_path / "loss.png")


def test_replot_redraws_from_a_results_json(exp, tmp_path, capsys):
    import json

    results = [_arm("bf16", [3.0, math.nan, 2.9], [1], [1])]
    src = tmp_path / "monitor_wikitext2.json"
    src.write_text(json.dumps({"results": results}))  # NaN as the script's json.dumps writes it
    assert exp.main(["--replot", str(src), "--out", str(tmp_path / "out")]) == 0
    assert _is_png(tmp_path / "out" / "monitor_wikitext2_loss.png")
    (tmp_path / "bad.json").write_text("{}")
    assert exp.main(["--replot", str(tmp_path / "bad.json"), "--out", str(tmp_path)]) == 2
    assert "not a results JSON" in capsys.readouterr().err


def test_loss_plot_reads_results_written_before_the_step_lists(exp):
    import matplotlib.pyplot as plt

    fig = exp.loss_figure([_arm("bf16", [3.0, math.nan, 2.9, 2.8])])
    try:
        assert _marks(fig, "nonfinite:bf16") == [1.0]
    finally:
        plt.close(fig)
    with pytest.raises(ValueError, match="no results"):
        exp.loss_figure([])


def test_data_lookup(exp, tmp_path, monkeypatch, capsys):
    clone = tmp_path / "clone"
    wt2 = tmp_path / "shared" / "data" / "wikitext-2"
    monkeypatch.setattr(exp, "ROOT", clone)
    monkeypatch.delenv(exp.DATA_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=r"--data DIR.*FXSTAB_DATA") as e:
        exp.data_dir()
    assert str(wt2) in str(e.value) and "never downloads" in str(e.value)
    wt2.mkdir(parents=True)
    (wt2 / "train.txt").write_text("a b\n")
    with pytest.raises(FileNotFoundError, match="lacks valid.txt"):
        exp.data_dir()
    (wt2 / "valid.txt").write_text("a\n")
    assert exp.data_dir() == wt2  # relative to the repository: <clone>/../shared/data

    other = tmp_path / "elsewhere"
    (other / "wikitext-2").mkdir(parents=True)
    for f in exp.SPLITS:
        (other / "wikitext-2" / f).write_text("x\n")
    monkeypatch.setenv(exp.DATA_ENV, str(other))
    assert exp.data_dir() == other / "wikitext-2"
    assert exp.data_dir(wt2) == wt2  # --data wins
    train, valid, vocab = exp.load(10, wt2)
    assert train.tolist() == [1, 2, 3] and vocab == 4 and valid.numel() == 2

    assert exp.main(["--data", str(tmp_path / "nowhere")]) == 2
    assert "WikiText-2 not found" in capsys.readouterr().err
    assert not os.path.exists(clone)
