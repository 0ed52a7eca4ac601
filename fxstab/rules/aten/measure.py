"""What the arithmetic level measures of stacked samples (:class:`fxstab.rules.lifting.Stacked`):
their :class:`Analysis`, per-element CESTAC digits and the masks the counters read, each
measured on first use (``Stacked.analysis(ctx)`` asks the context, :meth:`AtenContext.measure`)."""

from __future__ import annotations

from typing import Optional

import torch

from ... import executors
from ...cpu import bindings as native
from ...numerics.digits import MIN, NON_FINITE, ZEROS

# ``ctx`` below is the call's fxstab.rules.aten.context.AtenContext (that module imports this
# one, so it is named in annotations only)
__all__ = ["Analysis"]


class Analysis:
    """Per-element CESTAC digits (docs/design.md §2) of stacked samples and the masks the counters
    need, each computed on first use (most primitives need only some of them, often none).

    ``digits`` comes from the fused kernel when the primitive was rounded with
    ``want_digits`` (else one measuring pass over the samples); ``non_finite`` (elements with a
    NaN/inf sample) comes with the digit statistics, so the anomaly check of a finite output
    costs nothing. A computational zero has digits below the threshold and finite samples; an
    exact zero (all samples 0) has the cap's digits, so it is never one.
    """

    __slots__ = ("_s", "_ctx", "_digits", "_nf", "_finite", "_exact_zero", "_identical", "_zero",
                 "zeros", "min_digits")

    def __init__(self, samples: torch.Tensor, ctx: "AtenContext", digits=None,
                 non_finite: Optional[int] = None, stats: Optional[list] = None, zero=None):
        self._s, self._ctx, self._digits, self._nf = samples, ctx, digits, non_finite
        self._finite = self._exact_zero = self._identical = None
        self._zero = zero
        # from the digit statistics when measured: computational zeros, smallest digits (the
        # counters skip the masks these rule out)
        self.zeros = self.min_digits = None
        if stats is not None:
            self.zeros, self.min_digits, self._nf = stats[ZEROS], stats[MIN], \
                int(stats[NON_FINITE])

    @property
    def samples(self) -> torch.Tensor:
        """The samples ``[N, ...]`` analysed."""
        return self._s

    @property
    def measured_digits(self) -> Optional[torch.Tensor]:
        """The per-element digits if already measured (None: not yet)."""
        return self._digits

    @property
    def measured_zero(self) -> Optional[torch.Tensor]:
        """The computational-zero mask if already made (None: not yet)."""
        return self._zero

    @property
    def non_finite(self) -> Optional[int]:
        """Elements with a NaN/inf sample, if counted (None: not yet)."""
        return self._nf

    def set_stats(self, st: list) -> None:
        """Take what the digit statistics ``st`` (a row: :class:`~fxstab.numerics.digits.StatsRow`)
        tell: the computational zeros, the smallest digits, the non-finite elements."""
        self.zeros, self.min_digits, self._nf = st[ZEROS], st[MIN], int(st[NON_FINITE])

    @property
    def no_zeros(self) -> bool:
        """Known to hold no computational zero (its zero mask is all False)."""
        return self.zeros == 0 or self._s.stride(0) == 0 or not self._s.is_floating_point()

    @property
    def shape(self) -> torch.Size:
        return self._s.shape[1:]

    @property
    def digits(self) -> torch.Tensor:
        if self._digits is None:
            s, ctx = self._s, self._ctx
            if not s.is_floating_point():
                self._digits = torch.where(self.identical, ctx.cap, 0.0).to(ctx.working_dtype)
            elif s.stride(0) == 0:  # identical samples: the cap, 0 where not finite
                fin = self.finite
                if self.all_finite:  # one value for all: a view, nothing to write
                    self._digits = torch.full((), ctx.cap, dtype=s.dtype).expand(s.shape[1:])
                else:
                    self._digits = torch.where(fin, ctx.cap, 0.0).to(s.dtype)
            elif s[0].numel() == 0:
                self._digits = torch.zeros(s.shape[1:], dtype=ctx.working_dtype, device=s.device)
            else:  # one measuring pass (:data:`fxstab.executors.ATEN_DIGITS`)
                d, st = ctx.kernel(executors.ATEN_DIGITS, s)(s, ctx, self)
                self._digits = d
                if st is not None:  # the fused kernel's statistics came with them
                    self._nf = int(st[NON_FINITE])
                    self.zeros, self.min_digits = st[ZEROS], st[MIN]
        return self._digits

    @property
    def all_finite(self) -> bool:
        """Whether every sample of every element is finite (one reduction, cached)."""
        if self._nf is None:
            fin = self.finite
            self._nf = fin.numel() - int(torch.count_nonzero(fin)) if self._s.is_floating_point() else 0
        return self._nf == 0

    @property
    def non_finite(self) -> int:
        """The elements with a non-finite sample (from the statistics, or one reduction)."""
        self.all_finite
        return self._nf

    @property
    def finite(self) -> torch.Tensor:
        if self._finite is None:
            s = self._s
            if self._nf == 0 or not s.is_floating_point():
                self._finite = torch.ones((), dtype=torch.bool, device=s.device).expand(s.shape[1:])
            elif s.stride(0) == 0:
                self._finite = (s[0] * 0) == 0  # torch.isfinite is several times slower
            elif s[0].numel() == 0:
                self._finite = torch.ones(s.shape[1:], dtype=torch.bool, device=s.device)
            else:
                # x*0 is 0 exactly when x is finite (NaN for inf and NaN): the sum over the
                # samples is 0 when all are, and no sum of zeros overflows (a min/max pass
                # over the sample dim was 6x slower on CPU, torch.isfinite(s).all(0) 4x)
                self._finite = (s * 0).sum(0) == 0
        return self._finite

    @property
    def identical(self) -> torch.Tensor:
        if self._identical is None:
            s = self._s
            if s.stride(0) == 0 or s.shape[0] < 2:
                self._identical = torch.ones((), dtype=torch.bool, device=s.device).expand(s.shape[1:])
            else:
                self._identical = (s == s[:1]).all(0)
        return self._identical

    @property
    def exact_zero(self) -> torch.Tensor:
        if self._exact_zero is None:
            self._exact_zero = (self._s == 0).all(0)
        return self._exact_zero

    @property
    def zero(self) -> torch.Tensor:
        """Computational zeros: finite, not all samples 0, digits below the threshold."""
        if self._zero is None:
            s, ctx = self._s, self._ctx
            if not s.is_floating_point() or s.stride(0) == 0:  # exact data
                self._zero = torch.zeros((), dtype=torch.bool, device=s.device).expand(s.shape[1:])
            else:
                z = self.digits < ctx.zero_threshold
                if not self.all_finite:
                    z = z & self.finite
                if ctx.zero_threshold > ctx.cap:  # exact zeros (cap digits) would qualify
                    z = z & ~self.exact_zero
                self._zero = z
        return self._zero


