"""NumPy programs analysed as NumPy programs (fxstab/eager/arrays.py, ufuncs.py,
array_functions.py): ufuncs, array functions, CESTAC control flow, NumPy results, and the torch
twins' digits."""

import contextlib
import io
import math
import pathlib
import re

import numpy as np
import pytest
import torch

import fxstab
from fxstab.rules.aten import AtenContext, Stacked
from fxstab.numerics.formats import get_format
from fxstab.eager.arrays import SUPPORTED_FUNCTIONS, SUPPORTED_UFUNCS, StochasticArray
from fxstab.records.report import ROUNDED
from fxstab.eager.stochastic import StochasticTensor

ROOT = pathlib.Path(__file__).resolve().parents[1]
CAP32 = get_format("fp32").digit_cap


# ----------------------------------------------------------------------------- the ufunc sweep
def _float_ufuncs() -> list:
    """Every ufunc NumPy exports that has a loop over a floating type (aliases once)."""
    found = {getattr(np, n) for n in dir(np) if isinstance(getattr(np, n), np.ufunc)}
    return sorted((u for u in found if any(set("efdg") & set(t.split("->")[0])
                                           for t in u.types)), key=lambda u: u.__name__)


FLOAT_UFUNCS = _float_ufuncs()

# ordinary values, then the edges: NaN, infinities, signed zeros, a subnormal, near overflow
X = np.array([0.3, 0.7, 1.9, -1.5, 2.5, np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 3e38],
             np.float32)
Y = np.array([1.7, 0.4, -2.5, 2.0, -2.5, 1.0, -np.inf, 2.0, -0.0, 0.0, 3.0, 2.0], np.float32)
INTS = np.array([1, -2, 3, 0, 2, 1, 2, 3, 1, 1, 4, 1])
UNIT = np.array([0.3, -0.5, 0.7, 0.0, -0.0, np.nan, 1.0, -1.0, 0.99, 2.0, 1e-40, -0.2],
                np.float32)
GE1 = np.array([1.3, 2.0, 5.0, 1.0, np.inf, np.nan, 0.5, 1e30, 3.0, 1.0, 7.0, 1.5], np.float32)
M = np.outer(X[:3], Y[:3]).astype(np.float32)
V = X[:3].copy()

# Ufuncs whose results are (a selection of) input values: the rules neither round nor record
# them (docs/design.md §3); for exact inputs their samples stay identical.
EXACT = {"absolute", "fabs", "negative", "positive", "conjugate", "floor", "ceil", "trunc",
         "rint", "sign", "maximum", "minimum", "nextafter"}
# Signed zeros torch gives differently from NumPy: 2.5 % -2.5 is +0 (NumPy -0), max/min of
# (-0, +0) pick the other zero, frac(-0) is +0.
SIGNED_ZERO_DIFFERS = {"remainder", "divmod", "fmax", "fmin", "maximum", "minimum", "modf"}


def _args(u: np.ufunc) -> tuple:
    name = u.__name__
    if name in ("arcsin", "arccos", "arctanh"):
        return (UNIT,)
    if name == "arccosh":
        return (GE1,)
    if name == "ldexp":
        return (X, INTS)
    if name in ("matmul", "matvec"):
        return (M, V)
    if name == "vecmat":
        return (V, M)
    if name == "vecdot":
        return (V, Y[:3])
    return (X,) if u.nin == 1 else (X, Y)


def _close_in_fp32(got: np.ndarray, ref: np.ndarray) -> bool:
    """Within two fp32 units of NumPy's result rounded into fp32 (the format): a random-rounded
    result's sample mean lies between the exact result's two fp32 neighbours; results beyond
    the format's range are its inf or its subnormals."""
    with np.errstate(over="ignore"):  # beyond fp32's range: inf, as the format
        ref32 = ref.astype(np.float32)
        tol = 2 * np.spacing(np.abs(ref32)).astype(np.float64)
    got = got.astype(np.float64)
    both_nan = np.isnan(got) & np.isnan(ref32)
    same_inf = np.isinf(ref32) & (got == ref32.astype(np.float64))
    with np.errstate(invalid="ignore"):
        near = np.abs(got - ref32.astype(np.float64)) <= tol
    return bool((both_nan | same_inf | near).all())


