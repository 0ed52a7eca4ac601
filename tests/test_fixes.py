"""The stable rewrites (fxstab/fixes, docs/fixes.md): each one's pattern found in a captured
graph and its stable form equal to the naive formula in fp64, on random and edge inputs; then
:func:`fxstab.suggest_fixes` on small programs with the naive formula in their forward, run
in fp16 or bf16 where it fails: a verified fix at the program's own line."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from fxstab.fixes import REWRITES, apply_match, describe, find_matches

# -------------------------------------------------------------------------------- equivalence
# Each rewrite: the naive formula and its inputs in fp64, each a (label, inputs) pair. "huge"
# and "tiny" are huge and tiny for the low formats (beyond fp16's 65504, below its 6e-8
# subnormal), where fp64 still computes the naive formula.


def _randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape) + int(scale) % 97)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift


def _probs(*shape: int) -> torch.Tensor:
    return F.softmax(_randn(*shape), -1)


def _one_hot(n: int, c: int) -> torch.Tensor:
    return F.one_hot(torch.arange(n) % c, c).to(torch.float64)


def _labels(n: int) -> torch.Tensor:
    return (torch.arange(n) % 2).to(torch.float64)


def _edges(*shape: int, huge: float, tiny: float = 1e-30) -> list:
    """Random, zeros, huge and tiny inputs of ``shape`` (each one tensor)."""
    return [("random", (_randn(*shape),)), ("zeros", (torch.zeros(*shape, dtype=torch.float64),)),
            ("huge", (_beyond(_randn(*shape), huge),)), ("tiny", (_randn(*shape, scale=tiny),))]


def _beyond(r: torch.Tensor, bound: float) -> torch.Tensor:
    """``r``'s signs with magnitudes at least ``bound``."""
    return torch.sign(r) * bound * (1 + r.abs())


CASES = {
    "log_softmax": (lambda x: torch.log(F.softmax(x, 1)), _edges(4, 7, huge=1e3)),
    "cross_entropy": (lambda z, t: -(t * torch.log(F.softmax(z, 1))).sum(1),
                      [("random soft", (_randn(5, 6), _probs(5, 6))),
                       ("zeros", (torch.zeros(5, 6, dtype=torch.float64), _one_hot(5, 6))),
                       ("huge one-hot", (_randn(5, 6, scale=1e3), _one_hot(5, 6))),
                       ("tiny", (_randn(5, 6, scale=1e-30), _probs(5, 6)))]),
    "nll_by_hand": (lambda z, y: -torch.log(F.softmax(z, 1))[torch.arange(5), y],
                    [(label, (z, torch.arange(5) % 3)) for label, (z,) in _edges(5, 6, huge=1e3)]),
    "nll_loss": (lambda z, y: F.nll_loss(torch.log(F.softmax(z, 1)), y, reduction="none"),
                 [(label, (z, torch.arange(5) % 3)) for label, (z,) in _edges(5, 6, huge=1e3)]),
    "logsigmoid": (lambda x: torch.log(torch.sigmoid(x)), _edges(9, huge=1e3)),
    "log1m_sigmoid": (lambda x: torch.log(1 - torch.sigmoid(x)), _edges(9, huge=1e3)),
    "bce_with_logits": (lambda x, y: -(y * torch.log(torch.sigmoid(x))
                                       + (1 - y) * torch.log(1 - torch.sigmoid(x))),
                        [(label, (x, _labels(8))) for label, (x,) in _edges(8, huge=1e3)]),
    "softplus": (lambda x: torch.log(1 + torch.exp(x)), _edges(9, huge=1e3)),
    "log1p": (lambda x: torch.log(1 + x), [("random", (_randn(9).abs(),)),
                                           ("zeros", (torch.zeros(9, dtype=torch.float64),)),
                                           ("huge", (_beyond(_randn(9), 1e30).abs(),)),
                                           ("tiny", (_randn(9, scale=1e-30),))]),
    "logsumexp": (lambda x: torch.log(torch.exp(x).sum(-1)), _edges(4, 7, huge=1e3)),
    "expm1": (lambda x: torch.exp(x) - 1, _edges(9, huge=1e2)),
    "softmax": (lambda x: torch.exp(x) / torch.exp(x).sum(1, keepdim=True),
                _edges(4, 7, huge=1e3)),
    "sigmoid_neg": (lambda x: 1 - torch.sigmoid(x), _edges(9, huge=1e3)),
    "sigmoid_by_hand": (lambda x: torch.exp(x) / (1 + torch.exp(x)), _edges(9, huge=1e2)),
    "tanh_by_hand": (lambda x: (torch.exp(x) - torch.exp(-x)) / (torch.exp(x) + torch.exp(-x)),
                     _edges(9, huge=1e3)),
    "add_sub": (lambda a, c: (a + c) - c,
                [(label, (a, torch.full((9,), 3.0, dtype=torch.float64)))
                 for label, (a,) in _edges(9, huge=1e3)]),
    "xlogy": (lambda y, x: y * torch.log(x),
              [(label, (x, x.abs().flip(-1))) for label, (x,) in _edges(9, huge=1e30)]),
    "hypot": (lambda x, y: torch.sqrt(x * x + y * y),
              [(label, (x, x.flip(-1))) for label, (x,) in _edges(9, huge=1e30)]),
    "cosine_similarity": (lambda a, b: (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)),
                          [(label, (a, a.flip(-1) + 0.5 * a)) for label, (a,)
                           in _edges(4, 7, huge=1e30, tiny=1e-3)]),
    "layer_norm": (lambda x: (x - x.mean(-1, keepdim=True)) / torch.sqrt(
                       ((x - x.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True) + 1e-5),
                   _edges(4, 16, huge=1e4) + [("offset", (_randn(4, 16, shift=300.0),))]),
    "rms_norm": (lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
                 _edges(4, 16, huge=1e30)),
    "attention": (lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) / 4.0, -1) @ v,
                  [(label, (q, q.flip(-1), q.flip(-2))) for label, (q,) in
                   _edges(2, 3, 5, 4, huge=1e2)]),
    "where_masked": (lambda a: torch.where(a <= 0, torch.exp(a), 1 + a), _edges(9, huge=1e3)),
    "variance": (lambda x: (x * x).mean(1) - x.mean(1) ** 2,
                 _edges(4, 16, huge=1e4) + [("offset", (_randn(4, 16, shift=300.0),))]),
    "vector_norm": (lambda x: torch.sqrt((x ** 2).sum(-1)), _edges(4, 7, huge=1e30)),
    "normalize": (lambda x: x / torch.sqrt((x * x).sum(1, keepdim=True)),
                  _edges(4, 7, huge=1e30, tiny=1e-9)),
}


