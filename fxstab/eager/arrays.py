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

The modules: this one holds the value (:class:`StochasticArray`, the conversions between NumPy
and the stochastic tensors inside, the tables NumPy's protocols look up) and registers it with
the eager driver (:func:`fxstab.eager.stochastic.register_value_type`: that module never imports
this one); :mod:`fxstab.eager.ufuncs` (the ufuncs and their methods) and
:mod:`fxstab.eager.array_functions` (``np.sum``, ``np.dot``...) fill the tables, as JAX's rule
modules fill its primitive tables. ``import fxstab`` imports all three (``fxstab/eager``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from numpy.lib.mixins import NDArrayOperatorsMixin

from .stochastic import (
    StochasticTensor, ValueType, assign, decide, index_key, register_value_type, sample_mean,
    set_items, stochastic,
)

__all__ = ["StochasticArray", "SUPPORTED_UFUNCS", "SUPPORTED_FUNCTIONS", "as_numpy_value",
           "PROTOCOLS", "refuse", "np_dtype", "to_torch", "to_tensor", "dummy", "numpy_dtypes",
           "result_dtype", "wrap", "decided_indices", "truth", "is_stochastic", "store",
           "qualname"]

_LEAVE = ("leave the analysis with np.asarray(x.value) (the sample mean) or write it with the "
          "supported NumPy operations (fxstab.eager.arrays.SUPPORTED_UFUNCS and "
          "SUPPORTED_FUNCTIONS list them)")


def refuse(what: str) -> TypeError:
    """The ``TypeError`` for an operation stochastic arrays do not support (``what``)."""
    return TypeError(f"fxstab: {what} is not supported on stochastic arrays; {_LEAVE}")


# --------------------------------------------------------------------------- dtypes, conversion
def np_dtype(td: torch.dtype) -> np.dtype:
    """The NumPy dtype of a torch dtype (bfloat16: float32)."""
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


def to_torch(x: Any) -> Any:
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
            return torch.stack([torch.as_tensor(to_torch(v), dtype=torch.float64)
                                if not isinstance(v, (StochasticArray, StochasticTensor))
                                else to_torch(v) for v in x])
        return _torch_of(np.asarray(x))
    if isinstance(x, (bool, int, float)) or x is None:
        return x
    raise TypeError(f"fxstab: a {type(x).__name__} cannot enter the analysis of a NumPy "
                    f"operation (stochastic arrays, NumPy arrays and Python numbers can)")


def to_tensor(x: Any) -> torch.Tensor:
    """As :func:`to_torch`, a number as a 0-d tensor (for torch functions that need one)."""
    x = to_torch(x)
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, bool):
        return torch.tensor(x)
    if isinstance(x, int):
        return torch.tensor(x, dtype=torch.int64)
    return torch.tensor(x, dtype=torch.float64)


def dummy(x: Any) -> Any:
    """A stand-in with the operand's NumPy dtype (0-d, or the Python number itself: NumPy's
    promotion treats those as weak), to ask NumPy what dtype its own operation would return."""
    if isinstance(x, StochasticArray):
        return np.ones((), x.dtype)
    if isinstance(x, np.ndarray):
        return np.ones((), x.dtype)
    if isinstance(x, np.generic):
        return x
    if isinstance(x, torch.Tensor):
        return np.ones((), np_dtype(x.dtype))
    if isinstance(x, (list, tuple)):
        return np.ones((), np.result_type(*[dummy(v) for v in x])) if x else np.ones(())
    return x


def numpy_dtypes(fn: Callable, inputs: tuple, dtype=None) -> list:
    """The dtype(s) NumPy's own ``fn`` gives for operands of these dtypes (``None`` if it
    cannot tell)."""
    try:
        with np.errstate(all="ignore"):
            r = fn(*[dummy(x) for x in inputs], **({} if dtype is None else {"dtype": dtype}))
    except Exception:  # noqa: BLE001 - e.g. an operand kind NumPy rejects on a 0-d stand-in
        return [None]
    return [np.asarray(v).dtype for v in (r if isinstance(r, tuple) else (r,))]


def result_dtype(*operands) -> np.dtype:
    """NumPy's result dtype for these operands (``None`` ones left out)."""
    return np.result_type(*[dummy(x) for x in operands if x is not None])


def wrap(r: Any, dtype: Optional[np.dtype] = None, *, decided: bool = False) -> Any:
    """A torch-side result back in NumPy: stochastic tensors as stochastic arrays (floating ones
    with NumPy's dtype), plain tensors as ndarrays (0-d: NumPy scalars). ``decided``: integer or
    boolean samples become one plain array (majority, counted when samples disagree)."""
    if isinstance(r, StochasticTensor):
        if decided and not r.samples.is_floating_point():
            return decide(r)
        if r.samples.is_floating_point():
            dt = dtype if dtype is not None and np.dtype(dtype).kind == "f" else np_dtype(r.dtype)
        else:
            dt = dtype if dtype is not None and np.dtype(dtype).kind in "biu" else \
                np_dtype(r.dtype)
        return StochasticArray(r, dt)
    if isinstance(r, torch.Tensor):
        a = r.detach().numpy() if r.dtype != torch.bfloat16 else r.float().numpy()
        if dtype is not None and np.dtype(dtype).kind == a.dtype.kind:
            a = a.astype(dtype, copy=False)
        return a[()] if a.ndim == 0 else a
    if isinstance(r, (tuple, list)):
        return type(r)(wrap(v, dtype, decided=decided) for v in r)
    return r


def decided_indices(t: Any) -> Any:
    """An index result (argmax, argsort...): decided (plain), disagreement = branching."""
    if isinstance(t, StochasticTensor):
        return decide(t, index=True)
    return wrap(t)


def truth(x):
    """NumPy's truth of a value, CESTAC style: floating values compare with 0 (``x != 0``,
    a CESTAC decision); booleans stay as they are."""
    x = to_torch(x)
    if isinstance(x, torch.Tensor):
        return x != 0 if x.is_floating_point() or x.dtype != torch.bool else x
    return torch.tensor(bool(x))


def is_stochastic(x) -> bool:
    """Whether ``x`` carries samples (a stochastic array or tensor)."""
    return isinstance(x, (StochasticArray, StochasticTensor))


def store(out, r):
    """``out=``: the result becomes the out array's contents (samples rebound, its dtype kept)."""
    if isinstance(out, StochasticTensor):
        t = to_torch(r) if isinstance(r, StochasticArray) else r
        if not isinstance(t, StochasticTensor):
            t = stochastic(torch.as_tensor(np.asarray(t), dtype=out.dtype), context=out.context)
        assign(out, t.expand(out.shape))
        return out
    if not isinstance(out, StochasticArray):
        raise TypeError(f"fxstab: out= must be a stochastic array (got "
                        f"{type(out).__name__}): a plain array cannot hold the samples. Make "
                        f"one with np.empty_like(x) on a stochastic x, or drop out=")
    t = to_torch(r)
    if not isinstance(t, StochasticTensor):
        t = stochastic(torch.as_tensor(np.asarray(t)).to(torch.float64), context=out._t.context)
    if tuple(torch.broadcast_shapes(t.shape, out._t.shape)) != out.shape:
        raise ValueError(f"fxstab: a result of shape {tuple(t.shape)} does not fit out= of "
                         f"shape {out.shape}")
    out._t = t.expand(out.shape) if tuple(t.shape) != out.shape else t
    return out


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
        self._dtype = np.dtype(dtype) if dtype is not None else np_dtype(tensor.dtype)

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
        return self._t.context

    @property
    def samples(self) -> np.ndarray:
        return self._t.samples.numpy().copy()

    @property
    def value(self) -> Any:
        a = sample_mean(self._t.samples).numpy().astype(self._dtype)
        return a[()] if a.ndim == 0 else a

    @property
    def digits(self) -> Any:
        d = self._t.digits.double().numpy()
        return d[()] if d.ndim == 0 else d

    # -- Python conversions: CESTAC -------------------------------------------------------
    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is "
                             "ambiguous. Use a.any() or a.all()")
        if self._t.samples.is_floating_point():
            return bool(self != 0)  # CESTAC: false when x is an exact or computational zero
        return bool(decide(self._t.reshape(())))

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
        raise refuse(f"ndarray.{name}")

    # -- printing: CADNA's style, as for tensors ----------------------------------------------
    def __str__(self) -> str:
        if not self._t.samples.is_floating_point():
            return str(self.value)  # integers, booleans: NumPy's printing of sample 0
        return str(self._t)

    def __repr__(self) -> str:
        ctx = self._t.context
        return (f"StochasticArray({self}, dtype={self._dtype}, format={ctx.fmt.name}, "
                f"n_samples={ctx.n_samples})")

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else format(float(self), spec)

    # -- indexing ---------------------------------------------------------------------------
    def __getitem__(self, key) -> Any:
        return wrap(self._t[index_key(key)], self._dtype)

    def __setitem__(self, key, v) -> None:
        self._t = set_items(self._t, index_key(key), to_torch(v))

    # -- NumPy's protocols ------------------------------------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _protocol_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        impl = PROTOCOLS.functions.get(func)
        if impl is None:
            raise refuse(f"NumPy's {qualname(func)}")
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
            return wrap(truth(self._t), dt)
        if dt.kind in "iu":
            return wrap(self._t.to(torch.from_numpy(np.empty(0, dt)).dtype), dt)
        raise refuse(f"astype({dt})")


