"""Gradient digit maps: the backward graph analysed like the forward one (``backward=True``).

With ``fxstab.backend(..., backward=True)`` each captured graph runs through AOTAutograd
(:func:`through_autograd`): the forward graph AOTAutograd makes is what the model runs, and its
backward graph, when autograd first needs it, becomes a :class:`BackwardAnalysis`, the same
:class:`~fxstab.backend.GraphAnalysis` (the same rules, traced into a sampled graph per
signature) over the backward's aten operators. On each analysed backward call:

* the backward graph runs as is: the gradients that reach the model are the deterministic
  ones, bit for bit;
* beside it, its operators run on N samples, each floating output rounded into the format and
  measured. The backward graph's inputs (saved activations, incoming gradients) are exact
  values: what is measured is the error the backward arithmetic itself makes. Exact operators
  (views, transposes, copies, selections) are not instrumented, as at the arithmetic level.

Names. A backward operator is named after the forward operator it belongs to (AOTAutograd
keeps the forward node in ``fwd_source_fn_stack``), then ``grad``, then its aten kind and an
occurrence index within that forward operator: ``fc1/linear#0/grad/mm#1``; its module path is
the forward operator's. Each trainable parameter's gradient is one more entry,
``kind="param_grad"``, named ``"<parameter>/grad"`` (``fc1.weight/grad``), with the statistics
of the rounded output it is (the operator that produced it, through views: its ``underflow``
included), status ``observed``. Every backward entry has ``direction="backward"``.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Optional

import torch
import torch.fx
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

from ..config import rule_for
from ..rules.lifting import ACCUMULATED_KINDS, NodePlan, Stacked
from ..rules.op.tracer import Pending, SampleTracer
from .op_level import GraphAnalysis
from ..capture.naming import qualified_name, source_location
from ..capture.torchao import float8_cast
from ..records.report import OBSERVED

__all__ = ["through_autograd", "BackwardAnalysis", "parameter_name"]

_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']*)'\]")


def parameter_name(placeholder: torch.fx.Node) -> Optional[str]:
    """``fc1.weight`` for the dynamo placeholder of a module parameter (its source
    ``L['self']._modules['fc1']._parameters['weight']``); None for anything else."""
    arg = placeholder.meta.get("grapharg")
    source = getattr(arg, "source", None)
    text = source.name if isinstance(getattr(source, "name", None), str) else \
        (source.name() if source is not None and callable(getattr(source, "name", None)) else "")
    if "._parameters[" not in text:
        return None
    return ".".join(_PART.findall(text)) or None


def through_autograd(forward: GraphAnalysis, example_inputs: list) -> None:
    """Make ``forward`` run its graph through AOTAutograd, whose backward graph becomes a
    :class:`BackwardAnalysis` of the same backend."""
    owner = forward.owner
    params = [parameter_name(n) for n in forward.gm.graph.nodes if n.op == "placeholder"]
    made: dict = {}

    def fw_compiler(gm: torch.fx.GraphModule, example: list) -> Any:
        made["forward"] = gm  # (its saved values are the backward's inputs, by name)
        return make_boxed_func(gm)

    def bw_compiler(gm: torch.fx.GraphModule, example: list) -> Any:
        analysis = BackwardAnalysis(gm, owner, len(owner.graphs), forward, params,
                                    made.get("forward"))
        owner.graphs.append(analysis)
        return make_boxed_func(analysis)

    forward.deterministic = aot_module_simplified(forward.gm, example_inputs,
                                                  fw_compiler=fw_compiler,
                                                  bw_compiler=bw_compiler)


def _saved_weights(aot_forward: Optional[torch.fx.GraphModule], params: list) -> frozenset:
    """Names of the AOTAutograd forward's values that are a parameter (its placeholder
    ``primals_i`` is the captured graph's i-th input, ``params[i]`` names it) or a layout view
    of one alone (:data:`WEIGHT_VIEWS`): the backward's inputs of those names hold weights."""
    from ..rules.aten import op_info
    from ..rules.lifting import WEIGHT_VIEWS

    if aot_forward is None:
        return frozenset()
    placeholders = [n for n in aot_forward.graph.nodes if n.op == "placeholder"]
    weights = {n for n, p in zip(placeholders, params) if p is not None}
    for node in aot_forward.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        ins = node.all_input_nodes
        kind = node.target.overloadpacket.__name__
        if len(ins) == 1 and ins[0] in weights and kind in WEIGHT_VIEWS and \
                op_info(node.target).exact:
            weights.add(node)
    return frozenset(n.name for n in weights)


