"""Rounding into simulated formats (fxstab.numerics.rounding) against independent oracles.

Oracles: ml_dtypes casts (bf16, fp8) and NumPy casts (fp16, fp32) for round-to-nearest, their
``nextafter`` for the two neighbours, and the pure-Python grid arithmetic of ``_oracles`` for
every mode and every (exp_bits, man_bits) format.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _oracles import assert_same_bits, neighbours, oracle_round
from fxstab.numerics import randbits
from fxstab.numerics.formats import FORMATS, Format, get_format
from fxstab.numerics.rounding import (
    Rounding, quantize, round_samples, round_with_bits, sample_draws,
)

MODES = [m.value for m in Rounding]
RANDOM_MODES = ("random", "stochastic")
# derandomize: CI sees the same examples on every run; deadline off: a 2-core shared machine.
PROPS = settings(max_examples=40, derandomize=True, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Oracle dtypes for round-to-nearest from fp32 (docs/design.md §1: ml_dtypes for bf16/fp8, NumPy fp16).
NP_DTYPES = {
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
}


# ----------------------------------------------------------------------------- strategies
@st.composite
def formats_for(draw, wdtype: torch.dtype) -> Format:
    """A named or custom format that fits the working dtype."""
    if draw(st.booleans()):
        fmt = draw(st.sampled_from(sorted(FORMATS.values(), key=lambda f: f.name)))
    else:
        fmt = get_format((draw(st.integers(2, 11)), draw(st.integers(1, 52))))
    if not fmt.fits_in(wdtype):
        wm = 23 if wdtype == torch.float32 else 52
        e = min(fmt.exp_bits, 8 if wdtype == torch.float32 else 11)
        fmt = get_format((e, min(fmt.man_bits, wm - 2)))
        if not fmt.fits_in(wdtype):  # e=8 with m close to 23 loses the subnormal range
            fmt = get_format((min(e, 7), min(fmt.man_bits, 16)))
    assert fmt.fits_in(wdtype)
    return fmt


@st.composite
def values_for(draw, fmt: Format, wdtype: torch.dtype) -> list[float]:
    """Finite and special values around the format's range: arbitrary working-dtype values,
    grid points, exact ties, and the edges (max, overflow threshold, subnormals, zeros)."""
    wm, wemin, wemax = (23, -126, 127) if wdtype == torch.float32 else (52, -1022, 1023)
    m = fmt.man_bits
    lo_e = max(fmt.emin - m - 3, wemin - wm)
    hi_e = min(fmt.emax + 2, wemax)
    max_ulp = math.ldexp(1.0, fmt.emax - m)
    edges = [0.0, -0.0, math.inf, -math.inf, math.nan, fmt.max_normal, fmt.max_normal + max_ulp / 2,
             fmt.min_subnormal, fmt.min_subnormal / 2, 1.5 * fmt.min_subnormal, fmt.min_normal,
             fmt.min_normal - fmt.min_subnormal / 2, 1.0, 1.0 + 2.0**-m / 2]
    out = []
    for kind in draw(st.lists(st.sampled_from(["any", "any", "grid", "tie", "edge"]),
                              min_size=1, max_size=24)):
        sign = -1.0 if draw(st.booleans()) else 1.0
        if kind == "edge":
            out.append(sign * draw(st.sampled_from(edges)))
            continue
        e = draw(st.integers(lo_e, hi_e))
        if kind == "any":
            out.append(sign * math.ldexp(1.0 + draw(st.integers(0, 2**wm - 1)) / 2**wm, e))
            continue
        e = max(e, fmt.emin - m)
        q = math.ldexp(1.0, max(e, fmt.emin) - m)
        k = draw(st.integers(0, 2 ** (m + 1)))
        v = k * q + (q / 2 if kind == "tie" else 0.0)
        out.append(sign * v)
    # Cast to the working dtype (values that do not fit become inf or round: still valid input).
    with np.errstate(over="ignore"):
        return torch.tensor(np.array(out, dtype=np.float64).astype(
            np.float32 if wdtype == torch.float32 else np.float64)).tolist()


WDTYPES = pytest.mark.parametrize("wdtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])


# ----------------------------------------------------------------------------- oracle equality
@WDTYPES
@PROPS
@given(data=st.data())
def test_every_mode_matches_the_python_oracle(wdtype, data):
    """round_with_bits equals the exact Python oracle for every mode, given the same randomness.

    This fixes the semantics a kernel must reproduce: which neighbour each random bit or
    uniform word selects (stochastic: up iff word < floor(frac * 2**32)), and IEEE overflow.
    """
    fmt = data.draw(formats_for(wdtype), label="format")
    xs = data.draw(values_for(fmt, wdtype), label="values")
    x = torch.tensor(xs, dtype=wdtype)
    bits = data.draw(st.lists(st.integers(0, 1), min_size=len(xs), max_size=len(xs)))
    words = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(xs), max_size=len(xs)))
    for mode in MODES:
        rand = {"random": bits, "stochastic": words}.get(mode, [0] * len(xs))
        for saturate in (False, True):
            got = round_with_bits(x, fmt, Rounding(mode), torch.tensor(rand, dtype=torch.int64),
                                  saturate)
            want = torch.tensor([oracle_round(v, fmt, mode, r, saturate) for v, r in zip(xs, rand)],
                                dtype=wdtype)
            assert_same_bits(got, want, (fmt, mode, saturate))


@WDTYPES
@PROPS
@given(data=st.data())
def test_grid_bracketing_and_fixed_points(wdtype, data):
    """Properties without an oracle: every mode lands on the grid (re-rounding to nearest is
    the identity), down <= x <= up, random/stochastic pick one of down/up (in magnitude:
    zero/up-in-magnitude), and values on the grid are unchanged by every mode."""
    fmt = data.draw(formats_for(wdtype), label="format")
    xs = data.draw(values_for(fmt, wdtype), label="values")
    x = torch.tensor(xs, dtype=wdtype)
    finite = torch.isfinite(x) & (x.abs() <= fmt.max_normal)
    seed = data.draw(st.integers(0, 2**64 - 1), label="seed")
    res = {m: quantize(x, fmt, m, seed=seed) for m in MODES}
    for m, r in res.items():
        assert_same_bits(quantize(r, fmt, "nearest"), r, (fmt, m, "on grid"))
        assert r.dtype == x.dtype and r.shape == x.shape
    up, down = res["up"], res["down"]
    assert (down[finite] <= x[finite]).all() and (x[finite] <= up[finite]).all()
    for m in RANDOM_MODES:
        r = res[m]
        assert ((r == up) | (r == down))[finite].all(), (fmt, m)
    on_grid = finite & (up == down)
    for m, r in res.items():
        assert_same_bits(r[on_grid], x[on_grid], (fmt, m, "fixed point"))
    # zero = the neighbour of smaller magnitude; nearest is one of the two neighbours.
    assert (res["zero"].abs() <= x.abs())[finite].all()
    assert ((res["nearest"] == up) | (res["nearest"] == down))[finite].all()


# ----------------------------------------------------------------------------- casting oracles
def _all_values(np_dtype) -> np.ndarray:
    """Every finite value of an 8- or 16-bit dtype, as float64, sorted, both signs."""
    bits = np.arange(2 ** (8 * np.dtype(np_dtype).itemsize), dtype=np.uint64)
    v = bits.astype(np.uint8 if np.dtype(np_dtype).itemsize == 1 else np.uint16).view(np_dtype)
    with np.errstate(invalid="ignore"):
        v = v.astype(np.float64)
    return np.unique(v[np.isfinite(v)])


def _probe_points(np_dtype) -> np.ndarray:
    """Grid points, exact midpoints and the fp32 neighbours of each midpoint, plus the region
    past the largest value; all exactly representable in fp32."""
    v = _all_values(np_dtype)
    mid = (v[:-1] + v[1:]) / 2
    mid32 = mid.astype(np.float32)
    assert (mid32.astype(np.float64) == mid).all()  # midpoints of <=16-bit formats fit fp32
    big = float(v[-1])
    ulp = big - float(v[-2])
    with np.errstate(over="ignore"):  # bf16's overflow threshold is past fp32's max: inf
        tail = np.array([big + ulp / 2, big + ulp / 4, big + ulp, 2 * big, 1e30], dtype=np.float32)
    pts = np.concatenate([v.astype(np.float32), mid32, np.nextafter(mid32, np.float32(np.inf)),
                          np.nextafter(mid32, np.float32(-np.inf)), tail, -tail])
    return pts


@pytest.mark.parametrize("name", list(NP_DTYPES))
def test_nearest_up_down_equal_casts_exhaustively(name):
    """On every grid point, every tie and both fp32 neighbours of every tie of the format,
    nearest equals the ml_dtypes/NumPy cast bit for bit (including overflow to inf/NaN), and
    up/down equal the cast's nextafter neighbours (below the largest finite value)."""
    np_dtype = NP_DTYPES[name]
    pts = _probe_points(np_dtype)
    x = torch.from_numpy(pts)
    with np.errstate(over="ignore", invalid="ignore"):
        cast = pts.astype(np_dtype)
        want_nearest = torch.from_numpy(cast.astype(np.float32))
    assert_same_bits(quantize(x, name, "nearest"), want_nearest, name)
    big = float(np.finfo(np_dtype).max) if np_dtype is np.float16 else float(ml_dtypes.finfo(np_dtype).max)
    inside = np.abs(pts) < big
    p, c = pts[inside], cast[inside]
    cf = c.astype(np.float32)
    toward_up = np.nextafter(c, np.full_like(c, big))
    toward_down = np.nextafter(c, np.full_like(c, -big))
    want_up = np.where(cf >= p, cf, toward_up.astype(np.float32))
    want_down = np.where(cf <= p, cf, toward_down.astype(np.float32))
    xi = torch.from_numpy(p)
    assert_same_bits(quantize(xi, name, "up"), torch.from_numpy(want_up), (name, "up"))
    assert_same_bits(quantize(xi, name, "down"), torch.from_numpy(want_down), (name, "down"))