def qualname(func) -> str:
    """How an error names a NumPy function: ``np.sum``, ``np.linalg.norm``..."""
    mod = getattr(func, "__module__", "") or ""
    name = getattr(func, "__name__", str(func))
    if mod.startswith("numpy.linalg"):
        return f"np.linalg.{name}"
    if mod.startswith("numpy.fft"):
        return f"np.fft.{name}"
    return f"np.{name}"


# --------------------------------------------------------------------------- NumPy's protocols
@dataclass
class Protocols:
    """What NumPy's protocols run on stochastic values, filled by the modules that implement
    them (imported with ``fxstab.eager``); this module, below them, only looks them up.

    Attributes:
        ufunc: ``(ufunc, method, inputs, kwargs)``: a ufunc call or method (``reduce``,
            ``accumulate``, ``outer``, ``out=``, ``where=``): :mod:`fxstab.eager.ufuncs`.
        ufuncs: ufunc -> the torch operation a torch program writes for it (the supported ones).
        functions: NumPy function -> its implementation on stochastic values:
            :mod:`fxstab.eager.array_functions`.
    """

    ufunc: Optional[Callable] = None
    ufuncs: dict = field(default_factory=dict)
    functions: dict = field(default_factory=dict)


PROTOCOLS = Protocols()


def _protocol_ufunc(ufunc, method, inputs, kwargs):
    if PROTOCOLS.ufunc is None:
        raise refuse(f"the ufunc np.{ufunc.__name__} (fxstab.eager.ufuncs is not loaded)")
    return PROTOCOLS.ufunc(ufunc, method, inputs, kwargs)


