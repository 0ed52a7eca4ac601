"""``monitor.wrap(model)``: the eager front end of the monitor.

The wrapper runs the model's forward under a ``TorchFunctionMode`` that sees every torch-level
call (``F.linear``, ``Tensor.softmax``, ``torch.matmul``, ``F.layer_norm``...), the same
granularity dynamo captures; forward hooks keep the current module path, so operators get the
same ``module.path/kind#k`` names as under ``monitor.backend()``. Calls made inside a handled
call (e.g. the ``log_softmax`` inside ``F.cross_entropy``) are not seen again: the mode is off
while it handles one, exactly as a dynamo graph keeps ``cross_entropy`` as one node.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from ..capture.naming import op_name
from ..capture.opsets import family_of, target_kind
from .modes import CustomOp
from .ops import OpRouter, eager_forward

__all__ = ["MonitoredModule"]

_DUNDER = {"__matmul__": "matmul"}


def _func_kind(func: Callable) -> str:
    name = getattr(func, "__name__", "")
    if name in _DUNDER:
        return _DUNDER[name]
    if name.startswith("__"):
        return ""
    return target_kind("call_function", func)


class _Mode(TorchFunctionMode):
    def __init__(self, owner: "MonitoredModule") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self.owner._kind(func)
        if not kind:
            return func(*args, **kwargs)
        return self.owner._dispatch(kind, func, None, args, kwargs)


class MonitoredModule(torch.nn.Module):
    """An eager model whose candidate operators are routed through a monitor.

    Attributes:
        module: The wrapped model (its parameters are this module's parameters).
        monitor: The :class:`~fxstab.monitor.core.StabilityMonitor`.
    """

    def __init__(self, model: torch.nn.Module, monitor: OpRouter) -> None:
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"wrap() takes an nn.Module, got {type(model).__name__}")
        self.module = model
        object.__setattr__(self, "monitor", monitor)
        object.__setattr__(self, "_paths", [""])
        object.__setattr__(self, "_counts", defaultdict(int))
        object.__setattr__(self, "_kinds", {})
        self._hooks = []
        for path, sub in model.named_modules():
            if not path:
                continue
            self._hooks.append(sub.register_forward_pre_hook(self._enter(path)))
            self._hooks.append(sub.register_forward_hook(self._leave, always_call=True))

    def _enter(self, path: str) -> Callable:
        def hook(module, args):
            self._paths.append(path)
        return hook

    def _leave(self, module, args, output) -> None:
        if len(self._paths) > 1:
            self._paths.pop()

    def _kind(self, func: Callable) -> str:
        kind = self._kinds.get(func)
        if kind is None:
            kind = _func_kind(func)
            if family_of(kind) not in self.monitor.config.families:
                kind = ""
            try:
                self._kinds[func] = kind
            except TypeError:  # unhashable callable
                pass
        return kind

    def _dispatch(self, kind: str, fn: Callable, spec: Optional[CustomOp], args: tuple,
                  kwargs: dict) -> Any:
        path = self._paths[-1]
        name = op_name(path, kind, self._counts[(path, kind)])
        self._counts[(path, kind)] += 1
        op = self.monitor.discover(name, kind, fn, spec)
        return self.monitor.route(op, args, kwargs)

    def call_custom(self, fn: Callable, spec: CustomOp, args: tuple, kwargs: dict) -> Any:
        # A registered op called inside the forward: its body must not be seen op by op.
        with torch._C.DisableTorchFunction():
            return self._dispatch(spec.name, spec.fn, spec, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._counts.clear()
        del self._paths[1:]
        with eager_forward(self), _Mode(self):
            return self.module(*args, **kwargs)
