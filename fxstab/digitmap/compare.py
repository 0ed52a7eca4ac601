"""Comparing two digit maps: :func:`diff`, the CI gate, and its :class:`DiffResult`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

from .map import DigitMap
from .operators import LocalLoss, OperatorDigits, as_digits, check_metric, effective_digits
from .schema import DigitMapError, encode

@dataclass
class OpChange:
    """One operator present in both maps: its digits under the diff's metric."""

    name: str
    kind: str
    base: float
    head: float
    # head's digits are its accumulator's own (fewer than its CESTAC digits): a drop of the
    # accumulator's figure counts like a drop of digits (effective_digits)
    accumulator: bool = False
    # head's cap - base's cap when the maps were analysed in different formats: the digits are
    # compared relative to each map's cap (digits below the cap), see diff()
    shift: float = 0.0
    # its name in base where that differs (an operator inserted before it in its module moved
    # its index: match_operators)
    base_name: str = ""

    @property
    def label(self) -> str:
        """Its name, and base's where that differs."""
        return f"{self.name} (base: {self.base_name})" if self.base_name else self.name

    @property
    def delta(self) -> float:
        """head - base (negative: digits lost), relative to each map's cap when the maps'
        formats differ."""
        return self.head - self.base - self.shift


@dataclass
class OpPresence:
    """An operator present in only one of the two maps."""

    name: str
    kind: str
    digits: float


@dataclass
class Rewrite:
    """A rewritten region: operators removed from base and added in head between matched
    operators (``softmax`` rewritten as ``exp``, ``sum``, ``div``), compared at its boundary.

    ``consumer`` is a matched operator that reads the region; ``base`` and ``head`` are the
    digits of what it reads from the region (its least accurate producer there) in each map.
    The names of the region's operators change, so nothing matches them by name: at the
    boundary the value the rest of the program sees is the same one, and there it is compared.
    """

    consumer: str
    removed: list[str]
    added: list[str]
    base: float
    head: float
    shift: float = 0.0  # head's cap - base's cap (maps of different formats), as OpChange's

    @property
    def delta(self) -> float:
        """head - base at the consumer's input (negative: digits lost)."""
        return self.head - self.base - self.shift

    def describe(self) -> str:
        """``rewritten: softmax#0 -> exp#0, sum#0, div#1: -0.74 digits at the input of
        attn/matmul#1`` (region operators in the consumer's module by their short name)."""
        module = self.consumer.rsplit("/", 1)[0] + "/" if "/" in self.consumer else ""

        def short(names: list[str]) -> str:
            return ", ".join(n[len(module):] if module and n.startswith(module) else n
                             for n in names)

        return (f"rewritten: {short(self.removed)} -> {short(self.added)}: {self.delta:+.2f} "
                f"digits at the input of {self.consumer}")


