"""The operator level's rules as a table: how a torch-level operator of each kind runs on N
stacked samples (``OP_RULES[kind]``), as JAX's ``primitive_batchers`` holds a batching rule per
primitive.

A rule is registered next to its code with :func:`op_rule`; the tracer
(:class:`fxstab.rules.op.tracer.SampleTracer`) looks a node's kind up in :data:`OP_RULES` and
runs its rules in registration order until one returns an :class:`Outcome`:

1. the rules that run whatever the operands (``samples=False``: random draws, an input's
   ``.item()``),
2. no operand carries samples: the operator runs once on the plain values
   (:data:`ONCE`: "once: no operand carries samples"),
3. the rules that need samples (``samples=True``, the default),
4. no rule answered: the default, :func:`fxstab.rules.op.lifted.lifted` (``vmap`` over the
   samples, else once per sample).

So "how is a softmax analysed?" has one answer: ``OP_RULES.get("softmax")`` (none: the
default), and ``describe("linear")`` lists the rules of a kind with what each does. What every
operator shares (the GEMM surrogate before a product, rounding and measuring the selected
operators' outputs, the coverage note) is the tracer's, not a rule's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Protocol

import torch

from ...config import AnalysisConfig
from ...numerics.formats import Format
from ...records.run import RunState
from ..lifting import NodePlan, OpGraph

__all__ = ["OpCall", "Outcome", "OpRule", "OP_RULES", "op_rule", "rules_for", "describe", "ONCE",
           "Tracer"]


class Tracer(Protocol):
    """What a rule may use of the tracer that calls it
    (:class:`fxstab.rules.op.tracer.SampleTracer`, which imports this table: the registry
    names the tracer's side of the boundary instead of importing it)."""

    g: OpGraph  # the graph's decisions (what vmap does not lift, what runs in the model's dtype)
    state: RunState
    cfg: AnalysisConfig
    fmt: Format  # the analysis's format
    wdtype: torch.dtype  # the working dtype of the samples
    n: int  # the samples
    acc_errors: dict  # GEMM plan index -> its modelled accumulator's figures

    def seed(self, plan: NodePlan, purpose: int) -> int: ...

    def to_working(self, t: torch.Tensor) -> torch.Tensor: ...

    def stack(self, v: Any) -> torch.Tensor: ...

    def step(self, what: str, plan: NodePlan, fn: Callable[[list], Any], leaves: list) -> Any: ...

    def det_dtype(self, plan: NodePlan) -> Optional[torch.dtype]: ...

    def wrap_out(self, out: Any) -> Any: ...


@dataclass(slots=True)
class OpCall:
    """One call of an operator on the samples, as a rule receives it.

    ``leaves`` are the call's flattened arguments (``args`` and ``kwargs``,
    :func:`fxstab.capture.flat.flatten_call`, rebuilt with ``spec``): a
    :class:`~fxstab.rules.lifting.Stacked` where a value carries samples; ``stacked`` their
    positions; ``fn`` the callable the node calls (a custom operator's implementation, a
    ``reshape`` for a view of samples); ``args`` the node's arguments as the environment holds
    them; ``tracer`` the :class:`~fxstab.rules.op.tracer.SampleTracer` whose helpers
    (:class:`Tracer`: ``step``, ``wrap_out``, ``to_working``, ``det_dtype``...) the rule
    calls; ``plan`` the node's."""

    tracer: Tracer
    plan: NodePlan
    fn: Callable
    args: tuple
    leaves: list
    spec: Any
    stacked: list


class Outcome(NamedTuple):
    """What a rule made of a call: the outputs (:class:`~fxstab.rules.lifting.Stacked` where
    they carry samples), the status of its reports and how it ran (the coverage's reason)."""

    out: Any
    status: str
    how: str


@dataclass(frozen=True)
class OpRule:
    """One rule: ``run(call) -> Outcome`` or None (it does not apply to this call: the next
    rule of the kind, then the default, is asked)."""

    name: str
    run: Callable[[OpCall], Optional[Outcome]]
    samples: bool  # asked only when an operand carries samples
    doc: str


OP_RULES: dict[str, tuple[OpRule, ...]] = {}
"""kind -> its rules, in the order they are asked."""

ONCE = "once: no operand carries samples"


def op_rule(*kinds: str, samples: bool = True) -> Callable:
    """Register the decorated ``run(call) -> Outcome | None`` as a rule of every kind in
    ``kinds`` (after the rules already registered for it). ``samples=False``: asked even when
    no operand carries samples."""
    if not kinds:
        raise ValueError("op_rule needs at least one operator kind")

    def register(run: Callable[[OpCall], Optional[Outcome]]) -> Callable:
        doc = (run.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        rule = OpRule(run.__name__, run, samples, doc)
        for kind in kinds:
            OP_RULES[kind] = OP_RULES.get(kind, ()) + (rule,)
        return run

    return register


_NONE: tuple = ()


def rules_for(kind: str) -> tuple[OpRule, ...]:
    """The rules registered for ``kind`` (empty: the default alone)."""
    return OP_RULES.get(kind, _NONE)


def describe(kind: str) -> str:
    """How an operator of ``kind`` runs on the samples, one line per rule, then the default."""
    lines = [f"{r.name} ({'any operands' if not r.samples else 'samples'}): {r.doc}"
             for r in rules_for(kind)]
    return "\n".join(lines + ["default: lifted (vmap over the samples, else once per sample)"])
