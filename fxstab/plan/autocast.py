"""``torch.autocast``'s fp32 list as a plan (issue 55, item 3): the operators autocast runs in
fp32 when the model is kept in fp32 and autocast lowers to the plan's format.

Which operators those are is torch's own decision, not a copy of it here: the model (a copy in
fp32) runs once under ``torch.autocast(device, dtype=format)`` through a ``torch.compile``
backend that names each captured graph's operators exactly as the analysis does
(:class:`fxstab.analysis.op_level.GraphAnalysis`, as :class:`fxstab.plan.apply.PlanBackend`
does) and reads the dtype of each operator's output. An operator whose output is fp32 ran in
fp32: the ops on autocast's fp32 list for the device (``KERNEL_CPU(..., fp32)`` /
``KERNEL_CUDA(..., fp32)`` in ``aten/src/ATen/autocast_mode.cpp``: ``softmax``,
``log_softmax``, ``layer_norm``, ``group_norm``, the norms, ``exp``/``log``/``pow``, ``sum``,
``cross_entropy``/``nll_loss``, ...; the CPU list is the longer one) and every operator autocast
leaves alone that reads an fp32 value (type promotion: the residual stream's ``add`` of the
fp32 embeddings and a bf16 GEMM's output is fp32). Autocast's lower-precision list (``linear``,
``matmul``, ``bmm``, ``addmm``, ``conv``, attention) and the operators reading only their
outputs run in the format.

Run by :func:`fxstab.apply_plan`, that set of operators computes as autocast computes: a
promoted operator's output stays fp32 for the promoted operators that read it and is cast to
the format for the rest (autocast casts a GEMM's fp32 operands to the format); an operator
reading a GEMM's output in the format casts it up (type promotion does the same).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..analysis.op_level import GraphAnalysis
from ..config import AnalysisConfig
from ..numerics.formats import get_format, torch_dtype_of
from ..records.run import RunState

__all__ = ["autocast_fp32_operators", "AutocastProbe", "AutocastCandidate"]


class AutocastProbe:
    """The ``torch.compile`` backend that names the operators as the analysis does and records
    the dtype each one's output has (``dtypes``: operator name -> dtype, the first call's)."""

    def __init__(self, format: Any, select: Any = None) -> None:
        options = {"select": select} if isinstance(select, (str, list)) else {}
        self.state = RunState(AnalysisConfig(format=get_format(format).name, **options))
        self.dtypes: dict = {}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        analysis = GraphAnalysis(gm, self.state, len(self.state.graphs))
        self.state.graphs.append(analysis)
        names = {p.node.name: p.name for p in analysis.plans}
        graph = analysis.sgraph
        module = torch.fx.GraphModule(gm, graph) if graph is not gm.graph else gm
        dtypes = self.dtypes

        class Reader(torch.fx.Interpreter):
            def run_node(self, n: torch.fx.Node) -> Any:
                out = super().run_node(n)
                name = names.get(n.name)
                if name is not None and name not in dtypes:
                    leaf = next((t for t in pytree.tree_leaves(out)
                                 if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
                    if leaf is not None:
                        dtypes[name] = leaf.dtype
                return out

        def run(*args: Any) -> Any:
            return Reader(module).run(*args)
        return run


def autocast_fp32_operators(model: Any, inputs: Sequence, format: Any,
                            forward: Optional[Sequence[str]] = None,
                            select: Any = None) -> Optional[list]:
    """The operators (digit-map names, in ``forward``'s order where given) that
    ``torch.autocast(device, dtype=format)`` runs in fp32 on a copy of ``model`` in fp32 with
    ``inputs`` (floating ones in fp32); None where autocast cannot lower to ``format`` (a
    format torch does not compute in, an fp32 or wider one, or a device autocast refuses)."""
    low = torch_dtype_of(format)
    if low is None or low not in (torch.bfloat16, torch.float16):
        return None
    leaves = [t for t in pytree.tree_leaves(tuple(inputs)) if isinstance(t, torch.Tensor)]
    if isinstance(model, torch.nn.Module):
        leaves += list(model.parameters())[:1]
    device = leaves[0].device.type if leaves else "cpu"
    probe = AutocastProbe(format, select)
    fp32 = copy.deepcopy(model)
    if isinstance(fp32, torch.nn.Module):
        fp32 = fp32.float()
    args = pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor)
                           and t.is_floating_point() else t, tuple(inputs))
    torch._dynamo.reset()
    try:
        with torch.no_grad(), torch.autocast(device, dtype=low):
            torch.compile(fp32, backend=probe)(*args)
    except RuntimeError as exc:  # autocast refuses the device/dtype pair
        if "autocast" in str(exc).lower():
            return None
        raise
    finally:
        torch._dynamo.reset()
    names = [n for n, d in probe.dtypes.items() if d == torch.float32]
    if forward is not None:
        chosen = set(names)
        return [n for n in forward if n in chosen]
    return names


class AutocastCandidate:
    """``torch.autocast``'s fp32 list as a candidate of a plan's search
    (:class:`fxstab.plan.search.PlanSearch`): :meth:`prepare` finds its operators (a real fp32
    run under autocast, not an analysed call) and prices them; :meth:`compare` sets the
    search's plan against it once, in the analysis (one analysed call, with the search's seed
    and metric), and returns the plan the search goes on with. ``info`` is what the plan's
    ``settings["autocast"]`` records: the candidate's operators, cost, digits and run digits,
    whether it was chosen and why.

    The rule: the plan stays only where it is better than autocast's list. Autocast's list is
    returned where it costs no more than the plan and keeps ``keep`` or at least the plan's
    digits (less the margin the search compares candidates with: the estimator's standard
    error on the bisection route), and where the plan misses ``keep`` and autocast's list
    meets it, whatever it costs. On the local route (a hazard), a plan that keeps ``keep`` at a
    lower cost than autocast's list beats it without the call; the bisection's plans (a spread
    loss) are always set against it (the search left a call for it)."""

    def __init__(self, search: Any) -> None:
        self.search = search
        self.ops: Optional[list] = None  # None: no candidate (info["reason"] says why)
        self.cost = math.nan
        self.compared = False
        self.info: dict = {}

    def prepare(self) -> None:
        s = self.search
        if s.recipe[0] or s.recipe[1]:
            self.info = {"reason": "a GEMM recipe (gemm_inputs=/accumulate=): autocast has no "
                                   "such list"}
            return
        try:
            ops = autocast_fp32_operators(s.model, s.inputs, s.format, s.forward,
                                          s.options.get("select"))
        except Exception as exc:  # the plan goes on without the candidate, and says why
            self.info = {"reason": f"autocast's list could not be read (the model under "
                                   f"torch.autocast in fp32 failed: {type(exc).__name__}: "
                                   f"{str(exc)[:200]})"}
            return
        if ops is None:
            self.info = {"reason": f"torch.autocast does not lower to {s.format.name} here"}
            return
        if not ops:
            self.info = {"reason": "torch.autocast runs no operator of the model in fp32"}
            return
        self.ops, self.cost = ops, s.plan_cost(ops)
        # digits/run: None until analysed (JSON null; a NaN would come back a string)
        self.info = {"operators": len(ops), "cost": self.cost, "digits": None,
                     "run": None, "chosen": False,
                     "reason": "not compared (no search: the outputs keep keep with nothing "
                               "promoted, or miss it with everything)"}

    def compare(self, target: float, promoted: list, ev: Any) -> tuple:
        """(promoted, evaluation) after the comparison with autocast's list (above)."""
        s = self.search
        if self.compared or not self.ops:
            return promoted, ev
        self.compared = True
        cost = s.plan_cost(promoted)
        mine = f"the plan ({len(promoted)} operators) keeps {ev.digits:.2f} at cost {cost:.3f}"
        if s.meets(ev, target) and cost < self.cost and s.route != "bisection":
            self.info["reason"] = (f"{mine}, cheaper than autocast's fp32 list "
                                   f"({len(self.ops)} operators, cost {self.cost:.3f}): the plan "
                                   f"stays (autocast's list not analysed)")
            return promoted, ev
        if s.exhausted:
            self.info["reason"] = "not compared: the budget ran out"
            return promoted, ev
        a = s.evaluate(self.ops)
        self.info.update(digits=a.digits, run=a.run)
        theirs = (f"autocast's fp32 list ({len(self.ops)} operators) keeps {a.digits:.2f} at "
                  f"cost {self.cost:.3f}")
        if self.cost <= cost and (s.meets(a, target) or
                                  a.digits >= ev.digits - s.margin * ev.spread):
            why = "keeps keep" if s.meets(a, target) else "keeps as much"
            self.info.update(chosen=True, reason=f"{theirs}, {mine}: autocast's list {why} at "
                                                 f"no higher cost; the plan is autocast's list")
            return list(self.ops), a
        if s.meets(a, target) and not s.meets(ev, target):
            self.info.update(chosen=True, reason=f"{theirs}, {mine}: the search's plan misses "
                                                 f"keep and autocast's list meets it; the plan "
                                                 f"is autocast's list")
            return list(self.ops), a
        better = "cheaper" if cost < self.cost else "more digits"
        self.info["reason"] = f"{mine}, {theirs}: the plan beats it ({better}) and stays"
        return promoted, ev
