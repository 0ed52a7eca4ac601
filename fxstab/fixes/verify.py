"""Fixes proposed and proven: :func:`suggest_fixes` analyses a program, tries the rewrites of
the table (:mod:`fxstab.fixes.registry`) that match at or next to its findings, and keeps
those that the real run in the format confirms (:class:`Fix`, ``verified``; the record is
:mod:`fxstab.digitmap.fixrecord`'s, so that a digit map can keep it: :func:`analyse_fixes`
returns the analysis's map with its fixes, ``dm.fixes()``).

For each candidate the program is compiled again with that one rewrite applied to its
captured graph (:class:`~fxstab.fixes.graph.RewriteBackend`): once under the analysis (the
same options and seed as the first analysis: common random numbers, so the two maps differ by
the rewrite alone) and once for real in the format, against an fp64 run of the same weights
and inputs, as :func:`fxstab.check_plan` measures a plan (a copy of the model cast to the
format, the inputs too; true digits at the outputs, a NaN/inf counting 0 digits).
"""

from __future__ import annotations

import copy
import linecache
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch.utils import _pytree as pytree

from ..backend import backend as make_backend
from ..capture.naming import source_location
from ..capture.opsets import DEFAULT_KINDS, EXACT_KINDS, FAMILIES, known_kind, target_kind
from ..digitmap.fixrecord import Fix
from ..digitmap.hints import MIN_FINDING, MIN_UNDERFLOW
from ..digitmap.map import DigitMap
from ..numerics.digits import cestac_digits
from ..numerics.formats import Format, get_format, torch_dtype_of
from ..plan.apply import output_non_finite, output_true_digits
from ..plan.inputs import as_inputs
from .graph import RewriteBackend, Site
from .registry import Call, Match

__all__ = ["Fix", "FixSearch", "suggest_fixes", "search_fixes", "analyse_fixes", "MIN_GAIN"]

# a rewrite that removes no NaN/inf must gain this many digits at the outputs of the real run
# (a different but no better order of roundings moves the average by a few hundredths)
MIN_GAIN = 0.2


@dataclass
class _Analysed:
    dm: DigitMap
    digits: float
    nonfinite: int
    rewriter: RewriteBackend
    names: list  # per graph: node name -> operator name


@dataclass
class _Real:
    digits: float
    nonfinite: int
    numel: int
    rewriter: RewriteBackend


def _sample_digits(outputs: Any, fmt: Format) -> tuple[float, int]:
    """The avg CESTAC digits of a graph's floating output samples (``[N, *shape]``; an
    element with a NaN/inf sample counts 0) and the number of such elements."""
    total = numel = bad = 0
    for leaf in pytree.tree_leaves(outputs):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() >= 1 \
                and leaf.numel() > 0 and leaf.shape[0] >= 2:
            s = leaf.detach().to(torch.float64)
            finite = torch.isfinite(s).all(0)
            d = torch.where(finite, cestac_digits(torch.nan_to_num(s), fmt), 0.0)
            total += float(d.sum())
            numel += d.numel()
            bad += int((~finite).sum())
    return (total / numel if numel else math.nan), bad


def _params(model: Any) -> list:
    return list(model.parameters()) if isinstance(model, torch.nn.Module) else []


def _with_gradients(fn: Callable, inputs: tuple, params: list) -> tuple:
    """``(outputs, gradients)``: ``fn``'s outputs, and the gradients of their sum with
    respect to the floating inputs and ``params`` (0 where unused), taken with
    ``torch.autograd.grad`` (no ``.grad`` of the model is written)."""
    ins = tuple(t.detach().requires_grad_() if isinstance(t, torch.Tensor) and
                t.is_floating_point() else t for t in inputs)
    wrt = [t for t in ins if isinstance(t, torch.Tensor) and t.requires_grad] + \
        [p for p in params if p.requires_grad]
    with torch.enable_grad():
        y = fn(*ins)
        outs = [t for t in pytree.tree_leaves(y) if isinstance(t, torch.Tensor) and
                t.is_floating_point() and t.requires_grad]
        grads = torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs],
                                    allow_unused=True) if outs and wrt else ()
    grads = tuple(torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt))
    return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y), grads


