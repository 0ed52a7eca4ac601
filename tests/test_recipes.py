"""Low-precision GEMM recipes of issue 43: the fp4/fp6 element formats against ml_dtypes, the
NVFP4 and MX operand recipes against references written from their specifications (OCP
Microscaling Formats v1.0 §6.3; NVIDIA's NVFP4: e2m1 values, an e4m3 scale per 16 elements,
an fp32 scale per tensor), their per-block statistics, and the tensor cores' alignment of a
group's products (``Alignment``) against a reference in exact rational arithmetic."""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

import fxstab
from fxstab import Accumulation, emulate_matmul
from fxstab.numerics.accumulation import (RECIPES, Alignment, operand_stats, quantize_operand,
                                          recipe)
from fxstab.numerics.formats import get_format

ML = {"fp4_e2m1": ml_dtypes.float4_e2m1fn, "fp6_e3m2": ml_dtypes.float6_e3m2fn,
      "fp6_e2m3": ml_dtypes.float6_e2m3fn, "fp8_e4m3": ml_dtypes.float8_e4m3fn,
      "fp8_e5m2": ml_dtypes.float8_e5m2}
SMALL = ("fp4_e2m1", "fp6_e3m2", "fp6_e2m3")


def _cast(v: np.ndarray, name: str) -> np.ndarray:
    """A saturating conversion (the recipes'): clipped to the largest value, then ml_dtypes'
    round to nearest even."""
    top = float(ml_dtypes.finfo(ML[name]).max)
    return np.clip(v, -top, top).astype(ML[name]).astype(np.float64)


# --------------------------------------------------------------------------- formats
@pytest.mark.parametrize("name", SMALL)
def test_fp4_fp6_constants_match_ml_dtypes(name):
    f, fi = get_format(name), ml_dtypes.finfo(ML[name])
    assert (f.max_normal, f.min_normal, f.min_subnormal) == (
        float(fi.max), float(fi.smallest_normal), float(fi.smallest_subnormal))
    assert f.bits == fi.bits and f.precision == fi.nmant + 1
    assert f.all_finite and f.finite_only and not f.has_inf
    # every bit pattern is a finite number (no inf, no NaN encodings)
    every = np.arange(1 << f.bits, dtype=np.uint8).view(ML[name]).astype(np.float64)
    assert np.isfinite(every).all() and len(set(every.tolist())) == (1 << f.bits) - 1  # +-0
    assert get_format(name.split("_")[1]) is f


@pytest.mark.parametrize("name", SMALL)
def test_round_to_nearest_into_fp4_fp6_is_ml_dtypes_cast_element_for_element(name):
    """Every representable value, every midpoint (the ties, to even), just above and below
    them, values past the largest (saturating as ml_dtypes does), below the smallest
    subnormal, signed zeros."""
    f = get_format(name)
    grid = np.unique(np.arange(1 << f.bits, dtype=np.uint8).view(ML[name]).astype(np.float64))
    mids = (grid[1:] + grid[:-1]) / 2
    x = np.concatenate([grid, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                        [f.max_normal * 1.01, -f.max_normal * 3, 1e30, -1e30,
                         f.min_subnormal / 2, -f.min_subnormal / 4, 1e-30, 0.0, -0.0]])
    got = fxstab.quantize(torch.from_numpy(x), name, "nearest", saturate=True).numpy()
    want = x.astype(ML[name]).astype(np.float64)
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))  # -0.0 stays -0.0
    # the directed modes stay on the grid and bracket x
    y = torch.from_numpy(x[np.abs(x) <= f.max_normal])
    up = fxstab.quantize(y, name, "up").numpy()
    down = fxstab.quantize(y, name, "down").numpy()
    assert np.isin(up, grid).all() and np.isin(down, grid).all()
    assert (down <= y.numpy()).all() and (y.numpy() <= up).all()
    # no inf to round to: past the largest value, NaN unless saturating; NaN stays NaN
    big = torch.tensor([f.max_normal * 2, float("inf"), float("nan")], dtype=torch.float64)
    assert fxstab.quantize(big, name, "nearest").isnan().all()
    sat = fxstab.quantize(big, name, "nearest", saturate=True)
    assert sat[:2].tolist() == [f.max_normal] * 2 and sat[2].isnan()


