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
    python benchmarks/exp_accumulation.py --part align  # the alignment's error (issue 43)
    python benchmarks/exp_accumulation.py --part validity  # est - true per preset and recipe

(d): a directed accumulator is a bias the samples' spread cannot see. A linear of torch's
initialisation (64 tokens of N(0, 1), K inputs, 64 outputs, fp32 format, N = 3) analysed with
the fast accumulator (``"fp8-fast"``, toward zero), the promoted one (``"fp8-promoted"``)
and the fast one's random-rounding variant, K = 256
... 16384: the average CESTAC digits of the outputs ("spread"), the average true digits of
the samples' mean against the fp64 product of the program's operands ("true"), the
accumulator's own digits against the exact sum of the same operand samples (the map's
second figure, "acc"), and min(spread, acc), which the localization and the diff compare.

(align), issue 43: the fp8 presets' accumulator (aligned with the accumulator to 16 bits,
truncated) against the same accumulator summing each block exactly and against the "calibrated"
blocks of 4, for uniform [0, 1), Gaussian and signed heavy-tailed (Student t, 2 degrees of
freedom) operands in e4m3 (per-tensor scaled), K = 256 ... 16384: the largest element-wise
relative error (against the largest exact output: the signed operands' outputs cross zero)
and the normwise one, beside DeepSeek-V3's ~2% at K = 4096 (uniform operands, as its test).

(validity), issue 43's done-when: for every accumulator preset and operand recipe, operands
uniform / Gaussian / signed heavy-tailed, K = 256, 4096, 16384, a linear of 32 tokens and 32
outputs (fp32 format, N = 3) analysed with ``accumulate=PRESET, gemm_inputs=, gemm_scaling=``:
the CESTAC digits of each output ("est") against the true digits of the recipe as the hardware
runs it (the operands scaled and rounded to nearest, the directed aligned accumulator:
``emulate_matmul``) against the exact fp64 product of the unscaled operands ("true"); "over"
the share of outputs with est - true >= 1 digit (the bound: 5%).
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
                    "d: the spread's digits and the accumulator's own against the true digits; "
                    "align: the alignment's error; validity: est - true per preset and recipe")
    args = ap.parse_args(argv)
    parts = set(args.part.split(","))
    if "align" in parts:
        part_align(args)
    if "validity" in parts and not part_validity(args):
        return 1  # a case over the 5% bound
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


def _operand(kind: str, shape: tuple, g: torch.Generator) -> torch.Tensor:
    """uniform [0, 1), Gaussian, or signed heavy-tailed (Student t, 2 degrees of freedom: a
    Gaussian over the square root of an independent chi-square of 2 over 2)."""
    if kind == "uniform":
        return torch.rand(shape, generator=g, dtype=torch.float64)
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "gaussian":
        return z
    chi2 = -2.0 * torch.log(torch.rand(shape, generator=g, dtype=torch.float64).clamp_min(1e-300))
    return z / torch.sqrt(chi2 / 2.0)


DISTRIBUTIONS = ("uniform", "gaussian", "heavy")


def part_align(args) -> None:
    """The aligned fp8 accumulator's error against K for three operand distributions."""
    from fxstab import Accumulation, emulate_matmul
    from fxstab.numerics.accumulation import quantize_operand
    from benchmarks.common import save_json

    ks = [256, 1024, 4096, 16384] if not args.quick else [256, 4096]
    size = 32
    arms = {"aligned (fp8-fast)": "fp8-fast", "exact blocks of 32": Accumulation((8, 13), 32,
                                                                               rounding="zero"),
            "exact blocks of 4": Accumulation((8, 13), 4, rounding="zero"),
            "aligned, promoted (fp8-promoted)": "fp8-promoted"}
    g = torch.Generator().manual_seed(args.seed)
    rows = []
    print(f"\n(align) e4m3 operands (per-tensor scaled), {size} x K @ K x {size}: relative "
          f"error against the exact product of the same operands, max element-wise (over the "
          f"largest exact output) / normwise")
    print(f"{'operands':<10}{'K':>6}" + "".join(f"{n:>34}" for n in arms))
    for kind in DISTRIBUTIONS:
        for k in ks:
            a = quantize_operand(_operand(kind, (size, k), g), "fp8_e4m3")
            b = quantize_operand(_operand(kind, (k, size), g), "fp8_e4m3", right=True)
            exact = a @ b
            row = {"operands": kind, "K": k}
            for name, spec in arms.items():
                err = emulate_matmul(a, b, spec) - exact
                row[name] = (float(err.abs().max() / exact.abs().max()),
                             float(torch.linalg.norm(err) / torch.linalg.norm(exact)))
            rows.append(row)
            print(f"{kind:<10}{k:>6}" + "".join(
                f"{row[n][0]:>23.1e} /{row[n][1]:>8.1e}" for n in arms), flush=True)
    path = save_json(args.out / "exp_accumulation_align.json",
                     {"experiment": "exp_accumulation (align)", "seed": args.seed,
                      "size": size, "rows": rows})
    print(f"wrote {path}")


