"""Stochastic values for NumPy programs: CADNA's ``float_st`` as an array NumPy code can use.

``fxstab.stochastic(np_array)`` (and ``fxstab.analyze`` on NumPy arguments) returns a
:class:`StochasticArray`. NumPy's ufuncs (``__array_ufunc__``: calls with ``out=`` and
``where=``, ``reduce``, ``accumulate``, ``outer``) and its array functions
(``__array_function__``: ``np.sum``, ``np.dot``, ``np.where``, ``np.linalg.norm``...) run on it
through the same per-primitive rules as torch code (:mod:`fxstab.rules.aten`): each NumPy
operation is the torch operation a torch program would write for it (``np.add`` is ``+``,
``np.sqrt`` is ``torch.sqrt``, ``np.dot`` of vectors is ``@``...), applied to the
:class:`~fxstab.stochastic.StochasticTensor` inside, so a NumPy program and its torch twin run
the same primitives and, for the same seed, give the same samples and digits. NumPy functions
written in Python (``np.var``, ``np.linalg.norm``, ``np.isclose``...) follow NumPy's own
algorithm (``var``: mean, deviations, squares, sum, divide), so the digits are those of the
arithmetic NumPy does.

What comes back is NumPy: ``.value`` (the sample mean, in the array's NumPy dtype), ``.samples``
(``[N, ...]``, the working dtype) and ``.digits`` are ``np.ndarray`` (NumPy scalars for 0-d
values). Comparisons are CESTAC decisions (``a == b`` when ``a - b`` is an exact or
computational zero...) returned as plain NumPy booleans, so ``if`` and ``while`` behave as in
CADNA; ``bool(x)`` of a floating value is ``x != 0`` decided the same way. Indices that samples
disagree on (``argmax``, ``argsort``) are decided by majority and count as unstable branching.

Semantics that differ from ``np.ndarray`` (docs/arithmetic-level.md, "NumPy"):

* Views are copies (as for stochastic tensors): ``x[0][...] = 1`` does not reach ``x``;
  ``x[key] = v`` does.
* ``out=`` must be a stochastic array (``np.empty_like(x)`` makes one): a plain ndarray cannot
  hold samples. ``where=`` without ``out=`` leaves 0 (exact) where NumPy leaves uninitialised
  memory.
* ``np.nextafter`` and ``np.spacing`` step on the simulated format's grid (the neighbour of an
  fp32-format value is its fp32 neighbour whatever the array's dtype), as a bit-level function
  of the samples.
* Anything else (``np.asarray(x)``, ``np.fft``, ``np.linalg.solve``...) raises a ``TypeError``
  naming the function: leave the analysis with ``np.asarray(x.value)``.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Optional

import numpy as np
import torch
from numpy.lib.mixins import NDArrayOperatorsMixin

from ..records.counters import active_collectors
from ..numerics.rounding import quantize
from .stochastic import StochasticTensor, _mean, stochastic

__all__ = ["StochasticArray", "SUPPORTED_UFUNCS", "SUPPORTED_FUNCTIONS", "as_numpy_value"]

_LEAVE = ("leave the analysis with np.asarray(x.value) (the sample mean) or write it with the "
          "supported NumPy operations (fxstab.eager.arrays.SUPPORTED_UFUNCS and "
          "SUPPORTED_FUNCTIONS list them)")


def _refuse(what: str) -> TypeError:
    return TypeError(f"fxstab: {what} is not supported on stochastic arrays; {_LEAVE}")


# --------------------------------------------------------------------------- dtypes, conversion
def _np_dtype(td: torch.dtype) -> np.dtype:
    if td == torch.bfloat16:
        return np.dtype(np.float32)  # NumPy has no bfloat16: its nearest wider dtype
    return np.dtype(str(td).removeprefix("torch."))


def _torch_of(a: np.ndarray) -> torch.Tensor:
    if a.dtype == object or a.dtype.kind not in "biuf":
        raise TypeError(f"fxstab: a NumPy array of dtype {a.dtype} cannot enter the analysis "
                        f"(only booleans, integers and floats); convert it first")
    if a.dtype.kind == "f" and a.dtype.itemsize > 8:  # long double: torch has no such dtype
        a = a.astype(np.float64)
    return torch.from_numpy(np.array(a, copy=True, order="C"))


def _to_torch(x: Any) -> Any:
    """A NumPy-side operand as the torch program would hold it: the stochastic tensor inside a
    stochastic array, a plain tensor for a plain array, a Python number for a NumPy scalar."""
    if isinstance(x, StochasticArray):
        return x._t
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return _torch_of(x)
    if isinstance(x, np.generic):
        if x.dtype.kind not in "biuf":
            raise TypeError(f"fxstab: a NumPy scalar of dtype {x.dtype} cannot enter the "
                            f"analysis; convert it first")
        return x.item()
    if isinstance(x, (list, tuple)):
        if any(isinstance(v, (StochasticArray, StochasticTensor)) for v in x):
            return torch.stack([torch.as_tensor(_to_torch(v), dtype=torch.float64)
                                if not isinstance(v, (StochasticArray, StochasticTensor))
                                else _to_torch(v) for v in x])
        return _torch_of(np.asarray(x))
    if isinstance(x, (bool, int, float)) or x is None:
        return x
    raise TypeError(f"fxstab: a {type(x).__name__} cannot enter the analysis of a NumPy "
                    f"operation (stochastic arrays, NumPy arrays and Python numbers can)")


def _tensor(x: Any) -> torch.Tensor:
    """As :func:`_to_torch`, a number as a 0-d tensor (for torch functions that need one)."""
    x = _to_torch(x)
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, bool):
        return torch.tensor(x)
    if isinstance(x, int):
        return torch.tensor(x, dtype=torch.int64)
    return torch.tensor(x, dtype=torch.float64)


def _dummy(x: Any) -> Any:
    """A stand-in with the operand's NumPy dtype (0-d, or the Python number itself: NumPy's
    promotion treats those as weak), to ask NumPy what dtype its own operation would return."""
    if isinstance(x, StochasticArray):
        return np.ones((), x.dtype)
    if isinstance(x, np.ndarray):
        return np.ones((), x.dtype)
    if isinstance(x, np.generic):
        return x
    if isinstance(x, torch.Tensor):
        return np.ones((), _np_dtype(x.dtype))
    if isinstance(x, (list, tuple)):
        return np.ones((), np.result_type(*[_dummy(v) for v in x])) if x else np.ones(())
    return x


def _numpy_dtypes(fn: Callable, inputs: tuple, dtype=None) -> list:
    """The dtype(s) NumPy's own ``fn`` gives for operands of these dtypes (``None`` if it
    cannot tell)."""
    try:
        with np.errstate(all="ignore"):
            r = fn(*[_dummy(x) for x in inputs], **({} if dtype is None else {"dtype": dtype}))
    except Exception:  # noqa: BLE001 - e.g. an operand kind NumPy rejects on a 0-d stand-in
        return [None]
    return [np.asarray(v).dtype for v in (r if isinstance(r, tuple) else (r,))]


def _result_dtype(*operands) -> np.dtype:
    return np.result_type(*[_dummy(x) for x in operands if x is not None])


def _wrap(r: Any, dtype: Optional[np.dtype] = None, *, decide: bool = False) -> Any:
    """A torch-side result back in NumPy: stochastic tensors as stochastic arrays (floating ones
    with NumPy's dtype), plain tensors as ndarrays (0-d: NumPy scalars). ``decide``: integer or
    boolean samples become one plain array (majority, counted when samples disagree)."""
    if isinstance(r, StochasticTensor):
        if decide and not r._st.samples.is_floating_point():
            return _decided(r)
        if r._st.samples.is_floating_point():
            dt = dtype if dtype is not None and np.dtype(dtype).kind == "f" else _np_dtype(r.dtype)
        else:
            dt = dtype if dtype is not None and np.dtype(dtype).kind in "biu" else \
                _np_dtype(r.dtype)
        return StochasticArray(r, dt)
    if isinstance(r, torch.Tensor):
        a = r.detach().numpy() if r.dtype != torch.bfloat16 else r.float().numpy()
        if dtype is not None and np.dtype(dtype).kind == a.dtype.kind:
            a = a.astype(dtype, copy=False)
        return a[()] if a.ndim == 0 else a
    if isinstance(r, (tuple, list)):
        return type(r)(_wrap(v, dtype, decide=decide) for v in r)
    return r


def _decided(t: StochasticTensor) -> Any:
    """Integer/boolean samples as one plain NumPy array: the majority per element. Samples that
    disagree are CADNA's unstable branching (booleans, indices) or unstable intrinsic (other
    integers), counted as :func:`fxstab.stochastic._scalar` counts ``int()``/``bool()``."""
    s = t._st.samples
    n = s.shape[0]
    flat = s.reshape(n, -1)
    # the most frequent sample value (ties: the smallest); torch.mode has no bool kernel
    mode = torch.mode(flat.to(torch.int64), dim=0).values.to(s.dtype) if flat.shape[1] \
        else flat[0]
    differ = int((flat != flat[:1]).any(0).sum()) if flat.shape[1] else 0
    if differ:
        key = "branching" if s.dtype == torch.bool or getattr(t, "_index", False) \
            else "intrinsic"
        t._ctx.counters.add(key, differ)
        for c in active_collectors():
            c.add(key, differ)
    a = mode.reshape(s.shape[1:]).numpy()
    return a[()] if a.ndim == 0 else a


def _indices(t: Any) -> Any:
    """An index result (argmax, argsort...): decided (plain), disagreement = branching."""
    if isinstance(t, StochasticTensor):
        t._index = True
        return _decided(t)
    return _wrap(t)


# --------------------------------------------------------------------------- the array
class StochasticArray(NDArrayOperatorsMixin):
    """N synchronous stochastic samples (CESTAC) of a NumPy array, shaped like one sample.

    Operators and NumPy functions run through the arithmetic-level rules (module docstring).

    Attributes:
        value: The sample mean, an ``np.ndarray`` of the nominal dtype (0-d: a NumPy scalar).
        samples: The samples ``[N, ...]`` in the working dtype (``np.ndarray``).
        digits: Per-element CESTAC digits (``np.ndarray``; 0-d: ``np.float64``).
        dtype: The nominal NumPy dtype (what the program would hold without fxstab).
        tensor: The :class:`~fxstab.stochastic.StochasticTensor` holding the samples (torch
            code can take over from there).
    """

    __slots__ = ("_t", "_dtype")
    __array_priority__ = 2000

    def __init__(self, tensor: StochasticTensor, dtype: Any = None):
        if not isinstance(tensor, StochasticTensor):
            raise TypeError(f"StochasticArray wraps a StochasticTensor, got "
                            f"{type(tensor).__name__}; make one with fxstab.stochastic(array)")
        self._t = tensor
        self._dtype = np.dtype(dtype) if dtype is not None else _np_dtype(tensor.dtype)

    # -- what a NumPy array answers -------------------------------------------------------
    @property
    def shape(self) -> tuple:
        return tuple(self._t.shape)

    @property
    def ndim(self) -> int:
        return self._t.dim()

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def T(self) -> "StochasticArray":
        return np.transpose(self)

    @property
    def mT(self) -> "StochasticArray":
        return np.swapaxes(self, -1, -2)

    @property
    def real(self) -> "StochasticArray":
        return self

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if not self.shape:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    # -- the analysis' views ----------------------------------------------------------------
    @property
    def tensor(self) -> StochasticTensor:
        return self._t

    @property
    def context(self):
        return self._t._ctx

    @property
    def samples(self) -> np.ndarray:
        return self._t._st.samples.numpy().copy()

    @property
    def value(self) -> Any:
        a = _mean(self._t._st.samples).numpy().astype(self._dtype)
        return a[()] if a.ndim == 0 else a

    @property
    def digits(self) -> Any:
        d = self._t._st.analysis(self._t._ctx).digits.double().numpy().copy()
        return d[()] if d.ndim == 0 else d

    # -- Python conversions: CESTAC -------------------------------------------------------
    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is "
                             "ambiguous. Use a.any() or a.all()")
        if self._t._st.samples.is_floating_point():
            return bool(self != 0)  # CESTAC: false when x is an exact or computational zero
        return bool(_decided(self._t.reshape(())))

    def __float__(self) -> float:
        return float(self._t.reshape(()))

    def __int__(self) -> int:
        return int(self._t.reshape(()))

    def item(self, *args) -> Any:
        x = self[args] if args else self.reshape(()) if self.size == 1 else None
        if x is None:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return float(x) if self._dtype.kind == "f" else int(x) if self._dtype.kind in "iu" \
            else bool(x)

    def __array__(self, dtype=None, copy=None):
        raise TypeError(f"fxstab: np.asarray/np.array of a stochastic array would drop its "
                        f"samples; use np.asarray(x.value) for the sample mean (leaving the "
                        f"analysis) or np.stack([...]) to keep them")

    def __getattr__(self, name: str):
        if name.startswith("__") or not hasattr(np.ndarray, name):
            raise AttributeError(f"'StochasticArray' object has no attribute '{name}'")
        raise _refuse(f"ndarray.{name}")

    # -- printing: CADNA's style, as for tensors ----------------------------------------------
    def __str__(self) -> str:
        if not self._t._st.samples.is_floating_point():
            return str(self.value)  # integers, booleans: NumPy's printing of sample 0
        return str(self._t)

    def __repr__(self) -> str:
        ctx = self._t._ctx
        return (f"StochasticArray({self}, dtype={self._dtype}, format={ctx.fmt.name}, "
                f"n_samples={ctx.n_samples})")

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else format(float(self), spec)

    # -- indexing ---------------------------------------------------------------------------
    def __getitem__(self, key) -> Any:
        return _wrap(self._t[_key(key)], self._dtype)

    def __setitem__(self, key, v) -> None:
        self._t = _set(self._t, _key(key), _to_torch(v))

    # -- NumPy's protocols ------------------------------------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _array_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        impl = _FUNCTIONS.get(func)
        if impl is None:
            raise _refuse(f"NumPy's {_qualname(func)}")
        return impl(*args, **kwargs)

    # -- ndarray methods (the NumPy functions of the same name) -----------------------------
    def sum(self, *a, **k):
        return np.sum(self, *a, **k)

    def mean(self, *a, **k):
        return np.mean(self, *a, **k)

    def prod(self, *a, **k):
        return np.prod(self, *a, **k)

    def max(self, *a, **k):
        return np.max(self, *a, **k)

    def min(self, *a, **k):
        return np.min(self, *a, **k)

    def argmax(self, *a, **k):
        return np.argmax(self, *a, **k)

    def argmin(self, *a, **k):
        return np.argmin(self, *a, **k)

    def std(self, *a, **k):
        return np.std(self, *a, **k)

    def var(self, *a, **k):
        return np.var(self, *a, **k)

    def cumsum(self, *a, **k):
        return np.cumsum(self, *a, **k)

    def cumprod(self, *a, **k):
        return np.cumprod(self, *a, **k)

    def dot(self, b, out=None):
        return np.dot(self, b, out=out)

    def clip(self, *a, **k):
        return np.clip(self, *a, **k)

    def round(self, decimals=0, out=None):
        return np.round(self, decimals, out)

    def all(self, *a, **k):
        return np.all(self, *a, **k)

    def any(self, *a, **k):
        return np.any(self, *a, **k)

    def reshape(self, *shape, order="C"):
        return np.reshape(self, shape[0] if len(shape) == 1 else shape, order=order)

    def transpose(self, *axes):
        return np.transpose(self, axes[0] if len(axes) == 1 else (axes or None))

    def swapaxes(self, a, b):
        return np.swapaxes(self, a, b)

    def squeeze(self, axis=None):
        return np.squeeze(self, axis)

    def ravel(self, order="C"):
        return np.ravel(self, order)

    def flatten(self, order="C"):
        return np.ravel(self, order)

    def copy(self, order="C"):
        return np.copy(self)

    def conj(self):
        return np.conjugate(self)

    def conjugate(self):
        return np.conjugate(self)

    def sort(self, axis=-1):
        self._t = np.sort(self, axis)._t

    def argsort(self, axis=-1):
        return np.argsort(self, axis)

    def nonzero(self):
        return np.nonzero(self)

    def diagonal(self, offset=0, axis1=0, axis2=1):
        return np.diagonal(self, offset, axis1, axis2)

    def trace(self, offset=0, axis1=0, axis2=1):
        return np.trace(self, offset, axis1, axis2)

    def repeat(self, repeats, axis=None):
        return np.repeat(self, repeats, axis)

    def fill(self, value) -> None:
        self[...] = value

    def astype(self, dtype, copy=True):
        dt = np.dtype(dtype)
        if dt.kind == "f":
            # the format is the format: a float cast only relabels (as .float() on a tensor)
            return StochasticArray(self._t.clone() if copy else self._t, dt)
        if dt.kind == "b":
            return _wrap(_truth(self._t), dt)
        if dt.kind in "iu":
            return _wrap(self._t.to(torch.from_numpy(np.empty(0, dt)).dtype), dt)
        raise _refuse(f"astype({dt})")


def _qualname(func) -> str:
    mod = getattr(func, "__module__", "") or ""
    name = getattr(func, "__name__", str(func))
    if mod.startswith("numpy.linalg"):
        return f"np.linalg.{name}"
    if mod.startswith("numpy.fft"):
        return f"np.fft.{name}"
    return f"np.{name}"


def _key(key):
    """An index for the tensor inside: plain arrays as tensors, stochastic indices decided."""
    if isinstance(key, tuple):
        return tuple(_key(k) for k in key)
    if isinstance(key, (StochasticArray, StochasticTensor)):
        t = key._t if isinstance(key, StochasticArray) else key
        if t._st.samples.is_floating_point():
            raise IndexError("only integers, slices, ellipsis, None and integer or boolean "
                             "arrays are valid indices (got a floating stochastic value)")
        t._index = True
        return torch.as_tensor(_decided(t))
    if isinstance(key, (np.ndarray, list)):
        return torch.as_tensor(np.asarray(key))
    if isinstance(key, np.generic):
        return key.item()
    return key


def _set(t: StochasticTensor, key, v) -> StochasticTensor:
    """``t[key] = v`` without views: the selected elements' flat positions are found on an index
    tensor, then one ``index_put`` (exact) writes them; returns the updated tensor."""
    pos = torch.arange(t.numel()).reshape(t.shape)[key]
    flat = t.reshape(-1)
    vals = v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64)
    if t.is_floating_point() and not vals.is_floating_point():
        vals = vals.to(torch.float64)  # integers written into floats (NumPy casts them)
    vals = vals.expand(pos.shape) if vals.shape != pos.shape else vals
    out = flat.index_put((pos.reshape(-1),), vals.reshape(-1))
    return out.reshape(t.shape)


# --------------------------------------------------------------------------- ufuncs
def _truth(x):
    """NumPy's truth of a value, CESTAC style: floating values compare with 0 (``x != 0``,
    a CESTAC decision); booleans stay as they are."""
    x = _to_torch(x)
    if isinstance(x, torch.Tensor):
        return x != 0 if x.is_floating_point() or x.dtype != torch.bool else x
    return torch.tensor(bool(x))


def _cbrt(x):
    # torch has no cbrt: |x|**(1/3) (one rounding, to fp64 accuracy for an fp32 format) with
    # x's sign (exact; keeps -0.0)
    return torch.copysign(torch.abs(x).pow(1.0 / 3.0), x)


def _clone(x):
    return x.clone()


def _vecdot(a, b):
    return (_tensor(a).unsqueeze(-2) @ _tensor(b).unsqueeze(-1))[..., 0, 0]


def _matvec(m, v):
    return (_tensor(m) @ _tensor(v).unsqueeze(-1))[..., 0]


def _vecmat(v, m):
    return (_tensor(v).unsqueeze(-2) @ _tensor(m))[..., 0, :]


def _bin(fn):
    return lambda a, b: fn(_tensor(a), _tensor(b))


def _grid_step(x, toward):
    """The neighbour of each sample in the simulated format toward ``toward`` (NumPy's
    ``nextafter`` on the format's grid): a bit-level function of the samples, exact."""
    x, toward = _tensor(x), _tensor(toward)
    st = x if isinstance(x, StochasticTensor) else toward
    ctx = st._ctx
    xs = x._st.samples if isinstance(x, StochasticTensor) else \
        ctx.stack(x.to(ctx.working_dtype)).samples
    ys = toward._st.samples if isinstance(toward, StochasticTensor) else \
        toward.to(ctx.working_dtype).unsqueeze(0)
    nd = max(xs.dim(), ys.dim()) - 1
    xs = xs.reshape(xs.shape[:1] + (1,) * (nd + 1 - xs.dim()) + xs.shape[1:])
    ys = ys.reshape(ys.shape[:1] + (1,) * (nd + 1 - ys.dim()) + ys.shape[1:])
    up = quantize(torch.nextafter(xs, torch.full_like(xs, math.inf)), ctx.fmt, "up")
    down = quantize(torch.nextafter(xs, torch.full_like(xs, -math.inf)), ctx.fmt, "down")
    out = torch.where(ys > xs, up, torch.where(ys < xs, down, ys.expand_as(xs)))
    out = torch.where(torch.isnan(xs) | torch.isnan(ys), math.nan, out)
    from ..rules.aten import Stacked  # noqa: PLC0415 - the rules' value type
    return StochasticTensor(Stacked(out.contiguous()), ctx, st.dtype)


def _spacing(x):
    x = _tensor(x)
    s = x._st.samples
    away = torch.where(s < 0, -math.inf, math.inf)  # NumPy: spacing(-0.0) > 0
    from ..rules.aten import Stacked  # noqa: PLC0415
    return _grid_step(x, StochasticTensor(Stacked(away), x._ctx, x.dtype)) - x


def _logical(fn):
    return lambda *xs: fn(*[_truth(x) for x in xs])


def _ldexp(x, e):
    return torch.ldexp(_tensor(x), _tensor(e))


def _heaviside(x, h):
    x, h = _tensor(x), _tensor(h)
    r = torch.heaviside(x, h.to(x.dtype) if not isinstance(h, StochasticTensor) else h)
    return torch.where(torch.isnan(x), x, r)  # NumPy: NaN stays NaN (torch gives 0)


def _sign(x):
    return torch.where(torch.isnan(x), x, torch.sign(x))  # NumPy: sign(NaN) is NaN


def _frexp(x):
    m, e = torch.frexp(_tensor(x))
    return m, e


def _modf(x):
    x = _tensor(x)
    # NumPy: the fractional part of +-inf is +-0 (torch.frac gives NaN)
    frac = torch.where(torch.isinf(x), torch.copysign(torch.zeros((), dtype=x.dtype), x),
                       torch.frac(x))
    return frac, torch.trunc(x)


def _divmod(a, b):
    return operator.floordiv(a, b), operator.mod(a, b)


_UFUNCS: dict = {
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
        _UFUNCS[getattr(np, _name)] = _fn

#: The ufuncs stochastic arrays support (every other one raises a clear ``TypeError``).
SUPPORTED_UFUNCS = frozenset(u.__name__ for u in _UFUNCS)

# reductions and scans with a torch primitive of their own (the rest fold the binary ufunc)
_REDUCE = {np.add: "sum", np.multiply: "prod", np.maximum: "amax", np.minimum: "amin",
           np.fmax: "amax", np.fmin: "amin", np.logical_and: "all", np.logical_or: "any"}
_ACCUMULATE = {np.add: torch.cumsum, np.multiply: torch.cumprod,
               np.maximum: lambda t, d: torch.cummax(t, d).values,
               np.minimum: lambda t, d: torch.cummin(t, d).values}
_REORDERABLE = frozenset({np.add, np.multiply, np.maximum, np.minimum, np.fmax, np.fmin,
                          np.logical_and, np.logical_or, np.logical_xor})
_UFUNC_KWARGS = {"out", "where", "dtype", "casting", "order", "subok"}


def _is_ours(x) -> bool:
    return isinstance(x, (StochasticArray, StochasticTensor))


def _array_ufunc(ufunc, method, inputs, kwargs):
    impl = _UFUNCS.get(ufunc)
    if impl is None:
        raise _refuse(f"the ufunc np.{ufunc.__name__}")
    out = kwargs.pop("out", None)
    if out is not None and not isinstance(out, tuple):
        out = (out,)
    if method == "__call__":
        where = kwargs.pop("where", True)
        dtype = kwargs.pop("dtype", None)
        extra = set(kwargs) - _UFUNC_KWARGS
        if extra or kwargs.get("casting", "same_kind") not in ("same_kind", "unsafe", "safe"):
            raise _refuse(f"np.{ufunc.__name__}(..., {', '.join(sorted(kwargs))}=...)")
        dtypes = _numpy_dtypes(ufunc, inputs, dtype)
        res = impl(*[_to_torch(x) for x in inputs])
        many = isinstance(res, tuple)
        res = res if many else (res,)
        if where is not True:
            res = tuple(_masked(r, where, o) for r, o in
                        zip(res, out if out is not None else (None,) * len(res)))
        results = tuple(_wrap(r, d) for r, d in zip(res, dtypes * len(res) if len(dtypes) == 1
                                                    and many else dtypes))
        if out is not None:
            results = tuple(_store(o, r) if o is not None else r for o, r in zip(out, results))
        return results if many else results[0]
    if method == "reduce":
        (a,) = inputs
        return _reduce(ufunc, a, out=out[0] if out else None, **kwargs)
    if method == "accumulate":
        (a,) = inputs
        return _accumulate(ufunc, a, out=out[0] if out else None, **kwargs)
    if method == "outer":
        a, b = (_to_torch(x) for x in inputs)
        nb = b.dim() if isinstance(b, torch.Tensor) else 0
        if isinstance(a, torch.Tensor):
            a = a.reshape(tuple(a.shape) + (1,) * nb)
        return _array_ufunc(ufunc, "__call__", (_wrap(a), _wrap(b)),
                            dict(kwargs, **({"out": out} if out else {})))
    raise _refuse(f"np.{ufunc.__name__}.{method}")


def _masked(r, where, old):
    """``where=``: the result where the mask holds, else the ``out`` array's old values (0
    without ``out``: exact, where NumPy leaves uninitialised memory)."""
    mask = _tensor(where) if not _is_ours(where) else _truth(where)
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
        mask = mask != 0
    other = _to_torch(old) if old is not None else torch.zeros((), dtype=torch.float64)
    return torch.where(mask, r, other)


def _store(out, r):
    """``out=``: the result becomes the out array's contents (samples rebound, its dtype kept)."""
    if isinstance(out, StochasticTensor):
        t = _to_torch(r) if isinstance(r, StochasticArray) else r
        if not isinstance(t, StochasticTensor):
            t = stochastic(torch.as_tensor(np.asarray(t), dtype=out.dtype), context=out._ctx)
        out._st = t.expand(out.shape)._st
        return out
    if not isinstance(out, StochasticArray):
        raise TypeError(f"fxstab: out= must be a stochastic array (got "
                        f"{type(out).__name__}): a plain array cannot hold the samples. Make "
                        f"one with np.empty_like(x) on a stochastic x, or drop out=")
    t = _to_torch(r)
    if not isinstance(t, StochasticTensor):
        t = stochastic(torch.as_tensor(np.asarray(t)).to(torch.float64), context=out._t._ctx)
    if tuple(torch.broadcast_shapes(t.shape, out._t.shape)) != out.shape:
        raise ValueError(f"fxstab: a result of shape {tuple(t.shape)} does not fit out= of "
                         f"shape {out.shape}")
    out._t = t.expand(out.shape) if tuple(t.shape) != out.shape else t
    return out


def _norm_axes(axis, ndim: int) -> tuple:
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


_NO_VALUE = np._NoValue


def _reduce(ufunc, a, axis=0, dtype=None, out=None, keepdims=False, initial=_NO_VALUE,
            where=True):
    """``ufunc.reduce``: sum/prod/amax/amin/all/any where torch has the reduction (one
    primitive, as ``x.sum()`` in torch code), else a left fold of the binary ufunc over the
    axis (NumPy's order)."""
    t = _to_torch(a)
    if not isinstance(t, torch.Tensor):
        t = _tensor(t)
    axes = _norm_axes(axis, t.dim())
    if len(axes) > 1 and ufunc not in _REORDERABLE:
        raise ValueError(f"reduction operation '{ufunc.__name__}' is not reorderable, so at "
                         f"most one axis may be specified")
    dt = dtype if dtype is not None else _numpy_dtypes(ufunc, (a, a))[0]
    kind = _REDUCE.get(ufunc)
    if where is not True:
        fill = ufunc.identity if initial is _NO_VALUE else initial
        if fill is None:
            raise ValueError(f"reduction operation '{ufunc.__name__}' does not have an "
                             f"identity, so to use a where mask one has to specify 'initial'")
        t = torch.where(_masked_cond(where), t, _tensor(fill))
    if kind in ("all", "any"):
        t = _truth(t)
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
        fn = _UFUNCS[ufunc]
        (d,) = axes
        if t.shape[d] == 0:
            if ufunc.identity is None and initial is _NO_VALUE:
                raise ValueError(f"zero-size array to reduction operation {ufunc.__name__} "
                                 f"which has no identity")
            r = torch.full(t.shape[:d] + t.shape[d + 1:],
                           float(ufunc.identity if initial is _NO_VALUE else initial))
            initial = _NO_VALUE
        else:
            r = t.select(d, 0)
            for i in range(1, t.shape[d]):
                r = fn(r, t.select(d, i))
        if keepdims:
            r = r.unsqueeze(d)
    if initial is not _NO_VALUE and where is True:
        r = _UFUNCS[ufunc](initial, r)
    res = _wrap(r, dt)
    return _store(out, res) if out is not None else res


def _masked_cond(where):
    m = _truth(where) if _is_ours(where) else _tensor(where)
    return m if m.dtype == torch.bool else m != 0


def _accumulate(ufunc, a, axis=0, dtype=None, out=None):
    """``ufunc.accumulate``: cumsum/cumprod/cummax/cummin, else the running left fold."""
    t = _tensor(a)
    (d,) = _norm_axes(axis, t.dim()) if t.dim() else (0,)
    dt = dtype if dtype is not None else _numpy_dtypes(ufunc, (a, a))[0]
    scan = _ACCUMULATE.get(ufunc)
    if scan is not None:
        r = scan(t, d)
    else:
        fn = _UFUNCS[ufunc]
        parts = [t.select(d, 0)] if t.shape[d] else []
        for i in range(1, t.shape[d]):
            parts.append(fn(parts[-1], t.select(d, i)))
        r = torch.stack(parts, d) if parts else t.clone()
    res = _wrap(r, dt)
    return _store(out, res) if out is not None else res


# --------------------------------------------------------------------------- array functions
_FUNCTIONS: dict = {}


def _implements(*funcs):
    def deco(impl):
        for f in funcs:
            if f is not None:
                _FUNCTIONS[f] = impl
        return impl
    return deco


def _out(res, out):
    return _store(out, res) if out is not None else res


@_implements(np.sum)
def _sum(a, axis=None, dtype=None, out=None, keepdims=False, initial=_NO_VALUE, where=True):
    return _reduce(np.add, a, axis, dtype, out, keepdims, initial, where)


@_implements(np.prod)
def _prod(a, axis=None, dtype=None, out=None, keepdims=False, initial=_NO_VALUE, where=True):
    return _reduce(np.multiply, a, axis, dtype, out, keepdims, initial, where)


@_implements(np.max, np.amax)
def _max(a, axis=None, out=None, keepdims=False, initial=_NO_VALUE, where=True):
    return _reduce(np.maximum, a, axis, None, out, keepdims, initial, where)


@_implements(np.min, np.amin)
def _min(a, axis=None, out=None, keepdims=False, initial=_NO_VALUE, where=True):
    return _reduce(np.minimum, a, axis, None, out, keepdims, initial, where)


@_implements(np.all)
def _all(a, axis=None, out=None, keepdims=False, *, where=True):
    return _reduce(np.logical_and, a, axis, None, out, keepdims, _NO_VALUE, where)


@_implements(np.any)
def _any(a, axis=None, out=None, keepdims=False, *, where=True):
    return _reduce(np.logical_or, a, axis, None, out, keepdims, _NO_VALUE, where)


def _count(a, axes) -> int:
    shape = np.shape(a)
    return math.prod(shape[d] for d in axes)


@_implements(np.mean)
def _np_mean(a, axis=None, dtype=None, out=None, keepdims=False, *, where=True):
    t = _tensor(a)
    axes = _norm_axes(axis, t.dim())
    dt = dtype if dtype is not None else _result_dtype(a, 1.0)
    if where is not True:
        s = _reduce(np.add, a, axes, dt, None, keepdims, _NO_VALUE, where)
        n = np.sum(np.broadcast_to(_plain_mask(where), t.shape), axis=axes, keepdims=keepdims)
        return _out(np.true_divide(s, n), out)
    if not axes:
        r = t.clone()
    elif len(axes) == t.dim() and not keepdims:
        r = torch.mean(t)
    else:
        r = torch.mean(t, dim=axes, keepdim=keepdims)
    return _out(_wrap(r, dt), out)


def _plain_mask(where) -> np.ndarray:
    m = _masked_cond(where)
    return _wrap(m) if not isinstance(m, StochasticTensor) else _decided(m)


@_implements(np.var)
def _var(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, where=True,
         mean=_NO_VALUE, correction=_NO_VALUE):
    """NumPy's own algorithm (``numpy._core._methods._var``): the mean, the deviations, their
    squares, their sum, divided by ``n - ddof``."""
    if where is not True:
        raise _refuse("np.var(..., where=...)")
    if correction is not _NO_VALUE:
        ddof = correction
    axes = _norm_axes(axis, len(np.shape(a)))
    n = _count(a, axes)
    m = np.sum(a, axis=axes, keepdims=True, dtype=dtype) / n if mean is _NO_VALUE else mean
    x = np.subtract(a, m)
    x = np.multiply(x, x)
    r = np.sum(x, axis=axes, dtype=dtype, keepdims=keepdims)
    return _out(np.true_divide(r, max(n - ddof, 0)), out)


@_implements(np.std)
def _std(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, where=True,
         mean=_NO_VALUE, correction=_NO_VALUE):
    return _out(np.sqrt(_var(a, axis, dtype, None, ddof, keepdims, where=where, mean=mean,
                             correction=correction)), out)


@_implements(np.average)
def _average(a, axis=None, weights=None, returned=False, *, keepdims=False):
    if weights is None:
        avg = np.mean(a, axis=axis, keepdims=keepdims)
        scl = _count(a, _norm_axes(axis, len(np.shape(a))))
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
    t = _tensor(a)
    r = torch.argmax(t.reshape(-1)) if axis is None else torch.argmax(t, dim=axis,
                                                                      keepdim=keepdims)
    r = _indices(r)
    if axis is None and keepdims:
        r = np.reshape(r, (1,) * t.dim())
    return r


@_implements(np.argmin)
def _argmin(a, axis=None, out=None, *, keepdims=False):
    t = _tensor(a)
    r = torch.argmin(t.reshape(-1)) if axis is None else torch.argmin(t, dim=axis,
                                                                      keepdim=keepdims)
    r = _indices(r)
    if axis is None and keepdims:
        r = np.reshape(r, (1,) * t.dim())
    return r


@_implements(np.cumsum)
def _cumsum(a, axis=None, dtype=None, out=None):
    t = _tensor(a)
    if axis is None:
        a, axis = _wrap(t.reshape(-1), np.result_type(_dummy(a))), 0
    return _accumulate(np.add, a, axis, dtype, out)


@_implements(np.cumprod)
def _cumprod(a, axis=None, dtype=None, out=None):
    t = _tensor(a)
    if axis is None:
        a, axis = _wrap(t.reshape(-1), np.result_type(_dummy(a))), 0
    return _accumulate(np.multiply, a, axis, dtype, out)


@_implements(np.dot)
def _dot(a, b, out=None):
    """NumPy's dot: a product for 0-d operands, ``@`` for vectors and matrices (the GEMM rules),
    a contraction of a's last axis with b's second-to-last above."""
    ta, tb = _to_torch(a), _to_torch(b)
    na = ta.dim() if isinstance(ta, torch.Tensor) else 0
    nb = tb.dim() if isinstance(tb, torch.Tensor) else 0
    if na == 0 or nb == 0:
        return _out(np.multiply(a, b), out)
    if na <= 2 and nb <= 2:
        r = operator.matmul(ta, tb)
    else:
        r = torch.tensordot(_tensor(ta), _tensor(tb), dims=([na - 1], [max(nb - 2, 0)]))
    return _out(_wrap(r, _result_dtype(a, b)), out)


@_implements(np.vdot)
def _vdot(a, b):
    return _dot(np.ravel(a), np.ravel(b))


@_implements(np.inner)
def _inner(a, b):
    ta, tb = _tensor(a), _tensor(b)
    if ta.dim() == 0 or tb.dim() == 0:
        return np.multiply(a, b)
    return _wrap(torch.tensordot(ta, tb, dims=([-1], [-1])), _result_dtype(a, b))


@_implements(np.outer)
def _outer(a, b, out=None):
    return np.multiply.outer(np.ravel(a), np.ravel(b), **({"out": out} if out is not None else {}))


@_implements(np.tensordot)
def _tensordot(a, b, axes=2):
    ta, tb = _tensor(a), _tensor(b)
    if isinstance(axes, int):
        dims = axes
    else:
        xa, xb = axes
        dims = ([xa] if isinstance(xa, int) else list(xa),
                [xb] if isinstance(xb, int) else list(xb))
    return _wrap(torch.tensordot(ta, tb, dims=dims), _result_dtype(a, b))


@_implements(np.einsum)
def _einsum(subscripts, *operands, out=None, dtype=None, optimize=False, **kwargs):
    if not isinstance(subscripts, str) or kwargs:
        raise _refuse("np.einsum in its interleaved form or with order/casting")
    r = torch.einsum(subscripts, *[_tensor(x) for x in operands])
    return _out(_wrap(r, dtype or _result_dtype(*operands)), out)


@_implements(np.trace)
def _trace(a, offset=0, axis1=0, axis2=1, dtype=None, out=None):
    return np.sum(np.diagonal(a, offset, axis1, axis2), axis=-1, dtype=dtype, out=out)


@_implements(np.where)
def _where(condition, x=_NO_VALUE, y=_NO_VALUE):
    if x is _NO_VALUE and y is _NO_VALUE:
        return np.nonzero(condition)
    if x is _NO_VALUE or y is _NO_VALUE:
        raise ValueError("either both or neither of x and y should be given")
    cond = _masked_cond(condition)
    r = torch.where(cond, _tensor(x), _tensor(y))
    return _wrap(r, _result_dtype(x, y))


@_implements(np.nonzero)
def _nonzero(a):
    t = _truth(a)
    return np.nonzero(_decided(t) if isinstance(t, StochasticTensor) else _wrap(t))


@_implements(np.count_nonzero)
def _count_nonzero(a, axis=None, *, keepdims=False):
    t = _truth(a)
    return np.count_nonzero(_decided(t) if isinstance(t, StochasticTensor) else _wrap(t),
                            axis=axis, keepdims=keepdims)


@_implements(np.clip)
def _clip(a, a_min=_NO_VALUE, a_max=_NO_VALUE, out=None, *, min=_NO_VALUE, max=_NO_VALUE,
          **kwargs):
    lo = a_min if a_min is not _NO_VALUE else min
    hi = a_max if a_max is not _NO_VALUE else max
    lo = None if lo is _NO_VALUE else lo
    hi = None if hi is _NO_VALUE else hi
    if lo is None and hi is None:
        raise ValueError("One of max or min must be given")
    t = _tensor(a)
    lo_t = None if lo is None else _to_torch(lo)
    hi_t = None if hi is None else _to_torch(hi)
    if isinstance(lo_t, torch.Tensor) or isinstance(hi_t, torch.Tensor):
        lo_t = None if lo_t is None else _tensor(lo_t)
        hi_t = None if hi_t is None else _tensor(hi_t)
    r = torch.clamp(t, lo_t, hi_t)
    return _out(_wrap(r, _result_dtype(a, lo, hi)), out)


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
    ts = [_tensor(x) for x in arrays]
    if axis is None:
        ts, axis = [t.reshape(-1) for t in ts], 0
    r = torch.cat(ts, dim=axis)
    return _out(_wrap(r, dtype or _result_dtype(*arrays)), out)


@_implements(np.stack)
def _stack(arrays, axis=0, out=None, *, dtype=None, casting="same_kind"):
    arrays = _seq(arrays)
    r = torch.stack([_tensor(x) for x in arrays], dim=axis)
    return _out(_wrap(r, dtype or _result_dtype(*arrays)), out)


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
            if not _is_ours(x):
                out.append(getattr(np, f"atleast_{nd}d")(x))
                continue
            t = _tensor(x)
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
        raise _refuse(f"np.reshape(..., order={order!r})")
    shape = newshape if shape is None else shape
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return _wrap(_tensor(a).reshape(shape), np.result_type(_dummy(a)))


@_implements(np.ravel)
def _ravel(a, order="C"):
    return np.reshape(a, -1, order=order)


@_implements(np.transpose)
def _transpose(a, axes=None):
    t = _tensor(a)
    axes = tuple(reversed(range(t.dim()))) if axes is None else tuple(axes)
    return _wrap(t.permute(axes), np.result_type(_dummy(a)))


@_implements(np.swapaxes)
def _swapaxes(a, axis1, axis2):
    return _wrap(_tensor(a).transpose(axis1, axis2), np.result_type(_dummy(a)))


@_implements(np.moveaxis)
def _moveaxis(a, source, destination):
    return _wrap(torch.movedim(_tensor(a), source, destination), np.result_type(_dummy(a)))


@_implements(np.squeeze)
def _squeeze(a, axis=None):
    t = _tensor(a)
    if axis is None:
        r = t.squeeze()
    else:
        axes = _norm_axes(axis, t.dim())
        for d in axes:
            if t.shape[d] != 1:
                raise ValueError("cannot select an axis to squeeze out which has size not "
                                 "equal to one")
        r = t.reshape(tuple(s for i, s in enumerate(t.shape) if i not in axes))
    return _wrap(r, np.result_type(_dummy(a)))


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
    return _wrap(_tensor(array).expand(shape).clone(), np.result_type(_dummy(array)))


@_implements(np.flip)
def _flip(m, axis=None):
    t = _tensor(m)
    return _wrap(torch.flip(t, _norm_axes(axis, t.dim())), np.result_type(_dummy(m)))


@_implements(np.roll)
def _roll(a, shift, axis=None):
    t = _tensor(a)
    r = torch.roll(t.reshape(-1), shift).reshape(t.shape) if axis is None else \
        torch.roll(t, shift, axis)
    return _wrap(r, np.result_type(_dummy(a)))


@_implements(np.tile)
def _tile(a, reps):
    reps = (reps,) if isinstance(reps, int) else tuple(reps)
    return _wrap(_tensor(a).tile(reps), np.result_type(_dummy(a)))


@_implements(np.repeat)
def _repeat(a, repeats, axis=None):
    t = _tensor(a)
    if axis is None:
        t, axis = t.reshape(-1), 0
    r = torch.repeat_interleave(t, torch.as_tensor(repeats) if not isinstance(repeats, int)
                                else repeats, dim=axis)
    return _wrap(r, np.result_type(_dummy(a)))


@_implements(np.diagonal)
def _diagonal(a, offset=0, axis1=0, axis2=1):
    return _wrap(torch.diagonal(_tensor(a), offset, axis1, axis2), np.result_type(_dummy(a)))


@_implements(np.diag)
def _diag(v, k=0):
    return _wrap(torch.diag(_tensor(v), k), np.result_type(_dummy(v)))


@_implements(np.triu)
def _triu(m, k=0):
    return _wrap(torch.triu(_tensor(m), k), np.result_type(_dummy(m)))


@_implements(np.tril)
def _tril(m, k=0):
    return _wrap(torch.tril(_tensor(m), k), np.result_type(_dummy(m)))


@_implements(np.take)
def _take(a, indices, axis=None, out=None, mode="raise"):
    t = _tensor(a)
    idx = _key(indices)
    idx = torch.as_tensor(idx)
    r = t.reshape(-1)[idx] if axis is None else torch.index_select(
        t, axis, idx.reshape(-1)).reshape(t.shape[:axis % t.dim()] + idx.shape +
                                          t.shape[axis % t.dim() + 1:])
    return _out(_wrap(r, np.result_type(_dummy(a))), out)


@_implements(np.sort)
def _sort(a, axis=-1, kind=None, order=None, *, stable=None):
    t = _tensor(a)
    if axis is None:
        t, axis = t.reshape(-1), -1
    return _wrap(torch.sort(t, dim=axis).values, np.result_type(_dummy(a)))


@_implements(np.argsort)
def _argsort(a, axis=-1, kind=None, order=None, *, stable=None):
    t = _tensor(a)
    if axis is None:
        t, axis = t.reshape(-1), -1
    return _indices(torch.sort(t, dim=axis, stable=True).indices)


@_implements(np.diff)
def _diff(a, n=1, axis=-1, prepend=_NO_VALUE, append=_NO_VALUE):
    """NumPy's algorithm: ``a[1:] - a[:-1]`` along the axis, n times."""
    if prepend is not _NO_VALUE or append is not _NO_VALUE:
        parts = ([np.broadcast_to(prepend, _side(a, axis))] if prepend is not _NO_VALUE
                 else []) + [a] + ([np.broadcast_to(append, _side(a, axis))]
                                   if append is not _NO_VALUE else [])
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
    return _wrap(_tensor(a).clone(), np.result_type(_dummy(a)))


def _like(fill):
    def impl(prototype, dtype=None, order="K", subok=True, shape=None, *, device=None,
             fill_value=None):
        t = _tensor(prototype)
        shape = tuple(t.shape) if shape is None else ((shape,) if isinstance(shape, int)
                                                       else tuple(shape))
        dt = np.dtype(dtype) if dtype is not None else np.result_type(_dummy(prototype))
        value = fill if fill is not None else fill_value
        base = np.full(shape, value, dtype=dt if dt.kind == "f" else np.float64)
        if not isinstance(t, StochasticTensor) or dt.kind != "f":
            return np.full(shape, value, dtype=dt)
        return StochasticArray(stochastic(torch.from_numpy(base), context=t._ctx), dt)
    return impl


_implements(np.zeros_like)(_like(0.0))
_implements(np.empty_like)(_like(0.0))
_implements(np.ones_like)(_like(1.0))


@_implements(np.full_like)
def _full_like(a, fill_value, dtype=None, order="K", subok=True, shape=None, *, device=None):
    return _like(None)(a, dtype, order, subok, shape, fill_value=fill_value)


@_implements(np.shape)
def _shape(a):
    return tuple(_tensor(a).shape)


@_implements(np.ndim)
def _ndim(a):
    return _tensor(a).dim()


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
    return _decided(x._t) if isinstance(x, StochasticArray) else x


@_implements(np.allclose)
def _allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    return bool(np.all(_isclose(a, b, rtol, atol, equal_nan)))


@_implements(np.polyval)
def _polyval(p, x):
    """Horner's scheme, as NumPy's polyval: ``y = y * x + p[i]``."""
    y = np.zeros_like(x) if _is_ours(x) else 0.0
    for pv in (p if not _is_ours(p) else list(p)):
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
            t = _truth(x)
            d = _decided(t) if isinstance(t, StochasticTensor) else _wrap(t)
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
            raise _refuse(f"np.linalg.norm(..., ord={ord!r}) (it needs an SVD)")
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


#: The array functions stochastic arrays support (others raise a clear ``TypeError``).
SUPPORTED_FUNCTIONS = frozenset(_qualname(f) for f in _FUNCTIONS)


# --------------------------------------------------------------------------- torch values
def as_numpy_value(x: StochasticTensor) -> StochasticArray:
    """A stochastic tensor as a stochastic array (the same samples; NumPy results)."""
    return StochasticArray(x, _np_dtype(x.dtype))


def _to_array_side(x):
    if isinstance(x, StochasticTensor):
        return as_numpy_value(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_array_side(v) for v in x)
    return x


def _to_tensor_side(x):
    if isinstance(x, StochasticArray):
        return x._t
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x) if x.dtype.kind in "biuf" else x
    if isinstance(x, (list, tuple)):
        return type(x)(_to_tensor_side(v) for v in x)
    return x


def tensor_array_ufunc(ufunc, method, inputs, kwargs):
    """NumPy ufuncs on stochastic *tensors*: the same rules, results back as tensors."""
    out = kwargs.get("out")
    if out is not None:
        kwargs = dict(kwargs, out=tuple(o if isinstance(o, StochasticTensor) else o
                                        for o in (out if isinstance(out, tuple) else (out,))))
    return _to_tensor_side(_array_ufunc(ufunc, method, _to_array_side(tuple(inputs)), kwargs))


def tensor_array_function(func, args, kwargs):
    """NumPy array functions on stochastic tensors: the same rules, results back as tensors."""
    impl = _FUNCTIONS.get(func)
    if impl is None:
        raise _refuse(f"NumPy's {_qualname(func)}")
    kwargs = {k: _to_array_side(v) for k, v in kwargs.items()}
    return _to_tensor_side(impl(*_to_array_side(tuple(args)), **kwargs))
