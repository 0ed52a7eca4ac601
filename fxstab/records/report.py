"""Per-operator reports: what one analysed call of one instrumented operator looked like.

An :class:`OpReport` is the unit every analysis produces (operator level, aten level, eager
driver); a digit map (``fxstab.digitmap``) aggregates them over calls. Field names here are the
JSON keys of digit maps, so renaming one is a schema change.
"""

from __future__ import annotations

import math
import struct
from collections.abc import MutableSequence
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from ..numerics.digits import STATS_LEN, normwise_digits

COUNTER_KEYS = (
    "cancellation",
    "division",
    "multiplication",
    "power",
    "math_function",
    "intrinsic",
    "branching",
    "anomaly",
)

# Status of an operator in one analysed call.
ROUNDED = "rounded"  # output rounded into the format and recorded
OBSERVED = "observed"  # recorded without rounding (an exact primitive, recorded on request)
UNLIFTED = "unlifted"  # could not run on stacked samples: ran per sample, unrounded
PER_SAMPLE = "per_sample"  # no batching rule: ran once per sample, rounded and recorded


_NO_COUNTS = {k: 0 for k in COUNTER_KEYS}


def empty_counters() -> dict[str, int]:
    return dict(_NO_COUNTS)


@dataclass(slots=True)
class OpReport:
    """Digits of one instrumented operator's output in one analysed call.

    ``name`` is stable across runs and unrelated edits: ``module.path/kind#k`` where ``k``
    counts the operators of that kind within that module, in graph order (docs/design.md §7).
    ``inputs`` names the instrumented operators whose outputs feed this one (graph edges).
    """

    name: str
    kind: str
    module_path: str
    source: str = ""
    phase: str = "default"
    step: Optional[int] = None
    format: str = ""
    n_samples: int = 0
    avg_digits: float = 0.0
    min_digits: float = 0.0
    max_digits: float = 0.0
    numel: int = 0
    zero_fraction: float = 0.0
    non_finite: int = 0
    normwise_digits: float = 0.0
    p10_digits: float = 0.0
    p50_digits: float = 0.0
    underflow: int = 0
    # the avg digits a round-to-nearest run in the format is expected to keep (an estimate to
    # compare with a real run; avg_digits is CESTAC's bound: fxstab.numerics.digits.run_shift)
    run_digits: float = math.nan
    surrogate: bool = False
    status: str = ROUNDED
    shape: tuple = ()
    counters: dict = field(default_factory=empty_counters)
    inputs: tuple = ()
    call: int = 0
    # "forward", or "backward": an operator of the backward graph (its name says the forward
    # operator it belongs to) or a parameter's gradient (kind "param_grad")
    direction: str = "forward"
    # a modelled GEMM's accumulator (accumulate=): the digits its output shares with the same
    # operator's exact sum of the same operand samples, average and minimum over the elements
    # (rules.accumulation.modelled_gemm; NaN: no accumulator modelled). A bias of a nearest or
    # directed accumulator, which the samples' spread (the digits above) cannot show
    accumulator_digits: float = math.nan
    accumulator_min_digits: float = math.nan
    # a modelled GEMM's operands in a low-precision recipe (gemm_inputs=): per-block statistics
    # of both operands as the recipe scales them and rounds them to nearest
    # (numerics.accumulation.operand_stats): non-zero elements, how many flush to zero, how
    # many saturate, the smallest and largest group scale (NaN: no recipe, no non-zero group)
    operand_elements: int = 0
    operand_underflow: int = 0
    operand_saturation: int = 0
    operand_scale_min: float = math.nan
    operand_scale_max: float = math.nan
    # where its digits go: the digits the exact product of the recipe's operands keeps of the
    # program's exact product (average, minimum; NaN: no recipe), beside accumulator_digits
    operand_digits: float = math.nan
    operand_min_digits: float = math.nan

    def as_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["inputs"] = list(self.inputs)
        return d

    @classmethod
    def from_stats(cls, fixed: tuple, phase: str, step: Optional[int], call: int,
                   surrogate: bool, counters: dict, v: Sequence[float], n: int, t: float,
                   cap: float) -> "OpReport":
        """A report from the fields its operator's reports share (``fixed``: the values of
        :data:`FIXED_FIELDS`, see :meth:`fixed_of`), this call's, and a statistics list
        (:func:`fxstab.numerics.digits.stats_vector`'s layout; empty: the cap), with the digits of
        :func:`fxstab.numerics.digits.stats_from_list`: how the backends build their reports."""
        name, kind, module_path, source, fmt, n_samples, status, shape, inputs, direction = fixed
        total, mn, mx, zeros, nf, numel, msq, vsq, under, p10, p50, run = v
        if numel == 0:  # nothing measured: every digit figure the cap
            return cls(name=name, kind=kind, module_path=module_path, source=source,
                       phase=phase, step=step, format=fmt, n_samples=n_samples,
                       avg_digits=cap, min_digits=cap, max_digits=cap, numel=0,
                       zero_fraction=0.0, non_finite=0, normwise_digits=cap, p10_digits=cap,
                       p50_digits=cap, underflow=0, run_digits=cap, surrogate=surrogate,
                       status=status,
                       shape=shape, counters=counters, inputs=inputs, call=call,
                       direction=direction)
        return cls(name=name, kind=kind, module_path=module_path, source=source, phase=phase,
                   step=step, format=fmt, n_samples=n_samples, avg_digits=total / numel,
                   min_digits=mn, max_digits=mx, numel=int(numel), zero_fraction=zeros / numel,
                   non_finite=int(nf), normwise_digits=normwise_digits(msq, vsq, nf, n, t, cap),
                   p10_digits=p10, p50_digits=p50, underflow=int(under),
                   run_digits=run / numel, surrogate=surrogate,
                   status=status, shape=shape, counters=counters, inputs=inputs, call=call,
                   direction=direction)

    def fixed(self) -> tuple:
        """This report's :data:`FIXED_FIELDS` (what :meth:`from_stats` takes)."""
        return tuple(getattr(self, k) for k in FIXED_FIELDS)

    @staticmethod
    def fixed_of(values: dict) -> tuple:
        """The :data:`FIXED_FIELDS` of :meth:`from_stats` from a dict of field values (the
        defaults where it has none)."""
        return tuple(values[k] if k in values else _DEFAULTS[k] for k in FIXED_FIELDS)


