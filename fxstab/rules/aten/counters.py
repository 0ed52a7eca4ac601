"""CADNA's counters at the arithmetic level (docs/design.md §5), from the digits the rules already
have: the counters of each primitive family, registered with its row of the table
(:func:`fxstab.rules.aten.primitives.primitive`: the families with counters have their rows
here, beside their code), :func:`compute_counters` (a row's counters, then the anomalies every
inexact primitive shares), and counting them into the context, the open collectors and
per-event records (:func:`count_found`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
from torch.utils import _pytree as pytree

from ...records.counters import CounterEvent, active_collectors
from ...records.report import empty_counters
from .batching import aligned, logical_ndim
from .context import AtenContext
from .primitives import (
    ARITHMETIC, BINARY, EXACT, PrimitiveRule, primitive, reads_digits, reads_zeros,
)
from ..lifting import Stacked
from .measure import Analysis

__all__ = ["differs", "diff_analysis", "CounterCall", "compute_counters", "counting_mode",
           "no_counts", "count_found"]


def _bcount(mask: torch.Tensor, out_numel: int) -> torch.Tensor:
    """Number of output elements a broadcast mask covers (each mask element repeats equally)."""
    m = mask.numel()
    f = out_numel // m if m else 0
    return torch.count_nonzero(mask) * f  # several times faster than a bool sum


def _operand(x, ctx) -> Optional[Analysis]:
    return x.analysis(ctx) if isinstance(x, Stacked) and x.samples.is_floating_point() else None


def _zeros(o: Analysis, out_numel: int):
    """An operand's computational zeros as a counter's mask: the analysis itself (counted by
    its statistics, no pass over the mask) when they cover the output one to one and the
    statistics counted them, else the mask."""
    if o.zeros is not None and o.samples.numel() == out_numel * o.samples.shape[0]:
        return o
    return o.zero


def _exact_data(a: Analysis) -> bool:
    """Identical, finite samples (data entering the analysis): digits at the cap everywhere."""
    return a.samples.stride(0) == 0 and a.all_finite


def differs(a, b) -> bool:
    """Whether :func:`diff_analysis` has a difference to analyse (from types and dtypes)."""
    if not isinstance(a, Stacked) and not isinstance(b, Stacked):
        return False
    x = a.samples if isinstance(a, Stacked) else a
    y = b.samples if isinstance(b, Stacked) else b
    return not (isinstance(x, torch.Tensor) and not x.is_floating_point() and
                (not isinstance(y, torch.Tensor) or not y.is_floating_point()))


def diff_analysis(a, b, ctx, nd) -> Optional[Analysis]:
    """Analysis of a - b (unrounded, on the samples) for comparison-like primitives."""
    if not differs(a, b):
        return None
    x, y = aligned((a, b), nd)
    return Analysis(torch.sub(x, y) if isinstance(x, torch.Tensor) else torch.rsub(y, x), ctx)


class Counted(int):
    """A counter's count found without its mask (summary counters only)."""


class CounterCall(NamedTuple):
    """One primitive call as its family's counters read it: the arguments, the output (its
    samples and their analysis ``oa``, None where not floating), the output's logical number
    of elements, the compared difference of a selection (its row's ``branch``) and whether
    a cancellation is possible at all (an output digit below ``cap - cancel_digits``)."""

    args: tuple
    kwargs: dict
    out: Optional[Stacked]
    oa: Optional[Analysis]
    out_numel: int
    ctx: AtenContext
    diff: Optional[Analysis]
    can_cancel: bool


_NONE: list = []


