"""Graph passes of the stochastic path (docs/compiled-path.md).

At the second analysed call per input signature, :mod:`fxstab.analysis.sampled_graph` traces the
stochastic rules (of the operator level, :class:`fxstab.rules.op_level.SampleTracer`; of the
arithmetic level, :class:`fxstab.rules.aten.tracer.AtenTracer`) with ``make_fx`` into one
``fx.GraphModule`` over the N samples; :mod:`fxstab.passes.steps` holds the nodes that run
fxstab's own code in it (rounding and recording, counters, the GEMM surrogate, per-sample
operators) and the passes that check the traced graph (no value-dependent shapes), clean it
(dead code) and lower those nodes to direct calls; :mod:`fxstab.passes.bindings` calls each aten
operator through the torch binding that makes exactly its call; :mod:`fxstab.passes.pipeline`
composes them (linted after each pass, the code generated once at the end).
"""

from .bindings import DirectBindings
from .pipeline import SampledGraphPasses, run_sampled_graph_passes
from .steps import (DropDetach, EliminateDeadCode, LowerSteps, RefuseDynamicShapes, Step, emit,
                    is_step, tracing)

__all__ = ["DirectBindings", "DropDetach", "EliminateDeadCode", "LowerSteps",
           "RefuseDynamicShapes", "SampledGraphPasses", "Step", "emit", "is_step", "run_sampled_graph_passes",
           "tracing"]
