"""fxstab: find where a PyTorch program loses significant digits in low precision."""

from . import inject
from .backend import FxstabBackend, backend, get_default_backend
from .counters import instability_counters
from .digitmap import DiffResult, DigitMap, DigitMapError, diff
from .digits import (
    DigitStats,
    cestac_digits,
    computational_zero,
    digit_stats,
    format_stochastic,
    student_t,
)
from .formats import FORMATS, Format, get_format
from .monitor import Mode, MonitorConfig, StabilityMonitor
from .operator import operator
from .report import OpReport
from .rounding import Rounding, quantize, round_samples
from .stochastic import AnalysisResult, StochasticTensor, analyze, stochastic

__version__ = "0.1.0"

__all__ = [
    "FORMATS", "Format", "get_format", "Rounding", "quantize", "round_samples",
    "cestac_digits", "computational_zero", "digit_stats", "DigitStats", "format_stochastic",
    "student_t", "backend", "FxstabBackend", "get_default_backend", "OpReport", "DigitMap",
    "DigitMapError",
    "DiffResult", "diff", "instability_counters", "stochastic", "StochasticTensor", "analyze",
    "AnalysisResult", "StabilityMonitor", "MonitorConfig", "Mode", "inject", "operator",
    "__version__",
]
