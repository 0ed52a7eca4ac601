"""The fused CPU kernels (fxstab.cpu.bindings) against the plain-torch references, bit for bit."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

import fxstab
from fxstab.cpu import bindings as native
from fxstab.numerics.digits import (
    cestac_digits, computational_zero, digits_cap, stats_vector, student_t,
)
from fxstab.numerics.formats import get_format
from fxstab.numerics.rounding import Rounding, round_samples
from fxstab.numerics.surrogate import perturb_samples

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler for fxstab.cpu.bindings")

FORMATS = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "tf32", (3, 2), (8, 23)]
_INT = {torch.float32: torch.int32, torch.float64: torch.int64}


def _hard_values(dtype: torch.dtype, fmt) -> torch.Tensor:
    """Specials, signed zeros, the format's extremes and their neighbours, and a wide range."""
    f = get_format(fmt)
    finfo = torch.finfo(dtype)
    special = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, f.max_normal,
               -f.max_normal, f.max_normal * (1 + 2.0 ** -(f.man_bits + 2)), f.min_subnormal,
               f.min_subnormal * 0.5, f.min_subnormal * 1.5, -f.min_subnormal * 0.25,
               f.min_normal, f.min_normal * (1 - 2.0 ** -12), finfo.tiny, finfo.max, -finfo.max,
               finfo.tiny * 2.0 ** -10]
    g = torch.Generator().manual_seed(0)
    mant = torch.rand(997, generator=g, dtype=torch.float64) + 0.5
    expo = torch.randint(-150, 150, (997,), generator=g).double()
    sign = torch.where(torch.rand(997, generator=g) < 0.5, -1.0, 1.0).double()
    wide = (sign * mant * torch.exp2(expo)).to(dtype)
    return torch.cat([torch.tensor(special, dtype=torch.float64).to(dtype), wide])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(_INT[a.dtype]),
                                              b.contiguous().view(_INT[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", list(Rounding))
def test_rounding_is_bit_identical_to_the_reference(dtype, fmt, mode):
    f = get_format(fmt)
    if not f.fits_in(dtype):
        pytest.skip("format does not fit the dtype")
    v = _hard_values(dtype, fmt)
    # three samples that differ, then identical ones: both kinds of element in one tensor
    x = torch.stack([v, v * (1 + 2.0 ** -9), -v]).reshape(3, 5, -1)
    for saturate in (False, True):
        ref = round_samples(x, f, mode, seed=2024, saturate=saturate)
        out, stats, digits = native.round_stats(x, f, mode, 2024, saturate=saturate,
                                                want_digits=True)
        assert _same_bits(out, ref), (fmt, mode, saturate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", list(Rounding))
def test_masked_rows_round_as_the_reference(dtype, fmt, mode):
    """Rows of normal values with infinities among them (a causal mask's -inf, an overflow's
    +inf) take the short path with the infinities kept; where the format saturates or has no
    infinity (fn formats) they take the general one: bit for bit the reference either way,
    with the statistics of the general path (non-finite elements counted)."""
    f = get_format(fmt)
    if not f.fits_in(dtype):
        pytest.skip("format does not fit the dtype")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 16, 128, generator=g, dtype=dtype) * min(4.0, f.max_normal / 8)
    causal = torch.ones(128, 128, dtype=torch.bool).tril()[:16]
    x = x.masked_fill(~causal, float("-inf"))
    x[:, 3, 5] = float("inf")  # one +inf in a row of its own samples
    for saturate in (False, True):
        ref = round_samples(x, f, mode, seed=77, saturate=saturate)
        out, stats, _ = native.round_stats(x, f, mode, 77, saturate=saturate)
        assert _same_bits(out, ref), (fmt, mode, saturate)
        _, mstats, _ = native.round_stats(ref, f, None, 0)
        assert stats[4] == mstats[4] == int((~torch.isfinite(ref)).any(0).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", list(Rounding))
def test_groups_at_the_edges_of_the_normal_range(dtype, fmt, mode):
    """The kernel rounds a 128-element group whose values all lie in the format's normal range
    below its top binade (or are zeros) by a short path, any other group by the general one:
    groups of such values with one value at or just past an edge of that range."""
    f = get_format(fmt)
    if not f.fits_in(dtype):
        pytest.skip("format does not fit the dtype")
    g = torch.Generator().manual_seed(3)
    lo, hi = math.log2(f.min_normal) + 1, math.log2(f.max_normal) - 2
    base = torch.exp2(torch.rand(128, generator=g, dtype=torch.float64) * (hi - lo) + lo)
    base = base * torch.where(torch.rand(128, generator=g) < 0.5, -1.0, 1.0).double()
    top = 2.0 ** math.floor(math.log2(f.max_normal))  # the top binade starts here
    edges = [None, 0.0, -0.0, f.min_normal, -f.min_normal, f.min_normal * (1 - 2.0 ** -12),
             f.min_normal * 0.75, f.min_subnormal, f.min_subnormal * 0.5, top * (1 - 2.0 ** -12),
             top, f.max_normal, -f.max_normal * (1 - 2.0 ** -(f.man_bits + 3)), float("inf"),
             float("nan")]
    rows = []
    for e in edges:
        row = base.clone()
        if e is not None:
            row[37] = e
        rows.append(row)
    v = torch.stack(rows).to(dtype).reshape(-1)
    x = torch.stack([v, v * (1 + 2.0 ** -(f.man_bits + 4)), -v])
    for saturate in (False, True):
        ref = round_samples(x, f, mode, seed=99, saturate=saturate)
        out, _, _ = native.round_stats(x, f, mode, 99, saturate=saturate)
        assert _same_bits(out, ref), (fmt, mode, saturate)


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "bf16"), (torch.float64, "fp32")])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 17])
@pytest.mark.parametrize("numel", [1, 127, 128, 129, 1000, 70000])
def test_sample_counts_and_odd_sizes(dtype, fmt, n, numel):
    """The antithetic draws of every N and element counts across the 128-element groups and
    the kernel's superblocks of 16 groups (N=17: one group at a time); fp32 samples into bf16,
    fp64 samples into the fp32 format (their own statistics block, its padded tail)."""
    g = torch.Generator().manual_seed(n * numel)
    x = torch.randn(n, numel, generator=g).to(dtype)
    for mode in (Rounding.RANDOM, Rounding.STOCHASTIC):
        ref = round_samples(x, fmt, mode, seed=7)
        out, st, _ = native.round_stats(x, get_format(fmt), mode, 7)
        assert _same_bits(out, ref)
        want = torch.tensor(stats_vector(ref, student_t(n), digits_cap(fmt, x.dtype)),
                            dtype=torch.float64)
        # the sums (digits, sum_run) in the kernels' fp32 log polynomial against the fp64
        # reference: 2e-6 relative of the sum, 1e-4 absolute for a handful of elements
        torch.testing.assert_close(st, want, rtol=2e-6, atol=1e-4)
        assert st[9:11].tolist() == want[9:11].tolist()  # the same quantile bins


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_statistics_and_digits_match_the_estimator(dtype):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4000, generator=g, dtype=torch.float64)
    rel = torch.logspace(-14, 0, 4000, dtype=torch.float64)  # every digit count from 0 to the cap
    x = torch.stack([base, base * (1 + rel), base * (1 - rel)]).to(dtype)
    x[:, :10] = 0.0  # exact zeros
    x[1, 10] = float("nan")
    x[2, 11] = float("inf")
    x[:, 12] = torch.tensor([1e-3, -1e-3, 0.0], dtype=dtype)  # mean 0 with spread
    fmt = "fp64" if dtype == torch.float64 else "fp32"
    _, st, d = native.round_stats(x, get_format(fmt), None, want_digits=True)
    ref_d = cestac_digits(x, fmt)
    torch.testing.assert_close(d, ref_d, rtol=0, atol=2e-5 if dtype == torch.float32 else 1e-9)
    ref = torch.tensor(stats_vector(x, student_t(3), digits_cap(fmt, dtype)), dtype=torch.float64)
    torch.testing.assert_close(st, ref, rtol=1e-6, atol=1e-3)
    assert st[3].item() == computational_zero(x, ref_d).sum().item()
    assert st[4].item() == 2.0  # the NaN and the inf elements