def _anomalies_counted(rule: PrimitiveRule, args: tuple, oa: Analysis, out_numel: int,
                       ctx: AtenContext) -> Optional[Counted]:
    """The anomalies of an add, sub, mul or div (a row with ``carriers``: the operands whose
    non-finite elements the output carries, IEEE) from counts, without masks, where they
    decide it: with finite operands every non-finite output element is one; with one operand
    holding non-finite elements that the output carries (a causal mask's -inf through the
    softmax's x - max), the output's non-finite elements beyond the ones it carries. None
    where only masks tell (both operands non-finite, a divisor's infinities)."""
    carriers = rule.carriers
    if not carriers or len(args) != 2:
        return None
    found = None  # (position, non-finite elements, logical numel) of the one non-finite operand
    for i, x in enumerate(args):
        o = _operand(x, ctx)
        if o is not None:
            if o.all_finite:
                continue
            if found is not None:
                return None
            found = (i, o.non_finite, o.samples.numel() // o.samples.shape[0])
        elif isinstance(x, torch.Tensor):
            if x.is_floating_point() and not bool(torch.isfinite(x).all()):
                return None
        elif isinstance(x, float) and not math.isfinite(x):
            return None
    if found is None:
        return Counted(oa.non_finite)
    i, nf, numel = found
    if i not in carriers or not numel or out_numel % numel:
        return None
    return Counted(oa.non_finite - nf * (out_numel // numel))


def compute_counters(rule: PrimitiveRule, args: tuple, kwargs: dict, out: Optional[Stacked],
                     out_numel: int, ctx: AtenContext, diff: Optional[Analysis],
                     masks: bool = False) -> list:
    """Masks (or counts) of the counters this primitive triggers: list of (key, mask); with
    ``masks`` (per-event records) every one as a mask. Its row's ``counters``, then the
    anomalies (NaN/inf from finite operands) of a primitive that is not exact."""
    oa = out.analysis(ctx) if out is not None and out.samples.is_floating_point() else None
    # no output digit is below cap - cancel_digits (>= every reference): no cancellation
    # (always so when the format has fewer digits than cancel_digits: bf16, fp16, fp8)
    can_cancel = oa is not None and not (oa.min_digits is not None and
                                         oa.min_digits > ctx.cap - ctx.cancel_digits)
    found = _NONE
    if rule.counters is not None:
        found = rule.counters(CounterCall(args, kwargs, out, oa, out_numel, ctx, diff,
                                          can_cancel))
    # NaN/inf produced from finite operands; an exact primitive only moves values around
    if oa is not None and not rule.exact and not oa.all_finite:
        found = list(found)
        counted = None if masks else _anomalies_counted(rule, args, oa, out_numel, ctx)
        if counted is not None:
            found.append(("anomaly", counted))
            return found
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


# --------------------------------------------------------------------------- the families
@primitive("add", "sub", path=BINARY, needs=reads_digits, output_digits=True, carriers=(0, 1))
def _cancellation(c: CounterCall) -> list:
    """cancellation where the output keeps cancel_digits fewer digits than the fewer of its
    two operands' (exact data counts with the cap's)."""
    if not c.can_cancel:
        return _NONE
    ctx = c.ctx
    ops = [_operand(x, ctx) for x in c.args[:2]]
    # exact data (identical samples, finite) has the cap's digits: it never lowers the min
    ds = [o.digits for o in ops if o is not None and not _exact_data(o)]
    if not ds and not any(o is not None for o in ops):
        return _NONE
    ref = ctx.cap if not ds else ds[0] if len(ds) == 1 else torch.minimum(ds[0], ds[1])
    return [("cancellation", c.oa.digits <= ref - ctx.cancel_digits)]


primitive("rsub", path=ARITHMETIC, needs=reads_digits, output_digits=True,
          counters=_cancellation, family="cancellation")


@primitive("sum", "mean", "nansum", path=ARITHMETIC, needs=reads_digits, output_digits=True)
def _summed_cancellation(c: CounterCall) -> list:
    """cancellation where the sum keeps cancel_digits fewer digits than the fewest of the
    terms it sums."""
    args, kwargs = c.args, c.kwargs
    if not c.can_cancel or not isinstance(args[0], Stacked):
        return _NONE
    a = args[0].analysis(c.ctx)
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
    return [("cancellation", c.oa.digits <= ref - c.ctx.cancel_digits)]


def _divided_by(o: Optional[Analysis], c: CounterCall) -> list:
    if o is None or o.no_zeros:
        return _NONE
    return [("division", _zeros(o, c.out_numel))]


def _second_operand(args: tuple, operand: Any) -> tuple[bool, bool]:
    """The zero mask of the divisor, the second operand."""
    return False, len(args) > 1 and args[1] is operand


@primitive("div", path=BINARY, needs=_second_operand, carriers=(0,))
def _division(c: CounterCall) -> list:
    """division by a computational zero (the divisor's zero mask)."""
    return _divided_by(_operand(c.args[1], c.ctx) if len(c.args) > 1 else None, c)


primitive("remainder", "fmod", "floor_divide", path=ARITHMETIC, needs=_second_operand,
          counters=_division, family="division")


def _first_operand(args: tuple, operand: Any) -> tuple[bool, bool]:
    """The zero mask of the divisor, the only operand."""
    return False, args[0] is operand


@primitive("reciprocal", path=ARITHMETIC, needs=_first_operand)
def _reciprocal(c: CounterCall) -> list:
    """division by a computational zero (1/x: the operand's zero mask)."""
    return _divided_by(_operand(c.args[0], c.ctx), c)


@primitive("mul", path=BINARY, needs=reads_zeros, carriers=(0, 1))
def _multiplication(c: CounterCall) -> list:
    """multiplication of two computational zeros."""
    oa_, ob_ = (_operand(x, c.ctx) for x in c.args[:2])
    if oa_ is None or ob_ is None or oa_.no_zeros or ob_.no_zeros:
        return _NONE
    return [("multiplication", oa_.zero & ob_.zero)]


def _zero_argument(c: CounterCall, key: str) -> list:
    zs = [o for o in (_operand(x, c.ctx) for x in c.args[:2]) if o is not None and not o.no_zeros]
    if not zs:
        return _NONE
    return [(key, _zeros(zs[0], c.out_numel) if len(zs) == 1 else zs[0].zero | zs[1].zero)]


@primitive("pow", "float_power", path=ARITHMETIC, needs=reads_zeros)
def _power(c: CounterCall) -> list:
    """power with a computational zero as its base or exponent."""
    return _zero_argument(c, "power")


@primitive("sqrt", "rsqrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin",
           "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh",
           "atanh", "erf", "erfc", "erfinv", "sigmoid", "lgamma", "digamma", "atan2", "logit",
           "special_erfcx", "xlogy", path=ARITHMETIC, needs=reads_zeros)
def _math_function(c: CounterCall) -> list:
    """math_function of a computational zero."""
    return _zero_argument(c, "math_function")


def _complex_operand(args: tuple, kwargs: dict) -> bool:
    """|z|, z / |z|: arithmetic on the parts of a complex operand."""
    return type(args[0]) is Stacked and args[0].samples.is_complex()


@primitive("abs", path=EXACT, inexact=_complex_operand)
def _sign_change(c: CounterCall) -> list:
    """intrinsic where the samples of the operand differ in sign."""
    x = c.args[0]
    if not (isinstance(x, Stacked) and x.samples.is_floating_point()):
        return _NONE
    s = x.samples
    return [("intrinsic", (s > 0).any(0) & (s < 0).any(0))]


def _with_decimals(args: tuple, kwargs: dict) -> bool:
    """round(x * 10**d) / 10**d: not a value of the format in general."""
    return bool(kwargs.get("decimals"))


@primitive("floor", "ceil", "trunc", "sign", path=EXACT)
def _rounding_intrinsic(c: CounterCall) -> list:
    """intrinsic where the samples of the output differ (rounded to different integers)."""
    if c.out is None or c.kwargs.get("decimals"):
        return _NONE
    return [("intrinsic", ~c.out.analysis(c.ctx).identical)]


primitive("round", path=EXACT, inexact=_with_decimals, counters=_rounding_intrinsic,
          family="rounding_intrinsic")
primitive("sgn", path=EXACT, inexact=_complex_operand, counters=_rounding_intrinsic,
          family="rounding_intrinsic")
primitive("frac", path=ARITHMETIC, counters=_rounding_intrinsic, family="rounding_intrinsic")


@primitive("_to_copy", "to", path=EXACT, casts=True)
def _cast(c: CounterCall) -> list:
    """intrinsic where a floating operand's samples cast to different integers."""
    out, x = c.out, c.args[0]
    if out is None or out.samples.is_floating_point() or \
            not (isinstance(x, Stacked) and x.samples.is_floating_point()):
        return _NONE
    return [("intrinsic", ~out.analysis(c.ctx).identical)]


def _branching(c: CounterCall) -> list:
    """branching where the compared difference is a computational zero."""
    return _NONE if c.diff is None else [("branching", c.diff.zero)]


def _two_operands(args: tuple, kwargs: dict, ctx: AtenContext) -> Optional[Analysis]:
    """max/min of two operands: their difference."""
    return diff_analysis(args[0], args[1], ctx, logical_ndim(args[:2]))


primitive("maximum", "minimum", path=EXACT, branch=_two_operands, counters=_branching,
          family="selection")
primitive("fmax", "fmin", path=ARITHMETIC, branch=_two_operands, counters=_branching,
          family="selection")


def _limits(args: tuple, lo: Any, hi: Any, ctx: AtenContext) -> Optional[Analysis]:
    """The difference of the operand and its limits (both: the fewer digits, either zero)."""
    diffs = [d for d in (diff_analysis(args[0], lim, ctx, args[0].ndim)
                         for lim in (lo, hi) if lim is not None) if d is not None]
    if len(diffs) < 2:
        return diffs[0] if diffs else None
    a, b = diffs
    return Analysis(a.samples, ctx, digits=torch.minimum(a.digits, b.digits), zero=a.zero | b.zero)


def _clamp_limits(args: tuple, kwargs: dict, ctx: AtenContext) -> Optional[Analysis]:
    """clamp(x, min, max), clamp_min(x, min): the differences from the limits."""
    return _limits(args, args[1] if len(args) > 1 else kwargs.get("min"),
                   args[2] if len(args) > 2 else kwargs.get("max"), ctx)


def _upper_limit(args: tuple, kwargs: dict, ctx: AtenContext) -> Optional[Analysis]:
    """clamp_max(x, max): the difference from the limit."""
    return _limits(args, None, args[1] if len(args) > 1 else kwargs.get("min"), ctx)


primitive("clamp", "clamp_min", path=EXACT, branch=_clamp_limits, counters=_branching,
          family="clamp")
primitive("clamp_max", path=EXACT, branch=_upper_limit, counters=_branching, family="clamp")


@primitive("relu", path=EXACT, needs=reads_zeros)
def _relu_branching(c: CounterCall) -> list:
    """branching where the operand is a computational zero (its zero mask)."""
    x = c.args[0]
    if not isinstance(x, Stacked):
        return _NONE
    a = x.analysis(c.ctx)
    return _NONE if a.no_zeros else [("branching", _zeros(a, c.out_numel))]


def _below(c: CounterCall, default: float) -> list:
    x = c.args[0]
    if not isinstance(x, Stacked):
        return _NONE
    lim = c.args[1] if len(c.args) > 1 else default
    d = diff_analysis(x, lim, c.ctx, x.ndim)
    return _NONE if d is None else [("branching", d.zero)]


@primitive("threshold", path=EXACT)
def _threshold_branching(c: CounterCall) -> list:
    """branching where the operand minus its threshold is a computational zero."""
    return _below(c, 0.0)


@primitive("hardtanh", path=EXACT)
def _hardtanh_branching(c: CounterCall) -> list:
    """branching where the operand minus its lower limit is a computational zero."""
    return _below(c, -1.0)


@primitive("where", path=EXACT, writes=True)
def _condition_branching(c: CounterCall) -> list:
    """branching where the samples of the condition disagree."""
    cond = c.args[0]
    if not isinstance(cond, Stacked):
        return _NONE
    s = cond.samples
    return [("branching", s.any(0) & ~s.all(0))]


def counting_mode(ctx: AtenContext) -> tuple[bool, bool]:
    """(whether counters run, whether they keep per-event records): the context's
    diagnostics, or an open :func:`fxstab.records.counters.instability_counters` block."""
    collectors = active_collectors()
    counting = ctx.diagnostics != "off" or bool(collectors)
    detailed = counting and (ctx.diagnostics == "detailed" or bool(collectors) and any(
        c.diagnostics == "detailed" for c in collectors))
    return counting, detailed


def no_counts(ctx: AtenContext) -> dict:
    """Empty counters for a primitive that triggers none (and no events)."""
    ctx.last_events = []
    return empty_counters()


def count_found(kind, found, out_numel, out, ctx, rec_name, op, detailed, diff) -> dict:
    """Count each (key, mask) of ``found`` over the output; a mask given as an operand's
    :class:`Analysis` is that operand's zero mask, counted by its statistics (no pass)."""
    counts = empty_counters()
    ctx.last_events = []
    if not found:
        return counts
    masks = [m for _, m in found if type(m) is not Analysis and type(m) is not Counted]
    if len(masks) == 1:
        counted = [int(_bcount(masks[0], out_numel))]
    elif masks:
        counted = torch.stack([_bcount(m, out_numel) for m in masks]).tolist()
    counted = iter(counted if masks else ())
    for key, mask in found:
        v = int(mask.zeros) if type(mask) is Analysis else int(mask) \
            if type(mask) is Counted else int(next(counted))
        if v <= 0:
            continue
        counts[key] += v
        ev = None
        if detailed:
            if type(mask) is Analysis:
                mask = mask.zero
            ev = _event(key, mask, v, out, ctx, rec_name, op, diff)
            ctx.last_events.append(ev)
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


