"""What both trainer callbacks do (:mod:`fxstab.integrations.transformers`,
:mod:`fxstab.integrations.lightning`), without either trainer.

:class:`StepAnalysis` analyses one training step in ``every``: the model is compiled once with
an fxstab backend (``backward=True`` by default), and at an analysed step it runs the step's
batch forward and backward through it, on the side: the gradients the optimizer saw and the
random number generators' states are put back as they were, so the run trains exactly as
without fxstab. Each analysed step's digit map is saved as ``OUTPUT/step-NNNNNN.json``; its
headline figures (:func:`headline`) are what the callbacks log; :meth:`StepAnalysis.finish`
writes the last map's page and the trend page of every analysed step. With a
:class:`fxstab.StabilityMonitor` the callbacks step it and log its scores and promotions
instead (:func:`monitor_headline`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional

import torch

PREFIX = "fxstab/"


def headline(dm: Any) -> dict:
    """The figures logged per analysed step: the worst forward operator's and the worst
    gradient's digits (the default metric, CESTAC's bound) and the same operators' expected
    digits in a real run (``..._run_digits``: what to set beside a real run), how many
    operators NaN/inf first appear at, and how many findings the map has."""
    from ..digitmap import DEFAULT_METRIC

    fwd = [op for op in dm.operators.values() if op.direction != "backward"]
    grads = [op for op in dm.operators.values() if op.kind == "param_grad"]

    def lowest(ops: list) -> tuple:
        """(the lowest bound, that operator's run digits) of ``ops``."""
        if not ops:
            return math.nan, math.nan
        op = min(ops, key=lambda o: _or0(o.digits(DEFAULT_METRIC)))
        return _or0(op.digits(DEFAULT_METRIC)), op.run_digits

    out = {f"{PREFIX}nan_origins": float(len(dm.nonfinite_sources())),
           f"{PREFIX}findings": float(len(dm.findings()))}
    for key, ops in (("forward", fwd), ("grad", grads)):
        if ops or key == "forward":
            bound, run = lowest(ops)
            out[f"{PREFIX}worst_{key}_digits"] = bound
            out[f"{PREFIX}worst_{key}_run_digits"] = run
    return out


def _or0(v: float) -> float:
    return 0.0 if math.isnan(v) else v


def monitor_headline(mon: Any) -> dict:
    """A stability monitor's figures: its highest score, the operators promoted now and ever."""
    scores = [s for n, s in mon.scores.items() if mon.history.get(n)]  # checked ones only
    return {f"{PREFIX}monitor_max_score": max(scores) if scores else math.nan,
            f"{PREFIX}monitor_promoted": float(len(mon.promoted)),
            f"{PREFIX}monitor_ever_promoted": float(len(mon.ever_promoted))}


class StepAnalysis:
    """Digit maps of one training step in ``every`` (see the module docstring).

    Args:
        output_dir: where the maps and pages go.
        every: analyse the steps ``every``, ``2 * every``, ... (>= 1).
        backward: analyse the backward pass too (gradient digit maps).
        **options: :func:`fxstab.backend`'s options (``format``, ``n_samples``, ``seed``...).

    Raises:
        ValueError: ``every`` < 1, or an option ``fxstab.backend`` refuses.
    """

    def __init__(self, output_dir: Any, every: int = 10, backward: bool = True,
                 **options: Any) -> None:
        import fxstab

        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        self.output_dir = Path(output_dir)
        self.every = every
        self.backend = fxstab.backend(backward=backward, **options)  # checks the options now
        self.backward = backward
        self.maps: list[tuple[int, Path]] = []
        self._compiled: Optional[tuple[Any, Callable]] = None

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1, 2, ...) is analysed."""
        return step > 0 and step % self.every == 0

    def _compile(self, fn: Any) -> Callable:
        if self._compiled is None or self._compiled[0] != fn:  # a bound method: equal, not the same
            self._compiled = (fn, torch.compile(fn, backend=self.backend))
        return self._compiled[1]

    def analyse(self, fn: Any, args: tuple, kwargs: dict, step: int,
                loss_of: Callable[[Any], torch.Tensor]) -> dict:
        """Run ``fn(*args, **kwargs)`` (the model, or the training step) through the analysis,
        ``loss_of(output).backward()`` with ``backward``; save the step's map; put gradients
        and random states back. Returns :func:`headline` of the map."""
        params = [p for p in _parameters(fn) if p.requires_grad]
        grads = [p.grad for p in params]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        compiled = self._compile(fn)
        self.backend.clear()
        try:
            for p in params:
                p.grad = None
            with self.backend.phase("train", step=step):
                out = compiled(*args, **kwargs)
                if self.backward:
                    loss_of(out).backward()
        finally:
            for p, g in zip(params, grads):
                p.grad = g  # what the optimizer's zero_grad left, exactly
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
        dm = self.backend.digit_map()
        path = self.output_dir / f"step-{step:06d}.json"
        dm.save(path)
        self.maps.append((step, path))
        return headline(dm)

    def finish(self) -> list[Path]:
        """Write the last analysed step's map page and the trend page over the analysed steps;
        returns their paths (none when no step was analysed)."""
        from ..digitmap import DigitMap
        from ..plots import html

        if not self.maps:
            return []
        step, last = self.maps[-1]
        dm = DigitMap.load(last)
        pages = [html.write_page(html.map_page(dm, title=html.map_title(dm, last)),
                                 last.with_suffix(".html"))]
        points = [(f"step {s}", {"model": DigitMap.load(p)}) for s, p in self.maps]
        pages.append(html.write_page(html.history_page(points, title="fxstab: digits over "
                                                                      "training steps",
                                                       unit="step"),
                                     self.output_dir / "steps.html"))
        return pages


def _parameters(fn: Any) -> list:
    """The parameters a model or a bound method of a module trains."""
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    return list(owner.parameters()) if isinstance(owner, torch.nn.Module) else []
