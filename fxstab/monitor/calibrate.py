"""Threshold calibration from clean versus injected-instability scores (docs/design.md §8).

Clean operators of different families disperse differently: in the CPU WikiText-2 experiment
clean softmax S stayed near 0.0013 on the initial model while clean attention-score matmuls
reached 0.0045 and, later in training, 0.0059 (about 1.5 u for bf16). One global threshold
between the clean maximum and the weakest injected operator (0.0068, a naive softmax) left a
margin of x1.2 to the matmul and promoted it; per family the same data separate by x4 or
more. So thresholds are chosen per family, with a global pair for families that calibration
did not see.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

__all__ = ["Calibration", "FamilyCalibration", "choose_thresholds"]


@dataclass(frozen=True)
class FamilyCalibration:
    """Separation and thresholds of one family.

    Attributes:
        family: The family (``fxstab.capture.opsets`` family or a custom op's registered family).
        max_clean: Largest clean dispersion of the family.
        min_injected: Smallest finite injected dispersion of the family (``inf`` when it had
            no injected operator or only non-finite measurements).
        separation: ``min_injected / max_clean`` (``inf`` without finite injected data).
        rule: ``"midpoint"`` (geometric midpoint of the two: equal log-margins), ``"margin"``
            (``margin * max_clean``: no finite injected data, or the two overlap) or
            ``"floor"`` (no finite injected data of its own, and the smallest finite injected
            dispersion of any family is above ``margin * max_clean``).
        tau_warn, tau_safe: The chosen pair.
        n_clean, n_injected: Measurements on each side.
    """

    family: str
    max_clean: float
    min_injected: float
    separation: float
    rule: str
    tau_warn: float
    tau_safe: float
    n_clean: int
    n_injected: int

    def __str__(self) -> str:
        inj = "-" if self.n_injected == 0 else f"{self.min_injected:.3g}"
        sep = "-" if not math.isfinite(self.separation) else f"x{self.separation:.3g}"
        return (f"{self.family:<12} clean max {self.max_clean:.3g} ({self.n_clean}) | injected "
                f"min {inj} ({self.n_injected}) | separation {sep} | {self.rule} -> tau_warn "
                f"{self.tau_warn:.3g}")


@dataclass(frozen=True)
class Calibration:
    """What calibration found and chose.

    Attributes:
        max_clean: Largest dispersion measured on clean operators (all families).
        min_injected: Smallest finite dispersion measured on injected operators (``inf`` when
            every injected measurement overflowed).
        separation: ``min_injected / max_clean`` over all families (the separation a single
            global threshold would have).
        separated: Whether every family with finite injected data separates (> 1); with no
            per-family data, whether the global separation is > 1.
        tau_warn: Global threshold for families calibration did not see: the geometric
            midpoint of ``max_clean`` and ``min_injected`` when they separate, else
            ``margin * max_clean``.
        tau_safe: ``safe_ratio * tau_warn``.
        n_clean, n_injected: How many measurements each side had.
        non_finite_injected: Injected measurements that were non-finite (overflow).
        families: Per-family results (empty when no family function was given).
    """

    max_clean: float
    min_injected: float
    separation: float
    separated: bool
    tau_warn: float
    tau_safe: float
    n_clean: int
    n_injected: int
    non_finite_injected: int
    families: tuple = field(default=())

    @property
    def thresholds(self) -> dict[str, tuple[float, float]]:
        """``{family: (tau_warn, tau_safe)}`` for ``MonitorConfig.thresholds``."""
        return {f.family: (f.tau_warn, f.tau_safe) for f in self.families}

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        head = (f"clean max S {self.max_clean:.3g} | injected min S {self.min_injected:.3g} | "
                f"global separation x{self.separation:.3g} | tau_warn {self.tau_warn:.3g} | "
                f"tau_safe {self.tau_safe:.3g}")
        return "\n".join([head] + [f"  {f}" for f in self.families])


def _values(scores: Any, what: str) -> list[float]:
    if isinstance(scores, Mapping):
        out: list[float] = []
        for v in scores.values():
            out.extend(_values(v, what) if isinstance(v, (list, tuple, Mapping)) else [v])
        return [float(x) for x in out]
    if isinstance(scores, (int, float)):
        return [float(scores)]
    if isinstance(scores, Iterable):
        return [float(x) for x in scores]
    raise ValueError(f"{what} scores must be numbers, a sequence or a mapping of them, "
                     f"got {type(scores).__name__}")


def _by_family(scores: Any, family: Callable[[str], str], what: str) -> dict[str, list[float]]:
    if not isinstance(scores, Mapping):
        raise ValueError(f"per-family calibration needs {what} scores as a mapping operator "
                         f"name -> dispersions (monitor.measurements()), got "
                         f"{type(scores).__name__}")
    out: dict[str, list[float]] = {}
    for name, v in scores.items():
        out.setdefault(family(name), []).extend(_values(v, what))
    return out


def _pair(max_clean: float, min_inj: float, margin: float,
          floor: float = 0.0) -> tuple[float, str]:
    if math.isfinite(min_inj) and min_inj > max_clean:
        return math.sqrt(max_clean * min_inj), "midpoint"
    if floor > margin * max_clean:
        return floor, "floor"
    return margin * max_clean, "margin"


def choose_thresholds(clean: Any, injected: Any, *, safe_ratio: float = 10.0,
                      margin: float = 2.0,
                      family: Optional[Callable[[str], str]] = None) -> Calibration:
    """Choose tau_warn / tau_safe (global and per family) from clean and injected dispersions.

    Per family (when ``family`` is given): the geometric midpoint of the family's clean
    maximum and its smallest finite injected dispersion when the injected one is larger.
    When the family had no injected operator or only non-finite injected measurements (any
    finite threshold catches those): ``margin`` x the clean maximum, but never below the
    smallest finite injected dispersion of any family (rule ``floor``): with nothing of its
    own to separate from, an operator is flagged only when it disperses at least as much as
    the mildest instability calibration saw. (In the WikiText-2 experiment a clean attention
    matmul reached 2.3x the pilot run's maximum on another training seed.) When the family's
    clean and injected data overlap: ``margin`` x the clean maximum. Families with injected
    but no clean data get no entry (the global pair applies).

    Args:
        clean: Dispersions S measured on clean operators (numbers, a sequence, or a mapping
            operator -> sequence, e.g. ``monitor.measurements()`` of a clean run).
        injected: Dispersions measured on the injected operators only.
        safe_ratio: tau_safe / tau_warn (> 1).
        margin: Factor above the clean maximum when there is nothing to separate from (> 1).
        family: Operator name -> family (``fxstab.monitor.ops.op_family``); needs mappings.

    Raises:
        ValueError: empty or non-finite clean scores, or bad ratios.
    """
    if not safe_ratio > 1:
        raise ValueError(f"safe_ratio must be > 1, got {safe_ratio!r}")
    if not margin > 1:
        raise ValueError(f"margin must be > 1, got {margin!r}")
    c = _values(clean, "clean")
    i = _values(injected, "injected")
    if not c or not i:
        raise ValueError(f"calibration needs clean and injected scores, got {len(c)} clean and "
                         f"{len(i)} injected")
    if not all(math.isfinite(x) for x in c):
        raise ValueError("a clean operator produced a non-finite dispersion: the clean run "
                         "overflowed, so it cannot calibrate thresholds")
    max_clean = max(max(c), 1e-30)
    finite = [x for x in i if math.isfinite(x)]
    min_inj = min(finite) if finite else math.inf
    sep = min_inj / max_clean
    tau, _ = _pair(max_clean, min_inj, margin)

    fams: list[FamilyCalibration] = []
    separated = sep > 1
    if family is not None:
        cf, inf_ = _by_family(clean, family, "clean"), _by_family(injected, family, "injected")
        separated = True
        for fam in sorted(cf):
            fc = max(max(cf[fam]), 1e-30) if cf[fam] else None
            if fc is None:
                continue
            fi = [x for x in inf_.get(fam, []) if math.isfinite(x)]
            fmin = min(fi) if fi else math.inf
            t, rule = _pair(fc, fmin, margin, floor=0.0 if fi else min_inj if finite else 0.0)
            if fi and fmin <= fc:
                separated = False
            fams.append(FamilyCalibration(fam, fc, fmin, fmin / fc, rule, t, safe_ratio * t,
                                          len(cf[fam]), len(inf_.get(fam, []))))
    return Calibration(max_clean, min_inj, sep, separated, tau, safe_ratio * tau, len(c),
                       len(i), len(i) - len(finite), tuple(fams))
