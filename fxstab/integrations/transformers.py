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
``fxstab/worst_grad_digits``, their ``..._run_digits``, ``fxstab/nan_origins``,
``fxstab/findings``) go to the trainer's own loggers (``report_to``: TensorBoard, W&B, CSV...) with the step's loss; when training ends
the last map's page and ``steps.html`` (digits over the analysed steps) are written beside the
maps. With ``monitor=StabilityMonitor(...)`` (the model wrapped by ``monitor.wrap``) the
callback steps the monitor and logs its scores and promotions instead.

``Trainer(callbacks=[FxstabCallback(every=10, format="bf16")])``, the usual idiom, does the
same. The reporting callbacks must see its figures in the ``on_log`` call that carries them,
so the callback goes first among the trainer's callbacks: ``attach`` puts it there; added any
other way (``callbacks=[...]`` and ``add_callback`` append it after the reporting callbacks),
it moves itself there when the trainer first calls it (``on_init_end``, ``on_train_begin``).
When training ends it says where the maps and pages went.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Optional

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

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
    def on_init_end(self, args, state, control, **kwargs):
        _go_first(self)
        return control

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _go_first(self)  # (added by add_callback after the trainer was made)
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
        if self.pages and state.is_world_process_zero:
            print(where_they_went(self.analysis, self.pages))
        return control


def where_they_went(analysis: Optional[StepAnalysis], pages: list) -> str:
    """The line said when training ends: the maps written and the pages to open."""
    maps = f"{len(analysis.maps)} digit map(s) in {analysis.output_dir}; " \
        if analysis is not None else ""
    return f"fxstab: {maps}open {' and '.join(str(p) for p in pages)}"


def _go_first(cb: FxstabCallback) -> None:
    """Put ``cb`` first among the callbacks of the trainer calling it. The handler is not
    handed to a callback: it is the ``self`` of ``CallbackHandler.call_event``, the frame
    that calls the event (searched a few frames up; nothing found, nothing moves)."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return
        handler = frame.f_locals.get("self")
        if isinstance(handler, CallbackHandler):
            if any(c is cb for c in handler.callbacks) and handler.callbacks[0] is not cb:
                handler.callbacks.remove(cb)
                handler.callbacks.insert(0, cb)
            return


def _loss_of(out: Any) -> Any:
    """A Hugging Face model's loss (its output's ``loss``, or the first element)."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)):
        loss = out[0]
    if loss is None:
        raise ValueError("the model returned no loss: give the batches labels (the Trainer's "
                         "own loss needs them too)")
    return loss
