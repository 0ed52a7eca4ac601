"""Fused round+digits kernel against its plain-torch reference (bit-exact rounding)."""

from __future__ import annotations

import math

import pytest
import torch

from fxstab.numerics.formats import get_format
from fxstab.kernels.round_digits import round_digits, round_digits_torch
from fxstab.numerics.rounding import Rounding

from kernel_testutil import adversarial_samples, assert_bits_equal, needs_cuda, needs_interpreter

MODES = [m.value for m in Rounding]
FORMATS = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "tf32", (3, 2), (6, 5), "fp32", (11, 40)]
SEED = 0xFEEDFACECAFEBEEF
_SHAPE_CASES = [("bf16", "random", torch.float32), ("fp16", "stochastic", torch.float32),
                ("fp8_e4m3", "nearest", torch.float64), ("fp32", "random", torch.float64)]  # >= 2**63: exercises the unsigned seed path


def _tol(dtype: torch.dtype) -> float:
    # The digits differ from the reference only through the last bits of mean, 1/|mean|
    # (kernel: one reciprocal, reference: N divisions; <= 2 ulp each) and log2*log10(2) vs
    # log10 (<= 2 ulp). With d = log10(sqrt(N)/t) - log10(var)/2 and var's relative error
    # below ~10 ulp, |delta d| <= 10 * eps / (2 ln 10) + 2 ulp(cap) ~ 3e-6 in fp32; 1e-5 and
    # 1e-12 (fp64) leave room without hiding a wrong formula (a wrong t or sqrt(N) moves the
    # digits by > 0.01).
    return 1e-5 if dtype == torch.float32 else 1e-12


def _check(samples, fmt, mode, saturate=False, want_digits=True, n_check=True):
    a, sa, da = round_digits(samples, fmt, mode, SEED, saturate=saturate, want_digits=want_digits)
    b, sb, db = round_digits_torch(samples, fmt, mode, SEED, saturate=saturate,
                                   want_digits=want_digits)
    assert_bits_equal(a, b)
    tol = _tol(samples.dtype)
    # avg/min/max within the digit tolerance; counts (zero fraction * numel, non-finite) exact.
    numel = samples[0].numel()
    assert torch.allclose(sa[:3], sb[:3], rtol=0, atol=tol), (sa.tolist(), sb.tolist())
    # Computational zeros: exact, except elements whose reference digits lie within the digit
    # tolerance of the threshold (either side is right there; none in practice on the CPU).
    borderline = int(((db - 0.5).abs() <= tol).sum()) if want_digits else 0
    zeros_a, zeros_b = round(sa[3].item() * numel), round(sb[3].item() * numel)
    assert abs(zeros_a - zeros_b) <= borderline, (sa.tolist(), sb.tolist(), borderline)
    assert sa[4].item() == sb[4].item()
    if want_digits:
        assert da.shape == samples.shape[1:]
        assert torch.allclose(da, db, rtol=0, atol=tol), (da - db).abs().max()
    return a, sa


@needs_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_formats_modes_bit_exact(fmt, mode, dtype):
    fmt = get_format(fmt)
    if not fmt.fits_in(dtype):
        pytest.skip(f"{fmt} is not representable in {dtype}")
    x = adversarial_samples(3, (311,), dtype, fmt, seed=hash((fmt.name, mode)) & 0xFFFF)
    out, st = _check(x, fmt, mode)
    # The data really reaches the special cases (a test that can't fail is worse than none).
    assert st[4].item() > 0 and torch.isnan(out).any()


