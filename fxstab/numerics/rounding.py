"""Rounding of floating tensors into a simulated format (docs/design.md §1).

The rounding works on the bit patterns of the working dtype (fp32 or fp64): truncating the low
``shift`` bits of |x| gives the lower neighbour ``lo`` on the format's grid, adding one unit at
bit ``shift`` gives the upper neighbour ``hi`` (the carry moves into the exponent exactly as the
next binade needs). ``shift`` grows below the format's smallest normal so that subnormals are on
the right grid; values below the smallest subnormal have ``lo = 0`` and ``hi = min_subnormal``.
Every mode then only chooses between ``lo`` and ``hi``; values already on the grid are returned
unchanged. Overflow follows IEEE 754 and ``ml_dtypes``: a result above the largest finite value
becomes inf (NaN for fn formats) when the rounding went away from zero or to nearest, and the
largest finite value when it went toward zero; ``saturate=True`` clamps every overflow (and
infinite inputs) to ±max, NVIDIA "satfinite" style. NaN passes through; zeros keep their sign.

The same function is the plain-torch reference of the fused Triton kernel in
``fxstab.kernels``: given the same seed it draws the same bits (``fxstab.numerics.randbits``).
"""

from __future__ import annotations

from enum import Enum
from typing import Optional

import torch

from . import randbits
from .formats import WORKING_DTYPES, Format, FormatLike, float_bits, get_format

__all__ = ["Rounding", "MODE_CODES", "default_seed", "quantize", "round_samples", "sample_draws",
           "round_with_bits"]


class Rounding(str, Enum):
    """Rounding modes. ``random`` is CESTAC's: up or down with probability 1/2 each."""

    RANDOM = "random"
    STOCHASTIC = "stochastic"
    NEAREST = "nearest"
    UP = "up"
    DOWN = "down"
    ZERO = "zero"

    @classmethod
    def parse(cls, mode) -> "Rounding":
        if isinstance(mode, cls):
            return mode
        try:
            return cls(str(mode).lower())
        except ValueError:
            raise ValueError(f"unknown rounding mode {mode!r}; choose one of "
                             f"{', '.join(m.value for m in cls)}") from None


MODE_CODES = {Rounding.RANDOM: 0, Rounding.STOCHASTIC: 1, Rounding.NEAREST: 2, Rounding.UP: 3,
              Rounding.DOWN: 4, Rounding.ZERO: 5}
"""The integer code of each mode in the fused kernels (the Triton kernel's ``MODE``, the
``MODE_*`` constants of ``fxstab/cpu/csrc/cpu_kernels.c``)."""

_SIGN = {torch.int32: -(1 << 31), torch.int64: -(1 << 63)}


def sample_draws(n_samples: int) -> tuple[list[int], list[bool]]:
    """Cross-sample scheme of docs/design.md §1: (draw index, flipped) for each sample.

    CADNA's rule for N=3: samples 0 and 1 draw independent directions, sample 2 takes the
    opposite of sample 1. In general the samples pair up antithetically (for odd N the first
    sample stays alone), so an operation that rounds never leaves all samples identical.
    """
    draws, flips = [], []
    free = 0
    start = n_samples % 2
    for i in range(n_samples):
        j = i - start
        if i >= start and j % 2 == 1:
            draws.append(draws[-1])
            flips.append(True)
        else:
            draws.append(free)
            flips.append(False)
            free += 1
    return draws, flips


