"""The eager driver: stochastic tensors, CESTAC comparisons, analyze, and the rules' numbers."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fxstab
from fxstab.numerics import randbits
from fxstab.rules.aten import AtenContext, Stacked, apply_primitive, round_stacked
from fxstab.numerics.formats import get_format
from fxstab.records.report import ROUNDED, UNLIFTED
from fxstab.numerics.rounding import Rounding, quantize, round_samples

aten = torch.ops.aten


# ----------------------------------------------------------------------------- basics
def test_values_samples_digits_and_printing():
    x = fxstab.stochastic(2.0, format="fp32", seed=0)
    assert isinstance(x, fxstab.StochasticTensor) and x.dtype == torch.float32
    assert x.samples.shape == (3,) and x.samples.dtype == torch.float64
    assert float(x.digits) == pytest.approx(get_format("fp32").digit_cap)  # exact input
    r = x.sqrt()
    assert r.value.dtype == torch.float32 and abs(float(r.value) - math.sqrt(2)) < 3e-7
    assert 5.5 < float(r.digits) <= 7.23
    assert str(r).startswith("0.141421") and str(r).endswith("E+001")
    v = fxstab.stochastic(torch.tensor([1.0, 0.0]), seed=0) * 3
    assert "0.0000000E+000" in str(v)  # exact zero prints as such
    assert str(((fxstab.stochastic(1.0) + 1e-7) - 1.0)) == "@.0"


def test_one_rounding_matches_the_rule():
    """x + y of two fp32 values: each sample is one fp32 neighbour of the exact sum, antithetic
    samples differ, and .digits is the CESTAC estimate of those samples."""
    a, b = 0.1, float(np.float32(1.0 / 3.0))  # Python floats enter exactly (fp64)
    x = fxstab.stochastic(a, seed=4)
    s = x + b
    exact = float(np.float64(np.float32(a)) + np.float64(np.float32(b)))  # exact in fp64
    lo = float(quantize(torch.tensor(exact, dtype=torch.float64), "fp32", "down"))
    hi = float(quantize(torch.tensor(exact, dtype=torch.float64), "fp32", "up"))
    assert lo < exact < hi
    vals = s.samples.tolist()
    assert set(vals) <= {lo, hi} and vals[1] != vals[2]  # CADNA: sample 3 = opposite of 2
    # the kernel's fp64 digits are the estimator's to its logarithm's error (1e-14), not its bits
    torch.testing.assert_close(s.digits, fxstab.cestac_digits(s.samples, "fp32"), rtol=0,
                               atol=1e-12)
    # an exact operation leaves the samples identical
    assert len(set((x * 2).samples.tolist())) == 1


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("fmt", ["bf16", "fp32", (5, 2)])
def test_rounding_is_round_samples_bit_for_bit(kernels, fmt):
    """One mechanism: the fused kernel and the reference draw the same Philox bits."""
    ctx = AtenContext.of(format=fmt, n_samples=3, seed=7, kernels=kernels)
    x = torch.linspace(0.1, 3.0, 311, dtype=ctx.working_dtype)
    st = ctx.stack(x)
    out = apply_primitive(aten.exp.default, (st,), {}, ctx, salt=5)
    call_seed = randbits.derive_seed(7, 5)
    ref = round_samples(torch.exp(st.samples), fmt, "random", randbits.derive_seed(call_seed, 100))
    assert torch.equal(out.samples, ref)
    assert not torch.equal(out.samples[1], out.samples[2])  # rounded, antithetically


def test_kernels_and_references_agree_on_surrogate_and_fp64():
    x = torch.randn(4, 64, dtype=torch.float64)
    w = torch.randn(64, 8, dtype=torch.float64)
    outs = {}
    for kernels in ("auto", "torch"):
        ctx = AtenContext.of(format="fp64", n_samples=3, seed=3, kernels=kernels)
        st = ctx.stack(x)
        mm = apply_primitive(aten.mm.default, (st, w), {}, ctx, salt=1)  # surrogate + rounding
        e = apply_primitive(aten.exp.default, (st,), {}, ctx, salt=2)  # fp64: shared side
        d = apply_primitive(aten.div.Tensor, (st, 7.0), {}, ctx, salt=3)  # fp64: exact side
        outs[kernels] = (mm.samples, e.samples, d.samples)
    for a, b in zip(outs["auto"], outs["torch"]):
        assert torch.equal(a, b)
    assert not torch.equal(outs["auto"][2][1], outs["auto"][2][2])


def test_kernels_setting_is_validated():
    with pytest.raises(ValueError, match="kernels"):
        AtenContext.of(format="fp32", n_samples=3, kernels="fast")


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp16", (5, 2)])
def test_rounding_picks_neighbours_antithetically(fmt, kernels):
    f = get_format(fmt)
    wd = fxstab.numerics.formats.working_dtype_for(f)
    g = torch.Generator().manual_seed(1)
    base = torch.randn(311, generator=g, dtype=torch.float64).to(wd) * 3
    if f.max_normal < 1e5:
        base = base.clamp(-f.max_normal / 4, f.max_normal / 4)
    # include zeros, subnormals/overflow in a second tensor
    samples = base.expand(3, -1).contiguous()
    out = round_stacked(samples, f, Rounding.RANDOM, 123, kernels=kernels)
    lo = quantize(base, f, "down")
    hi = quantize(base, f, "up")
    assert bool(((out == lo) | (out == hi)).all())
    inexact = lo != hi
    assert bool((out[1][inexact] != out[2][inexact]).all())
    frac_up = (out[0][inexact] == hi[inexact]).double().mean()
    assert 0.3 < float(frac_up) < 0.7
    edge = torch.tensor([0.0, -0.0, f.min_subnormal / 3, f.max_normal * 1.5, math.nan, math.inf],
                        dtype=wd).expand(3, -1).contiguous()
    e = round_stacked(edge, f, Rounding.RANDOM, 5, kernels=kernels)
    assert torch.isnan(e[:, 4]).all() and (e[:, 0] == 0).all()
    assert bool(((e[:, 2] == 0) | (e[:, 2] == f.min_subnormal)).all())


def test_fp64_format_rounds_to_the_exact_results_neighbours():
    x = fxstab.stochastic(0.1, format="fp64", seed=3)
    for y, exact in ((x + 0.2, Fraction(0.1) + Fraction(0.2)),
                     (x * 3.0, Fraction(0.1) * 3),
                     (x / 7.0, Fraction(0.1) / 7),
                     (x.sqrt(), None)):
        vals = sorted(set(y.samples.tolist()))
        assert len(vals) == 2 and math.nextafter(vals[0], math.inf) == vals[1]
        if exact is not None:
            assert Fraction(vals[0]) < exact < Fraction(vals[1])
        else:
            assert vals[0] ** 2 < 0.1 < vals[1] ** 2 or Fraction(vals[0]) ** 2 < Fraction(0.1) < Fraction(vals[1]) ** 2
        assert 15.0 < float(y.digits) <= 15.96
    assert len(set((x * 2.0).samples.tolist())) == 1  # exact: no noise


# ----------------------------------------------------------------------------- mixing, dtypes
def test_mixing_with_plain_tensors_ints_and_floats():
    x = fxstab.stochastic(torch.tensor([1.0, 2.0, 3.0]), seed=1)
    y = 2.0 * x + torch.ones(3) - 1
    assert isinstance(y, fxstab.StochasticTensor) and y.shape == (3,)
    assert torch.allclose(y.value, torch.tensor([2.0, 4.0, 6.0]))
    idx = torch.tensor([2, 0])
    assert torch.allclose(x[idx].value, torch.tensor([3.0, 1.0]))
    assert int(x.argmax()) == 2
    m = x.reshape(3, 1) @ torch.ones(1, 4)
    assert m.shape == (3, 4) and torch.allclose(m.value[:, 0], x.value)
    z = torch.stack([x, x]).sum(0)
    assert torch.allclose(z.value, 2 * x.value)
    x += 1
    x.mul_(2)
    assert torch.allclose(x.value, torch.tensor([4.0, 6.0, 8.0]))


def test_composites_decompose_into_primitives():
    res = fxstab.analyze(lambda t: F.layer_norm(torch.softmax(t, -1), (8,)))(torch.randn(4, 8))
    kinds = {r.kind for r in res.reports}
    assert {"exp", "sum", "div", "rsqrt", "sub", "mul"} <= kinds
    assert "_softmax" not in kinds and "native_layer_norm" not in kinds


def test_batch_norm_running_stats_update_plain_buffers():
    rm, rv = torch.zeros(4), torch.ones(4)
    x = fxstab.stochastic(torch.randn(16, 4))
    y = F.batch_norm(x, rm, rv, training=True)
    assert isinstance(y, fxstab.StochasticTensor) and rm.abs().sum() > 0


# ----------------------------------------------------------------------------- control flow
def _cbrt_newton(a, equal, limit=1000):
    x = a
    for k in range(limit):
        xn = x - (x * x * x - a) / (3 * x * x)
        if equal(xn, x):
            return k, xn
        x = xn
    return None, x


def test_cestac_equality_stops_a_loop_that_cycles_in_plain_float():
    a = 938.43616  # Newton's cube root cycles between two fp32 values here
    k, _ = _cbrt_newton(np.float32(a), lambda p, q: p == q)
    assert k is None
    k, root = _cbrt_newton(fxstab.stochastic(a, seed=0), lambda p, q: p == q)
    assert k is not None and k < 30
    assert abs(float(root) - a ** (1 / 3)) < 1e-5 * a ** (1 / 3)
    assert float(root.digits) > 5


def test_series_summed_until_it_stops_changing():
    s, t, k = fxstab.stochastic(0.0), fxstab.stochastic(1.0), 0
    while True:
        k += 1
        t = t / k
        s_new = s + t
        if s_new == s:
            break
        s = s_new
    assert k < 20 and abs(float(s) - (math.e - 1)) < 1e-6


def test_ordered_comparisons_and_branching_count():
    x = fxstab.stochastic(1.0, seed=2)
    z = (x + 1e-7) - x  # computational zero
    with fxstab.instability_counters() as c:
        assert (z == 0) and (z <= 0) and (z >= 0) and not (z < 0) and not (z > 0)
    assert c.counts["branching"] == 5
    with fxstab.instability_counters() as c:
        assert (x > 0.5) and not (x < 0.5) and x != 2.0
    assert c.counts["branching"] == 0


# ----------------------------------------------------------------------------- bad input
def test_bad_input_is_rejected_clearly():
    with pytest.raises(ValueError, match="floating"):
        fxstab.stochastic(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="tensor, NumPy array or number"):
        fxstab.stochastic("1.0")
    with pytest.raises(ValueError, match="unknown format"):
        fxstab.stochastic(1.0, format="fp12")


def test_nan_inputs_propagate_without_crashing():
    x = fxstab.stochastic(torch.tensor([math.nan, 1.0, math.inf]))
    y = (x * 2 + 1).exp()
    assert torch.isnan(y.value[0]) and float(y.digits[0]) == 0 and float(y.digits[2]) == 0
    assert float(y.digits[1]) > 5
    assert "NaN" in str(y) and "Inf" in str(y)


def test_unbatchable_primitive_falls_back_per_sample():
    records = []
    ctx = AtenContext.of(format="fp32", n_samples=3, seed=0, recorder=records.append)
    st = Stacked(torch.tensor([[1.0, 2.0], [1.0, 2.0 + 2**-40], [1.0, 2.0 - 2**-40]],
                              dtype=torch.float64))  # samples that differ

    def needs_a_python_number(t):
        return t * float(t.sum())  # .item() inside: vmap cannot batch it

    out = apply_primitive(needs_a_python_number, (st,), {}, ctx)
    assert isinstance(out, Stacked) and torch.allclose(out.samples[0], torch.tensor([3.0, 6.0], dtype=torch.float64))
    assert records[-1].status == UNLIFTED
    # identical samples (data entering the analysis) need one evaluation, then the rounding
    plain = torch.tensor([1.0, 0.1], dtype=torch.float64)  # 1.1 * (1, 0.1): not fp32 values
    same = apply_primitive(needs_a_python_number, (ctx.stack(plain),), {}, ctx)
    assert records[-1].status == ROUNDED and same.samples.shape == (3, 2)
    assert not torch.equal(same.samples[1], same.samples[2])
    # data-dependent output shapes come back from sample 0 without crashing
    nz = torch.nonzero(fxstab.stochastic(torch.tensor([0.0, 1.0, 2.0])))
    assert nz.shape[-1] == 1


def test_results_are_rounded_in_place_only_when_they_own_their_memory():
    """A fresh result is rounded in its own buffer; a view of an operand (unfold) or an
    operand returned as is never is: the operand's samples stay as they were."""
    ctx = AtenContext.of(format="bf16", n_samples=3, seed=0)
    g = torch.Generator().manual_seed(0)
    x = Stacked(torch.randn(3, 2, 8, generator=g))  # fp32 values: bf16 rounding moves them
    before = x.samples.clone()
    y = apply_primitive(aten.mul.Tensor, (x, 1.0 / 3.0), {}, ctx)
    w = apply_primitive(aten.unfold.default, (x, 1, 4, 2), {}, ctx)
    z = apply_primitive(lambda t: t, (x,), {}, ctx)
    assert torch.equal(x.samples, before)
    assert y.samples.data_ptr() != x.samples.data_ptr()
    assert w.samples.shape == (3, 2, 3, 4) and z.samples.shape == (3, 2, 8)
    assert not torch.equal(z.samples, before)  # rounded into bf16, in a buffer of its own
    assert torch.equal(quantize(z.samples, "bf16", Rounding.NEAREST).float(), z.samples)


