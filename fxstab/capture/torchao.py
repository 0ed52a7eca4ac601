"""torchao's float8 training GEMMs as a captured graph shows them (modelled at every format).

A model converted with ``torchao.float8.convert_to_float8_training`` runs each ``Float8Linear``
as one call of torchao's autograd function ``matmul_with_hp_or_float8_args(input, weight.t(),
linear_mm_config, config)``: the operands cast to float8 with dynamic scales (per tensor:
``tensorwise``; per row of K: ``rowwise``, the ``axiswise`` granularity), then a scaled matmul
(``torch._scaled_mm``, or its fp32 emulation: ``Float8LinearConfig(emulate=True)``, the CPU
path). Dynamo keeps that call as one node, ``trampoline_autograd_apply``, whose function class
is torchao's, and builds the config in the graph from constructor calls of constants.

:func:`float8_matmul` reads such a node: the matmul it is and the recipe its config gives its
forward operands (:class:`Float8Recipe`), or None for any other node. Nothing here imports
torchao: the node is recognised by its function class's module and name, the config by
calling the constructors the graph records (torchao's frozen dataclasses and enums).

A graph AOTAutograd lowers (the backward graph, ``backward=True``) shows the same recipe as
aten operators: each operand's amax and scale, a saturating clamp, then a cast into the float8
dtype (``aten._to_copy(x, dtype=torch.float8_e5m2)``), upcast again for the emulated matmul.
:func:`float8_cast` finds those casts: each is a rounding into its float8 format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx

__all__ = ["Float8Recipe", "float8_matmul", "float8_format", "float8_cast"]

# torchao's autograd function of a Float8Linear's matmul (torchao/float8/float8_linear.py)
_FUNCTION = ("torchao.float8.float8_linear", "matmul_with_hp_or_float8_args")
# torchao's ScalingGranularity -> fxstab's operand scaling (numerics.accumulation.SCALINGS):
# axiswise scales the input per row of K and the weight per output channel (a row of K)
_SCALINGS = {"TENSORWISE": "tensor", "AXISWISE": "row"}
_RECIPE_NAMES = {"tensor": "tensorwise", "row": "rowwise"}


@dataclass(frozen=True)
class Float8Recipe:
    """The float8 recipe of one torchao GEMM's forward operands.

    Attributes:
        operands: fxstab's name of the operands' float8 format (``"fp8_e4m3"``).
        scaling: fxstab's scaling of them (``"tensor"`` or ``"row"``).
        pow2_scales: whether torchao rounds the scales down to powers of two
            (``round_scales_to_power_of_2``, the rowwise recipe's default).
        grad_output: the format torchao casts the incoming gradient into for the backward
            GEMMs (``"fp8_e5m2"`` in the tensorwise recipe), or None (kept in high precision).
        emulate: torchao runs the scaled matmul as its fp32 emulation (``emulate=True``).
    """

    operands: str
    scaling: str
    pow2_scales: bool = False
    grad_output: Optional[str] = None
    emulate: bool = False

    @property
    def name(self) -> str:
        """torchao's recipe name for this scaling (``tensorwise``, ``rowwise``)."""
        return _RECIPE_NAMES[self.scaling]

    @property
    def label(self) -> str:
        """How the analysis names it: ``torchao float8 tensorwise: fp8_e4m3 operands, tensor
        scaling``."""
        return f"torchao float8 {self.name}: {self.operands} operands, {self.scaling} scaling"


def float8_format(dtype: Any) -> Optional[str]:
    """fxstab's format name of a float8 dtype (``torch.float8_e4m3fn`` -> ``"fp8_e4m3"``,
    ``torch.float8_e5m2`` -> ``"fp8_e5m2"``); None for any other value."""
    names = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
    return names.get(dtype) if isinstance(dtype, torch.dtype) else None


def _function_class(target: Any) -> Any:
    """The autograd function class behind dynamo's ``trampoline_autograd_apply`` (its closure
    holds ``fn_cls``), else None."""
    if getattr(target, "__name__", "") != "trampoline_autograd_apply":
        return None
    for cell in getattr(target, "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, type) and issubclass(value, torch.autograd.Function):
            return value
    return None


def _constant(arg: Any, depth: int = 0) -> Any:
    """The value a graph argument holds when it is built from constants by torchao's
    constructors (its config dataclasses); raises ValueError otherwise."""
    if isinstance(arg, torch.fx.Node):
        target = arg.target
        if depth > 8 or arg.op != "call_function" or not isinstance(target, type) or \
                not target.__module__.startswith("torchao."):
            raise ValueError(f"not a torchao constant: {arg}")
        args = tuple(_constant(a, depth + 1) for a in arg.args)
        kwargs = {k: _constant(v, depth + 1) for k, v in arg.kwargs.items()}
        return target(*args, **kwargs)
    if isinstance(arg, (tuple, list)):
        return type(arg)(_constant(a, depth + 1) for a in arg)
    return arg


def _cast(cast_config: Any) -> Optional[tuple]:
    """(format, scaling) of a torchao CastConfig that scales dynamically; None otherwise."""
    kind = getattr(getattr(cast_config, "scaling_type", None), "name", None)
    granularity = getattr(getattr(cast_config, "scaling_granularity", None), "name", None)
    fmt = float8_format(getattr(cast_config, "target_dtype", None))
    if kind != "DYNAMIC" or granularity not in _SCALINGS or fmt is None:
        return None
    return fmt, _SCALINGS[granularity]


def float8_matmul(node: torch.fx.Node) -> Optional[Float8Recipe]:
    """The recipe of a torchao float8 GEMM node (``input @ weight_t`` with both operands cast
    dynamically to one float8 format at one scaling), or None: another node, a config the
    graph does not build from constants, an operand left in high precision (a disabled cast)
    or operands cast differently (the recipe fxstab models rounds both alike)."""
    if node.op != "call_function":
        return None
    cls = _function_class(node.target)
    if cls is None or (cls.__module__, cls.__name__) != _FUNCTION or len(node.args) < 4:
        return None
    try:
        config = _constant(node.args[3])
    except (ValueError, TypeError):
        return None
    casts = {_cast(getattr(config, "cast_config_input", None)),
             _cast(getattr(config, "cast_config_weight", None))}
    if len(casts) != 1 or None in casts:
        return None
    fmt, scaling = casts.pop()
    grad = _cast(getattr(config, "cast_config_grad_output", None))
    return Float8Recipe(fmt, scaling, bool(getattr(config, "round_scales_to_power_of_2", False)),
                        grad[0] if grad else None, bool(getattr(config, "emulate", False)))


def float8_cast(node: torch.fx.Node) -> Optional[str]:
    """fxstab's format of the float8 dtype a lowered graph's node casts a floating tensor (not
    itself float8) into (``aten._to_copy(x, dtype=torch.float8_e4m3fn)``), else None. The cast
    rounds to nearest: a rounding into that format."""
    if node.op != "call_function" or node.target is not torch.ops.aten._to_copy.default:
        return None
    dtype = node.kwargs.get("dtype")
    source = node.args[0] if node.args else None
    value = source.meta.get("val", source.meta.get("example_value")) \
        if isinstance(source, torch.fx.Node) else None
    if not (isinstance(value, torch.Tensor) and value.is_floating_point()) or \
            float8_format(value.dtype) is not None:
        return None
    return float8_format(dtype)
