"""Hints: the findings' thresholds, the table legend and a one-line remedy per operator kind."""

from __future__ import annotations

from ..capture.opsets import GEMM_KINDS
from ..rules.aten.kinds import GEMM_PRIMITIVES
from .operators import OperatorDigits

# A local loss below this fraction of the cap is the cost of a rounding or two (a bf16 GEMM of
# exact inputs keeps ~1.9 of 2.41 digits), not a finding.
MIN_FINDING = 0.25
# Underflow worth a finding: at least this fraction of an operator's elements.
MIN_UNDERFLOW = 0.01
LEGEND = ("legend: digits are the CESTAC estimate of the reliable significant digits of an "
          "output, at most the cap ({cap:.2f}); normwise: the tensor as a whole; p10/p50: "
          "quantiles of the elements' digits; zero%: computational zeros (samples disagree on "
          "every digit); under: elements rounded below the smallest normal; surrogate: the "
          "GEMM's inputs were perturbed (their samples were too close to expose it)")
_OVERFLOW_KINDS = {"exp", "exp2", "expm1", "softmax", "log_softmax", "logsumexp", "pow", "sinh",
                   "cosh", "mul", "matmul", "mm", "bmm", "linear", "sum", "cumsum", "square"}
_INVALID_KINDS = {"div", "reciprocal", "rsqrt", "sqrt", "log", "log2", "log10", "log1p",
                  "true_divide", "floor_divide", "atanh", "acos", "asin"}
_NORM_KINDS = {"layer_norm", "batch_norm", "group_norm", "instance_norm", "rms_norm", "var",
               "std", "var_mean", "rsqrt", "native_layer_norm", "native_batch_norm"}
_CANCEL_KINDS = {"add", "sub", "rsub", "iadd", "isub", "addmm", "sum", "mean", "cumsum"}
_GEMM_KINDS = GEMM_KINDS | GEMM_PRIMITIVES  # an operator's kinds, a primitive's
UNDERFLOW_HINT = ("scale the values up (loss scaling for gradients), or use a format with a "
                   "wider exponent (bf16) or fp32 there")


def _kinds_of(op: "OperatorDigits") -> set:
    """The operator's kind and, at the aten level, the kinds in its name (``blocks.0.attn/
    softmax#0/aten.exp#0`` is an exp inside a softmax)."""
    kinds = {op.kind}
    for part in op.name.split("/")[1:]:
        kinds.add(part.split("#")[0].removeprefix("aten."))
    return kinds


def hint(op: "OperatorDigits", nonfinite: bool = False) -> str:
    """A one-line remedy for an operator that loses digits (or produces NaN/inf)."""
    kinds = _kinds_of(op)
    if nonfinite:
        if kinds & _INVALID_KINDS:
            return ("invalid operation or division by (almost) zero: guard the argument "
                    "(an eps), reformulate, or compute it in fp32")
        return ("overflow: subtract the max before exponentials (softmax, logsumexp), scale "
                "the values down, or accumulate in fp32")
    if kinds & _NORM_KINDS:
        return ("near-constant normalization: compute the statistics in fp32, use a larger "
                "eps, or centre the input first")
    if kinds & {"exp", "softmax", "log_softmax", "logsumexp", "exp2", "expm1"}:
        return "exponential of large values: subtract the max first and accumulate in fp32"
    if kinds & {"div", "reciprocal", "true_divide"}:
        return ("division by a value with few reliable digits: guard or reformulate the "
                "denominator, or compute it in fp32")
    if kinds & _GEMM_KINDS:
        return ("ill-conditioned or cancelling product: accumulate in fp32, or check for "
                "cancelling weights and near-tied scores")
    if kinds & _CANCEL_KINDS:
        return ("cancellation (nearly equal values subtracted): reformulate the expression "
                "or raise its precision")
    if op.underflow:
        return "underflow: " + UNDERFLOW_HINT
    return "raise this operator's precision (fp32) and check whether the loss goes away"
