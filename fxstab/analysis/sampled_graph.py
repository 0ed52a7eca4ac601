"""The sampled graph: the stochastic path of one captured graph, emitted once per signature.

:class:`SampledGraph` traces the operator level's stochastic rules
(:class:`fxstab.backend.SampleTracer`, or the arithmetic level's
:class:`fxstab.analysis.aten_level.AtenTracer`) with ``make_fx`` on the second analysed call with a
given input signature (:meth:`SampledGraphs.first_sight`). The trace runs the rules for real,
so it is that call's stochastic path; the
graph it leaves, through the passes of :mod:`fxstab.passes.pipeline` (cleaned, its steps
lowered to direct calls, its aten calls made through torch's own bindings), is every later
call's: one call of
generated code, whose cost follows the work, not the number of nodes. ``print(sg.code)``
shows it (``be.sampled_graphs()``).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Iterator, Optional

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from ..passes import steps
from ..passes.pipeline import run_sampled_graph_passes

__all__ = ["SampledGraph", "signature", "SampledGraphs"]

MAX_SIGNATURES = 8
MAX_SEEN = 64  # signatures seen once, waiting for a second call to be traced


def signature(args: tuple) -> tuple:
    """What a trace depends on: each tensor's shape, strides, dtype, device and whether it is a
    parameter (weights are not perturbed), each other argument's type and value."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.device, isinstance(a, torch.nn.Parameter)))
        else:
            try:
                hash(a)
                key.append((type(a), a))
            except TypeError:
                key.append((type(a), id(a)))
    return tuple(key)


class SampledGraph:
    """The generated stochastic path of one graph for one input signature.

    Built by :meth:`trace` (which is also the traced call's own stochastic path: ``first``
    holds its result); called with the graph's arguments, it runs the generated code and
    returns the outputs' samples, built as the rules return them.
    """

    def __init__(self, gm: torch.fx.GraphModule, tracer: Any, positions: list, layout: tuple,
                 stacked_type: type) -> None:
        self.gm = gm
        self.tracer = tracer
        self.positions = positions  # which arguments are tensors (the graph's inputs)
        self.layout = layout  # (output leaves without tensors, spec, [(leaf, stacked)])
        self.stacked_type = stacked_type
        self.first: Any = None
        self.coverage: dict = {}  # how each operator ran, noted by the trace

    @property
    def code(self) -> str:
        return self.gm.code

    @property
    def n_nodes(self) -> int:
        return len(self.gm.graph.nodes)

    @classmethod
    def trace(cls, tracer: Any, args: tuple, stacked_type: type) -> "SampledGraph":
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        template = [None if isinstance(a, torch.Tensor) else a for a in args]
        held: dict = {}
        is_stacked = lambda x: isinstance(x, stacked_type)  # noqa: E731

        def rules(*tensors: torch.Tensor) -> list:
            full = list(template)
            for i, t in zip(positions, tensors):
                full[i] = t
            result = tracer.run(tuple(full))
            flat, spec = pytree.tree_flatten(result, is_leaf=is_stacked)
            where = [(j, is_stacked(v)) for j, v in enumerate(flat)
                     if is_stacked(v) or isinstance(v, torch.Tensor)]
            held["layout"] = ([None if is_stacked(v) or isinstance(v, torch.Tensor) else v
                               for v in flat], spec, where)
            held["first"] = result
            return [flat[j].samples if s else flat[j] for j, s in where]

        # a tensor subclass may override __torch_function__, which torch's bindings call and
        # an OpOverload does not (the trace already ran through it): its graph keeps them
        plain = all(type(args[i]) in (torch.Tensor, torch.nn.Parameter) for i in positions)
        with steps.tracing(), _one_fake_mode(), _meta_values():
            gm = make_fx(rules, tracing_mode="real")(*[args[i] for i in positions])
            run_sampled_graph_passes(gm, bindings=plain)
        sg = cls(gm, tracer, positions, held["layout"], stacked_type)
        sg.first = held["first"]
        return sg

    def __call__(self, args: tuple, call: int) -> Any:
        self.tracer.begin(call)
        outs = self.gm(*[args[i] for i in self.positions])
        leaves, spec, where = self.layout
        flat = list(leaves)
        for (j, s), t in zip(where, outs):
            flat[j] = self.stacked_type(t) if s else t
        return pytree.tree_unflatten(flat, spec)


@contextlib.contextmanager
def _one_fake_mode() -> Iterator[None]:
    """One fake mode for the values a real-mode ``make_fx`` notes on its nodes (``meta["val"]``):
    without one in the tracing context it makes a new ``FakeTensorMode`` per value, each taking
    a stack trace (a third of a 4-layer Llama's trace, ``benchmarks/bench_scale.py``)."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    if TracingContext.try_get() is not None:  # (dynamo's own, at compile time: as it is)
        yield
        return
    with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
        yield


@contextlib.contextmanager
def _meta_values() -> Iterator[None]:
    """A real-mode trace's values noted as meta tensors (shape, strides, dtype), not fake ones:
    the passes read nothing else of ``meta["val"]`` (:mod:`fxstab.passes`), and a fake
    snapshot costs ~0.2-2 ms per value against ~2 us (issue 52, item 4: the first calls). Where
    this torch has no ``extract_val`` to wrap, the trace notes fake values as before."""
    from torch.fx.experimental import proxy_tensor

    original = getattr(proxy_tensor, "extract_val", None)
    if original is None:
        yield
        return

    def extract_val(val: Any, include_real: bool = False) -> Any:
        if type(val) in (torch.Tensor, torch.nn.Parameter) and not val.is_sparse:
            return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
        return original(val, include_real=include_real)

    proxy_tensor.extract_val = extract_val
    try:
        yield
    finally:
        proxy_tensor.extract_val = original


class SampledGraphs:
    """The sampled graphs of one captured graph, by signature (the latest few).

    A signature is traced the second time it is seen (:meth:`first_sight`): a trace costs
    tens to hundreds of untraced calls (``make_fx`` over the rules, the generated code
    compiled), which only calls that come back repay. A model whose shapes keep changing
    (variable-length batches under ``dynamic=True``) then costs what the untraced rules cost,
    not a trace per call."""

    def __init__(self) -> None:
        self.by_signature: "collections.OrderedDict[tuple, SampledGraph]" = \
            collections.OrderedDict()
        self.traces = 0
        self.latest: Optional[SampledGraph] = None
        self._seen: "collections.OrderedDict[tuple, None]" = collections.OrderedDict()

    def first_sight(self, key: tuple) -> bool:
        """Whether ``key`` is new (it is remembered: the next call with it is traced)."""
        if key in self._seen:
            del self._seen[key]
            return False
        self._seen[key] = None
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
        return True

    def get(self, key: tuple) -> Optional[SampledGraph]:
        sg = self.by_signature.get(key)
        if sg is not None:
            self.by_signature.move_to_end(key)
            self.latest = sg
        return sg

    def add(self, key: tuple, sg: SampledGraph) -> None:
        self.traces += 1
        self.by_signature[key] = self.latest = sg
        while len(self.by_signature) > MAX_SIGNATURES:
            self.by_signature.popitem(last=False)
