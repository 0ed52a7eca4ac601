"""The rewrites of a statistic written with squares: a variance as the difference of two
means (``E[x^2] - E[x]^2`` cancels, and ``x^2`` overflows), a Euclidean norm as the root of a
sum of squares (``x^2`` overflows above 256 in fp16 and underflows below 2^-12), a vector
divided by such a norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .pattern import dims, is_const, kind, one_dim, operand, same_dim, shape, square_of
from .registry import Call, Match, keep, rewrite

__all__ = ["variance", "vector_norm", "normalize", "hypot", "cosine_similarity"]


@rewrite("variance", "(x * x).mean(dim) - x.mean(dim) ** 2",
         "torch.var(x, dim, correction=0)")
def variance(node: object) -> Match | None:
    """The population variance ``E[x^2] - E[x]^2`` as ``torch.var(x, dim, correction=0)``,
    which subtracts the mean first (two passes). Where the mean is large against the spread,
    the two terms agree in their leading digits and the difference keeps none of them (it
    can come out negative); in fp16, ``x^2`` overflows for ``|x|`` above 256.

    Needs: both means over the same ``dim`` with the same ``keepdim``."""
    if kind(node) != "sub" or len(node.args) != 2:
        return None
    m2, sq = node.args
    if kind(m2) != "mean" or kind(sq) is None:
        return None
    m = square_of(sq)
    if kind(m) != "mean":
        return None
    x = operand(m, 0)
    x2 = operand(m2, 0)
    if square_of(x2) is not x:
        return None
    (d1, k1), (d2, k2) = dims(m), dims(m2)
    xs = shape(x)
    if k1 != k2 or not same_dim(d1, d2, len(xs) if xs is not None else None) or \
            operand(m, 3, "dtype", None) is not None:
        return None
    args = (x,) if d1 is None else (x, d1)
    return Match("variance", node, node, tuple(dict.fromkeys((node, m2, sq, m, x2))),
                 Call("torch.var", torch.var, *args, correction=0, **keep(k1)))


def _sum_of_squares(node: object) -> tuple | None:
    """``(x, dim, keepdim, nodes)`` where ``node`` is ``sum(x^2, dim, keepdim)``, else None."""
    if kind(node) != "sum":
        return None
    sq = operand(node, 0)
    x = square_of(sq)
    if x is None:
        return None
    dim, keepdim = dims(node)
    return x, dim, keepdim, (node, sq)


def _root(node: object) -> object:
    """``s`` where ``node`` is ``sqrt(s)`` or ``s ** 0.5``, else None."""
    k = kind(node)
    if k == "sqrt":
        return operand(node, 0)
    if k == "pow" and is_const(operand(node, 1, "exponent"), 0.5):
        return operand(node, 0)
    return None


@rewrite("vector_norm", "torch.sqrt((x * x).sum(dim))", "torch.linalg.vector_norm(x, 2, dim)")
def vector_norm(node: object) -> Match | None:
    """The Euclidean norm as the root of a sum of squares, as ``torch.linalg.vector_norm``:
    in fp16 ``x^2`` overflows for ``|x|`` above 256 (the norm is ``inf`` where the value is
    finite) and underflows to 0 below ``2^-12``; the library's norm accumulates in a wider
    type and its gradient at 0 is 0, not the NaN of ``sqrt``'s.

    Needs: nothing."""
    found = _sum_of_squares(_root(node))
    if found is None:
        return None
    x, dim, keepdim, nodes = found
    return Match("vector_norm", node, node, (node, *nodes),
                 Call("torch.linalg.vector_norm", torch.linalg.vector_norm, x, 2, dim,
                      **keep(keepdim)))


def _norm_of(node: object) -> tuple | None:
    """``(x, dim, keepdim, nodes)`` where ``node`` is the Euclidean norm of ``x``: a root of a
    sum of squares, ``x.norm(dim=...)``/``torch.norm`` (2 or Frobenius) or
    ``torch.linalg.vector_norm`` (order 2), else None."""
    found = _sum_of_squares(_root(node))
    if found is not None:
        x, dim, keepdim, nodes = found
        return x, dim, keepdim, (node, *nodes)
    k = kind(node)
    if k in ("norm", "linalg_vector_norm"):
        p = operand(node, 1, "p", operand(node, 1, "ord", 2))
        if not is_const(p, 2) and p != "fro":
            return None
        return (operand(node, 0), operand(node, 2, "dim", None),
                bool(operand(node, 3, "keepdim", False)), (node,))
    return None


@rewrite("normalize", "x / torch.sqrt((x * x).sum(dim, keepdim=True))",
         "F.normalize(x, dim=dim)")
def normalize(node: object) -> Match | None:
    """A vector divided by its Euclidean norm (written as a root of a sum of squares, or with
    ``norm``/``vector_norm``), as ``F.normalize``: the norm no longer overflows, and a zero
    vector gives 0 (the norm clamped below by ``eps=1e-12``) instead of the NaN of ``0/0``.

    Needs: the norm over one dimension with ``keepdim=True`` (so that the quotient
    broadcasts as ``F.normalize``'s does); equal to the naive form wherever that is finite
    and the norm is above ``1e-12``."""
    if kind(node) != "div" or len(node.args) != 2:
        return None
    x, n = node.args
    found = _norm_of(n)
    if found is None:
        return None
    y, dim, keepdim, nodes = found
    if y is not x or one_dim(dim) is None or not keepdim:
        return None
    return Match("normalize", node, n, (node, *nodes),
                 Call("F.normalize", F.normalize, x, dim=one_dim(dim)))


@rewrite("hypot", "torch.sqrt(x * x + y * y)", "torch.hypot(x, y)")
def hypot(node: object) -> Match | None:
    """The length ``sqrt(x^2 + y^2)`` as ``torch.hypot(x, y)``, which scales before it squares:
    in fp16 a square overflows for ``|x|`` above 256 (the length is ``inf`` where it is
    finite) and underflows to 0 below ``2^-12``.

    Needs: nothing (the squares in either order)."""
    s = _root(node)
    if kind(s) != "add" or len(s.args) != 2 or s.kwargs:
        return None
    a, b = (square_of(v) for v in s.args)
    if a is None or b is None:
        return None
    return Match("hypot", node, node, (node, s, *s.args), Call("torch.hypot", torch.hypot, a, b))


@rewrite("cosine_similarity", "(a * b).sum(dim) / (a.norm(dim=dim) * b.norm(dim=dim))",
         "F.cosine_similarity(a, b, dim)")
def cosine_similarity(node: object) -> Match | None:
    """A cosine similarity written by hand, as ``F.cosine_similarity``: the naive norms
    square the elements (``inf`` above 256 in fp16: the quotient is 0 or NaN), and a zero
    vector divides 0 by 0; the library's bounds the norms below by ``eps=1e-8``.

    Needs: the dot product and both norms over the same single ``dim`` without ``keepdim``;
    equal to the naive form wherever that is finite and the norms' product is above
    ``1e-8``."""
    if kind(node) != "div" or len(node.args) != 2:
        return None
    dot, den = node.args
    if kind(dot) != "sum" or kind(den) != "mul" or len(den.args) != 2:
        return None
    prod = operand(dot, 0)
    ddim, dkeep = dims(dot)
    if kind(prod) != "mul" or len(prod.args) != 2 or dkeep or one_dim(ddim) is None:
        return None
    na, nb = (_norm_of(v) for v in den.args)
    if na is None or nb is None:
        return None
    a, b = prod.args
    if {id(na[0]), id(nb[0])} != {id(a), id(b)} or na[2] or nb[2]:
        return None
    xs = shape(a)
    nd = len(xs) if xs is not None else None
    if not (same_dim(na[1], ddim, nd) and same_dim(nb[1], ddim, nd)) or shape(b) != xs:
        return None
    nodes = tuple(dict.fromkeys((node, dot, prod, den, *na[3], *nb[3])))
    return Match("cosine_similarity", node, den, nodes,
                 Call("F.cosine_similarity", F.cosine_similarity, a, b, one_dim(ddim)))
