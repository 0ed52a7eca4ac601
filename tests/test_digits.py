"""The CESTAC digit estimator (fxstab.numerics.digits) against hand computation and mpmath."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch

from fxstab.numerics.digits import (
    DigitStats, cestac_digits, computational_zero, digit_stats, format_stochastic, student_t,
)
from fxstab.numerics.formats import get_format

# Two-sided 95% Student-t with 2 degrees of freedom: the CDF is 1/2 + t / (2 sqrt(2 + t^2)), so
# t / sqrt(2 + t^2) = 0.95 gives t = 0.95 sqrt(2 / (1 - 0.95^2)) = 4.3027.
T3 = 0.95 * math.sqrt(2 / (1 - 0.95**2))
CAP32, CAP64 = get_format("fp32").digit_cap, get_format("fp64").digit_cap


def _mp_t(n: int, conf: float) -> mpmath.mpf:
    """Two-sided quantile from mpmath's regularized incomplete beta (50 digits)."""
    with mpmath.workdps(50):
        df = mpmath.mpf(n - 1)
        p = (1 + mpmath.mpf(conf)) / 2

        def cdf(t):
            return 1 - mpmath.betainc(df / 2, mpmath.mpf(1) / 2, 0, df / (df + t * t),
                                      regularized=True) / 2

        return mpmath.findroot(lambda t: cdf(t) - p, mpmath.mpf(2.5), tol=mpmath.mpf(10) ** -40)


def _mp_digits(col: list[float], conf: float) -> float:
    """docs/design.md §2: C = log10(sqrt(N)|mean| / (t sigma)), exact arithmetic on the samples."""
    with mpmath.workdps(50):
        xs = [mpmath.mpf(v) for v in col]
        n = len(xs)
        mean = mpmath.fsum(xs) / n
        sigma = mpmath.sqrt(mpmath.fsum((x - mean) ** 2 for x in xs) / (n - 1))
        return float(mpmath.log10(mpmath.sqrt(n) * abs(mean) / (_mp_t(n, conf) * sigma)))


# ----------------------------------------------------------------------------- hand-computed
def test_hand_computed_triples():
    s = torch.tensor([[1.0, 100.0], [1.0 + 1e-3, 101.0], [1.0 - 1e-3, 99.0]], dtype=torch.float64)
    # mean 1, sigma = sqrt((1e-6 + 1e-6) / 2) = 1e-3; mean 100, sigma 1.
    want = [math.log10(math.sqrt(3) * 1.0 / (T3 * 1e-3)),  # 2.6048
            math.log10(math.sqrt(3) * 100.0 / (T3 * 1.0))]  # 1.6048
    got = cestac_digits(s).tolist()
    assert got == pytest.approx(want, abs=1e-12)
    assert got[0] == pytest.approx(2.6048, abs=1e-4)
    # N = 2: (100, 101): mean 100.5, sigma = 1/sqrt(2), t = 12.706
    t2 = math.tan(math.pi * 0.475)
    got2 = cestac_digits(torch.tensor([[100.0], [101.0]], dtype=torch.float64)).item()
    assert got2 == pytest.approx(math.log10(math.sqrt(2) * 100.5 / (t2 / math.sqrt(2))), abs=1e-12)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("conf", [0.95, 0.99])
def test_formula_agrees_with_mpmath(n, conf):
    g = torch.Generator().manual_seed(n)
    base = torch.randn(40, generator=g, dtype=torch.float64) * torch.logspace(-200, 200, 40,
                                                                               dtype=torch.float64)
    rel = torch.logspace(-12, -1, 40, dtype=torch.float64)
    s = base * (1 + rel * torch.randn(n, 40, generator=g, dtype=torch.float64))
    got = cestac_digits(s, confidence=conf).tolist()
    for j in range(40):
        want = _mp_digits(s[:, j].tolist(), conf)
        want = min(max(want, 0.0), CAP64)
        assert got[j] == pytest.approx(want, abs=1e-12), (j, s[:, j].tolist())