@pytest.mark.parametrize("n", [2, 3, 5])
def test_fp64_digits_are_the_same_in_the_vector_lanes_and_the_scalar_tail(n):
    """fp64 digits run 4 lanes at a time, the last cnt % 4 elements of a group through the
    same code on a padded copy: every element's digits and zero flag must be the same bits
    wherever it sits, for hard cases too (subnormal and huge means, zero means with spread,
    NaN, inf, -0)."""
    g = torch.Generator().manual_seed(n)
    base = torch.randn(125, generator=g, dtype=torch.float64) * \
        torch.exp2(torch.randint(-1060, 1000, (125,), generator=g).double())
    rel = torch.logspace(-17, 1, 125, dtype=torch.float64)
    x = base * (1 + rel * torch.randn(n, 125, generator=g, dtype=torch.float64))
    x[:, :8] = x[0, :8]  # identical samples
    x[:, 8:12] = 0.0
    x[:, 12:16] = -0.0
    x[0, 16], x[1, 17] = float("nan"), float("inf")
    x[:, 18] = torch.linspace(-1e-3, 1e-3, n, dtype=torch.float64)  # zero mean, spread
    x[:, 19:23] = torch.tensor([5e-324, -1e-310, 2.2250738585072014e-308, 1.7e308])
    r = native.rounder(get_format("fp32"), None, torch.float64, n)
    _, _, d, z = r(x.contiguous(), 0, False, True, True)
    for k in range(1, 4):  # element j at position j + k: three of every four move lane or tail
        y = torch.cat([x[:, :k] * 0 + 1, x], dim=1).contiguous()  # 125 + k: k = 3 -> no tail
        _, _, dy, zy = r(y, 0, False, True, True)
        assert torch.equal(dy[k:].view(torch.int64), d.view(torch.int64)), k
        assert torch.equal(zy[k:], z), k


