"""CADNA's counters at the arithmetic level (docs/design.md §5), from the digits the rules already
have: which counters a primitive triggers (:func:`compute_counters`, :func:`limit_diff` for
max/min/clamp), and counting them into the context, the open collectors and per-event records
(:func:`count_found`)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils import _pytree as pytree

from ...records.counters import CounterEvent, active_collectors
from ...records.report import empty_counters
from .batching import aligned, logical_ndim
from .context import AtenContext
from .kinds import (
    ADD_KINDS, DIV_KINDS, EXACT_PRIMITIVES, MATH_KINDS, POW_KINDS, REDUCE_SUM_KINDS,
    ROUNDING_INTRINSICS, COMPARISONS, SELECT2_KINDS,
)
from ..lifting import Stacked
from .measure import Analysis

__all__ = ["differs", "diff_analysis", "compute_counters", "limit_diff", "counting_mode",
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


# Elementwise kinds whose result is non-finite wherever the operands at these positions are
# (IEEE: an infinity or NaN in a sum, a difference or a product, or in a quotient's numerator)
_NONFINITE_CARRIERS = {"add": (0, 1), "sub": (0, 1), "mul": (0, 1), "div": (0,)}


def _anomalies_counted(kind: str, args: tuple, oa: Analysis, out_numel: int,
                       ctx: AtenContext) -> Optional[Counted]:
    """The anomalies of an add, sub, mul or div from counts, without masks, where they
    decide it: with finite operands every non-finite output element is one; with one operand
    holding non-finite elements that the output carries (a causal mask's -inf through the
    softmax's x - max), the output's non-finite elements beyond the ones it carries. None
    where only masks tell (both operands non-finite, a divisor's infinities)."""
    carriers = _NONFINITE_CARRIERS.get(kind)
    if carriers is None or len(args) != 2:
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


def compute_counters(kind: str, args: tuple, kwargs: dict, out: Optional[Stacked],
                      out_numel: int, ctx: AtenContext, diff: Optional[Analysis],
                      masks: bool = False):
    """Masks (or counts) of the counters this primitive triggers: list of (key, mask); with
    ``masks`` (per-event records) every one as a mask."""
    found = []
    oa = out.analysis(ctx) if out is not None and out.samples.is_floating_point() else None
    # no output digit is below cap - cancel_digits (>= every reference): no cancellation
    # (always so when the format has fewer digits than cancel_digits: bf16, fp16, fp8)
    can_cancel = oa is not None and not (oa.min_digits is not None and
                                         oa.min_digits > ctx.cap - ctx.cancel_digits)
    if kind in ADD_KINDS and can_cancel:
        ops = [_operand(x, ctx) for x in args[:2]]
        # exact data (identical samples, finite) has the cap's digits: it never lowers the min
        ds = [o.digits for o in ops if o is not None and not _exact_data(o)]
        if ds or any(o is not None for o in ops):
            ref = (ctx.cap if not ds else ds[0] if len(ds) == 1
                   else torch.minimum(ds[0], ds[1]))
            found.append(("cancellation", oa.digits <= ref - ctx.cancel_digits))
    elif kind in ADD_KINDS or kind in REDUCE_SUM_KINDS and not can_cancel:
        pass
    elif kind in REDUCE_SUM_KINDS and oa is not None and isinstance(args[0], Stacked):
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
    elif kind in DIV_KINDS:
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
    elif kind in POW_KINDS or kind in MATH_KINDS:
        zs = [o for o in (_operand(x, ctx) for x in args[:2]) if o is not None and not o.no_zeros]
        if zs:
            found.append(("power" if kind in POW_KINDS else "math_function",
                          _zeros(zs[0], out_numel) if len(zs) == 1 else zs[0].zero | zs[1].zero))
    elif kind == "abs" and isinstance(args[0], Stacked) and args[0].samples.is_floating_point():
        s = args[0].samples
        found.append(("intrinsic", (s > 0).any(0) & (s < 0).any(0)))
    elif kind in ROUNDING_INTRINSICS and out is not None and not kwargs.get("decimals"):
        found.append(("intrinsic", ~out.analysis(ctx).identical))
    elif kind in ("_to_copy", "to") and out is not None and not out.samples.is_floating_point() \
            and isinstance(args[0], Stacked) and args[0].samples.is_floating_point():
        found.append(("intrinsic", ~out.analysis(ctx).identical))
    elif kind in COMPARISONS or kind in SELECT2_KINDS or kind in ("clamp", "clamp_min", "clamp_max"):
        if diff is not None:
            found.append(("branching", diff.zero))
    elif kind in ("relu", "threshold", "hardtanh") and isinstance(args[0], Stacked):
        if kind == "relu":
            a = args[0].analysis(ctx)
            if not a.no_zeros:
                found.append(("branching", _zeros(a, out_numel)))
        else:
            lim = args[1] if len(args) > 1 else (-1.0 if kind == "hardtanh" else 0.0)
            d = diff_analysis(args[0], lim, ctx, args[0].ndim)
            if d is not None:
                found.append(("branching", d.zero))
    elif kind == "where" and isinstance(args[0], Stacked):
        c = args[0].samples
        found.append(("branching", c.any(0) & ~c.all(0)))
    # NaN/inf produced from finite operands; an exact primitive only moves values around
    if oa is not None and kind not in EXACT_PRIMITIVES and not oa.all_finite:
        counted = None if masks else _anomalies_counted(kind, args, oa, out_numel, ctx)
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


def counting_mode(ctx: AtenContext) -> tuple[bool, bool]:
    """(whether counters run, whether they keep per-event records): the context's
    diagnostics, or an open :func:`fxstab.records.counters.instability_counters` block."""
    collectors = active_collectors()
    counting = ctx.diagnostics != "off" or bool(collectors)
    detailed = counting and (ctx.diagnostics == "detailed" or bool(collectors) and any(
        c.diagnostics == "detailed" for c in collectors))
    return counting, detailed


def limit_diff(kind: str, args: tuple, kwargs: dict, ctx: AtenContext) -> Optional[Analysis]:
    """Analysis of the compared difference of max/min/clamp (computational zero: branching)."""
    if kind in SELECT2_KINDS:
        return diff_analysis(args[0], args[1], ctx, logical_ndim(args[:2]))
    lo = args[1] if len(args) > 1 else kwargs.get("min")
    hi = args[2] if len(args) > 2 else kwargs.get("max")
    if kind == "clamp_max":
        lo, hi = None, lo
    diffs = [d for d in (diff_analysis(args[0], lim, ctx, args[0].ndim)
                         for lim in (lo, hi) if lim is not None) if d is not None]
    if len(diffs) < 2:
        return diffs[0] if diffs else None
    a, b = diffs
    z = a.zero | b.zero
    both = Analysis(a.samples, ctx, digits=torch.minimum(a.digits, b.digits), zero=z)
    return both


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