def test_integer_and_bool_tensors_pass_through():
    ctx = AtenContext.of(format="fp32", n_samples=3, seed=0)
    i = torch.arange(4)
    assert torch.equal(apply_primitive(aten.add.Tensor, (i, 1), {}, ctx), i + 1)
    st = ctx.stack(torch.tensor([1.5, -2.5], dtype=torch.float64))
    out = apply_primitive(aten._to_copy.default, (st,), {"dtype": torch.int64}, ctx)
    assert out.samples.dtype == torch.int64 and out.samples.tolist() == [[1, -2]] * 3


# ----------------------------------------------------------------------------- analyze
def test_analyze_numpy_and_python_floats():
    res = fxstab.analyze(lambda a, b: (a * b).sum() / 3.0, format="fp32", seed=1)(
        np.linspace(0.1, 1, 10), 0.7)
    assert set(res.counters) == set(fxstab.records.report.COUNTER_KEYS)
    assert abs(float(res.value) - 0.7 * np.linspace(0.1, 1, 10).sum() / 3) < 1e-6
    assert res.samples.shape == (3,) and 5 < float(res.digits) <= 7.23
    # a NumPy program's results come back in NumPy
    assert isinstance(res.value, np.float64) and isinstance(res.samples, np.ndarray)
    assert isinstance(res.digits, np.float64)
    assert res.reports and all(r.format == "fp32" and r.n_samples == 3 for r in res.reports)
    again = fxstab.analyze(lambda a, b: (a * b).sum() / 3.0, format="fp32", seed=1)(
        np.linspace(0.1, 1, 10), 0.7)
    assert np.array_equal(res.samples, again.samples)  # fresh context: reproducible
    assert "primitive" in res.table()


