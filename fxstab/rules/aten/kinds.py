"""What the arithmetic-level rules know about each aten primitive, from its name and schema.

The op classes (GEMMs, exact primitives, additions, divisions, math functions, comparisons...),
and :func:`op_info`, the per-overload decisions the rules take once: pointwise or not, exact,
trusted GEMM, factory, layout (digits follow the op), CESTAC comparison, prims replacements,
in-place. :func:`operand_needs` says what a primitive's counters read of an operand, so a graph
driver can measure it in the operand's rounding pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

aten = torch.ops.aten

__all__ = [
    "primitive_kind", "GEMM_PRIMITIVES", "EXACT_PRIMITIVES", "COMPLEX_ARITHMETIC", "ADD_KINDS",
    "DIV_KINDS", "POW_KINDS", "MATH_KINDS", "ROUNDING_INTRINSICS", "COMPARISONS",
    "SELECT2_KINDS", "REDUCE_SUM_KINDS", "RANDOM_PRIMITIVES", "SYMBOLIC_PRIMITIVES", "OpInfo",
    "op_info", "prims_var", "broadcast_in_dim",
    "OUTPUT_DIGITS_KINDS", "operand_needs",
]


# --------------------------------------------------------------------------- op classes
def primitive_kind(op: Any) -> str:
    """Short name of an aten overload: ``aten.add.Tensor`` -> ``add``."""
    packet = getattr(op, "overloadpacket", None)
    name = packet.__name__ if packet is not None else getattr(op, "__name__", str(op))
    return name.split(".")[0]


GEMM_PRIMITIVES = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "convolution",
    "_convolution", "conv1d", "conv2d", "conv3d", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "scaled_dot_product_attention",
    "_scaled_dot_product_attention_math",
})
# Exact primitives: the result is (a selection of) input values, so rounding is the identity.
EXACT_PRIMITIVES = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze",
    "squeeze", "select", "slice", "clone", "contiguous", "alias", "detach", "lift_fresh_copy",
    "cat", "stack", "split", "split_with_sizes", "chunk", "unbind", "index", "index_select",
    "gather", "narrow", "flatten", "unflatten", "repeat", "roll", "flip", "diagonal", "as_strided",
    "_to_copy", "to", "copy", "convert_element_type", "neg", "abs", "maximum", "minimum", "max", "min", "amax", "amin",
    "clamp", "clamp_min", "clamp_max", "relu", "threshold", "hardtanh", "where", "masked_fill",
    "constant_pad_nd", "sort", "topk", "embedding", "scatter", "slice_scatter", "select_scatter",
    "index_put", "fill", "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros",
    "new_ones", "new_full", "new_empty", "floor", "ceil", "trunc", "round", "sign", "sgn",
    "_reshape_alias", "view_as", "expand_as", "movedim", "squeeze_copy", "unsqueeze_copy",
    "view_copy", "permute_copy", "t_copy", "transpose_copy", "expand_copy", "detach_copy",
    "pixel_shuffle", "broadcast_in_dim", "collapse_view", "split_dim", "squeeze_copy", "max_pool2d_with_indices", "max_pool1d", "max_pool2d", "repeat_interleave",
    # complex values: views of their parts, and the parts put together
    "view_as_real", "view_as_complex", "real", "imag", "conj", "_conj", "conj_physical",
    "_conj_physical", "resolve_conj", "resolve_neg", "_neg_view", "complex",
})
# Exact on real values, arithmetic on complex ones (|z| = sqrt(re^2 + im^2), z / |z|).
COMPLEX_ARITHMETIC = frozenset({"abs", "sgn"})
ADD_KINDS = frozenset({"add", "sub", "rsub"})
DIV_KINDS = frozenset({"div", "reciprocal", "remainder", "fmod", "floor_divide"})
POW_KINDS = frozenset({"pow", "float_power"})
MATH_KINDS = frozenset({
    "sqrt", "rsqrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan",
    "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc",
    "erfinv", "sigmoid", "lgamma", "digamma", "atan2", "logit", "special_erfcx", "xlogy",
})
ROUNDING_INTRINSICS = frozenset({"floor", "ceil", "trunc", "round", "sign", "sgn", "frac"})
COMPARISONS = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
            "less": "lt", "less_equal": "le", "greater": "gt", "greater_equal": "ge",
            "not_equal": "ne"}
SELECT2_KINDS = frozenset({"maximum", "minimum", "fmax", "fmin"})
# Tensor factories (no arithmetic: their values are constants or uninitialised memory).
_FACTORY_PREFIXES = ("empty", "zeros", "ones", "full", "arange", "scalar_tensor", "new_",
                     "eye", "linspace", "logspace")
REDUCE_SUM_KINDS = frozenset({"sum", "mean", "nansum"})
# Random draws: run once, on the first sample's shape (every sample gets the deterministic
# pass's random numbers: dropout masks)
RANDOM_PRIMITIVES = frozenset({
    "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "bernoulli",
    "uniform", "normal", "randperm", "multinomial", "native_dropout", "exponential",
    "bernoulli_", "uniform_", "normal_", "exponential_", "random_", "geometric_", "cauchy_",
    "log_normal_",
})
# Symbolic sizes of a dynamic-shape lowering: plain values
SYMBOLIC_PRIMITIVES = frozenset({"sym_size", "sym_stride", "sym_numel", "sym_storage_offset"})


# --------------------------------------------------------------------------- per-op decisions
@dataclass(frozen=True)
class OpInfo:
    """What the rules need to know about one primitive, decided once per overload."""

    kind: str
    pointwise: bool  # torch.Tag.pointwise: runs directly on ranks-aligned samples
    exact: bool  # not rounded, not recorded (EXACT_PRIMITIVES)
    gemm: bool  # trusted, with the data-perturbation surrogate
    factory: bool  # tensor factories: constants stay plain
    layout: bool  # digits follow the op: digits(op(x, ...)) == op(digits(x), ...)
    compare: bool  # CESTAC comparison: a plain boolean decision
    prim: Any = None  # aten replacement of a prims op that neither vmap nor pointwise covers
    text: str = ""  # str(op), for records
    plain: Any = None  # faster equivalent of a prims op on plain (unstacked) values
    call: Any = None  # what runs it on aligned samples: ``prim`` or ``op``, without the
    # Python frame of OpOverload.__call__
    inplace: bool = False  # writes into its first argument (``add_``, ``copy_``...)
    binary: Optional[str] = None  # one IEEE operation per element (add, sub, mul, div of two
    # operands, nothing else): what fxstab.cpu.bindings.Binary computes inside the rounding


# Exact primitives whose per-element digits are the same rearrangement of their operand's
# digits: the digits of a view (or of -x) need no new measurement.
_LAYOUT = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze",
    "squeeze", "select", "slice", "clone", "alias", "detach", "lift_fresh_copy", "contiguous",
    "narrow", "flatten", "unflatten", "diagonal", "movedim", "squeeze_copy", "unsqueeze_copy",
    "view_copy", "permute_copy", "t_copy", "transpose_copy", "expand_copy", "detach_copy",
    "broadcast_in_dim", "collapse_view", "split_dim", "neg",
})
_PRIMS_AS_ATEN = {"div": aten.div.Tensor, "sum": None, "var": None}


def prims_var(x: torch.Tensor, dims=None, correction: float = 1.0, *, output_dtype=None):
    """prims.var in two passes (mean, then squared deviations): the same value to a few ulps,
    several times faster on CPU than torch.var's Welford loop."""
    dims = list(range(x.dim())) if dims is None or len(dims) == 0 else list(dims)
    count = math.prod(x.shape[d] for d in dims)
    d = x - x.sum(dims, keepdim=True).div_(count)  # torch.mean's own bits, with less overhead
    return d.mul_(d).sum(dims).div_(count - correction)


