"""fxstab's analysed call against another revision of fxstab, in one process.

On a shared machine absolute times drift by 2x within minutes, so a 5% change cannot be seen
by running the benchmark before and after it. This script loads ``fxstab/`` at a git revision
(or from a directory holding an ``fxstab`` package) side by side with the checkout's, as the
package ``fxstab_ref`` (its own modules, its own compiled kernels), compiles the same model
with both backends and times them call by call in turn (``timed_interleaved``: each timed
call follows an untimed call of the same function).

    python benchmarks/bench_ab.py --ref HEAD~3 --granularity aten --models lnsoftmax
    python benchmarks/bench_ab.py --ref /path/to/other/checkout --models mlp --samples 3

Prints one row per model (reference ms, checkout ms, checkout / reference) and saves JSON
under ``results/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_overhead import MODELS, make, timed_interleaved  # noqa: E402

REF_PACKAGE = "fxstab_ref"


def extract_ref(ref: str, into: Path) -> Path:
    """``fxstab/`` of ``ref`` (a git revision of this checkout, or a directory that holds an
    ``fxstab`` package) copied to ``into/fxstab_ref``; returns that directory."""
    dest = into / REF_PACKAGE
    path = Path(ref)
    if path.is_dir():
        src = path / "fxstab" if (path / "fxstab" / "__init__.py").exists() else path
        if not (src / "__init__.py").exists():
            raise SystemExit(f"bench_ab: {ref} holds no fxstab package")
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
        return dest
    try:
        proc = subprocess.run(["git", "archive", "--format=tar", ref, "fxstab"], cwd=ROOT,
                              capture_output=True)
    except OSError as exc:  # no git
        raise SystemExit(f"bench_ab: cannot read fxstab/ at {ref!r}: {exc}") from exc
    if proc.returncode != 0:
        raise SystemExit(f"bench_ab: cannot read fxstab/ at {ref!r}: "
                         f"{proc.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        tar.extractall(into, filter="data") if hasattr(tarfile, "data_filter") else \
            tar.extractall(into)
    (into / "fxstab").rename(dest)
    return dest


def load_ref(package_dir: Path):
    """Import ``package_dir`` as the package ``fxstab_ref`` (fxstab imports itself relatively,
    so the copy is self-contained: its own modules, and its kernels built from its own
    source)."""
    for name in [m for m in sys.modules if m == REF_PACKAGE or m.startswith(REF_PACKAGE + ".")]:
        del sys.modules[name]  # an earlier reference's modules must not answer for this one
    spec = importlib.util.spec_from_file_location(
        REF_PACKAGE, package_dir / "__init__.py", submodule_search_locations=[str(package_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[REF_PACKAGE] = module
    spec.loader.exec_module(module)
    return module


def submodule(pkg, *paths: str):
    """The first of ``paths`` (``"cpu.bindings"``, ``"native"``) that ``pkg`` has: a module
    found under its name in either layout (the revisions before the layout of issue 29 were
    flat: ``fxstab.native``, ``fxstab.formats``)."""
    for path in paths:
        try:
            return importlib.import_module(f"{pkg.__name__}.{path}")
        except ModuleNotFoundError:
            continue
    raise SystemExit(f"bench_ab: {pkg.__name__} has none of the modules {', '.join(paths)}")


def compiled_pair(ref, new, model, x: tuple, opts: dict) -> tuple:
    """Two fresh compilations of ``model``, one per fxstab package (``ref``, ``new``), as two
    callables doing one analysed call each and dropping its reports (every call the same
    work); and their backends."""
    torch._dynamo.reset()
    be_ref, be_new = ref.backend(**opts), new.backend(**opts)
    f_ref = torch.compile(model, backend=be_ref)
    f_new = torch.compile(model, backend=be_new)

    def call(f, be):
        f(*x)
        be.reports.clear()

    return (lambda: call(f_ref, be_ref)), (lambda: call(f_new, be_new)), be_ref, be_new


def main(argv=None) -> int:
    import fxstab
    from benchmarks.common import save_json

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", required=True,
                    help="git revision of this checkout, or a directory holding fxstab/")
    ap.add_argument("--models", default="lnsoftmax", help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--granularity", default="aten", choices=["op", "aten"])
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--diagnostics", default="summary", choices=["off", "summary", "detailed"])
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--quick", action="store_true", help="small models (a smoke test)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the process's CPU time, not the wall clock (a machine shared "
                         "with other jobs; with --threads 1 the two agree on an idle machine)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")

    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ref = load_ref(extract_ref(args.ref, Path(tmp)))
        opts = dict(granularity=args.granularity, n_samples=args.samples,
                    diagnostics=args.diagnostics)
        for name in args.models.split(","):
            model, x = make(name, args.quick)
            with torch.no_grad():
                call_ref, call_new, be_ref, be_new = compiled_pair(ref, fxstab, model, x, opts)
                t_ref, t_new = timed_interleaved([call_ref, call_new], args.repeats, clock)
                for be in (be_ref, be_new):
                    if any(info.failures for info in be.infos):
                        raise RuntimeError(f"{name}: the stochastic path failed: "
                                           f"{[info.failures for info in be.infos]}")
            rows.append({"model": name, "ref_ms": t_ref * 1e3, "new_ms": t_new * 1e3,
                         "new_over_ref": t_new / t_ref})
            r = rows[-1]
            print(f"{name:<12} {args.ref}: {r['ref_ms']:8.3f} ms   checkout: {r['new_ms']:8.3f} ms"
                  f"   checkout/ref {r['new_over_ref']:.3f}", flush=True)
    path = save_json(Path(args.out) / f"bench_ab_{args.granularity}.json",
                     {"benchmark": "bench_ab", "ref": args.ref, "granularity": args.granularity,
                      "n_samples": args.samples, "diagnostics": args.diagnostics,
                      "repeats": args.repeats, "rows": rows})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
