"""Per-operator implementations of the monitor's modes (docs/design.md §8).

Every implementation has the signature ``impl(args, kwargs)`` and takes the operator's own
arguments (the ones the model passed to ``F.linear``, ``Tensor.softmax``...). Outputs keep the
dtype the NORMAL kernel would return, so switching modes never changes the dtypes the rest of
the model sees:

* NORMAL calls the operator as the model wrote it (the low-precision kernel).
* FP32_ACCUMULATION upcasts the floating inputs to fp32 and casts the result back. For a bf16
  or fp16 GEMM this *is* "low-precision inputs with fp32 accumulation": the inputs are exact in
  fp32 and so are their products (2 x 8 significand bits <= 24). Softmax subtracts the row
  maximum and sums the exponentials in fp32; layer/RMS norm compute mean and variance in fp32.
* STABLE_KERNEL upcasts to the stable dtype (fp64 by default) and uses overflow-safe formulas:
  max-subtracted softmax and log-softmax, and norms that first divide each normalized slice by
  its largest magnitude (layer/RMS norm are scale invariant; eps is rescaled to match), so an
  input whose squares overflow fp32 is still normalized correctly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from .config import Mode

__all__ = ["Impl", "CustomOp", "implementations", "upcast_call", "method_caller", "out_dtype",
           "safe_softmax"]

Impl = Callable[[tuple, dict], Any]


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def out_dtype(args: tuple, kwargs: dict) -> Optional[torch.dtype]:
    """The dtype the NORMAL kernel returns: an explicit ``dtype=``, else the first floating
    input's dtype (the candidates' floating inputs share one dtype in a bf16 model)."""
    d = kwargs.get("dtype")
    if isinstance(d, torch.dtype):
        return d
    for a in list(args) + list(kwargs.values()):
        if _is_float(a):
            return a.dtype
        if isinstance(a, (list, tuple)):
            for b in a:
                if _is_float(b):
                    return b.dtype
    return None


_SCALARS = (int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
            torch.layout, torch.memory_format)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with its floating tensors cast to ``dtype``. Plain tuples, lists and dicts are
    walked here and scalars returned as they are: ``tree_map`` cost 10-20 us per call, three
    calls per promoted operator's call (issue 52: a promoted LayerNorm took twice the time of
    the same fp32 LayerNorm written by hand); other containers go through ``tree_map``."""
    t = type(tree)
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if t is tuple or t is list:
        return t(_cast_floats(x, dtype) for x in tree)
    if t is dict:
        return {k: _cast_floats(v, dtype) for k, v in tree.items()}
    if isinstance(tree, _SCALARS):
        return tree
    return tree_map(lambda x: x.to(dtype) if _is_float(x) else x, tree)


def upcast_call(fn: Callable, dtype: torch.dtype, args: tuple, kwargs: dict) -> Any:
    """Call ``fn`` with floating inputs upcast to ``dtype``; cast floating outputs back."""
    target = out_dtype(args, kwargs)
    kwargs = dict(kwargs)
    kwargs.pop("dtype", None)  # an explicit dtype= would downcast the upcast input first
    out = fn(*_cast_floats(args, dtype), **_cast_floats(kwargs, dtype))
    return out if target is None else _cast_floats(out, target)


def method_caller(name: str) -> Callable:
    """A function calling the tensor method ``name`` (for FX ``call_method`` nodes)."""
    def call(self, *args, **kwargs):
        return getattr(self, name)(*args, **kwargs)
    call.__name__ = name
    return call


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


# -- softmax -----------------------------------------------------------------------------------
def safe_softmax(x: torch.Tensor, dim: int, log: bool = False) -> torch.Tensor:
    """Softmax (``log``: log-softmax) of ``x`` along ``dim`` in ``x``'s dtype, the row maximum
    subtracted first so that no exponential overflows; a fully masked row (maximum ``-inf``)
    subtracts 0. The monitor's safer softmax kernels and the injections' exact softmax."""
    m = x.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # fully masked (-inf) rows
    z = x - m
    s = torch.exp(z).sum(dim=dim, keepdim=True)
    return z - torch.log(s) if log else torch.exp(z) / s


def _softmax_in(args: tuple, kwargs: dict, dtype: torch.dtype, log: bool) -> torch.Tensor:
    """``F.softmax``/``F.log_softmax``'s call computed by :func:`safe_softmax` in ``dtype``."""
    x = args[0]
    dim = _arg(args, kwargs, 1, "dim")
    if dim is None:  # legacy implicit dim of F.softmax
        dim = 0 if x.dim() in (0, 1, 3) else 1
    return safe_softmax(x.to(dtype), dim, log).to(out_dtype(args, kwargs))


# -- normalization -----------------------------------------------------------------------------
def _norm_dims(x: torch.Tensor, normalized_shape) -> tuple:
    n = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    return tuple(range(x.dim() - n, x.dim()))


