"""Training-time stability monitor (docs/design.md §8): detect operators going unstable in
low-precision training and promote them to safer kernels without recompiling.

Entry point: :class:`StabilityMonitor` (``monitor.backend()`` for ``torch.compile``,
``monitor.wrap(model)`` for eager models).
"""

from .calibrate import Calibration, FamilyCalibration, choose_thresholds
from .config import DEFAULT_MONITOR_FAMILIES, Mode, MonitorConfig
from .core import Promotion, StabilityMonitor
from .ops import OpState, op_family, register_op

__all__ = ["StabilityMonitor", "MonitorConfig", "Mode", "Promotion", "OpState", "register_op",
           "Calibration", "FamilyCalibration", "choose_thresholds", "op_family",
           "DEFAULT_MONITOR_FAMILIES"]
