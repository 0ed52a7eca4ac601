"""The ``fxstab`` command line: demo, formats, record, plan, diff, show (and ci, history, fix).

Exit codes: 0 success; 1 ``diff``'s gate failed (an operator or module lost more than
``--max-drop`` digits, a new NaN/inf origin, an operator no longer analysed), ``plan``'s plan
does not meet ``--keep`` or ``fix`` leaves findings without a verified fix; 2 unusable input
(missing or corrupt digit map, schema mismatch, a map with no analysed operator, bad target,
bad arguments, a target whose model fails).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Optional, Sequence

from .targets import TargetBuildError, failure_line, quiet_torch_logs

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
def load_target(spec: str, kwargs: Optional[dict] = None, root: Optional[Path] = None) -> Any:
    """:func:`fxstab.targets.load_target`, its errors as exit code 2."""
    from .targets import TargetError
    from .targets import load_target as load

    try:
        return load(spec, kwargs, root)
    except TargetError as e:
        raise CLIError(str(e)) from None
    except Exception as e:  # the build function's own code (or its module's) raised
        raise TargetBuildError(spec) from e


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


def _gemm_options(opts: dict) -> dict:
    """The GEMM recipe (``accumulate``, ``accumulate_rounding``, ``gemm_inputs``,
    ``gemm_scaling``: flags over the settings file) as backend options."""
    extra: dict = {}
    if opts.get("accumulate") is not None:
        extra["accumulate"] = _accumulate_arg(opts["accumulate"], opts.get("accumulate_rounding"))
    elif opts.get("accumulate_rounding") is not None:
        raise CLIError("--accumulate-rounding needs --accumulate (the accumulator it rounds)")
    if opts.get("gemm_inputs") is not None:
        gi = opts["gemm_inputs"]
        extra.update(gemm_inputs=_format_arg(gi) if isinstance(gi, str) else gi,
                     gemm_scaling=opts.get("gemm_scaling") or "tensor")
    elif (opts.get("gemm_scaling") or "tensor") != "tensor":
        raise CLIError("--gemm-scaling needs --gemm-inputs (the format it scales into)")
    return extra


_GEMM_KEYS = ("accumulate", "accumulate_rounding", "gemm_inputs", "gemm_scaling")
# what record and plan use when neither a flag nor the settings file says
_DEFAULTS = {"granularity": "op", "format": "bf16", "n_samples": 3, "seed": 0,
             "rounding": "random", "confidence": 0.95}


def _settings(args: argparse.Namespace) -> Any:
    """The settings file (``--config FILE``, else the nearest fxstab.toml / pyproject.toml with
    [tool.fxstab]); a bad file is exit 2 with the file, key and value named."""
    import warnings

    from .configfile import ConfigError, ConfigWarning, load

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConfigWarning)
            cfg = load(getattr(args, "config", None))
    except ConfigError as e:
        raise CLIError(str(e)) from None
    for w in caught:  # one line each, as the CLI's errors (a broken pyproject.toml passed by)
        if issubclass(w.category, ConfigWarning):
            print(f"fxstab {args.command}: warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return cfg


def _analysis_options(args: argparse.Namespace, cfg: Any, target: Any = None,
                      keys: Sequence[str] = tuple(_DEFAULTS)) -> dict:
    """The analysis options of one run: the defaults, then the settings file, then the
    configured target's own, then the command-line flags (those given)."""
    opts = {k: _DEFAULTS[k] for k in keys if k in _DEFAULTS}
    opts.update(cfg.analysis)
    if target is not None:
        opts.update(target.options)
    for key in (*keys, *_GEMM_KEYS):
        flag = getattr(args, key, None)
        if flag is not None:
            if key == "accumulate":  # a flag's preset replaces the file's accumulator whole
                opts.pop("accumulate_rounding", None)
            opts[key] = flag
    if isinstance(opts.get("format"), str):
        opts["format"] = _format_arg(opts["format"])
    if isinstance(opts.get("format"), list):
        opts["format"] = tuple(opts["format"])
    return opts


