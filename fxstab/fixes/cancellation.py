"""The rewrites of a value added and subtracted again: ``(a + c) - c`` rounds ``a`` to the
spacing of ``c`` (a small ``a`` next to a large ``c`` is lost) and gives it back as that
rounding; ``a`` itself is what the program meant."""

from __future__ import annotations

import torch.fx

from .pattern import is_const, kind
from .registry import Match, rewrite

__all__ = ["add_sub"]


def _same(a: object, b: object) -> bool:
    """The same node, or equal Python numbers."""
    if isinstance(a, torch.fx.Node) or isinstance(b, torch.fx.Node):
        return a is b
    return isinstance(b, (int, float)) and is_const(a, b)


@rewrite("add_sub", "(a + c) - c", "a")
def add_sub(node: object) -> Match | None:
    """``(a + c) - c`` (or ``(c + a) - c``) as ``a``: the sum rounds ``a`` to the spacing at
    ``c`` (0.5 at 1000 in fp16), so the difference keeps only the digits of ``a`` above it;
    no rounding at all keeps every one.

    Needs: the same ``c`` added and subtracted (the same node, or equal constants), ``a`` of
    the result's shape (``c`` broadcasts no dimension into it)."""
    if kind(node) != "sub" or len(node.args) != 2 or node.kwargs:
        return None
    s, c = node.args
    if kind(s) != "add" or len(s.args) != 2 or s.kwargs:
        return None
    for a, c1 in (s.args, s.args[::-1]):
        if _same(c1, c) and isinstance(a, torch.fx.Node) and \
                a.meta.get("example_value") is not None and node.meta.get("example_value") \
                is not None and a.meta["example_value"].shape == node.meta["example_value"].shape \
                and a.meta["example_value"].dtype == node.meta["example_value"].dtype:
            return Match("add_sub", node, node, (node, s), a)
    return None
