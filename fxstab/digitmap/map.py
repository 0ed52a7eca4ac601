"""Digit maps: per-operator digits of one analysis, saved, diffed and localized (DESIGN.md §7).

A :class:`DigitMap` aggregates :class:`fxstab.records.report.OpReport` records (one per instrumented
operator and analysed call) per stable operator name, keeps per-(phase, step) entries for the time
series over training, carries the metadata of the analysis and the graph edges between
instrumented operators. It is saved as JSON only (schema-versioned, written atomically); loading
validates every key and never executes code. ``docs/digit-maps.md`` documents the schema, the
naming rule, the diff semantics and the localization rule.

Typical use::

    dm = DigitMap.from_reports(be.reports, metadata={"format": "bf16", "seed": 0})
    print(dm.table())
    dm.save("digits.json")
    result = diff(DigitMap.load("main.json"), dm, max_drop=0.5)
    print(result.to_markdown())
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence, Union

from ..records.report import COUNTER_KEYS, OBSERVED, PER_SAMPLE, ROUNDED, UNLIFTED, OpReport

SCHEMA_NAME = "fxstab-digit-map"
SCHEMA_VERSION = 2
# Version 1 had no normwise digits, quantiles or underflow: it still loads (those are NaN/0).
_READABLE_VERSIONS = (1, 2)

# An operator aggregated over calls takes its most severe status: a single call that could not
# be lifted onto the samples means its digits are incomplete for the whole map.
_STATUS_SEVERITY = {ROUNDED: 0, PER_SAMPLE: 1, OBSERVED: 2, UNLIFTED: 3}
# Per-operator statistics a metric can name, and the OperatorDigits/StepDigits field of each.
_METRIC_FIELDS = {"normwise": "normwise_digits", "p10": "p10_digits", "p50": "p50_digits",
                  "avg": "avg_digits", "min": "min_digits"}
_METRICS = tuple(_METRIC_FIELDS)
# The metric of tables, rankings, plots and the CI gate (docs/digit-maps.md says why).
DEFAULT_METRIC = "avg"

# JSON has no NaN/Infinity literals (Python's json writes invalid tokens for them); a digit map
# writes non-finite numbers as these strings and reads them back as floats.
_NONFINITE_TO_STR = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_STR_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

PathLike = Union[str, "os.PathLike[str]"]


class DigitMapError(ValueError):
    """A digit map file or document is unusable: says what is wrong and where.

    Attributes:
        source: the file (or ``"<string>"``) the document came from.
        where: the location inside the document, e.g. ``operators[3] 'blocks.0/softmax#0'``.
        key: the offending key, when one is to blame.
    """

    def __init__(self, message: str, source: str = "<string>", where: str = "",
                 key: Optional[str] = None) -> None:
        self.source = source
        self.where = where
        self.key = key
        self.reason = message
        parts = [source]
        if where:
            parts.append(where)
        if key is not None:
            parts.append(f"key {key!r}")
        super().__init__(f"{': '.join(parts)}: {message}")


# --------------------------------------------------------------------------- records
class _Metrics:
    """The metric accessor of the records that carry per-operator statistics."""

    def digits(self, metric: Optional[str] = None) -> float:
        """The digits under ``metric`` (default :data:`DEFAULT_METRIC`)."""
        return getattr(self, _METRIC_FIELDS[_check_metric(metric)])


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
    direction: str = "forward"  # or "backward": an operator of the backward graph, a gradient
    format: str = ""  # the format its output rounded into (format="auto"); "": the map's

    def as_dict(self) -> dict:
        return {
            "name": self.name, "kind": self.kind, "module_path": self.module_path,
            "direction": self.direction, **({"format": self.format} if self.format else {}),
            "source": self.source, "shape": list(self.shape), "status": self.status,
            "calls": self.calls, "numel": self.numel, "avg_digits": self.avg_digits,
            "min_digits": self.min_digits, "max_digits": self.max_digits,
            "normwise_digits": self.normwise_digits, "p10_digits": self.p10_digits,
            "p50_digits": self.p50_digits,
            "zero_fraction": self.zero_fraction, "non_finite": self.non_finite,
            "underflow": self.underflow,
            "surrogate": self.surrogate, "counters": dict(self.counters),
            "inputs": list(self.inputs),
        }


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


@dataclass
class LocalLoss:
    """Where an operator loses digits: its digits against the least accurate of its inputs.

    ``worst_input`` is None for an operator without instrumented inputs, whose reference is
    then the format's digit cap (``reference``). ``nonfinite_origin`` marks an operator whose
    output holds NaN/inf while none of its instrumented inputs does (it ranks first).
    """

    name: str
    kind: str
    digits: float
    reference: float
    worst_input: Optional[str]
    local_loss: float
    nonfinite_origin: bool = False


# --------------------------------------------------------------------------- aggregation
def _check_metric(metric: Optional[str]) -> str:
    """``metric``, or the default metric for None; a clear error for an unknown name."""
    if metric is None:
        return DEFAULT_METRIC
    if metric not in _METRICS:
        raise ValueError(f"metric must be one of {', '.join(_METRICS)}, got {metric!r}")
    return metric


def _nanmin(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return min(vals) if vals else math.nan


def _nanmax(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return max(vals) if vals else math.nan


def _weighted(values: Sequence[float], weights: Sequence[int]) -> float:
    """numel-weighted mean; a plain mean when every call was empty."""
    total = sum(weights)
    if total > 0:
        return sum(v * w for v, w in zip(values, weights) if w) / total
    return sum(values) / len(values) if values else math.nan


def _aggregate(reports: Sequence[OpReport]) -> dict:
    numels = [int(r.numel) for r in reports]
    return {
        "calls": len(reports),
        "numel": sum(numels),
        "avg_digits": _weighted([float(r.avg_digits) for r in reports], numels),
        "min_digits": _nanmin(float(r.min_digits) for r in reports),
        "max_digits": _nanmax(float(r.max_digits) for r in reports),
        "zero_fraction": _weighted([float(r.zero_fraction) for r in reports], numels),
        "non_finite": sum(int(r.non_finite) for r in reports),
        # over calls: numel-weighted means (an operator's calls usually have one shape)
        "normwise_digits": _weighted([float(r.normwise_digits) for r in reports], numels),
        "p10_digits": _weighted([float(r.p10_digits) for r in reports], numels),
        "p50_digits": _weighted([float(r.p50_digits) for r in reports], numels),
        "underflow": sum(int(r.underflow) for r in reports),
    }


def _git_commit(cwd: Optional[PathLike] = None) -> Optional[str]:
    """HEAD's commit of the git checkout containing ``cwd``; None when there is none."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or os.getcwd(),
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def _default_metadata() -> dict:
    import torch

    from .._version import __version__

    meta: dict[str, Any] = {"fxstab_version": __version__,
                            "torch_version": str(torch.__version__)}
    commit = _git_commit()
    if commit:
        meta["git_commit"] = commit
    return meta


