"""A precision plan as data: which operators run in a higher format, what the analysis measured
before and after, and its JSON file (``fxstab-precision-plan``, docs/precision-plan.md).

Operator names are the digit map's stable names (``blocks.0.attn/exp#0``); a plan is read back
with the same rules a digit map is: non-finite numbers as strings, every key validated, errors
that name the file, the place and the key (:class:`PlanError`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from .._version import __version__
from ..digitmap.schema import DigitMapError, encode

__all__ = ["PrecisionPlan", "PlanError", "PLAN_SCHEMA", "PLAN_VERSION"]

PLAN_SCHEMA = "fxstab-precision-plan"
PLAN_VERSION = 1


class PlanError(DigitMapError):
    """A precision plan file is unusable: says what is wrong and where."""


@dataclass
class PrecisionPlan:
    """The operators to run in ``higher`` so that the checked outputs keep ``keep`` digits.

    Attributes:
        format: the low-precision format the rest of the program runs in.
        higher: the format the promoted operators run in.
        keep: the avg digits required at the outputs.
        promoted: the promoted operators' stable names, in graph order.
        modules: operator name -> its module path (for the per-module exports).
        kinds: operator name -> its kind.
        before / after: avg digits at the checked outputs, the analysis without / with the plan.
        per_operator: promoted name -> (avg digits without the plan, with it).
        operators: how many operators the analysis instruments (the plan's share of them).
        runs: analysed calls the search made; met: whether ``after >= keep`` (False: the
            search stopped at its budget, or even all operators in ``higher`` keep less).
        outputs: the checked outputs (None: the model's outputs; else operator names).
        settings: n_samples, seed, granularity, target and what else the search ran with.
        regions: the module paths whose every analysed operator is promoted (the search
            fills it from the digit map: :meth:`autocast_regions`).
        checks: what the final plan keeps in each check (``"seed 0"``, ``"seed 1"``,
            ``"inputs[1]"``...); ``after`` is the worst of them.
        cost / cost_all_higher: the plan's cost and everything in ``higher``'s, relative to
            the program all in ``format`` (:class:`~fxstab.plan.cost.CostModel`).
        frontier: [cost, digits, operators] of the plans the search evaluated that no cheaper
            one beats (the analysis's digits with the search's seed), by cost.
    """

    format: str
    higher: str
    keep: float
    promoted: list = field(default_factory=list)
    modules: dict = field(default_factory=dict)
    kinds: dict = field(default_factory=dict)
    before: float = math.nan
    after: float = math.nan
    all_higher: float = math.nan
    per_operator: dict = field(default_factory=dict)
    operators: int = 0
    runs: int = 0
    met: bool = False
    outputs: Optional[list] = None
    settings: dict = field(default_factory=dict)
    regions: list = field(default_factory=list)
    checks: dict = field(default_factory=dict)
    cost: float = math.nan
    cost_all_higher: float = math.nan
    frontier: list = field(default_factory=list)

    # -- exports --------------------------------------------------------------------------
    def formats(self) -> dict:
        """The analysis's ``formats=`` option for this plan."""
        return {name: self.higher for name in self.promoted}

    def module_paths(self) -> list:
        """The module paths holding a promoted operator ("" is the model itself), sorted."""
        return sorted({self.modules.get(n, "") for n in self.promoted})

    def autocast_regions(self, module_operators: Optional[dict] = None) -> list:
        """Module paths that can run whole under ``torch.autocast(enabled=False)``: every
        operator the analysis saw in the module is promoted (``module_operators``: module path
        -> its operator names, e.g. from the digit map; without it every promoted operator's
        module). Operators of a module with others left low are not covered by any region."""
        paths = self.module_paths()
        if module_operators is None:
            return [p for p in paths if p]
        chosen = set(self.promoted)
        return [p for p in paths if p and set(module_operators.get(p, ())) <= chosen]

    # -- text -----------------------------------------------------------------------------
    def metric_words(self) -> str:
        """What the plan's digits are (its :attr:`metric`), in words."""
        return "run digits: what a real run is expected to keep" if self.metric == "run" \
            else "CESTAC digits: the bound"

    def context(self) -> list:
        """The lines that say what the search knew beside its digits: the gain expected in a
        real run, and how torch.autocast's fp32 list fared as a candidate (the report's and the
        page's)."""
        lines = []
        expected = self.settings.get("expected_real")
        if isinstance(expected, list) and len(expected) == 2 and all(
                isinstance(v, (int, float)) and math.isfinite(v) for v in expected):
            lines.append(f"expected in a real run in {self.format} (run digits, an estimate, "
                         f"not the bound): {expected[0]:.2f} -> {expected[1]:.2f} "
                         f"({expected[1] - expected[0]:+.2f})")
        autocast = self.settings.get("autocast")
        if isinstance(autocast, dict) and autocast.get("reason"):
            lines.append(f"torch.autocast's fp32 list as a candidate: {autocast['reason']}")
        return lines

    def report(self) -> str:
        """Before/after digits at the outputs and per promoted operator, as text."""
        what = "the model's outputs" if not self.outputs else ", ".join(self.outputs)
        share = f"{len(self.promoted)} of {self.operators} operators" if self.operators else \
            f"{len(self.promoted)} operators"
        criterion = {"mean": "avg", "p5": "5% quantile", "min": "min"}.get(
            self.settings.get("criterion", "mean"), "avg")
        metric = self.metric_words()
        worst = ""
        if len(self.checks) > 1:
            worst = (f", the worst of {', '.join(self.checks)}: "
                     + ", ".join(_digits(d) for d in self.checks.values()))
        # known where the search ran everything in higher (an empty plan's did not need to)
        all_higher = f"; all in {self.higher}: {_digits(self.all_higher)}" \
            if self.all_higher == self.all_higher else ""
        lines = [f"precision plan: {share} in {self.higher}, the rest in {self.format}; "
                 f"{self.runs} analysed calls",
                 f"digits at {what} ({criterion} {metric}, the analysis; NaN/inf fails): "
                 f"{_digits(self.before)} in {self.format} -> {_digits(self.after)} with the "
                 f"plan{worst} (required {self.required():.2f}{all_higher})"]
        lines += self.context()
        calibration = self.settings.get("calibration")
        if isinstance(calibration, dict):
            lines.append(f"keep {self.keep:.2f} is in true digits of the real run: the analysis "
                         f"must keep {calibration.get('goal', math.nan):.2f} (calibrated on "
                         f"{calibration.get('real_runs', 0)} real runs); the real run with "
                         f"the plan: {_digits(calibration.get('real', math.nan))}")
        if self.cost == self.cost:
            lines.append(f"cost (roofline estimate, all in {self.format} = 1): the plan "
                         f"{self.cost:.3f}, all in {self.higher} {self.cost_all_higher:.3f}")
        recipe = [f"{k} {v}" for k, v in self.settings.items()
                  if k in ("gemm_inputs", "accumulate")]
        if recipe:
            lines.append(f"GEMM recipe: {'; '.join(recipe)}; a promoted GEMM leaves it (operands "
                         f"as the program gives them, the fp32 sum)")
        if not self.met:
            first = next(iter(self.checks.values()), math.nan)
            if self.all_higher < self.required():
                why = f"even every operator in {self.higher} keeps less"
            elif first >= self.required():
                worst = min(self.checks, key=self.checks.__getitem__)
                why = (f"the plan keeps {_digits(self.checks[worst])} with {worst} (the "
                       f"search's seed: {_digits(first)})")
            else:
                why = "the search stopped at its budget"
            lines.append("NOT MET: " + why)
        if self.promoted:
            width = max(len(n) for n in self.promoted)
            lines.append(f"{'promoted operator':<{width}}  {'kind':<12} {'before':>7} {'after':>7}")
            for name in self.promoted:
                b, a = self.per_operator.get(name, (math.nan, math.nan))
                lines.append(f"{name:<{width}}  {self.kinds.get(name, ''):<12} {b:>7.2f} "
                             f"{a:>7.2f}")
            if self.regions:
                lines.append(f"whole modules in {self.higher} (torch.autocast(enabled=False) "
                             f"regions): {', '.join(self.regions)}")
        else:
            lines.append(f"nothing to promote: the outputs keep {self.before:.2f} digits in "
                         f"{self.format}")
        return "\n".join(lines)

    @property
    def metric(self) -> str:
        """The digits ``keep`` and the plan's digits are in: ``"run"`` (expected of a real
        round-to-nearest run) or ``"avg"`` (CESTAC's bound; a plan file written before the key
        was)."""
        metric = self.settings.get("metric", "avg")
        return metric if metric in ("run", "avg") else "avg"

    def required(self) -> float:
        """The analysis digits the plan must keep: ``keep``, or calibrated its goal."""
        calibration = self.settings.get("calibration")
        if isinstance(calibration, dict) and isinstance(calibration.get("goal"), (int, float)):
            return float(calibration["goal"])
        return self.keep

    def frontier_table(self) -> str:
        """Digits at the outputs against cost for the plans the search evaluated that no
        cheaper plan beats (``fxstab plan --frontier``)."""
        lines = [f"frontier: digits at the outputs against cost (all in {self.format} = 1; "
                 f"the analysis, seed {self.settings.get('seed', 0)})",
                 f"{'cost':>8} {'digits':>7} {'operators':>9}"]
        first = next((i for i, (_, d, _n) in enumerate(self.frontier)
                      if d >= self.required()), None)
        for i, (cost, digits, n) in enumerate(self.frontier):
            mark = "  <- the cheapest that keeps keep" if i == first else ""
            lines.append(f"{cost:>8.3f} {_digits(digits):>7} {n:>9}{mark}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        return (f"PrecisionPlan({len(self.promoted)} of {self.operators} operators in "
                f"{self.higher}, the rest in {self.format}: keeps {self.after:.2f} digits, "
                f"{'meets' if self.met else 'does not meet'} {self.required():.2f})")

    def _repr_html_(self) -> str:
        """Jupyter's display: the verdict and the promoted operators
        (:func:`fxstab.plots.notebook.plan_fragment`)."""
        from ..plots import notebook

        return notebook.plan_fragment(self)

    @property
    def feasible(self) -> float:
        """The most digits the outputs keep with every operator in ``higher`` (NaN where the
        search did not need to know)."""
        return self.all_higher

    # -- JSON -----------------------------------------------------------------------------
    def as_dict(self) -> dict:
        return {"schema": PLAN_SCHEMA, "version": PLAN_VERSION, "fxstab_version": __version__,
                "format": self.format, "higher": self.higher, "keep": self.keep,
                "promoted": [{"name": n, "kind": self.kinds.get(n, ""),
                              "module_path": self.modules.get(n, ""),
                              "before": self.per_operator.get(n, (math.nan, math.nan))[0],
                              "after": self.per_operator.get(n, (math.nan, math.nan))[1]}
                             for n in self.promoted],
                "before": self.before, "after": self.after, "all_higher": self.all_higher,
                "operators": self.operators, "runs": self.runs, "met": self.met,
                "outputs": self.outputs, "settings": self.settings,
                "regions": self.regions, "checks": self.checks, "cost": self.cost,
                "cost_all_higher": self.cost_all_higher, "frontier": self.frontier}

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(encode(self.as_dict()), indent=indent, allow_nan=False)

    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Write the plan as JSON (parent folders created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "PrecisionPlan":
        """Read a plan written by :meth:`save`.

        Raises:
            PlanError: missing or unreadable file, not JSON, another schema or version, a
                missing or mistyped key (named with its place).
        """
        src = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise PlanError(f"cannot read: {exc.strerror or exc}", src) from None
        return cls.from_json(text, src)

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> "PrecisionPlan":
        try:
            doc = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(
                PlanError(f"invalid JSON constant {c}", source)))
        except json.JSONDecodeError as exc:
            raise PlanError(f"not JSON: {exc}", source) from None
        if not isinstance(doc, dict):
            raise PlanError("the document is not a JSON object", source)
        if doc.get("schema") != PLAN_SCHEMA:
            raise PlanError(f"not a precision plan (schema {doc.get('schema')!r}, expected "
                            f"{PLAN_SCHEMA!r})", source, key="schema")
        if doc.get("version") != PLAN_VERSION:
            raise PlanError(f"unsupported version {doc.get('version')!r} (this fxstab reads "
                            f"{PLAN_VERSION})", source, key="version")

        def get(d: dict, key: str, kinds: tuple, where: str = "", default: Any = ...) -> Any:
            if key not in d:
                if default is not ...:
                    return default
                raise PlanError("missing", source, where, key)
            v = d[key]
            if isinstance(v, str) and float in kinds and v in ("NaN", "Infinity", "-Infinity"):
                return float(v.replace("Infinity", "inf"))
            if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
                names = "/".join(k.__name__ for k in kinds)
                raise PlanError(f"expected {names}, got {type(v).__name__}", source, where, key)
            return float(v) if float in kinds and isinstance(v, int) and \
                not isinstance(v, bool) else v

        plan = cls(format=get(doc, "format", (str,)), higher=get(doc, "higher", (str,)),
                   keep=get(doc, "keep", (float, int)))
        for i, entry in enumerate(get(doc, "promoted", (list,))):
            where = f"promoted[{i}]"
            if not isinstance(entry, dict):
                raise PlanError("expected an object", source, where)
            name = get(entry, "name", (str,), where)
            if not name or name in plan.kinds:
                raise PlanError(f"empty or repeated operator name {name!r}", source, where,
                                "name")
            plan.promoted.append(name)
            plan.kinds[name] = get(entry, "kind", (str,), where, "")
            plan.modules[name] = get(entry, "module_path", (str,), where, "")
            plan.per_operator[name] = (get(entry, "before", (float, int), where, math.nan),
                                       get(entry, "after", (float, int), where, math.nan))
        plan.before = get(doc, "before", (float, int), default=math.nan)
        plan.after = get(doc, "after", (float, int), default=math.nan)
        plan.all_higher = get(doc, "all_higher", (float, int), default=math.nan)
        plan.operators = get(doc, "operators", (int,), default=0)
        plan.runs = get(doc, "runs", (int,), default=0)
        plan.met = get(doc, "met", (bool,), default=False)
        outputs = doc.get("outputs")
        if outputs is not None and not (isinstance(outputs, list)
                                        and all(isinstance(o, str) for o in outputs)):
            raise PlanError("expected null or a list of operator names", source, key="outputs")
        plan.outputs = outputs
        plan.settings = get(doc, "settings", (dict,), default={})
        plan.regions = get(doc, "regions", (list,), default=[])
        if not all(isinstance(r, str) for r in plan.regions):
            raise PlanError("expected a list of module paths", source, key="regions")
        checks = get(doc, "checks", (dict,), default={})
        plan.checks = {str(k): get(checks, k, (float, int), "checks") for k in checks}
        plan.cost = get(doc, "cost", (float, int), default=math.nan)
        plan.cost_all_higher = get(doc, "cost_all_higher", (float, int), default=math.nan)
        plan.frontier = []
        for i, point in enumerate(get(doc, "frontier", (list,), default=[])):
            if not (isinstance(point, list) and len(point) == 3):
                raise PlanError("expected [cost, digits, operators]", source, f"frontier[{i}]")
            c, d, n = (get({"v": v}, "v", kinds, f"frontier[{i}]")
                       for v, kinds in zip(point, ((float, int), (float, int), (int,))))
            plan.frontier.append([c, d, n])
        for key in ("format", "higher"):
            from ..numerics.formats import get_format

            try:
                get_format(getattr(plan, key))
            except ValueError as exc:
                raise PlanError(str(exc), source, key=key) from None
        return plan


def _digits(x: float) -> str:
    """Digits as the reports print them: ``NaN/inf`` where an output holds one."""
    return "NaN/inf" if x == -math.inf else f"{x:.2f}"