def test_plain_values_are_read_n_times_not_copied():
    x = torch.randn(300, 7)
    fmt = get_format("bf16")
    out, st, _ = native.round_stats(x, fmt, Rounding.RANDOM, 5, n_samples=3)
    ref = round_samples(x.expand(3, 300, 7), fmt, "random", seed=5)
    assert _same_bits(out, ref)
    out2, st2, _ = native.round_stats(x.expand(3, 300, 7), fmt, Rounding.RANDOM, 5)
    assert _same_bits(out2, ref) and torch.equal(st, st2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grid", [None, "bf16", "fp16", "fp8_e4m3"])
def test_perturbation_is_bit_identical_to_the_reference(dtype, grid):
    """With a grid too: the perturbed values rounded onto it (fp32's largest value saturating
    at the format's)."""
    grid = None if grid is None else get_format(grid)
    g = torch.Generator().manual_seed(3)
    v = torch.randn(2, 1001, generator=g, dtype=dtype)
    # separated elements (left alone), identical ones (perturbed), specials and huge values
    x = torch.stack([v[0], v[0] * (1 + 2.0 ** -12), v[0] + v[1]])
    x[:, :4] = torch.tensor([float("nan"), float("inf"), 0.0, torch.finfo(dtype).max],
                            dtype=dtype).unsqueeze(0)
    eta = 2.0 ** -8
    ref, n_ref = perturb_samples(x, eta, 11, grid)
    out, n_out = native.perturb(x, eta, 11, grid=grid)
    assert _same_bits(out, ref) and n_out == n_ref > 0
    plain = v[0]
    ref, n_ref = perturb_samples(plain.expand(3, -1).contiguous(), eta, 11, grid)
    out, n_out = native.perturb(plain, eta, 11, n_samples=3, grid=grid)
    assert _same_bits(out, ref) and n_out == n_ref == plain.numel()
    if grid is not None:  # every perturbed value on the grid, finite
        assert torch.isfinite(out).all()
        assert _same_bits(out, round_samples(out, grid, "nearest"))


@pytest.mark.parametrize("n", [2, 3, 16, 17, 40])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("grid", [None, "bf16"])
def test_perturbation_of_every_sample_count_is_the_reference(n, threads, grid):
    """The Philox records of all N samples of a group come from one run (N <= 16) or one run
    per sample; one thread's scan stops at the first group that moves. Groups that move only
    after groups that do not, and a partial last group; enough elements for two threads."""
    g = torch.Generator().manual_seed(n)
    v = torch.randn(130 * 128 + 37, generator=g)
    x = v.expand(n, -1).clone()
    x[:, :300] += torch.randn(n, 300, generator=g)  # the first groups: separated, left alone
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref, n_ref = perturb_samples(x, 2.0 ** -8, 5, grid and get_format(grid))
        out, n_out = native.perturb(x, 2.0 ** -8, 5, grid=grid and get_format(grid))
    finally:
        torch.set_num_threads(old)
    assert _same_bits(out, ref) and n_out == n_ref >= v.numel() - 300


@pytest.mark.parametrize("threads", [1, 2])
def test_perturbation_that_moves_nothing_returns_its_input(threads):
    """Separated samples, or close ones that are all exact zeros, move nothing: every group is
    scanned (by a team too, whose threads stop early only once a group moves), the input comes
    back as it is, and the count is the reference's."""
    g = torch.Generator().manual_seed(threads)
    v = torch.randn(200 * 128 + 5, generator=g)
    x = torch.stack([v, v * 1.1, v * 1.2])  # separated everywhere...
    x[:, 1000:1500] = 0.0  # ...but for exact zeros: close, not moving
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, count = native.perturb(x, 2.0 ** -8, 5)
    finally:
        torch.set_num_threads(old)
    ref, n_ref = perturb_samples(x, 2.0 ** -8, 5)
    assert out is x and count == n_ref == 500 and _same_bits(ref, x)


def test_empty_and_bad_input():
    fmt = get_format("bf16")
    out, st, d = native.round_stats(torch.empty(3, 0), fmt, Rounding.RANDOM, 1, want_digits=True)
    assert out.shape == (3, 0) and st.tolist()[5] == 0.0 and d.numel() == 0
    assert native.perturb(torch.empty(3, 0, 4), 2.0 ** -8, 1)[1] == 0
    with pytest.raises(ValueError, match="float32/float64"):
        native.round_stats(torch.ones(3, 4, dtype=torch.int32), fmt, Rounding.RANDOM, 1)
    with pytest.raises(ValueError, match="float32/float64"):
        native.round_stats(torch.ones(3, 4, dtype=torch.float16), fmt, Rounding.RANDOM, 1)
    with pytest.raises(ValueError, match="1..256"):
        native.perturb(torch.ones(300, 4), 2.0 ** -8, 1)
    with pytest.raises(ValueError, match="N >= 2"):
        native.round_stats(torch.ones(1, 4), fmt, Rounding.RANDOM, 1)
    with pytest.raises(ValueError, match="does not fit"):
        native.round_stats(torch.ones(3, 4), get_format("fp64"), Rounding.RANDOM, 1)


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "fp16"), (torch.float64, "fp32")])
def test_threads_do_not_change_results(dtype, fmt):
    x = torch.randn(3, 200_000, dtype=dtype)
    fmt = get_format(fmt)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = native.round_stats(x, fmt, Rounding.RANDOM, 9, want_digits=True)
        torch.set_num_threads(2)
        b = native.round_stats(x, fmt, Rounding.RANDOM, 9, want_digits=True)
    finally:
        torch.set_num_threads(old)
    assert _same_bits(a[0], b[0]) and _same_bits(a[2], b[2])  # samples, per-element digits
    # each thread reduces its groups in float lanes (a product of significands per lane):
    # the sum of digits moves in its tenth significant digit with the split
    torch.testing.assert_close(a[1], b[1], rtol=1e-8, atol=1e-6)


