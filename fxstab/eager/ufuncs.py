"""NumPy's ufuncs on stochastic arrays (``__array_ufunc__``): each ufunc is the torch operation a
torch program writes for it (``np.add`` is ``+``, ``np.sqrt`` is ``torch.sqrt``...), run through
the arithmetic-level rules on the stochastic tensor inside; calls with ``out=`` and ``where=``,
and the methods ``reduce`` (one torch reduction where torch has it, else NumPy's left fold),
``accumulate`` and ``outer``. Registered in :data:`fxstab.eager.arrays.PROTOCOLS`.
"""

from __future__ import annotations

import math
import operator

import numpy as np
import torch

from ..numerics.rounding import quantize
from ..rules.aten import Stacked
from .arrays import (
    PROTOCOLS, is_stochastic, numpy_dtypes, refuse, store, to_tensor, to_torch, truth, wrap,
)
from .stochastic import StochasticTensor

__all__ = ["UFUNCS", "array_ufunc", "norm_axes", "NO_VALUE", "reduce_ufunc",
           "masked_cond", "accumulate_ufunc"]


def _cbrt(x):
    # torch has no cbrt: |x|**(1/3) (one rounding, to fp64 accuracy for an fp32 format) with
    # x's sign (exact; keeps -0.0)
    return torch.copysign(torch.abs(x).pow(1.0 / 3.0), x)


def _clone(x):
    return x.clone()


def _vecdot(a, b):
    return (to_tensor(a).unsqueeze(-2) @ to_tensor(b).unsqueeze(-1))[..., 0, 0]


def _matvec(m, v):
    return (to_tensor(m) @ to_tensor(v).unsqueeze(-1))[..., 0]


def _vecmat(v, m):
    return (to_tensor(v).unsqueeze(-2) @ to_tensor(m))[..., 0, :]


def _bin(fn):
    return lambda a, b: fn(to_tensor(a), to_tensor(b))


def _grid_step(x, toward):
    """The neighbour of each sample in the simulated format toward ``toward`` (NumPy's
    ``nextafter`` on the format's grid): a bit-level function of the samples, exact."""
    x, toward = to_tensor(x), to_tensor(toward)
    st = x if isinstance(x, StochasticTensor) else toward
    ctx = st.context
    xs = x.samples if isinstance(x, StochasticTensor) else \
        ctx.stack(x.to(ctx.working_dtype)).samples
    ys = toward.samples if isinstance(toward, StochasticTensor) else \
        toward.to(ctx.working_dtype).unsqueeze(0)
    nd = max(xs.dim(), ys.dim()) - 1
    xs = xs.reshape(xs.shape[:1] + (1,) * (nd + 1 - xs.dim()) + xs.shape[1:])
    ys = ys.reshape(ys.shape[:1] + (1,) * (nd + 1 - ys.dim()) + ys.shape[1:])
    up = quantize(torch.nextafter(xs, torch.full_like(xs, math.inf)), ctx.fmt, "up")
    down = quantize(torch.nextafter(xs, torch.full_like(xs, -math.inf)), ctx.fmt, "down")
    out = torch.where(ys > xs, up, torch.where(ys < xs, down, ys.expand_as(xs)))
    out = torch.where(torch.isnan(xs) | torch.isnan(ys), math.nan, out)
    return StochasticTensor(Stacked(out.contiguous()), ctx, st.dtype)


def _spacing(x):
    x = to_tensor(x)
    s = x.samples
    away = torch.where(s < 0, -math.inf, math.inf)  # NumPy: spacing(-0.0) > 0
    return _grid_step(x, StochasticTensor(Stacked(away), x.context, x.dtype)) - x


def _logical(fn):
    return lambda *xs: fn(*[truth(x) for x in xs])


def _ldexp(x, e):
    return torch.ldexp(to_tensor(x), to_tensor(e))


