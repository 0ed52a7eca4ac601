"""The analysis at realistic scale (issue 46, item 1: profile first).

A Llama-shaped model with TinyLlama's widths (hidden 2048, 32 heads, 4 KV heads, MLP 5632,
vocabulary 32000; 22 layers for the 1.1B model, ``--layers`` for quick runs), random init,
eval, one ``--batch`` x ``--seq`` prompt, in ``--dtype`` (bf16 by default, as the issue's
model), analysed at the operator level in ``--format`` (bf16) with N = 3. Printed, each
measured in this run:

* the steady analysed call against an eager call (median of ``--repeat`` interleaved pairs),
* the first two analysed calls (the untraced rules, then the trace) against one eager call
  and against ``torch.compile(backend="eager")``'s first two (dynamo's own compile),
* peak resident memory of the process after the eager calls and after the analysed ones
  (``ru_maxrss``; the model, built in its dtype, is in both),
* where the steady call's time goes, each part timed around its calls over a few steady calls
  (the least): the deterministic call (the captured graph as the model runs it), the samples'
  GEMMs of weights (``lowp_gemm.linear``: its GEMMs and conversions), the roundings with
  their statistics (the prepared C kernels), the GEMM surrogate's perturbations, and the rest
  (the samples' other operators, Python). ``--profile`` adds torch's profiler table (its
  self CPU times inflate memory-bound operators several times over: a profiled call took
  twice an unprofiled one).

``--backward`` measures a training step instead (issue 52, item 3): forward, cross-entropy on
the next tokens and backward, analysed with ``backward=True`` against the same step compiled
with ``backend="eager"`` (median of ``--repeat`` interleaved pairs), the gradients compared bit
for bit, and the analysed step's time by part (the weight GEMMs of both directions).

Writes ``results/bench_scale.json``.

    python benchmarks/bench_scale.py --layers 2            # minutes
    python benchmarks/bench_scale.py                       # the 1.1B model (22 layers)
    python benchmarks/bench_scale.py --backward --layers 4 # its training step, 4 layers
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


def breakdown(f, x, be, calls: int = 3, grad: bool = False) -> dict:
    """Seconds of one steady analysed call by part (the least over ``calls``): each part timed
    around its functions, the rest by difference (``grad``: ``f`` is a training step)."""
    from fxstab.cpu import bindings
    from fxstab.numerics import lowp_gemm

    spent: dict = {}

    def timed(name, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return run

    graphs = [g for g in be.graphs if g.direction == "forward"]  # (the backward's: boxed)
    saved = (lowp_gemm.linear, bindings.Prepared.__call__, bindings.perturb,
             [g.deterministic for g in graphs])
    lowp_gemm.linear = timed("weight GEMMs", lowp_gemm.linear)
    bindings.Prepared.__call__ = timed("roundings", bindings.Prepared.__call__)
    bindings.perturb = timed("surrogate", bindings.perturb)
    for g in graphs:
        g.deterministic = timed("deterministic", g.deterministic)
    best: dict = {}
    try:
        for _ in range(calls):
            spent.clear()
            t0 = time.perf_counter()
            with torch.set_grad_enabled(grad):
                f(x)
            total = time.perf_counter() - t0
            if not best or total < best["total"]:
                best = {**spent, "total": total}
    finally:
        lowp_gemm.linear, bindings.Prepared.__call__, bindings.perturb = saved[:3]
        for g, d in zip(graphs, saved[3]):
            g.deterministic = d
    total = best.pop("total")
    best["rest"] = total - sum(best.values())
    best["total"] = total
    return best


def training(args, model: torch.nn.Module, x: torch.Tensor) -> dict:
    """The analysed training step (``backward=True``) against the plain compiled one: times,
    gradients bit for bit, the analysed step by part."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]

    def step(f) -> tuple[float, list]:
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        logits = f(x).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                 x[:, 1:].flatten())
        loss.backward()
        return time.perf_counter() - t0, [p.grad for p in params]

    torch._dynamo.reset()
    plain = torch.compile(model, backend="eager")
    step(plain)
    step(plain)
    be = fxstab.backend(format=args.format, n_samples=3, seed=0, lowp_gemm=args.lowp_gemm,
                        backward=True)
    analysed = torch.compile(model, backend=be)
    first = step(analysed)[0] + step(analysed)[0]
    pairs = [(step(plain)[0], step(analysed)[0]) for _ in range(args.repeat)]
    plain_t = statistics.median(p[0] for p in pairs)
    steady = statistics.median(p[1] for p in pairs)
    _, want = step(plain)
    _, got = step(analysed)
    identical = all(torch.equal(a, b) for a, b in zip(want, got))
    parts = breakdown(lambda x_: step(analysed), x, be, grad=True)
    table = ""
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step(analysed)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    dm = be.digit_map()
    backward = sum(1 for name in dm.operators if dm.operators[name].direction == "backward")
    return {"plain_step_s": round(plain_t, 3), "analysed_step_s": round(steady, 3),
            "step_x": round(steady / plain_t, 2), "first_two_s": round(first, 2),
            "gradients_bit_identical": identical, "operators": len(dm),
            "backward_operators": backward,
            "parts_x": {k: round(v / plain_t, 2) for k, v in parts.items()}, "profile": table}


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
    ap.add_argument("--profile", action="store_true", help="torch's profiler table too")
    ap.add_argument("--backward", action="store_true", help="a training step (forward, "
                    "cross-entropy, backward) analysed with backward=True against the plain "
                    "compiled step")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = build(args.layers, dtype, args.hidden)
    x = torch.randint(0, 32000, (args.batch, args.seq))
    params = sum(p.numel() for p in model.parameters())
    if args.backward:
        row = {"layers": args.layers, "hidden": args.hidden, "params": params,
               "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
               "format": args.format, "lowp_gemm": args.lowp_gemm,
               **training(args, model, x)}
        print(f"Llama-shaped training step, {args.layers} layers, hidden {args.hidden} "
              f"({params / 1e6:.0f}M parameters), {args.dtype}, format {args.format}, N=3, "
              f"{args.batch}x{args.seq}, {torch.get_num_threads()} threads, backward=True")
        print(f"plain compiled step {row['plain_step_s']:.2f} s, analysed "
              f"{row['analysed_step_s']:.2f} s: {row['step_x']:.1f}x; first two analysed "
              f"steps {row['first_two_s']:.1f} s; gradients bit-identical: "
              f"{row['gradients_bit_identical']}; operators {row['operators']} "
              f"({row['backward_operators']} backward)")
        print("where the analysed step's time goes (x one plain step):  " + "  ".join(
            f"{k} {v:.2f}" for k, v in row["parts_x"].items()))
        if row["profile"]:
            print(row["profile"])
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_scale.json").write_text(json.dumps({"rows": [row]}, indent=1))
        return 0

    def eager() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model(x)
        return time.perf_counter() - t0

    eager()
    e0 = min(eager() for _ in range(2))
    rss_eager = _rss_gb()
    # what dynamo's own compile costs: torch.compile(backend="eager")'s first two calls
    torch._dynamo.reset()
    plain = torch.compile(model, backend="eager")
    t0 = time.perf_counter()
    with torch.no_grad():
        plain(x), plain(x)
    plain_first = time.perf_counter() - t0
    del plain
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
    parts = breakdown(f, x, be)
    table = ""
    if args.profile:
        with torch.no_grad(), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
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
           "first_two_x": round(first / e0, 1),
           "compile_eager_first_two_s": round(plain_first, 2),
           "first_two_x_compile_eager": round(first / plain_first, 2),
           "rss_eager_gb": round(rss_eager, 2),
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
    print(f"{'  against compile(eager)':<28}{plain_first:>9.2f}{first:>10.2f}"
          f"{first / plain_first:>7.1f}x")
    print(f"{'peak RSS (GB)':<28}{rss_eager:>9.2f}{rss_analysed:>10.2f}"
          f"{rss_analysed / rss_eager:>7.2f}x")
    print(f"operators {row['operators']}, coverage {100 * row['coverage']:.1f}%, output "
          f"bit-identical: {identical}")
    print("where the steady call's time goes (x one eager call):  " + "  ".join(
        f"{k} {v / eager_t:.2f}" for k, v in parts.items()))
    row["parts_x"] = {k: round(v / eager_t, 2) for k, v in parts.items()}
    if table:
        print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_scale.json").write_text(json.dumps({"rows": [row], "profile": table},
                                                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