def round_with_bits(
    x: torch.Tensor,
    fmt: Format,
    mode: Rounding,
    rand: Optional[torch.Tensor] = None,
    saturate: bool = False,
) -> torch.Tensor:
    """Round ``x`` (fp32 or fp64, already the working dtype) into ``fmt``.

    ``rand`` supplies the randomness, broadcastable to ``x``: 0/1 bits for ``random`` (1 picks
    the upper neighbour in magnitude), uint32 words held in int64 for ``stochastic``; unused
    for the deterministic modes. This is the shared core of every rounding path.

    The contract a kernel reproduces: with ``lo``/``hi`` the neighbours of |x| and
    ``frac = (|x| - lo) / (hi - lo)``, ``random`` takes hi iff the bit is 1, ``stochastic``
    iff ``word < floor(frac * 2**32)``, ``nearest`` ties to an even integral significand;
    values on the grid never move. fp32 works on int32 patterns, fp64 on int64.
    """
    int_dtype, wm, wbias, wexp_ones, sh_max = WORKING_DTYPES[x.dtype]
    m = fmt.man_bits
    bits = x.view(int_dtype)  # a view: never modified in place below
    mag = bits & ~_SIGN[int_dtype]
    inf_bits = wexp_ones << wm
    max_bits = float_bits(fmt.max_normal, x.dtype)

    # Low bits below the format's quantum: shift = (wm - m) + clamp(emin - e_eff, 0), with
    # e_eff = max(E, 1) - wbias the unbiased exponent (working subnormals count as its emin).
    # With K = emin + wbias >= 1 that is (wm - m) + clamp(K - E, 0, K - 1).
    k = fmt.emin + wbias
    exp_field = mag >> wm
    # |x| < min_subnormal ("tiny": lo = 0, hi = min_subnormal) needs E < K - m; for formats
    # whose subnormals are the working dtype's (bf16 in fp32) it cannot happen, and then the
    # significand's bits below wm are the pattern's own.
    may_be_tiny = k - m > 0
    if may_be_tiny:
        # significand with the implicit bit: mag - (max(E - 1, 0) << wm)
        significand = mag - (exp_field - 1).clamp_(min=0).bitwise_left_shift_(wm)
    else:
        significand = mag
    shift = exp_field.neg_().add_(k).clamp_(0, k - 1).add_(wm - m)  # reuses exp_field
    tiny = shift > wm if may_be_tiny else None
    sh = shift.clamp(max=sh_max) if may_be_tiny else shift
    unit = torch.bitwise_left_shift(torch.ones_like(sh), sh)
    low_mask = unit - 1
    rem = significand & low_mask  # = mag & low_mask unless tiny, where it is the significand

    if mode is Rounding.NEAREST:
        # ties to even: up iff rem + parity > half (integers; parity = bit sh of the significand,
        # implicit bit included: at shift == wm, lo = one quantum is odd).
        go = (significand >> sh).bitwise_and_(1).add_(rem) > (low_mask >> 1).add_(1)
    elif mode is Rounding.ZERO:
        go = None
    elif mode in (Rounding.UP, Rounding.DOWN):
        go = (bits >= 0) if mode is Rounding.UP else (bits < 0)
        go &= rem != 0
    elif mode is Rounding.RANDOM:
        if rand is None:
            raise ValueError("random rounding needs random bits")
        go = (rand != 0) & (rem != 0)
    elif mode is Rounding.STOCHASTIC:
        if rand is None:
            raise ValueError("stochastic rounding needs random words")
        # P(up) = rem / 2**shift, resolved on 32 bits: up iff word < rem * 2**(32 - shift)
        # (exact for shift <= 32), i.e. iff word >> (32 - shift) < rem; for shift > 32 (only
        # below min_subnormal) iff word < rem >> (shift - 32), truncated below 2**-32.
        go = (rand >> (32 - shift).clamp_(min=0)) < (rem >> (shift - 32).clamp_(0, sh_max))
    else:  # pragma: no cover - Rounding is closed
        raise ValueError(f"unknown rounding mode {mode!r}")

    res = mag - rem  # lo; exact values (rem == 0) are their own lo and never go up
    if tiny is not None:
        res.masked_fill_(tiny, 0)
        unit.masked_fill_(tiny, float_bits(fmt.min_subnormal, x.dtype))
    if go is not None:
        res += torch.where(go, unit, 0)

    # Overflow and special values (inf/NaN of the working dtype: mag >= inf_bits).
    over = res > max_bits
    if saturate:
        res.masked_fill_(over, max_bits)  # also turns inf into max
    else:
        # IEEE 754 at overflow: rounding toward zero gives max, otherwise inf (NaN for fn
        # formats). The directed modes know their direction even for values already on the
        # (unbounded) grid; random and stochastic went toward zero iff they picked lo < |x|.
        big = (inf_bits | (1 << (wm - 1))) if fmt.finite_only else inf_bits
        if mode is Rounding.NEAREST:
            res.masked_fill_(over, big)
        elif mode is Rounding.ZERO:
            res.masked_fill_(over, max_bits)
        else:
            if mode is Rounding.UP:
                toward_zero = bits < 0
            elif mode is Rounding.DOWN:
                toward_zero = bits >= 0
            else:
                toward_zero = res < mag
            toward_zero &= over
            res.masked_fill_(over, big)
            res.masked_fill_(toward_zero, max_bits)
        # infinite inputs stay infinite (or become NaN in an fn format)
        is_inf = mag == inf_bits
        res.masked_fill_(is_inf, big)
    res = torch.where(mag > inf_bits, mag, res)  # NaN unchanged
    res |= bits & _SIGN[int_dtype]  # the sign of x, zeros and NaN included
    return res.view(x.dtype)


