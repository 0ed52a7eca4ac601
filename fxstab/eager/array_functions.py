"""NumPy's array functions on stochastic arrays (``__array_function__``): ``np.sum``,
``np.dot``, ``np.where``, ``np.linalg.norm``... Each runs the torch operation a torch program
writes for it (``np.dot`` of vectors is ``@``: the GEMM rules), through the arithmetic-level
rules; NumPy functions written in Python (``np.var``, ``np.linalg.norm``, ``np.isclose``...)
follow NumPy's own algorithm, so the digits are those of the arithmetic NumPy does. Registered
in :data:`fxstab.eager.arrays.PROTOCOLS`.
"""

from __future__ import annotations

import math
import operator

import numpy as np
import torch

from .arrays import (
    PROTOCOLS, StochasticArray, decided_indices, dummy, is_stochastic, refuse, result_dtype,
    store, to_tensor, to_torch, truth, wrap,
)
from .stochastic import StochasticTensor, decide, index_key, stochastic
from .ufuncs import NO_VALUE, accumulate_ufunc, masked_cond, norm_axes, reduce_ufunc

# Nothing to import: the module registers its functions (fxstab.eager.arrays.SUPPORTED_FUNCTIONS
# lists them).
__all__: list = []

def _implements(*funcs):
    """Register the decorated function as the implementation of NumPy's ``funcs``."""
    def deco(impl):
        for f in funcs:
            if f is not None:
                PROTOCOLS.functions[f] = impl
        return impl
    return deco


def _out(res, out):
    return store(out, res) if out is not None else res


@_implements(np.sum)
def _sum(a, axis=None, dtype=None, out=None, keepdims=False, initial=NO_VALUE, where=True):
    return reduce_ufunc(np.add, a, axis, dtype, out, keepdims, initial, where)


@_implements(np.prod)
def _prod(a, axis=None, dtype=None, out=None, keepdims=False, initial=NO_VALUE, where=True):
    return reduce_ufunc(np.multiply, a, axis, dtype, out, keepdims, initial, where)


@_implements(np.max, np.amax)
def _max(a, axis=None, out=None, keepdims=False, initial=NO_VALUE, where=True):
    return reduce_ufunc(np.maximum, a, axis, None, out, keepdims, initial, where)


@_implements(np.min, np.amin)
def _min(a, axis=None, out=None, keepdims=False, initial=NO_VALUE, where=True):
    return reduce_ufunc(np.minimum, a, axis, None, out, keepdims, initial, where)


@_implements(np.all)
def _all(a, axis=None, out=None, keepdims=False, *, where=True):
    return reduce_ufunc(np.logical_and, a, axis, None, out, keepdims, NO_VALUE, where)


@_implements(np.any)
def _any(a, axis=None, out=None, keepdims=False, *, where=True):
    return reduce_ufunc(np.logical_or, a, axis, None, out, keepdims, NO_VALUE, where)


def _count(a, axes) -> int:
    shape = np.shape(a)
    return math.prod(shape[d] for d in axes)


@_implements(np.mean)
def _np_mean(a, axis=None, dtype=None, out=None, keepdims=False, *, where=True):
    t = to_tensor(a)
    axes = norm_axes(axis, t.dim())
    dt = dtype if dtype is not None else result_dtype(a, 1.0)
    if where is not True:
        s = reduce_ufunc(np.add, a, axes, dt, None, keepdims, NO_VALUE, where)
        n = np.sum(np.broadcast_to(_plain_mask(where), t.shape), axis=axes, keepdims=keepdims)
        return _out(np.true_divide(s, n), out)
    if not axes:
        r = t.clone()
    elif len(axes) == t.dim() and not keepdims:
        r = torch.mean(t)
    else:
        r = torch.mean(t, dim=axes, keepdim=keepdims)
    return _out(wrap(r, dt), out)


def _plain_mask(where) -> np.ndarray:
    m = masked_cond(where)
    return wrap(m) if not isinstance(m, StochasticTensor) else decide(m)


