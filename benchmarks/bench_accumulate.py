"""What modelling a GEMM's accumulator costs (issue 31, item 7).

For a GEMM-heavy MLP and the GPT-2-style LM of ``tests/models.py``: one analysed call with the
accumulator modelled (``accumulate=Accumulation("fp16", 32, rounding="random")``, blocks of 32)
against the same analysis without (the trusted product), both timed interleaved in one
process (``bench_overhead.timed_interleaved``), and the floor of the modelled GEMMs: their K /
block roundings of the output tile, measured as the fused C kernel's rounding of output-sized
fp64 samples that many times (what any blocked emulation pays, whatever computes the block
products).

    python benchmarks/bench_accumulate.py            # results/bench_accumulate.json
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def models(quick: bool) -> dict:
    from models import GPT2

    d, h = (128, 256) if quick else (256, 1024)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, d))
    lm = GPT2(vocab=256, d=64, heads=4, layers=2, ctx=64)
    return {f"MLP {d}-{h}, batch 64": (mlp, (torch.randn(64, d),)),
            "GPT-2-style LM, d=64, seq 64, batch 4": (lm.eval(), (torch.randint(0, 256, (4, 64)),))}


def main(argv=None) -> int:
    import fxstab
    from benchmarks.bench_overhead import timed_interleaved
    from benchmarks.common import save_json
    from fxstab import Accumulation

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args(argv)
    acc = Accumulation("fp16", args.block, rounding="random")
    rows = []
    print(f"accumulator fp16, blocks of {args.block}, random rounding; analysed call with the "
          f"accumulator / without (same process, interleaved)")
    for name, (model, x) in models(args.quick).items():
        calls = []
        for opts in ({}, {"accumulate": acc}):
            torch._dynamo.reset()
            be = fxstab.backend(format="bf16", **opts)
            f = torch.compile(model, backend=be)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(3):
                    f(*x)

            def call(f=f, be=be):
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    f(*x)
                be.reports.clear()
            calls.append(call)
        t_plain, t_acc = timed_interleaved(calls, args.repeats)
        # the floor: K / block roundings of each linear's output samples with the fused
        # kernel the analysis uses (the attention's products, modelled too, are left out)
        from fxstab.cpu import bindings
        from fxstab.numerics.rounding import Rounding

        rounder = bindings.rounder(fxstab.get_format("fp16"), Rounding.RANDOM, torch.float64, 3)
        floor = 0.0
        for mod in model.modules():
            if isinstance(mod, nn.Linear):
                rows_in = x[0].numel() // x[0].shape[-1] if isinstance(model, nn.Sequential) \
                    else x[0].numel()
                out = torch.randn(3, rows_in, mod.out_features, dtype=torch.float64)
                n = -(-mod.in_features // args.block)
                t = time.perf_counter()
                for i in range(n):
                    rounder(out, i, want_stats=False, in_place=True)
                floor += time.perf_counter() - t
        row = {"model": name, "plain_ms": t_plain * 1e3, "accumulate_ms": t_acc * 1e3,
               "ratio": t_acc / t_plain, "floor_ms": floor * 1e3,
               "floor_ratio": (t_plain + floor) / t_plain}
        rows.append(row)
        print(f"{name:<40} without {row['plain_ms']:8.1f} ms  with {row['accumulate_ms']:8.1f} ms"
              f"  x{row['ratio']:.2f}  (floor: + {row['floor_ms']:.1f} ms of roundings, "
              f"x{row['floor_ratio']:.2f})")
    path = save_json(args.out / "bench_accumulate.json",
                     {"benchmark": "bench_accumulate", "block": args.block, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
