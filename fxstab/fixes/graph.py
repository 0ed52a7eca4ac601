"""A rewrite applied to a captured graph (:func:`apply_match`), and the ``torch.compile``
backend that applies chosen rewrites to every graph it is given before handing it on
(:class:`RewriteBackend`): to the analysis (an fxstab backend), or to nothing (the real run,
the graph as it is).

A match is named across compilations of the same program by :class:`Site`: the graph's
position among the graphs compiled, the rewrite and the root node's name (dynamo names a
program's nodes the same way each time it captures it; the analysis names its operators from
the same graph, so a site found under one backend is found again under another).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from .registry import Call, Match, find_matches

__all__ = ["Site", "apply_match", "RewriteBackend"]

# what a node of the stable form inherits from the root it replaces: the user's line (the
# operator's source), its module (its name's path)
_INHERITED = ("stack_trace", "nn_module_stack")


@dataclass(frozen=True)
class Site:
    """Where a rewrite matched: the ``graph`` (its index in compile order), the ``rewrite``'s
    name and the ``root`` node's name."""

    graph: int
    rewrite: str
    root: str


def _example(value: Any) -> Any:
    return value.meta.get("example_value") if isinstance(value, torch.fx.Node) else value


def _emit(graph: torch.fx.Graph, call: Call, root: torch.fx.Node) -> torch.fx.Node:
    """``call`` as nodes before ``root`` (its inner calls first), with the metadata the
    analysis reads: the example value (computed on the operands' fake tensors), the root's
    line and module."""
    args = tuple(_emit(graph, a, root) if isinstance(a, Call) else a for a in call.args)
    kwargs = {k: _emit(graph, v, root) if isinstance(v, Call) else v
              for k, v in call.kwargs.items()}
    with graph.inserting_before(root):
        node = graph.call_function(call.fn, args, kwargs)
    for key in _INHERITED:
        if key in root.meta:
            node.meta[key] = root.meta[key]
    fake_args, fake_kwargs = pytree.tree_map(_example, (args, kwargs))
    mode = detect_fake_mode(pytree.tree_leaves((fake_args, fake_kwargs)))
    try:
        if mode is not None:
            with mode:
                node.meta["example_value"] = call.fn(*fake_args, **fake_kwargs)
        else:
            node.meta["example_value"] = call.fn(*fake_args, **fake_kwargs)
    except Exception:  # an operand without an example value: the root's stands for it
        if "example_value" in root.meta:
            node.meta["example_value"] = root.meta["example_value"]
    return node


def apply_match(gm: torch.fx.GraphModule, match: Match) -> torch.fx.Node:
    """Replace ``match.root`` in ``gm`` by the stable form (every reader of the root reads it),
    remove the nodes of the naive formula no other node reads, and recompile. Returns the
    stable form's node."""
    graph = gm.graph
    new = _emit(graph, match.form, match.root) if isinstance(match.form, Call) else match.form
    match.root.replace_all_uses_with(new)
    for node in reversed([n for n in graph.nodes if n in set(match.nodes)]):
        if not node.users and node.op in ("call_function", "call_method"):
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return new


class RewriteBackend:
    """A ``torch.compile`` backend that applies the rewrites at ``sites`` to each graph, then
    hands it to ``inner`` (another backend; None: the graph runs as it is). ``format``: the
    format the program runs in (the format-aware rewrites match only where it is given).

    Attributes:
        matches: per graph compiled, every match of the table found before rewriting (what a
            site can name).
        applied: the sites applied.
    """

    def __init__(self, sites: Iterable[Site] = (), inner: Optional[Callable] = None,
                 format: Optional[Any] = None) -> None:
        self.sites = list(sites)
        self.inner = inner
        self.format = format  # the format the program runs in: the format-aware rewrites
        self.matches: list[list[Match]] = []
        self.applied: list[Site] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        index = len(self.matches)
        self.matches.append(find_matches(gm.graph, format=self.format))
        for site in [s for s in self.sites if s.graph == index]:
            # matched again on the graph as rewritten so far: an earlier rewrite may have
            # removed the nodes of an overlapping one (then the site is skipped)
            found = [m for m in find_matches(gm.graph, [site.rewrite], self.format)
                     if m.root.name == site.root]
            if found:
                apply_match(gm, found[0])
                self.applied.append(site)
        if self.inner is None:
            return gm
        return self.inner(gm, example_inputs)
