"""The ``fxstab`` command line: demo, formats, record, plan, diff, show.

Exit codes: 0 success; 1 ``diff``'s gate failed (an operator or module lost more than
``--max-drop`` digits, a new NaN/inf origin, an operator no longer analysed); 2 unusable input
(missing or corrupt digit map, schema mismatch, a map with no analysed operator, bad target,
bad arguments, a target whose model fails).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Optional, Sequence

EXIT_OK, EXIT_DROP, EXIT_USAGE = 0, 1, 2


class CLIError(Exception):
    """An unusable input: printed as one line ``fxstab <cmd>: error: ...``, exit code 2."""


def _cmd_formats(args: argparse.Namespace) -> int:
    from .numerics.formats import FORMATS, working_dtype_for

    print(f"{'format':<10} {'e':>2} {'m':>2} {'p':>2} {'u':>10} {'max':>11} {'min normal':>11} "
          f"{'min subnorm':>11} {'digits':>6} {'work':>8}")
    for f in FORMATS.values():
        print(f"{f.name:<10} {f.exp_bits:>2} {f.man_bits:>2} {f.precision:>2} {f.unit_roundoff:>10.3e} "
              f"{f.max_normal:>11.4e} {f.min_normal:>11.4e} {f.min_subnormal:>11.4e} "
              f"{f.digit_cap:>6.2f} {str(working_dtype_for(f)).replace('torch.', ''):>8}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(seed=args.seed, format=_format_arg(args.format), output=args.output)


def _format_arg(text: str) -> Any:
    """A --format value: a format name, or ``E,M`` (exponent and significand bits)."""
    from .numerics.formats import get_format

    if text.strip().lower() == "auto":  # each operator in its dtype in the program
        return "auto"
    parts = text.replace(" ", "").split(",")
    fmt: Any = text
    if len(parts) == 2 and all(p.isdigit() for p in parts):
        fmt = (int(parts[0]), int(parts[1]))
    try:
        get_format(fmt)
    except ValueError as e:
        raise CLIError(str(e)) from None
    return fmt


# --------------------------------------------------------------------------- record
def load_target(spec: str) -> tuple[Any, tuple]:
    """Import ``path/to/file.py:function``, call it with no arguments, check what it returns.

    The contract: the function takes no arguments and returns ``(model, example_inputs)``;
    ``model`` is a ``torch.nn.Module`` (or any callable torch.compile accepts) and
    ``example_inputs`` a tuple (or list) of positional arguments; a single tensor is accepted as
    a one-element tuple. The file's folder and the current directory are put in front of
    ``sys.path`` so the file can import its own project.

    Raises:
        CLIError: malformed spec, missing file or function, or a return value that does not
            follow the contract. Exceptions raised by the target's own code propagate.
    """
    import torch

    path_s, sep, func = spec.rpartition(":")
    if not sep or not path_s or not func:
        raise CLIError(f"TARGET must be 'path/to/file.py:function', got {spec!r}")
    if not func.isidentifier():
        raise CLIError(f"TARGET function {func!r} is not a Python identifier (in {spec!r})")
    path = Path(path_s)
    if path.suffix != ".py":
        raise CLIError(f"TARGET file must be a .py file, got {path_s!r}")
    if not path.is_file():
        raise CLIError(f"TARGET file {path_s!r} does not exist")
    path = path.resolve()
    for p in (os.getcwd(), str(path.parent)):
        if p not in sys.path:
            sys.path.insert(0, p)
    mod_name = f"_fxstab_target_{path.stem}"
    mod_spec = importlib.util.spec_from_file_location(mod_name, path)
    if mod_spec is None or mod_spec.loader is None:  # pragma: no cover - .py files always load
        raise CLIError(f"cannot import {str(path)!r}")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look modules up by name
    mod_spec.loader.exec_module(module)
    fn = getattr(module, func, None)
    if fn is None or not callable(fn):
        raise CLIError(f"{path_s!r} has no function {func!r}")
    result = fn()
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise CLIError(f"{spec} must return (model, example_inputs), got "
                       f"{type(result).__name__}")
    model, inputs = result
    if not callable(model):
        raise CLIError(f"{spec} returned a model that is not callable: {type(model).__name__}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise CLIError(f"{spec} must return example_inputs as a tuple, got "
                       f"{type(inputs).__name__}")
    return model, tuple(inputs)


def _accumulate_arg(preset: str, rounding: Optional[str]):
    """``--accumulate PRESET [--accumulate-rounding MODE]`` as an accumulate= value."""
    import dataclasses

    from .numerics.accumulation import Accumulation

    acc = Accumulation.parse(preset)
    if rounding is None:
        return acc if acc is not None else "fp32"
    if acc is None:
        raise CLIError("--accumulate-rounding needs an emulated accumulator (fp16, bf16, "
                       "fp8-fast, fp8-promoted): fp32 is the trusted product")
    return dataclasses.replace(acc, rounding=rounding, name="")


def _gemm_options(args: argparse.Namespace) -> dict:
    """``--accumulate``, ``--accumulate-rounding``, ``--gemm-inputs``, ``--gemm-scaling`` as
    backend options."""
    extra: dict = {}
    if args.accumulate is not None:
        extra["accumulate"] = _accumulate_arg(args.accumulate, args.accumulate_rounding)
    elif args.accumulate_rounding is not None:
        raise CLIError("--accumulate-rounding needs --accumulate (the accumulator it rounds)")
    if args.gemm_inputs is not None:
        extra.update(gemm_inputs=_format_arg(args.gemm_inputs), gemm_scaling=args.gemm_scaling)
    elif args.gemm_scaling != "tensor":
        raise CLIError("--gemm-scaling needs --gemm-inputs (the format it scales into)")
    return extra


def _cmd_record(args: argparse.Namespace) -> int:
    import torch

    import fxstab

    from .digitmap import DigitMap

    if args.calls < 1:
        raise CLIError(f"--calls must be >= 1, got {args.calls}")
    if not hasattr(fxstab, "backend"):
        raise CLIError("this fxstab build has no operator-level backend (fxstab.backend)")
    torch.manual_seed(args.seed)  # the target's parameters and inputs are part of the result
    model, inputs = load_target(args.target)
    fmt = _format_arg(args.format)
    extra = _gemm_options(args)
    try:
        be = fxstab.backend(granularity=args.granularity, format=fmt,
                            n_samples=args.n_samples, seed=args.seed, rounding=args.rounding,
                            confidence=args.confidence, **extra)
    except ValueError as e:
        raise CLIError(str(e)) from None
    torch._dynamo.reset()  # a fresh compile: names and graph order do not depend on history
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        for step in range(args.calls):
            with be.phase(args.phase, step=step):
                compiled(*inputs)
    meta = {"target": args.target, "format": "auto" if fmt == "auto" else
            fxstab.get_format(fmt).name,
            "n_samples": args.n_samples,
            "seed": args.seed, "granularity": args.granularity,
            "confidence": args.confidence, "rounding": args.rounding}
    if hasattr(be, "digit_map"):
        dm = be.digit_map()
        dm.metadata.update(meta)
    else:  # pragma: no cover - the backend offers digit_map(); reports are the fallback
        dm = DigitMap.from_reports(be.reports, metadata=meta)
    if not len(dm):
        raise CLIError(f"no operator of {args.target} was analysed (nothing compiled to a graph, "
                       f"or none of its operators is floating or selected): no digit map "
                       f"written to {args.output}")
    dm.save(args.output)
    _warn_coverage(dm.metadata.get("coverage"))
    for line in dm.findings():
        print(f"- {line}")
    print(dm.table(top=args.top))
    print(f"saved {len(dm)} operators to {args.output}")
    return EXIT_OK


# --------------------------------------------------------------------------- plan
def _cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from .plan import check_plan, plan_precision

    torch.manual_seed(args.seed)  # the target's parameters and inputs are part of the result
    model, inputs = load_target(args.target)
    fmt, higher = _format_arg(args.format), _format_arg(args.higher)
    if fmt == "auto" or higher == "auto":
        raise CLIError("plan needs one --format and one --higher (not auto)")
    extra = _gemm_options(args)
    try:
        plan = plan_precision(model, inputs, format=fmt, keep=args.keep, higher=higher,
                              outputs=args.outputs, budget=args.budget,
                              n_samples=args.n_samples, seed=args.seed, **extra)
    except ValueError as e:
        raise CLIError(str(e)) from None
    plan.settings["target"] = args.target
    print(plan.report())
    if args.output:
        plan.save(args.output)
        print(f"saved the plan ({len(plan.promoted)} operators) to {args.output}")
    if args.apply_check:
        try:
            print(check_plan(model, inputs, plan).report(plan))
        except ValueError as e:
            raise CLIError(str(e)) from None
    return EXIT_OK


def _warn_coverage(cov: Any) -> None:
    """Warn (stderr) when less than 90% of the model's floating operators were analysed,
    saying which were not and why (fxstab.records.coverage)."""
    from .records.coverage import WARN_BELOW, coverage_lines

    if not isinstance(cov, dict) or cov.get("fraction") is None:
        return
    if cov["fraction"] < WARN_BELOW:
        n = round(cov["fraction"] * cov["counted"])
        print(f"fxstab record: warning: only {n} of the model's {cov['counted']} floating "
              f"operators ({100 * cov['fraction']:.0f}%) were analysed; the others are not in "
              f"the map:", file=sys.stderr)
        for line in coverage_lines(cov)[1:]:
            print(line, file=sys.stderr)


# --------------------------------------------------------------------------- diff / show
def _load(path: str):
    from .digitmap import DigitMap, DigitMapError

    try:
        return DigitMap.load(path)
    except DigitMapError as e:
        raise CLIError(str(e)) from None


def _cmd_diff(args: argparse.Namespace) -> int:
    from .digitmap import DigitMapError, diff

    if args.max_drop < 0:
        raise CLIError(f"--max-drop must be >= 0, got {args.max_drop}")
    _check_page_path(args.html)
    base, head = _load(args.base), _load(args.head)
    try:
        result = diff(base, head, max_drop=args.max_drop, metric=args.metric)
    except DigitMapError as e:
        raise CLIError(str(e)) from None
    render = {"text": result.to_text, "markdown": result.to_markdown, "json": result.to_json}
    for fmt in render:  # extra renderings to files: one process (one torch import) in CI
        dest = getattr(args, f"{fmt}_out")
        if dest:
            text = render[fmt]()
            _write_text(dest, text if text.endswith("\n") else text + "\n")
    if args.html:  # the page is one more rendering: stdout and the exit code stay the same
        _write_page(args.html, lambda html: html.diff_page(base, head, result))
    text = render[args.format]()
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
    return EXIT_DROP if result.failed else EXIT_OK


def _check_page_path(path: Optional[str]) -> None:
    """--html must name an .html file (checked before any work or output)."""
    if path and Path(path).suffix.lower() not in (".html", ".htm"):
        raise CLIError(f"--html: the page's file must end in .html, got {path!r}")


def _write_page(path: str, build) -> None:
    """Write the HTML page ``build(fxstab.plots.html)`` makes to ``path`` (.html), or fail with
    exit code 2."""
    from .plots import html

    _check_page_path(path)
    try:
        html.write_page(build(html), path)
    except OSError as e:
        raise CLIError(f"cannot write {path!r}: {e.strerror or e}") from None


def _write_text(path: str, text: str) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise CLIError(f"cannot write {path!r}: {e.strerror or e}") from None


def _cmd_show(args: argparse.Namespace) -> int:
    from . import plots
    from .records.coverage import coverage_lines

    dm = _load(args.digits)
    if args.top < 1:
        raise CLIError(f"--top must be >= 1, got {args.top}")
    _check_page_path(args.html)
    meta = dm.metadata
    extras = ", ".join(f"{k}={meta[k]}" for k in ("target", "seed", "granularity", "rounding",
                                                  "git_commit") if meta.get(k) is not None)
    findings = dm.findings(metric=args.metric)
    print("findings:" if findings else "findings: none (no NaN/inf origin, no operator losing "
          "a quarter of the cap or more)")
    for line in findings:
        print(f"  - {line}")
    print()
    print(dm.table(top=args.top, metric=args.metric))
    if extras:
        print(f"({extras})")
    print()
    print(dm.localize_table(top=args.top, metric=args.metric))
    cov = coverage_lines(meta.get("coverage"), limit=args.top)
    if cov:
        print()
        print("\n".join(cov))
    for flag, fn, kw in (("plot", plots.plot_digits, {"top": args.top, "metric": args.metric}),
                         ("graph", plots.plot_graph, {"metric": args.metric}),
                         ("series", plots.plot_series, {"top": min(args.top, 8),
                                                        "metric": args.metric})):
        out = getattr(args, flag)
        if out:
            try:
                fn(dm, out, **kw)
            except ValueError as e:
                raise CLIError(f"--{flag}: {e}") from None
            except ImportError as e:
                raise CLIError(f"--{flag} needs matplotlib ({e}): pip install 'fxstab[plot]'"
                               ) from None
            print(f"wrote {out}")
    if args.html:
        try:
            _write_page(args.html, lambda html: html.map_page(dm, metric=args.metric))
        except ValueError as e:
            raise CLIError(f"--html: {e}") from None
        print(f"wrote {args.html}")
    if args.tensorboard:
        try:
            n = dm.to_tensorboard(args.tensorboard)
            print(f"wrote {n} TensorBoard scalars to {args.tensorboard}")
        except ModuleNotFoundError as e:
            print(f"fxstab show: skipped --tensorboard: {e}", file=sys.stderr)
    return EXIT_OK


# --------------------------------------------------------------------------- parser
_TARGET_CONTRACT = """\
TARGET contract: TARGET is 'path/to/file.py:function'. fxstab imports the file (its folder and
the current directory go first on sys.path), calls function() with no arguments and expects
(model, example_inputs): a torch.nn.Module (or callable) and a tuple of positional inputs.
torch.manual_seed(SEED) is set before the call, so a target that builds its model and inputs
with torch's default generator is deterministic. """
_RECORD_EPILOG = _TARGET_CONTRACT + """record compiles the model with the fxstab
backend, runs it --calls times under torch.no_grad() (step 0, 1, ... of --phase), and saves
the digit map as JSON. The same target, options and seed give the same digit map.
"""
_PLAN_EPILOG = _TARGET_CONTRACT + """plan analyses the model under torch.no_grad() once per
candidate plan (plan.runs counts them) and prints the plan; --apply-check then runs it for
real. The same target, options and seed give the same plan.
"""


