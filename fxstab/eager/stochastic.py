"""Stochastic values in eager PyTorch code: CADNA's ``float_st`` for tensors (docs/design.md §3, §5).

``fxstab.stochastic(x, format="fp32")`` returns a :class:`StochasticTensor`, a wrapper tensor
subclass that holds N stacked samples and runs every aten primitive it meets through the
arithmetic-level rules of :mod:`fxstab.rules.aten` (rounding into the format, digits, CADNA's
counters). Composite operators (softmax, layer_norm, batch_norm, gelu, silu, logsumexp, var...)
are decomposed into primitives first, so the digits and counters are those of the arithmetic.

Mixing with plain tensors and Python numbers works: they are exact data (identical samples).
When Python needs a number or a bool the CESTAC semantics apply: ``float(x)`` is the sample
mean; ``x == y`` is true when ``x - y`` is an exact or computational zero; ``<``, ``>``, ``<=``,
``>=`` are decided on the mean difference, a computational-zero difference counting as unstable
branching. Data-dependent loops (Newton iterations, sums run until they stop changing) therefore
stop where CADNA's do.

Approximations (see docs/arithmetic-level.md): every primitive is computed in the working dtype
(:func:`fxstab.numerics.formats.working_dtype_for`, fp64 for fp32/tf32) and the result is rounded into the
format; for an fp32 format that reproduces random-rounded fp32 arithmetic for the basic
operations (the fp64 result of +, -, *, / of fp32 values rounds to the same fp32 neighbours as the
exact result, since 53 >= 2*24+2) and to within fp64 accuracy for library functions. For the fp64
format the working dtype is fp64 itself: results are already rounded to nearest and the random
rounding cannot see the exact result's side, so fp64 digits are optimistic by up to one half unit
per operation. Views are copies: an in-place update of a view does not reach its base.

Other value types join the analysis by registering a :class:`ValueType` here
(:func:`register_value_type`, as JAX's ``register_vmappable``): NumPy arrays do, from
:mod:`fxstab.eager.arrays`, so this module never imports them. The composite operators decomposed
before the rules run are :func:`fxstab.rules.aten.decompositions`'s (``core=False``: the
operators this driver meets stay as the program dispatches them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ..rules.aten import (
    AtenContext, PrimitiveRecord, Stacked, apply_primitive, decompositions, op_info, to_op_report,
)
from ..records.counters import Counters, active_collectors, instability_counters
from ..numerics.digits import format_stochastic
from ..numerics.formats import FormatLike, get_format
from ..numerics.rounding import quantize

aten = torch.ops.aten

__all__ = ["StochasticTensor", "stochastic", "analyze", "AnalysisResult", "instability_counters",
           "ValueType", "register_value_type", "sample_mean", "decide", "index_key", "set_items",
           "assign"]


@functools.lru_cache(maxsize=None)
def _decompositions() -> dict:
    """The arithmetic level's decompositions as the eager driver meets operators
    (:func:`fxstab.rules.aten.decompositions`, ``core=False``), built on first use."""
    return decompositions(core=False)


_CONTEXTS: dict = {}


def _context(format, n_samples, seed, rounding, confidence, diagnostics, kernels) -> AtenContext:
    key = (get_format(format), n_samples, seed, str(rounding), confidence, diagnostics, kernels)
    ctx = _CONTEXTS.get(key)
    if ctx is None:
        ctx = _CONTEXTS[key] = AtenContext.of(
            format=format, n_samples=n_samples, seed=seed, rounding=rounding,
            confidence=confidence, diagnostics=diagnostics, kernels=kernels)
    return ctx


class StochasticTensor(torch.Tensor):
    """A tensor of N synchronous stochastic samples (CESTAC), shaped like one sample.

    Attributes:
        value: The sample mean, a plain tensor of the nominal dtype.
        samples: The samples ``[N, ...]`` in the working dtype.
        digits: Per-element CESTAC digits (plain tensor).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, stacked: Stacked, ctx: AtenContext, dtype: torch.dtype):
        r = torch.Tensor._make_wrapper_subclass(
            cls, tuple(stacked.shape), dtype=dtype, device=stacked.samples.device,
            requires_grad=False)
        r._st = stacked
        r._ctx = ctx
        return r

    # -- user-facing views ----------------------------------------------------------------
    @property
    def samples(self) -> torch.Tensor:
        return self._st.samples

    @property
    def value(self) -> torch.Tensor:
        return sample_mean(self._st.samples).to(self.dtype)

    @property
    def digits(self) -> torch.Tensor:
        return self._st.analysis(self._ctx).digits.clone()

    @property
    def context(self) -> AtenContext:
        return self._ctx

    def _texts(self) -> list:
        an = self._st.analysis(self._ctx)
        means = self._st.samples.double().mean(0).reshape(-1).tolist()
        digs = an.digits.reshape(-1).tolist()
        ez = an.exact_zero.reshape(-1).tolist()
        return [format_stochastic(m, d, e, cap=self._ctx.cap) for m, d, e in zip(means, digs, ez)]

    def __str__(self) -> str:
        if not self._st.samples.is_floating_point():
            return str(self._st.samples[0])
        texts = self._texts()
        if self.dim() == 0:
            return texts[0]
        return str(np.array(texts, dtype=object).reshape(tuple(self.shape))).replace("'", "")

    def __repr__(self) -> str:
        return (f"StochasticTensor({self}, format={self._ctx.fmt.name}, "
                f"n_samples={self._ctx.n_samples})")

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else format(float(self), spec)

    def __setitem__(self, key, v) -> None:
        # torch writes x[1:3] = v into a view, and views of stochastic tensors are copies:
        # the base would not change. One index_put on the flat positions does reach it.
        k = index_key(key)
        self._st = set_items(self, k, v if isinstance(v, torch.Tensor) else
                             torch.tensor(v, dtype=torch.float64))._st

    # -- NumPy's protocols: np.sqrt(x), np.sum(x)... run the same rules -------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError("fxstab: np.asarray/np.array of a stochastic tensor would drop its "
                        "samples; use x.value.numpy() for the sample mean (leaving the "
                        "analysis), or fxstab.stochastic(np_array) to analyse NumPy code")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        for vt in _VALUE_TYPES:  # NumPy arrays' rules (fxstab.eager.arrays registers them)
            if vt.array_ufunc is not None:
                return vt.array_ufunc(ufunc, method, inputs, kwargs)
        return NotImplemented

    def __array_function__(self, func, types, args, kwargs):
        for vt in _VALUE_TYPES:
            if vt.array_function is not None:
                return vt.array_function(func, args, kwargs)
        return NotImplemented

    # -- dispatch -------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        ctx = next(x._ctx for x in leaves if isinstance(x, StochasticTensor))

        if func is aten._local_scalar_dense.default:
            return _scalar(args[0], ctx)
        table = _decompositions()
        if func in table:
            out = table[func](*args, **kwargs)
            if out is not NotImplemented:
                return out
        schema = func._schema
        if schema.is_mutable:
            return _inplace(func, args, kwargs, ctx)

        nominal = _nominal_dtype(leaves, kwargs)

        def unwrap(x):
            return x._st if isinstance(x, StochasticTensor) else x

        uargs, ukw = pytree.tree_map(unwrap, (args, kwargs))
        if op_info(func).pointwise:  # run directly on the samples, never through vmap
            out = apply_primitive(func, tuple(uargs), ukw, ctx)
        else:
            with _functorch_enabled():
                out = apply_primitive(func, tuple(uargs), ukw, ctx)
        return pytree.tree_map(lambda x: _wrap(x, ctx, nominal), out,
                               is_leaf=lambda x: isinstance(x, Stacked))