def test_fp32_from_fp64_equals_numpy_cast():
    """fp32 from fp64 input: all fp32 finite midpoints of a sample of fp32 values (random bit
    patterns, both ends of the range, subnormals), their fp64 neighbours, and nearest/up/down."""
    rng = np.random.default_rng(1234)
    pat = rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32)
    pat = np.concatenate([pat, np.arange(0, 64, dtype=np.uint32),  # subnormals incl. 1.5 min_sub
                          np.arange(0x7F7FFFC0, 0x7F800000, dtype=np.uint32)])
    v = pat.view(np.float32)
    v = v[np.isfinite(v)].astype(np.float64)
    with np.errstate(over="ignore"):
        nxt = np.nextafter(v.astype(np.float32), np.float32(np.inf)).astype(np.float64)
    mid = (v + nxt) / 2
    pts = np.concatenate([v, mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf)])
    pts = np.concatenate([pts, -pts, [1e300, -1e300, 2.0**128 - 2.0**103]])
    x = torch.from_numpy(pts)
    with np.errstate(over="ignore"):
        cast = pts.astype(np.float32)
    assert_same_bits(quantize(x, "fp32", "nearest"), torch.from_numpy(cast.astype(np.float64)))
    inside = np.isfinite(cast) & (np.abs(pts) < np.finfo(np.float32).max)
    p, c = pts[inside], cast[inside]
    big = np.float32(np.finfo(np.float32).max)
    want_up = np.where(c >= p, c, np.nextafter(c, big)).astype(np.float64)
    want_down = np.where(c <= p, c, np.nextafter(c, -big)).astype(np.float64)
    assert_same_bits(quantize(torch.from_numpy(p), "fp32", "up"), torch.from_numpy(want_up))
    assert_same_bits(quantize(torch.from_numpy(p), "fp32", "down"), torch.from_numpy(want_down))