def _prescale(x: torch.Tensor, dims: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.abs().amax(dim=dims, keepdim=True)
    m = torch.where((m > 0) & torch.isfinite(m), m, torch.ones_like(m)).detach()
    return x / m, m


def _layer_norm_fp32(args: tuple, kwargs: dict) -> torch.Tensor:
    return upcast_call(F.layer_norm, torch.float32, args, kwargs)


def _layer_norm_stable(args: tuple, kwargs: dict, dtype: torch.dtype) -> torch.Tensor:
    x, shape = args[0], _arg(args, kwargs, 1, "normalized_shape")
    w, b = _arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "bias")
    eps = _arg(args, kwargs, 4, "eps", 1e-5)
    target = out_dtype(args, kwargs)
    dims = _norm_dims(x, shape)
    xs, m = _prescale(x.to(dtype), dims)
    mu = xs.mean(dim=dims, keepdim=True)
    d = xs - mu
    var = (d * d).mean(dim=dims, keepdim=True)
    y = d / torch.sqrt(var + eps / (m * m))  # LN(x) = LN(x/m) with eps/m^2
    if w is not None:
        y = y * w.to(dtype)
    if b is not None:
        y = y + b.to(dtype)
    return y.to(target)


def _rms_norm_ref(x, shape, w, eps, dtype):
    dims = _norm_dims(x, shape)
    xs, m = _prescale(x.to(dtype), dims)
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    y = xs / torch.sqrt((xs * xs).mean(dim=dims, keepdim=True) + eps / (m * m))
    return y * w.to(dtype) if w is not None else y


def _rms_norm_fp32(args: tuple, kwargs: dict) -> torch.Tensor:
    x, shape = args[0], _arg(args, kwargs, 1, "normalized_shape")
    w, eps = _arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "eps")
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    dims = _norm_dims(x, shape)
    xw = x.float()
    y = xw * torch.rsqrt((xw * xw).mean(dim=dims, keepdim=True) + eps)
    if w is not None:
        y = y * w.float()
    return y.to(out_dtype(args, kwargs))


def _rms_norm_stable(args: tuple, kwargs: dict, dtype: torch.dtype) -> torch.Tensor:
    x, shape = args[0], _arg(args, kwargs, 1, "normalized_shape")
    w, eps = _arg(args, kwargs, 2, "weight"), _arg(args, kwargs, 3, "eps")
    return _rms_norm_ref(x, shape, w, eps, dtype).to(out_dtype(args, kwargs))


# -- custom ops --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CustomOp:
    """A user-registered operator with its three implementations (same signature).

    ``fp32_fn`` defaults to ``fn`` with floating inputs upcast to fp32, ``stable_fn`` to
    ``fp32_fn or fn`` upcast to the stable dtype. ``family`` is the family whose calibrated
    thresholds apply to it (an ``fxstab.capture.opsets`` family such as ``"linear"``, or any name;
    ``None``: its own name).
    """

    name: str
    fn: Callable
    fp32_fn: Optional[Callable] = None
    stable_fn: Optional[Callable] = None
    family: Optional[str] = None


def implementations(kind: str, fn: Callable, stable_dtype: torch.dtype,
                    custom: Optional[CustomOp] = None) -> tuple[Impl, Impl, Impl]:
    """The (NORMAL, FP32_ACCUMULATION, STABLE_KERNEL) implementations of one operator.

    Args:
        kind: Operator kind (``fxstab.capture.opsets``) or the custom op's name.
        fn: The callable the model invoked (the NORMAL kernel).
        stable_dtype: Working dtype of STABLE_KERNEL.
        custom: The registered op, for user-registered kinds.
    """
    def normal(args, kwargs):
        return fn(*args, **kwargs)

    if custom is not None:
        def fp32(args, kwargs):
            if custom.fp32_fn is not None:
                return custom.fp32_fn(*args, **kwargs)
            return upcast_call(custom.fn, torch.float32, args, kwargs)

        def stable(args, kwargs):
            if custom.stable_fn is not None:
                return custom.stable_fn(*args, **kwargs)
            return upcast_call(custom.fp32_fn or custom.fn, stable_dtype, args, kwargs)
        return normal, fp32, stable

    if kind in ("softmax", "log_softmax"):
        log = kind == "log_softmax"
        return (normal,
                lambda a, k: _softmax_in(a, k, torch.float32, log),
                lambda a, k: _softmax_in(a, k, stable_dtype, log))
    if kind == "layer_norm":
        return normal, _layer_norm_fp32, lambda a, k: _layer_norm_stable(a, k, stable_dtype)
    if kind == "rms_norm":
        return normal, _rms_norm_fp32, lambda a, k: _rms_norm_stable(a, k, stable_dtype)
    # GEMMs, attention, other norms, reductions: the same kernel on upcast inputs.
    return (normal,
            lambda a, k: upcast_call(fn, torch.float32, a, k),
            lambda a, k: upcast_call(fn, stable_dtype, a, k))


MODE_ORDER = (Mode.NORMAL, Mode.FP32_ACCUMULATION, Mode.STABLE_KERNEL)
