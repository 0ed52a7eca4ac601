"""Issue 17 at the arithmetic level (granularity="aten"): every operator analysed, with no
crash and the deterministic path bit-identical (fxstab/analysis/aten_level.py, fxstab/rules/aten/)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxstab
from models import ExpandUp, SpectralFilter, T5RelativeBias

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def analyse(model, *inputs, grad=False, dynamic=None, **options):
    be = fxstab.backend(granularity="aten", **options)
    with torch.set_grad_enabled(grad):
        out = torch.compile(model, backend=be, dynamic=dynamic)(*inputs)
    return be, out


def no_failures(be):
    assert not any(info.failures for info in be.infos), [i.failures for i in be.infos]


def by_name(be):
    return {r.name: r for r in be.reports}


def operators(be):
    """Operator names (the part before /aten.) of the recorded primitives."""
    return {r.name.split("/aten.", 1)[0] for r in be.reports}


# --------------------------------------------------------------------------- rules
def test_expand_to_a_higher_rank():
    torch.manual_seed(0)
    m = ExpandUp()
    x = torch.randn(3, 4)
    be, y = analyse(m, x, output="mean", format="fp32")
    no_failures(be)
    torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)  # the mean of fp32 samples
    sums = [r for r in be.reports if r.name.startswith("sum#0/")]
    assert sums and sums[0].shape == (3, 4)


def test_positional_embedding_expanded_to_the_batch():
    class Pos(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.pos = nn.Parameter(torch.randn(5, 4))

        def forward(self, x):
            h = self.fc(x)
            return h + (self.pos * 2).expand(x.shape[0], -1, -1) + h[0].expand(3, -1, -1)

    torch.manual_seed(0)
    m = Pos()
    x = torch.randn(3, 5, 4)
    be, y = analyse(m, x)
    no_failures(be)
    assert torch.equal(y, m(x))
    add = [r for r in be.reports if r.name.startswith("add#1/")]
    assert add and add[0].shape == (3, 5, 4) and add[0].status == "rounded"


def test_reductions_softmax_and_cumsum_over_dim_0_of_a_0d_value():
    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            s = self.fc(x).sum()  # 0-d
            return (s.sum(0) + s.mean(dim=0) + s.amax(0) + torch.softmax(s, 0)
                    + torch.log_softmax(s, -1) + s.cumsum(0) + torch.logsumexp(s, 0))

    torch.manual_seed(0)
    m = Scalar()
    x = torch.randn(2, 4)
    be, y = analyse(m, x, output="mean", format="fp32")
    no_failures(be)
    # the mean of 3 samples rounded into fp32 against the fp32 eager result: a few fp32 ulps
    torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)
    kinds = {r.name.split("/aten.")[0].split("#")[0] for r in be.reports}
    assert {"softmax", "log_softmax", "cumsum", "logsumexp"} <= kinds
    torch._dynamo.reset()
    be, y = analyse(m, x)
    assert torch.equal(y, m(x))


def test_batch_norm_with_update_is_decomposed_and_rounded():
    torch.manual_seed(0)
    w, b = torch.rand(4) + 0.5, torch.randn(4)

    def f(x, mean, var):
        out = torch.ops.aten._batch_norm_with_update(x, w, b, mean, var, 0.1, 1e-5)
        return out[0]

    x = torch.randn(8, 4, 3)
    mean, var = torch.zeros(4), torch.ones(4)
    m_ref, v_ref = mean.clone(), var.clone()
    want = f(x, m_ref, v_ref)
    be, y = analyse(f, x, mean, var)
    no_failures(be)
    assert torch.equal(y, want) and torch.equal(mean, m_ref) and torch.equal(var, v_ref)
    prims = [r for r in be.reports if "batch_norm_with_update" in r.name]
    kinds = {r.kind for r in prims}
    assert {"rsqrt", "sub", "mul"} <= kinds, kinds  # its arithmetic, not one opaque primitive
    assert all(r.status == "rounded" for r in prims)
    assert be.coverage().fraction == 1.0


def test_round_to_decimals_is_arithmetic():
    """round(x, 2) is round(x * 100) / 100, not a value of the format: rounded (and no
    intrinsic instability: its samples differ by the rounding); round(x) stays exact (an
    integer of the format)."""
    torch.manual_seed(0)
    x = torch.randn(64) * 10

    be, y = analyse(lambda t: torch.round(t * 1.0, decimals=2), x, diagnostics="summary")
    no_failures(be)
    assert torch.equal(y, torch.round(x * 1.0, decimals=2))
    r = [r for r in be.reports if "/aten.round#" in r.name][0]
    cap = fxstab.get_format("bf16").digit_cap
    assert r.status == "rounded" and r.avg_digits < cap and r.counters["intrinsic"] == 0
    torch._dynamo.reset()
    be, _ = analyse(lambda t: torch.round(t * 1.01), x, diagnostics="summary")
    assert not [r for r in be.reports if "/aten.round#" in r.name]  # exact: not recorded


# --------------------------------------------------------------------------- in place
def test_in_place_update_of_a_plain_tensor_with_samples_keeps_the_graph():
    torch.manual_seed(0)
    m = T5RelativeBias()
    x = torch.randn(2, 16, 8)
    be, y = analyse(m, x)
    no_failures(be)
    assert torch.equal(y, m(x))
    ops = operators(be)
    assert {"q/linear#0", "matmul#0", "add#2"} <= ops, ops
    join = [r for r in be.reports if r.name.startswith("add#2/")][0]
    assert join.shape == (2, 2, 16, 16)  # the bias joins the scores
    # the bias itself went through the samples: the log of the distances is rounded
    assert any(r.name.startswith("log#0/") and r.status == "rounded" for r in be.reports)


def test_in_place_update_of_a_plain_float_tensor():
    class Accumulate(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            acc = torch.zeros(3, 4)
            acc += self.fc(x)
            acc.mul_(0.7)
            return acc / 3

    torch.manual_seed(0)
    m = Accumulate()
    x = torch.randn(3, 4)
    be, y = analyse(m, x, format="bf16")
    no_failures(be)
    assert torch.equal(y, m(x))
    div = [r for r in be.reports if "/aten.div#" in r.name]
    cap = fxstab.get_format("bf16").digit_cap
    assert div and div[0].avg_digits < cap  # the samples reached the division


# --------------------------------------------------------------------------- per sample
def test_a_primitive_without_a_vmap_rule_runs_per_sample_and_is_rounded():
    def f(x, src):
        return torch.as_strided_scatter(x * 3, src * 0.1, (2, 2), (1, 2)).sin()

    torch.manual_seed(0)
    x, src = torch.randn(4, 4), torch.randn(2, 2)
    be, y = analyse(f, x, src, select="*")
    no_failures(be)
    assert torch.equal(y, f(x, src))
    r = [r for r in be.reports if r.name.startswith("as_strided_scatter#0/")][0]
    cap = fxstab.get_format("bf16").digit_cap
    assert r.status == "per_sample" and 0.5 < r.avg_digits < cap  # rounded: below the cap
    entry = next(e for e in be.coverage().entries if e.kind == "as_strided_scatter")
    assert entry.how == "analysed" and entry.reason.startswith("per sample")


def test_random_primitive_per_sample_draws_the_deterministic_noise():
    """rrelu in training draws a slope per element (no vmap rule for its noise): every sample
    runs from the RNG state the deterministic pass had, so all draw its slopes."""
    def f(x):
        return F.rrelu(x * 1.0, training=True) * 2

    x = torch.randn(64, 32)
    torch.manual_seed(5)
    want = f(x)
    after = torch.rand(3)
    torch.manual_seed(5)
    be, y = analyse(f, x, output="mean", format="fp32")
    assert torch.equal(torch.rand(3), after)  # the user's RNG stream is unchanged
    no_failures(be)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)  # other slopes: off by ~0.1
    r = [r for r in be.reports if r.name.startswith("rrelu#0/")][0]
    assert r.status == "per_sample"


# --------------------------------------------------------------------------- complex
def test_complex_operators_round_their_real_and_imaginary_parts():
    torch.manual_seed(0)
    m = SpectralFilter()
    x = torch.randn(3, 16)
    be, (y, mag) = analyse(m, x, output="mean", select="*")
    want, want_mag = m(x)
    torch.testing.assert_close(y, want, atol=0.05, rtol=0.05)  # the mean of bf16 samples
    no_failures(be)
    cap = fxstab.get_format("bf16").digit_cap
    complex_prims = [r for r in be.reports if r.name.startswith(("fft_rfft#0/", "mul#0/"))]
    assert complex_prims
    for r in complex_prims:
        assert r.status == "rounded" and 1.0 < r.avg_digits < cap, (r.name, r.avg_digits)
        assert r.numel == 2 * 3 * 9  # real and imaginary parts: two values an element
    assert any(r.name.startswith("fft_irfft#0/") and r.shape == (3, 16) for r in be.reports)
    assert be.coverage().fraction == 1.0
    torch._dynamo.reset()
    be, (y, _) = analyse(m, x)
    assert torch.equal(y, want)


def test_complex_input_enters_the_samples():
    def f(z):
        return torch.fft.ifft(z * z).abs()

    torch.manual_seed(0)
    z = torch.randn(4, 8, dtype=torch.complex64)
    be, y = analyse(f, z, select="*")
    no_failures(be)
    assert torch.equal(y, f(z))
    names = {r.name.split("/aten.")[0]: r for r in be.reports}
    assert {"mul#0", "fft_ifft#0", "abs#0"} <= set(names)
    assert names["mul#0"].numel == 2 * 32 and names["abs#0"].numel == 32


# --------------------------------------------------------------------------- attention
def encoder(norm_first=False):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                       norm_first=norm_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_fast_path_is_lowered_from_its_composite(norm_first):
    enc = encoder(norm_first).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = enc(x)
    be, y = analyse(enc, x)  # eval + no_grad: _transformer_encoder_layer_fwd
    no_failures(be)
    assert torch.equal(y, want)
    assert any(info.composites for info in be.infos)
    ops = operators(be)
    for i in (0, 1):
        assert {f"layers.{i}.self_attn/multi_head_attention_forward#0",
                f"layers.{i}.linear1/linear#0", f"layers.{i}.norm2/layer_norm#0"} <= ops, ops
    kinds = {r.kind for r in be.reports if ".self_attn/" in r.name}
    assert {"addmm", "bmm", "exp", "sum", "div"} <= kinds, kinds  # projections, softmax
    # the same names as the unfused module (training mode, no fast path)
    torch._dynamo.reset()
    slow, _ = analyse(encoder(norm_first).eval(), x, grad=True)
    assert operators(slow) == ops
    assert be.coverage().fraction == 1.0


def test_multihead_attention_is_analysed_through_its_primitives():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    ref_be = torch.compile(mha, backend="eager")  # dynamo's graph (no fused fast path)
    with torch.no_grad():
        want = ref_be(x, x, x)
    torch._dynamo.reset()
    be, y = analyse(mha, x, x, x)
    no_failures(be)
    assert torch.equal(y[0], want[0]) and torch.equal(y[1], want[1])
    prims = [r for r in be.reports if r.name.startswith("multi_head_attention_forward#0/")]
    kinds = {r.kind for r in prims}
    assert {"addmm", "bmm"} <= kinds, kinds
    assert all(r.status == "rounded" for r in prims if r.kind in ("addmm", "bmm"))


# --------------------------------------------------------------------------- dynamic shapes
class EpsModel(nn.Module):
    """Embedding with max_norm (its norm_type and max_norm) and LayerNorm (its eps): under
    dynamic=True dynamo passes the floats as 0-d tensors that the graph reads with .item()."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8, max_norm=1.0)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, t):
        return self.fc(self.ln(self.emb(t)))


