"""The rewrites of a logarithm taken of a value that can round to 0 or 1 in the format: of a
softmax or a sigmoid (a probability that underflows to 0: ``log`` gives ``-inf``), of ``1 +
x`` (``x`` below the format's epsilon is lost), of a sum of exponentials (which overflow), and
the losses written with them (cross entropy, binary cross entropy). The stable forms compute
the logarithm from the logits, never from the rounded probability."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .pattern import dims, floating, is_const, kind, one_dim, operand, shape, softmax_operands
from .registry import Call, Match, keep, rewrite

__all__ = ["log_softmax", "cross_entropy", "nll_by_hand", "nll_loss", "logsigmoid",
           "log1m_sigmoid", "bce_with_logits", "softplus", "log1p", "logsumexp", "xlogy"]


@rewrite("log_softmax", "torch.log(F.softmax(x, dim))", "F.log_softmax(x, dim)")
def log_softmax(node: object) -> Match | None:
    """The logarithm of a softmax, computed from the logits: ``x - max - log(sum(exp(x -
    max)))``. A probability below the format's smallest subnormal rounds to 0 (in fp16, a
    logit 17 below the largest), and ``log`` of it is ``-inf``; the stable form returns the
    finite ``x - logsumexp(x)`` instead, and keeps the digits of the small probabilities'
    logarithms that the rounded probability lost.

    Needs: the softmax's ``dim`` given, no ``dtype=``."""
    s = operand(node, 0) if kind(node) == "log" else None
    xd = softmax_operands(s)
    if xd is None:
        return None
    x, dim = xd
    return Match("log_softmax", node, node, (node, s), Call("F.log_softmax", F.log_softmax, x, dim))


@rewrite("cross_entropy", "-(t * torch.log(F.softmax(z, 1))).sum(1)",
         "F.cross_entropy(z, t, reduction='none')")
def cross_entropy(node: object) -> Match | None:
    """A cross entropy written by hand on probabilities (one-hot or soft targets ``t``), as
    PyTorch's cross entropy with probabilities as targets: ``-(t * log_softmax(z, 1)).sum(1)``
    from the logits. The naive form's ``log`` of an underflowed probability is ``-inf``, and
    ``0 * -inf`` is NaN where the target is 0: one underflowed class spoils the sample's loss.

    The minus sign may stand outside the sum (``-(t * log p).sum(1)``) or on the logarithm
    (``(t * -log p).sum(1)``); with the batch's ``mean()`` inside the minus, the stable form
    takes the mean (``F.cross_entropy(z, t)``).

    Needs: the softmax and the sum over dimension 1 (the classes, as ``F.cross_entropy``
    takes them), the sum without ``keepdim``, ``t`` a floating tensor of the logits' shape."""
    outer = kind(node) == "neg"
    s = operand(node, 0) if outer else node
    mean = None
    if outer and kind(s) == "mean" and dims(s) == (None, False) and len(s.args) == 1:
        mean, s = s, operand(s, 0)  # -(t * log p).sum(1).mean(): the batch's mean loss
    if kind(s) != "sum":
        return None
    dim, keepdim = dims(s)
    m = operand(s, 0)
    if keepdim or one_dim(dim) is None or kind(m) != "mul" or len(m.args) != 2:
        return None
    for t, lg in (m.args, m.args[::-1]):
        inner = kind(lg) == "neg"
        log = operand(lg, 0) if inner else lg
        if outer == inner or kind(log) != "log":
            continue
        xd = softmax_operands(operand(log, 0))
        if xd is None:
            continue
        z, sdim = xd
        zs = shape(z)
        if zs is None or len(zs) < 2 or shape(t) != zs or not floating(t) or \
                one_dim(dim) % len(zs) != 1 or sdim % len(zs) != 1:
            continue
        nodes = tuple(n for n in (node, mean, s, m, lg, log, operand(log, 0)) if n is not None)
        return Match("cross_entropy", node, log, tuple(dict.fromkeys(nodes)),
                     Call("F.cross_entropy", F.cross_entropy, z, t,
                          reduction="mean" if mean is not None else "none"))
    return None


