"""Issue 44 items 2-5: the search's robustness to the estimator (common random numbers,
re-checks with further seeds and inputs), the spread-loss route by bisection within the call
target, the cost model, the budget in seconds, and the frontier."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from benchmarks.exp_plan import localization
from fxstab.plan import CostModel, PrecisionPlan, plan_precision
from fxstab.plan.search import PlanSearch, call_target, parse_budget


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class OffsetLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh((self.lin(x) + 300.0) - 300.0)


def _search(model, inputs, seed=0):
    search = PlanSearch(model, inputs, "bf16", "fp32", None, None, {"seed": seed})
    search.consumers = search.evaluate(()).map.consumers()
    return search


# --------------------------------------------------------------------------- robustness
def test_candidates_share_their_random_numbers():
    """Every candidate runs with the search's seed (an operator's draws are a function of the
    seed and its own place): the same plan reads the same digits in two searches (no cache
    between them), another seed other digits (the re-checks' draws)."""
    torch.manual_seed(0)
    model, x = OffsetLinear().eval(), torch.randn(8, 16)
    a, b = _search(model, (x,)), _search(model, (x,))
    plan = ["add#0", "sub#0"]
    assert a.evaluate(plan).digits == b.evaluate(plan).digits
    assert a.evaluate(plan, seed=1).digits != a.evaluate(plan).digits
    assert a.runs == 3  # the base, the plan, the plan with seed 1


def test_the_final_plan_is_rechecked_with_two_seeds_and_further_inputs():
    torch.manual_seed(0)
    model, x = OffsetLinear().eval(), torch.randn(8, 16)
    plan = plan_precision(model, (x,), format="bf16", keep=1.2, inputs=[torch.randn(8, 16)])
    assert list(plan.checks) == ["seed 0", "seed 1", "seed 2", "inputs[1]"]
    assert plan.after == min(plan.checks.values()) and plan.met == (plan.after >= 1.2)
    assert "the worst of seed 0, seed 1, seed 2, inputs[1]" in plan.report()
    back = PrecisionPlan.from_json(plan.to_json())
    assert back.checks == plan.checks and back.frontier == plan.frontier
    assert back.cost == plan.cost


# --------------------------------------------------------------------------- spread loss
def test_a_spread_loss_is_bisected_within_the_call_target_and_holds_with_seeds_0_to_3():
    """A healthy GPT-style LM (44 operators, no hazard: no local loss to follow) asked for 0.2
    CESTAC digit more than it keeps: the search bisects the operators' impact, stays within
    4 + 2·log2(44) analysed calls (the re-checks included), and the plan keeps ``keep`` with
    seeds 0-3 (seed 3 never seen by the search). In CESTAC's digits (``metric="avg"``) and
    without autocast's candidate: the bisection's own plan (tests/test_plan_autocast.py has
    the default)."""
    model, inputs = localization("offset_cancel")(False)
    base = _search(model, inputs).evaluate(()).cestac
    keep = round(base + 0.2, 2)
    plan = plan_precision(model, inputs, format="bf16", keep=keep, seed=0, metric="avg",
                          autocast=False)
    assert plan.settings["route"] == "bisection" and plan.met, plan.report()
    assert plan.runs <= call_target(plan.operators), plan.runs
    assert min(plan.checks.values()) >= keep and len(plan.checks) == 3
    assert _search(model, inputs, seed=3).evaluate(plan.promoted).cestac >= keep
    assert plan.settings["metric"] == "avg" and "autocast" not in plan.settings
    assert 1.0 < plan.cost < plan.cost_all_higher
    costs = [c for c, _, _ in plan.frontier]
    digits = [d for _, d, _ in plan.frontier]
    assert costs == sorted(costs) and digits == sorted(digits) and len(plan.frontier) >= 3
    assert "<- the cheapest that keeps keep" in plan.frontier_table()


# --------------------------------------------------------------------------- cost and budget
def test_the_cost_model_charges_a_promoted_gemm_more_than_an_add():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(256, 256), nn.Tanh()).eval(), torch.randn(64, 256)
    dmap = _search(model, (x,)).evaluate(()).map
    cm = CostModel()
    (lin_lo, lin_hi), (tanh_lo, tanh_hi) = cm.table(dmap, ["0/linear#0", "1/tanh#0"],
                                                     "bf16", "fp32").values()
    assert tanh_hi == pytest.approx(2 * tanh_lo)  # memory: twice the bytes
    assert lin_hi / lin_lo > 4  # the matrix units: fp32 at 0.068 of bf16's speed
    flat = CostModel(speeds={"fp32": 1.0}).operator_cost(dmap["0/linear#0"], dmap, "fp32")
    assert flat < lin_hi
    with pytest.raises(ValueError, match=r"speeds\['fp32'\]"):
        CostModel(speeds={"fp32": 0})
    with pytest.raises(ValueError, match="fp99"):
        CostModel(speeds={"fp99": 1.0})


