"""The rewrite of a guard the format erases: an ``eps`` added before a logarithm, a root or a
division, below what the format holds (``1e-8`` is 0 in fp16, whose smallest subnormal is
6e-8), so the guard guards nothing in the real run. The stable form is the smallest eps the
format holds at full precision: its smallest normal number. The only rewrite of the table
that changes the formula's value (where the guarded value is near 0, by design), so the
only one whose pattern depends on the format."""

from __future__ import annotations

import operator

from .pattern import kind, operand
from .registry import Call, Match, rewrite

__all__ = ["eps"]

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