def _rewritten(fn, name: str):
    """``fn`` compiled with every match of the rewrite ``name`` applied; the matches found."""
    found: list = []

    def backend(gm, example_inputs):
        matches = find_matches(gm.graph, [name])
        found.extend(m.code() for m in matches)
        for m in matches[:1]:
            apply_match(gm, m)
        return gm

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, dynamic=False), found


def test_every_rewrite_has_an_equivalence_case():
    """The format-aware rewrites change the value by design: their own test below."""
    assert sorted(CASES) == sorted(n for n, r in REWRITES.items() if not r.format_aware)
    assert [n for n, r in REWRITES.items() if r.format_aware] == ["eps", "clamp_bounds"]


def test_eps_raises_a_guard_the_format_erases_to_its_smallest_normal():
    """In fp16, ``log(x + 1e-8)`` becomes ``log(x + 2^-14)``: in fp64 exactly that formula;
    in bf16 (fp32's range) nothing matches, nor does a guard the format holds, nor an
    addition no guarded function reads."""
    import fxstab

    fp16, bf16 = fxstab.get_format("fp16"), fxstab.get_format("bf16")
    x = torch.cat([torch.zeros(2, dtype=torch.float64), _randn(6).abs(), _randn(3, scale=1e-9).abs()])

    def compiled(fn, fmt):
        found: list = []

        def backend(gm, example_inputs):
            matches = find_matches(gm.graph, ["eps"], fmt)
            found.extend(m.code() for m in matches)
            for m in matches[:1]:
                apply_match(gm, m)
            return gm

        torch._dynamo.reset()
        return torch.compile(fn, backend=backend, dynamic=False), found

    for naive, meant in ((lambda x: torch.log(x + 1e-8), lambda x: torch.log(x + 2.0 ** -14)),
                         (lambda x: 1.0 / (1e-10 + x), lambda x: 1.0 / (2.0 ** -14 + x)),
                         (lambda x: torch.sqrt(x + 1e-12), lambda x: torch.sqrt(x + 2.0 ** -14))):
        fixed, found = compiled(naive, fp16)
        torch.testing.assert_close(fixed(x), meant(x), rtol=0, atol=0)
        assert found and found[0].endswith("+ 6.103515625e-05"), found
        _, found = compiled(naive, bf16)
        _(x)
        assert found == []
    for fn in (lambda x: torch.log(x + 1e-3), lambda x: torch.exp(x + 1e-8)):
        f, found = compiled(fn, fp16)
        f(x)
        assert found == [], found


@pytest.mark.parametrize("name", sorted(CASES))
def test_rewrite_equals_the_naive_formula_in_fp64(name):
    """Where fp64 computes the naive formula finitely, the stable form equals it to rtol 1e-6
    and an absolute 1e-12 (at least; relative to the largest value): what differs at the
    edges is the naive form's own fp64 rounding, of terms of order 1 where ``1 + x`` or
    ``exp(x) - 1`` cancel (``log(1 + 1e-30)`` is 0 in fp64, ``log1p`` 1e-30). Where the
    naive form is NaN/inf, the stable form is finite (the values it stands for all are)."""
    naive, cases = CASES[name]
    fixed, found = _rewritten(naive, name)
    for label, inputs in cases:
        got = fixed(*inputs)
        assert found, f"{name}: the pattern did not match the naive formula"
        want = naive(*inputs)
        ok = torch.isfinite(want)
        assert torch.isfinite(got).all(), f"{name} on {label} inputs: {got}"
        scale = float(want[ok].abs().max()) if ok.any() else 1.0
        torch.testing.assert_close(got[ok], want[ok], rtol=1e-6, atol=1e-12 * max(scale, 1.0),
                                   msg=f"{name} on {label} inputs")