def _prims_sum(x: torch.Tensor, dims=None, *, output_dtype=None):
    return torch.sum(x, dims, dtype=output_dtype) if dims else torch.sum(x, dtype=output_dtype)


def broadcast_in_dim(x: torch.Tensor, shape, broadcast_dimensions) -> torch.Tensor:
    """prims.broadcast_in_dim as unsqueeze + expand (a view; the prim's Python wrapper costs
    more than the op)."""
    keep = set(broadcast_dimensions)
    for i in range(len(shape)):
        if i not in keep:
            x = x.unsqueeze(i)
    return x.expand(list(shape))


_PRIMS_PLAIN = {"var": prims_var, "sum": _prims_sum, "broadcast_in_dim": broadcast_in_dim}


# The overloads that are one IEEE add, sub, mul or true division per element (with no alpha
# or rounding mode given: the rule checks that no keyword argument is given)
_BINARY = {f"{ns}.{k}.{o}": k for k in ("add", "sub", "mul", "div")
           for ns, o in (("aten", "Tensor"), ("aten", "Scalar"), ("prims", "default"))}


def _compute_op_info(op: Any) -> OpInfo:
    kind = primitive_kind(op)
    prim = None
    is_prim = getattr(op, "namespace", None) == "prims"
    if is_prim and kind in _PRIMS_AS_ATEN:
        prim = _PRIMS_AS_ATEN[kind] or kind
    run = prim if prim is not None and not isinstance(prim, str) else op
    return OpInfo(
        kind=kind, pointwise=torch.Tag.pointwise in getattr(op, "tags", ()),
        exact=kind in EXACT_PRIMITIVES, gemm=kind in GEMM_PRIMITIVES,
        factory=kind.startswith(_FACTORY_PREFIXES), layout=kind in _LAYOUT,
        compare=kind in COMPARISONS, prim=prim, text=str(op),
        plain=_PRIMS_PLAIN.get(kind) if is_prim else None,
        call=getattr(run, "_op", run), inplace=_writes_first(op), binary=_BINARY.get(str(op)))


