"""Fused versus unfused rounding + digit statistics (the kernel ablation of docs/design.md §9).

Paths, all computing rounded samples and the five digit statistics of one operator output:
  fused     the Triton kernel (fxstab.kernels.round_digits; CUDA only)
  cpu       the fused C/OpenMP kernel (fxstab.cpu.bindings.round_stats; CPU only)
  unfused   the plain-torch reference (round_samples + cestac_digits + reductions)
  compiled  the same reference compiled with torch.compile (inductor)

Bytes counted are the ones that must move: N samples read once and written once (plus the
per-element digits if --digits). GB/s is reported against the device's copy bandwidth,
measured in this script with a large tensor copy (read + write). On a GPU times come from
triton.testing.do_bench (median and 20/80% quantiles); on a CPU from a simple timer (median of
repeats), and the fused path is skipped (the Triton interpreter is not a performance path); the
cpu path uses torch.get_num_threads() threads, like the torch paths.

    python benchmarks/bench_kernels.py                      # CPU: 1e5 and 1e6 elements
    python benchmarks/bench_kernels.py --sizes 1e5,1e7,1e8,1e9 --out results/gpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def parse_sizes(text: str) -> list[int]:
    return [int(float(s)) for s in text.split(",") if s.strip()]


def timer(fn, device: torch.device, min_time: float = 0.5, max_reps: int = 50) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds of fn()."""
    if device.type == "cuda":
        import triton.testing

        fn()  # first call autotunes / compiles; keep it out of do_bench's run-count estimate
        torch.cuda.synchronize()
        q = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=25, rep=100)
        return tuple(float(v) for v in q)
    fn()  # warm-up (allocator, first-call compilation)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return statistics.median(times), pick(0.2), pick(0.8)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of a large device copy (bytes read + bytes written)."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    ms, _, _ = timer(lambda: y.copy_(x), device)
    del x, y
    return 2 * nbytes / (ms * 1e-3) / 1e9