def test_docs_list_every_rewrite():
    """docs/fixes.md has a row per rewrite of the table, with its stable form."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "fixes.md").read_text()
    for name, r in REWRITES.items():
        assert f"| `{name}` |" in text, f"docs/fixes.md has no row for {name}"
        assert f"`{r.stable.split('(')[0]}" in text, (name, r.stable)


def test_the_attention_rewrite_keeps_a_mask_and_the_scale():
    """A causal ``masked_fill(mask, -inf)`` becomes ``attn_mask=~mask``, a ``* c`` scale
    ``scale=c``: equal in fp64, masked before or after the scale."""
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    q, k, v = _randn(2, 5, 4), _randn(2, 5, 4, scale=3.0), _randn(2, 5, 4, scale=2.0)
    for naive in (lambda q, k, v, m: torch.softmax(
                      (q @ k.transpose(-1, -2) * 0.5).masked_fill(m, float("-inf")), -1) @ v,
                  lambda q, k, v, m: torch.softmax(
                      0.5 * (q @ k.transpose(-2, -1)).masked_fill(m, float("-inf")), -1) @ v):
        fixed, found = _rewritten(naive, "attention")
        got = fixed(q, k, v, mask)
        assert found == ["F.scaled_dot_product_attention(q, k, v, attn_mask=~m, scale=0.5)"]
        torch.testing.assert_close(got, naive(q, k, v, mask), rtol=1e-12, atol=1e-12)


def test_where_masked_keeps_the_gradient_finite():
    """The gradient too equals the naive form's wherever that is finite (fp64), and is
    finite where the naive one is NaN (exp(1000) on the branch not taken)."""
    naive = lambda a: torch.where(a <= 0, torch.exp(a), 1 + a)  # noqa: E731
    fixed, found = _rewritten(naive, "where_masked")
    a = torch.tensor([-3.0, -1e-3, 0.0, 2.0, 1e3], dtype=torch.float64, requires_grad=True)
    g_naive, = torch.autograd.grad(naive(a).sum(), a)
    g_fixed, = torch.autograd.grad(fixed(a).sum(), a)
    assert found == ["torch.where(a <= 0, torch.exp(torch.where(a <= 0, a, 0.0)), 1 + a)"]
    assert torch.isnan(g_naive[-1]) and torch.isfinite(g_fixed).all()
    ok = torch.isfinite(g_naive)
    torch.testing.assert_close(g_fixed[ok], g_naive[ok], rtol=0, atol=0)


def test_clamp_bounds_raises_the_bounds_the_format_erases():
    """fp16 erases both bounds of ``clamp(1e-8, 1 - 1e-4)``, bf16 the upper one (``1 - 2^-8``
    is its largest number below 1), fp32 neither; the rewritten formula is exactly the naive
    one with the format's bounds (fp64)."""
    import fxstab

    x = torch.linspace(-0.5, 1.5, 11, dtype=torch.float64)

    def found_in(fn, fmt):
        found: list = []

        def backend(gm, example_inputs):
            matches = find_matches(gm.graph, ["clamp_bounds"], fxstab.get_format(fmt))
            found.extend(m.code() for m in matches)
            for m in matches[:1]:
                apply_match(gm, m)
            return gm

        torch._dynamo.reset()
        return torch.compile(fn, backend=backend, dynamic=False)(x), found

    naive = lambda p: torch.log(1 - p.clamp(1e-8, 1 - 1e-4))  # noqa: E731
    got, found = found_in(naive, "fp16")
    assert found == ["torch.clamp(p, min=6.103515625e-05, max=0.99951171875)"]
    torch.testing.assert_close(got, torch.log(1 - x.clamp(2.0 ** -14, 1 - 2.0 ** -11)),
                               rtol=0, atol=0)
    assert found_in(naive, "bf16")[1] == ["torch.clamp(p, min=1e-08, max=0.99609375)"]
    assert found_in(naive, "fp32")[1] == []
    assert found_in(lambda p: torch.log(p.clamp_min(1e-8)), "fp16")[1] == \
        ["torch.clamp(p, min=6.103515625e-05)"]
    assert found_in(lambda p: torch.log(torch.clamp(p, min=1e-3)), "fp16")[1] == []


def test_a_pattern_matches_only_where_its_precondition_holds():
    """A softmax over dim 0 summed over dim 1 is no cross entropy; ``log(2 + x)`` no log1p;
    ``exp(x) / exp(y).sum()`` no softmax; means over different dims no variance."""
    cases = [
        (lambda z, t: -(t * torch.log(F.softmax(z, 0))).sum(1), (_randn(3, 4), _probs(3, 4)),
         "cross_entropy"),
        (lambda x: torch.log(2 + x), (_randn(5).abs(),), "log1p"),
        (lambda x, y: torch.exp(x) / torch.exp(y).sum(1, keepdim=True),
         (_randn(3, 4), _randn(3, 4)), "softmax"),
        (lambda x: (x * x).mean(0) - x.mean(1) ** 2, (_randn(4, 4),), "variance"),
        (lambda x: x / torch.sqrt((x * x).sum(1)), (_randn(4, 4),), "normalize"),
        (lambda a, b: (a * b).sum(0) / (a.norm(dim=1) * b.norm(dim=1)),
         (_randn(4, 4), _randn(4, 4)), "cosine_similarity"),
        (lambda a, b: (a * b).sum(1) / (a.norm(dim=1) * a.norm(dim=1)),
         (_randn(4, 4), _randn(4, 4)), "cosine_similarity"),
        (lambda q, k, v: torch.softmax(q @ k.transpose(-3, -1), -1) @ v,
         (_randn(2, 3, 4), _randn(3, 4, 2), _randn(2, 3, 4)), "attention"),
        (lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), 1) @ v,
         (_randn(2, 3, 4), _randn(2, 3, 4), _randn(2, 3, 4)), "attention"),  # not the last dim
        (lambda x: (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5),
         (_randn(4, 8),), "layer_norm"),  # the unbiased variance
        (lambda x: x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6), (_randn(4, 8),),
         "rms_norm"),  # not the last dimension
        (lambda a, c, d: (a + c) - d, (_randn(4), _randn(4), _randn(4)), "add_sub"),
        (lambda a, c: (a + c) - c, (_randn(4), _randn(3, 4)), "add_sub"),  # c broadcasts
        (lambda z, y: -torch.log(F.softmax(z, 1))[torch.arange(3), y],
         (_randn(5, 4), torch.arange(3)), "nll_by_hand"),  # not every row
    ]
    for fn, inputs, name in cases:
        compiled, found = _rewritten(fn, name)
        compiled(*inputs)
        assert not found, (name, found)


