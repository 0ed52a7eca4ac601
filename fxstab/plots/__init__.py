"""Pictures of digit maps: digits per operator, the operator graph, digits over steps.

All plots use matplotlib's Agg backend (no display needed) and write PNG, SVG or PDF by the
file's extension. Every plot takes ``metric`` (None: :data:`fxstab.digitmap.DEFAULT_METRIC`,
read at call time) and sorts and colours operators by ``op.digits(metric)``. Colours encode
severity as a fraction of the format's digit cap (p·log10 2): see :func:`severity`.

- :mod:`~fxstab.plots.layout`: where the operator graph's boxes and edges go
  (:func:`layout_graph`, plain data, no matplotlib);
- :mod:`~fxstab.plots.draw`: the pictures (:func:`plot_digits`, :func:`plot_graph`,
  :func:`plot_series`), drawn with matplotlib.

``docs/pictures.md`` shows how to read each picture.
"""

from ..digitmap import PathLike
from .draw import (
    NONFINITE_COLOUR,
    SEVERITY_BANDS,
    NodeStyle,
    node_styles,
    plot_digits,
    plot_graph,
    plot_series,
    severity,
)
from .layout import (
    FONT_PT,
    EdgeRoute,
    GraphLayout,
    GroupBox,
    NodeBox,
    group_key,
    layout_graph,
)

__all__ = [
    "FONT_PT",
    "NONFINITE_COLOUR",
    "SEVERITY_BANDS",
    "EdgeRoute",
    "GraphLayout",
    "GroupBox",
    "NodeBox",
    "NodeStyle",
    "PathLike",
    "group_key",
    "layout_graph",
    "node_styles",
    "plot_digits",
    "plot_graph",
    "plot_series",
    "severity",
]