def _heaviside(x, h):
    x, h = to_tensor(x), to_tensor(h)
    r = torch.heaviside(x, h.to(x.dtype) if not isinstance(h, StochasticTensor) else h)
    return torch.where(torch.isnan(x), x, r)  # NumPy: NaN stays NaN (torch gives 0)


def _sign(x):
    return torch.where(torch.isnan(x), x, torch.sign(x))  # NumPy: sign(NaN) is NaN


def _frexp(x):
    m, e = torch.frexp(to_tensor(x))
    return m, e


def _modf(x):
    x = to_tensor(x)
    # NumPy: the fractional part of +-inf is +-0 (torch.frac gives NaN)
    frac = torch.where(torch.isinf(x), torch.copysign(torch.zeros((), dtype=x.dtype), x),
                       torch.frac(x))
    return frac, torch.trunc(x)


def _divmod(a, b):
    return operator.floordiv(a, b), operator.mod(a, b)


UFUNCS: dict = {
    np.add: operator.add, np.subtract: operator.sub, np.multiply: operator.mul,
    np.divide: operator.truediv, np.power: operator.pow, np.floor_divide: operator.floordiv,
    np.remainder: operator.mod, np.matmul: operator.matmul, np.negative: operator.neg,
    np.float_power: _bin(torch.float_power), np.fmod: _bin(torch.fmod),
    np.divmod: _divmod, np.positive: _clone, np.conjugate: _clone,
    np.absolute: torch.abs, np.fabs: torch.abs, np.sign: _sign, np.signbit: torch.signbit,
    np.sqrt: torch.sqrt, np.cbrt: _cbrt, np.square: torch.square, np.reciprocal: torch.reciprocal,
    np.exp: torch.exp, np.exp2: torch.exp2, np.expm1: torch.expm1, np.log: torch.log,
    np.log2: torch.log2, np.log10: torch.log10, np.log1p: torch.log1p, np.sin: torch.sin,
    np.cos: torch.cos, np.tan: torch.tan, np.arcsin: torch.asin, np.arccos: torch.acos,
    np.arctan: torch.atan, np.sinh: torch.sinh, np.cosh: torch.cosh, np.tanh: torch.tanh,
    np.arcsinh: torch.asinh, np.arccosh: torch.acosh, np.arctanh: torch.atanh,
    np.deg2rad: torch.deg2rad, np.radians: torch.deg2rad, np.rad2deg: torch.rad2deg,
    np.degrees: torch.rad2deg, np.floor: torch.floor, np.ceil: torch.ceil, np.trunc: torch.trunc,
    np.rint: torch.round, np.isnan: torch.isnan, np.isinf: torch.isinf,
    np.isfinite: torch.isfinite, np.maximum: _bin(torch.maximum),
    np.minimum: _bin(torch.minimum), np.fmax: _bin(torch.fmax), np.fmin: _bin(torch.fmin),
    np.arctan2: _bin(torch.atan2), np.hypot: _bin(torch.hypot),
    np.logaddexp: _bin(torch.logaddexp), np.logaddexp2: _bin(torch.logaddexp2),
    np.copysign: _bin(torch.copysign), np.heaviside: _heaviside, np.ldexp: _ldexp,
    np.frexp: _frexp, np.modf: _modf, np.nextafter: _grid_step, np.spacing: _spacing,
    np.equal: operator.eq, np.not_equal: operator.ne, np.less: operator.lt,
    np.less_equal: operator.le, np.greater: operator.gt, np.greater_equal: operator.ge,
    np.logical_and: _logical(torch.logical_and), np.logical_or: _logical(torch.logical_or),
    np.logical_xor: _logical(torch.logical_xor), np.logical_not: _logical(torch.logical_not),
    np.vecdot: _vecdot,
}
for _name, _fn in (("matvec", _matvec), ("vecmat", _vecmat)):  # NumPy >= 2.2
    if isinstance(getattr(np, _name, None), np.ufunc):
        UFUNCS[getattr(np, _name)] = _fn


