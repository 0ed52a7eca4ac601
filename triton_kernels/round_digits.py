"""Fused rounding of stacked samples plus CESTAC digit statistics (docs/design.md §2, §9).

One program owns a tile of ``ROWS x 128`` consecutive elements of every one of the N samples.
Pass 1 loads each sample's tile, rounds it into the format with the chosen mode, stores it and
accumulates what the digits need (sum, all-identical, all-zero, all-finite). Pass 2 re-reads the
rounded tile it has just written (still in L1/L2, so HBM sees each sample read once and written
once) for the squared relative deviations, then computes the per-element digits, optionally
stores them, and writes one row of block partials ``[sum of digits, min, max, computational
zeros, non-finite]``. A small torch reduction over the partials finishes the statistics.

Rounding is ``fxstab.numerics.rounding.round_with_bits`` in Triton: the same integer tricks on the fp32
(int32) or fp64 (int64) bit pattern, with the format's constants as ``tl.constexpr`` so every
format specialises its own kernel. Random bits follow ``fxstab.numerics.randbits`` exactly:

* ``random``: bit ``e % 32`` of word ``(e // 32) % 4`` of ``philox(seed, lo32(e // 128), d,
  hi32(e // 128), 0)``. A tile row is one such group of 128 elements, so Philox runs on a
  ``[ROWS, 1]`` tile and is broadcast over the row. Triton replicates the ``[ROWS, 1]`` values
  across the 32 lanes that share a row (each lane holds 4 fp32 of it), so a lane evaluates one
  Philox per 4 of its elements per draw instead of one per element: 10 Philox rounds are
  ~70 integer instructions, which per element would make the kernel compute-bound on an H200;
  sharing the row through shared memory would cut it further but needs layout control that
  Triton does not expose. Samples that are antithetic partners reuse the bits, flipped
  (``sample_draws``), so N=3 costs two draws, N=5 three.
* ``stochastic``: word ``d % 4`` of ``philox(seed, lo32(e), d // 4, hi32(e), 0)``; sample i
  uses draw i, so one Philox per element serves four samples.

The plain-torch reference ``round_digits_torch`` computes the same outputs from
``fxstab.numerics.rounding.round_samples`` and ``fxstab.numerics.digits``; the rounded samples agree bit for bit
and the digits to a few units in the last place (``log2`` vs ``log10``, sum order).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from fxstab.numerics.digits import cestac_digits, computational_zero, student_t
from fxstab.numerics.formats import WORKING_DTYPES, Format, FormatLike, float_bits, get_format
from fxstab.numerics.rounding import MODE_CODES, Rounding, default_seed, round_samples

__all__ = ["round_digits", "round_digits_torch", "STATS_FIELDS"]

# Order of the five statistics in the stats tensor returned by both paths.
STATS_FIELDS = ("avg", "min", "max", "zero_fraction", "non_finite")


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _round_bits(x, rand, MODE: tl.constexpr, IS64: tl.constexpr, WM: tl.constexpr,
                EXP_ONES: tl.constexpr, SHMAX: tl.constexpr, SHIFT0: tl.constexpr,
                EB: tl.constexpr, MAX_BITS: tl.constexpr, MINSUB_BITS: tl.constexpr,
                INF_BITS: tl.constexpr, NAN_BITS: tl.constexpr, BIG_BITS: tl.constexpr,
                FINITE_ONLY: tl.constexpr, SATURATE: tl.constexpr):
    """round_with_bits on one tile; returns (rounded value, magnitude bits of the result)."""
    if IS64:
        bits = x.to(tl.int64, bitcast=True)
        mag = bits & 0x7FFFFFFFFFFFFFFF
    else:
        bits = x.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
    MANT_MASK: tl.constexpr = (1 << WM) - 1
    ef = mag >> WM
    # Quantum of the format at this exponent: SHIFT0 = wm - man_bits, plus the distance below
    # the format's smallest normal exponent (EB = its biased value in the working dtype).
    if EB == 1:
        # The format's exponent range reaches down to the working dtype's (bf16 and tf32 in
        # fp32, fp32 in fp64): one quantum for every exponent, subnormals included, and no
        # value lies below the smallest subnormal. Saves ~15 instructions per element.
        shift = SHIFT0 + (ef - ef)
        sh = shift
        LOW: tl.constexpr = (1 << SHIFT0) - 1
        rem = mag & LOW
        lo = mag & ~LOW
        hi = lo + (1 << SHIFT0)
    else:
        shift = SHIFT0 + tl.maximum(EB - tl.maximum(ef, 1), 0)
        tiny = shift > WM
        sh = tl.minimum(shift, SHMAX)
        unit = 1 << sh
        low_mask = unit - 1
        significand = (mag & MANT_MASK) | tl.where(ef != 0, 1 << WM, 0)
        rem = tl.where(tiny, significand, mag & low_mask)
        lo = tl.where(tiny, 0, mag & ~low_mask)
        hi = tl.where(tiny, MINSUB_BITS, lo + unit)

    if MODE == 0:  # random: one bit picks the upper neighbour in magnitude
        up = rand != 0
    elif MODE == 1:  # stochastic: P(up) = rem / 2**shift, resolved on 32 bits
        if IS64:
            ds = tl.minimum(tl.maximum(shift - 32, 0), 63)
            us = tl.minimum(tl.maximum(32 - shift, 0), 31)
            scaled = (rem >> ds) << us
            up = rand.to(tl.int64) < scaled
        else:
            # rem < 2**24 here, so >> 31 already gives the reference's 0; the product
            # rem * 2**(32 - shift) < 2**32 needs the unsigned type.
            ds = tl.minimum(tl.maximum(shift - 32, 0), 31).to(tl.uint32)
            us = tl.minimum(tl.maximum(32 - shift, 0), 31).to(tl.uint32)
            scaled = (rem.to(tl.uint32) >> ds) << us
            up = rand < scaled
    elif MODE == 2:  # nearest, ties to even
        half = 1 << tl.maximum(sh - 1, 0)
        lo_odd = ((lo >> sh) & 1) == 1
        up = (rem > half) | ((rem == half) & lo_odd)
    elif MODE == 3:  # up (toward +inf): away from zero for positive values
        up = bits >= 0
    elif MODE == 4:  # down (toward -inf)
        up = bits < 0
    else:  # zero
        up = bits != bits

    exact = rem == 0
    res = tl.where(exact, mag, tl.where(up, hi, lo))
    is_inf = mag == INF_BITS
    is_nan = mag > INF_BITS
    over = (res > MAX_BITS) & (ef != EXP_ONES)
    if SATURATE:
        res = tl.where(over | is_inf, MAX_BITS, res)
    else:
        # IEEE 754 at overflow: toward zero gives max, any other direction inf (NaN in fn).
        if MODE == 2:
            toward_zero = bits != bits
        elif MODE == 5:
            toward_zero = bits == bits
        elif MODE == 3:
            toward_zero = bits < 0
        elif MODE == 4:
            toward_zero = bits >= 0
        else:
            toward_zero = (rem != 0) & (up == 0)
        res = tl.where(over, tl.where(toward_zero, MAX_BITS, BIG_BITS), res)
        if FINITE_ONLY:
            res = tl.where(is_inf, NAN_BITS, res)
    res = tl.where(is_nan, mag, res)  # NaN passes through with its payload
    out = res | (bits ^ mag)  # put the sign bit back (signed zeros, -inf, -NaN)
    if IS64:
        return out.to(tl.float64, bitcast=True), res
    else:
        return out.to(tl.float32, bitcast=True), res


# The rounding on one tile, public for the other kernels of this package (accumulate.py).
round_bits = _round_bits


@triton.jit
def _round_digits_kernel(
    x_ptr, out_ptr, digits_ptr, part_ptr, numel, seed, size_class,
    N: tl.constexpr, MODE: tl.constexpr, IS64: tl.constexpr, WM: tl.constexpr,
    EXP_ONES: tl.constexpr, SHMAX: tl.constexpr, SHIFT0: tl.constexpr, EB: tl.constexpr,
    MAX_BITS: tl.constexpr, MINSUB_BITS: tl.constexpr, INF_BITS: tl.constexpr,
    NAN_BITS: tl.constexpr, BIG_BITS: tl.constexpr, FINITE_ONLY: tl.constexpr,
    SATURATE: tl.constexpr, CAP: tl.constexpr, LOGK: tl.constexpr, THR: tl.constexpr,
    SCALE_LO: tl.constexpr, SCALE_HI: tl.constexpr, FAST_LOG2: tl.constexpr, STATS: tl.constexpr,
    WANT_DIGITS: tl.constexpr, ROWS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = tl.arange(0, ROWS)[:, None]
    col = tl.arange(0, 128)[None, :]
    offs = pid * (ROWS * 128) + row * 128 + col  # int64: element index within one sample
    mask = offs < numel
    stride = tl.to_tensor(numel).to(tl.int64)  # distance between samples, 64-bit

    if MODE == 0:
        g = pid * ROWS + row  # [ROWS, 1] group of 128 elements
        c0 = (g & 0xFFFFFFFF).to(tl.uint32)
        c2 = (g >> 32).to(tl.uint32)
        zero = tl.zeros([ROWS, 1], dtype=tl.uint32)
        word_idx = col // 32
        bit_idx = (col % 32).to(tl.uint32)
    if MODE == 1:
        c0 = (offs & 0xFFFFFFFF).to(tl.uint32)
        c2 = (offs >> 32).to(tl.uint32)
        zero = tl.zeros([ROWS, 128], dtype=tl.uint32)

    START: tl.constexpr = N % 2
    rand = 0
    for i in tl.static_range(N):
        x = tl.load(x_ptr + i * stride + offs, mask=mask, other=0.0)
        if MODE == 0:
            # sample_draws(N): the first sample of an odd N is alone, then pairs share a draw
            # and the second member takes the complement.
            if i > 0 and i % 2 != START:
                rand = rand ^ 1
            else:
                w0, w1, w2, w3 = tl.philox(seed, c0, zero + (i + START) // 2, c2, zero)
                w = tl.where(word_idx == 0, w0,
                             tl.where(word_idx == 1, w1, tl.where(word_idx == 2, w2, w3)))
                rand = (w >> bit_idx) & 1
        if MODE == 1:
            if i % 4 == 0:
                s0, s1, s2, s3 = tl.philox(seed, c0, zero + i // 4, c2, zero)
            if i % 4 == 0:
                rand = s0
            elif i % 4 == 1:
                rand = s1
            elif i % 4 == 2:
                rand = s2
            else:
                rand = s3
        r, rmag = _round_bits(x, rand, MODE, IS64, WM, EXP_ONES, SHMAX, SHIFT0, EB, MAX_BITS,
                              MINSUB_BITS, INF_BITS, NAN_BITS, BIG_BITS, FINITE_ONLY, SATURATE)
        tl.store(out_ptr + i * stride + offs, r, mask=mask)
        if STATS:
            if i == 0:
                r0 = r
                total = r / N  # sum of x_i / N, as the reference: no overflow near the max
                identical = r == r
                all_zero = r == 0
                finite = rmag < INF_BITS
            else:
                total = total + r / N  # sequential, as torch's CPU sum over dim 0
                identical = identical & (r == r0)
                all_zero = all_zero & (r == 0)
                finite = finite & (rmag < INF_BITS)

    if STATS:
        mean = total
        absmean = tl.abs(mean)
        # rel = (r - mean) / |mean| through one reciprocal per element instead of N IEEE
        # divisions (~10 instructions each on the GPU); within 1.5 ulp of the division.
        # Scaling by a power of two (exact) keeps 1/|mean| finite and normal for subnormal
        # or huge means; |mean| == 0 gives inf/NaN here and 0 digits below, as the reference.
        small = absmean < SCALE_LO
        big = absmean > SCALE_HI
        scale = tl.where(small, SCALE_HI, tl.where(big, SCALE_LO, 1.0))
        inv = 1.0 / (absmean * scale)
        for i in tl.static_range(N):
            r = tl.load(out_ptr + i * stride + offs, mask=mask, other=0.0)
            rel = ((r - mean) * scale) * inv
            if i == 0:
                acc = rel * rel
                s1 = rel
            else:
                acc = acc + rel * rel
                s1 = s1 + rel
        # Corrected two-pass variance (as fxstab.numerics.digits): subtracting (sum r)^2 / N removes the
        # error of the rounded mean.
        # (where, not maximum: a NaN from inf - inf must survive, as torch's clamp keeps it)
        v = acc - s1 * s1 / N
        var = tl.where(v < 0, 0.0, v) / (N - 1)
        # C = log10(sqrt(N) / t) - log10(var) / 2; log2 * log10(2) is within a few ulps of
        # log10 (the tests bound the difference).
        if FAST_LOG2:
            # lg2.approx.f32: 1 MUFU op, |error| < 2**-22.6, vs ~20 instructions for the
            # libdevice log2f that tl.log2 becomes (GPU fp32 only; the interpreter has no PTX).
            lg = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [var],
                                           dtype=tl.float32, is_pure=True, pack=1)
        else:
            lg = tl.log2(var)
        c = LOGK - 0.5 * (lg * 0.30102999566398120)
        c = tl.where(c != c, 0.0, c)  # nan_to_num(nan=0)
        c = tl.minimum(tl.maximum(c, 0.0), CAP)  # +inf -> cap, -inf -> 0
        c = tl.where(absmean == 0, 0.0, c)
        c = tl.where(identical, CAP, c)
        c = tl.where(finite, c, 0.0)
        if WANT_DIGITS:
            tl.store(digits_ptr + offs, c, mask=mask)
        cd = c.to(tl.float64)
        czero = mask & finite & (all_zero == 0) & (c < THR)
        base = part_ptr + pid * 5
        tl.store(base + 0, tl.sum(tl.where(mask, cd, 0.0)))
        tl.store(base + 1, tl.min(tl.where(mask, cd, CAP)))  # every valid digit is <= CAP
        tl.store(base + 2, tl.max(tl.where(mask, cd, 0.0)))  # and >= 0
        tl.store(base + 3, tl.sum(czero.to(tl.int32)).to(tl.float64))
        tl.store(base + 4, tl.sum((mask & (finite == 0)).to(tl.int32)).to(tl.float64))


# ----------------------------------------------------------------------------- launcher
# Autotune list (GPU only). Tiles of 1024..4096 elements per sample; 8 warps keep enough
# loads in flight for HBM at N=2 while leaving registers for N=5.
_AUTOTUNE_CONFIGS = [
    triton.Config({"ROWS": rows}, num_warps=warps)
    for rows in (8, 16, 32) for warps in (4, 8)
]
_INTERPRETER_ROWS = 8  # fixed config under TRITON_INTERPRET=1 (no autotuning on the CPU)
# Fixed GPU config when FXSTAB_AUTOTUNE=0 (tests: one compile per variant instead of six).
_FIXED_GPU = triton.Config({"ROWS": 16}, num_warps=4)
_autotuned = None


def _size_class(numel: int) -> int:
    """Autotune bucket: < 1M elements, < 16M, larger (L2-resident vs HBM-bound tiles)."""
    return 0 if numel < 1 << 20 else (1 if numel < 1 << 24 else 2)


def interpreter_active() -> bool:
    """Whether the kernels of this module were built for the Triton interpreter.

    ``triton.jit`` picks the interpreter when the module is imported, from TRITON_INTERPRET.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_round_digits_kernel, InterpretedFunction)


