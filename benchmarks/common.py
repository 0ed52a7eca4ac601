"""What every benchmark script records beside its rows: versions, machine and commit."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """HEAD of the checkout, with ``-dirty`` when tracked files changed; ``unknown`` outside git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    import fxstab

    return {
        "time": _dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "commit": git_commit(),
        "fxstab": fxstab.__version__, "torch": torch.__version__,
        "python": sys.version.split()[0],
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
    }


def save_json(path: "str | Path", payload: dict) -> Path:
    """Write ``payload`` plus :func:`environment` as JSON, atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"environment": environment(), **payload}, indent=1, default=str))
    tmp.replace(path)
    return path


class Progress:
    """A progress bar on stderr: one line redrawn in place on a terminal; elsewhere (a CI log, a
    file) a plain line every ``every`` of the way and at the end, never a carriage return.

    ``Progress(total, label).update(info)`` once per step.
    """

    def __init__(self, total: int, label: str, stream=None, every: float = 0.05) -> None:
        import time

        self.total, self.label, self.n, self.t0 = max(int(total), 1), label, 0, time.time()
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every, self._next = every, every

    def update(self, info: str = "") -> None:
        import time

        self.n += 1
        frac = self.n / self.total
        elapsed = time.time() - self.t0
        if self.tty:
            fill = int(30 * frac)
            self.stream.write(f"\r{self.label:<34} [{'#' * fill}{'.' * (30 - fill)}] "
                              f"{self.n}/{self.total} {elapsed:5.0f}s {info:<24}")
            if self.n >= self.total:
                self.stream.write("\n")
        elif frac + 1e-12 >= self._next or self.n >= self.total:
            while self._next <= frac + 1e-12:
                self._next += self.every
            self.stream.write(f"{self.label}: {self.n}/{self.total} ({100 * frac:.0f}%) "
                              f"{elapsed:.0f}s {info}".rstrip() + "\n")
        self.stream.flush()
