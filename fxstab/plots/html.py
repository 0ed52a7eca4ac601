"""Self-contained HTML pages: a digit map, a diff of two maps, a monitor's history (issue 33).

Each page is one file: the CSS and the script (``fxstab/plots/pages/``) and the data (JSON in a
``<script type="application/json">``) are inlined; nothing is fetched, so a page opens from
``file://`` and from a CI artifact, offline. The operator graph is SVG drawn where
:func:`fxstab.plots.layout.layout_graph` puts it (:mod:`fxstab.plots.svg`).

- :func:`map_page`: findings first, the graph coloured by a chosen metric (NaN/inf origin
  marked as in the PNG), every statistic on hover, inputs and consumers on click, a sortable
  and filterable table, the coverage and the settings; with several (phase, step) points, a
  layer x step heatmap and lines for a selection;
- :func:`diff_page`: the gate's verdict, what failed it first, the graph coloured by the change
  (lost / gained / new / gone), base and head side by side on hover;
- :func:`monitor_page`: a :class:`~fxstab.monitor.StabilityMonitor`'s scores per operator and
  step, its thresholds and promotions (``StabilityMonitor.save_html``);
- :func:`history_page`: digit maps across commits, per target its outputs' and worst
  operators' digits as lines and a table (``fxstab history``).

The pieces the pages share with the notebook displays (:mod:`fxstab.plots.notebook`) are
public: :func:`settings_html`, :func:`ops_table`, :func:`coverage_summary`,
:func:`coverage_html`, :func:`finding_class`, :func:`fmt_digits`, :func:`ink_for`.

Every function takes plain data and returns the page as text; :func:`write_page` saves it.
``docs/pictures.md`` shows the pages.
"""

from __future__ import annotations

import dataclasses
import json
import math
from html import escape
from pathlib import Path
from typing import Any, Mapping, Optional

from ..digitmap import METRICS, DiffResult, DigitMap, PathLike, operators
from ..digitmap.findings import NO_FINDINGS
from .fix_section import fixed_operators, fixes_html, fixes_note
from .layout import layout_graph
from .svg import BoxStyle, graph_svg

PAGES = Path(__file__).parent / "pages"
NONFINITE_COLOUR = "#6a00f4"  # as draw.NONFINITE_COLOUR: the violet of NaN/inf
# matplotlib's RdYlGn (ColorBrewer, 11 classes), as pages/common.js interpolates it
_RDYLGN = ("#a50026", "#d73027", "#f46d43", "#fdae61", "#fee08b", "#ffffbf", "#d9ef8b",
           "#a6d96a", "#66bd63", "#1a9850", "#006837")
_NO_DIGITS = "#d1d1d1"
# the change of an operator between two maps: fill, ink, what the legend says
CHANGE_STYLES = {
    "lost": ("#d62728", "#ffffff", "lost digits (fails the gate)"),
    "gained": ("#2ca02c", "#ffffff", "gained digits"),
    "same": ("#ececf1", "#000000", "within the threshold"),
    "new": ("#9ecae1", "#000000", "new in head"),
    "gone": ("#ffffff", "#555555", "only in base"),
    "vanished": ("#ffffff", "#d62728", "no longer analysed (fails the gate)"),
}
# the metadata shown as the analysis settings, in this order (the rest follow)
_SETTINGS = ("format", "n_samples", "seed", "git_commit", "target", "granularity", "rounding",
             "confidence", "analysed_calls", "accumulate", "gemm_inputs", "fxstab_version",
             "torch_version")
_SETTING_NAMES = {"n_samples": "N", "git_commit": "commit", "analysed_calls": "analysed calls"}


# --------------------------------------------------------------------------- helpers
def _num(v: Any, nd: Optional[int] = None) -> Any:
    """A number for the page's JSON: NaN -> null, +-inf -> "inf"/"-inf", rounded to ``nd``
    decimals (None: exact, so that the page prints what the text tables print)."""
    if v is None:
        return None
    v = float(v)
    if math.isnan(v):
        return None
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if nd is None:
        return v
    r = round(v, nd)
    return int(r) if r == int(r) and abs(r) < 1e15 else r


def digit_colour(digits: float, cap: float) -> str:
    """The fill of ``digits`` on the red (0) to green (``cap``) scale (the PNG's RdYlGn);
    grey when unknown (NaN)."""
    if digits is None or math.isnan(digits):
        return _NO_DIGITS
    t = min(1.0, max(0.0, digits / cap if cap > 0 else 0.0)) * (len(_RDYLGN) - 1)
    i = min(len(_RDYLGN) - 2, int(t))
    f = t - i
    a, b = _RDYLGN[i], _RDYLGN[i + 1]
    rgb = [int(a[k:k + 2], 16) + f * (int(b[k:k + 2], 16) - int(a[k:k + 2], 16))
           for k in (1, 3, 5)]
    return "#" + "".join(f"{round(c):02x}" for c in rgb)