def test_the_replacement_reads_as_code():
    """The stable form is printed with the program's names: its inputs without dynamo's
    ``l_..._``, its intermediates by the variable they were assigned to."""
    def f(logits):
        p = F.softmax(logits, 1)
        return torch.log(p)

    compiled, found = _rewritten(f, "log_softmax")
    compiled(_randn(2, 3))
    assert found == ["F.log_softmax(logits, 1)"]
    compiled, found = _rewritten(lambda h, y: torch.log(1 - torch.sigmoid(h * 20 + y)),
                                 "log1m_sigmoid")
    compiled(_randn(3), _randn(3))
    assert found == ["F.logsigmoid(-(h * 20 + y))"]  # an unnamed operation by its expression
    compiled, found = _rewritten(lambda t, z: t * torch.log(F.softmax(z, 1)), "xlogy")
    compiled(_probs(2, 3), _randn(2, 3))
    assert found == ["torch.xlogy(t, F.softmax(z, 1))"]  # an unnamed call, as written
    compiled, found = _rewritten(lambda x: torch.log(1 + x.sum(-1)), "log1p")
    compiled(_randn(2, 3).abs())
    assert found == ["torch.log1p(x.sum(-1))"]
    assert "log_softmax" in describe("log_softmax") and "needs:" in describe("log_softmax")
    assert all(r.summary and r.doc for r in REWRITES.values())


# -------------------------------------------------------------------------------- bug programs
# Small programs with a naive formula in their forward (the line marked "# naive"), each with
# inputs in the regime where it fails in its format; suggest_fixes must verify the rewrite
# named at that line.
class SoftmaxCrossEntropy(torch.nn.Module):
    """A classifier's loss written by hand on probabilities (one-hot targets)."""

    def forward(self, z, t):
        p = F.softmax(z, 1)
        return -(t * torch.log(p)).sum(1).mean()  # naive


class LogProbabilities(torch.nn.Module):
    """Log-probabilities of a linear head, as the log of its softmax."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 6)

    def forward(self, x):
        return torch.log(F.softmax(self.head(x), -1))  # naive


class ProbabilityBCE(torch.nn.Module):
    """Logistic regression's loss on the sigmoid's probabilities."""

    def forward(self, x, y):
        h = torch.sigmoid(x)
        return -(y * torch.log(h) + (1 - y) * torch.log(1 - h))  # naive


class LogSigmoid(torch.nn.Module):
    def forward(self, x):
        return torch.log(torch.sigmoid(x)) * 2  # naive


class LogOneMinusSigmoid(torch.nn.Module):
    def forward(self, x):
        return torch.log(1 - torch.sigmoid(x)) + 1  # naive


class SmallGrowth(torch.nn.Module):
    """Log returns of small growth rates."""

    def forward(self, r):
        return torch.log(1 + r) * 100  # naive


class ExpMinusOne(torch.nn.Module):
    def forward(self, x):
        return (torch.exp(x) - 1) * 1000  # naive


class Softplus(torch.nn.Module):
    def forward(self, x):
        return torch.log(1 + torch.exp(x)) - x  # naive


class LogPartition(torch.nn.Module):
    """The log partition function of energies."""

    def forward(self, e):
        return torch.log(torch.exp(e).sum(-1))  # naive


class HandSoftmax(torch.nn.Module):
    """Attention weights normalised by hand."""

    def forward(self, s):
        w = torch.exp(s)
        return w / w.sum(-1, keepdim=True)  # naive


class OneMinusSigmoid(torch.nn.Module):
    def forward(self, x):
        return (1 - torch.sigmoid(x)) * 1000  # naive


class PopulationVariance(torch.nn.Module):
    def forward(self, x):
        return (x * x).mean(-1) - x.mean(-1) ** 2  # naive


class EuclideanNorm(torch.nn.Module):
    def forward(self, x):
        return torch.sqrt((x ** 2).sum(-1))  # naive


class UnitVectors(torch.nn.Module):
    def forward(self, x):
        return x / torch.sqrt((x * x).sum(1, keepdim=True))  # naive


class PickedLogLikelihood(torch.nn.Module):
    """The negative log-likelihood of the labels, picked by hand."""

    def forward(self, z, y):
        return -torch.log(F.softmax(z, 1))[torch.arange(z.shape[0]), y].mean()  # naive


class NllOfLogSoftmax(torch.nn.Module):
    def forward(self, z, y):
        return F.nll_loss(torch.log(F.softmax(z, 1)), y)  # naive


class SigmoidByHand(torch.nn.Module):
    def forward(self, x):
        return torch.exp(x) / (1 + torch.exp(x))  # naive


class TanhByHand(torch.nn.Module):
    def forward(self, x):
        return (torch.exp(x) - torch.exp(-x)) / (torch.exp(x) + torch.exp(-x))  # naive


class Entropy(torch.nn.Module):
    """The entropy of a confident classifier's distribution."""

    def forward(self, z):
        p = F.softmax(z, -1)
        return -(p * torch.log(p)).sum(-1)  # naive


