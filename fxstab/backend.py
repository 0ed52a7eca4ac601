"""The ``torch.compile`` backend (DESIGN.md §3, §4, §6).

``fxstab.backend(...)`` returns an :class:`FxstabBackend`. For every graph dynamo captures it
builds a :class:`GraphAnalysis`: the selection of instrumented operators, their stable names and
the edges between them, decided once at compile time. At run time an analysed call

1. runs the captured graph as is (the *deterministic path*: bit-identical to eager, autograd
   and optimizer unchanged), remembering the RNG state before and after;
2. runs the same graph on N stacked samples ``[N, ...]`` in the working dtype, without autograd
   (the *stochastic path*: the rules of :class:`SampleTracer`, traced once per input signature
   into generated code, :mod:`fxstab.passes`): each operator is lifted to the samples
   with ``torch.vmap`` (per sample where it cannot be), GEMM-like operators get the
   data-perturbation surrogate when their input samples are insufficiently separated, and the
   selected operators' outputs are rounded into the format (random rounding, one Philox stream
   per operator and call) and measured;
3. restores the RNG state, so the user's next random numbers are the ones they would have had.

Random operators see the deterministic pass's RNG state and dtype: dropout draws its mask once
(on ones) and multiplies every sample by it; other random operators, and every operator that
runs once per sample (no vmap rule: LSTM/GRU, custom kernels), start each sample from the state
the operator found, so all samples draw what the deterministic pass drew. Buffers the graph
mutates (BatchNorm running statistics, inputs updated in place) are cloned for the stochastic
path, and BatchNorm in training mode runs per sample so samples never mix statistics. Fused
fast paths (``torch._transformer_encoder_layer_fwd``) run their composite on the samples; how
each operator ran is :meth:`FxstabBackend.coverage` (``fxstab/records/coverage.py``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils import _pytree as pytree

from .cpu import alloc, bindings as native
from .numerics import randbits
from .capture import user_ops as user_operator
from .config import AnalysisConfig
from .numerics.digits import (
    digits_cap, empty_stats, extra_stats, merge_stats, stats_vector, student_t, underflow_count,
)
from .numerics.formats import working_dtype_for
from .capture.naming import NameRegistry, module_path, qualified_name, source_location
from .records.coverage import ANALYSED, SKIPPED, UNROUNDED, Coverage, CoverageEntry
from .passes import steps
from .analysis.sampled_graph import SampledGraph, SampledGraphs, signature
from .capture.opsets import (
    COMPOSITE_KINDS, DEFAULT_KINDS, DROPOUT_KINDS, EXACT_KINDS, FAMILIES, RANDOM_KINDS,
    RNN_KINDS, is_custom, is_gemm, node_kind,
)
from .records.report import (
    PER_SAMPLE, ROUNDED, UNLIFTED, OpReport, ReportLog, block_builder, report_builder,
    stats_row,
)
from .capture.flat import flatten_call as _flatten, unflatten_call as _unflatten
from .numerics.rounding import round_samples
from .numerics.surrogate import perturb_samples


__all__ = ["backend", "FxstabBackend", "GraphAnalysis", "GraphInfo", "default_backend",
           "SampleCapture"]

# Operators that only read metadata: run once, on the first sample.
_METADATA_KINDS = frozenset({"size", "dim", "numel", "stride", "is_floating_point", "is_contiguous",
                             "getattr", "sym_size", "sym_numel", "sym_stride", "nelement",
                             "element_size", "get_device", "is_complex"})
# Attributes that are tensors computed from the tensor (x.T, x.mT, x.real...): operators, not
# metadata, when dynamo records them as getattr nodes.
_TENSOR_ATTRS = frozenset({"T", "mT", "H", "mH", "real", "imag"})


def _metadata(node: torch.fx.Node, kind: str) -> bool:
    if kind != "getattr":
        return kind in _METADATA_KINDS
    return not (len(node.args) > 1 and node.args[1] in _TENSOR_ATTRS)


# Floating dtype conversions keep the working dtype on the stochastic path: the simulated format
# is what rounds, not the dtype the model happens to cast to.
_CAST_METHODS = frozenset({"to", "type", "float", "half", "bfloat16", "double", "type_as"})
_VIEW_KINDS = frozenset({"view", "reshape", "transpose", "permute", "getitem", "unsqueeze",
                         "squeeze", "flatten", "expand", "narrow", "select", "t", "contiguous"})
# Run per sample: BatchNorm/InstanceNorm in training mode must not mix the samples' statistics,
# and their in-place running-stat updates cannot be batched.
_PER_SAMPLE_KINDS = frozenset({"batch_norm", "instance_norm"})

# Dropout that multiplies by a mask (scaled by 1/(1-p)): the mask is drawn once. Alpha dropout
# is affine in the mask and runs per sample, each sample with the deterministic pass's draws.
_MASK_DROPOUT_KINDS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d"})

# Operators that take stacked samples directly in their leading arguments (count): SDPA batches
# over leading dims, and linear with a plain weight runs as one addmm over N * batch rows
# (vmap would split it into mm + add).
_BATCHED_KINDS = {"scaled_dot_product_attention": 3, "linear": 1}
# Elementwise operators (no dim argument): the stacked samples broadcast against the other
# operands as the plain values do, so the operator runs once on them, without vmap's dispatch,
# whenever the sample dim cannot meet another operand's dims (see _broadcasts_directly).
_ELEMENTWISE_KINDS = ((FAMILIES["activation"] - {"glu", "prelu"}) | FAMILIES["elementwise"]
                      | FAMILIES["addsub"] | {"mul", "neg", "abs"})


# Views whose samples may have to be copied (reshape): the deterministic pass's strides allowed
# the view, the samples' need not.
_RESHAPE_VIEWS = frozenset({"view", "unsafe_view"})


def _reshape(x: torch.Tensor, *shape: Any) -> torch.Tensor:
    return x.reshape(*shape)


def _attention_folded(fn: Callable, a: list, kw: dict) -> torch.Tensor:
    """SDPA (``fn``) of stacked q, k, v ``[N, B, H, L, E]`` (``a``; the rest of its arguments
    after them) as one call over ``N * B`` batches. SDPA takes any leading dims, but on five
    dims the CPU dispatch leaves the fused kernel for the math path (two bmm, a safe softmax
    that scans for fully masked rows, its where and isneginf): on the test GPT that path cost
    about twice three calls of the fused kernel. Each (batch, head) is computed alone by
    the fused kernel, so the samples are those of N separate calls. A plain attn_mask with a
    batch dim of its own is repeated N times along it; any other layout, or a folded call that
    raises, calls ``fn`` as is."""
    q, k, v = a[:3]
    n = q.shape[0]
    mask = a[3] if len(a) > 3 else kw.get("attn_mask")
    if not (q.dim() == k.dim() == v.dim() == 5 and q.shape[1] == k.shape[1] == v.shape[1]) or \
            (isinstance(mask, torch.Tensor) and mask.dim() > 4):
        return fn(*a, **kw)
    rest, fkw = a[3:], kw
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[0] != 1:
        mask = mask.expand(n, *mask.shape).reshape(n * mask.shape[0], *mask.shape[1:])
        if rest:
            rest = [mask, *rest[1:]]
        else:
            fkw = {**kw, "attn_mask": mask}
    b = q.shape[1]
    try:
        out = fn(*[t.reshape(n * b, *t.shape[2:]) for t in (q, k, v)], *rest, **fkw)
    except Exception:  # noqa: BLE001 - a layout the fold does not suit: SDPA as called
        return fn(*a, **kw)
    return out.reshape(n, b, *out.shape[1:])


class Stacked:
    """N samples of one value, stacked on dim 0. A pytree leaf."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __repr__(self) -> str:  # pragma: no cover
        return f"Stacked({tuple(self.t.shape)}, {self.t.dtype})"