def check_launchable(t: torch.Tensor, what: str) -> None:
    """Raise a clear error if the kernels of this package cannot run on ``t``'s device."""
    if t.device.type == "cuda":
        if interpreter_active():
            return  # the interpreter copies CUDA tensors to the host; slow but correct
        return
    if interpreter_active():
        return
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError(
            f"{what}: TRITON_INTERPRET=1 is set but fxstab.kernels was imported before it was "
            f"set, so its kernels were compiled for a GPU; set TRITON_INTERPRET=1 before the "
            f"first import of fxstab.kernels (or use kernels='torch')")
    raise RuntimeError(
        f"{what}: the Triton kernels need a CUDA tensor, got one on {t.device}; on the CPU they "
        f"only run under the Triton interpreter (set TRITON_INTERPRET=1 before importing "
        f"fxstab.kernels), otherwise use kernels='torch' or kernels='auto'")


def format_constants(fmt: Format, dtype: torch.dtype) -> dict:
    """The constexpr parameters that specialise the rounding for ``fmt`` in ``dtype``."""
    w = WORKING_DTYPES[dtype]
    wm, wbias, exp_ones, shmax = w.man_bits, w.bias, w.exp_ones, w.max_shift
    inf_bits = exp_ones << wm
    nan_bits = inf_bits | (1 << (wm - 1))
    return dict(
        IS64=dtype == torch.float64, WM=wm, EXP_ONES=exp_ones, SHMAX=shmax,
        SHIFT0=wm - fmt.man_bits, EB=fmt.emin + wbias,
        MAX_BITS=float_bits(fmt.max_normal, dtype),
        MINSUB_BITS=float_bits(fmt.min_subnormal, dtype),
        INF_BITS=inf_bits, NAN_BITS=nan_bits,
        BIG_BITS=nan_bits if fmt.finite_only else inf_bits,
        FINITE_ONLY=fmt.finite_only,
        # |mean| outside [SCALE_LO, SCALE_HI] is rescaled before taking its reciprocal.
        SCALE_LO=2.0 ** (-512 if dtype == torch.float64 else -64),
        SCALE_HI=2.0 ** (512 if dtype == torch.float64 else 64),
    )


