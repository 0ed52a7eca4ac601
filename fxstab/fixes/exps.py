"""The rewrites of an exponential that over- or underflows or loses its digits to a
subtraction: ``exp(x) - 1`` (cancellation near 0), a softmax written by hand (no maximum
subtracted), ``1 - sigmoid(x)`` (cancellation once ``sigmoid(x)`` nears 1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .pattern import dims, is_const, kind, one_dim, operand, shape
from .registry import Call, Match, rewrite

__all__ = ["expm1", "softmax", "sigmoid_neg", "sigmoid_by_hand", "tanh_by_hand"]


@rewrite("expm1", "torch.exp(x) - 1", "torch.expm1(x)")
def expm1(node: object) -> Match | None:
    """``exp(x) - 1`` as ``torch.expm1(x)``: for small ``x`` the subtraction cancels the
    leading digits of ``exp(x)``, which already rounded ``x`` to the spacing at 1 (``2^-10``
    in fp16): below that, the naive form is 0.

    Needs: the constant exactly 1."""
    if kind(node) != "sub" or len(node.args) != 2 or not is_const(node.args[1], 1):
        return None
    e = node.args[0]
    if kind(e) != "exp":
        return None
    return Match("expm1", node, node, (node, e), Call("torch.expm1", torch.expm1, operand(e, 0)))


@rewrite("softmax", "torch.exp(x) / torch.exp(x).sum(dim, keepdim=True)", "F.softmax(x, dim)")
def softmax(node: object) -> Match | None:
    """A softmax written by hand as ``F.softmax``, which subtracts the maximum first: the
    naive ``exp`` overflows for a logit above 11 in fp16 (``inf / inf`` is NaN) and the sum
    underflows to 0 where every logit is below -17 (``0 / 0``).

    Needs: the two exponentials of the same ``x``; the sum over one dimension with
    ``keepdim=True``, or over the only dimension of a vector."""
    if kind(node) != "div" or len(node.args) != 2:
        return None
    num, s = node.args
    if kind(num) != "exp" or kind(s) != "sum":
        return None
    den = operand(s, 0)
    x = operand(num, 0)
    if kind(den) != "exp" or operand(den, 0) is not x:
        return None
    dim, keepdim = dims(s)
    xs = shape(x)
    if xs is None:
        return None
    if dim is None and len(xs) == 1:
        dim = 0
    elif one_dim(dim) is None or not (keepdim or len(xs) == 1):
        return None
    return Match("softmax", node, num, tuple(dict.fromkeys((node, num, s, den))),
                 Call("F.softmax", F.softmax, x, one_dim(dim)))


@rewrite("sigmoid_neg", "1 - torch.sigmoid(x)", "torch.sigmoid(-x)")
def sigmoid_neg(node: object) -> Match | None:
    """``1 - sigmoid(x)`` as ``sigmoid(-x)``: once ``sigmoid(x)`` nears 1 (a logit above
    about 3 in fp16) the subtraction cancels its digits, and above 8 it is 0 exactly, where
    ``sigmoid(-x)`` keeps every digit of the small value.

    Needs: the constant exactly 1."""
    if kind(node) != "sub" or len(node.args) != 2 or not is_const(node.args[0], 1):
        return None
    s = node.args[1]
    if kind(s) != "sigmoid":
        return None
    return Match("sigmoid_neg", node, node, (node, s),
                 Call("torch.sigmoid", torch.sigmoid, Call("-", torch.neg, operand(s, 0))))


def _exp_of(node: object, x: object) -> bool:
    """Whether ``node`` is ``exp(x)``."""
    return kind(node) == "exp" and operand(node, 0) is x


def _plus_one(node: object) -> object:
    """``y`` where ``node`` is ``1 + y`` or ``y + 1``, else None."""
    if kind(node) == "add" and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        if is_const(a, 1):
            return b
        if is_const(b, 1):
            return a
    return None


@rewrite("sigmoid_by_hand", "torch.exp(x) / (1 + torch.exp(x))", "torch.sigmoid(x)")
def sigmoid_by_hand(node: object) -> Match | None:
    """A sigmoid written by hand, as ``torch.sigmoid``: ``exp(x) / (1 + exp(x))`` is ``inf /
    inf``, NaN, for ``x`` above 11 in fp16; ``1 / (1 + exp(-x))`` is 0 for ``x`` below -11,
    where the value (about ``exp(x)``) is still a normal number.

    Needs: the constants exactly 1, both exponentials of the same ``x``."""
    if kind(node) != "div" or len(node.args) != 2:
        return None
    num, den = node.args
    e = _plus_one(den)
    if kind(e) != "exp":
        return None
    if is_const(num, 1) and kind(operand(e, 0)) == "neg":  # 1 / (1 + exp(-x))
        n = operand(e, 0)
        x, nodes = operand(n, 0), (node, den, e, n)
    elif kind(num) == "exp" and _exp_of(e, operand(num, 0)):  # exp(x) / (1 + exp(x))
        x, nodes = operand(num, 0), tuple(dict.fromkeys((node, num, den, e)))
    else:
        return None
    return Match("sigmoid_by_hand", node, e, nodes, Call("torch.sigmoid", torch.sigmoid, x))


@rewrite("tanh_by_hand", "(torch.exp(x) - torch.exp(-x)) / (torch.exp(x) + torch.exp(-x))",
         "torch.tanh(x)")
def tanh_by_hand(node: object) -> Match | None:
    """A hyperbolic tangent written by hand, as ``torch.tanh``: either exponential overflows
    for ``|x|`` above 11 in fp16, and the quotient is ``inf / inf``, NaN, where the value is
    ±1.

    Needs: the four exponentials of ``x`` and ``-x`` (the same nodes or recomputed)."""
    if kind(node) != "div" or len(node.args) != 2:
        return None
    num, den = node.args
    if kind(num) != "sub" or kind(den) != "add" or len(num.args) != 2 or len(den.args) != 2:
        return None
    ep, en = num.args
    if kind(ep) != "exp" or kind(en) != "exp" or kind(operand(en, 0)) != "neg":
        return None
    x = operand(ep, 0)
    neg = operand(en, 0)
    if operand(neg, 0) is not x:
        return None
    dp, dn = den.args

    def same(a: object, b: object) -> bool:  # the same exponential, or one of the same operand
        return a is b or (kind(a) == "exp" and kind(b) == "exp" and (
            operand(a, 0) is operand(b, 0) or (
                kind(operand(a, 0)) == "neg" and kind(operand(b, 0)) == "neg" and
                operand(operand(a, 0), 0) is operand(operand(b, 0), 0))))

    if not (same(dp, ep) and same(dn, en)):
        return None
    nodes = tuple(dict.fromkeys((node, num, den, ep, en, neg, dp, dn, operand(dn, 0))))
    return Match("tanh_by_hand", node, ep, nodes, Call("torch.tanh", torch.tanh, x))
