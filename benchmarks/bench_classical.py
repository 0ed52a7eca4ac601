"""Calibration table 1: classical formulations, unstable vs stabilized, in fp32 and fp64.

Each case is a plain Python function of floats (or tensors) run by the eager arithmetic-level
driver (``fxstab.analyze``): every primitive rounds randomly into the format, and the digits of
the result are CESTAC's. Expected: the unstable formulations keep ~0 digits in fp32, the
stabilized ones ~6-7 (fp32, cap 7.22) and ~15 (fp64, cap 15.95).

A second table runs the NumPy twins of Rump's polynomial, the quadratic, the variance and the
series (the same formulas written with NumPy functions on NumPy arguments,
``fxstab.eager.arrays``) beside the torch versions: for the same seed they must give the same
samples, hence the same digits and counters.

    .venv/bin/python benchmarks/bench_classical.py [--seeds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import save_json  # noqa: E402

import fxstab


# ----------------------------------------------------------------------------- cases
def rump(a, b):
    # Rump (1988): the exact value at (77617, 33096) is -0.827396059946821...
    return 333.75 * b**6 + a**2 * (11 * a**2 * b**2 - b**6 - 121 * b**4 - 2) + 5.5 * b**8 + a / (2 * b)


def quadratic_naive(b, c):
    # smaller root of x^2 + b x + c with b^2 >> 4c: -b + sqrt(...) cancels
    return (-b + (b * b - 4 * c).sqrt()) / 2


def quadratic_stable(b, c):
    q = -(b + (b * b - 4 * c).sqrt()) / 2
    return c / q


def one_minus_cos_naive(x):
    return (1 - x.cos()) / (x * x)


def one_minus_cos_stable(x):
    s = (x / 2).sin()
    return 2 * s * s / (x * x)


def expm1_naive(x):
    return x.exp() - 1


def expm1_stable(x):
    return x.expm1()


def variance_one_pass(x):
    n = x.shape[0]
    return ((x * x).sum() - x.sum() * x.sum() / n) / (n - 1)


def variance_two_pass(x):
    n = x.shape[0]
    d = x - x.sum() / n
    return (d * d).sum() / (n - 1)


_BINOM6 = [1.0, -6.0, 15.0, -20.0, 15.0, -6.0, 1.0]  # (x-1)^6 = sum c_k x^k


def poly_naive(x):
    s = 0.0
    for k, c in enumerate(_BINOM6):
        s = s + c * x**k
    return s


def poly_horner(x):
    s = 0.0
    for c in reversed(_BINOM6):
        s = s * x + c
    return s


def poly_factored(x):
    return (x - 1) ** 6


def series_naive(x):
    # exp(-x) by its alternating Taylor series, summed until the sum stops changing (CESTAC ==)
    s = 1.0 + 0 * x
    t = 1.0 + 0 * x
    k = 0
    while True:
        k += 1
        t = t * (-x) / k
        s_new = s + t
        if s_new == s or k > 500:
            return s_new
        s = s_new


def series_closed(x):
    return 1 / x.exp()


# NumPy twins: the same formulas with NumPy functions, for NumPy arguments.
def quadratic_naive_np(b, c):
    return (-b + np.sqrt(b * b - 4 * c)) / 2


def quadratic_stable_np(b, c):
    q = -(b + np.sqrt(b * b - 4 * c)) / 2
    return c / q


def variance_one_pass_np(x):
    n = x.shape[0]
    return (np.sum(x * x) - np.sum(x) * np.sum(x) / n) / (n - 1)


def variance_two_pass_np(x):
    n = x.shape[0]
    d = x - np.sum(x) / n
    return np.sum(d * d) / (n - 1)


def series_naive_np(x):
    s = 1.0 + 0 * x
    t = 1.0 + 0 * x
    k = 0
    while True:
        k += 1
        t = t * np.negative(x) / k
        s_new = np.add(s, t)
        if np.equal(s_new, s) or k > 500:
            return s_new
        s = s_new


def series_closed_np(x):
    return 1 / np.exp(x)


def _variance_data():
    return 1e4 + torch.rand(64, generator=torch.Generator().manual_seed(0)).double()


@dataclass(frozen=True)
class Case:
    name: str
    unstable: Callable
    stable: Callable | None
    args: Callable  # () -> tuple of Python floats / tensors
    note: str


CASES = [
    Case("Rump's polynomial", rump, None, lambda: (77617.0, 33096.0), "(77617, 33096)"),
    Case("quadratic smaller root", quadratic_naive, quadratic_stable, lambda: (1e4, 1.0),
         "x^2 + 1e4 x + 1"),
    Case("(1-cos x)/x^2", one_minus_cos_naive, one_minus_cos_stable, lambda: (1e-4,),
         "x = 1e-4; stable 2 sin^2(x/2)/x^2"),
    Case("exp(x)-1", expm1_naive, expm1_stable, lambda: (1e-8,), "x = 1e-8; stable expm1"),
    Case("variance, offset data", variance_one_pass, variance_two_pass,
         lambda: (_variance_data(),),
         "1e4 + U(0,1), n=64; one-pass vs two-pass"),
    Case("(x-1)^6 near 1", poly_naive, poly_factored, lambda: (1.001,),
         "expanded vs factored (Horner: extra row)"),
    Case("(x-1)^6 Horner", poly_horner, poly_factored, lambda: (1.001,), "Horner vs factored"),
    Case("alternating series exp(-20)", series_naive, series_closed, lambda: (20.0,),
         "Taylor series until it stops changing vs 1/exp(20)"),
]


@dataclass(frozen=True)
class Twin:
    """A classical case in torch and in NumPy: the same formula, the same data."""

    case: str
    variant: str
    torch_fn: Callable
    numpy_fn: Callable
    torch_args: Callable
    numpy_args: Callable


NUMPY_TWINS = [
    Twin("Rump's polynomial", "unstable", rump, rump, lambda: (77617.0, 33096.0),
         lambda: (np.float64(77617.0), np.float64(33096.0))),
    Twin("quadratic smaller root", "unstable", quadratic_naive, quadratic_naive_np,
         lambda: (1e4, 1.0), lambda: (np.float64(1e4), np.float64(1.0))),
    Twin("quadratic smaller root", "stable", quadratic_stable, quadratic_stable_np,
         lambda: (1e4, 1.0), lambda: (np.float64(1e4), np.float64(1.0))),
    Twin("variance, offset data", "unstable", variance_one_pass, variance_one_pass_np,
         lambda: (_variance_data(),), lambda: (_variance_data().numpy(),)),
    Twin("variance, offset data", "stable", variance_two_pass, variance_two_pass_np,
         lambda: (_variance_data(),), lambda: (_variance_data().numpy(),)),
    Twin("alternating series exp(-20)", "unstable", series_naive, series_naive_np,
         lambda: (20.0,), lambda: (np.float64(20.0),)),
    Twin("alternating series exp(-20)", "stable", series_closed, series_closed_np,
         lambda: (20.0,), lambda: (np.float64(20.0),)),
]


def digits_of(fn: Callable, args: tuple, fmt: str, seed: int) -> tuple[float, float, dict]:
    """(avg, min) digits of fn's output and the counters, eager arithmetic-level analysis."""
    r = fxstab.analyze(fn, format=fmt, seed=seed)(*args)
    d = np.asarray(r.digits, dtype=np.float64)  # a tensor (torch) or an ndarray (NumPy)
    return float(d.mean()), float(d.min()), r.counters


