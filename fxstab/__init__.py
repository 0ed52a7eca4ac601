"""fxstab: find where a PyTorch program loses significant digits in low precision."""

from .monitor import inject
from .backend import FxstabBackend, backend, get_default_backend
from .records.counters import instability_counters
from .digitmap import DiffResult, DigitMap, DigitMapError, diff
from .numerics.digits import (
    DigitStats, cestac_digits, computational_zero, digit_stats, format_stochastic, student_t,
)
from .numerics.accumulation import Accumulation, Alignment, emulate_matmul
from .numerics.formats import FORMATS, Format, get_format
from .monitor import Mode, MonitorConfig, StabilityMonitor
from .capture.user_ops import operator
from .records.report import OpReport
from .numerics.rounding import Rounding, quantize, round_samples
from .eager.stochastic import AnalysisResult, StochasticTensor, analyze, stochastic
from .plan import PrecisionPlan, apply_plan, check_plan, plan_precision
from .impact import Impact, operator_impact
from .fixes.verify import Fix, suggest_fixes
from .plots.notebook import register_displays as _register_displays

from ._version import __version__

_register_displays()  # maps, diffs and coverages show themselves in notebooks

__all__ = [
    "FORMATS", "Format", "get_format", "Rounding", "quantize", "round_samples",
    "cestac_digits", "computational_zero", "digit_stats", "DigitStats", "format_stochastic",
    "student_t", "backend", "FxstabBackend", "get_default_backend", "OpReport", "DigitMap",
    "DigitMapError",
    "DiffResult", "diff", "instability_counters", "stochastic", "StochasticTensor", "analyze",
    "AnalysisResult", "StabilityMonitor", "MonitorConfig", "Mode", "inject", "operator",
    "Accumulation", "Alignment", "emulate_matmul", "plan_precision", "PrecisionPlan", "apply_plan",
    "check_plan", "operator_impact", "Impact", "suggest_fixes", "Fix",
    "__version__",
]
