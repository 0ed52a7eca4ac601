"""Cost of the stability monitor per training step (issues 16 and 52): a bf16 GPT-style LM
(``tests/models.py`` GPT, 3 blocks, d=64, seq 64, batch 8 by default), AdamW by default as
training runs (``--optimizer sgd``), every step of every arm timed in the same process,
interleaved step by step (``bench_overhead.timed_interleaved``) after ``--warmup`` untimed
steps per arm. Two cases (``--case``, both by default):

* **clean** (nothing promoted): the model compiled with dynamo's ``eager`` backend (the plain
  step: the monitor's own graphs run as plain Python too), with ``monitor.backend()`` and the
  monitor paused (its dispatch alone), and monitored (``period=1``).
* **promoted**: the same model with one ill-conditioned LayerNorm: ``blocks.1.ln2`` normalizes
  ``x + c`` (``--offset`` c = 64: a common offset far above the spread of ``x``, condition
  ~c/std(x): S ~ 0.09 at seq 32, 0.14 at seq 64 in bf16), which the monitor promotes to
  FP32_ACCUMULATION within the warm-up (checked: the run fails otherwise). Three arms: that model plain (its LayerNorm in
  bf16, eager backend), the *floor* (the LayerNorm hand-written in fp32, ``F.layer_norm`` of the
  fp32-upcast operands cast back to bf16, as the promoted mode computes it; eager backend, no
  monitor) and monitored (a second monitor, ``period=1``).

Prints the medians, each overhead over its plain step (the promoted case over the floor as
well: what the monitor adds to the fp32 kernel it switched to), the quartiles of the paired
per-step ratios, the time inside checks over the monitored step and the checks per step.

Measured (docs/monitor.md, "With a promoted operator"; ``--seq 32 --warmup 100 --steps 60``,
2 shared cores): the promoted step cost +12% (1 thread) to +20-23% (2 threads) over its plain
step while the promoted LayerNorm, watched against the tau_warn it had crossed, was checked
with K replicas on every step (1.30 checks per step); watched against tau_safe since issue 52,
+2.1 to +5.0% over plain and +3.5 to +4.0% over the fp32 floor (0.37 checks per step), as
with nothing promoted (+2.4 to +7.5%, noise of the shared machine).

    python benchmarks/bench_monitor.py                   # results/bench_monitor.json
    python benchmarks/bench_monitor.py --seq 32          # issue 52: <= 5% with the promotion
    python benchmarks/bench_monitor.py --case promoted --steps 30 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

ILL_PATH = "blocks.1.ln2"


class OffsetLayerNorm(nn.Module):
    """``LayerNorm(x + offset)``: ill-conditioned when ``|offset|`` >> the spread of ``x`` (the
    sum rounds x's low bits away in bf16 and a relative perturbation of the input moves the
    centred values by ~u * offset). ``fp32``: the LayerNorm computed in fp32 on the upcast
    operands and cast back (the monitor's FP32_ACCUMULATION kernel, hand-written)."""

    def __init__(self, ln: nn.LayerNorm, offset: float, fp32: bool = False) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = ln.weight, ln.bias, ln.eps
        self.shape = tuple(ln.normalized_shape)
        self.offset, self.fp32 = offset, fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.offset
        if self.fp32:
            return F.layer_norm(h.float(), self.shape, self.weight.float(), self.bias.float(),
                                self.eps).to(h.dtype)
        return F.layer_norm(h, self.shape, self.weight, self.bias, self.eps)


def _quartiles(num: list, den: list) -> tuple[float, float]:
    ratios = sorted(n / d - 1 for n, d in zip(num, den))
    return ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]


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
                         "rotations, after which clean operators settle and the ill-conditioned "
                         "LayerNorm is promoted: the steady state)")
    ap.add_argument("--case", default="both", choices=["both", "clean", "promoted"])
    ap.add_argument("--offset", type=float, default=64.0,
                    help="the promoted case's offset c of LayerNorm(x + c) at " + ILL_PATH)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--front", default="backend", choices=["backend", "wrap"],
                    help="monitor.backend() under torch.compile, or monitor.wrap(model) eager")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.layers < 2 and args.case != "clean":
        ap.error(f"the promoted case puts its LayerNorm at {ILL_PATH}: --layers >= 2")

    def make(ill: "str | None" = None):
        torch.manual_seed(0)
        m = GPT(vocab=256, d=args.d, heads=4, layers=args.layers, ctx=args.seq).to(torch.bfloat16)
        if ill is not None:
            blk = m.blocks[1]
            blk.ln2 = OffsetLayerNorm(blk.ln2, args.offset, fp32=ill == "fp32")
        opt = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
        return m, opt(m.parameters(), lr=1e-3)

    torch.manual_seed(1)
    data = [torch.randint(0, 256, (args.batch, args.seq + 1)) for _ in range(8)]
    # one monitor per model: the operator table is keyed by module path
    mons = {"monitored": fxstab.StabilityMonitor(format="bf16", period=args.period),
            "ill_monitored": fxstab.StabilityMonitor(format="bf16", period=args.period)}
    backends = {}
    arms = {}
    torch._dynamo.reset()
    names = ((["plain", "paused", "monitored"] if args.case != "promoted" else [])
             + (["ill_plain", "ill_fp32", "ill_monitored"] if args.case != "clean" else []))
    for name in names:
        ill = None if not name.startswith("ill_") else ("fp32" if name == "ill_fp32" else "bf16")
        model, opt = make(ill)
        mon = mons["ill_monitored" if ill else "monitored"]
        monitored = name in ("paused", "monitored", "ill_monitored")
        if args.front == "wrap":
            arms[name] = (mon.wrap(model) if monitored else model, opt)
        else:
            backend = mon.backend() if monitored else "eager"
            if monitored:
                backends[name] = backend
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
            with mons["monitored"].paused():
                step(name, i)
            return
        step(name, i)
        if name in mons:
            mons[name].step()

    for _ in range(args.warmup):  # compile, warm up, the first rotations (and the promotion)
        for name in arms:
            run(name)
    ill_op = None
    if "ill_monitored" in arms:
        mon = mons["ill_monitored"]
        ill_op = next(n for n in mon.operators if n.startswith(ILL_PATH + "/layer_norm#"))
        if mon.promoted != [ill_op]:
            raise SystemExit(f"the promoted case needs {ill_op} promoted, alone, within the "
                             f"warm-up; after {args.warmup} steps: promoted {mon.promoted}, "
                             f"score {mon.scores[ill_op]:.3g} (--offset, --warmup)")
    start = {n: (m.monitor_time, m.checks_run, counter[n]) for n, m in mons.items() if n in arms}
    compiles = {n: b.compiles for n, b in backends.items()}
    # each timed step follows an untimed step of the same arm (bench_overhead.timed_interleaved):
    # a fixed order of arms had timed each arm on the caches the previous arm left
    names = list(arms)
    raw = timed_interleaved([lambda n=n: run(n) for n in names], args.steps, raw=True)
    times = dict(zip(names, raw))
    med = {name: statistics.median(ts) for name, ts in times.items()}

    def checks(name: str) -> dict:
        # time inside checks per monitored step over the monitored step (the monitor's own
        # time_fraction would count the other arms' steps run between two of its steps)
        m = mons[name]
        t0, c0, s0 = start[name]
        steps = counter[name] - s0
        return {"time_fraction": (m.monitor_time - t0) / steps / med[name],
                "checks_per_step": (m.checks_run - c0) / steps,
                "recompiles": backends[name].compiles - compiles[name] if name in backends
                else None}

    print(f"{args.front}: GPT bf16, {args.layers} blocks, d={args.d}, batch {args.batch}, "
          f"seq {args.seq}, {args.optimizer}, period {args.period}, "
          f"{torch.get_num_threads()} thread(s), {args.warmup} warm-up steps, "
          f"{args.steps} timed steps per arm")
    rows: dict = {}
    if "monitored" in arms:
        mon = mons["monitored"]
        q1, q3 = _quartiles(times["monitored"], times["plain"])
        c = checks("monitored")
        rows.update({
            "plain_ms": med["plain"] * 1e3, "paused_ms": med["paused"] * 1e3,
            "monitored_ms": med["monitored"] * 1e3,
            "dispatch_overhead": med["paused"] / med["plain"] - 1,
            "monitor_overhead": med["monitored"] / med["plain"] - 1,
            "monitor_overhead_q1": q1, "monitor_overhead_q3": q3,
            "monitor_time_fraction": c["time_fraction"], "checks": mon.checks_run,
            "checks_per_step": c["checks_per_step"], "settled": len(mon.settled),
            "operators": len(mon.operators), "promoted": mon.promoted})
        print(f"nothing promoted ({rows['operators']} monitored operators, {rows['settled']} "
              f"settled): plain step {rows['plain_ms']:.2f} ms | monitor paused "
              f"{rows['paused_ms']:.2f} ms ({100 * rows['dispatch_overhead']:+.1f}%) | "
              f"monitored {rows['monitored_ms']:.2f} ms ({100 * rows['monitor_overhead']:+.1f}%, "
              f"per-step pairs: quartiles {100 * q1:+.1f}% .. {100 * q3:+.1f}%) | time in checks "
              f"{100 * c['time_fraction']:.1f}% of the monitored steps, "
              f"{c['checks_per_step']:.2f} checks per step")
    if "ill_monitored" in arms:
        mon = mons["ill_monitored"]
        q1, q3 = _quartiles(times["ill_monitored"], times["ill_plain"])
        f1, f3 = _quartiles(times["ill_monitored"], times["ill_fp32"])
        c = checks("ill_monitored")
        op = mon._ops[ill_op]
        rows["promoted_case"] = {
            "operator": ill_op, "offset": args.offset, "mode": op.mode.name,
            "score": op.score, "promotions": [p.__dict__ for p in mon.promotions],
            "plain_ms": med["ill_plain"] * 1e3, "fp32_floor_ms": med["ill_fp32"] * 1e3,
            "monitored_ms": med["ill_monitored"] * 1e3,
            "floor_overhead": med["ill_fp32"] / med["ill_plain"] - 1,
            "monitor_overhead": med["ill_monitored"] / med["ill_plain"] - 1,
            "monitor_overhead_q1": q1, "monitor_overhead_q3": q3,
            "over_floor": med["ill_monitored"] / med["ill_fp32"] - 1,
            "over_floor_q1": f1, "over_floor_q3": f3,
            "monitor_time_fraction": c["time_fraction"],
            "checks_per_step": c["checks_per_step"], "recompiles": c["recompiles"],
            "settled": len(mon.settled), "operators": len(mon.operators)}
        r = rows["promoted_case"]
        first = mon.promotions[0]
        print(f"promoted ({ill_op} -> {r['mode']} at step {first.step}, score "
              f"{r['score']:.3g}): plain step {r['plain_ms']:.2f} ms | fp32 LayerNorm by hand "
              f"(floor) {r['fp32_floor_ms']:.2f} ms ({100 * r['floor_overhead']:+.1f}%) | "
              f"monitored {r['monitored_ms']:.2f} ms ({100 * r['monitor_overhead']:+.1f}%, "
              f"quartiles {100 * q1:+.1f}% .. {100 * q3:+.1f}%; over the floor "
              f"{100 * r['over_floor']:+.1f}%, quartiles {100 * f1:+.1f}% .. {100 * f3:+.1f}%) | "
              f"time in checks {100 * c['time_fraction']:.1f}%, {c['checks_per_step']:.2f} "
              f"checks per step"
              + (f", {c['recompiles']} recompiles while timed" if c["recompiles"] is not None
                 else ""))
    path = save_json(Path(args.out) / "bench_monitor.json",
                     {"benchmark": "bench_monitor", "args": vars(args), **rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