# ----------------------------------------------------------------------------- edges
def _q(values, fmt, mode, dtype=torch.float32, **kw):
    return quantize(torch.tensor(values, dtype=dtype), fmt, mode, seed=0, **kw).tolist()


def test_subnormal_edges():
    for name in ("fp16", "bf16", "fp8_e5m2", "fp8_e4m3"):
        f = get_format(name)
        s = f.min_subnormal
        # ties to even: s/2 -> 0 (0 is even), 1.5 s -> 2 s, 2.5 s -> 2 s; just above s/2 -> s.
        got = _q([s / 2, 1.5 * s, 2.5 * s, 0.75 * s, s / 4], name, "nearest")
        assert got == [0.0, 2 * s, 2 * s, s, 0.0], name
        assert _q([s / 4, -s / 4], name, "up") == [s, -0.0]
        assert math.copysign(1, _q([-s / 4], name, "up")[0]) == -1  # -tiny rounds up to -0
        assert _q([s / 4, -s / 4], name, "down") == [0.0, -s]
        assert _q([s / 4, -s / 4], name, "zero") == [0.0, -0.0]
        # the last subnormal and the first normal
        assert _q([f.min_normal - s / 2], name, "nearest") == [f.min_normal]  # tie, even
        assert _q([f.min_normal - s / 4], name, "down") == [f.min_normal - s]


