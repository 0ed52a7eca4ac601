"""The arithmetic level's tracer: one lowered graph's primitives run on N stacked samples with
the per-primitive rules (:func:`fxstab.rules.aten.apply_primitive`), traced once per signature
into a sampled graph. The lowering and its plans (:class:`LoweredGraph`, one
:class:`PrimitivePlan` per primitive) are made by :class:`fxstab.analysis.aten_level.AtenGraphAnalysis`.

A :class:`PrimitivePlan` is the arithmetic level's counterpart of the operator level's
:class:`fxstab.rules.lifting.NodePlan`: the decisions about one node of the graph the samples
run, made once per lowering (here: a primitive of the lowered graph; there: a torch-level
operator of dynamo's graph).
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ...capture.flat import flatten_call, unflatten_call
from ...capture.graph import fetch_attr, node_callable
from ...numerics import randbits
from ...passes import steps
from ...records.report import OpReport, ReportRow, report_builder, stats_row
from ...records.run import RunState
from .apply import apply_primitive, observe
from .context import AtenContext, PrimitiveRecord
from .kinds import op_info
from ..lifting import Stacked

__all__ = ["AtenTracer", "AtenGraph", "PrimitivePlan", "LoweredGraph", "plain_call", "ISOLATED"]

# the status an operator's primitives have in ``AtenTracer.statuses`` where one's rule failed
ISOLATED = "isolated"

_EMPTY: frozenset = frozenset()


@dataclass
class AtenGraph:
    """What an arithmetic-level analysis (:class:`fxstab.analysis.aten_level.AtenGraphAnalysis`)
    hands its tracer: the settings, the graph's index (its seeds) and the run state (reports,
    phase, step); per placeholder, whether the graph writes into it. The tracer hands back the
    outputs' samples and, per operator, the statuses of its primitives (``statuses``)."""

    context: AtenContext  # the analysis's settings
    index: int
    state: RunState  # the backend's
    mutated_inputs: list  # per placeholder of the captured graph: the graph writes into it


