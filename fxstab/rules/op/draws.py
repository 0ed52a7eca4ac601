"""Random operators: every sample sees what the deterministic pass drew. Dropout that
multiplies by a mask draws the mask once (on ones) and multiplies every sample by it (its
1/(1-p) scaling then rounds); a dropout that is the identity (eval, ``p=0``) passes the samples
on; every other random draw (alpha dropout, ``rand``, ``bernoulli_``...) runs once per sample
from the deterministic pass's RNG state and in its dtype."""

from __future__ import annotations

from typing import Any

import torch

from ...capture.flat import unflatten_call
from ...capture.graph import identity_dropout
from ...capture.opsets import DROPOUT_KINDS, RANDOM_KINDS
from ...records.report import ROUNDED
from ..lifting import Stacked
from .per_sample import run_per_sample
from .registry import OpCall, Outcome, op_rule

__all__ = ["MASK_DROPOUT_KINDS"]

# Dropout that multiplies by a mask (scaled by 1/(1-p)): the mask is drawn once. Alpha dropout
# is affine in the mask and runs per sample, each sample with the deterministic pass's draws.
MASK_DROPOUT_KINDS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d"})


@op_rule(*sorted(RANDOM_KINDS - MASK_DROPOUT_KINDS), samples=False)
def random_draws(call: OpCall) -> Outcome:
    """Once per sample from the deterministic pass's RNG state, in its dtype: every sample
    draws what it drew."""
    t, plan, fn, spec = call.tracer, call.plan, call.fn, call.spec
    out = t.step("random", plan, lambda lv: run_per_sample(t, fn, lv, spec, plan), call.leaves)
    return Outcome(out, ROUNDED, "random: the deterministic pass's draws in every sample")


@op_rule(*sorted(DROPOUT_KINDS))
def identity(call: OpCall) -> Any:
    """The samples as they are: a dropout with ``training=False`` or ``p=0``."""
    if identity_dropout(call.plan.node, call.plan.kind) and isinstance(call.leaves[0], Stacked):
        return Outcome(call.leaves[0], ROUNDED, "identity: dropout with training=False or p=0")
    return None


@op_rule(*sorted(MASK_DROPOUT_KINDS))
def mask_dropout(call: OpCall) -> Outcome:
    """The deterministic pass's mask on every sample."""
    t, plan, fn, spec = call.tracer, call.plan, call.fn, call.spec

    def dropout(leaves: list) -> Stacked:
        # the mask of the deterministic pass: same RNG state, same shape and dtype, ones as
        # input; the samples are multiplied by it (the 1/(1-p) scaling then rounds)
        det = t.det_dtype(plan)
        first = [torch.ones_like(v.samples[0], dtype=det or v.samples.dtype)
                 if isinstance(v, Stacked) else v for v in leaves]
        a, k = unflatten_call(first, spec)
        k = dict(k)
        if "inplace" in k:
            k["inplace"] = False
        mask = fn(*a, **k)
        x = next(v for v in leaves if isinstance(v, Stacked))
        return Stacked(x.samples * mask.to(x.samples.dtype))

    return Outcome(t.step("dropout", plan, dropout, call.leaves), ROUNDED,
                   "dropout: the deterministic pass's mask on every sample")