def _unique(values: Iterable[Any], what: str) -> Any:
    seen = sorted({v for v in values if v not in ("", 0, None)}, key=str)
    if len(seen) > 1:
        raise ValueError(f"reports mix {what} values {seen}; build one digit map per {what}")
    return seen[0] if seen else None


# --------------------------------------------------------------------------- hints
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
_GEMM_KINDS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d", "conv2d",
               "conv3d", "convolution", "einsum", "scaled_dot_product_attention"}
_UNDERFLOW_HINT = ("scale the values up (loss scaling for gradients), or use a format with a "
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
        return "underflow: " + _UNDERFLOW_HINT
    return "raise this operator's precision (fp32) and check whether the loss goes away"


# --------------------------------------------------------------------------- the map
class DigitMap:
    """Per-operator digits of one analysis (or of many calls aggregated), with metadata.

    Attributes:
        metadata: analysis settings and provenance (format, n_samples, seed, granularity,
            confidence, rounding, target, analysed_calls, fxstab/torch versions, git commit...).
        operators: name -> :class:`OperatorDigits`, in graph order (first appearance).
        steps: :class:`StepDigits` per (phase, step, operator), in order of appearance.
    """

    def __init__(self, operators: Iterable[OperatorDigits] = (), metadata: Optional[dict] = None,
                 steps: Iterable[StepDigits] = ()) -> None:
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.operators: dict[str, OperatorDigits] = {}
        for op in operators:
            if op.name in self.operators:
                raise ValueError(f"duplicate operator name {op.name!r} in a digit map")
            self.operators[op.name] = op
        self.steps: list[StepDigits] = list(steps)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_reports(cls, reports: Iterable[OpReport], metadata: Optional[dict] = None
                     ) -> "DigitMap":
        """Aggregate reports per operator name and per (phase, step).

        Args:
            reports: ``OpReport`` records, one per instrumented operator and analysed call.
            metadata: settings of the analysis (format, n_samples, seed, granularity,
                confidence, rounding, target, analysed_calls, ...). They override what is
                derived here: fxstab/torch versions, the git commit of the current directory
                (when it is a git checkout), and format, n_samples and analysed_calls taken from
                the reports.

        Raises:
            ValueError: reports of one name disagree on kind or module path (names are meant
                to be unique), or reports mix formats or sample counts.
        """
        reports = list(reports)
        by_name: dict[str, list[OpReport]] = {}
        for r in reports:
            by_name.setdefault(r.name, []).append(r)
        ops = []
        for name, rs in by_name.items():
            first = rs[0]
            for r in rs[1:]:
                if (r.kind, r.module_path) != (first.kind, first.module_path):
                    raise ValueError(
                        f"reports named {name!r} disagree: kind/module {first.kind!r}/"
                        f"{first.module_path!r} vs {r.kind!r}/{r.module_path!r}; operator "
                        f"names must be unique")
            counters = {k: 0 for k in COUNTER_KEYS}
            inputs: list[str] = []
            for r in rs:
                for k, v in (r.counters or {}).items():
                    counters[k] = counters.get(k, 0) + int(v)
                for i in r.inputs:
                    if i not in inputs:
                        inputs.append(i)
            status = max((r.status for r in rs), key=lambda s: _STATUS_SEVERITY.get(s, 4))
            ops.append(OperatorDigits(
                name=name, kind=first.kind, module_path=first.module_path, source=first.source,
                direction=getattr(first, "direction", "forward"),
                format=first.format if (metadata or {}).get("format") == "auto" else "",
                shape=tuple(first.shape), status=status, surrogate=any(r.surrogate for r in rs),
                counters=counters, inputs=tuple(inputs), **_aggregate(rs)))
        known = set(by_name)
        for op in ops:  # edges only between instrumented operators of this map
            op.inputs = tuple(i for i in op.inputs if i in known and i != op.name)

        groups: dict[tuple, dict[str, list[OpReport]]] = {}
        for r in reports:
            groups.setdefault((r.phase, r.step), {}).setdefault(r.name, []).append(r)
        steps = [StepDigits(phase=phase, step=step, name=name, **_aggregate(rs))
                 for (phase, step), per_op in groups.items() for name, rs in per_op.items()]

        meta = _default_metadata()
        if (metadata or {}).get("format") == "auto":  # format="auto": each operator its own
            meta["format"] = "auto"
        else:
            fmt = _unique((r.format for r in reports), "format")
            if fmt is not None:
                meta["format"] = fmt
        n = _unique((r.n_samples for r in reports), "n_samples")
        if n is not None:
            meta["n_samples"] = int(n)
        meta["analysed_calls"] = len({(r.phase, r.step, r.call) for r in reports})
        meta.update(metadata or {})
        return cls(ops, meta, steps)

    # ----------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self.operators)

    def __contains__(self, name: object) -> bool:
        return name in self.operators

    def __getitem__(self, name: str) -> OperatorDigits:
        try:
            return self.operators[name]
        except KeyError:
            raise KeyError(f"no operator {name!r} in this digit map") from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DigitMap):
            return NotImplemented
        return self.to_json() == other.to_json()

    _COMPARED_STATS = ("avg_digits", "min_digits", "max_digits", "normwise_digits",
                       "p10_digits", "p50_digits", "zero_fraction", "non_finite", "underflow")

    def difference(self, other: "DigitMap") -> float:
        """The largest difference of any statistic of any operator between two maps of the
        same program (two mechanisms, two revisions): 0 when they agree bit for bit, inf when
        their operators, statuses, surrogate flags or call counts differ. NaN equals NaN."""
        if set(self.operators) != set(other.operators):
            return math.inf
        worst = 0.0
        for name, x in self.operators.items():
            y = other.operators[name]
            if (x.status, x.surrogate, x.calls) != (y.status, y.surrogate, y.calls):
                return math.inf
            for f in self._COMPARED_STATS:
                u, v = getattr(x, f), getattr(y, f)
                if u == v or (u != u and v != v):
                    continue
                worst = max(worst, abs(u - v))
        return worst

    def cap_of(self, op: "OperatorDigits") -> float:
        """The digit cap of one operator's format (format="auto": its own; else the map's)."""
        if op.format:
            try:
                from ..numerics.formats import get_format

                return get_format(op.format).digit_cap
            except ValueError:
                pass
        return self.cap

    @property
    def cap(self) -> float:
        """The format's digit cap (p·log10 2); with format="auto" the largest of the
        operators'; the largest max digits when the format is unknown."""
        fmt = self.metadata.get("format")
        if fmt == "auto" and any(op.format for op in self.operators.values()):
            return max(self.cap_of(op) for op in self.operators.values() if op.format)
        if isinstance(fmt, str) and fmt:
            try:
                from ..numerics.formats import get_format

                return get_format(fmt).digit_cap
            except ValueError:
                pass
        return _nanmax(op.max_digits for op in self.operators.values()) if self.operators else 0.0

    def sorted_worst_first(self, metric: Optional[str] = None) -> list[OperatorDigits]:
        """Operators by ``metric`` digits (default :data:`DEFAULT_METRIC`), then min digits,
        then name (NaN digits count as 0)."""
        metric = _check_metric(metric)

        def key(op: OperatorDigits) -> tuple:
            return (_as_digits(op.digits(metric)), _as_digits(op.min_digits), op.name)
        return sorted(self.operators.values(), key=key)

    def worst(self, k: int = 10, metric: Optional[str] = None) -> list[OperatorDigits]:
        """The ``k`` operators with the fewest reliable digits under ``metric`` (worst first)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        return self.sorted_worst_first(metric)[:k]

    def table(self, top: Optional[int] = None, metric: Optional[str] = None) -> str:
        """A readable text table of the operators, worst first under ``metric`` (the column
        marked ``*``), with a legend."""
        metric = _check_metric(metric)
        ops = self.sorted_worst_first(metric) if top is None else self.worst(top, metric)
        m = self.metadata
        head = (f"digit map: {len(self)} operators, format {m.get('format', '?')}, "
                f"N={m.get('n_samples', '?')}, cap {self.cap:.2f} digits, "
                f"{m.get('analysed_calls', '?')} analysed call(s); sorted by {metric} digits")
        if not ops:
            return head + "\n(no operators)"
        width = max(8, *(len(op.name) for op in ops))
        kw = max(4, *(len(op.kind) for op in ops))
        cols = [c for c in _METRICS]
        lines = [head,
                 f"{'operator':<{width}}  {'kind':<{kw}}  {'calls':>5}  {'numel':>9}  "
                 + "  ".join(f"{c + ('*' if c == metric else ''):>8}" for c in cols)
                 + f"  {'zero%':>6}  {'nonfin':>6}  {'under':>6}  flags"]
        for op in ops:
            flags = []
            if op.surrogate:
                flags.append("surrogate")
            if op.status != ROUNDED:
                flags.append(op.status)
            flags += [f"{k}={v}" for k, v in op.counters.items() if v]
            lines.append(
                f"{op.name:<{width}}  {op.kind:<{kw}}  {op.calls:>5}  {op.numel:>9}  "
                + "  ".join(f"{op.digits(c):>8.2f}" for c in cols)
                + f"  {100 * op.zero_fraction:>5.1f}%  {op.non_finite:>6}  {op.underflow:>6}  "
                f"{' '.join(flags)}".rstrip())
        if top is not None and top < len(self):
            lines.append(f"... {len(self) - top} more operator(s)")
        lines.append(LEGEND.format(cap=self.cap))
        return "\n".join(lines)

    def findings(self, top: int = 3, metric: Optional[str] = None) -> list[str]:
        """What to look at first, one line each with a hint: where NaN/inf first appear, then
        the largest local losses (:meth:`localize`) and underflow."""
        metric = _check_metric(metric)
        out = []
        ranked = self.localize(metric)
        for r in ranked:
            if r.nonfinite_origin:
                op = self.operators[r.name]
                out.append(f"NaN/inf first appear at {r.name} ({op.non_finite} of {op.numel} "
                           f"elements): {hint(op, nonfinite=True)}")
        # an operator of exact inputs is compared with the cap, which its own rounding already
        # costs ~0.6 bf16 digits: a finding only when it keeps less than half the cap
        losses = [r for r in ranked
                  if not r.nonfinite_origin and r.local_loss >= MIN_FINDING * self.cap
                  and (r.worst_input is not None or r.digits < 0.5 * self.cap)]
        for r in losses[:top]:
            op = self.operators[r.name]
            src = f"{r.worst_input}" if r.worst_input else "the format's cap"
            out.append(f"digits are lost at {r.name}: {r.digits:.2f} {metric} digits against "
                       f"{r.reference:.2f} of {src} (local loss {r.local_loss:.2f}): {hint(op)}")
        for op in self.operators.values():
            if op.numel and op.underflow >= MIN_UNDERFLOW * op.numel:
                out.append(f"underflow at {op.name}: {op.underflow} of {op.numel} elements fell "
                           f"below the format's smallest normal: {_UNDERFLOW_HINT}")
                break
        return out

    def __repr__(self) -> str:
        return (f"DigitMap({len(self)} operators, format={self.metadata.get('format')!r}, "
                f"steps={len(self.step_keys())})")

    # ----------------------------------------------------------------- time series
    def step_keys(self) -> list[tuple[str, Optional[int]]]:
        """The distinct (phase, step) pairs, in order of appearance."""
        keys: dict[tuple, None] = {}
        for s in self.steps:
            keys.setdefault((s.phase, s.step), None)
        return list(keys)

    def series(self, name: str, phase: Optional[str] = None) -> list[StepDigits]:
        """Digits of operator ``name`` per (phase, step), optionally of one phase only.

        Points are ordered by phase (first appearance) then step; steps that are None (calls
        made outside a ``phase(..., step=...)`` context) come first within their phase.
        """
        if name not in self.operators:
            raise KeyError(f"no operator {name!r} in this digit map")
        phases = {p: i for i, (p, _) in enumerate(self.step_keys())}
        pts = [s for s in self.steps if s.name == name and (phase is None or s.phase == phase)]
        return sorted(pts, key=lambda s: (phases[s.phase], -1 if s.step is None else s.step))

    def to_tensorboard(self, log_dir: PathLike, metric: str = "min") -> int:
        """Write digits per operator and step as TensorBoard scalars ``digits_<metric>/<name>``.

        Points without a step are written at step 0. Needs the ``tensorboard`` package
        (``torch.utils.tensorboard``).

        Returns:
            The number of scalars written.

        Raises:
            ModuleNotFoundError: tensorboard is not installed (``pip install tensorboard``).
        """
        _check_metric(metric)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch raises ImportError with its own text
            raise ModuleNotFoundError(
                "TensorBoard scalars need the 'tensorboard' package: pip install tensorboard"
            ) from e
        n = 0
        with SummaryWriter(log_dir=str(log_dir)) as writer:
            for s in self.steps:
                tag = f"digits_{metric}/{s.phase}/{s.name}"
                writer.add_scalar(tag, s.digits(metric), 0 if s.step is None else s.step)
                n += 1
        return n

    # ----------------------------------------------------------------- localization
    def graph(self) -> "Any":
        """The networkx DiGraph of instrumented operators (edge = input -> consumer).

        Node attributes: kind, module_path, avg_digits, min_digits, max_digits, numel, status,
        surrogate.
        """
        import networkx as nx

        g = nx.DiGraph()
        for op in self.operators.values():
            g.add_node(op.name, kind=op.kind, module_path=op.module_path,
                       avg_digits=op.avg_digits, min_digits=op.min_digits,
                       max_digits=op.max_digits, numel=op.numel, status=op.status,
                       surrogate=op.surrogate)
        for op in self.operators.values():
            for i in op.inputs:
                if i in self.operators:
                    g.add_edge(i, op.name)
        return g

    def localize(self, metric: Optional[str] = None) -> list[LocalLoss]:
        """Rank operators by where digits are lost, not merely where they are low.

        An operator's local loss is the digits of its *least accurate* instrumented input minus
        its own digits: how much it amplifies the error it receives. An operator that receives
        accurate inputs and returns few digits is where the loss happens; the operators
        downstream of it inherit low digits (their local loss is small), and so does a residual
        join of a clean skip path and a damaged branch (against its damaged input it loses
        nothing; against its best input it would look like the culprit). An operator without
        instrumented inputs is compared with the format's digit cap. A negative local loss means
        the operator restores digits (a normalization after a cancellation).

        Operators where NaN/inf first appear (:meth:`nonfinite_sources`) rank above every
        other, in graph order: everything downstream of them merely propagates the overflow.

        Args:
            metric: the per-operator digits compared (default :data:`DEFAULT_METRIC`).

        Returns:
            One :class:`LocalLoss` per operator, NaN/inf origins first, then largest local loss
            first (ties: fewer own digits first, then name).
        """
        metric = _check_metric(metric)
        origins = set(self.nonfinite_sources())
        out = []
        for op in self.operators.values():
            own = _as_digits(op.digits(metric))
            cap = self.cap_of(op)
            ins = [i for i in op.inputs if i in self.operators]
            if ins:
                worst = min(ins, key=lambda i: (_as_digits(self.operators[i].digits(metric)), i))
                # no operator keeps more than its format holds (format="auto": an fp32 input
                # feeding a bf16 operator is the program's own precision drop, not a loss)
                ref = min(_as_digits(self.operators[worst].digits(metric)), cap)
            else:
                worst, ref = None, cap
            # an observed operator does no arithmetic: it loses nothing of its own
            loss = 0.0 if op.status == OBSERVED else ref - own
            out.append(LocalLoss(op.name, op.kind, own, ref, worst, loss, op.name in origins))
        order = {name: i for i, name in enumerate(self.operators)}
        return sorted(out, key=lambda x: (not x.nonfinite_origin,
                                          order[x.name] if x.nonfinite_origin else 0,
                                          -x.local_loss, x.digits, x.name))

    def nonfinite_sources(self) -> list[str]:
        """Operators that produce NaN/inf although none of their instrumented inputs did.

        This is where an overflow or an invalid operation starts; everything downstream merely
        propagates it. An observed operator (an exact primitive recorded without rounding,
        such as an attention mask's ``masked_fill(-inf)`` at the aten level) writes its
        infinities by design: it is no origin, but its consumers read them. Graph order (the
        order of the map) is kept.
        """
        out = []
        for op in self.operators.values():
            if op.non_finite and op.status != OBSERVED and not any(
                    self.operators[i].non_finite for i in op.inputs if i in self.operators):
                out.append(op.name)
        return out

    def localize_table(self, top: Optional[int] = None, metric: Optional[str] = None) -> str:
        """The localization ranking as text (see :meth:`localize`)."""
        metric = _check_metric(metric)
        ranked = self.localize(metric)
        if top is not None:
            ranked = ranked[:top]
        if not ranked:
            return "(no operators)"
        width = max(8, *(len(r.name) for r in ranked))
        lines = [f"where digits are lost ({metric} digits; local loss = least accurate input "
                 f"- own, cap {self.cap:.2f} without instrumented inputs; NaN/inf origins "
                 f"first)",
                 f"{'operator':<{width}}  {'loss':>6}  {'own':>5}  {'ref':>5}  worst input"]
        for r in ranked:
            loss = "NaN/inf" if r.nonfinite_origin else f"{r.local_loss:.2f}"
            lines.append(f"{r.name:<{width}}  {loss:>6}  {r.digits:>5.2f}  "
                         f"{r.reference:>5.2f}  {r.worst_input or '(cap)'}")
        return "\n".join(lines)

    # ----------------------------------------------------------------- JSON
    def as_dict(self) -> dict:
        """The JSON document (non-finite floats still as floats; see :meth:`to_json`)."""
        steps = []
        index: dict[tuple, dict] = {}
        for s in self.steps:
            key = (s.phase, s.step)
            if key not in index:
                index[key] = {"phase": s.phase, "step": s.step, "operators": {}}
                steps.append(index[key])
            index[key]["operators"][s.name] = {
                "calls": s.calls, "numel": s.numel, "avg_digits": s.avg_digits,
                "min_digits": s.min_digits, "max_digits": s.max_digits,
                "normwise_digits": s.normwise_digits, "p10_digits": s.p10_digits,
                "p50_digits": s.p50_digits,
                "zero_fraction": s.zero_fraction, "non_finite": s.non_finite,
                "underflow": s.underflow,
            }
        return {
            "schema": SCHEMA_NAME,
            "schema_version": SCHEMA_VERSION,
            "metadata": dict(self.metadata),
            "operators": [op.as_dict() for op in self.operators.values()],
            "steps": steps,
        }

    def to_json(self, indent: Optional[int] = 1) -> str:
        """Serialize to JSON text; NaN/±inf become the strings "NaN"/"Infinity"/"-Infinity".

        Raises:
            DigitMapError: metadata holds a value JSON cannot represent.
        """
        try:
            return json.dumps(_encode(self.as_dict()), indent=indent, allow_nan=False,
                              ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise DigitMapError(f"cannot serialize: {e}", source="<DigitMap>") from e

    @classmethod
    def from_json(cls, text: Union[str, bytes], source: str = "<string>") -> "DigitMap":
        """Parse and validate a JSON digit map (see docs/digit-maps.md for the schema).

        Raises:
            DigitMapError: not JSON, not a digit map, wrong schema version, a missing key or a
                value of the wrong type; the message names the source, location and key.
        """
        try:
            doc = json.loads(text, parse_constant=lambda c: _STR_TO_NONFINITE[c])
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DigitMapError(f"not valid JSON ({e})", source) from None
        return _validate(doc, source)

    def save(self, path: PathLike) -> Path:
        """Write the digit map as JSON atomically (temp file in the same folder + os.replace).

        A failure leaves any previous file at ``path`` untouched and no temp file behind.
        """
        path = Path(path)
        text = self.to_json()  # serialize first: a bad value never opens a file
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 is for secrets, not results
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        return path

    @classmethod
    def load(cls, path: PathLike) -> "DigitMap":
        """Read and validate a digit map file; never executes code.

        Raises:
            DigitMapError: the file is missing, unreadable, or not a valid digit map.
        """
        src = str(path)
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            raise DigitMapError("no such file", src) from None
        except OSError as e:
            raise DigitMapError(f"cannot read ({e.strerror or e})", src) from None
        return cls.from_json(data, source=src)


def _umask() -> int:
    """The process's file-creation mask (reading it means setting it: set it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _as_digits(v: float) -> float:
    """NaN digits (unknown) count as 0 reliable digits in rankings and diffs."""
    return 0.0 if math.isnan(v) else v


# --------------------------------------------------------------------------- encoding
def _encode(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return _NONFINITE_TO_STR[repr(obj)]
    if isinstance(obj, dict):
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    return obj


class _Checker:
    """Typed accessors that raise DigitMapError naming source, location and key."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, msg: str, where: str = "", key: Optional[str] = None) -> DigitMapError:
        return DigitMapError(msg, self.source, where, key)

    def get(self, d: dict, key: str, kind: str, where: str, required: bool = True,
            default: Any = None, nullable: bool = False) -> Any:
        if key not in d:
            if required:
                raise self.fail("missing", where, key)
            return default
        v = d[key]
        if v is None and nullable:
            return None
        return self.check(v, kind, where, key)

    def check(self, v: Any, kind: str, where: str, key: Optional[str]) -> Any:
        def bad() -> DigitMapError:
            return self.fail(f"must be {kind}, got {v!r} ({type(v).__name__})", where, key)

        if kind == "a string":
            if not isinstance(v, str):
                raise bad()
            return v
        if kind == "an integer":
            if isinstance(v, bool) or not isinstance(v, int):
                raise bad()
            return v
        if kind == "a non-negative integer":
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad()
            return v
        if kind == "a boolean":
            if not isinstance(v, bool):
                raise bad()
            return v
        if kind == "a number":
            if isinstance(v, str) and v in _STR_TO_NONFINITE:
                return _STR_TO_NONFINITE[v]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad()
            return float(v)
        if kind == "an object":
            if not isinstance(v, dict):
                raise bad()
            return v
        if kind == "a list":
            if not isinstance(v, list):
                raise bad()
            return v
        raise AssertionError(kind)


_META_TYPES = {
    "fxstab_version": "a string", "torch_version": "a string", "format": "a string",
    "n_samples": "an integer", "seed": "an integer", "granularity": "a string",
    "confidence": "a number", "rounding": "a string", "target": "a string",
    "analysed_calls": "a non-negative integer", "git_commit": "a string", "modules": "a list",
}
_META_REQUIRED = ("fxstab_version", "torch_version")


def _validate(doc: Any, source: str) -> DigitMap:
    c = _Checker(source)
    if not isinstance(doc, dict):
        raise c.fail(f"a digit map is a JSON object, got {type(doc).__name__}")
    if doc.get("schema") != SCHEMA_NAME:
        if "schema" not in doc:
            raise c.fail(f"not an fxstab digit map (no 'schema' key; expected {SCHEMA_NAME!r})")
        raise c.fail(f"not an fxstab digit map: schema is {doc['schema']!r}, expected "
                     f"{SCHEMA_NAME!r}", key="schema")
    version = c.get(doc, "schema_version", "an integer", "")
    if version not in _READABLE_VERSIONS:
        hint = ("written by a newer fxstab; upgrade fxstab" if version > SCHEMA_VERSION
                else "written by an older fxstab; record it again")
        raise c.fail(f"schema version {version} is not supported (this fxstab reads versions "
                     f"{', '.join(map(str, _READABLE_VERSIONS))}): {hint}", key="schema_version")

    meta = c.get(doc, "metadata", "an object", "")
    for key in _META_REQUIRED:
        c.get(meta, key, _META_TYPES[key], "metadata")
    for key, kind in _META_TYPES.items():
        c.get(meta, key, kind, "metadata", required=False, nullable=True)
    if "confidence" in meta and meta["confidence"] is not None:
        meta["confidence"] = float(c.check(meta["confidence"], "a number", "metadata",
                                           "confidence"))

    ops = []
    seen: set[str] = set()
    for i, o in enumerate(c.get(doc, "operators", "a list", "")):
        where = f"operators[{i}]"
        o = c.check(o, "an object", where, None)
        name = c.get(o, "name", "a string", where)
        if name in seen:
            raise c.fail(f"duplicate operator name {name!r}", where, "name")
        seen.add(name)
        where = f"operators[{i}] {name!r}"
        shape = c.get(o, "shape", "a list", where, required=False, default=[])
        for d in shape:
            c.check(d, "a non-negative integer", where, "shape")
        counters = {k: 0 for k in COUNTER_KEYS}
        for k, v in c.get(o, "counters", "an object", where, required=False, default={}).items():
            counters[k] = c.check(v, "a non-negative integer", where, f"counters.{k}")
        inputs = c.get(o, "inputs", "a list", where, required=False, default=[])
        for x in inputs:
            c.check(x, "a string", where, "inputs")
        ops.append(OperatorDigits(
            name=name,
            kind=c.get(o, "kind", "a string", where),
            module_path=c.get(o, "module_path", "a string", where),
            calls=c.get(o, "calls", "a non-negative integer", where),
            numel=c.get(o, "numel", "a non-negative integer", where),
            avg_digits=c.get(o, "avg_digits", "a number", where),
            min_digits=c.get(o, "min_digits", "a number", where),
            max_digits=c.get(o, "max_digits", "a number", where),
            zero_fraction=c.get(o, "zero_fraction", "a number", where, False, 0.0),
            non_finite=c.get(o, "non_finite", "a non-negative integer", where, False, 0),
            **_extras(c, o, where),
            surrogate=c.get(o, "surrogate", "a boolean", where, False, False),
            status=c.get(o, "status", "a string", where, False, ROUNDED),
            source=c.get(o, "source", "a string", where, False, ""),
            direction=_direction(c, o, where),
            format=c.get(o, "format", "a string", where, False, ""),
            shape=tuple(shape), counters=counters, inputs=tuple(inputs)))
    for i, op in enumerate(ops):
        for x in op.inputs:
            if x not in seen:
                raise c.fail(f"names unknown operator {x!r} (inputs must be operators of this "
                             f"map)", f"operators[{i}] {op.name!r}", "inputs")

    steps = []
    for i, s in enumerate(c.get(doc, "steps", "a list", "", required=False, default=[])):
        where = f"steps[{i}]"
        s = c.check(s, "an object", where, None)
        phase = c.get(s, "phase", "a string", where)
        step = c.get(s, "step", "an integer", where, nullable=True)
        for name, e in c.get(s, "operators", "an object", where).items():
            w = f"{where} operator {name!r}"
            if name not in seen:
                raise c.fail("is not an operator of this map", w)
            e = c.check(e, "an object", w, None)
            steps.append(StepDigits(
                phase=phase, step=step, name=name,
                calls=c.get(e, "calls", "a non-negative integer", w),
                numel=c.get(e, "numel", "a non-negative integer", w),
                avg_digits=c.get(e, "avg_digits", "a number", w),
                min_digits=c.get(e, "min_digits", "a number", w),
                max_digits=c.get(e, "max_digits", "a number", w),
                zero_fraction=c.get(e, "zero_fraction", "a number", w, False, 0.0),
                non_finite=c.get(e, "non_finite", "a non-negative integer", w, False, 0),
                **_extras(c, e, w)))
    return DigitMap(ops, meta, steps)


def _direction(c, o: dict, where: str) -> str:
    d = c.get(o, "direction", "a string", where, False, "forward")
    if d not in ("forward", "backward"):
        raise c.fail(f"direction must be 'forward' or 'backward', got {d!r}", where, "direction")
    return d


def _extras(c: "_Checker", o: dict, where: str) -> dict:
    """The statistics schema version 2 added (absent from version 1: NaN digits, 0 underflow)."""
    out = {f: c.get(o, f, "a number", where, False, math.nan)
           for f in ("normwise_digits", "p10_digits", "p50_digits")}
    out["underflow"] = c.get(o, "underflow", "a non-negative integer", where, False, 0)
    return out


# --------------------------------------------------------------------------- diff
@dataclass
class OpChange:
    """One operator present in both maps: its digits under the diff's metric."""

    name: str
    kind: str
    base: float
    head: float

    @property
    def delta(self) -> float:
        """head - base (negative: digits lost)."""
        return self.head - self.base


@dataclass
class OpPresence:
    """An operator present in only one of the two maps."""

    name: str
    kind: str
    digits: float


@dataclass
class DiffResult:
    """Outcome of :func:`diff`.

    ``drops`` lost more than ``max_drop`` digits (largest loss first), ``gains`` gained more than
    ``max_drop`` (largest gain first), ``unchanged`` counts the operators within ``max_drop``
    either way. ``module_drops`` compares the modules whose operators were renamed (a rewrite
    inside a module): a module's digits are those of its worst operator. ``new_origins`` are
    operators where NaN/inf first appear in head but not in base; ``vanished`` are base
    operators of a module that is still in the model (head's ``metadata["modules"]``) but has
    no analysed operator any more. ``failed`` is True when any of drops, module drops, new
    NaN/inf origins or vanished operators is non-empty; added and removed operators are listed
    but do not fail. ``origins`` ranks the dropped operators by their local loss in the head map
    (:meth:`DigitMap.localize`): the first is where the lost digits start.
    """

    metric: str
    max_drop: float
    drops: list[OpChange]
    gains: list[OpChange]
    added: list[OpPresence]
    removed: list[OpPresence]
    unchanged: int
    notes: list[str] = field(default_factory=list)
    base_label: str = "base"
    head_label: str = "head"
    origins: list[LocalLoss] = field(default_factory=list)
    new_origins: list[str] = field(default_factory=list)
    module_drops: list[OpChange] = field(default_factory=list)
    vanished: list[OpPresence] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.drops or self.module_drops or self.new_origins or self.vanished)

    @property
    def exit_code(self) -> int:
        """0 when the gate passes, 1 when it fails."""
        return 1 if self.failed else 0

    def summary(self) -> str:
        if not self.failed:
            return f"OK: no operator lost more than {self.max_drop:g} {self.metric} digits"
        why = []
        if self.new_origins:
            why.append(f"{len(self.new_origins)} new NaN/inf origin(s)")
        if self.drops:
            why.append(f"{len(self.drops)} operator(s) lost more than {self.max_drop:g} "
                       f"{self.metric} digits")
        if self.module_drops:
            why.append(f"{len(self.module_drops)} module(s) lost more than {self.max_drop:g} "
                       f"{self.metric} digits")
        if self.vanished:
            why.append(f"{len(self.vanished)} operator(s) no longer analysed")
        return "FAIL: " + "; ".join(why)

    def to_text(self) -> str:
        lines = [f"fxstab diff {self.base_label} -> {self.head_label}: {self.summary()}"]
        lines += [f"note: {n}" for n in self.notes]
        if self.new_origins:
            lines.append(f"NaN/inf now first appear at ({len(self.new_origins)}):")
            lines.extend(f"  {n}" for n in self.new_origins)

        def changes(title: str, rows: list[OpChange]) -> None:
            if rows:
                w = max(len(r.name) for r in rows)
                lines.append(f"{title} ({len(rows)}):")
                lines.extend(f"  {r.name:<{w}}  {r.kind:<12} {r.base:5.2f} -> {r.head:5.2f}  "
                             f"({r.delta:+.2f})" for r in rows)

        def presence(title: str, rows: list[OpPresence]) -> None:
            if rows:
                w = max(len(r.name) for r in rows)
                lines.append(f"{title} ({len(rows)}):")
                lines.extend(f"  {r.name:<{w}}  {r.kind:<12} {r.digits:5.2f}" for r in rows)

        changes("drops", self.drops)
        if self.origins:
            o = self.origins[0]
            lines.append(f"digits are lost first at {o.name} (local loss {o.local_loss:.2f}: "
                         f"{o.digits:.2f} against {o.reference:.2f} "
                         f"{'of ' + o.worst_input if o.worst_input else '(cap)'})")
        changes("module drops (operators renamed inside)", self.module_drops)
        presence("no longer analysed (their module is still there)", self.vanished)
        changes("gains", self.gains)
        presence("added", self.added)
        presence("removed", self.removed)
        lines.append(f"unchanged: {self.unchanged} operator(s) within "
                     f"+/-{self.max_drop:g} digits")
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """A pull-request comment: verdict, NaN/inf origins, drops table, the rest folded."""
        icon = ":x:" if self.failed else ":white_check_mark:"
        lines = ["<!-- fxstab-digit-map-diff -->",
                 f"### fxstab digit map {icon} {_md_text(self.summary())}", "",
                 f"Metric: **{self.metric} digits** per operator, threshold {self.max_drop:g}; "
                 f"{_md(self.base_label)} → {_md(self.head_label)}."]
        for n in self.notes:
            lines.append(f"> **Note:** {_md_text(n)}")
        lines.append("")
        if self.new_origins:
            lines += [f"**NaN/inf now first appear at** "
                      + ", ".join(_md(n) for n in self.new_origins), ""]

        def change_table(rows: list[OpChange]) -> list[str]:
            out = ["| operator | kind | base | head | change |", "|---|---|--:|--:|--:|"]
            out += [f"| {_md(r.name)} | {_md_text(r.kind)} | {r.base:.2f} | {r.head:.2f} | "
                    f"**{r.delta:+.2f}** |" for r in rows]
            return out

        def presence_table(rows: list[OpPresence]) -> list[str]:
            out = ["| operator | kind | digits |", "|---|---|--:|"]
            out += [f"| {_md(r.name)} | {_md_text(r.kind)} | {r.digits:.2f} |" for r in rows]
            return out

        for title, rows, fn in (("Lost digits", self.drops, change_table),
                                ("Modules that lost digits", self.module_drops, change_table),
                                ("No longer analysed", self.vanished, presence_table)):
            if rows:
                lines += [f"**{title} ({len(rows)})**", ""] + fn(rows) + [""]
        if self.origins:
            o = self.origins[0]
            ref = f"its least accurate input {_md(o.worst_input)}" if o.worst_input \
                else "the format's cap"
            lines += [f"Digits are lost first at {_md(o.name)}: {o.digits:.2f} digits against "
                      f"{o.reference:.2f} of {ref} (local loss {o.local_loss:.2f}).", ""]
        for title, rows, fn in (("Gained digits", self.gains, change_table),
                                ("Added operators", self.added, presence_table),
                                ("Removed operators", self.removed, presence_table)):
            if rows:
                lines += [f"<details><summary>{title} ({len(rows)})</summary>", ""]
                lines += fn(rows)
                lines += ["", "</details>", ""]
        lines.append(f"{self.unchanged} operator(s) unchanged within ±{self.max_drop:g} digits.")
        return "\n".join(lines) + "\n"

    def as_dict(self) -> dict:
        def ch(r: OpChange) -> dict:
            return {"name": r.name, "kind": r.kind, "base": r.base, "head": r.head,
                    "delta": r.delta}

        def pr(r: OpPresence) -> dict:
            return {"name": r.name, "kind": r.kind, "digits": r.digits}

        return {"metric": self.metric, "max_drop": self.max_drop, "failed": self.failed,
                "base": self.base_label, "head": self.head_label,
                "new_nonfinite_origins": list(self.new_origins),
                "drops": [ch(r) for r in self.drops],
                "module_drops": [ch(r) for r in self.module_drops],
                "vanished": [pr(r) for r in self.vanished],
                "gains": [ch(r) for r in self.gains],
                "added": [pr(r) for r in self.added], "removed": [pr(r) for r in self.removed],
                "unchanged": self.unchanged, "notes": list(self.notes),
                "origins": [{"name": o.name, "local_loss": o.local_loss, "digits": o.digits,
                             "reference": o.reference, "worst_input": o.worst_input}
                            for o in self.origins]}

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(_encode(self.as_dict()), indent=indent, allow_nan=False)


def _md_text(s: str) -> str:
    return s.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _md(s: str) -> str:
    """Inline code for names (backticks in a name fall back to escaped text)."""
    return f"`{s}`".replace("|", "\\|") if "`" not in s else _md_text(s)


_COMPARED_SETTINGS = ("format", "n_samples", "granularity", "confidence", "rounding", "seed",
                      "target")


def diff(base: DigitMap, head: DigitMap, max_drop: float = 0.5, metric: Optional[str] = None,
         base_label: Optional[str] = None, head_label: Optional[str] = None) -> DiffResult:
    """The CI gate: match operators by name (and modules by path) and compare their digits.

    Args:
        base: the reference map (e.g. the main branch).
        head: the map under test (e.g. the pull request).
        max_drop: tolerance in digits: a drop larger than this fails; changes within it either
            way count as unchanged.
        metric: per-operator digits compared (default :data:`DEFAULT_METRIC`). NaN digits
            count as 0.
        base_label, head_label: names in the rendering (default: the maps' git commits).

    Returns:
        A :class:`DiffResult` (see it for what fails); ``notes`` lists analysis settings that
        differ between the maps (a diff across formats or sample counts compares different
        things); ``origins`` ranks the dropped operators by local loss in ``head``.

    Raises:
        DigitMapError: a map has no analysed operator (nothing to compare is no pass), or holds
            no value of ``metric`` (a schema 1 map has no normwise digits or quantiles).
    """
    metric = _check_metric(metric)
    if isinstance(max_drop, bool) or not isinstance(max_drop, (int, float)) \
            or not math.isfinite(max_drop) or max_drop < 0:
        raise ValueError(f"max_drop must be a finite number >= 0, got {max_drop!r}")
    for dm, what in ((base, "base"), (head, "head")):
        src = str(dm.metadata.get("target") or what)
        if not dm.operators:
            raise DigitMapError(f"the {what} map has no analysed operator: nothing was "
                                f"compared (was the model analysed? see `fxstab record`)", src)
        if all(math.isnan(op.digits(metric)) for op in dm.operators.values()):
            raise DigitMapError(f"the {what} map has no {metric} digits (a schema version 1 "
                                f"map): record it again, or compare with --metric avg", src)
    drops, gains, unchanged = [], [], 0
    for name, b in base.operators.items():
        if name not in head.operators:
            continue
        h = head.operators[name]
        c = OpChange(name, h.kind, _as_digits(b.digits(metric)), _as_digits(h.digits(metric)))
        if -c.delta > max_drop:
            drops.append(c)
        elif c.delta > max_drop:
            gains.append(c)
        else:
            unchanged += 1
    drops.sort(key=lambda c: (c.delta, c.name))
    gains.sort(key=lambda c: (-c.delta, c.name))
    added = [OpPresence(n, o.kind, _as_digits(o.digits(metric)))
             for n, o in head.operators.items() if n not in base.operators]
    removed = [OpPresence(n, o.kind, _as_digits(o.digits(metric)))
               for n, o in base.operators.items() if n not in head.operators]

    # modules whose operators were renamed: compare their worst operators
    def by_module(dm: DigitMap) -> dict[str, list[OperatorDigits]]:
        out: dict[str, list[OperatorDigits]] = {}
        for op in dm.operators.values():
            out.setdefault(op.module_path, []).append(op)
        return out

    bm, hm = by_module(base), by_module(head)
    module_drops = []
    for path, bops in bm.items():
        hops = hm.get(path)
        if not hops or {o.name for o in bops} == {o.name for o in hops}:
            continue
        bd = min(_as_digits(o.digits(metric)) for o in bops)
        hd = min(_as_digits(o.digits(metric)) for o in hops)
        if bd - hd > max_drop:
            module_drops.append(OpChange(path or "(top level)", "module", bd, hd))
    module_drops.sort(key=lambda c: (c.delta, c.name))
    still = head.metadata.get("modules")
    still = set(still) if isinstance(still, list) else set()
    vanished = [r for r in removed
                if base.operators[r.name].module_path not in hm
                and base.operators[r.name].module_path in still]
    gone = {r.name for r in vanished}
    removed = [r for r in removed if r.name not in gone]
    base_origins = set(base.nonfinite_sources())
    new_origins = [n for n in head.nonfinite_sources() if n not in base_origins]

    notes = []
    for key in _COMPARED_SETTINGS:
        bv, hv = base.metadata.get(key), head.metadata.get(key)
        if bv is not None and hv is not None and bv != hv:
            notes.append(f"{key} differs: {bv!r} (base) vs {hv!r} (head)")

    def label(dm: DigitMap, default: str) -> str:
        commit = dm.metadata.get("git_commit")
        return f"{default} {commit[:10]}" if isinstance(commit, str) and commit else default

    dropped = {c.name for c in drops}
    origins = [x for x in head.localize(metric) if x.name in dropped]
    return DiffResult(metric, float(max_drop), drops, gains, added, removed, unchanged, notes,
                      base_label or label(base, "base"), head_label or label(head, "head"),
                      origins, new_origins, module_drops, vanished)
