"""A precision plan run for real (:func:`apply_plan`) and checked against fp64
(:func:`check_plan`).

:class:`PlanBackend` is a ``torch.compile`` backend: it names each captured graph's operators
exactly as the analysis does (:class:`fxstab.analysis.op_level.GraphAnalysis` on the same
graph, one name registry across the graphs), then rewrites the graph the analysis's samples
run: a promoted operator's floating inputs are cast up to ``higher`` and it runs with autocast
off; its output stays in ``higher`` for the promoted operators that read it, and is cast back
to the dtype the program gave it for every other reader. Autograd differentiates the casts:
the promoted operators' gradients run in ``higher`` too.
"""

from __future__ import annotations

import copy
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..analysis.op_level import GraphAnalysis
from ..capture.graph import floating_dtype, identity_dropout
from ..capture.opsets import EXACT_KINDS, node_kind
from ..config import AnalysisConfig
from ..numerics.digits import true_digits
from ..numerics.formats import get_format, torch_dtype_of
from ..records.run import RunState
from .record import PrecisionPlan
from .inputs import as_inputs

__all__ = ["apply_plan", "PlanBackend", "check_plan", "PlanCheck", "output_true_digits",
           "output_non_finite", "CARRIES_HIGH"]

# The nodes between operators that carry a promoted operator's output on in ``higher``, as the
# analysis's edges run from operator to operator through them: data movement and selections
# (views, getitem, split, permute, cat, where...: exact in any format) and floating casts (the
# analysis keeps its samples in the working dtype through ``.to``/``.type``: the format is
# what rounds, rules/op/structural.py), but for those that write into a tensor of the
# program's dtype (index_put, scatter: their source must match it) or make a new one; and a
# dropout that is the identity (eval mode, p=0), as the analysis passes it through. Cast
# back at them, a promoted operator's output reached its promoted reader rounded to the
# format: HF GPT-2's ``softmax(...).type(value.dtype)`` before the attention's second matmul
# (issue 55, item 3; docs/precision-plan.md)
CARRIES_HIGH = EXACT_KINDS - {
    "copy_", "fill_", "zero_", "setitem", "index_put", "scatter", "masked_scatter", "zeros",
    "ones", "empty", "full", "arange", "linspace", "logspace", "eye", "tensor", "getattr"}


def _higher_dtype(plan: PrecisionPlan) -> torch.dtype:
    dtype = torch_dtype_of(plan.higher)
    if dtype is None:
        raise ValueError(f"the plan's higher format {plan.higher} is not a dtype torch computes "
                         f"in (fp64, fp32, bf16, fp16): it can be analysed, not run")
    return dtype


def run_promoted(fn: Callable, dtype: torch.dtype, *args: Any, **kwargs: Any) -> Any:
    """``fn`` on its floating tensor arguments cast up to ``dtype`` (never down), autocast off."""
    def up(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and \
                torch.finfo(v.dtype).bits < torch.finfo(dtype).bits:
            return v.to(dtype)
        return v

    args, kwargs = pytree.tree_map(up, (args, kwargs))
    devices = {a.device.type for a in pytree.tree_leaves((args, kwargs))
               if isinstance(a, torch.Tensor)} or {"cpu"}
    with _autocast_off(devices):
        return fn(*args, **kwargs)


class _autocast_off:
    def __init__(self, devices: set) -> None:
        self.ctx = [torch.autocast(d, enabled=False) for d in sorted(devices)]

    def __enter__(self) -> None:
        for c in self.ctx:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self.ctx):
            c.__exit__(*exc)


def cast_back(value: Any, dtype: Optional[torch.dtype]) -> Any:
    """A promoted operator's output as a non-promoted reader expects it: floating tensors in
    ``dtype`` (None: as they are)."""
    if dtype is None:
        return value
    return pytree.tree_map(lambda v: v.to(dtype) if isinstance(v, torch.Tensor)
                           and v.is_floating_point() and v.dtype != dtype else v, value)


def _promoted(fn: Callable, dtype: torch.dtype) -> Callable:
    """``fn`` run by :func:`run_promoted` in ``dtype``, as a named function FX can call."""
    def promoted(*args: Any, **kwargs: Any) -> Any:
        return run_promoted(fn, dtype, *args, **kwargs)
    label = getattr(fn, "__name__", "op")
    promoted.__name__ = promoted.__qualname__ = f"promoted_{label}"
    promoted.__module__ = __name__
    return promoted


# floating casts: carried high, a cast down to the program's dtype keeps the higher value
_CASTS = frozenset({"to", "type", "float", "half", "bfloat16", "double", "type_as"})


