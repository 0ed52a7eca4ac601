"""Calibration table 2: operators in unstable vs stable formulations, fp32 and fp64.

Each row is a small PyTorch function analysed at the arithmetic level by the eager driver
(``fxstab.analyze``): composite operators decompose into aten primitives, every primitive rounds
randomly into the format, GEMMs use the data-perturbation surrogate. The table gives the avg and
min CESTAC digits of the output. Expected: the unstable formulations keep ~0-1 digits in fp32.

    .venv/bin/python benchmarks/bench_operator_table.py [--seeds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import save_json  # noqa: E402
import torch.nn.functional as F

import fxstab


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- operators
def softmax_naive(x):
    e = x.exp()
    return e / e.sum(-1, keepdim=True)


def softmax_shifted(x):
    return torch.softmax(x, -1)


def attention(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ v


def layer_norm(x):
    return F.layer_norm(x, x.shape[-1:])


def linear(x, w):
    return F.linear(x, w)


def logsumexp_naive(x):
    return x.exp().sum(-1).log()


def logsumexp_stable(x):
    return torch.logsumexp(x, -1)


def batch_norm(x):
    return F.batch_norm(x, None, None, training=True)


def _logits_large():
    # logits around 100: exp overflows fp32 (max 3.4e38 = e^88.7) but not fp64
    return (100.0 + 4 * torch.rand(8, 16, generator=_gen(1)),)


def _attn(near_tie: bool):
    g = _gen(2)
    d = 16
    k = torch.randn(8, d, generator=g)
    if near_tie:
        # keys nearly equal and a large query: scores ~1e6 that differ by O(0.1), a few fp32
        # units in the last place, so the softmax's max subtraction cancels every digit
        k = 1.0 + 1e-6 * k
        q = 3e5 * torch.ones(4, d) + torch.randn(4, d, generator=g)
    else:
        q = torch.randn(4, d, generator=g)
    v = torch.randn(8, d, generator=g)
    return q, k, v


def _ln(near_constant: bool):
    g = _gen(3)
    x = torch.randn(8, 64, generator=g)
    if near_constant:
        x = 1000.0 + 1e-4 * x
    return (x,)


def _lin(cancelling: bool):
    g = _gen(4)
    x = 1e4 + torch.rand(8, 2, generator=g)
    if cancelling:
        x[:, 1] = x[:, 0] + 1e-3 * torch.rand(8, generator=g)
        w = torch.tensor([[1.0, -1.0]])
    else:
        w = torch.eye(2)
    return x, w


def _bn(tiny: bool):
    g = _gen(5)
    if tiny:
        # a batch of 2 rows an odd number (1 or 3) of units in the last place apart: the
        # batch mean is a midpoint that must round, and x - mean cancels every digit
        base = 10.0 + torch.rand(1, 16, generator=g)
        ulp = torch.nextafter(base, torch.tensor(math.inf)) - base
        odd = 1 + 2 * torch.randint(0, 2, (1, 16), generator=g)
        x = torch.cat([base, base + odd * ulp])
    else:
        x = torch.randn(64, 16, generator=g)
    return (x,)


@dataclass(frozen=True)
class Row:
    operator: str
    variant: str
    unstable: bool
    fn: Callable
    args: Callable


ROWS = [
    Row("softmax", "naive exp/sum, logits ~100", True, softmax_naive, _logits_large),
    Row("softmax", "max-shifted", False, softmax_shifted, _logits_large),
    Row("attention", "near-tie scores ~1e6", True, attention, lambda: _attn(True)),
    Row("attention", "separated scores", False, attention, lambda: _attn(False)),
    Row("layer_norm", "near-constant rows", True, layer_norm, lambda: _ln(True)),
    Row("layer_norm", "regular rows", False, layer_norm, lambda: _ln(False)),
    Row("linear", "cancelling weights", True, linear, lambda: _lin(True)),
    Row("linear", "identity weights", False, linear, lambda: _lin(False)),
    Row("logsumexp", "naive log(sum(exp))", True, logsumexp_naive, _logits_large),
    Row("logsumexp", "stable (max-shifted)", False, logsumexp_stable, _logits_large),
    Row("batch_norm", "batch of 2, rows 1-3 ulp apart", True, batch_norm, lambda: _bn(True)),
    Row("batch_norm", "batch of 64", False, batch_norm, lambda: _bn(False)),
]


def digits_of(row: Row, fmt: str, seed: int) -> tuple[float, float, dict]:
    r = fxstab.analyze(row.fn, format=fmt, seed=seed)(*row.args())
    d = r.digits.double()
    return float(d.mean()), float(d.min()), r.counters


def measure(seeds: int = 2) -> list[dict]:
    out = []
    for row in ROWS:
        rec = {"operator": row.operator, "variant": row.variant, "unstable": row.unstable}
        for fmt in ("fp32", "fp64"):
            res = [digits_of(row, fmt, s) for s in range(seeds)]
            rec[f"{fmt}_avg"] = sum(a for a, _, _ in res) / seeds
            rec[f"{fmt}_min"] = min(m for _, m, _ in res)
            rec[f"{fmt}_counters"] = {k: v for k, v in res[-1][2].items() if v}
        out.append(rec)
    return out


def table(rows: list[dict]) -> str:
    head = (f"{'operator':<11} {'variant':<28} {'fp32 avg':>8} {'fp32 min':>8} {'fp64 avg':>8} "
            f"{'fp64 min':>8}  fp32 counters")
    lines = [head, "-" * len(head)]
    for r in rows:
        cs = ", ".join(f"{k}={v}" for k, v in r["fp32_counters"].items())
        lines.append(f"{r['operator']:<11} {r['variant']:<28} {r['fp32_avg']:8.2f} "
                     f"{r['fp32_min']:8.2f} {r['fp64_avg']:8.2f} {r['fp64_min']:8.2f}  {cs}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--json", default=None, help="save rows and machine info as JSON")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = measure(a.seeds)
    print(table(rows))
    print(f"\n({a.seeds} seeds, N=3, random rounding, arithmetic level (eager driver); "
          f"{time.perf_counter() - t0:.1f} s)")
    if a.json:
        save_json(a.json, {"benchmark": "bench_operator_table", "seeds": a.seeds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
