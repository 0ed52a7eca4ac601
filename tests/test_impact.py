"""Issue 42: each operator's impact on the outputs, by ablation (fxstab.operator_impact)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import fxstab


class Centred(nn.Module):
    """A harmless computational zero (the mean of an already centred row: no digit locally,
    nothing lost at the output) beside a hazard (a cancellation that costs the output its
    digits)."""

    def __init__(self, hazard: bool):
        super().__init__()
        self.fc, self.head = nn.Linear(32, 32), nn.Linear(32, 8)
        self.hazard = hazard

    def forward(self, x):
        h = self.fc(x)
        c = h - h.mean(-1, keepdim=True)
        y = c - c.mean(-1, keepdim=True)  # its mean is a computational zero
        if self.hazard:
            y = (y + 300.0) - 300.0  # bf16 keeps ~0 digits of y here
        return self.head(torch.tanh(y))


def test_impact_names_the_hazard_and_clears_the_computational_zero(tmp_path):
    torch.manual_seed(0)
    model, x = Centred(hazard=True), torch.randn(16, 32)
    imp = fxstab.operator_impact(model, (x,), format="bf16", seed=0)
    top, gain = imp.ranked()[0]
    # the rounding that costs the outputs is the addition's (h + 300 keeps few of h's bits);
    # the subtraction after it is exact (Sterbenz) and amplifies it
    assert top == "add#0", imp.table()
    assert gain > 0.5 and imp.matters(top)
    assert not imp.matters("mean#1"), imp.table()  # the computational zero: harmless
    assert imp.calls <= 1 + 2 * 2 * 4  # bisection: well under one call per operator + 1
    assert "impact on the outputs" in imp.table()
    # a group bound says what it is (issue 56, item 11)
    table = imp.table(top=None).splitlines()
    assert any(ln.endswith("(group bound)") for ln in table), table
    assert table[-1].startswith("group bound: left unrounded with its group, which gained less")
    # the map's findings lead with what costs the outputs; a harmless local loss is a note
    findings = imp.digit_map.findings()
    assert findings[0].startswith("digits are lost at sub#2") and "of add#0" in findings[0] \
        and "the outputs lose" in findings[0], findings
    assert not any(f.startswith("digits are lost at mean#1") for f in findings), findings
    # the impacts are optional keys of the map's JSON
    path = tmp_path / "map.json"
    imp.digit_map.save(path)
    again = fxstab.DigitMap.load(path)
    assert again.operators[top].impact == pytest.approx(gain)
    assert again.findings() == findings
    table = again.table()
    assert "impact" in table.splitlines()[1] and "impact: the digits the outputs lose" in table


def test_a_healthy_model_has_no_operator_that_matters():
    torch.manual_seed(0)
    model, x = Centred(hazard=False), torch.randn(16, 32)
    imp = fxstab.operator_impact(model, (x,), format="bf16", seed=0)
    assert not imp.matters("mean#1"), imp.table()
    # the local ranking blames the computational zero first: what impact corrects
    torch._dynamo.reset()
    be = fxstab.backend(format="bf16", seed=0)
    torch.compile(model, backend=be)(x)
    assert be.digit_map().localize()[0].name == "mean#1"
    notes = imp.digit_map.findings()
    assert any(f.startswith("note: mean#1 loses") and "harmless here" in f for f in notes), notes
    assert not any(f.startswith("digits are lost") for f in notes), notes


def test_unrounded_operators_are_measured_not_rounded():
    torch.manual_seed(0)
    model, x = Centred(hazard=False), torch.randn(16, 32)
    be = fxstab.backend(format="bf16", seed=0, unrounded=["tanh#0"])
    torch.compile(model, backend=be)(x)
    dm = be.digit_map()
    # tanh of exactly-rounded... its samples are its inputs' tanh, not rounded into bf16: its
    # digits are those its input carries, above what a bf16 rounding leaves
    assert dm.operators["tanh#0"].avg_digits > dm.operators["head/linear#0"].avg_digits
    with pytest.raises(ValueError, match="unrounded"):
        fxstab.backend(unrounded=[3])
    with pytest.raises(ValueError, match="threshold"):
        fxstab.operator_impact(model, (x,), threshold=0)


def test_record_with_impact_writes_the_impacts_and_ranks_by_them(tmp_path, capsys):
    from fxstab.cli import main

    (tmp_path / "centred_target.py").write_text(
        "import torch, sys\n"
        f"sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})\n"
        "from test_impact import Centred\n"
        "def build():\n"
        "    torch.manual_seed(0)\n"
        "    return Centred(hazard=False), (torch.randn(16, 32),)\n")
    out = tmp_path / "map.json"
    assert main(["record", f"{tmp_path / 'centred_target.py'}:build", "-o", str(out),
                 "--impact"]) == 0
    text = capsys.readouterr().out
    assert "impact on the outputs" in text
    dm = fxstab.DigitMap.load(out)
    assert dm.metadata["impact_calls"] >= 2 and dm.impact_threshold() == 0.1
    assert not any(f.startswith("digits are lost at mean#1") for f in dm.findings())
    assert any(f.startswith("note: mean#1 loses") for f in dm.findings())
    # show: the table in the order of the impacts (its default), or of the digits
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "sorted by impact on the outputs" in shown
    first = shown.split("sorted by impact on the outputs")[1].splitlines()[2].split()[0]
    assert first == dm.sorted_by_impact()[0].name
    assert main(["show", str(out), "--sort", "digits"]) == 0
    assert "sorted by avg digits" in capsys.readouterr().out
    plain = tmp_path / "plain.json"
    import dataclasses
    nothing = fxstab.DigitMap([dataclasses.replace(op, impact=float("nan"))
                               for op in dm.operators.values()], {"fxstab_version": "x",
                                                                    "torch_version": "y"})
    nothing.save(plain)
    assert main(["show", str(plain), "--sort", "impact"]) == 2
    assert "holds no impacts" in capsys.readouterr().err


def test_the_gate_warns_on_a_drop_that_costs_the_outputs_nothing():
    """A drop at an operator whose rounding costs the outputs less than the threshold is a
    warning with impacts (strict: a failure); the outputs' own digits dropping fails."""
    import copy

    torch.manual_seed(0)
    model, x = Centred(hazard=False), torch.randn(16, 32)
    head = fxstab.operator_impact(model, (x,), format="bf16", seed=0).digit_map
    base = copy.deepcopy(head)
    base.operators["mean#1"].avg_digits += 1.0  # mean#1 "lost" a digit in head
    result = fxstab.diff(base, head, max_drop=0.5)
    assert not result.failed and [c.name for c in result.harmless] == ["mean#1"]
    assert "cost the outputs nothing" in result.to_text()
    assert fxstab.diff(base, head, max_drop=0.5, strict=True).failed
    base.metadata["impact_output_digits"] = head.metadata["impact_output_digits"] + 1.0
    outputs = fxstab.diff(base, head, max_drop=0.5)
    assert outputs.failed and outputs.drops[0].name == "(outputs)"