@_implements(np.var)
def _var(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, where=True,
         mean=NO_VALUE, correction=NO_VALUE):
    """NumPy's own algorithm (``numpy._core._methods._var``): the mean, the deviations, their
    squares, their sum, divided by ``n - ddof``."""
    if where is not True:
        raise refuse("np.var(..., where=...)")
    if correction is not NO_VALUE:
        ddof = correction
    axes = norm_axes(axis, len(np.shape(a)))
    n = _count(a, axes)
    m = np.sum(a, axis=axes, keepdims=True, dtype=dtype) / n if mean is NO_VALUE else mean
    x = np.subtract(a, m)
    x = np.multiply(x, x)
    r = np.sum(x, axis=axes, dtype=dtype, keepdims=keepdims)
    return _out(np.true_divide(r, max(n - ddof, 0)), out)


@_implements(np.std)
def _std(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, where=True,
         mean=NO_VALUE, correction=NO_VALUE):
    return _out(np.sqrt(_var(a, axis, dtype, None, ddof, keepdims, where=where, mean=mean,
                             correction=correction)), out)


@_implements(np.average)
def _average(a, axis=None, weights=None, returned=False, *, keepdims=False):
    if weights is None:
        avg = np.mean(a, axis=axis, keepdims=keepdims)
        scl = _count(a, norm_axes(axis, len(np.shape(a))))
    else:
        nd = np.ndim(a)
        if np.ndim(weights) == 1 and nd > 1:  # NumPy: 1-d weights run along the axis
            if axis is None or isinstance(axis, tuple):
                raise TypeError("Axis must be specified when shapes of a and weights differ.")
            shape = [1] * nd
            shape[axis % nd] = np.shape(weights)[0]
            weights = np.reshape(weights, tuple(shape))
        scl = np.sum(weights, axis=axis, keepdims=keepdims)
        avg = np.true_divide(np.sum(np.multiply(a, weights), axis=axis, keepdims=keepdims), scl)
    return (avg, scl) if returned else avg


@_implements(np.argmax)
def _argmax(a, axis=None, out=None, *, keepdims=False):
    t = to_tensor(a)
    r = torch.argmax(t.reshape(-1)) if axis is None else torch.argmax(t, dim=axis,
                                                                      keepdim=keepdims)
    r = decided_indices(r)
    if axis is None and keepdims:
        r = np.reshape(r, (1,) * t.dim())
    return r


@_implements(np.argmin)
def _argmin(a, axis=None, out=None, *, keepdims=False):
    t = to_tensor(a)
    r = torch.argmin(t.reshape(-1)) if axis is None else torch.argmin(t, dim=axis,
                                                                      keepdim=keepdims)
    r = decided_indices(r)
    if axis is None and keepdims:
        r = np.reshape(r, (1,) * t.dim())
    return r


@_implements(np.cumsum)
def _cumsum(a, axis=None, dtype=None, out=None):
    t = to_tensor(a)
    if axis is None:
        a, axis = wrap(t.reshape(-1), np.result_type(dummy(a))), 0
    return accumulate_ufunc(np.add, a, axis, dtype, out)


@_implements(np.cumprod)
def _cumprod(a, axis=None, dtype=None, out=None):
    t = to_tensor(a)
    if axis is None:
        a, axis = wrap(t.reshape(-1), np.result_type(dummy(a))), 0
    return accumulate_ufunc(np.multiply, a, axis, dtype, out)


@_implements(np.dot)
def _dot(a, b, out=None):
    """NumPy's dot: a product for 0-d operands, ``@`` for vectors and matrices (the GEMM rules),
    a contraction of a's last axis with b's second-to-last above."""
    ta, tb = to_torch(a), to_torch(b)
    na = ta.dim() if isinstance(ta, torch.Tensor) else 0
    nb = tb.dim() if isinstance(tb, torch.Tensor) else 0
    if na == 0 or nb == 0:
        return _out(np.multiply(a, b), out)
    if na <= 2 and nb <= 2:
        r = operator.matmul(ta, tb)
    else:
        r = torch.tensordot(to_tensor(ta), to_tensor(tb), dims=([na - 1], [max(nb - 2, 0)]))
    return _out(wrap(r, result_dtype(a, b)), out)


@_implements(np.vdot)
def _vdot(a, b):
    return _dot(np.ravel(a), np.ravel(b))


@_implements(np.inner)
def _inner(a, b):
    ta, tb = to_tensor(a), to_tensor(b)
    if ta.dim() == 0 or tb.dim() == 0:
        return np.multiply(a, b)
    return wrap(torch.tensordot(ta, tb, dims=([-1], [-1])), result_dtype(a, b))


@_implements(np.outer)
def _outer(a, b, out=None):
    return np.multiply.outer(np.ravel(a), np.ravel(b), **({"out": out} if out is not None else {}))


