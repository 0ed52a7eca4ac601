"""What an operator becomes on N stacked samples: the rules, per level (docs/design.md §3).

* :mod:`fxstab.rules.lifting`: the value both levels run on (:class:`~fxstab.rules.lifting.Stacked`),
  the operator level's plans of a node and of a graph (:class:`~fxstab.rules.lifting.NodePlan`,
  :class:`~fxstab.rules.lifting.OpGraph`).
* :mod:`fxstab.rules.op`: the operator level's rules, one table ``OP_RULES[kind]``
  (:mod:`fxstab.rules.op.registry`), and its tracer (:class:`fxstab.rules.op.tracer.SampleTracer`).
* :mod:`fxstab.rules.accumulation`: a GEMM's accumulator and fp8 operands on the samples
  (``accumulate=``, ``gemm_inputs=``).
* :mod:`fxstab.rules.aten`: the arithmetic level's per-primitive rules
  (:func:`~fxstab.rules.aten.apply_primitive`, its context, rounding, batching, counters, the
  decomposition table) and its tracer (:mod:`fxstab.rules.aten.tracer`).

The subpackages are imported by name (``from fxstab.rules.aten import apply_primitive``); this
package imports none of them.
"""

__all__ = ["accumulation", "aten", "lifting", "op"]
