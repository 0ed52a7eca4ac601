"""Elementwise operators (activations, ``exp``/``log``/``pow``/``div``..., additions and
subtractions): the stacked samples broadcast against the other operands as the plain values
do, so the operator runs once on them, without vmap's dispatch, whenever the sample dim cannot
meet another operand's dims (:func:`fxstab.rules.lifting.broadcasts_directly`); otherwise the
default rule lifts it."""

from __future__ import annotations

from typing import Optional

from ...capture.flat import unflatten_call
from ...capture.opsets import FAMILIES
from ...records.report import ROUNDED
from ..lifting import Stacked, broadcasts_directly
from .registry import OpCall, Outcome, op_rule

__all__ = ["ELEMENTWISE_KINDS"]

# Elementwise operators (no dim argument)
ELEMENTWISE_KINDS = ((FAMILIES["activation"] - {"glu", "prelu"}) | FAMILIES["elementwise"]
                     | FAMILIES["addsub"] | {"mul", "neg", "abs"})


@op_rule(*sorted(ELEMENTWISE_KINDS))
def elementwise(call: OpCall) -> Optional[Outcome]:
    """Once on the stacked samples, which broadcast as the plain values do."""
    leaves = call.leaves
    if not broadcasts_directly(leaves):
        return None
    a, k = unflatten_call([v.samples if isinstance(v, Stacked) else v for v in leaves],
                          call.spec)
    return Outcome(call.tracer.wrap_out(call.fn(*a, **k)), ROUNDED, "elementwise on the samples")