VALIDITY_PRESETS = ("fp16", "bf16", "fp8-fast", "fp8-promoted")
# operand recipes: (format, scaling); None: the operands as the program gives them (fp32)
VALIDITY_RECIPES = {"fp32 operands": None, "e4m3 block128": ("fp8_e4m3", "block128"),
                    "mxfp8": ("fp8_e4m3", "mx32"), "mxfp6": ("fp6_e3m2", "mx32"),
                    "mxfp4": ("fp4_e2m1", "mx32"), "nvfp4": ("fp4_e2m1", "nvfp4")}


def part_validity(args) -> bool:
    """est - true >= 1 digit in at most 5% of the outputs, for every preset and recipe:
    whether every case keeps the bound."""
    import time
    import warnings

    import fxstab
    from fxstab import emulate_matmul
    from fxstab.numerics.digits import cestac_digits, true_digits
    from benchmarks.common import save_json

    ks = [256, 4096] if args.quick else [256, 4096, 16384]
    tokens = outputs = 32
    cap = fxstab.get_format("fp32").digit_cap
    rows = []
    start = time.perf_counter()
    print(f"\n(validity) linear {tokens} tokens x K -> {outputs}, fp32 format, N = 3: avg est "
          f"/ avg true digits, and the share of outputs with est - true >= 1 (bound 5%)")
    print(f"{'preset':<14}{'operands':<15}{'K':>6}" + "".join(f"{d:>22}" for d in DISTRIBUTIONS))
    for preset in VALIDITY_PRESETS:
        for rname, rec in VALIDITY_RECIPES.items():
            fmt, scaling = rec if rec is not None else (None, "tensor")
            for k in ks:
                torch.manual_seed(args.seed)
                lin = torch.nn.Linear(k, outputs, bias=False)
                torch._dynamo.reset()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # a directed accumulator's
                    be = fxstab.backend(format="fp32", accumulate=preset, n_samples=3,
                                        seed=args.seed, gemm_inputs=fmt, gemm_scaling=scaling)
                f = torch.compile(lin, backend=be)
                line = f"{preset:<14}{rname:<15}{k:>6}"
                g = torch.Generator().manual_seed(args.seed + k)
                for kind in DISTRIBUTIONS:
                    x = _operand(kind, (tokens, k), g).float()
                    w = _operand(kind, (outputs, k), g).float()
                    with torch.no_grad():
                        lin.weight.copy_(w)
                        with be.capture_samples() as cap_:
                            f(x)
                    est = cestac_digits(cap_.output.double(), "fp32")
                    x64, w64 = x.double(), w.double()
                    hardware = emulate_matmul(x64, w64.T, preset, inputs=fmt, scaling=scaling)
                    true = true_digits(hardware, x64 @ w64.T, cap)
                    over = float((est - true >= 1.0).double().mean())
                    rows.append({"preset": preset, "operands": rname, "K": k,
                                 "distribution": kind, "est": float(est.mean()),
                                 "true": float(true.mean()), "over": over})
                    line += f"{float(est.mean()):>8.2f} /{float(true.mean()):>5.2f} /" \
                            f"{100 * over:>5.1f}%"
                print(line, flush=True)
    worst = max(rows, key=lambda r: r["over"])
    print(f"worst: {100 * worst['over']:.1f}% ({worst['preset']}, {worst['operands']}, "
          f"K = {worst['K']}, {worst['distribution']}); "
          f"{sum(r['over'] > 0.05 for r in rows)} of {len(rows)} cases over 5%; "
          f"{time.perf_counter() - start:.0f} s")
    path = save_json(args.out / "exp_accumulation_validity.json",
                     {"experiment": "exp_accumulation (validity)", "seed": args.seed,
                      "tokens": tokens, "outputs": outputs, "rows": rows})
    print(f"wrote {path}")
    return all(r["over"] <= 0.05 for r in rows)


if __name__ == "__main__":
    sys.exit(main())
