"""The fused CPU kernels' expected digits of a round-to-nearest run (the statistics row's
``sum_run``, slot 11) against the torch reference (fxstab.numerics.digits.stats_vector, whose
per-element digits are _run_columns over _moments2): every path of the kernels that measures
elements (the fp32 8-lane and fp64 4-lane blocks with and without per-element digits, their
tails and the extras block, the lanes that take the reference's own arithmetic, the threads'
merge), every N, formats from fp8 to fp64, and the conventions (identical samples, zero
means, non-finite samples)."""

from __future__ import annotations

import math

import pytest
import torch

from fxstab.cpu import bindings as native
from fxstab.numerics.digits import (
    STATS_LEN, StatsRow, digits_cap, run_shift, stats_vector, student_t,
)
from fxstab.numerics.formats import get_format
from fxstab.numerics.rounding import Rounding

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for fxstab.cpu.bindings")

RUN = StatsRow._fields.index("sum_run")
# The kernels sum the run digits as logarithms of products of relative variances (fp32
# variances and products for fp32 samples: ~1e-8 digits an element, ~1e-7 relative) or take
# them per element from a log10 series (1e-14); the relative tolerance and one per element
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
ATOL = {torch.float32: 5e-8, torch.float64: 1e-14}
_MAN_BITS = {torch.float32: 23, torch.float64: 52}


def _want(samples: torch.Tensor, fmt, shift: float) -> float:
    """The reference's sum_run of the samples the kernel measured."""
    n = samples.shape[0]
    return stats_vector(samples, student_t(n), digits_cap(fmt, samples.dtype), shift=shift)[RUN]


def _close(got: float, want: float, dtype: torch.dtype, numel: int) -> bool:
    return abs(got - want) <= TOL[dtype] * abs(want) + ATOL[dtype] * numel


