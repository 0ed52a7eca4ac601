"""Rounding of a primitive's results into the format (docs/design.md §1), with their measurement.

:func:`round_measure` rounds stacked samples and measures their digits in one pass of the fused
CPU kernel (or the references: :func:`fxstab.numerics.rounding.round_samples` and torch digits:
the two implementations of :data:`fxstab.executors.ATEN_ROUND`, registered here, which
:func:`fxstab.executors.choose` picks between; its fused steps, the kernel bound to one output
(:data:`~fxstab.executors.ATEN_PREPARED`) and an add, sub, mul or div computed inside the
rounding (:data:`~fxstab.executors.ATEN_BINARY`), are registered here too);
the fp64 format rounds through error-free transformations (:func:`round_fp64`), complex values
part by part (:func:`round_complex`); :func:`perturb_operand` is the GEMM surrogate
(docs/design.md §4).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ... import executors
from ...cpu import bindings as native
from ...numerics import randbits
from ...numerics.digits import empty_stats, extra_stats, underflow_count
from ...numerics.formats import Format
from ...numerics.rounding import Rounding, round_samples
from .batching import aligned
from .context import AtenContext
from .measure import Analysis
from .primitives import primitive

__all__ = ["round_stacked", "round_measure", "round_fp64", "round_complex", "perturb_operand"]


def round_stacked(samples: torch.Tensor, fmt: Format, mode: Rounding, seed: int, *,
                  saturate: bool = False, kernels: str = "auto") -> torch.Tensor:
    """Round stacked samples into ``fmt`` with the cross-sample scheme of docs/design.md §1.

    The same bits as :func:`fxstab.numerics.rounding.round_samples` (Philox streams), through the fused
    CPU kernel where it runs (``kernels`` ``auto``/``cpu``) and the reference elsewhere
    (:data:`fxstab.executors.ROUND_ONLY`).
    """
    rounding = executors.choose(kernels, executors.ROUND_ONLY, samples, samples.shape[0])
    return rounding(samples, fmt, mode, seed, saturate)


def round_measure(v: torch.Tensor, ctx: AtenContext, seed: Optional[int], want_stats: bool,
                   want_digits: bool, want_zeros: bool = False, own: bool = False):
    """Round ``v`` ([N, ...], unless ``seed`` is None: measure only) and measure it.

    Returns (samples, stats list [sum, min, max, zeros, non-finite, numel] or None, analysis):
    one pass of the fused kernel, or the references (``round_samples`` + torch digits). The
    kernel also writes the computational-zero mask with ``want_zeros`` (a consumer's counters
    read it; a byte per element instead of the digits).
    """
    if seed is None and not (want_stats or want_digits):
        return v, None, Analysis(v, ctx)
    kernel = ctx.kernel(executors.ATEN_ROUND, v) if v.dim() and v.numel() else \
        executors.reference(executors.ATEN_ROUND)
    return kernel(v, ctx, seed, want_stats, want_digits, want_zeros, own)


@executors.implements(executors.ATEN_ROUND, executors.CPU, executors.fused_cpu)
def _round_measure_fused(v: torch.Tensor, ctx: AtenContext, seed: Optional[int],
                         want_stats: bool, want_digits: bool, want_zeros: bool, own: bool):
    """:func:`round_measure` in one pass of the fused CPU kernel (``v`` has elements)."""
    want_stats = want_stats or want_digits or want_zeros
    if not v.is_contiguous() and not (v.stride(0) == 0 and v[0].is_contiguous()):
        v = v.contiguous()
    # the settings are bound once per context; an expanded view (identical samples) is
    # read N times, not copied
    r = ctx.rounder(v.dtype, seed is not None)
    out, st, d, z = r(v, 0 if seed is None else seed, want_stats, want_digits, want_zeros, own)
    return out, st, Analysis(out, ctx, digits=d, stats=st, zero=z)


@executors.implements(executors.ATEN_ROUND, executors.TORCH)
def _round_measure_reference(v: torch.Tensor, ctx: AtenContext, seed: Optional[int],
                             want_stats: bool, want_digits: bool, want_zeros: bool, own: bool):
    """:func:`round_measure` by ``round_samples`` and torch digits (the zero mask and the
    digits wait for a reader: :class:`~fxstab.rules.aten.measure.Analysis`)."""
    numel = v.numel() // v.shape[0] if v.dim() and v.shape[0] else (0 if v.dim() else 1)
    under = 0
    if seed is not None:
        if want_stats and numel and v.is_floating_point():
            under = underflow_count(v, ctx.fmt)
        v = round_samples(v, ctx.fmt, ctx.rounding, seed, saturate=ctx.saturate)
    an = Analysis(v, ctx)
    st = None
    if want_stats and numel:
        d = an.digits
        dmin, dmax = torch.aminmax(d)
        st = torch.stack([d.sum(dtype=torch.float64), dmin.double(), dmax.double(),
                          an.zero.sum().double(), (~an.finite).sum().double()]).tolist()
        st.append(float(numel))
        if v.is_floating_point():  # the extras: norms, underflow, quantiles
            st += extra_stats(v, ctx.t, ctx.cap, under, ctx.config.run_shift)
        else:
            st += empty_stats(ctx.cap)[6:]
        an.set_stats(st)
    elif want_stats:
        st = empty_stats(ctx.cap)
    return v, st, an


# ATEN_ROUND's fused steps: the CPU implementation's kernel made for one use, with this
# context's settings (none where the reference rounds: the caller then rounds through
# round_measure)
@executors.implements(executors.ATEN_PREPARED, executors.CPU)
def _prepared_cpu(ctx: AtenContext, dtype: torch.dtype, in_place: bool) -> "native.Prepared":
    """The fused kernel bound to one output of a sampled graph: a call sets the seed and runs
    it (in place with ``in_place``; None for a layout it does not read)."""
    return native.Prepared(ctx.rounder(dtype, True), in_place)


@executors.implements(executors.ATEN_BINARY, executors.CPU)
def _binary_cpu(ctx: AtenContext, op: str) -> "native.Binary":
    """The fused kernel computing ``op`` (add, sub, mul, div) of two operands in the working
    dtype inside its rounding (:class:`fxstab.cpu.bindings.Binary`)."""
    return native.Binary(ctx.rounder(ctx.working_dtype, True), op)


def _random_up(n: int, numel: int, seed: int, ctx: AtenContext, y: torch.Tensor) -> torch.Tensor:
    """Rounding directions [N, numel] (True: away from zero) of ``random`` rounding for the
    samples ``y``: the Philox bits of :func:`fxstab.numerics.rounding.round_samples` with
    CADNA's cross-sample scheme (:data:`fxstab.executors.RANDOM_UP`: the fused kernel where it
    reads ``y``'s samples, the same bits)."""
    return ctx.kernel(executors.RANDOM_UP, y)(n, numel, seed, y.device)