def test_disabled_by_environment(tmp_path):
    code = ("import warnings, fxstab.cpu.bindings as n; warnings.simplefilter('error'); "
            "print(n.available())")
    env = dict(os.environ, FXSTAB_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_missing_compiler_falls_back_with_one_warning(tmp_path):
    code = ("import warnings, fxstab.cpu.bindings as n\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    print(n.available(), n.available(), len(w), 'unavailable' in str(w[0].message))\n")
    env = dict(os.environ, CC="no-such-compiler-fxstab", FXSTAB_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False False 1 True"


def test_first_build_says_so_once_on_stderr(tmp_path):
    """A first use compiles for tens of seconds: one line on stderr says why, and a second use
    (the cached library) says nothing. The 'compiler' here copies the library already built."""
    assert native.available()
    built = native.library_path()
    cc = tmp_path / "fake-cc"
    cc.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\ncp "%s" "$2"\n' % built)
    cc.chmod(0o755)
    code = "import fxstab.cpu.bindings as n; print(n.available())"
    env = dict(os.environ, CC=str(cc), FXSTAB_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True) for _ in range(2)]
    assert [r.stdout.strip() for r in runs] == ["True", "True"]
    assert runs[0].stderr.count("fxstab: compiling the CPU kernels") == 1
    assert "compiling" not in runs[1].stderr


def test_backend_cpu_kernels_match_the_torch_path():
    """Same model, same seed: the fused path and the references report the same digits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 128), torch.nn.LayerNorm(128),
                                torch.nn.Softmax(-1))
    x = torch.randn(16, 64)
    reports = {}
    for k in ("cpu", "torch"):
        torch._dynamo.reset()
        be = fxstab.backend(n_samples=3, seed=1, kernels=k)
        with torch.no_grad():
            y = torch.compile(model, backend=be)(x)
        assert torch.equal(y, model(x))
        reports[k] = {r.name: r for r in be.reports}
    assert reports["cpu"].keys() == reports["torch"].keys() and len(reports["cpu"]) == 5
    for name, r in reports["cpu"].items():
        t = reports["torch"][name]
        assert r.surrogate == t.surrogate and r.non_finite == t.non_finite
        assert abs(r.avg_digits - t.avg_digits) < 1e-5, name
        assert abs(r.min_digits - t.min_digits) < 1e-4, name
        assert r.zero_fraction == t.zero_fraction, name
        # fp32 relative spreads in the kernel's digit loops, fp64 deviations in the reference
        assert abs(r.normwise_digits - t.normwise_digits) < 1e-6, name
        assert (r.p10_digits, r.p50_digits, r.underflow) == \
            (t.p10_digits, t.p50_digits, t.underflow), name


def test_in_place_rounding_gives_the_same_bits():
    x = torch.randn(3, 1000)
    fmt = get_format("bf16")
    ref, st_ref, _ = native.round_stats(x, fmt, Rounding.RANDOM, 4)
    y = x.clone()
    out, st, _ = native.round_stats(y, fmt, Rounding.RANDOM, 4, in_place=True)
    assert out.data_ptr() == y.data_ptr() and _same_bits(y, ref) and torch.equal(st, st_ref)
    # a non-contiguous input is never written: the result is a new tensor
    z = torch.randn(1000, 3).t()
    before = z.clone()
    out, _, _ = native.round_stats(z, fmt, Rounding.RANDOM, 4, in_place=True)
    assert out.data_ptr() != z.data_ptr() and torch.equal(z, before)
    # samples laid out inside the rows (an embedding gradient's, [V][N][D]): rounded over
    # the one contiguous copy, the same bits and statistics as from contiguous samples
    w = torch.randn(50, 3, 8).transpose(0, 1)
    before = w.clone()
    ref, st_ref, _ = native.round_stats(w.contiguous(), fmt, Rounding.RANDOM, 4)
    out, st, _ = native.round_stats(w, fmt, Rounding.RANDOM, 4)
    assert _same_bits(out, ref) and torch.equal(st, st_ref) and torch.equal(w, before)


def test_perturbation_that_changes_nothing_returns_the_samples():
    """Separated samples and exact zeros: counted, but nothing is copied or written."""
    g = torch.Generator().manual_seed(8)
    v = torch.randn(1000, generator=g)
    x = torch.stack([v, v * (1 + 2.0 ** -5), v * (1 - 2.0 ** -5)])
    x[:, :100] = 0.0  # relu zeros: "close", but 0 * (1 + eta r) == 0
    out, count = native.perturb(x, 2.0 ** -8, 3)
    ref, ref_count = perturb_samples(x, 2.0 ** -8, 3)
    assert out is x and count == ref_count == 100 and _same_bits(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3"])
@pytest.mark.parametrize("mode", [Rounding.RANDOM, Rounding.NEAREST, Rounding.STOCHASTIC])
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("on_grid", [False, True], ids=["off-grid", "grid"])
def test_fused_round_and_surrogate_equals_the_two_passes(dtype, fmt, mode, n, on_grid):
    """round_perturb == perturb_samples(round_samples(...)) bit for bit, with the statistics of
    the rounded (not the perturbed) samples; stacked, plain and in-place inputs, odd sizes."""
    f = get_format(fmt)
    if not f.fits_in(dtype):
        pytest.skip("format does not fit the dtype")
    v = _hard_values(dtype, fmt)
    v = torch.cat([v, torch.zeros(40, dtype=dtype), torch.ones(300, dtype=dtype)])  # odd size
    eta = f.unit_roundoff
    stacked = torch.stack([v * (1 + 2.0 ** -12 * k) for k in range(n)])
    for x, n_samples in ((stacked, None), (v, n)):
        ref = round_samples(x if n_samples is None else x.expand(n, *x.shape), f, mode, seed=7)
        grid = f if on_grid else None
        want, want_count = perturb_samples(ref, eta, 99, grid)
        for in_place in (False, True):
            src = x.clone() if in_place else x
            out, stats, count = native.round_perturb(src, f, mode, 7, eta, 99,
                                                     n_samples=n_samples, in_place=in_place,
                                                     grid=grid)
            assert _same_bits(out, want)
            assert count == want_count
            assert torch.equal(stats, native.round_stats(x, f, mode, 7, n_samples=n_samples)[1])
            if in_place and n_samples is None:
                assert out.data_ptr() == src.data_ptr()
    with pytest.raises(ValueError, match="rounding mode"):
        native.round_perturb(stacked, f, None, 7, eta, 99)


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "bf16"), (torch.float32, "fp16"),
                                       (torch.float32, "fp8_e4m3"), (torch.float32, "tf32"),
                                       (torch.float64, "fp32"), (torch.float64, "fp64")])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_statistics_without_digits_match_the_statistics_with_digits(dtype, fmt, n):
    """The statistics-only path (no per-element logarithm) agrees with the per-element digits:
    hard values, a spread of relative noise from none to overwhelming, odd sizes; fp64 samples
    (the fp32 format, format="auto") have a statistics-only block of their own."""
    f = get_format(fmt)
    v = _hard_values(dtype, fmt)
    g = torch.Generator().manual_seed(n)
    top = 30 if dtype == torch.float32 else 60
    noise = torch.rand(v.shape, generator=g, dtype=dtype) * \
        2.0 ** -torch.randint(0, top, v.shape, generator=g)
    x = torch.stack([v * (1 + k * noise) for k in range(n)])[:, : v.numel() - 3]
    for mode in (None, Rounding.RANDOM):
        _, with_digits, d = native.round_stats(x, f, mode, 5, want_digits=True)
        _, stats, _ = native.round_stats(x, f, mode, 5)
        # fp32: a per-element degree-5 log10 polynomial (3.7e-7 digits) against one log per
        # lane of a product; fp64: the series (1e-14) against the same. The sums agree to that
        # error (the min and max too); the counts must agree exactly
        tol = 1e-6 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(stats, with_digits, rtol=tol, atol=10 * tol)
        assert stats[3] == with_digits[3] and stats[4] == with_digits[4]  # zeros, non-finite
        assert abs(float(stats[0]) - float(d.double().sum())) < tol * float(stats[5]) + 1e-3


@pytest.mark.parametrize("threads", [1, 2])
def test_statistics_of_many_groups_match_the_digits(threads):
    """Each thread carries its statistics across its groups (a running product per lane,
    folded back after every group) and reduces them once: on a million elements whose digits
    span 0 to the cap, the statistics still equal those of the per-element digits."""
    g = torch.Generator().manual_seed(threads)
    base = torch.randn(1_000_003, generator=g)
    rel = 2.0 ** -torch.randint(0, 26, base.shape, generator=g).float()
    x = torch.stack([base, base * (1 + rel), base * (1 - 0.5 * rel)])
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        _, stats, _ = native.round_stats(x, get_format("fp32"), None)
        _, with_digits, d = native.round_stats(x, get_format("fp32"), None, want_digits=True)
    finally:
        torch.set_num_threads(old)
    # the digits path takes a degree-5 log10 polynomial per element (3.7e-7 digits), the
    # statistics path one log per lane of a product: they agree to that polynomial's error
    torch.testing.assert_close(stats, with_digits, rtol=1e-6, atol=1e-5)
    assert abs(float(stats[0]) - float(d.double().sum())) < 1e-6 * float(stats[5])
    assert float(stats[1]) == pytest.approx(float(d.min()), abs=1e-5)
    assert float(stats[2]) == pytest.approx(float(d.max()), abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fmt", ["bf16", "fp16", (8, 23)])
@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("threshold", ["default", "none", "above the cap"])
def test_zero_mask_matches_computational_zero(dtype, fmt, n, threshold):
    """The kernel's zero mask is fxstab.numerics.digits.computational_zero of the samples it measured
    (rounded or not), with or without per-element digits; odd sizes and special values; the
    default zero threshold, one no element is below, and one above the digit cap (every finite
    element that is not an exact zero)."""
    f = get_format(fmt)
    thr = {"default": 0.5, "none": 0.0, "above the cap": digits_cap(f, dtype) + 1}[threshold]
    if not f.fits_in(dtype):
        pytest.skip("format does not fit the dtype")
    v = _hard_values(dtype, fmt)
    g = torch.Generator().manual_seed(n)
    noise = (torch.rand(v.shape, generator=g) * 2.0 ** -torch.randint(0, 30, v.shape, generator=g)).to(dtype)
    x = torch.stack([v * (1 + k * noise) for k in range(n)])[:, : v.numel() - 5]
    x[:, :40] = x[:1, :40] + torch.randn(n, 40, generator=g).to(dtype) * 1e-3  # noise near 0
    for mode in (None, Rounding.RANDOM):
        for want_digits in (False, True):
            out, st, _, z = native.round_stats(x, f, mode, 5, want_digits=want_digits,
                                               want_zero_mask=True, zero_threshold=thr)
            want = computational_zero(out, format=f, threshold=thr)
            assert z.dtype == torch.bool and torch.equal(z, want)
            assert int(z.sum()) == int(st[3])


@pytest.mark.parametrize("name", sorted(native.LOOKUP_OPS))
def test_lookup_of_bf16_values_is_the_op_itself(name):
    """lookup_bf16 gives torch's own bits for every bf16 value (incl. subnormals, infinities,
    NaNs) wherever the value sits in the tensor: odd sizes (the op's scalar tail), repeats,
    shuffles; any value that is not a bf16 value makes it decline (None)."""
    op = getattr(torch.ops.aten, name).default
    every = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    g = torch.Generator().manual_seed(5)
    for n in (1, 7, 4099, 1 << 16, 200_003):
        x = every[torch.randint(0, 1 << 16, (n,), generator=g)]
        got, want = native.lookup_bf16(op, x), op(x)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)) or \
            torch.equal(torch.isnan(got), torch.isnan(want)) and \
            torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])
    x = every[torch.randperm(1 << 16, generator=g)].reshape(256, 256).clone()
    x[100, 7] = 1.0 + 2.0 ** -20  # not a bf16 value
    assert native.lookup_bf16(op, x) is None
    assert native.lookup_bf16(op, every.double()) is None
    assert native.lookup_bf16(op, every.reshape(256, 256).t()) is None  # not contiguous


def test_rounder_reads_an_expanded_value_n_times():
    """A Rounder given one value expanded along the sample dim (identical samples) rounds and
    measures it as round_stats does with n_samples, without a copy; other layouts are refused
    clearly (the caller makes them contiguous)."""
    f = get_format("bf16")
    v = torch.randn(5, 33, generator=torch.Generator().manual_seed(8))
    r = native.rounder(f, Rounding.RANDOM, torch.float32, 3)
    out, st, d, z = r(v.unsqueeze(0).expand(3, 5, 33), 11, True, True, True)
    want = native.round_stats(v, f, Rounding.RANDOM, 11, n_samples=3, want_digits=True,
                              want_zero_mask=True, as_list=True)
    assert _same_bits(out, want[0]) and st == want[1]
    assert torch.equal(d, want[2]) and torch.equal(z, want[3])
    with pytest.raises(ValueError, match="contiguous"):
        r(torch.randn(3, 6, 4).transpose(1, 2), 11)
    with pytest.raises(ValueError, match="samples"):
        r(torch.randn(2, 4), 11)


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "bf16"), (torch.float64, "fp32")])
@pytest.mark.parametrize("mode", [Rounding.RANDOM, None])
def test_prepared_kernel_is_the_rounder(dtype, fmt, mode):
    """native.Prepared (one argument struct, the kernel's constants derived once) gives the
    Rounder's samples and statistics for stacked and expanded samples, call after call with
    new seeds; in place it overwrites its input; other layouts are refused with None."""
    f = get_format(fmt)
    g = torch.Generator().manual_seed(4)
    r = native.rounder(f, mode, dtype, 3)
    threads = torch.get_num_threads()
    for in_place in (False, True):
        prep = native.Prepared(r, in_place)
        # the struct keeps what the previous call set: the same size twice, a new size, an
        # expanded value between stacked ones, another thread count (2 threads from 32768
        # element-samples)
        for seed, numel, nt in ((3, 1000, 1), (6, 1000, 1), (4, 7, 1), (5, 129, 1),
                                (7, 20000, 2), (8, 20000, 1)):
            torch.set_num_threads(nt)
            try:
                x = torch.randn(3, numel, generator=g, dtype=dtype)
                want, st, _, _ = r(x, seed)
                given = x.clone()
                out = prep(given, seed)
                assert _same_bits(out, want) and prep.stats[:] == st
                assert (out.data_ptr() == given.data_ptr()) == (in_place or mode is None)
                v = torch.randn(numel, generator=g, dtype=dtype).unsqueeze(0).expand(3, numel)
                want, st, _, _ = r(v, seed)
                out = prep(v, seed)
                assert _same_bits(out, want) and prep.stats[:] == st
            finally:
                torch.set_num_threads(threads)
    assert prep(torch.randn(3, 6, 4, dtype=dtype).transpose(1, 2), 1) is None


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "bf16"), (torch.float64, "fp32")])
@pytest.mark.parametrize("on_grid", [False, True], ids=["off-grid", "grid"])
def test_prepared_kernel_with_the_surrogate_is_round_perturb(dtype, fmt, on_grid):
    """native.Prepared with ``eta``: round_perturb's samples, statistics and count of perturbed
    elements, bit for bit, for stacked (in place or not) and expanded samples, with the
    surrogate's seed set per call; values close to each other perturbed, separated ones not."""
    f = get_format(fmt)
    g = torch.Generator().manual_seed(5)
    eta = 1e-2
    r = native.rounder(f, Rounding.RANDOM, dtype, 3)
    with pytest.raises(ValueError, match="rounding mode"):
        native.Prepared(native.rounder(f, None, dtype, 3), False, eta)
    counts = []
    grid = f if on_grid else None
    for in_place in (False, True):
        prep = native.Prepared(r, in_place, eta, grid)
        for seed, pseed, numel in ((3, 9, 1000), (6, 1 << 63, 1000), (4, 2, 7), (7, 5, 20000)):
            base = torch.randn(numel, generator=g, dtype=dtype)
            # half the elements nearly tied across samples (close), half far apart
            spread = torch.where(torch.arange(numel) % 2 == 0, 1e-6, 1.0).to(dtype)
            x = base + spread * torch.randn(3, numel, generator=g, dtype=dtype)
            want, st, count = native.round_perturb(x.clone(), f, Rounding.RANDOM, seed, eta,
                                                   pseed, as_list=True, grid=grid)
            prep.fused.seed = pseed
            given = x.clone()
            out = prep(given, seed)
            assert _same_bits(out, want) and prep.stats[:] == st
            assert prep.fused.count == count and 0 < count < numel
            assert (out.data_ptr() == given.data_ptr()) == in_place
            counts.append(count)
            v = base.unsqueeze(0).expand(3, numel)
            want, st, count = native.round_perturb(v, f, Rounding.RANDOM, seed, eta, pseed,
                                                   as_list=True, grid=grid)
            out = prep(v, seed)
            assert _same_bits(out, want) and prep.stats[:] == st and prep.fused.count == count
    assert len(set(counts)) > 1


def test_derive_seeds_are_derive_seed():
    """A call's seeds derived at once in C are fxstab.numerics.randbits.derive_seed's, bit for bit (the
    arithmetic level's primitives round with them), 64-bit extremes included."""
    import random

    from fxstab.rules.aten import AtenContext
    from fxstab.numerics.randbits import M64, derive_seed

    r = random.Random(2)
    for _ in range(50):
        seed = r.choice([0, 1, M64, r.getrandbits(64)])
        salts = [r.choice([0, 7, M64, r.getrandbits(64), r.getrandbits(10)]) for _ in range(9)]
        seeds, then = native.derive_seeds(seed, salts, 100)
        assert seeds == [derive_seed(seed, s) for s in salts]
        assert then == [derive_seed(s, 100) for s in seeds]
    ctx = AtenContext.of(format="bf16").for_call(12345, None, [3, 5])
    for salt in (3, 5, 9):  # 9 was not derived ahead
        s = ctx.next_seed(salt)
        assert s == derive_seed(12345, salt)
        assert ctx.rounding_seed(s, 0) == derive_seed(s, 100)
        assert ctx.rounding_seed(s, 2) == derive_seed(s, 102)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype, fmt", [(torch.float32, "fp16"), (torch.float32, "bf16"),
                                        (torch.float64, "fp32"), (torch.float32, "fp8_e4m3")])
