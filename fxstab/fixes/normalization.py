"""The rewrites of a normalization written by hand: its statistics (a mean, a variance, a
mean of squares) computed and stored in the format, where the squares overflow (fp16, above
256) and the variance cancels; ``F.layer_norm`` and ``F.rms_norm`` compute them in fp32 for
fp16/bf16 inputs."""

from __future__ import annotations

import torch.nn.functional as F

from .pattern import dims, is_const, kind, one_dim, operand, shape, square_of
from .registry import Call, Match, rewrite

__all__ = ["layer_norm", "rms_norm"]


def _last(node: object, x: object) -> bool:
    """Whether the reduction ``node`` is over ``x``'s last dimension alone, ``keepdim=True``."""
    dim, keepdim = dims(node)
    xs = shape(x)
    d = one_dim(dim)
    return keepdim and d is not None and xs is not None and len(xs) > 0 and \
        d % len(xs) == len(xs) - 1


def _plus_eps(node: object) -> tuple:
    """``(v, eps)`` where ``node`` is ``v + eps`` or ``eps + v`` for a Python number ``eps >=
    0``, else ``(node, 0.0)``."""
    if kind(node) == "add" and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        for v, e in ((a, b), (b, a)):
            if isinstance(e, (int, float)) and not isinstance(e, bool) and e >= 0 and \
                    hasattr(v, "op"):
                return v, float(e)
    return node, 0.0


def _inverse_root(node: object) -> tuple | None:
    """``(numerator, s, nodes)`` where ``node`` is ``numerator / sqrt(s)``, ``numerator *
    rsqrt(s)`` or ``rsqrt(s) * numerator``, else None."""
    k = kind(node)
    if k == "div" and len(node.args) == 2 and kind(node.args[1]) == "sqrt":
        return node.args[0], operand(node.args[1], 0), (node, node.args[1])
    if k == "mul" and len(node.args) == 2:
        for a, r in (node.args, node.args[::-1]):
            if kind(r) == "rsqrt":
                return a, operand(r, 0), (node, r)
    return None


def _biased_variance(node: object, x: object, mu: object) -> tuple | None:
    """The nodes of ``node`` as the biased variance of ``x`` over its last dimension
    (``keepdim=True``): ``x.var(-1, keepdim=True, unbiased=False)`` (or ``correction=0``),
    or the mean of the squares of ``x - mu``; else None."""
    if kind(node) == "var" and operand(node, 0) is x and len(node.args) <= 2:
        dim = operand(node, 1, "dim", None)
        biased = node.kwargs.get("unbiased") is False or is_const(node.kwargs.get("correction"), 0)
        xs = shape(x)
        if biased and node.kwargs.get("keepdim") is True and one_dim(dim) is not None and \
                xs is not None and one_dim(dim) % len(xs) == len(xs) - 1:
            return (node,)
        return None
    if kind(node) == "mean" and _last(node, x):
        sq = operand(node, 0)
        c = square_of(sq)
        # the same mean, or the mean of x computed again (mu written out twice)
        if kind(c) == "sub" and c.args[0] is x and (c.args[1] is mu or (
                kind(c.args[1]) == "mean" and operand(c.args[1], 0) is x and
                _last(c.args[1], x))):
            return tuple(dict.fromkeys((node, sq, c, c.args[1])))
    return None


@rewrite("layer_norm", "(x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps)",
         "F.layer_norm(x, (n,), eps=eps)")
def layer_norm(node: object) -> Match | None:
    """A layer normalization without its affine part written by hand, ``mu =
    x.mean(-1, keepdim=True)``, as ``F.layer_norm`` (which computes the statistics in fp32
    for fp16 and bf16 inputs): the naive squares overflow above 256 in fp16, and a
    variance stored in the format keeps few digits where the mean is large against the
    spread.

    The variance may be ``x.var(-1, keepdim=True, unbiased=False)`` (or ``correction=0``)
    or the mean of the squared deviations; the root ``torch.sqrt(v + eps)`` dividing, or
    ``torch.rsqrt(v + eps)`` multiplying.

    Needs: the statistics over the last dimension with ``keepdim=True``, the biased
    variance, ``eps`` a number (0 where there is none)."""
    found = _inverse_root(node)
    if found is None:
        return None
    c, s, outer = found
    if kind(c) != "sub" or len(c.args) != 2:
        return None
    x, mu = c.args
    if kind(mu) != "mean" or operand(mu, 0) is not x or not _last(mu, x):
        return None
    v, eps = _plus_eps(s)
    var = _biased_variance(v, x, mu)
    if var is None:
        return None
    nodes = tuple(dict.fromkeys((*outer, c, mu, *((s,) if s is not v else ()), *var)))
    return Match("layer_norm", node, outer[-1], nodes,
                 Call("F.layer_norm", F.layer_norm, x, (shape(x)[-1],), eps=eps))


@rewrite("rms_norm", "x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)",
         "F.rms_norm(x, (n,), eps=eps)")
def rms_norm(node: object) -> Match | None:
    """An RMS normalization without its weight written by hand, as ``F.rms_norm`` (which
    computes the mean of squares in fp32 for fp16 and bf16 inputs): the naive squares
    overflow above 256 in fp16 (the root is ``inf`` and the output 0).

    Needs: the mean of squares over the last dimension with ``keepdim=True``, ``eps`` a
    number (0 where there is none)."""
    found = _inverse_root(node)
    if found is None:
        return None
    x, s, outer = found
    v, eps = _plus_eps(s)
    if kind(v) != "mean" or not _last(v, x) or square_of(operand(v, 0)) is not x:
        return None
    nodes = tuple(dict.fromkeys((*outer, *((s,) if s is not v else ()), v, operand(v, 0))))
    return Match("rms_norm", node, outer[-1], nodes,
                 Call("F.rms_norm", F.rms_norm, x, (shape(x)[-1],), eps=eps))
