"""fxstab: find where a PyTorch program loses significant digits in low precision."""

from .digits import (
    DigitStats,
    cestac_digits,
    computational_zero,
    digit_stats,
    format_stochastic,
    student_t,
)
from .backend import FxstabBackend, backend
from .formats import FORMATS, Format, get_format
from .report import OpReport
from .rounding import Rounding, quantize, round_samples

__version__ = "0.1.0"

__all__ = [
    "FORMATS", "Format", "get_format", "Rounding", "quantize", "round_samples",
    "cestac_digits", "computational_zero", "digit_stats", "DigitStats", "format_stochastic",
    "student_t", "backend", "FxstabBackend", "OpReport", "__version__",
]

from .digitmap import DiffResult, DigitMap, DigitMapError, diff  # noqa: E402

__all__ += ["DigitMap", "DigitMapError", "DiffResult", "diff"]
