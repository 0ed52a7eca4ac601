"""Hints: the findings' thresholds, the table legend and a one-line remedy per operator kind.

An operator's kinds are the operator level's names (the sets below) and, at the arithmetic
level, its primitives', whose rows (:func:`fxstab.rules.aten.primitives.rule_of`) say what they
are: a GEMM (its path), a cancellation (its counters read the output's digits), a division
(its family).
"""

from __future__ import annotations

from typing import Optional

from ..capture.opsets import GEMM_KINDS
from ..rules.aten.kinds import GEMM_PRIMITIVES
from ..rules.aten.primitives import rule_of
from .operators import OperatorDigits

# A local loss below this fraction of the cap is the cost of a rounding or two (a bf16 GEMM of
# exact inputs keeps ~1.9 of 2.41 digits), not a finding.
MIN_FINDING = 0.25
# Underflow worth a finding: at least this fraction of an operator's elements.
MIN_UNDERFLOW = 0.01
LEGEND = ("legend: digits are the CESTAC estimate of the reliable significant digits of an "
          "output, at most the cap ({cap:.2f}); normwise: the tensor as a whole; p10/p50: "
          "quantiles of the elements' digits; run: the avg digits a round-to-nearest run is "
          "expected to keep (an estimate to compare with a real run, not a bound); "
          "zero%: computational zeros (samples disagree on "
          "every digit); under: elements rounded below the smallest normal; surrogate: the "
          "GEMM's inputs were perturbed (their samples were too close to expose it)")
_INVALID_KINDS = {"div", "reciprocal", "rsqrt", "sqrt", "log", "log2", "log10", "log1p",
                  "true_divide", "floor_divide", "atanh", "acos", "asin"}
# normalizations that centre their input (x - mean): their rounding error is amplified by
# sqrt(1 + mean^2 / var), the mechanism "near-constant normalization" names
_CENTRING_KINDS = {"layer_norm", "batch_norm", "group_norm", "instance_norm", "native_layer_norm",
                   "native_batch_norm", "native_group_norm", "var", "std", "var_mean"}
# at the arithmetic level, the primitives of a centring normalization where that cancellation
# shows: the centring itself, and the statistics of its result
_CENTRING_PRIMITIVES = {"sub", "var", "var_mean", "std", "pow", "mul", "square"}
# a scale-only normalization (no centring): it loses digits only where the input's spread is
# (nearly) zero against eps or its rounding
_SCALE_NORM_KINDS = {"rms_norm", "rsqrt", "norm", "normalize"}
# at least this fraction of computational zeros: the operator's exact value is (nearly) zero
# against its terms, whatever its kind
ZERO_FINDING = 0.5
# operators that subtract or sum (a primitive: its row's counters read the output's digits)
_CANCEL_KINDS = {"add", "sub", "rsub", "iadd", "isub", "addmm", "sum", "mean", "cumsum"}
# operators that divide (a primitive: its row's family)
_DIVISION_KINDS = {"div", "reciprocal", "true_divide"}
_DIVISION_FAMILIES = {"division", "reciprocal"}
_GEMM_KINDS = GEMM_KINDS | GEMM_PRIMITIVES  # an operator's kinds, a primitive's (its row's path)
ZERO_HINT = ("computational zero (its exact value is nearly 0 against its terms, as the mean of "
             "a centred input is): harmless unless a reader divides by it, takes its log or "
             "scales it up; compute it in fp32 or reformulate where one does")
UNDERFLOW_HINT = ("scale the values up (loss scaling for gradients), or use a format with a "
                   "wider exponent (bf16) or fp32 there")


def _kinds_of(op: "OperatorDigits") -> set:
    """The operator's kind and, at the aten level, the kinds in its name (``blocks.0.attn/
    softmax#0/aten.exp#0`` is an exp inside a softmax)."""
    kinds = {op.kind}
    for part in op.name.split("/"):
        if "#" in part:  # an operator's (a module path has none; the root's is empty)
            kinds.add(part.split("#")[0].removeprefix("aten."))
    return kinds


def primitive_of(op: "OperatorDigits") -> Optional[str]:
    """The aten primitive an arithmetic-level entry is (``"sub"`` of
    ``ln/layer_norm#0/aten.sub#0``), None for an operator-level one."""
    parts = op.name.split("/")
    if not any(p.startswith("aten.") for p in parts):
        return None
    return parts[-1].split("#")[0].removeprefix("aten.")


def norm_step(op: "OperatorDigits") -> Optional[str]:
    """The step of a centring normalization the operator is: ``"centring"`` for the whole
    normalization (operator level) or, at the arithmetic level, ``x - mean`` and the statistics
    of its result, where a mean large against the spread cancels; ``"mean"`` for the mean's row
    sum, which loses digits in the opposite situation (an input already centred); None for
    another primitive."""
    primitive = primitive_of(op)
    if primitive is None:
        return "centring" if op.kind in _CENTRING_KINDS else None
    if primitive in _CENTRING_PRIMITIVES:
        return "centring"
    return "mean" if primitive in {"sum", "mean"} else None


def hint(op: "OperatorDigits", nonfinite: bool = False) -> str:
    """A one-line remedy for an operator that loses digits (or produces NaN/inf), chosen from
    the mechanism its statistics and its place show before its kind: a normalization is called
    near-constant only at the step where centring cancels (operator level: the whole
    normalization; arithmetic level: ``x - mean`` and its statistics, not the mean's row sum,
    which loses digits when the input is already centred); elsewhere a computational zero (most
    elements' samples disagree on every digit) is one whatever computed it."""
    kinds = _kinds_of(op)
    if nonfinite:
        if kinds & _INVALID_KINDS:
            return ("invalid operation or division by (almost) zero: guard the argument "
                    "(an eps), reformulate, or compute it in fp32")
        return ("overflow: subtract the max before exponentials (softmax, logsumexp), scale "
                "the values down, or accumulate in fp32")
    step = norm_step(op) if kinds & _CENTRING_KINDS else None
    if step == "centring":  # (its result may well be computational zeros: the cancellation)
        return ("near-constant normalization (the input's mean is large against its spread: "
                "centring it exposes the digits the input lost when it was rounded): remove "
                "the common offset before it or keep the input in fp32; written by hand, "
                "compute its statistics in fp32 too")
    if op.zero_fraction >= ZERO_FINDING:
        return ZERO_HINT
    if step == "mean":
        return ("cancellation in the mean of a nearly centred input (a large spread against "
                "its mean): harmless where x - mean keeps its digits; accumulate in fp32 "
                "otherwise")
    if kinds & (_CENTRING_KINDS | _SCALE_NORM_KINDS):
        return ("normalization of values with (almost) no spread: use a larger eps or "
                "compute the statistics in fp32")
    if kinds & {"exp", "softmax", "log_softmax", "logsumexp", "exp2", "expm1"}:
        return "exponential of large values: subtract the max first and accumulate in fp32"
    if kinds & _DIVISION_KINDS or any(rule_of(k).family in _DIVISION_FAMILIES for k in kinds):
        return ("division by a value with few reliable digits: guard or reformulate the "
                "denominator, or compute it in fp32")
    if kinds & _GEMM_KINDS:
        return ("ill-conditioned or cancelling product: accumulate in fp32, or check for "
                "cancelling weights and near-tied scores")
    if kinds & _CANCEL_KINDS or any(rule_of(k).output_digits for k in kinds):
        return ("cancellation (nearly equal values subtracted): reformulate the expression "
                "or raise its precision")
    if op.underflow:
        return "underflow: " + UNDERFLOW_HINT
    return "raise this operator's precision (fp32) and check whether the loss goes away"
