"""Digit maps of this checkout against another revision's, field for field (issue 29).

A change that moves code must not move a digit. For every model configuration of the sampled
graph's tests (``tests/test_passes.py``: ``CASES`` at the operator level, ``ATEN_CASES`` at
the arithmetic level) and for training steps with ``backward=True`` (both levels), both
packages analyse the same model (same weights, inputs and seed) over three calls (run
untraced, traced, replayed), and their maps are compared as JSON documents: every operator,
every field (statistics, counters, edges, statuses, shapes, surrogate flags, calls, steps), and
the metadata but for what names the package (versions, commit). The reference is loaded beside
the checkout as ``benchmarks/bench_ab.py`` loads it (``fxstab_ref``, its own modules and
kernels built from its own source).

    python benchmarks/maps_ab.py --ref a580ca9          # the revision before the layout move
    python benchmarks/maps_ab.py --ref a580ca9 --cases mlp,gpt2 --out results

Prints one row per configuration (operators, fields compared, fields that differ, the largest
difference of a number) and exits 1 if any map differs. ``--noise`` adds the reference's own
map under another seed: the largest change of an operator's avg digits that new random bits
alone make, the yardstick of an intended change of the samples (issue 52: the surrogate on the
grid).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.bench_ab import extract_ref, load_ref  # noqa: E402

# metadata that names the package or the moment, not the analysis
_UNCOMPARED_METADATA = {"fxstab_version", "torch_version", "git_commit", "commit", "created",
                        "python_version", "platform", "hostname", "time"}
CALLS = 3  # untraced, traced, replayed


def configurations() -> dict:
    """name -> (make model, make inputs, backend options, training?)."""
    from test_passes import ATEN_CASES, CASES

    out = {}
    for name, (model, inputs, opts) in CASES.items():
        out[f"{name}/op"] = (model, inputs, {**opts, "granularity": "op"}, False)
    for name, (model, inputs, opts) in ATEN_CASES.items():
        out[f"{name}/aten"] = (model, inputs, {**opts, "granularity": "aten"}, False)
    for name in ("mlp", "gpt-train", "gpt2"):
        model, inputs, opts = CASES[name]
        for level in ("op", "aten"):
            out[f"{name}/{level}/backward"] = (model, inputs, {**opts, "granularity": level,
                                                               "backward": True}, True)
    # a bf16 model analysed in bf16: the samples' linears in bf16 GEMMs (numerics/lowp_gemm.py)
    # where the package has them
    from test_passes import GPT2
    out["gpt2-bf16/op"] = (lambda: GPT2(layers=1).to(torch.bfloat16).eval(),
                           lambda: (torch.randint(0, 256, (2, 32)),), {"granularity": "op"},
                           False)
    # wide enough for the CPU's bf16 path (fxstab.numerics.lowp_gemm.CPU_MIN_DIM): its weights
    # read as they are, the embedding tied to the head
    out["gpt2-bf16-wide/op"] = (lambda: GPT2(d=1024, heads=16, layers=1).to(torch.bfloat16).eval(),
                                lambda: (torch.randint(0, 256, (2, 32)),), {"granularity": "op"},
                                False)
    return out


def digit_map(lib, model: torch.nn.Module, inputs: tuple, opts: dict, training: bool,
              seed: int = 0) -> dict:
    """The map of CALLS analysed calls of ``model`` under ``lib``'s backend, as a document."""
    torch._dynamo.reset()
    be = lib.backend(seed=seed, **opts)
    f = torch.compile(model, backend=be)
    for _ in range(CALLS):
        torch.manual_seed(11)
        y = f(*inputs)
        if training:
            model.zero_grad()
            y.float().pow(2).mean().backward()
    doc = be.digit_map().as_dict()
    doc["metadata"] = {k: v for k, v in doc.get("metadata", {}).items()
                       if k not in _UNCOMPARED_METADATA}
    return doc