def _check_options(opts: dict) -> tuple[dict, dict, Any]:
    """Split ``opts`` into (backend options, GEMM recipe, the backend) and validate them all by
    building the backend, before any model is built: a bad --format, --rounding or --n-samples costs
    nothing."""
    import fxstab

    extra = _gemm_options(opts)
    plain = {k: v for k, v in opts.items() if k not in _GEMM_KEYS}
    if not hasattr(fxstab, "backend"):
        raise CLIError("this fxstab build has no operator-level backend (fxstab.backend)")
    try:
        be = fxstab.backend(**plain, **extra)
    except (ValueError, TypeError) as e:
        raise CLIError(str(e)) from None
    return plain, extra, be


def _cmd_record(args: argparse.Namespace) -> int:
    cfg = _settings(args)
    if args.calls is not None and args.calls < 1:
        raise CLIError(f"--calls must be >= 1, got {args.calls}")
    if args.top < 1:
        raise CLIError(f"--top must be >= 1, got {args.top}")
    jobs = []  # (spec, configured target or None, output)
    if args.target is not None and ":" not in args.target and not cfg.targets:
        raise CLIError(f"TARGET must be 'path/to/file.py:function' or "
                       f"'package.module:function' (or a target of the settings file: there "
                       f"is none), got {args.target!r}")
    if args.target is None or ":" not in args.target:  # the settings file's targets
        from .configfile import ConfigError

        try:
            chosen = (list(cfg.targets.values()) if args.target is None
                      else [cfg.target(args.target)])
        except ConfigError as e:
            raise CLIError(f"{e} (a TARGET function is 'path/to/file.py:function' or "
                           f"'package.module:function')") from None
        if not chosen:
            where = cfg.path or "no fxstab.toml or [tool.fxstab] found from here"
            raise CLIError(f"no TARGET given and no [targets] configured ({where}): give "
                           f"'path/to/file.py:function' or 'package.module:function'")
        if args.output and len(chosen) > 1:
            raise CLIError(f"-o names one file but {len(chosen)} targets are configured "
                           f"({', '.join(t.name for t in chosen)}): use --output-dir DIR")
        for t in chosen:
            out = args.output or (str(Path(args.output_dir) / f"{t.name}.json")
                                  if args.output_dir else t.output)
            if cfg.path is not None and not args.output and not args.output_dir \
                    and not Path(out).is_absolute():
                out = str(cfg.path.parent / out)  # relative to the settings file
            jobs.append((t.target, t, out))
    else:
        if not args.output:
            out = (str(Path(args.output_dir) / "digits.json") if args.output_dir else None)
            if out is None:
                raise CLIError("-o/--output FILE is required with a TARGET (the digit map to "
                               "write)")
        jobs.append((args.target, None, args.output or out))
    # every job's options are checked before the first model is built
    checked = [(spec, t, out, *_check_options(_analysis_options(args, cfg, t)))
               for spec, t, out in jobs]
    for spec, t, out, plain, extra, be in checked:
        calls = args.calls if args.calls is not None else (t.calls if t is not None else 1)
        _record_one(args, spec, t, out, plain, extra, be, calls)
    return EXIT_OK


