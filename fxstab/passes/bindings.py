"""Direct bindings: the generated graph's aten calls through torch's own Python bindings.

``make_fx`` records every operator as its ``OpOverload`` (``torch.ops.aten.add.Tensor``); calling
one from Python goes through the dispatcher's boxed path: an ``OpOverload.__call__`` frame, then
each argument converted to an ``IValue`` by the schema. torch's generated bindings
(``torch.add``, ``Tensor.view``) parse their arguments in C++ and call the same overload
unboxed: on the tiny tensors of a long graph 1.5-4 us less per call, more than the operator's
own work (``benchmarks/bench_pernode.py``).

:class:`DirectBindings` replaces a node's overload by such a binding only where it is proven to
be the same call: the binding, run once on the node's own values (``meta["val"]``, as meta
tensors) under a dispatch mode that records what reaches the dispatcher, calls exactly that
overload, once, and gives an output of the same dtype, shape and strides. An operator that
mutates its inputs, draws random numbers or has no tensor operand keeps its overload, as does
one whose binding decomposes, picks another overload, or refuses the arguments. The generated
code then reads ``torch.add(x, 0.1)``. A graph whose inputs include a tensor subclass is left as
it is (``SampledGraph.trace``): a binding would call the subclass's ``__torch_function__``
again, which the trace already ran through.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils import _pytree as pytree

from .steps import recompile

__all__ = ["DirectBindings", "binding_of"]

# where torch's generated bindings live: torch.X, torch.nn.functional's C half, special, linalg,
# fft; then the Tensor methods (self first)
_NAMESPACES = (torch._C._VariableFunctions, torch._C._nn, torch._C._special, torch._C._linalg,
               torch._C._fft)


class _Record(TorchDispatchMode):
    """The operators that reach the dispatcher's Python key, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "prim":  # not the metadata queries (prim.device)
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _recorded(fn: Callable, args: tuple, kwargs: dict) -> tuple[list, Any]:
    with _Record() as rec:
        out = fn(*args, **kwargs)
    return rec.ops, out


def _layout(out: Any) -> tuple:
    """The structure of an output and each tensor's dtype, shape and strides."""
    flat, spec = pytree.tree_flatten(out)
    return spec, [(t.dtype, t.shape, t.stride()) if isinstance(t, torch.Tensor) else type(t)
                  for t in flat]


def _candidates(op: torch._ops.OpOverload) -> list:
    name = op._schema.name.split("::")[-1]
    found = [getattr(ns, name) for ns in _NAMESPACES if hasattr(ns, name)]
    method = getattr(torch._C.TensorBase, name, None)
    if method is not None:
        found.append(method)
    return found


def binding_of(node: torch.fx.Node) -> Optional[Callable]:
    """The binding that makes exactly ``node``'s call, or None (see the module's text)."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or \
            op.namespace != "aten" or op._schema.is_mutable or \
            torch.Tag.nondeterministic_seeded in op.tags:
        return None
    known = []

    def meta(n: torch.fx.Node) -> Any:
        # the node's value as a meta tensor (a trace's fake values each have their own mode)
        v = n.meta.get("val")
        known.append(isinstance(v, torch.Tensor))
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta") \
            if known[-1] else v

    try:
        args = torch.fx.node.map_arg(node.args, meta)
        kwargs = torch.fx.node.map_arg(node.kwargs, meta)
        if not known or not all(known):
            return None  # values unknown here, or no tensor operand (a factory): no proof
        ops, want = _recorded(op, args, kwargs)
    except Exception:  # a layout meta tensors do not take, an operator without a meta kernel
        return None
    if ops != [op]:
        return None
    for fn in _candidates(op):
        try:
            got_ops, got = _recorded(fn, args, kwargs)
        except Exception:
            continue
        if got_ops == [op] and _layout(got) == _layout(want):
            return fn
    return None


class DirectBindings(PassBase):
    """Each aten node whose call a torch binding makes exactly (:func:`binding_of`) calls that
    binding instead of its ``OpOverload``."""

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified = False
        for node in gm.graph.nodes:
            fn = binding_of(node)
            if fn is not None:
                node.target = fn
                modified = True
        if modified:
            recompile(gm)
        return PassResult(gm, modified)