# --------------------------------------------------------------------------- recipes
def _mx_reference(x: np.ndarray, elem: str) -> tuple[np.ndarray, list]:
    """OCP MX v1.0 §6.3 on the rows of x [rows, K], blocks of 32 along K: X = 2^(floor(log2
    max|V|) - emax_elem), clamped to e8m0's 2^-127 ... 2^127; P_i = the element format's
    saturating round-to-nearest of V_i / X; the value P_i X. Returns the values and the
    scales of the non-zero blocks."""
    emax = {"fp4_e2m1": 2, "fp6_e3m2": 4, "fp6_e2m3": 2, "fp8_e4m3": 8, "fp8_e5m2": 15}[elem]
    out, scales = np.empty_like(x), []
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], 32):
            v = x[r, c:c + 32]
            amax = float(np.abs(v).max())
            if amax == 0:
                out[r, c:c + 32] = v
                continue
            e = min(max(math.frexp(amax)[1] - 1 - emax, -127), 127)
            s = math.ldexp(1.0, e)
            # the scale is an e8m0 value
            assert float(np.array(s).astype(ml_dtypes.float8_e8m0fnu).astype(np.float64)) == s
            scales.append(s)
            out[r, c:c + 32] = _cast(v / s, elem) * s
    return out, scales


def _nvfp4_reference(x: np.ndarray) -> tuple[np.ndarray, list]:
    """NVFP4 on the rows of x [rows, K]: an fp32 per-tensor scale S = amax(x) / (6 x 448); per
    16 elements along K an e4m3 scale s = e4m3(amax(V) / (6 S)) (nearest, saturating); the
    values e2m1(V / (s S)) (nearest, saturating) times s S; a block whose s is 0 is zeros."""
    amax_t = float(np.abs(x).max())
    glob = float(np.float32(amax_t / (6 * 448))) if amax_t > 0 else 1.0
    out, scales = np.empty_like(x), []
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], 16):
            v = x[r, c:c + 16]
            amax = float(np.abs(v).max())
            if amax == 0:
                out[r, c:c + 16] = v
                continue
            s = float(_cast(np.array([amax / (6 * glob)]), "fp8_e4m3")[0]) * glob
            scales.append(s)
            out[r, c:c + 16] = 0.0 * v if s == 0 else _cast(v / s, "fp4_e2m1") * s
    return out, scales


