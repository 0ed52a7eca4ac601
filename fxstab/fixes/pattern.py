"""What the rewrites' patterns ask of a node of the captured graph: its operator kind (as the
analysis names it, :func:`fxstab.capture.opsets.node_kind`: ``torch.log(x)``, ``x.log()`` are
both ``log``; ``1 - x`` is ``sub``), an operand by position or keyword (a method's ``self`` is
its first operand, as a function's input is), a constant, its example value's shape."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx

from ..capture.opsets import node_kind

__all__ = ["kind", "operand", "is_const", "shape", "floating", "dims", "one_dim", "square_of",
           "same_dim", "softmax_operands", "MISSING"]

MISSING = object()


def kind(value: Any) -> Optional[str]:
    """The operator kind of a call node, None for anything else (a constant, an input)."""
    if isinstance(value, torch.fx.Node) and value.op in ("call_function", "call_method"):
        return node_kind(value)
    return None


def operand(node: torch.fx.Node, i: int, name: str = "", default: Any = MISSING) -> Any:
    """The operand at position ``i`` (or keyword ``name``) of a call, else ``default``."""
    if i < len(node.args):
        return node.args[i]
    if name and name in node.kwargs:
        return node.kwargs[name]
    return default


def is_const(value: Any, number: float) -> bool:
    """Whether ``value`` is the Python number ``number`` (a constant of the program)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == number


def shape(value: Any) -> Optional[tuple]:
    """The shape of a node's example value (dynamo's fake tensor), None where unknown."""
    if isinstance(value, torch.fx.Node):
        ev = value.meta.get("example_value", value.meta.get("val"))
        if isinstance(ev, torch.Tensor):
            return tuple(ev.shape)
    return None


def floating(value: Any) -> bool:
    """Whether a node's example value is a floating tensor."""
    ev = value.meta.get("example_value") if isinstance(value, torch.fx.Node) else None
    return isinstance(ev, torch.Tensor) and ev.is_floating_point()


def dims(node: torch.fx.Node) -> tuple:
    """A reduction's ``(dim, keepdim)`` (``dim`` None: over every dimension)."""
    dim = operand(node, 1, "dim", None)
    keepdim = operand(node, 2, "keepdim", False)
    return dim, bool(keepdim)


def one_dim(dim: Any) -> Optional[int]:
    """A reduction's single dimension (an int or a 1-tuple), None otherwise."""
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    return dim if isinstance(dim, int) and not isinstance(dim, bool) else None


def square_of(value: Any) -> Any:
    """``x`` where ``value`` is ``x * x``, ``x ** 2``, ``x.pow(2)`` or ``torch.square(x)``,
    else None."""
    k = kind(value)
    if k == "mul" and len(value.args) == 2 and value.args[0] is value.args[1] and \
            isinstance(value.args[0], torch.fx.Node):
        return value.args[0]
    if k == "pow" and is_const(operand(value, 1, "exponent"), 2):
        return operand(value, 0)
    if k == "square":
        return operand(value, 0)
    return None


def same_dim(a: Any, b: Any, ndim: Optional[int]) -> bool:
    """Whether two reductions' ``dim`` name the same dimensions (``-1`` and ``ndim - 1``)."""
    def norm(d: Any) -> Any:
        if d is None:
            return None
        ds = d if isinstance(d, (tuple, list)) else (d,)
        if ndim is None:
            return tuple(ds)
        return tuple(sorted(int(x) % ndim for x in ds)) if ndim else tuple(ds)
    return norm(a) == norm(b)


def softmax_operands(node: Any) -> Optional[tuple]:
    """``(x, dim)`` of ``softmax(x, dim)`` (``F.softmax``, ``torch.softmax``,
    ``x.softmax``; no ``dtype=``), else None."""
    if kind(node) != "softmax" or len(node.args) > 2 or node.kwargs.get("dtype") is not None:
        return None
    dim = operand(node, 1, "dim", None)
    return (operand(node, 0, "input"), dim) if isinstance(dim, int) else None
