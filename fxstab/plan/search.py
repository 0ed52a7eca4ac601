"""The search of a precision plan (:func:`plan_precision`, docs/precision-plan.md).

Each candidate plan is evaluated by one analysed call in which the promoted operators round
into ``higher`` (``fxstab.backend(formats=...)``) and the rest into ``format``; the digits that
count are the CESTAC avg digits of the checked outputs. The search proposes from what the
latest digit map knows, then removes what is not needed:

1. grow: promote the NaN/inf origins and the operators ranked first by the local loss
   (:meth:`fxstab.DigitMap.localize`), each with its producers (``(x + c) - c`` needs the
   add as well as the subtraction: the add's bf16 rounding already erased x), one more
   each round, doubling when a round did not suffice; a promoted operator that still loses
   digits first pulls in the producers where its promoted region begins, one generation a
   round (``E[x^2] - E[x]^2`` amplifies the rounding of x^2 and of x too), or inside its own
   module the module's whole upstream part at once;
2. shrink: drop chunks of halving size (delta debugging's complement step), then try each
   operator once, latest added first; each test is one analysed call.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional, Sequence

import torch

from ..backend import backend as make_backend
from ..config import AnalysisConfig
from ..rules.lifting import ACCUMULATED_KINDS
from ..digitmap.map import DigitMap
from ..numerics.formats import get_format
from .record import PrecisionPlan

__all__ = ["plan_precision", "Evaluation", "PlanSearch", "stored_high", "as_inputs", "CRITERIA"]

# below this local loss (digits) an operator is not worth promoting
MIN_LOCAL_LOSS = 0.5


class Evaluation:
    """One analysed call: the digits at the checked outputs and the digit map."""

    def __init__(self, digits: float, dmap: DigitMap) -> None:
        self.digits = digits
        self.map = dmap


class PlanSearch:
    """Runs the analysed calls of one search and counts them (``runs``)."""

    def __init__(self, model: Any, example_inputs: Sequence, format: Any, higher: Any,
                 outputs: Optional[Sequence[str]], budget: Optional[int], options: dict) -> None:
        self.model = model
        self.inputs = as_inputs(example_inputs)
        self.format = get_format(format)
        self.higher = get_format(higher)
        if self.higher.precision <= self.format.precision:
            raise ValueError(f"higher ({self.higher.name}) must have more significand bits "
                             f"than format ({self.format.name})")
        self.outputs = list(outputs) if outputs is not None else None
        self.budget = budget
        self.options = options
        self.runs = 0
        self.criterion = options.pop("criterion", "mean")
        self.consumers: dict = {}  # the base map's edges, reversed (set after the first call)
        self.kinds: dict = {}  # operator name -> kind, from the base map
        # a GEMM recipe (fp8 operands, an emulated accumulator) as the config's rules
        cfg = AnalysisConfig(gemm_inputs=options.get("gemm_inputs"),
                             accumulate=options.get("accumulate"))
        self.recipe = (cfg.gemm_inputs, cfg.accumulate)
        self._cache: dict = {}

    def recipe_off(self, promoted: Sequence[str]) -> list:
        """The promoted GEMMs that leave the recipe (bf16 operands, the trusted fp32 sum):
        with ``gemm_inputs=``/``accumulate=``, promoting a GEMM is that."""
        if not (self.recipe[0] or self.recipe[1]):
            return []
        return [p for p in promoted if self.kinds.get(p) in ACCUMULATED_KINDS]

    @property
    def exhausted(self) -> bool:
        return self.budget is not None and self.runs >= self.budget

    def evaluate(self, promoted: Sequence[str]) -> Evaluation:
        """The analysis with ``promoted`` in ``higher`` (cached: two plans whose outputs stay
        high on the same operators are one analysis)."""
        high = stored_high(promoted, self.consumers)
        exact = self.recipe_off(promoted)
        key = (frozenset(high), frozenset(exact))
        if key in self._cache:
            return self._cache[key]
        formats = {name: self.higher for name in high}
        options = dict(self.options)
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
            compiled(*self.inputs)
        self.runs += 1
        if not be.reports:
            raise RuntimeError("the analysis recorded no operator: nothing to plan (is the model "
                               "a torch.nn.Module torch.compile can capture?)")
        dmap = be.digit_map()
        if self.outputs is not None:
            digits = _operators_digits(dmap, self.outputs)
        else:
            digits = _outputs_digits(cap.graphs, self.format, self.criterion)
        result = Evaluation(digits, dmap)
        self._cache[key] = result
        return result


def as_inputs(example_inputs: Any) -> tuple:
    """Positional inputs as a tuple (one tensor is one input)."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    return tuple(example_inputs)