def test_impact_at_the_arithmetic_level_names_the_same_hazard():
    # the primitives are ablated: the hazard's add (h + 300) is the top impact there too, the
    # computational zero's row sum is harmless, and the ablation leaves the output's bits
    torch.manual_seed(0)
    model, x = Centred(hazard=True), torch.randn(16, 32)
    want = model(x)
    imp = fxstab.operator_impact(model, (x,), format="bf16", seed=0, granularity="aten")
    top, gain = imp.ranked()[0]
    assert top == "add#0/aten.add#0" and gain > 0.5, imp.table()
    zero = [n for n in imp.by_operator if n.startswith("mean#1/")]
    assert zero and not any(imp.matters(n) for n in zero), imp.table()
    n = len(imp.by_operator)
    assert imp.calls <= 2 + 4 * math.ceil(math.log2(n)), (imp.calls, n)
    findings = imp.digit_map.findings()
    assert findings[0].startswith("digits are lost at sub#2/aten.sub#0") and \
        "the outputs lose" in findings[0], findings
    # an unrounded primitive (a glob over a submodule's: full names) is measured, not rounded:
    # its samples are its inputs' exact function, more digits than rounded; its status stays
    digits = {}
    model = Centred(hazard=False)
    want = model(x)
    for unrounded in (None, ["fc/linear#0/*"]):
        torch._dynamo.reset()
        be = fxstab.backend(format="bf16", seed=0, granularity="aten", unrounded=unrounded)
        with torch.no_grad():
            assert torch.equal(torch.compile(model, backend=be)(x), want)
        torch._dynamo.reset()
        dm = be.digit_map()
        fc = [n for n in dm.operators if n.startswith("fc/linear#0/aten.addmm")]
        assert len(fc) == 1 and dm.operators[fc[0]].status == "rounded", list(dm.operators)
        digits[bool(unrounded)] = dm.operators[fc[0]].avg_digits
    # (its operands are exact: unrounded, its samples agree on every digit)
    assert digits[True] == pytest.approx(dm.cap) and digits[False] < dm.cap - 0.2, digits


def test_impact_on_a_loss_or_on_chosen_outputs():
    # outputs=: a loss (as in training) or a dict output's keys; the names stay the model's
    import torch.nn.functional as F

    torch.manual_seed(0)
    model, x = Centred(hazard=True), torch.randn(16, 32)
    y = torch.randint(0, 8, (16,))
    imp = fxstab.operator_impact(model, (x,), format="bf16", seed=0,
                                 outputs=lambda out: F.cross_entropy(out, y))
    assert imp.ranked()[0][0] == "add#0" and imp.ranked()[0][1] > 0.3, imp.table()
    assert "head/linear#0" in imp.by_operator and "mean#1" in imp.by_operator
    assert any(n.startswith("(outputs)/") for n in imp.by_operator), list(imp.by_operator)
    assert set(imp.digit_map.operators) == set(imp.by_operator)
    assert imp.digit_map.operators["sub#2"].inputs == ("add#0",)

    class Dict(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Centred(hazard=True)

        def forward(self, x):
            return {"logits": self.inner(x), "aux": torch.tanh(x * 3.0)}

    torch.manual_seed(0)
    both = fxstab.operator_impact(Dict(), (x,), format="bf16", seed=0)
    logits = fxstab.operator_impact(Dict(), (x,), format="bf16", seed=0, outputs=["logits"])
    # the aux output keeps its digits: with it, the hazard costs the average half as much
    assert logits.output_digits < both.output_digits
    assert logits.by_operator["inner/add#0"] > both.by_operator["inner/add#0"]
    with pytest.raises(ValueError, match="outputs"):
        fxstab.operator_impact(Dict(), (x,), outputs=[3])