def __getattr__(name: str) -> Any:
    # the supported lists, from the tables their modules filled (after this module's import)
    if name == "SUPPORTED_UFUNCS":
        #: The ufuncs stochastic arrays support (every other one raises a clear ``TypeError``).
        return frozenset(u.__name__ for u in PROTOCOLS.ufuncs)
    if name == "SUPPORTED_FUNCTIONS":
        #: The array functions stochastic arrays support (others raise a clear ``TypeError``).
        return frozenset(qualname(f) for f in PROTOCOLS.functions)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------- torch values
def as_numpy_value(x: StochasticTensor) -> StochasticArray:
    """A stochastic tensor as a stochastic array (the same samples; NumPy results)."""
    return StochasticArray(x, np_dtype(x.dtype))


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
    return _to_tensor_side(_protocol_ufunc(ufunc, method, _to_array_side(tuple(inputs)),
                                           kwargs))


def tensor_array_function(func, args, kwargs):
    """NumPy array functions on stochastic tensors: the same rules, results back as tensors."""
    impl = PROTOCOLS.functions.get(func)
    if impl is None:
        raise refuse(f"NumPy's {qualname(func)}")
    kwargs = {k: _to_array_side(v) for k, v in kwargs.items()}
    return _to_tensor_side(impl(*_to_array_side(tuple(args)), **kwargs))


# --------------------------------------------------------------------------- joining the analysis
def _lift(x: Any, ctx) -> StochasticArray:
    """``fxstab.stochastic(np_array)``: the array rounded to nearest into the format, as N
    identical samples, with its NumPy dtype."""
    if isinstance(x, np.generic) and not isinstance(x, (np.floating, np.integer)) or \
            isinstance(x, np.ndarray) and x.dtype.kind not in "iuf":
        raise ValueError(f"fxstab.stochastic needs floating values, got NumPy dtype "
                         f"{x.dtype}; convert with .astype(np.float64) first")
    a = np.asarray(x)
    a = a if a.dtype.kind == "f" else a.astype(np.float64)
    # long double enters as float64 (torch has no wider dtype; the format is narrower)
    w = a if a.dtype.itemsize <= 8 else a.astype(np.float64)
    t = stochastic(torch.from_numpy(np.array(w, copy=True, order="C")), context=ctx)
    return StochasticArray(t, a.dtype)


register_value_type(ValueType(StochasticArray, (np.ndarray, np.generic), _lift,
                              lambda a: a.tensor, tensor_array_ufunc, tensor_array_function))