def test_underflow_norms_and_quantiles_match_the_reference(dtype, fmt, in_place):
    """The extras of the statistics (underflowed elements, the norms of normwise digits, the
    digit quantiles) against the references, on values across the format's subnormal range,
    in groups that take the rounding's short path and groups that do not."""
    f = get_format(fmt)
    g = torch.Generator().manual_seed(3)
    numel = 5000
    mag = f.min_normal * 2.0 ** torch.linspace(-12, 12, numel, dtype=torch.float64)
    base = (torch.randn(numel, generator=g, dtype=torch.float64).sign() * mag)
    x = (base * (1 + 1e-3 * torch.randn(3, numel, generator=g, dtype=torch.float64))).to(dtype)
    x[:, 2000:2500] = torch.randn(3, 500, generator=g).to(dtype)  # a normal stretch
    x[:, 100:110] = 0.0
    from fxstab.numerics.digits import underflow_count
    want_under = underflow_count(x, f)
    assert 0 < want_under < numel
    ref = round_samples(x, f, Rounding.RANDOM, seed=5)
    want = stats_vector(ref, student_t(3), digits_cap(f, dtype), underflow=want_under)
    out, st, _ = native.round_stats(x.clone() if in_place else x, f, Rounding.RANDOM, 5,
                                    in_place=in_place, as_list=True)
    assert _same_bits(out, ref)
    assert st[8] == want_under
    # the norms: mean^2 from the same fp32 means; s^2 from the digit loops' fp32 relative spread
    # (the reference: fp64 deviations) wherever the kernel measured a group in vectors
    assert st[6] == pytest.approx(want[6], rel=1e-12) and st[7] == pytest.approx(want[7], rel=1e-6)
    assert st[9:11] == want[9:11]
    # the expected run digits: subnormal and tiny means take the reference's own arithmetic
    assert st[11] == pytest.approx(want[11], rel=1e-6) and want[11] > 0