@executors.implements(executors.ATEN_DIGITS, executors.CPU, executors.fused_cpu)
def _fused_digits(s: torch.Tensor, ctx: "AtenContext", an: Analysis) -> tuple:
    """The per-element digits of samples ``s`` (with elements) and their statistics row, by
    the fused kernel measuring without rounding."""
    _, st, d = native.round_stats(s, ctx.fmt, None, confidence=ctx.confidence,
                                  zero_threshold=ctx.zero_threshold, want_digits=True,
                                  run_shift=ctx.config.run_shift,
                                  as_list=True)
    return d, st


@executors.implements(executors.ATEN_DIGITS, executors.TORCH)
def _reference_digits(s: torch.Tensor, ctx: "AtenContext", an: Analysis) -> tuple:
    """:func:`_fused_digits`' reference: the digits alone (no statistics row)."""
    return _torch_digits(s, ctx, an.identical, an.finite), None


def _torch_digits(s: torch.Tensor, ctx: "AtenContext", identical: torch.Tensor,
                  finite: torch.Tensor) -> torch.Tensor:
    """Per-element CESTAC digits with torch operations (the fused kernel's reference path)."""
    mean = s.mean(0)
    rel = (s - mean) * (1.0 / mean.abs())
    var = (rel * rel).sum(0)
    # identical samples give var == 0 (or a rounding residue of the mean) -> +inf -> cap below
    d = torch.log10(var).mul_(-0.5).add_(ctx.digits_offset)
    d = torch.nan_to_num_(d, nan=0.0, posinf=ctx.cap, neginf=0.0).clamp_(0.0, ctx.cap)
    d = torch.where(identical & finite, ctx.cap, d)
    return torch.where(finite, d, 0.0)