class Distance(torch.nn.Module):
    def forward(self, x, y):
        return torch.sqrt(x * x + y * y)  # naive


class CosineByHand(torch.nn.Module):
    def forward(self, a, b):
        return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))  # naive


class UnscaledAttention(torch.nn.Module):
    """Causal attention written by hand, the 1/sqrt(d) forgotten."""

    def forward(self, q, k, v, mask):
        s = (q @ k.transpose(-2, -1)).masked_fill(mask, float("-inf"))
        return torch.softmax(s, -1) @ v  # naive


class HandLayerNorm(torch.nn.Module):
    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)  # naive


class HandRMSNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(64))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # naive


class GuardedLog(torch.nn.Module):
    """A log-likelihood guarded by an eps fp16 cannot hold."""

    def forward(self, z):
        p = F.softmax(z, -1)
        return torch.log(p + 1e-8)  # naive


class ClampedProbability(torch.nn.Module):
    """The complement's log, guarded by a clamp whose upper bound fp16 rounds to 1."""

    def forward(self, x):
        p = torch.sigmoid(x)
        return torch.log(1 - p.clamp(1e-6, 1 - 1e-4))  # naive


class ShiftedBack(torch.nn.Module):
    """A value shifted by a large offset and back."""

    def forward(self, a):
        return (a + 1000.0) - 1000.0  # naive


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bug_inputs(name: str) -> tuple:
    g = _gen(len(name))
    if name == "SoftmaxCrossEntropy":
        return (torch.randn(8, 10, generator=g) * 30,
                F.one_hot(torch.arange(8) % 10, 10).float())
    if name == "LogProbabilities":
        return (torch.randn(4, 8, generator=g) * 40,)
    if name == "ProbabilityBCE":
        return (torch.randn(16, generator=g) * 20, (torch.arange(16) % 2).float())
    if name in ("LogSigmoid", "Softplus"):
        return (torch.randn(16, generator=g) * 20,)
    if name in ("LogOneMinusSigmoid", "OneMinusSigmoid"):
        return (torch.rand(16, generator=g) * 10 + 8,)
    if name in ("SmallGrowth", "ExpMinusOne"):
        return (torch.rand(16, generator=g) * 1e-3,)
    if name == "LogPartition":
        return (torch.randn(4, 8, generator=g) * 4 + 12,)
    if name == "HandSoftmax":
        return (torch.randn(4, 8, generator=g) * 3 + 12,)
    if name in ("PickedLogLikelihood", "NllOfLogSoftmax"):
        return (torch.randn(8, 10, generator=g) * 30, torch.arange(8) % 10)
    if name in ("SigmoidByHand", "TanhByHand"):
        return (torch.randn(16, generator=g) * 15,)
    if name == "Entropy":
        return (torch.randn(4, 10, generator=g) * 30,)
    if name in ("Distance", "CosineByHand"):
        return (torch.randn(4, 16, generator=g) * 300, torch.randn(4, 16, generator=g) * 300)
    if name == "UnscaledAttention":
        q, k, v = (torch.randn(2, 2, 8, 16, generator=g) * s for s in (100, 100, 1))
        return q, k, v, torch.ones(8, 8, dtype=torch.bool).triu(1)
    if name in ("HandLayerNorm", "HandRMSNorm"):
        return (torch.randn(4, 64, generator=g) * 300 + 1000,)
    if name == "GuardedLog":
        return (torch.randn(4, 10, generator=g) * 30,)
    if name == "ClampedProbability":
        return (torch.randn(16, generator=g) * 20,)
    if name == "ShiftedBack":
        return (torch.rand(16, generator=g) * 1e-2,)
    if name == "PopulationVariance":
        return (torch.randn(4, 32, generator=g) + 300,)
    if name in ("EuclideanNorm", "UnitVectors"):
        return (torch.randn(4, 16, generator=g) * 300,)
    raise KeyError(name)


