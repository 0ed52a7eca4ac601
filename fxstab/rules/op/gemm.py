"""GEMM-like operators. A GEMM whose accumulator or operands are modelled (``accumulate=``,
``gemm_inputs=``: the plan's ``accumulate`` / ``gemm_inputs``) runs as
:func:`fxstab.rules.accumulation.modelled_gemm` on the samples (blocks of K summed exactly, one
rounding into the accumulator each; a random rounding draws per sample and element: CESTAC
inside the product, each call anew). Otherwise ``linear`` (a plain weight: one addmm over
N x batch rows; vmap would split it into mm + add) and ``scaled_dot_product_attention`` (any
leading dims; folded over the samples: :func:`fxstab.rules.lifting.attention_folded`) take
the stacked samples directly, and so does a backward graph's ``embedding_dense_backward`` (the
samples folded into the rows: :func:`fxstab.rules.lifting.embedding_grad_folded`); the others
are lifted by the default rule. The GEMM surrogate
(docs/design.md §4) runs before any of these, in the tracer. In a lowered graph of a torchao
float8 model (at every format), a cast into float8 rounds the samples into the float8 format
and keeps them in the working dtype, and ``_scaled_mm`` of such samples is their scaled product
(:mod:`fxstab.capture.torchao`)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from ... import executors
from ...capture.flat import unflatten_call
from ...capture.torchao import float8_cast
from ...numerics import lowp_gemm
from ...numerics.digits import digits_cap
from ...numerics.rounding import round_samples
from ...records.report import ROUNDED
from ..accumulation import accumulable, gemm_model_label, modelled_gemm
from ..lifting import (ACCUMULATED_KINDS, LOW_READERS, Stacked, as_linear, attention_folded,
                       embedding_grad_folded)
from .registry import OpCall, Outcome, op_rule
from .structural import in_vmap_region

__all__ = ["BATCHED_KINDS"]


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
    """A GEMM operand's cast into float8 (torchao's recipe in a lowered graph, at every format;
    :func:`fxstab.capture.torchao.float8_cast`): the samples rounded into the float8 format,
    each its own draws, and kept in the working dtype (the format's rounding after it, by the
    tracer, leaves them on the float8 grid)."""
    x = call.leaves[0] if call.leaves else None
    fmt = float8_cast(call.plan.node)
    plan, t = call.plan, call.tracer
    if fmt is None or plan.name is None or not isinstance(x, Stacked):
        return None
    if not plan.rounds:  # (unrounded=: an ablation leaves the cast's rounding out too)
        return Outcome(x, ROUNDED, f"float8 cast into {fmt}: unrounded")

    def rounded(leaves: list) -> Stacked:
        return Stacked(round_samples(leaves[0].samples, fmt, t.cfg.rounding,
                                     seed=t.seed(plan, 2100)))

    return Outcome(t.step("float8", plan, rounded, call.leaves), ROUNDED,
                   f"float8 cast: rounded into {fmt}")


@op_rule("scaled_mm")
def scaled_product(call: OpCall) -> Optional[Outcome]:
    """``torch._scaled_mm`` of operands whose float8 casts were analysed (:func:`float8_operand`:
    their samples in the working dtype, on the float8 grid): ``(mat1 * scale_a) @ (mat2 *
    scale_b) * scale_result + bias`` on the samples, in the working dtype (the output dtype is
    the rounding's; the product's sum exact)."""
    t = call.tracer
    a, kw = unflatten_call(call.leaves, call.spec)
    names = ("mat1", "mat2", "scale_a", "scale_b", "bias", "scale_result")
    v = dict(zip(names, a))
    v.update({k: kw[k] for k in names if k in kw})
    x, w = v.get("mat1"), v.get("mat2")
    if not any(isinstance(u, Stacked) and u.samples.dtype == t.wdtype for u in (x, w)):
        return None  # operands cast as the program casts them: the default runs the call

    def working(u: object) -> object:
        """A stacked value's samples with its logical dims padded to the matrices' two (a
        per-sample scale: ``[N] -> [N, 1, 1]``), a plain tensor as it is (it broadcasts)."""
        if isinstance(u, Stacked):
            out = t.to_working(u.samples)
            while out.dim() < 3:
                out = out.unsqueeze(1)
            return out
        return t.to_working(u) if isinstance(u, torch.Tensor) else u

    out = (working(x) * working(v["scale_a"])) @ (working(w) * working(v["scale_b"]))
    if v.get("scale_result") is not None:
        out = out * working(v["scale_result"])
    if v.get("bias") is not None:
        out = out + working(v["bias"])
    return Outcome(Stacked(out), ROUNDED, "scaled matmul of the float8 samples")


@op_rule("addmm", "matmul", "mm")
def lowp(call: OpCall) -> Optional[Outcome]:
    """A product of the samples and a plain weight (a linear, a Conv1D's ``addmm(b, x, W)`` or
    ``x @ W``, a backward graph's ``mm(grad, W)``) in the format's own GEMM kernels (:mod:`fxstab.numerics.lowp_gemm`): one step,
    whether its operands are exact in the format's dtype is known only at run time, else in
    the working dtype."""
    t, plan = call.tracer, call.plan
    fmt = (plan.format or t.fmt).name
    if not t.cfg.lowp_gemm or plan.kind not in LOW_READERS or \
            call.stacked != [LOW_READERS[plan.kind][1]]:
        return None
    ops = as_linear(plan.kind, *unflatten_call(call.leaves, call.spec))
    if ops is None or not lowp_gemm.applies(ops[1], fmt):  # (a weight of the format's dtype:
        return None  # a bf16 model's)
    kind, spec = plan.kind, call.spec  # (not call: a step kept by the sampled graph must not
    # hold the traced call's operands, a linear's samples each)

    def product(leaves: list) -> Stacked:
        x, w, b = as_linear(kind, *unflatten_call(leaves, spec))
        x = t.stack(x)
        out = None if in_vmap_region(x) else \
            t.state.kernel(executors.LOWP_CONVERT, x)(x, w, b, fmt)
        if out is None:  # (a weight kept in the format's dtype: in the working one here)
            out = F.linear(x, t.to_working(w), None if b is None else t.to_working(b))
        return Stacked(t.to_working(out))

    x = call.leaves[call.stacked[0]]
    return Outcome(t.step("gemm", plan, product, call.leaves), ROUNDED,
                   f"batched over the samples ({lowp_gemm.path_name(x.samples.device)})")


def _called(fn: Callable, a: list, kw: dict) -> Any:
    return fn(*a, **kw)


class _Batched(NamedTuple):
    leading: int  # its leading operands, which take the stacked samples directly
    run: Callable[[Callable, list, dict], Any]  # how it runs on them: run(fn, args, kwargs)
    # a rule asked first, on the same operands (a linear's plain weight: the format's GEMMs)
    first: Optional[Callable[[OpCall], Optional[Outcome]]] = None


# Operators that take stacked samples directly in their leading arguments
BATCHED_KINDS: dict[str, _Batched] = {
    "scaled_dot_product_attention": _Batched(3, attention_folded),
    "embedding_dense_backward": _Batched(1, embedding_grad_folded),
    "linear": _Batched(1, _called, first=lowp)}


@op_rule(*sorted(BATCHED_KINDS))
def batched(call: OpCall) -> Optional[Outcome]:
    """Once on the stacked samples (plain leading operands as N identical samples)."""
    k, run, first = BATCHED_KINDS[call.plan.kind]
    if not all(i < k for i in call.stacked):
        return None
    if first is not None:
        done = first(call)
        if done is not None:
            return done
    t = call.tracer
    a, kw = unflatten_call(call.leaves, call.spec)
    a = [t.stack(v) if i < k and isinstance(v, (Stacked, torch.Tensor)) else v
         for i, v in enumerate(a)]
    return Outcome(Stacked(t.to_working(run(call.fn, a, kw))), ROUNDED,
                   "batched over the samples")
