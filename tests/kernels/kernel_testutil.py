"""Shared helpers for the kernel tests: interpreter detection and adversarial sample data."""

from __future__ import annotations

import math

import pytest
import torch

from fxstab.numerics.formats import Format

INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}


def kernels_runnable() -> bool:
    from fxstab.kernels.round_digits import interpreter_active

    return interpreter_active()


needs_interpreter = pytest.mark.skipif(
    not kernels_runnable(),
    reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before import (make test)",
)
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and not kernels_runnable()),
    reason="needs a CUDA device with compiled (not interpreted) Triton kernels",
)


def cuda_ready() -> bool:
    return torch.cuda.is_available() and not kernels_runnable()


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-exact comparison (NaN payloads and signed zeros included)."""
    return t.contiguous().view(INT_VIEW[t.dtype])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    ba, bb = bits(a).reshape(-1), bits(b).reshape(-1)
    bad = (ba != bb).nonzero()
    assert bad.numel() == 0, (
        f"{bad.numel()} elements differ, first at {bad[0].item()}: "
        f"{a.reshape(-1)[bad[0]].item()!r} vs {b.reshape(-1)[bad[0]].item()!r}")


def adversarial_samples(n: int, shape, dtype: torch.dtype, fmt: Format, seed: int = 0) -> torch.Tensor:
    """Stacked samples [n, *shape] that exercise the whole exponent range of ``fmt``.

    Magnitudes span the format's subnormals to past its overflow threshold, plus the working
    dtype's own subnormals and extremes, signed zeros, infinities and NaN; samples of one
    element are close (relative spread ~ the format's epsilon), identical, all zero, of mixed
    signs (computational zeros) or contain a lone NaN.
    """
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    finfo = torch.finfo(dtype)
    nmant = 23 if dtype == torch.float32 else 52
    lo_exp = max(fmt.emin - fmt.man_bits - 3, math.frexp(finfo.tiny)[1] - nmant - 1)
    hi_exp = min(fmt.emax + 2, math.frexp(finfo.max)[1] - 1)
    k = torch.randint(lo_exp, hi_exp + 1, (numel,), generator=g).to(dtype)
    base = torch.randn(numel, generator=g, dtype=dtype) * torch.pow(torch.tensor(2.0, dtype=dtype), k)
    specials = torch.tensor([
        0.0, -0.0, math.inf, -math.inf, math.nan, finfo.tiny * 2.0**-nmant, finfo.max,
        -finfo.tiny, fmt.max_normal, -fmt.max_normal, fmt.min_subnormal, fmt.min_subnormal / 2,
        fmt.min_subnormal * 0.75, fmt.min_normal, fmt.max_normal * (1 + 2.0 ** -(fmt.man_bits + 1)),
        fmt.max_normal * (1 + 2.0 ** -(fmt.man_bits + 2)), 1.0, 1.0 + 2.0 ** -(fmt.man_bits + 1),
    ], dtype=torch.float64).to(dtype)
    m = min(numel, specials.numel())
    pos = torch.randperm(numel, generator=g)[:m]
    base[pos] = specials[:m]
    eps = 2.0 ** -fmt.man_bits
    noise = 1 + eps * torch.randn(n, numel, generator=g, dtype=dtype)
    x = base.unsqueeze(0) * noise
    kind = torch.randint(0, 6, (numel,), generator=g)
    x = torch.where((kind == 0).unsqueeze(0), base.unsqueeze(0).expand(n, -1), x)  # identical
    x = torch.where((kind == 1).unsqueeze(0), torch.zeros_like(x), x)  # exact zero
    signs = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).to(dtype).unsqueeze(1)
    x = torch.where((kind == 2).unsqueeze(0), x * signs, x)  # mixed signs
    x[:, pos] = specials[:m].unsqueeze(0)  # specials identical across samples
    if numel > m + 1 and n > 1:
        x[n - 1, pos[0] if m == 0 else (pos[-1] + 1) % numel] = math.nan  # a lone NaN
    return x.reshape(n, *shape).contiguous()