def _samples(dtype: torch.dtype, n: int, numel: int, seed: int, bits: int) -> torch.Tensor:
    """Samples whose relative spreads run from none to overwhelming (the run digits from the
    cap to 0), over a wide range of magnitudes, with the special elements at the front: all
    samples identical, all zero, a zero mean with spread, a NaN, an inf, identical infinities,
    subnormal and huge values, samples a few ulps of the dtype apart (the reference's mean
    rounding matters), tiny and huge fp64 means (its mean^2 under- and overflows)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g, dtype=torch.float64) * \
        torch.exp2(torch.randint(-30, 30, (numel,), generator=g).double())
    rel = torch.exp2(-torch.randint(0, bits + 6, (numel,), generator=g).double())
    x = (base * (1 + rel * torch.randn(n, numel, generator=g, dtype=torch.float64))).to(dtype)
    finfo = torch.finfo(dtype)
    eps = finfo.eps
    ulps = torch.arange(n, dtype=torch.float64)  # 0, 1, 2, ... ulps apart
    special = [
        torch.full((n,), 1.5, dtype=torch.float64),  # identical
        torch.zeros(n),  # exact zeros
        torch.linspace(-1.0, 1.0, n, dtype=torch.float64),  # zero mean (n odd: exactly)
        torch.tensor([float("nan")] + [1.0] * (n - 1)),
        torch.tensor([1.0] * (n - 1) + [float("inf")]),
        torch.full((n,), float("-inf"), dtype=torch.float64),
        finfo.tiny * 2.0 ** -3 * (1 + ulps * 0.25),  # a spread of subnormals
        torch.full((n,), finfo.tiny * 0.375, dtype=torch.float64),  # identical subnormals
        finfo.tiny * (1 + ulps * 2.0 ** -12),  # the smallest normals, a tiny spread
        # a few of the smallest subnormals: the mean's rounding is much of it
        torch.tensor([5.0, 6.0, 5.0, 7.0, 6.0][:n], dtype=torch.float64) * finfo.tiny *
        2.0 ** -_MAN_BITS[dtype],
        finfo.max * (1 - ulps * eps),  # the dtype's largest values (the mean may overflow)
        torch.full((n,), finfo.max, dtype=torch.float64),
        0.7 * (1 + ulps * eps),  # a few ulps apart
        -3.1 * (1 + ulps * 2 * eps),
        1e-200 * (1 + ulps * 1e-3),  # fp64: mean^2 underflows
        1e200 * (1 + ulps * 1e-3),  # fp64: mean^2 overflows
        torch.full((n,), 1e200, dtype=torch.float64),
        1e-30 * (1 + ulps * 1e-9),
    ]
    special = torch.stack([s.double() for s in special], dim=1).to(dtype)
    k = min(special.shape[1], numel)
    x[:, :k] = special[:, :k]
    return x.contiguous()


_CASES = [(torch.float32, "bf16"), (torch.float32, "fp16"), (torch.float32, "fp8_e4m3"),
          (torch.float32, (8, 23)), (torch.float64, "fp32"), (torch.float64, "fp64")]


@pytest.mark.parametrize("dtype,fmt", _CASES)
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("numel", [1, 7, 1000, 70001])
def test_sum_run_matches_the_reference(dtype, fmt, n, numel):
    """Slot 11 is the reference's sum over every element of the rounded samples (or of the
    samples as given, without a mode), with and without per-element digits and a zero mask
    (their own fp32 block), for one element up to more than a chunk split between threads."""
    f = get_format(fmt)
    x = _samples(dtype, n, numel, seed=n * numel, bits=f.man_bits + 1)
    shift = run_shift(n)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for mode in (None, Rounding.RANDOM):
            if mode is not None and f.man_bits >= _MAN_BITS[dtype]:
                continue  # rounding into the dtype's own format changes nothing
            want = None
            for want_digits in (False, True):
                out, st, _ = native.round_stats(x, f, mode, 11, want_digits=want_digits,
                                                as_list=True)
                assert len(st) == STATS_LEN
                if want is None:
                    want = _want(out, f, shift)
                    assert want > 0 or numel == 1
                assert _close(st[RUN], want, dtype, numel), (mode, want_digits, st[RUN], want)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "bf16"), (torch.float32, (8, 23)),
                                       (torch.float64, "fp32"), (torch.float64, "fp64")])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_given_shift_is_the_one_measured(dtype, fmt, n):
    """round_stats, round_perturb, a Rounder, Prepared and Binary measure the run digits with
    the shift they are given (None: N samples of random rounding); a shift 0.05 digits off
    moves the sum far beyond the tolerance, so a kernel that took another shift (or left the
    slot 0) fails."""
    f = get_format(fmt)
    numel = 5000
    x = _samples(dtype, n, numel, seed=n, bits=f.man_bits + 1)
    mode = Rounding.RANDOM if f.man_bits < _MAN_BITS[dtype] else None
    ref_out, st, _ = native.round_stats(x, f, mode, 3, as_list=True)
    default = _want(ref_out, f, run_shift(n))
    assert _close(st[RUN], default, dtype, numel)
    for shift in (0.0, 0.1, run_shift(n, "stochastic"), -1.5, 2.5):
        want = _want(ref_out, f, shift)
        assert not _close(want, default, dtype, numel)  # the check below can tell them apart
        assert not _close(_want(ref_out, f, shift + 0.05), want, dtype, numel)
        _, st, _ = native.round_stats(x, f, mode, 3, as_list=True, run_shift=shift)
        assert _close(st[RUN], want, dtype, numel), (shift, st[RUN], want)
        r = native.rounder(f, mode, dtype, n, run_shift=shift)
        _, rst, _, _ = r(x, 3)
        assert rst == st
        prep = native.Prepared(r, False)
        prep(x, 3)
        assert prep.stats[:] == st
        if mode is not None:
            # the statistics of the rounded samples, before the surrogate perturbs them
            _, pst, _ = native.round_perturb(x, f, mode, 3, 1e-3, 5, as_list=True,
                                             run_shift=shift)
            assert pst == st
            b = native.Binary(r, "mul")
            one = torch.ones((), dtype=dtype)
            assert b.reads(x, one)
            _, bst, _, _ = b(x, one, 3)
            assert bst == st


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_sum_run_of_a_million_elements(dtype, threads):
    """Each thread carries the run digits' product across its groups and reduces it once; the
    threads' sums merge: a million elements whose run digits span 0 to the cap."""
    g = torch.Generator().manual_seed(threads)
    base = torch.randn(1_000_003, generator=g, dtype=dtype)
    rel = torch.exp2(-torch.randint(0, 26, base.shape, generator=g)).to(dtype)
    x = torch.stack([base, base * (1 + rel), base * (1 - 0.5 * rel)])
    fmt = get_format("fp32")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        _, st, _ = native.round_stats(x, fmt, None, as_list=True)
    finally:
        torch.set_num_threads(old)
    want = _want(x, fmt, run_shift(3))
    assert _close(st[RUN], want, dtype, x.shape[1]), (st[RUN], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_conventions_of_whole_tensors(dtype, n):
    """Identical samples give the cap, zero means with spread and non-finite samples 0, in
    every lane and tail position (sizes around the 8- and 4-lane vectors and a group)."""
    fmt = get_format("fp32")
    cap = digits_cap(fmt, dtype)
    for numel in (1, 3, 4, 8, 13, 128, 131):
        v = torch.randn(numel, dtype=dtype)
        _, st, _ = native.round_stats(v.expand(n, numel).contiguous(), fmt, None, as_list=True)
        assert st[RUN] == pytest.approx(cap * numel, rel=TOL[dtype])
        z = torch.linspace(-1, 1, n, dtype=dtype).unsqueeze(1).expand(n, numel).contiguous()
        _, st, _ = native.round_stats(z * v.abs(), fmt, None, as_list=True)
        assert st[RUN] == pytest.approx(0.0, abs=ATOL[dtype] * numel)  # a zero mean (or a tiny one)
        w = v.expand(n, numel).clone()
        w[n - 1] = float("nan")
        _, st, _ = native.round_stats(w, fmt, None, as_list=True)
        assert st[RUN] == pytest.approx(0.0, abs=ATOL[dtype] * numel)


def test_run_shift_is_checked():
    x = torch.randn(3, 10)
    f = get_format("bf16")
    for bad in (float("nan"), float("inf"), 10.0, -5.0):
        with pytest.raises(ValueError, match="run_shift"):
            native.round_stats(x, f, Rounding.RANDOM, 1, run_shift=bad)
    a = native.round_stats(x, f, Rounding.RANDOM, 1, as_list=True)[1]
    b = native.round_stats(x, f, Rounding.RANDOM, 1, as_list=True, run_shift=run_shift(3))[1]
    assert a == b
    assert math.isfinite(a[RUN]) and a[RUN] > 0


@pytest.mark.parametrize("with_digits", [False, True])
def test_a_mean_that_overflows_counts_as_non_finite(with_digits):
    """fp32 samples near the dtype's largest value whose mean overflows (N = 10: each x / 10
    rounds up) have no finite mean^2 in the reference: 0 run digits, identical samples too;
    the same values with N = 3 keep a finite mean (the cap)."""
    mx = torch.finfo(torch.float32).max
    fmt = get_format("fp32")
    for n, per in ((10, 0.0), (3, digits_cap(fmt, torch.float32))):
        x = torch.randn(n, 37, generator=torch.Generator().manual_seed(n))
        x[:, :16] = mx
        _, st, _ = native.round_stats(x, fmt, None, want_digits=with_digits, as_list=True)
        want = _want(x, fmt, run_shift(n))
        assert _close(st[RUN], want, torch.float32, 37), (n, st[RUN], want)
        rest = _want(x[:, 16:], fmt, run_shift(n))
        assert want == pytest.approx(rest + 16 * per, abs=1e-9)
