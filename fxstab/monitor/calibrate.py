"""Threshold calibration from clean versus injected-instability scores (DESIGN.md §8)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

__all__ = ["Calibration", "choose_thresholds"]


@dataclass(frozen=True)
class Calibration:
    """What calibration found and chose.

    Attributes:
        max_clean: Largest dispersion measured on clean operators.
        min_injected: Smallest finite dispersion measured on injected operators (``inf`` when
            every injected measurement overflowed).
        separation: ``min_injected / max_clean`` (> 1 means the two populations separate).
        separated: Whether ``separation > 1``.
        tau_warn: Chosen promotion threshold: the geometric midpoint of ``max_clean`` and
            ``min_injected`` when they separate (equal margins in log scale), else
            ``margin * max_clean`` (no clean operator promoted, at the cost of recall).
        tau_safe: ``safe_ratio * tau_warn``.
        n_clean, n_injected: How many measurements each side had.
        non_finite_injected: Injected measurements that were non-finite (overflow).
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

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (f"clean max S {self.max_clean:.3g} | injected min S {self.min_injected:.3g} | "
                f"separation x{self.separation:.3g} | tau_warn {self.tau_warn:.3g} | "
                f"tau_safe {self.tau_safe:.3g}")


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


def choose_thresholds(clean: Any, injected: Any, *, safe_ratio: float = 10.0,
                      margin: float = 2.0) -> Calibration:
    """Choose tau_warn / tau_safe from dispersions of clean and injected operators.

    Args:
        clean: Dispersions S measured on clean operators (numbers, a sequence, or a mapping
            operator -> sequence, e.g. ``monitor.measurements()`` of a clean run).
        injected: Dispersions measured on the injected operators only.
        safe_ratio: tau_safe / tau_warn (> 1).
        margin: Factor above the clean maximum used when the populations overlap (> 1).

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
    if sep > 1:
        tau = math.sqrt(max_clean * min_inj) if math.isfinite(min_inj) else margin * max_clean
    else:
        tau = margin * max_clean
    return Calibration(max_clean, min_inj, sep, sep > 1, tau, safe_ratio * tau, len(c), len(i),
                       len(i) - len(finite))