def _floating(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


class BackwardAnalysis(GraphAnalysis):
    """The backward graph of one captured graph, analysed (see the module docstring)."""

    direction = "backward"

    def __init__(self, gm: torch.fx.GraphModule, owner: Any, index: int,
                 forward: GraphAnalysis, params: list,
                 aot_forward: Optional[torch.fx.GraphModule] = None) -> None:
        self.forward = forward
        self.params = params  # per backward output: the parameter whose gradient it is, or None
        # the inputs saved from a parameter (through layout operators), by name
        self._saved_weights = _saved_weights(aot_forward, params)
        self._grads: Optional[list] = None  # the parameter gradients among the outputs
        # AOTAutograd names a backward node's forward operator by the last entry of that
        # operator's source_fn_stack: -> (stable name, module path)
        self._forward_ops: dict = {}
        names = getattr(forward, "operators", {})  # the arithmetic level's, by node name
        plans = {p.node: p for p in forward.plans}
        for node in forward.sgraph.nodes:
            stack = node.meta.get("source_fn_stack")
            if not stack or node.op not in ("call_function", "call_method", "call_module"):
                continue
            if node.name in names:
                name, path, _ = names[node.name]
            elif node in plans:
                p = plans[node]
                name, path = p.name or qualified_name(p.module_path, p.kind), p.module_path
            else:
                continue
            self._forward_ops.setdefault(stack[-1][0], (name, path))
        super().__init__(gm, owner, index)

    # -- compile time -------------------------------------------------------------------
    def _weight_inputs(self) -> frozenset:
        """The backward's inputs that are a parameter the forward saved, or a layout view of
        one (``t_1 = t(primals_4)``): weights, as the forward's (the GEMM surrogate does not
        perturb them; a bf16 model's stay in their dtype for the samples' bf16 GEMMs)."""
        return frozenset(n for n in self.sgraph.nodes
                         if n.op == "placeholder" and n.name in self._saved_weights)

    def _selected(self, node: torch.fx.Node, kind: str, qn: str) -> bool:
        from ..rules.aten import op_info

        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return False
        if float8_cast(node):  # a rounding into float8 (torchao's recipes), at every format
            return True
        info = op_info(node.target)
        return not (info.exact or info.factory or info.compare) and _floating(
            node.meta.get("val"))

    def _plan(self) -> None:
        """The plans of the forward's, then each modelled GEMM's accumulator and operand format
        by its role: ``"wgrad"`` where it gives a weight's gradient
        (:meth:`_weight_gradient_gemms`), ``"dgrad"`` otherwise (an activation's gradient)."""
        super()._plan()
        wgrad = self._weight_gradient_gemms()
        for plan in self.plans:
            if plan.name is not None and plan.gemm and plan.kind in ACCUMULATED_KINDS:
                role = "wgrad" if plan.node in wgrad else "dgrad"
                qn = qualified_name(plan.module_path, plan.kind)
                plan.accumulate = rule_for(self.cfg.accumulate, plan.kind, qn, plan.name, role)
                plan.gemm_inputs = rule_for(self.cfg.gemm_inputs, plan.kind, qn, plan.name, role)

    def _weight_gradient_gemms(self) -> set:
        """The GEMM nodes that give a parameter's gradient: reached from a backward output that
        is one (``self.params``) through getitem, exact operators (the transposes and views of
        ``mm(grad_out.t(), x).t()``), casts and additions (a weight used twice sums its
        gradients)."""
        from ..rules.aten import op_info

        through = {torch.ops.aten.add.Tensor, torch.ops.aten._to_copy.default}
        output = next(n for n in self.sgraph.nodes if n.op == "output")
        outs = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else []
        todo = [outs[i] for i, name in enumerate(self.params) if name is not None and i < len(outs)]
        found: set = set()
        seen: set = set()
        while todo:
            node = todo.pop()
            if not isinstance(node, torch.fx.Node) or node in seen or node.op != "call_function":
                continue
            seen.add(node)
            plan = self.plan_of.get(node)
            if plan is not None and plan.gemm and plan.kind in ACCUMULATED_KINDS:
                found.add(node)
            elif node.target is operator.getitem or node.target in through or (
                    isinstance(node.target, torch._ops.OpOverload) and op_info(node.target).exact):
                todo.extend(node.all_input_nodes)
        return found

    def _forward_op(self, node: torch.fx.Node) -> tuple[str, str]:
        """(name, module path) of the forward operator a backward node belongs to."""
        stack = node.meta.get("fwd_source_fn_stack") or []
        found = self._forward_ops.get(stack[-1][0]) if stack else None
        # none: autograd's own (the gradient accumulation of a value used twice)
        return found or ("", "")

    def _operator(self, node: torch.fx.Node, kind: str, repeats: dict) -> tuple[str, str, str]:
        fwd, path = self._forward_op(node)
        k = repeats.get((fwd, kind), 0)
        repeats[(fwd, kind)] = k + 1
        name = f"{fwd}/grad/{kind}#{k}" if fwd else f"grad/{kind}#{k}"
        return name, path, source_location(node)

    def _producer(self, node: Any) -> Optional[tuple]:
        """(instrumented node, output index) whose rounded output a backward output is,
        through getitem and exact views; None if there is none. Decided once per graph."""
        from ..rules.aten import op_info

        instrumented = {p.node for p in self.plans if p.name is not None}
        j = 0
        for _ in range(32):
            if not isinstance(node, torch.fx.Node):
                return None
            if node in instrumented:
                return node, j
            if node.op == "call_function" and node.target is operator.getitem:
                node, j = node.args[0], int(node.args[1])
            elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                    and op_info(node.target).exact and node.args:
                node = node.args[0]
            else:
                return None
        return None

    # -- run time -----------------------------------------------------------------------
    def run_samples(self, args: tuple, call: int, rng_states: dict) -> Any:
        out = super().run_samples(args, call, rng_states)
        self._record_param_grads(out, call)
        return out

    def _record_param_grads(self, out: Any, call: int) -> None:
        """One ``param_grad`` entry per parameter gradient among the backward's outputs: the
        statistics of the rounded output it is (a view of), measured again only where it is
        none (a gradient no instrumented operator produced)."""
        if self._grads is None:  # (output index, parameter, output node, producer), once
            output = next(n for n in self.gm.graph.nodes if n.op == "output")
            nodes = list(output.args[0])
            self._grads = [(i, name, nodes[i], self._producer(nodes[i]))
                           for i, name in enumerate(self.params)
                           if name is not None and i < len(nodes)
                           and isinstance(nodes[i], torch.fx.Node)]
        flat = list(out)
        last = self.last_tracer
        pending = {e.plan.node: e.stats for e in (last.pending if last is not None else ())}
        tracer = SampleTracer(self.view, call)
        for i, name, node, source in self._grads:
            v = flat[i] if i < len(flat) else None
            t = v.samples if isinstance(v, Stacked) else v
            if not _floating(t):
                continue
            samples = t if isinstance(v, Stacked) else t.unsqueeze(0).expand(self.cfg.n_samples,
                                                                             *t.shape)
            for cap in self.owner.captures:
                cap.gradients[name] = samples.detach().clone()
            stats = pending.get(source[0]) if source is not None else None
            vec = stats[source[1]] if stats is not None and source[1] < len(stats) else None
            if vec is None:
                vec = tracer.measure(samples.contiguous(), self._format_of(node, f"{name}/grad"))
            pname = f"{name}/grad"
            plan = NodePlan(node=node, kind="param_grad", name=pname,
                            module_path=name.rsplit(".", 1)[0] if "." in name else "",
                            format=self._format_of(node, pname))
            plan.report = {"name": pname, "kind": "param_grad",
                           "module_path": plan.module_path, "source": "",
                           "inputs": tuple(sorted(self.frontier.get(node, frozenset()))),
                           "direction": "backward", "format": plan.format.name}
            tracer.note(Pending(plan, [vec], False, OBSERVED, tuple(samples.shape[1:])))
        tracer.finish()
