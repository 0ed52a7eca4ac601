"""Digit maps: per-operator digits of one analysis, saved, diffed and localized
(docs/design.md §7).

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

The package, in the order its modules build on each other:

- :mod:`~fxstab.digitmap.operators`: the records (:class:`OperatorDigits`,
  :class:`StepDigits`, :class:`LocalLoss`), the metrics and the aggregation of reports;
- :mod:`~fxstab.digitmap.hints`: the findings' thresholds, the legend, :func:`hint`;
- :mod:`~fxstab.digitmap.schema`: the JSON schema, its versions and validation,
  :class:`DigitMapError`;
- :mod:`~fxstab.digitmap.fixrecord`: :class:`~fxstab.digitmap.fixrecord.Fix`, a stable
  rewrite tried on the program and what it did (``fxstab fix``), as a map keeps it;
- :mod:`~fxstab.digitmap.map`: :class:`DigitMap` (aggregation, tables, time series,
  localization, save and load);
- :mod:`~fxstab.digitmap.compare`: :func:`diff`, the CI gate, and :class:`DiffResult`.
"""

from .compare import DiffResult, OpChange, OpPresence, Rewrite, diff
from .findings import mechanism_hint
from .hints import LEGEND, MIN_FINDING, MIN_UNDERFLOW, hint
from .map import DigitMap, PathLike
from .operators import DEFAULT_METRIC, METRICS, LocalLoss, OperatorDigits, StepDigits
from .schema import SCHEMA_NAME, SCHEMA_VERSION, DigitMapError

__all__ = [
    "DEFAULT_METRIC",
    "LEGEND",
    "METRICS",
    "MIN_FINDING",
    "MIN_UNDERFLOW",
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "DiffResult",
    "DigitMap",
    "DigitMapError",
    "LocalLoss",
    "OpChange",
    "OpPresence",
    "OperatorDigits",
    "PathLike",
    "Rewrite",
    "StepDigits",
    "diff",
    "hint",
    "mechanism_hint",
]