def test_call_seeds_are_derive_seed_of_each_pair():
    from fxstab.numerics.randbits import derive_seed

    bases = [0, 1, 2**63 + 5, 2**64 - 1, 12345678901234567]
    purposes = [0, 1000, 3, 2**40, 7]
    seeds = native.CallSeeds(bases, purposes)
    for call in (0, 1, 17, 2**33):
        assert seeds(call) == [derive_seed(b, call, q) for b, q in zip(bases, purposes)]


def _binary_cases(dtype, g):
    """Operand pairs as the arithmetic level hands them over (ranks aligned): stacked with
    stacked, with a row statistic, with a plain weight, an expanded input with stacked, a
    Python number's 0-d tensor, strided samples, an odd size across threads, and the specials
    (NaN, infinities, signed zeros, subnormals, overflow) against ordinary values."""
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    hard = _hard_values(dtype, "bf16" if dtype == torch.float32 else (8, 23))
    m = hard.numel()
    return [
        (r(3, 5, 7), r(3, 5, 7)),
        (r(3), r(3)),  # a 0-d value's samples
        (r(3, 256, 129), r(3, 256, 1)),  # (x - mean) over rows
        (r(3, 4, 33, 16), r(16)),  # a plain weight along the last dim
        (r(5, 7).expand(3, 5, 7), r(3, 1, 1)),  # identical samples with a stacked scalar
        (torch.tensor(2.5, dtype=dtype), r(3, 2, 3, 4, 5)),  # 2.5 - x: a number on the left
        (r(3, 300, 3).transpose(1, 2), r(3, 3, 300)),  # strided samples
        (r(3, 2, 1, 5), r(3, 1, 4, 5)),  # an outer product's broadcast: three collapsed dims
        (r(3, 40000), r(3, 40000)),  # two threads from 32768 element-samples
        (hard.repeat(3, 1), hard.flip(0).repeat(3, 1)),
        (hard.repeat(3, 1), r(3, m) * 1e-30),
        (hard.repeat(3, 1), torch.tensor(-0.0, dtype=dtype)),
    ]


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "bf16"), (torch.float32, "fp16"),
                                       (torch.float32, "fp8_e4m3"), (torch.float64, "fp32"),
                                       (torch.float64, "tf32")])