def test_signed_zeros_and_nan_pass_through():
    for mode in MODES:
        for name in ("bf16", "fp8_e4m3", (3, 2)):
            r = quantize(torch.tensor([0.0, -0.0, math.nan]), name, mode, seed=1)
            assert r[0].item() == 0 and not torch.signbit(r[0])
            assert r[1].item() == 0 and torch.signbit(r[1])
            assert torch.isnan(r[2])


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e5m2", (4, 2)])
def test_overflow_ieee_formats(name):
    # fp64 input: bf16's 4*max and max+ulp/2 are past fp32's range.
    def _q(values, fmt, mode, **kw):
        return quantize(torch.tensor(values, dtype=torch.float64), fmt, mode, seed=0, **kw).tolist()

    f = get_format(name)
    big = f.max_normal
    ulp = math.ldexp(1.0, f.emax - f.man_bits)
    inf = math.inf
    xs = [big, big + ulp / 4, big + ulp / 2, big + 3 * ulp / 4, 4 * big, inf]
    assert _q(xs, name, "nearest") == [big, big, inf, inf, inf, inf]  # tie at max+ulp/2 -> inf
    assert _q(xs, name, "up") == [big, inf, inf, inf, inf, inf]
    assert _q(xs, name, "down") == [big, big, big, big, big, inf]
    assert _q(xs, name, "zero") == [big, big, big, big, big, inf]
    neg = [-v for v in xs]
    assert _q(neg, name, "up") == [-big, -big, -big, -big, -big, -inf]
    assert _q(neg, name, "down") == [-big, -inf, -inf, -inf, -inf, -inf]
    assert _q(neg, name, "zero") == [-big, -big, -big, -big, -big, -inf]
    for mode in MODES:
        assert _q(xs + neg, name, mode, saturate=True) == [big] * 6 + [-big] * 6
    # random/stochastic just above max: inf when they went up, max when they went down.
    for mode in RANDOM_MODES:
        r = quantize(torch.full((4000,), big + ulp / 2), name, mode, seed=3)
        assert set(r.unique().tolist()) == {big, inf}