def ink_for(fill: str) -> str:
    r, g, b = (int(fill[k:k + 2], 16) / 255 for k in (1, 3, 5))
    return "#ffffff" if 0.299 * r + 0.587 * g + 0.114 * b < 0.45 else "#000000"


def _sig(v: Any) -> Any:
    """A score for the page's JSON: 4 significant digits (scores span decades)."""
    v = _num(v)
    return float(f"{v:.4g}") if isinstance(v, float) else v


def _stats(op: Any) -> dict:
    """Every per-operator statistic of the schema."""
    d = {m: _num(op.digits(m)) for m in METRICS}
    d.update(max=_num(op.max_digits), zero=_num(op.zero_fraction),
             nonfin=int(op.non_finite), under=int(op.underflow), numel=int(op.numel),
             calls=int(op.calls))
    if not math.isnan(op.impact):
        d["imp"] = _num(op.impact)
    return d


def _asset(name: str) -> str:
    return (PAGES / name).read_text(encoding="utf-8")


def _json_script(data: Any) -> str:
    """JSON safe inside <script>: ``</`` and the HTML comment openers cannot end it early."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _page(title: str, body: str, data: Any, script: str) -> str:
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        # the page may use nothing but itself: no request can leave it
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">",
        f"<title>{escape(title)}</title>",
        f"<style>\n{_asset('page.css')}</style>",
        "</head><body>",
        body,
        f'<script id="fxstab-data" type="application/json">{_json_script(data)}</script>',
        f"<script>\n{_asset('common.js')}\n{_asset(script)}</script>",
        "</body></html>", ""])


def settings_html(meta: Mapping) -> str:
    keys = [k for k in _SETTINGS if meta.get(k) is not None]
    keys += sorted(k for k, v in meta.items() if k not in _SETTINGS and v is not None
                   and isinstance(v, (str, int, float, bool)))
    items = []
    for k in keys:
        v = meta[k]
        if k == "git_commit" and isinstance(v, str):
            v = v[:12]
        items.append(f"<span>{escape(_SETTING_NAMES.get(k, k))}: <b>{escape(str(v))}</b></span>")
    return f'<div class="settings" id="settings">{"".join(items)}</div>'


def _metric_select(metric: str, ident: str = "metric") -> str:
    opts = "".join(f'<option value="{m}"{" selected" if m == metric else ""}>{m}</option>'
                   for m in METRICS)
    return f'<label>metric <select id="{ident}">{opts}</select></label>'


def _graph_controls(extra: str = "") -> str:
    return (f'<div class="controls">{extra}<button id="zoom-fit" type="button">fit width'
            f'</button><button id="zoom-full" type="button">100%</button>'
            f'<span class="legend" id="graph-legend"></span></div>')


def _steps_data(dm: DigitMap, index: dict) -> Optional[dict]:
    """Digits per operator and (phase, step) for the heatmap and the lines: None with fewer
    than two points. Values per metric as rows (operators, map order) x columns (points),
    rounded to 2 decimals (a 250-operator, 100-step map stays under 2 MB)."""
    keys = dm.step_keys()
    if len(keys) < 2:
        return None
    phases = {p for p, _ in keys}
    labels = [(p if s is None else (str(s) if len(phases) == 1 else f"{p}:{s}"))
              for p, s in keys]
    col = {k: c for c, k in enumerate(keys)}
    n = len(index)
    values = {m: [[None] * len(keys) for _ in range(n)] for m in METRICS}
    bad = []
    for s in dm.steps:
        r, c = index[s.name], col[(s.phase, s.step)]
        for m in METRICS:
            values[m][r][c] = _num(s.digits(m), 2)
        if s.non_finite:
            bad.append([r, c])
    return {"labels": labels, "values": values, "bad": bad}


def coverage_summary(cov: Any, names: set) -> tuple[dict, dict]:
    """(operator name -> [how, reason], the summary: counts and what was not analysed)."""
    if not isinstance(cov, dict):
        return {}, {}
    per_op, missing, others = {}, [], {}
    for e in cov.get("operators", []) or []:
        if not isinstance(e, dict):
            continue
        name = e.get("operator", "")
        if name in names:
            per_op[name] = [e.get("how", ""), e.get("reason", "")]
        elif e.get("counted") and e.get("how") != "analysed":
            missing.append([name, e.get("kind", ""), e.get("how", ""), e.get("reason", "")])
        else:
            key = (e.get("how", ""), e.get("reason", ""))
            others.setdefault(key, []).append(name)
    summary = {k: cov.get(k) for k in ("fraction", "counted", "analysed", "per_sample",
                                       "unrounded", "skipped")}
    summary["missing"] = missing
    summary["others"] = [[how, reason, len(ns), ns[:6]] for (how, reason), ns in
                         sorted(others.items(), key=lambda kv: -len(kv[1]))]
    return per_op, summary


def ops_table(head: tuple, rows) -> str:
    """A static ``ops`` table: ``rows`` of HTML cells, a cell ``(html, cls)`` with its class."""
    def cell(c: Any) -> str:
        return (f'<td class="{c[1]}">{c[0]}</td>' if isinstance(c, tuple)
                else f'<td class="txt">{c}</td>')
    body = "".join("<tr>" + "".join(cell(c) for c in row) + "</tr>" for row in rows)
    return (f'<table class="ops"><thead><tr>{"".join(f"<th>{h}</th>" for h in head)}</tr>'
            f"</thead><tbody>{body}</tbody></table>")


def coverage_html(summary: dict) -> str:
    if not summary:
        return ('<p class="muted" id="coverage">This map carries no coverage (recorded before '
                'fxstab kept it).</p>')
    frac = summary.get("fraction")
    head = (f"<b>{100 * frac:.0f}%</b> of the model's {summary.get('counted')} floating "
            f"operators were analysed" if frac is not None else "no floating operator counted")
    kp = "".join(f"<span>{escape(k.replace('_', ' '))}: <b>{summary.get(k)}</b></span>"
                 for k in ("analysed", "per_sample", "unrounded", "skipped")
                 if summary.get(k) is not None)
    out = [f'<div id="coverage"><p>{head}.</p><div class="kpis">{kp}</div>']
    if summary["missing"]:
        table = ops_table(("operator", "kind", "how", "reason"),
                           ((f"<code>{escape(n)}</code>", escape(k), escape(h), escape(r))
                            for n, k, h, r in summary["missing"]))
        out.append(f"<p><b>Not analysed ({len(summary['missing'])})</b>: not in the map.</p>"
                   + table)
    if summary["others"]:
        table = ops_table(("how", "reason", "count", "e.g."),
                           ((escape(h), escape(r), (c, "n"),
                             f"<code>{escape(', '.join(ex))}</code>")
                            for h, r, c, ex in summary["others"]))
        out.append(f"<details><summary>Not counted (cannot lose digits) and not rounded "
                   f"</summary>{table}</details>")
    out.append("</div>")
    return "".join(out)


def finding_class(line: str) -> str:
    if line.startswith("NaN/inf first appear"):
        return "origin"
    if line.startswith("note:"):
        return "note"
    return "loss"


def _findings_html(dm: DigitMap, metric: str) -> str:
    """The findings under every metric, one list each (the selector shows one)."""
    out = []
    for m in METRICS:
        lines = dm.findings(metric=m)
        items = "".join(f'<li class="{finding_class(t)}">{escape(t)}</li>' for t in lines)
        if not lines:
            items = f'<li class="none">{escape(NO_FINDINGS)}</li>'
        hidden = "" if m == metric else " hidden"
        out.append(f'<ul class="findings" data-metric="{m}"{hidden}>{items}</ul>')
    return "".join(out)


# --------------------------------------------------------------------------- the map page
def map_title(dm: DigitMap, path: Optional[PathLike] = None) -> str:
    """``fxstab digit map: TARGET (FILE)``: the model the map is of (its ``target``, or
    ``model``; else its operator count and format) and the file it was read from."""
    meta = dm.metadata
    what = meta.get("target") or meta.get("model")
    if not what:
        what = f"{len(dm)} operators in {meta.get('format') or 'an unknown format'}"
    return f"fxstab digit map: {what}" + (f" ({Path(path).name})" if path else "")


def map_page(dm: DigitMap, metric: Optional[str] = None, title: Optional[str] = None) -> str:
    """The page of one digit map (see the module docstring).

    Args:
        dm: the digit map.
        metric: the metric selected when the page opens (default: the map's default
            metric); the page's selector switches between all of them.
        title: the page's title (default: ``fxstab digit map: TARGET``, the map's target;
            without one, its operator count and format; ``fxstab show`` adds the file).

    Raises:
        ValueError: an unknown metric, or a map without operators.
    """
    metric = operators.check_metric(metric)
    if not len(dm):
        raise ValueError("the digit map has no operators: nothing to show")
    meta = dm.metadata
    title = title or map_title(dm)
    names = list(dm.operators)
    index = {n: i for i, n in enumerate(names)}
    consumers = dm.consumers()
    sources = set(dm.nonfinite_sources())
    cov_of, cov_summary = coverage_summary(meta.get("coverage"), set(names))
    cap = dm.cap
    ops = []
    for n, op in dm.operators.items():
        ops.append({
            "name": n, "kind": op.kind, "module": op.module_path, "fmt": op.format,
            "dir": op.direction, "status": op.status, "shape": list(op.shape),
            "sur": op.surrogate, "src": op.source, "s": _stats(op),
            "counters": dict(op.counters), "cov": cov_of.get(n),
            "inputs": [index[i] for i in op.inputs if i in index],
            "consumers": [index[c] for c in consumers[n]],
        })
    loss = {}
    for m in METRICS:
        per = [None] * len(names)
        for r in dm.localize(m):
            # an operator more accurate than its least accurate input lost nothing: 0, not a
            # negative loss (the ranking's order is the same)
            per[index[r.name]] = [_num(max(0.0, r.local_loss)), index.get(r.worst_input, -1)]
        loss[m] = per
    styles = {}
    for n, op in dm.operators.items():
        v = op.digits(metric)
        fill = digit_colour(v, cap)
        cls = "origin" if n in sources else "pass" if op.non_finite else ""
        text = ("n/a" if math.isnan(v) else f"{v:.2f}") + (" NaN/inf" if op.non_finite else "")
        styles[n] = BoxStyle(fill, ink_for(fill), text, cls, n in sources)
    lay = layout_graph(dm)
    steps = _steps_data(dm, index)
    data = {"page": "map", "metric": metric, "metrics": list(METRICS), "cap": cap, "ops": ops,
            "loss": loss, "origins": [index[n] for n in dm.nonfinite_sources()],
            "steps": steps, "format": meta.get("format"), "impact": dm.impact_threshold()}
    fixes = dm.fixes()  # fxstab fix: a section beside the findings (none without fixes)
    if fixes:
        data["fixed"] = fixed_operators(fixes, index)
    origin_line = ""
    if sources:
        origin_line = (f'<p class="muted">NaN/inf first appear at '
                       f'{", ".join(f"<code>{escape(s)}</code>" for s in sorted(sources))} '
                       f'(violet halo).</p>')
    body = f"""