BUGS = {  # program -> (its format, the rewrite that fixes it)
    SoftmaxCrossEntropy: ("fp16", "cross_entropy"),
    LogProbabilities: ("fp16", "log_softmax"),
    ProbabilityBCE: ("fp16", "bce_with_logits"),
    LogSigmoid: ("fp16", "logsigmoid"),
    LogOneMinusSigmoid: ("bf16", "log1m_sigmoid"),
    SmallGrowth: ("fp16", "log1p"),
    ExpMinusOne: ("bf16", "expm1"),
    Softplus: ("fp16", "softplus"),
    LogPartition: ("fp16", "logsumexp"),
    HandSoftmax: ("fp16", "softmax"),
    OneMinusSigmoid: ("fp16", "sigmoid_neg"),
    PopulationVariance: ("bf16", "variance"),
    EuclideanNorm: ("fp16", "vector_norm"),
    UnitVectors: ("fp16", "normalize"),
    PickedLogLikelihood: ("fp16", "nll_by_hand"),
    NllOfLogSoftmax: ("fp16", "nll_loss"),
    SigmoidByHand: ("fp16", "sigmoid_by_hand"),
    TanhByHand: ("fp16", "tanh_by_hand"),
    ShiftedBack: ("fp16", "add_sub"),
    Entropy: ("fp16", "xlogy"),
    Distance: ("fp16", "hypot"),
    CosineByHand: ("fp16", "cosine_similarity"),
    UnscaledAttention: ("fp16", "attention"),
    HandLayerNorm: ("fp16", "layer_norm"),
    HandRMSNorm: ("fp16", "rms_norm"),
    GuardedLog: ("fp16", "eps"),
    ClampedProbability: ("fp16", "clamp_bounds"),
}


class BranchGradient(torch.nn.Module):
    """A piecewise activation whose exp branch overflows where it is not selected."""

    def forward(self, a):
        return torch.where(a <= 0, torch.exp(a), 1 + a)  # naive


class ZeroNormGradient(torch.nn.Module):
    """A norm taken of rows some of which are 0 (padding): its gradient there."""

    def forward(self, x):
        return torch.sqrt((x * x).sum(-1))  # naive


BACKWARD_BUGS = {  # programs whose real run fails in the backward alone (backward=True)
    BranchGradient: ("fp16", "where_masked",
                     (torch.linspace(-4, 20, 16),)),
    ZeroNormGradient: ("bf16", "vector_norm",
                       (torch.cat([torch.randn(3, 8, generator=_gen(1)), torch.zeros(1, 8)]),)),
}


@pytest.mark.parametrize("cls", list(BACKWARD_BUGS), ids=lambda c: c.__name__)
def test_a_backward_bug_gets_a_verified_fix_with_backward(cls):
    from fxstab import suggest_fixes

    fmt, rewrite_name, inputs = BACKWARD_BUGS[cls]
    fixes = suggest_fixes(cls(), inputs, format=fmt, backward=True)
    fix = next((f for f in fixes if f.rewrite == rewrite_name), None)
    assert fix is not None and fix.verified, fixes
    assert fix.source == _naive_line(cls) and fix.nonfinite_before > 0 == fix.nonfinite_after
    # the forward alone is fine: without backward=True nothing is verified for it
    forward = [f for f in suggest_fixes(cls(), inputs, format=fmt) if f.rewrite == rewrite_name]
    assert not any(f.verified for f in forward), forward


def test_every_rewrite_fixes_a_bug_program():
    fixed = [r for _, r in BUGS.values()] + [r for _, r, _ in BACKWARD_BUGS.values()]
    assert set(fixed) == set(REWRITES)


def _naive_line(cls) -> str:
    """``file:LINE`` of the line marked ``# naive`` in ``cls.forward``."""
    import inspect

    lines, first = inspect.getsourcelines(cls.forward)
    at = next(i for i, text in enumerate(lines) if text.rstrip().endswith("# naive"))
    return f"{inspect.getsourcefile(cls)}:{first + at}"


@pytest.mark.parametrize("cls", list(BUGS), ids=lambda c: c.__name__)
def test_a_bug_program_gets_a_verified_fix_at_its_line(cls):
    from fxstab import Fix, suggest_fixes

    fmt, rewrite_name = BUGS[cls]
    torch.manual_seed(0)
    model = cls().eval()
    fixes = suggest_fixes(model, _bug_inputs(cls.__name__), format=fmt)
    assert fixes and all(isinstance(f, Fix) for f in fixes)
    fix = next((f for f in fixes if f.rewrite == rewrite_name), None)
    assert fix is not None, (rewrite_name, fixes)
    assert fix.verified, fix
    assert fix.source == _naive_line(cls), fix
    assert fix.code.endswith("# naive") and fix.replacement
    # what verified it: the real run in the format, against fp64
    assert fix.nonfinite_after < fix.nonfinite_before or \
        fix.real_after >= fix.real_before + 0.2, fix
    assert fix.nonfinite_after == 0 and not math.isnan(fix.after), fix
    assert fixes[0].verified  # the verified ones first
    assert fix.source in repr(fix) and fix.replacement in repr(fix)


def test_a_healthy_program_has_nothing_to_fix():
    """The stable forms themselves: no rewrite matches, nothing is proposed."""
    from fxstab import suggest_fixes

    class Stable(torch.nn.Module):
        def forward(self, z, t):
            return F.cross_entropy(z, t) + F.logsigmoid(z).mean()

    fixes = suggest_fixes(Stable(), (torch.randn(8, 10) * 30, torch.arange(8)), format="fp16")
    assert fixes == []