def _analyse(model: Any, inputs: tuple, fmt: Format, options: dict,
             sites: Sequence[Site]) -> _Analysed:
    """The analysis of ``model`` with the rewrites at ``sites`` applied (with
    ``backward=True``, of its backward too: the gradients of the outputs' sum)."""
    torch._dynamo.reset()
    with warnings.catch_warnings():  # the backend's notes (coverage): fixes are not about them
        warnings.simplefilter("ignore", UserWarning)
        be = make_backend(format=fmt, **options)
        rewriter = RewriteBackend(sites, inner=be, format=fmt)
        compiled = torch.compile(model, backend=rewriter)
        with be.capture_samples() as cap:
            if options.get("backward"):
                _with_gradients(compiled, inputs, _params(model))
            else:
                with torch.no_grad():
                    compiled(*inputs)
        dm = be.digit_map()
    if not be.reports and not sites:
        raise RuntimeError("the analysis recorded no operator: nothing to fix (is the model a "
                           "torch.nn.Module or function torch.compile can capture?)")
    if be.reports:
        digits, bad = _sample_digits(cap.graphs[-1] if cap.graphs else (), fmt)
    else:  # the rewrite left no operator that rounds ((a + c) - c is a): the outputs are exact
        digits, bad = fmt.digit_cap, 0
    names = [{p.node.name: p.name for p in g.plans} for g in be.graphs]
    return _Analysed(dm, digits, bad, rewriter, names)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                           and t.is_floating_point() else t, value)


def _as(model: Any, dtype: torch.dtype) -> Any:
    """A copy of ``model`` in ``dtype`` (a function: itself; its inputs are cast)."""
    return copy.deepcopy(model).to(dtype) if isinstance(model, torch.nn.Module) else model


def _real(model: Any, inputs: tuple, fmt: Format, sites: Sequence[Site],
          backward: bool = False) -> _Real:
    """The real run in the format with the rewrites at ``sites``, against fp64: its outputs
    (with ``backward``, and the gradients of their sum: :func:`_with_gradients`)."""
    low = torch_dtype_of(fmt.name)
    lowered = _as(model, low)
    xs = _cast(inputs, low)
    ref_model, run_model = _as(lowered, torch.float64), _as(lowered, low)
    torch._dynamo.reset()
    rewriter = RewriteBackend(sites, format=fmt)
    compiled = torch.compile(run_model, backend=rewriter)
    if backward:
        ref = _with_gradients(ref_model, _cast(xs, torch.float64), _params(ref_model))
        y = _with_gradients(compiled, xs, _params(run_model))
    else:
        with torch.no_grad():
            ref = ref_model(*_cast(xs, torch.float64))
            y = compiled(*xs)
    bad, numel = output_non_finite(y)
    return _Real(output_true_digits(y, ref, fmt.digit_cap), bad, numel, rewriter)


def _kinds(call: Any) -> set:
    """The operator kinds of a stable form (its calls, nested ones included)."""
    if not isinstance(call, Call):  # an operand of the formula itself
        return set()
    out = {target_kind("call_function", call.fn)}
    for a in (*call.args, *call.kwargs.values()):
        if isinstance(a, Call):
            out |= _kinds(a)
    return out


def _selecting(options: dict, match: Match) -> dict:
    """The analysis options with the stable form's operators selected where the default
    selection leaves them out (``torch.linalg.vector_norm``): a rewrite's digits are then
    measured, not merely run. A selection the user gave is kept as it is."""
    extra = sorted(_kinds(match.form) - DEFAULT_KINDS - EXACT_KINDS)
    if not extra or options.get("select") is not None:
        return options
    # a kind the selection does not know by name (F.logsigmoid's "log_sigmoid") as globs
    # over the operators' qualified names (module.path/kind, or kind at the root)
    select: list = [*sorted(FAMILIES), "custom"]
    for k in extra:
        select += [k] if known_kind(k) else [f"*/{k}", f"{k}*"]
    return {**options, "select": select}


def _findings(dm: DigitMap) -> list[str]:
    """The findings of the map (operators), as :meth:`DigitMap.findings` selects them: the
    NaN/inf origins, the operators losing :data:`~fxstab.digitmap.hints.MIN_FINDING` of the
    cap against their inputs (not a computational zero whose readers keep their digits),
    those with :data:`~fxstab.digitmap.hints.MIN_UNDERFLOW` of their elements underflowed."""
    out = list(dm.nonfinite_sources())
    for r in dm.localize():
        if not r.nonfinite_origin and r.local_loss >= MIN_FINDING * dm.cap and \
                (r.worst_input is not None or r.digits < 0.5 * dm.cap) and \
                not dm.zero_readers(r.name, r.reference):
            out.append(r.name)
    out += [op.name for op in dm.operators.values()
            if op.numel and op.underflow >= MIN_UNDERFLOW * op.numel]
    return list(dict.fromkeys(out))


def _near(dm: DigitMap, names: Sequence[str]) -> set:
    """The operators ``names``, their instrumented inputs and their readers; for a backward
    operator (``exp#0/grad/mul#0``) its forward operator's too (``exp#0``: the rewrite
    changes the backward through the forward graph)."""
    readers = dm.consumers()
    out = set()
    for name in names:
        forward = name.split("/grad/")[0] if "/grad/" in name else None
        for n in (name, forward):
            if n is not None:
                out.add(n)
                if n in dm:
                    out.update(dm[n].inputs)
                    out.update(readers.get(n, ()))
    return out