def test_dynamic_model_is_lowered_once_and_analysed():
    torch.manual_seed(0)
    m = EpsModel()
    be = fxstab.backend(granularity="aten")
    cm = torch.compile(m, backend=be, dynamic=True)
    x = torch.randint(0, 10, (2, 6))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(cm(x), m(x))
    no_failures(be)
    (g,) = be.graphs
    assert any(n.op == "call_method" and n.target == "item" for n in g.gm.graph.nodes)
    assert g.lowerings == 1 and g.info.analysed_calls == 3
    assert {"ln/layer_norm#0", "fc/linear#0"} <= operators(be)
    assert len({r.call for r in be.reports}) == 3
    # lowered with symbolic shapes: other lengths reuse it (its guards accept them)
    for t in (9, 4, 13):
        x = torch.randint(0, 10, (3, t))
        with torch.no_grad():
            assert torch.equal(cm(x), m(x))
    assert len(be.graphs) == 1 and g.lowerings == 1 and g.info.analysed_calls == 6
    last = [r for r in be.reports if r.call == 5]
    assert {r.shape for r in last if r.name.startswith("fc/linear#0/aten.addmm")} == {(39, 4)}
    no_failures(be)
    # its guards are checked on every call: a length of 1 (0/1 specialisation) is refused
    seen = []
    lower = g._lower
    g._lower = lambda args: seen.append(args) or lower(args)
    with torch.no_grad():
        cm(torch.randint(0, 10, (3, 5)))
    (code, low), = next(iter(g._symbolic.values()))
    args = list(seen[0])
    assert code and low.shape_env.evaluate_guards_expression(code, args)
    i = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.dtype == torch.long)
    args[i] = args[i][:, :1]
    args = [1 if isinstance(a, int) and a == 5 else a for a in args]
    assert not low.shape_env.evaluate_guards_expression(code, args)
    assert g.lowerings == 1
    # the same names (and about the same digits) as a graph compiled for one shape
    torch._dynamo.reset()
    static, _ = analyse(m, torch.randint(0, 10, (3, 13)))
    want = {r.name: r.avg_digits for r in static.reports}
    got = {r.name: r.avg_digits for r in be.reports if r.call == 5}
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 0.5 for k in want), (got, want)


