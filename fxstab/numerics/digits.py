"""The CESTAC estimator of significant digits (docs/design.md §2).

For N samples x_1..x_N of one value (leading dimension of a tensor), the number of decimal
digits the samples have in common, at confidence ``c``, is

    C = log10( sqrt(N) * |mean| / (t * sigma) )

with ``sigma`` the sample standard deviation (N-1 denominator) and ``t`` the two-sided Student-t
quantile with N-1 degrees of freedom (4.303 for N=3, c=0.95). Conventions: all samples
identical -> the format's cap p*log10(2); any sample NaN/inf -> 0; mean 0 with spread -> 0;
clipped to [0, cap]. An element whose samples are not all exactly zero and whose C is below
``zero_threshold`` (0.5: zero digits once rounded, as CADNA prints) is a computational zero.

The implementation evaluates sigma/|mean| from the relative deviations (x_i - mean)/|mean|, which
is the same quantity but cannot underflow for tiny values or overflow for huge ones, with the
corrected two-pass variance so that the rounding of the mean does not bias sigma.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional, Sequence

import torch

from .formats import FormatLike, get_format
from .randbits import CPU_CHUNK

__all__ = [
    "student_t", "cestac_digits", "computational_zero", "digit_stats", "DigitStats",
    "format_stochastic", "digits_cap", "stats_vector", "stats_from_list", "empty_stats",
    "normwise_digits", "underflow_count", "true_digits", "extra_stats", "merge_stats",
    "STATS_LEN", "EXTRA_STATS", "StatsRow", "MIN", "ZEROS", "NON_FINITE", "run_shift",
    "run_digits", "ERROR_RATIO",
]

ZERO_THRESHOLD = 0.5

class StatsRow(NamedTuple):
    """The layout of a statistics row (:func:`stats_vector`, the fused kernels' buffers, which
    hold these floats in this order): the six digit reductions, then the extras."""

    sum_digits: float  # the digits of every element, summed
    min: float
    max: float
    zeros: float  # computational zeros
    non_finite: float  # elements with a NaN/inf sample
    numel: float
    mean_sq: float  # squared Frobenius norm of the sample means (normwise digits)
    var_sq: float  # ... of the sample standard deviations
    underflow: float  # elements the rounding took to zero or a subnormal (docs/design.md §2)
    p10: float  # the 10% and 50% quantiles of the digits
    p50: float
    sum_run: float  # the expected digits of a round-to-nearest run (run_digits), summed


# the positions of a row that the rules read by name (a row is a list or a kernel's buffer)
MIN, ZEROS, NON_FINITE = (StatsRow._fields.index(f) for f in ("min", "zeros", "non_finite"))
EXTRA_STATS = StatsRow._fields[6:]
STATS_LEN = len(StatsRow._fields)
QUANTILES = (0.1, 0.5)
# Quantile bins: the top 16 bits of the fp64 relative sample variance s^2 / mean^2 (sign,
# exponent and 4 significand bits: 16 bins an octave, at most 0.013 digits wide).
_BIN_SHIFT = 48
# The quantiles sample every ceil(groups / _QGROUPS)-th group of _GROUP consecutive elements
# (the fused kernels' groups): all elements up to 1024, then 512-1024 of them (a p10 within
# about 1% of its rank; a histogram increment per element costs as much as the norms).
_GROUP = 128
_QGROUPS = 8


def empty_stats(cap: float) -> list:
    """The statistics of a tensor without elements: nothing lost, every digit the cap."""
    return [0.0, cap, cap, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, cap, cap, 0.0]


# ------------------------------------------------------------ expected digits of a real run
# How much wider one operation's rounding error is in a mode than in round-to-nearest (the
# standard deviations, a value uniform within its ulp): random rounding (up or down with
# probability 1/2) u/sqrt(3) against u/sqrt(12); stochastic rounding u/sqrt(6). The other
# modes leave the samples identical (their digits are the cap).
ERROR_RATIO = {"random": 2.0, "stochastic": math.sqrt(2.0)}
_EULER_GAMMA = 0.5772156649015329


def _digamma(x: float) -> float:
    """psi(x) for x > 0: the recurrence up to x >= 6, then the asymptotic series."""
    acc = 0.0
    while x < 6.0:
        acc -= 1.0 / x
        x += 1.0
    f = 1.0 / (x * x)
    return acc + math.log(x) - 0.5 / x - f * (1 / 12 - f * (1 / 120 - f * (1 / 252 - f / 240)))


@functools.lru_cache(maxsize=64)
def run_shift(n_samples: int, rounding: str = "random") -> float:
    """The digits a round-to-nearest run keeps beyond ``-log10(s / |mean|)`` of ``n_samples``
    samples in ``rounding`` (docs/digit-maps.md, "Expected digits of a real run").

    Three known terms: the sample spread of N normal samples under-reads sigma on a log scale
    (``E[-log10(s / sigma)] = -(psi((N-1)/2) + ln(2/(N-1))) / (2 ln 10)``, 0.125 for N = 3: it is
    taken off); the run's error is sigma_RN |Z| with Z standard normal, whose
    ``E[-log10|Z|] = (gamma + ln 2) / (2 ln 10) = 0.276`` is added; and sigma_RN is the samples'
    sigma divided by :data:`ERROR_RATIO` (log10 2 = 0.301 added for random rounding). For
    N = 3, random rounding: 0.452 (CESTAC's own constant ``log10(sqrt(N) / t)`` is -0.395).
    """
    if n_samples < 2:
        raise ValueError(f"the expected digits need N >= 2 samples, got {n_samples}")
    k = n_samples - 1
    spread_bias = -(_digamma(k / 2.0) + math.log(2.0 / k)) / (2.0 * math.log(10.0))
    gauss = (_EULER_GAMMA + math.log(2.0)) / (2.0 * math.log(10.0))
    ratio = ERROR_RATIO.get(str(getattr(rounding, "value", rounding)), 1.0)
    return -spread_bias + gauss + math.log10(ratio)


def _run_columns(ss: torch.Tensor, m2: torch.Tensor, finite: torch.Tensor, same: torch.Tensor,
                 shift: float, cap: float) -> torch.Tensor:
    """Per element, the expected digits of a round-to-nearest run from the moments of its
    samples (:func:`_moments2`): ``shift - log10(s^2 / mean^2) / 2`` clipped to [0, cap];
    identical finite samples the cap, a zero mean with spread or a non-finite sample 0 (the
    conventions of the CESTAC digits)."""
    r = (torch.log10(ss / m2) * -0.5 + shift).clamp_(0.0, cap)
    r = torch.where(m2 == 0, torch.zeros_like(r), r.nan_to_num(nan=0.0))
    r = torch.where(same, torch.full_like(r, cap), r)
    return torch.where(finite, r, torch.zeros_like(r))


def run_digits(samples: torch.Tensor, format: Optional[FormatLike] = None,
               rounding: str = "random") -> torch.Tensor:
    """Per element of ``samples`` ([N, ...], N >= 2), the digits a round-to-nearest run in
    ``format`` is expected to keep (:func:`run_shift`): an estimate to compare with a real run,
    not a bound (CESTAC's :func:`cestac_digits` is the bound); returns shape ``[...]``."""
    _check_samples(samples)
    n = samples.shape[0]
    shift, cap = run_shift(n, rounding), digits_cap(format, samples.dtype)
    flat = samples.reshape(n, -1)
    ss, m2, finite, same = _moments2(flat, n)
    return _run_columns(ss, m2, finite, same, shift, cap).to(samples.dtype).reshape(
        samples.shape[1:])


# --------------------------------------------------------------------------- Student t
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=256)
def student_t(n_samples: int, confidence: float = 0.95) -> float:
    """Two-sided Student-t quantile for N samples (N-1 degrees of freedom).

    ``student_t(3, 0.95) == 4.3027...``; exact to about 1e-12 relative (bisection on the CDF).
    """
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 2:
        raise ValueError(f"the CESTAC estimator needs n_samples >= 2 (an integer), got {n_samples!r}")
    if not (isinstance(confidence, (int, float)) and 0.0 < confidence < 1.0):
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    df = float(n_samples - 1)
    p = 0.5 * (1.0 + confidence)
    if df == 1.0:  # Cauchy: closed form
        return math.tan(math.pi * (p - 0.5))
    if df == 2.0:  # closed form
        a = 4.0 * p * (1.0 - p)
        return 2.0 * (p - 0.5) * math.sqrt(2.0 / a)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * hi:
            break
    return 0.5 * (lo + hi)


# --------------------------------------------------------------------------- digits
def digits_cap(format: Optional[FormatLike], dtype: torch.dtype) -> float:
    """p*log10(2) of ``format``, or of ``dtype`` when no format is given."""
    return get_format(format if format is not None else dtype).digit_cap


def cestac_digits(
    samples: torch.Tensor,
    format: Optional[FormatLike] = None,
    confidence: float = 0.95,
) -> torch.Tensor:
    """Per-element CESTAC digits of ``samples`` ([N, ...], N >= 2); returns shape ``[...]``.

    Args:
        samples: Stacked samples along dim 0, floating dtype.
        format: Simulated format; sets the cap (p*log10 2). Defaults to the samples' dtype.
        confidence: Confidence of the Student-t interval.
    """
    _check_samples(samples)
    n = samples.shape[0]
    t = student_t(n, confidence)
    cap = digits_cap(format, samples.dtype)
    return _digits(samples, n, t, cap)


def _check_samples(samples: torch.Tensor) -> None:
    if not isinstance(samples, torch.Tensor) or not samples.is_floating_point():
        raise ValueError(f"samples must be a floating tensor, got "
                         f"{getattr(samples, 'dtype', type(samples).__name__)}")
    if samples.dim() < 1:
        raise ValueError("samples need a leading sample dimension [N, ...], got a 0-d tensor")


def _masks(samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(identical, finite, exact_zero) per element from one min/max pass over the samples.

    min and max propagate NaN, so min == max is false and min/max are not finite whenever a
    sample is NaN; an infinite sample makes min or max infinite; -0 == 0.
    """
    mn, mx = torch.aminmax(samples, dim=0)
    identical = mn == mx
    finite = torch.isfinite(mn) & torch.isfinite(mx)
    exact_zero = identical & (mx == 0)
    return identical, finite, exact_zero


def _digits(samples: torch.Tensor, n: int, t: float, cap: float,
            masks: Optional[tuple] = None) -> torch.Tensor:
    # Sum of x_i / N: no overflow for values near the dtype's max (three fp32 samples near
    # 3e38, a bf16 softmax that is about to overflow, have a finite mean).
    mean = (samples / n).sum(0)
    absmean = mean.abs()
    rel = (samples - mean).div_(absmean)
    # Corrected two-pass variance: sum(r^2) - (sum r)^2 / N removes the error of the rounded
    # mean exactly (sum (x - m~)^2 = sum (x - m)^2 + N (m - m~)^2). Without it an fp64 mean
    # one ulp off biases sigma^2 by (ulp / sigma)^2: 1e-8 relative at a 1e-12 spread, and a
    # factor 1.5 for samples one ulp apart.
    s1 = rel.sum(0)
    var = (rel.square_().sum(0) - s1 * s1 / n).clamp_(min=0.0).div_(n - 1)
    c = var.log10_().mul_(-0.5).add_(math.log10(math.sqrt(n) / t))
    c = c.nan_to_num_(nan=0.0, posinf=cap, neginf=0.0).clamp_(0.0, cap)
    identical, finite, _ = masks if masks is not None else _masks(samples)
    c.masked_fill_(absmean == 0, 0.0)
    c.masked_fill_(identical, cap)
    return c.masked_fill_(~finite, 0.0)


def computational_zero(
    samples: torch.Tensor,
    digits: Optional[torch.Tensor] = None,
    format: Optional[FormatLike] = None,
    confidence: float = 0.95,
    threshold: float = ZERO_THRESHOLD,
) -> torch.Tensor:
    """Boolean mask of computational zeros ("@.0"): not all samples exactly 0, finite, and
    fewer than ``threshold`` digits."""
    if digits is None:
        digits = cestac_digits(samples, format, confidence)
    _, finite, exact_zero = _masks(samples)
    return finite & ~exact_zero & (digits < threshold)


@dataclass(frozen=True)
class DigitStats:
    """Reductions of per-element digits over one tensor (one operator output)."""

    avg: float
    min: float
    max: float
    numel: int
    zero_fraction: float  # computational zeros / numel
    non_finite: int  # elements with a NaN/inf sample
    normwise: float = math.nan  # the CESTAC estimate of the tensor as a whole
    p10: float = math.nan  # quantiles of the per-element digits
    p50: float = math.nan
    underflow: int = 0  # elements a rounding took below the smallest normal (to 0 or subnormal)
    run: float = math.nan  # the avg digits a round-to-nearest run is expected to keep

    def as_dict(self) -> dict:
        return asdict(self)


def normwise_digits(mean_sq: float, var_sq: float, non_finite: int, n: int, t: float,
                    cap: float) -> float:
    """CESTAC digits of a tensor as a whole: ``log10(sqrt(N) ||mean|| / (t ||std||))``.

    ``mean_sq`` and ``var_sq`` are the squared Frobenius norms of the elements' sample means and
    sample standard deviations (N-1 denominator). The element conventions carry over: any
    non-finite sample gives 0, no spread at all the cap, a zero mean with spread 0; clipped to
    [0, cap]. NaN when a norm overflowed fp64 (means beyond 1e154).
    """
    if non_finite:
        return 0.0
    if var_sq == 0:
        return cap
    if mean_sq == 0:
        return 0.0
    if not (math.isfinite(mean_sq) and math.isfinite(var_sq)):
        return math.nan
    d = math.log10(math.sqrt(n) / t) + 0.5 * (math.log10(mean_sq) - math.log10(var_sq))
    return min(max(d, 0.0), cap)


def stats_from_list(v: "torch.Tensor | list", n: int, t: float, cap: float) -> DigitStats:
    """A :class:`DigitStats` from a statistics vector (tensor or list; empty: the cap)."""
    v = v.tolist() if isinstance(v, torch.Tensor) else v
    total, mn, mx, zeros, nf, numel, msq, vsq, under, p10, p50, run = v
    if numel == 0:
        return DigitStats(cap, cap, cap, 0, 0.0, 0, cap, cap, cap, 0, cap)
    return DigitStats(total / numel, mn, mx, int(numel), zeros / numel, int(nf),
                      normwise_digits(msq, vsq, nf, n, t, cap), p10, p50, int(under),
                      run / numel)


def digit_stats(
    samples: torch.Tensor,
    format: Optional[FormatLike] = None,
    confidence: float = 0.95,
    zero_threshold: float = ZERO_THRESHOLD,
    rounding: str = "random",
) -> DigitStats:
    """avg/min/max digits, numel, fraction of computational zeros and non-finite count; ``run``
    the avg digits a round-to-nearest run is expected to keep (the samples in ``rounding``).

    An empty tensor has no element that lost digits: its avg/min/max are the cap.
    """
    _check_samples(samples)
    n = samples.shape[0]
    t = student_t(n, confidence)  # validates N and the confidence even for empty tensors
    cap = digits_cap(format, samples.dtype)
    return stats_from_list(stats_vector(samples, t, cap, zero_threshold,
                                        shift=run_shift(n, rounding)), n, t, cap)


def stats_vector(samples: torch.Tensor, t: float, cap: float,
                 zero_threshold: float = ZERO_THRESHOLD, underflow: int = 0,
                 shift: Optional[float] = None) -> list:
    """The statistics of :func:`digit_stats` as a list of :data:`STATS_LEN` floats: [sum of
    digits, min, max, computational zeros, non-finite elements, numel, squared norm of the
    means, squared norm of the standard deviations, underflowed elements, p10, p50, sum of the
    expected digits of a real run].

    ``samples`` is [N, ...]; ``underflow`` is the count of :func:`underflow_count` on the
    samples before they were rounded (the caller has them); ``shift`` the
    :func:`run_shift` of the analysis (default: N samples of random rounding). The quantiles
    are the "lower" ones
    (the element of rank floor(q (numel - 1)) in ascending digits) at the resolution of the
    bins (16 per octave of the relative variance, at most 0.013 digits; the fused kernels use
    the same bins).
    """
    n = samples.shape[0]
    flat = samples.reshape(n, -1)
    if flat.shape[1] == 0:
        return empty_stats(cap)
    # Column chunks bound the temporaries on the CPU; sums, mins and maxes combine.
    parts = torch.stack([_stats_columns(flat[:, a:a + step], n, t, cap, zero_threshold)
                         for a, step in _chunks(flat)])
    head = torch.stack([parts[:, 0].sum(), parts[:, 1].min(), parts[:, 2].max(),
                        parts[:, 3].sum(), parts[:, 4].sum(), parts[:, 5].sum()]).tolist()
    return head + extra_stats(flat, t, cap, underflow, shift)


def extra_stats(samples: torch.Tensor, t: float, cap: float, underflow: int = 0,
                shift: Optional[float] = None) -> list:
    """The extras of a statistics vector (:data:`EXTRA_STATS`) of ``samples`` [N, ...]: what
    the fused kernels compute beside the six digit reductions (the Triton path and the
    references call this); ``shift``: the :func:`run_shift` of the expected digits of a real
    run (default: N samples of random rounding).

    The norms and the expected digits cover every element. The quantiles sample the elements in groups of 128
    consecutive ones, every ``ceil(groups / 8)``-th group (all of them up to 8 groups, 1024
    elements), as the kernels do: the histogram costs an increment per element it holds.
    """
    n = samples.shape[0]
    flat = samples.reshape(n, -1)
    numel = flat.shape[1]
    if numel == 0:
        return empty_stats(cap)[6:]
    consts = _extras_constants(n, t, cap)
    shift = run_shift(n) if shift is None else shift
    sums = None
    for a, step in _chunks(flat):  # norms and expected digits over every element
        ss, m2, finite, same = _moments2(flat[:, a:a + step], n)
        zero = torch.zeros((), dtype=torch.float64, device=flat.device)
        part = torch.stack([torch.where(finite, m2, zero).sum(), torch.where(finite, ss, zero).sum(),
                            _run_columns(ss, m2, finite, same, shift, cap).sum()])
        sums = part if sums is None else sums + part
    groups = -(-numel // _GROUP)
    stride = -(-groups // _QGROUPS) if groups > _QGROUPS else 1
    if stride > 1:
        cols = (torch.arange(0, groups, stride, device=flat.device).unsqueeze(1) * _GROUP
                + torch.arange(_GROUP, device=flat.device)).reshape(-1)
        sampled = flat[:, cols[cols < numel]]
    else:
        sampled = flat
    counts = _bins(sampled, n, consts).tolist()
    msq, vsq, run = sums.tolist()
    return [msq, vsq, float(underflow)] + [
        _hist_quantile(counts, consts, sampled.shape[1], q, cap) for q in QUANTILES] + [run]


def _chunks(flat: torch.Tensor) -> list:
    """(start, width) of the column chunks that bound the temporaries on the CPU."""
    step = CPU_CHUNK if flat.device.type == "cpu" else max(flat.shape[1], 1)
    return [(a, step) for a in range(0, flat.shape[1], step)]


def merge_stats(parts: Sequence[Sequence[float]]) -> list:
    """One statistics vector of several tensors (an operator's outputs): sums add, min and max
    combine; the quantiles are not kept per element, so theirs is the numel-weighted mean."""
    numel = sum(p[5] for p in parts)
    out = [sum(p[0] for p in parts), min(p[1] for p in parts), max(p[2] for p in parts),
           sum(p[3] for p in parts), sum(p[4] for p in parts), numel,
           sum(p[6] for p in parts), sum(p[7] for p in parts), sum(p[8] for p in parts)]
    for j in (9, 10):
        out.append(sum(p[j] * p[5] for p in parts) / numel if numel else parts[0][j])
    out.append(sum(p[11] for p in parts))
    return out


def underflow_count(samples: torch.Tensor, format: FormatLike) -> int:
    """Elements of ``samples`` ([N, ...], before rounding) whose value is finite, non-zero and
    below ``format``'s smallest normal in some sample: rounding takes it to a subnormal or to
    zero, where the format keeps fewer digits than it reports (all samples may agree on 0)."""
    a = samples.reshape(samples.shape[0], -1).abs()
    tiny = (a > 0) & (a < get_format(format).min_normal)
    return int(tiny.any(0).sum())


def _extras_constants(n: int, t: float, cap: float) -> tuple:
    """(K, relative variance of the cap's digits, of 0 digits, the cap's bin, bin count)."""
    k0 = math.log10(math.sqrt(n) / t)
    rv_cap = 10.0 ** (2.0 * (k0 - cap))
    rv_zero = 10.0 ** (2.0 * k0)
    b_cap = struct.unpack("<q", struct.pack("<d", rv_cap))[0] >> _BIN_SHIFT
    nbins = (struct.unpack("<q", struct.pack("<d", rv_zero))[0] >> _BIN_SHIFT) - b_cap + 1
    return k0, rv_cap, rv_zero, b_cap, nbins


def _moments2(samples: torch.Tensor, n: int) -> tuple:
    """(s^2, mean^2, finite, identical) per element of ``samples`` [N, M]: the fused kernels'
    extras_block operation for operation. The mean in the samples' dtype as the digits take it
    (sum of x_i * (1 / n): no overflow near the dtype's maximum), the rest in fp64."""
    inv = 1.0 / n
    m = samples[0] * inv
    for i in range(1, n):
        m = m + samples[i] * inv
    md = m.double()
    ss = torch.zeros_like(md)
    for i in range(n):
        ss += (samples[i].double() - md).square()
    ss *= 1.0 / (n - 1)
    m2 = md * md
    finite = ((m2 - m2) == 0) & ((ss - ss) == 0)  # a mean beyond 1e154 (fp64) counts as not
    same = (samples == samples[:1]).all(0)
    return ss, m2, finite, same


def _bins(samples: torch.Tensor, n: int, consts: tuple) -> torch.Tensor:
    """The digit histogram (int64 [bins + 2]: the bins, then 0 digits, then the cap's) of
    ``samples`` [N, M]. The bin of a relative variance r = s^2 / mean^2 is read off
    bits(s^2) - bits(mean^2) + bits(1.0), the bit pattern of r up to mean^2's significand (no
    division; within 0.013 digits)."""
    k0, rv_cap, rv_zero, b_cap, nbins = consts
    ss, m2, finite, same = _moments2(samples, n)
    bits = ss.view(torch.int64) - m2.view(torch.int64) + (1023 << 52)
    idx = ((bits >> _BIN_SHIFT) - b_cap).clamp_(0, nbins - 1)
    zero_cls = ~finite | (~same & ((m2 == 0) | ~(ss < rv_zero * m2)))
    cap_cls = ~zero_cls & (same | (ss <= rv_cap * m2))
    idx = torch.where(zero_cls, nbins, torch.where(cap_cls, nbins + 1, idx))
    return torch.bincount(idx, minlength=nbins + 2)


def _hist_quantile(counts: list, consts: tuple, numel: int, q: float, cap: float) -> float:
    """The fused kernels' ext_quantile: ascending digits are 0 digits, the bins from the
    largest relative variance down, then the cap's."""
    k0, _, _, b_cap, nbins = consts
    r = int(math.floor(q * (numel - 1)))
    cum = counts[nbins]
    if r < cum:
        return 0.0
    for b in range(nbins - 1, -1, -1):
        cum += counts[b]
        if r < cum:
            bits = ((b + b_cap) << _BIN_SHIFT) | (1 << (_BIN_SHIFT - 1))
            rv = struct.unpack("<d", struct.pack("<q", bits))[0]
            return min(max(k0 - 0.5 * math.log10(rv), 0.0), cap)
    return cap



def _stats_columns(samples: torch.Tensor, n: int, t: float, cap: float,
                   zero_threshold: float) -> torch.Tensor:
    masks = _masks(samples)
    d = _digits(samples, n, t, cap, masks)
    _, finite, exact_zero = masks
    zeros = finite & ~exact_zero & (d < zero_threshold)
    dd = d.double()
    numel = torch.tensor(float(d.numel()), dtype=torch.float64, device=d.device)
    return torch.stack([dd.sum(), dd.min(), dd.max(), zeros.sum().double(),
                        (~finite).sum().double(), numel])


# --------------------------------------------------------------------------- printing
def true_digits(value: torch.Tensor, reference: torch.Tensor, cap: float) -> torch.Tensor:
    """Per element, the significant digits ``value`` shares with an exact ``reference`` (an
    fp64 run of the same program): ``-log10(|value - reference| / |reference|)`` clamped to
    ``[0, cap]``; equal values keep ``cap``, a NaN/inf or a non-zero value against a zero
    reference keeps 0. The measure a real low-precision run is judged by."""
    v = value.detach().to(torch.float64)
    r = reference.detach().to(torch.float64).expand_as(v) if v.dim() else \
        reference.detach().to(torch.float64)
    err = (v - r).abs()
    d = torch.where(r != 0, -torch.log10(err / r.abs()), torch.zeros_like(v))
    d = d.clamp(0.0, cap)
    d = torch.where(err == 0, torch.full_like(v, cap), d)
    return torch.where(torch.isfinite(v) & torch.isfinite(r), d, torch.zeros_like(v))


def format_stochastic(mean: float, digits: float, exact_zero: bool = False,
                      cap: float = 15.95) -> str:
    """CADNA-style text of a stochastic value: its reliable digits only.

    The digits are rounded to the nearest integer (CADNA prints ``C`` rounded, so C < 0.5 is a
    computational zero, shown ``@.0``). ``format_stochastic(3.4999993, 7.3)`` gives
    ``'0.3499999E+001'``; an exact zero prints its cap's worth of zeros.
    """
    if exact_zero:
        k = max(1, int(math.floor(cap + 0.5)))
        return "0." + "0" * k + "E+000"
    if not math.isfinite(mean):
        return "NaN" if math.isnan(mean) else ("-Inf" if mean < 0 else "Inf")
    k = int(math.floor(digits + 0.5)) if math.isfinite(digits) else 0
    if k <= 0:
        return "@.0"
    sign = "-" if mean < 0 else ""
    # Scientific form d.ddd × 10^e rounded to k digits, rewritten as 0.dddd × 10^(e+1).
    text = f"{abs(mean):.{k - 1}e}"
    mant, exp = text.split("e")
    digits_str = mant.replace(".", "")
    exponent = int(exp) + 1
    return f"{sign}0.{digits_str}E{'+' if exponent >= 0 else '-'}{abs(exponent):03d}"
