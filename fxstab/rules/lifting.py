"""How a torch-level operator runs on N stacked samples: the value that carries them
(:class:`Stacked`), the compile-time plan of one node (:class:`NodePlan`) and of one graph
(:class:`OpGraph`: what the analysis hands the operator level's tracer), SDPA folded over the
samples, and the RNG state the deterministic pass saw (so every sample draws what it drew).

Shared by the operator-level tracer and its rules (:mod:`fxstab.rules.op`) and the analyses
that plan and run it (:mod:`fxstab.analysis`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..capture import user_ops as user_operator
from ..capture.opsets import qualified_op_name
from ..records.run import RunState

__all__ = ["Stacked", "NodePlan", "OpGraph", "ACCUMULATED_KINDS", "LOW_READERS", "WEIGHT_VIEWS",
           "as_linear", "DECISIONS", "decided_on_mean",
           "reshape", "attention_folded", "embedding_grad_folded",
           "has_floating", "rng_states", "set_rng_states", "broadcasts_directly", "has_vmap_rule",
           "is_float_cast"]

# GEMMs whose accumulator the samples can model (accumulate=): products of two operands with
# at least two logical dims each (linear: its 2-D weight); 1-D and 2-D convolutions through
# their GEMM form, attention as its two products (rules/accumulation.py)
ACCUMULATED_KINDS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm",
                               "conv1d", "conv2d",
                               "scaled_dot_product_attention"})

# the operators that may read a weight kept in its own low-precision dtype as it is
# (NodePlan.lowp): kind -> (the weight's position and keyword, the data operand's position, None
# for a lookup). The GEMMs read it as a linear's weight (as_linear): F.linear(x, w, b),
# addmm(b, x, W) and x @ W (a GPT-2 Conv1D's, W = w^T)
LOW_READERS = {"linear": ((1, "weight"), 0), "addmm": ((2, "mat2"), 1),
               "matmul": ((1, "other"), 0), "mm": ((1, "mat2"), 0),
               "embedding": ((1, "weight"), None)}

# layout operators whose output, from a weight alone, is that weight (a transposed, reshaped or
# detached view of it): a weight to the GEMM surrogate (not perturbed), and in its own dtype
# where the weight is (the backward graph's ``mm(grad, t(W^T))``: rules/op/tracer.py)
WEIGHT_VIEWS = frozenset({"t", "transpose", "permute", "view", "reshape", "_unsafe_view",
                          "contiguous", "detach", "alias", "unsqueeze", "squeeze", "flatten",
                          "expand"})


def _arg(args: list, kwargs: dict, i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def _linear_of_linear(args: list, kwargs: dict) -> tuple:
    """F.linear(x, w, b): as it is."""
    return _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"), \
        _arg(args, kwargs, 2, "bias")


def _linear_of_addmm(args: list, kwargs: dict) -> Optional[tuple]:
    """addmm(b, x, W) = F.linear(x, W^T, b), unless it scales (beta, alpha)."""
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1 or len(args) > 3:
        return None
    w = _arg(args, kwargs, 2, "mat2")
    return (_arg(args, kwargs, 1, "mat1"), w.t(), _arg(args, kwargs, 0, "input")) \
        if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def _linear_of_matmul(args: list, kwargs: dict) -> Optional[tuple]:
    """x @ W = F.linear(x, W^T) of a 2-D W."""
    w = _arg(args, kwargs, 1, "other")
    return (_arg(args, kwargs, 0, "input"), w.t(), None) \
        if isinstance(w, torch.Tensor) and w.dim() == 2 else None


# the GEMMs of LOW_READERS read as F.linear reads its operands: kind -> (args, kwargs) ->
# (x, w, b) or None (an embedding, a lookup, has none)
_AS_LINEAR: dict[str, Callable[[list, dict], Optional[tuple]]] = {
    "linear": _linear_of_linear, "addmm": _linear_of_addmm, "matmul": _linear_of_matmul,
    "mm": _linear_of_matmul}


def as_linear(kind: str, args: list, kwargs: dict) -> Optional[tuple]:
    """``(x, w, b)`` with ``w`` as F.linear reads it (``[out, in]``; ``b`` or None) of a GEMM
    of :data:`LOW_READERS`, or None where the call is not that product (an addmm that scales,
    a matmul of a weight that is not 2-D)."""
    form = _AS_LINEAR.get(kind)
    return None if form is None else form(args, kwargs)


# Decisions (docs/design.md §3): operators whose integer outputs choose positions of the data
# (a mixture of experts' top-k routing, sort/argsort before a dispatch by index, argmax) decide
# once for every sample, on the samples' mean, as CADNA's synchronous arithmetic takes every
# branch on the mean; their floating outputs are each sample's values at the decided positions.
# kind -> (position of the dim argument, its default, whether the outputs are (values, indices));
# the same at both levels (aten's overloads take the same arguments)
DECISIONS = {"topk": (2, -1, True), "sort": (1, -1, True), "argsort": (1, -1, False),
             "kthvalue": (2, -1, True), "argmax": (1, None, False), "argmin": (1, None, False)}


def decided_on_mean(fn: Callable, kind: str, x: "Stacked", rest: tuple, kwargs: dict) -> Any:
    """``fn(x, *rest, **kwargs)`` decided on the samples' mean: its indices (one plain tensor
    for every sample) and, where it returns values, each sample's values at them
    (:class:`Stacked`), in ``fn``'s own return type; None where the call is not one to decide
    (a dim that is no int)."""
    pos, default, has_values = DECISIONS[kind]
    a = (None, *rest)
    dim = a[pos] if len(a) > pos else kwargs.get("dim", default)
    if not (dim is None or isinstance(dim, int) and not isinstance(dim, bool)):
        return None
    res = fn(x.samples.mean(0), *rest, **kwargs)
    if not has_values:
        return res
    values, indices = res[0], res[1]
    d = dim % x.ndim if x.ndim else 0
    idx = indices if indices.dim() == x.ndim else indices.unsqueeze(d)  # keepdim=False
    s = x.samples
    taken = torch.gather(s, d + 1, idx.unsqueeze(0).expand(s.shape[0], *idx.shape))
    if indices.dim() != x.ndim:
        taken = taken.squeeze(d + 1)
    pair = (Stacked(taken), indices)
    return pair if type(res) is tuple else type(res)(pair)


def reshape(x: torch.Tensor, *shape: Any) -> torch.Tensor:
    return x.reshape(*shape)


def attention_folded(fn: Callable, a: list, kw: dict) -> torch.Tensor:
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


def embedding_grad_folded(fn: Callable, a: list, kw: dict) -> torch.Tensor:
    """``embedding_dense_backward`` (``fn``) of stacked gradients ``[N, *indices.shape, D]``
    with the samples folded into the rows: sample s's row i is row ``s * V + i`` of one
    ``[N * V, D]`` sum, so the result comes sample-major ``[N, V, D]``, as the rounding reads
    it. vmap's rule lays the samples inside the rows (``[V][N][D]``), which the rounding then
    copied whole: a vocabulary-wide copy at every training step (0.45 s against 0.21 s for
    a 32000 x 2048 table, N = 3). The rows are summed in the order of the indices, as the
    kernel sums them; ``scale_grad_by_freq`` calls ``fn`` per sample under vmap."""
    names = ("grad_output", "indices", "num_weights", "padding_idx", "scale_grad_by_freq")
    args = dict(zip(names, a))
    args.update(kw)
    grad, indices = args["grad_output"], args["indices"]
    num, pad = int(args["num_weights"]), int(args["padding_idx"])
    if args["scale_grad_by_freq"] or grad.dim() != indices.dim() + 2:
        return torch.vmap(lambda g: fn(g, *a[1:], **kw))(grad)
    n, d = grad.shape[0], grad.shape[-1]
    flat = indices.reshape(-1)
    rows = grad.reshape(n, -1, d)
    if pad >= 0:  # (a padding row gets no gradient)
        keep = flat != pad
        flat, rows = flat[keep], rows[:, keep]
    where = (flat[None, :] + num * torch.arange(n, device=flat.device)[:, None]).reshape(-1)
    out = grad.new_zeros(n * num, d)
    out.index_add_(0, where, rows.reshape(-1, d))
    return out.view(n, num, d)


class Stacked:
    """N samples ``[N, ...]`` of one value, stacked on dim 0: the value every rule of both
    levels runs on (a pytree leaf).

    The samples may be an ``expand``ed view of one plain value (identical samples, never
    copied); the rules never write into samples in place. The arithmetic level also caches
    what it measured of them (:meth:`analysis`: per-element digits and the masks the counters
    read, made once, so each primitive's output is measured once and serves as operand of its
    consumers), and the slot of a traced step's output in the sampled graph.
    """

    __slots__ = ("samples", "_an", "slot")

    def __init__(self, samples: torch.Tensor, analysis: Any = None) -> None:
        self.samples = samples
        self._an = analysis
        self.slot = -1  # a step output of a sampled graph being traced: its slot there

    @property
    def shape(self) -> torch.Size:
        """Logical shape (without the sample dimension)."""
        return self.samples.shape[1:]

    @property
    def ndim(self) -> int:
        return self.samples.dim() - 1

    def analysis(self, ctx: Any) -> Any:
        """What the arithmetic level measured of these samples (``ctx.measure``: a
        :class:`fxstab.rules.aten.measure.Analysis`), made on first use."""
        if self._an is None:
            self._an = ctx.measure(self.samples)
        return self._an

    @property
    def measured(self) -> Any:
        """The analysis if already made (None: nothing measured yet)."""
        return self._an

    @measured.setter
    def measured(self, an: Any) -> None:
        self._an = an

    def __repr__(self) -> str:
        return (f"Stacked(shape={tuple(self.shape)}, n={self.samples.shape[0]}, "
                f"dtype={self.samples.dtype})")


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
    # the GEMM modelled on the samples (config accumulate=, gemm_inputs=): its accumulator (an
    # Accumulation, or None: the trusted sum) and its operands' format (or None)
    accumulate: Any = None
    gemm_inputs: Any = None
    # its operands' scaling where the program names its own (a torchao float8 recipe); None:
    # the config's gemm_scaling
    gemm_scaling: Optional[str] = None
    rounds: bool = True  # False: its output is measured, not rounded (unrounded=, an ablation)
    # a node that may read a weight kept in its own low-precision dtype as it is: a linear
    # whose samples' GEMMs run in the format's kernels (fxstab.numerics.lowp_gemm), an
    # embedding (a lookup); GraphAnalysis decides, the tracer keeps such weights
    lowp: bool = False
    # a layout operator (:data:`WEIGHT_VIEWS`): from one weight alone, its output is that weight
    layout: bool = False


@dataclass
class OpGraph:
    """What an operator-level analysis (:class:`fxstab.analysis.op_level.GraphAnalysis`) hands
    its tracer (:class:`fxstab.rules.op.tracer.SampleTracer`): the graph the samples run and
    the decisions made once for it. The tracer hands back values (the outputs' samples, its
    coverage notes, its reports through ``state``); it reads nothing else of the analysis."""

    gm: torch.fx.GraphModule  # the captured module (its submodules and attributes)
    graph: torch.fx.Graph  # the graph the samples run (fused operators expanded)
    index: int  # the graph's index in its backend (seeds, coverage)
    plan_of: dict  # node -> its NodePlan
    free_after: dict  # node -> the values whose last use it is
    mutated: set  # the placeholders the graph writes into
    state: RunState  # the backend's: config, reports, kernels
    # operator -> why vmap does not lift it / why its samples run in the model's dtype: what
    # the default rule learned, kept across calls (GraphInfo shows them)
    unlifted: dict = field(default_factory=dict)
    in_model_dtype: dict = field(default_factory=dict)
    # the weights (placeholder -> the format name of its readers' GEMMs, None: lookups only)
    # that may enter in their own low-precision dtype, not the working one: every reader reads
    # it so (NodePlan.lowp)
    low_weights: dict = field(default_factory=dict)
    # placeholders that hold a weight though dynamo does not name them so (a backward graph's
    # saved views of the forward's parameters: analysis/backward.py)
    weight_inputs: frozenset = frozenset()


def has_floating(out: Any) -> bool:
    """Whether an output holds a floating or complex tensor (stacked or plain)."""
    for v in pytree.tree_leaves(out, is_leaf=lambda x: isinstance(x, Stacked)):
        t = v.samples if isinstance(v, Stacked) else v
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            return True
    return False


def rng_states(args: tuple) -> dict:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def broadcasts_directly(leaves: list) -> bool:
    """Whether an elementwise operator can run on the stacked samples as they are: every stacked
    operand has the same number of dims (sample dim included) and no plain tensor has as many
    (right-aligned broadcasting then matches logical dims only), nothing asks for an in-place
    update (a ``True`` flag: ``inplace``) or an ``out`` tensor."""
    nd = -1
    for v in leaves:
        if isinstance(v, Stacked):
            if nd not in (-1, v.samples.dim()):
                return False
            nd = v.samples.dim()
    for v in leaves:
        if v is True or (isinstance(v, torch.Tensor) and v.dim() >= nd):
            return False
    return nd > 0


def has_vmap_rule(target: Any) -> bool:
    """Whether a custom operator batches under vmap (a FuncTorchBatched kernel, or a composite
    that decomposes into operators that do); an @fxstab.operator is lifted as its function."""
    if user_operator.implementation(target) is not None:
        return True
    name = qualified_op_name(target)
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return has(name, "FuncTorchBatched") or has(name, "CompositeImplicitAutograd")


def is_float_cast(node: torch.fx.Node, leaves: list) -> bool:
    """Whether a cast method keeps a floating tensor floating (so it is a no-op here)."""
    target = node.args[1] if len(node.args) > 1 else node.kwargs.get("dtype")
    name = node.target
    if name in ("float", "half", "bfloat16", "double"):
        return True
    if name == "type_as":
        other = leaves[1] if len(leaves) > 1 else None
        t = other.samples if isinstance(other, Stacked) else other
        return isinstance(t, torch.Tensor) and t.is_floating_point()
    if isinstance(target, torch.dtype):
        return target.is_floating_point
    if isinstance(target, torch.fx.Node):
        return False
    dt = node.kwargs.get("dtype")
    return dt is None or (isinstance(dt, torch.dtype) and dt.is_floating_point)
