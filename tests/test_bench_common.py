"""benchmarks/common.py: the progress bar in a terminal and in a log."""

from __future__ import annotations

import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Progress  # noqa: E402


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_in_a_log_writes_a_line_every_five_percent():
    out = io.StringIO()
    bar = Progress(1000, "train", stream=out)
    for _ in range(1000):
        bar.update("loss 1.0")
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 20 and lines[-1].startswith("train: 1000/1000 (100%)")
    assert lines[0].startswith("train: 50/1000 (5%)")


def test_progress_on_a_terminal_redraws_one_line():
    out = _Tty()
    bar = Progress(3, "eval", stream=out)
    for _ in range(3):
        bar.update()
    assert out.getvalue().count("\r") == 3 and out.getvalue().endswith("\n")


def test_short_runs_print_every_step_in_a_log():
    out = io.StringIO()
    bar = Progress(4, "x", stream=out)
    for _ in range(4):
        bar.update()
    assert len(out.getvalue().splitlines()) == 4
