"""The rewrites of a guard the format erases: an ``eps`` added before a logarithm, a root or a
division, below what the format holds (``1e-8`` is 0 in fp16, whose smallest subnormal is
6e-8), or a clamp's bound that rounds onto the edge it keeps the value from (``1 - 1e-4`` is
1.0 in fp16), so the guard guards nothing in the real run. The stable form is the nearest
value the format holds at full precision on the guarded side: its smallest normal number, the
largest number below 1. The only rewrites of the table that change the formula's value (where
the guarded value is near the edge, by design), so the only ones whose pattern depends on
the format."""

from __future__ import annotations

import operator

import torch

from .pattern import kind, operand
from .registry import Call, Match, rewrite

__all__ = ["eps", "clamp_bounds"]

# the readers an eps guards: a value near 0 is their pole or the edge of their domain
_GUARDED = {"log": 0, "log2": 0, "log10": 0, "sqrt": 0, "rsqrt": 0, "reciprocal": 0, "div": 1}


def _guard(node: object) -> object:
    """The reader of ``node`` it guards (``node`` as the logarithm's argument, the
    divisor...), else None."""
    for user in node.users:
        k = kind(user)
        if k in _GUARDED and len(user.args) > _GUARDED[k] and user.args[_GUARDED[k]] is node:
            return user
    return None


@rewrite("eps", "torch.log(x + 1e-8)", "torch.log(x + 6.103515625e-05)", format_aware=True)
def eps(node: object, format: object) -> Match | None:
    """An ``eps`` guard (``x + eps`` read by a ``log``, ``sqrt``, ``rsqrt``, ``reciprocal``
    or as a divisor) below the format's smallest normal number, raised to it (``2^-14``,
    6.1e-5, in fp16; bf16 holds fp32's range): in fp16 ``1e-8`` rounds to 0, so ``log(0 +
    eps)`` is ``-inf`` in the real run, and an eps between the smallest subnormal and normal
    keeps few digits. The value changes where ``x`` is near 0, which is the point: the guard
    the program meant to have, in the format it runs in.

    Needs: ``eps`` a Python number above 0 and below the format's smallest normal, read by
    one of the guarded functions."""
    if kind(node) != "add" or len(node.args) != 2 or node.kwargs:
        return None
    for x, c in (node.args, node.args[::-1]):
        if isinstance(c, (int, float)) and not isinstance(c, bool) and \
                0 < c < format.min_normal and hasattr(x, "op"):
            reader = _guard(node)
            if reader is None:
                return None
            return Match("eps", node, reader, (node,),
                         Call("+", operator.add, x, float(format.min_normal)))
    return None


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@rewrite("clamp_bounds", "p.clamp(1e-8, 1 - 1e-4)",
         "p.clamp(6.103515625e-05, 0.99951171875)", format_aware=True)
def clamp_bounds(node: object, format: object) -> Match | None:
    """A clamp whose bounds the format erases, raised to what it holds: a lower bound in
    ``(0, smallest normal)`` to the smallest normal (``1e-8`` is 0 in fp16), an upper bound
    below 1 that rounds to 1 to the largest number below 1 (``1 - 1e-4`` is 1.0 in fp16:
    ``1 - 2^-11`` is the largest, 0.99951171875; ``1 - 2^-8`` in bf16). The clamp is what a
    program writes to keep ``log(p)`` and ``log(1 - p)`` finite; with the bound erased both
    are ``-inf`` where ``p`` reaches 0 or 1.

    Needs: ``clamp``, ``clamp_min``, ``clamp_max`` or ``clip`` with a Python number as a bound
    the format erases (the other bound, if any, is kept)."""
    k = kind(node)
    if k in ("clamp", "clip"):
        lo, hi = operand(node, 1, "min", None), operand(node, 2, "max", None)
    elif k == "clamp_min":
        lo, hi = operand(node, 1, "min", None), None
    elif k == "clamp_max":
        lo, hi = None, operand(node, 1, "max", None)
    else:
        return None
    x = operand(node, 0)
    new_lo, new_hi = lo, hi
    if _number(lo) and 0 < lo < format.min_normal:
        new_lo = float(format.min_normal)
    below_one = 1.0 - 2.0 ** -format.precision  # the largest number below 1
    if _number(hi) and hi < 1 and 1 - hi <= 2.0 ** -(format.precision + 1):  # rounds to 1
        new_hi = below_one
    if (new_lo, new_hi) == (lo, hi) or not hasattr(x, "op"):
        return None
    kwargs = {k: v for k, v in (("min", new_lo), ("max", new_hi)) if v is not None}
    return Match("clamp_bounds", node, node, (node,),
                 Call("torch.clamp", torch.clamp, x, **kwargs))