def sample_mean(s: torch.Tensor) -> torch.Tensor:
    """The sample mean (fp64) of floating samples; where all samples agree, that sample itself
    (a signed zero stays signed, an exact value exact); sample 0 of integer or boolean ones."""
    if not s.is_floating_point():
        return s[0]
    m = s.double().mean(0)
    if s.shape[0] and s.numel():
        m = torch.where((s == s[:1]).all(0), s[0].double(), m)
    return m


_FUNCTORCH_KEYS = tuple(getattr(torch._C.DispatchKey, k) for k in (
    "FuncTorchBatched", "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode",
    "FuncTorchVmapMode") if hasattr(torch._C.DispatchKey, k))


def _functorch_enabled():
    """The dispatch state outside ``__torch_dispatch__`` for the rules' ``torch.vmap``: inside
    the handler torch excludes functorch's keys, so a vmapped primitive reached its CPU kernel
    with batched tensors (``mv``, ``dot``, ``prod``, ``tril``: "Cannot access data pointer";
    ``cumprod``, ``logcumsumexp``: a segmentation fault)."""
    inside = torch._C._dispatch_tls_local_exclude_set()
    key = inside.raw_repr()
    ex = _OUTSIDE.get(key)
    if ex is None:
        ex = inside
        for k in _FUNCTORCH_KEYS:
            ex = ex.remove(k)
        _OUTSIDE[key] = ex
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), ex)