def test_overflow_fp8_e4m3fn_gives_nan():
    f = get_format("fp8_e4m3")
    assert f.max_normal == 448.0
    xs = [448.0, 464.0, 465.0, 480.0, 1e4, math.inf, -464.0, -465.0, -math.inf]
    got = _q(xs, "fp8_e4m3", "nearest")
    assert got[:2] == [448.0, 448.0] and got[6] == -448.0  # 464 is a tie -> even (448)
    assert all(math.isnan(v) for v in got[2:6] + got[7:])
    assert all(math.isnan(v) for v in _q([449.0, math.inf], "fp8_e4m3", "up"))
    assert _q([449.0, 1e4], "fp8_e4m3", "down") == [448.0, 448.0]
    assert _q(xs, "fp8_e4m3", "nearest", saturate=True) == [448.0] * 6 + [-448.0] * 3
    want = np.array(xs, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert_same_bits(quantize(torch.tensor(xs), "fp8_e4m3", "nearest"), torch.from_numpy(want))


def test_bf16_overflow_like_hardware_softmax():
    """exp of large fp32 logits overflows in bf16 exactly where ml_dtypes says."""
    x = torch.exp(torch.linspace(80.0, 95.0, 1001))
    want = torch.from_numpy(x.numpy().astype(ml_dtypes.bfloat16).astype(np.float32))
    assert_same_bits(quantize(x, "bf16", "nearest"), want)
    assert torch.isinf(quantize(x, "bf16", "nearest")).any()


# ----------------------------------------------------------------------------- statistics
def test_random_picks_each_neighbour_with_probability_half():
    """n = 200_064 draws of an off-grid value. Under P(up) = 1/2 the count of ups is
    Binomial(n, 1/2): mean n/2, sd sqrt(n)/2 = 223.6. With the fixed seed the test is
    deterministic; the bound of 5 sd would be exceeded by a fair generator with probability
    5.7e-7, while a 1% bias (P = 0.51) shifts the mean by 2000 = 8.9 sd and fails."""
    n = 1563 * 128  # 200_064, a whole number of 128-element Philox groups
    for name, x0 in (("bf16", 1.0 + 2**-9), ("fp8_e4m3", 3.3), ((5, 4), -7.77)):
        r = quantize(torch.full((n,), x0, dtype=torch.float32), name, "random", seed=2024)
        lo, hi = sorted(neighbours(float(torch.tensor(x0, dtype=torch.float32)),
                                   get_format(name).exp_bits, get_format(name).man_bits))
        assert set(r.unique().tolist()) == {lo, hi}
        ups = int((r == hi).sum())
        assert abs(ups - n / 2) <= 5 * math.sqrt(n) / 2, (name, ups)
        # Bit positions within a Philox group (e % 128) are balanced too: each position gets
        # n/128 = 1562 draws, sd 19.8; 6 sd bounds all 128 positions at probability ~1e-7.
        per_pos = (r == hi).reshape(-1, 128).sum(0).double()
        assert ((per_pos - n // 128 / 2).abs() <= 6 * math.sqrt(n // 128) / 2).all()


def test_stochastic_is_unbiased():
    """E[round(x)] = x: for x = lo + f*q, the mean of n roundings is lo + q*B/n with B
    ~ Binomial(n, f), standard error q*sqrt(f(1-f)/n). Bound: 5 standard errors. The 32-bit
    resolution of the decision biases by < 2**-32 q, far below that."""
    n = 20_000  # 5 standard errors = 0.018 q at f = 0.5: a 2% bias in P(up) fails
    fracs = (0.1, 0.37, 0.5, 0.9)
    for name, wd in (("bf16", torch.float32), ("fp8_e5m2", torch.float32), ("fp32", torch.float64),
                     ((6, 9), torch.float64)):
        f = get_format(name)
        q = math.ldexp(1.0, -f.man_bits)  # quantum in [1, 2)
        x0 = [1.0 + 3 * q + frac * q for frac in fracs]
        x = torch.tensor(x0, dtype=wd).repeat_interleave(n)
        means = quantize(x, name, "stochastic", seed=77).double().reshape(len(fracs), n).mean(1)
        for frac, v, mean in zip(fracs, x0, means.tolist()):
            se = q * math.sqrt(frac * (1 - frac) / n)
            assert abs(mean - v) <= 5 * se, (name, frac)
    # subnormal range: P(up) = x / min_subnormal
    s = get_format("fp8_e4m3").min_subnormal
    r = quantize(torch.full((n,), 0.3 * s), "fp8_e4m3", "stochastic", seed=5)
    assert set(r.unique().tolist()) == {0.0, s}
    assert abs(r.double().mean().item() / s - 0.3) <= 5 * math.sqrt(0.21 / n)


# ----------------------------------------------------------------------------- cross-sample
def test_sample_draws_scheme():
    assert sample_draws(1) == ([0], [False])
    assert sample_draws(2) == ([0, 0], [False, True])
    assert sample_draws(3) == ([0, 1, 1], [False, False, True])
    assert sample_draws(4) == ([0, 0, 1, 1], [False, True, False, True])
    assert sample_draws(5) == ([0, 1, 1, 2, 2], [False, False, True, False, True])


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_round_samples_antithetic(n):
    """Partners of a pair always take opposite neighbours; for N=3 (CADNA) sample 2 is the
    opposite of sample 1, so an off-grid value never yields three identical samples."""
    x = torch.rand(20000, dtype=torch.float32, generator=torch.Generator().manual_seed(0)) + 0.5
    samples = x.expand(n, -1).clone()
    r = round_samples(samples, "bf16", "random", seed=11)
    lo, hi = quantize(x, "bf16", "down"), quantize(x, "bf16", "up")
    off = lo != hi
    draws, flips = sample_draws(n)
    for i in range(n):
        assert ((r[i] == lo) | (r[i] == hi)).all()
        if flips[i]:
            assert (r[i] != r[i - 1])[off].all()
            assert (r[i] == r[i - 1])[~off].all()
    if n == 3:
        assert not ((r[0] == r[1]) & (r[1] == r[2]))[off].any()
    # independent draws agree about half of the time (n=20000: sd 71; 6 sd bound)
    firsts = [i for i in range(n) if not flips[i]]
    if len(firsts) > 1:
        agree = int((r[firsts[0]] == r[firsts[1]])[off].sum())
        m = int(off.sum())
        assert abs(agree - m / 2) <= 6 * math.sqrt(m) / 2


def test_round_samples_uses_the_documented_streams():
    """Sample i of round_samples uses draw sample_draws(N)[0][i] of randbits.random_bits (XOR
    the flip) and, for stochastic, draw i of randbits.uniform_words: the kernel contract."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(3, 7, 45, generator=g) * 100
    seed = 2**40 + 17
    r = round_samples(s, "fp8_e5m2", "random", seed=seed)
    draws, flips = sample_draws(3)
    bits = randbits.random_bits(seed, 7 * 45, [0, 1])
    for i in range(3):
        b = bits[draws[i]] ^ int(flips[i])
        want = round_with_bits(s[i].reshape(-1), get_format("fp8_e5m2"), Rounding.RANDOM, b)
        assert_same_bits(r[i].reshape(-1), want)
    r = round_samples(s, "fp8_e5m2", "stochastic", seed=seed)
    words = randbits.uniform_words(seed, 7 * 45, [0, 1, 2])
    for i in range(3):
        want = round_with_bits(s[i].reshape(-1), get_format("fp8_e5m2"), Rounding.STOCHASTIC,
                               words[i])
        assert_same_bits(r[i].reshape(-1), want)
    # quantize uses draw 0 of the same streams
    x = s[0]
    want = round_with_bits(x.reshape(-1), get_format("bf16"), Rounding.RANDOM,
                           randbits.random_bits(seed, x.numel(), [0])[0]).reshape(x.shape)
    assert_same_bits(quantize(x, "bf16", "random", seed=seed), want)


# ----------------------------------------------------------------------------- reproducibility
@pytest.mark.parametrize("mode", RANDOM_MODES)
def test_reproducible_bits(mode):
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    a = quantize(x, "bf16", mode, seed=123)
    assert_same_bits(quantize(x, "bf16", mode, seed=123), a)
    b = quantize(x, "bf16", mode, seed=124)
    assert (a != b).sum() > 100  # ~half of the off-grid elements differ
    big = quantize(x, "bf16", mode, seed=2**63 + 5)
    assert (big != a).sum() > 100
    s = x.expand(3, -1)
    assert_same_bits(round_samples(s, "bf16", mode, seed=9), round_samples(s, "bf16", mode, seed=9))
    # seed=None draws from torch's global generator
    torch.manual_seed(42)
    c = quantize(x, "bf16", mode)
    torch.manual_seed(42)
    assert_same_bits(quantize(x, "bf16", mode), c)
    assert (quantize(x, "bf16", mode) != c).any()  # the global generator advanced


# ----------------------------------------------------------------------------- API surface
@pytest.mark.parametrize("shape", [(0,), (3, 0), (), (311,), (9999,), (7, 13, 5)])
@pytest.mark.parametrize("mode", MODES)
def test_shapes(shape, mode):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 10
    r = quantize(x, "fp8_e4m3", mode, seed=4)
    assert r.shape == x.shape and r.dtype == x.dtype
    if x.numel():
        assert_same_bits(quantize(r, "fp8_e4m3", "nearest"), r)
    rs = round_samples(x.expand(2, *shape), "fp8_e4m3", mode, seed=4)
    assert rs.shape == (2, *shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_input_is_not_modified(dtype):
    """round_with_bits works on a view of x's bits; in-place steps must never reach x."""
    x = torch.randn(1000, dtype=dtype, generator=torch.Generator().manual_seed(5)) * 1e3
    x[:3] = torch.tensor([math.inf, math.nan, -0.0], dtype=dtype)
    before = x.clone()
    for mode in MODES:
        for saturate in (False, True):
            rand = torch.randint(0, 2**32, x.shape, generator=torch.Generator().manual_seed(1))
            round_with_bits(x, get_format("fp8_e4m3"), Rounding(mode), rand, saturate)
    assert_same_bits(x, before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_half_inputs_return_their_dtype(dtype, mode):
    x = (torch.randn(999, generator=torch.Generator().manual_seed(2)) * 30).to(dtype)
    r = quantize(x, "fp8_e5m2", mode, seed=8)
    assert r.dtype == dtype
    assert_same_bits(r, quantize(x.float(), "fp8_e5m2", mode, seed=8).to(dtype))


def test_invalid_inputs():
    with pytest.raises(ValueError, match="int64"):
        quantize(torch.arange(4), "bf16", "nearest")
    with pytest.raises(ValueError, match="bool"):
        quantize(torch.ones(2, dtype=torch.bool), "bf16")
    with pytest.raises(ValueError, match="not representable in torch.float16"):
        quantize(torch.ones(2, dtype=torch.float16), "bf16")
    with pytest.raises(ValueError, match="not representable in torch.float32"):
        quantize(torch.ones(2), (11, 30))
    with pytest.raises(ValueError, match="'sideways'"):
        quantize(torch.ones(2), "bf16", "sideways")
    with pytest.raises(ValueError, match="1.5"):
        quantize(torch.ones(2), "bf16", "random", seed=1.5)
    with pytest.raises(ValueError, match="leading sample dimension"):
        round_samples(torch.tensor(1.0), "bf16")
    with pytest.raises(ValueError):
        round_with_bits(torch.ones(2), get_format("bf16"), Rounding.RANDOM, None)
    # fp32 format from fp32 input is the identity; from fp64 it rounds
    x = torch.randn(100, dtype=torch.float64)
    assert_same_bits(quantize(x.float(), "fp32", "random", seed=1), x.float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", MODES)
def test_cuda_matches_cpu(mode):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1000, 33, generator=g) * torch.logspace(-45, 38, 33)
    for fmt in ("bf16", "fp8_e4m3", (5, 4)):
        assert_same_bits(quantize(x.cuda(), fmt, mode, seed=5).cpu(), quantize(x, fmt, mode, seed=5))
        assert_same_bits(round_samples(x.cuda(), fmt, mode, seed=5).cpu(),
                         round_samples(x, fmt, mode, seed=5))
    xd = x.double() * 1e-3
    assert_same_bits(quantize(xd.cuda(), "fp32", mode, seed=5).cpu(), quantize(xd, "fp32", mode, seed=5))
