"""Fused GEMM data-perturbation surrogate (docs/design.md §4): separation test + perturbation.

For stacked input samples ``[N, numel]`` an element is *close* when every sample is within
``eta * |mean|`` of the mean (identical samples included); close elements are multiplied, per
sample, by ``1 + eta * r`` with ``r = (2b + 1) / 256 - 1`` and ``b`` the byte of
``fxstab.numerics.randbits.random_bytes`` for (sample k, element e), exactly as
``fxstab.numerics.surrogate.perturb_samples``; with a grid (the format the GEMM rounds into), a
perturbed value is then rounded onto it stochastically, saturating, with the 16-bit uniform of
``randbits.random_halves`` under ``derive_seed(seed, GRID_SALT)`` as the top of the 32-bit word
(``round_digits.round_bits`` in stochastic mode).

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
from typing import Optional

import torch
import triton
import triton.language as tl

from fxstab.numerics import randbits
from fxstab.numerics.formats import Format
from fxstab.numerics.surrogate import GRID_SALT, grid_for, perturb_samples

from .round_digits import check_launchable, format_constants, interpreter_active, round_bits

__all__ = ["perturb", "perturb_torch"]


@triton.jit
def _perturb_kernel(x_ptr, out_ptr, count_ptr, numel, seed, grid_seed, eta,
                    N: tl.constexpr, INV_N: tl.constexpr, IS64: tl.constexpr,
                    MEAN_RECIP: tl.constexpr, BLOCK: tl.constexpr, GRID: tl.constexpr,
                    WM: tl.constexpr, EXP_ONES: tl.constexpr, SHMAX: tl.constexpr,
                    SHIFT0: tl.constexpr, EB: tl.constexpr, MAX_BITS: tl.constexpr,
                    MINSUB_BITS: tl.constexpr, INF_BITS: tl.constexpr, NAN_BITS: tl.constexpr,
                    BIG_BITS: tl.constexpr, FINITE_ONLY: tl.constexpr):
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
    # the grid rounding's word (randbits.random_halves): half e % 2 of word (e // 2) % 4 of
    # philox(grid_seed, lo32(e // 8), k, hi32(e // 8), 0), in the top 16 bits
    g8 = offs // 8
    h0 = (g8 & 0xFFFFFFFF).to(tl.uint32)
    h2 = (g8 >> 32).to(tl.uint32)
    hword = (offs // 2) % 4
    hshift = ((offs % 2) * 16).to(tl.uint32)
    for i in tl.static_range(N):
        s0, s1, s2, s3 = tl.philox(seed, c0, zero + i, c2, zero)
        w = tl.where(word == 0, s0, tl.where(word == 1, s1, tl.where(word == 2, s2, s3)))
        b = (w >> shift) & 0xFF
        x = tl.load(x_ptr + i * stride + offs, mask=mask, other=0.0)
        r = (2 * b + 1).to(x.dtype) * 0.00390625 - 1.0  # (2b + 1) / 256 - 1: exact
        y = x * (1.0 + eta * r)
        if GRID:
            t0, t1, t2, t3 = tl.philox(grid_seed, h0, zero + i, h2, zero)
            hw = tl.where(hword == 0, t0, tl.where(hword == 1, t1, tl.where(hword == 2, t2, t3)))
            rand = ((hw >> hshift) & 0xFFFF) << 16
            y, _ = round_bits(y, rand, 1, IS64, WM, EXP_ONES, SHMAX, SHIFT0, EB, MAX_BITS,
                              MINSUB_BITS, INF_BITS, NAN_BITS, BIG_BITS, FINITE_ONLY, True)
        y = tl.where(close, y, x)
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


def perturb(samples: torch.Tensor, eta: float, seed: int,
            grid: Optional[Format] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused separation test + perturbation of stacked samples ``[N, ...]`` (fp32/fp64).

    Args:
        samples: Contiguous float32/float64 tensor with the samples on dim 0.
        eta: Relative perturbation, a power of two (the format's unit roundoff).
        seed: Seed of the Philox stream (any integer; taken modulo 2**64).
        grid: The format the perturbed values are rounded onto (``grid_for``), or None.

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
    launch = (triton.cdiv(numel, block),)
    counts = torch.empty(launch[0], dtype=torch.int32, device=samples.device)
    fmt = grid_for(grid, samples.dtype)
    consts = format_constants(fmt, samples.dtype) if fmt is not None else {}
    seed &= randbits.M64
    _perturb_kernel[launch](samples, out, counts, numel, seed,
                            randbits.derive_seed(seed, GRID_SALT), eta,
                            N=n, INV_N=1.0 / n, IS64=samples.dtype == torch.float64,
                            MEAN_RECIP=samples.device.type == "cuda", BLOCK=block,
                            GRID=fmt is not None, num_warps=4,
                            **{k: consts.get(k, 0) for k in _FORMAT_KEYS})
    return out, counts.sum(dtype=torch.int64)


# the rounding's constants the kernel takes (format_constants' others: IS64 is its own)
_FORMAT_KEYS = ("WM", "EXP_ONES", "SHMAX", "SHIFT0", "EB", "MAX_BITS", "MINSUB_BITS",
                "INF_BITS", "NAN_BITS", "BIG_BITS", "FINITE_ONLY")


def perturb_torch(samples: torch.Tensor, eta: float, seed: int,
                  grid: Optional[Format] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of :func:`perturb` (``fxstab.numerics.surrogate.perturb_samples``)."""
    eta = _check_eta(eta)
    out, count = perturb_samples(samples, eta, seed & randbits.M64, grid)
    if out is samples:  # nothing perturbed or empty: the reference returns its input
        out = samples.clone()
    return out, torch.tensor(count, dtype=torch.int64, device=samples.device)