# reductions and scans with a torch primitive of their own (the rest fold the binary ufunc)
_REDUCE = {np.add: "sum", np.multiply: "prod", np.maximum: "amax", np.minimum: "amin",
           np.fmax: "amax", np.fmin: "amin", np.logical_and: "all", np.logical_or: "any"}
_ACCUMULATE = {np.add: torch.cumsum, np.multiply: torch.cumprod,
               np.maximum: lambda t, d: torch.cummax(t, d).values,
               np.minimum: lambda t, d: torch.cummin(t, d).values}
_REORDERABLE = frozenset({np.add, np.multiply, np.maximum, np.minimum, np.fmax, np.fmin,
                          np.logical_and, np.logical_or, np.logical_xor})
_UFUNC_KWARGS = {"out", "where", "dtype", "casting", "order", "subok"}


def array_ufunc(ufunc, method, inputs, kwargs):
    """``__array_ufunc__`` of stochastic values: a call (with ``out=``, ``where=``,
    ``dtype=``) or the methods ``reduce``, ``accumulate``, ``outer``; any other ufunc or method
    raises a ``TypeError`` naming it."""
    impl = UFUNCS.get(ufunc)
    if impl is None:
        raise refuse(f"the ufunc np.{ufunc.__name__}")
    out = kwargs.pop("out", None)
    if out is not None and not isinstance(out, tuple):
        out = (out,)
    if method == "__call__":
        where = kwargs.pop("where", True)
        dtype = kwargs.pop("dtype", None)
        extra = set(kwargs) - _UFUNC_KWARGS
        if extra or kwargs.get("casting", "same_kind") not in ("same_kind", "unsafe", "safe"):
            raise refuse(f"np.{ufunc.__name__}(..., {', '.join(sorted(kwargs))}=...)")
        dtypes = numpy_dtypes(ufunc, inputs, dtype)
        res = impl(*[to_torch(x) for x in inputs])
        many = isinstance(res, tuple)
        res = res if many else (res,)
        if where is not True:
            res = tuple(_masked(r, where, o) for r, o in
                        zip(res, out if out is not None else (None,) * len(res)))
        results = tuple(wrap(r, d) for r, d in zip(res, dtypes * len(res) if len(dtypes) == 1
                                                    and many else dtypes))
        if out is not None:
            results = tuple(store(o, r) if o is not None else r for o, r in zip(out, results))
        return results if many else results[0]
    if method == "reduce":
        (a,) = inputs
        return reduce_ufunc(ufunc, a, out=out[0] if out else None, **kwargs)
    if method == "accumulate":
        (a,) = inputs
        return accumulate_ufunc(ufunc, a, out=out[0] if out else None, **kwargs)
    if method == "outer":
        a, b = (to_torch(x) for x in inputs)
        nb = b.dim() if isinstance(b, torch.Tensor) else 0
        if isinstance(a, torch.Tensor):
            a = a.reshape(tuple(a.shape) + (1,) * nb)
        return array_ufunc(ufunc, "__call__", (wrap(a), wrap(b)),
                            dict(kwargs, **({"out": out} if out else {})))
    raise refuse(f"np.{ufunc.__name__}.{method}")


def _masked(r, where, old):
    """``where=``: the result where the mask holds, else the ``out`` array's old values (0
    without ``out``: exact, where NumPy leaves uninitialised memory)."""
    mask = to_tensor(where) if not is_stochastic(where) else truth(where)
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        mask = mask != 0
    other = to_torch(old) if old is not None else torch.zeros((), dtype=torch.float64)
    return torch.where(mask, r, other)


def norm_axes(axis, ndim: int) -> tuple:
    """``axis`` (None, an int or a tuple) as sorted non-negative axes, checked as NumPy does."""
    if axis is None:
        return tuple(range(ndim))
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    norm = []
    for a in axes:
        a = operator.index(a)
        if not -ndim <= a < ndim:
            raise np.exceptions.AxisError(a, ndim)
        norm.append(a % ndim)
    if len(set(norm)) != len(norm):
        raise ValueError(f"duplicate value in 'axis': {axis}")
    return tuple(sorted(norm))


