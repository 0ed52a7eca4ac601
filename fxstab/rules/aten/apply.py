"""Per-primitive rules of the arithmetic level (DESIGN.md §3 ``aten``, §4, §5).

One function, :func:`apply_primitive`, runs one aten primitive on stacked samples and applies
every rule of the arithmetic level to it; the eager driver (:mod:`fxstab.stochastic`) and the
backend's graph walk (``granularity="aten"``, :class:`fxstab.analysis.aten_level.AtenTracer`, traced
once per signature into a generated graph) both call it, primitive by primitive:

* Arguments that carry samples are :class:`Stacked` (a tensor ``[N, ...]`` plus cached per-element
  digits); everything else (plain tensors, numbers, lists, dtypes) is unstacked and broadcast
  across samples. Floating plain tensors are exact data: identical samples.
* The primitive runs on all samples at once: pointwise primitives directly (ranks aligned),
  common views, reductions and GEMMs by shifting their dimension arguments, the rest through
  ``torch.vmap``; a primitive that cannot be batched runs once per sample, unrounded, and its
  record says ``unlifted``. Integer and boolean results pass through unrounded.
* Every floating result of an arithmetic primitive is rounded into the format (``random``
  rounding by default, one seed per call from :func:`fxstab.numerics.randbits.derive_seed`) and its digit
  statistics are recorded. Data movement and selection primitives (views, cat, index, neg, abs,
  max/min, where...) are exact: not rounded, not recorded, but their counters run.
* GEMM-like primitives (mm, bmm, addmm, baddbmm, convolution, SDPA kernels) are trusted: stacked
  operands whose samples are insufficiently separated get the data-perturbation surrogate with
  eta = the format's unit roundoff, then the product is rounded; the record says ``surrogate``.
  Plain operands (weights, constants) are not perturbed: perturbing one operand of a product by a
  relative eta already moves each output by eta times its condition-weighted magnitude, which is
  what the surrogate exists to expose, and it halves the cost.
* Comparisons follow CESTAC (CADNA's semantics): they return one *plain* boolean tensor decided
  on the samples' mean difference, ``a == b`` when ``a - b`` is an exact or computational zero,
  ``a < b`` when the mean difference is negative and not a computational zero, ``a <= b`` when
  it is negative or a computational zero. Every sample then takes the same branch, as in CADNA's
  synchronous arithmetic, and a computational-zero difference counts as unstable branching.
* CADNA's counters (:mod:`fxstab.records.counters`) are computed from the per-element digits the rules
  already have.

Randomness and speed: the rounding directions and the surrogate's factors are the Philox streams
of :mod:`fxstab.numerics.randbits`, the same bits as :func:`fxstab.numerics.rounding.round_samples` and
:func:`fxstab.numerics.surrogate.perturb_samples`. On CPU fp32/fp64 samples the fused kernels of
:mod:`fxstab.cpu.bindings` round and measure each output in one pass (``kernels="torch"`` uses the
references instead, for the same bits). Per-element digits are measured only where a counter
reads them; the other masks (computational zeros, finiteness...) are derived on first use.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from ...cpu import bindings as native
from ...numerics import randbits
from ...records.counters import CounterEvent, Counters, active_collectors, check_diagnostics
from ...numerics.digits import (
    ZERO_THRESHOLD, DigitStats, empty_stats, extra_stats, stats_from_list, student_t,
    underflow_count,
)
from ...numerics.formats import Format, FormatLike, get_format, working_dtype_for
from ...records.report import OBSERVED, PER_SAMPLE, ROUNDED, UNLIFTED, OpReport, empty_counters
from ...numerics.rounding import Rounding, round_samples, sample_draws
from ...numerics.surrogate import perturb_samples

aten = torch.ops.aten

__all__ = ["Stacked", "AtenContext", "PrimitiveRecord", "apply_primitive", "round_stacked",
           "primitive_kind", "op_info", "OpInfo", "GEMM_PRIMITIVES", "EXACT_PRIMITIVES", "observe",
           "operand_needs", "OUTPUT_DIGITS_KINDS", "to_op_report"]


# --------------------------------------------------------------------------- op classes
def primitive_kind(op: Any) -> str:
    """Short name of an aten overload: ``aten.add.Tensor`` -> ``add``."""
    packet = getattr(op, "overloadpacket", None)
    name = packet.__name__ if packet is not None else getattr(op, "__name__", str(op))
    return name.split(".")[0]


GEMM_PRIMITIVES = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "convolution",
    "_convolution", "conv1d", "conv2d", "conv3d", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "scaled_dot_product_attention",
    "_scaled_dot_product_attention_math",
})
# Exact primitives: the result is (a selection of) input values, so rounding is the identity.
EXACT_PRIMITIVES = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze",
    "squeeze", "select", "slice", "clone", "contiguous", "alias", "detach", "lift_fresh_copy",
    "cat", "stack", "split", "split_with_sizes", "chunk", "unbind", "index", "index_select",
    "gather", "narrow", "flatten", "unflatten", "repeat", "roll", "flip", "diagonal", "as_strided",
    "_to_copy", "to", "copy", "convert_element_type", "neg", "abs", "maximum", "minimum", "max", "min", "amax", "amin",
    "clamp", "clamp_min", "clamp_max", "relu", "threshold", "hardtanh", "where", "masked_fill",
    "constant_pad_nd", "sort", "topk", "embedding", "scatter", "slice_scatter", "select_scatter",
    "index_put", "fill", "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros",
    "new_ones", "new_full", "new_empty", "floor", "ceil", "trunc", "round", "sign", "sgn",
    "_reshape_alias", "view_as", "expand_as", "movedim", "squeeze_copy", "unsqueeze_copy",
    "view_copy", "permute_copy", "t_copy", "transpose_copy", "expand_copy", "detach_copy",
    "pixel_shuffle", "broadcast_in_dim", "collapse_view", "split_dim", "squeeze_copy", "max_pool2d_with_indices", "max_pool1d", "max_pool2d", "repeat_interleave",
    # complex values: views of their parts, and the parts put together
    "view_as_real", "view_as_complex", "real", "imag", "conj", "_conj", "conj_physical",
    "_conj_physical", "resolve_conj", "resolve_neg", "_neg_view", "complex",
})
# Exact on real values, arithmetic on complex ones (|z| = sqrt(re^2 + im^2), z / |z|).
_COMPLEX_ARITHMETIC = frozenset({"abs", "sgn"})
_ADD = frozenset({"add", "sub", "rsub"})
_DIV = frozenset({"div", "reciprocal", "remainder", "fmod", "floor_divide"})
_POW = frozenset({"pow", "float_power"})
_MATH = frozenset({
    "sqrt", "rsqrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan",
    "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc",
    "erfinv", "sigmoid", "lgamma", "digamma", "atan2", "logit", "special_erfcx", "xlogy",
})
_ROUNDING_INTRINSICS = frozenset({"floor", "ceil", "trunc", "round", "sign", "sgn", "frac"})
_COMPARE = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
            "less": "lt", "less_equal": "le", "greater": "gt", "greater_equal": "ge",
            "not_equal": "ne"}
_SELECT2 = frozenset({"maximum", "minimum", "fmax", "fmin"})
# Tensor factories (no arithmetic: their values are constants or uninitialised memory).
_FACTORY_PREFIXES = ("empty", "zeros", "ones", "full", "arange", "scalar_tensor", "new_",
                     "eye", "linspace", "logspace")
_REDUCE_SUM = frozenset({"sum", "mean", "nansum"})


# --------------------------------------------------------------------------- per-op decisions
@dataclass(frozen=True)
class OpInfo:
    """What the rules need to know about one primitive, decided once per overload."""

    kind: str
    pointwise: bool  # torch.Tag.pointwise: runs directly on ranks-aligned samples
    exact: bool  # not rounded, not recorded (EXACT_PRIMITIVES)
    gemm: bool  # trusted, with the data-perturbation surrogate
    factory: bool  # tensor factories: constants stay plain
    layout: bool  # digits follow the op: digits(op(x, ...)) == op(digits(x), ...)
    compare: bool  # CESTAC comparison: a plain boolean decision
    prim: Any = None  # aten replacement of a prims op that neither vmap nor pointwise covers
    text: str = ""  # str(op), for records
    plain: Any = None  # faster equivalent of a prims op on plain (unstacked) values
    call: Any = None  # what runs it on aligned samples: ``prim`` or ``op``, without the
    # Python frame of OpOverload.__call__
    inplace: bool = False  # writes into its first argument (``add_``, ``copy_``...)


# Exact primitives whose per-element digits are the same rearrangement of their operand's
# digits: the digits of a view (or of -x) need no new measurement.
_LAYOUT = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze",
    "squeeze", "select", "slice", "clone", "alias", "detach", "lift_fresh_copy", "contiguous",
    "narrow", "flatten", "unflatten", "diagonal", "movedim", "squeeze_copy", "unsqueeze_copy",
    "view_copy", "permute_copy", "t_copy", "transpose_copy", "expand_copy", "detach_copy",
    "broadcast_in_dim", "collapse_view", "split_dim", "neg",
})
_PRIMS_AS_ATEN = {"div": aten.div.Tensor, "sum": None, "var": None}


def _prims_var(x: torch.Tensor, dims=None, correction: float = 1.0, *, output_dtype=None):
    """prims.var in two passes (mean, then squared deviations): the same value to a few ulps,
    several times faster on CPU than torch.var's Welford loop."""
    dims = list(range(x.dim())) if dims is None or len(dims) == 0 else list(dims)
    count = math.prod(x.shape[d] for d in dims)
    d = x - x.sum(dims, keepdim=True).div_(count)  # torch.mean's own bits, with less overhead
    return d.mul_(d).sum(dims).div_(count - correction)


