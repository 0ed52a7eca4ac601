"""The findings of a digit map (:meth:`fxstab.DigitMap.findings`): what to look at first, one
line each with a hint, NaN/inf origins first, then local losses ranked by what they cost the
outputs where impacts were measured (docs/design.md §7), notes last. The functions take the
map (``dm``) as their first argument; the map's methods call them.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from .hints import (MIN_FINDING, MIN_UNDERFLOW, UNDERFLOW_HINT, ZERO_FINDING, hint, norm_step,
                    primitive_of)
from .operators import (
    OperatorDigits,
    check_metric,
    digit_budget_findings,
    effective_digits,
    operand_findings,
    source_code,
)

__all__ = ["findings", "zero_readers", "NO_FINDINGS", "ACCUMULATOR_HINT", "impact_or_0",
           "at_line", "gradient_hint", "mechanism_hint", "ROOT_GRADIENT_HINT",
           "UNSELECTED_BRANCH_HINT"]

# what an empty :meth:`DigitMap.findings` means (MIN_FINDING of the cap: a quarter)
NO_FINDINGS = "none (no NaN/inf origin, no operator losing a quarter of the cap or more)"
ACCUMULATOR_HINT = ("accumulate in fp32, or promote the partial sums into fp32 every 128 "
                    "elements of K (accumulate='fp8-promoted')")


def at_line(op: OperatorDigits, width: int = 60) -> str:
    """Where the user wrote operator ``op``: ``, model.py:17 `y = torch.log(p)``` (the file's
    name, the line and its code, cut to ``width``); "" where the map has no source."""
    path, _, line = op.source.rpartition(":")
    if not path or not line.isdigit():
        return ""
    code = op.code or source_code(op.source)
    if len(code) > width:
        code = code[:width - 3] + "..."
    return f", {path.replace(chr(92), '/').rpartition('/')[2]}:{line}" + \
        (f" `{code}`" if code else "")


# forward kinds whose gradient is infinite where their argument is 0 (a root, a norm) and
# overflows where it is large (a power above 1)
_ROOT_KINDS = {"pow", "sqrt", "rsqrt", "norm", "vector_norm", "linalg_vector_norm", "normalize",
               "float_power"}
ROOT_GRADIENT_HINT = ("the gradient of a root or a norm is infinite where its argument is 0 (of "
                      "a power above 1, it overflows where the argument is large): put an eps "
                      "inside the root (sqrt(s + eps)), or use torch.linalg.vector_norm, whose "
                      "gradient at 0 is 0")
UNSELECTED_BRANCH_HINT = ("a gradient through the branch torch.where did not select: its "
                          "function overflowed there in the forward ({forward} holds NaN/inf "
                          "the where dropped), and 0 x inf is NaN in the backward: mask the "
                          "argument before the function (torch.exp(torch.where(a <= 0, a, "
                          "0)), not after it")


def gradient_hint(dm: Any, op: OperatorDigits) -> Optional[str]:
    """The remedy for NaN/inf first appearing in a gradient, from what its forward operator
    (``X`` of ``X/grad/...``) did: a root or norm (:data:`ROOT_GRADIENT_HINT`), a function that
    overflowed on a side a ``where`` dropped (its NaN/inf absorbed in the forward:
    :data:`UNSELECTED_BRANCH_HINT`); None otherwise (the kind's hint applies)."""
    if op.direction != "backward" or "/grad/" not in op.name:
        return None
    forward = dm.operators.get(op.name.split("/grad/")[0])
    if forward is None:
        return None
    if forward.non_finite and forward.name in dm.absorbed_nonfinite():
        return UNSELECTED_BRANCH_HINT.format(forward=forward.name)
    if forward.kind in _ROOT_KINDS:
        return ROOT_GRADIENT_HINT
    return None


# softmax-like operators subtract the max themselves: "subtract the max" is no remedy for them
_SHIFTED_EXP_KINDS = {"softmax", "log_softmax", "logsumexp", "_softmax", "_log_softmax",
                      "scaled_dot_product_attention"}
_LOG_KINDS = {"log", "log2", "log10"}
# products whose output, read by a softmax directly, is a dot product nobody scaled
_DOT_KINDS = {"matmul", "bmm", "mm", "einsum", "baddbmm"}
_EXP_KINDS = {"exp", "exp2"}


def mechanism_hint(dm: Any, op: OperatorDigits, nonfinite: bool = False) -> str:
    """The remedy for ``op`` from what the map shows around it, before its kind's
    (:func:`~fxstab.digitmap.hints.hint`): a softmax (which subtracts the max itself) is told
    where its large logits come from (an unscaled dot product, or their producer); a log that
    meets zeros, which operator underflowed to them; an exp that overflows, which operator
    made its argument large; a normalization (one operator: a library kernel, whose statistics
    are fp32 already) that centres a large common offset, which operator rounded the input
    whose digits it exposes. A verified fix of the map (``fxstab fix``) that covers the
    operator is named last."""
    inputs = [dm.operators[i] for i in op.inputs if i in dm.operators]
    text = None
    if op.kind in _SHIFTED_EXP_KINDS and inputs:
        src = min(inputs, key=lambda i: effective_digits(i))
        if src.kind in _DOT_KINDS:
            text = (f"its logits come straight from {src.name}, a dot product nobody scaled: "
                    f"{op.kind} already subtracts the max, so what it loses is the logits' own "
                    f"rounding, which grows with their magnitude: scale the product "
                    f"(1/sqrt(d), as scaled_dot_product_attention does) or compute it in fp32")
        else:
            text = (f"{op.kind} already subtracts the max: what it loses is the rounding of "
                    f"its logits ({src.name}), which grows with their magnitude: scale them "
                    f"down (a temperature, 1/sqrt(d)) or compute them in fp32")
    elif op.kind in _LOG_KINDS and nonfinite:
        under = [i for i in inputs if i.underflow]
        if under:
            src = under[0]
            text = (f"log of zeros: {src.name} underflowed ({src.underflow} of {src.numel} "
                    f"elements rounded below the format's smallest normal) and the log meets "
                    f"the 0s: compute in log space (log_softmax, logsigmoid, logsumexp), or "
                    f"keep {src.name} in fp32")
    elif not nonfinite and inputs and primitive_of(op) is None and \
            norm_step(op) == "centring":
        # the digits of the spread were lost where the input was rounded: the normalization
        # in fp32 keeps no more (tests/test_hints.py analyses both remedies)
        src = min(inputs, key=lambda i: effective_digits(i))
        where = at_line(src).removeprefix(", ")
        text = (f"near-constant normalization: its input, from {src.name}, has a mean large "
                f"against its spread, and centring exposes the digits of the spread lost "
                f"where {src.name} rounded it ({op.kind} in fp32 keeps no more): keep "
                f"{src.name} in fp32{f' ({where})' if where else ''}, or remove the common "
                f"offset before it")
    elif op.kind in _EXP_KINDS and nonfinite and inputs:
        src = inputs[0]
        text = (f"overflow: its argument, from {src.name}, is too large for the format: "
                f"subtract the max first (softmax, logsumexp), scale {src.name} down, or "
                f"compute the exponential in fp32")
    text = text or hint(op, nonfinite=nonfinite)
    fix = next((f for f in dm.fixes() if f.verified and
                (f.operator == op.name or op.name in f.findings)), None)
    if fix is not None:
        text += f"; verified fix at {fix.source}: {fix.replacement}"
    return text


def impact_or_0(op: OperatorDigits) -> float:
    """An operator's impact on the outputs, 0 where not measured."""
    return 0.0 if math.isnan(op.impact) else op.impact


def findings(dm: Any, top: int = 3, metric: Optional[str] = None) -> list[str]:
    """What to look at first, one line each with a hint: where NaN/inf first appear, then
    the largest local losses (:meth:`DigitMap.localize`) and underflow; last, as notes, NaN/inf that
    the program absorbs before any output (:meth:`DigitMap.absorbed_nonfinite`).

    The empty list is the healthy answer: no NaN/inf origin, no operator losing a quarter
    of the cap or more (:data:`NO_FINDINGS` says so in words); :meth:`DigitMap.summary` gives the
    text ``fxstab show`` prints in either case."""
    metric = check_metric(metric)
    out = []
    ranked = dm.localize(metric)
    for r in ranked:
        if r.nonfinite_origin:
            op = dm.operators[r.name]
            out.append(f"NaN/inf first appear at {r.name}{at_line(op)} ({op.non_finite} of "
                       f"{op.numel} elements): "
                       f"{gradient_hint(dm, op) or mechanism_hint(dm, op, nonfinite=True)}")
    # an operator of exact inputs is compared with the cap, which its own rounding already
    # costs ~0.6 bf16 digits: a finding only when it keeps less than half the cap
    # a modelled GEMM whose accumulator keeps fewer digits than its samples' spread shows
    # (a bias, a nearest or directed accumulator's): its own finding, with its fix
    biased = dm.biased_accumulators(metric)
    for op, own, acc in biased[:top]:
        out.append(f"the accumulator of {op.name} keeps only {acc:.2f} {metric} digits of "
                   f"its exact sum, against {own:.2f} estimated from the samples' spread "
                   f"(it rounds every sample alike: a bias the spread cannot show): "
                   f"{ACCUMULATOR_HINT}")
    if len(biased) > top:
        out.append(f"the accumulators of {len(biased) - top} more GEMM(s) keep fewer "
                   f"digits than their spread shows (the table's acc column)")
    # a GEMM recipe: where its digits go (operands or accumulator), operands that underflow
    out += digit_budget_findings(dm.operators.values(), dm.cap)[:top]
    out += operand_findings(dm.operators.values())[:top]
    named = {op.name for op, _, _ in biased}  # each said once, as its accumulator's
    losses = [r for r in ranked
              if not r.nonfinite_origin and r.local_loss >= MIN_FINDING * dm.cap
              and (r.worst_input is not None or r.digits < 0.5 * dm.cap)
              and r.name not in named]
    impact = dm.impact_threshold()
    if impact is not None:  # measured (fxstab.impact): what costs the outputs leads
        # a local loss costs the outputs what the rounding it amplifies costs them: its
        # own, or its least accurate input's (a cancellation amplifies the rounding of
        # the addition before it; a computational zero's input costs nothing)
        cost = {r.name: max(impact_or_0(dm.operators[r.name]),
                            impact_or_0(dm.operators[r.worst_input])
                            if r.worst_input in dm.operators else 0.0) for r in losses}
        harmless = [r for r in losses if cost[r.name] < impact]
        losses = sorted((r for r in losses if cost[r.name] >= impact),
                        key=lambda r: -cost[r.name])
    else:  # not measured: a computational zero whose readers keep their digits is no loss
        readers = {r.name: dm.zero_readers(r.name, r.reference, metric) for r in losses}
        harmless = [r for r in losses if readers[r.name]]
        losses = [r for r in losses if not readers[r.name]]
    for r in losses[:top]:
        op = dm.operators[r.name]
        src = f"{r.worst_input}" if r.worst_input else "the format's cap"
        cost_text = "" if impact is None else \
            f"; the outputs lose {cost[r.name]:.2f} digits to the rounding it amplifies"
        out.append(f"digits are lost at {r.name}{at_line(op)}: {r.digits:.2f} {metric} "
                   f"digits against "
                   f"{r.reference:.2f} of {src} (local loss {r.local_loss:.2f}{cost_text}): "
                   f"{mechanism_hint(dm, op)}")
    for op in dm.operators.values():
        if op.numel and op.underflow >= MIN_UNDERFLOW * op.numel:
            out.append(f"underflow at {op.name}{at_line(op)}: {op.underflow} of {op.numel} "
                       f"elements fell "
                       f"below the format's smallest normal: {UNDERFLOW_HINT}")
            break
    for r in harmless[:top]:
        op = dm.operators[r.name]
        zero = op.zero_fraction >= ZERO_FINDING
        if impact is not None:
            out.append(f"note: {r.name} loses {r.local_loss:.2f} {metric} digits against "
                       f"its input, but the rounding it amplifies costs the outputs "
                       f"{cost[r.name]:.2f} digits (below {impact:g}): harmless here"
                       + (" (a computational zero)" if zero else ""))
        else:
            names = readers[r.name]
            out.append(f"note: {r.name} is a computational zero ({op.zero_fraction:.0%} of "
                       f"its elements; local loss {r.local_loss:.2f}), and its readers keep "
                       f"the digits it lost ({', '.join(names[:2])}"
                       + (f" and {len(names) - 2} more" if len(names) > 2 else "")
                       + "): harmless here")
    for origin, (_, absorbers) in dm.absorbed_nonfinite().items():
        op = dm.operators[origin]
        by = f"absorbed by {', '.join(absorbers)} before any output (as an additive " \
             f"mask of fp32's finfo.min is, rounded to -inf in bf16 or fp16, or the side of " \
             f"a torch.where it did not select)" if absorbers \
            else "absorbed: they reach only integer results, comparisons or masks (the " \
                 "log of a relative position 0 cast to an integer bucket)"
        out.append(f"note: NaN/inf appear at {origin} ({op.non_finite} of {op.numel} "
                   f"elements) and are {by}: what a real run in "
                   f"{op.format or dm.metadata.get('format')} computes, not a finding")
    return out


def zero_readers(dm: Any, name: str, reference: float,
                 metric: Optional[str] = None) -> list[str]:
    """The readers that keep the digits a computational zero lost: where operator
    ``name`` is one (at least :data:`~fxstab.digitmap.hints.ZERO_FINDING` of its elements)
    and every operator reading it, through readers that are computational zeros too (the
    mean's division of its row sum), keeps at least ``reference`` digits less the findings'
    margin, those readers (the LayerNorm's ``x - mean`` after the mean of a centred input);
    else ``[]``: an output, or a reader that passes the loss on (a division by it)."""
    if dm.operators[name].zero_fraction < ZERO_FINDING:
        return []
    consumers = dm.consumers()
    keep = reference - MIN_FINDING * dm.cap
    found: list[str] = []
    pending, seen = list(consumers[name]), {name}
    if not pending:
        return []
    while pending:
        reader = pending.pop(0)
        if reader in seen:
            continue
        seen.add(reader)
        op = dm.operators[reader]
        if op.zero_fraction >= ZERO_FINDING:
            if not consumers[reader] or len(seen) > 16:
                return []  # a zero that reaches an output (or too far to follow)
            pending += consumers[reader]
        elif effective_digits(op, metric) >= keep:
            found.append(reader)
        else:
            return []
    return found