def _analyse_ufunc(u: np.ufunc) -> str:
    """'analysed' (run through the rules, right values, rounded and reported) or 'refused'
    (a clear TypeError naming the ufunc); anything else fails the test."""
    args = _args(u)
    try:
        res = fxstab.analyze(lambda *a: u(*a), format="fp32", seed=0)(*args)
    except TypeError as e:
        assert f"np.{u.__name__}" in str(e) and "np.asarray(x.value)" in str(e), str(e)
        return "refused"
    with np.errstate(all="ignore"):
        ref = u(*args)
    outs = res.output if isinstance(res.output, tuple) else (res.output,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    vals = res.value if isinstance(res.value, tuple) else (res.value,)
    assert len(outs) == len(refs)
    for out, val, r in zip(outs, vals, refs):
        r = np.asarray(r)
        if isinstance(out, np.ndarray):  # a CESTAC decision: one plain answer per element
            assert out.dtype == np.bool_ and np.array_equal(out, r), (u.__name__, out, r)
            continue
        assert isinstance(out, StochasticArray), (u.__name__, type(out))
        assert isinstance(val, (np.ndarray, np.generic)) and val.dtype == r.dtype, \
            (u.__name__, val, r.dtype)  # 0-d results (vecdot) are NumPy scalars
        val = np.asarray(val)
        if r.dtype.kind != "f":
            assert np.array_equal(val, r), (u.__name__, val, r)
            continue
        assert _close_in_fp32(val, r), (u.__name__, val, r)
        if u.__name__ not in SIGNED_ZERO_DIFFERS:
            zero = r == 0
            assert np.array_equal(np.signbit(val[zero]), np.signbit(r[zero])), u.__name__
        s = out.samples
        with np.errstate(over="ignore"):
            on_grid = s.astype(np.float32).astype(np.float64)
        assert np.array_equal(on_grid, s, equal_nan=True), f"{u.__name__}: off the fp32 grid"
        d = np.asarray(out.digits)
        assert ((d >= 0) & (d <= CAP32 + 1e-6)).all()
        if u.__name__ in EXACT:
            assert (np.isnan(s) | (s == s[:1])).all(), f"{u.__name__} is exact: no noise"
        else:
            assert res.reports, f"{u.__name__}: rounded but not reported"
            assert all(rep.format == "fp32" and rep.status == ROUNDED for rep in res.reports), \
                [(rep.kind, rep.status) for rep in res.reports]
    return "analysed"


@pytest.mark.parametrize("u", FLOAT_UFUNCS, ids=lambda u: u.__name__)
def test_every_float_ufunc_is_analysed_or_refused_clearly(u):
    assert _analyse_ufunc(u) == ("analysed" if u.__name__ in SUPPORTED_UFUNCS else "refused")


def test_ufunc_sweep_coverage():
    assert len(FLOAT_UFUNCS) >= 70  # the sweep saw NumPy's ufuncs, not an empty list
    outcome = {u.__name__: _analyse_ufunc(u) for u in FLOAT_UFUNCS}
    analysed = sorted(n for n, o in outcome.items() if o == "analysed")
    coverage = len(analysed) / len(outcome)
    assert coverage >= 0.95, f"{coverage:.1%} analysed; refused: " \
        f"{sorted(set(outcome) - set(analysed))}"
    assert set(analysed) <= SUPPORTED_UFUNCS


def test_ufuncs_without_a_rule_are_refused_clearly():
    x = fxstab.stochastic(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"np\.gcd.*np\.asarray\(x\.value\)"):
        np.gcd(x, x)
    with pytest.raises(TypeError, match=r"np\.add\.at"):
        np.add.at(x, [0], 1.0)
    with pytest.raises(TypeError, match=r"np\.add\.reduceat"):
        np.add.reduceat(x, [0, 1])


def test_arithmetic_ufuncs_round_exactly_as_the_rule():
    """np.add of two fp32 values: each sample is one of the exact sum's fp32 neighbours and
    samples 2 and 3 are antithetic (CADNA), as for tensors."""
    a, b = np.float64(0.1), np.float64(np.float32(1.0 / 3.0))
    s = np.add(fxstab.stochastic(a, seed=4), b)
    exact = float(np.float64(np.float32(a)) + b)
    lo, hi = np.nextafter(np.float32(exact), -np.inf), np.nextafter(np.float32(exact), np.inf)
    vals = s.samples.tolist()
    assert set(vals) <= {float(np.float32(exact)), float(lo), float(hi)} and vals[1] != vals[2]


# ----------------------------------------------------------------------------- ufunc methods
def _x(shape=(3, 4), seed=0):
    """fp32 values (exact in the format) as a float64 array, and the stochastic array."""
    g = np.random.default_rng(seed)
    a = (g.standard_normal(shape) + 2).astype(np.float32).astype(np.float64)
    return a, fxstab.stochastic(a, format="fp32", seed=seed)


def _near(got, ref, rtol=3e-6):
    got = got.value if isinstance(got, StochasticArray) else got
    return np.allclose(np.asarray(got, dtype=np.float64), ref, rtol=rtol, atol=1e-6)


def test_reductions_and_accumulations():
    a, x = _x()
    assert _near(np.add.reduce(x), np.add.reduce(a))  # NumPy's default axis 0
    assert _near(np.add.reduce(x, axis=None), a.sum())
    assert _near(np.add.reduce(x, axis=1, keepdims=True), a.sum(1, keepdims=True))
    assert _near(np.add.reduce(x, axis=1, initial=5.0), np.add.reduce(a, 1, initial=5.0))
    mask = np.array([True, False, True, True])
    assert _near(np.add.reduce(x, axis=1, where=mask), np.add.reduce(a, 1, where=mask))
    assert _near(np.multiply.reduce(x, axis=(0, 1)), a.prod())
    assert _near(np.maximum.reduce(x, axis=0), a.max(0))
    assert _near(np.subtract.reduce(x, axis=1), np.subtract.reduce(a, axis=1))  # a left fold
    with pytest.raises(ValueError, match="not reorderable"):
        np.subtract.reduce(x, axis=(0, 1))
    assert _near(np.add.accumulate(x, axis=1), np.add.accumulate(a, axis=1))
    assert _near(np.multiply.accumulate(x), np.multiply.accumulate(a))
    assert _near(np.hypot.accumulate(x, axis=1), np.hypot.accumulate(a, axis=1))
    assert _near(np.multiply.outer(x[0], x[1]), np.multiply.outer(a[0], a[1]))
    assert np.array_equal(np.logical_and.reduce(x > 1.0, axis=0),
                          np.logical_and.reduce(a > 1.0, axis=0))


def test_reductions_are_one_primitive_as_in_torch_code():
    a, _ = _x()
    res = fxstab.analyze(lambda v: np.sum(v))(a)
    assert [r.kind for r in res.reports] == ["sum"]
    res = fxstab.analyze(lambda v: np.dot(v[0], v[1]))(a)
    assert [r.kind for r in res.reports] == ["dot"]  # a GEMM: the trusted-product rule


def test_out_and_where():
    a, x = _x()
    o = np.empty_like(x)
    assert isinstance(o, StochasticArray) and o.shape == x.shape
    r = np.multiply(x, 3.0, out=o)
    assert r is o and _near(o, a * 3.0)
    mask = a > 2.0
    o2 = np.zeros_like(x)
    np.sqrt(x, out=o2, where=mask)
    assert _near(o2, np.where(mask, np.sqrt(a), 0.0))
    assert _near(np.sqrt(x, where=mask), np.where(mask, np.sqrt(a), 0.0))  # 0 where NumPy: junk
    s = np.zeros_like(x[0])
    np.sum(x, axis=0, out=s)
    assert _near(s, a.sum(0))
    with pytest.raises(TypeError, match="out= must be a stochastic array"):
        np.add(x, 1.0, out=np.zeros(x.shape))


# ----------------------------------------------------------------------------- array functions
FUNCTION_CASES = {
    "sum": lambda m, a: m.sum(a, axis=1),
    "mean": lambda m, a: m.mean(a, axis=0, keepdims=True),
    "prod": lambda m, a: m.prod(a[0]),
    "max": lambda m, a: m.max(a, axis=1),
    "min": lambda m, a: m.min(a),
    "var": lambda m, a: m.var(a, axis=1, ddof=1),
    "std": lambda m, a: m.std(a),
    "dot": lambda m, a: m.dot(a, a.T),
    "dot_vectors": lambda m, a: m.dot(a[0], a[1]),
    "matmul": lambda m, a: m.matmul(a.T, a),
    "where": lambda m, a: m.where(a > 2.0, a, -a),
    "norm": lambda m, a: m.linalg.norm(a),
    "norm_axis": lambda m, a: m.linalg.norm(a, axis=1),
    "norm_1": lambda m, a: m.linalg.norm(a[0], 1),
    "norm_inf": lambda m, a: m.linalg.norm(a, np.inf),
    "norm_fro": lambda m, a: m.linalg.norm(a, "fro"),
    "norm_3": lambda m, a: m.linalg.norm(a[1], 3),
    "cumsum": lambda m, a: m.cumsum(a),
    "cumsum_axis": lambda m, a: m.cumsum(a, axis=1),
    "cumprod": lambda m, a: m.cumprod(a[0]),
    "clip": lambda m, a: m.clip(a, 1.5, 2.5),
    "concatenate": lambda m, a: m.concatenate([a, a * 2], axis=1),
    "stack": lambda m, a: m.stack([a[0], a[1], a[2]], axis=1),
    "vstack": lambda m, a: m.vstack([a, a[0]]),
    "hstack": lambda m, a: m.hstack([a[0], a[1]]),
    "transpose": lambda m, a: m.transpose(a),
    "reshape": lambda m, a: m.reshape(a, (4, 3)),
    "einsum": lambda m, a: m.einsum("ij,kj->ik", a, a),
    "tensordot": lambda m, a: m.tensordot(a, a, axes=([1], [1])),
    "trace": lambda m, a: m.trace(a),
    "diff": lambda m, a: m.diff(a, axis=1),
    "sort": lambda m, a: m.sort(-a, axis=1),
    "outer": lambda m, a: m.outer(a[0], a[1]),
    "average": lambda m, a: m.average(a, axis=0, weights=[1.0, 2.0, 3.0]),
    "round": lambda m, a: m.round(a, 2),
    "polyval": lambda m, a: m.polyval([1.0, -2.0, 0.5], a),
    "abs": lambda m, a: m.abs(a - 2.0),
    "square_sum": lambda m, a: m.sum(m.square(a), axis=0),
    "take": lambda m, a: m.take(a, [2, 0], axis=1),
    "take_flat": lambda m, a: m.take(a, [5, 1]),
    "roll": lambda m, a: m.roll(a, 1, axis=1),
    "roll_flat": lambda m, a: m.roll(a, 2),
    "tile": lambda m, a: m.tile(a[0], 2),
    "repeat": lambda m, a: m.repeat(a, 2, axis=0),
    "flip": lambda m, a: m.flip(a, axis=1),
    "moveaxis": lambda m, a: m.moveaxis(a, 0, -1),
    "expand_dims": lambda m, a: m.expand_dims(a, 1),
    "squeeze": lambda m, a: m.squeeze(a[None, :, None]),
    "broadcast_to": lambda m, a: m.broadcast_to(a[0], (2, 4)),
    "atleast_2d": lambda m, a: m.atleast_2d(a[0]),
    "column_stack": lambda m, a: m.column_stack([a[0], a[1]]),
    "triu": lambda m, a: m.triu(a),
    "diag": lambda m, a: m.diag(a[0] * 2),
    "diagonal": lambda m, a: m.diagonal(a * 3),
    "inner": lambda m, a: m.inner(a, a),
    "vdot": lambda m, a: m.vdot(a, a),
    "prod_axes": lambda m, a: m.prod(a, axis=(0, 1)),
    "cumprod_flat": lambda m, a: m.cumprod(a[:2]),
    "round_negative": lambda m, a: m.round(a * 1000, -2),
    "diff_prepend": lambda m, a: m.diff(a, axis=0, prepend=0.0),
    "mean_where": lambda m, a: m.mean(a, axis=1, where=a > 2.0),
    "sum_initial": lambda m, a: m.sum(a, initial=10.0),
    "var_keepdims": lambda m, a: m.var(a, axis=0, keepdims=True),
    "std_ddof": lambda m, a: m.std(a, axis=1, ddof=1),
    "norm_keepdims": lambda m, a: m.linalg.norm(a, axis=0, keepdims=True),
    "norm_matrix_1": lambda m, a: m.linalg.norm(a, 1),
    "norm_matrix_-inf": lambda m, a: m.linalg.norm(a, -np.inf),
    "norm_-inf": lambda m, a: m.linalg.norm(a[0], -np.inf),
    "where_scalar": lambda m, a: m.where(a[0] > 2.0, 1.0, a[0]),
}


# selections and rearrangements: exact primitives (not rounded, not recorded)
DATA_MOVEMENT = {"transpose", "reshape", "sort", "where", "where_scalar", "clip", "max", "min",
                 "hstack", "vstack", "stack", "concatenate", "abs", "take", "take_flat", "roll",
                 "roll_flat", "tile", "repeat", "flip", "moveaxis", "expand_dims", "squeeze",
                 "broadcast_to", "atleast_2d", "column_stack", "triu", "norm_-inf"}


@pytest.mark.parametrize("name", sorted(FUNCTION_CASES))
def test_array_functions_match_numpy(name):
    a, x = _x()
    f = FUNCTION_CASES[name]
    ref = f(np, a)
    res = fxstab.analyze(lambda v: f(np, v), format="fp32", seed=1)(a)
    assert isinstance(res.output, StochasticArray), type(res.output)
    assert isinstance(res.value, (np.ndarray, np.generic)) and np.shape(res.value) == np.shape(ref)
    assert np.asarray(res.value).dtype == np.asarray(ref).dtype
    assert _near(res.value, ref, rtol=2e-5), (res.value, ref)
    assert isinstance(res.digits, (np.ndarray, np.floating))
    if name not in DATA_MOVEMENT:
        assert res.reports, f"{name}: nothing rounded"  # arithmetic happened and was analysed
    assert all(r.status == ROUNDED for r in res.reports), [(r.kind, r.status) for r in res.reports]


def test_decisions_and_indices_are_plain_numpy():
    a, x = _x()
    assert np.argmax(x) == np.argmax(a) and isinstance(np.argmax(x), np.integer)
    assert np.array_equal(np.argmin(x, axis=1), np.argmin(a, axis=1))
    assert np.array_equal(np.argsort(x, axis=1), np.argsort(a, axis=1))
    assert np.array_equal(np.isclose(x, a), np.ones(a.shape, bool))
    assert np.allclose(x, a) and not np.allclose(x, a + 1.0)
    assert np.array_equal(np.nonzero(x > 2.0)[0], np.nonzero(a > 2.0)[0])
    assert np.count_nonzero(x - x) == 0  # exact zeros
    assert np.array_equal(x[:, np.argsort(x[0])].value, a[:, np.argsort(a[0])])


def test_indices_that_samples_disagree_on_count_as_branching():
    ctx = AtenContext.of(format="fp32", n_samples=3, seed=0)
    # element 0 wins in sample 0, element 1 in samples 1 and 2
    s = torch.tensor([[1.0, 1.0 - 2**-23], [1.0, 1.0 + 2**-23], [1.0, 1.0 + 2**-22]],
                     dtype=torch.float64)
    x = StochasticArray(StochasticTensor(Stacked(s), ctx, torch.float32))
    with fxstab.instability_counters() as c:
        i = np.argmax(x)
    assert i == 1 and c.counts["branching"] == 1  # the majority, and the instability counted


# ----------------------------------------------------------------------------- values, printing
def test_stochastic_numpy_values_are_numpy():
    x = fxstab.stochastic(np.array([2.0, 3.0], np.float32), format="fp32", seed=0)
    assert isinstance(x, StochasticArray) and x.dtype == np.float32 and x.shape == (2,)
    r = np.sqrt(x)
    assert isinstance(r.value, np.ndarray) and r.value.dtype == np.float32
    assert isinstance(r.digits, np.ndarray) and isinstance(r.samples, np.ndarray)
    assert r.samples.shape == (3, 2)
    t = torch.sqrt(fxstab.stochastic(torch.tensor([2.0, 3.0]), format="fp32", seed=0))
    assert str(r) == str(t)  # CADNA's style, as for tensors
    assert "format=fp32" in repr(r) and "dtype=float32" in repr(r)
    s = fxstab.stochastic(np.float64(2.0))
    assert isinstance(s, StochasticArray) and isinstance(np.sqrt(s).value, np.float64)
    assert isinstance(np.sqrt(s).digits, np.float64)
    assert f"{np.sqrt(s):.3f}" == "1.414"
    assert fxstab.stochastic(np.arange(3)).dtype == np.float64  # integers enter as float64
    assert str(np.isnan(x)) == "[False False]" and str(x.astype(np.int64)) == "[2 3]"


def test_item_assignment_reaches_the_array():
    a, x = _x()
    x[1:3, 0] = 7.0
    x[0] = np.arange(4)  # integers into floats
    a[1:3, 0] = 7.0
    a[0] = np.arange(4)
    assert np.array_equal(x.value, a)
    before = x
    x += 1.0  # in place: the same object, its samples rebound
    a += 1.0
    assert x is before  # and each sample one of the fp32 neighbours of the exact sum:
    assert (np.abs(x.samples - a) <= np.spacing(np.abs(a).astype(np.float32))).all()
    y = x * 1.0
    y[y > 5.0] = 0.0
    assert np.array_equal(y.value, np.where(x.value > 5.0, 0.0, x.value))


def test_unsupported_functions_say_how_to_leave_the_analysis():
    _, x = _x((4, 4))
    for call, name in ((lambda: np.fft.fft(x), "np.fft.fft"),
                       (lambda: np.linalg.solve(x, x[0]), "np.linalg.solve"),
                       (lambda: np.median(x), "np.median"),
                       (lambda: x.tolist(), "ndarray.tolist"),
                       (lambda: np.linalg.norm(x, 2), "ord=2")):
        with pytest.raises(TypeError) as e:
            call()
        assert name in str(e.value) and "np.asarray(x.value)" in str(e.value), str(e.value)
    with pytest.raises(TypeError, match=r"np\.asarray\(x\.value\)"):
        np.asarray(x)
    assert "sum" in str(SUPPORTED_FUNCTIONS) and "np.linalg.norm" in SUPPORTED_FUNCTIONS


def test_numpy_functions_on_stochastic_tensors_stay_tensors():
    t = fxstab.stochastic(torch.tensor([1.0, 4.0, 9.0]), seed=0)
    r = np.sqrt(t)
    assert isinstance(r, StochasticTensor) and torch.allclose(r.value, torch.tensor([1., 2., 3.]))
    s = np.sum(t * 2)
    assert isinstance(s, StochasticTensor) and float(s) == 28.0
    assert float(np.linalg.norm(t)) == pytest.approx(math.sqrt(98), rel=1e-6)
    with pytest.raises(TypeError, match=r"x\.value\.numpy\(\)"):  # not torch's .numpy() error
        np.asarray(t)
    with pytest.raises(TypeError, match=r"np\.fft\.fft"):
        np.fft.fft(t)


def test_tensor_slice_assignment_reaches_the_tensor():
    """x[1:3] = v on a stochastic tensor wrote into a copy before (views are copies)."""
    x = fxstab.stochastic(torch.tensor([1.0, 2.0, 3.0, 4.0]), seed=0)
    x[1:3] = torch.tensor([9.0, 8.0])
    x[0] = 5.0
    assert torch.equal(x.value, torch.tensor([5.0, 9.0, 8.0, 4.0]))


# ----------------------------------------------------------------------------- CESTAC, counters
def test_comparisons_are_cestac_decisions_with_counters():
    x = fxstab.stochastic(np.float64(1.0), seed=2)
    z = (x + 1e-7) - x  # a computational zero
    assert str(z) == "@.0"
    with fxstab.instability_counters() as c:
        assert z == 0 and np.less_equal(z, 0) and not np.less(z, 0) and not np.greater(z, 0)
        assert not bool(z)  # NumPy's truth of a float is x != 0: CESTAC false here
    assert c.counts["branching"] == 5
    res = fxstab.analyze(lambda a: (a + 1e8) - 1e8, format="fp32")(np.array([0.1, 0.2]))
    assert res.counters["cancellation"] == 2 and np.all(res.digits == 0)


def _newton_numpy(x):
    y, k = x, 0
    while True:
        z = np.multiply(0.5, np.add(y, np.divide(x, y)))
        k += 1
        if np.equal(z, y) or k > 100:
            return z, k
        y = z


def _newton_torch(x):
    y, k = x, 0
    while True:
        z = 0.5 * (y + x / y)
        k += 1
        if z == y or k > 100:
            return z, k
        y = z


def _cbrt_numpy(a):
    x, k = a, 0
    while k < 1000:
        xn = np.subtract(x, (x * x * x - a) / np.multiply(3, x * x))
        k += 1
        if xn == x:
            return xn, k
        x = xn
    return x, None


def _cbrt_torch(a):
    x, k = a, 0
    while k < 1000:
        xn = torch.sub(x, (x * x * x - a) / torch.mul(3, x * x))
        k += 1
        if xn == x:
            return xn, k
        x = xn
    return x, None


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "fp64"])
def test_newton_in_numpy_stops_where_its_torch_twin_stops(fmt):
    for seed in range(3):
        rn = fxstab.analyze(_newton_numpy, format=fmt, seed=seed)(np.float64(2.0))
        rt = fxstab.analyze(_newton_torch, format=fmt, seed=seed)(
            torch.tensor(2.0, dtype=torch.float64))
        (zn, kn), (zt, kt) = rn.output, rt.output
        assert kn == kt < 100
        assert np.array_equal(zn.samples, zt.samples.numpy())
        assert zn.digits == float(zt.digits) and rn.counters == rt.counters
        assert abs(float(zn) - math.sqrt(2)) < 1e-2