def test_a_failed_lowering_is_not_retried():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return h * h.sum().item()  # .item() of a computed value: no constant to take

    import torch._dynamo.config as dynamo_config

    torch.manual_seed(0)
    m = DataDependent()
    x = torch.randn(3, 4)
    be = fxstab.backend(granularity="aten")
    with dynamo_config.patch(capture_scalar_outputs=True), torch.no_grad():
        cm = torch.compile(m, backend=be)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            for _ in range(4):
                assert torch.equal(cm(x), m(x))
    (g,) = be.graphs
    assert g.lowerings == 1 and len(g.info.failures) == 4
    assert "not retried" in g.info.failures[-1]
    cov = be.coverage()
    assert cov.analysed == [] and all("stochastic path failed" in e.reason for e in cov.skipped)


# --------------------------------------------------------------------------- coverage
def test_coverage_says_how_each_operator_ran():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return torch.flip(h, [0]).abs() + h.view(-1).view(3, 4).exp()

    torch.manual_seed(0)
    m = Mixed()
    x = torch.randn(3, 4)
    be = fxstab.backend(granularity="aten")
    cm = torch.compile(m, backend=be)
    y = cm(x)
    assert torch.equal(y, m(x))
    entries = {e.kind: e for e in be.coverage().entries}
    assert entries["linear"].how == "analysed" and entries["exp"].how == "analysed"
    for kind in ("flip", "abs", "view"):  # exact: nothing to round, not counted
        assert entries[kind].how == "skipped" and entries[kind].reason.startswith("exact")
        assert entries[kind].floating and not entries[kind].counted
    assert be.coverage().fraction == 1.0
    first = be.coverage().entries
    cm(x)  # the next call: the same entries (reused, not rebuilt)
    assert len(be.graphs) == 1 and be.infos[0].analysed_calls == 2
    again = be.coverage().entries
    assert len(again) == len(first) and all(a is b for a, b in zip(again, first))
    # asked for by name, exact operators are observed: measured and recorded, not rounded
    torch._dynamo.reset()
    be, _ = analyse(m, x, select="*")
    flips = [r for r in be.reports if r.name.startswith("flip#0/")]
    assert flips and flips[0].status == "observed"
    assert {e.kind: e for e in be.coverage().entries}["flip"].how == "analysed"


# The OpInfo sweep at this level: tests/test_coverage.py (both levels).
