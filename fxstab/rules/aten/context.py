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
from ...numerics.digits import ZERO_THRESHOLD, DigitStats, stats_from_list, student_t
from ...numerics.formats import Format, FormatLike, working_dtype_for
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


# the settings AtenContext takes from an AnalysisConfig (AtenContext.from_config)
_SETTINGS = ("format", "n_samples", "seed", "rounding", "confidence", "diagnostics",
             "cancel_digits", "zero_threshold", "kernels", "saturate",
             "data_perturbation_threshold")


@dataclass
class AtenContext:
    """Configuration and running state shared by the primitives of one analysed call.

    The settings are an :class:`~fxstab.config.AnalysisConfig` (``config``), validated there
    and only there: the backend passes its own (:meth:`from_config`); the eager driver's
    keyword settings below make one.

    Args:
        format: Simulated format (name, pair, dtype or Format).
        n_samples: N >= 2 samples.
        seed: Base seed; call ``k`` of the context rounds with ``derive_seed(seed, k)`` unless the
            caller passes its own ``salt``.
        rounding: Rounding mode of every result (``random``: CESTAC).
        confidence: Student-t confidence of the digits.
        diagnostics: ``off`` | ``summary`` | ``detailed`` (counters, docs/design.md §5).
        cancel_digits: Digits an add/sub must lose to count as a cancellation (CADNA: 4).
        zero_threshold: Digits below which a value is a computational zero (0.5).
        recorder: Called with a :class:`PrimitiveRecord` for every recorded primitive.
        kernels: ``auto``/``cpu``: the fused CPU kernels (:mod:`fxstab.cpu.bindings`) where they run
            (CPU fp32/fp64 samples), the plain-torch references elsewhere; ``torch``: always
            the references (:mod:`fxstab.executors`: this level has no Triton path yet, so
            ``triton`` means ``auto``). Both draw the same Philox streams: the rounded samples
            are the same bits either way.
        saturate: Clamp overflow to the format's largest finite value instead of inf/NaN.
        data_perturbation_threshold: The GEMM surrogate's eta (default: the format's unit
            roundoff, docs/design.md §4).
        record_exact: Also record digit statistics of exact primitives (views, selections).
        round_per_sample: Round the results of a primitive that vmap cannot batch (it runs once
            per sample; status ``per_sample``) like any other, as the backend does
            (docs/design.md §3); ``False`` (the eager driver) leaves them unrounded (status ``unlifted``).

    Derived once (read by the rules' modules): ``fmt``, ``working_dtype``, ``complex_dtype``,
    ``eft`` (the fp64 format's error-free rounding), ``cap`` (the format's digit cap), ``t``
    (Student's t of the digits), ``digits_offset`` (the digits' additive constant,
    ``log10(sqrt(N (N - 1)) / t)``), ``use_native`` (the fused CPU kernels run),
    ``use_lookup`` (unary math through the bf16 tables). Running state: ``counters``,
    ``calls``, ``last_events`` (the counter events of the last primitive), ``gemm_pending``
    (the seed and surrogate of the GEMM between its perturbation and its rounding).
    """

    format: FormatLike = "fp32"
    n_samples: int = 3
    seed: int = 0
    rounding: str | Rounding = "random"
    confidence: float = 0.95
    diagnostics: str = "summary"
    cancel_digits: float = 4.0
    zero_threshold: float = ZERO_THRESHOLD
    recorder: Optional[Callable[[PrimitiveRecord], None]] = None
    kernels: str = "auto"
    saturate: bool = False
    record_exact: bool = False
    round_per_sample: bool = False
    data_perturbation_threshold: Optional[float] = None
    # the settings above as one validated config (given: the settings are read from it)
    config: Optional[AnalysisConfig] = None
    counters: Counters = field(init=False)
    calls: int = field(default=0, init=False)
    # emits the parts of the rules that read values as steps of a graph being traced (the
    # backend's sampled graph, fxstab.analysis.aten_level); None: they run directly
    stepper: Optional[Callable] = field(default=None, init=False, repr=False)

    @classmethod
    def from_config(cls, config: AnalysisConfig, **running: Any) -> "AtenContext":
        """The context of an analysis configured by ``config`` (its settings as they are:
        already validated); ``running``: ``recorder``, ``record_exact``,
        ``round_per_sample``."""
        return cls(config=config, **running)

    def __post_init__(self) -> None:
        config = self.config
        if config is None:  # the keyword settings: validated by the one config
            config = AnalysisConfig(
                granularity="aten", format=self.format, n_samples=self.n_samples,
                seed=self.seed, rounding=self.rounding, confidence=self.confidence,
                diagnostics=self.diagnostics, cancel_digits=self.cancel_digits,
                zero_threshold=self.zero_threshold, kernels=self.kernels,
                saturate=self.saturate,
                data_perturbation_threshold=self.data_perturbation_threshold)
        else:  # the settings read from the config
            for name in _SETTINGS:
                setattr(self, name, getattr(config, name))
        self.config = config
        self.fmt: Format = config.format
        self.rounding = config.rounding
        # the GEMM surrogate's threshold (config: the format's unit roundoff by default)
        self.eta: float = config.data_perturbation_threshold
        self.working_dtype = working_dtype_for(self.fmt)
        # complex samples: real and imaginary parts in the working dtype
        self.complex_dtype = torch.complex128 if self.working_dtype == torch.float64 else \
            torch.complex64
        # fp64 format in fp64: rounding needs the exact result's side (error-free transforms)
        self.eft = (self.working_dtype == torch.float64 and self.fmt.man_bits == 52
                    and self.rounding is Rounding.RANDOM)
        self.cap = self.fmt.digit_cap
        t = self.t = student_t(self.n_samples, self.confidence)
        n = self.n_samples
        self.digits_offset = math.log10(math.sqrt(n * (n - 1)) / t)
        self.counters = Counters("detailed" if self.diagnostics == "detailed" else "summary")
        self._occurrence: dict[str, int] = {}
        self._seeds: Optional[dict] = None  # salt -> seed, derived ahead (for_call)
        self._round_seeds: Optional[dict] = None  # seed -> its first output's rounding seed
        self.use_native = executors.native_possible(self.kernels)
        self._rounders: dict = {}
        self.gemm_pending: Optional[tuple] = None  # (seed, surrogate fired) of the GEMM being run
        # unary math on rounded values of a format with at most bf16's significand (bf16, fp8:
        # every such value is a bf16 value) through native.lookup_bf16
        self.use_lookup = (self.use_native and self.working_dtype == torch.float32
                           and self.fmt.man_bits <= 7)
        self.last_events: list = []

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

    def native_for(self, samples: torch.Tensor) -> bool:
        """Whether ``samples`` ([N, ...]) go through the fused CPU kernels."""
        return self.use_native and samples.is_cpu and samples.dtype in executors.NATIVE_DTYPES

    def rounder(self, dtype: torch.dtype, rounded: bool) -> "native.Rounder":
        """The fused kernel with this context's settings, rounding (or only measuring)."""
        key = (dtype, rounded)
        r = self._rounders.get(key)
        if r is None:
            r = self._rounders[key] = native.rounder(
                self.fmt, self.rounding if rounded else None, dtype, self.n_samples,
                saturate=self.saturate, confidence=self.confidence,
                zero_threshold=self.zero_threshold)
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
