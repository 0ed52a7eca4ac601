"""Cost of the stability monitor per training step (issue 16): a bf16 GPT-style LM
(``tests/models.py`` GPT, 3 blocks, d=64, seq 64, batch 8 by default), each
step timed three ways in the same process, interleaved step by step (AdamW by default, as
training runs; ``--optimizer sgd``): the model compiled with
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main(argv=None) -> int:
    import fxstab
    from benchmarks.bench_overhead import timed_interleaved
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
    ap.add_argument("--warmup", type=int, default=80,
                    help="untimed steps per arm first (compilation; the monitor's first "
                         "rotations, after which clean operators settle: the steady state)")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
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
        opt = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
        return m, opt(m.parameters(), lr=1e-3)

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

    counter = {name: 0 for name in arms}

    def run(name: str) -> None:
        i = counter[name]
        counter[name] += 1
        if name == "paused":
            with mon.paused():
                step(name, i)
            return
        step(name, i)
        if name == "monitored":
            mon.step()

    for _ in range(args.warmup):  # compile, warm up, the first rotations
        for name in arms:
            run(name)
    m0, c0 = mon.monitor_time, counter["monitored"]
    # each timed step follows an untimed step of the same arm (bench_overhead.timed_interleaved):
    # a fixed order of arms had timed each arm on the caches the previous arm left
    names = list(arms)
    raw = timed_interleaved([lambda n=n: run(n) for n in names], args.steps, raw=True)
    times = dict(zip(names, raw))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    # the spread of the overhead: step i of each arm ran side by side, so their ratio is paired
    ratios = sorted(m / p - 1 for m, p in zip(times["monitored"], times["plain"]))
    q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    # time inside checks per monitored step over the monitored step (the monitor's own
    # time_fraction would count the other arms' steps run between two of its steps)
    fraction = (mon.monitor_time - m0) / (counter["monitored"] - c0) / med["monitored"]
    rows = {"plain_ms": med["plain"] * 1e3, "paused_ms": med["paused"] * 1e3,
            "monitored_ms": med["monitored"] * 1e3,
            "dispatch_overhead": med["paused"] / med["plain"] - 1,
            "monitor_overhead": med["monitored"] / med["plain"] - 1,
            "monitor_overhead_q1": q1, "monitor_overhead_q3": q3,
            "monitor_time_fraction": fraction, "checks": mon.checks_run,
            "settled": len(mon.settled),
            "operators": len(mon.operators)}
    print(f"{args.front}: GPT bf16, {args.layers} blocks, d={args.d}, batch {args.batch}, "
          f"seq {args.seq}, {args.optimizer}, period {args.period}, "
          f"{torch.get_num_threads()} thread(s), {rows['operators']} monitored operators "
          f"({rows['settled']} settled), {args.warmup} warm-up steps")
    print(f"plain step {rows['plain_ms']:.2f} ms | monitor paused {rows['paused_ms']:.2f} ms "
          f"(+{100 * rows['dispatch_overhead']:.1f}%) | monitored {rows['monitored_ms']:.2f} ms "
          f"(+{100 * rows['monitor_overhead']:.1f}%, per-step pairs: quartiles "
          f"{100 * q1:+.1f}% .. {100 * q3:+.1f}%) | time in checks "
          f"{100 * fraction:.1f}% of the monitored steps")
    path = save_json(Path(args.out) / "bench_monitor.json",
                     {"benchmark": "bench_monitor", "args": vars(args), **rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
