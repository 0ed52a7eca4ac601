"""The default rule, for every kind no rule of the table answers: ``torch.vmap`` over the
samples; where vmap fails (no batching rule, a custom operator without one, an operator that
is not batch-transparent), once per sample, remembered per operator; where the operator also
refuses the working dtype (fp64 for an fp32 format), once per sample in the model's dtype.

And what the tracer does when any rule raises (:func:`isolated`): that operator alone falls
back, once per sample, else once on the first sample's operands broadcast to every sample
(not rounded: its coverage says ``unrounded`` with the exception), so one operator never sinks
the analysis of its graph."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...capture.flat import unflatten_call
from ...records.report import PER_SAMPLE, ROUNDED, UNLIFTED
from ..lifting import Stacked, has_vmap_rule, rng_states, set_rng_states
from .per_sample import per_sample_step
from .registry import OpCall, Outcome

__all__ = ["lifted", "isolated"]


def lifted(call: OpCall) -> Outcome:
    """vmap over the samples, else once per sample: (output, status, how it ran)."""
    t, plan, leaves, spec, stacked, fn = (call.tracer, call.plan, call.leaves, call.spec,
                                          call.stacked, call.fn)
    unlifted, in_model_dtype = t.g.unlifted, t.g.in_model_dtype
    key = plan.name or plan.node.name
    if plan.custom and key not in unlifted and not has_vmap_rule(plan.node.target):
        unlifted[key] = "custom operator without a vmap rule"
    if key not in unlifted:
        holder: list = []

        def one(*ts: Any) -> tuple:
            new = list(leaves)
            for i, x in zip(stacked, ts):
                new[i] = x
            a, k = unflatten_call(new, spec)
            # vmap returns tensors only: the other leaves (None, numbers) go around it
            flat, out_spec = pytree.tree_flatten(fn(*a, **k))
            where = [j for j, v in enumerate(flat) if isinstance(v, torch.Tensor)]
            holder[:] = [flat, out_spec, where]
            return tuple(flat[j] for j in where)

        states = rng_states(())
        try:
            outs = torch.vmap(one, randomness="error")(*[leaves[i].samples for i in stacked])
            flat, out_spec, where = holder
            flat = list(flat)
            for j, x in zip(where, outs):
                flat[j] = x
            return Outcome(t.wrap_out(pytree.tree_unflatten(flat, out_spec)), ROUNDED, "vmap")
        except Exception as exc:  # not batch-transparent: fall back to per-sample
            set_rng_states(states)  # a random operator may have drawn before failing
            unlifted[key] = (f"vmap: {type(exc).__name__}: "
                             f"{(str(exc).splitlines() or [''])[0][:200]}")
    status = PER_SAMPLE if plan.name is not None else UNLIFTED
    det = t.det_dtype(plan)
    if key not in in_model_dtype:
        try:
            return Outcome(per_sample_step(call), status, f"per sample ({unlifted[key]})")
        except Exception as exc:
            if det is None or det == t.wdtype:
                raise
            in_model_dtype[key] = f"{type(exc).__name__}: {str(exc)[:160]}"
    # the operator refuses the working dtype (fp64 for an fp32 format, say): its samples run in
    # the model's dtype, then return to the working dtype
    return Outcome(per_sample_step(call, det), status,
                   f"per sample in {str(det).replace('torch.', '')} ({unlifted[key]}; the "
                   f"working dtype: {in_model_dtype[key]})")


def isolated(call: OpCall, exc: Exception) -> Outcome:
    """The outcome of an operator whose rule raised ``exc`` (no batching rule and no way to
    run per sample, a dtype the operator refuses, an in-place update vmap cannot express):
    once per sample from the deterministic pass's RNG state, else once on the first sample's
    operands with the result broadcast to every sample (status ``unlifted``: measured, not
    rounded). The reason quotes the exception."""
    t, plan = call.tracer, call.plan
    why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
    t.g.unlifted.setdefault(plan.name or plan.node.name, f"its rule failed ({why})")
    if call.stacked:
        try:
            return Outcome(per_sample_step(call), PER_SAMPLE if plan.name is not None else
                           UNLIFTED, f"per sample (its rule failed: {why})")
        except Exception as again:  # noqa: BLE001 - once, on the first sample
            why = f"{why}; per sample: {type(again).__name__}: " \
                  f"{(str(again).splitlines() or [''])[0][:120]}"
    fn, spec, n = call.fn, call.spec, t.n

    def once(leaves: list) -> Any:
        first = [v.samples[0] if isinstance(v, Stacked) else v for v in leaves]
        a, k = unflatten_call(first, spec)
        return pytree.tree_map(
            lambda v: Stacked(t.to_working(v).unsqueeze(0).expand(n, *v.shape))
            if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
            else v, fn(*a, **k))

    return Outcome(t.step("once", plan, once, call.leaves), UNLIFTED,
                   f"once on the first sample, broadcast, not rounded (its rule failed: {why})")
