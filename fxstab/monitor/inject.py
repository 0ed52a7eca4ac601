"""Instability injection for monitor experiments and tests (issue 7).

Each injection replaces one module of a model with a hazardous low-precision kernel, registered
as a monitor custom op whose three modes are the hazard (NORMAL), its fp32-accumulating repair
(FP32_ACCUMULATION) and a stable kernel (STABLE_KERNEL). The returned :class:`Injection` says
which operator is injected (``matches(op_name)``), so detection precision and recall can be
scored, and carries a ``strength`` (a buffer, so changing it never recompiles).

* :func:`fp16_accumulation`: a cancellation-heavy linear layer, y = (x + c) W^T - c rowsum(W)
  + b (equal to x W^T + b in exact arithmetic), whose NORMAL kernel accumulates in fp16: the
  k-block partial sums are rounded to fp16 (``fxstab.quantize``, mode nearest) and so is the
  running sum. The offset c is the strength: the error grows like c·2^-11 and the sum overflows
  fp16 (65504) once c·|rowsum| does.
* :func:`naive_softmax`: softmax without max subtraction, exponentials rounded to the input's
  format and summed in k-blocks in that format; the logits are multiplied by the strength (a
  temperature), so exp overflows past 88.7.
* :func:`overflow_activation`: the input of a LayerNorm scaled by the strength toward the
  format's overflow, normalized by a one-pass low-precision kernel (E[x^2] - E[x]^2 summed in
  k-blocks in the input's format), which returns NaN once the sums overflow.

NORMAL outputs are straight-through: forward values are the emulated kernel's, gradients are
those of the exact formula (a real low-precision kernel's backward is not what is injected).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..numerics.formats import get_format
from ..numerics.rounding import quantize
from .modes import safe_softmax
from .ops import register_op

__all__ = ["Injection", "fp16_accumulation", "naive_softmax", "overflow_activation",
           "blocked_sum", "INJECTIONS"]

DEFAULT_BLOCK = 16


def blocked_sum(terms: torch.Tensor, dim: int, block: int, fmt) -> torch.Tensor:
    """Sum ``terms`` along ``dim`` in blocks of ``block``: each block's sum and the running sum
    are rounded to ``fmt`` (round to nearest), like a kernel accumulating in ``fmt``."""
    n = terms.shape[dim]
    acc: Optional[torch.Tensor] = None
    for s in range(0, n, block):
        part = quantize(terms.narrow(dim, s, min(block, n - s)).sum(dim, keepdim=True), fmt,
                        "nearest")
        acc = part if acc is None else quantize(acc + part, fmt, "nearest")
    assert acc is not None, "blocked_sum of an empty dimension"
    return acc


def _straight_through(exact: torch.Tensor, emulated: torch.Tensor) -> torch.Tensor:
    return exact + (emulated - exact).detach()


# -- kernels (NORMAL, FP32_ACCUMULATION, STABLE_KERNEL share a signature) -------------------------
def _cancel_linear(x, weight, bias, offset, dtype):
    xw, ww, c = x.to(dtype), weight.to(dtype), offset.to(dtype)
    y = (xw + c) @ ww.transpose(0, 1) - c * ww.sum(dim=1)
    return y + bias.to(dtype) if bias is not None else y


def _fp16acc_linear(x, weight, bias, offset, block: int = DEFAULT_BLOCK):
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    with torch.no_grad():
        xc, wf = x.float() + offset.float(), weight.float()
        fp16 = get_format("fp16")
        n = xc.shape[-1]
        acc = None
        for s in range(0, n, block):
            e = min(block, n - s)
            part = quantize(xc[..., s:s + e] @ wf[:, s:s + e].transpose(0, 1), fp16, "nearest")
            acc = part if acc is None else quantize(acc + part, fp16, "nearest")
        emul = acc - offset.float() * wf.sum(dim=1)
        if bias is not None:
            emul = emul + bias.float()
    return _straight_through(exact, emul).to(x.dtype)


def _fp16acc_linear_fp32(x, weight, bias, offset, block: int = DEFAULT_BLOCK):
    return _cancel_linear(x, weight, bias, offset, torch.float32).to(x.dtype)


def _fp16acc_linear_stable(x, weight, bias, offset, block: int = DEFAULT_BLOCK):
    return _cancel_linear(x, weight, bias, offset, torch.float64).to(x.dtype)


def _naive_softmax(x, scale, dim: int = -1, block: int = DEFAULT_BLOCK):
    fmt = get_format(x.dtype)
    logits = x.float() * scale.float()
    exact = safe_softmax(logits, dim)
    with torch.no_grad():
        e = quantize(torch.exp(logits), fmt, "nearest")  # no max subtraction: overflows > 88.7
        s = blocked_sum(e, dim, block, fmt)
        emul = quantize(e / s, fmt, "nearest")
    return _straight_through(exact, emul).to(x.dtype)


def _naive_softmax_fp32(x, scale, dim: int = -1, block: int = DEFAULT_BLOCK):
    return safe_softmax(x.float() * scale.float(), dim).to(x.dtype)


def _naive_softmax_stable(x, scale, dim: int = -1, block: int = DEFAULT_BLOCK):
    return safe_softmax(x.double() * scale.double(), dim).to(x.dtype)


def _ln_prescaled(xs, weight, bias, eps, dtype):
    xs = xs.to(dtype)
    m = xs.abs().amax(dim=-1, keepdim=True)
    m = torch.where((m > 0) & torch.isfinite(m), m, torch.ones_like(m)).detach()
    xn = xs / m
    mu = xn.mean(dim=-1, keepdim=True)
    d = xn - mu
    y = d / torch.sqrt((d * d).mean(dim=-1, keepdim=True) + eps / (m * m))
    return y * weight.to(dtype) + bias.to(dtype)


def _lowprec_layer_norm(x, weight, bias, scale, eps: float = 1e-5, block: int = DEFAULT_BLOCK):
    fmt = get_format(x.dtype)
    xs = x.float() * scale.float()
    exact = _ln_prescaled(xs, weight, bias, eps, torch.float32)
    with torch.no_grad():
        n = xs.shape[-1]
        mean = quantize(blocked_sum(xs, -1, block, fmt) / n, fmt, "nearest")
        ex2 = quantize(blocked_sum(xs * xs, -1, block, fmt) / n, fmt, "nearest")
        var = quantize(ex2 - mean * mean, fmt, "nearest")  # one pass: inf - inf = NaN
        emul = (xs - mean) / torch.sqrt(var + eps) * weight.float() + bias.float()
    return _straight_through(exact, emul).to(x.dtype)


def _lowprec_layer_norm_fp32(x, weight, bias, scale, eps: float = 1e-5,
                             block: int = DEFAULT_BLOCK):
    # mean and variance in fp32 (two pass): repairs the accumulation, not the range.
    xs = x.float() * scale.float()
    return F.layer_norm(xs, xs.shape[-1:], weight.float(), bias.float(), eps).to(x.dtype)


def _lowprec_layer_norm_stable(x, weight, bias, scale, eps: float = 1e-5,
                               block: int = DEFAULT_BLOCK):
    xs = x.double() * scale.double()
    return _ln_prescaled(xs, weight, bias, eps, torch.float64).to(x.dtype)


_OPS: dict[str, Callable] = {}


def _op(name: str) -> Callable:
    """The registered custom op ``name`` (registered on first use)."""
    if not _OPS:
        # Each injected op is judged by the thresholds of the family it stands in for.
        _OPS["inject_fp16acc_linear"] = register_op(
            "inject_fp16acc_linear", _fp16acc_linear, _fp16acc_linear_fp32,
            _fp16acc_linear_stable, family="linear")
        _OPS["inject_naive_softmax"] = register_op(
            "inject_naive_softmax", _naive_softmax, _naive_softmax_fp32, _naive_softmax_stable,
            family="softmax")
        _OPS["inject_lowprec_layer_norm"] = register_op(
            "inject_lowprec_layer_norm", _lowprec_layer_norm, _lowprec_layer_norm_fp32,
            _lowprec_layer_norm_stable, family="norm")
    return _OPS[name]


# -- modules ---------------------------------------------------------------------------------
class _Injected(nn.Module):
    def __init__(self, strength: float, block: int) -> None:
        super().__init__()
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive integer, got {block!r}")
        self.block = block
        self.register_buffer("strength", torch.tensor(float(strength), dtype=torch.float32))


class Fp16AccumulationLinear(_Injected):
    """nn.Linear replacement: cancellation-heavy formula, fp16 k-block accumulation."""

    def __init__(self, linear: nn.Linear, offset: float, block: int) -> None:
        super().__init__(offset, block)
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        return _op("inject_fp16acc_linear")(x, self.weight, self.bias, self.strength,
                                            self.block)


class NaiveSoftmax(_Injected):
    """nn.Softmax replacement: logits x strength, no max subtraction, low-precision sum."""

    def __init__(self, dim: int, scale: float, block: int) -> None:
        super().__init__(scale, block)
        self.dim = dim

    def forward(self, x):
        return _op("inject_naive_softmax")(x, self.strength, self.dim, self.block)


class OverflowLayerNorm(_Injected):
    """nn.LayerNorm replacement: input x strength, one-pass low-precision statistics."""

    def __init__(self, ln: nn.LayerNorm, scale: float, block: int) -> None:
        super().__init__(scale, block)
        if len(ln.normalized_shape) != 1 or ln.weight is None or ln.bias is None:
            raise ValueError("overflow_activation needs a LayerNorm over the last dimension "
                             "with weight and bias")
        self.weight, self.bias, self.eps = ln.weight, ln.bias, ln.eps

    def forward(self, x):
        return _op("inject_lowprec_layer_norm")(x, self.weight, self.bias, self.strength,
                                                self.eps, self.block)


@dataclass
class Injection:
    """One injected operator: which module, which custom-op kind, how strong.

    Attributes:
        path: Module path of the replaced module in the model (``blocks.2.mlp.fc1``).
        kind: The custom op kind the monitor names it by (``inject_fp16acc_linear``).
        module: The replacement module.
        original: The module it replaced (``remove()`` puts it back).
    """

    path: str
    kind: str
    module: _Injected
    original: nn.Module
    model: nn.Module

    @property
    def strength(self) -> float:
        return float(self.module.strength)

    @strength.setter
    def strength(self, value: float) -> None:
        if not math.isfinite(value):
            raise ValueError(f"strength must be finite, got {value!r}")
        self.module.strength.fill_(float(value))

    @property
    def op_name(self) -> str:
        """Monitor name of the injected operator (``path/kind#0``)."""
        return f"{self.path}/{self.kind}#0"

    def matches(self, op_name: str) -> bool:
        """Whether a monitor operator name is this injected operator."""
        return op_name.startswith(f"{self.path}/{self.kind}#")

    def remove(self) -> None:
        """Put the original module back."""
        _set_submodule(self.model, self.path, self.original)


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _target(model: nn.Module, path: str, cls: type) -> nn.Module:
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"model has no submodule {path!r}") from None
    if not isinstance(mod, cls):
        raise ValueError(f"{path!r} is a {type(mod).__name__}, this injection needs an "
                         f"nn.{cls.__name__}")
    return mod


