"""Precision plans (fxstab.plan, issue 32): the search, the plan file, the real run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import fxstab
from benchmarks.exp_plan import TwoHazards, two_hazards
from fxstab.cli import main
from fxstab.plan import PrecisionPlan, apply_plan, check_plan, plan_precision
from fxstab.plan.record import PlanError
from fxstab.plan.search import stored_high


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------- the search
def test_a_plan_promotes_both_planted_hazards_and_little_else_and_the_real_run_keeps_its_digits():
    """Two hazards among twelve clean blocks: the plan is each hazard's rounding and the
    operator that amplifies it, found in few analysed calls; run for real in bf16, the plan
    gives the output back its digits (the plain bf16 run keeps almost none)."""
    model, inputs = two_hazards()
    plan = plan_precision(model, inputs, format="bf16", keep=0.95)
    culprits = {name for group in TwoHazards.CULPRITS for name in group}
    assert set(plan.promoted) == culprits, plan.report()
    assert plan.met and plan.after >= 0.95 > plan.before
    assert plan.operators == 54 and len(plan.promoted) <= 0.1 * plan.operators
    assert plan.runs <= 2 * (4 + 2 * math.log2(plan.operators))
    real = check_plan(model, inputs, plan)
    assert not real.missing
    assert real.plain < 0.95 - 0.5 <= real.planned, real.report(plan)
    assert real.high > real.planned  # fp32 everywhere is better still (the reference run)
    # the run digits read what the real run keeps without and with the plan (measured:
    # 0.29 -> 2.00 expected, 0.23 -> 1.93 real), and the report says so
    before, after = plan.settings["expected_real"]
    assert abs(before - real.plain) <= 0.15 and abs(after - real.planned) <= 0.15
    assert f"expected in a real run in bf16 (run digits, an estimate, not the bound): " \
        f"{before:.2f} -> {after:.2f}" in plan.report()


class OffsetLinear(nn.Module):
    """A linear whose output is cancelled against a large offset, then a clean tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        return torch.tanh((h + 300.0) - 300.0)


def test_a_promoted_operator_read_by_no_promoted_operator_rounds_low_as_before():
    consumers = {"add#0": ["sub#0"], "sub#0": ["tanh#0"], "tanh#0": []}
    assert stored_high(["sub#0"], consumers) == []  # its reader casts it back to bf16
    assert stored_high(["add#0", "sub#0"], consumers) == ["add#0"]


def test_nothing_to_promote_when_the_outputs_keep_their_digits():
    torch.manual_seed(0)
    plan = plan_precision(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), (torch.randn(4, 8),),
                          format="bf16", keep=0.5)
    # one call, and the empty plan re-checked with two further seeds
    assert plan.promoted == [] and plan.met and plan.runs == 3
    assert set(plan.checks) == {"seed 0", "seed 1", "seed 2"}
    assert plan.after == min(plan.checks.values()) >= 0.5
    assert "nothing to promote" in plan.report()


def test_the_budget_caps_the_analysed_calls():
    torch.manual_seed(0)
    model, x = OffsetLinear().eval(), torch.randn(8, 16)
    plan = plan_precision(model, (x,), format="bf16", keep=1.5, budget=2)
    assert plan.runs <= 2 and not plan.met
    assert "NOT MET" in plan.report()


def test_bad_arguments_are_named():
    model, x = OffsetLinear(), torch.randn(2, 16)
    with pytest.raises(ValueError, match="granularity='op'"):
        plan_precision(model, (x,), granularity="aten")
    with pytest.raises(ValueError, match="higher"):
        plan_precision(model, (x,), format="fp16", higher="bf16", keep=1.0)
    with pytest.raises(ValueError, match="keep"):
        plan_precision(model, (x,), keep=-1)
    with pytest.raises(ValueError, match="budget"):
        plan_precision(model, (x,), budget=0)


# --------------------------------------------------------------------------- formats=
def test_per_operator_formats_round_the_named_operator_higher_and_the_map_says_so():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    be = fxstab.backend(format="bf16", formats={"add#0": "fp32", "sub#0": "fp32"})
    torch.compile(OffsetLinear().eval(), backend=be)(x)
    dm = be.digit_map()
    assert dm.metadata["formats"] == {"add#0": "fp32", "sub#0": "fp32"}
    assert dm["add#0"].format == "fp32" and dm["tanh#0"].format == ""
    assert dm.cap_of(dm["add#0"]) > dm.cap_of(dm["tanh#0"])
    torch._dynamo.reset()
    be0 = fxstab.backend(format="bf16")
    torch.compile(OffsetLinear().eval(), backend=be0)(x)
    # the promoted pair keeps the digits bf16 erased
    assert dm["sub#0"].avg_digits > be0.digit_map()["sub#0"].avg_digits + 1.0
    notes = fxstab.diff(be0.digit_map(), dm).notes
    assert any("formats differs" in n for n in notes)


def test_formats_option_is_validated():
    with pytest.raises(ValueError, match="granularity='op'"):
        fxstab.backend(granularity="aten", formats={"add#0": "fp32"})
    with pytest.raises(ValueError, match=r"formats\['add#0'\]"):
        fxstab.backend(formats={"add#0": "fp99"})
    with pytest.raises(ValueError, match="mapping"):
        fxstab.backend(formats=["add#0"])


