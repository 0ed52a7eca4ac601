"""The passes a traced stochastic path goes through, in order, composed by torch.fx's
``PassManager`` (which checks the graph after each pass and names the pass that failed).

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
from torch.fx.passes.infra.pass_manager import PassManager

from .bindings import DirectBindings
from .steps import DropDetach, EliminateDeadCode, LowerSteps, RefuseDynamicShapes

__all__ = ["SampledGraphPasses", "run_sampled_graph_passes"]


class SampledGraphPasses(PassManager):
    """The pipeline, linting the graph after each pass."""

    def __init__(self, bindings: bool = True) -> None:
        passes = [RefuseDynamicShapes(), EliminateDeadCode(), DropDetach(), LowerSteps()]
        if bindings:
            passes.append(DirectBindings())
        super().__init__(passes, steps=1, run_checks_after_each_pass=True)

    def check(self, module: torch.nn.Module) -> None:
        if isinstance(module, torch.fx.GraphModule):
            module.graph.lint()


def run_sampled_graph_passes(gm: torch.fx.GraphModule, bindings: bool = True) -> None:
    """Run the pipeline on ``gm`` in place. A pass that raises (a refused trace) raises a
    ``RuntimeError`` naming the pass and the original error, chained to it."""
    try:
        SampledGraphPasses(bindings)(gm)
    except Exception as exc:  # PassManager wraps the pass's error: say both
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise RuntimeError(f"{exc}: {type(cause).__name__}: {cause}") from cause
