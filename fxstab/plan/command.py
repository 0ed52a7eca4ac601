"""What ``fxstab plan`` does once its options are checked (:func:`run`): the search, its
report, the plan file, the real-run check, and the exit code: 0 met, 1 not met. Warnings are
one clean line each on stderr; bad input is a ``ValueError`` (the CLI's exit 2)."""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any, Optional, Sequence

from .apply import check_plan
from .search import plan_precision

__all__ = ["run", "real_gain"]


def real_gain(check: Any) -> Optional[float]:
    """The true digits the real run gains with the plan (a :class:`~fxstab.plan.apply.PlanCheck`)."""
    before, after = getattr(check, "plain", None), getattr(check, "planned", None)
    if isinstance(before, (int, float)) and isinstance(after, (int, float)):
        return float(after) - float(before)
    return None


def run(model: Any, inputs: Sequence, *, target: str, output: Optional[str],
        apply_check: bool, frontier: bool = False, html: Optional[str] = None,
        **search: Any) -> int:
    """Search a plan (``search``: :func:`plan_precision`'s arguments), print its report
    (with ``frontier`` its digits-against-cost frontier), save it to ``output``, with
    ``apply_check`` measure the real run, write its page to ``html``; returns the exit code.
    The search's progress is a line on stderr."""
    with warnings.catch_warnings(record=True) as said:  # each one clean line, below
        warnings.simplefilter("always")
        plan = plan_precision(model, inputs, progress=True, **search)
    for w in dict.fromkeys(str(w.message).removeprefix("fxstab: ") for w in said
                           if issubclass(w.category, UserWarning)):
        print(f"fxstab plan: warning: {w}", file=sys.stderr)
    plan.settings["target"] = target
    print(plan.report())
    if frontier:
        print(plan.frontier_table())
    if output:
        plan.save(output)
        print(f"saved the plan ({len(plan.promoted)} operators) to {output}")
    check = None
    if apply_check:
        check = check_plan(model, inputs, plan)
        print(check.report(plan))
        gain = real_gain(check)
        expected = plan.settings.get("expected_real")
        if gain is not None and isinstance(expected, list) and len(expected) == 2:
            before, after = expected
            said = f"{after - before:+.2f}" if math.isfinite(before) and \
                math.isfinite(after) else f"{after:.2f} with the plan (NaN/inf without it)"
            print(f"the real run keeps {check.planned:.2f} digits at the outputs with the plan "
                  f"({gain:+.2f}); expected {said} (run digits)")
        if plan.promoted and gain is not None and gain < 0.1:
            print(f"fxstab plan: warning: the real {plan.format} run gains {gain:.2f} digits "
                  f"with the plan (less than 0.1): the analysis's gain does not show in the "
                  f"program as it runs", file=sys.stderr)
    if html:
        from ..plots import html as pages

        pages.write_page(pages.plan_page(plan, check), html)
        print(f"wrote {html}")
    if not plan.met:
        feasible = plan.all_higher
        hint = f" (every operator in {plan.higher} keeps {feasible:.2f}: ask for at most " \
               f"that)" if feasible == feasible and feasible < plan.keep else ""
        print(f"fxstab plan: the plan does not meet --keep {plan.keep}{hint}", file=sys.stderr)
        return 1
    return 0