def _log_softmax_classes(node: object) -> tuple | None:
    """``(z, log, softmax)`` where ``node`` is ``log(softmax(z, 1))`` of 2-D logits (the
    classes in dimension 1, as ``F.cross_entropy`` takes them), else None."""
    if kind(node) != "log":
        return None
    s = operand(node, 0)
    xd = softmax_operands(s)
    if xd is None:
        return None
    z, dim = xd
    zs = shape(z)
    if zs is None or len(zs) != 2 or dim % 2 != 1:
        return None
    return z, node, s


@rewrite("nll_by_hand", "-torch.log(F.softmax(z, 1))[torch.arange(n), y]",
         "F.cross_entropy(z, y, reduction='none')")
def nll_by_hand(node: object) -> Match | None:
    """The negative log-likelihood of class labels picked by hand from the log of a
    softmax, as ``F.cross_entropy`` with class indices: the label's probability underflows to
    0 once its logit is 17 below the largest (fp16), and the naive loss is ``inf``.

    The minus may stand outside a ``.mean()`` (``-(...)[range, y].mean()``: the stable form
    takes the mean).

    Needs: 2-D logits with the classes in dimension 1, the rows picked by
    ``torch.arange(n)`` over all ``n`` rows, ``y`` an integer tensor of ``n`` labels."""
    if kind(node) != "neg":
        return None
    g, mean = operand(node, 0), None
    if kind(g) == "mean" and dims(g) == (None, False) and len(g.args) == 1:
        mean, g = g, operand(g, 0)
    if kind(g) != "getitem" or not isinstance(g.args[1], tuple) or len(g.args[1]) != 2:
        return None
    found = _log_softmax_classes(g.args[0])
    if found is None:
        return None
    z, log, s = found
    rows, y = g.args[1]
    n = shape(z)[0]
    ys = shape(y)
    if kind(rows) != "arange" or len(rows.args) != 1 or rows.args[0] != n or rows.kwargs or \
            ys != (n,) or floating(y):
        return None
    nodes = tuple(x for x in (node, mean, g, rows, log, s) if x is not None)
    return Match("nll_by_hand", node, log, nodes,
                 Call("F.cross_entropy", F.cross_entropy, z, y,
                      reduction="mean" if mean is not None else "none"))


@rewrite("nll_loss", "F.nll_loss(torch.log(F.softmax(z, 1)), y)", "F.cross_entropy(z, y)")
def nll_loss(node: object) -> Match | None:
    """``F.nll_loss`` of the log of a softmax as ``F.cross_entropy`` of the logits (which
    is ``nll_loss(log_softmax(z, 1), y)``): the naive form's ``log`` of an underflowed
    probability is ``-inf``. The loss's other arguments (``weight``, ``ignore_index``,
    ``reduction``...) pass through unchanged.

    Needs: 2-D logits with the classes in dimension 1."""
    if kind(node) != "nll_loss" or not node.args:
        return None
    found = _log_softmax_classes(node.args[0])
    if found is None:
        return None
    z, log, s = found
    return Match("nll_loss", node, log, (node, log, s),
                 Call("F.cross_entropy", F.cross_entropy, z, *node.args[1:], **node.kwargs))


def _sigmoid_operand(node: object) -> object:
    return operand(node, 0, "input") if kind(node) == "sigmoid" else None


@rewrite("logsigmoid", "torch.log(torch.sigmoid(x))", "F.logsigmoid(x)")
def logsigmoid(node: object) -> Match | None:
    """The logarithm of a sigmoid from the logit: ``-softplus(-x)``. ``sigmoid(x)`` of a
    logit below about -17 (fp16) rounds to 0 and ``log`` gives ``-inf``; ``F.logsigmoid`` is
    finite (about ``x``) there.

    Needs: nothing."""
    s = operand(node, 0) if kind(node) == "log" else None
    x = _sigmoid_operand(s)
    if x is None:
        return None
    return Match("logsigmoid", node, node, (node, s), Call("F.logsigmoid", F.logsigmoid, x))


