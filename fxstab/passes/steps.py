"""Steps: the nodes of a generated stochastic graph that run fxstab's own code.

While the stochastic rules are traced (``make_fx`` over the rules, :mod:`fxstab.analysis.sampled_graph`),
everything they compute with torch operators becomes aten nodes; what must run as Python at
every call (rounding and recording the statistics, the GEMM surrogate, operators that run once
per sample with the deterministic pass's random numbers) goes through :func:`emit`: one
``fxstab_step::step`` node per call site, opaque to the tracer. After tracing,
:class:`LowerSteps` turns each into a direct call of its Python function (no dispatcher on the
way), named after what it does, so the generated code reads
``round_fc1_linear_0 = fxstab_round_fc1_linear_0([addmm])``.

A step is ``fn(tensors: list) -> list[Tensor]``; the tensors it receives are the values at run
time. It must not hold tensors of the call that traced it.
"""

from __future__ import annotations

import itertools
import operator
import re
import types
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

__all__ = ["Step", "active", "emit", "is_step", "lowered", "LowerSteps", "EliminateDeadCode",
           "DropDetach", "RefuseDynamicShapes", "tracing", "registered", "recompile",
           "deferred_recompile"]

# > 0 while a pipeline runs its passes: they leave the code generation to its end
_deferred = 0


def recompile(gm: torch.fx.GraphModule) -> None:
    """What a pass that changed ``gm``'s graph calls: the code generated anew (a pass run on
    its own leaves a module that runs), unless a pipeline defers it to its end
    (:func:`deferred_recompile`: the generation of a model's graph costs ~0.5 ms a node)."""
    if not _deferred:
        gm.recompile()


class deferred_recompile:
    """Inside: :func:`recompile` does nothing (the caller recompiles once, after the passes)."""

    def __enter__(self) -> None:
        global _deferred
        _deferred += 1

    def __exit__(self, *exc: Any) -> None:
        global _deferred
        _deferred -= 1



def _library() -> tuple:
    """The step operator's library: one namespace per copy of the package imported (a
    benchmark may import a reference copy beside this one, and reload it)."""
    base = __name__.split(".")[0] + "_step"
    for i in itertools.count():
        namespace = base if i == 0 else f"{base}{i}"
        try:
            lib = torch.library.Library(namespace, "DEF")
        except RuntimeError:  # taken by an earlier copy
            continue
        lib.define("step(int key, Tensor?[] xs) -> Tensor[]")
        return lib, getattr(torch.ops, namespace).step


_LIB, _STEP_OP = _library()
_REGISTRY: dict[int, "Step"] = {}
_KEYS = itertools.count()
_ACTIVE: list = []  # the open tracing() blocks


class Step:
    """A Python function that a generated graph calls as one node."""

    def __init__(self, what: str, label: str, fn: Callable[[list], list],
                 direct: bool = False, op: Optional[Callable] = None,
                 one: Optional[Callable[[list], Any]] = None) -> None:
        self.fn = fn
        self.direct = direct  # fn is this step's own function: the lowered node may call it
        # fn's own single output (not a list): a lowered node whose only readers take output 0
        # calls it instead, without the list and the getitem node (LowerSteps)
        self.one = one
        self.what = what  # round, perturb, per_sample, random, dropout, lookup, compare...
        # the operator whose value a step computes (a bf16 table lookup: op(x) by a table)
        self.op = op
        name = re.sub(r"\W+", "_", f"{what}_{label}").strip("_").lower() or what
        self.__name__ = self.__qualname__ = name[:80]
        self.__module__ = "fxstab"

    def __call__(self, xs: list) -> list:
        return self.fn(xs)

    def target(self, one: bool = False) -> Callable[[list], Any]:
        """What the lowered node calls: with ``direct``, the step's own function (renamed after
        the step: one call less per node), else this step; with ``one``, :attr:`one` (which
        returns the output itself); :func:`lowered` finds the step either way."""
        fn = self.one if one else self.fn
        if (self.direct or one) and isinstance(fn, types.FunctionType):
            fn.__name__ = fn.__qualname__ = self.__name__
            fn.__module__ = self.__module__
            fn._fxstab_step = self
            fn._fxstab_one = one
            return fn
        return self

    def __repr__(self) -> str:
        return f"Step({self.__name__})"


def lowered(node: torch.fx.Node) -> "Step | None":
    """The step a lowered node calls, if it calls one."""
    if node.op != "call_function":
        return None
    if isinstance(node.target, Step):
        return node.target
    return getattr(node.target, "_fxstab_step", None)