def validate_samples(samples: torch.Tensor, fmt: Format, what: str, need_two: bool) -> None:
    """Checks shared by the launchers: tensor, dtype, contiguity, sample dimension."""
    if not isinstance(samples, torch.Tensor):
        raise ValueError(f"{what}: samples must be a tensor, got {type(samples).__name__}")
    if samples.dtype not in WORKING_DTYPES:
        raise ValueError(f"{what}: samples must be float32 or float64 (the working dtype), got "
                         f"{samples.dtype}; convert with .float() or .double() first")
    if samples.dim() < 1 or samples.shape[0] < 1:
        raise ValueError(f"{what}: samples need a leading sample dimension [N, ...], got shape "
                         f"{tuple(samples.shape)}")
    if need_two and samples.shape[0] < 2:
        raise ValueError(f"{what}: digits need N >= 2 samples, got N={samples.shape[0]} "
                         f"(shape {tuple(samples.shape)})")
    if not samples.is_contiguous():
        raise ValueError(f"{what}: samples must be contiguous (strides {samples.stride()} for "
                         f"shape {tuple(samples.shape)}); call .contiguous() first")
    if not fmt.fits_in(samples.dtype):
        raise ValueError(f"{what}: format {fmt.name} (exp_bits={fmt.exp_bits}, "
                         f"man_bits={fmt.man_bits}) is not representable in {samples.dtype}; "
                         f"pass float64 samples")


