"""``granularity="aten"``: the arithmetic level of the backend (DESIGN.md §3, §5).

The dynamo graph keeps running as is on the deterministic path. For the stochastic path it is
lowered to aten primitives with decompositions (softmax becomes exp/sum/div, layer_norm becomes
mean/var/sub/rsqrt/mul, ...) by ``make_fx`` over an ``fx.Interpreter`` of the graph, with
``preserve_node_meta`` so every primitive knows which torch-level operator it came from. The
lowered graph is then interpreted node by node with :func:`fxstab.aten_rules.apply_primitive`,
the same per-primitive rules the eager driver uses: every floating primitive's output is rounded
and recorded, GEMM-like primitives get the data-perturbation surrogate, CADNA's counters run.

Names keep the operator context: ``blocks.3.attn/softmax#0/aten.exp#0`` is the first ``exp``
primitive of the operator ``blocks.3.attn/softmax#0``. Lowering happens on the first analysed
call for each input signature (shapes, dtypes), with the RNG state saved and restored around it.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from . import randbits
from .backend import GraphAnalysis, _callable, _fetch_attr, _rng_states, _set_rng_states
from .naming import module_path, qualified_name, source_location
from .opsets import node_kind

aten = torch.ops.aten

# Decomposed beyond the core aten set, so the primitives the arithmetic level counts are seen.
_EXTRA_DECOMPOSITIONS = [
    aten._softmax, aten._log_softmax, aten.native_layer_norm, aten.native_group_norm,
    aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training, aten.gelu, aten.silu, aten.mish, aten.hardswish,
    aten.hardsigmoid, aten.elu, aten.leaky_relu, aten.softplus, aten.logsumexp, aten.var_mean,
    aten.mse_loss, aten.nll_loss_forward, aten.huber_loss, aten.smooth_l1_loss, aten.addcmul,
    aten.addcdiv, aten.lerp, aten.rsub, aten.norm, aten.linalg_vector_norm, aten._log_softmax,
    aten.rms_norm if hasattr(aten, "rms_norm") else aten.native_layer_norm,
]
_RANDOM_PRIMITIVES = frozenset({
    "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "bernoulli",
    "uniform", "normal", "randperm", "multinomial", "native_dropout", "exponential",
    "bernoulli_", "uniform_", "normal_", "exponential_", "random_", "geometric_", "cauchy_",
    "log_normal_",
})
_SYMBOLIC = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset"})


def _decompositions() -> dict:
    from torch._decomp import core_aten_decompositions, get_decompositions

    table = dict(core_aten_decompositions())
    table.update(get_decompositions(_EXTRA_DECOMPOSITIONS))
    return table


class AtenGraphAnalysis(GraphAnalysis):
    """One dynamo graph analysed at the arithmetic level."""

    def __init__(self, gm: torch.fx.GraphModule, owner: Any, index: int) -> None:
        self._lowered: dict[tuple, _Lowered] = {}
        self._context = None
        super().__init__(gm, owner, index)

    def _plan(self) -> None:
        """Name every torch-level operator (the context of its primitives)."""
        pred = None
        if self.cfg.select is not None:
            from .backend import _selector

            pred = _selector(self.cfg.select)
        repeats: dict[tuple, int] = {}
        self.op_names: dict[str, tuple[str, str, str]] = {}
        self.recorded_ops: set[str] = set()
        for node in self.gm.graph.nodes:
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
            self.op_names[node.name] = (name, path, kind)
            if pred is None or pred(node, kind, qualified_name(path, kind)):
                self.recorded_ops.add(node.name)
                self.info.instrumented.append((name, kind, node.name))

    # -- lowering -------------------------------------------------------------------------
    def _lower(self, args: tuple) -> "_Lowered":
        key = tuple((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else
                    (type(a).__name__, a) for a in args)
        found = self._lowered.get(key)
        if found is not None:
            return found
        states = _rng_states(args)
        try:
            with fx_traceback.preserve_node_meta():
                lowered = make_fx(torch.fx.Interpreter(self.gm).run,
                                  decomposition_table=_decompositions(),
                                  tracing_mode="real")(*[a.detach() if isinstance(a, torch.Tensor)
                                                         else a for a in args])
        finally:
            _set_rng_states(states)
        mutates = any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                      and n.target._schema.is_mutable for n in lowered.graph.nodes)
        self._lowered[key] = _Lowered(lowered, self._node_plans(lowered),
                                      self._last_uses(lowered.graph), mutates)
        return self._lowered[key]

    def _node_plans(self, lowered: torch.fx.GraphModule) -> list:
        """What each node of the lowered graph does, decided once per lowering: a
        :class:`_NodePlan` (primitive, stable name, record?, digits needed?) or None."""
        from .aten_rules import op_info, operand_needs

        counts: dict[tuple[str, str], int] = {}
        plans: list = []
        by_node: dict = {}
        for i, node in enumerate(lowered.graph.nodes):
            plan = None
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                info = op_info(node.target)
                origin = _origin(node, self.op_names)
                op_name, path, _ = self.op_names.get(origin, ("", module_path(node), ""))
                k = counts.get((op_name, info.kind), 0)
                counts[(op_name, info.kind)] = k + 1
                prim = f"aten.{info.kind}#{k}"
                name = f"{op_name}/{prim}" if op_name else (f"{path}/{prim}" if path else prim)
                record = origin in self.recorded_ops if self.cfg.select is not None else True
                action = ("plain" if info.kind in _SYMBOLIC else
                          "random" if info.kind in _RANDOM_PRIMITIVES else "rule")
                plan = _NodePlan(i, action, node.target, name, path, record, False, False)
                by_node[node] = plan
            plans.append(plan)
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
        return plans

    # -- the stochastic path ----------------------------------------------------------------
    def run_samples(self, args: tuple, call: int, rng_states: dict) -> Any:
        from .aten_rules import AtenContext, Stacked, apply_primitive, to_op_report

        cfg = self.cfg
        owner = self.owner
        placeholders = self._placeholders()
        args = tuple(a.detach().clone() if (isinstance(a, torch.Tensor) and node in self.mutated)
                     else a for a, node in zip(args, placeholders))
        low = self._lower(args)
        lowered, plans, free_after = low.gm, low.plans, low.free_after
        _set_rng_states(rng_states)  # the deterministic pass's random numbers, again

        records: list = []
        if self._context is None:  # the settings, checked and derived once per graph
            self._context = AtenContext(format=cfg.format, n_samples=cfg.n_samples,
                                        rounding=cfg.rounding, confidence=cfg.confidence,
                                        diagnostics=cfg.diagnostics,
                                        cancel_digits=cfg.cancel_digits,
                                        zero_threshold=cfg.zero_threshold, kernels=cfg.kernels,
                                        saturate=cfg.saturate)
        ctx = self._context.for_call(randbits.derive_seed(cfg.seed, self.index, call),
                                     records.append, low.salts)
        env: dict[torch.fx.Node, Any] = {}
        frontier: dict[torch.fx.Node, frozenset] = {}
        inputs = iter(args)
        # Samples of inputs are expanded views of one value; a graph that updates values in
        # place (BatchNorm's running statistics) gets N real copies instead.
        copies = iter([low.mutates or node in self.mutated for node in placeholders])
        result = None
        empty: frozenset = frozenset()
        fetch = env.__getitem__
        for node, plan, inputs_of in zip(lowered.graph.nodes, plans, low.input_nodes):
            ins = empty
            for m in inputs_of:
                f = frontier.get(m, empty)
                if f:
                    ins = ins | f if ins else f
            frontier[node] = ins
            if node.op == "placeholder":
                v = next(inputs)
                copy = next(copies)
                # Inputs and buffers enter as N identical samples (an expanded view: no copy
                # unless the graph updates them in place); parameters stay plain (the rules
                # broadcast plain operands) so weights are never copied N times.
                if isinstance(v, torch.Tensor) and v.is_floating_point() and \
                        not isinstance(v, torch.nn.Parameter):
                    v = ctx.stack(v, materialize=copy)
                env[node] = v
                continue
            if node.op == "get_attr":
                env[node] = _fetch_attr(lowered, node.target)
                continue
            if node.op == "output":
                result = torch.fx.node.map_arg(node.args[0], lambda m: env[m])
                continue
            a = torch.fx.node.map_arg(node.args, fetch)
            kw = torch.fx.node.map_arg(node.kwargs, fetch) if node.kwargs else {}
            if plan is None or plan.action == "plain":
                # Python operators on sizes, getitem on tuples, symbolic sizes: plain values.
                env[node] = _plain_call(_callable(lowered, node), a, kw, Stacked)
                continue
            if plan.action == "random":
                env[node] = _random_call(plan.target, a, kw, Stacked)
                continue
            before = len(records)
            env[node] = apply_primitive(plan.target, a, kw, ctx, name=plan.name, salt=plan.index,
                                        need_digits=plan.need_digits,
                                        need_zeros=plan.need_zeros)
            if len(records) > before:
                for rec in records[before:]:
                    if not plan.record:
                        continue
                    rep = to_op_report(rec, ctx, phase=owner._phase, step=owner._step, call=call,
                                       inputs=tuple(sorted(ins)))
                    rep.module_path = plan.path
                    owner.reports.append(rep)
                    frontier[node] = frozenset({rec.name})
                del records[before:]
            for dead in free_after.get(node, ()):
                env.pop(dead, None)
        return result


class _NodePlan:
    """One lowered node's decisions, made once per lowering (see ``_node_plans``)."""

    __slots__ = ("index", "action", "target", "name", "path", "record", "need_digits",
                 "need_zeros")

    def __init__(self, index, action, target, name, path, record, need_digits, need_zeros):
        self.index, self.action, self.target, self.name = index, action, target, name
        self.path, self.record = path, record
        self.need_digits, self.need_zeros = need_digits, need_zeros