@dataclass
class NodePlan:
    node: torch.fx.Node
    kind: str
    name: Optional[str] = None  # set when instrumented
    module_path: str = ""
    source: str = ""
    gemm: bool = False
    inputs: tuple = ()
    index: int = 0
    custom: bool = False  # a custom operator (torch.library, @fxstab.operator)
    # (consumer GEMM's plan, operand's leaf index): this output's only consumer is that GEMM,
    # whose surrogate then runs in this output's rounding pass (native.round_perturb)
    fuse: Optional[tuple["NodePlan", int]] = None
    report: dict = field(default_factory=dict)  # the fields of its reports fixed at compile time
    format: Any = None  # format="auto": the format its output rounds into (its dtype's)


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
    # signature -> why its stochastic path could not be traced (its rules then run untraced)
    untraced: dict = field(default_factory=dict)


def _selector(select: Any) -> Callable[[torch.fx.Node, str, str], bool]:
    """Build ``pred(node, kind, qualified_name)`` from the ``select`` option."""
    if select is None:  # the default families, and custom operators (DESIGN.md §3)
        return lambda node, kind, qn: kind in DEFAULT_KINDS or is_custom(node)
    if callable(select) and not isinstance(select, str):
        return lambda node, kind, qn: bool(select(node, qn))
    items = [select] if isinstance(select, str) else list(select)
    kinds: set[str] = set()
    globs: list[str] = []
    custom = False
    for item in items:
        if item in FAMILIES:
            kinds |= FAMILIES[item]
        elif item in ("all", "custom"):
            kinds |= DEFAULT_KINDS if item == "all" else set()
            custom = True
        elif any(ch in item for ch in "*?[/.") :
            globs.append(item)
        else:
            kinds.add(item)

    def pred(node: torch.fx.Node, kind: str, qn: str) -> bool:
        if kind in kinds or (custom and is_custom(node)):
            return True
        return any(fnmatch.fnmatchcase(qn, g) or
                   (kind in DEFAULT_KINDS and fnmatch.fnmatchcase(qn.rsplit("/", 1)[0], g))
                   for g in globs)

    return pred


_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.setitem,
})


