"""The operator level's analysis of one captured graph (docs/design.md §3): the plan (which nodes
are instrumented, their stable names, the edges between them, which roundings carry their
consumer GEMM's surrogate), decided once at compile time, and the analysed call: the
deterministic path as captured, then the stochastic path (:class:`fxstab.rules.op_level.SampleTracer`,
traced into a :class:`~fxstab.analysis.sampled_graph.SampledGraph` per input signature), the
user's RNG state restored after it.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..capture.graph import (
    floating_dtype, identity_dropout, is_metadata, mutated_placeholders, names_weight, reads_item,
    selector,
)
from ..capture.naming import module_path, qualified_name, source_location
from ..capture.opsets import DROPOUT_KINDS, RANDOM_KINDS, is_custom, is_gemm, node_kind
from ..capture.torchao import float8_cast, float8_matmul
from ..cpu import alloc
from ..numerics.formats import get_format
from ..records.coverage import SKIPPED, CoverageEntry
from ..records.run import RunState
from ..config import rule_for
from ..rules.lifting import (
    ACCUMULATED_KINDS, LOW_READERS, WEIGHT_VIEWS, NodePlan, OpGraph, Stacked, has_floating,
    rng_states, set_rng_states,
)
from ..rules.op.tracer import SampleTracer
from .composites import expand_composites
from .sampled_graph import SampledGraph, SampledGraphs, signature

__all__ = ["GraphAnalysis", "GraphInfo", "SampleCapture"]

@dataclass
class GraphInfo:
    """What the backend did with one captured graph (for tests and debugging)."""

    index: int
    n_nodes: int
    instrumented: list = field(default_factory=list)  # (name, kind, node name)
    unlifted: dict = field(default_factory=dict)  # name or node name -> reason
    # operators whose samples run in the model's dtype (the working dtype raised): -> reason
    in_model_dtype: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)  # exceptions swallowed on the stochastic path
    calls: int = 0
    analysed_calls: int = 0
    # node name -> how it ran in the latest analysed call (fxstab.records.coverage)
    coverage: dict = field(default_factory=dict)
    # fused node name -> the kinds of the composite its samples ran as
    composites: dict = field(default_factory=dict)
    # operator -> the low-precision recipe recognised in the program (a torchao float8 GEMM,
    # fxstab.capture.torchao)
    recipes: dict = field(default_factory=dict)
    # signature -> why its stochastic path could not be traced (its rules then run untraced)
    untraced: dict = field(default_factory=dict)
    # the weights' copies in the working dtype the analysis keeps, in bytes (a weight its
    # readers' GEMMs read in its own dtype has none: GraphAnalysis._low_weights)
    weight_copies: int = 0
    # device -> the bf16 GEMM path's platform check, where it decided a weight's products
    # (fxstab.numerics.lowp_gemm.verdict_for; the map's metadata "lowp_gemm")
    lowp_checks: dict = field(default_factory=dict)
    # instrumented operators whose values reach no floating output but through instrumented
    # operators (a NaN/inf there is absorbed: GraphAnalysis._reaching_no_output)
    no_output: set = field(default_factory=set)
    # instrumented operators whose values are outputs of the graph (through no instrumented
    # operator), read by other operators or not: a NaN/inf there reaches the caller
    outputs: set = field(default_factory=set)


class GraphAnalysis:
    """One captured graph: its plan, and the callable dynamo runs."""

    def __init__(self, gm: torch.fx.GraphModule, owner: RunState, index: int) -> None:
        self.gm = gm
        self.owner = owner
        self.cfg = owner.config
        self.index = index
        self.info = GraphInfo(index=index, n_nodes=len(gm.graph.nodes))
        self.mutated = mutated_placeholders(gm.graph)
        self.plans: list[NodePlan] = []
        self.free_after = self._last_uses(gm.graph)
        self.sampled = SampledGraphs()  # the generated stochastic paths, by signature
        # what the model runs: the captured graph (backward=True: through AOTAutograd, whose
        # backward graph fxstab.analysis.backward analyses)
        self.deterministic: Callable = gm
        self.last_tracer: Optional["SampleTracer"] = None  # of the latest analysed call
        # weights kept in the working dtype: position -> (weight, its version, the copy)
        self._weight_slots: Optional[list] = None
        self._kept_weights: dict = {}
        self._plan()

    # -- compile time -------------------------------------------------------------------
    @staticmethod
    def _last_uses(graph: torch.fx.Graph) -> dict:
        """node -> the values whose last use it is: the stochastic path frees them right after,
        so at most the live activations exist N times (not every activation of the graph)."""
        last: dict = {}
        for node in graph.nodes:
            for m in node.all_input_nodes:
                last[m] = node
        freed: dict = {}
        for value, user in last.items():
            if user.op != "output":
                freed.setdefault(user, []).append(value)
        return freed

    def _placeholders(self) -> list:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    direction = "forward"  # of this graph's operators (fxstab.analysis.backward: "backward")

    def _selected(self, node: torch.fx.Node, kind: str, qn: str) -> bool:
        """Whether the node is an instrumented operator (rounded and recorded)."""
        if self._pred is None:
            self._pred = selector(self.cfg.select)
        return (not is_metadata(node, kind) and not identity_dropout(node, kind)
                and (kind in DROPOUT_KINDS or kind not in RANDOM_KINDS or
                     self.cfg.select is not None) and self._pred(node, kind, qn))

    def _format_of(self, node: torch.fx.Node, name: Optional[str] = None) -> Any:
        """The format an instrumented node's output rounds into: the configured one (its own
        with ``formats=``, by its stable ``name``), or with ``format="auto"`` its floating
        dtype in the program (dynamo's example value, the lowered graph's value; a cast into
        float8, :func:`~fxstab.capture.torchao.float8_cast`: that format)."""
        if not self.cfg.auto_format:
            return self.cfg.format_for(name) if name is not None else self.cfg.format
        fp8 = float8_cast(node)
        if fp8 is not None:
            return get_format(fp8)
        dtype = floating_dtype(node)
        try:
            return get_format(dtype) if dtype is not None else self.cfg.format
        except ValueError:
            return self.cfg.format

    def _operator(self, node: torch.fx.Node, kind: str, repeats: dict) -> tuple[str, str, str]:
        """(stable name, module path, source location) of an instrumented node."""
        path = module_path(node)
        src = source_location(node)
        key = (path, kind, src)
        rep = repeats.get(key, 0)
        repeats[key] = rep + 1
        return self.owner.names.name(path, kind, src, rep), path, src

    def _plan(self) -> None:
        self._pred = None
        repeats: dict[tuple, int] = {}
        frontier: dict[torch.fx.Node, frozenset] = {}
        # the graph the samples run: the captured one, fused operators expanded (the
        # deterministic path keeps calling self.gm)
        self.sgraph = expand_composites(self.gm.graph, self.info.composites)
        if self.sgraph is not self.gm.graph:
            self.mutated = mutated_placeholders(self.sgraph)
            self.free_after = self._last_uses(self.sgraph)
        for i, node in enumerate(self.sgraph.nodes):
            kind = node_kind(node)
            # a torchao float8 GEMM is the matmul it is, its operands in the recipe its config
            # gives (fxstab.capture.torchao), at every format: the program's own quantisation
            fp8 = float8_matmul(node)
            if fp8 is not None:
                kind = "matmul"
            plan = NodePlan(node=node, kind=kind, index=i, custom=is_custom(node),
                            layout=kind in WEIGHT_VIEWS)
            ins: set = set()
            for m in node.all_input_nodes:
                ins |= frontier.get(m, frozenset())
            if node.op in ("call_function", "call_method", "call_module"):
                path = module_path(node)
                self.owner.modules.add(path)
                plan.module_path = path
                if self._selected(node, kind, qualified_name(path, kind)):
                    plan.name, path, src = self._operator(node, kind, repeats)
                    plan.module_path = path
                    plan.source = src
                    plan.gemm = is_gemm(kind)
                    if plan.gemm and kind in ACCUMULATED_KINDS:
                        qn = qualified_name(path, kind)
                        plan.accumulate = rule_for(self.cfg.accumulate, kind, qn, plan.name)
                        plan.gemm_inputs = rule_for(self.cfg.gemm_inputs, kind, qn, plan.name)
                        if fp8 is not None and plan.gemm_inputs is None:
                            plan.gemm_inputs = get_format(fp8.operands)
                            plan.gemm_scaling = fp8.scaling
                            self.info.recipes[plan.name] = fp8.label
                    plan.inputs = tuple(sorted(ins))
                    plan.format = self._format_of(node, plan.name)
                    plan.rounds = self.cfg.rounds(plan.name)
                    plan.report = {"name": plan.name, "kind": kind, "module_path": path,
                                   "source": src, "inputs": plan.inputs,
                                   "direction": self.direction, "format": plan.format.name}
                    self.info.instrumented.append((plan.name, kind, node.name))
                    frontier[node] = frozenset({plan.name})
                else:
                    frontier[node] = frozenset(ins)
            else:
                frontier[node] = frozenset(ins)
            self.plans.append(plan)
        self.frontier = frontier
        self.plan_of = {plan.node: plan for plan in self.plans}  # the tracer's lookup
        self.info.no_output, self.info.outputs = self._reaching_no_output()
        # placeholders read with .item() (dynamo passes a module's float as a 0-d tensor):
        # their values are part of a trace's signature
        self._item_inputs = [i for i, n in enumerate(self._placeholders())
                             if any(reads_item(u) for u in n.users)]
        self._plan_fusion()
        low = self._low_weights()
        # what the tracer reads of this graph (fxstab.rules.lifting.OpGraph)
        self.view = OpGraph(self.gm, self.sgraph, self.index, self.plan_of, self.free_after,
                            self.mutated, self.owner, self.info.unlifted,
                            self.info.in_model_dtype, dict(low), self._weight_inputs())
        names = [n.name for n in self._placeholders()]
        self._low_slots = {names.index(n.name): fmt for n, fmt in low.items() if n.name in names}

    def _low_weights(self) -> dict:
        """The weights (placeholder -> format name) that may stay in their own low-precision
        dtype: every reader is a GEMM that reads it as its weight (a linear, a Conv1D's addmm
        or matmul: ``LOW_READERS``) and whose samples' GEMMs run in the format's kernels
        (:mod:`fxstab.numerics.lowp_gemm`), or an embedding (a lookup, exact in any dtype; its
        rows then widen); those plans are marked ``lowp``. A
        bf16 model's weights were otherwise copied into the working dtype: twice the model's
        memory, and the first analysed call's time faulting it in
        (benchmarks/bench_scale.py). The format is the linear readers' (None: embeddings
        only)."""
        from ..numerics.formats import working_dtype_for
        from ..numerics.lowp_gemm import LOWP_DTYPES

        if not self.cfg.lowp_gemm:
            return {}
        # (the path computes fp32 samples' products: fp64 ones, format="auto"'s, read the
        # working copy, converted once, not at every call)
        fp32 = working_dtype_for(self.cfg.widest_format) == torch.float32
        for plan in self.plans:
            fmt = (plan.format or self.cfg.format).name
            node = plan.node
            if plan.kind == "embedding":
                plan.lowp = _arg(node, 3, "max_norm") is None
            else:  # a GEMM of LOW_READERS with no modelled accumulator, no scaled addmm
                plan.lowp = fp32 and plan.kind in LOW_READERS and plan.accumulate is None and \
                    plan.gemm_inputs is None and fmt in LOWP_DTYPES and \
                    node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1
        low: dict = {}
        weights = self._weight_inputs()
        for node in self.sgraph.nodes:
            if node.op != "placeholder" or not (names_weight(node) or node in weights) or \
                    not node.users:
                continue
            fmts: set = set()
            if self._read_low(node, fmts) and len(fmts) <= 1:
                low[node] = fmts.pop() if fmts else None
        return low

    def _read_low(self, node: torch.fx.Node, fmts: set) -> bool:
        """Whether every reader of ``node`` reads it as a ``lowp`` plan's weight, directly or
        through layout operators of it alone (:data:`WEIGHT_VIEWS`: a backward graph's
        ``mm(grad, t(W^T))``); their formats into ``fmts``."""
        for user in node.users:
            plan = self.plan_of.get(user)
            leaves = pytree.tree_leaves((user.args, user.kwargs))
            if sum(v is node for v in leaves) != 1:
                return False
            if plan is not None and plan.name is None and plan.layout and \
                    sum(isinstance(v, torch.fx.Node) for v in leaves) == 1:
                if not user.users or not self._read_low(user, fmts):
                    return False
                continue
            if plan is None or not plan.lowp or \
                    _arg(user, *LOW_READERS[plan.kind][0]) is not node:
                return False
            if plan.kind != "embedding":
                fmts.add((plan.format or self.cfg.format).name)
        return True

    def _weight_inputs(self) -> frozenset:
        """Placeholders that hold a weight though dynamo does not name them so (none here: a
        backward graph's saved views of parameters, :class:`~fxstab.analysis.backward.
        BackwardAnalysis`)."""
        return frozenset()

    def _reaching_no_output(self) -> tuple[set, set]:
        """The instrumented operators that no instrumented operator reads and whose values
        reach no floating output of the graph: only integer results (a cast to int, a
        comparison, a mask) or nothing. A NaN/inf they hold is absorbed there (a T5
        relative-position bucket's ``log(0)`` feeds an integer cast). And the instrumented
        operators whose values reach an output of the graph (a NaN/inf there is no one's to
        absorb, even where another operator reads them too)."""
        plans = self.plan_of
        reaches: dict = {}

        def reaches_output(node: torch.fx.Node) -> bool:  # past ``node``, not through plans
            if node in reaches:
                return reaches[node]
            reaches[node] = False  # (a graph has no cycle; guards a revisit)
            found = False
            for user in node.users:
                if user.op == "output":
                    found = True
                elif (plans.get(user) is None or plans[user].name is None) and \
                        _maybe_floating(user) and reaches_output(user):
                    found = True
                if found:
                    break
            reaches[node] = found
            return found

        # read by an instrumented operator with a floating output (one the map will hold)
        read = {i for p in self.plans if p.name is not None and _maybe_floating(p.node)
                for i in p.inputs}
        out, outputs = set(), set()
        for node in reversed(list(self.sgraph.nodes)):  # users first: shallow recursion
            plan = plans.get(node)
            if plan is None or plan.name is None:
                continue
            if reaches_output(node):
                if _maybe_floating(node):
                    outputs.add(plan.name)
            elif plan.name not in read:
                # (one that instrumented operators read is the map's edges' business)
                out.add(plan.name)
        return out, outputs

    def _plan_fusion(self) -> None:
        """Mark the rounded outputs whose only consumer is an instrumented GEMM that reads them
        once: the GEMM surrogate's perturbation of that operand then runs in the same pass as
        the rounding (the samples in cache), with the seed the GEMM would have used."""
        by_node = self.plan_of
        for plan in self.plans:
            read, users = plan.node, list(plan.node.users)
            # through identity dropouts (eval), which pass the samples on as they are
            while len(users) == 1 and identity_dropout(users[0], node_kind(users[0])) and \
                    users[0].args and users[0].args[0] is read:
                read, users = users[0], list(users[0].users)
            if plan.name is None or plan.gemm or len(users) != 1:
                continue
            user = by_node.get(users[0])
            if user is None or user.name is None or not user.gemm:
                continue
            leaves = pytree.tree_flatten((user.node.args, user.node.kwargs))[0]
            where = [i for i, v in enumerate(leaves) if v is read]
            if len(where) == 1:
                plan.fuse = (user, where[0])

    # -- run time -----------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        info = self.info
        call = info.calls
        info.calls += 1
        if call % self.cfg.every != 0 or not self.owner.enabled:
            return self.deterministic(*args)
        info.analysed_calls += 1
        alloc.tune()  # once per process: see fxstab/cpu/alloc.py
        states = rng_states(args)
        out = self.deterministic(*args)
        after = rng_states(args)
        try:
            set_rng_states(states)
            # the samples run in the working dtype, rounded into the format: an autocast around
            # the call would cast them to its own dtype (round to nearest) first
            with torch.no_grad(), _autocast_off():
                sample_out = self.run_samples(args, call, states)
        except Exception as exc:  # the user's model never crashes because of fxstab
            info.failures.append(f"{type(exc).__name__}: {exc}")
            self._coverage_failed(exc)
            warnings.warn(f"fxstab: stochastic path of graph {self.index} failed "
                          f"({type(exc).__name__}: {exc}); the model's output is unaffected",
                          RuntimeWarning, stacklevel=2)
            sample_out = None
        finally:
            set_rng_states(after)
        forward = self.direction == "forward"  # a backward graph returns gradients as they are
        if self.owner.captures and sample_out is not None and forward:
            captured = SampleCapture.as_tensors(out, sample_out, self.cfg.n_samples)
            for cap in self.owner.captures:
                cap.graphs.append(captured)
        if self.cfg.output == "mean" and sample_out is not None and forward:
            return _straight_through_mean(out, sample_out)
        return out

    def _coverage_failed(self, exc: Exception) -> None:
        """Every operator of a graph whose stochastic path failed: skipped, with the reason."""
        graph = getattr(self, "sgraph", self.gm.graph)
        why = f"the graph's stochastic path failed ({type(exc).__name__}: " \
              f"{(str(exc).splitlines() or [''])[0][:160]})"
        by_node = {p.node: p for p in self.plans if isinstance(p, NodePlan)}
        cov = self.info.coverage = {}  # a sampled graph's own notes stay as they are
        for node in graph.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            plan = by_node.get(node)
            kind = node_kind(node)
            floating = has_floating(node.meta.get("example_value"))
            name = plan.name if plan is not None and plan.name else \
                qualified_name(module_path(node), kind)
            cov[node.name] = CoverageEntry(operator=name, kind=kind, how=SKIPPED, reason=why,
                                           graph=self.index, node=node.name, floating=floating,
                                           counted=floating)

    def coverage_entries(self) -> list:
        """How each operator ran in the latest analysed call (graph order)."""
        out = []
        for fused, (kind, parts, qn) in self.info.composites.items():
            out.append(CoverageEntry(
                operator=qn, kind=kind, how=SKIPPED,
                reason=f"fused: its composite ran on the samples ({', '.join(dict.fromkeys(parts))})",
                graph=self.index, node=fused, floating=True, counted=False))
        return out + list(self.info.coverage.values())

    def run_samples(self, args: tuple, call: int, rng_states: dict) -> Any:
        """The stochastic path of one analysed call; returns the outputs' samples.

        The first call with a signature runs the rules untraced; the second traces them into
        a :class:`SampledGraph` (that trace is the call's stochastic path); later calls run the
        generated graph. Where the trace fails, the rules run untraced on every call with that
        signature (``info.untraced`` says why)."""
        args = self._working_weights(args)
        key = self._sampled_key(args)
        sg = self.sampled.get(key)
        if sg is not None:
            if self.info.coverage is not sg.coverage:
                self.info.coverage = sg.coverage
            out = sg(args, call)
            sg.tracer.finish()
            self.last_tracer = sg.tracer
            return out
        if key in self.info.untraced or self.sampled.first_sight(key):
            # notes of its own: the current ones may be a sampled graph's (its coverage)
            tracer = SampleTracer(self.view, call, dict(self.info.coverage))
            self.info.coverage = tracer.coverage
            out = tracer.run(args)
            tracer.finish()
            self.last_tracer = tracer
            return out
        tracer = SampleTracer(self.view, call)
        self.info.coverage = tracer.coverage
        try:
            sg = SampledGraph.trace(tracer, args, Stacked)
        except Exception as exc:  # noqa: BLE001 - the rules, untraced, for this signature
            self._refused(key, exc)
            set_rng_states(rng_states)
            self.info.coverage = {}
            return self.run_samples(args, call, rng_states)
        sg.coverage = tracer.coverage
        self.sampled.add(key, sg)
        tracer.finish()
        self.last_tracer = tracer
        out, sg.first = sg.first, None
        return out

    def _working_weights(self, args: tuple) -> tuple:
        """The graph's weights (parameters and buffers) in the samples' working dtype,
        converted once and kept while a weight is unchanged (the same tensor at the same
        version): a bf16 model's weights were cast to fp32 at every analysed call, half of a
        Llama-shaped model's analysed call (benchmarks/bench_scale.py). The samples' values
        are the same; the kept copies cost the weights once more in the working dtype, except
        a weight read only by linears of the format's own GEMMs (:meth:`_low_weights`), which
        stays as it is: its own twin."""
        from ..numerics import lowp_gemm

        if self._weight_slots is None:
            from ..numerics.formats import working_dtype_for

            self._wdtype = working_dtype_for(self.cfg.widest_format)
            self._weight_slots = [i for i, n in enumerate(self._placeholders())
                                  if names_weight(n)]
        if not self._weight_slots:
            return args
        new, changed = list(args), False
        for i in self._weight_slots:
            a = args[i] if i < len(args) else None
            if not isinstance(a, torch.Tensor) or not a.is_floating_point() or \
                    a.dtype == self._wdtype:
                continue
            try:
                version = a._version
            except Exception:  # noqa: BLE001 - an inference tensor: no version to trust
                continue
            kept = self._kept_weights.get(i)
            if kept is None or kept[0] is not a or kept[1] != version:
                if i in self._low_slots:
                    verdict = lowp_gemm.verdict_for(a, self._low_slots[i] or "")
                    if verdict is not None:
                        self.info.lowp_checks[str(a.device)] = verdict
                copy = a if i in self._low_slots and lowp_gemm.keeps(
                    a, self._low_slots[i]) else a.detach().to(self._wdtype)
                kept = self._kept_weights[i] = (a, version, copy)
                lowp_gemm.set_twin(copy, a)  # the samples' GEMMs read it as it is
                changed = True
            new[i] = kept[2]
        if changed:
            self.info.weight_copies = sum(c.numel() * c.element_size()
                                          for w, _, c in self._kept_weights.values() if c is not w)
        return tuple(new)

    def _sampled_key(self, args: tuple) -> tuple:
        """What a sampled graph of this graph depends on: the arguments' signature, and the
        values of the module's scalars the graph reads with ``.item()`` (constants of a
        trace)."""
        key = signature(args)
        if self._item_inputs:
            key += tuple(args[i].item() if isinstance(args[i], torch.Tensor) and
                         args[i].numel() == 1 else None for i in self._item_inputs)
        return key

    def _refused(self, key: tuple, exc: Exception) -> None:
        """A trace failed: the rules run untraced for this signature from now on (say why)."""
        self.info.untraced[key] = f"{type(exc).__name__}: " \
            f"{(str(exc).splitlines() or [''])[0][:200]}"
        warnings.warn(f"fxstab: the stochastic path of graph {self.index} could not be "
                      f"traced ({self.info.untraced[key]}); its rules run untraced, which "
                      "is slower", RuntimeWarning, stacklevel=4)

    def sampled_graphs(self) -> list:
        """The generated stochastic paths of this graph (the latest signatures first)."""
        return list(reversed(self.sampled.by_signature.values()))


class SampleCapture:
    """The output samples of the graphs analysed inside ``with be.capture_samples() as cap``.

    ``cap.graphs`` holds one entry per analysed graph call, in call order: the graph's outputs
    (a tuple: dynamo flattens the model's return value into them), each floating tensor as its
    samples ``[N, *shape]`` (an output the stochastic path did not vary: N equal copies), every
    other leaf as the deterministic value. ``cap.output`` is the last graph's outputs, the one
    tensor itself when there is one: the model's output when it runs as one graph. What a
    decision-level metric needs: whether the N samples' predictions agree with the
    deterministic one. With ``backward=True``, ``cap.gradients`` maps each parameter to the
    samples of its gradient (a backward run inside the block).
    """

    def __init__(self) -> None:
        self.graphs: list = []
        # backward=True: parameter name -> the samples [N, *shape] of its gradient in the
        # latest backward analysed inside the block
        self.gradients: dict = {}

    @property
    def output(self) -> Any:
        if not self.graphs:
            raise RuntimeError("no graph was analysed inside capture_samples() (a call skipped "
                               "by every=k, a paused backend, or a failed stochastic path)")
        last = self.graphs[-1]
        return last[0] if isinstance(last, (tuple, list)) and len(last) == 1 else last

    @staticmethod
    def as_tensors(det: Any, samples: Any, n: int) -> Any:
        det_flat, spec = pytree.tree_flatten(det)
        s_flat, _ = pytree.tree_flatten(samples)
        out = []
        for d, s in zip(det_flat, s_flat):
            t = s.samples if isinstance(s, Stacked) else s
            if isinstance(d, torch.Tensor) and d.is_floating_point() and \
                    isinstance(t, torch.Tensor):
                if t.dim() == d.dim() + 1 and t.shape[1:] == d.shape:
                    out.append(t.detach())
                else:  # not stochastic: N equal samples
                    out.append(t.detach().unsqueeze(0).expand(n, *t.shape))
            else:
                out.append(d)
        return pytree.tree_unflatten(out, spec)


def _arg(node: torch.fx.Node, i: int, name: str) -> Any:
    """A call node's argument ``i`` or keyword ``name`` (None where it has neither)."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name)


def _maybe_floating(node: torch.fx.Node) -> bool:
    """Whether a node's output may hold a floating tensor: its value as dynamo's or
    AOTAutograd's graph records it (``example_value``, ``val``), floating where none is."""
    value = node.meta.get("example_value", node.meta.get("val"))
    return value is None or has_floating(value)


def _straight_through_mean(det: Any, samples: Any) -> Any:
    det_flat, spec = pytree.tree_flatten(det)
    s_flat, _ = pytree.tree_flatten(samples)
    out = []
    for d, s in zip(det_flat, s_flat):
        t = s.samples if isinstance(s, Stacked) else None
        if isinstance(d, torch.Tensor) and d.is_floating_point() and isinstance(t, torch.Tensor):
            mean = t.mean(0).to(d.dtype)
            out.append(d + (mean - d).detach())
        else:
            out.append(d)
    return pytree.tree_unflatten(out, spec)


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
        yield
        return
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield
