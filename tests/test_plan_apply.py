"""A plan run for real and checked (fxstab.plan.apply), and what the plan's text, page and
progress line say of it (issue 56, item 10)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from fxstab.plan import PrecisionPlan, apply_plan, check_plan
from fxstab.plan.search import Evaluation, _progress_line
from fxstab.plots import html


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class LogSumExp(nn.Module):
    """In fp16 the sum of exp overflows: every output is inf without ``exp, sum, log`` in
    fp32."""

    def forward(self, x):
        e = torch.exp(x * 2.0 + 6.0)
        return (torch.log(e.sum(-1)) - 6.0) / 2.0


def _plan(promoted=("exp#0", "sum#0", "log#0"), **fields) -> PrecisionPlan:
    return PrecisionPlan(format="fp16", higher="fp32", keep=1.2, promoted=list(promoted),
                         kinds={n: n.split("#")[0] for n in promoted}, **fields)


def test_a_model_run_with_its_plan_can_still_be_checked_and_copied():
    """``apply_plan`` keeps its backend (whose graphs hold fake tensors) on the compiled
    wrapper, not on the user's model: the model deep-copies and ``check_plan`` runs after it."""
    torch.manual_seed(0)
    model, x = LogSumExp(), torch.randn(4, 64)
    fixed = apply_plan(model, _plan())
    fixed(x)
    assert "plan_backend" not in vars(model)
    assert fixed.plan_backend.promoted == ["exp#0", "sum#0", "log#0"]
    copy.deepcopy(model)
    check = check_plan(model, (x,), _plan())
    assert check.planned > 2.0 and not check.missing


def test_the_real_run_check_counts_the_nan_inf_outputs():
    """Without the plan every fp16 output is inf (0 true digits each): the check says so
    beside the average, which alone reads as a run that kept few digits."""
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    plan = _plan()
    check = check_plan(LogSumExp(), (x,), plan)
    assert (check.plain_non_finite, check.planned_non_finite, check.numel) == (4, 0, 4)
    text = check.report(plan)
    assert "0.00 (4 of 4 output elements NaN/inf) without the plan" in text, text
    assert "with it (3 operators" in text  # the planned run has none: nothing added
    page = html.plan_page(plan, check)
    assert "(4 of 4 output elements NaN/inf) without the plan" in page


def test_the_page_headline_says_what_the_plan_keeps_and_what_was_required():
    plan = _plan(before=-math.inf, after=1.48, met=True, checks={"seed 0": 1.48})
    page = html.plan_page(plan)
    assert "The plan keeps 1.48 digits at the outputs (the analysis), meeting the 1.20 " \
           "required" in page
    short = _plan(before=-math.inf, after=0.9, met=False, checks={"seed 0": 0.9})
    assert "keeps 0.90 digits at the outputs (the analysis), NOT meeting the 1.20" in \
        html.plan_page(short)


def test_an_empty_plan_says_nothing_of_the_all_higher_run_it_did_not_make():
    plan = _plan(promoted=(), before=2.0, after=2.0, met=True, checks={"seed 0": 2.0})
    text = plan.report()
    assert "nan" not in text and "all in fp32" not in text, text
    plan.all_higher = 2.3
    assert "(required 1.20; all in fp32: 2.30)" in plan.report()


class _Search:
    def __init__(self, digits: list) -> None:
        self.runs = len(digits)
        self.history = [((), Evaluation(d, None)) for d in digits]


def test_the_progress_line_never_prints_minus_inf(capsys):
    show = _progress_line(1.2)
    show(_Search([-math.inf, -math.inf]))
    show(_Search([-math.inf, 1.5]))
    err = capsys.readouterr().err.splitlines()
    assert err == ["fxstab plan: 2 analysed calls, every candidate's outputs hold a NaN/inf so "
                   "far (keep 1.20)",
                   "fxstab plan: 2 analysed calls, best 1.50 digits (keep 1.20)"]


def test_the_page_says_which_digits_the_expected_real_gain_and_autocasts_verdict():
    """The plan page says what the text report says beside its digits: which digits (the
    bound or a real run's), the gain expected in a real run, and how torch.autocast's fp32
    list fared as a candidate."""
    plan = _plan(before=1.0, after=1.5, met=True, checks={"seed 0": 1.5},
                 settings={"metric": "run", "expected_real": [1.9, 2.2],
                           "autocast": {"reason": "the plan keeps more at a lower cost"}})
    page, text = html.plan_page(plan), plan.report()
    for line in ("run digits: what a real run is expected to keep",
                 "expected in a real run in fp16 (run digits, an estimate, not the bound): "
                 "1.90 -> 2.20 (+0.30)",
                 "torch.autocast's fp32 list as a candidate: the plan keeps more at a lower "
                 "cost"):
        assert line in text
        assert html.escape(line) in page or html.escape(line[0].upper() + line[1:]) in page
    bound = _plan(before=1.0, after=1.5, met=True, checks={"seed 0": 1.5},
                  settings={"metric": "avg"})
    assert "The digits are CESTAC digits: the bound." in html.plan_page(bound)
