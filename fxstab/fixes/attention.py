"""The rewrite of an attention written by hand: ``softmax(q @ k^T * scale) @ v`` as
``F.scaled_dot_product_attention``, whose kernels compute the scores in a wider type than the
operands (fp32 for fp16/bf16 inputs) and never store them in the format: the stored scores of
the naive form overflow once they pass 65504 in fp16 (large activations, a missing
``1/sqrt(d)``), and the softmax of an ``inf`` is NaN."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .pattern import is_const, kind, operand, shape, softmax_operands
from .registry import Call, Match, rewrite

__all__ = ["attention"]


def _transposed(node: object) -> object:
    """``k`` where ``node`` is ``k.transpose(-2, -1)`` (either order of the two last
    dimensions), else None."""
    if kind(node) != "transpose" or len(node.args) != 3:
        return None
    k, a, b = node.args
    xs = shape(k)
    if xs is None or not isinstance(a, int) or not isinstance(b, int):
        return None
    n = len(xs)
    return k if {a % n, b % n} == {n - 2, n - 1} else None


def _masked(node: object) -> tuple:
    """``(scores, mask)`` where ``node`` is ``scores.masked_fill(mask, -inf)``, else
    ``(node, None)``."""
    if kind(node) == "masked_fill" and len(node.args) == 3 and \
            isinstance(node.args[2], float) and node.args[2] == -math.inf:
        return node.args[0], node.args[1]
    return node, None


def _scaled(node: object) -> tuple:
    """``(product, scale)`` where ``node`` is ``product * c``, ``c * product`` or ``product /
    c`` for a Python number ``c``, else ``(node, 1.0)``."""
    k = kind(node)
    if k in ("mul", "div") and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        if isinstance(b, (int, float)) and not isinstance(b, bool) and not is_const(b, 0):
            return a, float(b) if k == "mul" else 1.0 / b
        if k == "mul" and isinstance(a, (int, float)) and not isinstance(a, bool):
            return b, float(a)
    return node, 1.0


@rewrite("attention", "torch.softmax(q @ k.transpose(-2, -1) * scale, -1) @ v",
         "F.scaled_dot_product_attention(q, k, v, scale=scale)")
def attention(node: object) -> Match | None:
    """An attention written by hand, as ``F.scaled_dot_product_attention``: the scores ``q @
    k^T`` are not stored in the format (fp16 overflows above 65504: a missing ``1/sqrt(d)``
    or large activations give ``inf``, and the softmax NaN), and the softmax and the product
    with ``v`` run in one kernel. The scale is the program's (``scale=1.0`` where it had
    none: the rewrite keeps the formula; a missing ``1/sqrt(d)`` is the program's choice to
    revisit). A ``masked_fill(mask, -inf)`` before the softmax becomes ``attn_mask=~mask``.

    Needs: the softmax over the last dimension, ``k`` transposed in its two last
    dimensions, a Python number as the scale (``*`` or ``/``), ``q``, ``k``, ``v`` of at
    least 3 dimensions with the same last dimension for ``q`` and ``k``."""
    if kind(node) != "matmul" or len(node.args) != 2 or node.kwargs:
        return None
    a, v = node.args
    xd = softmax_operands(a)
    vs = shape(v)
    if xd is None or vs is None:
        return None
    s, dim = xd
    s1, mask = _masked(s)
    p, scale = _scaled(s1)
    if mask is None:
        p, mask = _masked(p)
    if kind(p) != "matmul" or len(p.args) != 2 or p.kwargs:
        return None
    q, kt = p.args
    k = _transposed(kt)
    qs, ks = shape(q), shape(k)
    if k is None or qs is None or len(qs) < 3 or len(ks) != len(qs) or len(vs) != len(qs) or \
            qs[-1] != ks[-1] or vs[-2] != ks[-2] or dim % len(qs) != len(qs) - 1:
        return None
    kwargs = {"attn_mask": Call("~", torch.logical_not, mask)} if mask is not None else {}
    nodes = tuple(n for n in dict.fromkeys((node, a, s, s1, p, kt)) if hasattr(n, "op"))
    return Match("attention", node, p, nodes,
                 Call("F.scaled_dot_product_attention", F.scaled_dot_product_attention, q, k, v,
                      **kwargs, scale=scale))
