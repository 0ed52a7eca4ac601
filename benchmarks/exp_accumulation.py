"""What a GEMM's accumulator costs (issue 31, experiment (a)): DeepSeek-V3's observation.

FP8 tensor cores on Hopper accumulate in about 14 bits (DeepSeek-V3, arXiv 2412.19437, §3.3:
"roughly 2% maximum relative error" at K = 4096, fixed by promoting the partial sums into fp32
every 128 elements). Here: fp8 e4m3 operands (uniform in [0, 1), so no cancellation hides or
inflates the accumulator's own error; per-tensor scaled to use e4m3's range), the product of
``fxstab.emulate_matmul`` with the fast accumulator (``"fp8-fast"``: e8m13, blocks of 32,
toward zero), the promoted one (``"fp8-promoted"``) and a sequential fp32 accumulator
(``Accumulation("fp32")``), against the exact product of the same operands (fp64), for K = 256
... 16384: the largest element-wise relative error and the normwise one.

(b): the digits of every GEMM of a GPT-style LM (``tests/models.py`` GPT, fp32 format so
that the accumulator's loss is not hidden by the output's rounding) analysed with the fast and
the promoted accumulator, their random-rounding variants (what the samples' spread can show),
against the trusted product: which GEMMs lose digits first.

    python benchmarks/exp_accumulation.py               # results/exp_accumulation.json + .png
    python benchmarks/exp_accumulation.py --quick --out /tmp/acc
    python benchmarks/exp_accumulation.py --part b      # the LM's GEMMs only
    python benchmarks/exp_accumulation.py --part d      # the spread's digits against the truth

(d): a directed accumulator is a bias the samples' spread cannot see. A linear of torch's
initialisation (64 tokens of N(0, 1), K inputs, 64 outputs, fp32 format, N = 3) analysed with
the fast accumulator (``"fp8-fast"``, toward zero), the promoted one (``"fp8-promoted"``)
and the fast one's random-rounding variant, K = 256
... 16384: the average CESTAC digits of the outputs ("spread"), the average true digits of
the samples' mean against the fp64 product of the program's operands ("true"), the
accumulator's own digits against the exact sum of the same operand samples (the map's
second figure, "acc"), and min(spread, acc), which the localization and the diff compare.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPECS = ("fp8-fast", "fp8-promoted", "fp32-sequential")


def _fp8(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor scaled into e4m3 (amax to 448) and back: the operand a recipe feeds."""
    scale = 448.0 / float(x.abs().max())
    return (x * scale).to(torch.float8_e4m3fn).double() / scale


def main(argv=None) -> int:
    from fxstab import Accumulation, emulate_matmul
    from benchmarks.common import save_json

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="K up to 4096, 32 x 32 outputs")
    ap.add_argument("--size", type=int, default=64, help="M = N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    ap.add_argument("--part", default="a,b,d", help="a: error against K; b: an LM's GEMMs; "
                    "d: the spread's digits and the accumulator's own against the true digits")
    args = ap.parse_args(argv)
    parts = set(args.part.split(","))
    if "b" in parts:
        part_b(args)
    if "d" in parts:
        part_d(args)
    if "a" not in parts:
        return 0
    ks = [256, 512, 1024, 2048, 4096] + ([] if args.quick else [8192, 16384])
    size = 32 if args.quick else args.size
    specs = {"fp8-fast": "fp8-fast", "fp8-promoted": "fp8-promoted",
             "fp32-sequential": Accumulation("fp32", block=1)}
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    print(f"fp8 e4m3 operands, uniform [0, 1), {size} x K @ K x {size}; relative error against "
          f"the exact product (max element-wise / normwise)")
    print(f"{'K':>6}" + "".join(f"{name:>26}" for name in specs))
    for k in ks:
        a = _fp8(torch.rand(size, k, generator=g, dtype=torch.float64))
        b = _fp8(torch.rand(k, size, generator=g, dtype=torch.float64))
        exact = a @ b
        row = {"K": k}
        for name, spec in specs.items():
            y = emulate_matmul(a, b, spec)
            row[f"{name}_max"] = float(((y - exact).abs() / exact.abs()).max())
            row[f"{name}_normwise"] = float(torch.linalg.norm(y - exact) /
                                            torch.linalg.norm(exact))
        rows.append(row)
        print(f"{k:>6}" + "".join(f"{row[f'{n}_max']:>13.2e} /{row[f'{n}_normwise']:>10.2e}"
                                  for n in specs))
    path = save_json(args.out / "exp_accumulation.json",
                     {"experiment": "exp_accumulation", "size": size, "seed": args.seed,
                      "operands": "fp8 e4m3, uniform [0, 1), per-tensor scaled", "rows": rows})
    print(f"wrote {path}")
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, style in zip(specs, ("o-", "s-", "^-")):
        ax.plot(ks, [r[f"{name}_max"] for r in rows], style, label=f"{name} (max)")
    ax.axhline(0.02, color="grey", linestyle="--", linewidth=1,
               label="DeepSeek-V3: ~2% at K = 4096")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("K (inner dimension)")
    ax.set_ylabel("max relative error")
    ax.set_title("fp8 e4m3 GEMM: the accumulator's error against K")
    ax.legend(fontsize=8)
    fig.savefig(args.out / "exp_accumulation.png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {args.out / 'exp_accumulation.png'}")
    return 0


