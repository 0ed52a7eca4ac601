"""The passes a traced stochastic path goes through, in order, composed as torch.fx's
``PassManager`` would (the graph linted after each pass, the pass that failed named), with the
code generated once, at the end.

``make_fx`` over the rules leaves a graph whose steps are opaque ``fxstab_step`` nodes; then
:class:`~fxstab.passes.steps.RefuseDynamicShapes` refuses a trace whose shapes follow the
values, :class:`~fxstab.passes.steps.EliminateDeadCode` and
:class:`~fxstab.passes.steps.DropDetach` clean it, :class:`~fxstab.passes.steps.LowerSteps`
makes each step a direct call, and :class:`~fxstab.passes.bindings.DirectBindings` calls each
aten operator through torch's own binding (not for a graph fed a tensor subclass, whose
``__torch_function__`` the bindings would call again).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassResult

from .bindings import DirectBindings
from .steps import (DropDetach, EliminateDeadCode, LowerSteps, RefuseDynamicShapes,
                    deferred_recompile)

__all__ = ["SampledGraphPasses", "run_sampled_graph_passes"]


class SampledGraphPasses:
    """The pipeline: each pass in order, the graph linted after each, a pass that raises named
    with the passes before it (as torch.fx's ``PassManager`` does), and the code generated
    once at the end (``PassManager`` regenerates it after every pass, and each of these
    passes after changing the graph: ten generations of a model's graph, ~0.3 s of a 4-layer
    1.1B-shaped model's trace)."""

    def __init__(self, bindings: bool = True) -> None:
        self.passes = [RefuseDynamicShapes(), EliminateDeadCode(), DropDetach(), LowerSteps()]
        if bindings:
            self.passes.append(DirectBindings())

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        gm.graph.lint()
        modified = False
        with deferred_recompile():
            for i, p in enumerate(self.passes):
                try:
                    modified = p(gm).modified or modified
                    gm.graph.lint()
                except Exception as exc:
                    before = [type(q).__name__ for q in self.passes[:i]]
                    raise RuntimeError(f"An error occurred when running the "
                                       f"'{type(p).__name__}' pass after the following "
                                       f"passes: {before}") from exc
        if modified:
            gm.recompile()
        return PassResult(gm, modified)


def run_sampled_graph_passes(gm: torch.fx.GraphModule, bindings: bool = True) -> None:
    """Run the pipeline on ``gm`` in place. A pass that raises (a refused trace) raises a
    ``RuntimeError`` naming the pass and the original error, chained to it."""
    try:
        SampledGraphPasses(bindings)(gm)
    except Exception as exc:  # the pipeline names the pass: say both
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise RuntimeError(f"{exc}: {type(cause).__name__}: {cause}") from cause