# Error-free transformations for the fp64 format (docs/design.md §1): the working dtype is the
# format, so the side of the exact result must be computed, not read off extra bits.
_SPLIT = 134217729.0  # 2**27 + 1, Veltkamp's splitter for binary64


def _two_prod_err(a: torch.Tensor, b: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """a*b - p exactly (Dekker), p = fl(a*b); valid without overflow in the splitting."""
    ca = _SPLIT * a
    ah = ca - (ca - a)
    al = a - ah
    cb = _SPLIT * b
    bh = cb - (cb - b)
    bl = b - bh
    return al * bl - (((p - ah * bh) - al * bh) - ah * bl)


def _operands(args: tuple, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.as_tensor(v, dtype=y.dtype, device=y.device)
                 for v in aligned(args[:2], y.dim() - 1))


def _sum_side(order: Callable) -> Callable:
    """The side of a sum ``order(a, b)`` (a + b, a - b, b - a) of the two operands: TwoSum's
    error term (none where alpha is not 1)."""
    def side(op, args: tuple, kwargs: dict, y: torch.Tensor) -> Optional[torch.Tensor]:
        if kwargs.get("alpha", args[2] if len(args) > 2 else 1) != 1:
            return None
        a, b = order(*_operands(args, y))
        bb = y - a
        return torch.sign((a - (y - bb)) + (b - bb))
    return side


def _product_side(op, args: tuple, kwargs: dict, y: torch.Tensor) -> Optional[torch.Tensor]:
    """a * b: TwoProd's error term."""
    a, b = _operands(args, y)
    return torch.sign(_two_prod_err(a, b, y))


def _quotient_side(op, args: tuple, kwargs: dict, y: torch.Tensor) -> Optional[torch.Tensor]:
    """a / b (true division): the sign of the remainder a - y * b, times b's."""
    if getattr(op, "_overloadname", "") not in ("Tensor", "Scalar") or \
            kwargs.get("rounding_mode"):
        return None
    a, b = _operands(args, y)
    ph = y * b
    return torch.sign((a - ph) - _two_prod_err(y, b, ph)) * torch.sign(b)


def _reciprocal_side(op, args: tuple, kwargs: dict, y: torch.Tensor) -> Optional[torch.Tensor]:
    """1 / b: the sign of 1 - y * b, times b's."""
    b = args[0].samples
    ph = y * b
    return torch.sign((1.0 - ph) - _two_prod_err(y, b, ph)) * torch.sign(b)


def _sqrt_side(op, args: tuple, kwargs: dict, y: torch.Tensor) -> Optional[torch.Tensor]:
    """sqrt(a): the sign of a - y * y."""
    a = args[0].samples
    ph = y * y
    return torch.sign((a - ph) - _two_prod_err(y, y, ph))


# the exact result's side in the fp64 format, in the primitives' rows
primitive("add", fp64=_sum_side(lambda a, b: (a, b)))
primitive("sub", fp64=_sum_side(lambda a, b: (a, -b)))
primitive("rsub", fp64=_sum_side(lambda a, b: (b, -a)))
primitive("mul", fp64=_product_side)
primitive("div", fp64=_quotient_side)
primitive("reciprocal", fp64=_reciprocal_side)
primitive("sqrt", fp64=_sqrt_side)


def round_fp64(side_of: Optional[Callable], op, args: tuple, kwargs: dict, y: torch.Tensor,
               seed: int, ctx: AtenContext) -> torch.Tensor:
    """Random rounding in the fp64 format on fp64 results (already rounded to nearest).

    ``side_of(op, args, kwargs, y)`` is the primitive's row's ``fp64`` (None: no row gives it).
    With the exact side known (TwoSum/TwoProd), a sample keeps y or moves to the neighbour on the
    exact result's side, each with probability 1/2 (exactly CESTAC's random rounding). For other
    primitives the side is unknown: one shared random side per element stands in for it, so a
    result moves by at most one unit in the last place, as a rounding error would. The coins are
    the Philox bits of ``random`` rounding (:func:`_random_up`).
    """
    n = y.shape[0]
    numel = y[0].numel()
    if numel == 0:
        return y
    side = side_of(op, args, kwargs, y) if side_of is not None else None
    up = _random_up(n, numel, seed, ctx, y).reshape(y.shape)
    if side is None:
        shared = _random_up(1, numel, randbits.derive_seed(seed, 1), ctx, y)
        side = torch.where(shared.reshape((1,) + y.shape[1:]), 1.0, -1.0).to(y.dtype)
        moved = torch.nextafter(y, side * math.inf)
        return torch.where(up & torch.isfinite(y), moved, y)
    side = side.expand(y.shape) if side.shape != y.shape else side
    moved = torch.nextafter(y, side * math.inf)
    return torch.where(up & (side != 0) & torch.isfinite(y), moved, y)


def perturb_operand(samples: torch.Tensor, eta: float, seed: int, ctx: AtenContext) -> tuple[torch.Tensor, int]:
    """The GEMM surrogate (docs/design.md §4): :func:`fxstab.numerics.surrogate.perturb_samples`
    onto the format's grid, through the fused kernel where it runs (same bits;
    :data:`fxstab.executors.ATEN_PERTURB`)."""
    return ctx.kernel(executors.ATEN_PERTURB, samples)(samples, eta, seed, ctx.fmt)


def round_complex(v: torch.Tensor, ctx: AtenContext, seed: Optional[int], want_stats: bool,
                   own: bool):
    """Round complex samples ``v`` (unless ``seed`` is None: measure only) part by part: their
    real view ``[N, ..., 2]`` is rounded and measured like real samples (statistics over
    2 x numel values: the digits of each part). Returns (complex samples, stats or None)."""
    r = torch.view_as_real(v.resolve_conj().resolve_neg())
    own = own and r.is_contiguous() and not v.is_conj() and not v.is_neg()
    r = r.contiguous()
    if seed is not None and ctx.eft:  # the fp64 format: one shared random side per part
        r = round_fp64(None, None, (), {}, r, seed, ctx)
        seed = None
    out, st, _ = round_measure(r, ctx, seed, want_stats, False, False, own)
    return torch.view_as_complex(out.contiguous()), st
