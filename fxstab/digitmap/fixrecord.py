"""The record of a stable rewrite tried on a program, and what it did (:class:`Fix`).

:func:`fxstab.suggest_fixes` makes them (:mod:`fxstab.fixes.verify`); a digit map made with
them keeps them (:meth:`fxstab.digitmap.DigitMap.fixes`, the JSON's optional ``fixes`` key,
validated by :func:`fxstab.digitmap.schema.check_fix`). The record lives here, below the
rewrites' layer, so that a map can hold and load it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .schema import check_fix

__all__ = ["Fix"]


@dataclass(frozen=True)
class Fix:
    """A rewrite tried at one place of the program, and what it did.

    Attributes:
        operator: the operator the finding names (the ``log`` of ``log(softmax(x))``).
        rewrite: the table entry's name (:data:`fxstab.fixes.REWRITES`).
        source: ``file.py:LINE`` in the user's code where the stable form is written (the
            line of the formula's last operator, whose value it replaces).
        code: that line's text.
        replacement: the stable form as code (``F.log_softmax(z, 1)``).
        before, after: the analysis's avg digits at the outputs without and with the rewrite
            (a NaN/inf sample's element counts 0 digits).
        real_before, real_after: the real run's avg true digits at the outputs, in the format
            against fp64 (a NaN/inf element counts 0).
        nonfinite_before, nonfinite_after: the real run's NaN/inf output elements, of
            ``numel`` (with ``backward=True``, the gradients' elements are counted too: the
            gradients of the outputs' sum with respect to the floating inputs and the
            parameters).
        verified: the real run confirms the rewrite: fewer NaN/inf outputs, or
            :data:`fxstab.fixes.verify.MIN_GAIN` digits more, and neither run shows more
            NaN/inf than before. Where one rewrite matches at several places none of which
            alone removes every NaN/inf, they are also run together, and each place's fix
            reports that run where it does better.
        numel: the real run's floating output elements.
        format: the format of both runs.
        findings: the findings of the analysis (operators) whose neighbourhood the rewrite
            matched: a verified fix covers them.
    """

    operator: str
    rewrite: str
    source: str
    code: str
    replacement: str
    before: float
    after: float
    real_before: float
    real_after: float
    nonfinite_before: int
    nonfinite_after: int
    verified: bool
    numel: int = 0
    format: str = ""
    findings: tuple = ()

    def __repr__(self) -> str:
        where = f"{self.source}  {self.code}" if self.code else self.source or self.operator
        bad = (f"NaN/inf {self.nonfinite_before}/{self.numel} -> {self.nonfinite_after}; "
               if self.nonfinite_before or self.nonfinite_after else "")
        return (f"Fix({where}  ->  {self.replacement}   {bad}outputs {self.real_before:.2f} -> "
                f"{self.real_after:.2f} digits (real {self.format} run), analysis "
                f"{self.before:.2f} -> {self.after:.2f}; {self.rewrite} at {self.operator}, "
                f"{'verified' if self.verified else 'not verified'})")

    def as_dict(self) -> dict:
        """The record as JSON data (a digit map's ``fixes`` entry): every field, the
        findings as a list; NaN digits stay floats (the map's writer encodes them)."""
        d = dataclasses.asdict(self)
        d["findings"] = list(self.findings)
        return d

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>", where: str = "fix") -> "Fix":
        """The record of :meth:`as_dict`'s data, validated as a digit map's ``fixes`` entry.

        Raises:
            fxstab.digitmap.DigitMapError: not an object, a required key missing or a value
                of the wrong type; the message names ``source``, ``where`` and the key.
        """
        return cls(**check_fix(d, source, where))