@pytest.mark.parametrize("mode", [Rounding.RANDOM, Rounding.STOCHASTIC, Rounding.NEAREST])
@pytest.mark.parametrize("op", sorted(native.BINARY_OPS))
def test_binary_kernel_is_the_operator_then_the_rounder(dtype, fmt, mode, op):
    """native.Binary computes add/sub/mul/div inside the rounding: the samples, statistics,
    digits and zero mask of torch's operator followed by the Rounder, bit for bit, for every
    broadcast the arithmetic level hands it, call after call (the layout set up once)."""
    g = torch.Generator().manual_seed(5)
    r = native.rounder(get_format(fmt), mode, dtype, 3)
    k = native.Binary(r, op)
    fn = getattr(torch, op)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seed, (a, b) in enumerate(_binary_cases(dtype, g)):
            for x, y in ((a, b), (b, a)):
                assert k.reads(x, y), (x.shape, y.shape)
                for s in (seed, seed + 100):  # the second call reuses the layout
                    out, st, d, z = k(x, y, s, True, True)
                    want, wst, wd, wz = r(fn(x, y).contiguous(), s, True, True, True)
                    assert _same_bits(out, want) and st == wst, (op, x.shape, y.shape)
                    assert torch.equal(d.view(_INT[dtype]), wd.view(_INT[dtype]))
                    assert torch.equal(z, wz)
    finally:
        torch.set_num_threads(threads)


