"""The results in a notebook (Jupyter's ``_repr_html_``): a digit map, a diff, a coverage, a
precision plan, its check and an impact show the first part of their page, its header,
findings and tables, built from the pages' own pieces (:mod:`fxstab.plots.html`): static HTML,
no script, with CSS scoped to the fragment (a notebook is one document: a page's styles and
scripts would reach the other cells). The graph and every operator stay the page's.

- :func:`map_fragment`, :func:`diff_fragment`, :func:`coverage_fragment`: for results of the
  layers below this one, which may not import it: their ``_repr_html_`` asks the table of
  :mod:`fxstab.records.display`, which :func:`register_displays` fills (``import fxstab``
  calls it);
- :func:`plan_fragment`, :func:`check_fragment`, :func:`impact_fragment`: for results of the
  layers above, whose ``_repr_html_`` calls them.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any, Optional

from ..digitmap import DiffResult, DigitMap, operators
from ..digitmap.findings import NO_FINDINGS
from ..records import display
from ..records.coverage import Coverage
from .html import (
    coverage_html,
    coverage_summary,
    digit_colour,
    finding_class,
    fmt_digits,
    ink_for,
    map_title,
    ops_table,
    settings_html,
)

__all__ = ["register_displays", "map_fragment", "diff_fragment", "coverage_fragment",
           "plan_fragment", "check_fragment", "impact_fragment"]


def register_displays() -> None:
    """Show digit maps, diffs and coverages in notebooks with :mod:`fxstab.plots.html`'s
    fragments."""
    display.register(DigitMap, map_fragment)
    display.register(DiffResult, diff_fragment)
    display.register(Coverage, coverage_fragment)


# What a result shows in Jupyter (its _repr_html_): the page's header, findings and tables as
# static HTML with CSS scoped to the fragment (a notebook is one document: no page-wide style,
# no script), pointing at the page for the graph and every operator.
_NB_CSS = (
    ".fxstab-nb{font:13px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;color:#1f2328}"
    ".fxstab-nb h3{margin:.2em 0 .3em;font-size:15px}"
    ".fxstab-nb h4{margin:.8em 0 .2em;font-size:13px}"
    ".fxstab-nb .muted{color:#656d76}"
    ".fxstab-nb .settings,.fxstab-nb .kpis{display:flex;flex-wrap:wrap;gap:0 1.2em}"
    ".fxstab-nb .settings span,.fxstab-nb .kpis span{white-space:nowrap}"
    ".fxstab-nb table.ops{border-collapse:collapse;margin:.3em 0}"
    ".fxstab-nb table.ops th,.fxstab-nb table.ops td{border:1px solid #d0d7de;"
    "padding:2px 7px;text-align:left;vertical-align:top}"
    ".fxstab-nb table.ops th{background:#f6f8fa}"
    ".fxstab-nb td.n{text-align:right;font-variant-numeric:tabular-nums}"
    ".fxstab-nb .digits{display:inline-block;min-width:3.2em;padding:0 4px;border-radius:3px;"
    "text-align:right}"
    ".fxstab-nb ul.findings{margin:.2em 0;padding-left:1.3em}"
    ".fxstab-nb li.origin{color:#6a00f4}.fxstab-nb li.loss{color:#a50026}"
    ".fxstab-nb li.note,.fxstab-nb li.none{color:#656d76}"
    ".fxstab-nb .verdict{font-weight:600}.fxstab-nb .verdict.pass{color:#1a7f37}"
    ".fxstab-nb .verdict.fail{color:#cf222e}")


def _fragment(body: str) -> str:
    return f'<div class="fxstab-nb"><style>{_NB_CSS}</style>{body}</div>'


def _digits_cell(v: float, cap: float) -> tuple:
    """A digits cell coloured as the graph colours it."""
    fill = digit_colour(v, cap)
    text = "n/a" if not isinstance(v, (int, float)) or math.isnan(v) else f"{v:.2f}"
    return (f'<span class="digits" style="background:{fill};color:{ink_for(fill)}">{text}'
            f"</span>", "n")


def _list(items: list, cls: str = "") -> str:
    return "".join(f'<li class="{cls}">{escape(t)}</li>' for t in items)


def map_fragment(dm: DigitMap, top: int = 15, metric: Optional[str] = None) -> str:
    """A digit map in a notebook: its title, settings and findings, then its ``top`` operators
    with the fewest digits (of ``metric``), then its coverage; the page
    (:func:`fxstab.plots.html.map_page`) has the graph and every operator."""
    metric = operators.check_metric(metric)
    meta = dm.metadata
    cap = dm.cap
    head = (f"<h3>{escape(map_title(dm))}</h3><div class=\"muted\">{len(dm)} operators, "
            f"{escape(str(meta.get('format', '?')))}, cap {cap:.2f} digits, "
            f"{len(dm.step_keys())} (phase, step) point(s)</div>{settings_html(meta)}")
    lines = dm.findings(metric=metric)
    finds = ("".join(f'<li class="{finding_class(t)}">{escape(t)}</li>' for t in lines)
             if lines else _list([NO_FINDINGS], "none"))
    ops = sorted(dm.operators.values(), key=lambda o: (
        not math.isnan(o.digits(metric)), o.digits(metric) if not math.isnan(o.digits(metric))
        else 0.0))[:top]
    rows = ((f"<code>{escape(o.name)}</code>", escape(o.kind), _digits_cell(o.digits(metric), cap),
             (f"{o.digits('min'):.2f}" if not math.isnan(o.digits("min")) else "n/a", "n"),
             (f"{int(o.non_finite)}", "n"), (f"{int(o.calls)}", "n")) for o in ops)
    table = ops_table(("operator", "kind", f"{metric} digits", "min", "NaN/inf", "calls"), rows)
    more = (f'<p class="muted">{len(dm) - len(ops)} more operator(s); the page has them all '
            f"and the graph: <code>fxstab show MAP --html map.html</code>, or "
            f"<code>fxstab.plots.html.write_page(fxstab.plots.html.map_page(dm), "
            f"'map.html')</code>.</p>" if len(dm) > len(ops) else "")
    _, cov = coverage_summary(meta.get("coverage"), set(dm.operators))
    coverage = (f"<details><summary>Coverage</summary>{coverage_html(cov)}</details>"
                if cov else "")
    return _fragment(f"{head}<h4>Findings</h4><ul class=\"findings\">{finds}</ul>"
                     f"<h4>Fewest {metric} digits</h4>{table}{more}{coverage}")


def diff_fragment(result: DiffResult) -> str:
    """A diff in a notebook: the gate's verdict, where NaN/inf now first appear, the drops (and
    the rest, folded) as the page (:func:`fxstab.plots.html.diff_page`) lists them."""
    verdict = (f'<p class="verdict {"fail" if result.failed else "pass"}">'
               f"{escape(result.summary())}</p>")
    parts = [f"<h3>fxstab diff {escape(result.base_label)} &rarr; "
             f"{escape(result.head_label)}</h3>", verdict,
             f'<div class="muted">{escape(result.metric)} digits per operator, threshold '
             f"{result.max_drop:g}; {result.unchanged} operator(s) unchanged</div>"]
    if result.notes:
        parts.append(f'<ul class="findings">{_list(list(result.notes), "note")}</ul>')
    if result.new_origins:
        parts.append("<h4>NaN/inf now first appear at</h4><ul class=\"findings\">"
                     + _list(list(result.new_origins), "origin") + "</ul>")
    lead = [o for o in result.origins if o.local_loss > 0][:1]
    if lead:
        parts.append(f'<p>Digits are lost first at <code>{escape(lead[0].name)}</code> (local '
                     f"loss {lead[0].local_loss:.2f}).</p>")

    def changes(title: str, rows: list, open_: bool = True) -> None:
        if not rows:
            return
        table = ops_table(("operator", "kind", "base", "head", "change"), (
            (f"<code>{escape(r.name)}</code>", escape(r.kind), (f"{r.base:.2f}", "n"),
             (f"{r.head:.2f}", "n"), (f"{r.delta:+.2f}", "n")) for r in rows))
        body = f"{escape(title)} ({len(rows)})"
        parts.append(f"<h4>{body}</h4>{table}" if open_ else
                     f"<details><summary>{body}</summary>{table}</details>")

    def presence(title: str, rows: list) -> None:
        if rows:
            table = ops_table(("operator", "kind", "digits"), (
                (f"<code>{escape(r.name)}</code>", escape(r.kind), (f"{r.digits:.2f}", "n"))
                for r in rows))
            parts.append(f"<details><summary>{escape(title)} ({len(rows)})</summary>{table}"
                         f"</details>")

    changes("Lost digits", result.drops)
    if result.rewrite_drops:
        parts.append("<h4>Rewritten regions that lost digits</h4><ul class=\"findings\">"
                     + _list([r.describe() for r in result.rewrite_drops], "loss") + "</ul>")
    changes("Modules that lost digits (operators renamed inside)", result.module_drops)
    presence("No longer analysed (their module is still there)", result.vanished)
    changes("Drops that cost the outputs nothing", result.harmless, open_=False)
    changes("Gained digits", result.gains, open_=False)
    presence("Added", result.added)
    presence("Removed", result.removed)
    return _fragment("".join(parts))


def coverage_fragment(cov: Any) -> str:
    """A coverage (``be.coverage()``) in a notebook: the map page's coverage section."""
    data = cov.as_dict()
    names = {e["operator"] for e in data.get("operators", ()) if e.get("how") == "analysed"}
    _, summary = coverage_summary(data, names)
    return _fragment(f"<h3>fxstab coverage</h3>{coverage_html(summary)}")


