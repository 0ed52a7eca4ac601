"""``granularity="aten"``: the arithmetic level of the backend (docs/design.md §3, §5).

The dynamo graph keeps running as is on the deterministic path. For the stochastic path it is
lowered to aten primitives with decompositions (softmax becomes exp/sum/div, layer_norm becomes
mean/var/sub/rsqrt/mul, ...) by ``make_fx`` over an ``fx.Interpreter`` of the graph, with
``preserve_node_meta`` so every primitive knows which torch-level operator it came from. The
lowered graph is then walked with :func:`fxstab.rules.aten.apply_primitive`, the same
per-primitive rules the eager driver uses (every floating primitive's output is rounded and
recorded, GEMM-like primitives get the data-perturbation surrogate, CADNA's counters run), by
:class:`AtenTracer`, untraced on the first analysed call per signature and under ``make_fx``
on the second, which leaves a generated graph (:class:`fxstab.analysis.sampled_graph.SampledGraph`)
that later calls run (docs/compiled-path.md).

Names keep the operator context: ``blocks.3.attn/softmax#0/aten.exp#0`` is the first ``exp``
primitive of the operator ``blocks.3.attn/softmax#0``. Lowering happens on the first analysed
call for each input signature (shapes, dtypes, and the values of the scalars the graph reads
with ``.item()``: under ``dynamic=True`` dynamo passes LayerNorm's eps or Embedding's norm_type
as 0-d tensors, which the lowering takes as constants), with the RNG state saved and restored
around it; a graph captured with dynamic shapes is lowered with symbolic shapes once, for
every shape its guards accept. A lowering that fails is remembered: the graph's stochastic path is off from then on
(its coverage says why), and no later call traces it again. Fused fast paths
(``torch._transformer_encoder_layer_fwd``) are lowered from their composite (the operators the
unfused module runs, with its names), as at the operator level.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Optional

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from ..capture.graph import mutated_placeholders, selector
from ..capture.naming import module_path, qualified_name, source_location
from ..capture.opsets import node_kind
from ..records.coverage import ANALYSED, SKIPPED, UNROUNDED, CoverageEntry
from ..records.report import OBSERVED, PER_SAMPLE, UNLIFTED
from ..rules.aten import decompositions
from ..rules.aten.primitives import RANDOM, SYMBOLIC
from ..rules.aten.tracer import ISOLATED, AtenGraph, AtenTracer, LoweredGraph, PrimitivePlan
from ..rules.lifting import rng_states, set_rng_states
from .composites import expand_composites
from .op_level import GraphAnalysis
from .sampled_graph import SampledGraph

# what the tracer does with a primitive of a path (the rows of rules/aten/primitives.py): a
# symbolic size is a plain value, a random draw runs once; every other path is the rule's
_ACTIONS = {SYMBOLIC: "plain", RANDOM: "random"}

# Lowerings kept per graph (input signatures: shapes, dtypes, scalars read with .item()); the
# least recently used one goes first (a dynamic-shape model called with ever new lengths).
_MAX_LOWERINGS = 16


class AtenGraphAnalysis(GraphAnalysis):
    """One dynamo graph analysed at the arithmetic level."""

    def __init__(self, gm: torch.fx.GraphModule, owner: Any, index: int) -> None:
        self._lowered: "collections.OrderedDict[tuple, LoweredGraph]" = collections.OrderedDict()
        self._context = None
        self._view = None  # what the tracer reads of this graph (AtenGraph), made once
        self.lowerings = 0  # make_fx traces of this graph (each signature once)
        self.lowering_error: Optional[Exception] = None  # a failed lowering, remembered
        self._last_coverage: Optional[tuple] = None  # (lowering, statuses, entries)
        super().__init__(gm, owner, index)

    def _placeholders(self) -> list:
        return [n for n in self.sgraph.nodes if n.op == "placeholder"]

    def _plan(self) -> None:
        """Name every torch-level operator (the context of its primitives)."""
        pred = None
        if self.cfg.select is not None:
            pred = selector(self.cfg.select)
        # the graph the samples run: fused fast paths replaced by their composite
        self.sgraph = expand_composites(self.gm.graph, self.info.composites)
        if self.sgraph is self.gm.graph:
            self.sgm = self.gm
        else:
            self.sgm = torch.fx.GraphModule(self.gm, self.sgraph)
            self.mutated = mutated_placeholders(self.sgraph)
            self.free_after = self._last_uses(self.sgraph)
        repeats: dict[tuple, int] = {}
        # dynamo node name -> (stable name, module path, kind); the operators of coverage()
        self.operators: dict[str, tuple[str, str, str]] = {}
        self.recorded_ops: set[str] = set()
        for node in self.sgraph.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            kind = node_kind(node)
            path = module_path(node)
            self.owner.modules.add(path)
            src = source_location(node)
            key = (path, kind, src)
            rep = repeats.get(key, 0)
            repeats[key] = rep + 1
            name = self.owner.names.name(path, kind, src, rep)
            self.operators[node.name] = (name, path, kind)
            if pred is None or pred(node, kind, qualified_name(path, kind)):
                self.recorded_ops.add(node.name)
                self.info.instrumented.append((name, kind, node.name))
        # placeholders read with .item() (dynamic=True: floats of modules as 0-d tensors)
        self._item_inputs = [i for i, n in enumerate(self._placeholders())
                             if any(u.op == "call_method" and u.target == "item"
                                    for u in n.users)]
        # captured with dynamic shapes (SymInt inputs, symbolic sizes): lowered symbolically
        self._symbolic: Optional[dict] = {} if any(
            _is_symbolic(n.meta.get("example_value")) for n in self._placeholders()) else None

    # -- lowering -------------------------------------------------------------------------
    def _signature(self, args: tuple, symbolic: bool = False) -> tuple:
        """What a lowering depends on: shapes (ranks only for a symbolic one: its guards say
        which shapes it serves), dtypes, devices, Python scalars, the values read with
        ``.item()``."""
        if symbolic:
            key = tuple((a.dim(), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else
                        (type(a).__name__,) for a in args)
        else:
            key = tuple((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor)
                        else (type(a).__name__, a) for a in args)
        items = tuple(args[i].item() if isinstance(args[i], torch.Tensor) and
                      args[i].numel() == 1 else None for i in self._item_inputs)
        return key + (items,) if items else key

    def _lower(self, args: tuple) -> "LoweredGraph":
        if self.lowering_error is not None:
            err = self.lowering_error
            raise RuntimeError(f"the lowering to aten primitives failed on an earlier call and "
                               f"is not retried ({type(err).__name__}: "
                               f"{(str(err).splitlines() or [''])[0][:200]})") from err
        if self._symbolic is not None:
            low = self._lower_symbolic(args)
            if low is not None:
                return low
        key = self._signature(args)
        found = self._lowered.get(key)
        if found is not None:
            self._lowered.move_to_end(key)
            return found
        states = rng_states(args)
        try:
            lowered = self._trace(args, "real")
        except Exception as exc:
            self.lowering_error = exc  # never traced again: every call would fail the same way
            raise
        finally:
            set_rng_states(states)
        low = self._lowered[key] = self._plan_lowering(lowered)
        while len(self._lowered) > _MAX_LOWERINGS:
            self._lowered.popitem(last=False)
        return low

    def _lower_symbolic(self, args: tuple) -> Optional["LoweredGraph"]:
        """A graph dynamo captured with dynamic shapes is lowered with symbolic shapes: one
        lowering serves every shape its guards accept (the decompositions' own conditions on
        sizes: 0/1 specialisation, equal sizes...), checked on each call. None when symbolic
        tracing fails: the graph then lowers per concrete signature (``tracing_mode="real"``)."""
        key = self._signature(args, symbolic=True)
        entries = self._symbolic.setdefault(key, [])
        for i, (code, low) in enumerate(entries):
            try:
                ok = code is None or low.shape_env.evaluate_guards_expression(code, list(args))
            except Exception:  # noqa: BLE001 - an unusual guard: lower again
                ok = False
            if ok:
                if i:
                    entries.insert(0, entries.pop(i))
                return low
        states = rng_states(args)
        try:
            lowered = self._trace(args, "symbolic")
            fakes = [n.meta.get("val") for n in lowered.graph.nodes if n.op == "placeholder"]
            env = next((_shape_env(v) for v in fakes if _shape_env(v) is not None), None)
            if env is None or len(fakes) != len(args):
                raise RuntimeError("no shape environment in the symbolic lowering")
            code = env.produce_guards_expression(fakes, ignore_static=False)
            if code is not None and not env.evaluate_guards_expression(code, list(args)):
                raise RuntimeError("the symbolic lowering's guards refuse its own inputs")
        except Exception:  # noqa: BLE001 - lower per signature instead, as before
            self._symbolic = None
            return None
        finally:
            set_rng_states(states)
        low = self._plan_lowering(lowered)
        low.shape_env = env
        entries.insert(0, (code, low))
        del entries[_MAX_LOWERINGS:]
        self._lowered[("symbolic",) + key] = low  # the latest, for coverage
        self._lowered.move_to_end(("symbolic",) + key)
        while len(self._lowered) > _MAX_LOWERINGS:
            self._lowered.popitem(last=False)
        return low

    def _trace(self, args: tuple, mode: str) -> torch.fx.GraphModule:
        """The graph lowered to aten primitives by ``make_fx`` (``mode``: "real" or
        "symbolic"); the caller keeps the RNG state."""
        self.lowerings += 1
        values = dict(zip(self._placeholders(), args))
        # "real" tracing runs the primitives: on copies, so that an in-place update the graph
        # makes (BatchNorm's running statistics) never reaches the user's tensors
        inputs = [(a.detach().clone() if mode == "real" else a.detach())
                  if isinstance(a, torch.Tensor) else a for a in args]
        with fx_traceback.preserve_node_meta():
            return make_fx(_Specializing(self.sgm, values).run,
                           decomposition_table=decompositions(), tracing_mode=mode)(*inputs)

    def primitive_nodes(self) -> Optional[tuple]:
        """``(gm, names)``: the latest lowered graph and its nodes' primitives (node name ->
        the primitive's name in the map), or None before any lowering; what the first-order
        impact linearizes at this level (:mod:`fxstab.impact`)."""
        if not self._lowered:
            return None
        low = next(reversed(self._lowered.values()))
        return low.gm, {node.name: plan.name for node, plan in zip(low.gm.graph.nodes, low.plans)
                        if plan is not None}

    def _plan_lowering(self, lowered: torch.fx.GraphModule) -> "LoweredGraph":
        """A lowering with its node plans, decided once."""
        mutates = any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                      and n.target._schema.is_mutable for n in lowered.graph.nodes)
        plans, origins = self._node_plans(lowered)
        return LoweredGraph(lowered, plans, self._last_uses(lowered.graph), mutates, origins,
                        _written_inputs(lowered.graph))

    def _node_plans(self, lowered: torch.fx.GraphModule) -> tuple[list, dict]:
        """What each node of the lowered graph does, decided once per lowering: a
        :class:`PrimitivePlan` (primitive, stable name, record?, digits needed?) or None; and per
        operator (dynamo node name) what its primitives are (:class:`_Origin`)."""
        from ..rules.aten import op_info, operand_needs

        counts: dict[tuple[str, str], int] = {}
        plans: list = []
        by_node: dict = {}
        origins: dict[str, _Origin] = {}
        for i, node in enumerate(lowered.graph.nodes):
            plan = None
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                info = op_info(node.target)
                origin = _origin(node, self.operators)
                op_name, path, _ = self.operators.get(origin, ("", module_path(node), ""))
                k = counts.get((op_name, info.kind), 0)
                counts[(op_name, info.kind)] = k + 1
                prim = f"aten.{info.kind}#{k}"
                name = f"{op_name}/{prim}" if op_name else (f"{path}/{prim}" if path else prim)
                record = origin in self.recorded_ops if self.cfg.select is not None else True
                action = _ACTIONS.get(info.rule.path, "rule")  # the primitive's row
                plan = PrimitivePlan(i, action, node.target, name, path, record, False, False,
                                 origin, info.inplace)
                if self.cfg.unrounded:  # an ablation (name: the record's, in full)
                    plan.rounds = self.cfg.rounds(name)
                by_node[node] = plan
                if origin is not None and action != "plain":
                    o = origins.setdefault(origin, _Origin())
                    floating = _floating(node.meta.get("val"))
                    o.floating |= floating
                    if floating and action == "rule" and not (info.exact or info.factory):
                        o.exact = False
                    o.random |= action == "random"
                    o.nodes.append(plan)
            plans.append(plan)
        # An operator made only of exact primitives (views, selections, max/abs/clamp) or
        # random draws has nothing to round; selected explicitly (select="*"), its primitives
        # are recorded as observed (measured, not rounded), as the operator level rounds (the
        # identity) and records an exact operator it is asked for.
        if self.cfg.select is not None:
            for name, o in origins.items():
                if o.exact and o.floating and name in self.recorded_ops:
                    for plan in o.nodes:
                        plan.observe = True
        # Per-element digits of an output are worth writing in the rounding pass only when a
        # consumer's counters read them (add/sub operands, sums), and its zero mask only when
        # a consumer's counters read that (divisors, factors, math arguments...), also through
        # layout primitives (views) whose digits and masks follow their operand's.
        for node in reversed(list(lowered.graph.nodes)):
            plan = by_node.get(node)
            if plan is None:
                continue
            for user in node.users:
                up = by_node.get(user)
                if up is None:
                    continue
                uinfo = op_info(user.target)
                digits, zeros = operand_needs(uinfo, user.args, user.kwargs, node)
                layout = uinfo.layout
                plan.need_digits |= digits or (layout and up.need_digits)
                plan.need_zeros |= zeros or (layout and up.need_zeros)
        return plans, origins

    # -- the stochastic path ----------------------------------------------------------------
    def run_samples(self, args: tuple, call: int, rng_states: dict) -> Any:
        """The stochastic path of one analysed call; returns the outputs' samples.

        As at the operator level: the first call with a signature runs the rules untraced
        (:class:`AtenTracer` outside a trace), the second traces them over the lowered graph
        into a :class:`~fxstab.analysis.sampled_graph.SampledGraph`, later calls run the generated
        graph; where the trace fails, the rules run untraced (``info.untraced`` says why)."""
        from ..rules.aten import AtenContext, Stacked

        cfg = self.cfg
        placeholders = self._placeholders()
        args = tuple(a.detach().clone() if (isinstance(a, torch.Tensor) and node in self.mutated)
                     else a for a, node in zip(args, placeholders))
        low = self._lower(args)
        if low.written:  # inputs its primitives write into (found in the lowered graph)
            args = tuple(a.detach().clone() if i in low.written and isinstance(a, torch.Tensor)
                         and placeholders[i] not in self.mutated else a
                         for i, a in enumerate(args))
        set_rng_states(rng_states)  # the deterministic pass's random numbers, again
        if self._context is None:  # the settings, derived once per graph
            self._context = AtenContext(cfg, round_per_sample=True)
        key = self._sampled_key(args)
        sg = self.sampled.get(key)
        if sg is not None and sg.tracer.low is low:
            if self.info.coverage is not sg.coverage:
                self.info.coverage = sg.coverage
            return sg(args, call)
        if self._view is None:
            self._view = AtenGraph(self._context, self.index, self.owner,
                                   [n in self.mutated for n in self._placeholders()])
        tracer = AtenTracer(self._view, low, call)
        if key in self.info.untraced or self.sampled.first_sight(key):
            out = tracer.run(args)
            self._note_coverage(low, tracer.statuses)
            return out
        try:
            with _provisional(self.owner):
                sg = SampledGraph.trace(tracer, args, Stacked)
        except Exception as exc:  # noqa: BLE001 - the rules, untraced, for this signature
            self._refused(key, exc)
            tracer.discard()
            set_rng_states(rng_states)
            return self.run_samples(args, call, rng_states)
        self._note_coverage(low, tracer.statuses)
        tracer.seal()
        sg.coverage = self.info.coverage
        self.sampled.add(key, sg)
        out, sg.first = sg.first, None
        return out

    # -- coverage ---------------------------------------------------------------------------
    def _floating(self, node: torch.fx.Node, low: Optional["LoweredGraph"]) -> bool:
        """Whether an operator's output holds a floating or complex tensor: dynamo's example
        value, else (the nodes of a fused operator's composite have none) its primitives'."""
        ev = node.meta.get("example_value")
        if ev is not None:
            return _floating(ev)
        o = low.origins.get(node.name) if low is not None else None
        return o is not None and o.floating

    def _note_coverage(self, low: "LoweredGraph", statuses: dict) -> None:
        """How each operator ran in this call (``be.coverage()``), from its primitives."""
        cov = self.info.coverage = {}  # a sampled graph's own notes stay as they are
        last = self._last_coverage
        if last is not None and last[0] is low and last[1] == statuses:
            cov.update(last[2])  # as in the previous call (the usual case): no new entries
            return
        selected = self.cfg.select is None
        for node in self.sgraph.nodes:
            entry = self.operators.get(node.name)
            if entry is None:
                continue
            name, _path, kind = entry
            floating = self._floating(node, low)
            o = low.origins.get(node.name)
            st = statuses.get(node.name, {})
            counted = floating
            if not floating:
                how, reason, counted = SKIPPED, "no floating output", False
            elif o is None:
                how, reason, counted = SKIPPED, "identity: no primitive after lowering", False
            elif not (selected or node.name in self.recorded_ops):
                how, reason = UNROUNDED, "not selected (its primitives ran on the samples, " \
                    "not recorded)"
            elif ISOLATED in st:
                how, reason = UNROUNDED, f"a primitive's rule failed ({st[ISOLATED]}): it " \
                    "ran once on the first sample, broadcast, not rounded"
            elif UNLIFTED in st:
                how, reason = UNROUNDED, "aten level: a primitive ran per sample unrounded " \
                    f"(no vmap rule: {st[UNLIFTED].rsplit('/', 1)[-1]})"
            elif PER_SAMPLE in st:
                how, reason = ANALYSED, "per sample: no vmap rule " \
                    f"({st[PER_SAMPLE].rsplit('/', 1)[-1]}), rounded"
            elif st and set(st) <= {OBSERVED}:
                how, reason = ANALYSED, "aten level: its primitives observed (" + \
                    ("random draws" if o.random else "exact") + ": measured, not rounded)"
            elif st:
                how, reason = ANALYSED, "aten level: its primitives"
            elif o.random:
                how, reason, counted = SKIPPED, "random draws: the deterministic pass's in " \
                    "every sample", False
            elif o.exact:
                how, reason, counted = SKIPPED, "exact (data movement or selection): its " \
                    "primitives ran on the samples, not rounded", False
            else:
                how, reason = SKIPPED, "no primitive recorded (no operand carries samples)"
            cov[node.name] = CoverageEntry(operator=name, kind=kind, how=how, reason=reason,
                                           graph=self.index, node=node.name, floating=floating,
                                           counted=counted)
        self._last_coverage = (low, statuses, dict(cov))

    def _coverage_failed(self, exc: Exception) -> None:
        """Every operator of a graph whose stochastic path failed: skipped, with the reason."""
        why = f"the graph's stochastic path failed ({type(exc).__name__}: " \
              f"{(str(exc).splitlines() or [''])[0][:160]})"
        low = next(reversed(self._lowered.values()), None) if self._lowered else None
        cov = self.info.coverage = {}
        for node in self.sgraph.nodes:
            entry = self.operators.get(node.name)
            if entry is None:
                continue
            name, _path, kind = entry
            floating = self._floating(node, low) if low is not None or \
                node.meta.get("example_value") is not None else True
            cov[node.name] = CoverageEntry(operator=name, kind=kind, how=SKIPPED, reason=why,
                                           graph=self.index, node=node.name, floating=floating,
                                           counted=floating)


@contextlib.contextmanager
def _provisional(owner: Any):
    """The reports and counts a trace makes (it runs the rules for real) are kept only if it
    succeeds: a refused trace is followed by the same call untraced, which makes them again."""
    from ..records.counters import Counters, active_collectors

    n = len(owner.reports)
    stack = active_collectors()
    saved = list(stack)
    held = [Counters(c.diagnostics) for c in saved]
    stack[:] = held
    try:
        yield
    except BaseException:
        del owner.reports[n:]
        raise
    else:
        for c, h in zip(saved, held):
            c.merge(h.counts, h.events)
    finally:
        stack[:] = saved


class _Specializing(torch.fx.Interpreter):
    """The dynamo graph run under ``make_fx``, with the scalars it reads from its inputs with
    ``.item()`` (``dynamic=True`` passes LayerNorm's eps, Embedding's max_norm as 0-d tensors)
    taken as the constants they are in this call: a traced tensor has no value to read, and
    the lowering would fail. The signature of a lowering holds those values
    (:meth:`AtenGraphAnalysis._signature`), so another value lowers again."""

    def __init__(self, gm: torch.fx.GraphModule, values: dict) -> None:
        super().__init__(gm)
        self.values = values

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "call_method" and n.target == "item" and n.args and \
                isinstance(n.args[0], torch.fx.Node) and n.args[0] in self.values:
            v = self.values[n.args[0]]
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                return v.item()
        return super().run_node(n)


class _Origin:
    """The primitives of one torch-level operator in a lowered graph."""

    __slots__ = ("floating", "exact", "random", "nodes")

    def __init__(self) -> None:
        self.floating = False  # some primitive has a floating or complex output
        self.exact = True  # every primitive with a floating output is exact (or random)
        self.random = False
        self.nodes: list = []


def _written_inputs(graph: torch.fx.Graph) -> frozenset:
    """Indices of the placeholders that a primitive of a lowered graph writes into (its
    schema's ``Tensor(a!)`` arguments), directly or through views of them."""
    index = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    out = set()
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or \
                not target._schema.is_mutable:
            continue
        for arg, value in zip(target._schema.arguments, node.args):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            seen = 0
            while isinstance(value, torch.fx.Node) and value.op == "call_function" and \
                    value.args and seen < 16:  # through views (aliasing, not writing)
                schema = getattr(value.target, "_schema", None)
                if schema is None or not schema.arguments or \
                        schema.arguments[0].alias_info is None:
                    break
                value, seen = value.args[0], seen + 1
            if value in index:
                out.add(index[value])
    return frozenset(out)


def _is_symbolic(v: Any) -> bool:
    """Whether a dynamo example value is a symbolic size or a tensor with symbolic sizes."""
    if isinstance(v, torch.SymInt):
        return True
    return isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)


def _shape_env(v: Any):
    if isinstance(v, torch.SymInt):
        return v.node.shape_env
    mode = getattr(v, "fake_mode", None)
    return getattr(mode, "shape_env", None)


def _floating(v: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
               for t in pytree.tree_leaves(v))


def _origin(node: torch.fx.Node, known: dict) -> Any:
    """Name of the dynamo-graph node a lowered primitive came from (``from_node`` provenance,
    else the source function's node name), or None."""
    for source in node.meta.get("from_node") or []:
        name = getattr(source, "name", None)
        if name in known:
            return name
    stack = node.meta.get("source_fn_stack") or []
    if stack and stack[-1][0] in known:
        return stack[-1][0]
    return None


def compile_aten(owner: Any, gm: torch.fx.GraphModule, example_inputs: list) -> AtenGraphAnalysis:
    analysis = AtenGraphAnalysis(gm, owner, len(owner.graphs))
    owner.graphs.append(analysis)
    return analysis