def _record_one(args: argparse.Namespace, spec: str, t: Any, output: str, plain: dict,
                extra: dict, be: Any, calls: int) -> None:
    import torch

    import fxstab

    from .digitmap import DigitMap

    torch.manual_seed(plain["seed"])  # the target's parameters and inputs are part of the result
    # a configured target's file is relative to the settings file (as its output is)
    root = t.root if t is not None else None
    target = load_target(spec, t.kwargs if t is not None else None, root)
    torch._dynamo.reset()  # a fresh compile: names and graph order do not depend on history
    compiled = torch.compile(target.model, backend=be)
    with torch.no_grad():
        for step in range(calls):
            with be.phase(args.phase, step=step):
                target(compiled)
    fmt = plain["format"]
    meta = {"target": spec, "format": "auto" if fmt == "auto" else fxstab.get_format(fmt).name,
            "n_samples": plain["n_samples"], "seed": plain["seed"],
            "granularity": plain["granularity"], "confidence": plain["confidence"],
            "rounding": plain["rounding"]}
    if t is not None:
        meta["target_name"] = t.name
    if hasattr(be, "digit_map"):
        import warnings

        from .backend import CoverageWarning

        with warnings.catch_warnings():  # said below, as record's own warning (with the fix)
            warnings.simplefilter("ignore", CoverageWarning)
            dm = be.digit_map()
        dm.metadata.update(meta)
    else:  # pragma: no cover - the backend offers digit_map(); reports are the fallback
        dm = DigitMap.from_reports(be.reports, metadata=meta)
    if not len(dm):
        raise CLIError(f"no operator of {spec} was analysed (nothing compiled to a graph, "
                       f"or none of its operators is floating or selected): no digit map "
                       f"written to {output}")
    if getattr(args, "impact", False):  # each operator's cost to the outputs (fxstab.impact)
        from .impact import operator_impact

        torch.manual_seed(plain["seed"])
        target = load_target(spec, t.kwargs if t is not None else None, root)
        options = {**plain, **extra}
        imp = operator_impact(target.model, target.args, kwargs=target.kwargs,
                              method=args.impact_method, **options)
        imp.annotate(dm)
        print(imp.table(top=args.top))
    dm.save(output)
    _warn_coverage(dm.metadata.get("coverage"))
    for line in dm.findings():
        print(f"- {line}")
    print(dm.table(top=args.top))
    print(f"saved {len(dm)} operators to {output}")


# --------------------------------------------------------------------------- plan
def _cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from .plan.command import run as run_plan

    cfg = _settings(args)
    _check_page_path(args.html)
    if args.keep <= 0:
        raise CLIError(f"--keep must be > 0 digits, got {args.keep}")
    from .plan.search import parse_budget

    budget = args.budget
    if budget is not None:
        budget = int(budget) if budget.strip().isdigit() else budget
        try:
            parse_budget(budget)
        except ValueError:
            raise CLIError(f"--budget must be a number of analysed calls (>= 1) or of seconds "
                           f"('90s'), got {args.budget!r}") from None
    opts = _analysis_options(args, cfg, keys=("format", "n_samples", "seed"))
    if opts["format"] == "auto":
        raise CLIError("plan needs one --format and one --higher (not auto)")
    higher = _format_arg(args.higher)
    if higher == "auto":
        raise CLIError("plan needs one --format and one --higher (not auto)")
    plain, extra, _ = _check_options({k: v for k, v in opts.items()
                                      if k in ("format", "n_samples", "seed", *_GEMM_KEYS)})
    from .numerics.formats import get_format

    cap = get_format(plain["format"]).digit_cap
    if args.keep > cap:  # before the model is built
        raise CLIError(f"--keep {args.keep} is more than {get_format(plain['format']).name} "
                       f"holds ({cap:.2f} digits: the outputs are cast back to it); ask for "
                       f"at most that")
    torch.manual_seed(plain["seed"])  # the target's parameters and inputs are part of the result
    model, inputs = load_target(args.target)
    try:
        return run_plan(model, inputs, target=args.target, output=args.output,
                        apply_check=args.apply_check, frontier=args.frontier, html=args.html,
                        calibrate=args.calibrate,
                        format=plain["format"], keep=args.keep,
                        higher=higher, outputs=args.outputs, budget=budget,
                        criterion=args.criterion, n_samples=plain["n_samples"],
                        metric=args.metric, autocast=not args.no_autocast,
                        seed=plain["seed"], **extra)
    except ValueError as e:
        raise CLIError(str(e)) from None


def _warn_coverage(cov: Any) -> None:
    """Warn (stderr) when less than 90% of the model's floating operators were analysed,
    saying which were not, why (fxstab.records.coverage) and the fix (``select = "*"`` in
    the settings file analyses the kinds left "not selected": fxstab.backend.coverage_fix)."""
    from .backend import coverage_fix
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
        fix = coverage_fix(cov)
        if fix.startswith("select="):  # record's selection is the settings file's
            fix = fix.replace('select="*"', 'select = "*" (the settings file: [tool.fxstab] '
                                            'or fxstab.toml)', 1)
        print(f"  fix: {fix}", file=sys.stderr)