def plan_fragment(plan: Any) -> str:
    """A precision plan in a notebook: its verdict and its promoted operators, as
    :func:`fxstab.plots.html.plan_page` (which adds the frontier's chart)."""
    required = plan.required()
    target = plan.settings.get("target")
    verdict = (f"keeps {fmt_digits(plan.after)} digits at the outputs (the analysis), "
               f"{'meeting' if plan.met else 'NOT meeting'} the {required:.2f} required; "
               f"{fmt_digits(plan.before)} all in {plan.format}")
    rows = ((f"<code>{escape(n)}</code>", escape(plan.kinds.get(n, "")),
             escape(plan.modules.get(n, "")),
             (fmt_digits(plan.per_operator.get(n, (math.nan, math.nan))[0]), "n"),
             (fmt_digits(plan.per_operator.get(n, (math.nan, math.nan))[1]), "n"))
            for n in plan.promoted)
    table = ops_table(("operator", "kind", "module", "digits without the plan", "with it"),
                       rows)
    return _fragment(
        f"<h3>fxstab precision plan: {escape(str(target or 'model'))} in "
        f"{escape(plan.format)}</h3><div class=\"muted\">{len(plan.promoted)} of "
        f"{plan.operators} operators in {escape(plan.higher)}, the rest in "
        f"{escape(plan.format)}; {plan.runs} analysed calls</div>"
        f'<p class="verdict {"pass" if plan.met else "fail"}">The plan {escape(verdict)}.</p>'
        f"<h4>Promoted operators ({len(plan.promoted)})</h4>{table}")


