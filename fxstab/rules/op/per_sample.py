"""Operators run once per sample: those whose samples must not share batch statistics
(BatchNorm, InstanceNorm: their in-place running statistics cannot be batched either) and
recurrent layers (no vmap rule for ``aten::lstm`` & co.); :func:`run_per_sample` is also the
fallback of the default rule and what random operators run."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree

from ...capture.flat import unflatten_call
from ...capture.opsets import RANDOM_KINDS, RNN_KINDS
from ...records.report import ROUNDED
from ..lifting import Stacked, rng_states, set_rng_states
from .registry import OpCall, Outcome, op_rule

__all__ = ["run_per_sample", "per_sample_step", "PER_SAMPLE_KINDS"]

# Run per sample: BatchNorm/InstanceNorm in training mode must not mix the samples' statistics,
# and their in-place running-stat updates cannot be batched.
PER_SAMPLE_KINDS = frozenset({"batch_norm", "instance_norm"})


def run_per_sample(tracer: Any, fn: Callable, leaves: list, spec: Any,
                   plan: Optional[Any] = None, dtype: Optional[torch.dtype] = None) -> Any:
    """Run ``fn`` once per sample and stack the results as they come: each sample's output
    is copied into its slot and freed, so the peak holds one stacked output, not two.

    Every sample starts from the RNG state the operator found, so an operator that draws
    random numbers (inter-layer dropout of an LSTM, a custom kernel) draws the same ones in
    every sample, those of the deterministic pass; the state afterwards is the one a single
    call leaves. Random operators run in the deterministic pass's dtype."""
    merged: list = []
    out_spec = None
    states = rng_states(())
    random = plan is not None and plan.kind in RANDOM_KINDS
    det = dtype or (tracer.det_dtype(plan) if random else None)
    n = tracer.n
    if not any(isinstance(v, Stacked) for v in leaves):  # a random draw from plain values
        a, kw = unflatten_call([v.to(det) if det is not None and isinstance(v, torch.Tensor)
                                and v.is_floating_point() else v for v in leaves], spec)
        return pytree.tree_map(lambda t: tracer.to_working(t) if isinstance(t, torch.Tensor)
                               else t, fn(*a, **kw))
    for k in range(n):
        set_rng_states(states)
        sample = [v.samples[k] if isinstance(v, Stacked) else v for v in leaves]
        if det is not None:
            sample = [v.to(det) if isinstance(v, torch.Tensor) and v.is_floating_point()
                      else v for v in sample]
        a, kw = unflatten_call(sample, spec)
        flat, out_spec = pytree.tree_flatten(fn(*a, **kw))
        if k == 0:
            merged = [torch.empty((n, *v.shape), dtype=v.dtype, device=v.device)
                      if isinstance(v, torch.Tensor) else v for v in flat]
        for slot, v in zip(merged, flat):
            if isinstance(v, torch.Tensor):
                slot[k].copy_(v)
        del flat
    merged = [Stacked(tracer.to_working(v)) if isinstance(v, torch.Tensor) else v
              for v in merged]
    return pytree.tree_unflatten(merged, out_spec)


def per_sample_step(call: OpCall, dtype: Optional[torch.dtype] = None) -> Any:
    """:func:`run_per_sample` of a call as one step of the generated graph (it runs at every
    call: random numbers and per-sample loops are not traced)."""
    t, plan, fn, spec = call.tracer, call.plan, call.fn, call.spec
    return t.step("per_sample", plan,
                  lambda lv: run_per_sample(t, fn, lv, spec, plan, dtype=dtype), call.leaves)


@op_rule(*sorted(PER_SAMPLE_KINDS))
def batch_statistics(call: OpCall) -> Outcome:
    """Once per sample: the samples must not share batch statistics."""
    return Outcome(per_sample_step(call), ROUNDED,
                   "per sample: samples must not share batch statistics")


@op_rule(*sorted(RNN_KINDS))
def recurrent(call: OpCall) -> Outcome:
    """Once per sample, each with the deterministic pass's RNG state (its dropout masks): no
    vmap rule for recurrent layers."""
    return Outcome(per_sample_step(call), ROUNDED,
                   "per sample: no vmap rule for recurrent layers (deterministic pass's dropout)")