def part_b(args) -> None:
    """Per-GEMM digits of a GPT-style LM with the fast and the promoted accumulator."""
    import warnings

    import fxstab
    from fxstab import Accumulation
    from benchmarks.common import save_json

    sys.path.insert(0, str(ROOT / "tests"))
    from models import GPT

    d = 128 if args.quick else 256
    torch.manual_seed(args.seed)
    model = GPT(vocab=256, d=d, heads=4, layers=2, ctx=64).eval()
    x = torch.randint(0, 256, (4, 64))
    arms = {"trusted": None,
            "fast": Accumulation((8, 13), 32, rounding="random"),
            "promoted": Accumulation((8, 13), 32, 128, rounding="random")}
    maps = {}
    for name, acc in arms.items():
        torch._dynamo.reset()
        be = fxstab.backend(format="fp32", accumulate=acc, seed=args.seed)
        f = torch.compile(model, backend=be)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                f(x)
        maps[name] = be.digit_map()
    gemms = [n for n, op in maps["trusted"].operators.items()
             if op.kind in ("linear", "matmul", "bmm", "mm", "scaled_dot_product_attention")]
    print(f"\n(b) GPT d={d}, 2 blocks, seq 64, fp32 format: avg digits per GEMM "
          f"(e8m13 accumulator, blocks of 32, random rounding)")
    print(f"{'GEMM':<28}{'trusted':>9}{'fast':>8}{'promoted':>10}{'fast loses':>12}")
    rows = []
    for n in gemms:
        t, fa, pr = (maps[a].operators[n].avg_digits for a in arms)
        rows.append({"gemm": n, "trusted": t, "fast": fa, "promoted": pr})
        print(f"{n:<28}{t:>9.2f}{fa:>8.2f}{pr:>10.2f}{t - fa:>12.2f}")
    path = save_json(args.out / "exp_accumulation_lm.json",
                     {"experiment": "exp_accumulation (b)", "d": d, "rows": rows})
    print(f"wrote {path}")


def part_d(args) -> None:
    """The spread's digits, the true digits and the accumulator's own against K, for a
    directed (toward zero) and a random accumulator."""
    import warnings

    import fxstab
    from fxstab import Accumulation
    from fxstab.numerics.digits import true_digits
    from benchmarks.common import save_json

    ks = [256, 1024, 4096] + ([] if args.quick else [16384])
    arms = {"fp8-fast (zero)": "fp8-fast", "fp8-promoted (zero)": "fp8-promoted",
            "e8m13/b32/random": Accumulation((8, 13), 32, rounding="random")}
    print("\n(d) linear, 64 tokens x K -> 64, fp32 format, N = 3: avg digits of the outputs "
          "(spread: CESTAC; true: the samples' mean against the fp64 product; acc: the "
          "accumulator against the exact sum of the same operands)")
    print(f"{'accumulator':<20}{'K':>6}{'spread':>8}{'true':>7}{'acc':>7}"
          f"{'min(spread, acc)':>18}{'spread - true':>15}{'min - true':>12}")
    rows = []
    for name, acc in arms.items():
        for k in ks:
            torch.manual_seed(args.seed)
            lin = torch.nn.Linear(k, 64)
            x = torch.randn(64, k)
            w, b = lin.weight.detach().double(), lin.bias.detach().double()
            exact = x.double() @ w.T + b
            torch._dynamo.reset()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # the directed one's warning
                be = fxstab.backend(format="fp32", accumulate=acc, n_samples=3, seed=args.seed)
            f = torch.compile(lin, backend=be)
            with torch.no_grad(), be.capture_samples() as cap:
                assert torch.equal(f(x), lin(x))
            op = be.digit_map().operators["linear#0"]
            true = true_digits(cap.output.double().mean(0), exact,
                               fxstab.get_format("fp32").digit_cap).mean().item()
            spread, figure = op.avg_digits, op.accumulator_digits
            low = min(spread, figure)
            rows.append({"accumulator": name, "K": k, "spread": spread, "true": true,
                         "acc": figure, "min": low})
            print(f"{name:<20}{k:>6}{spread:>8.2f}{true:>7.2f}{figure:>7.2f}{low:>18.2f}"
                  f"{spread - true:>+15.2f}{low - true:>+12.2f}")
    path = save_json(args.out / "exp_accumulation_bias.json",
                     {"experiment": "exp_accumulation (d)", "seed": args.seed, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
