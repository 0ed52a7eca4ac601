"""The digit map: per-operator digits of one analysis, with its metadata (docs/design.md §7).

A :class:`DigitMap` aggregates :class:`fxstab.records.report.OpReport` records (one per instrumented
operator and analysed call) per stable operator name, keeps per-(phase, step) entries for the time
series over training, carries the metadata of the analysis and the graph edges between
instrumented operators. It renders itself as tables, ranks where digits are lost
(:meth:`DigitMap.localize`), and saves as JSON only (schema-versioned, written atomically; the
schema and its validation are :mod:`fxstab.digitmap.schema`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from ..records.report import COUNTER_KEYS, OBSERVED, ROUNDED, OpReport
from .findings import NO_FINDINGS, findings, impact_or_0, zero_readers
from .fixrecord import Fix
from .hints import LEGEND, MIN_FINDING
from .operators import (
    METRICS,
    STATUS_SEVERITY,
    LocalLoss,
    OperatorDigits,
    StepDigits,
    accumulator_digits,
    accumulator_keys,
    run_keys,
    aggregate,
    as_digits,
    check_metric,
    effective_digits,
    source_code,
    nanmax,
    operand_keys,
)
from .schema import SCHEMA_NAME, SCHEMA_VERSION, DigitMapError, decode_map, encode

PathLike = Union[str, "os.PathLike[str]"]


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


def _digits_cell(v: float) -> str:
    """A table's digits column: the figure, or ``-`` where the map does not hold it."""
    return f"{'-':>8}" if math.isnan(v) else f"{v:>8.2f}"