def check_fragment(check: Any) -> str:
    """A plan's check on the real run (:class:`fxstab.plan.apply.PlanCheck`) in a notebook."""
    def row(label: str, which: str) -> tuple:
        bad = getattr(check, f"{which}_non_finite", 0)
        return (label, (fmt_digits(getattr(check, which)), "n"),
                (f"{bad} of {check.numel}" if bad else "0", "n"))
    table = ops_table(("real run", "avg true digits at the outputs", "NaN/inf elements"),
                       (row("without the plan", "plain"), row("with the plan", "planned"),
                        row("all in the higher format", "high")))
    missing = (f'<ul class="findings"><li class="loss">{len(check.missing)} operator(s) of '
               f"the plan were not found in the compiled model: "
               f"{escape(', '.join(check.missing[:5]))}</li></ul>" if check.missing else "")
    return _fragment("<h3>fxstab plan check: the real low-precision run against fp64</h3>"
                     f"{table}{missing}")


def impact_fragment(imp: Any, top: int = 15) -> str:
    """An impact (:func:`fxstab.operator_impact`) in a notebook: the operators whose rounding
    costs the outputs most."""
    rows = ((f"<code>{escape(n)}</code>", (f"{g:.2f}", "n"),
             "alone" if n in imp.resolved else "with its group (group bound)")
            for n, g in imp.ranked()[:top])
    table = ops_table(("operator", "impact (digits)", "measured"), rows)
    return _fragment(
        f"<h3>fxstab impact on the outputs</h3><div class=\"muted\">"
        f"{fmt_digits(imp.output_digits)} avg digits at the outputs with every operator rounded; "
        f"{imp.calls} analysed calls; an operator's impact is the digits the outputs gain when "
        f"its output is left unrounded; below {imp.threshold:g}: harmless here. A group bound "
        f"is the gain of a group of operators left unrounded together, which gained less than "
        f"{imp.threshold:g} and so was not split further: each operator in it is given the "
        f"group's gain, a bound on its own.</div>{table}"
        + (f'<p class="muted">{len(imp.by_operator) - top} more: '
           f"<code>impact.table(top=None)</code>.</p>" if len(imp.by_operator) > top else ""))