def test_a_rewrite_that_fails_to_run_is_skipped_with_a_warning(monkeypatch):
    """A stable form the program refuses (here: made to raise) costs that candidate alone."""
    from fxstab import suggest_fixes
    from fxstab.fixes import verify

    real = verify._real

    def failing(model, inputs, fmt, sites, *rest):
        if any(site.rewrite == "log_softmax" for site in sites):
            raise RuntimeError("refused")
        return real(model, inputs, fmt, sites, *rest)

    monkeypatch.setattr(verify, "_real", failing)
    with pytest.warns(UserWarning, match="log_softmax .* failed to run .* refused"):
        fixes = suggest_fixes(SoftmaxCrossEntropy(), _bug_inputs("SoftmaxCrossEntropy"),
                              format="fp16")
    assert "log_softmax" not in [f.rewrite for f in fixes]
    assert fixes[0].rewrite == "cross_entropy" and fixes[0].verified, fixes


class TwoNaiveHeads(torch.nn.Module):
    """The same naive formula twice: either one alone keeps the sum's output -inf."""

    def forward(self, z, w):
        a = torch.log(F.softmax(z, -1))
        b = torch.log(F.softmax(w, -1))
        return a + b


def test_one_rewrite_at_several_places_is_verified_together():
    from fxstab import suggest_fixes

    g = _gen(3)
    z, w = torch.randn(4, 10, generator=g) * 30, torch.randn(4, 10, generator=g) * 30
    fixes = [f for f in suggest_fixes(TwoNaiveHeads(), (z, w), format="fp16")
             if f.rewrite == "log_softmax"]
    lines = sorted(int(f.source.rpartition(":")[2]) for f in fixes)
    assert len(fixes) == 2 and all(f.verified and f.nonfinite_after == 0 for f in fixes), fixes
    assert lines[1] == lines[0] + 1 and fixes[0].replacement != fixes[1].replacement


def test_suggest_fixes_says_what_was_wrong_with_its_arguments():
    from fxstab import suggest_fixes

    with pytest.raises(ValueError, match="not a dtype torch computes in"):
        suggest_fixes(LogSigmoid(), (torch.randn(4),), format="fp8_e4m3")
    with pytest.raises(ValueError, match="positional inputs"):
        suggest_fixes(LogSigmoid(), {"x": torch.randn(4)}, format="fp16")
    with pytest.raises(ValueError, match="granularity"):
        suggest_fixes(LogSigmoid(), (torch.randn(4),), format="fp16", granularity="aten")


# -------------------------------------------------------------------------------- fxstab fix
_TARGET = '''
import torch
import torch.nn.functional as F


class Loss(torch.nn.Module):
    def forward(self, z, t):
        return -(t * torch.log(F.softmax(z, 1))).sum(1)


class Scaled(torch.nn.Module):
    def forward(self, a):
        return (a * 1000.0) * 1000.0 / 1e6


def fixable():
    return Loss(), (torch.randn(6, 10) * 30, F.one_hot(torch.arange(6), 10).float())


def unfixable():
    return Scaled(), (torch.rand(8) + 1,)
'''