def _operand(seed: int, rows: int = 9, k: int = 70) -> torch.Tensor:
    """Rows over 12 decades (blocks that saturate and blocks that flush), a zero block, signed
    zeros, a partial last block (K = 70)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g, dtype=torch.float64)
    x = x * torch.logspace(-8, 4, rows, dtype=torch.float64)[:, None]
    x[:, ::7] *= 1e-4  # elements far below their block's largest: they flush
    x[:, 3::11] *= 1e-12
    x[2, 32:64] = 0.0
    x[3, 5] = -0.0
    return x


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("right", [False, True])
def test_recipes_are_their_specifications_element_for_element(name, right):
    elem, scaling = RECIPES[name]
    # one fixed operand (hash(name) was a seed per process: PYTHONHASHSEED varies, and one
    # run's mxfp6_e2m3 operand had no block that saturates); seed 0 saturates and flushes in
    # every recipe
    x = _operand(0)
    t = x.T.contiguous() if right else x
    got = quantize_operand(t, name, right=right)
    got = got.T if right else got
    ref, scales = (_nvfp4_reference if scaling == "nvfp4" else
                   lambda v: _mx_reference(v, elem))(x.numpy())
    np.testing.assert_array_equal(got.numpy(), ref)
    assert np.array_equal(np.signbit(got.numpy()), np.signbit(ref))
    # the same as the element format with the recipe's scaling
    assert torch.equal(quantize_operand(t, elem, scaling, right=right), got.T if right else got)
    # the statistics: against the reference's own counts
    st = operand_stats(t, name, right=right)
    nz = (x != 0).numpy()
    assert st["elements"] == int(nz.sum())
    assert st["underflow"] == int((nz & (ref == 0)).sum()) > 0
    assert (st["scale_min"], st["scale_max"]) == (min(scales), max(scales))
    assert st["saturation"] > 0  # MX: a block's largest in [2^emax * 1.5, 2^(emax+1)) clamps


def test_recipe_extremes_e8m0_clamp_nvfp4_flush_and_bad_names():
    # an MX block far below 2^-127 * 2^emax: the e8m0 scale clamps at 2^-127, elements flush
    x = torch.full((1, 32), 2.0 ** -140, dtype=torch.float64)
    assert operand_stats(x, "mxfp8")["scale_min"] == 2.0 ** -127
    assert torch.equal(quantize_operand(x, "mxfp8"), torch.zeros_like(x))
    assert operand_stats(x, "mxfp8")["underflow"] == 32
    # nvfp4: a block 10^-8 below the tensor's largest has an e4m3 scale of 0: all flushed
    # (the tensor's largest 6 x 448: its fp32 scale is 1, exact)
    x = torch.full((1, 32), 6.0 * 448, dtype=torch.float64)
    x[0, 16:] = -1e-5
    q = quantize_operand(x, "nvfp4")
    assert q[0, :16].eq(6 * 448).all() and q[0, 16:].eq(0).all() and q[0, 16:].signbit().all()
    st = operand_stats(x, "nvfp4")
    assert (st["underflow"], st["scale_min"]) == (16, 0.0)
    # empty and all-zero operands
    assert quantize_operand(torch.zeros(3, 0, dtype=torch.float64), "nvfp4").shape == (3, 0)
    z = torch.zeros(2, 40, dtype=torch.float64)
    assert torch.equal(quantize_operand(z, "mxfp4"), z)
    assert operand_stats(z, "mxfp4")["elements"] == 0
    assert math.isnan(operand_stats(z, "mxfp4")["scale_min"])
    assert recipe("MXFP6") == (get_format("fp6_e3m2"), "mx32")
    with pytest.raises(ValueError, match="gemm scaling must be one of"):
        quantize_operand(z, "fp4_e2m1", "mx16")
    with pytest.raises(ValueError, match="unknown format"):
        quantize_operand(z, "nvfp8")


def test_emulate_matmul_with_a_recipe_is_the_product_of_its_operands():
    a, b = _operand(1, 8, 96), _operand(2, 8, 96).T.contiguous()
    for name in ("nvfp4", "mxfp4"):
        got = emulate_matmul(a, b, "fp8-promoted", inputs=name)
        qa, qb = quantize_operand(a, name), quantize_operand(b, name, right=True)
        assert torch.equal(got, emulate_matmul(qa, qb, "fp8-promoted"))
    # finer elements keep more: fp4 < fp6 < fp8 on Gaussian operands (mx32 each)
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randn(16, 256, generator=g, dtype=torch.float64),
            torch.randn(256, 16, generator=g, dtype=torch.float64))
    exact = a @ b
    err = {n: float((emulate_matmul(a, b, None, inputs=n) - exact).norm() / exact.norm())
           for n in ("mxfp4", "mxfp6", "mxfp8")}
    assert err["mxfp8"] < err["mxfp6"] < err["mxfp4"] < 0.2


# --------------------------------------------------------------------------- alignment
def _aligned_reference(a: np.ndarray, b: np.ndarray, acc: Accumulation) -> np.ndarray:
    """The aligned accumulator from its definition, one output element at a time in exact
    rationals: per group, 2^e the leading bit of the largest |product| (and |accumulator|),
    each rounded to a multiple of 2^(e - bits + 1) (truncation or nearest-even), summed;
    the block's sum rounded into the accumulator's format (fxstab.quantize on one value)."""
    al, k = acc.align, a.shape[1]
    out = np.empty((a.shape[0], b.shape[1]))

    def to_quantum(v: Fraction, q: Fraction) -> Fraction:
        n = v / q
        if al.rounding.value == "zero":
            return Fraction(math.trunc(n)) * q
        return Fraction(round(n)) * q  # Python's round of a Fraction: ties to even

    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            run = Fraction(0)
            for s in range(0, k, acc.block):
                block = Fraction(0)
                for g in range(s, min(s + acc.block, k), al.group):
                    ps = [Fraction(float(a[i, t])) * Fraction(float(b[t, j]))
                          for t in range(g, min(g + al.group, k))]
                    vals = ps + ([run] if al.with_accumulator else [])
                    big = max(abs(v) for v in vals)
                    if big == 0:
                        continue
                    e = math.floor(math.log2(big))
                    e += (Fraction(2) ** (e + 1) <= big) - (Fraction(2) ** e > big)
                    q = Fraction(2) ** (e - al.bits + 1)
                    if al.with_accumulator:
                        run = to_quantum(run, q)
                    block += sum(to_quantum(p, q) for p in ps)
                t = torch.tensor([float(run + block)], dtype=torch.float64)
                run = Fraction(float(fxstab.quantize(t, acc.fmt, acc.rounding)[0]))
            out[i, j] = float(run)
    return out


ALIGNED = [
    Accumulation((8, 13), 32, rounding="zero", align=Alignment(32, 16, True)),
    Accumulation((8, 13), 16, rounding="zero", align=Alignment(4, 14)),
    Accumulation("fp32", 8, rounding="zero", align=Alignment(8, 24, True)),
    Accumulation("fp16", 4, rounding="nearest", align=Alignment(4, 11, True, "nearest")),
]


@pytest.mark.parametrize("acc", ALIGNED, ids=lambda a: a.label)
def test_aligned_accumulators_are_the_definition_bit_for_bit(acc):
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(3, 45, generator=g) * torch.logspace(-3, 3, 45)).to(torch.bfloat16)
    b = torch.randn(45, 4, generator=g).to(torch.bfloat16)
    a[0, 3] = 0.0
    a64, b64 = a.double().numpy(), b.double().numpy()
    got = emulate_matmul(a.double(), b.double(), acc)
    np.testing.assert_array_equal(got.numpy(), _aligned_reference(a64, b64, acc))


def test_alignment_costs_digits_settings_and_labels():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(8, 2048, generator=g, dtype=torch.float64)
    b = torch.rand(2048, 8, generator=g, dtype=torch.float64)
    exact = a @ b
    plain = Accumulation((8, 13), 32, rounding="zero")
    aligned = fxstab.Accumulation.parse("fp8-fast")
    assert aligned.align == Alignment(32, 16, True) and aligned.block == 32
    e_plain = float(((emulate_matmul(a, b, plain) - exact) / exact).abs().max())
    e_al = float(((emulate_matmul(a, b, aligned) - exact) / exact).abs().max())
    assert e_al > 3 * e_plain  # truncating each product at the accumulator's scale loses more
    # a wide alignment changes nothing a fine accumulator would show
    wide = Accumulation("fp64", 32, rounding="nearest", align=Alignment(32, 40))
    assert float(((emulate_matmul(a, b, wide) - exact) / exact).abs().max()) < 1e-11
    # NaN and inf products stay non-finite; K = 0 is the empty sum
    an = a.clone()
    an[0, 5] = float("nan")
    assert emulate_matmul(an, b, aligned)[0].isnan().all()
    assert emulate_matmul(an, b, aligned)[1:].isfinite().all()
    assert torch.equal(emulate_matmul(a[:, :0], b[:0], aligned), torch.zeros(8, 8,
                                                                          dtype=torch.float64))
    assert aligned.label == "fp8-fast"
    assert Accumulation((8, 13), 32, align=Alignment(8, 14)).label == \
        "e8m13/b32/nearest/a8x14/zero"
    for kw, match in [(dict(group=0, bits=14), "group"), (dict(group=4, bits=1), "bits"),
                      (dict(group=1 << 16, bits=40), "exact in fp64"),
                      (dict(group=4, bits=14, rounding="up"), "'zero'"),
                      (dict(group=4, bits=14, with_accumulator=1), "True or False")]:
        with pytest.raises(ValueError, match=match):
            Alignment(**kw)
    with pytest.raises(ValueError, match="must divide the block"):
        Accumulation("fp16", 16, align=Alignment(5, 11))
    with pytest.raises(ValueError, match="equal it when the accumulator"):
        Accumulation("fp16", 16, align=Alignment(4, 11, True))
    with pytest.raises(ValueError, match="fxstab Alignment"):
        Accumulation("fp16", 16, align=(4, 11))


# --------------------------------------------------------------------------- in the analysis
def test_an_analysed_linear_reports_its_operands_block_statistics_and_the_finding():
    """gemm_inputs="fp4_e2m1", gemm_scaling="nvfp4": the linear's report carries both
    operands' statistics in the recipe (the first sample's, the program's operands up to the
    surrogate's 2^-24), the map aggregates them and writes them as optional JSON keys (a map
    without them loads as one with none measured), and a GEMM past the underflow threshold
    gets a finding."""
    import json
    import warnings

    from fxstab.digitmap import DigitMap
    from fxstab.digitmap.operators import (UNDERFLOW_FINDING_PCT, operand_findings,
                                           operand_percent)

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 16)
    x = torch.randn(8, 64) * torch.logspace(-8, 0, 64)  # elements far below their block's max
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        be = fxstab.backend(format="fp32", gemm_inputs="fp4_e2m1", gemm_scaling="nvfp4",
                            accumulate="fp8-promoted")
    f = torch.compile(lin, backend=be)
    for _ in range(2):
        assert torch.equal(f(x), lin(x))
    (r,) = [r for r in be.reports if r.kind == "linear"][-1:]
    want = [operand_stats(x.double(), "nvfp4"),
            operand_stats(lin.weight.detach().double().T, "nvfp4", right=True)]
    assert r.operand_elements == sum(w["elements"] for w in want) == 8 * 64 + 16 * 64
    assert abs(r.operand_underflow - sum(w["underflow"] for w in want)) <= 2
    assert r.operand_scale_min == pytest.approx(min(w["scale_min"] for w in want), rel=1e-6)
    assert r.operand_scale_max == pytest.approx(max(w["scale_max"] for w in want), rel=1e-6)
    dm = be.digit_map()
    op = dm.operators["linear#0"]
    assert op.operand_elements == 2 * r.operand_elements  # two calls, summed
    under, sat = operand_percent(op)
    assert under > UNDERFLOW_FINDING_PCT and 0 <= sat < 100
    (finding,) = operand_findings(dm.operators.values())
    assert finding.startswith(f"the operands of linear#0 lose {under:.1f}% of their non-zero "
                              f"elements to underflow")
    # fp8 e4m3 with per-tensor scaling keeps these operands: below the threshold
    assert operand_findings(dm.operators.values(), threshold=100.0) == []
    doc = json.loads(dm.to_json())
    assert doc["operators"][0]["operand_underflow"] == op.operand_underflow
    back = DigitMap.from_json(dm.to_json())
    assert back.operators["linear#0"].operand_underflow == op.operand_underflow
    # where its digits go: the recipe's operands' digits beside the accumulator's
    assert 0 <= r.operand_min_digits <= r.operand_digits < 3 and op.operand_digits > 0
    assert back.operators["linear#0"].operand_digits == op.operand_digits
    for k in ("operand_elements", "operand_underflow", "operand_saturation",
              "operand_scale_min", "operand_scale_max", "operand_digits", "operand_min_digits"):
        del doc["operators"][0][k]
    old = DigitMap.from_json(json.dumps(doc)).operators["linear#0"]
    assert old.operand_elements == 0 and math.isnan(operand_percent(old)[0])
    # without a recipe: nothing measured
    torch._dynamo.reset()
    plain = fxstab.backend(format="fp32")
    torch.compile(lin, backend=plain)(x)
    assert all(r.operand_elements == 0 for r in plain.reports)


def test_where_a_gemms_digits_go_operands_against_accumulator():
    """Item 3 of issue 43: modelled_gemm measures the digits the recipe's operands keep of the
    program's product (exact sums of both, first sample) beside the accumulator's; the finding
    names the larger loss with its fix."""
    from types import SimpleNamespace

    from fxstab.digitmap.operators import OperatorDigits, digit_budget_findings
    from fxstab.numerics.digits import true_digits
    from fxstab.rules.accumulation import accumulated_product, modelled_gemm
    from fxstab.rules.lifting import Stacked

    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 16, 512, generator=g, dtype=torch.float64)
    w = torch.randn(24, 512, generator=g, dtype=torch.float64)
    cfg = SimpleNamespace(gemm_scaling="mx32", rounding="random", kernels="torch")
    got = {}
    for fmt in ("fp8_e4m3", "fp4_e2m1"):
        plan = SimpleNamespace(kind="linear", accumulate=Accumulation.parse("fp8-promoted"),
                               gemm_inputs=get_format(fmt), gemm_scaling=None)
        _, fig = modelled_gemm((Stacked(x), w), {}, plan, cfg, 9, lambda t: t.double(), 7.0)
        rounded = accumulated_product((Stacked(x[:1]), w), {}, "linear", None, 9,
                                      lambda t: t.double(), get_format(fmt), "mx32", "random",
                                      "torch").samples
        want = true_digits(rounded, x[:1] @ w.T, 7.0)
        assert fig.operands["digits"] == pytest.approx(float(want.mean()), abs=1e-12)
        assert fig.operands["min_digits"] == pytest.approx(float(want.min()), abs=1e-12)
        got[fmt] = fig
    assert got["fp4_e2m1"].operands["digits"] < got["fp8_e4m3"].operands["digits"] - 0.5
    # promoted e8m13 keeps ~3.9 digits; e4m3 operands ~2, fp4 ~1: the operands cost more
    assert got["fp8_e4m3"][0] > got["fp8_e4m3"].operands["digits"]

    def op(name, ops, acc):
        return OperatorDigits(name=name, kind="linear", module_path="", status="rounded",
                              calls=1, numel=4, avg_digits=1.0, min_digits=1.0, max_digits=1.0,
                              operand_elements=8, operand_digits=ops, accumulator_digits=acc)
    findings = digit_budget_findings([op("a", 6.5, 2.0), op("b", 1.0, 3.5), op("c", 6.9, 6.8),
                                      op("d", math.nan, 1.0)], cap=7.22)
    assert len(findings) == 2
    assert findings[0].startswith("the operands' recipe, not the accumulator, costs b 6.2 "
                                  "digits")
    assert findings[1].startswith("the accumulator, not the operands, costs a 5.2 digits")
    assert "promote the partial sums into fp32 every 128" in findings[1]


@pytest.mark.parametrize("name", SMALL)
def test_the_fused_c_rounder_rounds_fp4_fp6_as_the_reference(name):
    """The analysis's CPU kernel reads the same constants (largest value, no inf): a format
    of the program or of a recipe rounds there as fxstab.quantize does."""
    from fxstab.cpu import bindings

    if not bindings.available():
        pytest.skip("the C kernels did not build here")
    f = get_format(name)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 200, generator=g, dtype=torch.float64) * f.max_normal / 2
    x[0, :4] = torch.tensor([f.max_normal * 1.5, -f.min_subnormal / 3, -0.0, 1e-300])
    for mode in ("nearest", "zero", "up", "down"):
        got = bindings.rounder(f, mode, torch.float64, 3)(x.clone(), 0, want_stats=False,
                                                          in_place=True)[0]
        want = fxstab.quantize(x, f, mode)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), mode


def _uniform_mx_linear_over(monkeypatch=None):
    """An analysed linear (32 tokens, K = 1024, 32 outputs, fp32 format, N = 3) of uniform
    [0, 1) operands in mxfp4 with the fp8-promoted accumulator: the share of outputs whose
    CESTAC estimate exceeds the true digits of the recipe as the hardware runs it (against the
    exact product of the unscaled operands) by a digit or more."""
    import warnings

    from fxstab.numerics.digits import cestac_digits, true_digits

    g = torch.Generator().manual_seed(0)
    x, w = torch.rand(32, 1024, generator=g), torch.rand(32, 1024, generator=g)
    lin = torch.nn.Linear(1024, 32, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        be = fxstab.backend(format="fp32", accumulate="fp8-promoted", gemm_inputs="fp4_e2m1",
                            gemm_scaling="mx32", n_samples=3, seed=0)
    f = torch.compile(lin, backend=be)
    with torch.no_grad(), be.capture_samples() as cap:
        f(x)
    est = cestac_digits(cap.output.double(), "fp32")
    hw = emulate_matmul(x.double(), w.double().T, "fp8-promoted", inputs="mxfp4")
    true = true_digits(hw, x.double() @ w.double().T, get_format("fp32").digit_cap)
    return float((est - true >= 1).double().mean())


def test_a_recipes_saturation_is_in_the_spread(monkeypatch):
    """MX's blocks clamp their largest elements (a block's largest lands in [4, 8) x scale,
    e2m1 ends at 6) alike in every sample: a bias. The samples' spread carries the recipe's
    whole error (t_i (D - X), X the program's exact product), so the estimate is not over the
    truth; without that term 60% of the outputs were over by a digit."""
    import fxstab.rules.accumulation as rules

    assert _uniform_mx_linear_over() <= 0.05
    blind = rules.with_bias
    monkeypatch.setattr(rules, "with_bias", lambda s, hw, ex, prog=None: blind(s, hw, ex))
    assert _uniform_mx_linear_over() > 0.3
