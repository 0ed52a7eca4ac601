"""Throughput of fxstab's rounding and digit reduction on CPU tensors.

For each size, every rounding mode of ``fxstab.quantize`` (fp32 input, one element per value),
``round_samples`` on N stacked samples, and ``digit_stats`` (the per-operator digit reduction
over N samples) are timed against a plain ``x.to(torch.bfloat16)`` cast measured in the same
run. Absolute times on a shared CPU mean little; the ratio to the cast is the number to read.

    python benchmarks/bench_rounding.py                      # 1e4, 1e5, 1e6 elements
    python benchmarks/bench_rounding.py --sizes 1e4 1e7 --plot
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxstab  # noqa: E402
from benchmarks.common import save_json  # noqa: E402
from fxstab.numerics.digits import digit_stats  # noqa: E402
from fxstab.numerics.rounding import Rounding, quantize, round_samples  # noqa: E402


def _time(fn, min_time: float, min_reps: int) -> float:
    """Fastest of the timed calls (one warm-up, then at least ``min_reps`` calls and
    ``min_time`` seconds): on a CPU shared with other jobs the minimum is the stable estimate of
    the uncontended time; the median moved by 10x between runs on this 2-core machine."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return min(times)


def run(sizes: list[int], fmt: str, modes: list[str], n_samples: int, min_time: float,
        min_reps: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for size in sizes:
        x = torch.randn(size, generator=g)
        samples = torch.randn(n_samples, size, generator=g)
        samples = x * (1 + 1e-3 * samples)
        cast = _time(lambda: x.to(torch.bfloat16), min_time, min_reps)
        cases = [("cast to bf16", size, cast)]
        for mode in modes:
            t = _time(lambda: quantize(x, fmt, mode, seed=1), min_time, min_reps)
            cases.append((f"quantize {mode}", size, t))
        for mode in ("random", "stochastic"):
            if mode in modes:
                t = _time(lambda: round_samples(samples, fmt, mode, seed=1), min_time, min_reps)
                cases.append((f"round_samples N={n_samples} {mode}", size * n_samples, t))
        t = _time(lambda: digit_stats(samples, fmt), min_time, min_reps)
        cases.append((f"digit_stats N={n_samples}", size * n_samples, t))
        for name, elems, t in cases:
            # Ratio per element to the cast of the same number of elements.
            rows.append({"size": size, "op": name, "elements": elems, "seconds": t,
                         "elements_per_s": elems / t, "ratio_to_cast": (t / elems) / (cast / size)})
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'size':>9}  {'operation':<30} {'ms':>9} {'Melem/s':>9} {'x cast':>8}",
             "-" * 70]
    for r in rows:
        lines.append(f"{r['size']:>9.0e}  {r['op']:<30} {r['seconds'] * 1e3:>9.3f} "
                     f"{r['elements_per_s'] / 1e6:>9.1f} {r['ratio_to_cast']:>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e4, 1e5, 1e6],
                    help="element counts (1e4..1e7); default 1e4 1e5 1e6")
    ap.add_argument("--format", default="bf16")
    ap.add_argument("--modes", nargs="+", default=[m.value for m in Rounding],
                    choices=[m.value for m in Rounding])
    ap.add_argument("--n-samples", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads (default 1: stable on a shared machine; 0 = torch's default)")
    ap.add_argument("--out", default=str(ROOT / "results"), help="folder for JSON and plot")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--plot", action="store_true", help="also save a PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes]
    if any(s < 1 for s in sizes):
        ap.error(f"sizes must be positive, got {args.sizes}")
    rows = run(sizes, args.format, args.modes, args.n_samples, args.min_time, args.min_reps)
    print(f"fxstab {fxstab.__version__}, torch {torch.__version__}, format {args.format}, "
          f"{torch.get_num_threads()} threads")
    print(table(rows))
    if args.no_save:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = save_json(out / f"bench_rounding-{stamp}.json", {
        "benchmark": "bench_rounding", "format": args.format, "n_samples": args.n_samples,
        "rows": rows})
    print(f"saved {path}")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for op in dict.fromkeys(r["op"] for r in rows):
            pts = [(r["size"], r["elements_per_s"]) for r in rows if r["op"] == op]
            ax.loglog(*zip(*pts), marker="o", label=op)
        ax.set_xlabel("elements per sample")
        ax.set_ylabel("elements / s")
        ax.set_title(f"fxstab rounding into {args.format} (CPU, torch {torch.__version__})")
        ax.legend(fontsize=7)
        fig.tight_layout()
        png = path.with_suffix(".png")
        fig.savefig(png, dpi=120)
        print(f"saved {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