def machine_info(device: torch.device) -> dict:
    info = {
        "platform": platform.platform(), "python": sys.version.split()[0],
        "torch": torch.__version__, "cpu_count": os.cpu_count(), "device": str(device),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        info["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                        capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"],
                               capture_output=True, text=True).stdout.strip()
        info["dirty"] = bool(dirty)
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help="comma list of numel (default: CPU 1e5,1e6; "
                    "GPU 1e5,1e6,1e7,1e8,1e9)")
    ap.add_argument("--n", default="2,3,5", help="sample counts")
    ap.add_argument("--format", default="bf16")
    ap.add_argument("--mode", default="random")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--digits", action="store_true", help="also write per-element digits")
    ap.add_argument("--paths", default="fused,cpu,unfused,compiled")
    ap.add_argument("--compiled-max-numel", type=float, default=1e8,
                    help="largest numel for the torch.compile path (each size recompiles)")
    ap.add_argument("--unfused-max-numel", type=float, default=3e8,
                    help="largest numel for the eager torch path (it needs ~10x the memory)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default="results", help="folder for JSON and plot")
    ap.add_argument("--tag", default="", help="suffix of the JSON/plot file names")
    args = ap.parse_args(argv)

    from fxstab.numerics.formats import get_format
    from fxstab.kernels.round_digits import round_digits, round_digits_torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    sizes = parse_sizes(args.sizes or ("1e5,1e6,1e7,1e8,1e9" if gpu else "1e5,1e6"))
    ns = [int(v) for v in args.n.split(",")]
    paths = [p for p in args.paths.split(",") if p]
    if not gpu and "fused" in paths:
        paths.remove("fused")
        print("# CPU: fused Triton path skipped (interpreter only); torch paths measured")
    if "cpu" in paths and (gpu or not _native_available()):
        paths.remove("cpu")
        print("# cpu (fxstab.cpu.bindings) path skipped: " + ("not a CPU device" if gpu else
                                                        "kernels could not be built"))
    fmt = get_format(args.format)
    dtype = getattr(torch, args.dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    seed = 0x5EED

    copy_bytes = 1 << 30 if gpu else 1 << 26
    bw = copy_bandwidth(device, copy_bytes)
    print(f"# device {device}, copy bandwidth {bw:.1f} GB/s ({copy_bytes >> 20} MiB copy)")
    rows = []
    hdr = f"{'path':>9} {'N':>2} {'numel':>8} {'ms':>10} {'GB/s':>9} {'copy%':>6} {'x unfused':>9}"
    print(f"# format {fmt.name}, mode {args.mode}, {args.dtype}, digits written: {args.digits}")
    print(hdr, flush=True)
    try:
        _measure(args, ns, sizes, paths, fmt, dtype, esize, seed, device, bw, rows, round_digits,
                 round_digits_torch)
    except KeyboardInterrupt:  # `timeout --signal=INT`: keep what was measured
        print("# interrupted: saving the rows measured so far", flush=True)
    print("# summary")
    print(hdr)
    for r in rows:
        print(_fmt_row(r))
    _save(args, rows, fmt, device, bw, ns, paths)
    return 0


def _fmt_row(r: dict) -> str:
    sp = r.get("speedup_vs_unfused")
    return (f"{r['path']:>9} {r['n']:>2} {r['numel']:>8.0e} {r['ms']:>10.3f} {r['gbs']:>9.3g} "
            f"{100 * r['frac_copy']:>5.1f}% {'' if sp is None else f'{sp:.2f}':>9}")


def _measure(args, ns, sizes, paths, fmt, dtype, esize, seed, device, bw, rows, round_digits,
             round_digits_torch) -> None:
    gpu = device.type == "cuda"
    compiled = None
    for n in ns:
        for numel in sizes:
            need = 2 * n * numel * esize
            if gpu and need > 0.8 * torch.cuda.mem_get_info(device)[0]:
                print(f"# skip N={n} numel={numel:.0e}: {need / 2**30:.1f} GiB does not fit")
                continue
            x = torch.randn(n, numel, dtype=dtype, device=device)
            out = torch.empty_like(x)
            moved = 2 * n * numel * esize + (numel * esize if args.digits else 0)
            base = {}
            for path in paths:
                if path == "unfused" and numel > args.unfused_max_numel:
                    continue
                if path == "compiled" and numel > args.compiled_max_numel:
                    continue
                if path == "cpu":
                    from fxstab.cpu import bindings as native
                    from fxstab.numerics.rounding import Rounding

                    mode = Rounding.parse(args.mode)
                    fn = lambda: native.round_stats(x, fmt, mode, seed,  # noqa: E731
                                                    want_digits=args.digits)
                elif path == "fused":
                    fn = lambda: round_digits(x, fmt, args.mode, seed, out=out,  # noqa: E731
                                              want_digits=args.digits)
                elif path == "unfused":
                    fn = lambda: round_digits_torch(x, fmt, args.mode, seed,  # noqa: E731
                                                    want_digits=args.digits)
                else:
                    if compiled is None:
                        compiled = torch.compile(round_digits_torch)
                    cf = compiled
                    fn = lambda: cf(x, fmt, args.mode, seed, want_digits=args.digits)  # noqa: E731
                try:
                    ms, lo, hi = timer(fn, device)
                except torch.OutOfMemoryError:
                    print(f"# {path} N={n} numel={numel:.0e}: out of memory")
                    torch.cuda.empty_cache()
                    continue
                gbs = moved / (ms * 1e-3) / 1e9
                base[path] = ms
                rows.append(dict(path=path, n=n, numel=numel, ms=ms, ms_p20=lo, ms_p80=hi,
                                 gbs=gbs, frac_copy=gbs / bw, bytes=moved))
                print(_fmt_row(rows[-1]), flush=True)
            for r in rows:
                if r["n"] == n and r["numel"] == numel and "unfused" in base:
                    r["speedup_vs_unfused"] = base["unfused"] / r["ms"]
            del x, out
            if gpu:
                torch.cuda.empty_cache()


def _native_available() -> bool:
    from fxstab.cpu import bindings as native

    return native.available()


def _save(args, rows, fmt, device, bw, ns, paths) -> None:
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    tag = f"kernels_{device.type}_{fmt.name}_{args.mode}_{args.dtype}{args.tag}"
    result = dict(machine=machine_info(device), copy_gbs=bw, format=fmt.name, mode=args.mode,
                  dtype=args.dtype, digits=args.digits, rows=rows)
    (outdir / f"{tag}.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(ns), figsize=(5 * len(ns), 4), squeeze=False)
        for ax, n in zip(axes[0], ns):
            for path in paths:
                pts = [(r["numel"], r["gbs"]) for r in rows if r["n"] == n and r["path"] == path]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=path)
            ax.axhline(bw, color="gray", ls="--", label="copy")
            ax.set_xscale("log")
            ax.set_title(f"N={n}, {fmt.name} {args.mode} ({args.dtype})")
            ax.set_xlabel("numel per sample")
            ax.set_ylabel("GB/s (bytes that must move)")
            ax.legend()
        fig.tight_layout()
        fig.savefig(outdir / f"{tag}.png", dpi=120)
    except ImportError:
        print("# matplotlib missing: no plot")
    print(f"# wrote {outdir / (tag + '.json')}")


if __name__ == "__main__":
    sys.exit(main())
