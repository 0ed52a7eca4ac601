"""Decisions: operators whose integer outputs choose positions of the data (a mixture of
experts' top-k routing, ``sort``/``argsort`` before a dispatch by index, ``argmax``) decide once
for every sample, on the samples' mean (:func:`fxstab.rules.lifting.decided_on_mean`, as CADNA's
synchronous arithmetic takes every branch on the mean: docs/design.md §3); their floating
outputs are each sample's own values at the decided positions. Every sample then routes the
same tokens to the same experts in the same order, and the digits downstream measure the
rounding, not a different layout per sample (which would compare different tokens row by
row)."""

from __future__ import annotations

from typing import Optional

from ...capture.flat import unflatten_call
from ...records.report import ROUNDED
from ..lifting import DECISIONS, Stacked, decided_on_mean
from .registry import OpCall, Outcome, op_rule

__all__: list = []


@op_rule(*sorted(DECISIONS))
def decided(call: OpCall) -> Optional[Outcome]:
    """Decided once, on the samples' mean; each sample's values at the decided positions."""
    a, k = unflatten_call(call.leaves, call.spec)
    x = a[0] if a else None
    if not isinstance(x, Stacked) or not x.samples.is_floating_point() or \
            any(isinstance(v, Stacked) for v in (*a[1:], *k.values())):
        return None
    res = decided_on_mean(call.fn, call.plan.kind, x, tuple(a[1:]), k)
    if res is None:
        return None
    return Outcome(_working(call, res), ROUNDED,
                   "decided on the samples' mean (one set of indices for every sample)")


def _working(call: OpCall, res):
    """The decided values in the working dtype (the indices as they are)."""
    if isinstance(res, tuple) and res and isinstance(res[0], Stacked):
        values = Stacked(call.tracer.to_working(res[0].samples))
        return type(res)((values, res[1])) if type(res) is not tuple else (values, res[1])
    return res
