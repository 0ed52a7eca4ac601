"""The rewrite of a ``torch.where`` whose unselected branch overflows: the forward value is
right (``where`` picks the other branch), but the gradient of the unselected branch is 0
times the function's ``inf`` derivative, NaN (PyTorch's FAQ: "the gradient of where"). The
stable form masks the argument first, so the function never sees the values it overflows
on."""

from __future__ import annotations

import torch

from .pattern import floating, kind, operand
from .registry import Call, Match, rewrite

__all__ = ["where_masked"]

# the functions whose value or derivative overflows somewhere, and an argument where neither
# does (what the masked argument takes where the branch is not selected)
_SAFE = {"exp": 0.0, "expm1": 0.0, "exp2": 0.0, "log": 1.0, "log2": 1.0, "log10": 1.0,
         "log1p": 0.0, "sqrt": 1.0, "rsqrt": 1.0, "reciprocal": 1.0}


def _function(node: object) -> tuple | None:
    """``(a, text, fn)`` where ``node`` is one of :data:`_SAFE`'s functions of a tensor ``a``
    (no other operand), else None."""
    k = kind(node)
    if k not in _SAFE or len(node.args) != 1 or node.kwargs:
        return None
    a = operand(node, 0)
    if not floating(a):
        return None
    fn = getattr(torch, k)
    return a, f"torch.{k}", fn


@rewrite("where_masked", "torch.where(c, torch.exp(a), b)",
         "torch.where(c, torch.exp(torch.where(c, a, 0.0)), b)")
def where_masked(node: object) -> Match | None:
    """A ``torch.where`` over a function that overflows where its branch is not selected
    (``where(a <= 0, exp(a), 1 + a)`` at large ``a``), with the function's argument masked
    first: the forward value is the same, and the backward no longer multiplies 0 by the
    function's ``inf`` derivative (NaN). The masked argument takes a value where the function
    and its derivative are finite (0 for ``exp``, 1 for ``log``, ``sqrt``, ``reciprocal``).

    Needs: the function of one tensor argument (``exp``, ``expm1``, ``log``, ``log1p``,
    ``sqrt``, ``rsqrt``, ``reciprocal``...) as one branch, read by nothing but the
    ``where``."""
    if kind(node) != "where" or len(node.args) != 3 or node.kwargs:
        return None
    cond, x, y = node.args
    for branch, selected in ((x, True), (y, False)):
        found = _function(branch) if hasattr(branch, "op") else None
        if found is None or len(branch.users) != 1:
            continue
        a, text, fn = found
        safe = _SAFE[kind(branch)]
        inner = Call("torch.where", torch.where, cond, a, safe) if selected else \
            Call("torch.where", torch.where, cond, safe, a)
        masked = Call(text, fn, inner)
        form = Call("torch.where", torch.where, cond, masked, y) if selected else \
            Call("torch.where", torch.where, cond, x, masked)
        return Match("where_masked", node, branch, (node, branch), form)
    return None