# ----------------------------------------------------------------------------- conventions
def test_conventions():
    inf, nan = math.inf, math.nan
    s = torch.tensor([
        [2.5, 0.0, 1.0, inf, 1.0, -1.0, 1.0, 1e-30, -0.0],
        [2.5, 0.0, nan, inf, 1.0 + 2**-23, 1.0, 1.0, -1e-30, 0.0],
        [2.5, 0.0, 1.0, inf, 1.0, 0.0, 5.0, 3e-30, 0.0],
    ], dtype=torch.float32)
    d = cestac_digits(s, "fp32").tolist()
    CAP32 = float(torch.tensor(get_format("fp32").digit_cap, dtype=torch.float32))  # fp32 digits
    assert d[0] == CAP32  # identical -> cap
    assert d[1] == CAP32  # all exact zero -> cap (identical)
    assert d[2] == 0.0 and d[3] == 0.0  # NaN / inf sample -> 0 (even if identical)
    assert 6.0 < d[4] < CAP32  # 1 ulp apart: just under fp32's 7.22
    assert d[5] == 0.0  # mean 0 with spread
    assert d[6] == 0.0  # spread larger than the mean: C < 0 clipped to 0
    assert d[7] == 0.0
    assert d[8] == CAP32  # -0 == 0: identical
    # the cap follows the format, not the dtype
    assert cestac_digits(s[:, :1], "bf16").item() == pytest.approx(2.408, abs=1e-3)
    assert cestac_digits(s.double()[:, :1]).item() == pytest.approx(CAP64)
    # clipping at the cap from above: a tiny spread in fp64 samples with a bf16 cap
    tiny = torch.tensor([[1.0], [1.0 + 1e-12], [1.0]], dtype=torch.float64)
    assert cestac_digits(tiny, "bf16").item() == get_format("bf16").digit_cap


def test_huge_and_tiny_values_do_not_overflow():
    for scale in (1e-300, 1e300, 1e-40):
        s = torch.tensor([[1.0], [1.0 + 1e-3], [1.0 - 1e-3]], dtype=torch.float64) * scale
        assert cestac_digits(s).item() == pytest.approx(
            math.log10(math.sqrt(3) / (T3 * 1e-3)), abs=1e-9)
    s32 = torch.tensor([[3e38], [3.001e38], [2.999e38]], dtype=torch.float32)
    # mean 3e38 (a sum of the samples would overflow fp32), sigma 1e35; fp32 samples: 1e-3
    # covers the samples' own rounding (relative 6e-8 on 1e35-sized deviations: 2e-4 in sigma).
    assert cestac_digits(s32).item() == pytest.approx(
        math.log10(math.sqrt(3) * 3e38 / (T3 * 1e35)), abs=1e-3)


# ----------------------------------------------------------------------------- Student t
@pytest.mark.parametrize("n, conf, table", [
    (2, 0.95, 12.706), (3, 0.95, 4.303), (5, 0.95, 2.776), (10, 0.95, 2.262), (31, 0.95, 2.042),
    (2, 0.99, 63.657), (3, 0.99, 9.925), (5, 0.99, 4.604), (10, 0.99, 3.250), (30, 0.99, 2.756),
    (2, 0.90, 6.314), (3, 0.90, 2.920), (121, 0.95, 1.980),
])
def test_student_t_table(n, conf, table):
    assert round(student_t(n, conf), 3) == table


def test_student_t_matches_mpmath():
    for n in list(range(2, 51)) + [100, 1000]:
        for conf in (0.95, 0.99) if n % 7 else (0.9, 0.95, 0.99, 0.999):
            want = float(_mp_t(n, conf))
            assert student_t(n, conf) == pytest.approx(want, rel=1e-10), (n, conf)


@pytest.mark.parametrize("n", [0, 1, -3, 2.0, True, "3", None])
def test_student_t_invalid_n(n):
    with pytest.raises(ValueError, match="n_samples >= 2"):
        student_t(n)


@pytest.mark.parametrize("conf", [0.0, 1.0, 1.5, -0.1, math.nan, "0.95", None])
def test_student_t_invalid_confidence(conf):
    with pytest.raises(ValueError, match="confidence must be in"):
        student_t(3, conf)


def test_invalid_samples():
    with pytest.raises(ValueError, match="n_samples >= 2"):
        cestac_digits(torch.ones(1, 4))
    with pytest.raises(ValueError, match="floating"):
        cestac_digits(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="leading sample dimension"):
        cestac_digits(torch.tensor(1.0))
    with pytest.raises(ValueError, match="n_samples >= 2"):
        digit_stats(torch.ones(1, 0))  # empty, but still a wrong N
    with pytest.raises(ValueError, match="n_samples >= 2"):
        digit_stats(torch.ones(0, 5))
    with pytest.raises(ValueError, match="confidence"):
        digit_stats(torch.ones(3, 5), confidence=2.0)


