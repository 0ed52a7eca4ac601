"""The operator graph as SVG markup for the HTML pages (:mod:`fxstab.plots.html`).

Drawn where :func:`fxstab.plots.layout.layout_graph` puts it, as :func:`fxstab.plots.draw.
plot_graph` draws the PNG: module boxes, edges from an input's bottom to its consumer's top (a
connector through the gap between two columns), one box per operator with its name and a value
line. Each operator is a ``<g class="op" data-i="k" data-name="...">`` that the page's script
recolours, hovers and selects; each edge a ``<path class="edge" data-s data-t>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Optional

from .layout import CHAR_IN, FONT_PT, GraphLayout

PX = 96.0  # CSS pixels per inch: the layout's 7 pt labels are 9.3 px
_MARGIN = 6.0  # px around the drawing


@dataclass
class BoxStyle:
    """How one operator's box starts out (the page's script restyles it on a metric change).

    ``classes``: extra CSS classes (``origin``, ``pass``, ``gone``...); ``halo``: a violet halo
    behind the box (a NaN/inf origin)."""

    fill: str
    ink: str
    text: str
    classes: str = ""
    halo: bool = False


def _f(v: float) -> str:
    return f"{v:.1f}"


def _pt(x: float, y: float) -> tuple[float, float]:
    """Layout inches (y up, top 0) -> SVG pixels (y down)."""
    return x * PX + _MARGIN, -y * PX + _MARGIN


def _edge_d(pieces: list, connectors: list) -> str:
    """Path data of one edge: each piece a run of cubic curves with vertical tangents (edges
    leave and enter boxes straight down), each connector a polyline; the last piece last, so
    the arrowhead (``marker-end``) sits on the consumer's top."""
    parts = []
    order = []
    for k, piece in enumerate(pieces):
        order.append(("curve", piece))
        if k < len(connectors):
            order.append(("line", connectors[k]))
    for what, pts in order:
        x0, y0 = _pt(*pts[0])
        d = [f"M{_f(x0)} {_f(y0)}"]
        for (ax, ay), (bx, by) in zip(pts, pts[1:]):
            (sx, sy), (tx, ty) = _pt(ax, ay), _pt(bx, by)
            if what == "curve":
                k = (ty - sy) / 2
                d.append(f"C{_f(sx)} {_f(sy + k)} {_f(tx)} {_f(ty - k)} {_f(tx)} {_f(ty)}")
            else:
                d.append(f"L{_f(tx)} {_f(ty)}")
        parts.append("".join(d))
    return "".join(parts)


def graph_svg(lay: GraphLayout, index: dict, styles: dict, svg_id: str = "graph",
              title: Optional[str] = None) -> str:
    """The SVG of a laid-out operator graph.

    Args:
        lay: the layout (:func:`layout_graph`).
        index: operator name -> its index in the page's data (``data-i``).
        styles: operator name -> :class:`BoxStyle`.
        svg_id: the element's id.
        title: an accessible title.
    """
    w = lay.width * PX + 2 * _MARGIN
    h = lay.height * PX + 2 * _MARGIN
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" id="{svg_id}" '
           f'width="{w:.0f}" height="{h:.0f}" viewBox="0 0 {w:.0f} {h:.0f}">']
    if title:
        out.append(f"<title>{escape(title)}</title>")
    out.append('<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="7" '
               'markerHeight="7" markerUnits="userSpaceOnUse" orient="auto">'
               '<path d="M0 0L8 4L0 8z" fill="#6b6b6b"/></marker></defs>')
    out.append('<g class="groups">')
    for g in lay.groups:
        x0, y1 = _pt(g.x0, g.y1)
        out.append(f'<g class="group"><rect x="{_f(x0)}" y="{_f(y1)}" '
                   f'width="{_f((g.x1 - g.x0) * PX)}" height="{_f((g.y1 - g.y0) * PX)}" '
                   f'rx="6"/><text x="{_f(x0 + 6)}" y="{_f(y1 + 14)}">'
                   f'{escape(g.key + (" (continued)" if g.continued else ""))}</text></g>')
    out.append('</g><g class="edges">')
    for e in lay.edges:
        cls = "edge back" if e.back else "edge"
        out.append(f'<path class="{cls}" data-s="{index[e.source]}" data-t="{index[e.target]}" '
                   f'd="{_edge_d(e.pieces, e.connectors)}" marker-end="url(#arrow)"/>')
    out.append('</g><g class="nodes">')
    for name, b in lay.nodes.items():
        st = styles[name]
        x0, y0 = _pt(b.x - b.w / 2, b.y + b.h / 2)
        cx, cy = _pt(b.x, b.y)
        bw, bh = b.w * PX, b.h * PX
        cls = f"op {st.classes}".strip()
        g = [f'<g class="{cls}" data-i="{index[name]}" data-name="{escape(name)}">']
        if st.halo:
            pad = 0.07 * PX
            g.append(f'<rect class="halo" x="{_f(x0 - pad)}" y="{_f(y0 - pad)}" '
                     f'width="{_f(bw + 2 * pad)}" height="{_f(bh + 2 * pad)}" rx="8"/>')
        g.append(f'<rect class="box" x="{_f(x0)}" y="{_f(y0)}" width="{_f(bw)}" '
                 f'height="{_f(bh)}" rx="4" fill="{st.fill}"/>')
        fit = min(1.0, (b.w - 0.1) / (max(1, len(b.label)) * CHAR_IN))
        size = f' font-size="{FONT_PT * PX / 72 * fit:.1f}"' if fit < 1 else ""
        g.append(f'<text class="lbl" x="{_f(cx)}" y="{_f(cy - 0.075 * PX)}" '
                 f'fill="{st.ink}"{size}>{escape(b.label)}</text>')
        g.append(f'<text class="val" x="{_f(cx)}" y="{_f(cy + 0.085 * PX)}" '
                 f'fill="{st.ink}">{escape(st.text)}</text></g>')
        out.append("".join(g))
    out.append("</g></svg>")
    return "".join(out)
