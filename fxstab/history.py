"""Digit maps across commits: ``fxstab history MAP... | FOLDER`` (issue 45).

A *point* is one commit: the digit maps recorded there, by target. The points come from the
paths given, in order:

- a folder whose subfolders hold maps (``history/20261203T1200-3f2a9c1/mlp.json``, as the
  generated CI workflow keeps them): each subfolder, sorted by name, is a point whose targets
  are its files' names;
- a folder of maps and no subfolder, or map files: each map is a point of its own target
  (its ``target``, else its ``target_name``, else the file's name), sorted by name within a
  folder.

A point is labelled with its maps' commit (``git_commit``, 10 characters), else its folder's
or file's name. :func:`fxstab.plots.html.history_page` draws them; :func:`trend_lines` is the
text the command prints.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence, Union

from .digitmap import DigitMap, DigitMapError, operators

PathLike = Union[str, Path]
Point = tuple  # (label, {target: DigitMap})


def _target_of(dm: DigitMap, path: Path) -> str:
    meta = dm.metadata
    return str(meta.get("target") or meta.get("target_name") or path.stem)


def _label(maps: dict, default: str) -> str:
    commits = {dm.metadata.get("git_commit") for dm in maps.values()} - {None, ""}
    if len(commits) == 1:
        return str(commits.pop())[:10]
    return default


def collect(paths: Sequence[PathLike]) -> list[Point]:
    """The points of ``paths`` (see the module docstring), oldest first.

    Raises:
        DigitMapError: a path that does not exist, a folder without maps, or a file that is not
            a digit map (the message names it).
    """
    points: list[Point] = []
    for p in map(Path, paths):
        if p.is_dir():
            subs = sorted(d for d in p.iterdir() if d.is_dir() and any(d.glob("*.json")))
            if subs:
                for d in subs:
                    maps = {f.stem: DigitMap.load(f) for f in sorted(d.glob("*.json"))}
                    points.append((_label(maps, d.name), maps))
                continue
            files = sorted(p.glob("*.json"))
            if not files:
                raise DigitMapError("no digit map (*.json) in this folder, nor in a subfolder",
                                    str(p))
        elif p.is_file():
            files = [p]
        else:
            raise DigitMapError("no such file or folder", str(p))
        for f in files:
            dm = DigitMap.load(f)
            points.append((_label({"": dm}, f.stem), {_target_of(dm, f): dm}))
    return points


def trend_lines(points: list[Point], top: int = 3, metric: Optional[str] = None) -> list[str]:
    """Per target, the outputs' and the ``top`` worst operators' digits at the first and the
    last point that have them: what the page draws, as text."""
    metric = operators.check_metric(metric)
    lines = [f"{len(points)} commit(s): {points[0][0]} .. {points[-1][0]}" if points
             else "no commit"]
    targets = list(dict.fromkeys(t for _, maps in points for t in maps))
    for t in targets:
        series = [(lbl, maps[t]) for lbl, maps in points if t in maps]
        last = series[-1][1]
        cons = last.consumers()
        outputs = [n for n in last.operators if not cons[n]]
        worst = [op.name for op in last.sorted_worst_first(metric)[:top]]
        lines.append(f"{t} ({len(series)} commit(s), {metric} digits, first -> last):")
        for n in dict.fromkeys([*outputs, *worst]):
            vals = [dm.operators[n].digits(metric) for _, dm in series if n in dm.operators]
            first, now = operators.as_digits(vals[0]), operators.as_digits(vals[-1])
            role = "output" if n in outputs else "worst"
            lines.append(f"  {role:<6} {n}: {first:.2f} -> {now:.2f} ({now - first:+.2f})"
                         if not math.isnan(first) else f"  {role:<6} {n}: n/a")
    return lines