def measure_twins(seeds: int = 3) -> list[dict]:
    """The NumPy twins beside the torch versions: digits of both, and whether every seed gave
    the same samples."""
    rows = []
    for tw in NUMPY_TWINS:
        row = {"case": tw.case, "variant": tw.variant}
        for fmt in ("fp32", "fp64"):
            dt, dn, same = [], [], True
            for s in range(seeds):
                rt = fxstab.analyze(tw.torch_fn, format=fmt, seed=s)(*tw.torch_args())
                rn = fxstab.analyze(tw.numpy_fn, format=fmt, seed=s)(*tw.numpy_args())
                dt.append(float(np.asarray(rt.digits, dtype=np.float64).mean()))
                dn.append(float(np.asarray(rn.digits, dtype=np.float64).mean()))
                same &= bool(np.array_equal(rt.samples.numpy(), np.asarray(rn.samples),
                                            equal_nan=True)) and rt.counters == rn.counters
            row[f"{fmt}_torch"] = sum(dt) / len(dt)
            row[f"{fmt}_numpy"] = sum(dn) / len(dn)
            row[f"{fmt}_same"] = same
        rows.append(row)
    return rows


def twins_table(rows: list[dict]) -> str:
    head = (f"{'NumPy twin of':<30} {'variant':<9} {'fp32 torch':>10} {'fp32 numpy':>10} "
            f"{'fp64 torch':>10} {'fp64 numpy':>10}  same samples")
    lines = [head, "-" * len(head)]
    for r in rows:
        same = "yes" if r["fp32_same"] and r["fp64_same"] else "NO"
        lines.append(f"{r['case']:<30} {r['variant']:<9} {r['fp32_torch']:10.2f} "
                     f"{r['fp32_numpy']:10.2f} {r['fp64_torch']:10.2f} {r['fp64_numpy']:10.2f}"
                     f"  {same}")
    return "\n".join(lines)


def measure(seeds: int = 3) -> list[dict]:
    rows = []
    for case in CASES:
        for variant, fn in (("unstable", case.unstable), ("stable", case.stable)):
            if fn is None:
                continue
            row = {"case": case.name, "variant": variant, "note": case.note}
            for fmt in ("fp32", "fp64"):
                avgs, mins, counters = [], [], {}
                for s in range(seeds):
                    a, m, c = digits_of(fn, case.args(), fmt, s)
                    avgs.append(a)
                    mins.append(m)
                    counters = c
                row[f"{fmt}_avg"] = sum(avgs) / len(avgs)
                row[f"{fmt}_min"] = min(mins)
                row[f"{fmt}_cancel"] = counters["cancellation"]
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'case':<30} {'variant':<9} {'fp32 avg':>8} {'fp32 min':>8} {'fp64 avg':>8} "
            f"{'fp64 min':>8} {'cancel32':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['case']:<30} {r['variant']:<9} {r['fp32_avg']:8.2f} {r['fp32_min']:8.2f} "
                     f"{r['fp64_avg']:8.2f} {r['fp64_min']:8.2f} {r['fp32_cancel']:8d}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--json", default=None, help="save rows and machine info as JSON")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = measure(a.seeds)
    print(table(rows))
    print(f"\n({a.seeds} seeds, N=3, random rounding; min over seeds, avg of means; "
          f"{time.perf_counter() - t0:.1f} s)")
    twins = measure_twins(a.seeds)
    print()
    print(twins_table(twins))
    print(f"\n(avg digits over {a.seeds} seeds; same samples: every seed and format gave "
          f"bit-identical samples and equal counters)")
    if a.json:
        save_json(a.json, {"benchmark": "bench_classical", "seeds": a.seeds, "rows": rows,
                           "numpy_twins": twins})
    return 0


if __name__ == "__main__":
    sys.exit(main())
