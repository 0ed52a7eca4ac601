"""What the analyses of one backend share while it runs (:class:`RunState`).

The backend (:class:`fxstab.backend.FxstabBackend`) owns one; every graph analysis it builds
(:mod:`fxstab.analysis`) and every tracer of samples (:mod:`fxstab.rules`) reads it: the
configuration, the report log the tracers append to, the phase and step that label the
reports, the stable names given so far, the open ``capture_samples()`` blocks, whether analysis
is on, and which implementation computes a kernel on a tensor (:mod:`fxstab.executors`).
Nothing below the backend reads the backend itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from ..capture.naming import NameRegistry
from ..config import AnalysisConfig
from .. import executors
from .report import OpReport, ReportLog

__all__ = ["RunState"]


@dataclass
class RunState:
    """The shared, mutable state of one backend's analyses."""

    config: AnalysisConfig
    graphs: list = field(default_factory=list)  # the graph analyses, in compile order
    names: NameRegistry = field(default_factory=NameRegistry)
    modules: set = field(default_factory=set)  # module paths of the captured graphs' operators
    captures: list = field(default_factory=list)  # open capture_samples() blocks
    enabled: bool = True  # False inside paused(): only the deterministic path runs
    phase: str = "default"  # the label of the reports made now (be.phase(...))
    step: Optional[int] = None
    _reports: ReportLog = field(default_factory=ReportLog, repr=False)

    @property
    def reports(self) -> ReportLog:
        """The log the tracers append to (the backend's ``reports``)."""
        return self._reports

    @reports.setter
    def reports(self, reports: Iterable[OpReport]) -> None:
        self._reports = reports if isinstance(reports, ReportLog) else ReportLog(reports)

    def kernel(self, function: str, t: torch.Tensor) -> Optional[executors.Implementation]:
        """The implementation to call for ``function`` (:data:`fxstab.executors.ROUND`,
        ``PERTURB``, ``ACCUMULATE``...) on ``t`` under this analysis's ``kernels`` option
        (:func:`fxstab.executors.choose`; None: a fused step the chosen kernels lack)."""
        return executors.choose(self.config.kernels, function, t, self.config.n_samples)
