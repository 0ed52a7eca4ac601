"""Stable operator names: ``module.path/kind#k`` (DESIGN.md §7).

The module path is the innermost module in the node's ``nn_module_stack`` (dynamo records it), in
the dotted form of ``model.named_modules()`` (``blocks.3.attn``); ``kind`` is the operator kind
(:mod:`fxstab.capture.opsets`); ``k`` numbers the distinct operators of that kind within that module in
the order they first appear. An operator is identified by (module path, kind, source line,
repeat index on that line), so recompiling the same code (new batch size, graph breaks) gives
the same names, and adding a layer elsewhere changes none of them.
"""

from __future__ import annotations

import re
import torch

_PREFIX = re.compile(r"^L\[['\"][^'\"]*['\"]\]\.?")
_BRACKET = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def normalize_module_path(raw: str) -> str:
    """``L['self'].blocks[0]._modules['attn']`` -> ``blocks.0.attn``."""
    path = _PREFIX.sub("", raw)
    path = path.replace("._modules", "").replace("_modules", "")
    path = _BRACKET.sub(r".\1", path)
    path = re.sub(r"\.+", ".", path).strip(".")
    return path


def module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    raw = list(stack.values())[-1][0]
    return normalize_module_path(str(raw))


def source_location(node: torch.fx.Node) -> str:
    """``file.py:LINE`` of the user code that produced the node (last frame of the trace)."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not frames:
        return ""
    file, line = frames[-1]
    return f"{file}:{line}"


class NameRegistry:
    """Assigns stable names across the graphs one backend compiles."""

    def __init__(self) -> None:
        self._by_identity: dict[tuple, str] = {}
        self._count: dict[tuple[str, str], int] = {}

    def name(self, path: str, kind: str, source: str, repeat: int) -> str:
        identity = (path, kind, source, repeat)
        found = self._by_identity.get(identity)
        if found is not None:
            return found
        k = self._count.get((path, kind), 0)
        self._count[(path, kind)] = k + 1
        name = f"{path}/{kind}#{k}" if path else f"{kind}#{k}"
        self._by_identity[identity] = name
        return name


def qualified_name(path: str, kind: str) -> str:
    return f"{path}/{kind}" if path else kind


__all__ = ["normalize_module_path", "module_path", "source_location", "NameRegistry",
           "qualified_name"]