def avg_digits_delta(a: dict, b: dict) -> float:
    """The largest difference of an operator's avg digits between two maps (same names)."""
    ours = {op["name"]: op.get("avg_digits") for op in b.get("operators", [])}
    deltas = [abs(op["avg_digits"] - ours[op["name"]]) for op in a.get("operators", [])
              if isinstance(ours.get(op["name"]), (int, float))
              and isinstance(op.get("avg_digits"), (int, float))]
    return max(deltas, default=0.0)


def compare(a, b, where: str = "") -> tuple[int, list, float]:
    """(leaves compared, [paths that differ], largest difference of two numbers)."""
    if isinstance(a, dict) and isinstance(b, dict):
        n, bad, worst = 0, [], 0.0
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                bad.append(f"{where}/{k} (only in {'head' if k in b else 'ref'})")
                continue
            m, d, w = compare(a[k], b[k], f"{where}/{k}")
            n, bad, worst = n + m, bad + d, max(worst, w)
        return n, bad, worst
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return 1, [f"{where} (length {len(a)} vs {len(b)})"], math.inf
        n, bad, worst = 0, [], 0.0
        for i, (x, y) in enumerate(zip(a, b)):
            m, d, w = compare(x, y, f"{where}[{i}]")
            n, bad, worst = n + m, bad + d, max(worst, w)
        return n, bad, worst
    same = a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)
    if same:
        return 1, [], 0.0
    diff = abs(a - b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else math.inf
    return 1, [where], diff


def main(argv=None) -> int:
    import fxstab
    from benchmarks.common import save_json

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", required=True, help="a git revision, or a directory holding fxstab/")
    ap.add_argument("--cases", default="", help="comma-separated configuration names or "
                    "prefixes (default: all)")
    ap.add_argument("--out", default=None, help="write maps_ab.json into this folder")
    ap.add_argument("--noise", action="store_true", help="also the reference under seed 1: "
                    "how far new random bits alone move an operator's avg digits")
    args = ap.parse_args(argv)
    configs = configurations()
    if args.cases:
        wanted = args.cases.split(",")
        configs = {k: v for k, v in configs.items() if any(k.startswith(w) for w in wanted)}
        if not configs:
            print(f"maps_ab: no configuration matches {args.cases!r}; known: "
                  f"{', '.join(configurations())}", file=sys.stderr)
            return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ref = load_ref(extract_ref(args.ref, Path(tmp)))
        print(f"{'configuration':<34}{'operators':>10}{'fields':>9}{'differ':>8}{'max diff':>10}")
        for name, (make_model, make_inputs, opts, training) in configs.items():
            torch.manual_seed(0)
            model, inputs = make_model(), make_inputs()
            twin = copy.deepcopy(model)
            maps = [digit_map(lib, m, inputs, opts, training)
                    for lib, m in ((ref, model), (fxstab, twin))]
            n, bad, worst = compare(maps[0], maps[1])
            avg = avg_digits_delta(maps[0], maps[1])
            row = {"configuration": name, "operators": len(maps[1].get("operators", [])),
                   "fields": n, "differ": len(bad), "max_difference": worst,
                   "max_avg_digits_difference": avg, "first_differences": bad[:5]}
            if args.noise:
                torch.manual_seed(0)
                other = digit_map(ref, make_model(), inputs, opts, training, seed=1)
                row["seed_noise_avg_digits"] = avg_digits_delta(maps[0], other)
            rows.append(row)
            print(f"{name:<34}{row['operators']:>10}{n:>9}{len(bad):>8}{worst:>10.3g}")
            for path in bad[:5]:
                print(f"    differs: {path}")
            if bad:
                print(f"    an operator's avg digits differ by {avg:.4f} at most"
                      + (f" (another seed of the reference: {row['seed_noise_avg_digits']:.4f})"
                         if args.noise else ""))
    total = sum(r["differ"] for r in rows)
    print(f"{len(rows)} configurations, {sum(r['fields'] for r in rows)} fields compared: "
          + ("every map equal field for field" if total == 0 else f"{total} fields differ"))
    if args.out:
        save_json(Path(args.out) / "maps_ab.json", {"benchmark": "maps_ab", "ref": args.ref,
                                                     "rows": rows})
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
