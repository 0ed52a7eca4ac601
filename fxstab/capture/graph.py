"""Reading a captured ``torch.fx`` graph: which nodes a selection instruments, which only read
metadata, which write into their inputs (and so which placeholders the graph mutates), and the
callable behind a node.

Pure functions of the graph, used at compile time by both levels of the analysis
(:mod:`fxstab.analysis`) and by the rules that run its nodes on samples (:mod:`fxstab.rules`).
"""

from __future__ import annotations

import fnmatch
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx

from .opsets import (
    DEFAULT_KINDS,
    DROPOUT_KINDS,
    FAMILIES,
    METADATA_KINDS,
    does_arithmetic,
    is_custom,
    node_kind,
)

__all__ = ["is_metadata", "selector", "is_inplace", "mutated_placeholders", "identity_dropout",
           "reads_item", "fetch_attr", "node_callable", "floating_dtype", "names_weight"]

# Attributes that are tensors computed from the tensor (x.T, x.mT, x.real...): operators, not
# metadata, when dynamo records them as getattr nodes.
_TENSOR_ATTRS = frozenset({"T", "mT", "H", "mH", "real", "imag"})


def is_metadata(node: torch.fx.Node, kind: str) -> bool:
    if kind != "getattr":
        return kind in METADATA_KINDS
    return not (len(node.args) > 1 and node.args[1] in _TENSOR_ATTRS)


_VIEW_KINDS = frozenset({"view", "reshape", "transpose", "permute", "getitem", "unsqueeze",
                         "squeeze", "flatten", "expand", "narrow", "select", "t", "contiguous"})


def _floating_value(node: torch.fx.Node) -> bool:
    """Whether a node's recorded value (dynamo's ``example_value``) may hold a floating tensor
    (True where none is recorded): an in-place count of integers (BatchNorm's
    ``num_batches_tracked.add_(1)``) is no arithmetic to analyse."""
    value = node.meta.get("example_value", node.meta.get("val"))
    return value is None or any(isinstance(v, torch.Tensor) and (v.is_floating_point() or
                                                                 v.is_complex())
                                for v in torch.utils._pytree.tree_leaves(value))


def selector(select: Any) -> Callable[[torch.fx.Node, str, str], bool]:
    """Build ``pred(node, kind, qualified_name)`` from the ``select`` option.

    ``None``: every operator that may do floating arithmetic (the families, custom operators,
    and any kind :func:`~fxstab.capture.opsets.does_arithmetic` admits: ``F.normalize``,
    ``torch.erf``, ``cos``...; not data movement, selections, comparisons, random draws or
    metadata reads). A string or a list of strings: each a
    family (:data:`FAMILIES`), ``"custom"`` (custom operators), ``"all"`` (the same as ``"*"``:
    every operator), a glob over ``module.path/kind`` (any string with one of ``*?[/.``; a
    default-family operator also matches by its module path alone: ``"blocks.*"``) or else an
    operator kind (:class:`fxstab.config.AnalysisConfig` has rejected names that are none of
    these). A callable: ``(node, qualified_name) -> bool``."""
    if select is None:  # every operator that does floating arithmetic, custom ones included
        # (docs/design.md §3)
        return lambda node, kind, qn: kind in DEFAULT_KINDS or is_custom(node) or \
            (does_arithmetic(kind) and _floating_value(node))
    if callable(select) and not isinstance(select, str):
        return lambda node, kind, qn: bool(select(node, qn))
    items = [select] if isinstance(select, str) else list(select)
    kinds: set[str] = set()
    globs: list[str] = []
    custom = False
    for item in items:
        if item in FAMILIES:
            kinds |= FAMILIES[item]
        elif item == "custom":
            custom = True
        elif item == "all" or any(ch in item for ch in "*?[/."):  # "all" is "*"
            globs.append("*" if item == "all" else item)
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


def is_inplace(node: torch.fx.Node) -> bool:
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


def mutated_placeholders(graph: torch.fx.Graph) -> set:
    """Placeholders the graph mutates in place (directly or through views)."""
    out = set()
    for node in graph.nodes:
        if node.op not in ("call_method", "call_function"):
            continue
        kind = node_kind(node)
        targets = []
        if is_inplace(node) or kind.endswith("_"):
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


def identity_dropout(node: torch.fx.Node, kind: str) -> bool:
    """A dropout that is the identity (``training=False`` or ``p=0`` as constants, as in eval):
    there is no scaling to round."""
    if kind not in DROPOUT_KINDS:
        return False
    training = _arg(node, 2, "training", _arg(node, 2, "train", True))
    return training is False or _arg(node, 1, "p", 0.5) == 0


def floating_dtype(node: torch.fx.Node) -> Optional[torch.dtype]:
    """The dtype of the first floating tensor in a node's output as the program computes it
    (dynamo's example value, a lowered graph's value); None when it has none or no value."""
    from torch.utils import _pytree as pytree

    value = node.meta.get("example_value", node.meta.get("val"))
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.dtype
    return None


def reads_item(node: torch.fx.Node) -> bool:
    return node.op == "call_method" and node.target == "item"

def fetch_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def node_callable(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Callable:
    if node.op == "call_function":
        return node.target
    if node.op == "call_method":
        name = node.target
        return lambda self, *a, **k: getattr(self, name)(*a, **k)
    if node.op == "call_module":
        return fetch_attr(gm, node.target)
    raise ValueError(f"cannot call node {node.format_node()}")


def names_weight(node: torch.fx.Node) -> bool:
    """Whether a placeholder holds a module parameter or buffer (dynamo lifts both to graph
    inputs named ``L_self_modules_fc_parameters_weight_``, ``..._buffers_running_mean_``)."""
    return "_parameters_" in node.name or "_buffers_" in node.name