# the fields of a report that no call changes (OpReport.from_stats)
FIXED_FIELDS = ("name", "kind", "module_path", "source", "format", "n_samples", "status", "shape",
                "inputs", "direction")
_DEFAULTS = {"source": "", "format": "", "n_samples": 0, "status": ROUNDED, "shape": (),
             "inputs": (), "direction": "forward"}


_ROW = struct.Struct(f"{STATS_LEN}d")  # a statistics row kept past its call, as bytes


class ReportLog(MutableSequence):
    """The reports of an analysis in the order they were made (``be.reports``): a list of
    :class:`OpReport`, except that the latest ones may still be held as what they are built
    from (a statistics row and the operator's fixed fields: :meth:`defer`), built the first
    time anything reads the log. An analysed call then spends no time building reports that
    nobody reads before the next call, and holds ~0.2 KB per operator instead of ~0.7 KB until
    they are read; reading them builds exactly the reports it would have built (once: they
    are kept)."""

    __slots__ = ("_built", "_raw", "_more")

    def __init__(self, reports: Iterable[OpReport] = ()) -> None:
        self._built: list[OpReport] = list(reports)
        # (build, row): build(row) is one report, or a list of them (defer_many)
        self._raw: list[tuple[Callable[[Any], Any], Any]] = []
        self._more = 0  # the deferred reports beyond one per entry of _raw

    def defer(self) -> Callable[[tuple], None]:
        """The ``append`` of deferred reports, ``add((build, row))``: ``build(row)`` is the
        report, called once, when the log is first read after it (a read between two adds
        keeps their order)."""
        return self._raw.append

    def defer_many(self, build: Callable[[Any], list], rows: Any, count: int) -> None:
        """``count`` deferred reports in one entry: ``build(rows)`` is their list (a call's
        operators whose statistics rows lie in one block), in their order among the log's."""
        if count:
            self._raw.append((build, rows))
            self._more += count - 1

    def _reports(self) -> list[OpReport]:
        raw = self._raw
        if raw:  # emptied in place: the appends that defer() gave out stay this log's
            built = self._built
            for build, row in raw:
                r = build(row)
                if type(r) is list:
                    built.extend(r)
                else:
                    built.append(r)
            raw.clear()
            self._more = 0
        return self._built

    def __len__(self) -> int:
        return len(self._built) + len(self._raw) + self._more

    def __getitem__(self, i):
        return self._reports()[i]

    def __setitem__(self, i, value) -> None:
        self._reports()[i] = value

    def __delitem__(self, i) -> None:
        del self._reports()[i]

    def insert(self, i: int, value: OpReport) -> None:
        self._reports().insert(i, value)

    def append(self, value: OpReport) -> None:
        self._reports().append(value)

    def __iter__(self) -> Iterator[OpReport]:
        return iter(self._reports())

    def clear(self) -> None:
        self._built.clear()
        self._raw.clear()
        self._more = 0

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (ReportLog, list)):
            return self._reports() == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"ReportLog({self._reports()!r})"