def _operators(match: Match, names: dict) -> set:
    """The operators of a match's nodes; for a node the analysis does not instrument (a
    clamp is exact: it selects values), those of its inputs and readers in the graph."""
    out = set()
    for node in match.nodes:
        if node.name in names and names[node.name]:
            out.add(names[node.name])
        else:
            out.update(names[n.name] for n in (*node.all_input_nodes, *node.users)
                       if names.get(n.name))
    return out


def _operator(match: Match, names: dict) -> str:
    """The operator a match's finding names: its anchor's, else the first named node's, else
    a reader's or an input's (an exact clamp has no operator of its own)."""
    for node in (match.anchor, match.root, *match.nodes, *match.anchor.users,
                 *match.anchor.all_input_nodes):  # a reader first: where the guard acts
        if names.get(node.name):
            return names[node.name]
    return match.anchor.name


def _code(source: str) -> str:
    """The text of the line ``file.py:LINE``, stripped ("" where it cannot be read)."""
    path, _, line = source.rpartition(":")
    return linecache.getline(path, int(line)).strip() if line.isdigit() else ""


def suggest_fixes(model: Any, example_inputs: Any, format: Any = "bf16",
                  **options: Any) -> list[Fix]:
    """Stable rewrites for the findings of ``model``'s analysis, each proven on a real run.

    The model is analysed at the operator level (``fxstab.backend(format=format,
    **options)``); every rewrite of the table that matches at a finding's operator (a NaN/inf
    origin, an operator losing digits against its inputs, an underflow: the map's findings;
    and a NaN/inf the program absorbs), at its inputs or at its readers, is applied to a copy
    of the captured graph, and the program is analysed again (same seed) and run for real in
    ``format`` against fp64. Where the real run shows NaN/inf the analysis names no origin
    of, every match is tried.

    The real runs are compared with fp64 element by element: a model in training mode
    draws its dropout differently in each run; pass it in eval mode.

    Args:
        model: a ``torch.nn.Module`` (or a function) torch.compile can capture.
        example_inputs: its inputs (one tensor, or a tuple of positional inputs), in the
            regime to fix (large logits, say).
        format: the format of the analysis and of the real run: one torch computes in
            (``"fp16"``, ``"bf16"``).
        **options: the analysis's options (``fxstab.backend``'s: ``seed``, ``n_samples``,
            ``select``...). ``backward=True`` analyses the backward too (the gradients of
            the outputs' sum), and the real run measures those gradients beside the
            outputs: a rewrite that removes a NaN of the backward alone (a ``where`` over
            an overflowing branch, a root at 0) is verified there.

    Returns:
        One :class:`Fix` per rewrite tried: the verified ones first, the largest gain of the
        real run first (NaN/inf removed, then digits); an empty list where the analysis finds
        nothing to fix or no rewrite matches.
    """
    return search_fixes(model, example_inputs, format, **options)[1]


def search_fixes(model: Any, example_inputs: Any, format: Any = "bf16",
                 **options: Any) -> tuple[list[str], list[Fix]]:
    """:func:`suggest_fixes`, with the findings it looked for fixes around (operator names,
    in the map's order): what ``fxstab fix`` needs to say which findings no verified fix
    covers (a fix covers the findings of its :attr:`Fix.findings`)."""
    return analyse_fixes(model, example_inputs, format, **options)[1:]


class FixSearch(NamedTuple):
    """What :func:`analyse_fixes` found: the analysis's digit map, holding the fixes
    (``map.fixes()``), the findings looked for fixes around, and the fixes."""

    map: DigitMap
    findings: list
    fixes: list