NO_VALUE = np._NoValue


def reduce_ufunc(ufunc, a, axis=0, dtype=None, out=None, keepdims=False, initial=NO_VALUE,
            where=True):
    """``ufunc.reduce``: sum/prod/amax/amin/all/any where torch has the reduction (one
    primitive, as ``x.sum()`` in torch code), else a left fold of the binary ufunc over the
    axis (NumPy's order)."""
    t = to_torch(a)
    if not isinstance(t, torch.Tensor):
        t = to_tensor(t)
    axes = norm_axes(axis, t.dim())
    if len(axes) > 1 and ufunc not in _REORDERABLE:
        raise ValueError(f"reduction operation '{ufunc.__name__}' is not reorderable, so at "
                         f"most one axis may be specified")
    dt = dtype if dtype is not None else numpy_dtypes(ufunc, (a, a))[0]
    kind = _REDUCE.get(ufunc)
    if where is not True:
        fill = ufunc.identity if initial is NO_VALUE else initial
        if fill is None:
            raise ValueError(f"reduction operation '{ufunc.__name__}' does not have an "
                             f"identity, so to use a where mask one has to specify 'initial'")
        t = torch.where(masked_cond(where), t, to_tensor(fill))
    if kind in ("all", "any"):
        t = truth(t)
    if not axes:
        r = t.clone() if isinstance(t, StochasticTensor) else t
    elif kind == "sum":
        r = torch.sum(t) if len(axes) == t.dim() and not keepdims else \
            torch.sum(t, dim=axes, keepdim=keepdims)
    elif kind in ("amax", "amin"):
        r = getattr(torch, kind)(t, dim=axes, keepdim=keepdims)
    elif kind == "prod" and len(axes) == t.dim() and not keepdims:
        r = torch.prod(t)
    elif kind in ("prod", "all", "any"):
        r = t
        for d in reversed(axes):
            r = getattr(torch, kind)(r, dim=d, keepdim=keepdims)
    else:
        fn = UFUNCS[ufunc]
        (d,) = axes
        if t.shape[d] == 0:
            if ufunc.identity is None and initial is NO_VALUE:
                raise ValueError(f"zero-size array to reduction operation {ufunc.__name__} "
                                 f"which has no identity")
            r = torch.full(t.shape[:d] + t.shape[d + 1:],
                           float(ufunc.identity if initial is NO_VALUE else initial))
            initial = NO_VALUE
        else:
            r = t.select(d, 0)
            for i in range(1, t.shape[d]):
                r = fn(r, t.select(d, i))
        if keepdims:
            r = r.unsqueeze(d)
    if initial is not NO_VALUE and where is True:
        r = UFUNCS[ufunc](initial, r)
    res = wrap(r, dt)
    return store(out, res) if out is not None else res


def masked_cond(where):
    """A ``where=`` mask as a boolean tensor (stochastic masks decided CESTAC-style)."""
    m = truth(where) if is_stochastic(where) else to_tensor(where)
    return m if m.dtype == torch.bool else m != 0


def accumulate_ufunc(ufunc, a, axis=0, dtype=None, out=None):
    """``ufunc.accumulate``: cumsum/cumprod/cummax/cummin, else the running left fold."""
    t = to_tensor(a)
    (d,) = norm_axes(axis, t.dim()) if t.dim() else (0,)
    dt = dtype if dtype is not None else numpy_dtypes(ufunc, (a, a))[0]
    scan = _ACCUMULATE.get(ufunc)
    if scan is not None:
        r = scan(t, d)
    else:
        fn = UFUNCS[ufunc]
        parts = [t.select(d, 0)] if t.shape[d] else []
        for i in range(1, t.shape[d]):
            parts.append(fn(parts[-1], t.select(d, i)))
        r = torch.stack(parts, d) if parts else t.clone()
    res = wrap(r, dt)
    return store(out, res) if out is not None else res


PROTOCOLS.ufunc = array_ufunc
PROTOCOLS.ufuncs.update(UFUNCS)
