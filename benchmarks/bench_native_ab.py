"""The CPU kernels (``fxstab.cpu.bindings``) of this checkout against a reference revision, in one
process: each revision's library built from its own source, both called on the same samples,
interleaved (``bench_overhead.timed_interleaved``: each timed call follows an untimed call of
the same function, so neither revision is timed on the caches the other left), the median over
rounds in ns per element and sample.

Cases: one ``Rounder`` call on ``[N, numel]`` samples (rounded in place: the memory stays put)
in each working dtype (fp32 samples into bf16, fp64 samples into the fp32 format), rounding
only, with the statistics, with the zero mask, with per-element digits.

    python benchmarks/bench_native_ab.py --ref fafbb16
    python benchmarks/bench_native_ab.py --ref fafbb16 --threads 2 --numel 16384
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CASES = {"round": {"want_stats": False}, "stats": {},
         "zmask": {"want_zero_mask": True}, "digits": {"want_digits": True}}
DTYPES = {"float32": ("bf16", torch.float32), "float64": ("fp32", torch.float64)}


def calls(pkg, fmt: str, dtype: torch.dtype, x: torch.Tensor, mode: str) -> dict:
    """One callable per case, with ``pkg``'s kernels."""
    from benchmarks.bench_ab import submodule

    native = submodule(pkg, "cpu.bindings", "native")
    formats = submodule(pkg, "numerics.formats", "formats")
    rounding = submodule(pkg, "numerics.rounding", "rounding")
    r = native.rounder(formats.get_format(fmt), rounding.Rounding.parse(mode), dtype,
                       x.shape[0])
    return {case: (lambda kw=kw: r(x, 1, in_place=True, **kw)) for case, kw in CASES.items()}


def main(argv=None) -> int:
    import fxstab
    from benchmarks.bench_ab import extract_ref, load_ref, submodule
    from benchmarks.bench_overhead import timed_interleaved
    from benchmarks.common import save_json

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", required=True,
                    help="git revision of this checkout, or a directory holding fxstab/")
    ap.add_argument("--numel", type=int, default=256 * 1024, help="elements per sample")
    ap.add_argument("--n", type=int, default=3, help="samples")
    ap.add_argument("--mode", default="random")
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=31)
    ap.add_argument("--out", default="results")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    from fxstab.cpu import alloc

    alloc.tune()  # as an analysed call: freed buffers stay in the heap
    ref = load_ref(extract_ref(args.ref, Path(tempfile.mkdtemp(prefix="fxstab_ref_"))))
    if not (fxstab.cpu.bindings.available() and
            submodule(ref, "cpu.bindings", "native").available()):
        raise SystemExit("bench_native_ab: the CPU kernels could not be built")
    keys, fns = [], []
    for name in args.dtypes.split(","):
        fmt, dtype = DTYPES[name]
        x = torch.randn(args.n, args.numel, dtype=dtype, generator=torch.Generator().manual_seed(0))
        for case in CASES:
            keys.append((name, case))
            fns += [calls(pkg, fmt, dtype, x, args.mode)[case] for pkg in (ref, fxstab)]
    medians = timed_interleaved(fns, args.rounds)
    per = args.n * args.numel
    rows = []
    print(f"# {args.n} x {args.numel} samples, mode {args.mode}, {args.threads} thread(s), "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'samples':<9}{'case':<8}{args.ref[:10] + ' ns':>14}{'checkout ns':>13}{'speed-up':>10}")
    for k, (name, case) in enumerate(keys):
        a, b = (medians[2 * k + i] * 1e9 / per for i in (0, 1))
        rows.append({"dtype": name, "case": case, "ref_ns": a, "new_ns": b, "speedup": a / b})
    rows.sort(key=lambda r: (r["dtype"], list(CASES).index(r["case"])))
    for r in rows:
        print(f"{r['dtype']:<9}{r['case']:<8}{r['ref_ns']:>14.2f}{r['new_ns']:>13.2f}"
              f"{r['speedup']:>10.2f}")
    path = save_json(Path(args.out) / "bench_native_ab.json",
                     {"ref": args.ref, "args": vars(args), "rows": rows})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