def _working(x: torch.Tensor, fmt: Format) -> torch.dtype:
    if not x.is_floating_point():
        raise ValueError(f"fxstab rounds floating tensors only, got dtype {x.dtype}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"unsupported dtype {x.dtype}; use float16/bfloat16/float32/float64")
    if not fmt.fits_in(x.dtype):
        raise ValueError(
            f"format {fmt.name} (exp_bits={fmt.exp_bits}, man_bits={fmt.man_bits}) is not "
            f"representable in {x.dtype}; pass a tensor of a wider dtype (float32 or float64)"
        )
    if fmt.fits_in(torch.float32) and x.dtype != torch.float64:
        return torch.float32
    return torch.float64


def default_seed(seed: Optional[int]) -> int:
    """``seed`` as a 64-bit stream seed (validated); ``None`` draws one from torch's generator."""
    if seed is None:
        # Drawn from torch's global generator, so torch.manual_seed makes it reproducible.
        return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int or None, got {seed!r}")
    return seed & randbits.M64


def quantize(
    x: torch.Tensor,
    format: FormatLike,
    mode: str | Rounding = "random",
    seed: Optional[int] = None,
    *,
    saturate: bool = False,
) -> torch.Tensor:
    """Round every element of ``x`` onto the grid of ``format``; returns x's dtype.

    Args:
        x: Floating tensor (fp16, bf16, fp32, fp64) that can represent the format's values.
        format: Name (``"bf16"``), ``(exp_bits, man_bits)`` pair or :class:`Format`.
        mode: ``random`` (default, CESTAC), ``stochastic``, ``nearest``, ``up``, ``down``,
            ``zero``.
        seed: Seed of the counter-based random stream (random/stochastic modes). ``None``
            draws one from torch's global generator.
        saturate: Clamp overflow to ±max instead of producing inf/NaN.

    Element ``e`` of ``x.flatten()`` uses draw 0 of the streams in :mod:`fxstab.numerics.randbits`.
    """
    fmt = get_format(format)
    mode = Rounding.parse(mode)
    wdtype = _working(x, fmt)
    xw = x.to(wdtype).contiguous()
    rand = None
    if mode in (Rounding.RANDOM, Rounding.STOCHASTIC):
        s = default_seed(seed)
        gen = randbits.random_bits if mode is Rounding.RANDOM else randbits.uniform_words
        rand = gen(s, xw.numel(), [0], device=x.device).reshape(xw.shape)
    return round_with_bits(xw, fmt, mode, rand, saturate).to(x.dtype)


def round_samples(
    samples: torch.Tensor,
    format: FormatLike,
    mode: str | Rounding = "random",
    seed: Optional[int] = None,
    *,
    saturate: bool = False,
) -> torch.Tensor:
    """Round stacked samples ``[N, ...]`` with the cross-sample scheme of docs/design.md §1.

    In ``random`` mode sample ``i`` uses draw ``sample_draws(N)[0][i]`` and, for the antithetic
    member of a pair, the complement of its partner's bit; in ``stochastic`` mode sample ``i``
    uses draw ``i``. Element offsets count within one sample, so partners see the same bits.
    """
    fmt = get_format(format)
    mode = Rounding.parse(mode)
    if samples.dim() < 1 or samples.shape[0] < 1:
        raise ValueError(f"samples must have a leading sample dimension, got shape "
                         f"{tuple(samples.shape)}")
    wdtype = _working(samples, fmt)
    n = samples.shape[0]
    xw = samples.to(wdtype).contiguous().reshape(n, -1)
    numel = xw.shape[1]
    s = default_seed(seed) if mode in (Rounding.RANDOM, Rounding.STOCHASTIC) else 0
    if numel <= randbits.CPU_CHUNK or xw.device.type != "cpu":
        out = _round_columns(xw, fmt, mode, s, saturate, 0)
    else:
        # Column chunks bound the temporaries (int patterns, random bits) on the CPU; the
        # streams are indexed by element, so the bits are those of one pass.
        out = torch.empty_like(xw)
        step = randbits.CPU_CHUNK
        for a in range(0, numel, step):
            out[:, a:a + step] = _round_columns(xw[:, a:a + step], fmt, mode, s, saturate, a)
    return out.reshape(samples.shape).to(samples.dtype)


def _round_columns(xw: torch.Tensor, fmt: Format, mode: Rounding, seed: int, saturate: bool,
                   start: int) -> torch.Tensor:
    """round_samples on columns ``start ..`` of flattened samples [N, numel]."""
    n, numel = xw.shape
    rand = None
    if mode is Rounding.RANDOM:
        draws, flips = sample_draws(n)
        free = sorted(set(draws))
        bits = randbits.random_bits(seed, numel, free, device=xw.device, start=start)
        flip = torch.tensor(flips, dtype=torch.int64, device=xw.device).reshape(n, 1)
        rand = bits[torch.tensor(draws, device=xw.device)] ^ flip
    elif mode is Rounding.STOCHASTIC:
        rand = randbits.uniform_words(seed, numel, list(range(n)), device=xw.device, start=start)
    return round_with_bits(xw, fmt, mode, rand, saturate)
