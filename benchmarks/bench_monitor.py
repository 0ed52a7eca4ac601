"""Cost of the stability monitor per training step (issue 16): a bf16 GPT-style LM
(``tests/models.py`` GPT, 3 blocks, d=64, seq 64, batch 8 by default) trained with SGD, each
step timed three ways in the same process, interleaved step by step: the model compiled with
dynamo's ``eager`` backend (the plain step: the monitor's own graphs run as plain Python too),
with ``monitor.backend()`` and the monitor paused (its dispatch alone), and monitored
(``period=1``: one operator checked every step). Prints the medians, the overhead of each over
the plain step and the monitor's own ``time_fraction`` (time inside checks over step time).

    python benchmarks/bench_monitor.py                   # results/bench_monitor.json
    python benchmarks/bench_monitor.py --steps 30 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main(argv=None) -> int:
    import fxstab
    from benchmarks.common import save_json
    from models import GPT

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per arm")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--period", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--front", default="backend", choices=["backend", "wrap"],
                    help="monitor.backend() under torch.compile, or monitor.wrap(model) eager")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    def make():
        torch.manual_seed(0)
        m = GPT(vocab=256, d=args.d, heads=4, layers=args.layers, ctx=args.seq).to(torch.bfloat16)
        return m, torch.optim.SGD(m.parameters(), lr=1e-3)

    torch.manual_seed(1)
    data = [torch.randint(0, 256, (args.batch, args.seq + 1)) for _ in range(8)]
    mon = fxstab.StabilityMonitor(format="bf16", period=args.period)
    arms = {}
    for name in ("plain", "paused", "monitored"):
        torch._dynamo.reset() if name == "plain" else None
        model, opt = make()
        if args.front == "wrap":
            arms[name] = (model if name == "plain" else mon.wrap(model), opt)
        else:
            backend = "eager" if name == "plain" else mon.backend()
            arms[name] = (torch.compile(model, backend=backend), opt)

    def step(name: str, i: int) -> None:
        f, opt = arms[name]
        batch = data[i % len(data)]
        logits = f(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def run(name: str, i: int) -> float:
        if name == "paused":
            with mon.paused():
                t = time.perf_counter()
                step(name, i)
                return time.perf_counter() - t
        t = time.perf_counter()
        step(name, i)
        if name == "monitored":
            mon.step()
        return time.perf_counter() - t

    for i in range(5):  # compile, warm up
        for name in arms:
            run(name, i)
    m0, s0 = mon.monitor_time, mon.step_time
    times = {name: [] for name in arms}
    for i in range(args.steps):
        for name in arms:
            times[name].append(run(name, i))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    fraction = (mon.monitor_time - m0) / (mon.step_time - s0)
    rows = {"plain_ms": med["plain"] * 1e3, "paused_ms": med["paused"] * 1e3,
            "monitored_ms": med["monitored"] * 1e3,
            "dispatch_overhead": med["paused"] / med["plain"] - 1,
            "monitor_overhead": med["monitored"] / med["plain"] - 1,
            "monitor_time_fraction": fraction, "checks": mon.checks_run,
            "operators": len(mon.operators)}
    print(f"{args.front}: GPT bf16, {args.layers} blocks, d={args.d}, batch {args.batch}, seq {args.seq}, "
          f"period {args.period}, {torch.get_num_threads()} thread(s), {rows['operators']} "
          f"monitored operators")
    print(f"plain step {rows['plain_ms']:.2f} ms | monitor paused {rows['paused_ms']:.2f} ms "
          f"(+{100 * rows['dispatch_overhead']:.1f}%) | monitored {rows['monitored_ms']:.2f} ms "
          f"(+{100 * rows['monitor_overhead']:.1f}%) | time in checks "
          f"{100 * fraction:.1f}% of the monitored steps")
    path = save_json(Path(args.out) / "bench_monitor.json",
                     {"benchmark": "bench_monitor", "args": vars(args), **rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