@_implements(np.tensordot)
def _tensordot(a, b, axes=2):
    ta, tb = to_tensor(a), to_tensor(b)
    if isinstance(axes, int):
        dims = axes
    else:
        xa, xb = axes
        dims = ([xa] if isinstance(xa, int) else list(xa),
                [xb] if isinstance(xb, int) else list(xb))
    return wrap(torch.tensordot(ta, tb, dims=dims), result_dtype(a, b))


@_implements(np.einsum)
def _einsum(subscripts, *operands, out=None, dtype=None, optimize=False, **kwargs):
    if not isinstance(subscripts, str) or kwargs:
        raise refuse("np.einsum in its interleaved form or with order/casting")
    r = torch.einsum(subscripts, *[to_tensor(x) for x in operands])
    return _out(wrap(r, dtype or result_dtype(*operands)), out)


@_implements(np.trace)
def _trace(a, offset=0, axis1=0, axis2=1, dtype=None, out=None):
    return np.sum(np.diagonal(a, offset, axis1, axis2), axis=-1, dtype=dtype, out=out)


@_implements(np.where)
def _where(condition, x=NO_VALUE, y=NO_VALUE):
    if x is NO_VALUE and y is NO_VALUE:
        return np.nonzero(condition)
    if x is NO_VALUE or y is NO_VALUE:
        raise ValueError("either both or neither of x and y should be given")
    cond = masked_cond(condition)
    r = torch.where(cond, to_tensor(x), to_tensor(y))
    return wrap(r, result_dtype(x, y))


@_implements(np.nonzero)
def _nonzero(a):
    t = truth(a)
    return np.nonzero(decide(t) if isinstance(t, StochasticTensor) else wrap(t))


@_implements(np.count_nonzero)
def _count_nonzero(a, axis=None, *, keepdims=False):
    t = truth(a)
    return np.count_nonzero(decide(t) if isinstance(t, StochasticTensor) else wrap(t),
                            axis=axis, keepdims=keepdims)


@_implements(np.clip)
def _clip(a, a_min=NO_VALUE, a_max=NO_VALUE, out=None, *, min=NO_VALUE, max=NO_VALUE,
          **kwargs):
    lo = a_min if a_min is not NO_VALUE else min
    hi = a_max if a_max is not NO_VALUE else max
    lo = None if lo is NO_VALUE else lo
    hi = None if hi is NO_VALUE else hi
    if lo is None and hi is None:
        raise ValueError("One of max or min must be given")
    t = to_tensor(a)
    lo_t = None if lo is None else to_torch(lo)
    hi_t = None if hi is None else to_torch(hi)
    if isinstance(lo_t, torch.Tensor) or isinstance(hi_t, torch.Tensor):
        lo_t = None if lo_t is None else to_tensor(lo_t)
        hi_t = None if hi_t is None else to_tensor(hi_t)
    r = torch.clamp(t, lo_t, hi_t)
    return _out(wrap(r, result_dtype(a, lo, hi)), out)


@_implements(np.round, np.around)
def _round(a, decimals=0, out=None):
    """NumPy's algorithm: ``rint`` for 0 decimals, else ``rint(x * 10**d) / 10**d``."""
    if decimals == 0:
        return np.rint(a, **({"out": out} if out is not None else {}))
    f = 10.0 ** decimals
    return _out(np.true_divide(np.rint(np.multiply(a, f)), f), out) if decimals > 0 else \
        _out(np.multiply(np.rint(np.true_divide(a, 10.0 ** -decimals)), 10.0 ** -decimals), out)


def _seq(arrays) -> list:
    arrays = list(arrays)
    if not arrays:
        raise ValueError("need at least one array to concatenate")
    return arrays


@_implements(np.concatenate)
def _concatenate(arrays, axis=0, out=None, dtype=None, casting="same_kind"):
    arrays = _seq(arrays)
    ts = [to_tensor(x) for x in arrays]
    if axis is None:
        ts, axis = [t.reshape(-1) for t in ts], 0
    r = torch.cat(ts, dim=axis)
    return _out(wrap(r, dtype or result_dtype(*arrays)), out)


