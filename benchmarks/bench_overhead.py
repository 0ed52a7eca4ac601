"""Cost of an fxstab analysis relative to running the model without it.

For an MLP, a small CNN, a small transformer and LayerNorm+softmax on a 256x1024 input, and N in
{2, 3, 5}: time of one analysed forward divided by the plain eager forward and by the
inductor-compiled forward, measured in the same process, interleaved call by call (each timed
call right after an untimed call of the same function: warm caches for each), median of
repeats; also the `every=k` fast path and the peak-memory ratio: (parameters + inputs + peak
RSS growth during one forward) of a child process that runs the analysis over the same for one
that runs plain eager.

    python benchmarks/bench_overhead.py                 # prints the table, writes results/
    python benchmarks/bench_overhead.py --quick         # smaller, for a smoke run
    python benchmarks/bench_overhead.py --granularity aten --models mlp,lnsoftmax,transformer \
        --samples 3 --diagnostics summary,off          # arithmetic level, with/without counters
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


MODELS = ("mlp", "cnn", "transformer", "lnsoftmax")


class LayerNormSoftmax(nn.Module):
    """x -> F.layer_norm over the last dim -> softmax over the last dim (no parameters)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.d = d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(nn.functional.layer_norm(x, (self.d,)), dim=-1)


def make(name: str, quick: bool):
    from models import GPT, MLP

    torch.manual_seed(0)
    if name == "mlp":
        m = MLP(784, 512 if not quick else 128, 10)
        x = (torch.randn(256 if not quick else 64, 784),)
    elif name == "cnn":
        m = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
        x = (torch.randn(32 if not quick else 8, 3, 32, 32),)
    elif name == "transformer":
        m = GPT(vocab=256, d=128 if not quick else 64, heads=4, layers=2, ctx=64)
        x = (torch.randint(0, 256, (8 if not quick else 2, 64)),)
    elif name == "lnsoftmax":  # issue 4's target: LayerNorm + softmax, 256x1024
        m = LayerNormSoftmax(1024)
        x = (torch.randn(256 if not quick else 64, 1024),)
    else:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    return m.eval(), x


def timed_interleaved(fns: list, repeats: int, clock=time.perf_counter,
                      raw: bool = False) -> list:
    """Median time of each function, calling them in turn in every repeat: on a shared machine
    a load change then hits all of them alike instead of one side of a ratio.

    Each timed call follows an untimed call of the same function, so every function is timed
    with the caches as its own previous call left them. Timing the call that follows another
    function's call (fxstab's, which moves tens of MB) made a small eager model look up to
    twice as slow as it is, and the ratios that much better. ``clock``: ``time.process_time``
    counts the CPU time of this process (all its threads) instead of the wall clock, which a
    machine shared with other jobs inflates by whatever they take. ``raw``: every repeat's
    time of each function instead of the medians (repeat i of each ran side by side: paired)."""
    for fn in fns:
        fn()
        fn()
    ts = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            fn()
            t = clock()
            fn()
            ts[i].append(clock() - t)
    return ts if raw else [statistics.median(t) for t in ts]


