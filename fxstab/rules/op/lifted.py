"""The default rule, for every kind no rule of the table answers: ``torch.vmap`` over the
samples; where vmap fails (no batching rule, a custom operator without one, an operator that
is not batch-transparent), once per sample, remembered per operator; where the operator also
refuses the working dtype (fp64 for an fp32 format), once per sample in the model's dtype."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...capture.flat import unflatten_call
from ...records.report import PER_SAMPLE, ROUNDED, UNLIFTED
from ..lifting import has_vmap_rule, rng_states, set_rng_states
from .per_sample import per_sample_step
from .registry import OpCall, Outcome

__all__ = ["lifted"]


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
