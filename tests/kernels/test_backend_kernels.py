"""The backend's kernels option: the fused kernels and the torch path give the same digit map."""

from __future__ import annotations

import pytest
import torch

import fxstab
from kernel_testutil import needs_interpreter
from models import CancellingLinear, MLP


def _map(model, x, kernels):
    torch._dynamo.reset()
    be = fxstab.backend(format="bf16", seed=11, kernels=kernels)
    torch.compile(model, backend=be)(x)
    return {r.name: r for r in be.reports}


@needs_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("make", [MLP, CancellingLinear])
def test_triton_and_torch_paths_give_the_same_digit_map(make):
    torch.manual_seed(0)
    model, x = make(), torch.randn(8, 16)
    ref = _map(model, x, "torch")
    fused = _map(model, x, "triton")
    assert list(ref) == list(fused)
    for name, r in ref.items():
        f = fused[name]
        # Same Philox bits, so the same rounded samples; the digits differ by float rounding
        # of the estimator only (log2 vs log10, a reciprocal): 1e-5 digits bounds it.
        assert f.min_digits == pytest.approx(r.min_digits, abs=1e-5), name
        assert f.avg_digits == pytest.approx(r.avg_digits, abs=1e-5), name
        assert (f.non_finite, f.surrogate, f.numel) == (r.non_finite, r.surrogate, r.numel)
        assert f.zero_fraction == pytest.approx(r.zero_fraction, abs=1.0 / r.numel), name
        # the extras come from the same rounded samples by the same torch code
        assert (f.p10_digits, f.p50_digits, f.underflow) == \
            (r.p10_digits, r.p50_digits, r.underflow), name
        assert f.normwise_digits == pytest.approx(r.normwise_digits, abs=1e-12), name


def test_triton_without_gpu_or_interpreter_says_why(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: kernels='triton' is valid")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fxstab.backend(kernels="triton")
