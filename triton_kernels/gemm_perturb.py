"""Fused GEMM data-perturbation surrogate (docs/design.md §4): separation test + perturbation.

For stacked input samples ``[N, numel]`` an element is *close* when every sample is within
``eta * |mean|`` of the mean (identical samples included); close elements are multiplied, per
sample, by ``1 + eta * r`` with ``r = (2b + 1) / 256 - 1`` and ``b`` the byte of
``fxstab.numerics.randbits.random_bytes`` for (sample k, element e), exactly as
``fxstab.numerics.surrogate.perturb_samples``.

One program owns ``BLOCK`` elements of every sample: it sums the samples (mean), re-reads them
for the separation test and a third time to perturb and store; the re-reads hit L1/L2, so HBM
sees the samples read once and written once. A per-program count of perturbed elements is
summed by torch.

The mean must match the reference bit for bit, because the separation test compares it with
the spread: torch computes ``mean(0)`` as a sequential sum divided by N on the CPU and as that
sum times ``1/N`` on CUDA (ATen's ``MeanOps``), so the kernel takes the same route per device.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fxstab.numerics import randbits
from fxstab.numerics.surrogate import perturb_samples

from .round_digits import check_launchable, interpreter_active

__all__ = ["perturb", "perturb_torch"]


@triton.jit
def _perturb_kernel(x_ptr, out_ptr, count_ptr, numel, seed, eta,
                    N: tl.constexpr, INV_N: tl.constexpr, IS64: tl.constexpr, MEAN_RECIP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    stride = tl.to_tensor(numel).to(tl.int64)
    for i in tl.static_range(N):
        x = tl.load(x_ptr + i * stride + offs, mask=mask, other=0.0)
        if i == 0:
            total = x
        else:
            total = total + x
    if MEAN_RECIP:
        mean = total * tl.full([BLOCK], INV_N, total.dtype)
    elif IS64:
        mean = total / N  # fp64 division is IEEE (div.rn.f64) on the GPU
    else:
        mean = tl.div_rn(total, tl.full([BLOCK], N, tl.float32))  # fp32 '/' is div.full
    bound = eta * tl.abs(mean)  # exact: eta is a power of two
    close = mask
    for i in tl.static_range(N):
        x = tl.load(x_ptr + i * stride + offs, mask=mask, other=0.0)
        # all(|x_k - mean| <= bound) == (max_k |x_k - mean| <= bound), NaN giving False in both
        close = close & (tl.abs(x - mean) <= bound)
    # fxstab.numerics.randbits.random_bytes: byte e % 4 of word (e // 4) % 4 of
    # philox(seed, lo32(e // 16), k, hi32(e // 16), 0) for sample k, element e.
    g = offs // 16
    c0 = (g & 0xFFFFFFFF).to(tl.uint32)
    c2 = (g >> 32).to(tl.uint32)
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    word = (offs // 4) % 4
    shift = ((offs % 4) * 8).to(tl.uint32)
    for i in tl.static_range(N):
        s0, s1, s2, s3 = tl.philox(seed, c0, zero + i, c2, zero)
        w = tl.where(word == 0, s0, tl.where(word == 1, s1, tl.where(word == 2, s2, s3)))
        b = (w >> shift) & 0xFF
        x = tl.load(x_ptr + i * stride + offs, mask=mask, other=0.0)
        r = (2 * b + 1).to(x.dtype) * 0.00390625 - 1.0  # (2b + 1) / 256 - 1: exact
        y = tl.where(close, x * (1.0 + eta * r), x)
        tl.store(out_ptr + i * stride + offs, y, mask=mask)
    tl.store(count_ptr + pid, tl.sum(close.to(tl.int32)))


_BLOCK_GPU = 1024
_BLOCK_INTERPRETER = 1024


def _check_eta(eta: float) -> float:
    if isinstance(eta, bool) or not isinstance(eta, (int, float)):
        raise ValueError(f"eta must be a float, got {eta!r}")
    eta = float(eta)
    if not (eta > 0.0 and math.isfinite(eta) and math.frexp(eta)[0] == 0.5 and eta >= 2.0**-126):
        raise ValueError(f"eta must be a power of two in [2**-126, inf) (the format's unit "
                         f"roundoff 2**-p), got {eta!r}")
    return eta


def perturb(samples: torch.Tensor, eta: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused separation test + perturbation of stacked samples ``[N, ...]`` (fp32/fp64).

    Args:
        samples: Contiguous float32/float64 tensor with the samples on dim 0.
        eta: Relative perturbation, a power of two (the format's unit roundoff).
        seed: Seed of the Philox stream (any integer; taken modulo 2**64).

    Returns:
        ``(perturbed, n_perturbed)``: a new tensor like ``samples`` and a 0-dim int64 tensor on
        the same device (no host sync).
    """
    if not isinstance(samples, torch.Tensor) or samples.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"perturb: samples must be a float32/float64 tensor, got "
                         f"{getattr(samples, 'dtype', type(samples).__name__)}")
    if samples.dim() < 1 or samples.shape[0] < 1:
        raise ValueError(f"perturb: samples need a leading sample dimension, got shape "
                         f"{tuple(samples.shape)}")
    if not samples.is_contiguous():
        raise ValueError(f"perturb: samples must be contiguous (strides {samples.stride()}); "
                         f"call .contiguous() first")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"perturb: seed must be an int, got {seed!r}")
    eta = _check_eta(eta)
    check_launchable(samples, "perturb")
    n = samples.shape[0]
    numel = samples[0].numel()
    out = torch.empty_like(samples)
    if numel == 0:
        return out, torch.zeros((), dtype=torch.int64, device=samples.device)
    block = _BLOCK_INTERPRETER if interpreter_active() else _BLOCK_GPU
    grid = (triton.cdiv(numel, block),)
    counts = torch.empty(grid[0], dtype=torch.int32, device=samples.device)
    _perturb_kernel[grid](samples, out, counts, numel, seed & randbits.M64, eta,
                          N=n, INV_N=1.0 / n, IS64=samples.dtype == torch.float64, MEAN_RECIP=samples.device.type == "cuda", BLOCK=block,
                          num_warps=4)
    return out, counts.sum(dtype=torch.int64)


def perturb_torch(samples: torch.Tensor, eta: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of :func:`perturb` (``fxstab.numerics.surrogate.perturb_samples``)."""
    eta = _check_eta(eta)
    out, count = perturb_samples(samples, eta, seed & randbits.M64)
    if out is samples:  # nothing perturbed or empty: the reference returns its input
        out = samples.clone()
    return out, torch.tensor(count, dtype=torch.int64, device=samples.device)
