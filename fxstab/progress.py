"""Progress of long work (issue 56, item 8): a ``tqdm`` bar on a terminal, nothing otherwise.

The ablations of :func:`fxstab.operator_impact` (one analysed call per group bisected),
``fxstab ci run`` (a recording per target and commit), the plan search (its own line,
:mod:`fxstab.plan.search`) and the sweeps of ``benchmarks/`` (``bench_opinfo.py``'s operators,
``hf_sweep.py``'s models, whose rows print above the bar: :meth:`Progress.write`) take minutes. On a terminal (stderr a TTY) they
show how far they are; in CI logs, pipes and tests they stay quiet. Without ``tqdm``
installed the bar is one rewritten line of the same facts.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, TextIO

__all__ = ["Progress"]


class Progress:
    """A bar of ``desc``: ``update()`` after each unit of work, ``close()`` (or a ``with``
    block) at the end. ``enabled``: None shows it where ``stream`` (default stderr) is a
    terminal; True or False decide."""

    def __init__(self, desc: str, total: Optional[int] = None, unit: str = "call",
                 stream: Optional[TextIO] = None, enabled: Optional[bool] = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.desc, self.total, self.unit, self.count = desc, total, unit, 0
        self._bar: Any = None
        self._line = False
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # the same facts on one rewritten line
                self._line = True
            else:
                self._bar = tqdm(total=total, desc=desc, unit=unit, file=self.stream,
                                 leave=False, dynamic_ncols=True)

    def update(self, n: int = 1, note: str = "") -> None:
        """``n`` more units done; ``note``: what the last one found (the bar's postfix)."""
        self.count += n
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n)
            self._bar.refresh()  # (a unit is an analysed call: seconds, not tqdm's 0.1 s)
        elif self._line:
            of = f"/{self.total}" if self.total is not None else ""
            print(f"\r{self.desc}: {self.count}{of} {self.unit}(s)" + (f", {note}" if note
                                                                       else ""),
                  end="", file=self.stream, flush=True)

    def write(self, line: str, file: Optional[TextIO] = None) -> None:
        """Print ``line`` (to ``file``, default stdout) above the bar, which is drawn again
        below it: a report of each unit as it is done, beside the bar."""
        out = file if file is not None else sys.stdout
        if self._bar is not None:
            self._bar.write(line, file=out)
            return
        if self._line:  # the rewritten line ends first, and comes back at the next update
            print(file=self.stream, flush=True)
        print(line, file=out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._line:
            print(file=self.stream, flush=True)
            self._line = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
