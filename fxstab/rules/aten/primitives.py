"""The arithmetic level's primitives as a table: what the rules do with an aten primitive of each
kind (``PRIMITIVES[kind]``), as the operator level's :data:`fxstab.rules.op.registry.OP_RULES`
holds a rule per operator and JAX keys ``primitive_batchers`` by the primitive.

One frozen :class:`PrimitiveRule` per kind says everything the rules decide from the kind:

* its **path** through :func:`fxstab.rules.aten.apply_primitive` (:data:`PATHS`): ``exact``
  (the result is a selection of operand values: not rounded), ``layout`` (exact, and the
  per-element digits follow the op: views), ``gemm`` (trusted, with the data-perturbation
  surrogate), ``compare`` (a CESTAC decision per element), ``decide`` (top-k, sort, argmax:
  once, on the samples' mean), ``binary`` (one IEEE add, sub, mul or div per element: computed
  inside its rounding by the fused kernel where the overload allows), ``arithmetic`` (rounded
  into the format: every kind without a row), ``random`` (a random draw) and ``symbolic``
  (a size of a dynamic-shape lowering: a plain value);
* its **counters** (CADNA's, :mod:`.counters`): ``counters(c) -> [(key, mask)]`` and, for the
  selections that compare their operands (max/min/clamp), ``branch``: the compared difference;
* what its counters **need** of an operand (:func:`fxstab.rules.aten.kinds.operand_needs`: the
  per-element digits, the zero mask), and whether they read the output's own digits;
* its **batcher** (:mod:`.batching`: the primitive on all samples at once, without vmap), a
  random draw's ``draw`` (how it runs on the samples), a prims op's replacements;
* its **fp64** side (:mod:`.rounding`): the sign of (exact result - y) of its result y rounded
  to nearest in the fp64 format, by an error-free transformation (add, mul, div...);
* a one-line **doc** (:func:`describe_primitive`).

A family of kinds is registered once, beside its code, with :func:`primitive` (as a decorator
of its counters, or called with the fields alone); a field given by a second registration of
the same kind (a batcher, registered beside the batchers) joins the row, a field given twice
differently is an error. ``describe_primitive("add")`` says how an ``aten.add`` is analysed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["PrimitiveRule", "PRIMITIVES", "PATHS", "EXACT", "LAYOUT", "GEMM", "COMPARE",
           "DECIDE", "BINARY", "ARITHMETIC", "RANDOM", "SYMBOLIC", "primitive", "rule_of",
           "kinds_on", "describe_primitive", "reads_nothing", "reads_digits", "reads_zeros"]

EXACT = "exact"
LAYOUT = "layout"
GEMM = "gemm"
COMPARE = "compare"
DECIDE = "decide"
BINARY = "binary"
ARITHMETIC = "arithmetic"
RANDOM = "random"
SYMBOLIC = "symbolic"

PATHS = {
    EXACT: "exact: a selection of its operands' values, neither rounded nor recorded",
    LAYOUT: "layout: exact, and its per-element digits are its operand's, moved as the values",
    GEMM: "gemm: trusted; stacked operands too close to expose the rounding get the "
          "data-perturbation surrogate, then the product is rounded",
    COMPARE: "compare: a CESTAC decision per element (a plain boolean tensor, equal where the "
             "difference is a computational zero)",
    DECIDE: "decide: once for every sample, on the samples' mean (its floating outputs each "
            "sample's values at the decided positions)",
    BINARY: "binary: one IEEE operation per element, computed by the fused kernel inside its "
            "rounding where the overload is that operation, else rounded as arithmetic",
    ARITHMETIC: "arithmetic: every floating result rounded into the format and recorded",
    RANDOM: "random: a random draw, run on the samples by its row's draw (the backend's "
            "tracer): every sample gets the deterministic pass's random numbers",
    SYMBOLIC: "symbolic: a size of a dynamic-shape lowering, a plain value",
}


def reads_nothing(args: tuple, operand: Any) -> tuple[bool, bool]:
    """Counters that read no operand's digits or zero mask."""
    return False, False


