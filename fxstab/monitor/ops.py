"""The monitor's operator registry, below its core and both front ends.

What :mod:`fxstab.monitor.core` (the :class:`~fxstab.monitor.core.StabilityMonitor`) and its
front ends (:mod:`fxstab.monitor.compile` for ``torch.compile``, :mod:`fxstab.monitor.wrap` for
eager models) share: the registered custom ops and their threshold families, the eager
forwards running now (a registered op called inside one is routed to it), the state of one
candidate operator (:class:`OpState`), and the two calls a front end makes on a monitor
(:class:`OpRouter`). The front ends import this module, never the core, so the core can build
them without an import circle.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Protocol

import torch

from ..capture.opsets import family_of
from .config import Mode, MonitorConfig
from .modes import CustomOp

__all__ = ["OpState", "OpRouter", "EagerFrontEnd", "register_op", "custom_op_of", "op_family",
           "eager_forward"]

# Registered custom ops, keyed by the public callable's id (the callable is kept alive here).
_CUSTOM_OPS: dict[int, tuple[Callable, CustomOp]] = {}
# Threshold family of each registered custom op kind.
_CUSTOM_FAMILIES: dict[str, str] = {}
# Eager front ends currently running a forward (innermost last).
_EAGER_STACK: list = []


@dataclass
class OpState:
    """What the monitor knows about one candidate operator."""

    name: str
    kind: str
    index: int
    family: str = ""
    impls: tuple = field(repr=False, default=())
    mode: Mode = Mode.NORMAL
    score: float = 0.0
    n: int = 0  # measurements since the last reset of the EMA
    checks: int = 0
    checked_step: int = -1
    scored_step: int = -1  # step of the last measurement that updated the EMA
    inherited_nonfinite: int = 0  # non-finite checks blamed on the inputs (not counted)
    last_recheck: int = 0
    pinned: bool = False
    skip_reason: str = ""
    ever_promoted: bool = False
    history: list = field(default_factory=list, repr=False)  # (step, S, score, probe mode)


class OpRouter(Protocol):
    """What a front end calls on a monitor (:class:`~fxstab.monitor.core.StabilityMonitor`)."""

    config: MonitorConfig

    def discover(self, name: str, kind: str, fn: Callable,
                 custom: Optional[CustomOp] = None) -> OpState:
        """The operator ``name`` (added to the table on its first call)."""

    def route(self, op: OpState, args: tuple, kwargs: dict) -> Any:
        """Run one call of ``op`` in its mode (and check it when the schedule says so)."""


class EagerFrontEnd(Protocol):
    """An eager front end (:class:`~fxstab.monitor.wrap.MonitoredModule`) during its forward."""

    def call_custom(self, fn: Callable, spec: CustomOp, args: tuple, kwargs: dict) -> Any:
        """Route one call of the registered op ``spec`` through the monitor."""


@contextlib.contextmanager
def eager_forward(front: EagerFrontEnd) -> Iterator[None]:
    """Registered custom ops called inside go to ``front`` (the innermost one, when nested)."""
    _EAGER_STACK.append(front)
    try:
        yield
    finally:
        _EAGER_STACK.pop()


def custom_op_of(fn: Any) -> Optional[CustomOp]:
    """The registered :class:`CustomOp` behind a public callable, or ``None``."""
    entry = _CUSTOM_OPS.get(id(fn))
    return entry[1] if entry is not None and entry[0] is fn else None


def op_family(name_or_kind: str) -> str:
    """Threshold family of an operator name (``path/kind#k``) or kind: the ``fxstab.capture.opsets``
    family of the kind, the family a custom op was registered with, else the kind itself."""
    kind = name_or_kind.rsplit("/", 1)[-1].split("#", 1)[0]
    return _CUSTOM_FAMILIES.get(kind) or family_of(kind) or kind


def register_op(name: str, fn: Callable, fp32_fn: Optional[Callable] = None,
                stable_fn: Optional[Callable] = None, family: Optional[str] = None) -> Callable:
    """Register a custom operator with the monitor's modes; returns the callable to use.

    The returned function runs ``fn`` (NORMAL) when no monitor is active; inside a monitored
    model it is one candidate operator of kind ``name`` whose mode the monitor switches. It is
    ``torch.compiler.allow_in_graph``-ed so dynamo keeps it as one graph node (``fn`` must then
    work on fake tensors: no ``.item()`` or data-dependent Python control flow).

    Args:
        name: Kind name of the operator (a Python identifier, e.g. ``"my_fused_norm"``).
        fn: NORMAL implementation.
        fp32_fn: FP32_ACCUMULATION implementation (default: ``fn`` on fp32-upcast inputs).
        stable_fn: STABLE_KERNEL implementation (default: ``fp32_fn or fn`` upcast to the
            monitor's stable dtype).
        family: Whose thresholds apply (``MonitorConfig.thresholds``, ``monitor.calibrate``):
            e.g. ``"norm"`` for a fused normalization; default: the op's own name.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a custom op name must be a Python identifier, got {name!r}")
    for label, f in (("fn", fn), ("fp32_fn", fp32_fn), ("stable_fn", stable_fn)):
        if f is not None and not callable(f) or (label == "fn" and f is None):
            raise ValueError(f"{label} must be callable, got {f!r}")
    if family is not None and (not isinstance(family, str) or not family):
        raise ValueError(f"family must be a non-empty string or None, got {family!r}")
    spec = CustomOp(name, fn, fp32_fn, stable_fn, family)
    _CUSTOM_FAMILIES[name] = family or name

    def op(*args, **kwargs):
        if _EAGER_STACK:
            return _EAGER_STACK[-1].call_custom(op, spec, args, kwargs)
        return fn(*args, **kwargs)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = fn.__doc__
    op.fxstab_custom_op = spec  # type: ignore[attr-defined]
    op = torch.compiler.allow_in_graph(op)
    _CUSTOM_OPS[id(op)] = (op, spec)
    return op
