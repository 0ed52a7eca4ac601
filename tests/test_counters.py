"""CADNA's instability counters (docs/design.md §5) on constructed cases of each kind."""

import math

import pytest
import torch
import torch.nn.functional as F

import fxstab
from fxstab.rules.aten import AtenContext, Stacked, apply_primitive
from fxstab.records.counters import Counters, instability_counters
from fxstab.records.report import COUNTER_KEYS

aten = torch.ops.aten


def _noise_zero(fmt="fp32"):
    """A computational zero: (1 + 1e-7) - 1 in fp32, random rounding (samples 0 or 1 ulp)."""
    x = fxstab.stochastic(1.0, format=fmt, seed=11)
    return (x + 1e-7) - x


def _counts(fn, diagnostics="summary"):
    with instability_counters(diagnostics) as c:
        fn()
    return c


def test_keys_are_the_report_keys():
    c = _counts(lambda: None)
    assert tuple(c.counts) == COUNTER_KEYS
    assert c.total == 0


def test_cancellation_fires_and_reports_the_event():
    c = _counts(_noise_zero, "detailed")
    assert c.counts["cancellation"] == 1
    assert sum(c.counts.values()) == 1
    (ev,) = c.events
    assert ev.kind == "cancellation" and ev.primitive == "aten.sub.Tensor" and ev.count == 1
    assert ev.digits < 0.5


def test_cancellation_counts_elements():
    x = fxstab.stochastic(torch.ones(5), seed=3)
    c = _counts(lambda: (x + 1e-7) - x)
    assert c.counts["cancellation"] == 5


def test_cancellation_threshold_is_four_digits():
    # losing ~3 digits (1 + 1e-3) - 1 is not a cancellation in CADNA's sense
    x = fxstab.stochastic(1.0, seed=5)
    c = _counts(lambda: (x + 1.2345e-3) - x)
    assert c.counts["cancellation"] == 0


def test_division_multiplication_power_math():
    z = _noise_zero()
    c = _counts(lambda: (1.0 / z, 2.0 / z))
    assert c.counts["division"] == 2
    c = _counts(lambda: z * z)
    assert c.counts["multiplication"] == 1
    c = _counts(lambda: z * 2.0)  # one factor exact: not unstable
    assert c.counts["multiplication"] == 0
    c = _counts(lambda: z ** 2)
    assert c.counts["power"] == 1
    c = _counts(lambda: (z.exp(), z.sin(), torch.sigmoid(z)))
    assert c.counts["math_function"] == 3


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_operand_zero_counts_on_tensors(kernels):
    """Counts of division, math_function and branching on a tensor with some computational
    zeros: the fused kernel's statistics count them without a pass over the mask, and must
    agree with the mask, elementwise, in both kernel paths."""
    ctx = AtenContext.of(format="fp32", n_samples=3, seed=0, kernels=kernels)
    g = torch.Generator().manual_seed(0)
    one = Stacked(torch.ones(1, 64, dtype=torch.float64).expand(3, 64))
    delta = torch.where(torch.rand(64, generator=g) < 0.4, 1e-7, 0.5).double()
    d = apply_primitive(aten.sub.Tensor, (apply_primitive(aten.add.Tensor, (one, delta), {}, ctx),
                                          one), {}, ctx)
    zero = d.analysis(ctx).zero
    expected = int(zero.sum())
    assert 0 < expected < 64 and int(d.analysis(ctx).zeros) == expected
    with instability_counters("detailed") as c:
        apply_primitive(aten.exp.default, (d,), {}, ctx)
        apply_primitive(aten.reciprocal.default, (d,), {}, ctx)
        apply_primitive(aten.relu.default, (d,), {}, ctx)
    assert c.counts["math_function"] == c.counts["division"] == c.counts["branching"] == expected
    assert all(bool(zero[ev.index]) for ev in c.events)  # the worst element is one of them


def test_intrinsic_abs_floor_and_int_cast():
    ctx = AtenContext.of(format="fp32", n_samples=3, seed=0)
    mixed = Stacked(torch.tensor([[1e-8], [-1e-8], [2e-8]], dtype=torch.float64))
    with instability_counters() as c:
        apply_primitive(aten.abs.default, (mixed,), {}, ctx)
    assert c.counts["intrinsic"] == 1
    straddle = Stacked(torch.tensor([[0.9999999], [1.0000001], [1.0]], dtype=torch.float64))
    with instability_counters() as c:
        apply_primitive(aten.floor.default, (straddle,), {}, ctx)
        apply_primitive(aten._to_copy.default, (straddle,), {"dtype": torch.int64}, ctx)
    assert c.counts["intrinsic"] == 2
    same_sign = Stacked(torch.tensor([[1.5], [1.6], [1.7]], dtype=torch.float64))
    with instability_counters() as c:
        apply_primitive(aten.abs.default, (same_sign,), {}, ctx)
        apply_primitive(aten.floor.default, (same_sign,), {}, ctx)
    assert c.total == 0


