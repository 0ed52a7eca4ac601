"""The ``fxstab`` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _cmd_formats(args: argparse.Namespace) -> int:
    from .formats import FORMATS, working_dtype_for

    print(f"{'format':<10} {'e':>2} {'m':>2} {'p':>2} {'u':>10} {'max':>11} {'min normal':>11} "
          f"{'min subnorm':>11} {'digits':>6} {'work':>8}")
    for f in FORMATS.values():
        print(f"{f.name:<10} {f.exp_bits:>2} {f.man_bits:>2} {f.precision:>2} {f.unit_roundoff:>10.3e} "
              f"{f.max_normal:>11.4e} {f.min_normal:>11.4e} {f.min_subnormal:>11.4e} "
              f"{f.digit_cap:>6.2f} {str(working_dtype_for(f)).replace('torch.', ''):>8}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxstab",
        description="Find where a PyTorch program loses significant digits in low precision.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="analyse a built-in model and print its digit map")
    p.add_argument("--seed", type=int, default=0, help="seed of the random rounding (default 0)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("formats", help="print the table of named formats")
    p.set_defaults(func=_cmd_formats)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