def _prims_sum(x: torch.Tensor, dims=None, *, output_dtype=None):
    return torch.sum(x, dims, dtype=output_dtype) if dims else torch.sum(x, dtype=output_dtype)


def _broadcast_in_dim(x: torch.Tensor, shape, broadcast_dimensions) -> torch.Tensor:
    """prims.broadcast_in_dim as unsqueeze + expand (a view; the prim's Python wrapper costs
    more than the op)."""
    keep = set(broadcast_dimensions)
    for i in range(len(shape)):
        if i not in keep:
            x = x.unsqueeze(i)
    return x.expand(list(shape))


_PRIMS_PLAIN = {"var": _prims_var, "sum": _prims_sum, "broadcast_in_dim": _broadcast_in_dim}


def _compute_op_info(op: Any) -> OpInfo:
    kind = primitive_kind(op)
    prim = None
    is_prim = getattr(op, "namespace", None) == "prims"
    if is_prim and kind in _PRIMS_AS_ATEN:
        prim = _PRIMS_AS_ATEN[kind] or kind
    run = prim if prim is not None and not isinstance(prim, str) else op
    return OpInfo(
        kind=kind, pointwise=torch.Tag.pointwise in getattr(op, "tags", ()),
        exact=kind in EXACT_PRIMITIVES, gemm=kind in GEMM_PRIMITIVES,
        factory=kind.startswith(_FACTORY_PREFIXES), layout=kind in _LAYOUT,
        compare=kind in _COMPARE, prim=prim, text=str(op),
        plain=_PRIMS_PLAIN.get(kind) if is_prim else None,
        call=getattr(run, "_op", run), inplace=_writes_first(op))


def _writes_first(op: Any) -> bool:
    """Whether an overload's schema writes into its first argument (``Tensor(a!) self``)."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


_OP_INFO: dict = {}


def op_info(op: Any) -> OpInfo:
    """The :class:`OpInfo` of ``op`` (cached per overload)."""
    try:
        return _OP_INFO[op]
    except KeyError:
        info = _OP_INFO[op] = _compute_op_info(op)
        return info
    except TypeError:  # an unhashable callable
        return _compute_op_info(op)


# Kinds whose counters read their own output's per-element digits.
OUTPUT_DIGITS_KINDS = frozenset(_ADD | _REDUCE_SUM)
# Kinds whose counters read an operand's computational-zero mask (all operands, or the
# divisor of a division).
_OPERAND_ZEROS_KINDS = frozenset(_DIV | _POW | _MATH | {"mul", "relu"})


def operand_needs(info: "OpInfo", args: tuple, kwargs: dict, operand: Any) -> tuple[bool, bool]:
    """(digits, zero mask): what the counters of a primitive (``info``, its ``args`` and
    ``kwargs`` as a graph holds them) read of ``operand``: the digits of add/sub operands and
    of summed values (cancellation), the zero masks of divisors, factors and math arguments.
    A graph driver writes those in the operand's rounding pass; anything else a consumer reads
    is measured when read."""
    kind = info.kind
    if any(v is operand for v in kwargs.values()):
        return True, True  # an unusual place: assume everything
    if kind in _ADD or kind in _REDUCE_SUM:
        return True, False
    if kind in _DIV:
        divisor = args[0] if kind == "reciprocal" else (args[1] if len(args) > 1 else None)
        return False, divisor is operand
    return False, kind in _OPERAND_ZEROS_KINDS


# --------------------------------------------------------------------------- stacked values
class Stacked:
    """Samples ``[N, ...]`` of one value, with its analysis (digits, masks) cached once made.

    The graph walk keeps these in its environment so each primitive's output is measured
    once and its digits serve as operand digits of the consumers (cancellation counters). The
    samples may be an ``expand``ed view of one plain value (identical samples, never copied);
    the rules never write into samples in place.
    """

    __slots__ = ("samples", "_an", "slot")

    def __init__(self, samples: torch.Tensor, analysis: Optional["_Analysis"] = None):
        self.samples = samples
        self._an = analysis
        self.slot = -1  # a step output of a sampled graph being traced: its slot there

    @property
    def shape(self) -> torch.Size:
        """Logical shape (without the sample dimension)."""
        return self.samples.shape[1:]

    @property
    def ndim(self) -> int:
        return self.samples.dim() - 1

    @property
    def t(self) -> torch.Tensor:
        """The samples (the name :class:`fxstab.analysis.sampled_graph.SampledGraph` reads)."""
        return self.samples

    def analysis(self, ctx: "AtenContext") -> "_Analysis":
        if self._an is None:
            self._an = _Analysis(self.samples, ctx)
        return self._an

    def __repr__(self) -> str:
        return f"Stacked(shape={tuple(self.shape)}, n={self.samples.shape[0]}, dtype={self.samples.dtype})"


class _Analysis:
    """Per-element CESTAC digits (DESIGN.md §2) of stacked samples and the masks the counters
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
            self.zeros, self.min_digits, self._nf = stats[3], stats[1], int(stats[4])

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
            elif ctx.native_for(s):
                _, st, d = native.round_stats(s, ctx.fmt, None, confidence=ctx.confidence,
                                              zero_threshold=ctx.zero_threshold, want_digits=True,
                                              as_list=True)
                self._digits, self._nf = d, int(st[4])
                self.zeros, self.min_digits = st[3], st[1]
            else:
                self._digits = _torch_digits(s, ctx, self.identical, self.finite)
        return self._digits

    @property
    def all_finite(self) -> bool:
        """Whether every sample of every element is finite (one reduction, cached)."""
        if self._nf is None:
            fin = self.finite
            self._nf = fin.numel() - int(torch.count_nonzero(fin)) if self._s.is_floating_point() else 0
        return self._nf == 0

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


def _torch_digits(s: torch.Tensor, ctx: "AtenContext", identical: torch.Tensor,
                  finite: torch.Tensor) -> torch.Tensor:
    """Per-element CESTAC digits with torch operations (the fused kernel's reference path)."""
    mean = s.mean(0)
    rel = (s - mean) * (1.0 / mean.abs())
    var = (rel * rel).sum(0)
    # identical samples give var == 0 (or a rounding residue of the mean) -> +inf -> cap below
    d = torch.log10(var).mul_(-0.5).add_(ctx._dconst)
    d = torch.nan_to_num_(d, nan=0.0, posinf=ctx.cap, neginf=0.0).clamp_(0.0, ctx.cap)
    d = torch.where(identical & finite, ctx.cap, d)
    return torch.where(finite, d, 0.0)


# --------------------------------------------------------------------------- context
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


_KERNELS = ("auto", "cpu", "torch")
_NATIVE_DTYPES = (torch.float32, torch.float64)