<header><h1>{escape(title)}</h1>
<div class="muted">{len(dm)} operators, {escape(str(meta.get('format', '?')))}, cap
{cap:.2f} digits, {len(dm.step_keys())} (phase, step) point(s)</div>
{settings_html(meta)}</header>
<main>
<section id="findings-section"><h2>Findings</h2>{_findings_html(dm, metric)}\
{fixes_note(fixes, index)}</section>{fixes_html(fixes, index)}
<section id="graph-section"><h2>Operator graph</h2>
{_graph_controls(_metric_select(metric))}
{origin_line}
<div class="graphbox" id="graphbox">{graph_svg(lay, index, styles, title="operator graph")}</div>
<p class="muted">Hover an operator for its statistics; click it to mark its inputs (blue) and
consumers (orange) and its row in the table; click again to clear.</p></section>
{'<section id="steps-section"><h2>Digits over steps</h2><div id="steps"></div></section>'
 if steps else ''}
<section id="table-section"><h2>Operators</h2>
<div class="controls"><label>module or name <input type="text" id="f-module"
placeholder="blocks.1.* (glob)"></label><label>kind <select id="f-kind"></select></label>
<label><span id="f-metric-name">{metric}</span> digits below <input type="number" id="f-below"
step="0.1" min="0"></label><span class="muted" id="f-count"></span></div>
<div class="tablebox" id="table"></div></section>
<section id="coverage-section"><h2>Coverage</h2>{coverage_html(cov_summary)}</section>
</main>"""
    return _page(title, body, data, "map.js")


# --------------------------------------------------------------------------- the diff page
def _union(base: DigitMap, head: DigitMap) -> DigitMap:
    """Head's operators, then those only base has, each reading its inputs of either map
    (a rewritten region hangs where base had it): the graph of the diff page."""
    names = set(head.operators) | set(base.operators)
    ops = []
    for n, op in head.operators.items():
        extra = base.operators[n].inputs if n in base.operators else ()
        inputs = tuple(dict.fromkeys(i for i in (*op.inputs, *extra) if i in names and i != n))
        ops.append(dataclasses.replace(op, inputs=inputs))
    for n, op in base.operators.items():
        if n not in head.operators:
            ops.append(dataclasses.replace(op, inputs=tuple(i for i in op.inputs if i in names)))
    return DigitMap(ops, dict(head.metadata))


def diff_page(base: DigitMap, head: DigitMap, result: DiffResult,
              title: Optional[str] = None) -> str:
    """The page of a diff (:func:`fxstab.digitmap.diff` of ``base`` and ``head``).

    Args:
        base, head: the two maps.
        result: their diff (its metric and threshold colour the page).
        title: the page's title.
    """
    metric = result.metric
    union = _union(base, head)
    names = list(union.operators)
    index = {n: i for i, n in enumerate(names)}
    lost = {c.name for c in result.drops}
    gained = {c.name for c in result.gains}
    vanished = {r.name for r in result.vanished}
    head_sources = set(head.nonfinite_sources())
    consumers = union.consumers()
    ops, styles = [], {}
    for n, op in union.operators.items():
        b, h = base.operators.get(n), head.operators.get(n)
        state = ("lost" if n in lost else "gained" if n in gained else "vanished"
                 if n in vanished else "new" if b is None else "gone" if h is None else "same")
        delta = (operators.as_digits(h.digits(metric)) - operators.as_digits(b.digits(metric))
                 - result.cap_shift if b is not None and h is not None else None)
        ops.append({"name": n, "kind": op.kind, "module": op.module_path, "state": state,
                    "b": _stats(b) if b is not None else None,
                    "h": _stats(h) if h is not None else None,
                    "delta": _num(delta), "origin": n in head_sources,
                    "inputs": [index[i] for i in op.inputs],
                    "consumers": [index[c] for c in consumers[n]]})
        fill, ink, _ = CHANGE_STYLES[state]
        if delta is not None:
            text = f"{delta:+.2f}"
        else:
            text = "new" if state == "new" else "gone"
        cls = [state] if state in ("gone", "vanished") else []
        if n in head_sources:
            cls.append("origin")
        styles[n] = BoxStyle(fill, ink, text, " ".join(cls), n in head_sources)
    lay = layout_graph(union)
    title = title or f"fxstab diff: {result.base_label} -> {result.head_label}"
    verdict = "fail" if result.failed else "pass"
    data = {"page": "diff", "metric": metric, "metrics": list(METRICS), "cap": head.cap,
            "max_drop": result.max_drop, "failed": result.failed, "ops": ops,
            "base": result.base_label, "head": result.head_label,
            "styles": {k: list(v) for k, v in CHANGE_STYLES.items()},
            "new_origins": [index[n] for n in result.new_origins if n in index]}

    def code(n: str) -> str:
        return f"<code>{escape(n)}</code>"

    def change_rows(rows: list) -> str:
        return "".join(f'<tr><td class="txt">{code(r.name)}</td><td>{escape(r.kind)}</td>'
                       f'<td class="n">{r.base:.2f}</td><td class="n">{r.head:.2f}</td>'
                       f'<td class="n"><b>{r.delta:+.2f}</b></td></tr>' for r in rows)

    def presence_rows(rows: list) -> str:
        return "".join(f'<tr><td class="txt">{code(r.name)}</td><td>{escape(r.kind)}</td>'
                       f'<td class="n">{r.digits:.2f}</td></tr>' for r in rows)

    ch_head = ("<thead><tr><th>operator</th><th>kind</th><th>base</th><th>head</th>"
               "<th>change</th></tr></thead>")
    pr_head = "<thead><tr><th>operator</th><th>kind</th><th>digits</th></tr></thead>"
    first = []
    if result.new_origins:
        first.append(f'<p id="new-origins"><b>NaN/inf now first appear at</b> '
                     f'{", ".join(code(n) for n in result.new_origins)}</p>')
    for ident, what, rows, head_, fn in (
            ("drops", "Operators that lost digits", result.drops, ch_head, change_rows),
            ("module-drops", "Modules that lost digits (operators renamed inside)",
             result.module_drops, ch_head, change_rows),
            ("vanished", "No longer analysed (their module is still there)", result.vanished,
             pr_head, presence_rows)):
        if rows:
            first.append(f'<h3>{what} ({len(rows)})</h3><table class="ops" id="{ident}">'
                         f"{head_}<tbody>{fn(rows)}</tbody></table>")
    if result.rewrite_drops:
        first.append("<h3>Rewritten regions that lost digits</h3><ul>" + "".join(
            f"<li>{escape(r.describe())}</li>" for r in result.rewrite_drops) + "</ul>")
    if result.origins:
        o = result.origins[0]
        ref = f"its least accurate input {code(o.worst_input)}" if o.worst_input else \
            "the format's cap"
        first.append(f"<p>Digits are lost first at {code(o.name)}: {o.digits:.2f} digits "
                     f"against {o.reference:.2f} of {ref} (local loss {o.local_loss:.2f}).</p>")
    folded = []
    for what, rows, head_, fn in (("Gained digits", result.gains, ch_head, change_rows),
                                  ("Added operators", result.added, pr_head, presence_rows),
                                  ("Removed operators", result.removed, pr_head, presence_rows)):
        if rows:
            folded.append(f"<details><summary>{what} ({len(rows)})</summary>"
                          f'<table class="ops">{head_}<tbody>{fn(rows)}</tbody></table>'
                          f"</details>")
    notes = "".join(f'<p class="muted">Note: {escape(n)}</p>' for n in result.notes)
    word = "FAIL" if result.failed else "PASS"
    summary = result.summary().split(": ", 1)[-1]
    colour_by = ('<label>colour by <select id="colour-by"><option value="change" selected>'
                 'change</option><option value="head">head digits</option><option '
                 'value="base">base digits</option></select></label>')
    body = f"""
