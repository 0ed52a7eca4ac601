"""GEMM data-perturbation surrogate (docs/design.md §4), plain-torch reference.

A GEMM is one vendor kernel whose internal rounding fxstab does not see. When an input's samples
are insufficiently separated, each sample's copy of that input is perturbed by a relative factor
(1 + eta*r), r uniform in [-1, 1), fresh per sample and element, before the product. That keeps a
well-conditioned product near full digits and exposes an ill-conditioned or cancelling one.

Separation is tested per element: element e is perturbed when max_k |x_k,e - mean_e| <=
eta * |mean_e| (identical samples included). The fused Triton kernel in ``fxstab.kernels``
computes the same function with the same bits:

* r for (sample k, element e) is ``(2*b + 1) * 2**-8 - 1`` (256 levels, symmetric, mean 0) with
  ``b`` the byte of draw k, element e of ``fxstab.numerics.randbits.random_bytes`` (one Philox per 16
  elements: the weights of every GEMM are perturbed for every sample, so this must be cheap);
  eta*r is exact (eta is a power of two), so 1 + eta*r is rounded once whether or not the
  compiler fuses it into an FMA.
"""

from __future__ import annotations

import torch

from . import randbits
from .randbits import CPU_CHUNK

__all__ = ["perturb_samples", "uniform_signed"]


def uniform_signed(seed: int, numel: int, n_samples: int, dtype: torch.dtype, device=None,
                   start: int = 0) -> torch.Tensor:
    """r in (-1, 1), 256 symmetric levels: tensor [n_samples, numel] of ``dtype`` for elements
    ``start ..`` (a multiple of 16)."""
    b = randbits.random_bytes(seed, numel, list(range(n_samples)), device=device, start=start)
    return (2 * b + 1).to(dtype) * (2.0 ** -8) - 1.0


def perturb_samples(samples: torch.Tensor, eta: float, seed: int) -> tuple[torch.Tensor, int]:
    """Perturb the insufficiently separated elements of stacked samples ``[N, ...]``.

    Returns the perturbed samples (same shape and dtype) and the number of elements perturbed.
    ``eta`` must be a power of two (the format's unit roundoff 2**-p).
    """
    if not samples.is_floating_point():
        return samples, 0
    n = samples.shape[0]
    flat = samples.reshape(n, -1)
    numel = flat.shape[1]
    if numel == 0:
        return samples, 0
    if numel <= CPU_CHUNK or flat.device.type != "cpu":
        perturbed, count = _perturb_columns(flat, eta, seed, 0)
    else:  # column chunks bound the temporaries on the CPU (elementwise: same result)
        perturbed, count = torch.empty_like(flat), 0
        for a in range(0, numel, CPU_CHUNK):
            perturbed[:, a:a + CPU_CHUNK], c = _perturb_columns(flat[:, a:a + CPU_CHUNK], eta,
                                                                seed, a)
            count += c
    return perturbed.reshape(samples.shape), count


def _perturb_columns(flat: torch.Tensor, eta: float, seed: int, start: int) -> tuple[torch.Tensor, int]:
    mean = flat.mean(0)
    spread = (flat - mean).abs().amax(0)
    close = spread <= eta * mean.abs()
    r = uniform_signed(seed, flat.shape[1], flat.shape[0], flat.dtype, device=flat.device,
                       start=start)
    return torch.where(close, flat * (1.0 + eta * r), flat), int(close.sum())
