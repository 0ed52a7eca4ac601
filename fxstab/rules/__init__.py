"""What an operator becomes on N stacked samples: the rules, per level (DESIGN.md §3).

* :mod:`fxstab.rules.lifting`: the value both levels run on (:class:`~fxstab.rules.lifting.Stacked`),
  the operator level's plan of a node (:class:`~fxstab.rules.lifting.NodePlan`) and its lifting
  decisions (batched, elementwise, per sample, vmap).
* :mod:`fxstab.rules.op_level`: the operator level's tracer (:class:`SampleTracer`).
* :mod:`fxstab.rules.accumulation`: a GEMM's accumulator and fp8 operands on the samples
  (``accumulate=``, ``gemm_inputs=``).
* :mod:`fxstab.rules.aten`: the arithmetic level's per-primitive rules
  (:func:`~fxstab.rules.aten.apply_primitive`, its context, rounding, batching, counters, the
  decomposition table) and its tracer (:mod:`fxstab.rules.aten.tracer`).

The subpackages are imported by name (``from fxstab.rules.aten import apply_primitive``); this
package imports none of them.
"""

__all__ = ["accumulation", "aten", "lifting", "op_level"]
