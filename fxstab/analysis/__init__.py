"""One captured graph analysed: the plan (which operators are instrumented, their stable names
and edges) made once at compile time, and the analysed call (the deterministic path, then the
stochastic path traced into a sampled graph per input signature).

* :mod:`fxstab.analysis.op_level`: the operator level (:class:`~fxstab.analysis.op_level.GraphAnalysis`).
* :mod:`fxstab.analysis.aten_level`: the arithmetic level (the lowering to aten primitives).
* :mod:`fxstab.analysis.backward`: the backward graph through AOTAutograd (``backward=True``).
* :mod:`fxstab.analysis.composites`: fused fast paths expanded for the samples.
* :mod:`fxstab.analysis.sampled_graph`: the generated stochastic path of one signature.

The modules are imported by name; this package imports none of them.
"""

__all__ = ["op_level", "aten_level", "backward", "composites", "sampled_graph"]