def test_the_budget_is_calls_or_seconds():
    assert parse_budget(None) == (None, None) and parse_budget(7) == (7, None)
    assert parse_budget("90s") == (None, 90.0) and parse_budget(1.5) == (None, 1.5)
    assert parse_budget("12") == (12, None)
    for bad in (0, -1, "0s", "soon", True):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)
    torch.manual_seed(0)
    model, x = OffsetLinear().eval(), torch.randn(8, 16)
    plan = plan_precision(model, (x,), format="bf16", keep=1.5, budget=1e-3)
    assert not plan.met and plan.runs <= 2  # the first calls run before the clock is read


def test_the_cli_prints_the_frontier_and_a_progress_line(tmp_path, capsys):
    from fxstab.cli import main

    (tmp_path / "t.py").write_text(
        "import torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.lin = nn.Linear(16, 16)\n"
        "    def forward(self, x):\n"
        "        return torch.tanh((self.lin(x) + 300.0) - 300.0)\n"
        "def build():\n"
        "    return M().eval(), torch.randn(8, 16)\n")
    code = main(["plan", f"{tmp_path / 't.py'}:build", "--format", "bf16", "--keep", "1.2",
                 "--frontier", "--budget", "600s", "--calibrate"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "frontier: digits at the outputs against cost" in out
    assert "cost (roofline estimate, all in bf16 = 1)" in out
    assert "keep 1.20 is in true digits of the real run" in out
    assert "fxstab plan: 1 analysed calls" in err and "Traceback" not in err
    assert main(["plan", f"{tmp_path / 't.py'}:build", "--budget", "soon"]) == 2
    assert "--budget" in capsys.readouterr().err


# --------------------------------------------------------------------------- the bisection
class _FakeSearch:
    """A search whose candidates' digits come from a model of independent roundings: the
    outputs' squared error is a floor plus each operator's share unless it is promoted; a
    pair (an edge) removes its share only when both ends are promoted."""

    def __init__(self, shares: dict, pairs: tuple = ()) -> None:
        self.shares, self.pairs, self.runs, self.history = shares, pairs, 0, []
        self.paths: dict = {}
        self.exhausted = False
        self.margin = 0.0

    def meets(self, ev, target: float) -> bool:
        return ev.digits - self.margin * ev.spread >= target

    def digits(self, promoted) -> float:
        chosen = set(promoted)
        paired = {n for pair in self.pairs for n in pair}
        err = 1e-6 + sum(e for n, e in self.shares.items() if n not in chosen and n not in paired)
        err += sum(sum(self.shares[n] for n in pair) for pair in self.pairs
                   if not set(pair) <= chosen)
        return -0.5 * math.log10(err)

    def evaluate(self, promoted):
        from fxstab.plan.search import Evaluation

        self.runs += 1
        ev = Evaluation(self.digits(promoted), None)
        self.history.append((tuple(promoted), ev))
        return ev


def test_the_bisection_finds_the_cheap_operators_that_matter_in_log_calls():
    from fxstab.plan.bisection import Bisection
    from fxstab.plan.search import Evaluation

    names = [f"op{i}" for i in range(32)]
    shares = {n: 1e-7 for n in names}
    shares["op5"] = shares["op20"] = 4e-5  # two operators hold most of the error
    search = _FakeSearch(shares)
    base, full = Evaluation(search.digits(()), None), Evaluation(search.digits(names), None)
    bis = Bisection(search, base, full, names, {n: 1.0 for n in names})
    target = search.digits(["op5", "op20"]) - 0.01
    promoted, ev = bis.run(target, split_until=2 * 5, trim_until=2 * 5 + 3)
    # a lopsided split measures both halves (it cannot tell a half that holds nothing from
    # an edge it broke): 2·log2(32) calls isolate the two to groups of at most 4
    assert ev.digits >= target and set(promoted) >= {"op5", "op20"}
    assert len(promoted) <= 6 and search.runs <= 2 * 5 + 3
    assert all(g.gain > 0 for g in bis.selection(target))


def test_the_selection_prefers_the_cheaper_of_equal_impacts():
    from fxstab.plan.bisection import Bisection
    from fxstab.plan.search import Evaluation

    names = ["gemm", "add"]
    search = _FakeSearch({"gemm": 1e-5, "add": 1e-5})
    base, full = Evaluation(search.digits(()), None), Evaluation(search.digits(names), None)
    bis = Bisection(search, base, full, names, {"gemm": 15.0, "add": 1.0})
    target = search.digits(["add"]) - 0.01  # either one alone keeps it
    promoted, ev = bis.run(target, split_until=1, trim_until=3)
    assert promoted == ["add"] and ev.digits >= target


def test_a_split_that_breaks_an_edge_keeps_the_group_whole():
    from fxstab.plan.bisection import Bisection
    from fxstab.plan.search import Evaluation

    names = [f"op{i}" for i in range(8)]
    shares = {n: 1e-8 for n in names}
    shares["op3"] = shares["op4"] = 2e-5  # (x + c) - c: the add and the sub, across the middle
    search = _FakeSearch(shares, pairs=(("op3", "op4"),))
    base, full = Evaluation(search.digits(()), None), Evaluation(search.digits(names), None)
    bis = Bisection(search, base, full, names, {n: 1.0 for n in names})
    target = full.digits - 0.1
    promoted, ev = bis.run(target, split_until=6, trim_until=8)
    assert ev.digits >= target and {"op3", "op4"} <= set(promoted)
    assert any(g.fixed for g in bis.groups) or len(promoted) <= 4


# --------------------------------------------------------------------------- calibrate=True
def test_calibrate_states_keep_in_true_digits_of_the_real_run():
    """offset_cancel asked for 2.0 true digits: the analysis's goal comes from the real runs
    (the empty plan's plain and all-in-fp32 runs, then the plan's), and the plan's real run
    keeps 2.0 true digits."""
    from fxstab.plan import check_plan

    model, inputs = localization("offset_cancel")(True)
    plan = plan_precision(model, inputs, format="bf16", keep=2.0, calibrate=True)
    cal = plan.settings["calibration"]
    assert plan.met and cal["real"] >= 2.0 and cal["real_runs"] == 2, plan.report()
    assert cal["goal"] != 2.0 and plan.after >= cal["goal"]  # the analysis reads fewer digits
    assert check_plan(model, inputs, plan).planned == pytest.approx(cal["real"])
    assert "is in true digits of the real run" in plan.report()
    with pytest.raises(ValueError, match="calibrate=True"):
        plan_precision(model, inputs, format="bf16", keep=1.0, calibrate=True,
                       criterion="p5")


def test_the_analysis_goal_interpolates_the_real_runs():
    from fxstab.plan.search import _analysis_goal

    points = [(0.0, 0.7), (1.8, 2.4)]  # (analysis, true)
    assert _analysis_goal(points, 1.55) == pytest.approx(0.9)
    assert _analysis_goal(points + [(1.4, 2.0)], 2.0) == pytest.approx(1.4)
    assert _analysis_goal([(-math.inf, 0.0), (1.8, 2.4)], 2.0) == pytest.approx(1.4)
    assert _analysis_goal([], 1.3) == 1.3


def test_a_recheck_that_falls_short_raises_the_target_by_the_spread(monkeypatch):
    """Where another seed reads the plan below keep, the search runs once more with its target
    raised by what that seed read less, and the plan it returns keeps keep with every seed."""
    evaluate = PlanSearch.evaluate

    def pessimistic_seed_1(self, promoted, seed=None, **kw):
        ev = evaluate(self, promoted, seed=seed, **kw)
        if seed == 1:  # seed 1 reads every plan 0.3 digit lower
            from fxstab.plan.search import Evaluation

            return Evaluation(ev.digits - 0.3, ev.map, ev.spread)
        return ev

    monkeypatch.setattr(PlanSearch, "evaluate", pessimistic_seed_1)
    torch.manual_seed(0)
    model, x = OffsetLinear().eval(), torch.randn(8, 16)
    plain = plan_precision(model, (x,), format="bf16", keep=0.5, recheck_seeds=0, metric="avg")
    # the add and the sub keep 1.84 with seed 0, 1.54 with seed 1; everything in fp32 2.09 and
    # 1.79: keep 1.69 needs the target raised, and more than the add and the sub
    keep = round(plain.after - 0.15, 2)
    plan = plan_precision(model, (x,), format="bf16", keep=keep, metric="avg")
    assert len(plan.promoted) > len(plain.promoted)
    assert plan.settings["raised_target"] >= keep + 0.3, plan.report()
    assert plan.met and min(plan.checks.values()) >= keep, plan.report()


# --------------------------------------------------------------------------- trim and budget
class LogSumExp(nn.Module):
    """Seven operators; in fp16 the sum of exp overflows (a NaN/inf origin): ``exp, sum, log``
    in fp32 keep 2.89 digits at the output (issue 56, item 9)."""

    def forward(self, x):
        e = torch.exp(x * 2.0 + 6.0)
        return (torch.log(e.sum(-1)) - 6.0) / 2.0


@pytest.mark.parametrize("budget", [None, 50])
def test_a_small_model_is_trimmed_fully_and_a_budget_is_honoured(budget):
    """The grow promotes five of the seven operators; the trim then drops the two that the
    call target's 9 calls left untested (without a budget: a model of 7 operators is trimmed
    fully; with ``budget=50``: the budget's calls, not the call target)."""
    torch.manual_seed(0)
    x = torch.randn(16, 1024)
    plan = plan_precision(LogSumExp(), (x,), format="fp16", keep=2.0, budget=budget)
    assert plan.operators == 7 and plan.met, plan.report()
    assert plan.promoted == ["exp#0", "sum#0", "log#0"], plan.promoted
    assert plan.runs <= (50 if budget else 3 * 7)


def test_a_budget_in_calls_bounds_the_trim():
    """A budget of 9 calls is the call target's: the trim stops where it did before."""
    torch.manual_seed(0)
    x = torch.randn(16, 1024)
    plan = plan_precision(LogSumExp(), (x,), format="fp16", keep=2.0, budget=9)
    assert plan.runs <= 9 and len(plan.promoted) > 3
