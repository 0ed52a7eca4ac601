"""Digit maps (interim: the module moved into a package; its parts follow)."""

from .map import (  # noqa: F401
    _METRICS,
    DEFAULT_METRIC,
    LEGEND,
    MIN_FINDING,
    MIN_UNDERFLOW,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    DiffResult,
    DigitMap,
    DigitMapError,
    LocalLoss,
    OpChange,
    OperatorDigits,
    OpPresence,
    PathLike,
    StepDigits,
    diff,
    hint,
)