def _add_gemm_options(p: argparse.ArgumentParser) -> None:
    """The GEMM recipe's options of record and plan (read by :func:`_gemm_options`)."""
    p.add_argument("--accumulate", default=None, metavar="PRESET",
                   help="model the GEMMs' accumulator: fp32 (trusted, the default), fp16, bf16, "
                        "fp8-fast, fp8-promoted (docs/accumulation.md)")
    p.add_argument("--accumulate-rounding", default=None, metavar="MODE",
                   help="the accumulator's rounding instead of the preset's: random (CESTAC "
                        "inside the product: what the digits can show), nearest, zero, ...")
    p.add_argument("--gemm-inputs", default=None, metavar="FORMAT",
                   help="round the GEMMs' operands into FORMAT (fp8_e4m3, fp8_e5m2...) as an "
                        "fp8 recipe does, the rest of the program in --format")
    p.add_argument("--gemm-scaling", default="tensor",
                   choices=("tensor", "row", "block128", "mx32"),
                   help="how --gemm-inputs scales the operands (default tensor)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxstab",
        description="Find where a PyTorch program loses significant digits in low precision.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="analyse a built-in model and print its digit map")
    p.add_argument("--seed", type=int, default=0, help="seed of the random rounding (default 0)")
    p.add_argument("--format", default="fp16",
                   help="simulated format: a name or E,M bit counts (default fp16)")
    p.add_argument("-o", "--output", metavar="FILE", help="also save the digit map (JSON)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("formats", help="print the table of named formats")
    p.set_defaults(func=_cmd_formats)

    p = sub.add_parser(
        "plan", help="find the fewest operators to keep in a higher format",
        description="Search the fewest operators of a TARGET to run in --higher so that its "
                    "outputs keep --keep avg digits in the analysis (docs/precision-plan.md).",
        epilog=_PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="TARGET", help="path/to/file.py:function")
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan (JSON)")
    p.add_argument("--format", default="bf16", help="the low-precision format (default bf16)")
    p.add_argument("--higher", default="fp32",
                   help="the format promoted operators run in (default fp32)")
    p.add_argument("--keep", type=float, default=2.0,
                   help="avg digits the outputs must keep in the analysis (default 2.0)")
    p.add_argument("--outputs", nargs="+", metavar="OPERATOR", default=None,
                   help="check these operators' digits instead of the model's outputs")
    p.add_argument("--budget", type=int, default=None,
                   help="at most this many analysed calls (default: no cap)")
    p.add_argument("--n-samples", type=int, default=3, help="stochastic samples N (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of rounding and model (default 0)")
    _add_gemm_options(p)
    p.add_argument("--apply-check", action="store_true",
                   help="run the target for real in --format with and without the plan and "
                        "print the true digits of both against an fp64 run")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser(
        "record", help="analyse a model given by a TARGET file and save its digit map",
        description="Compile a model with the fxstab backend, run it and save its digit map.",
        epilog=_RECORD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="TARGET", help="path/to/file.py:function")
    p.add_argument("-o", "--output", required=True, help="digit map to write (JSON)")
    p.add_argument("--granularity", default="op", choices=("op", "aten"),
                   help="operator level or aten arithmetic level (default op)")
    p.add_argument("--format", default="bf16",
                   help="simulated format: bf16, fp16, fp8_e4m3, tf32, ..., E,M bit counts "
                        "such as 5,2, or auto (each operator in its dtype in the program; "
                        "operator level) (default bf16)")
    p.add_argument("--n-samples", type=int, default=3, help="stochastic samples N (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of rounding and model (default 0)")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence of the digit estimate (default 0.95)")
    p.add_argument("--rounding", default="random",
                   help="rounding mode: random, stochastic, nearest, ... (default random)")
    _add_gemm_options(p)
    p.add_argument("--calls", type=int, default=1,
                   help="number of analysed calls, recorded as steps 0..calls-1 (default 1)")
    p.add_argument("--phase", default="eval", help="phase label of the calls (default eval)")
    p.add_argument("--top", type=int, default=10, help="operators printed (default 10)")
    p.add_argument("--verbose", action="store_true",
                   help="print the whole traceback when the target's model fails")
    p.set_defaults(func=_cmd_record)

    p = sub.add_parser(
        "diff", help="compare two digit maps; exit 1 when an operator lost digits",
        description="Match operators by name (and modules by path) and report drops, gains, "
                    "added and removed operators. Exit 0: the gate passes; 1: an operator or a "
                    "module lost more than --max-drop digits, NaN/inf appear at a new origin, or "
                    "an operator is no longer analysed while its module is still there; 2: "
                    "unusable input (missing or corrupt file, schema mismatch, a map with no "
                    "analysed operator).")
    p.add_argument("base", metavar="BASE", help="reference digit map (e.g. main)")
    p.add_argument("head", metavar="HEAD", help="digit map under test (e.g. the branch)")
    p.add_argument("--max-drop", type=float, default=0.5,
                   help="digits an operator may lose before the diff fails (default 0.5)")
    p.add_argument("--metric", choices=_metrics(), default=None,
                   help=f"per-operator digits compared (default {_default_metric()})")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                   help="output format (markdown suits a pull-request comment)")
    for fmt in ("text", "markdown", "json"):
        p.add_argument(f"--{fmt}-out", metavar="FILE",
                       help=f"also write the {fmt} rendering to FILE")
    p.add_argument("--html", metavar="OUT",
                   help="also write the diff as a self-contained page (OUT.html: the verdict, "
                        "the graph coloured by the change; opens offline)")
    p.set_defaults(func=_cmd_diff)

    p = sub.add_parser(
        "show", help="print the worst operators and where digits are lost; draw pictures",
        description="Print the findings (where NaN/inf first appear, where digits are lost, with "
                    "a hint each), the worst operators and the localization ranking (local loss "
                    "= least accurate input's digits - own digits); optionally draw a bar chart, "
                    "the operator graph and digits over steps.")
    p.add_argument("digits", metavar="DIGITS", help="digit map (JSON)")
    p.add_argument("--top", type=int, default=15, help="operators listed (default 15)")
    p.add_argument("--metric", choices=_metrics(), default=None,
                   help=f"digits the tables, ranking and pictures use (default "
                        f"{_default_metric()})")
    p.add_argument("--plot", metavar="OUT", help="bar chart of digits per operator (.png/.svg)")
    p.add_argument("--graph", metavar="OUT", help="operator graph coloured by digits (.svg/.png)")
    p.add_argument("--series", metavar="OUT", help="digits over steps, worst operators (.png)")
    p.add_argument("--html", metavar="OUT",
                   help="a self-contained page (OUT.html): findings, the interactive graph, "
                        "the table, coverage, digits over steps; opens offline")
    p.add_argument("--tensorboard", metavar="LOGDIR",
                   help="also write TensorBoard scalars (needs the tensorboard package)")
    p.set_defaults(func=_cmd_show)
    return parser


def _metrics() -> tuple:
    from .digitmap import METRICS

    return METRICS


def _default_metric() -> str:
    from .digitmap import DEFAULT_METRIC

    return DEFAULT_METRIC


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a chain (dynamo wraps the model's own error)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        nxt = exc.__cause__ or exc.__context__  # dynamo re-raises the model's error
        if nxt is None:
            break
        exc = nxt
    return exc


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as e:
        print(f"fxstab {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # the reader (`| head`) went away: no traceback; stdout is closed quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_OK
    except Exception as e:
        if args.command != "record":
            raise
        # the target's own code failed: the cause in one line, the trace with --verbose
        if getattr(args, "verbose", False):
            traceback.print_exc()
        cause = _root_cause(e)
        first = (str(cause).strip().splitlines() or [""])[0]
        where = ""
        tb = traceback.extract_tb(cause.__traceback__) if cause.__traceback__ else []
        user = [f for f in tb if "site-packages" not in f.filename and "/torch/" not in f.filename
                and "/fxstab/" not in f.filename]
        if user:
            where = f" (at {user[-1].filename}:{user[-1].lineno})"
        print(f"fxstab record: error: the model failed: {type(cause).__name__}: {first}{where}"
              + ("" if getattr(args, "verbose", False) else "; --verbose prints the traceback"),
              file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
