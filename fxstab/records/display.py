"""How fxstab's results show themselves in a notebook: Jupyter calls ``obj._repr_html_()``.

The results live in several layers (a :class:`~fxstab.records.coverage.Coverage` here, a
:class:`~fxstab.digitmap.DigitMap` above) while their HTML is built from the pages' pieces
(:mod:`fxstab.plots.notebook`), a layer they may not import. So their ``_repr_html_`` asks this
table, which :func:`fxstab.plots.notebook.register_displays` fills (``import fxstab`` calls
it): a type without a renderer shows its plain ``repr``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["register", "html"]

_RENDERERS: dict[type, Callable[[Any], str]] = {}


def register(cls: type, render: Callable[[Any], str]) -> None:
    """Show instances of ``cls`` (and its subclasses) in a notebook as ``render(obj)``."""
    _RENDERERS[cls] = render


def html(obj: Any) -> Optional[str]:
    """The notebook HTML of ``obj``, or None (Jupyter then shows its ``repr``)."""
    for cls in type(obj).__mro__:
        render = _RENDERERS.get(cls)
        if render is not None:
            return render(obj)
    return None
