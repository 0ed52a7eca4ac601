"""Progress of long work (issue 56, item 8; fxstab.progress): a bar on a terminal, quiet
otherwise, a plain line without tqdm; operator_impact counts its analysed calls on it."""

from __future__ import annotations

import io
import sys

import torch

import fxstab
from fxstab.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_and_nothing_elsewhere():
    tty, pipe = _Tty(), io.StringIO()
    for stream in (tty, pipe):
        with Progress("fxstab impact", stream=stream) as bar:
            for k in range(3):
                bar.update(note=f"outputs {k}.00 digits")
    assert "fxstab impact" in tty.getvalue() and "3call" in tty.getvalue().replace(" ", "")
    assert pipe.getvalue() == ""
    forced = io.StringIO()
    with Progress("x", stream=forced, enabled=True) as bar:
        bar.update()
    assert "x" in forced.getvalue()


def test_without_tqdm_one_rewritten_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # (import tqdm raises ImportError)
    out = _Tty()
    with Progress("fxstab ci: recording head", total=2, unit="target", stream=out) as bar:
        bar.update(note="mlp")
        bar.update(note="lm")
    assert out.getvalue() == ("\rfxstab ci: recording head: 1/2 target(s), mlp"
                              "\rfxstab ci: recording head: 2/2 target(s), lm\n")


def test_operator_impact_counts_its_calls_on_the_bar(capsys):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    imp = fxstab.operator_impact(model, (torch.randn(4, 8),), format="bf16", seed=0,
                                 progress=True)
    err = capsys.readouterr().err
    assert "fxstab impact" in err and f"{imp.calls}call" in err.replace(" ", ""), err
    fxstab.operator_impact(model, (torch.randn(4, 8),), format="bf16", seed=0)
    assert "fxstab impact" not in capsys.readouterr().err  # (stderr no terminal here)


def test_a_line_written_beside_the_bar_and_without_one(capsys):
    """A unit's report prints above the bar (tqdm redraws it below), on stdout as before where
    no bar is shown, and ends the plain rewritten line first."""
    tty = _Tty()
    with Progress("HF sweep", total=2, unit="model", stream=tty) as bar:
        bar.write("gpt2 op 100% pass")
        bar.update(note="gpt2 op")
    assert "gpt2 op 100% pass" in capsys.readouterr().out and "HF sweep" in tty.getvalue()
    with Progress("HF sweep", stream=io.StringIO()) as bar:
        bar.write("bert op 100% pass")
    assert capsys.readouterr().out == "bert op 100% pass\n"


def test_the_sweeps_show_how_far_they_are(monkeypatch):
    """The OpInfo and Hugging Face sweeps (benchmarks/) count their operators and models on
    the bar: two OpInfo operators at the arithmetic level, forced on."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_opinfo

    shown = []
    real = Progress.update
    monkeypatch.setattr(Progress, "update",
                        lambda self, n=1, note="": (shown.append((self.desc, note)),
                                                    real(self, n, note)))
    rows = bench_opinfo.sweep("aten", names={"exp", "mul"}, progress=True)
    assert [r["op"] for r in rows] == [note.split(":")[0] for _, note in shown]
    assert {d for d, _ in shown} == {"OpInfo sweep (aten)"} and len(rows) >= 2