@dataclass
class AtenContext:
    """Configuration and running state shared by the primitives of one analysed call.

    Args:
        format: Simulated format (name, pair, dtype or Format).
        n_samples: N >= 2 samples.
        seed: Base seed; call ``k`` of the context rounds with ``derive_seed(seed, k)`` unless the
            caller passes its own ``salt``.
        rounding: Rounding mode of every result (``random``: CESTAC).
        confidence: Student-t confidence of the digits.
        diagnostics: ``off`` | ``summary`` | ``detailed`` (counters, DESIGN.md §5).
        cancel_digits: Digits an add/sub must lose to count as a cancellation (CADNA: 4).
        zero_threshold: Digits below which a value is a computational zero (0.5).
        recorder: Called with a :class:`PrimitiveRecord` for every recorded primitive.
        kernels: ``auto``/``cpu``: the fused CPU kernels (:mod:`fxstab.cpu.bindings`) where they run
            (CPU fp32/fp64 samples), the plain-torch references elsewhere; ``torch``: always
            the references. Both draw the same Philox streams: the rounded samples are the same
            bits either way.
        saturate: Clamp overflow to the format's largest finite value instead of inf/NaN.
        record_exact: Also record digit statistics of exact primitives (views, selections).
        round_per_sample: Round the results of a primitive that vmap cannot batch (it runs once
            per sample; status ``per_sample``) like any other, as the backend does (DESIGN.md
            §3); ``False`` (the eager driver) leaves them unrounded (status ``unlifted``).
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
    counters: Counters = field(init=False)
    calls: int = field(default=0, init=False)
    # emits the parts of the rules that read values as steps of a graph being traced (the
    # backend's sampled graph, fxstab.analysis.aten_level); None: they run directly
    stepper: Optional[Callable] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.fmt: Format = get_format(self.format)
        self.rounding = Rounding.parse(self.rounding)
        if isinstance(self.n_samples, bool) or not isinstance(self.n_samples, int) or self.n_samples < 2:
            raise ValueError(f"n_samples must be an integer >= 2, got {self.n_samples!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        check_diagnostics(self.diagnostics)
        if self.kernels == "triton":  # the backend's option: no Triton path at this level yet
            self.kernels = "auto"
        if self.kernels not in _KERNELS:
            raise ValueError(f"kernels must be one of {_KERNELS} (the fused CPU kernels or the "
                             f"plain-torch references), got {self.kernels!r}")
        if not self.cancel_digits > 0:
            raise ValueError(f"cancel_digits must be > 0, got {self.cancel_digits!r}")
        self.working_dtype = working_dtype_for(self.fmt)
        # complex samples: real and imaginary parts in the working dtype
        self.complex_dtype = torch.complex128 if self.working_dtype == torch.float64 else \
            torch.complex64
        # fp64 format in fp64: rounding needs the exact result's side (error-free transforms)
        self.eft = (self.working_dtype == torch.float64 and self.fmt.man_bits == 52
                    and self.rounding is Rounding.RANDOM)
        self.cap = self.fmt.digit_cap
        t = self._t = student_t(self.n_samples, self.confidence)
        n = self.n_samples
        self._dconst = math.log10(math.sqrt(n * (n - 1)) / t)
        self.counters = Counters("detailed" if self.diagnostics == "detailed" else "summary")
        self._occurrence: dict[str, int] = {}
        self._seeds: Optional[dict] = None  # salt -> seed, derived ahead (for_call)
        self._round_seeds: Optional[dict] = None  # seed -> its first output's rounding seed
        self._native = self.kernels != "torch" and native.available()
        self._rounders: dict = {}
        self._gemm: Optional[tuple] = None  # (seed, surrogate fired) of the GEMM being run
        # unary math on rounded values of a format with at most bf16's significand (bf16, fp8:
        # every such value is a bf16 value) through native.lookup_bf16
        self._lookup = (self._native and self.working_dtype == torch.float32
                        and self.fmt.man_bits <= 7)

    def for_call(self, seed: int, recorder: Optional[Callable[[PrimitiveRecord], None]],
                 salts: Sequence[int] = ()) -> "AtenContext":
        """A context with this one's settings (checked and derived once) and fresh running
        state: what a driver that analyses many calls with the same settings holds. The
        seeds of the primitives that will pass ``salts`` are derived now, all at once."""
        ctx = copy.copy(self)
        ctx.seed, ctx.recorder, ctx.calls = seed, recorder, 0
        ctx.counters = Counters(self.counters.diagnostics)
        ctx._occurrence = {}
        ctx._last_events = []
        ctx._seeds = ctx._round_seeds = None
        ctx._gemm = None
        found = native.derive_seeds(seed, salts, 100) if salts and self._native else None
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
        return self._native and samples.is_cpu and samples.dtype in _NATIVE_DTYPES

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


# --------------------------------------------------------------------------- rounding
def round_stacked(samples: torch.Tensor, fmt: Format, mode: Rounding, seed: int, *,
                  saturate: bool = False, kernels: str = "auto") -> torch.Tensor:
    """Round stacked samples into ``fmt`` with the cross-sample scheme of DESIGN.md §1.

    The same bits as :func:`fxstab.numerics.rounding.round_samples` (Philox streams), through the fused
    CPU kernel where it runs (``kernels`` ``auto``/``cpu``) and the reference elsewhere.
    """
    if kernels != "torch" and samples.device.type == "cpu" and \
            samples.dtype in (torch.float32, torch.float64) and native.available():
        return native.round_stats(samples, fmt, mode, seed, saturate=saturate,
                                  want_stats=False)[0]
    return round_samples(samples, fmt, mode, seed, saturate=saturate)


def _round_measure(v: torch.Tensor, ctx: AtenContext, seed: Optional[int], want_stats: bool,
                   want_digits: bool, want_zeros: bool = False, own: bool = False):
    """Round ``v`` ([N, ...], unless ``seed`` is None: measure only) and measure it.

    Returns (samples, stats list [sum, min, max, zeros, non-finite, numel] or None, analysis):
    one pass of the fused kernel, or the references (``round_samples`` + torch digits). The
    kernel also writes the computational-zero mask with ``want_zeros`` (a consumer's counters
    read it; a byte per element instead of the digits).
    """
    if seed is None and not (want_stats or want_digits):
        return v, None, _Analysis(v, ctx)
    if ctx._native and v.dtype in _NATIVE_DTYPES and v.is_cpu and v.dim() and v.numel():
        want_stats = want_stats or want_digits or want_zeros
        if not v.is_contiguous() and not (v.stride(0) == 0 and v[0].is_contiguous()):
            v = v.contiguous()
        # the settings are bound once per context; an expanded view (identical samples) is
        # read N times, not copied
        r = ctx._rounders.get((v.dtype, seed is not None)) or ctx.rounder(v.dtype, seed is not None)
        out, st, d, z = r(v, 0 if seed is None else seed, want_stats, want_digits, want_zeros, own)
        return out, st, _Analysis(out, ctx, digits=d, stats=st, zero=z)
    numel = v.numel() // v.shape[0] if v.dim() and v.shape[0] else (0 if v.dim() else 1)
    under = 0
    if seed is not None:
        if want_stats and numel and v.is_floating_point():
            under = underflow_count(v, ctx.fmt)
        v = round_samples(v, ctx.fmt, ctx.rounding, seed, saturate=ctx.saturate)
    an = _Analysis(v, ctx)
    st = None
    if want_stats and numel:
        d = an.digits
        dmin, dmax = torch.aminmax(d)
        st = torch.stack([d.sum(dtype=torch.float64), dmin.double(), dmax.double(),
                          an.zero.sum().double(), (~an.finite).sum().double()]).tolist()
        st.append(float(numel))
        if v.is_floating_point():  # the extras: norms, underflow, quantiles
            st += extra_stats(v, ctx._t, ctx.cap, under)
        else:
            st += empty_stats(ctx.cap)[6:]
        an.zeros, an.min_digits, an._nf = st[3], st[1], int(st[4])
    elif want_stats:
        st = empty_stats(ctx.cap)
    return v, st, an


def _random_up(n: int, numel: int, seed: int, ctx: AtenContext, device) -> torch.Tensor:
    """Rounding directions [N, numel] (True: away from zero) of ``random`` rounding: the
    Philox bits of :func:`fxstab.numerics.rounding.round_samples` with CADNA's cross-sample scheme.

    Through the fused kernel: rounding a value halfway inside a bf16 interval reads the bit
    (it goes up exactly when the bit says so), the same bits as the reference below.
    """
    if ctx._native and device.type == "cpu" and numel:
        probe = torch.full((numel,), _PROBE, dtype=torch.float32)
        out = native.round_stats(probe, _PROBE_FORMAT, Rounding.RANDOM, seed, n_samples=n,
                                 want_stats=False)[0]
        return out > _PROBE
    draws, flips = sample_draws(n)
    bits = randbits.random_bits(seed, numel, sorted(set(draws)), device=device)
    flip = torch.tensor(flips, dtype=torch.int64, device=device).reshape(n, 1)
    return (bits[torch.tensor(draws, device=device)] ^ flip).bool()


_PROBE = 1.0 + 2.0 ** -9  # between bf16's neighbours 1 and 1 + 2**-7
_PROBE_FORMAT = get_format("bf16")


# Error-free transformations for the fp64 format (DESIGN.md §1): the working dtype is the
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


def _fp64_side(kind: str, op, args: tuple, kwargs: dict, y: torch.Tensor) -> Optional[torch.Tensor]:
    """Sign of (exact result - y) for add/sub/mul/div/sqrt in fp64, or None if unknown."""
    name = getattr(op, "_overloadname", "")
    if kind in ("add", "sub", "rsub"):
        if kwargs.get("alpha", args[2] if len(args) > 2 else 1) != 1:
            return None
        a, b = _aligned(args[:2], y.dim() - 1)
        a = torch.as_tensor(a, dtype=y.dtype, device=y.device)
        b = torch.as_tensor(b, dtype=y.dtype, device=y.device)
        if kind == "sub":
            b = -b
        elif kind == "rsub":
            a, b = b, -a
        bb = y - a
        err = (a - (y - bb)) + (b - bb)
        return torch.sign(err)
    if kind == "mul":
        a, b = (torch.as_tensor(v, dtype=y.dtype, device=y.device)
                for v in _aligned(args[:2], y.dim() - 1))
        return torch.sign(_two_prod_err(a, b, y))
    if kind == "div" and name in ("Tensor", "Scalar") and not kwargs.get("rounding_mode"):
        a, b = (torch.as_tensor(v, dtype=y.dtype, device=y.device)
                for v in _aligned(args[:2], y.dim() - 1))
        ph = y * b
        r = (a - ph) - _two_prod_err(y, b, ph)
        return torch.sign(r) * torch.sign(b)
    if kind == "reciprocal":
        b = args[0].samples
        ph = y * b
        return torch.sign((1.0 - ph) - _two_prod_err(y, b, ph)) * torch.sign(b)
    if kind == "sqrt":
        a = args[0].samples
        ph = y * y
        return torch.sign((a - ph) - _two_prod_err(y, y, ph))
    return None


def _round_fp64(kind: str, op, args: tuple, kwargs: dict, y: torch.Tensor, seed: int,
                ctx: AtenContext) -> torch.Tensor:
    """Random rounding in the fp64 format on fp64 results (already rounded to nearest).

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
    side = _fp64_side(kind, op, args, kwargs, y)
    up = _random_up(n, numel, seed, ctx, y.device).reshape(y.shape)
    if side is None:
        shared = _random_up(1, numel, randbits.derive_seed(seed, 1), ctx, y.device)
        side = torch.where(shared.reshape((1,) + y.shape[1:]), 1.0, -1.0).to(y.dtype)
        moved = torch.nextafter(y, side * math.inf)
        return torch.where(up & torch.isfinite(y), moved, y)
    side = side.expand(y.shape) if side.shape != y.shape else side
    moved = torch.nextafter(y, side * math.inf)
    return torch.where(up & (side != 0) & torch.isfinite(y), moved, y)