def empty_stats(fmt: Format, device) -> torch.Tensor:
    """Statistics of an empty tensor: no element lost digits (as fxstab.numerics.digits.digit_stats)."""
    cap = fmt.digit_cap
    return torch.tensor([cap, cap, cap, 0.0, 0.0], dtype=torch.float64, device=device)




def round_digits(
    samples: torch.Tensor,
    format: FormatLike,
    mode: str | Rounding = "random",
    seed: Optional[int] = None,
    *,
    saturate: bool = False,
    confidence: float = 0.95,
    zero_threshold: float = 0.5,
    out: Optional[torch.Tensor] = None,
    want_digits: bool = False,
    stats: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Round stacked samples into ``format`` and compute their digit statistics in one pass.

    Args:
        samples: Contiguous float32/float64 tensor ``[N, ...]`` (the working dtype).
        format: Simulated format (name, ``(exp_bits, man_bits)`` or :class:`Format`).
        mode: Rounding mode (random, stochastic, nearest, up, down, zero).
        seed: Seed of the Philox streams; ``None`` draws one from torch's generator.
        saturate: Clamp overflow and infinities to ±max.
        confidence: Confidence of the Student-t interval of the digits.
        zero_threshold: Digits below which a non-zero element is a computational zero.
        out: Destination of the rounded samples (may be ``samples`` for in-place rounding).
        want_digits: Also return the per-element digits ``[...]`` in the working dtype.
        stats: Compute the statistics (needs N >= 2); ``False`` only rounds.

    Returns:
        ``(rounded, stats, digits)``: ``stats`` is a float64 tensor on the samples' device with
        the fields ``STATS_FIELDS`` (avg, min, max, zero fraction, non-finite count) or None;
        ``digits`` is None unless asked.
    """
    fmt = get_format(format)
    mode = Rounding.parse(mode)
    validate_samples(samples, fmt, "round_digits", need_two=stats or want_digits)
    check_launchable(samples, "round_digits")
    if out is None:
        out = torch.empty_like(samples)
    elif (out.shape != samples.shape or out.dtype != samples.dtype
          or out.device != samples.device or not out.is_contiguous()):
        raise ValueError(f"round_digits: out must be a contiguous {samples.dtype} tensor of shape "
                         f"{tuple(samples.shape)} on {samples.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    s = default_seed(seed) if mode in (Rounding.RANDOM, Rounding.STOCHASTIC) else 0
    n = samples.shape[0]
    numel = samples[0].numel()
    digits = (torch.empty(samples.shape[1:], dtype=samples.dtype, device=samples.device)
              if want_digits else None)
    if numel == 0:
        st = empty_stats(fmt, samples.device) if stats else None
        return out, st, digits

    kw = format_constants(fmt, samples.dtype)
    if stats or want_digits:
        if not 0.0 < confidence < 1.0:
            raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
        logk = math.log10(math.sqrt(n) / student_t(n, confidence))
    else:
        logk = 0.0
    kw.update(N=n, MODE=MODE_CODES[mode], SATURATE=bool(saturate), CAP=fmt.digit_cap,
              LOGK=logk, THR=float(zero_threshold), STATS=bool(stats or want_digits),
              WANT_DIGITS=bool(want_digits),
              FAST_LOG2=samples.dtype == torch.float32 and not interpreter_active())
    min_block = 128 * (_INTERPRETER_ROWS if interpreter_active()
                       else min(c.kwargs["ROWS"] for c in _AUTOTUNE_CONFIGS))
    partials = torch.empty((triton.cdiv(numel, min_block), 5), dtype=torch.float64,
                           device=samples.device)
    dptr = digits if digits is not None else partials  # never written when not asked
    sc = _size_class(numel)
    if interpreter_active() or os.environ.get("FXSTAB_AUTOTUNE", "1") == "0":
        rows = _INTERPRETER_ROWS if interpreter_active() else _FIXED_GPU.kwargs["ROWS"]
        grid = (triton.cdiv(numel, rows * 128),)
        _round_digits_kernel[grid](samples, out, dptr, partials, numel, s, sc, ROWS=rows,
                                   num_warps=_FIXED_GPU.num_warps, **kw)
    else:
        kernel = _get_autotuned()
        kernel[lambda meta: (triton.cdiv(numel, meta["ROWS"] * 128),)](
            samples, out, dptr, partials, numel, s, sc, **kw)
        rows = kernel.best_config.kwargs["ROWS"]
    if not (stats or want_digits):
        return out, None, digits
    p = partials[: triton.cdiv(numel, rows * 128)]
    st = torch.stack([
        p[:, 0].sum() / numel, p[:, 1].min(), p[:, 2].max(), p[:, 3].sum() / numel, p[:, 4].sum(),
    ])
    return out, (st if stats else None), digits


def _get_autotuned():
    """The autotuned kernel, built on first GPU use (no work at import)."""
    global _autotuned
    if _autotuned is None:
        # Narrow key: N (registers), working dtype width, mode (arithmetic per byte) and a
        # three-way size bucket; the format and the flags reuse the bucket's choice.
        _autotuned = triton.autotune(configs=_AUTOTUNE_CONFIGS,
                                     key=["N", "IS64", "MODE", "size_class"])(
            _round_digits_kernel)
    return _autotuned


# ----------------------------------------------------------------------------- reference
def round_digits_torch(
    samples: torch.Tensor,
    format: FormatLike,
    mode: str | Rounding = "random",
    seed: Optional[int] = None,
    *,
    saturate: bool = False,
    confidence: float = 0.95,
    zero_threshold: float = 0.5,
    want_digits: bool = False,
    stats: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Plain-torch reference of :func:`round_digits` (same arguments, same outputs).

    Rounds with :func:`fxstab.numerics.rounding.round_samples` and computes the digits with
    :func:`fxstab.numerics.digits.cestac_digits` / :func:`computational_zero`, without host syncs, so it
    can be compiled with inductor for the unfused-versus-fused ablation.
    """
    fmt = get_format(format)
    mode = Rounding.parse(mode)
    s = default_seed(seed) if mode in (Rounding.RANDOM, Rounding.STOCHASTIC) else 0
    rounded = round_samples(samples, fmt, mode, s, saturate=saturate)
    if rounded.data_ptr() == samples.data_ptr() and samples.numel():  # never alias the input
        rounded = rounded.clone()
    if not (stats or want_digits):
        return rounded, None, None
    n = samples.shape[0]
    if n < 2:
        raise ValueError(f"round_digits_torch: digits need N >= 2 samples, got N={n}")
    numel = samples[0].numel()
    if numel == 0:
        digits = torch.empty(samples.shape[1:], dtype=samples.dtype, device=samples.device)
        return rounded, (empty_stats(fmt, samples.device) if stats else None), (
            digits if want_digits else None)
    d = cestac_digits(rounded, fmt, confidence)
    st = None
    if stats:
        zeros = computational_zero(rounded, d, threshold=zero_threshold)
        non_finite = (~torch.isfinite(rounded).all(0)).sum()
        dd = d.double()
        st = torch.stack([dd.mean(), dd.min(), dd.max(), zeros.double().mean(),
                          non_finite.double()])
    return rounded, st, (d if want_digits else None)
