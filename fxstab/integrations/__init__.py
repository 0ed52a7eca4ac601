"""fxstab inside the trainers people run: one callback per trainer (issue 45).

- :mod:`fxstab.integrations.transformers`: ``FxstabCallback`` for Hugging Face's
  ``transformers.Trainer``;
- :mod:`fxstab.integrations.lightning`: ``FxstabCallback`` for Lightning's ``Trainer``.

Both share :mod:`fxstab.integrations.core`: every ``every`` optimizer steps the model's
forward and gradients are analysed on the step's batch and the digit map is saved under the
run's output folder, or a :class:`fxstab.StabilityMonitor` runs on every step; the headline
figures go to the trainer's own loggers (TensorBoard, W&B, CSV); the pages are written when
training ends. Each trainer is imported only by its own module.
"""