def test_analyze_detailed_events():
    res = fxstab.analyze(lambda x: (x + 1e-7) - x, diagnostics="detailed")(torch.ones(4))
    assert res.counters["cancellation"] == 4
    assert res.events and res.events[0].kind == "cancellation" and res.events[0].count == 4


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32", "fp8_e4m3"])
def test_rounding_with_zeros_and_subnormals(fmt, kernels):
    f = get_format(fmt)
    wd = fxstab.numerics.formats.working_dtype_for(f)
    vals = torch.tensor([0.0, -0.0, 1.0, f.min_normal * 0.3, -f.min_normal * 0.77,
                         f.min_subnormal * 2.5, f.min_normal * 1.01], dtype=wd)
    samples = vals.expand(3, -1).contiguous()
    out = round_stacked(samples, f, Rounding.RANDOM, 9, kernels=kernels)
    lo, hi = quantize(vals, f, "down"), quantize(vals, f, "up")
    assert bool(((out == lo) | (out == hi)).all()), (out, lo, hi)
    assert torch.equal(torch.signbit(out[:, 1]), torch.ones(3, dtype=torch.bool))


def test_analyze_reports_no_digits_for_outputs_that_are_not_stochastic():
    """An integer input is not lifted: its output carries no samples, so no digits (not its
    values, as before); a stochastic output beside it keeps its own."""
    res = fxstab.analyze(lambda a: a.float() * 2)(torch.arange(3))
    assert res.digits is None and res.samples is None
    assert torch.equal(res.value, torch.tensor([0.0, 2.0, 4.0]))
    res = fxstab.analyze(lambda a, i: (a * 3, i + 1, a > 0))(torch.ones(2), torch.arange(2))
    d_float, d_int, d_bool = res.digits
    assert d_int is None and d_bool is None and d_float.shape == (2,)
    assert float(d_float.min()) > 6 and torch.equal(res.value[1], torch.tensor([1, 2]))