<header><h1>{escape(title)}</h1>
<div class="verdict {verdict}" id="verdict">{word}: {escape(summary)}</div>
<div class="muted">{escape(metric)} digits per operator, threshold {result.max_drop:g};
{escape(result.base_label)} &rarr; {escape(result.head_label)};
{result.unchanged} operator(s) unchanged within &plusmn;{result.max_drop:g}.</div>
{notes}</header>
<main>
<section id="failed-section"><h2>{'What failed the gate' if result.failed else
 'Nothing failed the gate'}</h2>
{''.join(first) or '<p>No operator or module lost more than the threshold.</p>'}
{''.join(folded)}</section>
<section id="graph-section"><h2>Operator graph: the change</h2>
{_graph_controls(colour_by)}
<div class="graphbox" id="graphbox">{graph_svg(lay, index, styles, title="the change")}</div>
<p class="muted">Hover an operator for base and head side by side; click it to mark its inputs
and consumers and its row.</p></section>
<section id="table-section"><h2>Operators</h2>
<div class="controls"><label>module or name <input type="text" id="f-module"
placeholder="blocks.1.* (glob)"></label><label>change <select id="f-kind"></select></label>
<span class="muted" id="f-count"></span></div>
<div class="tablebox" id="table"></div></section>
<section id="settings-section"><h2>Settings</h2>
<h3>base</h3>{settings_html(base.metadata)}<h3>head</h3>{settings_html(head.metadata)}
</section></main>"""
    return _page(title, body, data, "diff.js")


# --------------------------------------------------------------------------- the monitor page
def monitor_page(history: Mapping[str, list], summary: Optional[Mapping] = None,
                 thresholds: Optional[Mapping[str, tuple]] = None,
                 title: str = "fxstab stability monitor") -> str:
    """The page of a stability monitor's run: scores per operator and step, promotions.

    Args:
        history: operator -> its checks ``(step, S, score, probed mode)``
            (``StabilityMonitor.history``).
        summary: ``StabilityMonitor.summary()`` (config, modes, promotions, overhead); None
            draws the history alone.
        thresholds: operator -> ``(tau_warn, tau_safe)`` of its family; default the
            summary's global pair.

    Raises:
        ValueError: a check that is not ``(step, S, score, mode)``.
    """
    summary = dict(summary or {})
    cfg = dict(summary.get("config") or {})
    names = list(history)
    index = {n: i for i, n in enumerate(names)}
    modes = summary.get("modes") or {}
    ops, last = [], -1
    for n in names:
        checks = []
        for k, h in enumerate(history[n]):
            if not isinstance(h, (tuple, list)) or len(h) < 4:
                raise ValueError(f"history[{n!r}][{k}] must be (step, S, score, mode), got {h!r}")
            checks.append([int(h[0]), _sig(h[1]), _sig(h[2]), str(h[3])])
            last = max(last, int(h[0]))
        warn, safe = (thresholds or {}).get(n, (cfg.get("tau_warn"), cfg.get("tau_safe")))
        ops.append({"name": n, "checks": checks, "warn": _sig(warn), "safe": _sig(safe),
                    "mode": modes.get(n, "")})
    promos = []
    for p in summary.get("promotions") or []:
        if p.get("op") in index:
            promos.append([int(p["step"]), index[p["op"]], p.get("old", ""), p.get("new", ""),
                           _sig(p.get("score")), p.get("reason", "")])
            last = max(last, int(p["step"]))
    steps = max(last + 1, int(summary.get("step") or 0))
    data = {"page": "monitor", "ops": ops, "steps": steps, "promotions": promos}
    kp = []
    for k, label in (("step", "steps"), ("operators", "operators"), ("checks", "checks"),
                     ("replicas", "replicas")):
        if summary.get(k) is not None:
            kp.append(f"<span>{label}: <b>{escape(str(summary[k]))}</b></span>")
    if summary.get("promoted") is not None:
        kp.append(f"<span>promoted now: <b>{len(summary['promoted'])}</b></span>")
    if summary.get("time_fraction") is not None:
        kp.append(f"<span>monitor time: <b>{100 * summary['time_fraction']:.1f}%</b> of the "
                  f"steps</span>")
    shown = {k: v for k, v in cfg.items() if isinstance(v, (str, int, float, bool))}
    body = f"""