# --------------------------------------------------------------------------- the map
class DigitMap:
    """Per-operator digits of one analysis (or of many calls aggregated), with metadata.

    Attributes:
        metadata: analysis settings and provenance (format, n_samples, seed, granularity,
            confidence, rounding, target, analysed_calls, fxstab/torch versions, git commit...).
        operators: name -> :class:`OperatorDigits`, in graph order (first appearance).
        steps: :class:`StepDigits` per (phase, step, operator), in order of appearance.

    A map made with fixes (``fxstab fix``, :func:`fxstab.fixes.verify.analyse_fixes`) holds
    them: :meth:`fixes`.
    """

    def __init__(self, operators: Iterable[OperatorDigits] = (), metadata: Optional[dict] = None,
                 steps: Iterable[StepDigits] = (), fixes: Iterable[Fix] = ()) -> None:
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.operators: dict[str, OperatorDigits] = {}
        for op in operators:
            if op.name in self.operators:
                raise ValueError(f"duplicate operator name {op.name!r} in a digit map")
            self.operators[op.name] = op
        self.steps: list[StepDigits] = list(steps)
        self._fixes: list[Fix] = list(fixes)

    def fixes(self) -> list[Fix]:
        """The stable rewrites tried on the program, as ``fxstab fix`` made the map with them
        (:class:`~fxstab.digitmap.fixrecord.Fix`, verified first); [] for a map made without."""
        return list(self._fixes)

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
        meta_in = metadata or {}
        auto = meta_in.get("format") == "auto"
        # formats= (a precision plan): an operator outside the map's format names its own
        planned = bool(meta_in.get("formats")) and not auto
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
            status = max((r.status for r in rs), key=lambda s: STATUS_SEVERITY.get(s, 4))
            ops.append(OperatorDigits(
                name=name, kind=first.kind, module_path=first.module_path, source=first.source,
                code=source_code(first.source),
                direction=getattr(first, "direction", "forward"),
                format=first.format if auto or (planned and first.format != meta_in.get(
                    "format")) else "",
                shape=tuple(first.shape), status=status, surrogate=any(r.surrogate for r in rs),
                counters=counters, inputs=tuple(inputs), **aggregate(rs)))
        known = set(by_name)
        for op in ops:  # edges only between instrumented operators of this map
            op.inputs = tuple(i for i in op.inputs if i in known and i != op.name)

        groups: dict[tuple, dict[str, list[OpReport]]] = {}
        for r in reports:
            groups.setdefault((r.phase, r.step), {}).setdefault(r.name, []).append(r)
        steps = [StepDigits(phase=phase, step=step, name=name, **aggregate(rs))
                 for (phase, step), per_op in groups.items() for name, rs in per_op.items()]

        meta = _default_metadata()
        if auto:  # format="auto": each operator its own
            meta["format"] = "auto"
        elif not planned:
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
                       "p10_digits", "p50_digits", "run_digits", "zero_fraction", "non_finite",
                       "underflow",
                       "accumulator_digits", "accumulator_min_digits")

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
        return nanmax(op.max_digits for op in self.operators.values()) if self.operators else 0.0

    def sorted_worst_first(self, metric: Optional[str] = None) -> list[OperatorDigits]:
        """Operators by ``metric`` digits (default :data:`DEFAULT_METRIC`), then min digits,
        then name (NaN digits count as 0)."""
        metric = check_metric(metric)

        def key(op: OperatorDigits) -> tuple:
            return (as_digits(op.digits(metric)), as_digits(op.min_digits), op.name)
        return sorted(self.operators.values(), key=key)

    def worst(self, k: int = 10, metric: Optional[str] = None) -> list[OperatorDigits]:
        """The ``k`` operators with the fewest reliable digits under ``metric`` (worst first)."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        return self.sorted_worst_first(metric)[:k]

    def sorted_by_impact(self, metric: Optional[str] = None) -> list[OperatorDigits]:
        """Operators by their impact on the outputs, largest first (unmeasured last), then as
        :meth:`sorted_worst_first`."""
        order = {op.name: i for i, op in enumerate(self.sorted_worst_first(metric))}
        return sorted(self.operators.values(),
                      key=lambda op: (math.isnan(op.impact), -impact_or_0(op), order[op.name]))

    def table(self, top: Optional[int] = None, metric: Optional[str] = None,
              sort: Optional[str] = None) -> str:
        """A readable text table of the operators with a legend: worst first under ``metric``
        (the column marked ``*``), or with ``sort="impact"`` largest impact on the outputs
        first, the default of a map that holds impacts (``fxstab record --impact``).

        Raises:
            ValueError: an unknown ``sort``, or ``"impact"`` for a map without impacts.
        """
        metric = check_metric(metric)
        has_impact = self.impact_threshold() is not None
        sort = sort or ("impact" if has_impact else "digits")
        if sort not in SORTS:
            raise ValueError(f"sort must be one of {', '.join(SORTS)}; got {sort!r}")
        if sort == "impact" and not has_impact:
            raise ValueError("this digit map holds no impacts: record it with --impact "
                             "(fxstab.operator_impact), or sort by digits")
        ops = self.sorted_by_impact(metric) if sort == "impact" else \
            self.sorted_worst_first(metric)
        # the operators that only carry an origin's NaN/inf (everything downstream of an
        # overflow): one line naming the origin, not rows of zeros ahead of what matters
        carried = self.carried_nonfinite()
        ops = [op for op in ops if op.name not in carried]
        shown = len(ops)
        ops = ops if top is None else ops[:max(0, top)]
        m = self.metadata
        order = f"{metric} digits" if sort == "digits" else "impact on the outputs"
        head = (f"digit map: {len(self)} operators, format {m.get('format', '?')}, "
                f"N={m.get('n_samples', '?')}, cap {self.cap:.2f} digits, "
                f"{m.get('analysed_calls', '?')} analysed call(s); sorted by {order}")
        if not ops and not carried:
            return head + "\n(no operators)"
        width = max([8, *(len(op.name) for op in ops)])
        kw = max([4, *(len(op.kind) for op in ops)])
        cols = [c for c in METRICS]
        # a modelled GEMM's accumulator: a column only in a map that measured one
        acc = any(not math.isnan(op.accumulator_digits) for op in self.operators.values())
        # each operator's impact on the outputs: a column only in a map that measured it
        impact = self.impact_threshold() is not None
        lines = [head,
                 f"{'operator':<{width}}  {'kind':<{kw}}  {'calls':>5}  {'numel':>9}  "
                 + "  ".join(f"{c + ('*' if c == metric else ''):>8}" for c in cols)
                 + (f"  {'acc':>6}" if acc else "") + (f"  {'impact':>6}" if impact else "")
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
                + "  ".join(_digits_cell(op.digits(c)) for c in cols)
                + (f"  {_acc_cell(op, metric):>6}" if acc else "")
                + (f"  {_impact_cell(op):>6}" if impact else "")
                + f"  {100 * op.zero_fraction:>5.1f}%  {op.non_finite:>6}  {op.underflow:>6}  "
                f"{' '.join(flags)}".rstrip())
        if top is not None and top < shown:
            lines.append(f"... {shown - top} more operator(s)")
        groups: dict = {}
        for name, origins in carried.items():
            groups.setdefault(origins, []).append(name)
        for origins, names in groups.items():
            lines.append(f"... {len(names)} operator(s) only carry the NaN/inf of "
                         f"{', '.join(origins)}: {', '.join(names[:3])}"
                         + (f" and {len(names) - 3} more" if len(names) > 3 else ""))
        lines.append(LEGEND.format(cap=self.cap) + (ACCUMULATOR_LEGEND if acc else "")
                     + ("; impact: the digits the outputs lose to the operator's own rounding "
                        "(an ablation, fxstab.operator_impact)" if impact else ""))
        return "\n".join(lines)

    def findings(self, top: int = 3, metric: Optional[str] = None) -> list[str]:
        """What to look at first, one line each with a hint (:func:`fxstab.digitmap.findings.
        findings`): where NaN/inf first appear, the largest local losses (ranked by what they
        cost the outputs where impacts were measured) and underflow; notes last. The empty list
        is the healthy answer (:data:`NO_FINDINGS` says so in words)."""
        return findings(self, top, metric)

    def summary(self, top: int = 3, metric: Optional[str] = None) -> str:
        """The findings as ``fxstab show`` prints them: ``findings:`` and one ``- line`` each,
        or ``findings: none (no NaN/inf origin, no operator losing a quarter of the cap or
        more)`` when :meth:`findings` is empty."""
        lines = self.findings(top=top, metric=metric)
        if not lines:
            return f"findings: {NO_FINDINGS}"
        return "\n".join(["findings:", *(f"  - {line}" for line in lines)])

    def biased_accumulators(self, metric: Optional[str] = None) -> list[tuple]:
        """The modelled GEMMs whose accumulator keeps fewer digits of its exact sum than the
        samples' spread estimates, by at least the findings' margin (``MIN_FINDING`` of the
        operator's cap): ``(operator, its digits, its accumulator's)``, fewest accumulator
        digits first. A nearest or directed accumulator rounds every sample alike, so the
        spread reads high; the accumulator's own figure (docs/accumulation.md) does not."""
        out = []
        for op in self.operators.values():
            acc = accumulator_digits(op, metric)
            own = as_digits(op.digits(metric))
            if not math.isnan(acc) and own - acc >= MIN_FINDING * self.cap_of(op):
                out.append((op, own, acc))
        return sorted(out, key=lambda x: (x[2], x[0].name))

    def __repr__(self) -> str:
        return (f"DigitMap({len(self)} operators, format={self.metadata.get('format')!r}, "
                f"steps={len(self.step_keys())})")

    def _repr_html_(self) -> Optional[str]:
        """Jupyter's display: the title, settings, findings, the operators with the fewest
        digits and the coverage (:func:`fxstab.plots.notebook.map_fragment`)."""
        from ..records import display

        return display.html(self)

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
        check_metric(metric)
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

        An operator's digits here are its CESTAC digits, or its accumulator's own digits where
        those are fewer (a modelled GEMM with a nearest or directed accumulator: a bias the
        samples' spread cannot show; :func:`~fxstab.digitmap.operators.effective_digits`).
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
        metric = check_metric(metric)
        origins = set(self.nonfinite_sources())
        # operators whose output holds infinities the program absorbs (an additive mask):
        # their statistics count those elements as 0 digits, so they are no reference and
        # lose nothing of their own (absorbed_nonfinite)
        masked = {name for region, _ in self.absorbed_nonfinite().values() for name in region}
        out = []
        for op in self.operators.values():
            own = effective_digits(op, metric)
            cap = self.cap_of(op)
            ins = [i for i in op.inputs if i in self.operators and i not in masked]
            if ins:
                worst = min(ins, key=lambda i: (effective_digits(self.operators[i], metric), i))
                # no operator keeps more than its format holds (format="auto": an fp32 input
                # feeding a bf16 operator is the program's own precision drop, not a loss)
                ref = min(effective_digits(self.operators[worst], metric), cap)
            else:
                worst, ref = None, cap
            # an observed operator does no arithmetic: it loses nothing of its own
            loss = 0.0 if op.status == OBSERVED or op.name in masked else ref - own
            out.append(LocalLoss(op.name, op.kind, own, ref, worst, loss, op.name in origins,
                                 own < as_digits(op.digits(metric))))
        order = {name: i for i, name in enumerate(self.operators)}
        return sorted(out, key=lambda x: (not x.nonfinite_origin,
                                          order[x.name] if x.nonfinite_origin else 0,
                                          -x.local_loss, x.digits, x.name))

    def nonfinite_sources(self) -> list[str]:
        """Operators where NaN/inf first appear and reach the program's outputs: an overflow or
        an invalid operation starts there; everything downstream merely propagates it.

        An origin is an operator whose output holds NaN/inf although none of its instrumented
        inputs does. An observed operator (an exact primitive recorded without rounding, such
        as an attention mask's ``masked_fill(-inf)`` at the arithmetic level) writes its
        infinities by design: it is no origin, but its consumers read them. An origin whose
        infinities the program absorbs before any output (:meth:`absorbed_nonfinite`: an
        additive ``finfo.min`` mask that rounds to ``-inf`` and a softmax turns into 0) is a
        note, not a source. Graph order (the order of the map) is kept.
        """
        absorbed = self.absorbed_nonfinite()
        return [name for name in self._nonfinite_origins() if name not in absorbed]

    def carried_nonfinite(self) -> dict[str, tuple]:
        """Operators whose NaN/inf all come from upstream (an input holds them and the
        operator is no origin) -> the origins (:meth:`_nonfinite_origins`) they carry, in graph
        order: what the table folds into one line per origin."""
        origins = set(self._nonfinite_origins())
        out: dict[str, tuple] = {}
        for op in self.operators.values():  # graph order: inputs first
            if not op.non_finite or op.name in origins:
                continue
            up: dict = {}
            for i in op.inputs:
                if i in origins:
                    up[i] = None
                elif i in out:
                    up.update(dict.fromkeys(out[i]))
            if up:
                out[op.name] = tuple(up)
        return out

    def _nonfinite_origins(self) -> list[str]:
        """Every operator with NaN/inf in its output and none in its instrumented inputs."""
        out = []
        for op in self.operators.values():
            if op.non_finite and op.status != OBSERVED and not any(
                    self.operators[i].non_finite for i in op.inputs if i in self.operators):
                out.append(op.name)
        return out

    def consumers(self) -> dict[str, list[str]]:
        """Operator -> the instrumented operators that read it (the edges, reversed)."""
        out: dict[str, list[str]] = {name: [] for name in self.operators}
        for op in self.operators.values():
            for i in op.inputs:
                if i in out:
                    out[i].append(op.name)
        return out

    def zero_readers(self, name: str, reference: float,
                     metric: Optional[str] = None) -> list[str]:
        """The readers that keep the digits computational zero ``name`` lost, or ``[]``
        (:func:`fxstab.digitmap.findings.zero_readers`)."""
        return zero_readers(self, name, reference, metric)

    def absorbed_nonfinite(self) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
        """NaN/inf origins whose non-finite values the program absorbs before any output:
        origin -> (the operators that carry them, from the origin on; the operators that
        absorb them).

        Decided from the graph and the samples: from the origin, the operators that read a
        non-finite value and hold non-finite values themselves carry them on; the origin is
        absorbed when every operator so reached is read by instrumented operators and every
        path ends at an operator whose samples are all finite (a softmax that turns ``-inf``
        into 0). An operator of the region that no instrumented operator reads may be an
        output: then the values are not absorbed, nor where a NaN is born from them and flows
        on. What a real run in the format with an fp32 mask computes is exactly this, so it
        stays visible as a note (:meth:`findings`), never as a finding, a rank or a gate.
        """
        consumers = self.consumers()
        order = {name: i for i, name in enumerate(self.operators)}
        # operators whose values reach no output but through instrumented ones (past them:
        # integer casts, comparisons, masks); recorded by the analysis (metadata)
        sinks = set(self.metadata.get("no_output", ()))
        # operators that are outputs and read by operators too (recorded by the analysis)
        outputs = set(self.metadata.get("outputs", ()))
        out = {}
        for origin in self._nonfinite_origins():
            region, todo, absorbers, closed = {origin}, [origin], set(), True
            while todo and closed:
                name = todo.pop()
                readers = consumers[name]
                if (not readers and name not in sinks) or name in outputs:  # an output (or
                    closed = False  # read by no operator)
                for r in readers:
                    if not self.operators[r].non_finite:
                        absorbers.add(r)
                    elif r not in region:
                        region.add(r)
                        todo.append(r)
            if closed:
                out[origin] = (tuple(sorted(region, key=order.__getitem__)),
                               tuple(sorted(absorbers, key=order.__getitem__)))
        return out

    def impact_threshold(self) -> Optional[float]:
        """The impact below which an operator is harmless, where the map holds impacts
        (:func:`fxstab.operator_impact`, ``metadata["impact_threshold"]``); None otherwise."""
        if not any(not math.isnan(op.impact) for op in self.operators.values()):
            return None
        return float(self.metadata.get("impact_threshold", 0.1))

    def localize_table(self, top: Optional[int] = None, metric: Optional[str] = None) -> str:
        """The localization ranking as text (see :meth:`localize`)."""
        metric = check_metric(metric)
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
                         f"{r.reference:>5.2f}  {r.worst_input or '(cap)'}"
                         + ("  (own: its accumulator's digits)" if r.accumulator else ""))
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
                "p50_digits": s.p50_digits, **run_keys(s),
                "zero_fraction": s.zero_fraction, "non_finite": s.non_finite,
                "underflow": s.underflow, **accumulator_keys(s), **operand_keys(s),
            }
        doc = {
            "schema": SCHEMA_NAME,
            "schema_version": SCHEMA_VERSION,
            "metadata": dict(self.metadata),
            "operators": [op.as_dict() for op in self.operators.values()],
            "steps": steps,
        }
        if self._fixes:  # optional: a map made without fixes has no key
            doc["fixes"] = [f.as_dict() for f in self._fixes]
        return doc

    def to_json(self, indent: Optional[int] = 1) -> str:
        """Serialize to JSON text; NaN/±inf become the strings "NaN"/"Infinity"/"-Infinity".

        Raises:
            DigitMapError: metadata holds a value JSON cannot represent.
        """
        try:
            return json.dumps(encode(self.as_dict()), indent=indent, allow_nan=False,
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
        operators, metadata, steps, fixes = decode_map(text, source)
        return cls(operators, metadata, steps, [Fix(**f) for f in fixes])

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


# the orders of DigitMap.table (fxstab show --sort)
SORTS = ("digits", "impact")


def _umask() -> int:
    """The process's file-creation mask (reading it means setting it: set it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# The fix of an accumulator that keeps fewer digits than its spread shows (docs/accumulation.md:
# DeepSeek-V3 promotes the fp8 GEMMs' partial sums every 128 elements of K)


ACCUMULATOR_LEGEND = ("; acc: a modelled GEMM's accumulator, the digits its output shares with "
                      "the exact sum of the same operands (a bias of a nearest or directed "
                      "accumulator, which the samples' spread cannot show)")


def _acc_cell(op: OperatorDigits, metric: str) -> str:
    """The table's acc cell: the accumulator's figure that ``metric`` is held against."""
    v = accumulator_digits(op, metric)
    return "-" if math.isnan(v) else f"{v:.2f}"


def _impact_cell(op: OperatorDigits) -> str:
    return "" if math.isnan(op.impact) else f"{op.impact:.2f}"
