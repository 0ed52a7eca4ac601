"""The records of a digit map and how reports aggregate into them (docs/design.md §7).

:class:`OperatorDigits` is one operator aggregated over its analysed calls, :class:`StepDigits`
one operator at one (phase, step), :class:`LocalLoss` one line of the localization ranking.
The metrics (:data:`METRICS`, :data:`DEFAULT_METRIC`) name the per-operator statistic that
tables, rankings, plots and the CI gate compare; :func:`aggregate` folds
:class:`fxstab.records.report.OpReport` records into those statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from ..records.report import COUNTER_KEYS, OBSERVED, PER_SAMPLE, ROUNDED, UNLIFTED, OpReport

# An operator aggregated over calls takes its most severe status: a single call that could not
# be lifted onto the samples means its digits are incomplete for the whole map.
STATUS_SEVERITY = {ROUNDED: 0, PER_SAMPLE: 1, OBSERVED: 2, UNLIFTED: 3}
# Per-operator statistics a metric can name, and the OperatorDigits/StepDigits field of each.
_METRIC_FIELDS = {"normwise": "normwise_digits", "p10": "p10_digits", "p50": "p50_digits",
                  "avg": "avg_digits", "run": "run_digits", "min": "min_digits"}
METRICS = tuple(_METRIC_FIELDS)
# The metric of tables, rankings, plots and the CI gate (docs/digit-maps.md says why).
DEFAULT_METRIC = "avg"


# --------------------------------------------------------------------------- records
class _Metrics:
    """The metric accessor of the records that carry per-operator statistics."""

    def digits(self, metric: Optional[str] = None) -> float:
        """The digits under ``metric`` (default :data:`DEFAULT_METRIC`)."""
        return getattr(self, _METRIC_FIELDS[check_metric(metric)])


@dataclass
class OperatorDigits(_Metrics):
    """One operator of a digit map, aggregated over all its analysed calls.

    ``numel`` is the total number of output elements analysed over those calls (the weight of
    ``avg_digits``); ``shape`` is the output shape of the first analysed call. ``status`` is the
    most severe status of any call (unlifted > observed > rounded). ``inputs`` names the
    instrumented operators feeding this one (the graph edges).
    """

    name: str
    kind: str
    module_path: str
    calls: int
    numel: int
    avg_digits: float
    min_digits: float
    max_digits: float
    zero_fraction: float = 0.0
    non_finite: int = 0
    surrogate: bool = False
    status: str = ROUNDED
    source: str = ""
    shape: tuple = ()
    counters: dict = field(default_factory=lambda: {k: 0 for k in COUNTER_KEYS})
    inputs: tuple = ()
    normwise_digits: float = math.nan
    p10_digits: float = math.nan
    p50_digits: float = math.nan
    underflow: int = 0
    # the avg digits a round-to-nearest run is expected to keep (metric "run"; NaN: a map
    # written before it was kept). An estimate to compare with a real run, not a bound
    run_digits: float = math.nan
    direction: str = "forward"  # or "backward": an operator of the backward graph, a gradient
    format: str = ""  # the format its output rounded into (format="auto"); "": the map's
    # a modelled GEMM's accumulator (docs/accumulation.md): the digits its output shares with
    # the exact sum of the same operands, numel-weighted average and minimum over the calls
    # that measured it; NaN where none did (no accumulator modelled, a map without the key)
    accumulator_digits: float = math.nan
    accumulator_min_digits: float = math.nan
    # a modelled GEMM's operands in a recipe (gemm_inputs=): summed over the calls (elements,
    # underflow, saturation) and the extreme group scales; 0 / NaN where none was measured
    operand_elements: int = 0
    operand_underflow: int = 0
    operand_saturation: int = 0
    operand_scale_min: float = math.nan
    operand_scale_max: float = math.nan
    # the digits its recipe's operands keep of the program's product (exact sums of both;
    # numel-weighted average, minimum), NaN where none was measured
    operand_digits: float = math.nan
    operand_min_digits: float = math.nan
    # the digits the model's outputs lose to this operator's own rounding (fxstab.impact, an
    # ablation); NaN where not measured (optional key of version 2)
    impact: float = math.nan
    # the text of its source line (``source``), what matches it across commits where its name's
    # index moved (compare.match_operators); "": unknown (a map recorded before it was kept)
    code: str = ""

    def as_dict(self) -> dict:
        return {
            "name": self.name, "kind": self.kind, "module_path": self.module_path,
            "direction": self.direction, **({"format": self.format} if self.format else {}),
            "source": self.source, "shape": list(self.shape), "status": self.status,
            "calls": self.calls, "numel": self.numel, "avg_digits": self.avg_digits,
            "min_digits": self.min_digits, "max_digits": self.max_digits,
            "normwise_digits": self.normwise_digits, "p10_digits": self.p10_digits,
            "p50_digits": self.p50_digits, **run_keys(self),
            "zero_fraction": self.zero_fraction, "non_finite": self.non_finite,
            "underflow": self.underflow,
            "surrogate": self.surrogate, "counters": dict(self.counters),
            "inputs": list(self.inputs), **accumulator_keys(self), **operand_keys(self),
            **({} if math.isnan(self.impact) else {"impact": self.impact}),
            **({"code": self.code} if self.code else {}),
        }


def run_keys(record: object) -> dict:
    """The optional ``run_digits`` key of a record (absent where it was not measured)."""
    v = getattr(record, "run_digits", math.nan)
    return {} if math.isnan(v) else {"run_digits": v}


def source_code(source: str) -> str:
    """The text of source line ``file.py:LINE`` (stripped), "" where it cannot be read."""
    import linecache

    path, _, line = source.rpartition(":")
    if not path or not line.isdigit():
        return ""
    return linecache.getline(path, int(line)).strip()


@dataclass
class StepDigits(_Metrics):
    """Digits of one operator at one (phase, step): a point of the time series."""

    phase: str
    step: Optional[int]
    name: str
    calls: int
    numel: int
    avg_digits: float
    min_digits: float
    max_digits: float
    zero_fraction: float = 0.0
    non_finite: int = 0
    normwise_digits: float = math.nan
    p10_digits: float = math.nan
    p50_digits: float = math.nan
    underflow: int = 0
    run_digits: float = math.nan  # as OperatorDigits'
    accumulator_digits: float = math.nan  # as OperatorDigits'
    accumulator_min_digits: float = math.nan
    operand_elements: int = 0  # as OperatorDigits'
    operand_underflow: int = 0
    operand_saturation: int = 0
    operand_scale_min: float = math.nan
    operand_scale_max: float = math.nan
    operand_digits: float = math.nan
    operand_min_digits: float = math.nan


@dataclass
class LocalLoss:
    """Where an operator loses digits: its digits against the least accurate of its inputs.

    ``worst_input`` is None for an operator without instrumented inputs, whose reference is
    then the format's digit cap (``reference``). ``nonfinite_origin`` marks an operator whose
    output holds NaN/inf while none of its instrumented inputs does (it ranks first).
    ``accumulator`` marks a modelled GEMM whose ``digits`` are its accumulator's own, fewer
    than its CESTAC digits (:func:`effective_digits`).
    """

    name: str
    kind: str
    digits: float
    reference: float
    worst_input: Optional[str]
    local_loss: float
    nonfinite_origin: bool = False
    # ``digits`` are its accumulator's own (fewer than its CESTAC digits: effective_digits)
    accumulator: bool = False


# --------------------------------------------------------------------------- aggregation
def check_metric(metric: Optional[str]) -> str:
    """``metric``, or the default metric for None; a clear error for an unknown name."""
    if metric is None:
        return DEFAULT_METRIC
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    return metric


def _nanmin(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return min(vals) if vals else math.nan


def nanmax(values: Iterable[float]) -> float:
    """The largest value that is not NaN; NaN when there is none."""
    vals = [v for v in values if not math.isnan(v)]
    return max(vals) if vals else math.nan


def _weighted(values: Sequence[float], weights: Sequence[int]) -> float:
    """numel-weighted mean; a plain mean when every call was empty."""
    total = sum(weights)
    if total > 0:
        return sum(v * w for v, w in zip(values, weights) if w) / total
    return sum(values) / len(values) if values else math.nan


def aggregate(reports: Sequence[OpReport]) -> dict:
    """The statistics of one operator over its reports (calls), keyed by the field names
    :class:`OperatorDigits` and :class:`StepDigits` share."""
    numels = [int(r.numel) for r in reports]
    return {
        "calls": len(reports),
        "numel": sum(numels),
        "avg_digits": _weighted([float(r.avg_digits) for r in reports], numels),
        "min_digits": _nanmin(float(r.min_digits) for r in reports),
        "max_digits": nanmax(float(r.max_digits) for r in reports),
        "zero_fraction": _weighted([float(r.zero_fraction) for r in reports], numels),
        "non_finite": sum(int(r.non_finite) for r in reports),
        # over calls: numel-weighted means (an operator's calls usually have one shape)
        "normwise_digits": _weighted([float(r.normwise_digits) for r in reports], numels),
        "p10_digits": _weighted([float(r.p10_digits) for r in reports], numels),
        "p50_digits": _weighted([float(r.p50_digits) for r in reports], numels),
        "run_digits": _weighted([float(getattr(r, "run_digits", math.nan)) for r in reports],
                                numels),
        "underflow": sum(int(r.underflow) for r in reports),
        **_accumulator(reports, numels),
        **_operands(reports),
    }


OPERAND_KEYS = ("operand_elements", "operand_underflow", "operand_saturation",
                "operand_scale_min", "operand_scale_max", "operand_digits", "operand_min_digits")
"""A modelled GEMM's operand statistics (optional JSON keys, docs/accumulation.md)."""