def test_cube_root_newton_cycles_in_numpy_floats_and_stops_with_cestac():
    a = np.float32(938.43616)  # Newton's cube root cycles between two fp32 values here
    _, k = _cbrt_numpy(a)
    assert k is None  # plain NumPy: `xn == x` never holds
    rn = fxstab.analyze(_cbrt_numpy, format="fp32", seed=0)(a)
    rt = fxstab.analyze(_cbrt_torch, format="fp32", seed=0)(torch.tensor(938.43616))
    (xn, kn), (xt, kt) = rn.output, rt.output
    assert kn is not None and kn == kt and kn < 30
    assert np.array_equal(xn.samples, xt.samples.numpy())
    assert abs(float(xn) - 938.43616 ** (1 / 3)) < 1e-4


# ----------------------------------------------------------------------------- the classical twins
def _load_classical():
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("bench_classical",
                                                  ROOT / "benchmarks" / "bench_classical.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_classical"] = mod
    spec.loader.exec_module(mod)
    return mod


classical = _load_classical()


@pytest.mark.parametrize("twin", classical.NUMPY_TWINS, ids=lambda t: f"{t.case}-{t.variant}")
def test_classical_numpy_twins_give_the_torch_digits(twin):
    for fmt in ("fp32", "fp64"):
        for seed in range(2):
            rt = fxstab.analyze(twin.torch_fn, format=fmt, seed=seed)(*twin.torch_args())
            rn = fxstab.analyze(twin.numpy_fn, format=fmt, seed=seed)(*twin.numpy_args())
            assert isinstance(rn.output, StochasticArray)
            assert isinstance(rn.digits, (np.ndarray, np.floating))
            assert np.array_equal(np.asarray(rn.samples), rt.samples.numpy(), equal_nan=True)
            assert np.array_equal(np.asarray(rn.digits), rt.digits.double().numpy())
            assert rn.counters == rt.counters


