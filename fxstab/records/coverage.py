"""How each operator of the captured graphs ran on the samples (docs/design.md §3, coverage).

Every call node of an analysed graph gets one :class:`CoverageEntry`:

* ``analysed``: its floating (or complex) output was rounded into the format and recorded; the
  reason says how it ran on the samples (``vmap``, ``elementwise on the stacked samples``,
  ``per sample: no vmap rule (...)``, ``once: no operand carries samples``...).
* ``unrounded``: it ran on the samples but its output was neither rounded nor recorded (not
  selected; a failure inside the operator's analysis).
* ``skipped``: nothing to analyse (no floating output, metadata, identity dropout in eval, a
  fused operator whose composite ran instead) or the graph's stochastic path failed.

The *coverage* is the fraction of the floating operators that were analysed. Exact data
movement (views, concatenation, copies: :data:`fxstab.capture.opsets.EXACT_KINDS`) left unselected and
random draws are not counted: they cannot lose digits. ``fxstab record`` warns below
:data:`WARN_BELOW`; the digit map keeps :meth:`Coverage.as_dict` as ``metadata["coverage"]``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

ANALYSED = "analysed"
UNROUNDED = "unrounded"
SKIPPED = "skipped"
HOWS = (ANALYSED, UNROUNDED, SKIPPED)

# fxstab record warns when less than this fraction of the floating operators was analysed
WARN_BELOW = 0.9


@dataclass
class CoverageEntry:
    """How one operator (a call node of one captured graph) ran in the latest analysed call.

    ``operator`` is the stable report name for instrumented operators, else
    ``module.path/kind`` (not unique: unselected operators are not numbered). ``counted``:
    whether the entry counts in the coverage fraction (a floating output that could lose
    digits)."""

    operator: str
    kind: str
    how: str
    reason: str
    graph: int = 0
    node: str = ""
    floating: bool = False
    counted: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Coverage:
    """The coverage of one backend's graphs (``be.coverage()``)."""

    entries: list = field(default_factory=list)

    # -- views ----------------------------------------------------------------------------
    def of(self, how: str) -> list:
        return [e for e in self.entries if e.how == how]

    @property
    def analysed(self) -> list:
        return self.of(ANALYSED)

    @property
    def unrounded(self) -> list:
        return self.of(UNROUNDED)

    @property
    def skipped(self) -> list:
        return self.of(SKIPPED)

    @property
    def counted(self) -> list:
        return [e for e in self.entries if e.counted]

    @property
    def fraction(self) -> Optional[float]:
        """Analysed / counted floating operators (None when nothing is counted)."""
        counted = self.counted
        if not counted:
            return None
        return sum(e.how == ANALYSED for e in counted) / len(counted)

    def per_sample(self) -> list:
        """Analysed operators that ran once per sample (no vmap rule)."""
        return [e for e in self.analysed if e.reason.startswith("per sample")]

    # -- rendering ------------------------------------------------------------------------
    def as_dict(self) -> dict:
        return coverage_dict(self.entries)

    def table(self, limit: int = 20) -> str:
        return "\n".join(coverage_lines(self.as_dict(), limit=limit))

    def __str__(self) -> str:  # pragma: no cover - convenience
        return self.table()

    def __repr__(self) -> str:
        frac = self.fraction
        share = "nothing counted" if frac is None else (
            f"{sum(e.how == ANALYSED for e in self.counted)} of {len(self.counted)} floating "
            f"operators analysed ({100 * frac:.0f}%)")
        return (f"Coverage({share}, {len(self.unrounded)} unrounded, {len(self.skipped)} "
                f"skipped)")

    def _repr_html_(self) -> Optional[str]:
        """Jupyter's display: the map page's coverage section
        (:func:`fxstab.plots.notebook.coverage_fragment`)."""
        from . import display

        return display.html(self)


def coverage_dict(entries: list) -> dict:
    """The JSON form (digit-map metadata): counts, the fraction and every entry."""
    counted = [e for e in entries if e.counted]
    analysed = sum(e.how == ANALYSED for e in counted)
    return {
        "fraction": (analysed / len(counted)) if counted else None,
        "counted": len(counted),
        "analysed": sum(e.how == ANALYSED for e in entries),
        "per_sample": sum(e.how == ANALYSED and e.reason.startswith("per sample")
                          for e in entries),
        "unrounded": sum(e.how == UNROUNDED for e in entries),
        "skipped": sum(e.how == SKIPPED for e in entries),
        "operators": [e.as_dict() for e in entries],
    }


def coverage_lines(cov: Any, limit: int = 20) -> list:
    """Human-readable lines of a coverage dict (``metadata["coverage"]``)."""
    if not isinstance(cov, dict):
        return []
    ops = [o for o in cov.get("operators", []) if isinstance(o, dict)]
    frac = cov.get("fraction")
    head = (f"coverage: {cov.get('analysed', 0)} operators analysed"
            f" ({cov.get('per_sample', 0)} of them per sample), {cov.get('unrounded', 0)} run "
            f"unrounded, {cov.get('skipped', 0)} skipped")
    if frac is not None:
        head += (f"; {100 * frac:.1f}% of the {cov.get('counted', 0)} floating operators "
                 f"analysed")
    lines = [head]
    for how in (UNROUNDED, SKIPPED):
        reasons = Counter(o.get("reason", "") for o in ops if o.get("how") == how
                          and (how == UNROUNDED or o.get("floating")))
        for reason, n in reasons.most_common(limit):
            names = [o.get("operator", "") for o in ops
                     if o.get("how") == how and o.get("reason", "") == reason]
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            lines.append(f"  {how}: {n} x {reason} ({shown})")
    per = [o for o in ops if o.get("how") == ANALYSED
           and str(o.get("reason", "")).startswith("per sample")]
    for o in per[:limit]:
        lines.append(f"  analysed {o.get('reason')}: {o.get('operator')}")
    return lines


__all__ = ["ANALYSED", "UNROUNDED", "SKIPPED", "HOWS", "WARN_BELOW", "CoverageEntry",
           "Coverage", "coverage_dict", "coverage_lines"]
