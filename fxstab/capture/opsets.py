"""Operator kinds and families at operator granularity (docs/design.md §3).

A node of a dynamo graph gets a *kind*: a short stable name of the torch-level operator
(``linear``, ``softmax``, ``layer_norm``, ``add``...), derived from ``node.target`` (never from the
node's name). Kinds group into *families* used for selection and for deciding which operators are
GEMM-like (trusted, with the data-perturbation surrogate of docs/design.md §4).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F

FAMILIES: dict[str, frozenset[str]] = {
    "linear": frozenset({"linear", "bilinear"}),
    "conv": frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                       "conv_transpose3d"}),
    # grouped GEMMs of mixture-of-experts layers: torch._grouped_mm, F.grouped_mm and
    # transformers' fallback custom op (one product per expert over its rows)
    "matmul": frozenset({"matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum",
                         "grouped_mm", "scaled_grouped_mm", "grouped_mm_fallback"}),
    "attention": frozenset({"scaled_dot_product_attention"}),
    # F.multi_head_attention_forward is one torch-level call (in-projection, attention,
    # out-projection): one trusted operator like SDPA (GEMM_KINDS); the fused encoder-layer
    # fast path runs on the samples as its composite (COMPOSITE_KINDS), with it inside. A
    # family of its own: the monitor's "attention" family means SDPA's signature.
    "multihead_attention": frozenset({"multi_head_attention_forward"}),
    "softmax": frozenset({"softmax", "log_softmax"}),
    "norm": frozenset({"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm"}),
    "activation": frozenset({
        "relu", "relu6", "gelu", "silu", "tanh", "sigmoid", "elu", "selu", "celu", "leaky_relu",
        "softplus", "mish", "hardswish", "hardsigmoid", "hardtanh", "logsigmoid", "log_sigmoid",
        "softsign",
        "glu", "prelu", "tanhshrink",
    }),
    "embedding": frozenset({"embedding", "embedding_bag"}),
    "reduction": frozenset({"sum", "mean", "var", "std", "norm", "logsumexp", "cumsum", "prod",
                            "var_mean", "std_mean", "cumprod"}),
    "loss": frozenset({"cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
                       "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
                       "kl_div", "cosine_embedding_loss"}),
    "pooling": frozenset({"max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d",
                          "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                          "adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
                          "adaptive_max_pool3d", "lp_pool1d", "lp_pool2d"}),
    "rnn": frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell",
                      "rnn_tanh_cell", "rnn_relu_cell"}),
    "elementwise": frozenset({"exp", "log", "sqrt", "rsqrt", "pow", "div", "mul", "reciprocal",
                              "log1p", "expm1", "log2", "log10", "exp2"}),
    # Additions and subtractions are where cancellation happens, and residual connections merge
    # branches there: without them, localization would blame the next operator.
    "addsub": frozenset({"add", "sub"}),
    # dropout's 1/(1-p) scaling rounds (in training; identity in eval is not instrumented)
    "dropout": frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                          "feature_alpha_dropout"}),
}

DEFAULT_FAMILIES = frozenset(FAMILIES)
GEMM_KINDS = (FAMILIES["linear"] | FAMILIES["conv"] | FAMILIES["matmul"] | FAMILIES["attention"]
              | FAMILIES["multihead_attention"])
KIND_TO_FAMILY = {k: fam for fam, kinds in FAMILIES.items() for k in kinds}
DEFAULT_KINDS = frozenset(KIND_TO_FAMILY)

# Operators whose results depend on the global RNG: the stochastic path replays them once with
# the deterministic pass's RNG state so every sample sees the same randomness (docs/design.md §6).
DROPOUT_KINDS = FAMILIES["dropout"]
RANDOM_KINDS = DROPOUT_KINDS | frozenset({
    "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli",
    "multinomial", "normal", "randperm", "uniform_", "normal_", "bernoulli_", "exponential_",
    "random_", "geometric_", "cauchy_", "log_normal_",
})

# Recurrent layers run once per sample (no vmap rule for aten::lstm & co.), each sample with
# the RNG state the deterministic pass had, so inter-layer dropout masks are the same.
RNN_KINDS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})

# Exact operators: data movement (copies or views of input values) and selections, exact in
# any format. Unselected, they are not counted against the coverage (nothing there can lose
# digits).
EXACT_KINDS = frozenset({
    "view", "reshape", "transpose", "permute", "getitem", "unsqueeze", "squeeze", "flatten",
    "unflatten", "expand", "expand_as", "narrow", "select", "t", "contiguous", "clone", "detach",
    "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack", "split", "chunk",
    "unbind", "tensor_split", "split_with_sizes", "flip", "fliplr", "flipud", "roll", "repeat",
    "tile", "repeat_interleave", "index_select", "gather", "take", "take_along_dim", "movedim",
    "moveaxis", "swapaxes", "swapdims", "view_as", "reshape_as", "to", "type", "float", "half",
    "bfloat16", "double", "type_as", "masked_select", "tril", "triu", "diag", "diagonal",
    "diag_embed", "zeros_like", "ones_like", "empty_like", "full_like", "zeros", "ones", "empty",
    "full", "arange", "linspace", "logspace", "eye", "tensor", "as_strided", "real", "imag",
    "view_as_real", "view_as_complex", "conj", "resolve_conj", "resolve_neg", "atleast_1d",
    "atleast_2d", "atleast_3d", "broadcast_to", "broadcast_tensors", "new_zeros", "new_ones",
    "new_empty", "new_full", "new_tensor", "fill_", "zero_", "copy_", "setitem", "unfold",
    "getattr", "slice", "pad",
    # a vmap region dynamo captured: its batch dims in and out (rules/op/structural.py)
    "add_batch_dim", "remove_batch_dim", "vmap_increment_nesting", "vmap_decrement_nesting",
    # selections and sign changes: every output is an input value, a bound or an integer
    "abs", "neg", "positive", "sign", "sgn", "max", "min", "maximum", "minimum", "fmax", "fmin",
    "amax", "amin", "clamp", "clamp_min", "clamp_max", "clip", "where", "masked_fill",
    "masked_scatter", "index_put", "scatter", "sort", "topk", "kthvalue", "median", "nanmedian",
    "cummax", "cummin", "floor", "ceil", "trunc", "round", "threshold", "relu", "relu6",
    "hardtanh",
})

# selections that write a Python scalar argument into their output (clamp's bounds,
# masked_fill's value, where's other side): the real run holds it in the tensor's format
SCALAR_WRITING_KINDS = frozenset({"clamp", "clamp_min", "clamp_max", "clip", "hardtanh",
                                  "threshold", "masked_fill", "where"})


def nothing_to_lose(kind: str) -> str | None:
    """Why an operator of ``kind`` cannot lose digits, if it cannot: ``"exact (data movement
    or selection)"`` (:data:`EXACT_KINDS`), ``"random draws"`` (a random operator that is no
    dropout: its values are the deterministic pass's draws); None otherwise. The coverage does
    not count such an operator against the analysis when it is not analysed."""
    if kind in EXACT_KINDS:
        return "exact (data movement or selection)"
    if kind in RANDOM_KINDS and kind not in DROPOUT_KINDS:
        return "random draws"
    return None


# Fused operators the stochastic path runs as their composite of torch-level operators
# (GraphAnalysis expands them; the deterministic path keeps the fused call).
COMPOSITE_KINDS = frozenset({"transformer_encoder_layer_fwd"})

# torch.library namespaces of PyTorch itself: an OpOverload from any other namespace is a
# custom operator (torch.library.custom_op, a registered Triton kernel, @fxstab.operator).
_TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "quantized", "_quantized", "rngprims",
                               "higher_order", "profiler", "inductor", "mkldnn", "mkl",
                               "_c10d_functional", "c10d", "_dtensor", "onednn", "debugprims",
                               "fxstab"})


def qualified_op_name(target: Any) -> str:
    """``ns::name`` of an OpOverload (``name()``: ``ns::name.overload`` as dispatch takes it) or
    of an overload packet (which dynamo may record: transformers' ``grouped_mm_fallback``)."""
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    return getattr(target, "_qualified_op_name", "") or str(target)


def custom_namespace(target: Any) -> str | None:
    """The namespace of a custom operator (``mylib`` of ``torch.ops.mylib.f.default``), else
    None (PyTorch's own operators, fxstab's kernels, plain Python callables)."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        ns = getattr(target, "namespace", None)
        if ns is None:  # a packet (dynamo may record one: transformers' grouped_mm_fallback)
            ns = qualified_op_name(target).split("::", 1)[0] or None
        if ns and ns not in _TORCH_NAMESPACES:
            return ns
    return None


def is_custom(node: torch.fx.Node) -> bool:
    """Whether a node calls a custom operator (always selected by default: docs/design.md §3)."""
    return node.op == "call_function" and custom_namespace(node.target) is not None


_OPERATOR_NAMES = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.floordiv: "floordiv", operator.matmul: "matmul", operator.pow: "pow",
    operator.neg: "neg", operator.mod: "mod", operator.iadd: "add", operator.isub: "sub",
    operator.imul: "mul", operator.itruediv: "div", operator.getitem: "getitem",
    operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge",
    operator.eq: "eq", operator.ne: "ne", operator.abs: "abs",
}
_ALIASES = {
    "true_divide": "div", "divide": "div", "multiply": "mul", "subtract": "sub",
    "_scaled_dot_product_attention": "scaled_dot_product_attention", "absolute": "abs",
    # the fast path of nn.MultiheadAttention: the same operator as the composite's
    "native_multi_head_attention": "multi_head_attention_forward",
    "dropout_": "dropout", "feature_dropout": "dropout2d", "relu_": "relu",
    "sigmoid_": "sigmoid", "tanh_": "tanh",
}


def target_kind(op: str, target: Any) -> str:
    """Kind name of an FX node's (op, target)."""
    if op == "call_method":
        name = str(target)
    elif op == "call_function":
        if target in _OPERATOR_NAMES:
            return _OPERATOR_NAMES[target]
        name = getattr(target, "__name__", None) or str(target)
        # aten OpOverloads (aten.add.Tensor) and overload packets
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            name = target.__name__.split(".")[0]
    elif op == "call_module":
        name = str(target).rsplit(".", 1)[-1]
    else:
        return op
    if name.startswith("__") and name.endswith("__"):  # Tensor.__matmul__ -> matmul
        name = name[2:-2]
    name = name.lstrip("_")  # _softmax -> softmax; a trailing "_" (in place: add_) stays
    return _ALIASES.get(name, name)


# torch namespaces whose functions get a prefixed kind (torch.fft.rfft: "fft_rfft")
_PREFIXED_NAMESPACES = ("special", "fft", "linalg")
# Operators that only read metadata: run once, on the first sample (capture/graph.py's
# is_metadata: getattr of a tensor attribute such as x.T is an operator)
METADATA_KINDS = frozenset({"size", "dim", "numel", "stride", "is_floating_point",
                            "is_contiguous", "getattr", "sym_size", "sym_numel", "sym_stride",
                            "nelement", "element_size", "get_device", "is_complex"})
# kinds no table lists that fxstab's naming gives: an input's .item(), an autograd.Function
_OTHER_KINDS = frozenset({"apply", "item"})


# kinds that compare, test or index: no floating arithmetic of their own (an integer or
# boolean result, or an index), so nothing the default selection need round
_NO_ARITHMETIC_KINDS = frozenset({
    "lt", "le", "gt", "ge", "eq", "ne", "isnan", "isinf", "isfinite", "isneginf", "isposinf",
    "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or",
    "bitwise_not", "bitwise_xor", "argmax", "argmin", "argsort", "nonzero", "any", "all",
    "floordiv", "mod", "remainder", "fmod", "bucketize", "searchsorted", "one_hot", "long",
    "int", "bool", "short", "byte", "char", "signbit", "isclose", "allclose", "equal",
    "count_nonzero", "bincount", "histc", "unique", "unique_consecutive",
})


def does_arithmetic(kind: str) -> bool:
    """Whether an operator of ``kind`` may do floating arithmetic the default selection must
    analyse: any kind but data movement and selections (:data:`EXACT_KINDS`), random draws,
    metadata reads, comparisons and index computations, and the fused calls whose composite is
    analysed instead (a default that listed families left ``F.normalize``, ``torch.erf``,
    ``cos``... unanalysed: issue 54)."""
    return not (kind in EXACT_KINDS or kind in METADATA_KINDS or kind in _OTHER_KINDS or
                kind in COMPOSITE_KINDS or kind in _NO_ARITHMETIC_KINDS or
                (kind in RANDOM_KINDS and kind not in DROPOUT_KINDS))


def known_kind(name: str) -> bool:
    """Whether ``name`` is an operator kind a selection (``select=``) can mean: a kind fxstab
    knows (the tables of this module, fxstab's names for Python operators and aliases), or one
    it has no entry for but a torch function or Tensor method has (``"erfinv"``,
    ``"logcumsumexp"``, ``"grid_sample"``; the functions of ``torch.special``/``fft``/
    ``linalg`` with their prefix, as their kind is named: ``"fft_rfft"``, ``"linalg_solve"``),
    or a registered custom operator's name. Aten primitives are not listed: most share a torch
    function's name."""
    if name in DEFAULT_KINDS | EXACT_KINDS | RANDOM_KINDS | COMPOSITE_KINDS | METADATA_KINDS | \
            _OTHER_KINDS or \
            name in set(_OPERATOR_NAMES.values()) | set(_ALIASES.values()):
        return True
    if any(hasattr(ns, attr) for ns in (torch, F, torch.Tensor) for attr in (name, "_" + name)):
        return True
    for prefix in _PREFIXED_NAMESPACES:
        if name.startswith(prefix + "_") and hasattr(getattr(torch, prefix),
                                                     name[len(prefix) + 1:]):
            return True
    return name in _custom_op_kinds()


def _custom_op_kinds() -> set:
    """The kinds of the registered operators outside PyTorch's namespaces (``mylib::fused_gelu``:
    ``"fused_gelu"``), as :func:`target_kind` names them."""
    try:
        names = torch._C._dispatch_get_all_op_names()
    except Exception:  # pragma: no cover - a private API; without it, custom names are unknown
        return set()
    return {op.split("::", 1)[1].split(".")[0].lstrip("_") for op in names
            if "::" in op and op.split("::", 1)[0] not in _TORCH_NAMESPACES}


def node_kind(node: torch.fx.Node) -> str:
    return target_kind(node.op, node.target)


def is_gemm(kind: str) -> bool:
    return kind in GEMM_KINDS


def family_of(kind: str) -> str | None:
    return KIND_TO_FAMILY.get(kind)


__all__ = ["does_arithmetic", "SCALAR_WRITING_KINDS", "FAMILIES", "METADATA_KINDS", "DEFAULT_FAMILIES", "GEMM_KINDS", "DEFAULT_KINDS", "RANDOM_KINDS",
           "DROPOUT_KINDS", "RNN_KINDS", "EXACT_KINDS", "COMPOSITE_KINDS", "target_kind",
           "node_kind", "is_gemm", "family_of", "custom_namespace", "is_custom", "nothing_to_lose", "qualified_op_name", "known_kind",
           "F"]