# ----------------------------------------------------------------------------- zeros and stats
def test_computational_zero():
    s = torch.tensor([
        [1e-20, 0.0, 1.0, 1e-20, math.nan, 1.0],
        [-1e-20, 0.0, 1.0 + 1e-6, 1e-20, 1.0, 1.5],
        [2e-20, 0.0, 1.0 - 1e-6, 1e-20, 1.0, 0.7],
    ], dtype=torch.float64)
    z = computational_zero(s).tolist()
    # cancellation noise: yes; exact zero: no; good value: no; identical tiny: no;
    # non-finite: no (counted separately); spread ~ mean (C < 0.5): yes
    assert z == [True, False, False, False, False, True]
    # threshold: C = 1.6 is a computational zero under threshold 2
    s2 = torch.tensor([[100.0], [101.0], [99.0]], dtype=torch.float64)
    assert not computational_zero(s2).item() and computational_zero(s2, threshold=2.0).item()


def test_digit_stats():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 11, generator=g, dtype=torch.float64)
    s = x * (1 + torch.logspace(-12, 0, 77, dtype=torch.float64).reshape(7, 11)
             * torch.randn(3, 7, 11, generator=g, dtype=torch.float64))
    s[:, 0, 0] = math.inf
    s[1, 0, 1] = math.nan
    s[:, 0, 2] = 0.0
    st = digit_stats(s, "fp64")
    d = cestac_digits(s, "fp64")
    z = computational_zero(s, d)
    assert isinstance(st, DigitStats)
    assert st.numel == 77 and st.non_finite == 2
    assert st.avg == pytest.approx(d.mean().item(), abs=1e-12)
    assert (st.min, st.max) == (d.min().item(), d.max().item())
    assert st.zero_fraction == pytest.approx(z.double().mean().item()) and st.zero_fraction > 0
    assert st.min == 0.0 and st.max == CAP64
    assert set(st.as_dict()) == {"avg", "min", "max", "numel", "zero_fraction", "non_finite",
                                 "normwise", "p10", "p50", "underflow", "run"}
    assert st.normwise == 0.0  # a non-finite sample: the tensor as a whole has no digit
    e = digit_stats(torch.empty(3, 0, 4), "bf16")
    cap = get_format("bf16").digit_cap
    assert (e.avg, e.min, e.max, e.numel, e.zero_fraction, e.non_finite) == (cap, cap, cap, 0, 0.0, 0)
    assert (e.normwise, e.p10, e.p50, e.underflow) == (cap, cap, cap, 0)
    # fp32 samples reduce in fp64 and match the per-element digits
    st32 = digit_stats(s.float(), "bf16", zero_threshold=1.0)
    d32 = cestac_digits(s.float(), "bf16")
    assert st32.avg == pytest.approx(d32.double().mean().item(), rel=1e-12)
    assert st32.zero_fraction == pytest.approx(computational_zero(s.float(), d32, threshold=1.0)
                                               .double().mean().item())


# ----------------------------------------------------------------------------- printing
@pytest.mark.parametrize("mean, digits, text", [
    (3.4999993, 7.3, "0.3499999E+001"),
    (-3.4999993, 7.3, "-0.3499999E+001"),
    (3.4999993, 6.5, "0.3499999E+001"),  # 6.5 rounds to 7 digits
    (3.4999993, 6.49, "0.350000E+001"),  # 6 digits, rounded value
    (9.99999, 2.2, "0.10E+002"),  # rounding carries into the exponent
    (1.234e-5, 3.0, "0.123E-004"),
    (123456.0, 0.5, "0.1E+006"),
    (123456.0, 0.49, "@.0"),  # fewer than 0.5 digits: a computational zero
    (1.0, 0.0, "@.0"),
    (1.0, math.nan, "@.0"),
    (math.nan, 3.0, "NaN"),
    (-math.inf, 3.0, "-Inf"),
    (math.inf, 3.0, "Inf"),
])
def test_format_stochastic(mean, digits, text):
    assert format_stochastic(mean, digits) == text