_OUTSIDE: dict = {}  # exclude set inside the handler (raw) -> the same without functorch's


def _wrap(x, ctx, nominal):
    if isinstance(x, Stacked):
        dtype = nominal if x.samples.is_floating_point() else x.samples.dtype
        return StochasticTensor(x, ctx, dtype)
    return x


def _nominal_dtype(leaves, kwargs) -> torch.dtype:
    dt = kwargs.get("dtype")
    if isinstance(dt, torch.dtype) and dt.is_floating_point:
        return dt
    best = None
    for x in leaves:
        if isinstance(x, StochasticTensor) and x.dtype.is_floating_point:
            best = x.dtype if best is None else torch.promote_types(best, x.dtype)
    return best or torch.get_default_dtype()


def _scalar(t: StochasticTensor, ctx: AtenContext):
    """float()/int()/bool() of a stochastic scalar: the mean (floats), the common value (others)."""
    s = t._st.samples.reshape(t._st.samples.shape[0])
    if s.is_floating_point():
        return float(s.double().mean())
    vals = s.tolist()
    if len(set(vals)) > 1:
        # samples disagree on an integer/boolean: CADNA's unstable branching (bool) or intrinsic
        key = "branching" if s.dtype == torch.bool else "intrinsic"
        ctx.counters.add(key, 1)
        for c in active_collectors():
            c.add(key, 1)
        return max(set(vals), key=vals.count)
    return vals[0]


def _functional(func):
    """The functional overload of an in-place primitive (``add_.Tensor`` -> ``add.Tensor``)."""
    name = func.overloadpacket.__name__
    if not name.endswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    ov = getattr(packet, func._overloadname, None) if packet is not None else None
    return ov if ov is not None and not ov._schema.is_mutable else None


def _inplace(func, args, kwargs, ctx):
    """x.add_(y), x.copy_(y), x.zero_()...: run the functional form and store the result."""
    self_ = args[0]
    if func.overloadpacket.__name__ in ("copy_",):
        src = args[1]
        res = src._st if isinstance(src, StochasticTensor) else ctx.stack(torch.as_tensor(src))
        res = Stacked(res.samples.expand(ctx.n_samples, *self_.shape).contiguous())
    else:
        fn = _functional(func)
        if fn is None or "out" in kwargs:
            raise NotImplementedError(
                f"fxstab.stochastic: in-place/out= primitive {func} has no functional form "
                f"fxstab knows; rewrite the code without it")
        out = StochasticTensor.__torch_dispatch__(fn, (), args, kwargs)
        res = out._st if isinstance(out, StochasticTensor) else ctx.stack(out)
    if isinstance(self_, StochasticTensor):
        if res.samples.is_floating_point() != self_._st.samples.is_floating_point():
            res = Stacked(res.samples.to(self_._st.samples.dtype))
        self_._st = res
        return self_
    # a plain tensor updated from stochastic values keeps their mean (e.g. BatchNorm's running
    # statistics): it cannot hold samples
    with torch._C._DisableTorchDispatch():
        mean = res.samples.double().mean(0) if res.samples.is_floating_point() else res.samples[0]
        self_.copy_(mean.to(self_.dtype))
    return self_


def assign(t: StochasticTensor, value: StochasticTensor) -> StochasticTensor:
    """``t[...] = value`` for a stochastic tensor of the same shape: ``t`` takes ``value``'s
    samples (and analysis) in place and is returned."""
    t._st = value._st
    return t


