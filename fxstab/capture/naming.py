"""Stable operator names: ``module.path/kind#k`` (docs/design.md §7).

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

# One parser for every spelling of a dynamo module path that torch versions have written:
# ``L['self'].blocks.0.attn`` (torch 2.13), ``L['self'].blocks[0]._modules['attn']``,
# ``L["self"].d['k']``, ``getattr(L['self'].blocks, '0')``. Used by the analysis
# (fxstab.backend, fxstab.analysis) and by the monitor's compiled front end alike. The root is
# the outermost frame's local: ``L['self']``, or, when that frame is a decorator's wrapper
# (``def wrapper(*args, **kwargs)``, as Hugging Face wraps its models' forward), the model as
# ``L['args'][0]`` or ``L['kwargs']['self']``.
_GETATTR = re.compile(r"""getattr\(([^()]*), (['"])([^'"]*)\2\)""")  # innermost first
_PREFIX = re.compile(r"""^L\[(['"])(?:(?:args|kwargs)\1\]\[[^\]]*\]|[^'"]*\1\])\.?""")
_MODULES = re.compile(r"""(^|\.)_modules\[(['"])([^'"]*)\2\]""")  # nn.Module._modules['x']
_SUBSCRIPT = re.compile(r"""\[(['"]?)([^\]'"]+)\1\]""")  # [0], ['k'], ["k"]
# what stands between the root and the model's modules when the compiled callable is a bound
# method (``L['fn'].__self__``: operator_impact of a compiled model) or a compiled module
# wrapping the model (``OptimizedModule._orig_mod``): not part of the model's names
_WRAPPERS = re.compile(r"^(?:(?:__self__|_orig_mod)(?:\.|$))+")
# a module held by a module-level global, not by the model (transformers 5 makes functions
# such as ``apply_rotary_pos_emb`` modules: ``G['__import_transformers_dot_..._llama'].
# apply_rotary_pos_emb``): named inside the module that calls it
_GLOBAL = re.compile(r"""^G\[(['"])([^'"]*)\1\]\.?""")


def normalize_module_path(raw: str) -> str:
    """A dynamo module path in the dotted form of ``model.named_modules()``:
    ``L['self'].blocks[0]._modules['attn']`` -> ``blocks.0.attn``; ``""`` at the root.

    An attribute whose name merely contains ``_modules`` (``sub_modules``) is kept whole.
    """
    path = str(raw)
    while True:
        unwrapped = _GETATTR.sub(r"\1.\3", path)
        if unwrapped == path:
            break
        path = unwrapped
    path = _PREFIX.sub("", path)
    path = _MODULES.sub(r"\1\3", path)
    path = _SUBSCRIPT.sub(r".\2", path)
    path = re.sub(r"\.+", ".", path).strip(".")
    return _WRAPPERS.sub("", path)


def _global_name(raw: str) -> str:
    """The name of a module held by a global (:data:`_GLOBAL`): its attribute path after the
    global (``apply_rotary_pos_emb``), or the global's own name (an import's last part)."""
    m = _GLOBAL.match(raw)
    rest = normalize_module_path(raw[m.end():])
    return rest or m.group(2).rpartition("_dot_")[2]


def module_path(node: torch.fx.Node) -> str:
    """Model-relative module path of a dynamo node (``blocks.3.attn``; ``""`` at the root).

    A module held by a global rather than by the model (a function made a module, as
    transformers' ``apply_rotary_pos_emb``) is named inside the module that calls it:
    ``model.layers.3.self_attn.apply_rotary_pos_emb``, so each layer's call has its own names
    (a bare global path named no layer, and numbered every layer's operators as one)."""
    stack = node.meta.get("nn_module_stack") or {}
    raws = [str(v[0]) for v in stack.values()]
    inner: list = []
    while raws and _GLOBAL.match(raws[-1]):
        inner.insert(0, _global_name(raws.pop()))
    return ".".join([p for p in [normalize_module_path(raws[-1]) if raws else ""] if p]
                    + inner)


def op_name(path: str, kind: str, index: int) -> str:
    """Stable operator name ``path/kind#index`` (``kind#index`` at the root; docs/design.md §7)."""
    return f"{path}/{kind}#{index}" if path else f"{kind}#{index}"


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
        name = op_name(path, kind, k)
        self._by_identity[identity] = name
        return name


def qualified_name(path: str, kind: str) -> str:
    return f"{path}/{kind}" if path else kind


__all__ = ["normalize_module_path", "module_path", "op_name", "source_location", "NameRegistry",
           "qualified_name"]
