"""The JSON schema of a digit map: versions, non-finite numbers, validation (docs/digit-maps.md).

:func:`encode` writes NaN/inf as strings JSON can hold; :func:`decode` parses a document and
validates every key, returning the operators, metadata and steps a
:class:`fxstab.digitmap.map.DigitMap` is built from; :class:`DigitMapError` names what is wrong
and where.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Union

from ..records.report import COUNTER_KEYS, ROUNDED
from .operators import OperatorDigits, StepDigits

SCHEMA_NAME = "fxstab-digit-map"
SCHEMA_VERSION = 3
# Version 1 had no normwise digits, quantiles or underflow: it still loads (those are NaN/0).
# The accumulator's digits are optional keys of version 2 (no bump: a map without them is a
# valid map with no accumulator measured, and a reader that predates them ignores them).
# Version 3 defines the operators' impact on the outputs (optional ``impact`` and the metadata
# ``impact_threshold``, ``impact_calls``, ``impact_output_digits``): a bump, since a reader
# that ignored them would gate as failures the drops the map says are harmless. Versions 1 and 2
# still load (no impact measured: NaN).
_READABLE_VERSIONS = (1, 2, 3)
# The stable rewrites a map was made with (``fxstab fix``: :class:`fxstab.digitmap.fixrecord.Fix`)
# are an optional top-level ``fixes`` list (no bump: a map without them is a map made without
# them, and a reader that predates them ignores them).

# JSON has no NaN/Infinity literals (Python's json writes invalid tokens for them); a digit map
# writes non-finite numbers as these strings and reads them back as floats.
_NONFINITE_TO_STR = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}
_STR_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


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


def encode(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return _NONFINITE_TO_STR[repr(obj)]
    if isinstance(obj, dict):
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
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
    "impact_threshold": "a number", "impact_calls": "a non-negative integer",
    "impact_output_digits": "a number",
}
_META_REQUIRED = ("fxstab_version", "torch_version")
# a ``fixes`` entry's keys (:class:`fxstab.digitmap.fixrecord.Fix`'s fields): the required ones,
# then the optional ones with their defaults
_FIX_TYPES = {
    "operator": "a string", "rewrite": "a string", "source": "a string", "code": "a string",
    "replacement": "a string", "before": "a number", "after": "a number",
    "real_before": "a number", "real_after": "a number",
    "nonfinite_before": "a non-negative integer", "nonfinite_after": "a non-negative integer",
    "verified": "a boolean",
}
_FIX_OPTIONAL = {"numel": ("a non-negative integer", 0), "format": ("a string", ""),
                 "findings": ("a list", [])}


def decode(text: Union[str, bytes], source: str = "<string>"
           ) -> tuple[list[OperatorDigits], dict, list[StepDigits]]:
    """Parse and validate a JSON digit map: its operators, metadata and steps.

    Raises:
        DigitMapError: not JSON, not a digit map, wrong schema version, a missing key or a
            value of the wrong type; the message names the source, location and key.
    """
    return decode_map(text, source)[:3]


def decode_map(text: Union[str, bytes], source: str = "<string>"
               ) -> tuple[list[OperatorDigits], dict, list[StepDigits], list[dict]]:
    """:func:`decode`, with the map's fixes: each ``fixes`` entry validated
    (:func:`check_fix`) as the keyword arguments of a
    :class:`~fxstab.digitmap.fixrecord.Fix` (none where the map has no ``fixes`` key)."""
    try:
        doc = json.loads(text, parse_constant=lambda c: _STR_TO_NONFINITE[c])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DigitMapError(f"not valid JSON ({e})", source) from None
    ops, meta, steps = _validate(doc, source)
    fixes = _Checker(source).get(doc, "fixes", "a list", "", required=False, default=[])
    return ops, meta, steps, [check_fix(f, source, f"fixes[{i}]") for i, f in enumerate(fixes)]


def check_fix(d: Any, source: str = "<string>", where: str = "fix") -> dict:
    """A ``fixes`` entry of a digit map, validated: the keyword arguments of its
    :class:`~fxstab.digitmap.fixrecord.Fix` (its findings a tuple of operator names).

    Raises:
        DigitMapError: not an object, a required key missing, or a value of the wrong type;
            the message names ``source``, ``where`` and the key.
    """
    c = _Checker(source)
    d = c.check(d, "an object", where, None)
    out = {k: c.get(d, k, kind, where) for k, kind in _FIX_TYPES.items()}
    for k, (kind, default) in _FIX_OPTIONAL.items():
        out[k] = c.get(d, k, kind, where, required=False, default=default)
    for x in out["findings"]:
        c.check(x, "a string", where, "findings")
    out["findings"] = tuple(out["findings"])
    return out


def _validate(doc: Any, source: str) -> tuple[list[OperatorDigits], dict, list[StepDigits]]:
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
            code=c.get(o, "code", "a string", where, False, ""),
            direction=_direction(c, o, where),
            format=c.get(o, "format", "a string", where, False, ""),
            # its impact on the outputs (fxstab.impact; version 3, optional: NaN)
            impact=c.get(o, "impact", "a number", where, False, math.nan),
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
    return ops, meta, steps


def _direction(c, o: dict, where: str) -> str:
    d = c.get(o, "direction", "a string", where, False, "forward")
    if d not in ("forward", "backward"):
        raise c.fail(f"direction must be 'forward' or 'backward', got {d!r}", where, "direction")
    return d


def _extras(c: "_Checker", o: dict, where: str) -> dict:
    """The statistics schema version 2 added (absent from version 1: NaN digits, 0 underflow),
    and the accumulator's digits (optional)."""
    out = {f: c.get(o, f, "a number", where, False, math.nan)
           for f in ("normwise_digits", "p10_digits", "p50_digits", "run_digits")}
    out["underflow"] = c.get(o, "underflow", "a non-negative integer", where, False, 0)
    # a modelled GEMM's accumulator (optional in version 2: absent, NaN, as in every map
    # written before it and every operator without an accumulator)
    for f in ("accumulator_digits", "accumulator_min_digits"):
        out[f] = c.get(o, f, "a number", where, False, math.nan)
    # a modelled GEMM's operand statistics in a recipe (optional, as above)
    for f in ("operand_elements", "operand_underflow", "operand_saturation"):
        out[f] = c.get(o, f, "a non-negative integer", where, False, 0)
    for f in ("operand_scale_min", "operand_scale_max", "operand_digits", "operand_min_digits"):
        out[f] = c.get(o, f, "a number", where, False, math.nan)
    return out
