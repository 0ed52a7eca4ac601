"""``monitor.backend()``: a ``torch.compile`` backend whose graphs call into the monitor.

An FX pass over each dynamo graph replaces every candidate ``call_function`` / ``call_method``
node (selected by ``fxstab.capture.opsets.node_kind`` and family, or by identity for registered custom
ops) with a call to a per-operator dispatcher bound to the monitor's operator table. The mode
lives in that table, so promotions and demotions take effect on the next call without any
recompilation: dynamo's guards never see the monitor's state. The transformed graph runs as
plain Python (like the ``eager`` backend): the dispatcher has data-dependent control flow that
AOT tracing could not keep.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..capture.naming import module_path, op_name
from ..capture.opsets import family_of, node_kind
from .modes import method_caller
from .ops import OpRouter, OpState, custom_op_of

# module_path and op_name live in fxstab.capture.naming (one parser for the analysis and the
# monitor); they stay importable from here.
__all__ = ["MonitorBackend", "MonitorPass", "MonitoredGraph"]

def _dispatcher(monitor: OpRouter, op: OpState) -> Callable:
    def monitored(*args, **kwargs):
        return monitor.route(op, args, kwargs)
    monitored.__name__ = monitored.__qualname__ = f"fxstab_monitored_{op.kind}"
    return monitored


class MonitorPass(PassBase):
    """Route candidate nodes of one graph through ``monitor`` (records what it did)."""

    def __init__(self, monitor: OpRouter) -> None:
        super().__init__()
        self.monitor = monitor
        self.instrumented: list[str] = []
        self.skipped: list[tuple[str, str]] = []

    def _candidate(self, node: torch.fx.Node) -> Optional[tuple[str, Callable, Any]]:
        if node.op == "call_function":
            spec = custom_op_of(node.target)
            if spec is not None:
                return spec.name, node.target, spec
        elif node.op != "call_method":
            return None
        kind = node_kind(node)
        if family_of(kind) not in self.monitor.config.families:
            return None
        fn = node.target if node.op == "call_function" else method_caller(str(node.target))
        return kind, fn, None

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        counts: dict[tuple[str, str], int] = defaultdict(int)
        changed = False
        for node in list(gm.graph.nodes):
            cand = self._candidate(node)
            if cand is None:
                continue
            kind, fn, spec = cand
            val = node.meta.get("example_value")
            if isinstance(val, torch.Tensor) and not val.is_floating_point():
                self.skipped.append((node.name, f"{kind}: non-floating output {val.dtype}"))
                continue
            path = module_path(node)
            name = op_name(path, kind, counts[(path, kind)])
            counts[(path, kind)] += 1
            op = self.monitor.discover(name, kind, fn, spec)
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(_dispatcher(self.monitor, op), tuple(node.args),
                                             dict(node.kwargs))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            self.instrumented.append(name)
            changed = True
        gm.graph.lint()
        gm.recompile()
        return PassResult(gm, changed)


@dataclass
class MonitoredGraph:
    """One graph the monitor's backend compiled: its operators and the nodes it skipped (with
    why). Not the analysis's :class:`fxstab.analysis.op_level.GraphInfo`, which records how a
    graph's samples ran."""

    index: int
    instrumented: list = field(default_factory=list)
    skipped: list = field(default_factory=list)


class MonitorBackend:
    """The ``torch.compile`` backend of a :class:`StabilityMonitor` (``monitor.backend()``).

    ``compiles`` counts the graphs dynamo handed over: promotions must not change it.
    """

    def __init__(self, monitor: OpRouter) -> None:
        self.monitor = monitor
        self.graphs: list[MonitoredGraph] = []

    @property
    def compiles(self) -> int:
        return len(self.graphs)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        p = MonitorPass(self.monitor)
        result = p(gm)
        self.graphs.append(MonitoredGraph(len(self.graphs), p.instrumented, p.skipped))
        return result.graph_module.forward
