"""Precision plans: from the verdict to the fix (docs/precision-plan.md).

:func:`plan_precision` finds the cheapest operators to keep in a higher format so that the
model's outputs keep the digits they need (the analysis with per-operator formats decides),
:class:`PrecisionPlan` holds the answer and its JSON file, :func:`apply_plan` runs a model with
the plan for real and :func:`check_plan` measures that run against fp64; :class:`CostModel`
prices a plan.
"""

from .apply import PlanBackend, PlanCheck, apply_plan, check_plan
from .cost import CostModel
from .record import PlanError, PrecisionPlan
from .search import plan_precision

__all__ = ["plan_precision", "PrecisionPlan", "PlanError", "apply_plan", "PlanBackend",
           "check_plan", "PlanCheck", "CostModel"]