@dataclass
class DiffResult:
    """Outcome of :func:`diff`.

    ``drops`` lost more than ``max_drop`` digits (largest loss first), ``gains`` gained more than
    ``max_drop`` (largest gain first), ``unchanged`` counts the operators within ``max_drop``
    either way. ``module_drops`` compares the modules whose operators were renamed (a rewrite
    inside a module): a module's digits are those of its worst operator. ``new_origins`` are
    operators where NaN/inf first appear in head but not in base; ``vanished`` are base
    operators of a module that is still in the model (head's ``metadata["modules"]``) but has
    no analysed operator any more. ``rewrites`` compares each rewritten region (operators
    removed and added between matched ones) at its boundary (:class:`Rewrite`);
    ``rewrite_drops`` are those that lost more than ``max_drop``. ``failed`` is True when any
    of drops, rewrite drops, module drops, new NaN/inf origins or vanished operators is
    non-empty; added and removed operators are listed but do not fail. Operators are matched
    across the maps by a stable identity (:func:`match_operators`), not by name: a row's
    ``base_name`` is base's name where that differs. ``origins`` ranks, as
    :meth:`DigitMap.localize` does in head, the operators that lose digits themselves
    (a positive local loss) among those that dropped and those head added:
    the first is where the lost digits start (the text and comment lead with it).
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
    rewrites: list[Rewrite] = field(default_factory=list)
    # head's cap - base's cap: non-zero when the maps' formats differ, and every change is then
    # relative to each map's cap (diff())
    cap_shift: float = 0.0
    # drops of operators whose rounding (or the rounding they amplify) costs the outputs less
    # than head's impact threshold (a map with impacts, fxstab.impact): warnings, not failures
    harmless: list[OpChange] = field(default_factory=list)

    @property
    def rewrite_drops(self) -> list[Rewrite]:
        """The rewritten regions that lost more than ``max_drop`` at their boundary."""
        return [r for r in self.rewrites if -r.delta > self.max_drop]

    @property
    def failed(self) -> bool:
        return bool(self.drops or self.rewrite_drops or self.module_drops or self.new_origins
                    or self.vanished)

    @property
    def exit_code(self) -> int:
        """0 when the gate passes, 1 when it fails."""
        return 1 if self.failed else 0

    def __repr__(self) -> str:
        return (f"DiffResult({self.summary()}; {self.base_label} -> {self.head_label}, "
                f"{len(self.drops)} drop(s), {len(self.gains)} gain(s), {len(self.added)} "
                f"added, {len(self.removed)} removed, {self.unchanged} unchanged)")

    def _repr_html_(self) -> Optional[str]:
        """Jupyter's display: the verdict and the tables of the diff's page
        (:func:`fxstab.plots.notebook.diff_fragment`)."""
        from ..records import display

        return display.html(self)

    def summary(self) -> str:
        if not self.failed:
            return f"OK: no operator lost more than {self.max_drop:g} {self.metric} digits"
        why = []
        if self.new_origins:
            why.append(f"{len(self.new_origins)} new NaN/inf origin(s)")
        if self.drops:
            why.append(f"{len(self.drops)} operator(s) lost more than {self.max_drop:g} "
                       f"{self.metric} digits")
        if self.rewrite_drops:
            why.append(f"{len(self.rewrite_drops)} rewritten region(s) lost more than "
                       f"{self.max_drop:g} {self.metric} digits")
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
        if self.origins:  # the cause first, then what it cost
            o = self.origins[0]
            lines.append(f"digits are lost first at {o.name} (local loss {o.local_loss:.2f}: "
                         f"{o.digits:.2f} against {o.reference:.2f} "
                         f"{'of ' + o.worst_input if o.worst_input else '(cap)'})")

        def changes(title: str, rows: list[OpChange]) -> None:
            if rows:
                w = max(len(r.label) for r in rows)
                lines.append(f"{title} ({len(rows)}):")
                lines.extend(f"  {r.label:<{w}}  {r.kind:<12} {r.base:5.2f} -> {r.head:5.2f}  "
                             f"({r.delta:+.2f})" + ("  its accumulator's digits" if
                                                    r.accumulator else "") for r in rows)

        def presence(title: str, rows: list[OpPresence]) -> None:
            if rows:
                w = max(len(r.name) for r in rows)
                lines.append(f"{title} ({len(rows)}):")
                lines.extend(f"  {r.name:<{w}}  {r.kind:<12} {r.digits:5.2f}" for r in rows)

        changes("drops", self.drops)
        changes("warning: drops that cost the outputs nothing (impact below the threshold; "
                "--strict fails on them)", self.harmless)
        lines.extend(r.describe() for r in self.rewrite_drops)
        changes("module drops (operators renamed inside)", self.module_drops)
        presence("no longer analysed (their module is still there)", self.vanished)
        changes("gains", self.gains)
        lines.extend(r.describe() for r in self.rewrites if r not in self.rewrite_drops)
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
            lines += ["**NaN/inf now first appear at** "
                      + ", ".join(_md(n) for n in self.new_origins), ""]
        if self.origins:  # the cause first, then what it cost
            o = self.origins[0]
            ref = f"its least accurate input {_md(o.worst_input)}" if o.worst_input \
                else "the format's cap"
            lines += [f"Digits are lost first at {_md(o.name)}: {o.digits:.2f} digits against "
                      f"{o.reference:.2f} of {ref} (local loss {o.local_loss:.2f}).", ""]

        def change_table(rows: list[OpChange]) -> list[str]:
            out = ["| operator | kind | base | head | change |", "|---|---|--:|--:|--:|"]
            out += [f"| {_md(r.name)}{' (base: ' + _md(r.base_name) + ')' if r.base_name else ''}"
                    f" | {_md_text(r.kind)} | {r.base:.2f} | {r.head:.2f} | "
                    f"**{r.delta:+.2f}**{' (its accumulator)' if r.accumulator else ''} |"
                    for r in rows]
            return out

        def presence_table(rows: list[OpPresence]) -> list[str]:
            out = ["| operator | kind | digits |", "|---|---|--:|"]
            out += [f"| {_md(r.name)} | {_md_text(r.kind)} | {r.digits:.2f} |" for r in rows]
            return out

        if self.rewrite_drops:
            lines += [f"**Rewritten regions that lost digits ({len(self.rewrite_drops)})**", ""]
            lines += [f"- {_md_text(r.describe())}" for r in self.rewrite_drops] + [""]
        for title, rows, fn in (("Lost digits", self.drops, change_table),
                                ("Modules that lost digits", self.module_drops, change_table),
                                ("No longer analysed", self.vanished, presence_table)):
            if rows:
                lines += [f"**{title} ({len(rows)})**", ""] + fn(rows) + [""]
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
                    "delta": r.delta, **({"accumulator": True} if r.accumulator else {}),
                    **({"base_name": r.base_name} if r.base_name else {})}

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
                "rewrites": [{"consumer": r.consumer, "removed": list(r.removed),
                              "added": list(r.added), "base": r.base, "head": r.head,
                              "delta": r.delta, "failed": r in self.rewrite_drops}
                             for r in self.rewrites],
                "unchanged": self.unchanged, "notes": list(self.notes),
                "origins": [{"name": o.name, "local_loss": o.local_loss, "digits": o.digits,
                             "reference": o.reference, "worst_input": o.worst_input}
                            for o in self.origins]}

    def to_json(self, indent: Optional[int] = 1) -> str:
        return json.dumps(encode(self.as_dict()), indent=indent, allow_nan=False)


def _md_text(s: str) -> str:
    return s.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _md(s: str) -> str:
    """Inline code for names (backticks in a name fall back to escaped text)."""
    return f"`{s}`".replace("|", "\\|") if "`" not in s else _md_text(s)


_COMPARED_SETTINGS = ("format", "n_samples", "granularity", "confidence", "rounding", "seed",
                      "target", "accumulate", "gemm_inputs", "formats")


def diff(base: DigitMap, head: DigitMap, max_drop: float = 0.5, metric: Optional[str] = None,
         base_label: Optional[str] = None, head_label: Optional[str] = None,
         strict: bool = False) -> DiffResult:
    """The CI gate: match operators by a stable identity (:func:`match_operators`; modules by
    path) and compare their digits.

    Args:
        base: the reference map (e.g. the main branch).
        head: the map under test (e.g. the pull request).
        max_drop: tolerance in digits: a drop larger than this fails; changes within it either
            way count as unchanged.
        metric: per-operator digits compared (default :data:`DEFAULT_METRIC`). NaN digits
            count as 0.
        base_label, head_label: names in the rendering (default: the maps' git commits).
        strict: with impacts in head (``fxstab record --impact``), an operator that lost
            digits whose rounding (or the rounding it amplifies: its inputs') costs the outputs
            less than the impact threshold is a warning (``harmless``), not a failure;
            ``strict=True`` fails on it as on any drop. Both maps with impacts: the outputs'
            own digits dropping by more than ``max_drop`` fails (a drop named ``(outputs)``).

    An operator's digits are its CESTAC digits under ``metric``, or its accumulator's own
    digits where those are fewer (:func:`~fxstab.digitmap.operators.effective_digits`): a
    modelled GEMM whose nearest or directed accumulator loses digits the samples' spread cannot
    show drops like an operator that loses them (its row says so).

    Maps of different formats (an fp16 map against a bf16 map) are compared relative to each
    map's cap: an operator's change is (head digits - head's cap) - (base digits - base's
    cap), the digits it keeps below its format's cap, so the caps' difference alone is no drop;
    the first note says so, and each row shows both maps' own digits.

    Returns:
        A :class:`DiffResult` (see it for what fails); ``notes`` lists analysis settings that
        differ between the maps (a diff across formats or sample counts compares different
        things); ``origins`` the operators where head's lost digits start (see DiffResult).

    Raises:
        DigitMapError: a map has no analysed operator (nothing to compare is no pass), or holds
            no value of ``metric`` (a schema 1 map has no normwise digits or quantiles).
    """
    metric = check_metric(metric)
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
    shift, cross = _cap_shift(base, head)
    match = match_operators(base, head)
    drops, gains, unchanged = [], [], 0
    for name, b in base.operators.items():
        if name not in match:
            continue
        h = head.operators[match[name]]
        c = OpChange(h.name, h.kind, effective_digits(b, metric), effective_digits(h, metric),
                     effective_digits(h, metric) < as_digits(h.digits(metric)), shift,
                     name if name != h.name else "")
        if -c.delta > max_drop:
            drops.append(c)
        elif c.delta > max_drop:
            gains.append(c)
        else:
            unchanged += 1
    harmless: list = []
    threshold = head.impact_threshold()
    if threshold is not None and not strict:  # what costs the outputs nothing only warns
        def cost(name: str) -> float:
            op = head.operators[name]
            own = [op.impact, *(head.operators[i].impact for i in op.inputs
                                if i in head.operators)]
            return max([v for v in own if not math.isnan(v)] or [math.inf])
        harmless = [c for c in drops if cost(c.name) < threshold]
        drops = [c for c in drops if c not in harmless]
    bo, ho = (dm.metadata.get("impact_output_digits") for dm in (base, head))
    if isinstance(bo, (int, float)) and isinstance(ho, (int, float)) and bo - ho + shift > max_drop:
        drops.append(OpChange("(outputs)", "outputs", float(bo), float(ho), shift=shift))
    drops.sort(key=lambda c: (c.delta, c.name))
    gains.sort(key=lambda c: (-c.delta, c.name))
    harmless.sort(key=lambda c: (c.delta, c.name))
    matched = set(match.values())
    added = [OpPresence(n, o.kind, effective_digits(o, metric))
             for n, o in head.operators.items() if n not in matched]
    removed = [OpPresence(n, o.kind, effective_digits(o, metric))
               for n, o in base.operators.items() if n not in match]

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
        if not hops or {match.get(o.name) for o in bops} == {o.name for o in hops}:
            continue
        bd = min(effective_digits(o, metric) for o in bops)
        hd = min(effective_digits(o, metric) for o in hops)
        if bd - hd + shift > max_drop:
            module_drops.append(OpChange(path or "(top level)", "module", bd, hd, shift=shift))
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

    notes = [cross] if cross else []
    for key in _COMPARED_SETTINGS:
        if key == "format" and cross:
            continue  # said first, with how the digits were compared
        bv, hv = base.metadata.get(key), head.metadata.get(key)
        if key == "accumulate":  # a map without it trusted its GEMMs
            bv, hv = bv or "fp32", hv or "fp32"
        if key == "formats":  # a map without it ran every operator in its format
            bv, hv = bv or {}, hv or {}
        if bv is not None and hv is not None and bv != hv:
            notes.append(f"{key} differs: {bv!r} (base) vs {hv!r} (head)")

    def label(dm: DigitMap, default: str) -> str:
        commit = dm.metadata.get("git_commit")
        return f"{default} {commit[:10]}" if isinstance(commit, str) and commit else default

    regions = rewrites(base, head, metric, shift, match)
    # where the lost digits start: among the operators that lost digits and those head added
    # (a rewrite's own operators: the cause of a drop is often new), those that lose digits
    # themselves (a positive local loss: a NaN/inf origin that only inherits the loss, rsqrt
    # of a cancelled variance, is named as such in new_origins, not as the cause), ranked as
    # localize ranks
    suspects = {c.name for c in drops} | {r.name for r in added} | \
        {n for r in regions if -r.delta > max_drop for n in r.added}
    origins = [x for x in head.localize(metric) if x.name in suspects
               and x.local_loss > 0] if drops or any(
        -r.delta > max_drop for r in regions) else []
    return DiffResult(metric, float(max_drop), drops, gains, added, removed, unchanged, notes,
                      base_label or label(base, "base"), head_label or label(head, "head"),
                      origins, new_origins, module_drops, vanished, regions, shift, harmless)


def match_operators(base: DigitMap, head: DigitMap) -> dict[str, str]:
    """base's operators -> head's, by a stable identity: the same direction, module, kind and
    source line (its text, ``OperatorDigits.code``), the k-th occurrence of that identity in
    base's graph order the k-th in head's. An edit that inserts an operator into a module
    moves the ``#k`` of those after it; it does not change their identity, and two operators
    of different lines are never compared (``x * x`` in head is not base's ``xc * xc`` because
    both were ``norm/mul#0``). An operator without source text on either side (a map recorded
    before ``code`` was kept, a node without a stack trace) matches by name."""
    def identity(op: OperatorDigits) -> tuple:
        return (op.direction, op.module_path, op.kind, op.code)

    queues: dict[tuple, list[str]] = {}
    for n, op in head.operators.items():
        if op.code:
            queues.setdefault(identity(op), []).append(n)
    match: dict[str, str] = {}
    for n, op in base.operators.items():
        queue = queues.get(identity(op)) if op.code else None
        if queue:
            match[n] = queue.pop(0)
    taken = set(match.values())
    for n, op in base.operators.items():
        h = head.operators.get(n)
        if n not in match and h is not None and n not in taken and not (op.code and h.code):
            match[n] = n
            taken.add(n)
    return match


def _cap_shift(base: DigitMap, head: DigitMap) -> tuple[float, str]:
    """(head's cap - base's cap, the note that says so) for maps analysed in different
    formats; (0.0, "") when their formats are the same (or unknown)."""
    bf, hf = base.metadata.get("format"), head.metadata.get("format")
    if bf is None or hf is None or bf == hf:
        return 0.0, ""
    bc, hc = base.cap, head.cap
    return hc - bc, (f"formats differ: {bf} (base, cap {bc:.2f} digits) vs {hf} (head, cap "
                     f"{hc:.2f}): digits compared relative to each map's cap (what each "
                     f"operator keeps below its format's cap), not as absolute digits")


def rewrites(base: DigitMap, head: DigitMap, metric: Optional[str] = None,
             shift: float = 0.0, match: Optional[dict] = None) -> list[Rewrite]:
    """The rewritten regions between two maps, compared at their boundary: for each operator
    of both maps that reads operators only base has (removed) and operators only head has
    (added), the digits of what it reads from the region, base producer against head producer;
    the region is those producers and the removed (added) operators they read, transitively.
    One row per (region, consumer) pair; largest loss first. ``match``: base's operators ->
    head's (default :func:`match_operators`)."""
    metric = check_metric(metric)
    if match is None:
        match = match_operators(base, head)
    in_both = {"base": set(match), "head": set(match.values())}

    def region(dm: DigitMap, start: list[str], side: str) -> list[str]:
        seen, todo = set(start), list(start)
        while todo:
            for i in dm.operators[todo.pop()].inputs:
                if i in dm.operators and i not in in_both[side] and i not in seen:
                    seen.add(i)
                    todo.append(i)
        return [n for n in dm.operators if n in seen]  # graph order

    def digits(dm: DigitMap, names: list[str]) -> float:
        return min(effective_digits(dm.operators[n], metric) for n in names)

    out = []
    for bname, name in match.items():
        b, h = base.operators[bname], head.operators[name]
        gone = [i for i in b.inputs if i in base.operators and i not in in_both["base"]]
        new = [i for i in h.inputs if i in head.operators and i not in in_both["head"]]
        if gone and new:
            out.append(Rewrite(name, region(base, gone, "base"), region(head, new, "head"),
                               digits(base, gone), digits(head, new), shift))
    out.sort(key=lambda r: (r.delta, r.consumer))
    return out