def test_the_paper_numpy_example():
    """Rump's polynomial on NumPy scalars, the classical example for a NumPy backend (the seed
    paper's own listing is not in this tree): plain float64 NumPy prints a confident wrong
    value, the analysis keeps no digit and counts the cancellation."""
    a, b = np.float64(77617.0), np.float64(33096.0)
    plain = classical.rump(a, b)
    assert abs(plain - (-0.827396059946821)) > 1.0  # float64 is wrong by ~1e21
    res = fxstab.analyze(classical.rump, format="fp64", seed=0)(a, b)
    assert isinstance(res.value, np.float64) and res.digits == 0
    assert res.counters["cancellation"] >= 1


# ----------------------------------------------------------------------------- README
def test_readme_numpy_example_runs_as_written():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Arithmetic level")[1].split("\n## ")[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    code = next(b for b in blocks if "import numpy as np" in b)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(code, "README.md", "exec"), {})
    printed = buf.getvalue().splitlines()
    expected = [line.split("#", 1)[1].strip() for line in code.splitlines()
                if line.startswith("print(") and "#" in line]
    assert len(printed) == len(expected)
    for got, want in zip(printed, expected):
        # the comment up to a remark in parentheses or an ellipsis is what the line prints
        want = re.split(r"\s+\(", want)[0].split("...")[0].strip()
        assert got.startswith(want), f"README says {want!r}, the code prints {got!r}"