# a GEMM whose recipe flushes more than this share of its operands' non-zero elements to zero
# gets a finding (operand_findings): well-scaled Gaussian operands flush none in e4m3 or e5m2
# (per tensor, block128, mx32), 0.3% in mxfp6 and 6.8% / 8.9% in nvfp4 / mxfp4
# (docs/accumulation.md), so past 10% the data is worse scaled than the coarsest recipe
# expects
UNDERFLOW_FINDING_PCT = 10.0


def _operands(reports: Sequence[OpReport]) -> dict:
    """The operands' statistics over the calls that measured them (none: no keys)."""
    measured = [r for r in reports if getattr(r, "operand_elements", 0)]
    if not measured:
        return {}
    digits = [r for r in measured if not math.isnan(getattr(r, "operand_digits", math.nan))]
    return {"operand_digits": _weighted([float(r.operand_digits) for r in digits],
                                        [int(r.numel) for r in digits]) if digits else math.nan,
            "operand_min_digits": _nanmin(float(r.operand_min_digits) for r in digits),
            "operand_elements": sum(int(r.operand_elements) for r in measured),
            "operand_underflow": sum(int(r.operand_underflow) for r in measured),
            "operand_saturation": sum(int(r.operand_saturation) for r in measured),
            "operand_scale_min": _nanmin(float(r.operand_scale_min) for r in measured),
            "operand_scale_max": nanmax(float(r.operand_scale_max) for r in measured)}


