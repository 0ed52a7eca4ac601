"""CADNA's instability counters at the arithmetic level (docs/design.md §5).

Each aten primitive executed on stacked samples is checked against CADNA's taxonomy. CADNA counts
*events*: one per scalar operation that met the condition. A tensor primitive is many scalar
operations, so here the count is the number of output elements (after broadcasting) for which the
condition held; a scalar program therefore counts exactly as CADNA would.

=================  =====================================================================
key                condition, per output element
=================  =====================================================================
cancellation       add/sub: result digits <= min(operand digits) - ``cancel_digits``
division           div/reciprocal/remainder: the divisor is a computational zero
multiplication     mul: both factors are computational zeros
power              pow: the base or the exponent is a computational zero
math_function      sqrt/log/exp/sin/...: the argument is a computational zero
intrinsic          abs of samples with mixed signs; floor/ceil/trunc/round/sign/int casts
                   whose per-sample results disagree
branching          comparisons, max/min/clamp/relu/threshold: the difference of the compared
                   operands is a computational zero; ``where`` whose condition differs across
                   samples
anomaly            NaN or inf produced from finite operands
=================  =====================================================================

Operands that are plain tensors or Python numbers are exact (all samples identical): they have
the format's full digits and are never computational zeros.

``diagnostics``: ``"off"`` computes nothing, ``"summary"`` keeps the counts (computed from the
per-element digits the rules already have, plus a few boolean reductions), ``"detailed"`` also
keeps one :class:`CounterEvent` per (primitive call, counter) with the worst element.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional

from .report import COUNTER_KEYS, empty_counters

__all__ = ["DIAGNOSTICS", "CounterEvent", "Counters", "instability_counters", "active_collectors",
           "check_diagnostics", "COUNTER_KEYS"]

DIAGNOSTICS = ("off", "summary", "detailed")


def check_diagnostics(value: str) -> str:
    """Validate a ``diagnostics`` setting."""
    if value not in DIAGNOSTICS:
        raise ValueError(f"diagnostics must be one of {DIAGNOSTICS}, got {value!r}")
    return value


@dataclass(frozen=True)
class CounterEvent:
    """One primitive call that triggered one counter (``diagnostics="detailed"``).

    ``index`` is the flat index (in the primitive's output) of the worst element: the one with the
    fewest digits among those that triggered; ``value`` is its sample mean and ``digits`` its
    digits.
    """

    kind: str
    primitive: str
    name: str
    count: int
    index: int
    value: float
    digits: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Counters:
    """Counts per key (the keys of :data:`fxstab.records.report.COUNTER_KEYS`) and, in detailed mode,
    the events."""

    diagnostics: str = "summary"
    counts: dict = field(default_factory=empty_counters)
    events: list = field(default_factory=list)

    def __post_init__(self) -> None:
        check_diagnostics(self.diagnostics)

    def add(self, kind: str, count: int, event: Optional[CounterEvent] = None) -> None:
        if kind not in self.counts:
            raise ValueError(f"unknown counter {kind!r}; keys: {COUNTER_KEYS}")
        self.counts[kind] += int(count)
        if event is not None and self.diagnostics == "detailed":
            self.events.append(event)

    def merge(self, counts: dict, events: list = ()) -> None:
        for k, v in counts.items():
            if v:
                self.counts[k] += int(v)
        if self.diagnostics == "detailed":
            self.events.extend(events)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def table(self) -> str:
        """Text table of the counts, CADNA's order."""
        width = max(len(k) for k in COUNTER_KEYS)
        return "\n".join(f"{k:<{width}}  {self.counts[k]}" for k in COUNTER_KEYS)


_local = threading.local()


def active_collectors() -> list:
    """The collectors opened by :func:`instability_counters` on this thread (innermost last)."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextmanager
def instability_counters(diagnostics: str = "summary") -> Iterator[Counters]:
    """Collect CADNA's counters of every primitive run on stochastic values inside the block.

    >>> with fxstab.instability_counters() as c:
    ...     y = (x + 1) - 1
    >>> c.counts["cancellation"]

    Nested blocks each see every event of their extent.
    """
    check_diagnostics(diagnostics)
    c = Counters(diagnostics)
    stack = active_collectors()
    stack.append(c)
    try:
        yield c
    finally:
        stack.remove(c)