def test_branching_comparisons_selections_where():
    z = _noise_zero()
    c = _counts(lambda: (z > 0, torch.maximum(z, torch.zeros(())), F.relu(z),
                         torch.clamp(z, min=0.0)))
    assert c.counts["branching"] == 4
    ctx = AtenContext.of(format="fp32", n_samples=3, seed=0)
    cond = Stacked(torch.tensor([[True, True], [False, True], [True, True]]))
    a = Stacked(torch.zeros(3, 2, dtype=torch.float64))
    with instability_counters() as c:
        apply_primitive(aten.where.self, (cond, a, torch.ones(2, dtype=torch.float64)), {}, ctx)
    assert c.counts["branching"] == 1


def test_anomaly_from_finite_inputs_only():
    big = fxstab.stochastic(100.0, seed=1)
    c = _counts(lambda: big.exp())  # e^100 overflows fp32
    assert c.counts["anomaly"] == 1
    nan_in = fxstab.stochastic(torch.tensor([math.nan, 1.0]), seed=1)
    c = _counts(lambda: nan_in + 1.0)
    assert c.counts["anomaly"] == 0
    neg = fxstab.stochastic(-1.0, seed=1)
    c = _counts(lambda: neg.sqrt())
    assert c.counts["anomaly"] == 1 and c.counts["math_function"] == 0


def _masked_scores():
    """Attention scores with a causal mask's -inf above the diagonal, as samples."""
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 6, 6, generator=g) * 3
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    return fxstab.stochastic(scores, seed=3).masked_fill(~causal, -math.inf)


@pytest.mark.parametrize("case", ["masked_softmax", "overflow", "both_masked", "over_inf",
                                  "inf_weight", "nan_number", "overflow_with_mask"])
def test_anomalies_counted_from_counts_are_the_masks(case, monkeypatch):
    """Anomalies of add/sub/mul/div are counted from non-finite counts where those decide
    (finite operands; one operand's infinities that the result carries: a causal mask through
    the softmax) and from masks otherwise (both operands non-finite, a divisor's, a plain
    operand's); summary counts are the per-element masks' (``detailed``) in every case."""
    big = lambda: fxstab.stochastic(torch.full((2, 6, 6), 1e30), seed=4)  # noqa: E731
    fns = {
        "masked_softmax": lambda: torch.softmax(_masked_scores(), -1),
        "overflow": lambda: big() * 1e10,  # finite operands, infinite products
        "both_masked": lambda: _masked_scores() + _masked_scores().transpose(-1, -2),
        "over_inf": lambda: big() / _masked_scores(),  # a divisor's -inf gives zeros
        "inf_weight": lambda: big() * torch.tensor([1.0, math.inf, 1e10, 2, 3, 4]),
        "nan_number": lambda: big() - math.nan,
        "overflow_with_mask": lambda: (_masked_scores() * 1e38) * 1e3,
    }
    want = {"masked_softmax": 0, "overflow": 72, "both_masked": 0, "over_inf": None,
            "inf_weight": 12, "nan_number": 0, "overflow_with_mask": None}[case]
    from fxstab.rules.aten import counters

    decided = []
    counted = counters._anomalies_counted

    def spy(*args):
        found = counted(*args)
        decided.append(found is not None)
        return found

    monkeypatch.setattr(counters, "_anomalies_counted", spy)
    summary = _counts(fns[case], "summary").counts["anomaly"]
    detailed = _counts(fns[case], "detailed").counts["anomaly"]
    assert summary == detailed
    assert want is None or summary == want, summary
    # by counts where they decide, by masks where they do not
    assert any(decided) == (case in ("masked_softmax", "overflow", "overflow_with_mask")), decided


def test_stable_code_counts_nothing():
    g = torch.Generator().manual_seed(0)
    x = fxstab.stochastic(torch.rand(16, 32, generator=g) + 0.5, seed=2)
    w = torch.rand(32, 8, generator=g)

    def stable():
        y = (x * x + 1.0).sqrt().log()
        p = torch.softmax(4 * torch.arange(8.0) + y @ w, -1)
        return (p * 2).exp() / (1 + x.mean())

    c = _counts(stable)
    assert c.total == 0, c.counts