# --------------------------------------------------------------------------- diff / show
def _load(path: str):
    from .digitmap import DigitMap, DigitMapError

    try:
        return DigitMap.load(path)
    except DigitMapError as e:
        raise CLIError(str(e)) from None


def _cmd_diff(args: argparse.Namespace) -> int:
    from .digitmap import DigitMapError, diff

    gate = _settings(args).gate
    max_drop = args.max_drop if args.max_drop is not None else gate.get("max_drop", 0.5)
    metric = args.metric or gate.get("metric")
    if max_drop < 0:
        raise CLIError(f"--max-drop must be >= 0, got {max_drop}")
    _check_page_path(args.html)
    base, head = _load(args.base), _load(args.head)
    try:
        result = diff(base, head, max_drop=max_drop, metric=metric,
                      base_label=_label(base, args.base), head_label=_label(head, args.head),
                      strict=args.strict)
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


def _label(dm: Any, path: str) -> str:
    """A map's name in a diff: its file, and its commit when it has one."""
    commit = dm.metadata.get("git_commit")
    name = Path(path).name
    return f"{name} ({commit[:10]})" if isinstance(commit, str) and commit else name


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
    print(dm.summary(metric=args.metric))
    print()
    try:
        table = dm.table(top=args.top, metric=args.metric, sort=args.sort)
    except ValueError as e:
        raise CLIError(str(e)) from None
    print(table)
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
            _write_page(args.html, lambda html: html.map_page(
                dm, metric=args.metric, title=html.map_title(dm, args.digits)))
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


# --------------------------------------------------------------------------- ci / history
def _cmd_ci(args: argparse.Namespace) -> int:
    from . import ci

    try:
        return ci.command(args)
    except (ci.CIError, ValueError) as e:
        raise CLIError(str(e)) from None


def _cmd_history(args: argparse.Namespace) -> int:
    from .digitmap import DigitMapError
    from .history import collect, trend_lines

    if args.top < 1:
        raise CLIError(f"--top must be >= 1, got {args.top}")
    _check_page_path(args.html)
    try:
        points = collect(args.maps)
    except DigitMapError as e:
        raise CLIError(str(e)) from None
    print("\n".join(trend_lines(points, top=min(args.top, 3), metric=args.metric)))
    if args.html:
        _write_page(args.html, lambda html: html.history_page(points, top=args.top,
                                                              metric=args.metric))
        print(f"wrote {args.html}")
    return EXIT_OK


