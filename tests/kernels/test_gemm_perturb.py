"""Fused GEMM perturbation kernel against fxstab.numerics.surrogate.perturb_samples (bit-exact)."""

from __future__ import annotations

import math

import pytest
import torch

from fxstab.kernels.gemm_perturb import perturb, perturb_torch
from fxstab.numerics.formats import get_format

from kernel_testutil import assert_bits_equal, needs_cuda, needs_interpreter


def _inputs(n: int, shape, dtype, eta: float, seed: int = 0) -> torch.Tensor:
    """Samples whose spread straddles eta*|mean|: a third identical, a third within and a third
    beyond the threshold, plus NaN/inf/zero elements."""
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    base = torch.randn(numel, generator=g, dtype=dtype) * 10.0 ** torch.randint(-5, 5, (numel,), generator=g).to(dtype)
    scale = torch.tensor([0.0, 0.5, 4.0], dtype=dtype)[torch.arange(numel) % 3]
    x = base * (1 + eta * scale * torch.randn(n, numel, generator=g, dtype=dtype))
    if numel >= 8:
        x[:, 3] = 0.0
        x[:, 4] = math.inf
        x[0, 5] = math.nan
        x[:, 6] = -0.0
    return x.reshape(n, *shape).contiguous()


@needs_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("n,shape", [(1, (311,)), (2, (311,)), (3, (9999,)), (5, (7, 13)),
                                     (3, (0,)), (3, (1,))], ids=str)
@pytest.mark.parametrize("grid", [None, "bf16", "fp8_e4m3"])
def test_perturb_bit_exact(n, shape, dtype, grid):
    """With a grid too: the perturbed values rounded onto it stochastically (the same words)."""
    eta = 2.0 ** -8
    grid = None if grid is None else get_format(grid)
    x = _inputs(n, shape, dtype, eta, seed=n)
    a, ca = perturb(x, eta, 2**64 - 77, grid)
    b, cb = perturb_torch(x, eta, 2**64 - 77, grid)
    assert_bits_equal(a, b)
    assert ca.item() == cb.item()
    if math.prod(shape) > 100:
        # The data straddles the threshold: some elements perturbed, some not.
        assert 0 < ca.item() < math.prod(shape)
        assert not torch.equal(a, x)


@needs_interpreter
@pytest.mark.interpreter
def test_perturb_validation():
    x = torch.ones(3, 8)
    with pytest.raises(ValueError, match="power of two"):
        perturb(x, 0.003, 0)
    with pytest.raises(ValueError, match="contiguous"):
        perturb(torch.ones(8, 3).t(), 2.0**-8, 0)
    with pytest.raises(ValueError, match="float32/float64"):
        perturb(x.half(), 2.0**-8, 0)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_perturb_cuda_bit_exact(n, dtype):
    eta = 2.0 ** -11
    x = _inputs(n, (1_000_003,), dtype, eta, seed=n).cuda()
    a, ca = perturb(x, eta, 123)
    b, cb = perturb_torch(x, eta, 123)
    assert_bits_equal(a, b)
    assert ca.item() == cb.item()
