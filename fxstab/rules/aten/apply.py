"""The rule: :func:`apply_primitive` runs one aten primitive on stacked samples and applies
every rule of the arithmetic level to it (the package docstring, :mod:`fxstab.rules.aten`,
states them); :func:`observe` records a value without rounding it; :func:`to_op_report` turns a
record into the report the backends write.

What happens to a primitive is its row's (:data:`fxstab.rules.aten.primitives.PRIMITIVES`):
:func:`apply_primitive` looks the row up and runs the function of its path (:data:`_PATHS`:
a decision, a comparison, a GEMM, the general path with the fused binary kernel or the bf16
lookup tables); the row's fields decide the rest (exact or not, counters, what is recorded).
What :func:`apply_primitive` decides from types and shapes (stacked or plain operands, the
batching, the dtype of plain operands) runs at once; what reads values (the comparison, the
GEMM surrogate, the bf16 lookup tables, the rounding, the counters, the record) is held by a
:class:`_Rule` and runs through :meth:`AtenContext.emit <fxstab.rules.aten.context.AtenContext.emit>`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.utils import _pytree as pytree

from ... import executors
from ...capture.torchao import float8_format
from ...cpu.bindings import LOOKUP_OPS
from ...numerics import randbits
from ...numerics.rounding import round_samples
from ...records.report import OBSERVED, PER_SAMPLE, ROUNDED, UNLIFTED, OpReport, empty_counters
from .batching import (
    PASS_THROUGH, aligned, has_stacked, logical_ndim, owned, run_batched, scan_args,
)
from .context import AtenContext, PrimitiveRecord
from .counters import (
    compute_counters, count_found, counting_mode, diff_analysis, differs, no_counts,
)
from .kinds import OpInfo, op_info, primitive_kind
from .lowp import lowp_operands, lowp_product
from .primitives import BINARY, COMPARE, DECIDE, GEMM, ARITHMETIC, PrimitiveRule, primitive
from .rounding import perturb_operand, round_complex, round_fp64, round_measure
from ..lifting import Stacked, decided_on_mean
from .measure import Analysis

__all__ = ["apply_primitive", "observe", "to_op_report"]

_NO_KWARGS: dict = {}


def _compare_identical(rule: PrimitiveRule, args: tuple) -> torch.Tensor:
    """A comparison whose stacked operands are identical samples (data entering the analysis,
    a buffer: a causal mask's ``bias == 0``): their difference has no noise (no computational
    zero, no branching to count), so CESTAC's rule (the relation's ``cestac``) is the sign of
    the difference of one sample, without a step (torch operators only)."""
    x, y = (v[0] if type(a) is Stacked else v
            for a, v in zip(args, aligned(args, logical_ndim(args))))
    d = torch.sub(x, y) if isinstance(x, torch.Tensor) else torch.rsub(y, x)
    return rule.relation.exact(d)


def _fix_dtype_kwargs(kwargs: dict, ctx: AtenContext) -> dict:
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


def _working_args(args: tuple, ctx: AtenContext) -> tuple:
    """Plain floating tensors (and float dtype arguments) in the working dtype; the tuple itself
    when nothing changes (the common case: no copy, no pytree walk)."""
    wd = ctx.working_dtype
    new = None
    for i, a in enumerate(args):
        if type(a) in PASS_THROUGH:  # samples are in the working dtype already
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
                    ctx: AtenContext) -> Optional[Analysis]:
    """The analysis of a layout primitive's output from its operand's, if already measured:
    its per-element digits and zero mask follow the same rearrangement, its statistics hold."""
    src = args[0].measured
    if src is None or (src.measured_digits is None and src.measured_zero is None) or \
            len(args) and has_stacked(args[1:], kwargs):
        return None
    moved = []
    for t in (src.measured_digits, src.measured_zero):
        if t is not None and not info.rule.identity:
            try:
                t = (info.plain or op)(t, *args[1:], **kwargs)
            except Exception:  # noqa: BLE001 - e.g. a view the digits' strides do not allow
                return None
            if not isinstance(t, torch.Tensor) or t.shape != out.shape[1:]:
                return None
        moved.append(t)
    an = Analysis(out, ctx, digits=moved[0], non_finite=0 if src.non_finite == 0 else None,
                   zero=moved[1])
    if src.zeros == 0:  # a rearrangement keeps no-zeros (views and copies, never reductions)
        an.zeros = 0
    return an


def apply_primitive(op: Any, args: tuple, kwargs: Optional[dict], ctx: AtenContext, *,
                    name: Optional[str] = None, salt: Optional[int] = None,
                    need_digits: Optional[bool] = None,
                    need_zeros: Optional[bool] = None, rounds: bool = True) -> Any:
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
        rounds: False: the output is measured, not rounded, and a GEMM's operands are not
            perturbed (``unrounded=``: an ablation, :func:`fxstab.operator_impact`).

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
    n = ctx.n_samples
    stacked, identical, other = scan_args(args)
    if kwargs and not stacked:
        stacked = has_stacked((), kwargs)
    if stacked and info.inplace and args and isinstance(args[0], torch.Tensor):
        # x += f(samples) into a plain tensor (a T5-style relative position bias): the target
        # becomes N copies of itself that the primitive updates, and the result carries samples
        t = _to_working(args[0], ctx)
        args = (Stacked(t.unsqueeze(0).expand(n, *t.shape).clone()),) + tuple(args[1:])
        identical = False
    from_plain = not stacked
    out = None
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
    given_args = args  # (the plain operands as the program holds them: lowp.lowp_operands)
    if other:
        args = _working_args(args, ctx)
    # a cast into float8 (torchao's float8 recipes): a rounding into that format, whatever the
    # analysis's (the samples stay in the working dtype)
    float8 = float8_format(kwargs.get("dtype")) if info.rule.casts and stacked and \
        type(args[0]) is Stacked and args[0].samples.is_floating_point() else None
    if kwargs:
        kwargs = _fix_dtype_kwargs(kwargs, ctx)
    rule = _Rule(op, info, name, salt, need_digits, need_zeros, ctx.stepper is not None)
    rule.rounds = rounds
    rule.float8 = float8
    return _PATHS.get(info.rule.path, _general)(rule, ctx, args, kwargs,
                                                _Given(identical, from_plain, out, given_args))


class _Given(NamedTuple):
    """What :func:`apply_primitive` found of a call's operands before its path runs: every
    stacked operand identical samples, no operand stacked (and then the plain result)."""

    identical: bool
    from_plain: bool
    out: Any
    original: tuple = ()  # the operands before the plain ones were converted


def _decide(rule: "_Rule", ctx: AtenContext, args: tuple, kwargs: dict, given: _Given) -> Any:
    """Decisions (top-k routing, sort, argmax): once for every sample, on the samples' mean;
    the general path where the call is not one to decide."""
    op, info, name = rule.op, rule.info, rule.name
    if type(args[0]) is Stacked and args[0].samples.is_floating_point() \
            and not any(type(a) is Stacked for a in args[1:]) and not has_stacked((), kwargs):
        decided = decided_on_mean(info.plain or op, info.kind, args[0], tuple(args[1:]), kwargs)
        if decided is not None:
            if counting_mode(ctx)[0]:  # where the samples alone would decide otherwise
                idx = decided[1] if isinstance(decided, tuple) else decided
                ctx.emit("decide", name, _decision_counter(info.plain or op, name), [idx],
                         args, kwargs)
            return decided
    return _general(rule, ctx, args, kwargs, given)


def _compare(rule: "_Rule", ctx: AtenContext, args: tuple, kwargs: dict, given: _Given) -> Any:
    """Comparisons: one plain boolean decision per element (CESTAC), branching on noise; the
    general path where no floating difference is compared."""
    if len(args) >= 2 and differs(args[0], args[1]):
        if given.identical and len(args) == 2 and not kwargs:
            return _compare_identical(rule.info.rule, args)
        return ctx.emit("compare", rule.name, rule.compare, (), args, kwargs)
    return _general(rule, ctx, args, kwargs, given)


def _gemm(rule: "_Rule", ctx: AtenContext, args: tuple, kwargs: dict, given: _Given) -> Any:
    """A GEMM: the surrogate on the stacked operands (a step), then the product on the
    samples; of plain operands only, the general path."""
    if given.from_plain:
        return _general(rule, ctx, args, kwargs, given)
    if rule.rounds:
        args = ctx.emit("perturb", rule.name, rule.perturb, (), args, kwargs)
    low = lowp_operands(rule.op, args, kwargs, given.original, ctx) if rule.float8 is None \
        else None
    if low is not None:  # the format's own GEMM kernels (a bf16 model's weights)
        raw = ctx.emit("gemm", rule.name, lowp_product, (), low, {})
    else:
        raw, rule.lifted = run_batched(rule.op, rule.info, args, kwargs, ctx.n_samples, ctx)
    return _finish(rule, ctx, raw, args, kwargs)


# what _general's fused step returns where it does not apply
_NOT_FUSED = object()


def _general(rule: "_Rule", ctx: AtenContext, args: tuple, kwargs: dict, given: _Given,
             fused: Optional[Callable] = None) -> Any:
    """The general path: the primitive on the samples (from plain operands: their result
    as N identical samples; identical operands: one evaluation for all), else ``fused``
    (a path's kernel that computes the primitive inside its rounding) or batched, then
    rounded, measured, counted and recorded (:meth:`_Rule.finish`)."""
    op, info, n = rule.op, rule.info, ctx.n_samples
    if given.from_plain:
        raw = pytree.tree_map(
            lambda v: _to_working(v, ctx).unsqueeze(0).expand(n, *v.shape)
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
            else v, given.out)
    elif given.identical and not (kwargs and has_stacked((), kwargs)):
        # Every operand is N identical samples (data entering the analysis, or exact
        # operations on it): one evaluation serves all samples; they part at the rounding.
        one = (info.plain or op)(*[a.samples[0] if isinstance(a, Stacked) else a for a in args],
                                 **kwargs)
        raw = one.unsqueeze(0).expand(n, *one.shape) if isinstance(one, torch.Tensor) else \
            pytree.tree_map(lambda v: v.unsqueeze(0).expand(n, *v.shape)
                            if isinstance(v, torch.Tensor) else v, one)
    else:
        if fused is not None:
            done = fused(rule, ctx, args, kwargs)
            if done is not _NOT_FUSED:
                return done
        raw, rule.lifted = run_batched(op, info, args, kwargs, n, ctx)
    return _finish(rule, ctx, raw, args, kwargs)


def _lookup(rule: "_Rule", ctx: AtenContext, args: tuple, kwargs: dict) -> Any:
    """exp, log, ... (a row with ``lookup``) of values in the format: a table of the op's own
    results (unless a value is not one of the format's), then rounded."""
    if rule.rounds and ctx.use_lookup and rule.info.rule.lookup and len(args) == 1 \
            and not kwargs and type(args[0]) is Stacked and args[0].samples.is_contiguous():
        tables = ctx.kernel(executors.ATEN_LOOKUP, args[0].samples)
        if tables.fused:  # (the reference has no tables: the general path runs the op)
            rule.kernel = tables
            return ctx.emit("lookup", rule.name, rule.lookup, (), args, kwargs, rule.op)
    return _NOT_FUSED


def _binary(rule: "_Rule", ctx: AtenContext, args: tuple, kwargs: dict) -> Any:
    """add, sub, mul, div: computed by the kernel inside its rounding (one step, no pass of
    the operator's own), where the kernel chosen for it has that step
    (:data:`fxstab.executors.ATEN_BINARY`)."""
    if not (rule.rounds and rule.info.binary and not kwargs and _fusable(args, ctx)):
        return _NOT_FUSED
    stacked = [a.samples for a in args if type(a) is Stacked]
    make = ctx.kernel(executors.ATEN_BINARY, stacked[0]) if stacked else None
    if make is None:  # the reference rounds: the operator, then its rounding
        return _NOT_FUSED
    rule.kernel = make(ctx, rule.info.binary)
    # whether a stacked operand's rank needs aligning (the same on every call)
    nd = logical_ndim(args) + 1
    rule.realign = any(type(v) is Stacked and v.samples.dim() != nd for v in args)
    return ctx.emit("binary", rule.name, rule.binary, (), args, kwargs,
                    _batched_call(rule.info, args))


def _finish(rule: "_Rule", ctx: AtenContext, raw: Any, args: tuple, kwargs: dict) -> Any:
    """The outputs ``raw`` on the samples rounded, measured, counted and recorded (a step)."""
    info = rule.info
    if info.layout and info.exact and rule.need_digits is False and \
            rule.need_zeros is False and rule.lifted and type(raw) is torch.Tensor and \
            not (ctx.record_exact and ctx.recorder is not None):
        # a view no reader measures through (a graph driver's plan says so): nothing to round,
        # count, record or carry, so no step
        return Stacked(raw)
    return rule.finish_raw(ctx, raw, args, kwargs)


# path -> how apply_primitive runs it (exact, layout, random, symbolic: the general path)
_PATHS: dict[str, Callable] = {
    DECIDE: _decide, COMPARE: _compare, GEMM: _gemm,
    ARITHMETIC: functools.partial(_general, fused=_lookup),
    BINARY: functools.partial(_general, fused=_binary),
}
# the primitives whose bf16 results have lookup tables (executors.ATEN_LOOKUP's, cpu/bindings.py)
primitive(*sorted(LOOKUP_OPS), lookup=True)


def _decision_counter(op: Any, name: Optional[str]) -> Any:
    """A decision's branching count: the elements of its indices that some sample, deciding
    alone, would have chosen otherwise (CADNA's unstable branching)."""
    def run(ctx: AtenContext, raw: list, args: tuple, kwargs: dict) -> None:
        decided, x = raw[0], args[0]
        per = []
        for k in range(x.samples.shape[0]):
            res = op(x.samples[k], *args[1:], **kwargs)
            per.append(res[1] if isinstance(res, tuple) else res)
        differ = (torch.stack(per) != decided.unsqueeze(0)).any(0)
        counting, detailed = counting_mode(ctx)
        count_found(primitive_kind(op), [("branching", differ)], differ.numel(), None, ctx,
                    name or ctx.name_for(op), op, detailed, None)
    return run


# Below this size of output samples, the operator's result stays in the CPU's caches until
# the rounding reads it, and computing it inside the kernel saves nothing (measured: equal at
# 3x32768 fp32 values, 10% faster at 3x65536, 20% at 3x262144; docs/kernels.md)
_BINARY_MIN_BYTES = 1 << 19


def _fusable(args: tuple, ctx: AtenContext) -> bool:
    """Whether :meth:`_Rule.binary` may read these two operands (samples or plain tensors in
    the working dtype on the CPU, or Python numbers) and their output is large enough for it to
    pay (whether a kernel computes it is the registry's choice: :func:`_binary`)."""
    if len(args) != 2 or ctx.eft:
        return False
    wd = ctx.working_dtype
    shapes = []
    for a in args:
        t = type(a)
        if t is Stacked:
            a = a.samples
            shapes.append(a.shape[1:])
        elif t is float or t is int:
            continue
        else:
            shapes.append(getattr(a, "shape", ()))
        if not isinstance(a, torch.Tensor) or a.dtype != wd or not a.is_cpu:
            return False
    try:
        numel = math.prod(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return False
    return numel * ctx.n_samples * wd.itemsize >= _BINARY_MIN_BYTES


def _batched_call(info: OpInfo, args: tuple):
    """The primitive on the tensors a step of :meth:`_Rule.binary` receives (the samples of
    its stacked operands, its plain tensors, in order), as the general path runs it: what a
    benchmark's floor runs instead of the step."""
    stacked = [type(a) is Stacked for a in args if type(a) is Stacked or isinstance(a, torch.Tensor)]

    def call(xs: list) -> torch.Tensor:
        it = iter(zip(xs, stacked))
        new = []
        for a in args:
            if type(a) is Stacked or isinstance(a, torch.Tensor):
                x, s = next(it)
                new.append(Stacked(x) if s else x)
            else:
                new.append(a)
        return info.call(*aligned(tuple(new)))
    return call


class _Rule:
    """What :func:`apply_primitive` decided for one primitive from types and shapes, and the
    parts of its rules that read values, as functions ``(ctx, raw, args, kwargs)`` of the
    run-time values (:meth:`AtenContext.emit`): they hold no tensor."""

    __slots__ = ("op", "info", "name", "salt", "need_digits", "need_zeros", "lifted", "spec",
                 "reused", "fast", "kernel", "numbers", "realign", "rounds", "float8")

    def __init__(self, op, info, name, salt, need_digits, need_zeros, reused=False) -> None:
        self.op, self.info, self.name, self.salt = op, info, name, salt
        self.need_digits, self.need_zeros = need_digits, need_zeros
        self.lifted = True
        self.spec = None  # the raw outputs' structure (None: one tensor)
        self.reused = reused  # a step of a sampled graph: its functions run on every call
        # the prepared kernel of the usual one-output rounding (decided on the first call):
        # (executors.ATEN_PREPARED's kernel, digits wanted when counting, zero mask wanted
        # when counting, a tensor of the output's logical shape to allocate the mask like)
        self.fast: Any = None
        # the fused kernel of its path: binary, ATEN_BINARY's bound to its op; lookup,
        # ATEN_LOOKUP's implementation (both chosen when the path is)
        self.kernel: Any = None
        self.numbers: dict = {}  # binary: Python numbers as 0-d tensors of the working dtype
        self.realign = True  # binary: whether its stacked operands' ranks need aligning
        self.rounds = True  # False: measured, not rounded (unrounded=, an ablation)
        self.float8 = None  # a cast into float8: that format's name (rounded into it first)

    def finish_raw(self, ctx: AtenContext, raw: Any, args: tuple, kwargs: dict) -> Any:
        """Round, measure, count and record the outputs ``raw`` of the batched primitive."""
        if isinstance(raw, torch.Tensor):
            flat = [raw]
        else:
            flat, self.spec = pytree.tree_flatten(raw)
        return ctx.emit("round", self.name, self.finish, flat, args, kwargs)

    def _wants(self, ctx: AtenContext, counting: bool) -> tuple[bool, bool]:
        """(per-element digits, zero mask) to write in the rounding pass (:meth:`finish`): a
        cancellation needs a format with more digits than cancel_digits; the zero masks of
        the other counters are measured later, only for values whose statistics count zeros."""
        if not counting:
            return False, False
        need_digits, need_zeros = self.need_digits, self.need_zeros
        digits = ctx.cap > ctx.cancel_digits and (
            need_digits is not False or self.info.rule.output_digits)
        zeros = (need_digits if need_zeros is None else need_zeros) is not False
        return digits, zeros

    def binary(self, ctx: AtenContext, raw: list, args: tuple, kwargs: dict) -> Any:
        """An add, sub, mul or div computed by the kernel inside its rounding (``kernel``,
        :data:`fxstab.executors.ATEN_BINARY`'s): the same samples, statistics, counters and
        record as the operator followed by :meth:`finish`, which runs instead where the kernel
        does not read the operands (a broadcast over more than three collapsed dims)."""
        a, b = args
        k = self.kernel
        if self.realign:
            a, b = aligned(args)
        else:
            a = a.samples if type(a) is Stacked else a
            b = b.samples if type(b) is Stacked else b
        if type(a) is not torch.Tensor:
            a = self._number(a, ctx)
        if type(b) is not torch.Tensor:
            b = self._number(b, ctx)
        if not k.reads(a, b):
            return self.finish(ctx, [self.info.call(*aligned(args))], args, kwargs)
        counting, detailed = counting_mode(ctx)
        want_digits, want_zeros = self._wants(ctx, counting)
        seed = ctx.rounding_seed(ctx.next_seed(self.salt), 0)
        out, st, d, z = k(a, b, seed, want_digits, want_zeros and not want_digits)
        first = Stacked(out, Analysis(out, ctx, digits=d, stats=st, zero=z))
        return self._conclude(ctx, first, first, st, args, kwargs, exact=False, do_round=True,
                              want_record=ctx.recorder is not None, surrogate=False,
                              counting=counting, detailed=detailed)

    def _number(self, v: Any, ctx: AtenContext) -> torch.Tensor:
        """A Python number operand as a 0-d tensor of the working dtype (as torch reads it)."""
        if isinstance(v, torch.Tensor):  # a tensor subclass (a parameter)
            return v
        key = (type(v), repr(v))  # -0.0 is not 0.0
        t = self.numbers.get(key)
        if t is None:  # (not a tensor of the call: the same on every call)
            t = self.numbers[key] = torch.tensor(v, dtype=ctx.working_dtype)
        return t

    def compare(self, ctx: AtenContext, raw: list, args: tuple, kwargs: dict) -> torch.Tensor:
        kind = self.info.kind
        diff = diff_analysis(args[0], args[1], ctx, logical_ndim(args[:2]))
        result = self.info.rule.relation.cestac(diff.exact_zero | diff.zero, diff.samples.mean(0))
        rec_name = self.name or ctx.name_for(self.op)
        counting, detailed = counting_mode(ctx)
        if counting:
            count_found(kind, [("branching", diff.zero)], result.numel(), None, ctx, rec_name,
                   self.op, detailed, diff)
        return result

    def perturb(self, ctx: AtenContext, raw: list, args: tuple, kwargs: dict) -> tuple:
        """The GEMM surrogate on the stacked floating operands; the primitive's seed and
        whether it perturbed anything wait in the context for :meth:`finish`."""
        seed = ctx.next_seed(self.salt)
        eta = ctx.eta  # data_perturbation_threshold (the format's unit roundoff by default)
        surrogate = False
        new_args = list(args)
        for i, a in enumerate(args):
            if isinstance(a, Stacked) and a.samples.is_floating_point():
                p, cnt = perturb_operand(a.samples, eta, randbits.derive_seed(seed, 1 + i), ctx)
                surrogate |= cnt > 0
                if p is not a.samples:
                    new_args[i] = Stacked(p)
        ctx.gemm_pending = (seed, surrogate)
        return tuple(new_args)

    def lookup(self, ctx: AtenContext, raw: list, args: tuple, kwargs: dict) -> Any:
        out = self.kernel(self.op, args[0].samples)  # ATEN_LOOKUP's chosen implementation
        if out is None:
            out, self.lifted = run_batched(self.op, self.info, args, kwargs, ctx.n_samples, ctx)
        return self.finish(ctx, [out], args, kwargs)

    def finish(self, ctx: AtenContext, flat: list, args: tuple, kwargs: dict) -> Any:
        """Round every floating output (the first measured and recorded), count, record."""
        info, op, n = self.info, self.op, ctx.n_samples
        kind = info.kind
        lifted = self.lifted
        if self.info.gemm and ctx.gemm_pending is not None:  # from perturb, just before
            (seed, surrogate), ctx.gemm_pending = ctx.gemm_pending, None
        else:
            seed, surrogate = ctx.next_seed(self.salt), False
        counting, detailed = counting_mode(ctx)
        if self.float8 is not None and self.rounds:
            # the cast's own rounding, each sample its draws; then the format's (a no-op on the
            # float8 grid for the 16- and 32-bit formats), measured and recorded below
            flat = [round_samples(flat[0], self.float8, ctx.rounding,
                                  seed=randbits.derive_seed(seed, 8))] + list(flat[1:])
        fast = self.fast
        if fast and not (counting and fast[1]):
            done = self._round_prepared(ctx, fast, flat[0], args, seed, counting)
            if done is not None:
                first, st = done
                return self._conclude(ctx, first, first, st, args, kwargs, exact=False,
                                      do_round=True, want_record=ctx.recorder is not None,
                                      surrogate=surrogate, counting=counting,
                                      detailed=detailed)
        exact = info.exact and self.float8 is None
        if exact and info.rule.inexact is not None and info.rule.inexact(args, kwargs):
            exact = False  # |z| of complex z, round(x, decimals=d): arithmetic after all
        do_round = (lifted or ctx.round_per_sample) and not exact and self.rounds
        want_record = ctx.recorder is not None and (
            not exact or ctx.record_exact or info.rule.writes and _writes_nonfinite(args, kwargs))
        # per-element digits (or the zero mask) now, in the rounding pass, when a counter will
        # read them
        digits_if_counting, zeros_if_counting = self._wants(ctx, True)
        want_digits = counting and digits_if_counting
        want_zeros = counting and zeros_if_counting
        if fast is None and self.reused:
            # a step of a sampled graph, run again on every call: the usual one-output
            # rounding gets the prepared kernel (the same bits, one C call with one argument)
            v = flat[0]
            self.fast = False
            prepare = ctx.kernel(executors.ATEN_PREPARED, v) \
                if self.spec is None and do_round and want_record and not ctx.eft and \
                isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() and \
                v.shape[0] == n and v[0].numel() else None
            if prepare is not None:  # (None: the reference rounds, through round_measure)
                # in place where the output is memory of its own: the graph's structure
                # decides that (a view, an operand), the same on every call
                self.fast = (prepare(ctx, v.dtype, owned(v, args)), digits_if_counting,
                             zeros_if_counting,
                             torch.empty((), dtype=torch.bool).expand(v.shape[1:]))
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
                    v, st = round_complex(v, ctx, seed_j,
                                           is_first and (want_record or counting),
                                           owned(v, args))
                    st_v = Stacked(v)
                    if is_first:
                        first_stats = st
                elif v.is_floating_point() and do_round:
                    seed_j = ctx.rounding_seed(seed, j)
                    j += 1
                    if ctx.eft:
                        v = round_fp64(info.rule.fp64, op, args, kwargs, v, seed_j, ctx)
                        seed_j = None  # rounded: measure only
                    if is_first:
                        v, st, an = round_measure(v, ctx, seed_j, want_record or counting,
                                                   want_digits, want_zeros and not want_digits,
                                                   owned(v, args))
                    else:
                        v, st, an = round_measure(v, ctx, seed_j, False, False, False,
                                                   owned(v, args))
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
        return self._conclude(ctx, result, first, first_stats, args, kwargs, exact=exact,
                              do_round=do_round, want_record=want_record, surrogate=surrogate,
                              counting=counting, detailed=detailed)

    def _round_prepared(self, ctx: AtenContext, fast: tuple, v: torch.Tensor, args: tuple,
                        seed: int, counting: bool) -> Optional[tuple]:
        """:meth:`finish`'s rounding of the one output through the prepared kernel: (its
        samples, the statistics); None for a layout it does not read (the general path then
        runs)."""
        prepared, _digits, zeros_if_counting, like = fast
        z = None
        if counting and zeros_if_counting:
            # the trace's shape: the graph's signature (empty_like parses its arguments in
            # half the time of torch.empty(shape, dtype=...))
            z = torch.empty_like(like, memory_format=torch.contiguous_format)
        prepared.write_zeros(z)
        out = prepared(v, ctx.rounding_seed(seed, 0))
        if out is None:
            return None
        st = prepared.stats[:]
        return Stacked(out, Analysis(out, ctx, stats=st, zero=z)), st

    def _conclude(self, ctx: AtenContext, result: Any, first: Optional[Stacked],
                  first_stats: Optional[list], args: tuple, kwargs: dict, *, exact: bool,
                  do_round: bool, want_record: bool, surrogate: bool, counting: bool,
                  detailed: bool) -> Any:
        """The counters and the record of :meth:`finish`."""
        info, op, n = self.info, self.op, ctx.n_samples
        kind = info.kind
        rec_name = self.name or ctx.name_for(op) if (want_record or counting) else None
        if counting:
            row = info.rule
            diff = row.branch(args, kwargs, ctx) if row.branch is not None else None
            out_numel = first.samples.numel() // n if first is not None else 0
            found = compute_counters(row, args, kwargs, first, out_numel, ctx, diff, detailed)
            counts = count_found(kind, found, out_numel, first, ctx, rec_name, op, detailed, None) \
                if found else no_counts(ctx)
        else:
            counts = empty_counters()
            ctx.last_events = []
        if want_record:
            lifted = self.lifted
            stats = _record_stats(first, first_stats, ctx)
            # (an ablation's unrounded primitive keeps the status it would have: its analysis
            # is the same but for its rounding)
            status = (PER_SAMPLE if not lifted else ROUNDED) \
                if do_round or not (self.rounds or exact) else \
                (UNLIFTED if not lifted else OBSERVED)
            ctx.recorder(PrimitiveRecord(rec_name, info.text, kind, stats, counts, surrogate,
                                         status, tuple(first.shape), list(ctx.last_events),
                                         n, ctx.t, ctx.cap))
        return result


def _writes_nonfinite(args: tuple, kwargs: dict) -> bool:
    """Whether an exact primitive that writes a value of its own (its row's ``writes``:
    masked_fill, where...) writes an infinity or NaN (an attention mask's -inf): then it is
    recorded (observed, not rounded), so the graph sees where the infinities come from and
    their consumers (the softmax's x - max) are not taken for where NaN/inf appear."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, float) and not math.isfinite(v):
            return True
        if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point() \
                and not bool(torch.isfinite(v)):
            return True
    return False


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
                                     OBSERVED, tuple(v.shape), [], ctx.n_samples, ctx.t,
                                     ctx.cap))
        return True
    return False


def _record_stats(first: Stacked, st: Optional[list], ctx: AtenContext) -> list:
    """The statistics list of a recorded output (measured now if its rounding did not)."""
    if st is None and first.samples.is_complex():  # observed complex values: their parts
        _, st = round_complex(first.samples, ctx, None, True, False)
    if st is None:  # not rounded here (exact, observed, unlifted): measure only
        _, st, an = round_measure(first.samples, ctx, None, True, first.measured is None)
        if first.measured is None:
            first.measured = an
        elif st is not None:  # the counters made it: what the statistics tell its readers
            first.measured.set_stats(st)
    return st


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
                                  rep.counters, record.values, ctx.n_samples, ctx.t, ctx.cap)
    return rep