def _is_inplace(node: torch.fx.Node) -> bool:
    """Whether a node writes into its first argument (``x += y``, ``x.add_(y)``,
    ``torch.relu_(x)``, ``x[i] = y``, ``inplace=True``, ``out=``)."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if isinstance(name, str) and name.endswith("_") and not name.endswith("__"):
        return True
    return node.kwargs.get("inplace") is True


def _chase_placeholder(node: Any) -> Optional[torch.fx.Node]:
    """The placeholder a (chain of views of a) node reads from, if any."""
    seen = 0
    while isinstance(node, torch.fx.Node) and seen < 16:
        if node.op == "placeholder":
            return node
        if node.op in ("call_method", "call_function") and node_kind(node) in _VIEW_KINDS and node.args:
            node = node.args[0]
            seen += 1
            continue
        return None
    return None


def _mutated_placeholders(graph: torch.fx.Graph) -> set:
    """Placeholders the graph mutates in place (directly or through views)."""
    out = set()
    for node in graph.nodes:
        if node.op not in ("call_method", "call_function"):
            continue
        kind = node_kind(node)
        targets = []
        if _is_inplace(node) or kind.endswith("_"):
            targets.append(node.args[0] if node.args else None)
        if isinstance(node.kwargs.get("out"), torch.fx.Node):
            targets.append(node.kwargs["out"])
        if kind == "batch_norm":
            targets += [node.args[i] if len(node.args) > i else None for i in (1, 2)]
            targets += [node.kwargs.get("running_mean"), node.kwargs.get("running_var")]
        if kind == "copy_" or (kind in ("setitem",) and node.args):
            targets.append(node.args[0])
        for t in targets:
            ph = _chase_placeholder(t)
            if ph is not None:
                out.add(ph)
    return out


def _arg(node: torch.fx.Node, i: int, name: str, default: Any) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _identity_dropout(node: torch.fx.Node, kind: str) -> bool:
    """A dropout that is the identity (``training=False`` or ``p=0`` as constants, as in eval):
    there is no scaling to round."""
    if kind not in DROPOUT_KINDS:
        return False
    training = _arg(node, 2, "training", _arg(node, 2, "train", True))
    return training is False or _arg(node, 1, "p", 0.5) == 0


class _SubGraph:
    """Emits the composite of one fused node into a graph: each operator carries the fused
    node's metadata with the submodule it belongs to (``layers.0`` + ``.self_attn``), so its
    stable name is the one the unfused module gives it (``layers.0.self_attn/...#0``)."""

    def __init__(self, graph: torch.fx.Graph, fused: torch.fx.Node) -> None:
        self.graph, self.fused, self.kinds = graph, fused, []
        stack = dict(fused.meta.get("nn_module_stack") or {})
        self.stack = stack
        self.raw = str(list(stack.values())[-1][0]) if stack else ""

    def call(self, sub: str, fn: Callable, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = self.graph.call_function(fn, args, kwargs)
        node.meta = {k: v for k, v in self.fused.meta.items() if k != "example_value"}
        if sub:
            path = f"{self.raw}.{sub}" if self.raw else sub
            node.meta["nn_module_stack"] = {**self.stack, f"fxstab.{sub}": (path, torch.nn.Module)}
        self.kinds.append(node_kind(node))
        return node


def _encoder_layer_composite(b: _SubGraph, src, embed_dim, num_heads, qkv_weight, qkv_bias,
                             proj_weight, proj_bias, use_gelu, norm_first, eps, norm_weight_1,
                             norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1,
                             ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    """``torch._transformer_encoder_layer_fwd`` (the eval fast path of
    ``nn.TransformerEncoderLayer``, batch first) as the operators the module runs without the
    fast path: self-attention (``F.multi_head_attention_forward``), residual adds, layer
    norms, the feed-forward linears and activation. Dropout is the identity there (eval)."""
    import torch.nn.functional as F

    def attention(x):
        q = b.call("self_attn", torch.transpose, x, 1, 0)
        kw: dict = {}
        if mask is not None:
            if mask_type == 1:
                kw["key_padding_mask"] = mask
            elif mask_type == 2:  # merged [B, H, T, S] -> [B * H, T, S]
                kw["attn_mask"] = b.call("self_attn", torch.flatten, mask, 0, 1)
            else:
                kw["attn_mask"] = mask
        out = b.call("self_attn", F.multi_head_attention_forward, q, q, q, embed_dim, num_heads,
                     qkv_weight, qkv_bias, None, None, False, 0.0, proj_weight, proj_bias,
                     training=False, need_weights=False, **kw)
        out = b.call("self_attn", operator.getitem, out, 0)
        return b.call("self_attn", torch.transpose, out, 1, 0)

    def feed_forward(x):
        h = b.call("linear1", F.linear, x, ffn_weight_1, ffn_bias_1)
        h = b.call("", F.gelu if use_gelu else F.relu, h)
        return b.call("linear2", F.linear, h, ffn_weight_2, ffn_bias_2)

    def norm(sub, x, w, bias):
        return b.call(sub, F.layer_norm, x, (embed_dim,), w, bias, eps)

    x = src
    if norm_first:
        x = b.call("", operator.add, x, attention(norm("norm1", x, norm_weight_1, norm_bias_1)))
        return b.call("", operator.add, x, feed_forward(norm("norm2", x, norm_weight_2,
                                                              norm_bias_2)))
    x = norm("norm1", b.call("", operator.add, x, attention(x)), norm_weight_1, norm_bias_1)
    return norm("norm2", b.call("", operator.add, x, feed_forward(x)), norm_weight_2, norm_bias_2)


_COMPOSITES = {"transformer_encoder_layer_fwd": _encoder_layer_composite}


def _expand_composites(graph: torch.fx.Graph, info: "GraphInfo") -> torch.fx.Graph:
    """The graph the stochastic path runs: ``graph`` itself, or a copy in which each fused
    operator of :data:`fxstab.capture.opsets.COMPOSITE_KINDS` is replaced by its composite."""
    if not any(n.op == "call_function" and node_kind(n) in COMPOSITE_KINDS for n in graph.nodes):
        return graph
    new = torch.fx.Graph()
    env: dict = {}
    for node in graph.nodes:
        kind = node_kind(node)
        if node.op == "call_function" and kind in COMPOSITE_KINDS:
            b = _SubGraph(new, node)
            args = torch.fx.node.map_arg(node.args, lambda m: env[m])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda m: env[m])
            env[node] = _COMPOSITES[kind](b, *args, **kwargs)
            info.composites[node.name] = (kind, tuple(b.kinds),
                                          qualified_name(module_path(node), kind))
        else:
            env[node] = new.node_copy(node, lambda m: env[m])
    return new


class GraphAnalysis:
    """One captured graph: its plan, and the callable dynamo runs."""

    def __init__(self, gm: torch.fx.GraphModule, owner: "FxstabBackend", index: int) -> None:
        self.gm = gm
        self.owner = owner
        self.cfg = owner.config
        self.index = index
        self.info = GraphInfo(index=index, n_nodes=len(gm.graph.nodes))
        self.mutated = _mutated_placeholders(gm.graph)
        self.plans: list[NodePlan] = []
        self.free_after = self._last_uses(gm.graph)
        self.sampled = SampledGraphs()  # the generated stochastic paths, by signature
        # what the model runs: the captured graph (backward=True: through AOTAutograd, whose
        # backward graph fxstab.analysis.backward analyses)
        self.deterministic: Callable = gm
        self.last_tracer: Optional["SampleTracer"] = None  # of the latest analysed call
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
            self._pred = _selector(self.cfg.select)
        return (not _metadata(node, kind) and not _identity_dropout(node, kind)
                and (kind in DROPOUT_KINDS or kind not in RANDOM_KINDS or
                     self.cfg.select is not None) and self._pred(node, kind, qn))

    def _format_of(self, node: torch.fx.Node) -> Any:
        """The format an instrumented node's output rounds into: the configured one, or with
        ``format="auto"`` its floating dtype in the program (dynamo's example value, the
        lowered graph's value)."""
        if not self.cfg.auto_format:
            return self.cfg.format
        from .numerics.formats import get_format

        value = node.meta.get("example_value", node.meta.get("val"))
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                try:
                    return get_format(leaf.dtype)
                except ValueError:
                    break
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
        self.sgraph = _expand_composites(self.gm.graph, self.info)
        if self.sgraph is not self.gm.graph:
            self.mutated = _mutated_placeholders(self.sgraph)
            self.free_after = self._last_uses(self.sgraph)
        for i, node in enumerate(self.sgraph.nodes):
            kind = node_kind(node)
            plan = NodePlan(node=node, kind=kind, index=i, custom=is_custom(node))
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
                    plan.inputs = tuple(sorted(ins))
                    plan.format = self._format_of(node)
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
        # placeholders read with .item() (dynamo passes a module's float as a 0-d tensor):
        # their values are part of a trace's signature
        self._item_inputs = [i for i, n in enumerate(self._placeholders())
                             if any(_reads_item(u) for u in n.users)]
        self._plan_fusion()

    def _plan_fusion(self) -> None:
        """Mark the rounded outputs whose only consumer is an instrumented GEMM that reads them
        once: the GEMM surrogate's perturbation of that operand then runs in the same pass as
        the rounding (the samples in cache), with the seed the GEMM would have used."""
        by_node = {plan.node: plan for plan in self.plans}
        for plan in self.plans:
            read, users = plan.node, list(plan.node.users)
            # through identity dropouts (eval), which pass the samples on as they are
            while len(users) == 1 and _identity_dropout(users[0], node_kind(users[0])) and \
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
        states = _rng_states(args)
        out = self.deterministic(*args)
        after = _rng_states(args)
        try:
            _set_rng_states(states)
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
            _set_rng_states(after)
        forward = self.direction == "forward"  # a backward graph returns gradients as they are
        if self.owner._captures and sample_out is not None and forward:
            captured = SampleCapture.as_tensors(out, sample_out, self.cfg.n_samples)
            for cap in self.owner._captures:
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
            floating = _has_floating(node.meta.get("example_value"))
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
            self.info.coverage = dict(self.info.coverage)
            tracer = SampleTracer(self, call)
            out = tracer.run(args)
            tracer.finish()
            self.last_tracer = tracer
            return out
        tracer = SampleTracer(self, call)
        self.info.coverage = {}
        try:
            sg = SampledGraph.trace(tracer, args, Stacked)
        except Exception as exc:  # noqa: BLE001 - the rules, untraced, for this signature
            self._refused(key, exc)
            _set_rng_states(rng_states)
            self.info.coverage = {}
            return self.run_samples(args, call, rng_states)
        sg.coverage = self.info.coverage
        self.sampled.add(key, sg)
        tracer.finish()
        self.last_tracer = tracer
        out, sg.first = sg.first, None
        return out

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
            t = getattr(s, "t", getattr(s, "samples", s))  # op-level or aten-level samples
            if isinstance(d, torch.Tensor) and d.is_floating_point() and \
                    isinstance(t, torch.Tensor):
                if t.dim() == d.dim() + 1 and t.shape[1:] == d.shape:
                    out.append(t.detach())
                else:  # not stochastic: N equal samples
                    out.append(t.detach().unsqueeze(0).expand(n, *t.shape))
            else:
                out.append(d)
        return pytree.tree_unflatten(out, spec)


def _straight_through_mean(det: Any, samples: Any) -> Any:
    det_flat, spec = pytree.tree_flatten(det)
    s_flat, _ = pytree.tree_flatten(samples)
    out = []
    for d, s in zip(det_flat, s_flat):
        t = getattr(s, "t", getattr(s, "samples", None))  # op-level or aten-level samples
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


def _rng_states(args: tuple) -> dict:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


class SampleTracer:
    """The stochastic rules of one graph: what each operator becomes on N stacked samples.

    :meth:`run` walks the graph once per input signature, under ``make_fx``
    (:class:`fxstab.analysis.sampled_graph.SampledGraph`): what it computes with torch operators (lifted
    with ``vmap``, batched, elementwise on the samples) is recorded as aten nodes, and what
    must run as fxstab's code at every call (rounding and recording, the GEMM surrogate,
    operators run once per sample with the deterministic pass's random numbers) as
    :class:`~fxstab.passes.steps.Step` nodes, which read the per-call state here (``call``,
    ``pending``, ``fired``) when the generated graph runs. Every decision :meth:`run` takes
    depends on shapes, dtypes and the graph, never on values, so one trace serves every call
    with the same signature.
    """

    def __init__(self, analysis: GraphAnalysis, call: int) -> None:
        self.a = analysis
        self.cfg = analysis.cfg
        self.n = self.cfg.n_samples
        self.fmt = self.cfg.format
        self.wdtype = working_dtype_for(self.fmt)
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
            return v.t
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
            return [flat[j].t if s else flat[j] for j, s in where]

        label = plan.name or f"{plan.module_path}/{plan.kind}"
        outs = steps.emit(steps.Step(what, label, run),
                          [leaves[i].t if s else leaves[i] for i, s in zip(pos, stacked)])
        flat, spec, where = layout
        flat = list(flat)
        for (j, s), t in zip(where, outs):
            flat[j] = Stacked(t) if s else t
        return pytree.tree_unflatten(flat, spec)

    # -- main loop ------------------------------------------------------------------------
    def run(self, args: tuple) -> Any:
        """Walk the graph on ``args`` (under ``make_fx``: the trace); returns the outputs'
        samples. :meth:`finish` then turns the steps' statistics into reports."""
        env: dict[torch.fx.Node, Any] = {}
        placeholders = iter(args)
        result = None
        for plan in self.a.plans:
            node = plan.node
            if node.op == "placeholder":
                v = next(placeholders)
                if isinstance(v, torch.Tensor):
                    weight = _is_weight(node, v)
                    if node in self.a.mutated:
                        v = v.detach().clone()
                    v = self._to_working(v.detach())
                    if weight:
                        self.weights.add(id(v))
                env[node] = v
            elif node.op == "get_attr":
                v = _fetch_attr(self.a.gm, node.target)
                if isinstance(v, torch.Tensor):
                    v = self._to_working(v.detach())
                    self.weights.add(id(v))
                env[node] = v
            elif node.op == "output":
                result = torch.fx.node.map_arg(node.args[0], lambda m: env[m])
            else:
                env[node] = self._run_node(plan, env)
            for dead in self.a.free_after.get(node, ()):
                gone = env.pop(dead, None)
                if isinstance(gone, torch.Tensor):  # a freed id may be reused by a data tensor
                    self.weights.discard(id(gone))
                del gone  # no name holds the freed value (one output more at the peak)
        self.preperturbed.clear()  # holds samples of the trace otherwise
        return result

    def _run_node(self, plan: NodePlan, env: dict) -> Any:
        node = plan.node
        args = torch.fx.node.map_arg(node.args, lambda m: env[m])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda m: env[m])
        fn = _callable(self.a.gm, node)
        if plan.custom:
            fn = user_operator.implementation(node.target) or fn
        leaves, spec = _flatten(args, kwargs)
        stacked = [i for i, v in enumerate(leaves) if isinstance(v, Stacked)]
        kind = plan.kind
        if stacked and kind in _RESHAPE_VIEWS and not any(isinstance(v, torch.dtype)
                                                           for v in leaves):
            # the samples' memory layout is not the deterministic pass's (a rounded output is
            # contiguous, a per-sample one stacked): a view of it may need a copy
            fn = _reshape

        if stacked and _is_inplace(node) and isinstance(args[0], torch.Tensor):
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

        if kind in RANDOM_KINDS and kind not in _MASK_DROPOUT_KINDS:
            # every sample draws what the deterministic pass drew (its RNG state, its dtype)
            out = self._step("random", plan, lambda lv: self._per_sample(fn, lv, spec, plan),
                             leaves)
            status = ROUNDED
            how = "random: the deterministic pass's draws in every sample"
        elif kind == "item" and not stacked and _reads_item(node) and \
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
        elif _identity_dropout(node, kind) and isinstance(leaves[0], Stacked):
            out, status, how = leaves[0], ROUNDED, "identity: dropout with training=False or p=0"
        elif kind in _MASK_DROPOUT_KINDS:
            out = self._step("dropout", plan, lambda lv: self._dropout(fn, lv, spec, plan),
                             leaves)
            status = ROUNDED
            how = "dropout: the deterministic pass's mask on every sample"
        elif _metadata(node, kind):
            first = [v.t[0] if isinstance(v, Stacked) else v for v in leaves]
            a, k = _unflatten(first, spec)
            out, status, how = fn(*a, **k), ROUNDED, "metadata: read on the first sample"
        elif node.op == "call_method" and kind in _CAST_METHODS and _is_float_cast(node, leaves):
            out, status, how = leaves[0], ROUNDED, "floating cast: kept in the working dtype"
        elif kind == "getitem" and isinstance(args[0], (tuple, list)):
            out, status, how = args[0][args[1]], ROUNDED, "item of a tuple"
        elif kind in _ELEMENTWISE_KINDS and _broadcasts_directly(leaves):
            a, k = _unflatten([v.t if isinstance(v, Stacked) else v for v in leaves], spec)
            out, status, how = self._wrap_out(fn(*a, **k)), ROUNDED, "elementwise on the samples"
        elif kind in _BATCHED_KINDS and all(i < _BATCHED_KINDS[kind] for i in stacked):
            out = self._batched(fn, leaves, spec, _BATCHED_KINDS[kind], kind)
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
            floating = _has_floating(out)
            if not floating:
                self._note(plan, SKIPPED, "no floating output", False)
            elif _identity_dropout(node, kind):
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

        if kind in _PER_SAMPLE_KINDS:
            return per_sample(), ROUNDED, "per sample: samples must not share batch statistics"
        if kind in RNN_KINDS:
            return per_sample(), ROUNDED, \
                "per sample: no vmap rule for recurrent layers (deterministic pass's dropout)"
        if plan.custom and key not in info.unlifted and not _has_vmap_rule(plan.node.target):
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
            states = _rng_states(())
            try:
                outs = torch.vmap(call, randomness="error")(*[leaves[i].t for i in stacked])
                flat, out_spec, where = holder
                flat = list(flat)
                for j, t in zip(where, outs):
                    flat[j] = t
                return self._wrap_out(pytree.tree_unflatten(flat, out_spec)), ROUNDED, "vmap"
            except Exception as exc:  # not batch-transparent: fall back to per-sample
                _set_rng_states(states)  # a random operator may have drawn before failing
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
        states = _rng_states(())
        random = plan is not None and plan.kind in RANDOM_KINDS
        det = dtype or (self._det_dtype(plan) if random else None)
        if not any(isinstance(v, Stacked) for v in leaves):  # a random draw from plain values
            a, kw = _unflatten([v.to(det) if det is not None and isinstance(v, torch.Tensor)
                                and v.is_floating_point() else v for v in leaves], spec)
            return pytree.tree_map(lambda t: self._to_working(t) if isinstance(t, torch.Tensor)
                                   else t, fn(*a, **kw))
        for k in range(self.n):
            _set_rng_states(states)
            sample = [v.t[k] if isinstance(v, Stacked) else v for v in leaves]
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
            return Stacked(self._to_working(_attention_folded(fn, a, kw)))
        return Stacked(self._to_working(fn(*a, **kw)))

    def _dropout(self, fn: Callable, leaves: list, spec, plan: NodePlan) -> Any:
        # The mask of the deterministic pass: same RNG state, same shape and dtype, ones as
        # input; the samples are multiplied by it (the 1/(1-p) scaling then rounds).
        det = self._det_dtype(plan)
        first = [torch.ones_like(v.t[0], dtype=det or v.t.dtype) if isinstance(v, Stacked) else v
                 for v in leaves]
        a, k = _unflatten(first, spec)
        k = dict(k)
        if "inplace" in k:
            k["inplace"] = False
        mask = fn(*a, **k)
        x = next(v for v in leaves if isinstance(v, Stacked))
        return Stacked(x.t * mask.to(x.t.dtype))

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
                  if isinstance(v, Stacked) and v.t.is_floating_point()]
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
            x = v.t if isinstance(v, Stacked) else self._to_working(v)
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
                from .kernels.dispatch import perturb

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
        taken = {_storage(v.t if isinstance(v, Stacked) else v) for v in inputs
                 if isinstance(v, (Stacked, torch.Tensor))}
        fuse = plan.fuse if status == ROUNDED and len(flat) == 1 else None
        to_round: list = []  # (leaf index, stacked, in place, complex, fused, prepared kernel)
        shape: tuple = ()
        cfg = self.cfg
        for j, v in enumerate(flat):
            t = v.t if isinstance(v, Stacked) else v
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
        rounded = steps.emit(step, [flat[j].t if s else flat[j] for j, s, *_ in to_round])
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
            from .kernels.dispatch import round_and_stats

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
        if pending == self._usual:  # the entries of _learn_block's call (compared by identity)
            owner.reports.defer_many(
                block_builder(owner._phase, owner._step, self.call, n, t),
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
        build = report_builder(owner._phase, owner._step, self.call, n, t)
        defer = owner.reports.defer()
        rows = self._rows
        for e in pending:
            plan, stats, fired, status, shape = e
            if fired is None:  # a prepared GEMM step's: its row's byte
                fired = bool(self._fired_rows[rows[id(e)][0]])
            # the prepared kernel's buffer is reused by its next call: copied (as bytes)
            v = stats_row(stats[0] if len(stats) == 1 else merge_stats([r[:] for r in stats]))
            tpl = self._template_of(plan, status, shape)
            defer((build, (tpl[0], tpl[1], fired, None, v)))
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


def _broadcasts_directly(leaves: list) -> bool:
    """Whether an elementwise operator can run on the stacked samples as they are: every stacked
    operand has the same number of dims (sample dim included) and no plain tensor has as many
    (right-aligned broadcasting then matches logical dims only), nothing asks for an in-place
    update (a ``True`` flag: ``inplace``) or an ``out`` tensor."""
    nd = -1
    for v in leaves:
        if isinstance(v, Stacked):
            if nd not in (-1, v.t.dim()):
                return False
            nd = v.t.dim()
    for v in leaves:
        if v is True or (isinstance(v, torch.Tensor) and v.dim() >= nd):
            return False
    return nd > 0


def _reads_item(node: torch.fx.Node) -> bool:
    return node.op == "call_method" and node.target == "item"


def _has_vmap_rule(target: Any) -> bool:
    """Whether a custom operator batches under vmap (a FuncTorchBatched kernel, or a composite
    that decomposes into operators that do); an @fxstab.operator is lifted as its function."""
    if user_operator.implementation(target) is not None:
        return True
    name = target.name()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, "FuncTorchBatched") or has(name, "CompositeImplicitAutograd")