def test_binary_kernel_refuses_what_it_does_not_read():
    """Other dtypes, a broadcast over four collapsed dims, an empty output: not read (the rule
    then runs the operator and rounds its result)."""
    r = native.rounder(get_format("bf16"), Rounding.RANDOM, torch.float32, 3)
    k = native.Binary(r, "add")
    a = torch.randn(3, 2, 1, 4, 1)
    assert not k.reads(a, torch.randn(3, 1, 3, 1, 5))
    assert not k.reads(a.double(), a.double())
    assert not k.reads(torch.randn(3, 0, 4), torch.randn(4))
    assert not k.reads(torch.randn(2, 4), torch.randn(4))  # not [N, ...]
    assert k.reads(a, a)
    with pytest.raises(ValueError, match="rounding mode"):
        native.Binary(native.rounder(get_format("bf16"), None, torch.float32, 3), "add")


@pytest.mark.parametrize("fmt", ["bf16", "fp32"])
def test_binary_steps_give_the_general_paths_maps(fmt, monkeypatch):
    """At the arithmetic level, adds, subs, products and quotients computed inside the
    kernel's rounding leave the digit map (statistics, counters with per-event records) as
    the operator followed by the rounding step does, field for field."""
    from fxstab.rules.aten import apply

    monkeypatch.setattr(apply, "_BINARY_MIN_BYTES", 0)  # the model's outputs are small
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Softmax(-1))
    x = torch.randn(8, 32) * 30
    maps, steps, counted = [], [], []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(apply, "_fusable", lambda args, ctx: False)
        torch._dynamo.reset()
        be = fxstab.backend(granularity="aten", format=fmt, diagnostics="detailed", seed=3)
        f = torch.compile(model, backend=be)
        with torch.no_grad():
            for _ in range(3):  # untraced, traced, replayed
                assert torch.equal(f(x), model(x))
        maps.append(json.loads(be.digit_map().to_json()))
        steps.append(be.sampled_graphs()[0].code.count("fxstab_binary_"))
        counted.append(sum(sum(r.counters.values()) for r in be.reports))
    assert steps[0] >= 6 and steps[1] == 0
    assert counted[0] == counted[1] > 0  # cancellations (fp32), math functions (bf16)
    for m in maps:
        m["metadata"].pop("created", None)
    assert maps[0] == maps[1]


def test_binary_steps_give_the_same_maps_on_opinfo_operators(monkeypatch):
    """Every 20th OpInfo entry (float32, its first sample) at the arithmetic level with every
    operator selected: with all adds, subs, products and quotients computed inside the
    kernel's rounding, the digit map is the one of the operators followed by their rounding
    steps, field for field (broadcasts, numbers, strided views, inputs' identical samples;
    the whole list: 670 entries equal when this was written, ~3 min)."""
    import copy

    from torch.testing._internal.common_methods_invocations import op_db

    from fxstab.rules.aten import apply

    calls = [0]
    kernel = native.Binary.__call__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return kernel(self, *args, **kwargs)

    monkeypatch.setattr(native.Binary, "__call__", counted)

    def digit_map(op, sample, fused):
        monkeypatch.setattr(apply, "_BINARY_MIN_BYTES", 0 if fused else 1 << 62)
        sample = copy.deepcopy(sample)  # an in-place primitive (BatchNorm's statistics)
        torch._dynamo.reset()
        be = fxstab.backend(granularity="aten", select="*", seed=0)
        f = torch.compile(lambda *a: op.op(*a, **sample.kwargs), backend=be)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):  # untraced, traced, replayed
                f(sample.input, *sample.args)
        doc = json.loads(be.digit_map().to_json())
        doc["metadata"].pop("created", None)
        return doc

    compared = 0
    for op in op_db[::20]:
        if torch.float32 not in op.supported_dtypes("cpu") or "empty" in op.name:
            continue  # (uninitialised memory differs between any two runs)
        sample = next(iter(op.sample_inputs("cpu", torch.float32, requires_grad=False)), None)
        if sample is None:
            continue
        try:
            fused = digit_map(op, sample, True)
        except Exception:  # noqa: BLE001 - what dynamo or the op refuses, either way
            continue
        assert fused == digit_map(op, sample, False), op.name
        compared += 1
    assert compared >= 25 and calls[0] >= 40, (compared, calls[0])  # 33 and 75 when written

