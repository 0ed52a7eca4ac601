"""Cost of the backward analysis of a training step against its forward analysis (issue 19).

Four training steps (forward, backward, SGD) timed interleaved in one process, each the median
of ``--repeats``: A, the forward-only backend paused (the captured graph, eager autograd);
B, the forward-only backend analysing; C, the ``backward=True`` backend paused (the graph
through AOTAutograd); D, the ``backward=True`` backend analysing both. The forward analysis
costs B - A, the backward analysis (D - C) - (B - A); the target is a ratio of at most 2.

    python benchmarks/bench_backward.py                 # results/bench_backward.json
    python benchmarks/bench_backward.py --models mlp --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MODELS = ("mlp", "gpt2")


def make(name: str, batch: int = 64):
    from models import GPT2

    torch.manual_seed(0)
    if name == "mlp":
        m = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                          nn.Linear(512, 10))
        x = torch.randn(batch, 256)
        return m, x, lambda y: y.pow(2).mean()
    if name == "gpt2":
        m = GPT2(vocab=256, d=64, heads=4, layers=2, ctx=64)
        x = torch.randint(0, 256, (4, 64))
        return m, x, lambda y: torch.nn.functional.cross_entropy(y.reshape(-1, y.shape[-1]),
                                                                 x.reshape(-1))
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def main(argv=None) -> int:
    import fxstab
    from benchmarks.common import save_json

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--format", default="bf16")
    ap.add_argument("--mlp-batch", type=int, default=64,
                    help="the MLP's batch: its weight gradients are 512/batch times its "
                         "activations, and the rounding work follows the elements")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        model, x, loss_fn = make(name, args.mlp_batch)
        model.train()
        arms = {}
        for key, backward in (("fwd", False), ("both", True)):
            be = fxstab.backend(format=args.format, backward=backward)
            arms[key] = (be, torch.compile(model, backend=be))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step does the same work

        def step(key: str, paused: bool) -> float:
            be, f = arms[key]
            t = time.perf_counter()
            if paused:
                with be.paused():
                    loss_fn(f(x)).backward()
            else:
                loss_fn(f(x)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            be.clear()
            return time.perf_counter() - t

        runs = [("fwd", True), ("fwd", False), ("both", True), ("both", False)]
        for r in runs:
            step(*r), step(*r)
        times: dict = {r: [] for r in runs}
        for _ in range(args.repeats):
            for r in runs:
                times[r].append(step(*r))
        a, b, c, d = (statistics.median(times[r]) for r in runs)
        fwd, bwd = b - a, (d - c) - (b - a)
        row = {"model": name, "paused_ms": a * 1e3, "forward_analysis_ms": fwd * 1e3,
               "aot_paused_ms": c * 1e3, "backward_analysis_ms": bwd * 1e3,
               "backward_over_forward": bwd / fwd if fwd > 0 else float("nan")}
        rows.append(row)
        print(f"{name:<6} step {a * 1e3:7.2f} ms (AOT {c * 1e3:7.2f}) | forward analysis "
              f"{fwd * 1e3:7.2f} ms | backward analysis {bwd * 1e3:7.2f} ms | backward/forward "
              f"{row['backward_over_forward']:.2f}", flush=True)
    path = save_json(Path(args.out) / "bench_backward.json",
                     {"benchmark": "bench_backward", "format": args.format,
                      "repeats": args.repeats, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
