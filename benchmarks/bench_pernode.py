"""Where an analysed call's time goes per graph node, on a long chain of tiny operators (issue 16).

The chain (``bench_compiled.Chain``: 400 elementwise operators on 8 elements) at the operator
level, every part timed interleaved in one process (``bench_overhead.timed_interleaved``) and
divided by the number of operators:

* ``eager``: the model without fxstab; ``deterministic``: the analysed call's deterministic
  pass alone (the backend disabled);
* ``ops``: the generated graph with every step that rounds made the identity (the batched aten
  operators, what ``bench_compiled``'s floor measures);
* ``graph``: the generated graph as it runs (its steps note each operator's statistics);
* ``+notes``: the same and the call's notes appended to the report log (``finish``);
* ``analysed``: the whole analysed call.

``steps = graph - ops``, ``notes = +notes - graph``, ``overhead = analysed - eager``.

    python benchmarks/bench_pernode.py                # the table, results/bench_pernode.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_compiled import Chain, compute_only, sampled_calls  # noqa: E402
from benchmarks.bench_overhead import timed_interleaved  # noqa: E402


def parts(length: int, repeats: int) -> dict:
    import fxstab

    torch.manual_seed(0)
    model, x = Chain(length), torch.randn(8)
    torch._dynamo.reset()
    be = fxstab.backend()
    f = torch.compile(model, backend=be)
    with torch.no_grad():
        for _ in range(3):  # untraced, traced, replayed
            f(x)
        (sg, args), = sampled_calls(lambda: f(x))
        inputs = [args[i] for i in sg.positions]
        tracer = sg.tracer
        ops = compute_only(lambda: f(x), (x,), {}, be.config.n_samples)

        def graph():
            tracer.begin(0)
            sg.gm(*inputs)
            tracer.pending.clear()

        def notes():
            tracer.begin(0)
            sg.gm(*inputs)
            tracer.finish()
            be.reports.clear()

        def deterministic():
            be.enabled = False
            try:
                f(x)
            finally:
                be.enabled = True

        def analysed():
            f(x)
            be.reports.clear()

        t = timed_interleaved([lambda: model(x), deterministic, ops, graph, notes, analysed],
                              repeats, time.perf_counter)
    us = [v / length * 1e6 for v in t]
    row = dict(zip(("eager", "deterministic", "ops", "graph", "graph_and_notes", "analysed"), us))
    row.update(steps=us[3] - us[2], notes=us[4] - us[3], overhead=us[5] - us[0])
    # what reading the log later costs per report (built once, when first read)
    with torch.no_grad():
        be.reports.clear()
        for _ in range(20):
            f(x)
    n = len(be.reports)
    t0 = time.perf_counter()
    be.reports[0]
    row["build_us_per_report"] = (time.perf_counter() - t0) / n * 1e6
    return row


def main(argv=None) -> int:
    from benchmarks.common import save_json

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=400)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    rows = []
    print(f"{'thr':>4}{'eager':>8}{'determ.':>9}{'ops':>7}{'steps':>7}{'notes':>7}"
          f"{'analysed':>10}{'overhead':>10}{'build':>7}   us per operator")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        row = {"threads": threads, **parts(args.length, args.repeats)}
        rows.append(row)
        print(f"{threads:>4}{row['eager']:>8.1f}{row['deterministic']:>9.1f}{row['ops']:>7.1f}"
              f"{row['steps']:>7.1f}{row['notes']:>7.1f}{row['analysed']:>10.1f}"
              f"{row['overhead']:>10.1f}{row['build_us_per_report']:>7.1f}", flush=True)
    path = save_json(Path(args.out) / "bench_pernode.json",
                     {"benchmark": "bench_pernode", "length": args.length,
                      "repeats": args.repeats, "rows": rows})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
