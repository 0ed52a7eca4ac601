"""The search of a precision plan (:func:`plan_precision`, docs/precision-plan.md).

Each candidate plan is evaluated by one analysed call in which the promoted operators round
into ``higher`` (``fxstab.backend(formats=...)``) and the rest into ``format``; the digits that
count are the checked outputs' (``criterion``). Every candidate runs with the same seed: an
operator's rounding draws are a function of the seed and its own place (counter-based random
bits), so two candidates differ only by the plan (common random numbers). Two routes:

* where the map holds a hazard (a NaN/inf origin, or an operator losing
  :data:`HAZARD_LOSS` digits against its inputs), the local route follows its ranking (1-2
  below);
* where it holds none (a healthy model asked for more: the loss is spread), the bisection
  route (:class:`Bisection`) measures the impact of groups of operators on the outputs by
  ablation and bisects them, within 4 + 2·log2(#operators) analysed calls.

The digits are those of ``metric``: by default the digits a real round-to-nearest run is
expected to keep (``"run"``), or CESTAC's bound (``"avg"``). Once a route has its plan, the plan
is set against ``torch.autocast``'s fp32 list (:mod:`fxstab.plan.autocast`): where it is not
better at equal or lower cost, the plan is autocast's list (``settings["autocast"]`` says why).

The final plan is re-checked with further seeds (and inputs); it reports the worst, and where
that falls short the search runs once more (the target raised by the spread the checks saw,
or, where another seed meets a NaN/inf, what that seed's map ranks first promoted). A cost
model (:mod:`fxstab.plan.cost`) ranks the bisection's groups by impact per cost and orders the
shrink's drops (the dearest first).

The local route:

1. grow: promote the NaN/inf origins and the operators ranked first by the local loss
   (:meth:`fxstab.DigitMap.localize`), each with its producers (``(x + c) - c`` needs the
   add as well as the subtraction: the add's bf16 rounding already erased x), one more
   each round, doubling when a round did not suffice; a promoted operator that still loses
   digits first pulls in the producers where its promoted region begins, one generation a
   round (``E[x^2] - E[x]^2`` amplifies the rounding of x^2 and of x too), or inside its own
   module the module's whole upstream part at once;
2. shrink: drop chunks of halving size (delta debugging's complement step), then try each
   operator once, the dearest first (latest added among equals); each test is one analysed
   call.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from typing import Any, Optional, Sequence

import torch

from ..backend import backend as make_backend
from ..config import AnalysisConfig
from ..rules.lifting import ACCUMULATED_KINDS
from ..digitmap.map import DigitMap
from ..numerics.formats import get_format, torch_dtype_of
from .autocast import AutocastCandidate
from .cost import CostModel
from .inputs import as_inputs
from .bisection import SPREAD_MARGIN, Bisection
from .outputs import CRITERIA, METRICS, operators_digits, outputs_digits
from .record import PrecisionPlan

__all__ = ["plan_precision", "Evaluation", "PlanSearch", "Bisection", "stored_high", "as_inputs",
           "parse_budget", "call_target", "CRITERIA", "METRICS"]

# below this local loss (digits) an operator is not worth promoting
MIN_LOCAL_LOSS = 0.5
# the names the tests and older callers import from here (plan/outputs.py holds them)
_outputs_digits, _operators_digits = outputs_digits, operators_digits


class Evaluation:
    """One analysed call: the digits at the checked outputs in the search's metric and
    criterion, the estimator's standard error (``spread``: the output elements' standard
    deviation over the square root of their count; 0 with ``outputs=``) and the digit map."""

    def __init__(self, digits: float, dmap: DigitMap, spread: float = 0.0,
                 run: float = math.nan, cestac: float = math.nan) -> None:
        self.digits = digits
        self.map = dmap
        self.spread = spread
        # the avg digits a round-to-nearest run keeps at the checked outputs, expected from the
        # samples (fxstab.numerics.digits.run_digits), whatever the metric and criterion
        self.run = run
        # CESTAC's digits under the criterion (the bound), whatever the metric
        self.cestac = cestac


class PlanSearch:
    """One search of a precision plan: its analysed calls (:meth:`evaluate`, counted in
    ``runs``) and, with :meth:`run`, the search itself (the module docstring's routes, the
    re-checks, the calibration), whose state lives here between its steps.

    The search's own settings (``keep``, ``recheck_seeds``, ``inputs``, ``cost``,
    ``calibrate``) are :func:`plan_precision`'s, validated there; a search made only to
    evaluate candidates (the tests', the benchmarks') needs none of them.
    """

    def __init__(self, model: Any, example_inputs: Sequence, format: Any, higher: Any,
                 outputs: Optional[Sequence[str]], budget: Any, options: dict, *,
                 keep: float = math.nan, recheck_seeds: int = 2,
                 inputs: Sequence[tuple] = (), cost: Optional[CostModel] = None,
                 calibrate: bool = False, metric: str = "run",
                 autocast: bool = False) -> None:
        self.model = model
        self.inputs = as_inputs(example_inputs)
        self.format = get_format(format)
        self.higher = get_format(higher)
        if self.higher.precision <= self.format.precision:
            raise ValueError(f"higher ({self.higher.name}) must have more significand bits "
                             f"than format ({self.format.name})")
        self.outputs = list(outputs) if outputs is not None else None
        self.budget = budget
        # budget= in analysed calls (an int) or seconds (a float, or a string "90s")
        self.budget_calls, seconds = parse_budget(budget)
        self.deadline = time.monotonic() + seconds if seconds is not None else None
        self.options = options = dict(options)  # the caller's own is left as it is
        self.runs = 0
        # (promoted, digits) of every candidate the search evaluated (the main seed and
        # inputs): the frontier's points
        self.history: list = []
        self.criterion = options.pop("criterion", "mean")
        # the digits keep is in: "run" (expected of a real round-to-nearest run) or "avg"
        # (CESTAC's bound); every candidate's Evaluation.digits is in it
        self.metric = options.pop("metric", metric)
        self.consumers: dict = {}  # the base map's edges, reversed (set after the first call)
        self.kinds: dict = {}  # operator name -> kind, from the base map
        self.paths: dict = {}  # operator name -> module path, from the base map
        # a GEMM recipe (fp8 operands, an emulated accumulator) as the config's rules
        cfg = AnalysisConfig(gemm_inputs=options.get("gemm_inputs"),
                             accumulate=options.get("accumulate"))
        self.recipe = (cfg.gemm_inputs, cfg.accumulate)
        self._cache: dict = {}
        self.progress: Any = None  # called after each analysed call (the CLI's progress line)
        self.margin = 0.0  # standard errors of the estimate a candidate must keep above
        # -- the search's settings (plan_precision's)
        self.keep = keep  # as given (the messages print it so); the record's is float(keep)
        self.recheck_seeds = recheck_seeds
        self.more_inputs = list(inputs)  # the further inputs the final plan is re-checked on
        self.cost_model = cost or CostModel()
        self.calibrate = calibrate
        self.seed = options.get("seed", 0)
        # torch.autocast's fp32 list as a candidate (plan/autocast.py; None: not compared)
        self.autocast = AutocastCandidate(self) if autocast else None
        # -- what the search learns (run(): the base call, then each step)
        self.base: Optional[Evaluation] = None  # the empty plan's call
        self.full: Optional[Evaluation] = None  # every forward operator in higher (once needed)
        self.forward: list = []  # the forward operators, in graph order
        self.extra: dict = {}  # operator -> what promoting it costs more (the cost model)
        self.low_total = 1.0  # the program's cost all in format
        self.record: Optional[PrecisionPlan] = None  # the plan returned, filled by finish()
        self.route = "local"  # "local" or "bisection" (the module docstring)
        self.bisection: Optional[Bisection] = None
        # the analysis digits the plan must keep: keep, or with calibrate=True keep's true
        # digits mapped through the real runs' points (analysis digits, true digits)
        self.goal = float(keep)
        self.points: list = []
        self.real_runs = 0

    def recipe_off(self, promoted: Sequence[str]) -> list:
        """The promoted GEMMs that leave the recipe (bf16 operands, the trusted fp32 sum):
        with ``gemm_inputs=``/``accumulate=``, promoting a GEMM is that."""
        if not (self.recipe[0] or self.recipe[1]):
            return []
        return [p for p in promoted if self.kinds.get(p) in ACCUMULATED_KINDS]

    def meets(self, ev: "Evaluation", target: float) -> bool:
        """Whether an evaluation keeps ``target`` digits, less ``margin`` standard errors of
        the estimate (set by the route: :data:`SPREAD_MARGIN` on the bisection, else 0)."""
        return ev.digits - self.margin * ev.spread >= target

    @property
    def exhausted(self) -> bool:
        if self.budget_calls is not None and self.runs >= self.budget_calls:
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline

    def evaluate(self, promoted: Sequence[str], seed: Optional[int] = None,
                 inputs: Optional[tuple] = None, input_index: int = 0) -> Evaluation:
        """The analysis with ``promoted`` in ``higher`` (cached: two plans whose outputs stay
        high on the same operators are one analysis). Every candidate runs with the same seed
        (common random numbers: an operator's rounding draws are a function of the seed and
        its own place, not of the other operators' formats), so two candidates differ only by
        the plan; ``seed``/``inputs`` (``input_index`` names them in the cache) re-check a
        plan with other draws or other inputs."""
        high = stored_high(promoted, self.consumers)
        exact = self.recipe_off(promoted)
        key = (frozenset(high), frozenset(exact), seed, input_index)
        if key in self._cache:
            return self._cache[key]
        formats = {name: self.higher for name in high}
        options = dict(self.options)
        if seed is not None:
            options["seed"] = seed
        if exact:  # promoted GEMMs leave the low-precision recipe: first rules win
            if self.recipe[0]:
                options["gemm_inputs"] = (*((n, None) for n in exact), *self.recipe[0])
            if self.recipe[1]:
                options["accumulate"] = (*((n, None) for n in exact), *self.recipe[1])
        torch._dynamo.reset()
        with warnings.catch_warnings():  # the backend's notes, said once by plan_precision
            warnings.simplefilter("ignore", UserWarning)
            be = make_backend(format=self.format, formats=formats or None, **options)
        compiled = torch.compile(self.model, backend=be)
        with be.capture_samples() as cap, torch.no_grad():
            compiled(*(self.inputs if inputs is None else inputs))
        self.runs += 1
        if not be.reports:
            raise RuntimeError("the analysis recorded no operator: nothing to plan (is the model "
                               "a torch.nn.Module torch.compile can capture?)")
        dmap = be.digit_map()
        if self.outputs is not None:
            cestac, spread = operators_digits(dmap, self.outputs), 0.0
            run = operators_digits(dmap, self.outputs, "run")
            digits = run if self.metric == "run" else cestac
        else:
            graphs, fmt = cap.graphs, self.format
            cestac, spread = outputs_digits(graphs, fmt, self.criterion, True)
            run, run_spread = outputs_digits(graphs, fmt, "mean", True, estimate="run")
            digits = cestac
            if self.metric == "run":
                digits, spread = (run, run_spread) if self.criterion == "mean" else \
                    outputs_digits(graphs, fmt, self.criterion, True, estimate="run")
        result = Evaluation(digits, dmap, spread, run, cestac)
        self._cache[key] = result
        if seed is None and input_index == 0:
            self.history.append((tuple(promoted), result))
        if self.progress is not None:  # after the history: the line shows this call's digits
            self.progress(self)
        return result

    # -- the search ------------------------------------------------------------------------
    def run(self) -> PrecisionPlan:
        """The search (the module docstring's routes, then the re-checks): the plan."""
        self._begin()
        if self.calibrate:
            self._calibrate()
        target, promoted, ev = self.goal, [], self.base
        for attempt in range(2):  # the second: the target raised by the spread the re-check saw
            if not self.meets(ev, target):
                if self.full is None:
                    self._all_higher()
                    if self.full.digits < self.goal:
                        need = f"keep={self.keep}" if not self.calibrate else \
                            f"the {self.goal:.2f} that keep={self.keep} true digits needs"
                        warnings.warn(f"fxstab: even every operator in {self.higher.name} keeps "
                                      f"{self.full.digits:.2f} digits at the outputs, less than "
                                      f"{need}: the plan promotes everything", UserWarning,
                                      stacklevel=3)  # plan_precision's caller
                        return self.finish(self.forward, self.full,
                                           {f"seed {self.seed}": self.full})
                if self.full.digits < target:  # the raised target is out of reach: the last plan
                    break
                promoted, ev = self._route(attempt, target, promoted, ev)
                if self.autocast is not None:  # autocast's fp32 list, once (plan/autocast.py)
                    promoted, ev = self.autocast.compare(target, promoted, ev)
            if ev.digits < self.goal:  # the budget ran out first
                return self.finish(promoted, ev, {f"seed {self.seed}": ev})
            checks = self.recheck(promoted, ev)
            failing = min(checks.values(), key=lambda e: e.digits)
            if self.calibrate and failing.digits >= self.goal:  # the found plan's real run
                self.points.append((ev.digits, self.real_run(promoted).planned))
                self.real_runs += 1
                if self.points[-1][1] < self.keep and not self.exhausted and attempt == 0:
                    self.goal = _analysis_goal(self.points, self.keep)
                    target = max(self.goal, target + 0.01)
                    continue
                return self.finish(promoted, ev, checks)
            if failing.digits >= self.goal or self.exhausted or attempt == 1:
                return self.finish(promoted, ev, checks)
            if math.isfinite(failing.digits):
                # the estimator's spread: the search's seed read this much above the worst check
                target = self.goal + (ev.digits - failing.digits) + 0.01
                self.record.settings["raised_target"] = target
            else:  # a NaN/inf another seed or input meets: promote what its map ranks first
                pulled, units = _candidates(failing, promoted, set(self.forward), self.consumers)
                step = pulled + [n for u in units[:1] for n in u if n not in pulled]
                if not step:
                    return self.finish(promoted, ev, checks)
                promoted = promoted + step
                ev = self.evaluate(promoted)
                self.route = "local"
        return self.finish(promoted, ev, checks)

    def _begin(self) -> None:
        """The empty plan's call, what it tells of the graph (operators, edges, costs) and the
        plan's record."""
        self.base = base = self.evaluate(())
        operators = base.map.operators
        self.forward = forward = [op.name for op in operators.values()
                                  if op.direction == "forward"]
        self.consumers = base.map.consumers()
        self.kinds = {name: op.kind for name, op in operators.items()}
        self.paths = {name: op.module_path for name, op in operators.items()}
        costs = self.cost_model.table(base.map, forward, self.format, self.higher)
        self.extra = {n: hi - lo for n, (lo, hi) in costs.items()}
        self.low_total = sum(lo for lo, _ in costs.values()) or 1.0
        settings = {"n_samples": self.options.get("n_samples", 3), "seed": self.seed,
                    "granularity": "op", "criterion": self.criterion}
        if self.recipe[0]:
            settings["gemm_inputs"] = {p: f.name if f is not None else "as given"
                                       for p, f in self.recipe[0]}
            settings["gemm_scaling"] = self.options.get("gemm_scaling", "tensor")
        if self.recipe[1]:
            settings["accumulate"] = {p: a.label if a is not None else "fp32"
                                      for p, a in self.recipe[1]}
        self.record = PrecisionPlan(format=self.format.name, higher=self.higher.name,
                                    keep=float(self.keep), outputs=self.outputs or None,
                                    operators=len(forward), before=base.digits,
                                    settings=settings)
        self.record.cost_all_higher = sum(hi for _, hi in costs.values()) / self.low_total
        settings["metric"] = self.metric
        if self.autocast is not None:
            self.autocast.prepare()

    def _all_higher(self) -> None:
        """Every forward operator in ``higher`` (one call, made once)."""
        self.full = self.evaluate(self.forward)
        self.record.all_higher = self.full.digits

    def _calibrate(self) -> None:
        """calibrate=True: the analysis's goal from the real runs of the empty plan (plain
        and all in ``higher``) against its two analysed calls."""
        self._all_higher()
        check = self.real_run([])
        self.real_runs += 1
        cap = self.format.digit_cap
        self.points = [(self.base.digits, check.plain), (self.full.digits, min(check.high, cap))]
        self.goal = _analysis_goal(self.points, self.keep)

    def _route(self, attempt: int, target: float, promoted: list,
               ev: Evaluation) -> tuple[list, Evaluation]:
        """One attempt's route towards ``target`` from ``promoted``: the cheapest candidate
        that keeps it (or the route's last, where none does)."""
        if attempt == 0 and _is_spread(self.base):
            self.route = "bisection"
        # the calls the routes may make, less the re-checks: the budget where one is given
        # (calls; none in calls for one in seconds, whose deadline stops the search), else
        # the call target (4 + 2·log2 n with two re-check seeds), which a small model's trim
        # does not stop at
        calls = self.route_calls(self.recheck_seeds + len(self.more_inputs))
        if self.route == "bisection" and self.autocast is not None and self.autocast.ops:
            calls -= 1  # the bisection's plans are dear: a call left for autocast's list
        trim = math.inf if self.budget is None and \
            len(self.forward) <= FULL_TRIM_OPERATORS else calls
        if self.route == "bisection":
            if self.bisection is None:
                self.bisection = Bisection(self, self.base, self.full, self.forward, self.extra)
            # splits leave a call for the selection and two for its corrections
            promoted, ev = self.bisection.run(target, calls - 3, trim)
        else:
            promoted, ev = self.grow(target, list(promoted), ev)
            if self.meets(ev, target) and attempt == 0:  # the second attempt keeps what
                # the first found (another seed or input needed it)
                promoted, ev = self.shrink(target, promoted, ev, trim)
        # of the candidates that keep the target, the cheapest (a correction may overshoot
        # past one found on the way)
        kept = [(self.plan_cost(p), list(p), e) for p, e in self.history
                if self.meets(e, target)]
        if kept and self.meets(ev, target):
            cheapest = min(kept, key=lambda k: (k[0], len(k[1])))
            if cheapest[0] < self.plan_cost(promoted):
                promoted, ev = cheapest[1], cheapest[2]
        return promoted, ev

    def route_calls(self, reserve: int) -> float:
        """The calls a route may have made when it stops, the re-checks' ``reserve`` left: the
        budget's calls (``budget=`` an int), no limit for a budget in seconds (its deadline
        stops the search), else the call target (:func:`call_target`) less its two re-check
        seeds."""
        if self.budget_calls is not None:
            return self.budget_calls - reserve
        if self.budget is not None:
            return math.inf
        return int(call_target(len(self.forward))) - 2  # the target counts two re-check seeds

    def grow(self, target: float, promoted: list, ev: Evaluation) -> tuple[list, Evaluation]:
        """The local route's grow step (the module docstring's 1.) until ``target``."""
        fwd = set(self.forward)
        batch = 1
        while not self.meets(ev, target):
            if self.exhausted:
                break
            pulled, units = _candidates(ev, promoted, fwd, self.consumers)
            step = list(pulled)  # the plan's regions grow a generation a round, beside new units
            for unit in units[:batch]:
                step += [n for n in unit if n not in step]
            if not step:  # nothing ranks as a loss: the remaining operators in graph order
                step = [n for n in self.forward if n not in promoted][:batch]
            if not step:
                break
            promoted = promoted + step
            ev = self.evaluate(promoted)
            batch = batch if pulled else 2 * batch
        return promoted, ev

    def shrink(self, target: float, promoted: list, ev: Evaluation,
               until: float) -> tuple[list, Evaluation]:
        """The local route's shrink step: chunks of halving size (delta debugging's complement
        step), then each operator once, the dearest first (latest added among equals); it
        stops once the search has made ``until`` calls (the plan may then keep an operator a
        longer search would drop: every test so far kept what it needs)."""
        n = 2
        while 2 <= n < len(promoted) and not self.exhausted and self.runs < until:
            size = math.ceil(len(promoted) / n)
            dropped = False
            for chunk in [promoted[i:i + size] for i in range(0, len(promoted), size)]:
                rest = [p for p in promoted if p not in chunk]
                if rest and not self.exhausted and self.runs < until:
                    trial = self.evaluate(rest)
                    if self.meets(trial, target):
                        promoted, ev, dropped = rest, trial, True
            n = n if dropped else 2 * n
        added = {n: i for i, n in enumerate(promoted)}
        for name in sorted(promoted, key=lambda n: (-self.extra.get(n, 0.0), -added[n])):
            if len(promoted) < 2 or self.exhausted or self.runs >= until:
                break
            rest = [p for p in promoted if p != name]
            trial = self.evaluate(rest)
            if self.meets(trial, target):
                promoted, ev = rest, trial
        return promoted, ev

    def plan_cost(self, promoted: Sequence[str]) -> float:
        """A plan's cost relative to the program all in ``format`` (the cost model)."""
        return 1.0 + sum(self.extra[n] for n in promoted) / self.low_total

    def recheck(self, promoted: list, ev: Evaluation) -> dict:
        """label -> the plan's evaluation with each further seed and input."""
        seed = self.seed
        checks = {f"seed {seed}": ev}
        for k in range(1, self.recheck_seeds + 1):
            if self.exhausted:
                break
            checks[f"seed {seed + k}"] = self.evaluate(promoted, seed=seed + k)
        for i, x in enumerate(self.more_inputs, start=1):
            if self.exhausted:
                break
            checks[f"inputs[{i}]"] = self.evaluate(promoted, inputs=x, input_index=i)
        return checks

    def real_run(self, promoted: Sequence[str]) -> Any:
        """check_plan's real run of a candidate (calibrate=True)."""
        from .apply import check_plan

        trial = PrecisionPlan(format=self.format.name, higher=self.higher.name,
                              keep=float(self.keep), promoted=list(promoted),
                              kinds={n: self.base.map[n].kind for n in promoted},
                              modules={n: self.base.map[n].module_path for n in promoted})
        torch._dynamo.reset()
        return check_plan(self.model, self.inputs, trial)

    def finish(self, promoted: list, ev: Evaluation, checks: dict) -> PrecisionPlan:
        """The plan's record of ``promoted`` (whose call is ``ev``) and its ``checks``."""
        plan, base = self.record, self.base
        order = {name: i for i, name in enumerate(self.forward)}
        promoted = sorted(promoted, key=order.__getitem__)
        plan.promoted = promoted
        plan.kinds = {n: base.map[n].kind for n in promoted}
        plan.modules = {n: base.map[n].module_path for n in promoted}
        plan.per_operator = {n: (base.map[n].digits(self.metric),  # in the plan's metric
                                 ev.map[n].digits(self.metric) if n in ev.map else math.nan)
                             for n in promoted}
        plan.checks = {k: (v.digits if isinstance(v, Evaluation) else v)
                       for k, v in checks.items()}
        plan.after = min(plan.checks.values())
        plan.met, plan.runs = plan.after >= self.goal, self.runs
        if self.calibrate:
            points = self.points
            real = points[-1][1] if len(points) > 2 else math.nan
            plan.settings["calibration"] = {"points": [list(p) for p in points],
                                            "goal": self.goal, "real": real,
                                            "real_runs": self.real_runs}
            plan.met = plan.met and real >= self.keep
        plan.settings["route"] = self.route
        if self.autocast is not None:
            plan.settings["autocast"] = self.autocast.info
        # what a real run is expected to gain (run digits at the outputs, before -> after):
        # what --apply-check measures
        plan.settings["expected_real"] = [self.base.run, ev.run]
        plan.cost = self.plan_cost(promoted)
        plan.frontier = _pareto([[self.plan_cost(p), e.digits, len(p)]
                                 for p, e in self.history])
        modules: dict = {}
        for name in self.forward:
            modules.setdefault(base.map[name].module_path, []).append(name)
        # never the whole model (a module holding every operator's module): that is the
        # program in higher, not a region of it
        plan.regions = [r for r in plan.autocast_regions(modules)
                        if not all(m == r or m.startswith(r + ".") for m in modules)]
        if self.progress is not None and sys.stderr.isatty():  # end the rewritten line
            print(file=sys.stderr)
        return plan


def stored_high(promoted: Sequence[str], consumers: dict) -> list:
    """The promoted operators whose output stays in ``higher``: those a promoted operator
    reads. As :func:`fxstab.apply_plan` runs a plan, every other reader (and the model's
    output) gets the output cast back to the program's dtype, so a promoted operator read by
    none of the plan rounds into the low format as before: promotion pays on an edge."""
    chosen = set(promoted)
    return [p for p in promoted if any(c in chosen for c in consumers.get(p, ()))]


def _candidates(ev: Evaluation, promoted: list, forward: set, consumers: dict
                ) -> tuple[list, list]:
    """(operators pulled in by the plan's own members, units worth promoting best first)
    from the evaluation's digit map.

    An operator that loses digits amplifies the rounding errors of its inputs: it comes with
    their producers (both ends of an edge must be promoted for the edge to carry ``higher``).
    A NaN/inf origin comes with its producers (an invalid operation's operand) and its readers
    (an overflow: its output must stay high). A promoted operator that still loses digits, or
    is still an origin, pulls in the next producers up (one generation per round: a
    cancellation amplifies every rounding upstream of it, back to where the values are
    accurate enough): the producers where the promoted region above it begins; a reader of
    the plan that loses digits is pulled in too (the accurate values reach it: with an fp8
    recipe, the GEMM after a cancelling one)."""
    chosen = set(promoted)
    dmap = ev.map
    ranking = dmap.localize()
    pulled: list = []

    def producers(name: str) -> list:
        return list(dmap[name].inputs) if name in dmap else []

    def pull(names: Any) -> None:
        for n in names:
            if n in forward and n not in chosen and n not in pulled:
                pulled.append(n)

    def frontier(name: str) -> list:
        """The producers where the promoted region upstream of ``name`` begins; inside the
        operator's own module (not the model's top level) the whole upstream part of that
        module at once: a hazard written as a module is local to it."""
        path = dmap[name].module_path if name in dmap else ""
        local = (lambda p: p in dmap and (dmap[p].module_path == path or
                                          dmap[p].module_path.startswith(path + "."))) \
            if path else (lambda p: False)
        out, seen, todo = [], {name}, [name]
        while todo:
            for p in producers(todo.pop()):
                if p in seen:
                    continue
                seen.add(p)
                if p not in chosen:
                    out.append(p)
                if p in chosen or local(p):
                    todo.append(p)
        return out

    lost = {x.name for x in ranking if x.nonfinite_origin or x.local_loss >= MIN_LOCAL_LOSS}
    for loss in ranking:
        if loss.name not in chosen:
            continue
        # a reader that loses the digits the plan now delivers is the region's next step
        pull([c for c in consumers.get(loss.name, ()) if c in lost])
        if loss.nonfinite_origin:
            pull(frontier(loss.name) + list(consumers.get(loss.name, ())))
        elif loss.local_loss >= MIN_LOCAL_LOSS:
            pull(frontier(loss.name))
    units: list = []
    for loss in ranking:
        if loss.name in chosen or loss.name not in forward or loss.name in pulled:
            continue
        if loss.nonfinite_origin:
            unit = [loss.name, *producers(loss.name), *consumers.get(loss.name, ())]
        elif loss.local_loss >= MIN_LOCAL_LOSS:
            unit = [loss.name, *(producers(loss.name) or consumers.get(loss.name, ()))]
        else:
            continue
        units.append([n for n in dict.fromkeys(unit) if n in forward and n not in chosen])
    return pulled, units


# a top-ranked local loss at least this large (digits) is a hazard the local ranking can follow;
# below it (a healthy model asked for more) the loss is spread and the search bisects instead
HAZARD_LOSS = 1.0


def parse_budget(budget: Any) -> tuple:
    """``budget=`` as (analysed calls or None, seconds or None): an int is calls, a float or a
    string ending in ``s`` (``"90s"``) seconds, a string of digits calls."""
    if budget is None:
        return None, None
    if isinstance(budget, str):
        text = budget.strip()
        try:
            if text.endswith("s"):
                value = float(text[:-1])
                if value > 0:
                    return None, value
            elif int(text) >= 1:
                return int(text), None
        except ValueError:
            pass
    elif not isinstance(budget, bool) and isinstance(budget, int) and budget >= 1:
        return budget, None
    elif not isinstance(budget, bool) and isinstance(budget, float) and budget > 0:
        return None, float(budget)
    raise ValueError(f"budget must be a positive number of analysed calls (an int, '20') or of "
                     f"seconds (a float, '90s'), got {budget!r}")


def call_target(n_operators: int) -> float:
    """The analysed calls a plan should take on ``n_operators``: 4 + 2·log2(n) (issue 44: the
    before/all-higher calls and the two re-check seeds, and a bisection's two halvings)."""
    return 4 + 2 * math.log2(max(n_operators, 2))


# a model of at most this many forward operators is trimmed fully when no budget is given (a
# shrink tests each promoted operator once after its chunks: at most ~3 calls an operator, each
# call of such a model short), not within the call target: a 7-operator model kept 5 where
# exp, sum, log did (issue 56, item 9)
FULL_TRIM_OPERATORS = 16


def _is_spread(ev: Evaluation) -> bool:
    """Whether the map holds no hazard the local ranking can follow: no NaN/inf origin and no
    operator losing :data:`HAZARD_LOSS` digits or more against its inputs."""
    ranking = ev.map.localize()
    return not any(x.nonfinite_origin or x.local_loss >= HAZARD_LOSS for x in ranking)


def _pareto(points: list) -> list:
    """The plans no cheaper plan beats: [cost, digits, promoted] sorted by cost."""
    front: list = []
    for cost, digits, n in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or digits > front[-1][1]:
            front.append([cost, digits, n])
    return front


def plan_precision(model: Any, example_inputs: Sequence, format: Any = "bf16",
                   keep: float = 2.0, granularity: str = "op",
                   outputs: Optional[Sequence[str]] = None, higher: Any = "fp32",
                   budget: Any = None, criterion: str = "mean",
                   inputs: Optional[Sequence] = None, recheck_seeds: int = 2,
                   cost: Optional[CostModel] = None, progress: bool = False,
                   calibrate: bool = False, metric: str = "run", autocast: bool = True,
                   **options: Any) -> PrecisionPlan:
    """The cheapest set of operators to run in ``higher`` so that the outputs keep ``keep``
    digits.

    Args:
        model: a module (or callable) ``torch.compile`` captures; it is not modified.
        example_inputs: its positional arguments.
        format: the low-precision format of the program (the analysis's ``format``).
        keep: the digits the checked outputs must keep in the analysis (``criterion``), in
            ``metric``'s digits.
        granularity: ``"op"``: the plan names torch-level operators, which
            :func:`fxstab.apply_plan` can run in ``higher`` for real.
        outputs: operator names (as in digit maps) whose digits are checked; None: the
            model's floating outputs.
        higher: the format promoted operators run in (more significand bits than ``format``).
            With a GEMM recipe in the options (``gemm_inputs=`` fp8 operands, ``accumulate=``
            an emulated accumulator), a promoted GEMM also leaves the recipe: its operands
            stay in the program's dtype and its sum is the trusted fp32 product.
        budget: at most this many analysed calls (an int) or seconds (a float, or ``"90s"``);
            the search's routes use what it allows. None: no cap, the routes then stop at the
            call target (:func:`call_target`), but for the trim of a model of at most
            :data:`FULL_TRIM_OPERATORS` operators, which tests every promoted operator. A
            search that reaches the budget returns its best plan so far, ``met`` False if
            that keeps less than ``keep``.
        criterion: what of the outputs' per-element digits must reach ``keep`` (without
            ``outputs=``): ``"mean"`` (their average), ``"p5"`` (their 5% quantile: 95% of
            the elements keep ``keep``) or ``"min"`` (every element). Whatever the criterion,
            a NaN/inf in any output sample fails it: a plan never passes a NaN.
        inputs: further example inputs (each a tuple of positional arguments, or a tensor)
            the final plan is re-checked on.
        recheck_seeds: the final plan is re-checked with this many further seeds; the plan
            reports the worst of every check (``plan.checks``), and ``met`` is that worst
            against ``keep``. Where the worst falls short, the search runs once more with
            its target raised by the spread it saw.
        cost: the :class:`~fxstab.plan.cost.CostModel` (None: the default's H100-like
            roofline); the search prefers the cheaper of plans that keep ``keep``.
        progress: a progress line on stderr after each analysed call.
        calibrate: ``keep`` is in avg true digits of the real run (``check_plan``'s, against
            fp64): the search maps it to the analysis's digits through real runs (the empty
            plan's, which gives plain and all-in-``higher``, then the found plan's), one
            real run per candidate size, not per candidate; ``met`` also needs the plan's
            real run to keep ``keep``. Needs a format torch computes in, no GEMM recipe,
            the model's outputs and ``criterion="mean"``.
        metric: the digits ``keep`` and every candidate's digits are in: ``"run"`` (the
            default), the digits a round-to-nearest run in ``format`` is expected to keep
            (:func:`fxstab.numerics.digits.run_digits`: an estimate of what ``check_plan``
            measures, ~0.5 digit above CESTAC's), or ``"avg"``, CESTAC's digits (the 95%
            bound the gate holds models to).
        autocast: set the plan against ``torch.autocast``'s fp32 list (the operators autocast
            runs in fp32 for the device, :mod:`fxstab.plan.autocast`) as a candidate: where
            the search's plan is not better than it at equal or lower cost, the plan is
            autocast's list; ``plan.settings["autocast"]`` says why either way (and why no
            comparison where none was made: a GEMM recipe, a format autocast does not lower
            to).
        **options: more :func:`fxstab.backend` options (``n_samples``, ``seed``, ``select``,
            ``accumulate``, ...).

    Returns:
        A :class:`PrecisionPlan`; ``plan.runs`` is the number of analysed calls made,
        the re-checks included.
    """
    if granularity != "op":
        raise ValueError("plan_precision plans torch-level operators (granularity='op'): the "
                         "arithmetic level's primitives cannot be run in another dtype for real")
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not keep > 0:
        raise ValueError(f"keep must be a positive number of digits, got {keep!r}")
    parse_budget(budget)
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(map(repr, METRICS))} (run: the "
                         f"digits a real run is expected to keep; avg: CESTAC's bound), got "
                         f"{metric!r}")
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {', '.join(map(repr, CRITERIA))}, got "
                         f"{criterion!r}")
    if isinstance(recheck_seeds, bool) or not isinstance(recheck_seeds, int) or \
            recheck_seeds < 0:
        raise ValueError(f"recheck_seeds must be a number of seeds >= 0, got {recheck_seeds!r}")
    if cost is not None and not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a fxstab.plan.CostModel, got {type(cost).__name__}")
    if calibrate and (outputs is not None or criterion != "mean" or
                      torch_dtype_of(format) is None or options.get("gemm_inputs") or
                      options.get("accumulate")):
        raise ValueError("calibrate=True maps keep in avg true digits of the real run at the "
                         "model's outputs: it needs a format torch computes in (bf16, fp16), "
                         "no GEMM recipe, no outputs= and criterion='mean'")
    more_inputs = [as_inputs(x) for x in (inputs or ())]
    cap = get_format(format).digit_cap
    if keep > cap:
        raise ValueError(f"keep={keep} digits is more than {get_format(format).name} holds "
                         f"({cap:.2f}: the outputs are cast back to it); ask for at most that")
    for bad in ("formats", "granularity", "format"):
        if bad in options:
            raise ValueError(f"{bad}= is set by the plan's search, not an option")
    make_backend(format=format, **options)  # validates the options, warns what it warns
    search = PlanSearch(model, example_inputs, format, higher, outputs, budget,
                        {**options, "criterion": criterion}, keep=keep,
                        recheck_seeds=recheck_seeds, inputs=more_inputs, cost=cost,
                        calibrate=calibrate, metric=metric, autocast=bool(autocast))
    if progress:
        search.progress = _progress_line(keep)
    return search.run()


