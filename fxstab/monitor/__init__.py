"""Training-time stability monitor (DESIGN.md §8): detect operators going unstable in
low-precision training and promote them to safer kernels without recompiling.

Entry point: :class:`StabilityMonitor` (``monitor.backend()`` for ``torch.compile``,
``monitor.wrap(model)`` for eager models).
"""

from .calibrate import Calibration, choose_thresholds
from .config import DEFAULT_MONITOR_FAMILIES, Mode, MonitorConfig
from .core import OpState, Promotion, StabilityMonitor, register_op

__all__ = ["StabilityMonitor", "MonitorConfig", "Mode", "Promotion", "OpState", "register_op",
           "Calibration", "choose_thresholds", "DEFAULT_MONITOR_FAMILIES"]