ISSUE_TABLE = {  # what a new user tried (issue 20): every row failed or came back as torch
    "arithmetic": lambda a, b: (a + b) * a - b / a, "matmul": lambda a, b: a @ b,
    "sum method": lambda a, b: (a * b).sum(), "sqrt": lambda a, b: np.sqrt(a),
    "exp": lambda a, b: np.exp(a), "dot": lambda a, b: np.dot(a, b),
    "norm": lambda a, b: np.linalg.norm(a), "where": lambda a, b: np.where(a > b, a, b),
    "maximum": lambda a, b: np.maximum(a, b), "np.sum": lambda a, b: np.sum(a),
}


@pytest.mark.parametrize("name", sorted(ISSUE_TABLE))
def test_the_issue_table_runs_and_answers_in_numpy(name):
    a, b = np.array([1.0, 2.0, 3.0]), np.array([0.5, 2.5, 1.0])
    res = fxstab.analyze(ISSUE_TABLE[name], format="fp32", seed=0)(a, b)
    ref = ISSUE_TABLE[name](a, b)
    assert isinstance(res.value, (np.ndarray, np.floating))
    assert isinstance(res.digits, (np.ndarray, np.floating)) and isinstance(res.samples, np.ndarray)
    assert np.allclose(res.value, ref, rtol=1e-6)


