"""GEMM data-perturbation surrogate (docs/design.md §4), plain-torch reference.

A GEMM is one vendor kernel whose internal rounding fxstab does not see. When an input's samples
are insufficiently separated, each sample's copy of that input is perturbed by a relative factor
(1 + eta*r), r uniform in [-1, 1), fresh per sample and element, before the product. That keeps a
well-conditioned product near full digits and exposes an ill-conditioned or cancelling one.

With a ``grid`` (the format the GEMM rounds into, :func:`grid_for`), a perturbed value is then
rounded stochastically onto that format's grid, saturating at its largest finite value (issue
52): the perturbed operands of a low-precision GEMM are data of that precision, as the hardware
sees them, unbiased (E[SR(y)] = y), so a GEMM of bf16 weights runs as bf16 GEMMs with no third
product for an off-grid part (``fxstab.numerics.lowp_gemm``). The rounding's word is 16 bits
(``randbits.random_halves`` under ``derive_seed(seed, GRID_SALT)``, shifted into the top of the
32-bit word of ``stochastic`` rounding): exact for a bf16 grid in fp32 samples (16 bits are
dropped), within 2^-16 of a unit for the others.

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

from typing import Optional

import torch

from . import randbits
from .formats import Format
from .randbits import CPU_CHUNK
from .rounding import Rounding, round_with_bits

__all__ = ["perturb_samples", "uniform_signed", "grid_for", "GRID_SALT"]

# the salt of the grid rounding's stream: derive_seed(seed, GRID_SALT) ("grid")
GRID_SALT = 0x67726964

# stored significand bits of the samples' dtypes: a grid at least this fine is no rounding
_WORKING_MAN_BITS = {torch.float32: 23, torch.float64: 52}


def grid_for(fmt: Optional[Format], dtype: torch.dtype) -> Optional[Format]:
    """The format whose grid a GEMM's perturbed samples of ``dtype`` are rounded onto: ``fmt``
    (the format the GEMM rounds into) where it is coarser than ``dtype`` and fits in it, else
    None (nothing to round: an fp32 format in fp32 samples)."""
    man = _WORKING_MAN_BITS.get(dtype)
    if fmt is None or man is None or fmt.man_bits >= man or not fmt.fits_in(dtype):
        return None
    return fmt


def uniform_signed(seed: int, numel: int, n_samples: int, dtype: torch.dtype, device=None,
                   start: int = 0) -> torch.Tensor:
    """r in (-1, 1), 256 symmetric levels: tensor [n_samples, numel] of ``dtype`` for elements
    ``start ..`` (a multiple of 16)."""
    b = randbits.random_bytes(seed, numel, list(range(n_samples)), device=device, start=start)
    return (2 * b + 1).to(dtype) * (2.0 ** -8) - 1.0


def perturb_samples(samples: torch.Tensor, eta: float, seed: int,
                    grid: Optional[Format] = None) -> tuple[torch.Tensor, int]:
    """Perturb the insufficiently separated elements of stacked samples ``[N, ...]``.

    Returns the perturbed samples (same shape and dtype) and the number of elements perturbed.
    ``eta`` must be a power of two (the format's unit roundoff 2**-p). With ``grid`` (see
    :func:`grid_for`), a perturbed value is rounded stochastically onto that format's grid.
    """
    grid = grid_for(grid, samples.dtype)
    if not samples.is_floating_point():
        return samples, 0
    n = samples.shape[0]
    flat = samples.reshape(n, -1)
    numel = flat.shape[1]
    if numel == 0:
        return samples, 0
    if numel <= CPU_CHUNK or flat.device.type != "cpu":
        perturbed, count = _perturb_columns(flat, eta, seed, 0, grid)
    else:  # column chunks bound the temporaries on the CPU (elementwise: same result)
        perturbed, count = torch.empty_like(flat), 0
        for a in range(0, numel, CPU_CHUNK):
            perturbed[:, a:a + CPU_CHUNK], c = _perturb_columns(flat[:, a:a + CPU_CHUNK], eta,
                                                                seed, a, grid)
            count += c
    return perturbed.reshape(samples.shape), count


def _perturb_columns(flat: torch.Tensor, eta: float, seed: int, start: int,
                     grid: Optional[Format]) -> tuple[torch.Tensor, int]:
    n, numel = flat.shape
    mean = flat.mean(0)
    spread = (flat - mean).abs().amax(0)
    close = spread <= eta * mean.abs()
    r = uniform_signed(seed, numel, n, flat.dtype, device=flat.device, start=start)
    moved = flat * (1.0 + eta * r)
    if grid is not None:
        halves = randbits.random_halves(randbits.derive_seed(seed, GRID_SALT), numel,
                                        list(range(n)), device=flat.device, start=start)
        moved = round_with_bits(moved, grid, Rounding.STOCHASTIC, halves << 16, saturate=True)
    return torch.where(close, moved, flat), int(close.sum())