def _one_minus(node: object) -> object:
    """``y`` where ``node`` is ``1 - y``, else None."""
    if kind(node) == "sub" and len(node.args) == 2 and is_const(node.args[0], 1):
        return node.args[1]
    return None


@rewrite("log1m_sigmoid", "torch.log(1 - torch.sigmoid(x))", "F.logsigmoid(-x)")
def log1m_sigmoid(node: object) -> Match | None:
    """The logarithm of ``1 - sigmoid(x)``, which is ``sigmoid(-x)``, from the logit. For a
    logit above about 8 (fp16; 6 in bf16) ``sigmoid(x)`` rounds to 1, ``1 - sigmoid(x)`` is 0
    and ``log`` gives ``-inf``; ``F.logsigmoid(-x)`` is about ``-x`` there.

    Needs: the constant exactly 1."""
    d = operand(node, 0) if kind(node) == "log" else None
    s = _one_minus(d)
    x = _sigmoid_operand(s)
    if x is None:
        return None
    return Match("log1m_sigmoid", node, node, (node, d, s),
                 Call("F.logsigmoid", F.logsigmoid, Call("-", torch.neg, x)))


def _bce_terms(a: object, b: object) -> tuple | None:
    """``(x, y)`` where ``{a, b}`` are ``y * log(sigmoid(x))`` and ``(1 - y) * log(1 -
    sigmoid(x))`` (each product's factors in either order), else None."""
    def factors(m: object) -> list:
        return [m.args, m.args[::-1]] if kind(m) == "mul" and len(m.args) == 2 else []

    for p, q in ((a, b), (b, a)):
        for y, lp in factors(p):
            h = operand(lp, 0) if kind(lp) == "log" else None
            x = _sigmoid_operand(h)
            if x is None:
                continue
            for y1, lq in factors(q):
                h1 = _one_minus(operand(lq, 0)) if kind(lq) == "log" else None
                # the same sigmoid, or one computed again of the same logits
                if _one_minus(y1) is y and (h1 is h or _sigmoid_operand(h1) is x):
                    return x, y, (p, lp, h, q, y1, lq, operand(lq, 0), h1)
    return None


@rewrite("bce_with_logits", "-(y * torch.log(torch.sigmoid(x)) + (1 - y) * "
         "torch.log(1 - torch.sigmoid(x)))",
         "F.binary_cross_entropy_with_logits(x, y, reduction='none')")
def bce_with_logits(node: object) -> Match | None:
    """A binary cross entropy written on probabilities ``h = sigmoid(x)``, computed from the
    logits instead (``max(x, 0) - x * y + log1p(exp(-|x|))``). Either logarithm of the naive
    form is ``-inf`` once ``h`` rounds to 0 or 1 (a logit beyond about ±8 in fp16), and ``0 *
    -inf`` is NaN where the label makes that term vanish.

    The minus may stand outside (``-(A + B)``) or be written ``-A - B``; where the sum's
    ``mean()`` stands inside the minus (``-(A + B).mean()``) the stable form takes the mean.

    Needs: the constant exactly 1, ``y`` a floating tensor of the logits' shape."""
    k = kind(node)
    mean = False
    if k == "neg":
        inner = operand(node, 0)
        if kind(inner) == "mean" and dims(inner) == (None, False) and len(inner.args) == 1:
            mean, inner = inner, operand(inner, 0)
        if kind(inner) != "add" or len(inner.args) != 2:
            return None
        found, extra = _bce_terms(*inner.args), (inner,) + ((mean,) if mean else ())
    elif k == "sub" and len(node.args) == 2 and kind(node.args[0]) == "neg":
        found, extra = _bce_terms(operand(node.args[0], 0), node.args[1]), (node.args[0],)
    else:
        return None
    if found is None:
        return None
    x, y, nodes = found
    if shape(y) != shape(x) or not floating(y):
        return None
    anchor = nodes[5]  # log(1 - h): the first to overflow for a confident positive logit
    nodes = tuple(dict.fromkeys(nodes))
    form = Call("F.binary_cross_entropy_with_logits", F.binary_cross_entropy_with_logits, x, y,
                reduction="mean" if mean else "none")
    return Match("bce_with_logits", node, anchor, (node, *extra, *nodes), form)


