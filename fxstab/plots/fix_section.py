"""The "Fixes" section of a digit map's page (:func:`fxstab.plots.html.map_page`): the stable
rewrites a map was made with (``fxstab fix --html``, :meth:`fxstab.digitmap.DigitMap.fixes`),
each at its line: the code, the stable form, verified or not, what the real run and the
analysis measured, and the findings it covers, linked to their operators in the graph.

A map without fixes has no section (:func:`fixes_html` gives "").
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path
from typing import Any, Mapping

__all__ = ["fixes_html", "fixes_note", "fixed_operators"]


def _digits(v: float) -> str:
    return "n/a" if v is None or math.isnan(v) else f"{v:.2f}"


def _where(source: str) -> str:
    """``file.py:LINE``: the file's name and the line (the whole path on hover)."""
    path, _, line = source.rpartition(":")
    return f"{Path(path).name}:{line}" if path and line.isdigit() else source


def _op(name: str, index: Mapping[str, int]) -> str:
    """An operator's name, linked to its box in the graph where the map has it."""
    if name in index:
        return (f'<a class="op-link" href="#graph-section" data-op="{index[name]}">'
                f"<code>{escape(name)}</code></a>")
    return f"<code>{escape(name)}</code>"


def _fix_html(fix: Any, index: Mapping[str, int]) -> str:
    state = "verified" if fix.verified else "not verified"
    src = (f'<code class="fix-src" title="{escape(fix.source)}">{escape(_where(fix.source))}'
           f"</code> " if fix.source else "")
    code = escape(fix.code) if fix.code else "(the line's text could not be read)"
    bad = f"NaN/inf {fix.nonfinite_before}/{fix.numel} -&gt; {fix.nonfinite_after}"
    covers = ", ".join(_op(f, index) for f in fix.findings)
    return (f'<div class="fix{" verified" if fix.verified else ""}" '
            f'data-rewrite="{escape(fix.rewrite)}" data-operator="{escape(fix.operator)}">'
            f'<div class="fix-head">{src}<b>{escape(fix.rewrite)}</b> at '
            f'{_op(fix.operator, index)} <span class="badge fix-state">{state}</span></div>'
            f'<pre class="fix-diff"><span class="del">- {code}</span>\n'
            f'<span class="add">+ {escape(fix.replacement)}</span></pre>'
            f'<div class="fix-runs">{bad}; outputs {_digits(fix.real_before)} -&gt; '
            f'{_digits(fix.real_after)} digits (real {escape(fix.format or "?")} run against '
            f"fp64); analysis {_digits(fix.before)} -&gt; {_digits(fix.after)}</div>"
            + (f'<div class="fix-covers">covers the finding(s) {covers}</div>' if covers else "")
            + "</div>")


def fixes_html(fixes: list, index: Mapping[str, int]) -> str:
    """The section (``id="fixes-section"``), or "" without fixes. ``index``: operator name ->
    its box's index in the page's graph."""
    if not fixes:
        return ""
    verified = sum(f.verified for f in fixes)
    head = (f'<p class="muted">{len(fixes)} stable rewrite(s) tried at the findings '
            f"(<code>fxstab fix</code>), each run for real in the format against fp64; "
            f"{verified} verified (fewer NaN/inf, or digits gained at the outputs), ranked "
            f"first.</p>")
    return (f'<section id="fixes-section"><h2>Fixes</h2>{head}'
            + "".join(_fix_html(f, index) for f in fixes) + "</section>")


def fixed_operators(fixes: list, index: Mapping[str, int]) -> dict:
    """For the page's data: operator index -> the verified fixes covering its finding, as
    ``rewrite at file.py:LINE`` (the graph's hover names them)."""
    out: dict = {}
    for f in fixes:
        if f.verified:
            for name in f.findings:
                if name in index:
                    out.setdefault(index[name], []).append(
                        f"{f.rewrite} at {_where(f.source) or f.operator}")
    return out


def fixes_note(fixes: list, index: Mapping[str, int]) -> str:
    """Under the findings: which of them a verified fix covers ("" where none does)."""
    covered = list(dict.fromkeys(n for f in fixes if f.verified for n in f.findings))
    if not covered:
        return ""
    names = ", ".join(_op(n, index) for n in covered)
    return (f'<p class="fixes-note">A verified fix covers {names}: see '
            f'<a href="#fixes-section">Fixes</a>.</p>')
