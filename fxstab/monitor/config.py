"""Configuration of the stability monitor (docs/design.md §8): modes and the frozen config."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Mapping

from ..numerics.formats import Format, FormatLike, get_format
from ..capture.opsets import FAMILIES

__all__ = ["Mode", "MonitorConfig", "DEFAULT_MONITOR_FAMILIES", "ESTIMATORS"]

# Families whose operators the monitor watches by default (issue 7): GEMMs, attention, softmax,
# normalization and reductions. User-registered custom ops are always candidates.
DEFAULT_MONITOR_FAMILIES = ("linear", "matmul", "attention", "softmax", "norm", "reduction")
ESTIMATORS = ("projection", "block", "full")
_STABLE_DTYPES = ("fp32", "fp64")


class Mode(enum.IntEnum):
    """How one monitored operator is computed; larger is safer (and slower).

    NORMAL: the low-precision kernel the model asked for (e.g. a bf16 matmul).
    FP32_ACCUMULATION: low-precision inputs, fp32 accumulation (linear/matmul); max subtraction
        and fp32 accumulation of exponentials (softmax); mean and variance in fp32 (norms).
    STABLE_KERNEL: a strictly more accurate kernel: inputs upcast to ``stable_dtype`` (fp64 by
        default), overflow-safe formulas (max-subtracted softmax, pre-scaled norms), output cast
        back to the operator's dtype.
    """

    NORMAL = 0
    FP32_ACCUMULATION = 1
    STABLE_KERNEL = 2

    @classmethod
    def parse(cls, mode: "Mode | str | int") -> "Mode":
        if isinstance(mode, Mode):
            return mode
        if isinstance(mode, str):
            key = mode.strip().upper()
            aliases = {"FP32": "FP32_ACCUMULATION", "FP32_ACC": "FP32_ACCUMULATION",
                       "STABLE": "STABLE_KERNEL"}
            key = aliases.get(key, key)
            if key in cls.__members__:
                return cls[key]
        elif isinstance(mode, int) and not isinstance(mode, bool) and mode in (0, 1, 2):
            return cls(mode)
        raise ValueError(f"unknown monitor mode {mode!r}; use one of "
                         f"{', '.join(m.name for m in cls)}")


def _check_int(name: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")


def _check_float(name: str, value, lo: float, hi: float, lo_open: bool, hi_open: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    bad_lo = value <= lo if lo_open else value < lo
    bad_hi = value >= hi if hi_open else value > hi
    if bad_lo or bad_hi:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value!r}")


@dataclass(frozen=True)
class MonitorConfig:
    """Settings of a :class:`~fxstab.monitor.StabilityMonitor` (validated on construction).

    Args:
        format: Hardware format the model computes in (``"bf16"``); its unit roundoff u is the
            half-width of the relative input perturbation (1 + U(-u, u)) of the replicas.
        k: Replicas per check (>= 2; the dispersion uses a K-1 denominator).
        screen_k: A check first runs this many of its K replicas (2 <= screen_k <= k); the
            other ``k - screen_k`` run only when the screening S reaches ``watch`` times the
            threshold that would promote the operator next (its family's tau_warn at NORMAL,
            tau_safe at FP32_ACCUMULATION), i.e. when the measurement could matter. Below
            that S only feeds the EMA of an operator far from that threshold, and no
            promotion can follow from it, so promotions always rest on K replicas. Rechecks (which may demote) and observe-only monitors
            (``promote=False``: calibration input) always run K. ``screen_k = k`` turns
            screening off.
        period: Run checks on one step in ``period``.
        beta: EMA weight of the old score, in [0, 1). The first measurement after a reset
            initialises the score (no bias towards 0).
        tau_warn: Score above which a NORMAL operator is promoted to FP32_ACCUMULATION.
        tau_safe: Score above which an operator is promoted to STABLE_KERNEL (> tau_warn).
        thresholds: Per-family overrides ``{family: (tau_warn, tau_safe)}`` (what
            ``monitor.calibrate`` sets): operators of different families disperse differently
            when clean (a GEMM with cancelling dot products more than a softmax with small
            logits), so one global pair is either too low for one or too high for another.
            A family is an ``fxstab.capture.opsets`` family or the family a custom op was registered
            with; operators of families not listed use ``tau_warn`` / ``tau_safe``. Stored as
            a sorted tuple of ``(family, tau_warn, tau_safe)``.
        recheck: A promoted operator's NORMAL kernel is re-measured every ``recheck`` steps.
        hysteresis: A recheck demotes to NORMAL only when the NORMAL kernel's dispersion is
            below ``hysteresis * tau_warn`` (in (0, 1]).
        watch: Operators whose score is at least ``watch`` times the threshold that would
            promote them next (tau_warn at NORMAL, tau_safe at FP32_ACCUMULATION) are checked
            on every check step, beside the one the rotating schedule picks (in (0, 1]). A
            promoted operator's score stays above the tau_warn it crossed; it is watched
            only once it approaches tau_safe.
        watch_every: Such watched operators are checked on one check step in
            ``watch_every`` (1: every check step). An operator whose score is already above
            its threshold is not watched but promoted; this only spaces out the checks of
            operators approaching it.
        settle: An operator at NORMAL whose score stays below ``settle * tau_warn`` (of its
            family) after ``settle_after`` checks is settled: the rotation checks it on one of
            its turns in ``settle_every`` (in [0, 1); 0: nothing settles). Its score rising to
            ``settle * tau_warn`` unsettles it at its next check; ``watch`` > ``settle``
            operators are checked as before.
        settle_after: Checks before an operator can settle (>= 1).
        settle_every: A settled operator is checked on one rotation turn in this many (>= 1;
            1: settled operators are checked as every other).
        projection_dim: Outputs with more elements than this are reduced before the norms
            (``estimator``): a fixed random sign projection to this many coordinates, or a
            fixed sampled block of this many elements.
        estimator: ``"projection"`` (default), ``"block"`` or ``"full"`` (no reduction).
        seed: Seed of the perturbations and of the projection signs.
        eps: Added to the mean's norm in the dispersion ratio.
        families: Operator families (``fxstab.capture.opsets.FAMILIES``) that are candidates.
        stable_dtype: Working dtype of STABLE_KERNEL, ``"fp64"`` or ``"fp32"``.
        promote: ``False`` observes only (scores are kept, modes never change): used to
            collect calibration scores.
    """

    format: FormatLike = "bf16"
    k: int = 4
    screen_k: int = 2
    period: int = 1
    beta: float = 0.8
    tau_warn: float = 0.05
    tau_safe: float = 0.5
    thresholds: "Mapping[str, tuple[float, float]] | tuple" = ()
    recheck: int = 50
    hysteresis: float = 0.5
    watch: float = 0.5
    watch_every: int = 1
    settle: float = 0.25
    settle_after: int = 3
    settle_every: int = 3
    projection_dim: int = 4096
    estimator: str = "projection"
    seed: int = 0
    eps: float = 1e-12
    families: tuple = field(default=DEFAULT_MONITOR_FAMILIES)
    stable_dtype: str = "fp64"
    promote: bool = True

    def __post_init__(self) -> None:
        try:
            fmt = get_format(self.format)
        except ValueError as e:
            raise ValueError(f"format: {e}") from None
        object.__setattr__(self, "format", fmt)
        _check_int("k (replicas per check)", self.k, 2)
        _check_int("screen_k", self.screen_k, 2)
        if self.screen_k > self.k:
            raise ValueError(f"screen_k must be at most k (the replicas of a full check), got "
                             f"screen_k={self.screen_k!r} and k={self.k!r}")
        _check_int("period", self.period, 1)
        _check_int("recheck", self.recheck, 1)
        _check_int("projection_dim", self.projection_dim, 1)
        _check_float("beta", self.beta, 0.0, 1.0, lo_open=False, hi_open=True)
        _check_float("tau_warn", self.tau_warn, 0.0, math.inf, lo_open=True, hi_open=True)
        _check_float("tau_safe", self.tau_safe, 0.0, math.inf, lo_open=True, hi_open=True)
        if self.tau_safe <= self.tau_warn:
            raise ValueError(f"tau_safe must be larger than tau_warn, got tau_warn="
                             f"{self.tau_warn!r} and tau_safe={self.tau_safe!r}")
        _check_int("watch_every", self.watch_every, 1)
        object.__setattr__(self, "thresholds", self._normalize_thresholds(self.thresholds))
        _check_float("hysteresis", self.hysteresis, 0.0, 1.0, lo_open=True, hi_open=False)
        _check_float("watch", self.watch, 0.0, 1.0, lo_open=True, hi_open=False)
        _check_float("settle", self.settle, 0.0, 1.0, lo_open=False, hi_open=True)
        if self.settle >= self.watch:
            raise ValueError(f"settle must be below watch (a settled operator is far from "
                             f"being watched), got settle={self.settle!r} and "
                             f"watch={self.watch!r}")
        _check_int("settle_after", self.settle_after, 1)
        _check_int("settle_every", self.settle_every, 1)
        _check_float("eps", self.eps, 0.0, math.inf, lo_open=True, hi_open=True)
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if self.stable_dtype not in _STABLE_DTYPES:
            raise ValueError(f"stable_dtype must be one of {_STABLE_DTYPES}, got "
                             f"{self.stable_dtype!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if isinstance(self.families, str):
            raise ValueError(f"families must be a sequence of family names, got the string "
                             f"{self.families!r}; write ({self.families!r},)")
        fams = tuple(self.families)
        unknown = [f for f in fams if f not in FAMILIES]
        if unknown:
            raise ValueError(f"unknown operator families {unknown}; known: {sorted(FAMILIES)}")
        object.__setattr__(self, "families", fams)
        if not isinstance(self.promote, bool):
            raise ValueError(f"promote must be True or False, got {self.promote!r}")

    @staticmethod
    def _normalize_thresholds(th) -> tuple:
        if isinstance(th, Mapping):
            items = [(f, *v) if isinstance(v, (tuple, list)) else (f, v) for f, v in th.items()]
        elif isinstance(th, (tuple, list)):
            items = [tuple(t) if isinstance(t, (tuple, list)) else (t,) for t in th]
        else:
            raise ValueError(f"thresholds must map family -> (tau_warn, tau_safe), got "
                             f"{type(th).__name__}")
        out = {}
        for item in items:
            if len(item) != 3 or not isinstance(item[0], str) or not item[0]:
                raise ValueError(f"thresholds entries must be family -> (tau_warn, tau_safe), "
                                 f"got {item!r}")
            fam, warn, safe = item
            _check_float(f"thresholds[{fam!r}] tau_warn", warn, 0.0, math.inf, True, True)
            _check_float(f"thresholds[{fam!r}] tau_safe", safe, 0.0, math.inf, True, True)
            if safe <= warn:
                raise ValueError(f"thresholds[{fam!r}]: tau_safe must be larger than tau_warn, "
                                 f"got ({warn!r}, {safe!r})")
            if fam in out:
                raise ValueError(f"thresholds: family {fam!r} given twice")
            out[fam] = (float(warn), float(safe))
        return tuple((f, *out[f]) for f in sorted(out))

    def thresholds_for(self, family: str) -> tuple[float, float]:
        """``(tau_warn, tau_safe)`` of operators of ``family``."""
        for fam, warn, safe in self.thresholds:
            if fam == family:
                return warn, safe
        return self.tau_warn, self.tau_safe

    @property
    def fmt(self) -> Format:
        return self.format  # type: ignore[return-value]

    @property
    def unit_roundoff(self) -> float:
        return self.fmt.unit_roundoff