def _perturb(samples: torch.Tensor, eta: float, seed: int, ctx: AtenContext) -> tuple[torch.Tensor, int]:
    """The GEMM surrogate (DESIGN.md §4): :func:`fxstab.numerics.surrogate.perturb_samples`, through the
    fused kernel where it runs (same bits)."""
    if ctx.native_for(samples):
        return native.perturb(samples, eta, seed)
    return perturb_samples(samples, eta, seed)


# --------------------------------------------------------------------------- batching
def _norm_dim(d: int, ndim: int) -> int:
    return d + 1 if d >= 0 else d + ndim + 1


def _dims(dim, ndim: int):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(1, ndim + 1))
    if isinstance(dim, (list, tuple)):
        return [_norm_dim(d, ndim) for d in dim]
    return _norm_dim(dim, ndim)


def _with(args: tuple, i: int, value) -> tuple:
    return args[:i] + (value,) + args[i + 1:]


def _samples_or(x, n: int):
    return x.samples if isinstance(x, Stacked) else x


def _aligned(args: tuple, ndim_out: Optional[int] = None) -> tuple:
    """Stacked samples reshaped to [N, 1.., *shape] so they broadcast like their logical shapes
    (``ndim_out``: the logical rank of the result, by default the largest operand's)."""
    if ndim_out is None:
        ndim_out = _logical_ndim(args)
    out = []
    for a in args:
        if type(a) is Stacked:
            s = a.samples
            k = ndim_out + 1 - s.dim()
            if k > 0:
                s = s.reshape(s.shape[:1] + (1,) * k + s.shape[1:])
            out.append(s)
        else:
            out.append(a)
    return tuple(out)


def _logical_ndim(args) -> int:
    nd = 0
    for a in args:
        if type(a) is Stacked:
            d = a.samples.dim() - 1
        elif isinstance(a, torch.Tensor):
            d = a.dim()
        else:
            continue
        nd = d if d > nd else nd
    return nd


def _special(op, kind: str, args: tuple, kwargs: dict):
    """Batched evaluation of hot non-pointwise primitives without vmap, or ``NotImplemented``."""
    if kwargs and kind not in ("sum", "mean", "amax", "amin", "var", "_softmax", "_log_softmax",
                               "addmm"):
        return NotImplemented
    if any(isinstance(v, Stacked) for v in kwargs.values()):
        return NotImplemented
    a0 = args[0] if args else None
    if kind in ("mm", "bmm", "matmul"):
        a, b = (_samples_or(x, 0) for x in args[:2])
        if isinstance(args[0], Stacked) and isinstance(args[1], Stacked) and kind == "mm":
            return torch.bmm(a, b)
        return torch.matmul(a, b)
    if kind == "addmm":
        bias, m1, m2 = args[:3]
        beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
        alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
        if isinstance(m1, Stacked) and not isinstance(m2, Stacked) and \
                not isinstance(bias, Stacked) and m2.dim() == 2:
            # one GEMM over the samples' rows with the bias fused, as the plain addmm runs
            s = m1.samples
            out = torch.addmm(bias, s.reshape(-1, s.shape[-1]), m2, beta=beta, alpha=alpha)
            return out.view(s.shape[0], s.shape[1], m2.shape[1])
        prod = torch.matmul(_samples_or(m1, 0), _samples_or(m2, 0))
        if alpha != 1:
            prod = prod * alpha
        b = _aligned((bias,), 2)[0]
        if beta != 1:
            b = b * beta
        return prod + b
    if not isinstance(a0, Stacked):
        return NotImplemented
    nd = a0.ndim
    s = a0.samples
    rest = args[1:]
    if kind in ("view", "_unsafe_view", "reshape", "expand") and len(rest) == 1 and not isinstance(rest[0], Stacked):
        size = list(rest[0])
        if kind != "expand":
            return op(s, [s.shape[0]] + size)
        if len(size) > nd:  # to a higher rank (pos.expand(B, -1, -1)): new dims after dim 0
            s = s.reshape(s.shape[:1] + (1,) * (len(size) - nd) + s.shape[1:])
        return s.expand([s.shape[0]] + size)
    if kind == "permute":
        return s.permute([0] + [_norm_dim(d, nd) for d in rest[0]])
    if kind == "transpose":
        return s.transpose(_norm_dim(rest[0], nd), _norm_dim(rest[1], nd))
    if kind == "t":
        return s.transpose(1, 2) if nd == 2 else s
    if kind == "unsqueeze":
        return s.unsqueeze(_norm_dim(rest[0], nd + 1))
    if kind in ("clone", "alias", "detach", "lift_fresh_copy", "contiguous"):
        return s.clone()
    if kind == "select":
        return s.select(_norm_dim(rest[0], nd), rest[1])
    if kind == "slice" and len(rest) >= 1:
        dim = _norm_dim(rest[0], nd)
        start = rest[1] if len(rest) > 1 else None
        end = rest[2] if len(rest) > 2 else None
        step = rest[3] if len(rest) > 3 else 1
        return op(s, dim, start, end, step)
    if nd == 0 and kind in _DIM_KINDS:
        # a 0-d value: its only dim (0 or -1) is the value itself; run on [N, 1] over dim 1
        return _on_scalar(op, kind, s, rest, kwargs)
    if kind in ("sum", "mean", "amax", "amin") and not any(isinstance(r, Stacked) for r in rest) \
            and not kwargs.get("output_dtype"):
        dim = rest[0] if rest else kwargs.get("dim", None)
        keepdim = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
        extra = {k: v for k, v in kwargs.items() if k == "dtype"}
        dims = _dims(dim, nd)
        if kind in ("amax", "amin"):
            return getattr(torch, kind)(s, dims, keepdim)
        if isinstance(dims, int):
            dims = [dims]
        if not dims:
            return s.clone()
        return getattr(torch, kind)(s, dims, keepdim, **extra)
    if kind == "broadcast_in_dim" and len(rest) == 2:  # prims: shape, broadcast_dimensions
        return _broadcast_in_dim(s, [s.shape[0]] + list(rest[0]), [0] + [d + 1 for d in rest[1]])
    if kind == "var" and getattr(op, "namespace", None) == "prims" and not kwargs.get("output_dtype"):
        dims = _dims(rest[0] if rest else None, nd)
        correction = rest[1] if len(rest) > 1 else kwargs.get("correction", 1)
        return _prims_var(s, [dims] if isinstance(dims, int) else dims, correction)
    if kind in ("_softmax", "_log_softmax", "cumsum") and len(rest) >= 1:
        return op(s, _norm_dim(rest[0], nd), *rest[1:], **kwargs)
    return NotImplemented


# Primitives of _special with a dim argument (reductions, softmax, cumsum), which a 0-d
# value reaches with dim 0 or -1 (torch wraps a scalar's dims), not a dim of its samples.
_DIM_KINDS = frozenset({"sum", "mean", "amax", "amin", "var", "_softmax", "_log_softmax",
                        "cumsum"})


def _on_scalar(op, kind: str, s: torch.Tensor, rest: tuple, kwargs: dict):
    """``op`` over the only dim of 0-d samples ``s`` ([N]): on ``s[:, None]`` over dim 1, then
    back to [N] (torch's own arithmetic: a sum of one value, a softmax of one value is 1)."""
    if any(isinstance(r, Stacked) for r in rest):
        return NotImplemented
    col = s.unsqueeze(1)
    if kind in ("_softmax", "_log_softmax", "cumsum"):
        if not rest:
            return NotImplemented
        return op(col, 1, *rest[1:], **kwargs).squeeze(1)
    if kind == "var":
        if getattr(op, "namespace", None) != "prims" or kwargs.get("output_dtype"):
            return NotImplemented
        correction = rest[1] if len(rest) > 1 else kwargs.get("correction", 1)
        return _prims_var(col, [1], correction).reshape(s.shape)
    if kwargs.get("output_dtype"):
        return NotImplemented
    extra = {k: v for k, v in kwargs.items() if k == "dtype"}
    if kind in ("amax", "amin"):
        return getattr(torch, kind)(col, [1], False)
    return getattr(torch, kind)(col, [1], False, **extra)


def _run_per_sample(op, args, kwargs, n):
    def pick(k):
        return lambda x: x.samples[k] if isinstance(x, Stacked) else x
    # a random primitive (rrelu's noise) draws in every sample what the first sample drew
    seeded = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
    state = torch.random.get_rng_state() if seeded else None
    results = []
    for k in range(n):
        if seeded:
            torch.random.set_rng_state(state)
        a, kw = pytree.tree_map(pick(k), (args, kwargs), is_leaf=lambda x: isinstance(x, Stacked))
        results.append(op(*a, **kw))
    flat0, spec = pytree.tree_flatten(results[0])
    flats = [pytree.tree_flatten(r)[0] for r in results]
    out = []
    for j, v in enumerate(flat0):
        if isinstance(v, torch.Tensor) and all(f[j].shape == v.shape for f in flats):
            out.append(torch.stack([f[j] for f in flats]))
        else:
            out.append(v)
    return pytree.tree_unflatten(out, spec)