class AtenTracer(torch.fx.Interpreter):
    """The arithmetic level's rules over one lowered graph, traced into its sampled graph.

    A ``torch.fx.Interpreter`` of the lowered graph: :meth:`run_node` takes each node with its
    plan to the handler of its kind (an input, an attribute, a primitive, the output).
    :meth:`run` interprets the lowered graph on stacked samples with
    :func:`~fxstab.rules.aten.apply_primitive`, under ``make_fx``
    (:class:`fxstab.analysis.sampled_graph.SampledGraph`): what the rules compute with torch operators
    (the batched primitives) becomes aten nodes, and what reads values (rounding and the
    statistics, counters, CESTAC comparisons, the surrogate: :meth:`AtenContext.emit`) becomes
    one :class:`~fxstab.passes.steps.Step` per primitive, which runs with this call's context
    (:meth:`begin`: seeds, counters, records) when the generated graph runs.

    A step's operands keep what their producer's step measured (per-element digits, zero
    masks, the statistics: the :class:`~fxstab.rules.aten.Stacked` analyses the counters of
    its consumers read): each stacked output of a step has a slot, the call's ``live`` table
    holds it from its step to its last reader. Called outside a trace (a graph the tracer
    refused), :meth:`run` is the same rules run directly.
    """

    def __init__(self, graph: "AtenGraph", low: "LoweredGraph", call: int) -> None:
        # values are freed after their last use by the lowering's table (free_after), which also
        # drops a freed value's slot; a failure keeps the primitive's own message
        super().__init__(low.gm, garbage_collect_values=False)
        self.extra_traceback = False
        self.g = graph
        self.low = low
        # per operator (dynamo node name): the statuses of its recorded primitives in the
        # latest run (what the analysis's coverage reads)
        self.statuses: dict[str, dict] = {}
        # primitive -> why its rule failed (it ran once on the first sample, broadcast)
        self.isolated: dict[str, str] = {}
        self._reads: list[list[int]] = []  # per step: the slots it reads
        self._drop: Optional[list] = None  # per step: the slots it reads last (seal)
        self._kept: Optional[set] = None  # the slots some step reads (seal)
        self._slots = 0
        self._meta: dict[str, tuple] = {}  # record name -> (module path, inputs)
        self._templates: dict[tuple, tuple] = {}  # (name, status, shape) -> fixed fields
        self.begin(call)

    def begin(self, call: int) -> None:
        """The state of one analysed call, which the steps use and fill."""
        g = self.g
        self.call = call
        self.live: dict[int, Any] = {}
        self.noted: list = []  # this call's records
        self.ctx = ctx = g.context.for_call(
            randbits.derive_seed(g.context.config.seed, g.index, call), self._record,
            self.low.salts)
        owner = g.state
        self._build = report_builder(owner.phase, owner.step, call, ctx.n_samples, ctx.t)
        self._defer = owner.reports.defer()

    def _record(self, rec: PrimitiveRecord) -> None:
        """A primitive's record becomes its report, from the fields its reports share (built
        once per name, status and shape)."""
        self.noted.append(rec)
        meta = self._meta.get(rec.name)
        if meta is None:  # not selected
            return
        key = (rec.name, rec.status, rec.shape)
        ctx = self.ctx
        fixed = self._templates.get(key)
        if fixed is None:
            fixed = self._templates[key] = OpReport.fixed_of(
                {"name": rec.name, "kind": rec.kind, "module_path": meta[0],
                 "format": ctx.fmt.name, "n_samples": ctx.n_samples, "status": rec.status,
                 "shape": rec.shape, "inputs": meta[1]})
        counters = rec.counters  # none counted (the usual case): nothing kept until read
        self._defer((self._build, ReportRow(
            fixed=fixed, cap=ctx.cap, surrogate=rec.surrogate, stats=stats_row(rec.values),
            counters=counters if any(counters.values()) else None)))

    def seal(self) -> None:
        """After the trace: when each slot is read last, and which ones are read at all."""
        last: dict[int, int] = {}
        for k, reads in enumerate(self._reads):
            for s in reads:
                last[s] = k
        drop: list = [[] for _ in self._reads]
        for s, k in last.items():
            drop[k].append(s)
        self._drop, self._kept = drop, set(last)
        self.discard()

    def discard(self) -> None:
        """Forget the trace's own values."""
        self.live = {}

    # -- steps ----------------------------------------------------------------------------
    def _step(self, what: str, name: Optional[str], fn: Callable, raw: list, args: tuple,
              kwargs: dict, op: Optional[Callable] = None) -> Any:
        """:meth:`AtenContext.emit` while tracing: ``fn`` as one step of the graph."""
        call_leaves, cspec = flatten_call(args, kwargs)
        nraw = len(raw)
        leaves = [*raw, *call_leaves]
        pos: list[int] = []
        slots: list[int] = []  # a step output's slot, -1 other samples, -2 a plain tensor
        template: list = []
        for i, v in enumerate(leaves):
            if type(v) is Stacked:
                pos.append(i)
                slots.append(v.slot)
                template.append(None)
            elif isinstance(v, torch.Tensor):
                pos.append(i)
                slots.append(-2)
                template.append(None)
            else:
                template.append(v)
        k = len(self._reads)
        self._reads.append([s for s in slots if s >= 0])
        layout: list = []  # the outputs: constants, structure, [(leaf, slot or -2)]
        tracer = self

        def run(ts: list) -> list:
            live = tracer.live
            new = template.copy()
            for i, s, t in zip(pos, slots, ts):
                if s == -2:
                    new[i] = t
                else:
                    st = live.get(s) if s >= 0 else None
                    new[i] = st if st is not None and st.samples is t else Stacked(t)
            if tracer._drop is not None:
                for s in tracer._drop[k]:
                    live.pop(s, None)
            a, kw = unflatten_call(new[nraw:], cspec)
            out = fn(tracer.ctx, new[:nraw], a, kw)
            if type(out) is Stacked:
                flat, spec = [out], None
            else:
                flat, spec = pytree.tree_flatten(out, is_leaf=lambda x: type(x) is Stacked)
            if not layout:  # the trace: how to rebuild the output (no tensor kept)
                where = []
                for j, v in enumerate(flat):
                    if type(v) is Stacked:
                        where.append((j, tracer._slots))
                        tracer._slots += 1
                    elif isinstance(v, torch.Tensor):
                        where.append((j, -2))
                layout[:] = [[None if type(v) is Stacked or isinstance(v, torch.Tensor) else v
                              for v in flat], spec, where]
            res = []
            kept = tracer._kept
            for j, s in layout[2]:
                v = flat[j]
                if s >= 0:
                    if kept is None or s in kept:
                        live[s] = v
                    res.append(v.samples)
                else:
                    res.append(v)
            return res

        outs = steps.emit(steps.Step(what, name or what, run, op=op, direct=True),
                          [leaves[i].samples if s != -2 else leaves[i]
                           for i, s in zip(pos, slots)])
        consts, spec, where = layout
        flat = list(consts)
        for (j, s), t in zip(where, outs):
            if s >= 0:
                st = Stacked(t)
                st.slot = s
                flat[j] = st
            else:
                flat[j] = t
        return flat[0] if spec is None else pytree.tree_unflatten(flat, spec)

    # -- the walk -------------------------------------------------------------------------
    def run(self, args: tuple) -> Any:
        """Interpret the lowered graph on ``args`` (under ``make_fx``: the trace); returns the
        outputs' samples."""
        low = self.low
        ctx = self.ctx
        if steps.active():
            ctx = copy.copy(ctx)  # decides and traces; the steps run with self.ctx
            ctx.stepper = self._step
        self._rules_ctx = ctx
        self._frontier: dict[torch.fx.Node, frozenset] = {}
        self.statuses = {}
        # Samples of inputs are expanded views of one value; a graph that updates values in
        # place (BatchNorm's running statistics) gets N real copies instead.
        self._copies = iter([low.mutates or m for m in self.g.mutated_inputs])
        try:
            return super().run(*args, enable_io_processing=False)
        finally:
            self.env = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        low = self.low
        i = low.index[node]
        plan = low.plans[i]
        frontier = self._frontier
        ins = _EMPTY
        for m in low.input_nodes[i]:
            f = frontier.get(m, _EMPTY)
            if f:
                ins = ins | f if ins else f
        frontier[node] = ins
        op = node.op
        if op == "placeholder":
            return self._input(next(self.args_iter), next(self._copies))
        if op == "get_attr":
            return fetch_attr(low.gm, node.target)
        if op == "output":
            return torch.fx.node.map_arg(node.args[0], self.env.__getitem__)
        out = self._primitive(node, plan, ins)
        for dead in low.free_after.get(node, ()):
            # no name holds the freed value (one full-size tensor more at the peak)
            _forget(self.live, self.env.pop(dead, None))
        return out

    def _stack_base(self, node: torch.fx.Node) -> bool:
        """An in-place write of samples into ``node``, a view of a plain tensor (DeepSeek-V3's
        ``k = x.new_empty(...); k[..., :8].copy_(a)``): the base becomes N copies of itself
        and the views along the way are taken again of those copies, so the write reaches
        the base and every later reader of it sees the samples. Returns whether it did."""
        chain = _view_chain(node, self.env)
        if chain is None:
            return False
        ctx, env = self._rules_ctx, self.env
        env[chain[0]] = ctx.stack(env[chain[0]], materialize=True)
        for view in chain[1:]:
            a = torch.fx.node.map_arg(view.args, env.__getitem__)
            k = torch.fx.node.map_arg(view.kwargs, env.__getitem__) if view.kwargs else {}
            env[view] = apply_primitive(view.target, a, k, ctx, need_digits=False,
                                        need_zeros=False)
        return type(env[node]) is Stacked

    def _input(self, v: Any, copy_: bool) -> Any:
        """Inputs and buffers enter as N identical samples (an expanded view: no copy unless
        the graph updates them in place); parameters stay plain (the rules broadcast plain
        operands) so weights are never copied N times."""
        if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) \
                and not isinstance(v, torch.nn.Parameter):
            return self._rules_ctx.stack(v, materialize=copy_)
        return v

    def _primitive(self, node: torch.fx.Node, plan: Optional["PrimitivePlan"],
                   ins: frozenset) -> Any:
        """One primitive of the lowered graph on the samples: its rule, or a plain call."""
        ctx, env, noted = self._rules_ctx, self.env, self.noted
        fetch = env.__getitem__
        args_ = torch.fx.node.map_arg(node.args, fetch)
        kw = torch.fx.node.map_arg(node.kwargs, fetch) if node.kwargs else {}
        if plan is None or plan.action == "plain":
            # Python operators on sizes, getitem on tuples, symbolic sizes: plain values.
            return plain_call(node_callable(self.low.gm, node), args_, kw, Stacked)
        if plan.record:
            self._meta[plan.name] = (plan.path, tuple(sorted(ins)))
        before = len(noted)
        if plan.inplace and args_ and type(args_[0]) is not Stacked and \
                isinstance(node.args[0], torch.fx.Node) and \
                any(type(a) is Stacked for a in args_[1:]) and self._stack_base(node.args[0]):
            args_ = torch.fx.node.map_arg(node.args, fetch)  # the target: a view of samples
        if plan.action == "random":
            out = ctx.emit("random", plan.name, _random_step(plan.target), (), args_, kw)
        else:
            try:
                out = apply_primitive(plan.target, args_, kw, ctx, name=plan.name,
                                      salt=plan.index, need_digits=plan.need_digits,
                                      need_zeros=plan.need_zeros, rounds=plan.rounds)
            except Exception as exc:  # noqa: BLE001 - one primitive never sinks the graph
                if steps.active():  # under a trace: refuse it; untraced, it is isolated
                    raise
                # once on the first sample's operands, broadcast to every sample: not rounded,
                # not recorded (its operator's coverage: no primitive recorded)
                why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
                self.isolated.setdefault(plan.name, why)
                if plan.origin is not None:
                    self.statuses.setdefault(plan.origin, {}).setdefault(ISOLATED, why)
                out = ctx.emit("isolated", plan.name, _isolated_step(plan.target), (), args_, kw)
            if plan.inplace and isinstance(out, Stacked) and args_ and \
                    isinstance(node.args[0], torch.fx.Node) and \
                    not isinstance(args_[0], Stacked):
                # a plain tensor updated in place from samples now holds samples: later
                # readers of the target see them
                env[node.args[0]] = out
        if plan.observe and len(noted) == before and plan.record:
            ctx.emit("observe", plan.name, _observe_step(plan.target, plan.name), (),
                     (out,), {})
        if len(noted) > before and plan.record:
            for rec in noted[before:]:
                self._frontier[node] = frozenset({rec.name})
                if plan.origin is not None:
                    self.statuses.setdefault(plan.origin, {}).setdefault(rec.status, rec.name)
        return out