def _analysis_goal(points: Sequence, keep: float) -> float:
    """The analysis digits whose real run keeps ``keep`` true digits: the piecewise-linear
    interpolation of the points (analysis digits, true digits) at ``keep``, finite points
    only, each true digit count the best analysis digits that reached it (the map must rise);
    beyond the points, the nearest segment's offset."""
    pts = sorted((t, a) for a, t in points if math.isfinite(a) and math.isfinite(t))
    mono: list = []
    for t, a in pts:
        if mono and t <= mono[-1][0]:
            mono[-1] = (mono[-1][0], max(mono[-1][1], a))
        elif not mono or a > mono[-1][1]:
            mono.append((t, a))
    if not mono:
        return float(keep)
    if len(mono) == 1 or keep <= mono[0][0]:
        return keep + mono[0][1] - mono[0][0]
    for (t0, a0), (t1, a1) in zip(mono, mono[1:]):
        if keep <= t1:
            return a0 + (keep - t0) * (a1 - a0) / (t1 - t0)
    return keep + mono[-1][1] - mono[-1][0]


def _progress_line(keep: float) -> Any:
    """A callback printing the search's progress on stderr (one line, rewritten)."""
    def show(search: "PlanSearch") -> None:
        best = max((e.digits for _, e in search.history), default=math.nan)
        end = "\r" if sys.stderr.isatty() else "\n"
        said = f"best {best:.2f} digits" if math.isfinite(best) else \
            "every candidate's outputs hold a NaN/inf so far" if best == -math.inf else \
            "no candidate yet"
        print(f"fxstab plan: {search.runs} analysed calls, {said} (keep {keep:.2f})", end=end,
              file=sys.stderr, flush=True)
    return show
