"""Per-primitive rules of the arithmetic level (docs/design.md §3 ``aten``, §4, §5).

One function, :func:`apply_primitive`, runs one aten primitive on stacked samples and applies
every rule of the arithmetic level to it; the eager driver (:mod:`fxstab.eager.stochastic`) and
the backend (``granularity="aten"``: :class:`fxstab.rules.aten.tracer.AtenTracer` over the
lowering :class:`fxstab.analysis.aten_level.AtenGraphAnalysis` makes, traced once per signature
into a generated graph) both call it, primitive by primitive:

* Arguments that carry samples are :class:`~fxstab.rules.lifting.Stacked` (a tensor ``[N, ...]``
  and what was measured of it); everything else (plain tensors, numbers, lists, dtypes) is
  unstacked and broadcast across samples: floating plain tensors are exact data.
* The primitive runs on all samples at once (:func:`.batching.run_batched`): pointwise
  primitives directly (ranks aligned), hot views, reductions, softmax and GEMMs by their batcher
  in the table :data:`.batching.BATCHERS`, the rest through ``torch.vmap``; a primitive that
  cannot be batched runs once per sample (rounded in the backend, status ``per_sample``;
  unrounded in the eager driver, status ``unlifted``). Integer and boolean results pass
  through unrounded.
* Every floating result of an arithmetic primitive is rounded into the format (``random`` by
  default, one seed per primitive and call from :func:`fxstab.numerics.randbits.derive_seed`)
  and its digit statistics are recorded. Data movement and selection primitives (views, cat,
  index, neg, abs, max/min, where...: the rows of the exact and layout paths) are exact: not
  rounded, not recorded, but their counters run.
* GEMM-like primitives (the rows of the gemm path) are trusted: stacked operands whose
  samples are insufficiently separated get the data-perturbation surrogate with eta =
  ``data_perturbation_threshold`` (the format's unit roundoff by default), then the product is
  rounded; the record says ``surrogate``. Plain operands (weights, constants) are not perturbed.
* Comparisons follow CESTAC (CADNA's semantics): one *plain* boolean tensor decided on the
  samples' mean difference (``a == b`` when ``a - b`` is an exact or computational zero); a
  computational-zero difference counts as unstable branching.
* CADNA's counters (:mod:`.counters`, :mod:`fxstab.records.counters`) read the per-element
  digits and masks the rules already have.

The settings are :class:`.context.AtenContext`'s, made from an
:class:`~fxstab.config.AnalysisConfig` (the one validated config); the kernel that rounds is
chosen by :mod:`fxstab.executors` (the fused CPU kernels of :mod:`fxstab.cpu.bindings`, or the
plain-torch references: the same Philox bits).

What the rules do with a primitive of each kind is its row of one table,
:data:`.primitives.PRIMITIVES` (:class:`.primitives.PrimitiveRule`: its path, exactness,
counters, what they read, its batcher; ``describe_primitive("add")`` says it in words): a new
primitive is one :func:`.primitives.primitive` entry.

The modules, in the order a primitive meets them: :mod:`.primitives` (the table), :mod:`.kinds`
(what each primitive is: the rows without code, :func:`op_info`), :mod:`.measure` (:class:`Analysis`: what is measured of samples),
:mod:`.context` (:class:`AtenContext`, :class:`PrimitiveRecord`), :mod:`.batching` (running a
primitive on all samples), :mod:`.rounding` (rounding into the format and measuring),
:mod:`.counters` (CADNA's counters), :mod:`.apply` (:func:`apply_primitive`, the rule),
:mod:`.decompositions` (the composite operators both drivers lower into primitives) and
:mod:`.tracer` (the backend's tracer over a lowered graph).
"""

from .apply import apply_primitive, observe, to_op_report
from .context import AtenContext, PrimitiveRecord
from .decompositions import DECOMPOSED, decompositions
from .kinds import GEMM_PRIMITIVES, OpInfo, op_info, operand_needs, primitive_kind
from .primitives import PRIMITIVES, PrimitiveRule, describe_primitive, primitive, rule_of
from .rounding import round_stacked
from ..lifting import Stacked
from .measure import Analysis

__all__ = ["Stacked", "Analysis", "AtenContext", "PrimitiveRecord", "apply_primitive",
           "round_stacked", "primitive_kind", "op_info", "OpInfo", "GEMM_PRIMITIVES",
           "observe", "operand_needs", "to_op_report", "decompositions", "DECOMPOSED",
           "PRIMITIVES", "PrimitiveRule", "primitive", "rule_of", "describe_primitive"]
