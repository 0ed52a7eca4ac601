"""The compiled stochastic path against a reference revision, in one process (issue 16).

For each model: the time of one analysed call divided by the plain eager call, for this
checkout and for ``--ref`` (a git revision or a directory holding ``fxstab/``: by default the
last revision with the node-by-node interpreter), both measured interleaved in the same process
(``bench_overhead.timed_interleaved``), at every thread count of ``--threads``; and whether the
two produce the same digit map (the largest difference of any statistic of any operator over a
few calls, same seed). The per-node row is a long chain of tiny elementwise operators: its
(analysed - eager) time divided by the number of graph nodes is the overhead per node.

``floor x`` is what the analysed call cannot go below without changing what it computes: the
deterministic call (1) plus the N samples' own compute, measured in the same run: the
checkout's generated graphs with every step that rounds, measures, counts or perturbs made the
identity (the batched operators alone, in the working dtype: fp64 for the fp32 format at the
arithmetic level); a step that computes an add, sub, mul or div inside its rounding
(``binary``) runs that operator on the samples instead. Steps that compute an operator's value (the bf16 table lookups of exp, tanh...,
which run as the operator itself; CESTAC comparisons, per-sample and random operators) run as
they are.

``kernels x`` is the time one analysed call of the checkout spends in the calls of fxstab's C
kernels (rounding and its statistics, the GEMM surrogate: ``native.Prepared``,
``native.Rounder``, ``native.perturb``; ``native.Binary``, which also computes its add, sub, mul
or div: their few lines of Python included) over the eager
call's, the least over a few calls. ``floor + kernels`` is what the analysed call cannot go
below without faster kernels (up to the floor's identity steps, a few microseconds each): a
target under it is a target for the kernels. On tiny tensors (the chain) it is mostly the
calls' own cost, 3-6 us each.

    python benchmarks/bench_compiled.py                    # the table, results/bench_compiled.json
    python benchmarks/bench_compiled.py --quick --threads 1
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.bench_ab import compiled_pair, extract_ref, load_ref  # noqa: E402
from benchmarks.bench_overhead import LayerNormSoftmax, timed_interleaved  # noqa: E402

INTERPRETER = "fe9f1ae"  # the last revision whose stochastic path was an interpreter
MODELS = ("mlp", "gpt", "gpt2", "chain", "lnsoftmax", "lnsoftmax-fp32", "gpt2-aten",
          "chain-aten")


class Chain(nn.Module):
    """``length`` tiny elementwise operators in a row (per-node overhead)."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.length // 3):
            x = torch.tanh(x * 1.01 + 0.1)
        return x


def sampled_calls(call) -> list:
    """The (sampled graph, arguments) of each generated graph that ``call()`` runs."""
    from fxstab.analysis.sampled_graph import SampledGraph

    seen = []
    run_graph = SampledGraph.__call__

    def spy(sg, args, index):
        seen.append((sg, args))
        return run_graph(sg, args, index)

    SampledGraph.__call__ = spy
    try:
        call()
    finally:
        SampledGraph.__call__ = run_graph
    return seen


def compute_only(call, x: tuple, opts: dict, n: int):
    """A callable running the samples' compute of an analysed call (``call()``) without
    fxstab's work (see the module docstring): the sampled graphs ``call`` runs, with their steps
    that round, measure or perturb made the identity, on the arguments it gives them."""
    runs = [(floor_graph(sg), [args[i] for i in sg.positions])
            for sg, args in sampled_calls(call)]

    def run():
        for gm, inputs in runs:
            gm(*inputs)
    return run


def floor_graph(sg) -> torch.fx.GraphModule:
    """A copy of one sampled graph's module with its steps that round, measure or perturb made
    the identity (a table lookup step runs its operator): the samples' compute alone."""
    from fxstab.passes import steps

    gm = copy.deepcopy(sg.gm)
    for node in gm.graph.nodes:
        step = steps.lowered(node)
        one = steps.returns_one(node)  # the output itself, not a list of outputs
        if step is not None and step.what in _FXSTABS_OWN:
            node.target = _identity_step(node.meta.get("val"), one)
        elif step is not None and step.what == "lookup":  # the op itself, then the identity
            node.target = _computing_step(lambda xs, op=step.op: op(xs[0]), one)
        elif step is not None and step.what == "binary":  # the add/sub/mul/div on the samples
            node.target = _computing_step(step.op, one)
    gm.recompile()
    return gm