def decide(t: StochasticTensor, *, index: bool = False) -> Any:
    """Integer/boolean samples as one plain NumPy array: the majority per element. Samples that
    disagree are CADNA's unstable branching (booleans, and indices: ``index``) or unstable
    intrinsic (other integers), counted as ``int()``/``bool()`` of a stochastic scalar counts."""
    s = t._st.samples
    n = s.shape[0]
    flat = s.reshape(n, -1)
    # the most frequent sample value (ties: the smallest); torch.mode has no bool kernel
    mode = torch.mode(flat.to(torch.int64), dim=0).values.to(s.dtype) if flat.shape[1] \
        else flat[0]
    differ = int((flat != flat[:1]).any(0).sum()) if flat.shape[1] else 0
    if differ:
        key = "branching" if s.dtype == torch.bool or index else "intrinsic"
        t._ctx.counters.add(key, differ)
        for c in active_collectors():
            c.add(key, differ)
    a = mode.reshape(s.shape[1:]).numpy()
    return a[()] if a.ndim == 0 else a


def index_key(key: Any) -> Any:
    """An index for a stochastic tensor: plain arrays as tensors, stochastic indices (tensors or
    registered value types) decided (:func:`decide`, disagreement counted as branching)."""
    if isinstance(key, tuple):
        return tuple(index_key(k) for k in key)
    for vt in _VALUE_TYPES:
        if isinstance(key, vt.cls):
            key = vt.tensor(key)
            break
    if isinstance(key, StochasticTensor):
        if key._st.samples.is_floating_point():
            raise IndexError("only integers, slices, ellipsis, None and integer or boolean "
                             "arrays are valid indices (got a floating stochastic value)")
        return torch.as_tensor(decide(key, index=True))
    if isinstance(key, (np.ndarray, list)):
        return torch.as_tensor(np.asarray(key))
    if isinstance(key, np.generic):
        return key.item()
    return key


def set_items(t: StochasticTensor, key: Any, v: Any) -> StochasticTensor:
    """``t[key] = v`` without views (``key`` from :func:`index_key`): the selected elements'
    flat positions are found on an index tensor, then one ``index_put`` (exact) writes them;
    returns the updated tensor."""
    pos = torch.arange(t.numel()).reshape(t.shape)[key]
    flat = t.reshape(-1)
    vals = v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64)
    if t.is_floating_point() and not vals.is_floating_point():
        vals = vals.to(torch.float64)  # integers written into floats (NumPy casts them)
    vals = vals.expand(pos.shape) if vals.shape != pos.shape else vals
    out = flat.index_put((pos.reshape(-1),), vals.reshape(-1))
    return out.reshape(t.shape)


# --------------------------------------------------------------------------- value types
@dataclass(frozen=True)
class ValueType:
    """A value type that joins the eager analysis beside :class:`StochasticTensor` (as JAX's
    ``register_vmappable``): this module never imports it; it registers itself here.

    Attributes:
        cls: The type of its stochastic values (returned as they are by :func:`stochastic`,
            read by :class:`AnalysisResult` through their ``value``, ``samples`` and
            ``digits``).
        inputs: The plain types :func:`stochastic` lifts into ``cls`` values.
        lift: ``(plain value, context) -> cls value``.
        tensor: ``cls value -> the StochasticTensor holding its samples``.
        array_ufunc: ``(ufunc, method, inputs, kwargs)``: NumPy's ufuncs on stochastic tensors
            (``np.sqrt(t)``), or None.
        array_function: ``(func, args, kwargs)``: NumPy's array functions on stochastic
            tensors (``np.sum(t)``), or None.
    """

    cls: type
    inputs: tuple
    lift: Callable[[Any, AtenContext], Any]
    tensor: Callable[[Any], StochasticTensor]
    array_ufunc: Optional[Callable] = None
    array_function: Optional[Callable] = None


_VALUE_TYPES: list[ValueType] = []


def register_value_type(value_type: ValueType) -> None:
    """Let ``value_type`` join the analysis (:class:`ValueType`); registering a class again
    replaces its entry."""
    if not isinstance(value_type, ValueType):
        raise TypeError(f"register_value_type takes a ValueType, got "
                        f"{type(value_type).__name__}")
    _VALUE_TYPES[:] = [vt for vt in _VALUE_TYPES if vt.cls is not value_type.cls]
    _VALUE_TYPES.append(value_type)


