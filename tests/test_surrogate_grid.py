"""The GEMM surrogate's perturbed values on the format's grid (issue 52, item 2; docs/design.md
§4): stochastically rounded, unbiased, saturating, specials kept; the kernels' bits are checked
against this reference in tests/test_native.py and tests/kernels/test_gemm_perturb.py."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fxstab.numerics import lowp_gemm
from fxstab.numerics.formats import get_format
from fxstab.numerics.rounding import round_samples
from fxstab.numerics.surrogate import grid_for, perturb_samples

BF16 = get_format("bf16")


def _on_grid(x: torch.Tensor, fmt) -> bool:
    return torch.equal(x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int64),
                       round_samples(x, fmt, "nearest").view(torch.int32 if x.dtype ==
                                                              torch.float32 else torch.int64))


@pytest.mark.parametrize("fmt,dtype", [("bf16", torch.float32), ("fp16", torch.float32),
                                       ("fp8_e4m3", torch.float32), ("fp8_e5m2", torch.float64),
                                       ("fp32", torch.float64)])
def test_perturbed_values_lie_on_the_grid_and_only_they_move(fmt, dtype):
    f = get_format(fmt)
    g = torch.Generator().manual_seed(1)
    v = round_samples((torch.randn(3000, generator=g, dtype=dtype) * 4).unsqueeze(0), f,
                      "nearest")[0]
    x = v.expand(3, -1).clone()  # identical samples: every element close
    # separated (spread |v| about a mean 2v: beyond any eta here), off the grid
    x[:, 2000:] = torch.randn(1000, generator=g, dtype=dtype) * torch.tensor(
        [1.0, 2.0, 3.0], dtype=dtype).unsqueeze(1) * (1 + 2.0 ** -20)
    out, count = perturb_samples(x, f.unit_roundoff, 7, f)
    assert count == 2000
    assert _on_grid(out[:, :2000], f)
    assert torch.equal(out[:, 2000:], x[:, 2000:])  # separated samples are left as they are
    assert (out[:, :2000] != x[:, :2000]).float().mean() > 0.2  # and the close ones do move


def test_the_grid_rounding_is_unbiased():
    """E[SR(x (1 + eta r))] = x: over many seeds the mean of the perturbed values of one bf16
    value in the middle of its binade is that value within the sampling error, and each sample
    lands on one of its two neighbours or on itself."""
    x = torch.full((3, 4096), 1.0 + 2.0 ** -7 * 37)  # a bf16 value
    outs = torch.stack([perturb_samples(x, 2.0 ** -8, s, BF16)[0] for s in range(16)])
    ulp = 2.0 ** -7
    steps = ((outs - x) / ulp).round()
    assert set(steps.unique().tolist()) <= {-1.0, 0.0, 1.0}
    # sd of one step <= 1, 16*3*4096 of them: 5 sigma of the mean is < 0.01 ulp
    assert abs(float(steps.mean())) < 0.01


def test_values_at_the_format_limits():
    """The largest finite values saturate (never inf, nor NaN in an fn format), subnormals
    round onto the subnormal grid, zeros keep their sign, NaN and inf pass as they are."""
    for name in ("bf16", "fp16", "fp8_e4m3"):
        f = get_format(name)
        v = torch.tensor([f.max_normal, -f.max_normal, f.min_subnormal, -3 * f.min_subnormal,
                          0.0, -0.0, math.inf, -math.inf, math.nan] * 64)
        out, _ = perturb_samples(v.expand(3, -1).contiguous(), f.unit_roundoff, 3, f)
        finite = torch.isfinite(v)
        assert torch.isfinite(out[:, finite]).all(), name
        assert out[:, finite].abs().max() <= f.max_normal
        assert _on_grid(out[:, finite], f)
        zeros = v == 0
        assert torch.equal(torch.signbit(out[:, zeros]), torch.signbit(v[zeros]).expand(3, -1))
        assert torch.equal(out[:, v.isinf()], v[v.isinf()].expand(3, -1))
        assert out[:, v.isnan()].isnan().all()
    # the grid is the format's as ml_dtypes has it
    out, _ = perturb_samples(torch.full((3, 512), 3.0e-40), 2.0 ** -8, 5, BF16)
    np.testing.assert_array_equal(out.numpy().astype(ml_dtypes.bfloat16).astype(np.float32),
                                  out.numpy())


def test_no_grid_where_the_samples_hold_nothing_finer():
    assert grid_for(get_format("fp32"), torch.float32) is None
    assert grid_for(None, torch.float32) is None
    assert grid_for(BF16, torch.float32) is BF16
    assert grid_for(get_format("fp32"), torch.float64) == get_format("fp32")
    x = torch.randn(3, 100).expand(3, 100).contiguous()
    a, _ = perturb_samples(x, 2.0 ** -24, 4, get_format("fp32"))
    b, _ = perturb_samples(x, 2.0 ** -24, 4)
    assert torch.equal(a, b)


def test_perturbed_operands_need_no_third_product():
    """The point of the grid: a perturbed bf16 operand splits into bf16(x) and no off-grid part,
    so the bf16 GEMM path runs hi and the residual only (no d product)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 64, 256, generator=g).bfloat16().float().expand(3, -1, -1).contiguous()
    on, _ = perturb_samples(x, 2.0 ** -8, 9, BF16)
    off, _ = perturb_samples(x, 2.0 ** -8, 9)
    assert lowp_gemm.split_reference(on.reshape(-1, 256))[1] is None
    assert lowp_gemm.split_reference(off.reshape(-1, 256))[1] is not None
