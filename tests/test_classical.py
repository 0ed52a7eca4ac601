"""Calibration bands of the two tables in benchmarks/ (docs/design.md §10), one seed.

The bands: unstable formulations keep ~0 digits in fp32 (classical) and ~0-1 (operators);
stabilized ones keep >= 5.5 of fp32's 7.22 and >= 14 of fp64's 15.95. The benchmark scripts print
the full tables over several seeds.
"""

import importlib.util
import pathlib
import sys

import pytest

import fxstab

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


classical = _load("bench_classical")
optable = _load("bench_operator_table")


# -1e4 + sqrt(1e8 - 4) in fp32: 1e8 - 4 rounds up to 1e8 (then sqrt is exactly 1e4) with
# probability 1/2, else sqrt(99999992) rounds up to 1e4 with probability 1/2, so each sample's
# difference is exactly 0 with probability 3/4 and all three are (samples 2 and 3 antithetic)
# with probability 3/8. CESTAC cannot tell that from an exact zero (docs/arithmetic-level.md,
# "Exact zeros by chance"): such seeds are skipped, every other one must show the loss.
_EXACT_ZERO_BY_CHANCE = {"quadratic smaller root"}


@pytest.mark.parametrize("case", classical.CASES, ids=lambda c: c.name)
def test_classical_case(case):
    if case.name in _EXACT_ZERO_BY_CHANCE:
        lost = 0
        for seed in range(8):
            r = fxstab.analyze(case.unstable, format="fp32", seed=seed)(*case.args())
            if bool((r.samples == 0).all()):
                continue
            assert float(r.digits.min()) <= 0.5, f"seed {seed}: kept {r.digits} digits"
            lost += 1
        assert lost >= 2, f"only {lost} of 8 seeds avoided an all-zero result (expected ~5/8)"
        c32 = {}
    else:
        avg32, min32, c32 = classical.digits_of(case.unstable, case.args(), "fp32", 0)
        assert avg32 <= 0.5, f"{case.name} unstable fp32 kept {avg32:.2f} digits"
    if case.name == "Rump's polynomial":
        avg64, _, c64 = classical.digits_of(case.unstable, case.args(), "fp64", 0)
        assert avg64 <= 0.5 and c64["cancellation"] >= 1
        assert c32["cancellation"] >= 1
    if case.stable is not None:
        s32, _, sc32 = classical.digits_of(case.stable, case.args(), "fp32", 0)
        s64, _, _ = classical.digits_of(case.stable, case.args(), "fp64", 0)
        assert 5.5 <= s32 <= 7.23, f"{case.name} stable fp32 {s32:.2f}"
        assert 14.0 <= s64 <= 15.96, f"{case.name} stable fp64 {s64:.2f}"


@pytest.mark.parametrize("row", optable.ROWS, ids=lambda r: f"{r.operator}-{r.variant}")
def test_operator_row(row):
    avg32, min32, _ = optable.digits_of(row, "fp32", 0)
    avg64, _, _ = optable.digits_of(row, "fp64", 0)
    if row.unstable:
        assert avg32 <= 1.5 and min32 <= 0.5, f"{row.variant}: fp32 avg {avg32:.2f} min {min32:.2f}"
    else:
        assert avg32 >= 5.5 and avg64 >= 14.0, f"{row.variant}: fp32 {avg32:.2f} fp64 {avg64:.2f}"
