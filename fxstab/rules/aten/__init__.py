"""Per-primitive rules of the arithmetic level (DESIGN.md §3 ``aten``, §4, §5).

One function, :func:`apply_primitive`, runs one aten primitive on stacked samples and applies
every rule of the arithmetic level to it; the eager driver (:mod:`fxstab.eager.stochastic`) and the
backend's graph walk (``granularity="aten"``, :class:`fxstab.analysis.aten_level.AtenTracer`, traced
once per signature into a generated graph) both call it, primitive by primitive:

* Arguments that carry samples are :class:`Stacked` (a tensor ``[N, ...]`` plus cached per-element
  digits); everything else (plain tensors, numbers, lists, dtypes) is unstacked and broadcast
  across samples. Floating plain tensors are exact data: identical samples.
* The primitive runs on all samples at once: pointwise primitives directly (ranks aligned),
  common views, reductions and GEMMs by shifting their dimension arguments, the rest through
  ``torch.vmap``; a primitive that cannot be batched runs once per sample, unrounded, and its
  record says ``unlifted``. Integer and boolean results pass through unrounded.
* Every floating result of an arithmetic primitive is rounded into the format (``random``
  rounding by default, one seed per call from :func:`fxstab.numerics.randbits.derive_seed`) and its digit
  statistics are recorded. Data movement and selection primitives (views, cat, index, neg, abs,
  max/min, where...) are exact: not rounded, not recorded, but their counters run.
* GEMM-like primitives (mm, bmm, addmm, baddbmm, convolution, SDPA kernels) are trusted: stacked
  operands whose samples are insufficiently separated get the data-perturbation surrogate with
  eta = the format's unit roundoff, then the product is rounded; the record says ``surrogate``.
  Plain operands (weights, constants) are not perturbed: perturbing one operand of a product by a
  relative eta already moves each output by eta times its condition-weighted magnitude, which is
  what the surrogate exists to expose, and it halves the cost.
* Comparisons follow CESTAC (CADNA's semantics): they return one *plain* boolean tensor decided
  on the samples' mean difference, ``a == b`` when ``a - b`` is an exact or computational zero,
  ``a < b`` when the mean difference is negative and not a computational zero, ``a <= b`` when
  it is negative or a computational zero. Every sample then takes the same branch, as in CADNA's
  synchronous arithmetic, and a computational-zero difference counts as unstable branching.
* CADNA's counters (:mod:`fxstab.records.counters`) are computed from the per-element digits the rules
  already have.

Randomness and speed: the rounding directions and the surrogate's factors are the Philox streams
of :mod:`fxstab.numerics.randbits`, the same bits as :func:`fxstab.numerics.rounding.round_samples` and
:func:`fxstab.numerics.surrogate.perturb_samples`. On CPU fp32/fp64 samples the fused kernels of
:mod:`fxstab.cpu.bindings` round and measure each output in one pass (``kernels="torch"`` uses the
references instead, for the same bits). Per-element digits are measured only where a counter
reads them; the other masks (computational zeros, finiteness...) are derived on first use.

The modules, in the order a primitive meets them: :mod:`.kinds` (what each primitive is: op
classes, :func:`op_info`), :mod:`.stacked` (the samples and their :class:`Analysis`),
:mod:`.context` (:class:`AtenContext`, :class:`PrimitiveRecord`), :mod:`.batching` (running a
primitive on all samples), :mod:`.rounding` (rounding into the format and measuring),
:mod:`.counters` (CADNA's counters), :mod:`.apply` (:func:`apply_primitive`, the rule), and
:mod:`.decompositions` (the composite operators both drivers lower into primitives).
"""

from .apply import apply_primitive, observe, to_op_report
from .context import AtenContext, PrimitiveRecord
from .decompositions import DECOMPOSED, decompositions
from .kinds import (
    EXACT_PRIMITIVES, GEMM_PRIMITIVES, OUTPUT_DIGITS_KINDS, OpInfo, op_info, operand_needs,
    primitive_kind,
)
from .rounding import round_stacked
from ..lifting import Stacked
from .measure import Analysis

__all__ = ["Stacked", "Analysis", "AtenContext", "PrimitiveRecord", "apply_primitive",
           "round_stacked", "primitive_kind", "op_info", "OpInfo", "GEMM_PRIMITIVES",
           "EXACT_PRIMITIVES", "observe", "operand_needs", "OUTPUT_DIGITS_KINDS", "to_op_report",
           "decompositions", "DECOMPOSED"]
