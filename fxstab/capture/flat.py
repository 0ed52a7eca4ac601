"""(args, kwargs) of an operator call as a flat list of leaves, and back.

Most calls hold no containers: their leaves are the positional arguments, then the keyword
values (pytree's order), and rebuilding them is a slice instead of a pytree walk. The stochastic
rules (``fxstab.backend``) and the monitor's replicas (``fxstab.monitor.core``) flatten and
rebuild a call per operator; anything else goes through ``torch.utils._pytree``.
"""

from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["flatten_call", "unflatten_call"]


class _FlatSpec:
    """The structure of a call without containers: how many positional arguments, which
    keywords."""

    __slots__ = ("n", "keys")

    def __init__(self, n: int, keys: tuple) -> None:
        self.n, self.keys = n, keys


def flatten_call(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """``pytree.tree_flatten((args, kwargs))``: the same leaves in the same order."""
    for v in args:
        if isinstance(v, (list, tuple, dict)):
            return pytree.tree_flatten((args, kwargs))
    for v in kwargs.values():
        if isinstance(v, (list, tuple, dict)):
            return pytree.tree_flatten((args, kwargs))
    return [*args, *kwargs.values()], _FlatSpec(len(args), tuple(kwargs))


def unflatten_call(leaves: list, spec: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from the leaves of :func:`flatten_call`."""
    if isinstance(spec, _FlatSpec):
        return tuple(leaves[:spec.n]), dict(zip(spec.keys, leaves[spec.n:]))
    return pytree.tree_unflatten(leaves, spec)