# --------------------------------------------------------------------------- the file
def test_a_plan_survives_its_json_file_and_bad_files_are_named(tmp_path):
    plan = PrecisionPlan(format="bf16", higher="fp32", keep=1.5, promoted=["a/add#0"],
                         kinds={"a/add#0": "add"}, modules={"a/add#0": "a"},
                         per_operator={"a/add#0": (0.1, math.nan)}, before=0.1, after=1.6,
                         all_higher=math.inf, operators=10, runs=4, met=True)
    path = plan.save(tmp_path / "sub" / "plan.json")
    back = PrecisionPlan.load(path)
    assert back.promoted == plan.promoted and back.modules == plan.modules
    assert back.after == 1.6 and back.all_higher == math.inf and back.met
    assert math.isnan(back.per_operator["a/add#0"][1])
    assert back.formats() == {"a/add#0": "fp32"} and back.module_paths() == ["a"]
    (tmp_path / "bad.json").write_text('{"schema": "fxstab-digit-map", "version": 1}')
    with pytest.raises(PlanError, match="not a precision plan"):
        PrecisionPlan.load(tmp_path / "bad.json")
    doc = plan.to_json().replace('"higher": "fp32"', '"higher": 32')
    with pytest.raises(PlanError, match="key 'higher'"):
        PrecisionPlan.from_json(doc)
    with pytest.raises(PlanError, match="cannot read"):
        PrecisionPlan.load(tmp_path / "missing.json")


def test_autocast_regions_cover_modules_whose_operators_are_all_promoted():
    plan = PrecisionPlan(format="bf16", higher="fp32", keep=1.0,
                         promoted=["a/add#0", "a/sub#0", "b/exp#0"],
                         modules={"a/add#0": "a", "a/sub#0": "a", "b/exp#0": "b"})
    ops = {"a": ["a/add#0", "a/sub#0"], "b": ["b/exp#0", "b/sum#0"]}
    assert plan.autocast_regions(ops) == ["a"]
    assert plan.module_paths() == ["a", "b"]


def test_a_plan_names_the_modules_that_can_run_whole_in_fp32():
    """near_const_layernorm's hazard: its input linear and its LayerNorm, each a module of its
    own: two torch.autocast(enabled=False) regions."""
    from benchmarks.exp_plan import localization

    model, inputs = localization("near_const_layernorm")(True)
    plan = plan_precision(model, inputs, format="bf16", keep=1.14)
    assert plan.promoted == ["blocks.1.hazard.inp/linear#0", "blocks.1.hazard.ln/layer_norm#0"]
    assert plan.regions == ["blocks.1.hazard.inp", "blocks.1.hazard.ln"]
    assert "torch.autocast(enabled=False)" in plan.report()


# --------------------------------------------------------------------------- for real
def test_apply_plan_runs_the_promoted_operators_in_fp32_under_autocast_and_in_backward():
    torch.manual_seed(0)
    model, x = OffsetLinear(), torch.randn(8, 16)
    ref = model.double()(x.double()).detach()
    model.float()
    plan = PrecisionPlan(format="bf16", higher="fp32", keep=1.0, promoted=["add#0", "sub#0"])
    planned = apply_plan(model, plan)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(x)
        y = planned(x)
    assert plain.dtype == torch.bfloat16  # the linear runs in bf16 under autocast
    assert not planned.plan_backend.missing()
    err = lambda v: float(((v.detach().double() - ref).abs() / ref.abs().clamp_min(1e-3)).median())  # noqa
    assert err(y) < err(plain) / 10
    y.float().sum().backward()  # the casts are differentiable: promoted gradients in fp32
    assert model.lin.weight.grad is not None and torch.isfinite(model.lin.weight.grad).all()


# --------------------------------------------------------------------------- CLI
TARGET = '''
import torch, torch.nn as nn

class OffsetLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh((self.lin(x) + 300.0) - 300.0)

def build():
    return OffsetLinear().eval(), torch.randn(8, 16)
'''


def test_cli_plan_writes_the_plan_and_checks_it_for_real(tmp_path, capsys):
    target = tmp_path / "target.py"
    target.write_text(TARGET)
    out = tmp_path / "plan.json"
    page = tmp_path / "plan.html"
    code = main(["plan", f"{target}:build", "--format", "bf16", "--keep", "1.2", "-o", str(out),
                 "--apply-check", "--html", str(page)])
    text = capsys.readouterr().out
    assert code == 0, text
    plan = PrecisionPlan.load(out)
    assert set(plan.promoted) == {"add#0", "sub#0"} and plan.settings["target"].endswith(":build")
    assert "precision plan: 2 of" in text and "real run in bf16" in text
    # the page: the verdict, the real run's check, the promoted operators (in its data)
    html = page.read_text()
    assert f"wrote {page}" in text and "The real run in bf16" in html and '"add#0"' in html
    assert main(["plan", f"{target}:build", "--html", str(tmp_path / "plan.txt")]) == 2
    assert main(["plan", f"{target}:build", "--format", "fp16", "--higher", "bf16"]) == 2
    assert "higher" in capsys.readouterr().err


class BrokenGraph(nn.Module):
    """Two offset cancellations with a graph break between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        h = (self.a(x) + 300.0) - 300.0
        torch._dynamo.graph_break()
        return torch.tanh((self.b(h) + 300.0) - 300.0)


def test_a_loss_before_a_graph_break_is_planned_too():
    """The samples restart at each graph's inputs: the first graph's hazard shows only at its
    own outputs, which the search checks as well (the least of the graphs counts)."""
    torch.manual_seed(0)
    model, x = BrokenGraph().eval(), torch.randn(8, 16)
    plan = plan_precision(model, (x,), format="bf16", keep=1.2)
    assert set(plan.promoted) == {"add#0", "sub#0", "add#1", "sub#1"}
    real = check_plan(model, (x,), plan)
    assert not real.missing and real.plain < 0.5 < 1.5 < real.planned
