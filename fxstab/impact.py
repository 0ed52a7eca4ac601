"""Each operator's impact on the model's outputs (issue 42): the digits the outputs lose
because of that operator's own rounding, not what it inherits.

A digit map ranks operators by their *local* loss (digits against their inputs). The question
users ask is another: which operator's rounding costs *my outputs* their digits? The two
disagree where it matters: a computational zero (the row sum of a centred input before a
LayerNorm) loses every local digit and costs the outputs nothing.

Impact is measured by ablation: the same analysis (same seed: every other operator draws the
same rounding directions, common random numbers) with an operator's output left unrounded
(``fxstab.backend(unrounded=[...])``, measured but not rounded); its impact is the digits the
outputs gain, averaged over their floating elements. Groups of operators in graph order are
ablated together and bisected where they gain at least ``threshold``: the k operators that
matter cost about ``1 + 2 k log2(n)`` analysed calls, not ``n``; an operator in a group that
gains less than ``threshold`` has an impact below it (recorded as the group's gain, an upper
bound of its own in practice). The output digits are CESTAC's over the samples of the graph's
outputs (``capture_samples``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from .backend import backend
from .progress import Progress
from .numerics.digits import cestac_digits

__all__ = ["Impact", "operator_impact"]


@dataclass
class Impact:
    """What :func:`operator_impact` measured.

    ``by_operator[name]``: the digits the outputs gain when the operator's output is left
    unrounded (its own rounding's cost to the outputs); for an operator in a group that gained
    less than ``threshold``, that group's gain. ``resolved``: the operators measured alone.
    ``output_digits``: the outputs' average digits with every operator rounded. ``calls``: the
    analysed calls spent."""

    output_digits: float
    by_operator: dict = field(default_factory=dict)
    resolved: set = field(default_factory=set)
    calls: int = 0
    threshold: float = 0.1
    # the digit map of the analysis with every operator rounded, its operators' impacts set
    # (annotate): its findings lead with what costs the outputs
    digit_map: Any = None

    def annotate(self, dm: Any) -> Any:
        """Set each of ``dm``'s operators' ``impact`` (and the map's threshold): its findings
        then rank by impact and say which local losses are harmless. Returns ``dm``."""
        for name, op in dm.operators.items():
            if name in self.by_operator:
                op.impact = float(self.by_operator[name])
        dm.metadata["impact_threshold"] = self.threshold
        dm.metadata["impact_calls"] = self.calls
        dm.metadata["impact_output_digits"] = self.output_digits
        return dm

    def ranked(self) -> list:
        """(operator, impact), largest impact first (graph order among equals)."""
        order = {n: i for i, n in enumerate(self.by_operator)}
        return sorted(self.by_operator.items(), key=lambda kv: (-kv[1], order[kv[0]]))

    def matters(self, name: str) -> bool:
        """Whether the operator's own rounding costs the outputs ``threshold`` digits or
        more."""
        return self.by_operator.get(name, 0.0) >= self.threshold

    def __repr__(self) -> str:
        top = self.ranked()[:1]
        return (f"Impact({len(self.by_operator)} operators, {len(self.resolved)} measured "
                f"alone; outputs {self.output_digits:.2f} avg digits with every operator "
                f"rounded; {self.calls} analysed calls"
                + (f"; largest: {top[0][0]} {top[0][1]:.2f}" if top else "") + ")")

    def _repr_html_(self) -> str:
        """Jupyter's display: the operators whose rounding costs the outputs most
        (:func:`fxstab.plots.notebook.impact_fragment`)."""
        from .plots import notebook

        return notebook.impact_fragment(self)

    def table(self, top: Optional[int] = 10) -> str:
        rows = self.ranked()[:top]
        width = max([len(n) for n, _ in rows] + [8])
        lines = [f"impact on the outputs ({self.output_digits:.2f} avg digits with every "
                 f"operator rounded; {self.calls} analysed calls; below {self.threshold:g}: "
                 f"harmless here)",
                 f"{'operator':<{width}}  {'impact':>7}"]
        bound = False
        for name, gain in rows:
            mark = "" if name in self.resolved else "  (group bound)"
            bound = bound or bool(mark)
            lines.append(f"{name:<{width}}  {gain:7.2f}{mark}")
        if bound:  # (issue 56, item 11: the words were explained nowhere)
            lines.append(f"group bound: left unrounded with its group, which gained less than "
                         f"{self.threshold:g} and was not split further; each operator in it is "
                         f"given the group's gain, a bound on its own")
        return "\n".join(lines)


def _output_digits(outputs: Any, fmt: Any, confidence: float) -> float:
    """The average CESTAC digits over every floating element of the outputs' samples."""
    total, count = 0.0, 0
    for t in pytree.tree_leaves(outputs):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 and \
                t.shape[0] >= 2 and t[0].numel():
            d = cestac_digits(t.detach().double(), fmt, confidence)
            total += float(d.sum())
            count += d.numel()
    return total / count if count else math.nan


class _Selected(torch.nn.Module):
    """The model followed by what counts of its output (``outputs=``): its operators are
    named ``model...`` here, the selection's own (a loss) at the root."""

    def __init__(self, model: torch.nn.Module, select: Any) -> None:
        super().__init__()
        self.model, self.select = model, select

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.select(self.model(*args, **kwargs))


def _selector(outputs: Any) -> Any:
    """``outputs=`` as a function of the model's output: a callable as it is; names (keys of a
    dict output, such as a ``transformers`` ModelOutput's ``"logits"``, or attributes)."""
    if callable(outputs):
        return outputs
    if isinstance(outputs, str):
        outputs = [outputs]
    if not isinstance(outputs, (list, tuple)) or not outputs or \
            not all(isinstance(k, str) for k in outputs):
        raise ValueError(f"outputs must be a callable of the model's output (a loss) or a list "
                         f"of its keys; got {outputs!r}")
    keys = list(outputs)

    def select(out: Any) -> Any:
        picked = []
        for k in keys:
            if isinstance(out, dict) and k in out:
                picked.append(out[k])
            elif hasattr(out, k):
                picked.append(getattr(out, k))
            else:
                raise ValueError(f"outputs: the model's output has no {k!r}")
        return picked
    return select


def _model_name(name: str) -> str:
    """An operator's name in the model's own map: ``model.fc/linear#0`` -> ``fc/linear#0``,
    ``model/mean#0`` -> ``mean#0``; the selection's (a loss's) -> ``(outputs)/...``."""
    for prefix in ("model.", "model/"):
        if name.startswith(prefix):
            return name[len(prefix):]
    return f"(outputs)/{name}"


def _renamed(dm: Any) -> Any:
    """``dm`` of a :class:`_Selected` run with the model's own operator names."""
    import dataclasses

    from .digitmap.map import DigitMap

    ops = [dataclasses.replace(
        op, name=_model_name(op.name), inputs=tuple(_model_name(i) for i in op.inputs),
        module_path="" if op.module_path == "model" else op.module_path.removeprefix("model."))
        for op in dm.operators.values()]
    steps = [dataclasses.replace(st, name=_model_name(st.name)) for st in dm.steps]
    return DigitMap(ops, dict(dm.metadata), steps)


def operator_impact(model: torch.nn.Module, inputs: Sequence, *, threshold: float = 0.1,
                    kwargs: Optional[dict] = None, bisect: bool = True,
                    outputs: Any = None, progress: Optional[bool] = None,
                    **options: Any) -> Impact:
    """Each analysed operator's impact on ``model``'s outputs (see the module docstring).

    Args:
        model: The model, called as ``model(*inputs, **kwargs)`` (under ``torch.no_grad``).
        inputs: Its positional inputs.
        threshold: Digits below which a group of operators is harmless (not bisected).
        kwargs: Its keyword inputs.
        outputs: What counts (default: every floating output): a callable of the model's
            output (``lambda out: F.cross_entropy(out, y)``: the impact on the loss, as in
            training), or a list of its keys (``["logits"]``). The selection's own operators
            (the loss's) are ablated too, named ``(outputs)/...``.
        bisect: False: every operator ablated alone (n + 1 analysed calls; the reference the
            bisection is validated against, ``benchmarks/bench_impact.py --validate``).
        progress: a bar of the analysed calls on stderr (:class:`fxstab.progress.Progress`);
            None: where stderr is a terminal.
        **options: :func:`fxstab.backend`'s options (format, n_samples, seed, select...);
            at ``granularity="aten"`` the ablated operators are the arithmetic primitives.
    """
    if not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ValueError(f"threshold must be a positive number of digits, got {threshold!r}")
    if "unrounded" in options:
        raise ValueError("operator_impact sets unrounded= itself")
    kwargs = kwargs or {}
    calls = 0
    target = model if outputs is None else _Selected(model, _selector(outputs))
    bar = Progress("fxstab impact", enabled=progress)  # (quiet off a terminal)
    # the names the backend sees (model.fc/linear#0 under a selection) and the model's own
    own = (lambda n: n) if outputs is None else _model_name

    def run(unrounded: Sequence[str]) -> tuple:
        nonlocal calls
        torch._dynamo.reset()
        be = backend(unrounded=list(unrounded) or None, **options)
        compiled = torch.compile(target, backend=be)
        with torch.no_grad(), be.capture_samples() as cap:
            compiled(*inputs, **kwargs)
        calls += 1
        cfg = be.config
        digits = _output_digits(cap.graphs[-1] if cap.graphs else None, cfg.format,
                                cfg.confidence)
        bar.update(note=f"{len(unrounded)} unrounded: outputs {digits:.2f} digits")
        return digits, be

    with bar:
        return _ablate(run, own, outputs, bisect, threshold, calls_of=lambda: calls)


def _ablate(run: Any, own: Any, outputs: Any, bisect: bool, threshold: float,
            calls_of: Any) -> Impact:
    """operator_impact's ablations: ``run(unrounded)`` -> (output digits, backend)."""
    base, be = run(())
    names = [n for n, op in be.digit_map().operators.items() if op.direction == "forward"]
    result = Impact(output_digits=base, threshold=threshold)
    pending = ([names] if names else []) if bisect else [[n] for n in names]
    gains: dict = {}
    while pending:
        group = pending.pop(0)
        digits, _ = run(group)
        gain = digits - base
        if len(group) == 1:
            gains[group[0]] = gain
            result.resolved.add(group[0])
        elif gain < threshold:
            for name in group:
                gains[name] = max(gain, 0.0)
        else:
            half = len(group) // 2
            pending += [group[:half], group[half:]]
    result.by_operator = {own(n): gains.get(n, 0.0) for n in names}
    result.resolved = {own(n) for n in result.resolved}
    result.calls = calls_of()
    dm = be.digit_map()
    result.digit_map = result.annotate(dm if outputs is None else _renamed(dm))
    torch._dynamo.reset()
    return result
