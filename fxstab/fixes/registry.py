"""The stable rewrites as a table: a naive formula over the captured operator-level graph and
the stable form that replaces it (``REWRITES[name]``), as :mod:`fxstab.rules.op.registry`
holds a rule per operator kind.

A rewrite is registered next to its code with :func:`rewrite`: the decorated
``match(node) -> Match | None`` is its pattern and its precondition at once (it looks at
``node`` as the *root* of the naive formula, the node whose value the stable form replaces,
and answers None where the pattern or the precondition fails); its docstring is its
documentation (the first paragraph is what :func:`describe` prints, a ``Needs:`` line the
precondition ``docs/fixes.md`` lists). The replacement is data, a :class:`Call` tree over the
matched operands, so one emitter (:mod:`fxstab.fixes.graph`) writes every stable form into a
graph and one printer writes it as code (``F.log_softmax(z, 1)``).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx

__all__ = ["Call", "Match", "Rewrite", "REWRITES", "rewrite", "describe", "find_matches",
           "spelled", "keep"]


class Call:
    """One call of the stable form: ``fn(*args, **kwargs)``, spelled ``text`` in code.

    An argument is a graph node (an operand of the naive formula), another :class:`Call`
    (emitted first) or a constant."""

    __slots__ = ("text", "fn", "args", "kwargs")

    def __init__(self, text: str, fn: Callable, *args: Any, **kwargs: Any) -> None:
        self.text, self.fn, self.args, self.kwargs = text, fn, args, kwargs

    def code(self) -> str:
        """The call as a user would write it (operands by their names in the program)."""
        if self.text in ("-", "~"):  # a negation reads as the operator
            return self.text + spelled(self.args[0], _NEG)
        if self.text == "+":  # so does a sum
            return f"{spelled(self.args[0], 1)} + {spelled(self.args[1], 1, True)}"
        parts = [spelled(a) for a in self.args]
        parts += [f"{k}={spelled(v)}" for k, v in self.kwargs.items()]
        return f"{self.text}({', '.join(parts)})"


# Python's operators as dynamo records them, spelled back as the program wrote them, with
# their precedence (a unary minus binds between ``*`` and ``**``)
_INFIX = {operator.lt: ("<", 0.5), operator.le: ("<=", 0.5), operator.gt: (">", 0.5),
          operator.ge: (">=", 0.5), operator.eq: ("==", 0.5), operator.ne: ("!=", 0.5),
          operator.add: ("+", 1), operator.sub: ("-", 1), operator.mul: ("*", 2),
          operator.truediv: ("/", 2), operator.matmul: ("@", 2), operator.pow: ("**", 4)}
_NEG = 3


def _unnamed(node: torch.fx.Node) -> bool:
    """Whether dynamo named ``node`` after its operator (``mul``, ``truediv_1``), not after a
    variable of the program (``p = softmax(z)`` names it ``p``)."""
    base = re.sub(r"_\d+$", "", node.name)
    target = node.target if isinstance(node.target, str) else \
        getattr(node.target, "__name__", None)
    return base == target


def _callee(fn: Any) -> Optional[str]:
    """How a program names a torch function: ``F.softmax``, ``torch.log``; None for others."""
    name = getattr(fn, "__name__", "")
    if getattr(fn, "__module__", "") == "torch.nn.functional":
        return f"F.{name}"
    if name and getattr(torch, name, None) is fn:
        return f"torch.{name}"
    return None


def _call_text(node: torch.fx.Node, depth: int) -> Optional[str]:
    """An unnamed call of a torch function or a tensor method, as the program wrote it
    (``F.softmax(z, 1)``, ``x.sum(-1)``), else None."""
    args = [spelled(a, 0, False, depth - 1) for a in node.args]
    args += [f"{k}={spelled(v, 0, False, depth - 1)}" for k, v in node.kwargs.items()]
    if node.op == "call_method" and node.args:
        return f"{spelled(node.args[0], 5, False, depth - 1)}.{node.target}({', '.join(args[1:])})"
    text = _callee(node.target) if node.op == "call_function" else None
    return f"{text}({', '.join(args)})" if text else None


def spelled(value: Any, outer: float = 0, right: bool = False, depth: int = 2) -> str:
    """An operand as code: a node by the program's name for it (dynamo names an input ``z``
    ``l_z_``, and an intermediate after the variable it was assigned to), or an unnamed
    arithmetic operation by its expression (``h * 20``, ``depth`` operators deep; in
    parentheses where the operator it is an operand of, of precedence ``outer``, binds
    tighter, or as tight on its ``right``); a call by its code, a constant by its repr."""
    if isinstance(value, Call):
        return value.code()
    if isinstance(value, torch.fx.Node):
        if depth and value.op == "call_function" and value.target in _INFIX and \
                len(value.args) == 2 and not value.kwargs and _unnamed(value):
            sym, prec = _INFIX[value.target]
            a = spelled(value.args[0], prec, False, depth - 1)
            b = spelled(value.args[1], prec, True, depth - 1)
            text = f"{a} {sym} {b}"
            return f"({text})" if prec < outer or (prec == outer and right) else text
        if depth and value.op in ("call_function", "call_method") and _unnamed(value):
            text = _call_text(value, depth)
            if text is not None:
                return text
        name = value.name
        if value.op == "placeholder" and name.startswith("l_") and name.endswith("_"):
            name = name[2:-1]
        return _program_name(value, name)
    if isinstance(value, (tuple, list)) and len(value) == 1:
        return spelled(value[0]) if isinstance(value, list) else f"({spelled(value[0])},)"
    return repr(value)


def _program_name(node: torch.fx.Node, name: str) -> str:
    """``name`` as the program spells it: dynamo numbers a variable assigned again (``scores``
    in a second block is ``scores_1``); where the line that assigned the node names the
    variable without the number, that is its name."""
    base = re.sub(r"_\d+$", "", name)
    if base == name:
        return name
    import linecache

    from ..capture.naming import source_location

    path, _, line = source_location(node).rpartition(":")
    code = linecache.getline(path, int(line)) if path and line.isdigit() else ""
    return base if re.search(rf"\b{re.escape(base)}\b", code) else name


def keep(keepdim: bool) -> dict:
    """A reduction's ``keepdim=True`` as a stable form's keyword, nothing for the default
    (``torch.logsumexp(x, -1)`` reads better than with ``keepdim=False``)."""
    return {"keepdim": True} if keepdim else {}


@dataclass(frozen=True)
class Match:
    """Where a rewrite matched: ``root`` is the node the stable form replaces (every reader of
    it reads the stable form instead), ``anchor`` the operator a finding names (the ``log`` of
    ``log(softmax(x))``: where the NaN/inf first appears), ``nodes`` every node of the naive
    formula (root included; those no other node reads are removed), ``form`` the stable
    form (a :class:`Call`, or an operand of the formula itself: ``(a + c) - c`` is ``a``)."""

    rewrite: str
    root: torch.fx.Node
    anchor: torch.fx.Node
    nodes: tuple
    form: Any

    def code(self) -> str:
        """The stable form as code (``F.log_softmax(z, 1)``)."""
        return spelled(self.form)


@dataclass(frozen=True)
class Rewrite:
    """One entry of the table: ``match(node) -> Match | None`` (pattern and precondition;
    ``match(node, format)`` where ``format_aware``: a guard the format erases), ``doc`` its
    documentation (the docstring), ``summary`` its first paragraph, ``needs`` its
    precondition (the docstring's ``Needs:`` paragraph)."""

    name: str
    match: Callable[..., Optional[Match]]
    naive: str  # the naive formula, as code
    stable: str  # the stable form, as code
    doc: str
    summary: str
    needs: str
    format_aware: bool = False  # match(node, format): the pattern depends on the format


REWRITES: dict[str, Rewrite] = {}
"""name -> its rewrite, in registration order (the order they are tried)."""


def rewrite(name: str, naive: str, stable: str, format_aware: bool = False) -> Callable:
    """Register the decorated ``match(node) -> Match | None`` as the rewrite ``name`` of
    ``naive`` into ``stable`` (both as code, for the documentation and the CLI);
    ``format_aware``: it is ``match(node, format)``, asked only where the format is known."""
    if name in REWRITES:
        raise ValueError(f"a rewrite named {name!r} is already registered; pick another name")

    def register(match: Callable[[torch.fx.Node], Optional[Match]]) -> Callable:
        doc = (match.__doc__ or "").strip()
        paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
        needs = next((p[len("Needs:"):].strip() for p in paragraphs if p.startswith("Needs:")),
                     "")
        REWRITES[name] = Rewrite(name, match, naive, stable, doc, paragraphs[0], needs,
                                 format_aware)
        return match

    return register


def describe(name: str) -> str:
    """What the rewrite ``name`` replaces, with what, and what it needs."""
    if name not in REWRITES:
        raise KeyError(f"no rewrite named {name!r}; the table holds {', '.join(REWRITES)}")
    r = REWRITES[name]
    return f"{r.name}: {r.naive}  ->  {r.stable}\n{r.summary}" + \
        (f"\nneeds: {r.needs}" if r.needs else "")


def find_matches(graph: torch.fx.Graph, names: Optional[Any] = None,
                 format: Optional[Any] = None) -> list[Match]:
    """Every match of the rewrites ``names`` (default: the whole table) in ``graph``, in graph
    order, each rewrite's in table order at one root; the format-aware ones only where
    ``format`` (a :class:`fxstab.Format`) is given."""
    chosen = [REWRITES[n] for n in names] if names is not None else list(REWRITES.values())
    chosen = [r for r in chosen if format is not None or not r.format_aware]
    out = []
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        for r in chosen:
            m = r.match(node, format) if r.format_aware else r.match(node)
            if m is not None:
                out.append(m)
    return out