def operand_keys(rec: "OperatorDigits | StepDigits") -> dict:
    """The operands' statistics keys of a record's JSON, only where it has them (the digits
    only where measured: JSON has no NaN)."""
    if not rec.operand_elements:
        return {}
    return {k: getattr(rec, k) for k in OPERAND_KEYS
            if not (k.endswith("digits") and math.isnan(getattr(rec, k)))}


def digit_budget_findings(operators: Iterable["OperatorDigits"], cap: float,
                          margin: float = 0.25) -> list[str]:
    """Where a modelled GEMM's digits go, for the GEMMs that measured both its recipe's
    operands (``operand_digits``: their exact product against the program's) and its
    accumulator (``accumulator_digits``: its sum against the exact sum of those operands):
    one finding per GEMM where one of the two costs at least ``margin`` x ``cap`` digits, the
    larger loss named with its fix, largest first."""
    rows = []
    for op in operators:
        ops_d, acc_d = op.operand_digits, op.accumulator_digits
        if math.isnan(ops_d) or math.isnan(acc_d):
            continue
        lost_ops, lost_acc = cap - ops_d, cap - acc_d
        if max(lost_ops, lost_acc) >= margin * cap:
            rows.append((max(lost_ops, lost_acc), lost_ops, lost_acc, op))
    rows.sort(key=lambda r: -r[0])
    out = []
    for _, lost_ops, lost_acc, op in rows:
        if lost_acc >= lost_ops:
            out.append(f"the accumulator, not the operands, costs {op.name} {lost_acc:.1f} "
                       f"digits (its sum keeps {op.accumulator_digits:.2f} of the exact sum; "
                       f"the recipe's operands keep {op.operand_digits:.2f} of the program's "
                       f"product): promote the partial sums into fp32 every 128 elements of K "
                       f"(accumulate='fp8-promoted') or accumulate in fp32")
        else:
            out.append(f"the operands' recipe, not the accumulator, costs {op.name} "
                       f"{lost_ops:.1f} digits (the recipe's operands keep "
                       f"{op.operand_digits:.2f} of the program's product; the accumulator "
                       f"keeps {op.accumulator_digits:.2f} of their exact sum): scale in "
                       f"smaller groups (block128, mx32, nvfp4) or use a wider operand format")
    return out


