"""The digits a plan's candidate keeps at the checked outputs (the search's criterion and
metric): of the model's floating outputs (:func:`outputs_digits`) or of named operators
(:func:`operators_digits`). Its own module: the search (``search.py``) and the autocast
candidate (``autocast.py``) read them."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..digitmap.map import DigitMap

__all__ = ["CRITERIA", "METRICS", "outputs_digits", "operators_digits"]

# The digits a plan's keep is in (plan_precision's metric=): "run", the avg digits a
# round-to-nearest run in the format is expected to keep (fxstab.numerics.digits.run_digits: an
# estimate, compared with the real run), or "avg", CESTAC's avg digits (a 95% bound on them)
METRICS = ("run", "avg")


def operators_digits(dmap: DigitMap, names: Sequence[str], metric: str = "avg") -> float:
    """The ``metric`` digits (avg: CESTAC's; run: those a round-to-nearest run is expected to
    keep) of the named operators, weighted by their elements (``-inf`` where one holds a
    NaN/inf)."""
    missing = [n for n in names if n not in dmap]
    if missing:
        raise ValueError(f"outputs: no operator named {missing[0]!r} in the digit map (names "
                         f"look like {next(iter(dmap.operators), '?')!r})")
    if any(dmap[n].non_finite for n in names):
        return -math.inf
    total = sum(dmap[n].digits(metric) * dmap[n].numel for n in names)
    numel = sum(dmap[n].numel for n in names)
    return total / numel if numel else math.nan


# The criteria a plan's outputs are held to (plan_precision's criterion=): the digits of every
# output element (CESTAC's, over the samples), averaged ("mean"), their 5% quantile ("p5":
# 95% of the elements keep at least keep digits) or their minimum ("min": every element). A
# NaN/inf in any output sample fails every criterion.
CRITERIA = ("mean", "p5", "min")


def outputs_digits(graphs: Sequence, fmt: Any, criterion: str = "mean",
                    spread: bool = False, estimate: str = "avg") -> Any:
    """The digits of the floating outputs under ``criterion`` (:data:`CRITERIA`) of the graph
    the model's output comes from, or with graph breaks the least over the graphs: the samples
    restart from the deterministic values at each graph's inputs, so a loss inside an earlier
    graph shows only at that graph's own outputs. ``-inf`` where any output sample is NaN/inf:
    no average hides it. With ``spread``, (digits, the estimator's standard error: the
    elements' standard deviation over the square root of their count, of that graph). With
    ``estimate="run"`` the digits are those a round-to-nearest run is expected to keep
    (:func:`~fxstab.numerics.digits.run_digits`), not CESTAC's bound."""
    from torch.utils import _pytree as pytree

    from ..numerics.digits import cestac_digits, run_digits

    per_element = run_digits if estimate == "run" else cestac_digits

    per_graph = []
    for outputs in graphs:
        digits = []
        for leaf in pytree.tree_leaves(outputs):
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and \
                    leaf.dim() >= 1 and leaf.numel() > 0:
                if not bool(torch.isfinite(leaf).all()):
                    return (-math.inf, 0.0) if spread else -math.inf
                digits.append(per_element(leaf.to(torch.float64), fmt).reshape(-1))
        if digits:
            d = torch.cat(digits)
            se = float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else 0.0
            per_graph.append((float(d.mean()) if criterion == "mean" else float(d.min())
                              if criterion == "min" else float(torch.quantile(d, 0.05)), se))
    if not per_graph:
        raise RuntimeError("the model's outputs hold no floating tensor: name the operators to "
                           "check with outputs=[...]")
    worst = min(per_graph)
    return worst if spread else worst[0]