def _writes_first(op: Any) -> bool:
    """Whether an overload's schema writes into its first argument (``Tensor(a!) self``)."""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


_OP_INFO: dict = {}


def op_info(op: Any) -> OpInfo:
    """The :class:`OpInfo` of ``op`` (cached per overload)."""
    try:
        return _OP_INFO[op]
    except KeyError:
        info = _OP_INFO[op] = _compute_op_info(op)
        return info
    except TypeError:  # an unhashable callable
        return _compute_op_info(op)


# Kinds whose counters read their own output's per-element digits.
OUTPUT_DIGITS_KINDS = frozenset(ADD_KINDS | REDUCE_SUM_KINDS)
# Kinds whose counters read an operand's computational-zero mask (all operands, or the
# divisor of a division).
_OPERAND_ZEROS_KINDS = frozenset(DIV_KINDS | POW_KINDS | MATH_KINDS | {"mul", "relu"})


def operand_needs(info: "OpInfo", args: tuple, kwargs: dict, operand: Any) -> tuple[bool, bool]:
    """(digits, zero mask): what the counters of a primitive (``info``, its ``args`` and
    ``kwargs`` as a graph holds them) read of ``operand``: the digits of add/sub operands and
    of summed values (cancellation), the zero masks of divisors, factors and math arguments.
    A graph driver writes those in the operand's rounding pass; anything else a consumer reads
    is measured when read."""
    kind = info.kind
    if any(v is operand for v in kwargs.values()):
        return True, True  # an unusual place: assume everything
    if kind in ADD_KINDS or kind in REDUCE_SUM_KINDS:
        return True, False
    if kind in DIV_KINDS:
        divisor = args[0] if kind == "reciprocal" else (args[1] if len(args) > 1 else None)
        return False, divisor is operand
    return False, kind in _OPERAND_ZEROS_KINDS