def _gauss_solve(A, b):
    """Gaussian elimination with partial pivoting, NumPy style: row swaps by fancy indexing,
    slice updates, a pivot chosen by argmax, back substitution with np.dot."""
    A, b = A.copy(), b.copy()
    n = A.shape[0]
    for k in range(n):
        p = k + np.argmax(np.abs(A[k:, k]))
        if p != k:
            A[[k, p]] = A[[p, k]]
            b[[k, p]] = b[[p, k]]
        for i in range(k + 1, n):
            f = A[i, k] / A[k, k]
            A[i, k:] = A[i, k:] - f * A[k, k:]
            b[i] = b[i] - f * b[k]
    x = np.zeros_like(b)
    for i in range(n - 1, -1, -1):
        x[i] = (b[i] - np.dot(A[i, i + 1:], x[i + 1:])) / A[i, i]
    return x


def test_a_numpy_solver_on_an_ill_conditioned_matrix():
    """Hilbert(6) has condition ~1.5e7, about fp32's 7.2 digits: the fp32 solution keeps at
    most a few digits and fp64 keeps ~15.9 - 7.2. The fp32 estimates lie within 2.5 digits of
    the digits the solution really has (about 0.8 below them on seed 0: N=3 is conservative
    here); a cap-like estimate would miss by 3-6."""
    n = 6
    H = 1.0 / (np.arange(1, n + 1)[:, None] + np.arange(n)[None, :])
    b = H @ np.ones(n)
    r32 = fxstab.analyze(_gauss_solve, format="fp32", seed=0)(H, b)
    r64 = fxstab.analyze(_gauss_solve, format="fp64", seed=0)(H, b)
    assert isinstance(r32.value, np.ndarray) and r32.value.shape == (n,)
    assert np.min(r32.digits) < 2 and r32.counters["cancellation"] > 0
    assert np.mean(r64.digits) > 7 and np.max(np.abs(r64.value - 1)) < 1e-6
    true32 = -np.log10(np.abs(r32.value - 1))  # correct digits of the fp32 solution
    assert np.all(np.abs(true32 - r32.digits) < 2.5), (true32, r32.digits)