def _run_batched(op, info: OpInfo, args: tuple, kwargs: dict, n: int, ctx: "AtenContext"):
    """Run ``op`` on all samples; returns (outputs with sample dim, lifted). A random primitive
    that ``vmap`` cannot batch runs once per sample from one RNG state: a step of the traced
    graph (:meth:`AtenContext.emit`)."""
    stacked_kw = bool(kwargs) and _has_stacked((), kwargs)
    if (info.pointwise or info.prim is not None and not isinstance(info.prim, str)) \
            and not stacked_kw:
        aligned = _aligned(args)
        if info.prim is aten.div.Tensor and not any(
                isinstance(a, torch.Tensor) and a.is_floating_point() or isinstance(a, float)
                for a in aligned[:2]):
            return torch.div(*aligned[:2], rounding_mode="trunc"), True  # prims.div of ints
        return info.call(*aligned, **kwargs), True
    res = _special(op, info.kind, args, kwargs)
    if res is not NotImplemented:
        return res, True
    if not stacked_kw:
        in_dims = tuple(pytree.tree_map(lambda x: 0 if isinstance(x, Stacked) else None, a,
                                        is_leaf=lambda x: isinstance(x, Stacked)) for a in args)
        plain = pytree.tree_map(lambda x: x.samples if isinstance(x, Stacked) else x, args,
                                is_leaf=lambda x: isinstance(x, Stacked))
        try:
            return torch.vmap(functools.partial(op, **kwargs), in_dims=in_dims)(*plain), True
        except Exception:  # noqa: BLE001 - any failure falls back to per-sample execution
            pass
    if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        return ctx.emit("per_sample", None, functools.partial(_per_sample_step, op), (), args,
                        kwargs), False
    return _run_per_sample(op, args, kwargs, n), False


def _per_sample_step(op, ctx: "AtenContext", raw: list, args: tuple, kwargs: dict):
    return _run_per_sample(op, args, kwargs, ctx.n_samples)


def _owned(v: torch.Tensor, args: tuple) -> bool:
    """Whether the primitive's result ``v`` is memory of its own (not a view, not an operand):
    then it is rounded in place instead of into a new buffer, one memory pass less."""
    if v._base is not None:
        return False
    ptr = v.data_ptr()
    for a in args:
        if type(a) is Stacked:
            if a.samples.data_ptr() == ptr:
                return False
        elif isinstance(a, torch.Tensor):
            if a.data_ptr() == ptr:
                return False
        elif isinstance(a, (list, tuple)):  # cat, stack: fresh results, but be sure
            return False
    return True


_NO_KWARGS: dict = {}


def _scan(args: tuple) -> tuple[bool, bool, bool]:
    """(whether any argument carries samples, whether every stacked one is an expanded view of
    one value: identical samples, whether any is something else than samples or a Python
    number: what :func:`_working_args` may convert) in one pass; a list holding samples (cat,
    stack) counts as stacked, not identical (it runs batched)."""
    stacked, identical, other = False, True, False
    for a in args:
        t = type(a)
        if t is Stacked:
            stacked = True
            if identical:
                s = a.samples
                identical = s.dim() > 0 and s.stride(0) == 0
        elif t not in _PASS_THROUGH:
            other = True
            if isinstance(a, (list, tuple)) and any(isinstance(b, Stacked) for b in a):
                stacked, identical = True, False
    return stacked, identical, other


def _has_stacked(args: tuple, kwargs: dict) -> bool:
    """Whether any argument (or list element: cat, stack) carries samples."""
    for a in args:
        if isinstance(a, Stacked):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(b, Stacked) for b in a):
            return True
    for a in kwargs.values():
        if isinstance(a, Stacked):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(b, Stacked) for b in a):
            return True
    return False


# --------------------------------------------------------------------------- counters
def _bcount(mask: torch.Tensor, out_numel: int) -> torch.Tensor:
    """Number of output elements a broadcast mask covers (each mask element repeats equally)."""
    m = mask.numel()
    f = out_numel // m if m else 0
    return torch.count_nonzero(mask) * f  # several times faster than a bool sum


def _operand(x, ctx) -> Optional[_Analysis]:
    return x.analysis(ctx) if isinstance(x, Stacked) and x.samples.is_floating_point() else None


def _zeros(o: _Analysis, out_numel: int):
    """An operand's computational zeros as a counter's mask: the analysis itself (counted by
    its statistics, no pass over the mask) when they cover the output one to one and the
    statistics counted them, else the mask."""
    if o.zeros is not None and o._s.numel() == out_numel * o._s.shape[0]:
        return o
    return o.zero


def _exact_data(a: _Analysis) -> bool:
    """Identical, finite samples (data entering the analysis): digits at the cap everywhere."""
    return a._s.stride(0) == 0 and a.all_finite


def _differs(a, b) -> bool:
    """Whether :func:`_diff_analysis` has a difference to analyse (from types and dtypes)."""
    if not isinstance(a, Stacked) and not isinstance(b, Stacked):
        return False
    x = a.samples if isinstance(a, Stacked) else a
    y = b.samples if isinstance(b, Stacked) else b
    return not (isinstance(x, torch.Tensor) and not x.is_floating_point() and
                (not isinstance(y, torch.Tensor) or not y.is_floating_point()))


def _diff_analysis(a, b, ctx, nd) -> Optional[_Analysis]:
    """Analysis of a - b (unrounded, on the samples) for comparison-like primitives."""
    if not _differs(a, b):
        return None
    x, y = _aligned((a, b), nd)
    return _Analysis(torch.sub(x, y) if isinstance(x, torch.Tensor) else torch.rsub(y, x), ctx)


def _compute_counters(kind: str, args: tuple, kwargs: dict, out: Optional[Stacked],
                      out_numel: int, ctx: AtenContext, diff: Optional[_Analysis]):
    """Masks (or counts) of the counters this primitive triggers: list of (key, mask)."""
    found = []
    oa = out.analysis(ctx) if out is not None and out.samples.is_floating_point() else None
    # no output digit is below cap - cancel_digits (>= every reference): no cancellation
    # (always so when the format has fewer digits than cancel_digits: bf16, fp16, fp8)
    can_cancel = oa is not None and not (oa.min_digits is not None and
                                         oa.min_digits > ctx.cap - ctx.cancel_digits)
    if kind in _ADD and can_cancel:
        ops = [_operand(x, ctx) for x in args[:2]]
        # exact data (identical samples, finite) has the cap's digits: it never lowers the min
        ds = [o.digits for o in ops if o is not None and not _exact_data(o)]
        if ds or any(o is not None for o in ops):
            ref = (ctx.cap if not ds else ds[0] if len(ds) == 1
                   else torch.minimum(ds[0], ds[1]))
            found.append(("cancellation", oa.digits <= ref - ctx.cancel_digits))
    elif kind in _ADD or kind in _REDUCE_SUM and not can_cancel:
        pass
    elif kind in _REDUCE_SUM and oa is not None and isinstance(args[0], Stacked):
        a = args[0].analysis(ctx)
        nd = args[0].ndim
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dg = a.digits
        if dg.dim() and not any(dg.stride()):  # one value for all (identical samples): no pass
            ref = dg.reshape(-1)[0]
        elif dim is None or (isinstance(dim, (list, tuple)) and not dim):
            ref = a.digits.amin() if nd else a.digits
        else:
            dims = [d % nd for d in (dim if isinstance(dim, (list, tuple)) else [dim])] if nd else []
            ref = a.digits.amin(dim=dims, keepdim=bool(keepdim)) if dims else a.digits
        found.append(("cancellation", oa.digits <= ref - ctx.cancel_digits))
    elif kind in _DIV:
        if kind == "reciprocal":
            o = _operand(args[0], ctx)
        else:
            o = _operand(args[1], ctx) if len(args) > 1 else None
        if o is not None and not o.no_zeros:
            found.append(("division", _zeros(o, out_numel)))
    elif kind == "mul":
        oa_, ob_ = (_operand(x, ctx) for x in args[:2])
        if oa_ is not None and ob_ is not None and not (oa_.no_zeros or ob_.no_zeros):
            found.append(("multiplication", oa_.zero & ob_.zero))
    elif kind in _POW or kind in _MATH:
        zs = [o for o in (_operand(x, ctx) for x in args[:2]) if o is not None and not o.no_zeros]
        if zs:
            found.append(("power" if kind in _POW else "math_function",
                          _zeros(zs[0], out_numel) if len(zs) == 1 else zs[0].zero | zs[1].zero))
    elif kind == "abs" and isinstance(args[0], Stacked) and args[0].samples.is_floating_point():
        s = args[0].samples
        found.append(("intrinsic", (s > 0).any(0) & (s < 0).any(0)))
    elif kind in _ROUNDING_INTRINSICS and out is not None and not kwargs.get("decimals"):
        found.append(("intrinsic", ~out.analysis(ctx).identical))
    elif kind in ("_to_copy", "to") and out is not None and not out.samples.is_floating_point() \
            and isinstance(args[0], Stacked) and args[0].samples.is_floating_point():
        found.append(("intrinsic", ~out.analysis(ctx).identical))
    elif kind in _COMPARE or kind in _SELECT2 or kind in ("clamp", "clamp_min", "clamp_max"):
        if diff is not None:
            found.append(("branching", diff.zero))
    elif kind in ("relu", "threshold", "hardtanh") and isinstance(args[0], Stacked):
        if kind == "relu":
            a = args[0].analysis(ctx)
            if not a.no_zeros:
                found.append(("branching", _zeros(a, out_numel)))
        else:
            lim = args[1] if len(args) > 1 else (-1.0 if kind == "hardtanh" else 0.0)
            d = _diff_analysis(args[0], lim, ctx, args[0].ndim)
            if d is not None:
                found.append(("branching", d.zero))
    elif kind == "where" and isinstance(args[0], Stacked):
        c = args[0].samples
        found.append(("branching", c.any(0) & ~c.all(0)))
    # NaN/inf produced from finite operands; an exact primitive only moves values around
    if oa is not None and kind not in EXACT_PRIMITIVES and not oa.all_finite:
        bad = ~oa.finite
        for x in pytree.tree_leaves(args, is_leaf=lambda v: isinstance(v, Stacked)):
            o = _operand(x, ctx)
            if o is not None:
                fin = o.finite
            elif isinstance(x, torch.Tensor) and x.is_floating_point():
                fin = torch.isfinite(x)
            elif isinstance(x, float):
                fin = torch.tensor(math.isfinite(x))
            else:
                continue
            try:  # elementwise when the operand broadcasts to the output, else as a whole
                torch.broadcast_shapes(fin.shape, bad.shape)
            except RuntimeError:
                fin = fin.all()
            bad = bad & fin
        found.append(("anomaly", bad))
    return found