def _kept_cast(name: str) -> Callable:
    """The cast method ``name`` as a function that keeps a floating value in its wider dtype
    where the cast would narrow it (the analysis keeps its samples in the working dtype through
    a floating cast: the format is what rounds); any other cast runs as written."""
    def cast(x: Any, *args: Any, **kwargs: Any) -> Any:
        y = getattr(x, name)(*args, **kwargs)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and \
                x.is_floating_point() and y.is_floating_point() and \
                torch.finfo(x.dtype).bits > torch.finfo(y.dtype).bits:
            return x if x.device == y.device else x.to(y.device)
        return y
    cast.__name__ = cast.__qualname__ = f"kept_{name}"
    cast.__module__ = __name__
    return cast


def _method(name: str) -> Callable:
    def call(self_: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self_, name)(*args, **kwargs)
    call.__name__ = f"method_{name}"
    return call


class PlanBackend:
    """The ``torch.compile`` backend of :func:`apply_plan`.

    Attributes:
        promoted: the operator names found and rewritten so far (a name of the plan that no
            graph holds is reported by :meth:`missing`).
    """

    def __init__(self, plan: PrecisionPlan) -> None:
        self.plan = plan
        self.dtype = _higher_dtype(plan)
        self.state = RunState(AnalysisConfig(format=plan.format, **_naming_options(plan)))
        self.promoted: list = []

    def missing(self) -> list:
        """The plan's operators no compiled graph held (a different model or input)."""
        return [n for n in self.plan.promoted if n not in self.promoted]

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        analysis = GraphAnalysis(gm, self.state, len(self.state.graphs))
        self.state.graphs.append(analysis)
        chosen = set(self.plan.promoted)
        names = {p.node: p.name for p in analysis.plans if p.name in chosen}
        if not names:
            return gm
        graph = analysis.sgraph if analysis.sgraph is not gm.graph else gm.graph
        graph = copy.deepcopy(graph) if graph is gm.graph else graph
        # deep-copied nodes keep their names: find the plan's nodes again by name
        by_name = {n.name: n for n in graph.nodes}
        high = set()
        for node, op_name in names.items():
            new = by_name[node.name]
            if new.op == "call_module":
                warnings.warn(f"fxstab: {op_name} is a module call the plan cannot rewrite; it "
                              f"runs as the program runs it", UserWarning, stacklevel=2)
                continue
            fn = new.target if new.op == "call_function" else _method(new.target)
            new.meta["fxstab_dtype"] = floating_dtype(new)
            new.op, new.target = "call_function", _promoted(fn, self.dtype)
            high.add(new)
            self.promoted.append(op_name)
        # a promoted output stays high through the data movement after it (getitem of a tuple
        # output, views, split...: CARRIES_HIGH), as the analysis's edges do; every other
        # reader gets the cast back
        operators = {p.node.name for p in analysis.plans if p.name is not None}
        for node in graph.nodes:  # in graph order: a node's inputs come before it
            if node in high or node.op not in ("call_function", "call_method") or \
                    node.name in operators or not any(a in high for a in node.all_input_nodes):
                continue
            kind = node_kind(node)
            if (node.op == "call_function" and node.target is operator.getitem) or \
                    (kind in CARRIES_HIGH and floating_dtype(node) is not None) or \
                    identity_dropout(node, kind):
                node.meta["fxstab_dtype"] = floating_dtype(node)
                high.add(node)
                if node.op == "call_method" and kind in _CASTS:
                    node.op, node.target = "call_function", _kept_cast(node.target)
        for node in list(graph.nodes):
            if node.op == "output" or node in high:
                continue
            for src in [a for a in node.all_input_nodes if a in high]:
                with graph.inserting_before(node):
                    back = graph.call_function(cast_back, (src, src.meta.get("fxstab_dtype")))
                node.replace_input_with(src, back)
        out = next(n for n in graph.nodes if n.op == "output")
        for src in [a for a in out.all_input_nodes if a in high]:
            with graph.inserting_before(out):
                back = graph.call_function(cast_back, (src, src.meta.get("fxstab_dtype")))
            out.replace_input_with(src, back)
        graph.lint()
        return torch.fx.GraphModule(gm, graph)


def _naming_options(plan: PrecisionPlan) -> dict:
    """The analysis options the operators' names depend on (which operators are selected)."""
    select = plan.settings.get("select")
    return {"select": select} if isinstance(select, (str, list)) else {}


def apply_plan(model: Any, plan: PrecisionPlan) -> Any:
    """``model`` compiled so that the plan's operators run in ``plan.higher`` for real.

    The rest runs as the program runs it: in the model's own dtype (``model.to(bf16)``) or
    under ``torch.autocast``. The returned callable has ``.plan_backend`` (a
    :class:`PlanBackend`: ``.missing()`` lists the plan's operators no graph held).
    """
    be = PlanBackend(plan)
    compiled = torch.compile(model, backend=be)
    if isinstance(compiled, torch.nn.Module):
        # on the wrapper itself: its setattr would set it on the user's model, whose
        # ``copy.deepcopy`` then meets the fake tensors the backend's graphs hold
        object.__setattr__(compiled, "plan_backend", be)
    else:
        try:
            compiled.plan_backend = be
        except AttributeError:  # a compiled function that takes no attributes
            pass
    return compiled