def _view_chain(node: torch.fx.Node, env: dict) -> Optional[list]:
    """The view primitives from a base tensor to ``node`` ([base, view, ..., node]), when
    ``node`` is a view (through view primitives) of a plain tensor of the environment that is
    not a view itself; None otherwise."""
    chain = [node]
    while True:
        cur = chain[-1]
        target = getattr(cur, "target", None)
        if cur.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            break
        info = op_info(target)
        if not (info.layout and info.exact) or not cur.args or \
                not isinstance(cur.args[0], torch.fx.Node):
            break
        chain.append(cur.args[0])
    base = chain[-1]
    value = env.get(base)
    if len(chain) < 2 or not isinstance(value, torch.Tensor) or type(value) is Stacked or \
            value._base is not None:
        return None
    return list(reversed(chain))


def _forget(live: dict, value: Any) -> None:
    """A value the walk frees: the slots of its samples (a traced step's outputs) go too."""
    for x in (value,) if type(value) is Stacked else \
            value if isinstance(value, (tuple, list)) else ():
        if type(x) is Stacked and x.slot >= 0:
            live.pop(x.slot, None)


def _isolated_step(op: Any) -> Callable:
    def run(ctx: Any, raw: list, args: tuple, kwargs: dict) -> Any:
        out = plain_call(op, args, kwargs, Stacked)
        return pytree.tree_map(
            lambda v: ctx.stack(v) if isinstance(v, torch.Tensor) and
            (v.is_floating_point() or v.is_complex()) else v, out)
    return run