@needs_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["random", "stochastic", "nearest", "up", "down", "zero"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp16"])
def test_saturate_bit_exact(fmt, mode):
    fmt = get_format(fmt)
    x = adversarial_samples(3, (311,), torch.float32, fmt, seed=7)
    out, _ = _check(x, fmt, mode, saturate=True)
    assert out[~torch.isnan(out)].abs().max().item() == fmt.max_normal


@needs_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("case,shape,n", [
    (case, shape, n)
    for case in _SHAPE_CASES
    for shape in [(0,), (1,), (311,), (9999,), (7, 13)]
    for n in (2, 3, 5)
    # 9999 x N=5 takes seconds under the interpreter: all N for the default case only.
    if shape != (9999,) or n == 3 or case == _SHAPE_CASES[0]
], ids=str)
def test_shapes_and_sample_counts(case, shape, n):
    fmt, mode, dtype = case
    fmt = get_format(fmt)
    x = adversarial_samples(n, shape, dtype, fmt, seed=n)
    out, st = _check(x, fmt, mode)
    if math.prod(shape) == 0:
        assert out.shape == x.shape and st.tolist()[:3] == [fmt.digit_cap] * 3


@needs_interpreter
@pytest.mark.interpreter
def test_in_place_and_rounding_only():
    fmt = get_format("bf16")
    x = adversarial_samples(3, (500,), torch.float32, fmt, seed=3)
    ref, _, _ = round_digits_torch(x, fmt, "random", 5)
    y = x.clone()
    out, st, d = round_digits(y, fmt, "random", 5, out=y)
    assert out.data_ptr() == y.data_ptr() and d is None
    assert_bits_equal(y, ref)
    z, st2, _ = round_digits(x, fmt, "random", 5, stats=False)
    assert st2 is None
    assert_bits_equal(z, ref)
    one, _, _ = round_digits(x[:1].contiguous(), fmt, "nearest", stats=False)  # N=1 rounds
    assert_bits_equal(one, round_digits_torch(x[:1], fmt, "nearest", stats=False)[0])


@needs_interpreter
@pytest.mark.interpreter
def test_seed_changes_bits_and_draws_match_round_samples_scheme():
    fmt = get_format("bf16")
    x = torch.full((2, 4096), 1.0 + 2.0 ** -9, dtype=torch.float32)  # halfway: random picks
    a, _, _ = round_digits(x, fmt, "random", 1)
    b, _, _ = round_digits(x, fmt, "random", 2)
    assert not torch.equal(a, b)
    # N=2 is one antithetic pair: the two samples always round in opposite directions.
    assert bool((a[0] != a[1]).all())


@needs_interpreter
@pytest.mark.interpreter
def test_random_mode_up_down_balance():
    fmt = get_format("fp16")
    n, numel = 3, 8191
    # 1 + k * 2**-23, k = 1..8191: strictly between the fp16 neighbours 1 and 1 + 2**-10.
    x = 1.0 + 2.0 ** -23 * torch.arange(1, numel + 1, dtype=torch.float32)
    x = x.unsqueeze(0).repeat(n, 1) * torch.where(torch.arange(numel) % 2 == 0, 1.0, -1.0)
    out, _, _ = round_digits(x, fmt, "random", 12345, stats=False)
    up = (out.abs() > x.abs()).double()
    assert bool(((out.abs() > x.abs()) | (out.abs() < x.abs())).all())  # never exact here
    # Each of samples 0 and 1 is an independent fair coin per element: |frac - 1/2| <= 5 sigma.
    sigma = 0.5 / math.sqrt(numel)
    for i in (0, 1):
        assert abs(up[i].mean().item() - 0.5) < 5 * sigma, up[i].mean().item()
    assert bool((up[2] == 1 - up[1]).all())  # CADNA: sample 2 is the opposite of sample 1
    # Independence of the two draws: agreement rate is also a fair coin.
    assert abs((up[0] == up[1]).double().mean().item() - 0.5) < 5 * sigma
    # Up and down balanced per sign (no direction bias toward +inf or -inf).
    pos = x[0] > 0
    assert abs(up[0][pos].mean().item() - up[0][~pos].mean().item()) < 10 * sigma


@needs_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("frac", [0.25, 0.7])
def test_stochastic_mode_unbiased(frac):
    fmt = get_format("bf16")
    n, numel = 5, 4096
    lo = 1.0
    ulp = 2.0 ** -fmt.man_bits
    v = lo + frac * ulp
    x = torch.full((n, numel), v, dtype=torch.float32)
    out, _, _ = round_digits(x, fmt, "stochastic", 99, stats=False)
    assert set(out.unique().tolist()) <= {lo, lo + ulp}
    p_up = (out == lo + ulp).double().mean().item()
    sigma = math.sqrt(frac * (1 - frac) / (n * numel))
    assert abs(p_up - frac) < 5 * sigma, (p_up, frac)
    assert abs(out.double().mean().item() - v) < 5 * sigma * ulp


@needs_interpreter
@pytest.mark.interpreter
def test_launcher_validation():
    fmt = get_format("bf16")
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="contiguous"):
        round_digits(x.t().contiguous().t(), fmt, "nearest")
    with pytest.raises(ValueError, match="float32 or float64"):
        round_digits(x.half(), fmt, "nearest")
    with pytest.raises(ValueError, match="N >= 2"):
        round_digits(x[:1], fmt, "nearest")
    with pytest.raises(ValueError, match="not representable"):
        round_digits(x, "fp64", "nearest")
    with pytest.raises(ValueError, match="out must be"):
        round_digits(x, fmt, "nearest", out=torch.empty(3, 65))
    with pytest.raises(ValueError, match="unknown rounding mode"):
        round_digits(x, fmt, "sideways")
    with pytest.raises(ValueError, match="leading sample dimension"):
        round_digits(torch.tensor(1.0), fmt, "nearest")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt,dtype", [("bf16", torch.float32), ("fp16", torch.float32),
                                       ("fp8_e4m3", torch.float32), ("tf32", torch.float64),
                                       ("fp32", torch.float64)], ids=str)
def test_cuda_bit_exact(fmt, dtype, mode):
    fmt = get_format(fmt)
    x = adversarial_samples(3, (1_000_003,), dtype, fmt, seed=11).cuda()
    _check(x, fmt, mode)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", _SHAPE_CASES[:2], ids=str)
@pytest.mark.parametrize("n,shape", [(2, (1,)), (2, (311,)), (5, (9999,)), (5, (64, 999)),
                                     (3, (0,))], ids=str)
def test_cuda_shapes(case, n, shape):
    fmt, mode, dtype = case
    fmt = get_format(fmt)
    x = adversarial_samples(n, shape, dtype, fmt, seed=12).cuda()
    _check(x, fmt, mode)
