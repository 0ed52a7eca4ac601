"""Impact against local loss on the localization benchmark's planted hazards (issue 42).

For each hazard of ``benchmarks/bench_localization.py`` planted in one architecture (bf16,
operator level), the model is analysed once (its digit map: the local-loss ranking, NaN/inf
origins first) and its operators' impact on the outputs is measured by ablation
(:func:`fxstab.operator_impact`). Printed per case: the top-1 of each ranking and whether it
is a culprit, the culprit's impact, the analysed calls the impact cost and the number of
operators; and for the healthy control, the largest impact (what "harmless" measures). The
impact names whose own rounding costs the outputs (the addition before a cancellation, the
linear before an exp); the findings with impact name where that rounding is amplified (the
cancellation, the exp) and only where it costs the outputs. Writes
``results/bench_impact.json``.

    .venv/bin/python benchmarks/bench_impact.py                 # every hazard, the mixer
    .venv/bin/python benchmarks/bench_impact.py --arch gpt --hazards offset_cancel,exp_gain
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxstab  # noqa: E402
from benchmarks.bench_localization import (  # noqa: E402
    HAZARDS, HAZARDS_BY_NAME, build_model, rank,
)


def run(arch: str, hazard: str | None, fmt: str) -> dict:
    model, x = build_model(arch, hazard)
    torch._dynamo.reset()
    be = fxstab.backend(format=fmt, seed=0)
    with torch.no_grad():
        torch.compile(model, backend=be)(x)
    dm = be.digit_map()
    local = rank(dm)
    t0 = time.perf_counter()
    imp = fxstab.operator_impact(model, (x,), format=fmt, seed=0)
    seconds = time.perf_counter() - t0
    by_impact = [n for n, _ in imp.ranked()]
    # the findings with impact: NaN/inf origins, then the local losses whose amplified rounding
    # costs the outputs (DigitMap.findings)
    lines = [f for f in imp.digit_map.findings()
             if f.startswith(("NaN/inf first appear at ", "digits are lost at "))]
    first = lines[0].split(" at ", 1)[1].split(" ")[0].rstrip(":") if lines else None
    culprit = (lambda n: any(c.matches(n, "op") for c in HAZARDS_BY_NAME[hazard].culprits)) \
        if hazard else (lambda n: False)
    return {"hazard": hazard or "healthy", "arch": arch, "format": fmt,
            "operators": len(imp.by_operator), "calls": imp.calls, "seconds": round(seconds, 1),
            "output_digits": round(imp.output_digits, 3),
            "local_top1": local[0] if local else None,
            "local_hit": bool(local) and culprit(local[0]),
            "impact_top1": by_impact[0] if by_impact else None,
            "impact_top1_value": round(imp.ranked()[0][1], 3) if by_impact else None,
            "impact_hit": bool(by_impact) and culprit(by_impact[0]),
            "finding_top1": first, "finding_hit": bool(first) and culprit(first),
            "findings": len(lines),
            "culprit_impact": max([round(v, 3) for n, v in imp.by_operator.items()
                                   if culprit(n)] or [None]) if hazard else None,
            "max_impact": round(max(imp.by_operator.values() or [0.0]), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="mixer")
    ap.add_argument("--format", default="bf16")
    ap.add_argument("--hazards", default="", help="comma-separated (default: every hazard)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    names = [h for h in args.hazards.split(",") if h] or [h.name for h in HAZARDS]
    rows = [run(args.arch, None, args.format)]
    rows += [run(args.arch, h, args.format) for h in names]
    head = (f"{'case':<22} {'ops':>3} {'calls':>5} {'local top-1':<32} {'hit':>3} "
            f"{'impact top-1 (own rounding)':<32} {'finding top-1 (with impact)':<32} "
            f"{'hit':>3} {'n':>2} {'max':>5}")
    print(head)
    for r in rows:
        print(f"{r['hazard']:<22} {r['operators']:>3} {r['calls']:>5} "
              f"{str(r['local_top1'])[-32:]:<32} {'y' if r['local_hit'] else '-':>3} "
              f"{str(r['impact_top1'])[-32:]:<32} {str(r['finding_top1'])[-32:]:<32} "
              f"{'y' if r['finding_hit'] else '-':>3} {r['findings']:>2} {r['max_impact']:>5.2f}")
    cases = [r for r in rows if r["hazard"] != "healthy"]
    if cases:
        print(f"top-1 hit rate: local {sum(r['local_hit'] for r in cases)}/{len(cases)}, "
              f"findings with impact {sum(r['finding_hit'] for r in cases)}/{len(cases)}; "
              f"calls per case {min(r['calls'] for r in cases)}-"
              f"{max(r['calls'] for r in cases)} for {cases[0]['operators']}-"
              f"{max(r['operators'] for r in cases)} operators; the healthy model: "
              f"{rows[0]['findings']} finding(s), largest impact {rows[0]['max_impact']:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_impact.json").write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