def _has_floating(out: Any) -> bool:
    """Whether an output holds a floating or complex tensor (stacked or plain)."""
    for v in pytree.tree_leaves(out, is_leaf=lambda x: isinstance(x, Stacked)):
        t = v.t if isinstance(v, Stacked) else v
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            return True
    return False


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _is_weight(node: torch.fx.Node, value: torch.Tensor) -> bool:
    """Whether a placeholder holds a module parameter or buffer (dynamo lifts both to graph
    inputs named ``L_self_modules_fc_parameters_weight_``, ``..._buffers_running_mean_``)."""
    return (isinstance(value, torch.nn.Parameter) or "_parameters_" in node.name
            or "_buffers_" in node.name)


def _is_float_cast(node: torch.fx.Node, leaves: list) -> bool:
    """Whether a cast method keeps a floating tensor floating (so it is a no-op here)."""
    target = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    name = node.target
    if name in ("float", "half", "bfloat16", "double"):
        return True
    if name == "type_as":
        other = leaves[1] if len(leaves) > 1 else None
        t = other.t if isinstance(other, Stacked) else other
        return isinstance(t, torch.Tensor) and t.is_floating_point()
    if isinstance(target, torch.dtype):
        return target.is_floating_point
    if isinstance(target, torch.fx.Node):
        return False
    dt = node.kwargs.get("dtype")
    return dt is None or (isinstance(dt, torch.dtype) and dt.is_floating_point)