def reads_digits(args: tuple, operand: Any) -> tuple[bool, bool]:
    """Counters that read every operand's per-element digits (a cancellation)."""
    return True, False


def reads_zeros(args: tuple, operand: Any) -> tuple[bool, bool]:
    """Counters that read every operand's computational-zero mask."""
    return False, True


@dataclass(frozen=True)
class PrimitiveRule:
    """What the arithmetic level's rules do with a primitive of one kind (the module
    docstring lists the fields' meanings)."""

    kind: str
    path: str = ARITHMETIC
    family: str = ""  # the name its family was registered under
    exact: bool = False  # neither rounded nor recorded (the exact and layout paths; sort, topk)
    # exact, but arithmetic for these arguments (|z| of complex z, round with decimals=)
    inexact: Optional[Callable[[tuple, dict], bool]] = None
    identity: bool = False  # layout: every output element is its operand's, in place (clone, -x)
    writes: bool = False  # exact, but writes a value of its own (recorded when non-finite)
    casts: bool = False  # a dtype conversion (into float8: rounded into that format first)
    # counters(c: fxstab.rules.aten.counters.CounterCall) -> [(key, mask or count)]
    counters: Optional[Callable] = None
    # the compared difference of a selection (max/min/clamp): branch(args, kwargs, ctx)
    branch: Optional[Callable] = None
    # (digits, zero mask) the counters read of an operand: needs(args, operand)
    needs: Callable[[tuple, Any], tuple[bool, bool]] = reads_nothing
    output_digits: bool = False  # the counters read the output's per-element digits
    # positions of the operands whose non-finite elements the output carries (IEEE)
    carriers: tuple = ()
    relation: Any = None  # compare: its relation (fxstab.rules.aten.kinds.Relation)
    lookup: bool = False  # arithmetic: bf16 lookup tables of its results exist
    # the fp64 format: the sign of (exact result - y) of its rounded-to-nearest result y,
    # fp64(op, args, kwargs, y), or None where unknown (fxstab.rules.aten.rounding)
    fp64: Optional[Callable] = None
    prims_aten: Any = None  # the aten overload its prims op runs as (prims.div: aten.div.Tensor)
    prims_plain: Optional[Callable] = None  # a faster equivalent of its prims op on plain values
    # random: how the draw runs on the samples, draw(op, args, kwargs) (rules/aten/kinds.py)
    draw: Optional[Callable] = None
    batcher: Optional[Callable] = None  # batcher(op, args, kwargs) (fxstab.rules.aten.batching)
    batcher_kwargs: bool = False  # the batcher takes keyword arguments
    doc: str = ""


PRIMITIVES: dict[str, PrimitiveRule] = {}
"""kind -> its :class:`PrimitiveRule` (a kind without a row: :func:`rule_of`'s default)."""

_FIELDS = {f.name: f.default for f in dataclasses.fields(PrimitiveRule)}
_EXACT_PATHS = (EXACT, LAYOUT)


def _doc_of(fn: Callable) -> str:
    return " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())


