"""The operator level's rules: what each torch-level operator of a captured graph becomes on N
stacked samples (:class:`SampleTracer`): lifted with ``vmap``, batched or elementwise on the
samples, run once per sample where it cannot be lifted; the selected operators' outputs rounded
into the format and measured, the GEMM surrogate where a product's operands are too close.
The analysis (:class:`fxstab.analysis.op_level.GraphAnalysis`) plans the graph and runs this
tracer once per call, or traces it into a sampled graph.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils import _pytree as pytree

from ..capture import user_ops as user_operator
from ..capture.flat import flatten_call as _flatten, unflatten_call as _unflatten
from ..capture.graph import fetch_attr, identity_dropout, is_inplace, is_metadata, node_callable, reads_item
from ..capture.naming import qualified_name
from ..capture.opsets import DROPOUT_KINDS, EXACT_KINDS, RANDOM_KINDS, RNN_KINDS
from ..cpu import bindings as native
from ..numerics import randbits
from ..numerics.digits import (
    digits_cap, empty_stats, extra_stats, merge_stats, stats_vector, student_t, underflow_count,
)
from ..numerics.formats import working_dtype_for
from ..numerics.rounding import round_samples
from ..numerics.surrogate import perturb_samples
from ..passes import steps
from ..records.coverage import ANALYSED, SKIPPED, UNROUNDED, CoverageEntry
from ..records.report import (
    PER_SAMPLE, ROUNDED, UNLIFTED, OpReport, block_builder, report_builder, stats_row,
)
from .accumulation import accumulable, gemm_model_label, modelled_gemm
from .lifting import (
    BATCHED_KINDS, CAST_METHODS, ELEMENTWISE_KINDS, MASK_DROPOUT_KINDS, PER_SAMPLE_KINDS,
    RESHAPE_VIEWS, NodePlan, Stacked, attention_folded, broadcasts_directly, has_floating,
    has_vmap_rule, is_float_cast, reshape, rng_states, set_rng_states,
)

__all__ = ["SampleTracer"]

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

    def __init__(self, analysis: Any, call: int) -> None:
        # values are freed after their last use by the plan's own table (free_after), which
        # also forgets a freed weight's id; a failure keeps the operator's own message (the
        # coverage and the warning quote it)
        super().__init__(analysis.gm, garbage_collect_values=False, graph=analysis.sgraph)
        self.extra_traceback = False
        self.a = analysis
        self.cfg = analysis.cfg
        self.n = self.cfg.n_samples
        self.fmt = self.cfg.format
        self.wdtype = working_dtype_for(self.cfg.widest_format)
        self.cdtype = torch.complex128 if self.wdtype == torch.float64 else torch.complex64
        # consumer GEMM's plan index -> its operand, perturbed in its producer's rounding step
        self.preperturbed: dict[int, "Stacked"] = {}
        # ids of the working copies of the module's parameters and buffers (GEMM surrogate)
        self.weights: set[int] = set()
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
        self.pending: list[tuple[NodePlan, list, bool, str, tuple]] = []
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
    def _seed(self, plan: NodePlan, purpose: int) -> int:
        """``derive_seed(seed, graph, operator, call, purpose)``: the first three salts once,
        the whole call's at its start once the steps are known."""
        key = (plan.index, purpose)
        slot = self._slots.get(key)
        if slot is not None and self._now is not None:
            return self._now[slot]
        base = self._seeds.get(plan.index)
        if base is None:
            base = self._seeds[plan.index] = randbits.derive_seed(self.cfg.seed, self.a.index,
                                                                  plan.index)
        if slot is None:
            self._slots[key] = len(self._slots)
        return randbits.derive_seed(base, self.call, purpose)

    def _to_working(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.to(self.wdtype) if t.dtype != self.wdtype else t
        if t.is_complex():
            return t.to(self.cdtype) if t.dtype != self.cdtype else t
        return t

    def _stack(self, v: Any) -> torch.Tensor:
        """Samples of a leaf: stacked as is, or N identical copies of a plain tensor."""
        if isinstance(v, Stacked):
            return v.samples
        return v.unsqueeze(0).expand(self.n, *v.shape)

    def _step(self, what: str, plan: NodePlan, fn: Callable[[list], Any], leaves: list) -> Any:
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
        plan = self.a.plan_of[node]
        op = node.op
        if op == "placeholder":
            out = self._input(node, next(self.args_iter))
        elif op == "get_attr":
            out = self._attribute(node)
        elif op == "output":
            out = torch.fx.node.map_arg(node.args[0], self.env.__getitem__)
        else:
            out = self._run_node(plan, self.env)
        for dead in self.a.free_after.get(node, ()):
            gone = self.env.pop(dead, None)
            if isinstance(gone, torch.Tensor):  # a freed id may be reused by a data tensor
                self.weights.discard(id(gone))
            del gone  # no name holds the freed value (one output more at the peak)
        return out

    def _input(self, node: torch.fx.Node, v: Any) -> Any:
        """An argument of the graph: a tensor enters in the working dtype (a copy where the
        graph writes into it); a parameter or buffer is remembered as a weight (the GEMM
        surrogate perturbs data operands only)."""
        if isinstance(v, torch.Tensor):
            weight = _is_weight(node, v)
            if node in self.a.mutated:
                v = v.detach().clone()
            v = self._to_working(v.detach())
            if weight:
                self.weights.add(id(v))
        return v

    def _attribute(self, node: torch.fx.Node) -> Any:
        v = fetch_attr(self.a.gm, node.target)
        if isinstance(v, torch.Tensor):
            v = self._to_working(v.detach())
            self.weights.add(id(v))
        return v

    def _run_node(self, plan: NodePlan, env: dict) -> Any:
        node = plan.node
        args = torch.fx.node.map_arg(node.args, lambda m: env[m])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda m: env[m])
        fn = node_callable(self.a.gm, node)
        if plan.custom:
            fn = user_operator.implementation(node.target) or fn
        leaves, spec = _flatten(args, kwargs)
        stacked = [i for i, v in enumerate(leaves) if isinstance(v, Stacked)]
        kind = plan.kind
        if stacked and kind in RESHAPE_VIEWS and not any(isinstance(v, torch.dtype)
                                                           for v in leaves):
            # the samples' memory layout is not the deterministic pass's (a rounded output is
            # contiguous, a per-sample one stacked): a view of it may need a copy
            fn = reshape

        if stacked and is_inplace(node) and isinstance(args[0], torch.Tensor):
            # x += f(samples) into a plain tensor (a T5-style relative bias): the target
            # becomes N copies that the operator updates in place, and every later reader of
            # the target sees the samples
            target = Stacked(self._stack(self._to_working(args[0])).clone())
            leaves[0] = target
            if isinstance(node.args[0], torch.fx.Node):
                env[node.args[0]] = target
            stacked = [0] + stacked

        if plan.gemm and plan.name is not None:
            leaves = self._perturb(plan, leaves)
            stacked = [i for i, v in enumerate(leaves) if isinstance(v, Stacked)]

        if (plan.accumulate is not None or plan.gemm_inputs is not None) and stacked and \
                accumulable(*_unflatten(leaves, spec), kind):
            # the GEMM's accumulator on the samples (fxstab.numerics.accumulation): blocks of
            # K summed exactly, one rounding into the accumulator each; a random rounding
            # draws per sample and element (CESTAC inside the product), each call anew
            out = self._step("accumulate", plan,
                             lambda lv: self._accumulated(plan, lv, spec), leaves)
            status, how = ROUNDED, gemm_model_label(plan.accumulate, plan.gemm_inputs,
                                                    self.cfg.gemm_scaling)
        elif kind in RANDOM_KINDS and kind not in MASK_DROPOUT_KINDS:
            # every sample draws what the deterministic pass drew (its RNG state, its dtype)
            out = self._step("random", plan, lambda lv: self._per_sample(fn, lv, spec, plan),
                             leaves)
            status = ROUNDED
            how = "random: the deterministic pass's draws in every sample"
        elif kind == "item" and not stacked and reads_item(node) and \
                getattr(node.args[0], "op", "") == "placeholder":
            # the value of an input scalar (in the trace's signature): a constant of the trace
            with disable_proxy_modes_tracing():
                out = args[0].item()
            status, how = ROUNDED, "once: no operand carries samples"
        elif not stacked:
            a, k = _unflatten(leaves, spec)
            out = fn(*a, **k)
            out = self._to_working(out) if isinstance(out, torch.Tensor) else pytree.tree_map(
                lambda t: self._to_working(t) if isinstance(t, torch.Tensor) else t, out)
            status, how = ROUNDED, "once: no operand carries samples"
        elif identity_dropout(node, kind) and isinstance(leaves[0], Stacked):
            out, status, how = leaves[0], ROUNDED, "identity: dropout with training=False or p=0"
        elif kind in MASK_DROPOUT_KINDS:
            out = self._step("dropout", plan, lambda lv: self._dropout(fn, lv, spec, plan),
                             leaves)
            status = ROUNDED
            how = "dropout: the deterministic pass's mask on every sample"
        elif is_metadata(node, kind):
            first = [v.samples[0] if isinstance(v, Stacked) else v for v in leaves]
            a, k = _unflatten(first, spec)
            out, status, how = fn(*a, **k), ROUNDED, "metadata: read on the first sample"
        elif node.op == "call_method" and kind in CAST_METHODS and is_float_cast(node, leaves):
            out, status, how = leaves[0], ROUNDED, "floating cast: kept in the working dtype"
        elif kind == "getitem" and isinstance(args[0], (tuple, list)):
            out, status, how = args[0][args[1]], ROUNDED, "item of a tuple"
        elif kind in ELEMENTWISE_KINDS and broadcasts_directly(leaves):
            a, k = _unflatten([v.samples if isinstance(v, Stacked) else v for v in leaves], spec)
            out, status, how = self._wrap_out(fn(*a, **k)), ROUNDED, "elementwise on the samples"
        elif kind in BATCHED_KINDS and all(i < BATCHED_KINDS[kind] for i in stacked):
            out = self._batched(fn, leaves, spec, BATCHED_KINDS[kind], kind)
            status, how = ROUNDED, "batched over the samples"
        else:
            out, status, how = self._lifted(plan, fn, leaves, spec, stacked)

        if plan.name is not None:
            out, measured = self._round_and_record(plan, out, status, leaves)
            if measured:
                self._note(plan, ANALYSED, how, True)
            else:
                self._note(plan, SKIPPED, "no floating output", False)
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

    def _note(self, plan: NodePlan, how: str, reason: str, floating: bool) -> None:
        """Record how the node ran (fxstab.records.coverage)."""
        kind = plan.kind
        exact = kind in EXACT_KINDS or (kind in RANDOM_KINDS and kind not in DROPOUT_KINDS)
        if plan.name is None and exact and floating:
            reason = ("exact (data movement or selection), " if kind in EXACT_KINDS else
                      "random draws, ") + reason
        counted = floating and not (exact and how != ANALYSED) and how != SKIPPED
        cov = self.a.info.coverage
        old = cov.get(plan.node.name)
        if old is not None and (old.how, old.reason, old.floating) == (how, reason, floating):
            return  # as in the previous call (the usual case): no new entry
        cov[plan.node.name] = CoverageEntry(
            operator=plan.name or qualified_name(plan.module_path, kind), kind=kind, how=how,
            reason=reason, graph=self.a.index, node=plan.node.name, floating=floating,
            counted=counted)

    # -- lifting --------------------------------------------------------------------------
    def _lifted(self, plan: NodePlan, fn: Callable, leaves: list, spec, stacked: list):
        """vmap over the samples, else once per sample: (output, status, how it ran)."""
        info = self.a.info
        key = plan.name or plan.node.name
        kind = plan.kind
        def per_sample(dtype: Optional[torch.dtype] = None) -> Any:
            return self._step("per_sample", plan,
                              lambda lv: self._per_sample(fn, lv, spec, plan, dtype=dtype), leaves)

        if kind in PER_SAMPLE_KINDS:
            return per_sample(), ROUNDED, "per sample: samples must not share batch statistics"
        if kind in RNN_KINDS:
            return per_sample(), ROUNDED, \
                "per sample: no vmap rule for recurrent layers (deterministic pass's dropout)"
        if plan.custom and key not in info.unlifted and not has_vmap_rule(plan.node.target):
            info.unlifted[key] = "custom operator without a vmap rule"
        if key not in info.unlifted:
            def call(*ts):
                new = list(leaves)
                for i, t in zip(stacked, ts):
                    new[i] = t
                a, k = _unflatten(new, spec)
                # vmap returns tensors only: the other leaves (None, numbers) go around it
                flat, out_spec = pytree.tree_flatten(fn(*a, **k))
                where = [j for j, v in enumerate(flat) if isinstance(v, torch.Tensor)]
                holder[:] = [flat, out_spec, where]
                return tuple(flat[j] for j in where)

            holder: list = []
            states = rng_states(())
            try:
                outs = torch.vmap(call, randomness="error")(*[leaves[i].samples for i in stacked])
                flat, out_spec, where = holder
                flat = list(flat)
                for j, t in zip(where, outs):
                    flat[j] = t
                return self._wrap_out(pytree.tree_unflatten(flat, out_spec)), ROUNDED, "vmap"
            except Exception as exc:  # not batch-transparent: fall back to per-sample
                set_rng_states(states)  # a random operator may have drawn before failing
                info.unlifted[key] = (f"vmap: {type(exc).__name__}: "
                                      f"{(str(exc).splitlines() or [''])[0][:200]}")
        status = PER_SAMPLE if plan.name is not None else UNLIFTED
        det = self._det_dtype(plan)
        if key not in info.in_model_dtype:
            try:
                return per_sample(), status, f"per sample ({info.unlifted[key]})"
            except Exception as exc:
                if det is None or det == self.wdtype:
                    raise
                info.in_model_dtype[key] = f"{type(exc).__name__}: {str(exc)[:160]}"
        # the operator refuses the working dtype (fp64 for an fp32 format, say): its samples
        # run in the model's dtype, then return to the working dtype
        return (per_sample(det), status,
                f"per sample in {str(det).replace('torch.', '')} ({info.unlifted[key]}; the "
                f"working dtype: {info.in_model_dtype[key]})")

    def _accumulated(self, plan: NodePlan, leaves: list, spec) -> "Stacked":
        """The GEMM of ``plan`` on the samples with its accumulator (``plan.accumulate``)."""
        out, self.acc_errors[plan.index] = modelled_gemm(
            *_unflatten(leaves, spec), plan, self.cfg, self._seed(plan, 2000), self._to_working,
            digits_cap(plan.format or self.fmt, self.wdtype))
        return out

    def _det_dtype(self, plan: NodePlan) -> Optional[torch.dtype]:
        """The floating dtype of the node's output in the deterministic pass (dynamo's
        example value), if known: random draws depend on it (rand of fp64 consumes twice the
        bits of fp32's)."""
        ev = plan.node.meta.get("example_value")
        leaf = next((t for t in pytree.tree_leaves(ev) if isinstance(t, torch.Tensor)), None)
        if leaf is not None and leaf.is_floating_point():
            return leaf.dtype
        return None

    def _per_sample(self, fn: Callable, leaves: list, spec, plan: Optional[NodePlan] = None,
                    dtype: Optional[torch.dtype] = None) -> Any:
        """Run ``fn`` once per sample and stack the results as they come: each sample's output
        is copied into its slot and freed, so the peak holds one stacked output, not two.

        Every sample starts from the RNG state the operator found, so an operator that draws
        random numbers (inter-layer dropout of an LSTM, a custom kernel) draws the same ones in
        every sample, those of the deterministic pass; the state afterwards is the one a single
        call leaves. Random operators run in the deterministic pass's dtype."""
        merged: list = []
        out_spec = None
        states = rng_states(())
        random = plan is not None and plan.kind in RANDOM_KINDS
        det = dtype or (self._det_dtype(plan) if random else None)
        if not any(isinstance(v, Stacked) for v in leaves):  # a random draw from plain values
            a, kw = _unflatten([v.to(det) if det is not None and isinstance(v, torch.Tensor)
                                and v.is_floating_point() else v for v in leaves], spec)
            return pytree.tree_map(lambda t: self._to_working(t) if isinstance(t, torch.Tensor)
                                   else t, fn(*a, **kw))
        for k in range(self.n):
            set_rng_states(states)
            sample = [v.samples[k] if isinstance(v, Stacked) else v for v in leaves]
            if det is not None:
                sample = [v.to(det) if isinstance(v, torch.Tensor) and v.is_floating_point()
                          else v for v in sample]
            a, kw = _unflatten(sample, spec)
            flat, out_spec = pytree.tree_flatten(fn(*a, **kw))
            if k == 0:
                merged = [torch.empty((self.n, *v.shape), dtype=v.dtype, device=v.device)
                          if isinstance(v, torch.Tensor) else v for v in flat]
            for slot, v in zip(merged, flat):
                if isinstance(v, torch.Tensor):
                    slot[k].copy_(v)
            del flat
        merged = [Stacked(self._to_working(v)) if isinstance(v, torch.Tensor) else v
                  for v in merged]
        return pytree.tree_unflatten(merged, out_spec)

    def _wrap_out(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return Stacked(self._to_working(out))
        return pytree.tree_map(
            lambda t: Stacked(self._to_working(t)) if isinstance(t, torch.Tensor) else t, out)

    def _batched(self, fn: Callable, leaves: list, spec, k: int, kind: str) -> Any:
        a, kw = _unflatten(leaves, spec)
        a = [self._stack(v) if i < k and isinstance(v, (Stacked, torch.Tensor)) else v
             for i, v in enumerate(a)]
        if kind == "scaled_dot_product_attention":
            return Stacked(self._to_working(attention_folded(fn, a, kw)))
        return Stacked(self._to_working(fn(*a, **kw)))

    def _dropout(self, fn: Callable, leaves: list, spec, plan: NodePlan) -> Any:
        # The mask of the deterministic pass: same RNG state, same shape and dtype, ones as
        # input; the samples are multiplied by it (the 1/(1-p) scaling then rounds).
        det = self._det_dtype(plan)
        first = [torch.ones_like(v.samples[0], dtype=det or v.samples.dtype) if isinstance(v, Stacked) else v
                 for v in leaves]
        a, k = _unflatten(first, spec)
        k = dict(k)
        if "inplace" in k:
            k["inplace"] = False
        mask = fn(*a, **k)
        x = next(v for v in leaves if isinstance(v, Stacked))
        return Stacked(x.samples * mask.to(x.samples.dtype))

    # -- surrogate, rounding, recording ----------------------------------------------------
    def _perturb(self, plan: NodePlan, leaves: list) -> list:
        """The GEMM surrogate (DESIGN.md §4) on the operands that carry samples.

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
            x = v.samples if isinstance(v, Stacked) else self._to_working(v)
            step = steps.Step("perturb", f"{plan.name}_{i}", functools.partial(
                self._perturb_step, plan, 1000 + i, isinstance(v, Stacked)))
            new[i] = Stacked(steps.emit(step, [x])[0])
        return new

    def _eta(self, plan: NodePlan) -> float:
        """The surrogate's threshold for a GEMM: the configured one, else (format="auto") the
        unit roundoff of the format the GEMM rounds into."""
        eta = self.cfg.data_perturbation_threshold
        return eta if eta is not None else (plan.format or self.fmt).unit_roundoff

    def _perturb_step(self, plan: NodePlan, purpose: int, stacked: bool, xs: list) -> list:
        x = xs[0]
        eta = self._eta(plan)
        seed = self._seed(plan, purpose)
        if self.a.owner.uses_native(x):  # a plain operand is read N times, never copied
            out, count = native.perturb(x, eta, seed, n_samples=None if stacked else self.n)
        else:
            samples = (x if stacked else x.unsqueeze(0).expand(self.n, *x.shape)).contiguous()
            if self.a.owner.uses_triton(samples):
                from ..kernels.dispatch import perturb

                out, count = perturb(samples, eta, seed, kernels=self.cfg.kernels)
            else:
                out, count = perturb_samples(samples, eta, seed)
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
        fuse = plan.fuse if status == ROUNDED and len(flat) == 1 else None
        to_round: list = []  # (leaf index, stacked, in place, complex, fused, prepared kernel)
        shape: tuple = ()
        cfg = self.cfg
        for j, v in enumerate(flat):
            t = v.samples if isinstance(v, Stacked) else v
            if not (isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())):
                continue
            stacked = isinstance(v, Stacked)
            if not shape:
                shape = tuple(t.shape[1:] if stacked else t.shape)
            samples = self._stack(v)
            native_ok = not t.is_complex() and self.a.owner.uses_native(samples)
            fused = fuse is not None and native_ok
            own = stacked and _storage(t) not in taken
            prepared = None
            if native_ok and samples[0].numel():
                # the kernel's settings bound once: a call sets the seed(s) and runs it; with
                # its consumer GEMM's surrogate in the same pass where fused
                prepared = native.Prepared(native.rounder(
                    plan.format or self.fmt, cfg.rounding if status != UNLIFTED else None,
                    samples.dtype,
                    self.n, saturate=cfg.saturate, confidence=cfg.confidence,
                    zero_threshold=cfg.zero_threshold), own,
                    self._eta(fuse[0]) if fused else None)
            to_round.append((j, stacked, own, t.is_complex(), fused, prepared))
        if not to_round:
            return out, False
        general = functools.partial(self._round_step, plan, tuple(to_round), status, shape)
        j, stacked, _own, _cplx, _fused, prepared = to_round[0]
        if len(to_round) == 1 and prepared is not None:
            one = self._one_output_step(plan, j, prepared, status, shape, general, stacked)
            step = steps.Step("round", plan.name, lambda xs: [one(xs)], one=one)
        else:
            step = steps.Step("round", plan.name, general)
        rounded = steps.emit(step, [flat[j].samples if s else flat[j] for j, s, *_ in to_round])
        new = list(flat)
        for (j, *_rest, fused, _prepared), r in zip(to_round, rounded):
            new[j] = Stacked(r)
            if fused:
                self.preperturbed[fuse[0].index] = new[j]
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
        entry = (plan, [prepared.stats], None if gemm else False, status, shape)
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
                seed = self._seed(plan, j)
                slot = self._slots.get(key, -1)
            if fz is not None:
                if now is not None and fslot >= 0:
                    fz.seed = now[fslot]
                else:
                    fz.seed = self._seed(user, purpose) & randbits.M64
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

    def _round_step(self, plan: NodePlan, to_round: tuple, status: str, shape: tuple,
                    xs: list) -> list:
        cfg = self.cfg
        stats, outs = [], []
        for (j, stacked, own, cplx, fused, prepared), t in zip(to_round, xs):
            samples = t if stacked else t.unsqueeze(0).expand(self.n, *t.shape)
            if prepared is not None and prepared.fused is None:  # (fused: one-output steps')
                out = prepared(samples, self._seed(plan, j))
                if out is not None:
                    outs.append(out)
                    stats.append(prepared.stats)  # read by finish, before the next call
                    continue
            if cplx:
                # real and imaginary parts round (and are measured) as two real values each
                parts, vec = self._round_stats(torch.view_as_real(samples.resolve_conj()
                                                                  .contiguous()),
                                               status != UNLIFTED, self._seed(plan, j), False,
                                               plan.format)
                outs.append(torch.view_as_complex(parts))
            elif fused:
                user, leaf = plan.fuse
                samples, vec, count = native.round_perturb(
                    samples, plan.format or self.fmt, cfg.rounding, self._seed(plan, j),
                    self._eta(user), self._seed(user, 1000 + leaf),
                    saturate=cfg.saturate, confidence=cfg.confidence,
                    zero_threshold=cfg.zero_threshold, in_place=own, as_list=True)
                if count:
                    self.fired[user.index] = True
                outs.append(samples)
            else:
                samples, vec = self._round_stats(samples, status != UNLIFTED,
                                                 self._seed(plan, j), own, plan.format)
                outs.append(samples)
            stats.append(vec)
        self.pending.append((plan, stats, self.fired.pop(plan.index, False), status, shape))
        self._tensor_stats = True
        return outs

    def _round_stats(self, samples: torch.Tensor, rounded: bool, seed: int,
                     in_place: bool = False, fmt: Any = None):
        """Round (unless ``rounded`` is False) and measure one output's samples.

        Returns the samples and [sum of digits, min, max, zeros, non-finite, numel] (a list
        from the CPU kernels, a tensor from the others: ``finish`` reads both);
        ``in_place`` lets the fused CPU kernels overwrite ``samples`` (an output nothing else
        holds), which saves one copy of every output at the peak. The fused
        Triton kernel does both in one pass where ``kernels`` selects it (CUDA by default);
        the plain-torch path computes the same bits.
        """
        cfg = self.cfg
        fmt = fmt or self.fmt
        n = samples.shape[0]
        cap = digits_cap(fmt, samples.dtype)
        numel = samples[0].numel()
        if numel == 0:
            return samples, empty_stats(cap)
        if self.a.owner.uses_native(samples):
            out, vec, _ = native.round_stats(samples, fmt, cfg.rounding if rounded else None,
                                             seed, saturate=cfg.saturate,
                                             confidence=cfg.confidence,
                                             zero_threshold=cfg.zero_threshold,
                                             in_place=in_place, as_list=True)
            return out, vec
        t = student_t(n, cfg.confidence)
        under = underflow_count(samples, fmt) if rounded else 0
        if rounded and self.a.owner.uses_triton(samples):
            from ..kernels.dispatch import round_and_stats

            out, st = round_and_stats(samples, fmt, cfg.rounding, seed,
                                      saturate=cfg.saturate, confidence=cfg.confidence,
                                      zero_threshold=cfg.zero_threshold, kernels=cfg.kernels)
            # the extras (norms, underflow, quantiles) with torch operations on the device
            return out, [st.avg * numel, st.min, st.max, st.zero_fraction * numel,
                         float(st.non_finite), float(numel)] + extra_stats(out, t, cap, under)
        if rounded:
            samples = round_samples(samples, fmt, cfg.rounding, seed=seed,
                                    saturate=cfg.saturate)
        return samples, stats_vector(samples, t, cap, cfg.zero_threshold, under)

    def finish(self) -> None:
        """The reports of this call, from what its steps recorded: deferred into the log
        (``ReportLog``), built when it is read."""
        pending = self.pending
        if not pending:
            return
        owner = self.a.owner
        n = self.n
        t = student_t(n, self.cfg.confidence)
        if pending == self._usual and not self.acc_errors:  # _learn_block's (by identity)
            owner.reports.defer_many(
                block_builder(owner.phase, owner.step, self.call, n, t),
                (self._layout, bytes(self._block), bytes(self._fired_rows)), len(pending))
            return
        # the CPU kernels give lists or their own buffers; tensors (Triton, references): one
        # stack, one transfer
        tensors = [(i, j) for i, e in enumerate(pending) for j, v in enumerate(e[1])
                   if isinstance(v, torch.Tensor)] if self._tensor_stats else ()
        if tensors:
            rows = [pending[i][1][j] for i, j in tensors]
            try:
                values = torch.stack(rows).tolist()
            except RuntimeError:  # outputs on several devices
                values = torch.stack([r.cpu() for r in rows]).tolist()
            for (i, j), v in zip(tensors, values):
                pending[i][1][j] = v
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
            defer((build, (tpl[0], tpl[1], fired, None, v) + ((acc,) if acc else ())))
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
            e[1][0] = rows[id(e)][1].stats
        self._block, self._usual = block, list(pending)
        self._layout = tuple((*self._template_of(e[0], e[3], e[4]), rows[id(e)][0])
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
    return t.untyped_storage().data_ptr()


def _is_weight(node: torch.fx.Node, value: torch.Tensor) -> bool:
    """Whether a placeholder holds a module parameter or buffer (dynamo lifts both to graph
    inputs named ``L_self_modules_fc_parameters_weight_``, ``..._buffers_running_mean_``)."""
    return (isinstance(value, torch.nn.Parameter) or "_parameters_" in node.name
            or "_buffers_" in node.name)
