"""Formats (fxstab.numerics.formats): constants against ml_dtypes/NumPy finfo and validation."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxstab.numerics.formats import FORMATS, Format, get_format, working_dtype_for

FINFO = {
    "fp64": np.finfo(np.float64),
    "fp32": np.finfo(np.float32),
    "fp16": np.finfo(np.float16),
    "bf16": ml_dtypes.finfo(ml_dtypes.bfloat16),
    "fp8_e5m2": ml_dtypes.finfo(ml_dtypes.float8_e5m2),
    "fp8_e4m3": ml_dtypes.finfo(ml_dtypes.float8_e4m3fn),
}


@pytest.mark.parametrize("name", list(FINFO))
def test_named_constants_match_finfo(name):
    f, fi = get_format(name), FINFO[name]
    assert f.max_normal == float(fi.max)
    assert f.min_normal == float(fi.smallest_normal)
    assert f.min_subnormal == float(fi.smallest_subnormal)
    assert 2.0**-f.man_bits == float(fi.eps)  # machine epsilon = 2u
    assert f.unit_roundoff == float(fi.eps) / 2
    assert f.precision == fi.nmant + 1
    assert f.bits == fi.bits
    assert f.digit_cap == pytest.approx(f.precision * math.log10(2), abs=0)


def test_tf32_and_caps():
    t = get_format("tf32")
    assert (t.exp_bits, t.man_bits, t.precision) == (8, 10, 11)
    assert t.max_normal == (2 - 2.0**-10) * 2.0**127
    assert t.min_normal == 2.0**-126 and t.min_subnormal == 2.0**-136
    assert round(get_format("fp32").digit_cap, 2) == 7.22
    assert round(get_format("bf16").digit_cap, 2) == 2.41
    assert round(get_format("fp64").digit_cap, 2) == 15.95
    e4m3 = get_format("fp8_e4m3")
    assert e4m3.finite_only and not e4m3.has_inf and e4m3.max_normal == 448.0
    assert get_format("fp8_e5m2").has_inf and get_format("fp8_e5m2").max_normal == 57344.0


@settings(max_examples=200, derandomize=True, deadline=None)
@given(e=st.integers(2, 11), m=st.integers(1, 52))
def test_any_valid_pair(e, m):
    """Constants from first principles (IEEE-like: all-ones exponent reserved)."""
    f = get_format((e, m))
    bias = 2 ** (e - 1) - 1
    assert f.emin == 1 - bias and f.emax == bias
    assert f.max_normal == math.ldexp(2 - 2.0**-m, bias)
    assert f.min_normal == math.ldexp(1.0, 1 - bias)
    assert f.min_subnormal == math.ldexp(1.0, 1 - bias - m)
    assert f.unit_roundoff == 2.0 ** -(m + 1)
    assert f.bits == 1 + e + m
    assert get_format([e, m]) == f and get_format(f) is f
    assert f.fits_in(torch.float64)
    assert f.fits_in(torch.float32) == (m <= 23 and e <= 8 and 1 - bias - m >= -149)
    wd = working_dtype_for(f)
    assert wd == (torch.float32 if f.bits <= 16 and f.fits_in(torch.float32) else torch.float64)


def test_lookup_by_name_alias_dtype_and_pair():
    assert get_format("BF16") is FORMATS["bf16"]
    assert get_format(" bfloat16 ") is FORMATS["bf16"]
    assert get_format("fp8_e4m3fn") is FORMATS["fp8_e4m3"]
    assert get_format(torch.float16) is FORMATS["fp16"]
    assert get_format(torch.float64) is FORMATS["fp64"]
    assert get_format((8, 7)) is FORMATS["bf16"]
    # (4, 3) as a pair is the IEEE-like variant (with inf, max 240), not the fn one
    ieee = get_format((4, 3))
    assert not ieee.finite_only and ieee.max_normal == 240.0 and ieee.name == "e4m3"
    assert get_format((np.int64(5), torch.tensor(2).item())) == get_format((5, 2))
    assert Format(np.int32(3), np.int64(4)).exp_bits == 3
    assert type(Format(np.int32(3), np.int64(4)).man_bits) is int
    assert working_dtype_for(FORMATS["bf16"]) == torch.float32
    assert working_dtype_for(FORMATS["tf32"]) == torch.float64
    assert working_dtype_for(FORMATS["fp32"]) == torch.float64
    assert str(FORMATS["fp16"]) == "fp16" and Format(3, 2).name == "e3m2"


@pytest.mark.parametrize("spec, pattern", [
    ((0, 3), r"exp_bits must be in \[2, 11\], got 0"),
    ((1, 3), r"exp_bits must be in \[2, 11\], got 1"),
    ((12, 3), r"exp_bits must be in \[2, 11\], got 12"),
    ((5, 0), r"man_bits must be in \[1, 52\], got 0"),
    ((5, 53), r"man_bits must be in \[1, 52\], got 53"),
    ((5.0, 2), r"exp_bits must be an integer in \[2, 11\], got 5.0"),
    ((5, 2.5), r"man_bits must be an integer in \[1, 52\], got 2.5"),
    ((5, "2"), r"man_bits must be an integer .* got '2'"),
    ((True, 2), r"exp_bits must be an integer .* got True"),
    ((5, False), r"man_bits must be an integer .* got False"),
    ((5, 2, 1), r"\(exp_bits, man_bits\), got \(5, 2, 1\)"),
    ((5,), r"\(exp_bits, man_bits\), got \(5,\)"),
    ("fp12", r"unknown format 'fp12'.*2 <= exp_bits <= 11, 1 <= man_bits <= 52"),
    ("", r"unknown format ''"),
    (torch.int8, r"no fxstab format for dtype torch.int8"),
    (3.5, r"cannot make a format from 3.5"),
    (None, r"cannot make a format from None"),
])
def test_invalid_specs_raise_value_error(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        get_format(spec)