def primitive(*kinds: str, **fields: Any) -> Callable:
    """Register ``kinds`` as one family with the :class:`PrimitiveRule` fields ``fields``
    (``path=`` one of :data:`PATHS`; ``exact`` follows the path unless given).

    The rows exist once this is called; used as a decorator it also registers the decorated
    function as the family's ``counters`` (its docstring's first paragraph the ``doc``, its
    name the family's, unless given) and returns it. A kind registered again gets the new
    fields added to its row; a field set twice to different values is a ``ValueError``.
    Register before the primitive first runs: :func:`~fxstab.rules.aten.kinds.op_info` reads
    the row once per overload.
    """
    if not kinds:
        raise ValueError("primitive() needs at least one aten primitive kind (aten.add.Tensor "
                         "-> 'add')")
    unknown = set(fields) - (set(_FIELDS) - {"kind"})
    if unknown:
        raise ValueError(f"unknown PrimitiveRule fields {sorted(unknown)}; the fields are "
                         f"{sorted(set(_FIELDS) - {'kind'})}")
    path = fields.get("path")
    if path is not None and path not in PATHS:
        raise ValueError(f"unknown path {path!r} for {kinds}; use one of {sorted(PATHS)}")
    named = "family" in fields
    if path is not None:
        fields.setdefault("exact", path in _EXACT_PATHS)
    if fields.get("counters") is not None:
        fields.setdefault("doc", _doc_of(fields["counters"]))
        fields.setdefault("family", kinds[0])
    for kind in kinds:
        PRIMITIVES[kind] = _joined(PRIMITIVES.get(kind), kind, fields)

    def decorate(counters: Callable) -> Callable:
        extra = {"counters": counters, "doc": fields.get("doc") or _doc_of(counters),
                 "family": fields["family"] if named else counters.__name__.lstrip("_")}
        for kind in kinds:
            PRIMITIVES[kind] = _joined(PRIMITIVES[kind], kind, extra, renaming=True)
        return counters

    return decorate


def _joined(old: Optional[PrimitiveRule], kind: str, fields: dict,
            renaming: bool = False) -> PrimitiveRule:
    """``old`` (or a new row) with ``fields`` added; a field it already set differently is an
    error (``renaming``: the decorator names the family after its counters)."""
    if old is None:
        return PrimitiveRule(kind=kind, **fields)
    for name, value in fields.items():
        mine = getattr(old, name)
        if mine != _FIELDS[name] and mine != value and not (renaming and name == "family"):
            raise ValueError(f"aten primitive {kind!r}: {name} registered twice "
                             f"({mine!r}, then {value!r}); one family per kind")
    return dataclasses.replace(old, **fields)


_DEFAULTS: dict[str, PrimitiveRule] = {}


def rule_of(kind: str) -> PrimitiveRule:
    """The row of ``kind``; a kind without one is arithmetic with no counters."""
    rule = PRIMITIVES.get(kind)
    if rule is None:
        rule = _DEFAULTS.get(kind)
        if rule is None:
            rule = _DEFAULTS[kind] = PrimitiveRule(kind=kind, family="(no row)")
    return rule


def kinds_on(path: str) -> frozenset:
    """The kinds registered on ``path``."""
    return frozenset(k for k, r in PRIMITIVES.items() if r.path == path)


def describe_primitive(kind: str) -> str:
    """How a primitive of ``kind`` is analysed: its path, its counters, what they read, its
    batcher, one line each."""
    r = rule_of(kind)
    exact = ("exact" if r.path not in _EXACT_PATHS else "") if r.exact else ""
    lines = [f"{kind} ({r.family}): {PATHS[r.path]}" + (f"; {exact}" if exact else "")]
    counters = [r.doc.rstrip(".")] if r.doc else []
    if not r.exact:
        counters.append("anomaly where NaN or inf come from finite operands")
    lines.append("counters: " + ("; ".join(counters) if counters else "none"))
    probe = (object(), object())  # two operands: which of them the counters read
    digits, zeros = (any(r.needs(probe, x)[i] for x in probe) for i in (0, 1))
    read = [w for w, on in (("per-element digits", digits), ("zero masks", zeros)) if on]
    if r.output_digits:
        read.append("its own output's digits")
    if r.draw is not None:
        lines.append(f"draw: {_doc_of(r.draw)}")
    lines.append("reads of its operands: " + (", ".join(read) if read else "nothing measured"))
    lines.append(f"batcher: {r.batcher.__name__.lstrip('_')}" if r.batcher is not None else
                 "batcher: none (pointwise on aligned samples, else vmap, else per sample)")
    return "\n".join(lines)