@dataclass
class PlanCheck:
    """True digits of the real low-precision run against fp64, without and with the plan.

    Attributes:
        plain, planned, high: the avg true digits at the outputs without the plan, with it,
            and all in ``higher`` (a NaN/inf element counts 0 digits).
        missing: the plan's operators no compiled graph held.
        plain_non_finite, planned_non_finite, high_non_finite: the output elements that are
            NaN/inf in each run, of ``numel`` floating output elements.
    """

    plain: float
    planned: float
    high: float
    missing: list = field(default_factory=list)
    plain_non_finite: int = 0
    planned_non_finite: int = 0
    high_non_finite: int = 0
    numel: int = 0

    def _digits(self, digits: float, non_finite: int) -> str:
        """A run's digits, with its NaN/inf outputs where it has some (they count 0 digits:
        the average alone would hide them)."""
        return f"{digits:.2f}" + (f" ({non_finite} of {self.numel} output elements NaN/inf)"
                                  if non_finite else "")

    def __repr__(self) -> str:
        return (f"PlanCheck(avg true digits at the outputs: "
                f"{self._digits(self.plain, self.plain_non_finite)} without the plan, "
                f"{self._digits(self.planned, self.planned_non_finite)} with it, "
                f"{self._digits(self.high, self.high_non_finite)} all in the higher format"
                + (f"; {len(self.missing)} operator(s) of the plan not found" if self.missing
                   else "") + ")")

    def _repr_html_(self) -> str:
        """Jupyter's display: the three runs' digits and NaN/inf outputs
        (:func:`fxstab.plots.notebook.check_fragment`)."""
        from ..plots import notebook

        return notebook.check_fragment(self)

    def report(self, plan: PrecisionPlan) -> str:
        lines = [f"real run in {plan.format} against fp64 of the same weights (avg true digits "
                 f"at the outputs): {self._digits(self.plain, self.plain_non_finite)} without "
                 f"the plan, {self._digits(self.planned, self.planned_non_finite)} with it "
                 f"({len(plan.promoted)} operators in {plan.higher}); all in {plan.higher}: "
                 f"{self._digits(self.high, self.high_non_finite)}"]
        if self.missing:
            lines.append(f"warning: {len(self.missing)} operator(s) of the plan were not found "
                         f"in the compiled model: {', '.join(self.missing[:5])}")
        return "\n".join(lines)


def _cast(v: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                           and t.is_floating_point() else t, v)


def output_true_digits(y: Any, ref: Any, cap: float) -> float:
    """The avg true digits of a model's floating outputs ``y`` against ``ref`` (fp64)."""
    total = numel = 0
    for a, r in zip(pytree.tree_leaves(y), pytree.tree_leaves(ref)):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel():
            total += float(true_digits(a, r, cap).sum())
            numel += a.numel()
    return total / numel if numel else float("nan")


def output_non_finite(y: Any) -> tuple[int, int]:
    """(NaN/inf elements, elements) of a model's floating outputs ``y``."""
    bad = numel = 0
    for a in pytree.tree_leaves(y):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel():
            bad += int((~torch.isfinite(a)).sum())
            numel += a.numel()
    return bad, numel


def check_plan(model: torch.nn.Module, example_inputs: Sequence, plan: PrecisionPlan
               ) -> PlanCheck:
    """Run ``model`` for real in the plan's format (a copy cast to its dtype, the inputs too),
    without and with the plan, and in ``higher``, against fp64 runs of the same weights and
    inputs (the low-precision copy's, widened: what the plan can fix is the arithmetic, not
    the parameters' own rounding): the avg true digits at the outputs of each, capped at the
    format's digits."""
    low = torch_dtype_of(plan.format)
    if low is None:
        raise ValueError(f"the plan's format {plan.format} is not a dtype torch computes in: "
                         f"the real run needs fp16, bf16 or fp32")
    high_dtype = _higher_dtype(plan)
    cap = get_format(plan.format).digit_cap
    lowered = copy.deepcopy(model).to(low)
    inputs = _cast(as_inputs(example_inputs), low)
    with torch.no_grad():
        ref = copy.deepcopy(lowered).to(torch.float64)(*_cast(inputs, torch.float64))
        plain = lowered(*inputs)
        high = copy.deepcopy(lowered).to(high_dtype)(*_cast(inputs, high_dtype))
        torch._dynamo.reset()
        planned_model = apply_plan(copy.deepcopy(lowered), plan)
        planned = planned_model(*inputs)
        missing = planned_model.plan_backend.missing()
    return PlanCheck(plain=output_true_digits(plain, ref, cap),
                     planned=output_true_digits(planned, ref, cap),
                     high=output_true_digits(high, ref, get_format(plan.higher).digit_cap),
                     missing=missing, plain_non_finite=output_non_finite(plain)[0],
                     planned_non_finite=output_non_finite(planned)[0],
                     high_non_finite=output_non_finite(high)[0],
                     numel=output_non_finite(plain)[1])