def _random_step(op: Any) -> Callable:
    """A random primitive's draw on the samples (its row's ``draw``)."""
    draw = op_info(op).rule.draw

    def run(ctx: Any, raw: list, args: tuple, kwargs: dict) -> Any:
        return draw(op, args, kwargs)
    return run


def _observe_step(op: Any, name: str) -> Callable:
    def run(ctx: Any, raw: list, args: tuple, kwargs: dict) -> bool:
        return observe(args[0], op, ctx, name)
    return run


class PrimitivePlan:
    """One lowered node's decisions, made once per lowering (see ``_node_plans``)."""

    __slots__ = ("index", "action", "target", "name", "path", "record", "need_digits",
                 "need_zeros", "origin", "inplace", "observe", "rounds")

    def __init__(self, index, action, target, name, path, record, need_digits, need_zeros,
                 origin=None, inplace=False):
        self.index, self.action, self.target, self.name = index, action, target, name
        self.path, self.record = path, record
        self.need_digits, self.need_zeros = need_digits, need_zeros
        self.origin, self.inplace = origin, inplace  # the dynamo node it came from
        self.observe = False  # record it as observed when the rules did not record it
        self.rounds = True  # False: measured, not rounded (unrounded=, an ablation)


class LoweredGraph:
    """A lowered graph with its node plans, each node's input nodes and the values each node
    frees."""

    __slots__ = ("gm", "plans", "free_after", "mutates", "input_nodes", "index", "salts",
                 "origins", "written", "shape_env")

    def __init__(self, gm, plans, free_after, mutates, origins, written=frozenset()):
        self.gm, self.plans, self.free_after, self.mutates = gm, plans, free_after, mutates
        self.origins = origins  # dynamo node name -> _Origin
        self.written = written  # indices of the inputs a primitive writes into
        self.shape_env = None  # a symbolic lowering's shape environment (its guards)
        self.input_nodes = [tuple(node.all_input_nodes) for node in gm.graph.nodes]
        self.index = {node: i for i, node in enumerate(gm.graph.nodes)}  # node -> its plan's
        # the seed salts of the primitives, derived together once per call
        self.salts = [p.index for p in plans if p is not None and p.action == "rule"]


def plain_call(fn: Callable, args: Any, kwargs: Any, stacked_type: type) -> Any:
    """Run on the first sample of every stacked value (metadata, sizes, tuple access)."""
    is_s = lambda v: isinstance(v, stacked_type)  # noqa: E731
    if fn is operator.getitem and isinstance(args[0], (tuple, list)):
        return args[0][args[1]]
    a, k = pytree.tree_map(lambda v: v.samples[0] if is_s(v) else v, (args, kwargs), is_leaf=is_s)
    return fn(*a, **k)