def test_format_exact_zero():
    assert format_stochastic(0.0, 0.0, exact_zero=True) == "0." + "0" * 16 + "E+000"
    assert format_stochastic(0.0, 0.0, exact_zero=True, cap=get_format("fp32").digit_cap) == \
        "0.0000000E+000"


# ----------------------------------------------------------------------------- extras
def _spread_samples(numel: int, dtype=torch.float64, seed: int = 0) -> torch.Tensor:
    """Samples whose relative spread runs from 1e-14 to 1: every digit count occurs."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g, dtype=dtype) * 10 ** torch.linspace(-3, 3, numel,
                                                                                dtype=dtype)
    rel = 10 ** torch.linspace(-14, 0, numel, dtype=dtype)[torch.randperm(numel, generator=g)]
    return base * (1 + rel * torch.randn(3, numel, generator=g, dtype=dtype))


def test_normwise_digits_against_fp64_formula():
    s = _spread_samples(999)
    t = student_t(3)
    m = s.mean(0)
    sd2 = s.var(0, unbiased=True)
    expect = math.log10(math.sqrt(3) * m.norm().item() / (t * sd2.sum().sqrt().item()))
    assert digit_stats(s, "fp64").normwise == pytest.approx(expect, abs=1e-9)
    # dominated by the large elements: a tiny cancelled element does not saturate it
    s2 = torch.stack([torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1e-9, 2e-9, -1e-9])], 1)
    st = digit_stats(s2.to(torch.float64), "fp64")
    assert st.min == 0.0 and st.normwise > 8
    # the conventions: identical samples, zero mean with spread
    assert digit_stats(torch.ones(3, 5, dtype=torch.float64), "bf16").normwise == \
        get_format("bf16").digit_cap
    zero_mean = torch.tensor([[1.0], [-0.5], [-0.5]], dtype=torch.float64)
    assert digit_stats(zero_mean, "fp64").normwise == 0.0


@pytest.mark.parametrize("numel", [1, 7, 128, 1000, 1024, 1025, 70001])
def test_quantiles_against_sorted_digits(numel):
    """Exact up to the bins for at most 8 groups of 128 elements; beyond, the quantiles of
    every ceil(groups / 8)-th group (70001: also the torch path's column chunks)."""
    s = _spread_samples(numel, seed=numel)
    d = cestac_digits(s, "fp64")
    groups = -(-numel // 128)
    stride = -(-groups // 8) if groups > 8 else 1
    keep = torch.cat([torch.arange(g * 128, min(g * 128 + 128, numel))
                      for g in range(0, groups, stride)])
    assert (stride == 1) == (numel <= 1024) and (512 <= keep.numel() or numel < 512)
    d = d[keep].sort().values
    st = digit_stats(s, "fp64")
    for q, got in ((0.1, st.p10), (0.5, st.p50)):
        exact = d[int(math.floor(q * (keep.numel() - 1)))].item()
        # a bin is 1/16 of an octave of the variance (0.0094 digits), read off the bits with a
        # piecewise-linear logarithm (within 0.013 digits)
        assert got == pytest.approx(exact, abs=0.023), (q, got, exact)


def test_quantiles_at_the_clamps():
    cap = get_format("fp16").digit_cap
    ident = torch.full((3, 50), 2.0, dtype=torch.float32)
    assert digit_stats(ident, "fp16").p10 == cap
    wild = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    st = digit_stats(wild, "fp16")
    assert st.p10 == 0.0 and st.p50 == 0.0


def test_underflow_count():
    from fxstab.numerics.digits import underflow_count
    fp16 = get_format("fp16")
    x = torch.tensor([[1.0, 1e-6, 0.0, -1e-5, 6.2e-5, math.inf],
                      [1.0, 1e-6, 0.0, -1e-4, 6.2e-5, math.nan],
                      [1.0, 1e-6, 0.0, -1e-4, 6.2e-5, 1.0]])
    # 1e-6 (every sample), -1e-5 (one sample) are below fp16's smallest normal 6.1e-5;
    # zeros, 6.2e-5 and non-finite values are not
    assert fp16.min_normal < 6.2e-5
    assert underflow_count(x, fp16) == 2
    assert underflow_count(x, "bf16") == 0