def operand_percent(rec: "OperatorDigits | StepDigits") -> tuple[float, float]:
    """(underflow %, saturation %) of a record's operand elements; NaN without any."""
    n = rec.operand_elements
    if not n:
        return math.nan, math.nan
    return 100.0 * rec.operand_underflow / n, 100.0 * rec.operand_saturation / n


def operand_findings(operators: Iterable["OperatorDigits"],
                     threshold: float = UNDERFLOW_FINDING_PCT) -> list[str]:
    """One finding per modelled GEMM whose recipe flushes more than ``threshold`` % of its
    operands' non-zero elements to zero, most first, with the scales' range and the fix."""
    rows = []
    for op in operators:
        under, sat = operand_percent(op)
        if not math.isnan(under) and under > threshold:
            rows.append((under, sat, op))
    rows.sort(key=lambda r: -r[0])
    return [f"the operands of {op.name} lose {under:.1f}% of their non-zero elements to "
            f"underflow in their recipe ({sat:.1f}% saturate; group scales "
            f"{op.operand_scale_min:.3g} ... {op.operand_scale_max:.3g}): use smaller "
            f"scaling groups (mx32, nvfp4), a format with more exponent range, or keep this "
            f"GEMM's operands wider" for under, sat, op in rows]


def _accumulator(reports: Sequence[OpReport], numels: list) -> dict:
    """The accumulator's digits over the calls that measured them (NaN where none did)."""
    measured = [i for i, r in enumerate(reports)
                if not math.isnan(getattr(r, "accumulator_digits", math.nan))]
    if not measured:
        return {}
    return {"accumulator_digits": _weighted([float(reports[i].accumulator_digits)
                                             for i in measured], [numels[i] for i in measured]),
            "accumulator_min_digits": _nanmin(float(reports[i].accumulator_min_digits)
                                              for i in measured)}


def accumulator_keys(rec: "OperatorDigits | StepDigits") -> dict:
    """The accumulator's keys of a record's JSON, only where it has them (optional keys: a
    map without an accumulator reads as before)."""
    if math.isnan(rec.accumulator_digits):
        return {}
    return {"accumulator_digits": rec.accumulator_digits,
            "accumulator_min_digits": rec.accumulator_min_digits}


# The accumulator's figure each metric is held against (normwise digits and the quantiles,
# which it does not measure, against its average)
_ACCUMULATOR_FIELDS = {"min": "accumulator_min_digits"}


def accumulator_digits(op: "OperatorDigits", metric: Optional[str] = None) -> float:
    """The accumulator's figure that ``metric`` is held against (NaN: none measured)."""
    return getattr(op, _ACCUMULATOR_FIELDS.get(check_metric(metric), "accumulator_digits"),
                   math.nan)


def effective_digits(op: "OperatorDigits", metric: Optional[str] = None) -> float:
    """The digits an operator keeps under ``metric``: its CESTAC digits, or its accumulator's
    own digits where those are fewer (a nearest or directed accumulator's bias, which the
    samples' spread cannot show). NaN counts as 0 (:func:`as_digits`). What the localization
    and the diff compare."""
    own = as_digits(op.digits(metric))
    acc = accumulator_digits(op, metric)
    return own if math.isnan(acc) else min(own, acc)


def as_digits(v: float) -> float:
    """NaN digits (unknown) count as 0 reliable digits in rankings and diffs."""
    return 0.0 if math.isnan(v) else v
