"""What each aten primitive is: :func:`primitive_kind`, the rows of the primitives that carry no
code of their own in the table :data:`fxstab.rules.aten.primitives.PRIMITIVES` (GEMMs, exact
and layout primitives, comparisons, decisions, random draws, symbolic sizes; the families with
counters are registered beside them, in :mod:`.counters`), and :func:`op_info`, the
per-overload decisions the rules take once from the row and the schema: pointwise or not,
prims replacements, in-place, one IEEE operation. :func:`operand_needs` says what a primitive's
counters read of an operand, so a graph driver can measure it in the operand's rounding pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.utils import _pytree as pytree

from ..lifting import DECISIONS, Stacked
from .primitives import (
    BINARY, COMPARE, DECIDE, EXACT, GEMM, LAYOUT, RANDOM, SYMBOLIC, PrimitiveRule, kinds_on,
    primitive, rule_of,
)

aten = torch.ops.aten

__all__ = ["primitive_kind", "GEMM_PRIMITIVES", "Relation", "OpInfo", "op_info", "prims_var",
           "broadcast_in_dim", "operand_needs"]


# --------------------------------------------------------------------------- the rows
def primitive_kind(op: Any) -> str:
    """Short name of an aten overload: ``aten.add.Tensor`` -> ``add``."""
    packet = getattr(op, "overloadpacket", None)
    name = packet.__name__ if packet is not None else getattr(op, "__name__", str(op))
    return name.split(".")[0]


primitive("mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "convolution",
          "_convolution", "conv1d", "conv2d", "conv3d", "_scaled_dot_product_flash_attention",
          "_scaled_dot_product_flash_attention_for_cpu",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
          "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
          path=GEMM, family="gemm")
# (what digitmap.hints reads; the table is the home)
GEMM_PRIMITIVES = kinds_on(GEMM)

# Exact primitives whose per-element digits are the same rearrangement of their operand's
# digits: the digits of a view (or of -x) need no new measurement; the identities keep every
# element in its place.
primitive("clone", "alias", "detach", "lift_fresh_copy", "contiguous", "neg", path=LAYOUT,
          identity=True, family="copy")
primitive("view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze",
          "squeeze", "select", "slice", "narrow", "flatten", "unflatten", "diagonal", "movedim",
          "squeeze_copy", "unsqueeze_copy", "view_copy", "permute_copy", "t_copy",
          "transpose_copy", "expand_copy", "detach_copy", "broadcast_in_dim", "collapse_view",
          "split_dim", path=LAYOUT, family="view")
# Exact primitives: the result is (a selection of) input values, so rounding is the identity
# (the ones with counters of their own, abs, max/min, clamp, relu, where, floor..., casts, are
# registered with them in .counters)
primitive("_reshape_alias", "view_as", "expand_as", "as_strided", "cat", "stack", "split",
          "split_with_sizes", "chunk", "unbind", "index", "index_select", "gather", "repeat",
          "repeat_interleave", "roll", "flip", "pixel_shuffle", "constant_pad_nd", "embedding",
          "slice_scatter", "select_scatter", "copy", "convert_element_type", "max", "min",
          "amax", "amin", "max_pool2d_with_indices", "max_pool1d", "max_pool2d", "zeros_like",
          "ones_like", "empty_like", "new_zeros", "new_ones", "new_empty",
          path=EXACT, family="data movement")
# exact, but writing a value of their own: filled with an infinity (an attention mask's -inf),
# they are recorded (observed, not rounded), so the graph sees where the infinities come from
# and their consumers (the softmax's x - max) are not taken for where NaN/inf appear
primitive("masked_fill", "fill", "full_like", "new_full", "index_put", "scatter", path=EXACT,
          writes=True, family="fill")
# complex values: views of their parts, and the parts put together
primitive("view_as_real", "view_as_complex", "real", "imag", "conj", "_conj", "conj_physical",
          "_conj_physical", "resolve_conj", "resolve_neg", "_neg_view", "complex", path=EXACT,
          family="complex parts")


class Relation(NamedTuple):
    """A comparison's relation: ``cestac(equal, mean_diff)`` (CESTAC's, on the samples'
    difference: ``equal`` where it is an exact or computational zero) and ``exact(d)`` (on
    the difference of identical samples)."""

    name: str
    cestac: Callable
    exact: Callable


_RELATIONS = {
    "eq": Relation("eq", lambda equal, m: equal, lambda d: d == 0),
    "ne": Relation("ne", lambda equal, m: ~equal, lambda d: d != 0),
    "lt": Relation("lt", lambda equal, m: (m < 0) & ~equal, lambda d: d < 0),
    "le": Relation("le", lambda equal, m: (m < 0) | equal, lambda d: d <= 0),
    "gt": Relation("gt", lambda equal, m: (m > 0) & ~equal, lambda d: d > 0),
    "ge": Relation("ge", lambda equal, m: (m > 0) | equal, lambda d: d >= 0),
}
for _name, _aliases in (("eq", ()), ("ne", ("not_equal",)), ("lt", ("less",)),
                        ("le", ("less_equal",)), ("gt", ("greater",)),
                        ("ge", ("greater_equal",))):
    primitive(_name, *_aliases, path=COMPARE, relation=_RELATIONS[_name], family="comparison",
              doc="branching where the compared difference is a computational zero")

# Decisions (rules/lifting.py's DECISIONS, shared with the operator level); sort's and
# topk's values are their operands' (exact) where they are not decided (a dim that is no int)
_DECIDED = "branching where a sample, deciding alone, would choose otherwise"
primitive("sort", "topk", path=DECIDE, exact=True, family="decision", doc=_DECIDED)
primitive(*sorted(set(DECISIONS) - {"sort", "topk"}), path=DECIDE, family="decision",
          doc=_DECIDED)

def _on_first_sample(op: Any, args: tuple, kwargs: dict) -> Any:
    """Once, on the first sample's shape: every sample gets the deterministic pass's random
    numbers."""
    is_s = lambda v: isinstance(v, Stacked)  # noqa: E731
    a, k = pytree.tree_map(lambda v: v.samples[0] if is_s(v) else v, (args, kwargs), is_leaf=is_s)
    return op(*a, **k)


def _mask_on_samples(op: Any, args: tuple, kwargs: dict) -> Any:
    """native_dropout: the deterministic pass's mask (drawn once, on ones) times every
    sample; the mask."""
    x = args[0]
    stacked = isinstance(x, Stacked)
    ones = torch.ones_like(x.samples[0] if stacked else x)
    scaled, mask = op(ones, *args[1:], **kwargs)
    xs = x.samples if stacked else x
    return (Stacked(xs * scaled) if stacked else xs * scaled), mask


# Random draws: run once, on the first sample's shape (every sample gets the deterministic
# pass's random numbers: dropout masks)
primitive("rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "bernoulli",
          "uniform", "normal", "randperm", "multinomial", "exponential", "bernoulli_",
          "uniform_", "normal_", "exponential_", "random_", "geometric_", "cauchy_",
          "log_normal_", path=RANDOM, draw=_on_first_sample, family="random draw")
primitive("native_dropout", path=RANDOM, draw=_mask_on_samples, family="random draw")
# Symbolic sizes of a dynamic-shape lowering: plain values
primitive("sym_size", "sym_stride", "sym_numel", "sym_storage_offset", path=SYMBOLIC,
          family="symbolic size")

# Tensor factories (no arithmetic: their values are constants or uninitialised memory).
_FACTORY_PREFIXES = ("empty", "zeros", "ones", "full", "arange", "scalar_tensor", "new_",
                     "eye", "linspace", "logspace")


# --------------------------------------------------------------------------- per-op decisions
@dataclass(frozen=True)
class OpInfo:
    """What the rules need to know about one primitive, decided once per overload."""

    kind: str
    pointwise: bool  # torch.Tag.pointwise: runs directly on ranks-aligned samples
    exact: bool  # not rounded, not recorded (its row's ``exact``)
    gemm: bool  # trusted, with the data-perturbation surrogate
    factory: bool  # tensor factories: constants stay plain
    layout: bool  # digits follow the op: digits(op(x, ...)) == op(digits(x), ...)
    compare: bool  # CESTAC comparison: a plain boolean decision
    prim: Any = None  # aten replacement of a prims op that neither vmap nor pointwise covers
    # (its row's ``prims_aten``)
    text: str = ""  # str(op), for records
    plain: Any = None  # faster equivalent of a prims op on plain (unstacked) values
    call: Any = None  # what runs it on aligned samples: ``prim`` or ``op``, without the
    # Python frame of OpOverload.__call__
    inplace: bool = False  # writes into its first argument (``add_``, ``copy_``...)
    binary: Optional[str] = None  # one IEEE operation per element (add, sub, mul, div of two
    # operands, nothing else): what fxstab.cpu.bindings.Binary computes inside the rounding
    rule: Optional[PrimitiveRule] = None  # its row of the table (PRIMITIVES)


# prims.div (true division of floats, truncation of integers) runs as aten.div.Tensor
primitive("div", prims_aten=aten.div.Tensor)


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


# the prims ops' faster equivalents on plain (unstacked) values
primitive("var", prims_plain=prims_var)
primitive("sum", prims_plain=_prims_sum)
primitive("broadcast_in_dim", prims_plain=broadcast_in_dim)


# The overloads that are one IEEE add, sub, mul or true division per element (with no alpha
# or rounding mode given: the rule checks that no keyword argument is given)
_BINARY = {f"{ns}.{k}.{o}": k for k in ("add", "sub", "mul", "div")
           for ns, o in (("aten", "Tensor"), ("aten", "Scalar"), ("prims", "default"))}


def _compute_op_info(op: Any) -> OpInfo:
    kind = primitive_kind(op)
    rule = rule_of(kind)
    is_prim = getattr(op, "namespace", None) == "prims"
    prim = rule.prims_aten if is_prim else None
    run = prim if prim is not None else op
    return OpInfo(
        kind=kind, pointwise=torch.Tag.pointwise in getattr(op, "tags", ()),
        exact=rule.exact, gemm=rule.path == GEMM,
        factory=kind.startswith(_FACTORY_PREFIXES), layout=rule.path == LAYOUT,
        compare=rule.path == COMPARE, prim=prim, text=str(op),
        plain=rule.prims_plain if is_prim else None,
        call=getattr(run, "_op", run), inplace=_writes_first(op),
        binary=_BINARY.get(str(op)) if rule.path == BINARY else None, rule=rule)


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


def operand_needs(info: "OpInfo", args: tuple, kwargs: dict, operand: Any) -> tuple[bool, bool]:
    """(digits, zero mask): what the counters of a primitive (``info``, its ``args`` and
    ``kwargs`` as a graph holds them) read of ``operand``: its row's ``needs`` (the digits of
    add/sub operands and of summed values for a cancellation, the zero masks of divisors,
    factors and math arguments). A graph driver writes those in the operand's rounding pass;
    anything else a consumer reads is measured when read."""
    if any(v is operand for v in kwargs.values()):
        return True, True  # an unusual place: assume everything
    return info.rule.needs(args, operand)
