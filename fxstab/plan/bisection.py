"""The spread-loss route of the plan search (issue 44, item 4; :func:`fxstab.plan_precision`):
groups of operators promoted, their impact on the outputs measured, bisected along graph order.
The search (:class:`fxstab.plan.search.PlanSearch`) evaluates the candidates."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["Bisection", "SPREAD_MARGIN"]

# on the bisection route a candidate keeps the target when its digits less this many of the
# estimator's standard errors do: measured on the spread cases (0.011 and 0.022 digits for
# 1024 and 512 output elements), the seeds' readings of one plan lie within about one of each
# other. The local route's candidates differ by whole digits: there the margin only bloats
# plans (the fp8 case: 12 operators instead of 2 for the same digits with seeds 0-3), and the
# re-checks catch what the seed hid
SPREAD_MARGIN = 1.0


def _residual(digits: float) -> float:
    """The squared relative error ``digits`` stands for (independent roundings' errors add in
    it): 10^(-2 d); a NaN/inf is an infinite error."""
    return math.inf if not math.isfinite(digits) else 10.0 ** (-2.0 * digits)


class _Group:
    """Operators in graph order promoted together, and the share of the outputs' residual
    error promoting them removes (``gain``); ``fixed``: splitting it breaks an edge that
    matters (each half alone removes less than half of what both do)."""

    def __init__(self, ops: list, gain: float) -> None:
        self.ops, self.gain, self.fixed = ops, max(gain, 0.0), False


class Bisection:
    """The spread-loss route (issue 44 item 4): the impact of groups of operators on the
    outputs, measured by ablation (the candidate plan that promotes the group; common random
    numbers, so the difference is the group's) and bisected along graph order, the more
    expensive group of the cheapest selection first, so that a loss spread over the model costs
    O(log n) analysed calls.

    A group's impact is the residual error (:func:`_residual`) its promotion removes; a split
    measures one half and infers the other (the errors add) unless the measured half took
    less than 20% or more than 80% of the group's, then measures it too. The selection ranks
    groups by impact per extra cost (the cost model) and takes them until the predicted
    residual meets the target; the union is then checked (one call), groups added until it
    holds, and the most expensive dropped while it still does."""

    def __init__(self, search: Any, base: Any, full: Any,
                 forward: list, extra_cost: dict) -> None:
        self.search, self.forward, self.extra = search, forward, extra_cost
        self.r0 = _residual(base.digits)
        search.margin = SPREAD_MARGIN  # candidates compared with the estimator's margin
        self.margin = SPREAD_MARGIN * base.spread  # the selection aims this much higher
        self.groups = [_Group(list(forward), self.r0 - _residual(full.digits))]

    def cost(self, group: _Group) -> float:
        return sum(self.extra.get(n, 0.0) for n in group.ops)

    def ranked(self) -> list:
        tiny = 1e-30 + 1e-9 * max((self.cost(g) for g in self.groups), default=0.0)
        return sorted(self.groups, key=lambda g: -g.gain / max(self.cost(g), tiny))

    def selection(self, target: float) -> list:
        need, chosen = self.r0 - _residual(target + self.margin), []
        for g in self.ranked():
            if need <= 0:
                break
            chosen.append(g)
            need -= g.gain
        return chosen

    def removes(self, ops: list) -> float:
        return self.r0 - _residual(self.search.evaluate(ops).digits)

    def split(self, group: _Group) -> None:
        ops = group.ops
        mid = len(ops) // 2
        paths = [self.search.paths.get(n, "") for n in ops]
        # the module boundary nearest the middle (a quarter either way), else the middle
        lo, hi = max(1, mid - len(ops) // 4), min(len(ops), mid + len(ops) // 4 + 1)
        cuts = [i for i in range(lo, hi) if paths[i] != paths[i - 1]]
        if cuts:
            mid = min(cuts, key=lambda i: abs(i - len(ops) / 2))
        a, b = ops[:mid], ops[mid:]
        ga = self.removes(a)
        if 0.2 * group.gain <= ga <= 0.8 * group.gain:
            gb = group.gain - ga
        else:
            gb = self.removes(b)
            if ga + gb < 0.5 * group.gain:
                group.fixed = True
                return
        i = self.groups.index(group)
        self.groups[i:i + 1] = [_Group(a, ga), _Group(b, gb)]

    def run(self, target: float, split_until: int, trim_until: int) -> tuple:
        """(promoted, evaluation) meeting ``target`` if the calls allow: splits while the
        search has made fewer than ``split_until`` calls, trims while fewer than
        ``trim_until``."""
        search = self.search
        while search.runs < split_until and not search.exhausted:
            pending = [g for g in self.selection(target) if len(g.ops) > 1 and not g.fixed]
            if not pending:
                break
            self.split(max(pending, key=self.cost))
        chosen = self.selection(target)
        order = {n: i for i, n in enumerate(self.forward)}

        def union(groups: list) -> list:
            return sorted({n for g in groups for n in g.ops}, key=order.__getitem__)

        promoted = union(chosen)
        ev = search.evaluate(promoted)
        rest = [g for g in self.ranked() if g not in chosen]
        while not search.meets(ev, target) and rest and not search.exhausted:
            # the groups' gains do not add up exactly (a rounding's error grows through the
            # operators after it): scale what is still needed by what the union removed
            # against what its groups predicted, and add groups until that is covered
            predicted = sum(g.gain for g in chosen)
            removed = self.r0 - _residual(ev.digits)
            scale = removed / predicted if predicted > 0 and removed > 0 else 0.5
            need = (_residual(ev.digits) - _residual(target + self.margin)) / max(scale, 1e-3)
            added = 0
            while rest and (need > 0 or not added):  # one group at least: each round a call
                g = rest.pop(0)
                chosen.append(g)
                need -= g.gain
                added += 1
            promoted = union(chosen)
            ev = search.evaluate(promoted)
        for g in sorted(chosen, key=self.cost, reverse=True):  # the dearest first
            if not search.meets(ev, target) or search.runs >= trim_until or search.exhausted:
                break
            if len(chosen) < 2:
                break
            trial_groups = [c for c in chosen if c is not g]
            trial = search.evaluate(union(trial_groups))
            if search.meets(trial, target):
                chosen, promoted, ev = trial_groups, union(trial_groups), trial
        return promoted, ev