def peak_child(model: str, mode: str, n: int, quick: bool, granularity: str = "op",
               diagnostics: str = "summary") -> float:
    """Peak RSS growth (MiB) of a child process during one forward in ``mode``.

    The child warms up (compilation, caches), resets the kernel's high-water mark
    (/proc/self/clear_refs), and reports VmHWM - VmRSS around one more forward; glibc is told to
    mmap every allocation >= 128 KiB so freed tensors leave RSS and live ones show in it.
    """
    code = f"""
import sys, torch
sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'tests')!r})
from benchmarks.bench_overhead import make
import fxstab
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1])
m, x = make({model!r}, {quick!r})
f = m
if {mode!r} == "fxstab":
    f = torch.compile(m, backend=fxstab.backend(n_samples={n}, granularity={granularity!r},
                                                diagnostics={diagnostics!r}))
with torch.no_grad():
    f(*x)
    f(*x)
    open('/proc/self/clear_refs', 'w').write('5')
    base = status('VmRSS:')
    f(*x)
    peak = status('VmHWM:')
print((peak - base) / 1024.0)
"""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    import fxstab
    from benchmarks.common import save_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--samples", default="2,3,5")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    ap.add_argument("--granularity", default="op", choices=["op", "aten"])
    ap.add_argument("--diagnostics", default="summary",
                    help="comma-separated counter settings to time (off, summary, detailed)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (default: all cores); 1 gives steadier ratios on a busy machine")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or max(1, os.cpu_count() or 1))

    rows = []
    for name in args.models.split(","):
        model, x = make(name, args.quick)
        with torch.no_grad():
            torch._dynamo.reset()
            ind = torch.compile(model)
            ind(*x)
            for n, diag in ((int(s), d) for s in args.samples.split(",")
                            for d in args.diagnostics.split(",")):
                torch._dynamo.reset()
                be = fxstab.backend(granularity=args.granularity, n_samples=n, diagnostics=diag)
                f = torch.compile(model, backend=be)
                t_eager, t_ind, t_fx = timed_interleaved(
                    [lambda: model(*x), lambda: ind(*x), lambda: f(*x)], args.repeats)
                if any(info.failures for info in be.infos):
                    raise RuntimeError(f"{name}: the stochastic path failed: "
                                       f"{[info.failures for info in be.infos]}")
                torch._dynamo.reset()
                be_k = fxstab.backend(granularity=args.granularity, n_samples=n, every=1000,
                                      diagnostics=diag)
                g = torch.compile(model, backend=be_k)
                g(*x)  # the analysed call; the rest take the fast path
                t_eager_k, t_every = timed_interleaved([lambda: model(*x), lambda: g(*x)],
                                                       args.repeats)
                mem = None
                if not args.no_memory:
                    # footprint = parameters + inputs + peak growth during one forward
                    resident = (sum(p.numel() * p.element_size() for p in model.parameters())
                                + sum(t.numel() * t.element_size() for t in x)) / 2**20
                    plain = resident + peak_child(name, "eager", n, args.quick)
                    fx = resident + peak_child(name, "fxstab", n, args.quick, args.granularity,
                                               diag)
                    mem = fx / plain
                rows.append({
                    "model": name, "N": n, "diagnostics": diag, "eager_ms": t_eager * 1e3, "inductor_ms": t_ind * 1e3,
                    "fxstab_ms": t_fx * 1e3, "vs_eager": t_fx / t_eager, "vs_inductor": t_fx / t_ind,
                    "every1000_vs_eager": t_every / t_eager_k, "peak_mem_ratio": mem,
                    "reports": len(be.reports) // max(1, be.infos[0].analysed_calls if be.infos else 1),
                })
                r = rows[-1]
                print(f"{name:<12} N={n} {diag:<8} eager {r['eager_ms']:8.2f} ms  inductor {r['inductor_ms']:8.2f} ms  "
                      f"fxstab {r['fxstab_ms']:8.2f} ms  x{r['vs_eager']:5.1f} eager  "
                      f"x{r['vs_inductor']:5.1f} inductor  every=1000 x{r['every1000_vs_eager']:4.2f}  "
                      f"mem x{mem if mem is None else round(mem, 2)}", flush=True)

    print()
    print(f"{'model':<12} {'N':>2} {'counters':<8} {'vs eager':>9} {'vs inductor':>12} {'every=1000':>11} {'peak mem':>9}")
    for r in rows:
        mem = "-" if r["peak_mem_ratio"] is None else f"{r['peak_mem_ratio']:.2f}"
        print(f"{r['model']:<12} {r['N']:>2} {r['diagnostics']:<8} {r['vs_eager']:>9.1f} {r['vs_inductor']:>12.1f} "
              f"{r['every1000_vs_eager']:>11.2f} {mem:>9}")
    path = save_json(Path(args.out) / f"bench_overhead_{args.granularity}.json",
                     {"benchmark": "bench_overhead", "granularity": args.granularity,
                      "threads": torch.get_num_threads(), "rows": rows})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