def _operators_digits(dmap: DigitMap, names: Sequence[str]) -> float:
    """The avg digits of the named operators, weighted by their elements (``-inf`` where one
    holds a NaN/inf)."""
    missing = [n for n in names if n not in dmap]
    if missing:
        raise ValueError(f"outputs: no operator named {missing[0]!r} in the digit map (names "
                         f"look like {next(iter(dmap.operators), '?')!r})")
    if any(dmap[n].non_finite for n in names):
        return -math.inf
    total = sum(dmap[n].avg_digits * dmap[n].numel for n in names)
    numel = sum(dmap[n].numel for n in names)
    return total / numel if numel else math.nan


# The criteria a plan's outputs are held to (plan_precision's criterion=): the digits of every
# output element (CESTAC's, over the samples), averaged ("mean"), their 5% quantile ("p5":
# 95% of the elements keep at least keep digits) or their minimum ("min": every element). A
# NaN/inf in any output sample fails every criterion.
CRITERIA = ("mean", "p5", "min")


def _outputs_digits(graphs: Sequence, fmt: Any, criterion: str = "mean") -> float:
    """The digits of the floating outputs under ``criterion`` (:data:`CRITERIA`) of the graph
    the model's output comes from, or with graph breaks the least over the graphs: the samples
    restart from the deterministic values at each graph's inputs, so a loss inside an earlier
    graph shows only at that graph's own outputs. ``-inf`` where any output sample is NaN/inf:
    no average hides it."""
    from torch.utils import _pytree as pytree

    from ..numerics.digits import cestac_digits

    per_graph = []
    for outputs in graphs:
        digits = []
        for leaf in pytree.tree_leaves(outputs):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and \
                    leaf.dim() >= 1 and leaf.numel() > 0:
                if not bool(torch.isfinite(leaf).all()):
                    return -math.inf
                digits.append(cestac_digits(leaf.to(torch.float64), fmt).reshape(-1))
        if digits:
            d = torch.cat(digits)
            per_graph.append(float(d.mean()) if criterion == "mean" else float(d.min())
                             if criterion == "min" else float(torch.quantile(d, 0.05)))
    if not per_graph:
        raise RuntimeError("the model's outputs hold no floating tensor: name the operators to "
                           "check with outputs=[...]")
    return min(per_graph)


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