@_implements(np.stack)
def _stack(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    arrays = _seq(arrays)
    r = torch.stack([to_tensor(x) for x in arrays], dim=axis)
    return _out(wrap(r, dtype or result_dtype(*arrays)), out)


@_implements(np.vstack, np.row_stack if hasattr(np, "row_stack") else None)
def _vstack(tup, *, dtype=None, casting="same_kind"):
    return np.concatenate([np.atleast_2d(x) for x in _seq(tup)], axis=0, dtype=dtype)


@_implements(np.hstack)
def _hstack(tup, *, dtype=None, casting="same_kind"):
    arrs = [np.atleast_1d(x) for x in _seq(tup)]
    return np.concatenate(arrs, axis=0 if arrs[0].ndim == 1 else 1, dtype=dtype)


@_implements(np.column_stack)
def _column_stack(tup):
    arrs = [x if np.ndim(x) >= 2 else np.reshape(np.atleast_1d(x), (-1, 1)) for x in _seq(tup)]
    return np.concatenate(arrs, axis=1)


def _atleast(nd):
    def impl(*arys):
        out = []
        for x in arys:
            if not is_stochastic(x):
                out.append(getattr(np, f"atleast_{nd}d")(x))
                continue
            t = to_tensor(x)
            if t.dim() < nd:
                shape = {1: (1,) * (1 - t.dim()) + tuple(t.shape),
                         2: (1,) * (2 - t.dim()) + tuple(t.shape),
                         3: ((1, 1, 1) if t.dim() == 0 else (1,) + tuple(t.shape) + (1,)
                             if t.dim() == 1 else tuple(t.shape) + (1,))}[nd]
                x = np.reshape(x, shape)
            out.append(x)
        return out[0] if len(out) == 1 else tuple(out)
    return impl


_implements(np.atleast_1d)(_atleast(1))
_implements(np.atleast_2d)(_atleast(2))
_implements(np.atleast_3d)(_atleast(3))


@_implements(np.reshape)
def _reshape(a, shape=None, order="C", *, newshape=None, copy=None):
    if order != "C":
        raise refuse(f"np.reshape(..., order={order!r})")
    shape = newshape if shape is None else shape
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return wrap(to_tensor(a).reshape(shape), np.result_type(dummy(a)))


@_implements(np.ravel)
def _ravel(a, order="C"):
    return np.reshape(a, -1, order=order)


@_implements(np.transpose)
def _transpose(a, axes=None):
    t = to_tensor(a)
    axes = tuple(reversed(range(t.dim()))) if axes is None else tuple(axes)
    return wrap(t.permute(axes), np.result_type(dummy(a)))


@_implements(np.swapaxes)
def _swapaxes(a, axis1, axis2):
    return wrap(to_tensor(a).transpose(axis1, axis2), np.result_type(dummy(a)))


@_implements(np.moveaxis)
def _moveaxis(a, source, destination):
    return wrap(torch.movedim(to_tensor(a), source, destination), np.result_type(dummy(a)))


@_implements(np.squeeze)
def _squeeze(a, axis=None):
    t = to_tensor(a)
    if axis is None:
        r = t.squeeze()
    else:
        axes = norm_axes(axis, t.dim())
        for d in axes:
            if t.shape[d] != 1:
                raise ValueError("cannot select an axis to squeeze out which has size not "
                                 "equal to one")
        r = t.reshape(tuple(s for i, s in enumerate(t.shape) if i not in axes))
    return wrap(r, np.result_type(dummy(a)))


@_implements(np.expand_dims)
def _expand_dims(a, axis):
    shape = list(np.shape(a))
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    nd = len(shape) + len(axes)
    for d in sorted(x % nd for x in axes):
        shape.insert(d, 1)
    return np.reshape(a, tuple(shape))


@_implements(np.broadcast_to)
def _broadcast_to(array, shape, subok=False):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return wrap(to_tensor(array).expand(shape).clone(), np.result_type(dummy(array)))


@_implements(np.flip)
def _flip(m, axis=None):
    t = to_tensor(m)
    return wrap(torch.flip(t, norm_axes(axis, t.dim())), np.result_type(dummy(m)))


@_implements(np.roll)
def _roll(a, shift, axis=None):
    t = to_tensor(a)
    r = torch.roll(t.reshape(-1), shift).reshape(t.shape) if axis is None else \
        torch.roll(t, shift, axis)
    return wrap(r, np.result_type(dummy(a)))


@_implements(np.tile)
def _tile(a, reps):
    reps = (reps,) if isinstance(reps, int) else tuple(reps)
    return wrap(to_tensor(a).tile(reps), np.result_type(dummy(a)))


@_implements(np.repeat)
def _repeat(a, repeats, axis=None):
    t = to_tensor(a)
    if axis is None:
        t, axis = t.reshape(-1), 0
    r = torch.repeat_interleave(t, torch.as_tensor(repeats) if not isinstance(repeats, int)
                                else repeats, dim=axis)
    return wrap(r, np.result_type(dummy(a)))


@_implements(np.diagonal)
def _diagonal(a, offset=0, axis1=0, axis2=1):
    return wrap(torch.diagonal(to_tensor(a), offset, axis1, axis2), np.result_type(dummy(a)))


@_implements(np.diag)
def _diag(v, k=0):
    return wrap(torch.diag(to_tensor(v), k), np.result_type(dummy(v)))


@_implements(np.triu)
def _triu(m, k=0):
    return wrap(torch.triu(to_tensor(m), k), np.result_type(dummy(m)))


@_implements(np.tril)
def _tril(m, k=0):
    return wrap(torch.tril(to_tensor(m), k), np.result_type(dummy(m)))


@_implements(np.take)
def _take(a, indices, axis=None, out=None, mode="raise"):
    t = to_tensor(a)
    idx = index_key(indices)
    idx = torch.as_tensor(idx)
    r = t.reshape(-1)[idx] if axis is None else torch.index_select(
        t, axis, idx.reshape(-1)).reshape(t.shape[:axis % t.dim()] + idx.shape +
                                          t.shape[axis % t.dim() + 1:])
    return _out(wrap(r, np.result_type(dummy(a))), out)


@_implements(np.sort)
def _sort(a, axis=-1, kind=None, order=None, *, stable=None):
    t = to_tensor(a)
    if axis is None:
        t, axis = t.reshape(-1), -1
    return wrap(torch.sort(t, dim=axis).values, np.result_type(dummy(a)))


@_implements(np.argsort)
def _argsort(a, axis=-1, kind=None, order=None, *, stable=None):
    t = to_tensor(a)
    if axis is None:
        t, axis = t.reshape(-1), -1
    return decided_indices(torch.sort(t, dim=axis, stable=True).indices)


@_implements(np.diff)
def _diff(a, n=1, axis=-1, prepend=NO_VALUE, append=NO_VALUE):
    """NumPy's algorithm: ``a[1:] - a[:-1]`` along the axis, n times."""
    if prepend is not NO_VALUE or append is not NO_VALUE:
        parts = ([np.broadcast_to(prepend, _side(a, axis))] if prepend is not NO_VALUE
                 else []) + [a] + ([np.broadcast_to(append, _side(a, axis))]
                                   if append is not NO_VALUE else [])
        a = np.concatenate(parts, axis=axis)
    nd = np.ndim(a)
    for _ in range(n):
        hi = [slice(None)] * nd
        lo = [slice(None)] * nd
        hi[axis], lo[axis] = slice(1, None), slice(None, -1)
        a = np.subtract(a[tuple(hi)], a[tuple(lo)])
    return a


def _side(a, axis):
    shape = list(np.shape(a))
    shape[axis] = 1
    return tuple(shape)


@_implements(np.copy)
def _copy(a, order="K", subok=False):
    return wrap(to_tensor(a).clone(), np.result_type(dummy(a)))


def _like(fill):
    def impl(prototype, dtype=None, order="K", subok=True, shape=None, *, device=None,
             fill_value=None):
        t = to_tensor(prototype)
        shape = tuple(t.shape) if shape is None else ((shape,) if isinstance(shape, int)
                                                       else tuple(shape))
        dt = np.dtype(dtype) if dtype is not None else np.result_type(dummy(prototype))
        value = fill if fill is not None else fill_value
        base = np.full(shape, value, dtype=dt if dt.kind == "f" else np.float64)
        if not isinstance(t, StochasticTensor) or dt.kind != "f":
            return np.full(shape, value, dtype=dt)
        return StochasticArray(stochastic(torch.from_numpy(base), context=t.context), dt)
    return impl


_implements(np.zeros_like)(_like(0.0))
_implements(np.empty_like)(_like(0.0))
_implements(np.ones_like)(_like(1.0))


@_implements(np.full_like)
def _full_like(a, fill_value, dtype=None, order="K", subok=True, shape=None, *, device=None):
    return _like(None)(a, dtype, order, subok, shape, fill_value=fill_value)


@_implements(np.shape)
def _shape(a):
    return tuple(to_tensor(a).shape)


@_implements(np.ndim)
def _ndim(a):
    return to_tensor(a).dim()


@_implements(np.size)
def _size(a, axis=None):
    shape = np.shape(a)
    return math.prod(shape) if axis is None else shape[axis]


@_implements(np.isclose)
def _isclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    """NumPy's test ``|a - b| <= atol + rtol * |b|``, decided by CESTAC comparisons."""
    res = np.less_equal(np.abs(np.subtract(a, b)), np.add(atol, np.multiply(rtol, np.abs(b))))
    res = np.logical_or(res, np.equal(a, b))  # equal infinities
    if equal_nan:
        res = np.logical_or(res, np.logical_and(_plain(np.isnan(a)), _plain(np.isnan(b))))
    return res


def _plain(x):
    return decide(x.tensor) if isinstance(x, StochasticArray) else x


@_implements(np.allclose)
def _allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    return bool(np.all(_isclose(a, b, rtol, atol, equal_nan)))


@_implements(np.polyval)
def _polyval(p, x):
    """Horner's scheme, as NumPy's polyval: ``y = y * x + p[i]``."""
    y = np.zeros_like(x) if is_stochastic(x) else 0.0
    for pv in (p if not is_stochastic(p) else list(p)):
        y = y * x + pv
    return y


@_implements(np.linalg.norm)
def _linalg_norm(x, ord=None, axis=None, keepdims=False):
    """NumPy's algorithm (``numpy.linalg.norm``): ``sqrt(dot(x, x))`` of the flattened array by
    default, ``sqrt(sum(x * x))`` over axes, the max/min/sum of ``|x|`` for inf/-inf/1, and
    ``sum(|x|**p)**(1/p)``; the SVD-based matrix norms (2, -2, 'nuc') are not supported."""
    nd = np.ndim(x)
    if axis is None:
        if ord is None or (ord in ("f", "fro") and nd == 2) or (ord == 2 and nd == 1):
            flat = np.ravel(x)
            ret = np.sqrt(np.dot(flat, flat))
            return np.reshape(ret, (1,) * nd) if keepdims else ret
        axis = tuple(range(nd))
    elif not isinstance(axis, tuple):
        axis = (operator.index(axis),)
    if len(axis) == 1:
        if ord == math.inf:
            return np.max(np.abs(x), axis=axis, keepdims=keepdims)
        if ord == -math.inf:
            return np.min(np.abs(x), axis=axis, keepdims=keepdims)
        if ord == 0:
            t = truth(x)
            d = decide(t) if isinstance(t, StochasticTensor) else wrap(t)
            return np.sum(d, axis=axis, keepdims=keepdims).astype(np.float64)
        if ord == 1:
            return np.sum(np.abs(x), axis=axis, keepdims=keepdims)
        if ord is None or ord == 2:
            return np.sqrt(np.sum(np.multiply(x, x), axis=axis, keepdims=keepdims))
        if isinstance(ord, str):
            raise ValueError(f"Invalid norm order '{ord}' for vectors")
        absx = np.power(np.abs(x), ord)
        return np.power(np.sum(absx, axis=axis, keepdims=keepdims), np.reciprocal(float(ord)))
    if len(axis) == 2:
        row, col = (a % nd for a in axis)
        if row == col:
            raise ValueError("Duplicate axes given.")
        if ord in (2, -2, "nuc"):
            raise refuse(f"np.linalg.norm(..., ord={ord!r}) (it needs an SVD)")
        if ord in (1, -1):
            red = np.max if ord == 1 else np.min
            c = col - 1 if col > row else col
            ret = red(np.sum(np.abs(x), axis=row), axis=c)
        elif ord in (math.inf, -math.inf):
            red = np.max if ord == math.inf else np.min
            r = row - 1 if row > col else row
            ret = red(np.sum(np.abs(x), axis=col), axis=r)
        elif ord in (None, "fro", "f"):
            ret = np.sqrt(np.sum(np.multiply(x, x), axis=axis))
        else:
            raise ValueError("Invalid norm order for matrices.")
        if keepdims:
            shape = list(np.shape(x))
            shape[row] = shape[col] = 1
            ret = np.reshape(ret, tuple(shape))
        return ret
    raise ValueError("Improper number of dimensions to norm.")