@pytest.mark.parametrize("name, fn", [
    ("mv", lambda u: torch.outer(u, u) @ u), ("dot", lambda u: u @ u),
    ("prod", lambda u: torch.prod(u * 3)), ("tril", lambda u: torch.tril(torch.outer(u, u))),
    ("cumprod", lambda u: torch.cumprod(u * 3, 0)), ("cummax", lambda u: torch.cummax(u * 3, 0).values),
    ("logcumsumexp", lambda u: torch.logcumsumexp(u * 3, 0)),
])
def test_primitives_batched_by_vmap_are_rounded_in_eager_code(name, fn):
    """vmap inside __torch_dispatch__ used to run without functorch's dispatch keys: mv, dot,
    prod, tril fell back to unrounded per-sample runs, cumprod and logcumsumexp crashed."""
    res = fxstab.analyze(fn, format="fp32")(torch.arange(1.0, 4.0))
    assert all(r.status == ROUNDED for r in res.reports), [(r.kind, r.status) for r in res.reports]
    assert torch.allclose(res.value.double(), fn(torch.arange(1.0, 4.0, dtype=torch.float64)))


def test_one_decomposition_table_for_both_drivers():
    """The eager driver decomposes with the compiled path's table (fxstab.rules.aten
    .decompositions): its named composites, the very same functions; the compiled path adds
    core ATen's decompositions on top."""
    from fxstab.rules.aten import DECOMPOSED, decompositions

    compiled, eager = decompositions(), decompositions(core=False)
    assert len(eager) >= len(DECOMPOSED) and len(compiled) > len(eager)
    assert all(compiled[op] is fn for op, fn in eager.items())
    names = {str(op) for op in eager}
    assert {"aten._softmax.default", "aten.native_layer_norm.default",
            "aten.std.correction"} <= names
    assert "aten.dot.default" in {str(op) for op in compiled} - names  # a GEMM in eager code