# --------------------------------------------------------------------------- entry points
def stochastic(
    x: Any,
    format: FormatLike = "fp32",
    n_samples: int = 3,
    seed: int = 0,
    rounding: str = "random",
    *,
    confidence: float = 0.95,
    diagnostics: str = "summary",
    kernels: str = "auto",
    context: Optional[AtenContext] = None,
) -> "StochasticTensor | StochasticArray":
    """A stochastic value (CADNA's ``float_st``) for a tensor, NumPy array or Python number.

    The input is rounded to nearest into the format (as assigning a double to a ``float_st``
    does) and enters as N identical samples; every operation on it then rounds randomly.

    A NumPy array or NumPy scalar gives a :class:`~fxstab.eager.arrays.StochasticArray`
    (NumPy functions run on it, and its ``value``, ``samples`` and ``digits`` are NumPy);
    a tensor, a Python number or a list gives a :class:`StochasticTensor`.

    Args:
        x: Floating tensor, NumPy array or scalar, Python number (integer arrays and lists are
            converted to float64).
        format: Simulated format (``"fp32"``, ``"bf16"``, a pair...).
        n_samples: N >= 2.
        seed: Base seed. Values created with the same settings share one context (so their
            operations draw distinct rounding bits).
        rounding: Rounding mode of every result (``random``: CESTAC).
        confidence: Student-t confidence of the digits.
        diagnostics: Counters: ``off`` | ``summary`` | ``detailed``.
        kernels: ``auto`` (the fused CPU kernels of :mod:`fxstab.cpu.bindings` where they run) or
            ``torch`` (the plain-torch references; the same rounded bits, slower).
        context: An explicit :class:`~fxstab.rules.aten.AtenContext` (overrides the settings).
    """
    ctx = context or _context(format, n_samples, seed, rounding, confidence, diagnostics, kernels)
    if isinstance(x, StochasticTensor):
        return x
    for vt in _VALUE_TYPES:  # registered value types (NumPy arrays: fxstab.eager.arrays)
        if isinstance(x, vt.cls):
            return x
        if isinstance(x, vt.inputs):
            return vt.lift(x, ctx)
    if isinstance(x, torch.Tensor):
        t = x.detach()
    elif isinstance(x, (list, tuple)):
        t = torch.as_tensor(np.asarray(x))
        if not t.is_floating_point():
            t = t.to(torch.float64)
    elif isinstance(x, (float, int)) and not isinstance(x, bool):
        t = torch.tensor(float(x), dtype=torch.float64 if ctx.fmt.name == "fp64" else torch.float32)
    else:
        raise ValueError(f"fxstab.stochastic takes a tensor, NumPy array or number, got "
                         f"{type(x).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"fxstab.stochastic needs floating values, got dtype {t.dtype}; convert "
                         f"with .double() or .float() first")
    nominal = t.dtype
    w = _nearest(t, ctx)
    return StochasticTensor(ctx.stack(w), ctx, nominal)


_HARDWARE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
             "fp64": torch.float64}


def _nearest(t: torch.Tensor, ctx: AtenContext) -> torch.Tensor:
    """Round-to-nearest into the format, in the working dtype: a hardware cast where the format
    is a torch dtype (IEEE, same as ml_dtypes), else :func:`fxstab.numerics.rounding.quantize`."""
    hw = _HARDWARE.get(ctx.fmt.name)
    if hw is not None and ctx.fmt == get_format(hw):
        return t.to(hw).to(ctx.working_dtype)
    return quantize(t.to(ctx.working_dtype), ctx.fmt, "nearest")