def returns_one(node: torch.fx.Node) -> bool:
    """Whether a lowered step's node gives its single output itself (not a list of them)."""
    return node.op == "call_function" and getattr(node.target, "_fxstab_one", False)


_FAILED: set = set()  # steps that raised while traced: a rule caught it and did otherwise


def _run_step(key: int, xs: list) -> list:
    try:
        return _REGISTRY[key].fn(list(xs))
    except Exception:
        _FAILED.add(key)
        raise


_LIB.impl("step", _run_step, "CompositeExplicitAutograd")


class tracing:
    """Inside the block, :func:`emit` records steps as graph nodes (``make_fx`` is tracing);
    :class:`LowerSteps` must run inside it too: at its end the registry forgets the block's
    steps (lowered or dead by then)."""

    def __init__(self) -> None:
        self.keys: list[int] = []

    def __enter__(self) -> "tracing":
        _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        _ACTIVE.remove(self)
        for k in self.keys:  # lowered by now, or dead
            _FAILED.discard(k)
            _REGISTRY.pop(k, None)


def active() -> bool:
    """Whether a :class:`tracing` block is open (:func:`emit` records steps)."""
    return bool(_ACTIVE)


def emit(step: Step, xs: list) -> list:
    """Run ``step`` on ``xs``: as one node of the graph being traced, or directly."""
    if not _ACTIVE:
        return step.fn(xs)
    key = next(_KEYS)
    _REGISTRY[key] = step
    _ACTIVE[-1].keys.append(key)
    return list(_STEP_OP(key, xs))


def is_step(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is _STEP_OP.default


class EliminateDeadCode(PassBase):
    """Dead-code elimination that keeps the steps (they record) and mutations: what a traced
    rule computed and then abandoned (a ``vmap`` that failed half-way, then ran per sample)
    goes."""

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        def impure(node: torch.fx.Node) -> bool:
            if is_step(node):
                return node.args[0] not in _FAILED
            return lowered(node) is not None or node.is_impure()

        modified = gm.graph.eliminate_dead_code(is_impure_node=impure)
        if modified:
            recompile(gm)
        return PassResult(gm, modified)


class LowerSteps(PassBase):
    """Each ``fxstab_step::step`` node becomes a direct call of its :class:`Step` (and the
    registry forgets it): the generated code calls fxstab's functions without the
    dispatcher."""

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified = False
        for node in list(gm.graph.nodes):
            if not is_step(node):
                continue
            key, xs = node.args
            step = _REGISTRY.pop(key)
            if node.args[0] in _FAILED and not node.users:
                gm.graph.erase_node(node)
                continue
            val = node.meta.get("val")
            one = step.one is not None and isinstance(val, (list, tuple)) and len(val) == 1 \
                and all(u.op == "call_function" and u.target is operator.getitem and
                        u.args[1] == 0 for u in node.users)
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(step.target(one), (xs,))
            new.meta = dict(node.meta)
            if one:  # the output itself: its getitem nodes go
                new.meta["val"] = val[0]
                for u in list(node.users):
                    u.replace_all_uses_with(new)
                    gm.graph.erase_node(u)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            modified = True
        if modified:
            recompile(gm)
        return PassResult(gm, modified)


def registered() -> int:
    """Steps traced and not lowered yet (0 between traces: nothing leaks)."""
    return len(_REGISTRY)


class RefuseDynamicShapes(PassBase):
    """A traced operator whose output shape follows the values (``nonzero``, boolean-mask
    indexing, ``unique``, ``masked_select``: ``torch.Tag.dynamic_output_shape``) makes the trace
    unusable: ``make_fx`` keeps the traced call's sizes, which a later call with other values
    would reuse. Raises, so the graph's rules run untraced for that signature. Indexing with
    integer tensors (a gather) keeps its shape and passes."""

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        for node in gm.graph.nodes:
            op = node.target
            if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or \
                    torch.Tag.dynamic_output_shape not in op.tags:
                continue
            if op is torch.ops.aten.index.Tensor and all(
                    i is None or (isinstance(i, torch.fx.Node) and
                                  getattr(i.meta.get("val"), "dtype", torch.bool)
                                  not in (torch.bool, torch.uint8))
                    for i in node.args[1]):
                continue
            raise RuntimeError(f"{op} has an output shape that depends on the values: a trace "
                               "would keep this call's sizes")
        return PassResult(gm, False)


class DropDetach(PassBase):
    """``aten.detach`` nodes become their input: the generated graph runs without autograd,
    where a detach is only a new alias (one per parameter and input, every call)."""

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified = False
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                modified = True
        if modified:
            recompile(gm)
        return PassResult(gm, modified)