def plan_precision(model: Any, example_inputs: Sequence, format: Any = "bf16",
                   keep: float = 2.0, granularity: str = "op",
                   outputs: Optional[Sequence[str]] = None, higher: Any = "fp32",
                   budget: Optional[int] = None, criterion: str = "mean",
                   **options: Any) -> PrecisionPlan:
    """The fewest operators to run in ``higher`` so that the outputs keep ``keep`` digits.

    Args:
        model: a module (or callable) ``torch.compile`` captures; it is not modified.
        example_inputs: its positional arguments.
        format: the low-precision format of the program (the analysis's ``format``).
        keep: the avg digits the checked outputs must keep in the analysis.
        granularity: ``"op"``: the plan names torch-level operators, which
            :func:`fxstab.apply_plan` can run in ``higher`` for real.
        outputs: operator names (as in digit maps) whose digits are checked; None: the
            model's floating outputs.
        higher: the format promoted operators run in (more significand bits than ``format``).
            With a GEMM recipe in the options (``gemm_inputs=`` fp8 operands, ``accumulate=``
            an emulated accumulator), a promoted GEMM also leaves the recipe: its operands
            stay in the program's dtype and its sum is the trusted fp32 product.
        budget: at most this many analysed calls (None: no cap); a search that reaches it
            returns its best plan so far, ``met`` False if that keeps less than ``keep``.
        criterion: what of the outputs' per-element digits must reach ``keep`` (without
            ``outputs=``): ``"mean"`` (their average), ``"p5"`` (their 5% quantile: 95% of
            the elements keep ``keep``) or ``"min"`` (every element). Whatever the criterion,
            a NaN/inf in any output sample fails it: a plan never passes a NaN.
        **options: more :func:`fxstab.backend` options (``n_samples``, ``seed``, ``select``,
            ``accumulate``, ...).

    Returns:
        A :class:`PrecisionPlan`; ``plan.runs`` is the number of analysed calls made.
    """
    if granularity != "op":
        raise ValueError("plan_precision plans torch-level operators (granularity='op'): the "
                         "arithmetic level's primitives cannot be run in another dtype for real")
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not keep > 0:
        raise ValueError(f"keep must be a positive number of digits, got {keep!r}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or budget < 1):
        raise ValueError(f"budget must be a positive number of analysed calls, got {budget!r}")
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {', '.join(map(repr, CRITERIA))}, got "
                         f"{criterion!r}")
    cap = get_format(format).digit_cap
    if keep > cap:
        raise ValueError(f"keep={keep} digits is more than {get_format(format).name} holds "
                         f"({cap:.2f}: the outputs are cast back to it); ask for at most that")
    for bad in ("formats", "granularity", "format"):
        if bad in options:
            raise ValueError(f"{bad}= is set by the plan's search, not an option")
    make_backend(format=format, **options)  # validates the options, warns what it warns
    search = PlanSearch(model, example_inputs, format, higher, outputs, budget,
                        {**options, "criterion": criterion})
    base = search.evaluate(())
    forward = [op.name for op in base.map.operators.values() if op.direction == "forward"]
    fwd = set(forward)
    consumers = base.map.consumers()
    search.consumers = consumers
    search.kinds = {name: op.kind for name, op in base.map.operators.items()}
    order = {name: i for i, name in enumerate(forward)}
    settings = {"n_samples": options.get("n_samples", 3), "seed": options.get("seed", 0),
                "granularity": granularity, "criterion": criterion}
    if search.recipe[0]:
        settings["gemm_inputs"] = {p: f.name if f is not None else "as given"
                                   for p, f in search.recipe[0]}
        settings["gemm_scaling"] = options.get("gemm_scaling", "tensor")
    if search.recipe[1]:
        settings["accumulate"] = {p: a.label if a is not None else "fp32"
                                  for p, a in search.recipe[1]}
    plan = PrecisionPlan(format=search.format.name, higher=search.higher.name,
                         keep=float(keep), outputs=list(outputs) if outputs else None,
                         operators=len(forward), before=base.digits, settings=settings)

    def finish(promoted: list, ev: Evaluation, met: bool) -> PrecisionPlan:
        promoted = sorted(promoted, key=order.__getitem__)
        plan.promoted = promoted
        plan.kinds = {n: base.map[n].kind for n in promoted}
        plan.modules = {n: base.map[n].module_path for n in promoted}
        plan.per_operator = {n: (base.map[n].avg_digits,
                                 ev.map[n].avg_digits if n in ev.map else math.nan)
                             for n in promoted}
        plan.after, plan.met, plan.runs = ev.digits, met, search.runs
        modules: dict = {}
        for name in forward:
            modules.setdefault(base.map[name].module_path, []).append(name)
        # never the whole model (a module holding every operator's module): that is the
        # program in higher, not a region of it
        plan.regions = [r for r in plan.autocast_regions(modules)
                        if not all(m == r or m.startswith(r + ".") for m in modules)]
        return plan

    if base.digits >= keep:
        plan.all_higher = math.nan
        return finish([], base, True)
    full = search.evaluate(forward)
    plan.all_higher = full.digits
    if full.digits < keep:
        warnings.warn(f"fxstab: even every operator in {search.higher.name} keeps "
                      f"{full.digits:.2f} digits at the outputs, less than keep={keep}: the "
                      f"plan promotes everything", UserWarning, stacklevel=2)
        return finish(forward, full, False)

    # 1. grow from the map's ranking
    promoted: list = []
    ev, batch = base, 1
    while ev.digits < keep:
        if search.exhausted:
            return finish(promoted, ev, False)
        pulled, units = _candidates(ev, promoted, fwd, consumers)
        step = list(pulled)  # the plan's regions grow a generation a round, beside new units
        for unit in units[:batch]:
            step += [n for n in unit if n not in step]
        if not step:  # nothing ranks as a loss: the remaining operators in graph order
            step = [n for n in forward if n not in promoted][:batch]
        if not step:
            break
        promoted += step
        ev = search.evaluate(promoted)
        batch = batch if pulled else 2 * batch
    if ev.digits < keep:
        return finish(promoted, ev, False)

    # 2. shrink: drop chunks of halving size (delta debugging's complement step), then each
    # operator once, latest added first, while the outputs keep their digits
    n = 2
    while 2 <= n < len(promoted) and not search.exhausted:
        size = math.ceil(len(promoted) / n)
        dropped = False
        for chunk in [promoted[i:i + size] for i in range(0, len(promoted), size)]:
            rest = [p for p in promoted if p not in chunk]
            if rest and not search.exhausted:
                trial = search.evaluate(rest)
                if trial.digits >= keep:
                    promoted, ev, dropped = rest, trial, True
        n = n if dropped else 2 * n
    for name in reversed(list(promoted)):
        if len(promoted) < 2 or search.exhausted:
            break
        rest = [p for p in promoted if p != name]
        trial = search.evaluate(rest)
        if trial.digits >= keep:
            promoted, ev = rest, trial
    return finish(promoted, ev, True)