def _fetch_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _callable(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Callable:
    if node.op == "call_function":
        return node.target
    if node.op == "call_method":
        name = node.target
        return lambda self, *a, **k: getattr(self, name)(*a, **k)
    if node.op == "call_module":
        return _fetch_attr(gm, node.target)
    raise ValueError(f"cannot call node {node.format_node()}")


class FxstabBackend:
    """A ``torch.compile`` backend that records per-operator digits (see :func:`backend`)."""

    def __init__(self, config: AnalysisConfig) -> None:
        self.config = config
        self._reports = ReportLog()
        self.graphs: list[GraphAnalysis] = []
        self.names = NameRegistry()
        self.modules: set[str] = set()  # module paths of the captured graphs' operators
        self._captures: list = []  # active capture_samples() blocks
        self.enabled = True
        self._phase = "default"
        self._step: Optional[int] = None

    def uses_triton(self, t: torch.Tensor) -> bool:
        """Whether rounding/statistics of ``t`` go through the fused Triton kernels."""
        k = self.config.kernels
        return k == "triton" or (k == "auto" and t.device.type == "cuda")

    def uses_native(self, t: torch.Tensor) -> bool:
        """Whether rounding/statistics of ``t`` go through the fused CPU kernels
        (:mod:`fxstab.cpu.bindings`): ``kernels="cpu"``, or ``"auto"`` on a CPU tensor."""
        return self.config.kernels in ("auto", "cpu") and native.supports(t, self.config.n_samples)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        if self.config.granularity == "aten":
            from .analysis.aten_level import compile_aten  # arithmetic level

            analysis = compile_aten(self, gm, example_inputs)
        else:
            analysis = GraphAnalysis(gm, self, len(self.graphs))
            self.graphs.append(analysis)
        if self.config.backward:
            from .analysis.backward import through_autograd

            through_autograd(analysis, example_inputs)
        return analysis

    # -- reporting ------------------------------------------------------------------------
    @property
    def reports(self) -> ReportLog:
        """One ``OpReport`` per instrumented operator and analysed call, in order (a list to
        read; its reports are built when first read: ``fxstab.records.report.ReportLog``)."""
        return self._reports

    @reports.setter
    def reports(self, reports: Iterable[OpReport]) -> None:
        self._reports = reports if isinstance(reports, ReportLog) else ReportLog(reports)

    @property
    def infos(self) -> list[GraphInfo]:
        return [g.info for g in self.graphs]

    def clear(self) -> None:
        """Forget the reports (compiled graphs and names stay); a digit map made after this
        counts only the calls analysed since (its ``analysed_calls`` comes from the reports)."""
        self.reports.clear()

    @contextlib.contextmanager
    def phase(self, name: str, step: Optional[int] = None) -> Iterator["FxstabBackend"]:
        """Label the reports of the calls inside: ``with be.phase("train", step=i): ...``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty string, got {name!r}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise ValueError(f"step must be an int or None, got {step!r}")
        old = (self._phase, self._step)
        self._phase, self._step = name, step
        try:
            yield self
        finally:
            self._phase, self._step = old

    @contextlib.contextmanager
    def capture_samples(self) -> Iterator[SampleCapture]:
        """Keep the output samples of the calls analysed inside the block (see
        :class:`SampleCapture`): ``with be.capture_samples() as cap: y = model(x)``, then
        ``cap.output`` is ``y``'s samples ``[N, *y.shape]``. Nothing is kept outside a block."""
        cap = SampleCapture()
        self._captures.append(cap)
        try:
            yield cap
        finally:
            self._captures.remove(cap)

    @contextlib.contextmanager
    def paused(self) -> Iterator["FxstabBackend"]:
        """Run without analysis inside the block (only the deterministic path)."""
        old = self.enabled
        self.enabled = False
        try:
            yield self
        finally:
            self.enabled = old

    def coverage(self) -> Coverage:
        """How every operator of the captured graphs ran in its latest analysed call:
        analysed (rounded and recorded; how: vmap, per sample, ...), run unrounded, or
        skipped, each with its reason (:mod:`fxstab.records.coverage`)."""
        entries: list = []
        for g in self.graphs:  # both levels fill GraphInfo.coverage
            entries += g.coverage_entries()
        return Coverage(entries)

    def sampled_graphs(self) -> list:
        """The generated stochastic paths (:class:`fxstab.analysis.sampled_graph.SampledGraph`), the
        latest signature of each captured graph first: ``print(be.sampled_graphs()[0].code)``
        shows the rewritten graph (both granularities)."""
        out: list = []
        for g in self.graphs:
            out += g.sampled_graphs()
        return out

    def metadata(self) -> dict:
        c = self.config
        return {
            "format": "auto" if c.auto_format else c.format.name, "n_samples": c.n_samples,
            "seed": c.seed,
            "granularity": c.granularity, "confidence": c.confidence,
            "rounding": c.rounding.value, "output": c.output, "every": c.every,
            "modules": sorted(self.modules), "coverage": self.coverage().as_dict(),
        }

    def digit_map(self, target: str = "", gather: bool = False):
        """The reports aggregated per operator (a :class:`fxstab.digitmap.DigitMap`).

        ``gather=True`` (every rank of an initialised ``torch.distributed`` process group must
        call it): one map of every rank's reports, merged as calls are merged, the same on
        every rank; ``metadata["world_size"]``, and ``metadata["provenance"]``: per operator,
        the ranks that reported it and their calls (``{"fc1/linear#0": {"0": 2, "1": 2}}``).
        """
        from .digitmap import DigitMap

        meta = self.metadata()
        if target:
            meta["target"] = target
        if not gather:
            return DigitMap.from_reports(self.reports, metadata=meta)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("digit_map(gather=True) needs an initialised torch.distributed "
                             "process group (torch.distributed.init_process_group); without "
                             "one, call digit_map()")
        world = dist.get_world_size()
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, list(self.reports))
        provenance: dict = {}
        calls = 0
        for rank, reports in enumerate(per_rank):
            calls += len({(r.phase, r.step, r.call) for r in reports})
            for r in reports:
                where = provenance.setdefault(r.name, {})
                where[str(rank)] = where.get(str(rank), 0) + 1
        meta.update(world_size=world, provenance=provenance, analysed_calls=calls)
        return DigitMap.from_reports([r for reports in per_rank for r in reports], metadata=meta)

    def table(self, top: Optional[int] = None) -> str:
        return self.digit_map().table(top) if top is not None else self.digit_map().table()


