"""Issue 44: a plan never passes a NaN; per-element criteria; the CLI's exit codes and
checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import fxstab
from fxstab.plan.search import _outputs_digits


def test_a_nan_in_any_output_sample_fails_every_criterion():
    ok = torch.ones(3, 64) + torch.randn(3, 64) * 1e-3
    assert _outputs_digits([(ok,)], "bf16", "mean") > 1
    bad = ok.clone()
    bad[1, 7] = math.nan  # one element of one sample: an average would hide it
    for criterion in ("mean", "p5", "min"):
        assert _outputs_digits([(bad,)], "bf16", criterion) == -math.inf
    # per element: the 5% quantile and the minimum see the worst elements the mean averages
    mixed = ok.clone()
    mixed[:, :8] = torch.randn(3, 8)  # 8 of 64 elements keep no digit
    mean, p5, low = (_outputs_digits([(mixed,)], "bf16", c) for c in ("mean", "p5", "min"))
    assert low <= p5 < mean


class Overflow(nn.Module):
    """Its last layer overflows fp16 in a few rows (the exp of large logits), as the issue's
    attention block does."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        return torch.exp(h) / torch.exp(h).sum(-1, keepdim=True)


def test_the_plan_removes_a_nan_the_mean_would_hide():
    torch.manual_seed(0)
    model, x = Overflow(), torch.randn(64, 16)
    x[:7] *= 40  # 7 of 64 rows overflow fp16's exp
    plan = fxstab.plan_precision(model, (x,), format="fp16", keep=1.0, seed=0)
    assert plan.before == -math.inf and plan.met and plan.promoted
    assert "exp#0" in plan.promoted or "exp#1" in plan.promoted
    check = fxstab.check_plan(model, (x,), plan)
    assert math.isfinite(check.planned)


def test_keep_beyond_the_format_and_bad_criteria_are_refused():
    model, x = Overflow(), torch.randn(4, 16)
    with pytest.raises(ValueError, match="more than bf16 holds"):
        fxstab.plan_precision(model, (x,), format="bf16", keep=9)
    with pytest.raises(ValueError, match="criterion"):
        fxstab.plan_precision(model, (x,), format="bf16", keep=1, criterion="p99")


def test_the_cli_exits_1_when_not_met_and_2_on_an_impossible_keep(tmp_path, capsys):
    from fxstab.cli import main

    (tmp_path / "plan_target.py").write_text(
        "import torch\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())\n"
        "    return m, (torch.randn(4, 8),)\n")
    target = f"{tmp_path / 'plan_target.py'}:build"
    assert main(["plan", target, "--format", "bf16", "--keep", "9"]) == 2
    assert "more than bf16 holds" in capsys.readouterr().err
    # met: 0; a budget too small to meet: 1, with the reason on stderr
    assert main(["plan", target, "--format", "bf16", "--keep", "1.0"]) == 0
    code = main(["plan", target, "--format", "bf16", "--keep", "2.4", "--budget", "1",
                 "--metric", "avg"])
    err = capsys.readouterr().err
    assert code == 1 and "does not meet --keep 2.4" in err
    assert "Traceback" not in err and "UserWarning" not in err