# --------------------------------------------------------------------------- the rule
def _cestac_compare(kind: str, diff: _Analysis, mean_diff: torch.Tensor) -> torch.Tensor:
    equal = diff.exact_zero | diff.zero
    c = _COMPARE[kind]
    if c == "eq":
        return equal
    if c == "ne":
        return ~equal
    if c == "lt":
        return (mean_diff < 0) & ~equal
    if c == "le":
        return (mean_diff < 0) | equal
    if c == "gt":
        return (mean_diff > 0) & ~equal
    return (mean_diff > 0) | equal


def _fix_dtype_kwargs(kind: str, kwargs: dict, ctx: AtenContext) -> dict:
    dt = kwargs.get("dtype")
    if isinstance(dt, torch.dtype) and dt.is_floating_point:
        kwargs = dict(kwargs)
        kwargs["dtype"] = ctx.working_dtype  # an int (or complex) source still converts
    elif isinstance(dt, torch.dtype) and dt.is_complex:
        kwargs = dict(kwargs)
        kwargs["dtype"] = ctx.complex_dtype
    return kwargs


def _to_working(x, ctx):
    if isinstance(x, torch.dtype):
        return ctx.working_dtype if x.is_floating_point else \
            ctx.complex_dtype if x.is_complex else x
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() and x.dtype != ctx.working_dtype:
            return x.to(ctx.working_dtype)
        if x.is_complex() and x.dtype != ctx.complex_dtype:
            return x.to(ctx.complex_dtype)
    return x


_PASS_THROUGH = frozenset({Stacked, int, float, bool, type(None)})


def _working_args(args: tuple, ctx: AtenContext) -> tuple:
    """Plain floating tensors (and float dtype arguments) in the working dtype; the tuple itself
    when nothing changes (the common case: no copy, no pytree walk)."""
    wd = ctx.working_dtype
    new = None
    for i, a in enumerate(args):
        if type(a) in _PASS_THROUGH:  # samples are in the working dtype already
            continue
        if isinstance(a, torch.Tensor):
            if a.dtype != wd and (a.is_floating_point() or a.is_complex()):
                conv = _to_working(a, ctx)
                if conv is not a:
                    new = list(args) if new is None else new
                    new[i] = conv
        elif isinstance(a, torch.dtype):
            if (a.is_floating_point or a.is_complex) and a not in (wd, ctx.complex_dtype):
                new = list(args) if new is None else new
                new[i] = _to_working(a, ctx)
        elif isinstance(a, (list, tuple)) and any(isinstance(b, (torch.Tensor, torch.dtype)) for b in a):
            conv = pytree.tree_map(lambda x: _to_working(x, ctx), a)
            new = list(args) if new is None else new
            new[i] = conv
    return args if new is None else tuple(new)


def _digits_through(info: OpInfo, op, args: tuple, kwargs: dict, out: torch.Tensor,
                    ctx: AtenContext) -> Optional[_Analysis]:
    """The analysis of a layout primitive's output from its operand's, if already measured:
    its per-element digits and zero mask follow the same rearrangement, its statistics hold."""
    src = args[0]._an
    if src is None or (src._digits is None and src._zero is None) or \
            len(args) and _has_stacked(args[1:], kwargs):
        return None
    same = info.kind in ("clone", "alias", "detach", "lift_fresh_copy", "contiguous", "neg")
    moved = []
    for t in (src._digits, src._zero):
        if t is not None and not same:
            try:
                t = (info.plain or op)(t, *args[1:], **kwargs)
            except Exception:  # noqa: BLE001 - e.g. a view the digits' strides do not allow
                return None
            if not isinstance(t, torch.Tensor) or t.shape != out.shape[1:]:
                return None
        moved.append(t)
    an = _Analysis(out, ctx, digits=moved[0], non_finite=0 if src._nf == 0 else None,
                   zero=moved[1])
    if src.zeros == 0:  # a rearrangement keeps no-zeros (views and copies, never reductions)
        an.zeros = 0
    return an


def apply_primitive(op: Any, args: tuple, kwargs: Optional[dict], ctx: AtenContext, *,
                    name: Optional[str] = None, salt: Optional[int] = None,
                    need_digits: Optional[bool] = None,
                    need_zeros: Optional[bool] = None) -> Any:
    """Run one aten primitive on stacked samples and apply the arithmetic-level rules.

    Args:
        op: An aten ``OpOverload`` (``torch.ops.aten.exp.default``) or another callable.
        args: Positional arguments; :class:`Stacked` where the value carries samples.
        kwargs: Keyword arguments (plain).
        ctx: The :class:`AtenContext` of the analysed call.
        name: Stable name for the record (default ``aten.<kind>#k`` within ``ctx``).
        salt: Seed salt (default: the context's call counter).
        need_digits: Whether a consumer's counters will read this output's per-element digits
            (a graph driver knows: :func:`operand_needs`; ``None``: assume so whenever counters
            run). Only decides whether the fused kernel writes them now or a consumer measures
            them later.
        need_zeros: The same for the output's computational-zero mask (``None``: as
            ``need_digits``).

    Returns:
        The primitive's outputs with the same structure as ``op``'s, each tensor computed from
        samples as :class:`Stacked` (floating results rounded into the format); comparisons
        return plain boolean tensors (CESTAC decisions); with no stacked argument the primitive
        runs once and returns plain results.

    What reads values (the rounding and its statistics, the counters, CESTAC's comparisons,
    the GEMM surrogate, the bf16 lookup tables, per-sample draws) runs through
    :meth:`AtenContext.emit`: directly, or as one step of the sampled graph being traced
    (``granularity="aten"`` in the backend); everything before it depends only on types,
    shapes and the primitive.
    """
    kwargs = kwargs or _NO_KWARGS
    info = op_info(op)
    kind = info.kind
    n = ctx.n_samples
    stacked, identical, other = _scan(args)
    if kwargs and not stacked:
        stacked = _has_stacked((), kwargs)
    if stacked and info.inplace and args and isinstance(args[0], torch.Tensor):
        # x += f(samples) into a plain tensor (a T5-style relative position bias): the target
        # becomes N copies of itself that the primitive updates, and the result carries samples
        t = _to_working(args[0], ctx)
        args = (Stacked(t.unsqueeze(0).expand(n, *t.shape).clone()),) + tuple(args[1:])
        identical = False
    from_plain = not stacked
    if from_plain:
        # Only plain operands (parameters, constants): run once. An arithmetic result is still
        # a result of the simulated arithmetic, so it enters the samples here (N identical
        # copies, then rounded below); a model whose data all come from parameters (token
        # embeddings) would otherwise never be analysed.
        out = (info.plain or op)(*args, **kwargs)
        if info.exact or info.factory or not any(
                isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
                for v in ((out,) if isinstance(out, torch.Tensor) else pytree.tree_leaves(out))):
            return out
    if other:
        args = _working_args(args, ctx)
    if kwargs:
        kwargs = _fix_dtype_kwargs(kind, kwargs, ctx)
    rule = _Rule(op, info, name, salt, need_digits, need_zeros, ctx.stepper is not None)

    # Comparisons: one plain boolean decision per element (CESTAC), branching on noise.
    if info.compare and len(args) >= 2 and _differs(args[0], args[1]):
        return ctx.emit("compare", name, rule.compare, (), args, kwargs)
    if info.gemm and not from_plain:
        # the surrogate on the stacked operands (a step), then the product on the samples
        args = ctx.emit("perturb", name, rule.perturb, (), args, kwargs)
        raw, lifted = _run_batched(op, info, args, kwargs, n, ctx)
        rule.lifted = lifted
    elif from_plain:
        raw = pytree.tree_map(
            lambda v: _to_working(v, ctx).unsqueeze(0).expand(n, *v.shape)
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
            else v, out)
    elif identical and not (kwargs and _has_stacked((), kwargs)):
        # Every operand is N identical samples (data entering the analysis, or exact
        # operations on it): one evaluation serves all samples; they part at the rounding.
        one = (info.plain or op)(*[a.samples[0] if isinstance(a, Stacked) else a for a in args],
                                 **kwargs)
        raw = one.unsqueeze(0).expand(n, *one.shape) if isinstance(one, torch.Tensor) else \
            pytree.tree_map(lambda v: v.unsqueeze(0).expand(n, *v.shape)
                            if isinstance(v, torch.Tensor) else v, one)
    elif ctx._lookup and info.kind in native.LOOKUP_OPS and len(args) == 1 and not kwargs \
            and type(args[0]) is Stacked and args[0].samples.dtype == torch.float32 \
            and args[0].samples.is_cpu and args[0].samples.is_contiguous():
        # exp, log, ... of values in the format: a table of the op's own results (unless a
        # value is not one of the format's), then rounded
        return ctx.emit("lookup", name, rule.lookup, (), args, kwargs, op)
    else:
        raw, rule.lifted = _run_batched(op, info, args, kwargs, n, ctx)
    return rule.finish_raw(ctx, raw, args, kwargs)