def backend(
    granularity: str = "op",
    format: Any = "bf16",
    n_samples: int = 3,
    seed: int = 0,
    rounding: str = "random",
    output: str = "deterministic",
    select: Any = None,
    every: int = 1,
    confidence: float = 0.95,
    kernels: str = "auto",
    **options: Any,
) -> FxstabBackend:
    """An fxstab ``torch.compile`` backend.

    Args:
        granularity: ``"op"`` (torch-level operators) or ``"aten"`` (aten primitives).
        format: Simulated format (``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``, ``(e, m)``...).
        n_samples: N synchronous samples (>= 2; 3 as in CADNA).
        seed: Seed of all random streams; the same seed gives the same digit map.
        rounding: ``random`` (CESTAC), ``stochastic``, ``nearest``, ``up``, ``down``, ``zero``.
        output: ``"deterministic"`` returns exactly what eager returns; ``"mean"`` returns the
            sample mean with straight-through gradients.
        select: Which operators to instrument: ``None`` (the default families of DESIGN.md §3),
            a family/kind name or a glob over ``module.path/kind``, a list of those, or a
            predicate ``(node, qualified_name) -> bool``.
        every: Analyse one call in ``every``; the others only run the deterministic path.
        confidence: Confidence of the CESTAC estimator (Student t).
        kernels: Implementation of rounding, statistics and the surrogate: ``auto`` (Triton on
            CUDA tensors, the fused CPU kernels of :mod:`fxstab.cpu.bindings` on CPU tensors, the
            plain-torch references where neither applies), ``triton``, ``cpu`` or ``torch``.
        **options: ``diagnostics``, ``cancel_digits``, ``zero_threshold``,
            ``data_perturbation_threshold``, ``saturate``, ``trace_rnn`` (see AnalysisConfig).
    """
    unknown = set(options) - set(AnalysisConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown fxstab option(s) {sorted(unknown)}; known: "
                         f"{sorted(AnalysisConfig.__dataclass_fields__)}")
    cfg = AnalysisConfig(granularity=granularity, format=format, n_samples=n_samples, seed=seed,
                         rounding=rounding, output=output, select=select, every=every,
                         confidence=confidence, kernels=kernels, **options)
    if cfg.kernels == "triton":
        _check_triton_usable()
    if cfg.kernels == "cpu" and not native.available():
        raise ValueError("kernels='cpu' needs the fused CPU kernels, which could not be built "
                         "here (a C compiler with OpenMP); use kernels='auto' or 'torch'")
    if cfg.trace_rnn:
        # Dynamo graph-breaks on nn.LSTM/GRU/RNN unless told to trace them.
        import torch._dynamo

        torch._dynamo.config.allow_rnn = True
    return FxstabBackend(cfg)


def _check_triton_usable() -> None:
    """kernels="triton" needs Triton, and a GPU or the interpreter: say so before compiling."""
    import os

    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ValueError("kernels='triton' needs the triton package (pip install 'fxstab[kernels]'); "
                         "use kernels='torch' or 'auto'") from exc
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError("kernels='triton' without a CUDA device runs the kernels under the Triton "
                         "interpreter only: set TRITON_INTERPRET=1 before importing fxstab, or use "
                         "kernels='torch' / 'auto'")


_DEFAULTS: dict = {}


def default_backend(gm: torch.fx.GraphModule, example_inputs: list,
                    options: Optional[dict] = None) -> Callable:
    """``torch.compile(model, backend="fxstab", options={...})``: a shared backend per set of
    options (the keyword arguments of :func:`backend`; none: the defaults).

    Its reports are at ``fxstab.get_default_backend(**options).reports``.
    """
    return get_default_backend(**(options or {}))(gm, example_inputs)


def get_default_backend(**options: Any) -> FxstabBackend:
    """The shared backend of ``torch.compile(..., backend="fxstab", options=options)``."""
    key = repr(sorted(options.items()))
    if key not in _DEFAULTS:
        _DEFAULTS[key] = backend(**options)
    return _DEFAULTS[key]