def test_diagnostics_off_computes_no_counters():
    ctx = AtenContext.of(format="fp32", n_samples=3, seed=0, diagnostics="off")
    z = Stacked(torch.tensor([[1e-8], [-1e-8], [2e-8]], dtype=torch.float64))
    apply_primitive(aten.reciprocal.default, (z,), {}, ctx)
    assert ctx.counters.total == 0
    ctx = AtenContext.of(format="fp32", n_samples=3, seed=0, diagnostics="summary")
    apply_primitive(aten.reciprocal.default, (z,), {}, ctx)
    assert ctx.counters.counts["division"] == 1


def test_records_carry_per_primitive_counters():
    records = []
    ctx = AtenContext.of(format="fp32", n_samples=3, seed=0, recorder=records.append)
    one = ctx.stack(torch.ones(4, dtype=torch.float64))
    y = apply_primitive(aten.add.Tensor, (one, 1e-7), {}, ctx)
    apply_primitive(aten.sub.Tensor, (y, one), {}, ctx)
    assert [r.name for r in records] == ["aten.add#0", "aten.sub#0"]
    assert records[1].counters["cancellation"] == 4 and records[0].counters["cancellation"] == 0
    assert records[1].stats.min < 0.5 and records[0].stats.min > 6


def test_bad_settings():
    with pytest.raises(ValueError, match="diagnostics"):
        Counters("verbose")
    with pytest.raises(ValueError, match="diagnostics"):
        with instability_counters("loud"):
            pass
    with pytest.raises(ValueError, match="n_samples"):
        AtenContext.of(format="fp32", n_samples=1)
    with pytest.raises(ValueError, match="kernels"):
        AtenContext.of(format="fp32", n_samples=3, kernels="os")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_finite_mask_matches_isfinite_over_samples(dtype):
    """The anomaly counter's per-element finiteness (every sample finite): against
    torch.isfinite, with one infinite or NaN sample among finite ones, values near the dtype's
    maximum (their sum overflows; the mask must not), signed zeros and subnormals."""
    from fxstab.rules.aten import Analysis

    big = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal / 4
    cols = [[1.0, 2.0, 3.0], [math.inf, 1.0, 1.0], [1.0, -math.inf, 1.0], [1.0, 1.0, math.nan],
            [big, big, big], [-big, big, -big], [0.0, -0.0, 0.0], [tiny, -tiny, 0.0],
            [math.inf, -math.inf, math.nan], [-math.inf, -math.inf, -math.inf]]
    s = torch.tensor(cols, dtype=dtype).T.contiguous()  # [3 samples, 10 elements]
    ctx = AtenContext.of(format="bf16" if dtype == torch.float32 else "fp32", n_samples=3)
    got = Analysis(s, ctx).finite
    assert torch.equal(got, torch.isfinite(s).all(0))
    assert got.tolist() == [True, False, False, False, True, True, True, True, False, False]


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_comparison_of_identical_samples_is_the_cestac_rule(fmt, op):
    """Identical samples (data, a buffer) compared need no step: the sign of one sample's
    difference decides, as CESTAC's rule on N real copies of the same values does (signed
    zeros, subnormals, infinities, NaN), against a stacked value, a plain tensor, a number;
    and nothing is counted."""
    special = [0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, math.inf, -math.inf, math.nan, 3.5, 1e30]
    a = torch.tensor(special)
    b = torch.tensor([v for v in reversed(special)])
    fn = getattr(aten, op).Tensor
    for other in ("stacked", "plain", "number"):
        results = []
        for copies in (False, True):
            ctx = AtenContext.of(format=fmt, n_samples=3, seed=0)
            emitted = []
            ctx.emit = lambda what, *rest, _e=ctx.emit: emitted.append(what) or _e(what, *rest)
            x = ctx.stack(a, materialize=copies)
            y = {"stacked": lambda: ctx.stack(b, materialize=copies), "plain": lambda: b,
                 "number": lambda: 0.0}[other]()
            with instability_counters() as c:
                op_ = fn if other != "number" else getattr(aten, op).Scalar
                results.append(apply_primitive(op_, (x, y), {}, ctx))
            assert sum(c.counts.values()) == 0
            assert ("compare" in emitted) == copies  # the rule's step only for real copies
        assert isinstance(results[0], torch.Tensor) and results[0].dtype == torch.bool
        assert torch.equal(results[0], results[1]), (op, other)