# the steps that are fxstab's work, not the operator's: made the identity for the floor
_FXSTABS_OWN = frozenset({"round", "perturb", "observe"})


def _computing_step(call, one: bool):
    """A step that computes its value from its inputs in the floor: ``call(xs)`` (a table
    lookup: its op on the one input; a binary step: the batched operator), laid out as the
    step's outputs (the output itself with ``one``)."""
    def computing_step(xs: list) -> list:
        return [call(xs)]

    def computing_step_one(xs: list) -> torch.Tensor:
        return call(xs)
    return computing_step_one if one else computing_step


def _identity_step(vals, one: bool):
    """A step that gives its inputs back, laid out as the step's traced outputs (``vals``; the
    output itself with ``one``): a rounding step of a value every sample shares returns its N
    samples, a surrogate step its operands in the strides the operator reads (then a copy, as
    the step's own output is)."""
    layouts = [(tuple(v.shape), v.stride()) if isinstance(v, torch.Tensor) else None
               for v in ([vals] if one else vals or ())]

    def identity_step(xs: list) -> list:
        out = []
        for t, layout in zip(xs, layouts):
            if layout is None or (tuple(t.shape), t.stride()) == layout:
                out.append(t)
            else:
                out.append(torch.empty_strided(*layout, dtype=t.dtype).copy_(t))
        return out

    def identity_step_one(xs: list) -> torch.Tensor:
        return identity_step(xs)[0]
    return identity_step_one if one else identity_step


