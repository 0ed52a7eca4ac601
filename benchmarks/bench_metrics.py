"""Which per-operator statistic should sort tables, rank localization and drive the CI gate?

For every candidate metric (normwise, p10, p50, avg, min digits) over the hazard suite of
``bench_localization.py`` (hazards planted in residual MLP-mixer, CNN and transformer LMs, bf16
and fp16, op and aten level) and the healthy controls, this prints:

- ``at 0``: the fraction of operators whose digits are 0 under the metric (a metric that
  saturates cannot rank or gate), over the healthy and the hazard models;
- ``healthy at 0``: the same over the healthy models only (false alarms);
- ``AUC``: how well the metric separates the culprit operators of damaged cases from the
  operators of healthy models (probability that a culprit has fewer digits than a healthy
  operator; ties count half; 1.0 is perfect);
- ``top-1`` / ``top-3``: the localization hit rates when ``localize`` ranks by the metric.

    .venv/bin/python benchmarks/bench_metrics.py --quick      # every hazard on one architecture
    .venv/bin/python benchmarks/bench_metrics.py              # the full grid

Writes ``DIR/metrics.json`` (``--out``, default ``results/``). docs/digit-maps.md keeps the table
that chose the default metric.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_localization as bl  # noqa: E402
from benchmarks.common import save_json  # noqa: E402

from fxstab import digitmap  # noqa: E402

METRICS = tuple(digitmap.METRICS)
ZERO = 0.005  # digits below this print as 0.00


def _digits(op, metric: str) -> float:
    d = op.digits(metric)
    return 0.0 if math.isnan(d) else d


def auc(damaged: Sequence[float], healthy: Sequence[float]) -> Optional[float]:
    """P(a damaged value < a healthy value) + P(tie) / 2."""
    if not damaged or not healthy:
        return None
    hs = sorted(healthy)
    import bisect

    total = 0.0
    for d in damaged:
        lo, hi = bisect.bisect_left(hs, d), bisect.bisect_right(hs, d)
        total += (len(hs) - hi) + 0.5 * (hi - lo)
    return total / (len(damaged) * len(hs))


def evaluate(cases: Sequence[bl.Case], log=print) -> dict:
    """Analyse every case once and score every metric on the same digit maps."""
    per = {m: {"zeros": 0, "ops": 0, "h_zeros": 0, "h_ops": 0, "damaged": [], "healthy": [],
               "hit1": 0, "hit3": 0, "scored": 0} for m in METRICS}
    # the healthy controls first: a hazard case did damage when something is non-finite or its
    # culprit keeps fewer avg digits than its control's lowest minus bench_localization's margin
    cases = sorted(cases, key=lambda c: c.hazard is not None)
    floor: dict[tuple, float] = {}
    for i, case in enumerate(cases, 1):
        t0 = time.perf_counter()
        dm, _ = bl.analyse(case)
        key = (case.arch, case.format, case.level)
        culprits: list[str] = []
        if case.hazard is not None:
            hz = bl.HAZARDS_BY_NAME[case.hazard]
            culprits = [n for n in dm.operators
                        if any(c.matches(n, case.level) for c in hz.culprits)]
        any_nf = any(op.non_finite for op in dm.operators.values())
        origins = list(dm.nonfinite_sources())
        for m in METRICS:
            p = per[m]
            vals = [_digits(op, m) for op in dm.operators.values()]
            p["zeros"] += sum(v < ZERO for v in vals)
            p["ops"] += len(vals)
            if case.hazard is None:
                if m == "avg":
                    floor[key] = min(vals)
                p["h_zeros"] += sum(v < ZERO for v in vals)
                p["h_ops"] += len(vals)
                p["healthy"] += vals
                continue
            if not culprits:
                continue
            worst = min(_digits(dm[n], m) for n in culprits)
            # damage is judged on avg digits for every metric, so all metrics score one set
            if key not in floor:
                raise ValueError(f"{case.id}: its healthy control ({key}) is not selected")
            damaged = any_nf or min(_digits(dm[n], "avg") for n in culprits) < \
                floor[key] - bl.DAMAGE_MARGIN
            if not damaged:
                continue
            p["damaged"].append(worst)
            ranked = origins + [x.name for x in dm.localize(m) if x.name not in origins]
            r = bl.culprit_rank(ranked, lambda n: n in culprits)
            p["scored"] += 1
            p["hit1"] += r == 1
            p["hit3"] += r is not None and r <= 3
        log(f"[{i}/{len(cases)}] {case.id} ({time.perf_counter() - t0:.1f}s)")
    rows = []
    for m in METRICS:
        p = per[m]
        rows.append({
            "metric": m,
            "at_zero": p["zeros"] / p["ops"] if p["ops"] else None,
            "healthy_at_zero": p["h_zeros"] / p["h_ops"] if p["h_ops"] else None,
            "auc": auc(p["damaged"], p["healthy"]),
            "top1": p["hit1"] / p["scored"] if p["scored"] else None,
            "top3": p["hit3"] / p["scored"] if p["scored"] else None,
            "damaged_cases": p["scored"], "operators": p["ops"],
        })
    return {"rows": rows}


def table(rows: Sequence[dict]) -> str:
    def f(v: Optional[float], pct: bool = False) -> str:
        if v is None:
            return "-"
        return f"{100 * v:5.1f}%" if pct else f"{v:.3f}"

    lines = [f"{'metric':<9} {'at 0':>7} {'healthy at 0':>13} {'AUC':>6} {'top-1':>7} "
             f"{'top-3':>7}  cases"]
    for r in rows:
        lines.append(f"{r['metric']:<9} {f(r['at_zero'], True):>7} "
                     f"{f(r['healthy_at_zero'], True):>13} {f(r['auc']):>6} "
                     f"{f(r['top1'], True):>7} {f(r['top3'], True):>7}  {r['damaged_cases']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every hazard on one architecture")
    ap.add_argument("--cases", help="comma-separated globs over hazard/arch/format/level")
    ap.add_argument("--out", default="results", help="folder of metrics.json")
    args = ap.parse_args(argv)
    cases = bl.select(bl.all_cases(args.quick), args.cases)
    archs = sorted({c.arch for c in cases})
    cases += [c for c in bl.control_cases(archs)
              if any((c.arch, c.format, c.level) == (h.arch, h.format, h.level) for h in cases)
              or not args.cases]
    result = evaluate(cases, log=lambda s: print(s, file=sys.stderr))
    print(table(result["rows"]))
    save_json(Path(args.out) / "metrics.json", {"settings": {"quick": args.quick,
                                                             "cases": len(cases)},
                                                **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
