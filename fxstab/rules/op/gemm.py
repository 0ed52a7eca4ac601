"""GEMM-like operators. A GEMM whose accumulator or operands are modelled (``accumulate=``,
``gemm_inputs=``: the plan's ``accumulate`` / ``gemm_inputs``) runs as
:func:`fxstab.rules.accumulation.modelled_gemm` on the samples (blocks of K summed exactly, one
rounding into the accumulator each; a random rounding draws per sample and element: CESTAC
inside the product, each call anew). Otherwise ``linear`` (a plain weight: one addmm over
N x batch rows; vmap would split it into mm + add) and ``scaled_dot_product_attention`` (any
leading dims; folded over the samples: :func:`fxstab.rules.lifting.attention_folded`) take
the stacked samples directly; the others are lifted by the default rule. The GEMM surrogate
(docs/design.md §4) runs before any of these, in the tracer."""

from __future__ import annotations

from typing import Optional

import torch

from ...capture.flat import unflatten_call
from ...capture.torchao import float8_cast
from ...numerics.digits import digits_cap
from ...records.report import ROUNDED
from ..accumulation import accumulable, gemm_model_label, modelled_gemm
from ..lifting import ACCUMULATED_KINDS, Stacked, attention_folded
from .registry import OpCall, Outcome, op_rule

__all__ = ["BATCHED_KINDS"]

# Operators that take stacked samples directly in their leading arguments (count)
BATCHED_KINDS = {"scaled_dot_product_attention": 3, "linear": 1}


@op_rule(*sorted(ACCUMULATED_KINDS))
def modelled(call: OpCall) -> Optional[Outcome]:
    """The GEMM with its modelled accumulator and operand recipe on the samples."""
    plan, spec, t = call.plan, call.spec, call.tracer
    if plan.accumulate is None and plan.gemm_inputs is None or \
            not accumulable(*unflatten_call(call.leaves, spec), plan.kind):
        return None

    def product(leaves: list) -> Stacked:
        out, t.acc_errors[plan.index] = modelled_gemm(
            *unflatten_call(leaves, spec), plan, t.cfg, t.seed(plan, 2000), t.to_working,
            digits_cap(plan.format or t.fmt, t.wdtype))
        return out

    return Outcome(t.step("accumulate", plan, product, call.leaves), ROUNDED,
                   gemm_model_label(plan.accumulate, plan.gemm_inputs,
                                    plan.gemm_scaling or t.cfg.gemm_scaling))


@op_rule("to_copy")
def float8_operand(call: OpCall) -> Optional[Outcome]:
    """A GEMM operand's cast into float8 (format="auto": torchao's recipe in a lowered graph,
    :func:`fxstab.capture.torchao.float8_cast`): the samples stay in the working dtype, and
    the rounding into the float8 format is the analysis's (each sample its own draws)."""
    x = call.leaves[0] if call.leaves else None
    fmt = float8_cast(call.plan.node)
    if fmt is None or call.plan.name is None or not isinstance(x, Stacked):
        return None
    return Outcome(x, ROUNDED, f"float8 cast: rounded into {fmt}")


@op_rule(*sorted(BATCHED_KINDS))
def batched(call: OpCall) -> Optional[Outcome]:
    """Once on the stacked samples (plain leading operands as N identical samples)."""
    kind = call.plan.kind
    k = BATCHED_KINDS[kind]
    if not all(i < k for i in call.stacked):
        return None
    t = call.tracer
    a, kw = unflatten_call(call.leaves, call.spec)
    a = [t.stack(v) if i < k and isinstance(v, (Stacked, torch.Tensor)) else v
         for i, v in enumerate(a)]
    out = attention_folded(call.fn, a, kw) if kind == "scaled_dot_product_attention" else \
        call.fn(*a, **kw)
    return Outcome(Stacked(t.to_working(out)), ROUNDED, "batched over the samples")