def stats_row(v: Any) -> bytes:
    """A statistics row (:func:`fxstab.numerics.digits.stats_vector`'s layout) kept past its call as
    bytes: a CPU kernel's own buffer (reused by its next call) copied, a list packed (96 bytes
    instead of ~400 for a list of floats)."""
    return v if type(v) is bytes else _ROW.pack(*v) if isinstance(v, (list, tuple)) else bytes(v)


def row_values(v: bytes) -> tuple:
    """The statistics of a :func:`stats_row` row, as :meth:`OpReport.from_stats` takes them."""
    return _ROW.unpack(v)


@dataclass(slots=True)
class ReportRow:
    """One operator's report of one analysed call as a tracer hands it to the log
    (:meth:`ReportLog.defer`, with :func:`report_builder`'s ``build``): what it is built from,
    kept until the log is read.

    Attributes:
        fixed: the operator's :data:`FIXED_FIELDS` (:meth:`OpReport.fixed_of`).
        cap: its digit cap (the digits of a value measured exactly).
        surrogate: whether its GEMM surrogate fired in this call.
        stats: its statistics row (:func:`stats_row`).
        counters: its instability counters; None: none counted (the usual case: no dict
            kept until the log is read).
        gemm: a modelled GEMM's figures: the accumulator's digits ``(avg, min)``, with its
            operands' statistics as ``.operands`` where a recipe rounds them
            (:class:`fxstab.rules.accumulation.GemmFigures`); None: no GEMM modelled.
    """

    fixed: tuple
    cap: float
    surrogate: bool
    stats: bytes
    counters: Optional[dict] = None
    gemm: Optional[tuple] = None


def report_builder(phase: str, step: Optional[int], call: int, n: int,
                   t: float) -> Callable[[ReportRow], OpReport]:
    """The ``build`` of one analysed call's deferred reports (:meth:`ReportLog.defer`): one
    :class:`ReportRow` to its :class:`OpReport`."""
    from_stats = OpReport.from_stats

    def build(row: ReportRow) -> OpReport:
        counters = row.counters
        r = from_stats(row.fixed, phase, step, call, row.surrogate,
                       empty_counters() if counters is None else counters,
                       row_values(row.stats), n, t, row.cap)
        gemm = row.gemm
        if gemm is not None:  # a modelled GEMM's accumulator digits (avg, min)
            r.accumulator_digits, r.accumulator_min_digits = gemm
            for k, v in getattr(gemm, "operands", {}).items():  # its operands' statistics
                setattr(r, f"operand_{k}", v)
        return r

    return build


def block_builder(phase: str, step: Optional[int], call: int, n: int,
                  t: float) -> Callable[[tuple], list]:
    """The ``build`` of :meth:`ReportLog.defer_many` for one call's operators whose statistics
    rows lie in one block: ``(layout, block, surrogate)`` with ``layout`` the operators in
    their order, each ``(fixed, cap, row)``, ``block`` the rows (``bytes``, :func:`stats_row`'s
    layout one after another) and ``surrogate`` a byte per row (its GEMM surrogate fired)."""
    from_stats, unpack = OpReport.from_stats, _ROW.unpack_from
    size = _ROW.size

    def build(rows: tuple) -> list:
        layout, block, surrogate = rows
        return [from_stats(fixed, phase, step, call, bool(surrogate[k]), empty_counters(),
                           unpack(block, k * size), n, t, cap) for fixed, cap, k in layout]

    return build
