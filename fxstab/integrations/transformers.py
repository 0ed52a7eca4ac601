"""fxstab in Hugging Face's ``transformers.Trainer``: one line, as
``TrainingArguments(debug="underflow_overflow")`` is.

::

    from fxstab.integrations.transformers import FxstabCallback
    trainer = Trainer(model, args, train_dataset=data)
    FxstabCallback.attach(trainer, every=10, format="bf16")   # the one line
    trainer.train()

Every ``every`` optimizer steps the step's batch runs forward and backward through fxstab on
the side (the training itself is unchanged, bit for bit) and the digit map is saved as
``OUTPUT_DIR/fxstab/step-NNNNNN.json``; its headline figures (``fxstab/worst_forward_digits``,
``fxstab/worst_grad_digits``, ``fxstab/nan_origins``, ``fxstab/findings``) go to the trainer's
own loggers (``report_to``: TensorBoard, W&B, CSV...) with the step's loss; when training ends
the last map's page and ``steps.html`` (digits over the analysed steps) are written beside the
maps. With ``monitor=StabilityMonitor(...)`` (the model wrapped by ``monitor.wrap``) the
callback steps the monitor and logs its scores and promotions instead.

``attach`` puts the callback first among the trainer's callbacks, so that the reporting
callbacks see its figures in the same ``on_log`` call; ``Trainer(callbacks=[FxstabCallback()])``
appends it after them, and its figures then reach only the callback's ``logged`` list.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

from transformers import TrainerCallback

from .core import StepAnalysis, monitor_headline


class FxstabCallback(TrainerCallback):
    """Digit maps (or a stability monitor) inside ``transformers.Trainer``.

    Args:
        every: analyse one optimizer step in ``every``.
        output_dir: where maps and pages go (default ``args.output_dir/fxstab``).
        monitor: a :class:`fxstab.StabilityMonitor` whose ``wrap`` wraps the trained model:
            stepped and logged instead of the digit maps.
        backward: also analyse the gradients.
        **options: :func:`fxstab.backend` options (``format``, ``n_samples``, ``seed``...),
            checked when the callback is made.
    """

    def __init__(self, every: int = 10, output_dir: Optional[str] = None, monitor: Any = None,
                 backward: bool = True, **options: Any) -> None:
        self.every, self.output_dir, self.monitor = every, output_dir, monitor
        self.analysis: Optional[StepAnalysis] = None
        if monitor is None:  # options checked now; the folder is known at train begin
            self.analysis = StepAnalysis(output_dir or ".", every, backward, **options)
        self._batch: Optional[tuple] = None
        self._hook = None
        self._pending: dict = {}
        self.logged: list[dict] = []  # what was handed to the loggers, per log call
        self.pages: list[Path] = []

    @classmethod
    def attach(cls, trainer: Any, **kwargs: Any) -> "FxstabCallback":
        """Make the callback and put it first among ``trainer``'s callbacks (see the module
        docstring); returns it."""
        cb = cls(**kwargs)
        trainer.callback_handler.callbacks.insert(0, cb)
        return cb

    # ----------------------------------------------------------------- events
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.analysis is not None:
            self.analysis.output_dir = Path(self.output_dir or Path(args.output_dir) / "fxstab")
            # the batch of each training forward (keyword inputs, as the Trainer calls it)
            self._hook = model.register_forward_pre_hook(self._keep_batch, with_kwargs=True)

    def _keep_batch(self, module, args, kwargs):
        if module.training:
            self._batch = (args, kwargs)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if self.monitor is not None:
            self.monitor.step()
            if step % self.every == 0:
                self._pending = monitor_headline(self.monitor)
                control.should_log = True
            return control
        if not self.analysis.due(step) or self._batch is None:
            return control
        b_args, b_kwargs = self._batch
        self._hook.remove()  # the analysed call is no training batch (and dynamo sees no hook)
        try:
            self._pending = self.analysis.analyse(model, b_args, b_kwargs, step, _loss_of)
        finally:
            self._hook = model.register_forward_pre_hook(self._keep_batch, with_kwargs=True)
        control.should_log = True  # the figures go out with this step's loss
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._pending and logs is not None:
            logs.update({k: v for k, v in self._pending.items() if not math.isnan(v)})
            self.logged.append(dict(self._pending, step=state.global_step))
            self._pending = {}
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.analysis is not None:
            self.pages = self.analysis.finish()
        elif self.monitor is not None:
            out = Path(self.output_dir or Path(args.output_dir) / "fxstab")
            self.pages = [self.monitor.save_html(out / "monitor.html")]
        return control


def _loss_of(out: Any) -> Any:
    """A Hugging Face model's loss (its output's ``loss``, or the first element)."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)):
        loss = out[0]
    if loss is None:
        raise ValueError("the model returned no loss: give the batches labels (the Trainer's "
                         "own loss needs them too)")
    return loss