class _Rule:
    """What :func:`apply_primitive` decided for one primitive from types and shapes, and the
    parts of its rules that read values, as functions ``(ctx, raw, args, kwargs)`` of the
    run-time values (:meth:`AtenContext.emit`): they hold no tensor."""

    __slots__ = ("op", "info", "name", "salt", "need_digits", "need_zeros", "lifted", "spec",
                 "reused", "fast")

    def __init__(self, op, info, name, salt, need_digits, need_zeros, reused=False) -> None:
        self.op, self.info, self.name, self.salt = op, info, name, salt
        self.need_digits, self.need_zeros = need_digits, need_zeros
        self.lifted = True
        self.spec = None  # the raw outputs' structure (None: one tensor)
        self.reused = reused  # a step of a sampled graph: its functions run on every call
        # the prepared kernel of the usual one-output rounding (decided on the first call):
        # (native.Prepared, digits wanted when counting, zero mask wanted when counting,
        # the output's logical shape)
        self.fast: Any = None

    def finish_raw(self, ctx: AtenContext, raw: Any, args: tuple, kwargs: dict) -> Any:
        """Round, measure, count and record the outputs ``raw`` of the batched primitive."""
        if isinstance(raw, torch.Tensor):
            flat = [raw]
        else:
            flat, self.spec = pytree.tree_flatten(raw)
        return ctx.emit("round", self.name, self.finish, flat, args, kwargs)

    def compare(self, ctx: AtenContext, raw: list, args: tuple, kwargs: dict) -> torch.Tensor:
        kind = self.info.kind
        diff = _diff_analysis(args[0], args[1], ctx, _logical_ndim(args[:2]))
        result = _cestac_compare(kind, diff, diff._s.mean(0))
        rec_name = self.name or ctx.name_for(self.op)
        counting, detailed = _counting(ctx)
        if counting:
            _count(kind, [("branching", diff.zero)], result.numel(), None, ctx, rec_name,
                   self.op, detailed, diff)
        return result

    def perturb(self, ctx: AtenContext, raw: list, args: tuple, kwargs: dict) -> tuple:
        """The GEMM surrogate on the stacked floating operands; the primitive's seed and
        whether it perturbed anything wait in the context for :meth:`finish`."""
        seed = ctx.next_seed(self.salt)
        eta = ctx.fmt.unit_roundoff
        surrogate = False
        new_args = list(args)
        for i, a in enumerate(args):
            if isinstance(a, Stacked) and a.samples.is_floating_point():
                p, cnt = _perturb(a.samples, eta, randbits.derive_seed(seed, 1 + i), ctx)
                surrogate |= cnt > 0
                if p is not a.samples:
                    new_args[i] = Stacked(p)
        ctx._gemm = (seed, surrogate)
        return tuple(new_args)

    def lookup(self, ctx: AtenContext, raw: list, args: tuple, kwargs: dict) -> Any:
        out = native.lookup_bf16(self.op, args[0].samples)
        if out is None:
            out, self.lifted = _run_batched(self.op, self.info, args, kwargs, ctx.n_samples, ctx)
        return self.finish(ctx, [out], args, kwargs)

    def finish(self, ctx: AtenContext, flat: list, args: tuple, kwargs: dict) -> Any:
        """Round every floating output (the first measured and recorded), count, record."""
        info, op, n = self.info, self.op, ctx.n_samples
        kind = info.kind
        lifted = self.lifted
        if self.info.gemm and ctx._gemm is not None:  # from perturb, just before
            (seed, surrogate), ctx._gemm = ctx._gemm, None
        else:
            seed, surrogate = ctx.next_seed(self.salt), False
        counting, detailed = _counting(ctx)
        fast = self.fast
        if fast and not (counting and fast[1]):
            done = self._round_prepared(ctx, fast, flat[0], args, seed, counting)
            if done is not None:
                first, st = done
                return self._conclude(ctx, first, first, st, args, kwargs, False, True,
                                      ctx.recorder is not None, surrogate, counting, detailed)
        exact = info.exact
        if exact and kind in _COMPLEX_ARITHMETIC and type(args[0]) is Stacked and \
                args[0].samples.is_complex():
            exact = False  # |z|, z / |z|: arithmetic on the parts
        elif exact and kind == "round" and kwargs.get("decimals"):
            exact = False  # round(x * 10**d) / 10**d: not a value of the format in general
        do_round = (lifted or ctx.round_per_sample) and not exact
        want_record = ctx.recorder is not None and (
            not exact or ctx.record_exact or _writes_nonfinite(kind, args, kwargs))
        # Per-element digits now, in the rounding pass, when a counter will read them: a
        # cancellation needs a format with more digits than cancel_digits; the zero masks of
        # the other counters are measured later, only for values whose statistics count zeros.
        need_digits, need_zeros = self.need_digits, self.need_zeros
        digits_if_counting = ctx.cap > ctx.cancel_digits and (
            need_digits is not False or kind in OUTPUT_DIGITS_KINDS)
        zeros_if_counting = (need_digits if need_zeros is None else need_zeros) is not False
        want_digits = counting and digits_if_counting
        want_zeros = counting and zeros_if_counting
        if fast is None and self.reused:
            # a step of a sampled graph, run again on every call: the usual one-output
            # rounding gets the prepared kernel (the same bits, one C call with one argument)
            v = flat[0]
            self.fast = False
            if self.spec is None and do_round and want_record and not ctx.eft and \
                    isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() and \
                    v.shape[0] == n and v[0].numel() and ctx.native_for(v):
                # in place where the output is memory of its own: the graph's structure
                # decides that (a view, an operand), the same on every call
                self.fast = (native.Prepared(ctx.rounder(v.dtype, True), _owned(v, args)),
                             digits_if_counting, zeros_if_counting, tuple(v.shape[1:]))
        outs = []
        first = None
        first_stats = None
        j = 0
        for v in flat:
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n:
                is_first = first is None
                if v.is_complex() and do_round:
                    # real and imaginary parts round (and are measured) as two real values
                    # each, as at the operator level
                    seed_j = ctx.rounding_seed(seed, j)
                    j += 1
                    v, st = _round_complex(v, ctx, seed_j,
                                           is_first and (want_record or counting),
                                           _owned(v, args))
                    st_v = Stacked(v)
                    if is_first:
                        first_stats = st
                elif v.is_floating_point() and do_round:
                    seed_j = ctx.rounding_seed(seed, j)
                    j += 1
                    if ctx.eft:
                        v = _round_fp64(kind, op, args, kwargs, v, seed_j, ctx)
                        seed_j = None  # rounded: measure only
                    if is_first:
                        v, st, an = _round_measure(v, ctx, seed_j, want_record or counting,
                                                   want_digits, want_zeros and not want_digits,
                                                   _owned(v, args))
                    else:
                        v, st, an = _round_measure(v, ctx, seed_j, False, False, False,
                                                   _owned(v, args))
                    st_v = Stacked(v, an)
                    if is_first:
                        first_stats = st
                else:
                    an = None
                    if info.layout and lifted and v.is_floating_point() and \
                            isinstance(args[0], Stacked):
                        an = _digits_through(info, op, args, kwargs, v, ctx)
                    st_v = Stacked(v, an)
                if is_first:
                    first = st_v
                outs.append(st_v)
            else:
                outs.append(v)
        result = outs[0] if self.spec is None else pytree.tree_unflatten(outs, self.spec)
        want_record = want_record and first is not None and (first.samples.is_floating_point()
                                                             or first.samples.is_complex())
        return self._conclude(ctx, result, first, first_stats, args, kwargs, exact, do_round,
                              want_record, surrogate, counting, detailed)

    def _round_prepared(self, ctx: AtenContext, fast: tuple, v: torch.Tensor, args: tuple,
                        seed: int, counting: bool) -> Optional[tuple]:
        """:meth:`finish`'s rounding of the one output through the prepared kernel: (its
        samples, the statistics); None for a layout it does not read (the general path then
        runs)."""
        prepared, _digits, zeros_if_counting, shape = fast
        z = None
        if counting and zeros_if_counting:
            z = native.empty(shape, torch.bool)  # the trace's shape: the graph's signature
            prepared._p.zmask = z.data_ptr()
        else:
            prepared._p.zmask = 0
        out = prepared(v, ctx.rounding_seed(seed, 0))
        if out is None:
            return None
        st = prepared.stats[:]
        return Stacked(out, _Analysis(out, ctx, stats=st, zero=z)), st

    def _conclude(self, ctx: AtenContext, result: Any, first: Optional[Stacked],
                  first_stats: Optional[list], args: tuple, kwargs: dict, exact: bool,
                  do_round: bool, want_record: bool, surrogate: bool, counting: bool,
                  detailed: bool) -> Any:
        """The counters and the record of :meth:`finish`."""
        info, op, n = self.info, self.op, ctx.n_samples
        kind = info.kind
        rec_name = self.name or ctx.name_for(op) if (want_record or counting) else None
        if counting:
            diff = None
            if kind in _SELECT2 or kind in ("clamp", "clamp_min", "clamp_max"):
                diff = _limit_diff(kind, args, kwargs, ctx)
            out_numel = first.samples.numel() // n if first is not None else 0
            found = _compute_counters(kind, args, kwargs, first, out_numel, ctx, diff)
            counts = _count(kind, found, out_numel, first, ctx, rec_name, op, detailed, None) \
                if found else _no_counts(ctx)
        else:
            counts = empty_counters()
            ctx._last_events = []
        if want_record:
            lifted = self.lifted
            stats = _record_stats(first, first_stats, ctx)
            status = (PER_SAMPLE if not lifted else ROUNDED) if do_round else \
                (UNLIFTED if not lifted else OBSERVED)
            ctx.recorder(PrimitiveRecord(rec_name, info.text, kind, stats, counts, surrogate,
                                         status, tuple(first.shape), list(ctx._last_events),
                                         n, ctx._t, ctx.cap))
        return result