class _Lowered:
    """A lowered graph with its node plans, each node's input nodes and the values each node
    frees."""

    __slots__ = ("gm", "plans", "free_after", "mutates", "input_nodes", "salts")

    def __init__(self, gm, plans, free_after, mutates):
        self.gm, self.plans, self.free_after, self.mutates = gm, plans, free_after, mutates
        self.input_nodes = [tuple(node.all_input_nodes) for node in gm.graph.nodes]
        # the seed salts of the primitives, derived together once per call
        self.salts = [p.index for p in plans if p is not None and p.action == "rule"]


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


def _plain_call(fn: Callable, args: Any, kwargs: Any, stacked_type: type) -> Any:
    """Run on the first sample of every stacked value (metadata, sizes, tuple access)."""
    is_s = lambda v: isinstance(v, stacked_type)  # noqa: E731
    if fn is operator.getitem and isinstance(args[0], (tuple, list)):
        return args[0][args[1]]
    a, k = pytree.tree_map(lambda v: v.samples[0] if is_s(v) else v, (args, kwargs), is_leaf=is_s)
    return fn(*a, **k)


def _random_call(op: Any, args: Any, kwargs: Any, stacked_type: type) -> Any:
    """Random primitives run once, on the first sample's shape: every sample gets the
    deterministic pass's random numbers (dropout masks)."""
    is_s = lambda v: isinstance(v, stacked_type)  # noqa: E731
    if "native_dropout" in str(op):
        x = args[0]
        ones = torch.ones_like(x.samples[0] if is_s(x) else x)
        scaled, mask = op(ones, *args[1:], **kwargs)
        xs = x.samples if is_s(x) else x
        return (stacked_type(xs * scaled) if is_s(x) else xs * scaled), mask
    a, k = pytree.tree_map(lambda v: v.samples[0] if is_s(v) else v, (args, kwargs), is_leaf=is_s)
    return op(*a, **k)


def compile_aten(owner: Any, gm: torch.fx.GraphModule, example_inputs: list) -> AtenGraphAnalysis:
    analysis = AtenGraphAnalysis(gm, owner, len(owner.graphs))
    owner.graphs.append(analysis)
    return analysis
