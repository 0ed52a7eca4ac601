"""fxstab in Lightning's ``Trainer``: one line, as ``detect_anomaly=True`` is.

::

    from fxstab.integrations.lightning import FxstabCallback
    trainer = L.Trainer(max_steps=1000, callbacks=[FxstabCallback(every=10, format="bf16")])

Every ``every`` optimizer steps the step's batch runs the module's ``training_step`` forward
and backward through fxstab on the side (its ``self.log`` calls silenced; the training itself
is unchanged, bit for bit) and the digit map is saved as ``ROOT/fxstab/step-NNNNNN.json``
(``ROOT``: the trainer's ``log_dir``, else its ``default_root_dir``); its headline figures
(``fxstab/worst_forward_digits``, ``fxstab/worst_grad_digits``, their ``..._run_digits``,
``fxstab/nan_origins``, ``fxstab/findings``) go to every logger of the trainer (TensorBoard, CSV, W&B...); when
training ends the last map's page and ``steps.html`` are written beside the maps. With
``monitor=StabilityMonitor(...)`` (the network inside the module wrapped by
``monitor.wrap``) the callback steps the monitor and logs its scores and promotions instead.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    from pytorch_lightning.callbacks import Callback

from .core import StepAnalysis, monitor_headline


class FxstabCallback(Callback):
    """Digit maps (or a stability monitor) inside a Lightning ``Trainer``.

    Args:
        every: analyse one optimizer step in ``every``.
        output_dir: where maps and pages go (default ``ROOT/fxstab``, see the module).
        monitor: a :class:`fxstab.StabilityMonitor` (stepped and logged instead of maps).
        backward: also analyse the gradients.
        **options: :func:`fxstab.backend` options, checked when the callback is made.
    """

    def __init__(self, every: int = 10, output_dir: Optional[str] = None, monitor: Any = None,
                 backward: bool = True, **options: Any) -> None:
        super().__init__()
        self.every, self.output_dir, self.monitor = every, output_dir, monitor
        self.analysis: Optional[StepAnalysis] = None
        if monitor is None:
            self.analysis = StepAnalysis(output_dir or ".", every, backward, **options)
        self._batch: Optional[tuple] = None
        self.logged: list[dict] = []
        self.pages: list[Path] = []

    def _root(self, trainer: Any) -> Path:
        if self.output_dir:
            return Path(self.output_dir)
        return Path(trainer.log_dir or trainer.default_root_dir) / "fxstab"

    def on_train_start(self, trainer, pl_module):
        if self.analysis is not None:
            self.analysis.output_dir = self._root(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._batch = (batch, batch_idx)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step  # optimizer steps done, this one included
        if self.monitor is not None:
            self.monitor.step()
            if step % self.every == 0:
                self._log(trainer, monitor_headline(self.monitor), step)
            return
        if not self.analysis.due(step) or self._batch is None:
            return
        log = pl_module.log
        pl_module.log = lambda *a, **k: None  # the analysed step logs nothing of its own
        try:
            figures = self.analysis.analyse(pl_module.training_step, self._batch, {}, step,
                                            _loss_of)
        finally:
            del pl_module.log  # the class's method again
            assert pl_module.log == log
        self._log(trainer, figures, step)

    def _log(self, trainer: Any, figures: dict, step: int) -> None:
        figures = {k: v for k, v in figures.items() if not math.isnan(v)}
        for logger in trainer.loggers:
            logger.log_metrics(figures, step=step)
        self.logged.append(dict(figures, step=step))

    def on_train_end(self, trainer, pl_module):
        if self.analysis is not None:
            self.pages = self.analysis.finish()
        elif self.monitor is not None:
            self.pages = [self.monitor.save_html(self._root(trainer) / "monitor.html")]


def _loss_of(out: Any) -> Any:
    """``training_step``'s loss: the tensor, or the dict's ``loss``."""
    if isinstance(out, dict):
        out = out.get("loss")
    if out is None:
        raise ValueError("training_step returned no loss (a tensor or {'loss': tensor})")
    return out
