"""What fp32 samples could save the fp32 format at the arithmetic level (issue 34), measured.

In the fp32 format the samples are fp64 (the working dtype): every rounded primitive computes
in fp64 and the kernel rounds and measures fp64 values. Samples kept in fp32 would halve the
memory of the samples, but the digits of fp32-format samples still need fp64 statistics (their
samples differ in the last fp32 bits: an fp32 mean and fp32 deviations lose them), and the
library functions (exp, log, tanh...) still need fp64 operands to round correctly. This script
measures, on the LayerNorm+softmax rows of ``bench_compiled.py`` (256x1024, N = 3, one
thread, in one process), each kind of full-size primitive as it runs now against what it
would cost at best with fp32 samples:

* ``binary`` (sub, mul, add, div: ``native.Binary`` computes them inside the rounding): now the
  fp64 kernel; at best the fp64 statistics alone (the kernel's ``stats only`` pass over fp64
  values of the same count: compute-bound, four double lanes), a bound that ignores the
  rounding and the memory traffic altogether.
* ``unary`` without an error-free transformation (exp): now ``exp`` in fp64 and the fp64
  rounding; at best the fp32 samples widened to fp64, ``exp`` in fp64 and the fp64 statistics.
* ``reduction`` (sum, var over rows): now the fp64 reduction of fp64 samples; at best an fp64
  accumulation of fp32 samples (``torch.sum(dtype=float64)``, or widened first: the faster).

The ``model`` rows add them up over the primitives of LayerNorm+softmax (six binary, one
unary, three reductions: ``--counts``) and put the sum over the eager call: the kernels and
the samples' own compute of the analysed call now, and their least with fp32 samples. The rest
of the analysed call (the deterministic pass, Python, counters) is not in either.

    python benchmarks/bench_sample_dtype.py          # the table, results/bench_sample_dtype.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def best_ms(fn, repeats: int) -> float:
    """The least of ``repeats`` timed calls (after one untimed), in ms."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None) -> int:
    from benchmarks.common import save_json
    from fxstab.cpu import bindings as native
    from fxstab.numerics.formats import get_format
    from fxstab.numerics.rounding import Rounding

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--counts", default="6,1,3", help="binary, unary, reduction primitives")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    if not native.available():
        print("the fused CPU kernels are unavailable here: nothing to measure")
        return 1
    torch.set_num_threads(1)
    n, shape = args.samples, (args.rows, args.cols)
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(n, *shape, generator=g)
    x64 = x32.double()
    col64 = torch.randn(n, args.rows, 1, generator=g, dtype=torch.float64)
    fp32 = get_format("fp32")
    rounder = native.rounder(fp32, Rounding.RANDOM, torch.float64, n)
    measure = native.rounder(fp32, None, torch.float64, n)
    binary = native.Binary(rounder, "sub")
    assert binary.reads(x64, col64)
    r = args.repeats
    one = x32[0].clone()

    def eager_call():
        return F.softmax(F.layer_norm(one, shape[-1:]), -1)
    eager = best_ms(eager_call, r)
    stats64 = best_ms(lambda: measure(x64, 0, True, False, False), r)
    rows = [
        {"primitive": "binary", "now_ms": best_ms(lambda: binary(x64, col64, 1), r),
         "fp32_best_ms": stats64},
        {"primitive": "unary", "now_ms": best_ms(lambda: rounder(torch.exp(x64), 1), r),
         "fp32_best_ms": best_ms(lambda: torch.exp(x32.double()), r) + stats64},
        {"primitive": "reduction", "now_ms": best_ms(lambda: torch.sum(x64, -1), r),
         "fp32_best_ms": min(best_ms(lambda: torch.sum(x32, -1, dtype=torch.float64), r),
                             best_ms(lambda: torch.sum(x32.double(), -1), r))},
    ]
    eager = min(eager, best_ms(eager_call, r))  # the least over the run's start and end
    counts = [int(c) for c in args.counts.split(",")]
    now = sum(c * row["now_ms"] for c, row in zip(counts, rows))
    best = sum(c * row["fp32_best_ms"] for c, row in zip(counts, rows))
    print(f"LayerNorm+softmax {args.rows}x{args.cols}, fp32 format, N={n}, one thread; "
          f"eager {eager:.3f} ms\n")
    print(f"{'primitive':<12}{'now ms':>10}{'fp32 samples, best ms':>24}{'saved':>8}")
    for row in rows:
        print(f"{row['primitive']:<12}{row['now_ms']:>10.3f}{row['fp32_best_ms']:>24.3f}"
              f"{1 - row['fp32_best_ms'] / row['now_ms']:>8.0%}")
    print(f"{'model':<12}{now / eager:>9.1f}x{best / eager:>23.1f}x{1 - best / now:>8.0%}"
          f"   ({'+'.join(map(str, counts))} primitives, over the eager call)")
    path = save_json(Path(args.out) / "bench_sample_dtype.json",
                     {"benchmark": "bench_sample_dtype", "shape": list(shape), "n_samples": n,
                      "eager_ms": eager, "counts": counts, "rows": rows,
                      "model_now_ratio": now / eager, "model_fp32_best_ratio": best / eager})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