def fp16_accumulation(model: nn.Module, path: str, offset: float = 0.0,
                      block: int = DEFAULT_BLOCK) -> Injection:
    """Replace the nn.Linear at ``path`` with a cancellation-heavy fp16-accumulating kernel.

    Args:
        model: Model to modify in place.
        path: Module path of an ``nn.Linear``.
        offset: Initial strength c (the cancelled offset).
        block: k-block size of the fp16 accumulation.
    """
    lin = _target(model, path, nn.Linear)
    new = Fp16AccumulationLinear(lin, offset, block)
    _op("inject_fp16acc_linear")
    _set_submodule(model, path, new)
    return Injection(path, "inject_fp16acc_linear", new, lin, model)


def naive_softmax(model: nn.Module, path: str, scale: float = 1.0,
                  block: int = DEFAULT_BLOCK) -> Injection:
    """Replace the nn.Softmax at ``path`` with a softmax without max subtraction.

    Args:
        scale: Initial strength: multiplier of the logits (a temperature).
    """
    sm = _target(model, path, nn.Softmax)
    new = NaiveSoftmax(-1 if sm.dim is None else sm.dim, scale, block)
    _op("inject_naive_softmax")
    _set_submodule(model, path, new)
    return Injection(path, "inject_naive_softmax", new, sm, model)


def overflow_activation(model: nn.Module, path: str, scale: float = 1.0,
                        block: int = DEFAULT_BLOCK) -> Injection:
    """Scale the input of the nn.LayerNorm at ``path`` toward overflow (one-pass kernel).

    Args:
        scale: Initial strength: multiplier of the LayerNorm's input.
    """
    ln = _target(model, path, nn.LayerNorm)
    new = OverflowLayerNorm(ln, scale, block)
    _op("inject_lowprec_layer_norm")
    _set_submodule(model, path, new)
    return Injection(path, "inject_lowprec_layer_norm", new, ln, model)


INJECTIONS = {"fp16_accumulation": fp16_accumulation, "naive_softmax": naive_softmax,
              "overflow_activation": overflow_activation}
