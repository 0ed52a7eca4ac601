"""Operators that compute nothing the format rounds: reads of metadata (``size``, ``dim``...:
on the first sample), an input's ``.item()`` (a constant of the trace), floating casts (the
samples stay in the working dtype: the simulated format is what rounds, not the dtype the
model casts to) and the items of a tuple."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from ...capture.flat import unflatten_call
from ...capture.graph import is_metadata, reads_item
from ...capture.opsets import METADATA_KINDS
from ...records.report import ROUNDED
from ..lifting import Stacked, is_float_cast, reshape
from .registry import ONCE, OpCall, Outcome, op_rule

__all__ = ["CAST_METHODS", "RESHAPE_VIEWS", "on_samples", "in_vmap_region", "unbatched",
           "rebatched"]

# Floating dtype conversions keep the working dtype on the stochastic path: the simulated format
# is what rounds, not the dtype the model happens to cast to.
CAST_METHODS = frozenset({"to", "type", "float", "half", "bfloat16", "double", "type_as"})


# Views whose samples may have to be copied (reshape): the deterministic pass's strides allowed
# the view, the samples' need not.
RESHAPE_VIEWS = frozenset({"view", "unsafe_view"})


def on_samples(kind: str, fn: Callable, leaves: list) -> Callable:
    """What a node's callable ``fn`` becomes on stacked samples: a view is a ``reshape`` (the
    samples' memory layout is not the deterministic pass's: a rounded output is contiguous, a
    per-sample one stacked, so a view of it may need a copy), unless it views a dtype."""
    if kind in RESHAPE_VIEWS and not any(isinstance(v, torch.dtype) for v in leaves):
        return reshape
    return fn


@op_rule("item", samples=False)
def input_scalar(call: OpCall) -> Optional[Outcome]:
    """The value of an input scalar read with ``.item()`` (in the trace's signature): a
    constant of the trace."""
    node = call.plan.node
    if call.stacked or not reads_item(node) or getattr(node.args[0], "op", "") != "placeholder":
        return None
    with disable_proxy_modes_tracing():
        return Outcome(call.args[0].item(), ROUNDED, ONCE)


@op_rule(*sorted(METADATA_KINDS))
def metadata(call: OpCall) -> Optional[Outcome]:
    """Read on the first sample (``x.T`` and other tensor attributes are operators)."""
    if not is_metadata(call.plan.node, call.plan.kind):
        return None
    first = [v.samples[0] if isinstance(v, Stacked) else v for v in call.leaves]
    a, k = unflatten_call(first, call.spec)
    return Outcome(call.fn(*a, **k), ROUNDED, "metadata: read on the first sample")


@op_rule(*sorted(CAST_METHODS))
def floating_cast(call: OpCall) -> Optional[Outcome]:
    """A cast method that keeps a floating tensor floating: the samples as they are, in the
    working dtype."""
    node, x = call.plan.node, call.leaves[0]
    # (an integer tensor cast to floating, a router's expert indices: the cast runs)
    if node.op != "call_method" or not is_float_cast(node, call.leaves) or \
            not (isinstance(x, Stacked) and x.samples.is_floating_point()):
        return None
    return Outcome(x, ROUNDED, "floating cast: kept in the working dtype")


@op_rule("getitem")
def tuple_item(call: OpCall) -> Any:
    """An item of a tuple (an operator's several outputs)."""
    args = call.args
    if not isinstance(args[0], (tuple, list)):
        return None
    return Outcome(args[0][args[1]], ROUNDED, "item of a tuple")


# -- vmap regions dynamo captured (torch.vmap, associative_scan's generic mode, Mamba's scan) --
# The graph calls functorch's own batching: _add_batch_dim(x, in_dim, level) and
# _remove_batch_dim(y, level, batch_size, out_dim) around the batched body. On the samples the
# sample dim leads, so the region's dims shift by one; inside, the samples are batched tensors
# whose logical shape is [N, ...] (the rules see the samples as anywhere else). Batched tensors
# have no storage of their own (a kernel cannot read them): the tracer rounds, measures and
# perturbs a batched value's physical tensor, [N, B, ...] (unbatched), and wraps the result
# back at the same levels (rebatched). Rounding is elementwise, so where B sits is immaterial,
# save that the samples must lead (the antithetic pairs are drawn per element of one sample).

_functorch = torch._C._functorch


def in_vmap_region(t: Any) -> bool:
    """Whether ``t`` is a functorch batched tensor (inside a captured vmap region)."""
    return isinstance(t, torch.Tensor) and _functorch.is_batchedtensor(t)


def unbatched(t: torch.Tensor, at: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The physical tensor under a batched ``t`` (every vmap level unwrapped, the innermost
    first) with each level's batch dim moved to ``at``: 1 for samples ([N, B_outer, ...,
    B_inner, ...]), 0 for a plain tensor; and the levels unwrapped, for :func:`rebatched`.
    A tensor that is not batched comes back as it is, with no level."""
    levels = []
    while in_vmap_region(t):
        level, bdim = _functorch.maybe_get_level(t), _functorch.maybe_get_bdim(t)
        t = _functorch.get_unwrapped(t).movedim(bdim, at)
        levels.append(level)
    return t, tuple(levels)


def rebatched(samples: torch.Tensor, levels: tuple[int, ...]) -> torch.Tensor:
    """Samples ``[N, B_outer, ..., B_inner, ...]`` (:func:`unbatched`'s layout) wrapped back as
    a batched tensor at ``levels`` (its logical shape ``[N, ...]``)."""
    for level in reversed(levels):
        samples = _functorch._add_batch_dim(samples, 1, level)
    return samples


@op_rule("add_batch_dim")
def add_batch_dim(call: OpCall) -> Optional[Outcome]:
    """The region's batch dim added past the sample dim."""
    a, k = unflatten_call(call.leaves, call.spec)
    x = a[0] if a else None
    if not isinstance(x, Stacked) or k or len(a) != 3 or not isinstance(a[1], int):
        return None
    dim = a[1] + 1 if a[1] >= 0 else a[1]
    return Outcome(Stacked(call.fn(x.samples, dim, a[2])), ROUNDED,
                   "vmap region: its batch dim after the sample dim")


@op_rule("remove_batch_dim")
def remove_batch_dim(call: OpCall) -> Optional[Outcome]:
    """The region's batch dim moved back to its place, past the sample dim."""
    a, k = unflatten_call(call.leaves, call.spec)
    x = a[0] if a else None
    if not isinstance(x, Stacked) or k or len(a) != 4 or not isinstance(a[3], int):
        return None
    dim = a[3] + 1 if a[3] >= 0 else a[3]
    return Outcome(Stacked(call.fn(x.samples, a[1], a[2], dim)), ROUNDED,
                   "vmap region: its batch dim after the sample dim")