# --------------------------------------------------------------------------- parser
_TARGET_CONTRACT = """\
TARGET contract: TARGET is 'path/to/file.py:function' (fxstab imports the file; its folder and
the current directory go first on sys.path) or 'package.module:function' (an installed package,
or a module under the current directory). fxstab calls function() with no arguments (a target
of the settings file: with its kwargs) and expects (model, example_inputs): a torch.nn.Module
(or callable) and a tuple of positional inputs or a dict of keyword inputs, which must fit the
model's forward. torch.manual_seed(SEED) is set before the call, so a target that builds its
model and inputs with torch's default generator is deterministic. The options are checked
before the model is built; the settings file (--config, docs/config.md) gives defaults that
the flags override. """
_RECORD_EPILOG = _TARGET_CONTRACT + """record compiles the model with the fxstab
backend, runs it --calls times under torch.no_grad() (step 0, 1, ... of --phase), and saves
the digit map as JSON. The same target, options and seed give the same digit map.
"""
_PLAN_EPILOG = _TARGET_CONTRACT + """plan analyses the model under torch.no_grad() once per
candidate plan (plan.runs counts them, the final plan's re-checks with two further seeds
included; its progress is a line on stderr) and prints the plan, its digits the worst of the
checks (--metric) and its cost against everything in --higher; where it is not better than
torch.autocast's fp32 list at equal or lower cost, the plan is that list (the report says why);
--frontier adds digits against cost for the plans found on the way; --apply-check then runs it
for real. The same target, options and seed give the same plan.
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
    p.add_argument("--gemm-scaling", default=None,
                   choices=("tensor", "row", "block128", "mx32", "nvfp4"),  # numerics SCALINGS
                   help="how --gemm-inputs scales the operands (default tensor)")


def _add_config_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", default=None,
                   help="settings file (fxstab.toml, or pyproject.toml's [tool.fxstab]); "
                        "default: the nearest one from the current folder up; flags override "
                        "it (docs/config.md)")


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
        "plan", help="find a cheap set of operators to keep in a higher format",
        description="Search a cheap set of operators of a TARGET to run in --higher so that "
                    "its outputs keep --keep digits in the analysis (run digits by default: "
                    "what a real run is expected to keep; docs/precision-plan.md).",
        epilog=_PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="TARGET",
                   help="path/to/file.py:function or package.module:function")
    p.add_argument("-o", "--output", metavar="FILE", help="write the plan (JSON)")
    p.add_argument("--format", default=None,
                   help="the low-precision format (default: the settings file's, else bf16)")
    p.add_argument("--higher", default="fp32",
                   help="the format promoted operators run in (default fp32)")
    p.add_argument("--keep", type=float, default=2.0,
                   help="avg digits the outputs must keep, in --metric's digits (default 2.0)")
    p.add_argument("--metric", default="run", choices=("run", "avg"),
                   help="run: digits a real round-to-nearest run is expected to keep (default); "
                        "avg: CESTAC's, the bound the gate uses (~0.5 lower)")
    p.add_argument("--no-autocast", action="store_true",
                   help="leave out torch.autocast's fp32 list as a candidate plan")
    p.add_argument("--outputs", nargs="+", metavar="OPERATOR", default=None,
                   help="check these operators' digits instead of the model's outputs")
    p.add_argument("--budget", default=None,
                   help="at most this many analysed calls, or seconds with an s ('90s'); the "
                        "search uses what it allows (default: none, the search then keeps "
                        "within 4 + 2*log2(operators) calls, but trims a model of up to 16 "
                        "operators fully)")
    p.add_argument("--criterion", default="mean", choices=("mean", "p5", "min"),
                   help="what of the outputs' per-element digits must reach --keep: their "
                        "average, 5%% quantile or minimum (a NaN/inf in any output always "
                        "fails) (default mean)")
    p.add_argument("--n-samples", type=int, default=None,
                   help="stochastic samples N (default 3)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of rounding and model (default 0)")
    _add_gemm_options(p)
    _add_config_option(p)
    p.add_argument("--apply-check", action="store_true",
                   help="run the target for real in --format with and without the plan and "
                        "print the true digits of both against an fp64 run")
    p.add_argument("--calibrate", action="store_true",
                   help="--keep is in avg true digits of the real run (against fp64): the "
                        "search calibrates the analysis on real runs of the target")
    p.add_argument("--frontier", action="store_true",
                   help="print digits at the outputs against cost for the plans the search "
                        "evaluated that no cheaper plan beats")
    p.add_argument("--html", metavar="OUT",
                   help="a self-contained page (OUT.html): the verdict, digits against cost "
                        "(the frontier), the promoted operators, the real run's check")
    p.add_argument("--verbose", action="store_true",
                   help="print the whole traceback when the target's model fails")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser(
        "record", help="analyse a model given by a TARGET file and save its digit map",
        description="Compile a model with the fxstab backend, run it and save its digit map.",
        epilog=_RECORD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="TARGET", nargs="?", default=None,
                   help="path/to/file.py:function, package.module:function, or the name of a "
                        "target of the settings file; none: every configured target")
    p.add_argument("-o", "--output", default=None,
                   help="digit map to write (JSON); required with a TARGET function")
    p.add_argument("--output-dir", metavar="DIR", default=None,
                   help="write each configured target's map as DIR/NAME.json")
    p.add_argument("--impact", action="store_true",
                   help="also measure each operator's impact on the outputs (ablation: a few "
                        "analysed calls more) and rank the findings by it (operator level)")
    p.add_argument("--impact-method", choices=("ablation", "first_order"), default="ablation",
                   help="how --impact measures: ablation (analysed calls with operators left "
                        "unrounded; default) or first_order (one analysed call and fp64 "
                        "Jacobian products: for models where ablation's calls are too many)")
    p.add_argument("--granularity", default=None, choices=("op", "aten"),
                   help="operator level or aten arithmetic level (default op)")
    p.add_argument("--format", default=None,
                   help="simulated format: bf16, fp16, fp8_e4m3, tf32, ..., E,M bit counts "
                        "such as 5,2, or auto (each operator in its dtype in the program; "
                        "operator level) (default bf16)")
    p.add_argument("--n-samples", type=int, default=None,
                   help="stochastic samples N (default 3)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of rounding and model (default 0)")
    p.add_argument("--confidence", type=float, default=None,
                   help="confidence of the digit estimate (default 0.95)")
    p.add_argument("--rounding", default=None,
                   help="rounding mode: random, stochastic, nearest, ... (default random)")
    _add_gemm_options(p)
    _add_config_option(p)
    p.add_argument("--calls", type=int, default=None,
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
    p.add_argument("--max-drop", type=float, default=None,
                   help="digits an operator may lose before the diff fails (default: the "
                        "settings file's [gate] max_drop, else 0.5)")
    p.add_argument("--strict", action="store_true",
                   help="with impacts in the head map (record --impact), fail on an operator "
                        "that lost digits even where that costs the outputs nothing (default: "
                        "a warning)")
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
    _add_config_option(p)
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
    p.add_argument("--sort", choices=("digits", "impact"), default=None,
                   help="the table's order: fewest digits first, or largest impact on the "
                        "outputs first (a map recorded with --impact; its default)")
    p.add_argument("--plot", metavar="OUT", help="bar chart of digits per operator (.png/.svg)")
    p.add_argument("--graph", metavar="OUT", help="operator graph coloured by digits (.svg/.png)")
    p.add_argument("--series", metavar="OUT", help="digits over steps, worst operators (.png)")
    p.add_argument("--html", metavar="OUT",
                   help="a self-contained page (OUT.html): findings, the interactive graph, "
                        "the table, coverage, digits over steps; opens offline")
    p.add_argument("--tensorboard", metavar="LOGDIR",
                   help="also write TensorBoard scalars (needs the tensorboard package)")
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser(
        "history", help="digits across commits: a trend page of the outputs and worst operators",
        description="Read digit maps by commit (map files, a folder of maps, or a folder of "
                    "commit folders such as the CI history branch's maps/STAMP-SHA/) and print "
                    "and draw each target's outputs' and worst operators' digits across them.")
    p.add_argument("maps", metavar="MAP", nargs="+",
                   help="digit map files or folders, oldest first")
    p.add_argument("--html", metavar="OUT", help="write the trend page (OUT.html)")
    p.add_argument("--top", type=int, default=8,
                   help="worst operators drawn per target (default 8)")
    p.add_argument("--metric", choices=_metrics(), default=None,
                   help=f"digits drawn (default {_default_metric()})")
    p.set_defaults(func=_cmd_history)

    from . import ci

    p = ci.add_parser(sub, _add_config_option)
    p.set_defaults(func=_cmd_ci)
    from . import fix  # fxstab fix: its arguments and command in fix.py

    fix.add_parser(sub).set_defaults(func=fix.command)
    return parser


def _metrics() -> tuple:
    from .digitmap import METRICS

    return METRICS


def _default_metric() -> str:
    from .digitmap import DEFAULT_METRIC

    return DEFAULT_METRIC


# the commands that run the user's model: its failures are one line, the trace with --verbose
_RUNS_THE_MODEL = ("record", "plan", "fix")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    args = build_parser().parse_args(argv)
    verbose = getattr(args, "verbose", False)
    try:
        with quiet_torch_logs(verbose or args.command not in _RUNS_THE_MODEL):
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
        if args.command not in _RUNS_THE_MODEL:
            raise
        # the target's own code failed: the cause in one line, the trace with --verbose
        if verbose:
            traceback.print_exc()
        what = (f"building the target failed: {e.spec} raised" if isinstance(e, TargetBuildError)
                else "the model failed")
        print(f"fxstab {args.command}: error: {what}: {failure_line(e)}"
              + ("" if verbose else "; --verbose prints the traceback"), file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