<header><h1>{escape(title)}</h1><div class="kpis" id="kpis">{''.join(kp)}</div>
{settings_html(shown)}</header>
<main>
<section id="promotions-section"><h2>Promotions</h2><div id="promotions"></div></section>
<section id="heat-section"><h2>Scores per operator and step</h2>
<p class="muted">Colour: the score against the operator's thresholds (green below tau_warn,
orange up to tau_safe, red above); violet cross: a non-finite dispersion; black frame: a
promotion. Click a row to add it to the lines below.</p><div class="heatbox">
<canvas class="heat" id="heat"></canvas></div></section>
<section id="lines-section"><h2>Scores over steps</h2><div id="lines"></div></section>
<section id="table-section"><h2>Operators</h2><div class="tablebox" id="table"></div></section>
</main>"""
    return _page(title, body, data, "monitor.js")


# --------------------------------------------------------------------------- the history page
def history_page(points: list, top: int = 8, metric: Optional[str] = None,
                 title: str = "fxstab digit history", unit: str = "commit") -> str:
    """The trend page of digit maps across commits (``fxstab history``), or across the steps
    of a training run (``unit="step"``: the trainer callbacks' ``steps.html``).

    Args:
        points: ``(label, {target name: DigitMap})`` in order, oldest first (a ``unit`` each).
        top: the worst operators drawn per target beside its outputs (the operators no other
            reads): those with the fewest digits at any point.
        metric: the metric selected when the page opens (the selector offers all).
        title: the page's title.
        unit: what a point is, in the page's words ("commit", "step").

    Raises:
        ValueError: no point, a point without maps, or ``top`` < 1.
    """
    metric = operators.check_metric(metric)
    if not points:
        raise ValueError("no digit map: the history needs at least one")
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    labels = [str(lbl) for lbl, _ in points]
    targets = list(dict.fromkeys(t for _, maps in points for t in maps))
    out = []
    for t in targets:
        names: dict = {}  # every operator any point has, first seen first
        for _, maps in points:
            if t in maps:
                names.update(dict.fromkeys(maps[t].operators))
        outputs = set()
        for _, maps in points:
            if t in maps:
                cons = maps[t].consumers()
                outputs |= {n for n in maps[t].operators if not cons[n]}
        values = {m: {n: [None] * len(points) for n in names} for m in METRICS}
        bad = {n: [] for n in names}
        caps = [None] * len(points)
        for k, (_, maps) in enumerate(points):
            dm = maps.get(t)
            if dm is None:
                continue
            caps[k] = _num(dm.cap, 3)
            for n, op in dm.operators.items():
                for m in METRICS:
                    values[m][n][k] = _num(op.digits(m), 3)
                if op.non_finite:
                    bad[n].append(k)

        def lowest(n: str, m: str) -> float:
            vs = [v for v in values[m][n] if isinstance(v, (int, float))]
            return min(vs) if vs else math.inf

        worst = {m: sorted(names, key=lambda n: (lowest(n, m), n))[:top] for m in METRICS}
        out.append({"name": t, "ops": list(names), "outputs": [n for n in names if n in outputs],
                    "worst": worst, "values": values, "bad": bad, "caps": caps})
    data = {"page": "history", "metric": metric, "metrics": list(METRICS), "labels": labels,
            "targets": out, "top": top, "unit": unit}
    sections = "".join(
        f'<section class="target" id="target-{k}"><h2>{escape(t["name"])}</h2>'
        f'<div class="lines" id="lines-{k}"></div><div class="tablebox" id="table-{k}"></div>'
        f"</section>" for k, t in enumerate(out))
    body = f"""
<header><h1>{escape(title)}</h1>
<div class="muted">{len(labels)} {escape(unit)}(s), {len(out)} target(s): each target's outputs
(the operators no other reads) and its {top} worst operators, their digits at each
{escape(unit)}.</div>
<div class="controls">{_metric_select(metric)}</div></header>
<main>{sections}</main>"""
    return _page(title, body, data, "history.js")


# --------------------------------------------------------------------------- the plan page
def plan_page(plan: Any, check: Any = None, title: Optional[str] = None) -> str:
    """The page of a precision plan (``fxstab plan --html``): whether it keeps ``keep``, its
    cost against everything in ``higher``, the frontier of digits against cost the search
    found (the plan marked), the promoted operators, and the real run's check when given (a
    :class:`fxstab.plan.apply.PlanCheck`).

    Raises:
        ValueError: ``plan`` is not a precision plan.
    """
    if not hasattr(plan, "promoted") or not hasattr(plan, "frontier"):
        raise ValueError(f"not a precision plan: {type(plan).__name__}")
    target = plan.settings.get("target")
    title = title or f"fxstab precision plan: {target or 'model'} in {plan.format}"
    required = plan.required()
    ops = [{"name": n, "kind": plan.kinds.get(n, ""), "module": plan.modules.get(n, ""),
            "before": _num(plan.per_operator.get(n, (math.nan, math.nan))[0], 3),
            "after": _num(plan.per_operator.get(n, (math.nan, math.nan))[1], 3)}
           for n in plan.promoted]
    frontier = [[_num(c, 4), _num(d, 3), int(k)] for c, d, k in plan.frontier]
    data = {"page": "plan", "format": plan.format, "higher": plan.higher, "keep": required,
            "cost": _num(plan.cost, 4), "promoted": len(plan.promoted), "ops": ops,
            "frontier": frontier, "checks": {k: _num(v, 3) for k, v in plan.checks.items()}}
    # what the plan keeps (the worst check) against what it must: the requirement alone read
    # as what it keeps
    verdict = (f"keeps {fmt_digits(plan.after)} digits at the outputs (the analysis), "
               f"{'meeting' if plan.met else 'NOT meeting'} the {required:.2f} required")
    real = ""
    if check is not None:
        def run(which: str) -> str:  # its NaN/inf outputs too: they count 0 digits
            bad = getattr(check, f"{which}_non_finite", 0)
            return f"<b>{getattr(check, which):.2f}</b>" + (
                f" ({bad} of {check.numel} output elements NaN/inf)" if bad else "")
        real = (f"<p>The real run in {escape(plan.format)} against fp64 of the same weights "
                f"(avg true digits at the outputs): {run('plain')} without the plan, "
                f"{run('planned')} with it; all in {escape(plan.higher)}: {run('high')}.</p>")
    checks = ", ".join(f"{escape(k)} {fmt_digits(v)}" for k, v in plan.checks.items())
    # which digits (the bound or a real run's), the real gain expected, autocast's list
    notes = [f"The digits are {plan.metric_words()}."]
    notes += [line[0].upper() + line[1:] + "." for line in plan.context()]
    context = "".join(f'<p class="muted">{escape(line)}</p>' for line in notes)
    cost = (f"; cost {plan.cost:.3f} against {plan.cost_all_higher:.3f} with everything in "
            f"{escape(plan.higher)} (all in {escape(plan.format)} = 1)"
            if plan.cost == plan.cost else "")
    body = f"""