class AnalysisResult:
    """What :func:`analyze` returns.

    Each of ``value``, ``samples`` and ``digits`` has the structure of the function's output
    (a value, a tuple, a dict...): tensors for stochastic tensors, ``np.ndarray`` (NumPy
    scalars for 0-d values) for stochastic arrays, that is for NumPy programs. An output leaf that is not stochastic (an integer tensor, a
    constant, a plain boolean decision of a CESTAC comparison) carries no samples: its
    ``value`` is the leaf itself and its ``samples`` and ``digits`` are ``None``.

    Attributes:
        value: Output(s) with each stochastic tensor replaced by its mean.
        samples: Output(s) as stacked samples ``[N, ...]`` (``None`` where not stochastic).
        digits: Output(s) as per-element digits (``None`` where not stochastic).
        counters: CADNA's counters over the whole call (dict with ``COUNTER_KEYS``).
        events: Per-event records (``diagnostics="detailed"``).
        reports: One :class:`~fxstab.records.report.OpReport` per recorded primitive, in call order.
        output: The raw output (stochastic tensors).
    """

    def __init__(self, output, counters: Counters, reports: list):
        self.output = output
        stochastic_types = (StochasticTensor,) + tuple(vt.cls for vt in _VALUE_TYPES)

        def pick(f, plain):
            return pytree.tree_map(
                lambda x: f(x) if isinstance(x, stochastic_types) else plain(x), output)
        self.value = pick(lambda t: t.value, lambda x: x)
        self.samples = pick(lambda t: t.samples, lambda x: None)
        self.digits = pick(lambda t: t.digits, lambda x: None)
        self.counters = dict(counters.counts)
        self.events = list(counters.events)
        self.reports = reports

    def table(self, worst: int = 20) -> str:
        """The recorded primitives, fewest min digits first."""
        rows = sorted(self.reports, key=lambda r: r.min_digits)[:worst]
        lines = [f"{'primitive':<28} {'avg':>6} {'min':>6}  counters"]
        for r in rows:
            cs = ", ".join(f"{k}={v}" for k, v in r.counters.items() if v)
            lines.append(f"{r.name:<28} {r.avg_digits:6.2f} {r.min_digits:6.2f}  {cs}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"AnalysisResult(value={self.value!r}, counters={self.counters})"


def analyze(fn: Callable, *, format: FormatLike = "fp32", n_samples: int = 3, seed: int = 0,
            rounding: str = "random", confidence: float = 0.95, diagnostics: str = "summary",
            kernels: str = "auto", cancel_digits: float = 4.0) -> Callable[..., AnalysisResult]:
    """Analyse a plain function of tensors, NumPy arrays or Python floats at the arithmetic level.

    ``fxstab.analyze(f, format="fp32")(x, y)`` turns every floating argument into a stochastic
    value, runs ``f`` once (eager driver), and returns an :class:`AnalysisResult`. Each call uses
    a fresh context, so the same call with the same seed gives the same samples.

    Floating tensors become :class:`StochasticTensor`; floating NumPy arrays and scalars become
    :class:`~fxstab.eager.arrays.StochasticArray` (NumPy functions run on them; results come
    back as NumPy). Python floats join the NumPy side when any argument is NumPy (as float64
    scalars: a NumPy program), else the torch side. Integer arguments are not lifted.
    """
    def run(*args, **kwargs) -> AnalysisResult:
        records: list[PrimitiveRecord] = []
        ctx = AtenContext.of(format=format, n_samples=n_samples, seed=seed, rounding=rounding,
                             confidence=confidence, diagnostics=diagnostics,
                             cancel_digits=cancel_digits, kernels=kernels,
                             recorder=records.append)

        numpy_call = any(isinstance(a, (np.ndarray, np.generic))
                         for a in pytree.tree_leaves((args, kwargs)))

        def lift(a):
            if isinstance(a, (np.ndarray, np.generic)):  # first: np.float64 is a float
                floating = np.issubdtype(a.dtype, np.floating)
                return stochastic(a, context=ctx) if floating else a
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                return stochastic(a, context=ctx)
            if isinstance(a, float):
                return stochastic(np.float64(a) if numpy_call else a, context=ctx)
            return a

        largs, lkw = pytree.tree_map(lift, (args, kwargs))
        with instability_counters(diagnostics if diagnostics != "off" else "summary") as c:
            out = fn(*largs, **lkw)
        reports = [to_op_report(r, ctx, call=i) for i, r in enumerate(records)]
        return AnalysisResult(out, c if diagnostics != "off" else Counters("summary"), reports)

    return run
