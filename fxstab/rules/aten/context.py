"""The state one analysed call shares across its primitives: :class:`AtenContext` (settings,
seeds, counters, the fused kernels' bound settings) and the :class:`PrimitiveRecord` a recorder
receives for every recorded primitive."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ... import executors
from ...config import AnalysisConfig
from ...cpu import bindings as native
from ...numerics import randbits
from ...numerics.digits import DigitStats, stats_from_list, student_t
from ...numerics.formats import Format, working_dtype_for
from ...numerics.rounding import Rounding
from ...records.counters import Counters
from ...records.report import ROUNDED
from .kinds import primitive_kind
from ..lifting import Stacked
from .measure import Analysis

__all__ = ["AtenContext", "PrimitiveRecord"]


@dataclass
class PrimitiveRecord:
    """What one primitive call looked like: the unit a recorder receives."""

    name: str
    primitive: str
    kind: str
    values: Optional[list]  # the statistics list (fxstab.numerics.digits.stats_vector's layout)
    counters: dict
    surrogate: bool = False
    status: str = ROUNDED
    shape: tuple = ()
    events: list = field(default_factory=list)
    n_samples: int = 3
    t: float = 0.0  # Student's t of the digits (the context's N and confidence)
    cap: float = 0.0  # the format's digit cap

    @property
    def stats(self) -> Optional[DigitStats]:
        """The digit statistics of the recorded output."""
        if self.values is None:
            return None
        return stats_from_list(self.values, self.n_samples, self.t, self.cap)


@dataclass
class AtenContext:
    """Configuration and running state shared by the primitives of one analysed call.

    The settings are an :class:`~fxstab.config.AnalysisConfig` (``config``), validated there
    and read from there, with its defaults: the backend passes its own; the eager driver and
    the tests make one from keyword settings with :meth:`of`. The settings the rules read per
    primitive (``n_samples``, ``fmt``, ``rounding``, ``confidence``, ``diagnostics``,
    ``cancel_digits``, ``zero_threshold``, ``saturate``, ``eta``) are properties reading it.

    Args:
        config: The analysis's settings (``granularity="aten"``).
        recorder: Called with a :class:`PrimitiveRecord` for every recorded primitive.
        record_exact: Also record digit statistics of exact primitives (views, selections).
        round_per_sample: Round the results of a primitive that vmap cannot batch (it runs once
            per sample; status ``per_sample``) like any other, as the backend does
            (docs/design.md §3); ``False`` (the eager driver) leaves them unrounded (status
            ``unlifted``).

    Derived once (read by the rules' modules): ``working_dtype``, ``complex_dtype``, ``eft`` (the
    fp64 format's error-free rounding), ``cap`` (the format's digit cap), ``t`` (Student's t of the
    digits), ``digits_offset`` (the digits' additive constant, ``log10(sqrt(N (N - 1)) / t)``),
    ``use_native`` (the fused CPU kernels may run: the ``kernels`` option,
    :func:`fxstab.executors.native_possible`), ``use_lookup`` (every value of the format is a bf16
    value: unary math may go through the bf16 tables where :data:`fxstab.executors.ATEN_LOOKUP`'s
    kernel runs). Running state: ``seed`` (the base seed of the call: call ``k`` of the context
    rounds with ``derive_seed(seed, k)`` unless the caller passes its own ``salt``; the config's
    until :meth:`for_call` gives one), ``counters``, ``calls``, ``last_events`` (the counter events
    of the last primitive), ``gemm_pending`` (the seed and surrogate of the GEMM between its
    perturbation and its rounding).
    """

    config: AnalysisConfig
    recorder: Optional[Callable[[PrimitiveRecord], None]] = None
    record_exact: bool = False
    round_per_sample: bool = False
    seed: int = field(init=False)
    counters: Counters = field(init=False)
    calls: int = field(default=0, init=False)
    # emits the parts of the rules that read values as steps of a graph being traced (the
    # backend's sampled graph, fxstab.analysis.aten_level); None: they run directly
    stepper: Optional[Callable] = field(default=None, init=False, repr=False)

    @classmethod
    def of(cls, *, recorder: Optional[Callable[[PrimitiveRecord], None]] = None,
           record_exact: bool = False, round_per_sample: bool = False,
           **settings: Any) -> "AtenContext":
        """The context of ``settings``: :class:`~fxstab.config.AnalysisConfig`'s keywords
        (``format=``, ``n_samples=``, ``seed=``, ``kernels=``...) at
        ``granularity="aten"``, with its defaults and its checks."""
        return cls(AnalysisConfig(granularity="aten", **settings), recorder, record_exact,
                   round_per_sample)

    def __post_init__(self) -> None:
        config = self.config
        self.seed = config.seed
        self.working_dtype = working_dtype_for(config.format)
        # complex samples: real and imaginary parts in the working dtype
        self.complex_dtype = torch.complex128 if self.working_dtype == torch.float64 else \
            torch.complex64
        # fp64 format in fp64: rounding needs the exact result's side (error-free transforms)
        self.eft = (self.working_dtype == torch.float64 and config.format.man_bits == 52
                    and config.rounding is Rounding.RANDOM)
        self.cap = config.format.digit_cap
        n = config.n_samples
        t = self.t = student_t(n, config.confidence)
        self.digits_offset = math.log10(math.sqrt(n * (n - 1)) / t)
        self.counters = Counters("detailed" if config.diagnostics == "detailed" else "summary")
        self._occurrence: dict[str, int] = {}
        self._seeds: Optional[dict] = None  # salt -> seed, derived ahead (for_call)
        self._round_seeds: Optional[dict] = None  # seed -> its first output's rounding seed
        self.use_native = executors.native_possible(config.kernels)
        self._rounders: dict = {}
        self.gemm_pending: Optional[tuple] = None  # (seed, surrogate fired) of the GEMM being run
        # unary math on rounded values of a format with at most bf16's significand (bf16, fp8:
        # every such value is a bf16 value) through the tables (executors.ATEN_LOOKUP)
        self.use_lookup = self.working_dtype == torch.float32 and config.format.man_bits <= 7
        self.last_events: list = []

    # -- the settings, read from the config ---------------------------------------------------
    @property
    def fmt(self) -> Format:
        """The simulated format."""
        return self.config.format

    @property
    def n_samples(self) -> int:
        return self.config.n_samples

    @property
    def rounding(self) -> Rounding:
        """The rounding mode of every result (``random``: CESTAC)."""
        return self.config.rounding

    @property
    def confidence(self) -> float:
        return self.config.confidence

    @property
    def diagnostics(self) -> str:
        return self.config.diagnostics

    @property
    def cancel_digits(self) -> float:
        """Digits an add/sub must lose to count as a cancellation (CADNA: 4)."""
        return self.config.cancel_digits

    @property
    def zero_threshold(self) -> float:
        return self.config.zero_threshold

    @property
    def saturate(self) -> bool:
        return self.config.saturate

    @property
    def eta(self) -> float:
        """The GEMM surrogate's threshold (the config's: the format's unit roundoff unless
        set, docs/design.md §4)."""
        return self.config.data_perturbation_threshold

    def measure(self, samples: torch.Tensor) -> Analysis:
        """What the counters read of ``samples``, measured on first use
        (:meth:`fxstab.rules.lifting.Stacked.analysis`)."""
        return Analysis(samples, self)

    def for_call(self, seed: int, recorder: Optional[Callable[[PrimitiveRecord], None]],
                 salts: Sequence[int] = ()) -> "AtenContext":
        """A context with this one's settings (checked and derived once) and fresh running
        state: what a driver that analyses many calls with the same settings holds. The
        seeds of the primitives that will pass ``salts`` are derived now, all at once."""
        ctx = copy.copy(self)
        ctx.seed, ctx.recorder, ctx.calls = seed, recorder, 0
        ctx.counters = Counters(self.counters.diagnostics)
        ctx._occurrence = {}
        ctx.last_events = []
        ctx._seeds = ctx._round_seeds = None
        ctx.gemm_pending = None
        found = native.derive_seeds(seed, salts, 100) if salts and self.use_native else None
        if found is not None:
            ctx._seeds = dict(zip(salts, found[0]))
            ctx._round_seeds = dict(zip(*found))
        return ctx

    def emit(self, what: str, name: Optional[str], fn: Callable, raw: list, args: tuple,
             kwargs: dict, op: Optional[Callable] = None) -> Any:
        """``fn(ctx, raw, args, kwargs)``: a part of a primitive's rules that reads values (it
        holds no tensor; ``raw`` are the batched primitive's outputs). Run directly, or with a
        ``stepper`` as one step of the graph being traced, which calls it with the context and
        values of each later call; ``op``: the operator whose value ``fn`` computes, if it does
        (a table lookup)."""
        if self.stepper is None:
            return fn(self, raw, args, kwargs)
        return self.stepper(what, name, fn, raw, args, kwargs, op)

    def kernel(self, function: str, samples: torch.Tensor) -> executors.Implementation:
        """The implementation to call for ``function`` (:data:`fxstab.executors.ATEN_ROUND`,
        ``ATEN_PERTURB``...) on ``samples`` under this context's ``kernels`` option
        (:func:`fxstab.executors.choose`)."""
        return executors.choose(self.config.kernels, function, samples, self.config.n_samples)

    def rounder(self, dtype: torch.dtype, rounded: bool) -> "native.Rounder":
        """The fused kernel with this context's settings, rounding (or only measuring): bound
        once per context and dtype (``bindings.rounder``'s cache would hash the settings on
        every primitive), for the CPU implementations of :data:`fxstab.executors.ATEN_ROUND`
        and its fused steps (:mod:`fxstab.rules.aten.rounding`), their only callers."""
        key = (dtype, rounded)
        r = self._rounders.get(key)
        if r is None:
            cfg = self.config
            r = self._rounders[key] = native.rounder(
                cfg.format, cfg.rounding if rounded else None, dtype, cfg.n_samples,
                saturate=cfg.saturate, confidence=cfg.confidence,
                zero_threshold=cfg.zero_threshold, run_shift=cfg.run_shift)
        return r

    def next_seed(self, salt: Optional[int] = None) -> int:
        self.calls += 1
        key = self.calls if salt is None else salt
        if self._seeds is not None:
            seed = self._seeds.get(key)
            if seed is not None:
                return seed
        return randbits.derive_seed(self.seed, key)

    def rounding_seed(self, seed: int, j: int) -> int:
        """The seed of a primitive's ``j``-th rounded output, from the primitive's seed
        (``derive_seed(seed, 100 + j)``)."""
        if j == 0 and self._round_seeds is not None:
            found = self._round_seeds.get(seed)
            if found is not None:
                return found
        return randbits.derive_seed(seed, 100 + j)

    def name_for(self, op: Any) -> str:
        kind = primitive_kind(op)
        k = self._occurrence.get(kind, 0)
        self._occurrence[kind] = k + 1
        return f"aten.{kind}#{k}"

    def stack(self, x: torch.Tensor, *, materialize: bool = False) -> Stacked:
        """N identical samples of ``x`` (exact data), in the working dtype when floating.

        The samples are an ``expand``ed view (no copy) unless ``materialize`` asks for N copies
        (a value that will be updated in place).
        """
        if x.is_floating_point() and x.dtype != self.working_dtype:
            x = x.to(self.working_dtype)
        elif x.is_complex() and x.dtype != self.complex_dtype:
            x = x.to(self.complex_dtype)
        s = x.expand(self.n_samples, *x.shape)
        return Stacked(s.contiguous() if materialize else s)