def make(name: str, quick: bool):
    """(model, inputs, backend options, granularity, what it stands for)."""
    from models import GPT, GPT2

    torch.manual_seed(0)
    if name == "mlp":
        d, h = (128, 256) if quick else (512, 1024)
        m = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, h), nn.GELU(),
                          nn.Linear(h, h), nn.GELU(), nn.Linear(h, d))
        return m, (torch.randn(64, d),), {}, f"4-layer {d}-{h} MLP, batch 64"
    if name == "gpt":
        m = GPT(vocab=256, d=64 if quick else 128, heads=4, layers=2, ctx=64)
        return m, (torch.randint(0, 256, (2 if quick else 8, 64)),), {}, \
            "tests/models.py GPT, 2 layers, d=128, seq 64, batch 8"
    aten = name.endswith("-aten")
    level = {"granularity": "aten"} if aten else {}
    if name.startswith("gpt2"):
        m = GPT2(vocab=256, d=64, heads=4, layers=2, ctx=64)
        return m, (torch.randint(0, 256, (4, 64)),), level, \
            "GPT-2-style LM (tests/models.py GPT2), 2 layers, d=64, seq 64, batch 4" + \
            (", aten" if aten else "")
    if name.startswith("chain"):
        length = 100 if quick else 400
        return Chain(length), (torch.randn(8),), level, \
            f"{length} elementwise operators on 8 elements" + (", aten" if aten else "")
    if name.startswith("lnsoftmax"):
        fmt = "fp32" if name.endswith("fp32") else "bf16"
        return LayerNormSoftmax(1024), (torch.randn(64 if quick else 256, 1024),), \
            {"granularity": "aten", "format": fmt}, f"aten, LayerNorm+softmax 256x1024, {fmt}"
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def kernel_time(call, calls: int = 5) -> float:
    """The least time over ``calls`` calls of ``call()`` spent inside fxstab's C kernels (the
    calls of ``native.Prepared``, ``native.Rounder``, ``native.Binary`` and ``native.perturb``),
    in seconds."""
    from fxstab.cpu import bindings as native

    spent = [0.0]
    saved = [(native.Prepared, "__call__"), (native.Rounder, "_run"), (native, "perturb"),
             (native.Binary, "__call__")]
    originals = [getattr(owner, name) for owner, name in saved]

    def timed(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0
        return run

    for (owner, name), fn in zip(saved, originals):
        setattr(owner, name, timed(fn))
    best = float("inf")
    try:
        for _ in range(calls):
            spent[0] = 0.0
            call()
            best = min(best, spent[0])
    finally:
        for (owner, name), fn in zip(saved, originals):
            setattr(owner, name, fn)
    return best


def main(argv=None) -> int:
    import fxstab
    from benchmarks.common import save_json

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default=INTERPRETER,
                    help="git revision or directory holding fxstab/ (default: the interpreter)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the process's CPU time (all its threads) instead of the wall "
                         "clock: on a machine shared with other jobs, with --threads 1")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    rows = []
    print(f"{'model':<16}{'thr':>4}{'eager ms':>10}{args.ref + ' x':>14}{'checkout x':>12}"
          f"{'floor x':>9}{'kernels x':>11}{'speed-up':>10}{'max|dmap|':>11}  what")
    with tempfile.TemporaryDirectory() as tmp:
        ref = load_ref(extract_ref(args.ref, Path(tmp)))
        for name in args.models.split(","):
            model, x, opts, what = make(name, args.quick)
            model.eval()
            opts = dict(n_samples=args.samples, **opts)
            # the same digit map? three calls each, same seed, fresh compilation
            maps = []
            for lib in (ref, fxstab):
                torch._dynamo.reset()
                be = lib.backend(**opts)
                f = torch.compile(model, backend=be)
                with torch.no_grad():
                    for _ in range(3):
                        f(*x)
                maps.append(be.digit_map())
            diff = maps[1].difference(maps[0])
            for threads in [int(t) for t in args.threads.split(",")]:
                torch.set_num_threads(threads)
                call_ref, call_new, _, be_new = compiled_pair(ref, fxstab, model, x, opts)
                with torch.no_grad():
                    call_new()
                    call_new()  # traced (on the second call): the generated graphs exist
                    compute = compute_only(call_new, x, opts, args.samples)
                    t_eager, t_ref, t_new, t_compute = timed_interleaved(
                        [lambda: model(*x), call_ref, call_new, compute], args.repeats,
                        time.process_time if args.cpu_time else time.perf_counter)
                    t_kernels = kernel_time(call_new)
                nodes = sum(len(g.gm.graph.nodes) for g in be_new.graphs)
                row = {"model": name, "what": what, "threads": threads,
                       "eager_ms": t_eager * 1e3, "ref_ratio": t_ref / t_eager,
                       "new_ratio": t_new / t_eager, "speedup": t_ref / t_new,
                       "floor_ratio": 1 + t_compute / t_eager,
                       "kernels_ratio": t_kernels / t_eager,
                       "digit_map_max_difference": diff, "graph_nodes": nodes,
                       "us_per_node_new": (t_new - t_eager) / nodes * 1e6,
                       "us_per_node_ref": (t_ref - t_eager) / nodes * 1e6}
                rows.append(row)
                extra = (f"  ({row['us_per_node_new']:.1f} vs {row['us_per_node_ref']:.1f} "
                         f"us/node, {nodes} nodes)" if name.startswith("chain") else "")
                print(f"{name:<16}{threads:>4}{row['eager_ms']:>10.3f}{row['ref_ratio']:>14.2f}"
                      f"{row['new_ratio']:>12.2f}{row['floor_ratio']:>9.2f}"
                      f"{row['kernels_ratio']:>11.2f}"
                      f"{row['speedup']:>10.2f}{diff:>11.2g}  "
                      f"{what}{extra}", flush=True)
    path = save_json(Path(args.out) / "bench_compiled.json",
                     {"benchmark": "bench_compiled", "ref": args.ref, "n_samples": args.samples,
                      "clock": "process_time" if args.cpu_time else "perf_counter",
                      "repeats": args.repeats, "quick": args.quick, "rows": rows})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