def _counting(ctx: AtenContext) -> tuple[bool, bool]:
    """(whether counters run, whether they keep per-event records): the context's
    diagnostics, or an open :func:`fxstab.records.counters.instability_counters` block."""
    collectors = active_collectors()
    counting = ctx.diagnostics != "off" or bool(collectors)
    detailed = counting and (ctx.diagnostics == "detailed" or bool(collectors) and any(
        c.diagnostics == "detailed" for c in collectors))
    return counting, detailed


# Exact primitives that write a value of their own: filled with an infinity (an attention mask's
# -inf), they are recorded (observed, not rounded), so the graph sees where the infinities come
# from and their consumers (the softmax's x - max) are not taken for where NaN/inf appear.
_WRITING_KINDS = frozenset({"masked_fill", "fill", "full", "full_like", "new_full", "where",
                            "index_put", "index_fill", "scatter", "masked_scatter"})


def _writes_nonfinite(kind: str, args: tuple, kwargs: dict) -> bool:
    if kind not in _WRITING_KINDS:
        return False
    for v in (*args, *kwargs.values()):
        if isinstance(v, float) and not math.isfinite(v):
            return True
        if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point() \
                and not bool(torch.isfinite(v)):
            return True
    return False


def _limit_diff(kind: str, args: tuple, kwargs: dict, ctx: AtenContext) -> Optional[_Analysis]:
    """Analysis of the compared difference of max/min/clamp (computational zero: branching)."""
    if kind in _SELECT2:
        return _diff_analysis(args[0], args[1], ctx, _logical_ndim(args[:2]))
    lo = args[1] if len(args) > 1 else kwargs.get("min")
    hi = args[2] if len(args) > 2 else kwargs.get("max")
    if kind == "clamp_max":
        lo, hi = None, lo
    diffs = [d for d in (_diff_analysis(args[0], lim, ctx, args[0].ndim)
                         for lim in (lo, hi) if lim is not None) if d is not None]
    if len(diffs) < 2:
        return diffs[0] if diffs else None
    a, b = diffs
    z = a.zero | b.zero
    both = _Analysis(a._s, ctx, digits=torch.minimum(a.digits, b.digits))
    both._zero = z
    return both


def _round_complex(v: torch.Tensor, ctx: AtenContext, seed: Optional[int], want_stats: bool,
                   own: bool):
    """Round complex samples ``v`` (unless ``seed`` is None: measure only) part by part: their
    real view ``[N, ..., 2]`` is rounded and measured like real samples (statistics over
    2 x numel values: the digits of each part). Returns (complex samples, stats or None)."""
    r = torch.view_as_real(v.resolve_conj().resolve_neg())
    own = own and r.is_contiguous() and not v.is_conj() and not v.is_neg()
    r = r.contiguous()
    if seed is not None and ctx.eft:  # the fp64 format: one shared random side per part
        r = _round_fp64("complex", None, (), {}, r, seed, ctx)
        seed = None
    out, st, _ = _round_measure(r, ctx, seed, want_stats, False, False, own)
    return torch.view_as_complex(out.contiguous()), st


def observe(value: Any, op: Any, ctx: AtenContext, name: Optional[str] = None) -> bool:
    """Record the first floating (or complex) tensor of ``value`` as observed: measured, not
    rounded (an exact primitive or a random draw that a driver was asked to report; a plain
    tensor is N identical samples). Returns whether a record was made."""
    if ctx.recorder is None:
        return False
    is_s = lambda v: isinstance(v, Stacked)  # noqa: E731
    for v in pytree.tree_leaves(value, is_leaf=is_s):
        if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()):
            v = ctx.stack(v)
        if not is_s(v) or not (v.samples.is_floating_point() or v.samples.is_complex()):
            continue
        ctx.recorder(PrimitiveRecord(name or ctx.name_for(op), str(op), primitive_kind(op),
                                     _record_stats(v, None, ctx), empty_counters(), False,
                                     OBSERVED, tuple(v.shape), [], ctx.n_samples, ctx._t,
                                     ctx.cap))
        return True
    return False


def _record_stats(first: Stacked, st: Optional[list], ctx: AtenContext) -> list:
    """The statistics list of a recorded output (measured now if its rounding did not)."""
    if st is None and first.samples.is_complex():  # observed complex values: their parts
        _, st = _round_complex(first.samples, ctx, None, True, False)
    if st is None:  # not rounded here (exact, observed, unlifted): measure only
        _, st, an = _round_measure(first.samples, ctx, None, True, first._an is None)
        if first._an is None:
            first._an = an
    return st


def _no_counts(ctx: AtenContext) -> dict:
    ctx._last_events = []
    return empty_counters()


def _count(kind, found, out_numel, out, ctx, rec_name, op, detailed, diff) -> dict:
    """Count each (key, mask) of ``found`` over the output; a mask given as an operand's
    :class:`_Analysis` is that operand's zero mask, counted by its statistics (no pass)."""
    counts = empty_counters()
    ctx._last_events = []
    if not found:
        return counts
    masks = [m for _, m in found if type(m) is not _Analysis]
    if len(masks) == 1:
        counted = [int(_bcount(masks[0], out_numel))]
    elif masks:
        counted = torch.stack([_bcount(m, out_numel) for m in masks]).tolist()
    counted = iter(counted if masks else ())
    for key, mask in found:
        v = int(mask.zeros) if type(mask) is _Analysis else int(next(counted))
        if v <= 0:
            continue
        counts[key] += v
        ev = None
        if detailed:
            if type(mask) is _Analysis:
                mask = mask.zero
            ev = _event(key, mask, v, out, ctx, rec_name, op, diff)
            ctx._last_events.append(ev)
        ctx.counters.add(key, v, ev)
        for c in active_collectors():
            c.add(key, v, ev)
    return counts


def _event(key, mask, count, out, ctx, rec_name, op, diff) -> CounterEvent:
    an = out.analysis(ctx) if out is not None and out.samples.is_floating_point() else diff
    if an is not None:
        shape = torch.broadcast_shapes(mask.shape, an.digits.shape)
        d = torch.where(mask.expand(shape), an.digits.expand(shape), math.inf).reshape(-1)
        idx = int(torch.argmin(d)) if d.numel() else 0
        digits = float(d[idx]) if d.numel() else 0.0
    else:
        m = mask.reshape(-1)
        idx = int(torch.nonzero(m)[0]) if m.any() else 0
        digits = 0.0
    value = math.nan
    if out is not None and out.samples.is_floating_point():
        flat = out.samples.reshape(out.samples.shape[0], -1)
        if idx < flat.shape[1]:
            value = float(flat[:, idx].mean())
    return CounterEvent(key, str(op), rec_name or "", count, idx, value, digits)


def to_op_report(record: PrimitiveRecord, ctx: AtenContext, *, module_path: str = "",
                 **fields) -> OpReport:
    """An :class:`~fxstab.records.report.OpReport` for one primitive record (``fields``: the other
    report fields: phase, step, call, inputs...)."""
    rep = OpReport(
        name=record.name if not module_path else f"{module_path}/{record.name}",
        kind=record.kind, module_path=module_path, format=ctx.fmt.name,
        n_samples=ctx.n_samples, surrogate=record.surrogate, status=record.status,
        shape=record.shape, counters=dict(record.counters), **fields)
    if record.values is not None:  # the digit fields, as the backends set them
        rep = OpReport.from_stats(rep.fixed(), rep.phase, rep.step, rep.call, rep.surrogate,
                                  rep.counters, record.values, ctx.n_samples, ctx._t, ctx.cap)
    return rep