def analyse_fixes(model: Any, example_inputs: Any, format: Any = "bf16",
                  **options: Any) -> FixSearch:
    """:func:`search_fixes`, with the analysis's digit map (the program as written) carrying
    the fixes: ``map.fixes()``, saved with the map and shown on its page
    (:func:`fxstab.plots.html.map_page`); what ``fxstab fix --html/--save`` writes."""
    fmt = get_format(format)
    if torch_dtype_of(fmt.name) is None:
        raise ValueError(f"format {fmt.name!r} is not a dtype torch computes in: the real run "
                         f"that verifies a fix needs fp16, bf16 or fp32")
    if options.get("granularity", "op") != "op":
        raise ValueError("suggest_fixes rewrites the operator-level graph: leave granularity "
                         f"at 'op' (got {options['granularity']!r})")
    if isinstance(example_inputs, dict):
        raise ValueError("suggest_fixes takes positional inputs (a tensor or a tuple), got a "
                         "dict of keyword inputs: wrap the model in a module whose forward "
                         "takes them in order")
    inputs = as_inputs(example_inputs)
    backward = bool(options.get("backward"))
    base = _analyse(model, inputs, fmt, options, ())
    real = _real(model, inputs, fmt, (), backward)
    findings = _findings(base.dm)
    # where the program absorbs a NaN/inf before an output (a norm that overflows to inf
    # divides a vector to 0), a rewrite is looked for too: a note of the map, no finding
    around = {f: _near(base.dm, [f]) for f in [*findings, *base.dm.absorbed_nonfinite()]}
    unexplained = bool(real.nonfinite) and not base.dm.nonfinite_sources()
    tried: dict = {}
    for gi, matches in enumerate(base.rewriter.matches):
        names = base.names[gi] if gi < len(base.names) else {}
        for m in matches:
            near = tuple(f for f in around if around[f] & _operators(m, names))
            if near or unexplained:
                tried.setdefault(Site(gi, m.rewrite, m.root.name), (m, names, near))
    fixes: dict = {}
    for site, (m, names, near) in tried.items():
        fixes.update(_attempt(model, inputs, fmt, options, {site: tried[site]}, base, real,
                              backward))
    # one rewrite at several places, none of which alone removes every NaN/inf (a naive
    # softmax in every layer): tried together, each place's Fix then the run with all of
    # them where that run does better than the best place alone
    for name in dict.fromkeys(site.rewrite for site in tried):
        group = {site: c for site, c in tried.items() if site.rewrite == name}
        alone = [fixes[s] for s in group if s in fixes]
        if len(group) < 2 or not alone or min(f.nonfinite_after for f in alone) == 0:
            continue
        together = _attempt(model, inputs, fmt, options, group, base, real, backward)
        best = min(alone, key=lambda f: (f.nonfinite_after, -f.real_after))
        if together and all(f.verified for f in together.values()) and (
                next(iter(together.values())).nonfinite_after < best.nonfinite_after):
            fixes.update(together)
    ranked = sorted(fixes.values(), key=lambda f: (not f.verified,
                                                   f.nonfinite_after - f.nonfinite_before,
                                                   f.real_before - f.real_after))
    dm = base.dm
    return FixSearch(DigitMap(dm.operators.values(), dm.metadata, dm.steps, ranked),
                     findings, ranked)


def _attempt(model: Any, inputs: tuple, fmt: Format, options: dict, group: dict,
             base: _Analysed, real: _Real, backward: bool) -> dict:
    """The rewrites at the sites of ``group`` (site -> (match, names, findings)), applied
    together: site -> its :class:`Fix`; none where the stable form fails to run (a warning
    names it)."""
    sites = list(group)
    match = group[sites[0]][0]
    try:
        after = _analyse(model, inputs, fmt, _selecting(options, match), sites)
        real_after = _real(model, inputs, fmt, sites, backward)
    except Exception as e:  # a stable form the program's shapes or dtypes refuse
        warnings.warn(f"fxstab: the rewrite {sites[0].rewrite} ({match.code()}) failed to run "
                      f"in the program and was skipped: {type(e).__name__}: {e}",
                      UserWarning, stacklevel=3)
        return {}
    applied = all(s in after.rewriter.applied and s in real_after.rewriter.applied
                  for s in sites)
    return {site: _fix(site, *group[site], base, real, after, real_after, applied, fmt)
            for site in sites}


def _fix(site: Site, match: Match, names: dict, findings: tuple, base: _Analysed,
         real: _Real, after: _Analysed, real_after: _Real, applied: bool, fmt: Format) -> Fix:
    """One place's :class:`Fix`: judged by the runs with its rewrite against the base."""
    operator = _operator(match, names)
    # the line the stable form is written at: the root's (the finding's operator may stand
    # on an earlier line, as the exp of ``w = exp(s)`` before ``w / w.sum(-1, keepdim=True)``)
    root = names.get(match.root.name) or ""
    source = base.dm[root].source if root in base.dm else ""
    source = source or source_location(match.root)
    verified = applied and real_after.nonfinite <= real.nonfinite and \
        after.nonfinite <= base.nonfinite and \
        (real_after.nonfinite < real.nonfinite or
         real_after.digits >= real.digits + MIN_GAIN)
    # the map's own record of the line's text where it has one, else the file's line
    code = (getattr(base.dm[root], "code", "") if root in base.dm else "") or _code(source)
    return Fix(operator=operator, rewrite=site.rewrite, source=source, code=code,
               replacement=match.code(), before=base.digits, after=after.digits,
               real_before=real.digits, real_after=real_after.digits,
               nonfinite_before=real.nonfinite, nonfinite_after=real_after.nonfinite,
               verified=bool(verified), numel=real.numel, format=fmt.name,
               findings=findings)