def test_fix_command_prints_a_verified_fix_at_the_line(tmp_path, capsys):
    from fxstab.cli import main

    path = tmp_path / "bugs.py"
    path.write_text(_TARGET)
    assert main(["fix", f"{path}:fixable", "--format", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "(verified)" in out and "+ F.log_softmax(z, 1)" in out, out
    assert "- return -(t * torch.log(F.softmax(z, 1))).sum(1)" in out, out
    assert f"{path}:8  log#0: log_softmax (verified)" in out, out  # outside the cwd: absolute
    assert "every finding has a verified fix" in out


def test_fix_command_writes_the_page_and_the_map_with_the_fixes(tmp_path, capsys):
    """--html: the map's page with a Fixes section (the line, its code, the stable form,
    verified, the runs' figures; the covered finding linked to its operator); --save: the map,
    whose fixes() are those printed. The exit code is the one without them."""
    from html.parser import HTMLParser

    from fxstab.cli import main
    from fxstab.digitmap import DigitMap

    path = tmp_path / "bugs.py"
    path.write_text(_TARGET)
    page, saved = tmp_path / "out" / "fix.html", tmp_path / "fix.json"
    assert main(["fix", f"{path}:fixable", "--format", "fp16", "--html", str(page),
                 "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {page}" in out and f"wrote {saved}" in out
    dm = DigitMap.load(saved)
    fixes = dm.fixes()
    assert fixes and fixes[0].rewrite == "log_softmax" and fixes[0].verified, fixes
    assert fixes[0].source == f"{path}:8" and "log#0" in fixes[0].findings
    assert dm.metadata["target"] == f"{path}:fixable"

    class Section(HTMLParser):  # the text of the Fixes section, and its operator links
        def __init__(self):
            super().__init__()
            self.depth, self.text, self.links = 0, [], []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "section":
                self.depth += 1 if (self.depth or a.get("id") == "fixes-section") else 0
            if self.depth and tag == "a" and "data-op" in a:
                self.links.append(int(a["data-op"]))

        def handle_endtag(self, tag):
            if tag == "section" and self.depth:
                self.depth -= 1

        def handle_data(self, data):
            if self.depth:
                self.text.append(data)

    text = page.read_text()
    parser = Section()
    parser.feed(text)
    section = "".join(parser.text)
    assert section.startswith("Fixes"), section
    assert "bugs.py:8" in section and "log_softmax" in section and "verified" in section
    assert "- return -(t * torch.log(F.softmax(z, 1))).sum(1)" in section, section
    assert "+ F.log_softmax(z, 1)" in section, section
    assert "NaN/inf 6/6 -> 0" in section and "(real fp16 run against fp64)" in section
    assert list(dm.operators).index("log#0") in parser.links  # the covered finding, linked
    assert len(re.findall(r'<div class="fix( verified)?" ', text)) == len(fixes)


def test_fix_command_exits_1_on_a_finding_without_a_fix(tmp_path, capsys):
    from fxstab.cli import main

    path = tmp_path / "bugs.py"
    path.write_text(_TARGET)
    assert main(["fix", f"{path}:unfixable", "--format", "fp16"]) == 1
    out = capsys.readouterr().out
    assert "without a verified fix: mul#1" in out, out  # (a * 1000) * 1000 overflows


def test_fix_command_has_its_help(capsys):
    from fxstab.cli import main

    with pytest.raises(SystemExit) as e:
        main(["fix", "--help"])
    assert e.value.code == 0 and "usage: fxstab fix" in capsys.readouterr().out


def test_fix_command_exits_2_on_bad_input(tmp_path, capsys):
    from fxstab.cli import main

    assert main(["fix", f"{tmp_path / 'missing.py'}:build"]) == 2
    assert "fxstab fix: error" in capsys.readouterr().err
    assert main(["fix", f"{tmp_path / 'missing.py'}:build", "--html", "page.png"]) == 2
    assert "--html: the page's file must end in .html" in capsys.readouterr().err
    path = tmp_path / "bugs.py"  # a map that cannot be written (its folder is a file)
    path.write_text(_TARGET)
    assert main(["fix", f"{path}:fixable", "--format", "fp16", "--save",
                 str(path / "map.json")]) == 2
    assert f"cannot write {str(path / 'map.json')!r}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse: a format torch does not compute in
        main(["fix", f"{tmp_path / 'missing.py'}:build", "--format", "fp8_e4m3"])
    assert e.value.code == 2


# -------------------------------------------------------------------------------- the graph
def test_a_rewrite_replaces_the_formula_in_the_graph():
    """The stable form's node takes the root's place, with the root's line and an example
    value; the naive formula's nodes no other node reads are gone; the site's backend applies
    that site alone."""
    from fxstab.fixes import RewriteBackend, Site

    def f(z, w):
        a = torch.log(F.softmax(z, 1))  # rewritten
        return a + torch.log(F.softmax(w, 1))  # left alone

    seen = {}

    def inspect_graph(gm, example_inputs):
        seen["graph"] = gm.graph
        return gm

    torch._dynamo.reset()
    probe = RewriteBackend()
    torch.compile(f, backend=probe)(_randn(2, 3), _randn(2, 3))
    matches = [m for m in probe.matches[0] if m.rewrite == "log_softmax"]
    assert [m.code() for m in matches] == ["F.log_softmax(z, 1)", "F.log_softmax(w, 1)"]
    torch._dynamo.reset()
    rb = RewriteBackend([Site(0, "log_softmax", matches[0].root.name)], inner=inspect_graph)
    z, w = _randn(2, 3), _randn(2, 3, scale=2.0)
    out = torch.compile(f, backend=rb)(z, w)
    assert rb.applied == [Site(0, "log_softmax", matches[0].root.name)]
    calls = [n for n in seen["graph"].nodes if n.op == "call_function"]
    targets = [n.target for n in calls]
    assert targets.count(F.log_softmax) == 1 and targets.count(F.softmax) == 1
    assert targets.count(torch.log) == 1
    new = next(n for n in calls if n.target is F.log_softmax)
    assert "# rewritten" in new.meta["stack_trace"]  # the root's line: the operator's source
    assert tuple(new.meta["example_value"].shape) == (2, 3)
    torch.testing.assert_close(out, F.log_softmax(z, 1) + torch.log(F.softmax(w, 1)),
                               rtol=0, atol=0)


def test_suggest_fixes_leaves_the_model_and_its_map_as_they_were():
    """The model's parameters and output are untouched, and the first analysis (under the
    rewriting backend, no site) gives the map a plain fxstab backend gives."""
    import fxstab
    from fxstab.fixes import verify

    torch.manual_seed(0)
    model = LogProbabilities().eval()
    x, = _bug_inputs("LogProbabilities")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    y = model(x)
    base = verify._analyse(model, (x,), fxstab.get_format("fp16"), {}, ())
    torch._dynamo.reset()
    be = fxstab.backend(format="fp16")
    with torch.no_grad():
        torch.compile(model, backend=be)(x)
    assert base.dm.as_dict()["operators"] == be.digit_map().as_dict()["operators"]
    fxstab.suggest_fixes(model, (x,), format="fp16")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert torch.equal(model(x), y)


class _ExpBlock(torch.nn.Module):
    def forward(self, x):
        scores = x * 30.0
        e = torch.exp(scores)
        return e / e.sum(-1, keepdim=True)


def test_a_variable_assigned_again_is_spelled_as_the_program_names_it(fresh_dynamo):
    """dynamo numbers the second block's ``scores`` ``scores_1``: the fix spells ``scores``, the
    name the line that assigned it uses."""
    model = torch.nn.Sequential(_ExpBlock(), _ExpBlock())
    x = torch.linspace(-1, 1, 64).reshape(4, 16)
    from fxstab import suggest_fixes

    fixes = suggest_fixes(model, (x,), format="fp16")
    assert fixes and all(f.verified for f in fixes)
    assert {f.replacement for f in fixes} == {"F.softmax(scores, -1)"}, fixes
