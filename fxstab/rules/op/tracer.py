"""The operator level's tracer: each torch-level operator of a captured graph run on N stacked
samples (:class:`SampleTracer`) by the rule its kind has in the table of
:mod:`fxstab.rules.op.registry` (lifted with ``vmap``, batched or elementwise on the samples,
once per sample where it cannot be lifted...); what every operator shares is here: the GEMM
surrogate before a product, the selected operators' outputs rounded into the format and
measured, the coverage notes. The analysis (:class:`fxstab.analysis.op_level.GraphAnalysis`)
plans the graph (:class:`~fxstab.rules.lifting.OpGraph`) and runs this tracer once per call, or
traces it into a sampled graph.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ...capture import user_ops as user_operator
from ...capture.flat import flatten_call as _flatten, unflatten_call as _unflatten
from ...capture.graph import (
    fetch_attr, identity_dropout, is_inplace, names_weight, node_callable,
)
from ...capture.naming import qualified_name
from ...capture.opsets import SCALAR_WRITING_KINDS, nothing_to_lose
from ... import executors
from ...cpu import alloc, bindings as native
from ...numerics import lowp_gemm, randbits
from ...numerics.digits import digits_cap, empty_stats, merge_stats, student_t
from ...numerics.formats import working_dtype_for
from ...passes import steps
from ...records.coverage import ANALYSED, SKIPPED, UNROUNDED, CoverageEntry
from ...records.report import (
    ROUNDED, UNLIFTED, OpReport, ReportRow, block_builder, report_builder, stats_row,
)
from ..lifting import LOW_READERS, NodePlan, OpGraph, Stacked, has_floating
from . import decisions, draws, elementwise, gemm, per_sample, structural  # noqa: F401 - rules
from .lifted import isolated, lifted
from .registry import ONCE, OpCall, rules_for
from .structural import in_vmap_region, on_samples, rebatched, unbatched

__all__ = ["SampleTracer", "Pending", "RoundedOutput", "held_scalars"]


def held_scalars(kind: str, leaves: list, fmt: Any) -> list:
    """The Python floats among the arguments of a selection that writes them into its output
    (:data:`~fxstab.capture.opsets.SCALAR_WRITING_KINDS`: clamp's bounds, masked_fill's value;
    other kinds' leaves as they are) as the real run in the format holds them: rounded to
    nearest, saturating (a mask's fp32
    ``finfo.min`` is the format's lowest). Issue 54: ``clamp(p, 1e-4, 1 - 1e-4)`` is
    ``clamp(p, 1e-4, 1.0)`` in fp16, and the ``log(1 - p)`` after it ``-inf`` where the
    samples, clamped at the fp32 bound, stayed finite."""
    from ...numerics.rounding import quantize

    if kind not in SCALAR_WRITING_KINDS:
        return leaves
    return [float(quantize(torch.tensor(v, dtype=torch.float64), fmt, "nearest",
                           saturate=True))
            if type(v) is float and v == v and abs(v) != float("inf") else v for v in leaves]

class Pending(NamedTuple):
    """What a round step of one call notes for :meth:`SampleTracer.finish`: the operator's
    plan, a statistics row per rounded output (:func:`fxstab.numerics.digits.stats_vector`'s
    layout: a list, a kernel's buffer or a tensor), whether its GEMM surrogate fired (None: in
    its row's byte, a prepared step's), its status and its output's shape."""

    plan: NodePlan
    stats: list
    fired: Optional[bool]
    status: str
    shape: tuple


class RoundedOutput(NamedTuple):
    """One floating output of an operator as its round step takes it (decided once, by
    :meth:`SampleTracer._round_and_record`)."""

    leaf: int  # its index among the operator's output leaves
    stacked: bool  # it carries samples (else a plain tensor, read as N identical samples)
    in_place: bool  # memory of its own (no input's): rounded where it lies
    complex: bool  # real and imaginary parts rounded (and measured) as two real values
    # the step that rounds it and runs its consumer GEMM's surrogate in the same pass, where the
    # chosen kernels have one (executors.ROUND_PERTURB; None: the GEMM perturbs it itself)
    fused: Optional[executors.Implementation]
    prepared: Optional["native.Prepared"]  # its kernel with the settings bound, if they have one


class SampleTracer(torch.fx.Interpreter):
    """The stochastic rules of one graph: what each operator becomes on N stacked samples.

    A ``torch.fx.Interpreter`` of the graph the samples run (the captured one, fused operators
    expanded): :meth:`run_node` takes each node with its compile-time plan to the handler of
    its kind (an input, an attribute, an operator, the output). :meth:`run` interprets the
    graph once per input signature, under ``make_fx``
    (:class:`fxstab.analysis.sampled_graph.SampledGraph`): what it computes with torch operators (lifted
    with ``vmap``, batched, elementwise on the samples) is recorded as aten nodes, and what
    must run as fxstab's code at every call (rounding and recording, the GEMM surrogate,
    operators run once per sample with the deterministic pass's random numbers) as
    :class:`~fxstab.passes.steps.Step` nodes, which read the per-call state here (``call``,
    ``pending``, ``fired``) when the generated graph runs. Every decision :meth:`run` takes
    depends on shapes, dtypes and the graph, never on values, so one trace serves every call
    with the same signature.
    """

    def __init__(self, graph: OpGraph, call: int, coverage: Optional[dict] = None) -> None:
        # values are freed after their last use by the plan's own table (free_after), which
        # also forgets a freed weight's id; a failure keeps the operator's own message (the
        # coverage and the warning quote it)
        super().__init__(graph.gm, garbage_collect_values=False, graph=graph.graph)
        self.extra_traceback = False
        self.g = graph
        self.state = graph.state
        self.cfg = graph.state.config
        # node name -> how it ran (fxstab.records.coverage), noted by run(): the previous
        # call's notes, which a note equal to them keeps
        self.coverage: dict = {} if coverage is None else coverage
        self.n = self.cfg.n_samples
        self.fmt = self.cfg.format
        self.wdtype = working_dtype_for(self.cfg.widest_format)
        self.cdtype = torch.complex128 if self.wdtype == torch.float64 else torch.complex64
        # consumer GEMM's plan index -> its operand, perturbed in its producer's rounding step
        self.preperturbed: dict[int, "Stacked"] = {}
        # ids of the working copies of the module's parameters and buffers (GEMM surrogate)
        self.weights: set[int] = set()
        self._freed = 0  # bytes of values freed since the heap was last trimmed (run_node)
        # plan index -> derive_seed(seed, graph, plan): a step's seed is that and (call, purpose)
        self._seeds: dict[int, int] = {}
        # (plan index, purpose) -> slot of the seeds computed for the whole call at once
        self._slots: dict[tuple, int] = {}
        self._call_seeds: Optional[native.CallSeeds] = None
        # (id of a plan, status, shape) -> what its reports share (finish)
        self._templates: dict[tuple, tuple] = {}
        # the steps of one output through a prepared kernel (_one_output_step) note the same
        # entry every call: id(entry) -> (its row, its kernel); a byte per row: whether its
        # GEMM's surrogate fired in this call (such an entry's own flag is None)
        self._rows: dict[int, tuple[int, "native.Prepared"]] = {}
        self._fired_rows = bytearray()
        # once a call noted only such entries: that call's entries, and their kernels'
        # statistics rows in one block, which finish then copies at once (_learn_block)
        self._usual: Optional[list] = None
        self._block: Any = None
        self._layout: tuple = ()
        self.begin(call)

    def begin(self, call: int) -> None:
        """The state of one analysed call, which the steps fill."""
        self.call = call
        self.pending: list[Pending] = []
        self.fired: dict[int, bool] = {}  # GEMM plan index -> its surrogate perturbed something
        self.acc_errors: dict[int, Optional[tuple]] = {}  # GEMM plan -> accumulator's digits
        # whether a step of this call may have left statistics as tensors (only the general
        # path of _round_step can: Triton, the references; finish converts them in one go)
        self._tensor_stats = False
        self._now: Optional[list] = None
        if self._slots and native.available():  # every step's seed of this call, in one go
            if self._call_seeds is None or self._call_seeds.n != len(self._slots):
                keys = list(self._slots)
                self._call_seeds = native.CallSeeds([self._seeds[i] for i, _ in keys],
                                                    [q for _, q in keys])
            self._now = self._call_seeds(call)

    # -- helpers --------------------------------------------------------------------------
    def seed(self, plan: NodePlan, purpose: int) -> int:
        """``derive_seed(seed, graph, operator, call, purpose)``: the first three salts once,
        the whole call's at its start once the steps are known."""
        key = (plan.index, purpose)
        slot = self._slots.get(key)
        if slot is not None and self._now is not None:
            return self._now[slot]
        base = self._seeds.get(plan.index)
        if base is None:
            base = self._seeds[plan.index] = randbits.derive_seed(self.cfg.seed, self.g.index,
                                                                  plan.index)
        if slot is None:
            self._slots[key] = len(self._slots)
        return randbits.derive_seed(base, self.call, purpose)

    def to_working(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.to(self.wdtype) if t.dtype != self.wdtype else t
        if t.is_complex():
            return t.to(self.cdtype) if t.dtype != self.cdtype else t
        return t

    def stack(self, v: Any) -> torch.Tensor:
        """Samples of a leaf: stacked as is, or N identical copies of a plain tensor."""
        if isinstance(v, Stacked):
            return v.samples
        return v.unsqueeze(0).expand(self.n, *v.shape)

    def step(self, what: str, plan: NodePlan, fn: Callable[[list], Any], leaves: list) -> Any:
        """``fn(leaves)`` as one step of the generated graph: the tensors among ``leaves``
        (stacked or plain) are its inputs at run time, the other leaves are constants of the
        trace, and the tensors of its result its outputs. ``fn`` returns a value built like
        the operator's output (Stacked where it carries samples)."""
        pos = [i for i, v in enumerate(leaves) if isinstance(v, (Stacked, torch.Tensor))]
        stacked = [isinstance(leaves[i], Stacked) for i in pos]
        template = [None if isinstance(v, (Stacked, torch.Tensor)) else v for v in leaves]
        layout: list = []

        def run(ts: list) -> list:
            new = list(template)
            for i, s, t in zip(pos, stacked, ts):
                new[i] = Stacked(t) if s else t
            flat, spec = pytree.tree_flatten(fn(new), is_leaf=lambda x: isinstance(x, Stacked))
            where = [(j, isinstance(v, Stacked)) for j, v in enumerate(flat)
                     if isinstance(v, (Stacked, torch.Tensor))]
            if not layout:  # the trace: how to rebuild the output (no tensor kept)
                layout[:] = [[None if isinstance(v, (Stacked, torch.Tensor)) else v
                              for v in flat], spec, where]
            return [flat[j].samples if s else flat[j] for j, s in where]

        label = plan.name or f"{plan.module_path}/{plan.kind}"
        outs = steps.emit(steps.Step(what, label, run),
                          [leaves[i].samples if s else leaves[i] for i, s in zip(pos, stacked)])
        flat, spec, where = layout
        flat = list(flat)
        for (j, s), t in zip(where, outs):
            flat[j] = Stacked(t) if s else t
        return pytree.tree_unflatten(flat, spec)

    # -- main loop ------------------------------------------------------------------------
    def run(self, args: tuple) -> Any:
        """Interpret the graph on ``args`` (under ``make_fx``: the trace); returns the outputs'
        samples. :meth:`finish` then turns the steps' statistics into reports."""
        try:
            return super().run(*args, enable_io_processing=False)
        finally:
            self.env = {}
            self.preperturbed.clear()  # holds samples of the trace otherwise

    def run_node(self, node: torch.fx.Node) -> Any:
        plan = self.g.plan_of[node]
        op = node.op
        if op == "placeholder":
            out = self._input(node, next(self.args_iter))
        elif op == "get_attr":
            out = self._attribute(node)
        elif op == "output":
            out = torch.fx.node.map_arg(node.args[0], self.env.__getitem__)
        else:
            out = self._run_node(plan, self.env)
        for dead in self.g.free_after.get(node, ()):
            gone = self.env.pop(dead, None)
            if isinstance(gone, torch.Tensor):  # a freed id may be reused by a data tensor
                self.weights.discard(id(gone))
            t = gone.samples if isinstance(gone, Stacked) else gone
            if isinstance(t, torch.Tensor):
                self._freed += t.numel() * t.element_size()
            del gone, t  # no name holds the freed value (one output more at the peak)
        if self._freed > TRIM_EVERY:  # the heap fragments node by node (fxstab.cpu.alloc)
            self._freed = 0
            alloc.trim()
        return out

    def _input(self, node: torch.fx.Node, v: Any) -> Any:
        """An argument of the graph: a tensor enters in the working dtype (a copy where the
        graph writes into it); a parameter or buffer is remembered as a weight (the GEMM
        surrogate perturbs data operands only)."""
        if isinstance(v, torch.Tensor):
            weight = _is_weight(self.g, node, v)
            if node in self.g.mutated:
                v = v.detach().clone()
            v = v.detach()
            # a weight its readers' GEMMs read in its own dtype stays so where the path takes
            # it (OpGraph.low_weights; a forward's weights were decided before the call:
            # GraphAnalysis._working_weights): _widened converts it elsewhere
            if not (weight and node in self.g.low_weights and (
                    v.dtype == self.wdtype or lowp_gemm.keeps(v, self.g.low_weights[node]))):
                v = self.to_working(v)
            if weight:
                self.weights.add(id(v))
        return v

    def _attribute(self, node: torch.fx.Node) -> Any:
        v = fetch_attr(self.g.gm, node.target)
        if isinstance(v, torch.Tensor):
            v = self.to_working(v.detach())
            self.weights.add(id(v))
        return v

    def _run_node(self, plan: NodePlan, env: dict) -> Any:
        node = plan.node
        args = torch.fx.node.map_arg(node.args, lambda m: env[m])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda m: env[m])
        fn = node_callable(self.g.gm, node)
        if plan.custom:
            fn = user_operator.implementation(node.target) or fn
        leaves, spec = _flatten(args, kwargs)
        stacked = [i for i, v in enumerate(leaves) if isinstance(v, Stacked)]
        kind = plan.kind
        if stacked:
            fn = on_samples(kind, fn, leaves)
            leaves = held_scalars(kind, leaves, plan.format or self.fmt)

        if stacked and is_inplace(node) and isinstance(args[0], torch.Tensor):
            # x += f(samples) into a plain tensor (a T5-style relative bias): the target
            # becomes N copies that the operator updates in place, and every later reader of
            # the target sees the samples
            target = Stacked(self.stack(self.to_working(args[0])).clone())
            leaves[0] = target
            if isinstance(node.args[0], torch.fx.Node):
                env[node.args[0]] = target
            stacked = [0] + stacked

        if plan.gemm and plan.name is not None:
            leaves = self._perturb(plan, leaves)
            stacked = [i for i, v in enumerate(leaves) if isinstance(v, Stacked)]
        if self.g.low_weights and not _reads_low(plan, stacked) and \
                not (plan.layout and not stacked):  # (a weight's view: see below)
            leaves = self._widened(leaves)

        call = OpCall(self, plan, fn, args, leaves, spec, stacked)
        try:
            out, status, how = self._apply_rules(call)
        except Exception as exc:  # noqa: BLE001 - one operator never sinks the graph
            if steps.active():  # under a trace: refuse it (a value it cannot keep, a
                raise  # .item()); the rules then run untraced, isolating this operator
            if plan.lowp:
                call = OpCall(self, plan, fn, args, self._widened(leaves), spec, stacked)
            out, status, how = isolated(call, exc)

        if plan.name is not None:
            out, measured = self._round_and_record(plan, out, status, leaves)
            if not measured:
                self._note(plan, SKIPPED, "no floating output", False)
            elif status == UNLIFTED:  # isolated: its samples are one value broadcast
                self._note(plan, UNROUNDED, how, True)
            else:
                self._note(plan, ANALYSED, how, True)
        else:
            floating = has_floating(out)
            if not floating:
                self._note(plan, SKIPPED, "no floating output", False)
            elif identity_dropout(node, kind):
                self._note(plan, SKIPPED, "identity: dropout with training=False or p=0", True)
            else:
                why = "not selected" + (f"; {how}" if how.startswith("per sample") else "")
                self._note(plan, UNROUNDED, why, True)
        return out

    def _widened(self, leaves: list) -> list:
        """``leaves`` with the weights kept in their own dtype (OpGraph.low_weights) in the
        working one: read by anything but a linear of samples in the format's GEMMs."""
        return [self.to_working(v) if isinstance(v, torch.Tensor) and id(v) in self.weights
                else v for v in leaves]

    def _note(self, plan: NodePlan, how: str, reason: str, floating: bool) -> None:
        """Record how the node ran (fxstab.records.coverage)."""
        kind = plan.kind
        why = nothing_to_lose(kind)  # exact or random draws: nothing to round there
        exact = why is not None
        if plan.name is None and exact and floating:
            reason = f"{why}, {reason}"
        counted = floating and not (exact and how != ANALYSED) and how != SKIPPED
        cov = self.coverage
        old = cov.get(plan.node.name)
        if old is not None and (old.how, old.reason, old.floating) == (how, reason, floating):
            return  # as in the previous call (the usual case): no new entry
        cov[plan.node.name] = CoverageEntry(
            operator=plan.name or qualified_name(plan.module_path, kind), kind=kind, how=how,
            reason=reason, graph=self.g.index, node=plan.node.name, floating=floating,
            counted=counted)

    # -- the rules' table ---------------------------------------------------------------
    def _apply_rules(self, call: OpCall) -> tuple:
        """The outcome of the first rule of the node's kind that answers
        (:mod:`fxstab.rules.op.registry`: those for any operands, then once on plain operands,
        then those that need samples, then the default)."""
        rules = rules_for(call.plan.kind)
        for rule in rules:
            if not rule.samples:
                found = rule.run(call)
                if found is not None:
                    return found
        if not call.stacked:
            a, k = _unflatten(call.leaves, call.spec)
            out = call.fn(*a, **k)
            if isinstance(out, torch.Tensor) and self._of_weight(call):
                # a weight's view is that weight, in its dtype (WEIGHT_VIEWS; the GEMMs that
                # read it widen it where they do not take it as it is: _widened)
                self.weights.add(id(out))
                return out, ROUNDED, ONCE
            out = self.to_working(out) if isinstance(out, torch.Tensor) else pytree.tree_map(
                lambda t: self.to_working(t) if isinstance(t, torch.Tensor) else t, out)
            return out, ROUNDED, ONCE
        for rule in rules:
            if rule.samples:
                found = rule.run(call)
                if found is not None:
                    return found
        return lifted(call)

    def _of_weight(self, call: OpCall) -> bool:
        """Whether a plain call is a layout operator (:data:`WEIGHT_VIEWS`) of one weight."""
        if not call.plan.layout:
            return False
        tensors = [v for v in call.leaves if isinstance(v, torch.Tensor)]
        return len(tensors) == 1 and id(tensors[0]) in self.weights

    def det_dtype(self, plan: NodePlan) -> Optional[torch.dtype]:
        """The floating dtype of the node's output in the deterministic pass (dynamo's
        example value), if known: random draws depend on it (rand of fp64 consumes twice the
        bits of fp32's)."""
        ev = plan.node.meta.get("example_value")
        leaf = next((t for t in pytree.tree_leaves(ev) if isinstance(t, torch.Tensor)), None)
        if leaf is not None and leaf.is_floating_point():
            return leaf.dtype
        return None

    def wrap_out(self, out: Any) -> Any:
        """An operator's result on the samples as :class:`Stacked` values in the working
        dtype (every tensor of it)."""
        if isinstance(out, torch.Tensor):
            return Stacked(self.to_working(out))
        return pytree.tree_map(
            lambda t: Stacked(self.to_working(t)) if isinstance(t, torch.Tensor) else t, out)

    # -- surrogate, rounding, recording ----------------------------------------------------
    def _perturb(self, plan: NodePlan, leaves: list) -> list:
        """The GEMM surrogate (docs/design.md §4) on the operands that carry samples.

        Weights (the module's parameters and buffers: identical in every sample) are not
        perturbed: perturbing the data already moves every term x_k * w_k of a dot product by
        its own relative eta, which is what the surrogate must expose, and the product then runs
        against one weight instead of N copies (the arithmetic level does the same: its inputs
        carry samples, its weights do not). Every floating operand that is data is perturbed,
        carrying samples or not (the model's inputs meeting a product, near-tie keys beside
        rounded queries): which of them is ill-conditioned is unknown. Only a product of
        weights alone has its weights perturbed. A plain operand always comes out as samples
        (all its elements are insufficiently separated); one step per operand, which notes in
        ``fired`` whether it perturbed anything.
        """
        new = list(leaves)
        floats = [i for i, v in enumerate(leaves)
                  if isinstance(v, Stacked) and v.samples.is_floating_point()]
        plain = [i for i, v in enumerate(leaves)
                 if isinstance(v, torch.Tensor) and v.is_floating_point()]
        data = [i for i in plain if id(leaves[i]) not in self.weights]
        # plain data (an input meeting a product with samples: near-tie keys beside rounded
        # queries) is perturbed too; weights only in a product of weights alone
        floats = sorted(floats + data) if floats else (data or plain)
        pre = self.preperturbed.pop(plan.index, None)
        for i in floats:
            v = leaves[i]
            if pre is not None and v is pre:  # perturbed in its producer's rounding step
                continue
            stacked = isinstance(v, Stacked)
            # (in a captured vmap region: the physical tensor, wrapped back after the step)
            x, levels = unbatched(v.samples if stacked else self.to_working(v),
                                  1 if stacked else 0)
            step = steps.Step("perturb", f"{plan.name}_{i}", functools.partial(
                self._perturb_step, plan, 1000 + i, stacked))
            new[i] = Stacked(rebatched(steps.emit(step, [x])[0], levels))
        return new

    def _eta(self, plan: NodePlan) -> float:
        """The surrogate's threshold for a GEMM: the configured one, else (format="auto") the
        unit roundoff of the format the GEMM rounds into."""
        eta = self.cfg.data_perturbation_threshold
        return eta if eta is not None else self._grid(plan).unit_roundoff

    def _grid(self, plan: NodePlan) -> Any:
        """The format a GEMM rounds into: its surrogate's perturbed values go on its grid."""
        return plan.format or self.fmt

    def _perturb_step(self, plan: NodePlan, purpose: int, stacked: bool, xs: list) -> list:
        x = xs[0]
        perturb = self.state.kernel(executors.PERTURB, x)  # (x plain: read as N samples)
        out, count = perturb(x, self._eta(plan), self.seed(plan, purpose), self.n, stacked,
                             self._grid(plan))
        if count:
            self.fired[plan.index] = True
        return [out]

    def _round_and_record(self, plan: NodePlan, out: Any, status: str, inputs: list) -> Any:
        """Round and measure the operator's floating outputs: one step, which appends the
        statistics to ``pending`` at every call. Decided here, once: which outputs are
        rounded in place (an output that shares no memory with the operator's inputs; a view
        of an input is not: other consumers of that input would see its rounding), which one
        carries its GEMM consumer's surrogate in the same pass."""
        single = isinstance(out, (Stacked, torch.Tensor))
        flat, spec = ([out], None) if single else pytree.tree_flatten(out)
        taken = {_storage(v.samples if isinstance(v, Stacked) else v) for v in inputs
                 if isinstance(v, (Stacked, torch.Tensor))}
        rounds = status != UNLIFTED and plan.rounds  # (unrounded=: an ablation)
        fuse = plan.fuse if status == ROUNDED and rounds and len(flat) == 1 else None
        to_round: list[RoundedOutput] = []
        # leaf index -> the tensor the step reads: inside a captured vmap region, a batched
        # value's physical tensor (its batch dims after the samples' dim; the shape reported
        # has them), wrapped back at its levels after the step (structural.unbatched)
        physical: dict[int, torch.Tensor] = {}
        levels: dict[int, tuple] = {}
        shape: tuple = ()
        cfg = self.cfg
        for j, v in enumerate(flat):
            t = v.samples if isinstance(v, Stacked) else v
            if not (isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())):
                continue
            stacked = isinstance(v, Stacked)
            t, levels[j] = unbatched(t, 1 if stacked else 0)
            physical[j] = t
            if not shape:
                shape = tuple(t.shape[1:] if stacked else t.shape)
            samples = t if stacked else self.stack(t)
            # the fused steps of the kernels that round these samples (complex ones round part
            # by part: neither)
            real = not t.is_complex()
            prepare = self.state.kernel(executors.PREPARED_ROUND, samples) if real else None
            fused = self.state.kernel(executors.ROUND_PERTURB, samples) \
                if real and fuse is not None else None
            own = stacked and _storage(t) not in taken
            prepared = None
            if prepare is not None and samples[0].numel():
                # the kernel's settings bound once: a call sets the seed(s) and runs it; with
                # its consumer GEMM's surrogate in the same pass where fused
                prepared = prepare(plan.format or self.fmt, cfg.rounding if rounds else None,
                                   samples.dtype, self.n, saturate=cfg.saturate,
                                   confidence=cfg.confidence,
                                   zero_threshold=cfg.zero_threshold, in_place=own,
                                   run_shift=cfg.run_shift,
                                   eta=self._eta(fuse[0]) if fused is not None else None,
                                   grid=self._grid(fuse[0]) if fused is not None else None)
            to_round.append(RoundedOutput(j, stacked, own, t.is_complex(), fused, prepared))
        if not to_round:
            return out, False
        general = functools.partial(self._round_step, plan, tuple(to_round), status, shape)
        first = to_round[0]
        if len(to_round) == 1 and first.prepared is not None:
            one = self._one_output_step(plan, first.leaf, first.prepared, status, shape, general,
                                        first.stacked)
            step = steps.Step("round", plan.name, lambda xs: [one(xs)], one=one)
        else:
            step = steps.Step("round", plan.name, general)
        rounded = steps.emit(step, [physical[o.leaf] for o in to_round])
        new = list(flat)
        for o, r in zip(to_round, rounded):
            new[o.leaf] = Stacked(rebatched(r, levels[o.leaf]))
            if o.fused is not None:
                self.preperturbed[fuse[0].index] = new[o.leaf]
        return (new[0] if single else pytree.tree_unflatten(new, spec)), True

    def _one_output_step(self, plan: NodePlan, j: int, prepared: "native.Prepared",
                         status: str, shape: tuple, general: Callable,
                         stacked: bool) -> Callable:
        """The round step of the usual operator (one output, the prepared CPU kernel):
        :meth:`_round_step` without its loop, returning the rounded samples themselves (a
        node of a long graph of small tensors spends most of its time in such Python). It
        notes the same entry every call (a GEMM's surrogate flag goes to its row's byte):
        what lets :meth:`finish` copy a whole call's statistics at once."""
        key = (plan.index, j)
        index, gemm, n = plan.index, plan.gemm, self.n
        fz = prepared.fused  # the consumer GEMM's surrogate, in the same pass
        user, leaf = plan.fuse if fz is not None else (None, 0)
        purpose = 1000 + leaf  # its seed's purpose, as _round_step's (the operand's position)
        row = len(self._rows)
        entry = Pending(plan, [prepared.stats], None if gemm else False, status, shape)
        self._rows[id(entry)] = (row, prepared)
        fired_rows = self._fired_rows
        fired_rows.append(0)
        # the step's seeds among the call's (CallSeeds), once the trace assigned them
        slot = fslot = -1

        def one(xs: list) -> torch.Tensor:
            nonlocal slot, fslot
            now = self._now
            if now is not None and slot >= 0:
                seed = now[slot]
            else:
                seed = self.seed(plan, j)
                slot = self._slots.get(key, -1)
            if fz is not None:
                if now is not None and fslot >= 0:
                    fz.seed = now[fslot]
                else:
                    fz.seed = self.seed(user, purpose) & randbits.M64
                    fslot = self._slots.get((user.index, purpose), -1)
            x = xs[0]
            out = prepared(x if stacked else x.unsqueeze(0).expand(n, *x.shape), seed)
            if out is None:  # a layout the kernel does not read
                return general(xs)[0]
            if gemm:  # only a GEMM's surrogate fires
                fired_rows[row] = self.fired.pop(index, False)
            if fz is not None and fz.count:
                self.fired[user.index] = True
            self.pending.append(entry)
            return out

        return one

    def _round_step(self, plan: NodePlan, to_round: tuple[RoundedOutput, ...], status: str,
                    shape: tuple, xs: list) -> list:
        cfg = self.cfg
        stats, outs = [], []
        for o, t in zip(to_round, xs):
            j, prepared = o.leaf, o.prepared
            samples = t if o.stacked else t.unsqueeze(0).expand(self.n, *t.shape)
            if prepared is not None and prepared.fused is None:  # (fused: one-output steps')
                out = prepared(samples, self.seed(plan, j))
                if out is not None:
                    outs.append(out)
                    stats.append(prepared.stats)  # read by finish, before the next call
                    continue
            if o.complex:
                # real and imaginary parts round (and are measured) as two real values each
                parts, vec = self._round_stats(torch.view_as_real(samples.resolve_conj()
                                                                  .contiguous()),
                                               status != UNLIFTED and plan.rounds,
                                               self.seed(plan, j), False,
                                               plan.format)
                outs.append(torch.view_as_complex(parts))
            elif o.fused is not None:
                user, leaf = plan.fuse
                samples, vec, count = o.fused(
                    samples, plan.format or self.fmt, cfg.rounding, self.seed(plan, j),
                    self._eta(user), self.seed(user, 1000 + leaf),
                    saturate=cfg.saturate, confidence=cfg.confidence,
                    zero_threshold=cfg.zero_threshold, in_place=o.in_place,
                    run_shift=cfg.run_shift, grid=self._grid(user))
                if count:
                    self.fired[user.index] = True
                outs.append(samples)
            else:
                samples, vec = self._round_stats(samples, status != UNLIFTED and plan.rounds,
                                                 self.seed(plan, j), o.in_place, plan.format)
                outs.append(samples)
            stats.append(vec)
        self.pending.append(Pending(plan, stats, self.fired.pop(plan.index, False), status, shape))
        self._tensor_stats = True
        return outs

    def _round_stats(self, samples: torch.Tensor, rounded: bool, seed: int,
                     in_place: bool = False, fmt: Any = None):
        """Round (unless ``rounded`` is False) and measure one output's samples.

        Returns the samples and [sum of digits, min, max, zeros, non-finite, numel] (a list
        from the CPU kernels, a list or tensor from the others: ``finish`` reads both), by the
        implementation of :data:`fxstab.executors.ROUND` chosen for them (the fused C or
        Triton kernels do both in one pass, the plain-torch path computes the same bits);
        ``in_place`` lets the fused CPU kernels overwrite ``samples`` (an output nothing else
        holds), which saves one copy of every output at the peak.
        """
        cfg = self.cfg
        fmt = fmt or self.fmt
        if samples[0].numel() == 0:
            return samples, empty_stats(digits_cap(fmt, samples.dtype))
        return self.state.kernel(executors.ROUND, samples)(
            samples, fmt, cfg.rounding if rounded else None, seed, saturate=cfg.saturate,
            confidence=cfg.confidence, zero_threshold=cfg.zero_threshold, in_place=in_place,
            run_shift=cfg.run_shift)

    def measure(self, samples: torch.Tensor, fmt: Any) -> Any:
        """The statistics row of ``samples`` ([N, ...]) measured, not rounded: a value no rule
        rounded that an analysis reports (a parameter's gradient)."""
        return self._round_stats(samples, False, 0, False, fmt)[1]

    def note(self, entry: Pending) -> None:
        """An entry of this call besides the steps' (a parameter gradient's), reported by
        :meth:`finish` with them."""
        self.pending.append(entry)
        self._tensor_stats = True  # its row may be the references' tensor

    def finish(self) -> None:
        """The reports of this call, from what its steps recorded: deferred into the log
        (``ReportLog``), built when it is read."""
        pending = self.pending
        if not pending:
            return
        owner = self.state
        n = self.n
        t = student_t(n, self.cfg.confidence)
        if pending == self._usual and not self.acc_errors:  # _learn_block's (by identity)
            owner.reports.defer_many(
                block_builder(owner.phase, owner.step, self.call, n, t),
                (self._layout, bytes(self._block), bytes(self._fired_rows)), len(pending))
            return
        # the CPU kernels give lists or their own buffers; tensors (Triton, references): one
        # stack, one transfer
        tensors = [(i, j) for i, e in enumerate(pending) for j, v in enumerate(e.stats)
                   if isinstance(v, torch.Tensor)] if self._tensor_stats else ()
        if tensors:
            rows = [pending[i].stats[j] for i, j in tensors]
            try:
                values = torch.stack(rows).tolist()
            except RuntimeError:  # outputs on several devices
                values = torch.stack([r.cpu() for r in rows]).tolist()
            for (i, j), v in zip(tensors, values):
                pending[i].stats[j] = v
        build = report_builder(owner.phase, owner.step, self.call, n, t)
        defer = owner.reports.defer()
        rows = self._rows
        for e in pending:
            plan, stats, fired, status, shape = e
            if fired is None:  # a prepared GEMM step's: its row's byte
                fired = bool(self._fired_rows[rows[id(e)][0]])
            # the prepared kernel's buffer is reused by its next call: copied (as bytes)
            v = stats_row(stats[0] if len(stats) == 1 else merge_stats([r[:] for r in stats]))
            tpl = self._template_of(plan, status, shape)
            acc = self.acc_errors.get(plan.index)  # an accumulator's own digits (avg, min)
            defer((build, ReportRow(fixed=tpl[0], cap=tpl[1], surrogate=fired, stats=v,
                                    gemm=acc)))
        self._learn_block(pending)

    def _learn_block(self, pending: list) -> None:
        """After a call whose every entry came from a prepared one-output step (each once): its
        entries in order, and every such kernel's statistics in one block from now on, so a
        call that notes the same entries is a comparison and one copy in :meth:`finish`."""
        rows = self._rows
        if self._usual is not None or not all(id(e) in rows for e in pending) or \
                len({id(e) for e in pending}) != len(pending):
            return
        block = native.stats_block(len(rows))
        for k, prepared in rows.values():
            prepared.use_row(block, k)
        for e in pending:  # the entries hold their kernel's buffer
            e.stats[0] = rows[id(e)][1].stats
        self._block, self._usual = block, list(pending)
        self._layout = tuple((*self._template_of(e.plan, e.status, e.shape), rows[id(e)][0])
                             for e in pending)

    def _template_of(self, plan: NodePlan, status: str, shape: tuple) -> tuple:
        key = (id(plan), status, shape)  # plans live as long as their tracer
        tpl = self._templates.get(key)
        if tpl is None:
            tpl = self._templates[key] = self._template(plan, status, shape)
        return tpl

    def _template(self, plan: NodePlan, status: str, shape: tuple) -> tuple:
        """The fields of ``plan``'s reports that no call changes (``OpReport.from_stats``),
        and its digit cap."""
        fmt = plan.format or self.fmt
        fixed = OpReport.fixed_of({"format": self.fmt.name, "n_samples": self.n, **plan.report,
                                   "status": status, "shape": shape})
        return fixed, digits_cap(fmt, self.wdtype)


def _storage(t: torch.Tensor) -> int:
    while in_vmap_region(t):  # a batched tensor's memory is its physical tensor's
        t = torch._C._functorch.get_unwrapped(t)
    return t.untyped_storage().data_ptr()


# the values freed by an interpreted call between two trims of the heap: its free pages go back
# to the kernel, or the heap grows past them (fxstab.cpu.alloc.trim)
TRIM_EVERY = 256 << 20


def _reads_low(plan: NodePlan, stacked: list) -> bool:
    """Whether the node reads a weight kept in its own dtype as it is (OpGraph.low_weights): a
    GEMM of the samples in the format's GEMMs (its data operand alone stacked: the rules of
    fxstab.rules.op.gemm), an embedding of plain indices (its rows widen after the lookup)."""
    if not plan.lowp:
        return False
    data = LOW_READERS[plan.kind][1]
    return stacked == ([] if data is None else [data])


def _is_weight(g: OpGraph, node: torch.fx.Node, value: torch.Tensor) -> bool:
    """Whether a placeholder holds a module parameter or buffer (a Parameter, named so by
    dynamo: :func:`fxstab.capture.graph.names_weight`, or a backward graph's saved view of
    one: ``OpGraph.weight_inputs``)."""
    return isinstance(value, torch.nn.Parameter) or names_weight(node) or \
        node in g.weight_inputs
