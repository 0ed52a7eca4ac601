"""OpInfo sweep: does the backend analyse every PyTorch operator? (issue 17)

For each entry of PyTorch's ``op_db`` that supports float32 on the CPU, the first sample input
is run eagerly and through ``torch.compile(backend=fxstab.backend(select="*", format="fp32"))``
(every operator selected). The function compiled is ``op(x + 0, ...)``: the ``+ 0`` (rounded into
fp32: exact) makes every floating input carry samples, so the operator itself meets stacked
samples as it does inside a model. An operator counts when its eager output holds a floating or
complex tensor; it is *analysed* when every operator of its graph but the ``+ 0`` prelude was
rounded and recorded (lifted with vmap, batched, or run once per sample), the stochastic path did
not fail, and the compiled call returned exactly the eager output (bit for bit, NaN for NaN).

    python benchmarks/bench_opinfo.py                      # both levels, every operator
    python benchmarks/bench_opinfo.py --levels op --stride 5
    python benchmarks/bench_opinfo.py --ops add,fft.fft --verbose

Prints the coverage table (analysed / per sample / not analysed / failed, with the reasons) and
writes ``results/bench_opinfo.json`` (machine, versions, commit, rows). The aten level's rows
use its coverage (``fxstab/analysis/aten_level.py``): an operator is analysed there when primitives
named within it were rounded and recorded on the samples, or, for an operator made only of exact
primitives (views, selections) or random draws, recorded as observed (``select="*"`` asks for
every operator); the reason of each coverage entry says which.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fxstab  # noqa: E402
from fxstab.records.coverage import ANALYSED  # noqa: E402
from fxstab.capture.naming import source_location  # noqa: E402

ANALYSED_ROW, PER_SAMPLE_ROW = "analysed", "analysed per sample"
NOT_ANALYSED, FAILED, MISMATCH = "not analysed", "failed", "deterministic mismatch"
# dynamo ran the operator outside every graph: no torch.compile backend sees it
NOT_CAPTURED = "not captured"
COUNTED = (ANALYSED_ROW, PER_SAMPLE_ROW, NOT_ANALYSED, FAILED, MISMATCH)


# factories of uninitialised memory: eager and compiled outputs differ by nature
_UNINITIALISED = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided",
                            "empty_strided", "empty_permuted"})


def _enter(t: torch.Tensor) -> torch.Tensor:
    return t + 0  # the prelude: the operator's floating inputs carry samples


_ENTER_LINE = inspect.getsourcelines(_enter)[1] + 1


def _floating(out: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
               for t in pytree.tree_leaves(out))


def _same(a: Any, b: Any) -> bool:
    fa, sa = pytree.tree_flatten(a)
    fb, sb = pytree.tree_flatten(b)
    if sa != sb or len(fa) != len(fb):
        return False
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if not (x == y or (x != x and y != y)):
                return False
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_sparse or x.layout != torch.strided:
            continue
        if x.is_complex():
            x, y = torch.view_as_real(x.resolve_conj()), torch.view_as_real(y.resolve_conj())
        x, y = x.resolve_neg().resolve_conj(), y.resolve_neg().resolve_conj()
        if x.is_floating_point():
            if not torch.equal(torch.isnan(x), torch.isnan(y)):
                return False
            x, y = torch.nan_to_num(x, 0.0), torch.nan_to_num(y, 0.0)
        if not torch.equal(x, y):
            return False
    return True


def _call(op: Any, sample: Any):
    return op.op(sample.input, *sample.args, **sample.kwargs)


def _function(op: Any, sample: Any):
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]

    def f(*ts):
        new = list(leaves)
        for i, t in zip(where, ts):
            new[i] = _enter(t) if (t.is_floating_point() or t.is_complex()) else t
        inp, a, k = pytree.tree_unflatten(new, spec)
        return op.op(inp, *a, **k)

    return f, [leaves[i] for i in where]


def _prelude_nodes(be: Any) -> set:
    here = os.path.abspath(__file__)
    out = set()
    for g in be.graphs:
        graph = getattr(g, "sgraph", g.gm.graph)
        for node in graph.nodes:
            src = source_location(node)
            if src.endswith(f":{_ENTER_LINE}") and os.path.abspath(src.rsplit(":", 1)[0]) == here:
                out.add((g.index, node.name))
    return out


def _without_seed_wrapper():
    """OpInfo wraps its random operators in ``wrapper_set_seed`` (freeze the RNG state, seed
    42), which dynamo cannot trace: the sweep calls the operators themselves (it seeds before
    the eager and the compiled call alike)."""
    import importlib
    import pkgutil

    import torch.testing._internal.opinfo.definitions as defs

    patched = []
    names = ["torch.testing._internal.common_methods_invocations"] + [
        f"{defs.__name__}.{m.name}" for m in pkgutil.iter_modules(defs.__path__)]
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "wrapper_set_seed"):
            patched.append((mod, mod.wrapper_set_seed))
            mod.wrapper_set_seed = lambda op, *a, **k: op(*a, **k)
    return patched


def check_operator(op: Any, granularity: str = "op") -> dict:
    """One OpInfo entry through the backend: its row (status, reason, coverage entries)."""
    row = {"op": op.name + (f".{op.variant_test_name}" if op.variant_test_name else ""),
           "granularity": granularity}
    if torch.float32 not in op.supported_dtypes("cpu"):
        return {**row, "status": "skipped", "reason": "no float32 on the CPU"}
    try:
        sample = next(iter(op.sample_inputs("cpu", torch.float32, requires_grad=False)))
    except Exception as exc:  # an OpInfo without samples for this configuration
        return {**row, "status": "skipped", "reason": f"no sample ({type(exc).__name__})"}
    try:
        torch.manual_seed(0)
        ref = _call(op, sample)
    except Exception as exc:
        return {**row, "status": "skipped", "reason": f"eager fails ({type(exc).__name__})"}
    if not _floating(ref):
        return {**row, "status": "skipped", "reason": "no floating or complex output"}
    if op.name.split(".")[0] in _UNINITIALISED:
        return {**row, "status": "skipped", "reason": "uninitialised memory (no reference)"}
    torch.manual_seed(0)
    if not _same(ref, _call(op, sample)):
        return {**row, "status": "skipped", "reason": "eager output is not deterministic "
                "(uninitialised memory)"}
    f, inputs = _function(op, sample)
    torch._dynamo.reset()
    be = fxstab.backend(granularity=granularity, format="fp32", select="*", seed=0)
    from torch._dynamo.utils import counters

    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.manual_seed(0)
            got = torch.compile(f, backend=be)(*inputs)
        except Exception as exc:
            why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]}"
            try:
                torch._dynamo.reset()
                torch.compile(f, backend="eager")(*inputs)
            except Exception:
                return {**row, "status": NOT_CAPTURED,
                        "reason": f"torch.compile fails without fxstab too ({why})"}
            return {**row, "status": FAILED, "reason": f"compiled call raised {why}"}
    failures = [m for info in be.infos for m in info.failures]
    if not _same(ref, got):
        return {**row, "status": MISMATCH, "reason": "compiled output differs from eager"}
    if failures:
        return {**row, "status": FAILED, "reason": failures[0][:160]}
    prelude = _prelude_nodes(be)
    entries = [e for e in be.coverage().entries if (e.graph, e.node) not in prelude]
    counted = [e for e in entries if e.floating and not (
        e.how == "skipped" and e.reason.startswith(("fused", "identity")))]
    missing = [e for e in counted if e.how != ANALYSED]
    per_sample = [e for e in counted if e.how == ANALYSED and e.reason.startswith("per sample")]
    row["operators"] = [(e.operator, e.how, e.reason) for e in entries]
    del caught
    identity = [e for e in entries if e.reason.startswith("identity")]
    if not counted and identity:
        return {**row, "status": "skipped", "reason": f"nothing to round in this sample "
                f"({identity[0].reason})"}
    if not counted:
        breaks = list(counters.get("graph_break", {}))
        if breaks:
            return {**row, "status": NOT_CAPTURED, "reason": "graph break: " +
                    " ".join(str(breaks[0]).split())[:140]}
        return {**row, "status": NOT_CAPTURED, "reason": "no floating operator in dynamo's "
                "graphs: dynamo ran it outside them"}
    if missing:
        return {**row, "status": NOT_ANALYSED,
                "reason": f"{missing[0].operator}: {missing[0].how} ({missing[0].reason})"}
    if per_sample:
        return {**row, "status": PER_SAMPLE_ROW, "reason": per_sample[0].reason[:160]}
    return {**row, "status": ANALYSED_ROW, "reason": ""}


def sweep(granularity: str = "op", stride: int = 1, offset: int = 0,
          names: Optional[set] = None, verbose: bool = False,
          progress: Optional[bool] = None) -> list:
    """Rows of :func:`check_operator` over ``op_db[offset::stride]`` (or the named ones); a
    bar of the operators done on a terminal (``progress``: :class:`fxstab.progress.Progress`'s
    ``enabled``)."""
    from fxstab.progress import Progress
    from torch.testing._internal.common_methods_invocations import op_db

    import torch._dynamo.config as dynamo_config

    # data-dependent operators (nonzero, unique, masked_select...) in the graph, not breaks
    dynamo_config.capture_dynamic_output_shape_ops = True
    dynamo_config.capture_scalar_outputs = True
    patched = _without_seed_wrapper()
    rows = []
    ops = [op for op in op_db if names is None or op.name in names
           or f"{op.name}.{op.variant_test_name}" in names]
    if names is None:
        ops = ops[offset::stride]
    bar = Progress(f"OpInfo sweep ({granularity})", total=len(ops), unit="operator",
                   enabled=False if verbose else progress)
    try:
        for op in ops:
            t0 = time.perf_counter()
            row = check_operator(op, granularity)
            row["seconds"] = round(time.perf_counter() - t0, 3)
            rows.append(row)
            bar.update(note=f"{row['op']}: {row['status']}")
            if verbose:
                print(f"{row['op']:<40} {row['status']:<22} {row['reason'][:110]}", flush=True)
    finally:
        bar.close()
        for mod, fn in patched:
            mod.wrapper_set_seed = fn
        dynamo_config.capture_dynamic_output_shape_ops = False
        dynamo_config.capture_scalar_outputs = False
        torch._dynamo.reset()
    return rows


def summary(rows: list) -> dict:
    """Counts; ``fraction``: analysed / operators in a captured graph; ``fraction_all``: the
    same over every operator with a floating output, the ones dynamo did not capture too."""
    counts = collections.Counter(r["status"] for r in rows)
    counted = sum(counts[s] for s in COUNTED)
    analysed = counts[ANALYSED_ROW] + counts[PER_SAMPLE_ROW]
    every = counted + counts[NOT_CAPTURED]
    return {"counted": counted, "analysed": analysed,
            "fraction": analysed / counted if counted else None,
            "not_captured": counts[NOT_CAPTURED],
            "fraction_all": analysed / every if every else None, "counts": dict(counts)}


def table(rows: list, level: str) -> str:
    s = summary(rows)
    lines = [f"level {level}: {s['analysed']} of the {s['counted']} captured operators with a "
             f"floating or complex output analysed"
             + (f" ({100 * s['fraction']:.1f}%)" if s["fraction"] is not None else "")
             + (f"; {s['analysed']} of {s['counted'] + s['not_captured']} "
                f"({100 * s['fraction_all']:.1f}%) counting the {s['not_captured']} that dynamo "
                f"runs outside its graphs" if s["fraction_all"] is not None else "")]
    for status in (ANALYSED_ROW, PER_SAMPLE_ROW, NOT_ANALYSED, FAILED, MISMATCH, NOT_CAPTURED,
                   "skipped"):
        lines.append(f"  {status:<24} {s['counts'].get(status, 0):>5}")
    for status in (PER_SAMPLE_ROW, NOT_ANALYSED, FAILED, MISMATCH, NOT_CAPTURED):
        bad = [r for r in rows if r["status"] == status]
        if bad:
            lines.append(f"  -- {status}:")
            for r in bad:
                lines.append(f"     {r['op']:<36} {r['reason'][:120]}")
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        return ""


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="op,aten", help="granularities (default op,aten)")
    p.add_argument("--stride", type=int, default=1, help="every k-th OpInfo entry (default 1)")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all)")
    p.add_argument("--out", default="results", help="folder of bench_opinfo.json")
    p.add_argument("--quick", action="store_true", help="--stride 10")
    p.add_argument("--verbose", action="store_true", help="one line per operator")
    args = p.parse_args(argv)
    stride = 10 if args.quick else args.stride
    names = set(args.ops.split(",")) if args.ops else None
    torch.set_num_threads(1)
    results = {}
    for level in args.levels.split(","):
        rows = sweep(level, stride, args.offset, names, args.verbose)
        results[level] = {"summary": summary(rows), "rows": rows}
        print(table(rows, level))
        print()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": platform.platform(), "python": platform.python_version(),
           "torch": torch.__version__, "fxstab": fxstab.__version__, "commit": _commit(),
           "settings": {"stride": stride, "offset": args.offset, "ops": sorted(names or [])},
           "levels": results}
    (out / "bench_opinfo.json").write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {out / 'bench_opinfo.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