def _one_plus(node: object) -> object:
    """``x`` where ``node`` is ``1 + x`` or ``x + 1``, else None."""
    if kind(node) == "add" and len(node.args) == 2 and not node.kwargs:
        a, b = node.args
        if is_const(a, 1) and hasattr(b, "op"):
            return b
        if is_const(b, 1) and hasattr(a, "op"):
            return a
    return None


@rewrite("softplus", "torch.log(1 + torch.exp(x))", "F.softplus(x)")
def softplus(node: object) -> Match | None:
    """``log(1 + exp(x))`` as ``F.softplus(x)`` (``x`` itself beyond a threshold). ``exp(x)``
    overflows for ``x`` above 11 in fp16, and the naive form is ``inf`` where the value is
    about ``x``; for ``x`` below -17 ``exp(x)`` rounds to 0 and the value (about ``exp(x)``)
    is lost.

    Needs: the constant exactly 1."""
    a = operand(node, 0) if kind(node) == "log" else None
    e = _one_plus(a)
    if kind(e) != "exp":
        return None
    return Match("softplus", node, e, (node, a, e), Call("F.softplus", F.softplus, operand(e, 0)))


@rewrite("log1p", "torch.log(1 + x)", "torch.log1p(x)")
def log1p(node: object) -> Match | None:
    """``log(1 + x)`` as ``torch.log1p(x)``: ``1 + x`` rounds ``x`` to the format's spacing
    at 1 (``2^-10`` in fp16, ``2^-7`` in bf16), so for small ``x`` the naive form keeps few or
    none of its digits; ``log1p`` keeps them all.

    Needs: the constant exactly 1, ``x`` a floating tensor."""
    a = operand(node, 0) if kind(node) == "log" else None
    x = _one_plus(a)
    if x is None or not floating(x):
        return None
    return Match("log1p", node, a, (node, a), Call("torch.log1p", torch.log1p, x))


@rewrite("logsumexp", "torch.log(torch.exp(x).sum(dim))", "torch.logsumexp(x, dim)")
def logsumexp(node: object) -> Match | None:
    """``log(sum(exp(x)))`` as ``torch.logsumexp``, which subtracts the maximum before the
    exponential: the naive ``exp`` overflows above 11 (fp16) or underflows to a sum of 0 below
    -17, where the value itself is about the largest ``x``.

    Needs: nothing (a sum over every dimension becomes ``logsumexp`` over all of them)."""
    s = operand(node, 0) if kind(node) == "log" else None
    if kind(s) != "sum":
        return None
    e = operand(s, 0)
    if kind(e) != "exp":
        return None
    dim, keepdim = dims(s)
    x = operand(e, 0)
    if dim is None:
        xs = shape(x)
        if xs is None:
            return None
        dim = tuple(range(len(xs)))
    return Match("logsumexp", node, e, (node, s, e),
                 Call("torch.logsumexp", torch.logsumexp, x, dim, **keep(keepdim)))


@rewrite("xlogy", "y * torch.log(x)", "torch.xlogy(y, x)")
def xlogy(node: object) -> Match | None:
    """``y * log(x)`` as ``torch.xlogy(y, x)``, which is 0 where ``y`` is 0: an entropy
    ``-(p * log(p)).sum()`` or a divergence over probabilities some of which underflow to 0
    (a logit 17 below the largest, fp16) multiplies 0 by ``-inf``, NaN, where the term is 0.

    Needs: ``x`` and ``y`` tensors (``x`` of the product's shape: ``y`` may broadcast)."""
    if kind(node) != "mul" or len(node.args) != 2 or node.kwargs:
        return None
    for y, lg in (node.args, node.args[::-1]):
        if kind(lg) == "log" and hasattr(y, "op") and floating(y):
            x = operand(lg, 0)
            if shape(x) is not None and shape(x) == shape(node):
                return Match("xlogy", node, lg, (node, lg), Call("torch.xlogy", torch.xlogy, y, x))
    return None
