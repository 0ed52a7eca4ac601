"""``fxstab fix TARGET``: the stable rewrites that fix a target's findings, each verified on
a real run in the format (:func:`fxstab.fixes.verify.search_fixes`), printed as small diffs
at the user's lines; ``--html OUT.html`` writes the map's page with the fixes on it, ``--save
MAP.json`` the map with them (``DigitMap.load(MAP.json).fixes()``).

Exit codes: 0, every finding has a verified fix (or there is nothing to fix); 1, findings
without one; 2, unusable input (a target that cannot be loaded, a format torch does not
compute in).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "command", "diff_lines"]

EXIT_OK, EXIT_UNFIXED, EXIT_USAGE = 0, 1, 2


def add_parser(sub: Any) -> Any:
    """The parser of ``fxstab fix``, added to the CLI's subparsers ``sub``."""
    p = sub.add_parser(
        "fix", help="propose stable rewrites for the findings and verify them on a real run",
        description="Analyse TARGET's model (operator level), try the stable rewrites of "
                    "docs/fixes.md that match at or next to each finding, and keep those that "
                    "the real run in --format confirms against fp64 (NaN/inf removed, or "
                    "digits gained at the outputs). Exit 0: every finding has a verified fix "
                    "or there is nothing to fix; 1: findings without one; 2: unusable input.")
    p.add_argument("target", metavar="TARGET",
                   help="'path/to/file.py:function' or 'package.module:function' returning "
                        "(model, example_inputs), as for fxstab record")
    p.add_argument("--format", default="fp16", choices=("fp16", "bf16"),
                   help="the format of the analysis and of the real run (default fp16)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of torch's generator before the target is built, and of the "
                        "analysis (default 0)")
    p.add_argument("--n-samples", type=int, default=3, help="CESTAC samples (default 3)")
    p.add_argument("--html", metavar="OUT",
                   help="also write the map's page (OUT.html): the findings, the fixes at "
                        "their lines (code, stable form, what the runs measured), the graph")
    p.add_argument("--save", metavar="MAP",
                   help="also save the digit map with its fixes (MAP.json; "
                        "DigitMap.load(MAP).fixes())")
    p.add_argument("--verbose", action="store_true",
                   help="print the whole traceback when the target's model fails")
    return p


def _where(source: str) -> str:
    """``file.py:LINE`` relative to the current folder where it lies under it."""
    path, _, line = source.rpartition(":")
    if path and os.path.isabs(path):
        rel = os.path.relpath(path)
        path = path if rel.startswith("..") else rel
    return f"{path}:{line}" if path else source


def diff_lines(fix: Any) -> list[str]:
    """One fix as a small diff: the line, its code, the stable form, what the runs measured."""
    from .fixes import REWRITES

    naive = REWRITES[fix.rewrite].naive if fix.rewrite in REWRITES else ""
    bad = (f"NaN/inf {fix.nonfinite_before}/{fix.numel} -> {fix.nonfinite_after}; "
           if fix.nonfinite_before or fix.nonfinite_after else "")
    return [f"{_where(fix.source)}  {fix.operator}: {fix.rewrite} "
            f"({'verified' if fix.verified else 'not verified'})",
            f"  - {fix.code}" if fix.code else "  - (the line's text could not be read)",
            f"  + {fix.replacement}" + (f"    (in place of {naive})" if naive else ""),
            f"    {bad}outputs {fix.real_before:.2f} -> {fix.real_after:.2f} digits (real "
            f"{fix.format} run against fp64); analysis {fix.before:.2f} -> {fix.after:.2f}"]


def command(args: Any) -> int:
    """``fxstab fix`` (the CLI's parsed arguments): prints the fixes; the exit code."""
    import torch

    from .fixes.verify import analyse_fixes
    from .targets import TargetBuildError, TargetError, load_target

    if args.n_samples < 2:
        print(f"fxstab fix: error: --n-samples must be >= 2, got {args.n_samples}",
              file=sys.stderr)
        return EXIT_USAGE
    html_out, save_out = getattr(args, "html", None), getattr(args, "save", None)
    if html_out and Path(html_out).suffix.lower() not in (".html", ".htm"):
        print(f"fxstab fix: error: --html: the page's file must end in .html, got {html_out!r}",
              file=sys.stderr)
        return EXIT_USAGE
    torch.manual_seed(args.seed)  # the target's parameters and inputs are part of the result
    try:
        model, inputs = load_target(args.target)
    except TargetError as e:
        print(f"fxstab fix: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # the build function's own code raised: the CLI's one line
        raise TargetBuildError(args.target) from e
    if isinstance(inputs, dict):
        print("fxstab fix: error: the target's inputs are keyword inputs (a dict); fix takes "
              "positional ones (a tuple)", file=sys.stderr)
        return EXIT_USAGE
    dm, findings, fixes = analyse_fixes(model, inputs, args.format, seed=args.seed,
                                        n_samples=args.n_samples)
    dm.metadata["target"] = args.target
    if not findings:
        print(f"nothing to fix: the analysis in {args.format} names no finding")
        code = EXIT_OK
    else:
        for fix in fixes:
            print("\n".join(diff_lines(fix)))
        covered = {f for fix in fixes if fix.verified for f in fix.findings}
        unfixed = [f for f in findings if f not in covered]
        verified = sum(fix.verified for fix in fixes)
        print(f"{len(findings)} finding(s), {verified} verified fix(es) of {len(fixes)} tried"
              + (f"; without a verified fix: {', '.join(unfixed)}" if unfixed else
                 "; every finding has a verified fix"))
        code = EXIT_UNFIXED if unfixed else EXIT_OK
    return EXIT_USAGE if _write(dm, html_out, save_out) else code


def _write(dm: Any, html_out: Any, save_out: Any) -> bool:
    """Write the map's page (``--html``) and the map (``--save``), each with the fixes, and
    say so; True (an error printed) where a file cannot be written."""
    from .plots import html

    writes = [(save_out, dm.save), (html_out, lambda p: html.write_page(html.map_page(dm), p))]
    for path, write in writes:
        if path:
            try:
                write(path)
            except OSError as e:
                print(f"fxstab fix: error: cannot write {path!r}: {e.strerror or e}",
                      file=sys.stderr)
                return True
            print(f"wrote {path}")
    return False
