"""The analysis at realistic scale (issue 46, item 1: profile first).

A Llama-shaped model with TinyLlama's widths (hidden 2048, 32 heads, 4 KV heads, MLP 5632,
vocabulary 32000; 22 layers for the 1.1B model, ``--layers`` for quick runs), random init,
eval, one ``--batch`` x ``--seq`` prompt, in ``--dtype`` (bf16 by default, as the issue's
model), analysed at the operator level in ``--format`` (bf16) with N = 3. Printed, each
measured in this run:

* the steady analysed call against an eager call (median of ``--repeat`` interleaved pairs),
* the first two analysed calls (the untraced rules, then the trace) against one eager call,
* peak resident memory of the process after the eager calls and after the analysed ones
  (``ru_maxrss``; the model, built in its dtype, is in both),
* where the steady call's time goes per kind of step of the generated graph (the profiler's
  self CPU time of fxstab's steps, the aten operators the samples run, the rest), the top
  entries.

Writes ``results/bench_scale.json``.

    python benchmarks/bench_scale.py --layers 2            # minutes
    python benchmarks/bench_scale.py                       # the 1.1B model (22 layers)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxstab  # noqa: E402


def build(layers: int, dtype: torch.dtype, hidden: int = 2048) -> torch.nn.Module:
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=5632 * hidden
                        // 2048, num_hidden_layers=layers, num_attention_heads=32,
                        num_key_value_heads=4, max_position_embeddings=2048)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no fp32 copy in the peak memory
    try:
        return T.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--format", default="bf16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lowp-gemm", action=argparse.BooleanOptionalAction, default=True,
                    help="the samples' linear layers in bf16 GEMMs (fxstab.numerics.lowp_gemm; "
                         "--no-lowp-gemm: in fp32, the reference)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = build(args.layers, dtype, args.hidden)
    x = torch.randint(0, 32000, (args.batch, args.seq))
    params = sum(p.numel() for p in model.parameters())

    def eager() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model(x)
        return time.perf_counter() - t0

    eager()
    e0 = min(eager() for _ in range(2))
    rss_eager = _rss_gb()
    torch._dynamo.reset()
    be = fxstab.backend(format=args.format, n_samples=3, seed=0, lowp_gemm=args.lowp_gemm)
    f = torch.compile(model, backend=be)

    def analysed() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = f(x)
        dt = time.perf_counter() - t0
        del out
        return dt

    first = analysed() + analysed()  # the untraced rules, then the trace (compile included)
    pairs = [(eager(), analysed()) for _ in range(args.repeat)]
    eager_t = statistics.median(p[0] for p in pairs)
    steady = statistics.median(p[1] for p in pairs)
    rss_analysed = _rss_gb()
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) \
            as prof:
        f(x)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    identical = True
    with torch.no_grad():
        identical = torch.equal(f(x).logits, model(x).logits)
    cov = be.coverage()
    row = {"layers": args.layers, "hidden": args.hidden, "params": params,
           "batch": args.batch, "seq": args.seq, "dtype": args.dtype, "format": args.format,
           "lowp_gemm": args.lowp_gemm,
           "eager_s": round(eager_t, 3), "steady_s": round(steady, 3),
           "steady_x": round(steady / eager_t, 2), "first_two_s": round(first, 2),
           "first_two_x": round(first / e0, 1), "rss_eager_gb": round(rss_eager, 2),
           "rss_analysed_gb": round(rss_analysed, 2),
           "rss_x": round(rss_analysed / rss_eager, 2), "operators": len(be.digit_map()),
           "coverage": round(cov.fraction, 3), "bit_identical": identical}
    print(f"Llama-shaped, {args.layers} layers, hidden {args.hidden} ({params / 1e6:.0f}M "
          f"parameters), {args.dtype}, format {args.format}, N=3, {args.batch}x{args.seq}, "
          f"{torch.get_num_threads()} threads, samples' linears in "
          f"{'bf16 GEMMs' if args.lowp_gemm else 'fp32 GEMMs'}")
    print(f"{'':<28}{'eager':>9}{'analysed':>10}{'ratio':>8}")
    print(f"{'steady call (s)':<28}{eager_t:>9.2f}{steady:>10.2f}{steady / eager_t:>7.1f}x")
    print(f"{'first two calls (s)':<28}{e0:>9.2f}{first:>10.2f}{first / e0:>7.1f}x")
    print(f"{'peak RSS (GB)':<28}{rss_eager:>9.2f}{rss_analysed:>10.2f}"
          f"{rss_analysed / rss_eager:>7.2f}x")
    print(f"operators {row['operators']}, coverage {100 * row['coverage']:.1f}%, output "
          f"bit-identical: {identical}")
    print("where the steady call's time goes (self CPU time, top 15):")
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_scale.json").write_text(json.dumps({"rows": [row], "profile": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