<header><h1>{escape(title)}</h1>
<div class="muted">{len(plan.promoted)} of {plan.operators} operators in
{escape(plan.higher)}, the rest in {escape(plan.format)}; {plan.runs} analysed calls</div></header>
<main>
<section id="verdict-section"><h2>Verdict</h2>
<p class="verdict {'pass' if plan.met else 'fail'}">The plan {verdict}: {fmt_digits(plan.before)} in
{escape(plan.format)}, {fmt_digits(plan.after)} with the plan{f" (the worst of {checks})"
if len(plan.checks) > 1 else ""}{cost}.</p>{context}{real}</section>
<section id="frontier-section"><h2>Digits against cost</h2>
<p class="muted">The plans the search evaluated that no cheaper one beats (the analysis, the
search's seed), by cost; the line is what the plan must keep, the marked point the plan.</p>
<div class="lines" id="frontier"></div></section>
<section id="table-section"><h2>Promoted operators</h2>
<div class="tablebox" id="table"></div></section>
</main>"""
    return _page(title, body, data, "plan.js")


def fmt_digits(v: Any) -> str:
    return "NaN/inf" if not isinstance(v, (int, float)) or not math.isfinite(v) else f"{v:.2f}"


# --------------------------------------------------------------------------- writing
def write_page(text: str, path: PathLike) -> Path:
    """Write a page (UTF-8); the folder is created. Returns the path.

    Raises:
        ValueError: ``path`` does not end in .html or .htm.
    """
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"a page's file must end in .html, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
