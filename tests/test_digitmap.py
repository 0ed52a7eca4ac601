"""Digit maps: aggregation, JSON schema and validation, atomic save, diff, localization, plots."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from fxstab.digitmap import (
    DEFAULT_METRIC,
    SCHEMA_VERSION,
    DigitMap,
    DigitMapError,
    diff,
)
from fxstab.records.report import COUNTER_KEYS, OBSERVED, UNLIFTED, OpReport

BF16_CAP = 8 * math.log10(2.0)


def rep(name: str, avg: float, mn: float, mx: float, numel: int = 100, inputs=(),
        kind: str = "", module: str = "", **kw) -> OpReport:
    kind = kind or name.split("/")[-1].split("#")[0]
    module = module if module else name.split("/")[0]
    kw.setdefault("format", "bf16")
    kw.setdefault("n_samples", 3)
    # the other statistics follow avg and min unless a test sets them
    kw.setdefault("normwise_digits", avg)
    kw.setdefault("p10_digits", mn)
    kw.setdefault("p50_digits", avg)
    return OpReport(name=name, kind=kind, module_path=module, avg_digits=avg, min_digits=mn,
                    max_digits=mx, numel=numel, inputs=tuple(inputs), **kw)


def chain_map() -> DigitMap:
    """l1 (good) -> cancel (loses digits) -> act -> head: everything after cancel is low."""
    return DigitMap.from_reports([
        rep("l1/linear#0", 2.3, 2.0, 2.41),
        rep("cancel/linear#0", 0.4, 0.0, 1.0, inputs=["l1/linear#0"]),
        rep("act/gelu#0", 0.35, 0.0, 1.0, inputs=["cancel/linear#0"]),
        rep("head/softmax#0", 0.3, 0.0, 0.9, inputs=["act/gelu#0"]),
    ], metadata={"seed": 0, "granularity": "op"})


def simple_map(digits: dict[str, float], **meta) -> DigitMap:
    """One operator per entry; avg = min = max = the given digits."""
    m = {"seed": 0}
    m.update(meta)
    return DigitMap.from_reports([rep(n, d, d, d) for n, d in digits.items()], metadata=m)


# --------------------------------------------------------------------------- aggregation
def test_aggregation_over_calls():
    c1 = dict.fromkeys(COUNTER_KEYS, 0) | {"cancellation": 2}
    c2 = dict.fromkeys(COUNTER_KEYS, 0) | {"cancellation": 1, "anomaly": 3}
    reports = [
        rep("m/linear#0", 2.0, 1.0, 2.4, numel=100, zero_fraction=0.1, non_finite=1,
            counters=c1, call=0, shape=(4, 25), source="m.py:3"),
        rep("m/linear#0", 1.0, 0.5, 2.2, numel=300, zero_fraction=0.5, non_finite=2,
            counters=c2, call=1, surrogate=True, status=UNLIFTED, shape=(12, 25)),
        rep("m/softmax#0", 2.0, 2.0, 2.0, numel=0, inputs=["m/linear#0", "outside/relu#0"],
            call=0, status=OBSERVED),
        rep("m/softmax#0", 1.0, 1.0, 1.0, numel=0, inputs=["m/linear#0"], call=1),
    ]
    dm = DigitMap.from_reports(reports, metadata={"seed": 7})
    op = dm["m/linear#0"]
    assert op.calls == 2 and op.numel == 400
    assert op.avg_digits == pytest.approx((2.0 * 100 + 1.0 * 300) / 400)
    assert op.min_digits == 0.5 and op.max_digits == 2.4
    assert op.zero_fraction == pytest.approx((0.1 * 100 + 0.5 * 300) / 400)
    assert op.non_finite == 3
    assert op.counters["cancellation"] == 3 and op.counters["anomaly"] == 3
    assert op.surrogate is True
    assert op.status == UNLIFTED  # the most severe status of any call
    assert op.shape == (4, 25) and op.source == "m.py:3"  # first call
    sm = dm["m/softmax#0"]
    assert sm.avg_digits == pytest.approx(1.5)  # empty outputs: plain mean over calls
    assert sm.status == OBSERVED
    # edges only between operators of the map
    assert sm.inputs == ("m/linear#0",)
    assert list(dm.operators) == ["m/linear#0", "m/softmax#0"]  # graph order
    assert dm.metadata["format"] == "bf16" and dm.metadata["n_samples"] == 3
    assert dm.metadata["analysed_calls"] == 2 and dm.metadata["seed"] == 7
    assert dm.metadata["fxstab_version"] and dm.metadata["torch_version"]


def test_from_reports_rejects_inconsistent_reports():
    with pytest.raises(ValueError, match="disagree"):
        DigitMap.from_reports([rep("a/linear#0", 1, 1, 1),
                               rep("a/linear#0", 1, 1, 1, kind="softmax")])
    with pytest.raises(ValueError, match="mix format"):
        DigitMap.from_reports([rep("a/x#0", 1, 1, 1), rep("b/x#0", 1, 1, 1, format="fp16")])


def test_metadata_git_commit_absent_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dm = DigitMap.from_reports([rep("a/x#0", 1, 1, 1)])
    assert "git_commit" not in dm.metadata


def test_series_per_phase_and_step():
    reports = []
    for step in range(3):
        reports.append(rep("a/linear#0", 2.0 - step * 0.5, 1.5 - step * 0.5, 2.4,
                           phase="train", step=step, call=step))
        reports.append(rep("b/softmax#0", 2.0, 2.0, 2.0, phase="train", step=step, call=step))
    reports.append(rep("a/linear#0", 2.2, 2.1, 2.4, phase="eval", step=0, call=3))
    dm = DigitMap.from_reports(reports)
    assert dm.step_keys() == [("train", 0), ("train", 1), ("train", 2), ("eval", 0)]
    s = dm.series("a/linear#0")
    assert [(p.phase, p.step, p.min_digits) for p in s] == [
        ("train", 0, 1.5), ("train", 1, 1.0), ("train", 2, 0.5), ("eval", 0, 2.1)]
    assert [p.step for p in dm.series("a/linear#0", phase="eval")] == [0]
    assert dm["a/linear#0"].calls == 4
    with pytest.raises(KeyError, match="nope"):
        dm.series("nope")


def test_table_and_worst_are_worst_first():
    dm = DigitMap.from_reports([
        rep("a/x#0", 2.0, 1.0, 2.4), rep("b/x#0", 0.5, 0.0, 2.0),
        rep("c/x#0", 0.3, 0.0, 2.0), rep("d/x#0", 2.4, 2.4, 2.4, surrogate=True)])
    assert [o.name for o in dm.worst(3)] == ["c/x#0", "b/x#0", "a/x#0"]
    lines = dm.table().splitlines()
    assert lines[0].startswith("digit map: 4 operators, format bf16, N=3")
    order = [ln.split()[0] for ln in lines[2:-1]]
    assert order == ["c/x#0", "b/x#0", "a/x#0", "d/x#0"]
    assert lines[-2].endswith("surrogate") and lines[-1].startswith("legend:")
    assert f"sorted by {DEFAULT_METRIC} digits" in lines[0] and f"{DEFAULT_METRIC}*" in lines[1]
    # another metric re-sorts: by min digits b and c tie at 0 (then min, then name)
    assert [o.name for o in dm.worst(2, metric="min")] == ["b/x#0", "c/x#0"]
    assert "1 more operator" in dm.table(top=3)
    with pytest.raises(ValueError):
        dm.worst(-1)


# --------------------------------------------------------------------------- JSON
def test_json_round_trip_including_nan_and_inf(tmp_path):
    reports = [rep("a/exp#0", math.nan, -math.inf, math.inf, phase="train", step=0),
               rep("b/div#0", 1.25, 0.5, 2.0, inputs=["a/exp#0"], phase="train", step=0,
                   counters=dict.fromkeys(COUNTER_KEYS, 0) | {"division": 4})]
    dm = DigitMap.from_reports(reports, metadata={"seed": 3, "confidence": 0.95,
                                                  "target": "t.py:f", "extra": {"k": [1, 2]}})
    text = dm.to_json()

    def refuse(token):
        raise AssertionError(f"invalid JSON token {token}")

    doc = json.loads(text, parse_constant=refuse)  # strictly valid JSON
    assert doc["schema_version"] == SCHEMA_VERSION
    op = doc["operators"][0]
    assert (op["avg_digits"], op["min_digits"], op["max_digits"]) == ("NaN", "-Infinity",
                                                                      "Infinity")
    path = dm.save(tmp_path / "d.json")
    back = DigitMap.load(path)
    a = back["a/exp#0"]
    assert math.isnan(a.avg_digits) and a.min_digits == -math.inf and a.max_digits == math.inf
    assert back == dm
    assert back.to_json() == text
    assert back["b/div#0"].counters["division"] == 4
    assert back.metadata["extra"] == {"k": [1, 2]}
    assert DigitMap.from_json(text) == dm
    # a bare NaN token (Python's json default) is read too
    assert math.isnan(DigitMap.from_json(text.replace('"NaN"', "NaN"))["a/exp#0"].avg_digits)


def test_version_2_maps_load_as_maps_without_impacts():
    # version 3 added the impacts; a version 2 map (with or without them: session 17 wrote
    # the optional key there) loads, and is written back as version 3
    doc = _doc()
    assert doc["schema_version"] == SCHEMA_VERSION == 3
    doc["schema_version"] = 2
    old = DigitMap.from_json(json.dumps(doc))
    assert old.impact_threshold() is None and old == DigitMap.from_json(json.dumps(_doc()))
    doc["operators"][0]["impact"] = 0.5
    doc["metadata"]["impact_threshold"] = 0.2
    with_impact = DigitMap.from_json(json.dumps(doc))
    assert with_impact.impact_threshold() == 0.2
    assert json.loads(with_impact.to_json())["schema_version"] == 3


def _doc() -> dict:
    return json.loads(chain_map().to_json())


def _mutations():
    def m(fn):
        def apply():
            d = _doc()
            fn(d)
            return json.dumps(d)
        return apply

    def set_(path, value):
        def fn(d):
            obj = d
            for k in path[:-1]:
                obj = obj[k]
            obj[path[-1]] = value
        return fn

    def del_(path):
        def fn(d):
            obj = d
            for k in path[:-1]:
                obj = obj[k]
            del obj[path[-1]]
        return fn

    return [
        ("not json", lambda: "{oops", "not valid JSON", None),
        ("array", lambda: "[1, 2]", "is a JSON object", None),
        ("pickle", lambda: b"\x80\x04\x95", "not valid JSON", None),
        ("no schema", m(del_(["schema"])), "not an fxstab digit map", None),
        ("other schema", m(set_(["schema"], "other")), "not an fxstab digit map", "schema"),
        ("newer", m(set_(["schema_version"], SCHEMA_VERSION + 1)), "upgrade fxstab",
         "schema_version"),
        ("older", m(set_(["schema_version"], 0)), "older fxstab", "schema_version"),
        ("version type", m(set_(["schema_version"], "1")), "must be an integer",
         "schema_version"),
        ("no operators", m(del_(["operators"])), "missing", "operators"),
        ("no torch version", m(del_(["metadata", "torch_version"])), "metadata", "torch_version"),
        ("seed type", m(set_(["metadata", "seed"], "zero")), "must be an integer", "seed"),
        ("impact threshold type", m(set_(["metadata", "impact_threshold"], "low")),
         "must be a number", "impact_threshold"),
        ("impact type", m(set_(["operators", 1, "impact"], "much")), "must be a number",
         "impact"),
        ("op min missing", m(del_(["operators", 2, "min_digits"])),
         "operators[2] 'act/gelu#0'", "min_digits"),
        ("op min str", m(set_(["operators", 1, "min_digits"], "low")),
         "must be a number, got 'low'", "min_digits"),
        ("op calls bool", m(set_(["operators", 0, "calls"], True)),
         "must be a non-negative integer", "calls"),
        ("op numel negative", m(set_(["operators", 0, "numel"], -3)),
         "non-negative integer", "numel"),
        ("op surrogate int", m(set_(["operators", 0, "surrogate"], 1)), "a boolean",
         "surrogate"),
        ("op counters", m(set_(["operators", 0, "counters", "cancellation"], 1.5)),
         "non-negative integer", "counters.cancellation"),
        ("op shape", m(set_(["operators", 0, "shape"], [2, "x"])), "non-negative integer",
         "shape"),
        ("duplicate", m(set_(["operators", 1, "name"], "l1/linear#0")), "duplicate", "name"),
        ("unknown input", m(set_(["operators", 1, "inputs"], ["ghost#0"])), "ghost#0",
         "inputs"),
        ("step unknown op", m(lambda d: d["steps"][0]["operators"].update(
            {"ghost#0": d["steps"][0]["operators"]["l1/linear#0"]})), "ghost#0", None),
        ("step type", m(set_(["steps", 0, "step"], "one")), "steps[0]", "step"),
    ]


@pytest.mark.parametrize("label,make,message,key", _mutations(),
                         ids=[m[0] for m in _mutations()])
def test_load_reports_exactly_what_is_wrong(tmp_path, label, make, message, key):
    path = tmp_path / "bad.json"
    data = make()
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    with pytest.raises(DigitMapError) as e:
        DigitMap.load(path)
    assert isinstance(e.value, ValueError)
    text = str(e.value)
    assert text.startswith(str(path)), text
    assert message in text, text
    assert e.value.key == key
    if key is not None:
        assert repr(key) in text


def test_load_missing_file(tmp_path):
    with pytest.raises(DigitMapError, match="no such file"):
        DigitMap.load(tmp_path / "absent.json")


def test_save_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "d.json"
    path.write_text("previous")
    import fxstab.digitmap.map as mod

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(mod.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        chain_map().save(path)
    assert path.read_text() == "previous"
    assert sorted(os.listdir(tmp_path)) == ["d.json"]  # no temp file left behind
    monkeypatch.undo()

    # a value JSON cannot hold fails before any file is opened
    bad = chain_map()
    bad.metadata["model"] = object()
    with pytest.raises(DigitMapError, match="cannot serialize"):
        bad.save(tmp_path / "new.json")
    assert sorted(os.listdir(tmp_path)) == ["d.json"]

    chain_map().save(path)
    assert sorted(os.listdir(tmp_path)) == ["d.json"]
    assert DigitMap.load(path) == chain_map()


# --------------------------------------------------------------------------- diff
def test_diff_drop_gain_added_removed():
    base = simple_map({"a/x#0": 2.0, "b/x#0": 2.0, "c/x#0": 1.0, "d/x#0": 2.0, "gone/x#0": 1.0})
    head = simple_map({"a/x#0": 0.5, "b/x#0": 1.6, "c/x#0": 2.2, "d/x#0": 1.5, "new/x#0": 0.1})
    r = diff(base, head, max_drop=0.5)
    assert [(c.name, c.delta) for c in r.drops] == [("a/x#0", pytest.approx(-1.5))]
    assert [(c.name, c.delta) for c in r.gains] == [("c/x#0", pytest.approx(1.2))]
    assert [p.name for p in r.added] == ["new/x#0"] and r.added[0].digits == 0.1
    assert [p.name for p in r.removed] == ["gone/x#0"]
    assert r.unchanged == 2  # b lost 0.4 and d exactly 0.5: within the threshold
    assert r.failed and r.exit_code == 1
    ok = diff(base, head, max_drop=1.5)
    assert not ok.failed and ok.exit_code == 0 and ok.unchanged == 4
    assert diff(base, base, max_drop=0.0).exit_code == 0
    assert diff(base, head, max_drop=0.0).unchanged == 0


def test_diff_metric_avg_and_nan():
    base = DigitMap.from_reports([rep("a/x#0", 2.0, 0.0, 2.4), rep("b/x#0", 2.0, 2.0, 2.0)])
    head = DigitMap.from_reports([rep("a/x#0", 0.5, 0.0, 2.4),
                                  rep("b/x#0", math.nan, math.nan, math.nan)])
    by_min = diff(base, head, metric="min")
    assert [c.name for c in by_min.drops] == ["b/x#0"]  # NaN digits count as 0
    by_avg = diff(base, head, metric="avg")
    assert [c.name for c in by_avg.drops] == ["b/x#0", "a/x#0"]
    with pytest.raises(ValueError, match="metric"):
        diff(base, head, metric="max")
    with pytest.raises(ValueError, match="max_drop"):
        diff(base, head, max_drop=-1)


def test_diff_notes_differing_settings():
    r = diff(simple_map({"a/x#0": 2.0}, rounding="random"),
             simple_map({"a/x#0": 2.0}, rounding="nearest"))
    assert r.notes == ["rounding differs: 'random' (base) vs 'nearest' (head)"]
    assert "note: rounding differs" in r.to_text()
    assert "**Note:** rounding differs" in r.to_markdown()


def test_diff_markdown_shape():
    base = simple_map({"blocks.0/softmax#0": 2.4, "b|x/gelu#0": 2.0, "c/x#0": 1.0,
                       "gone/x#0": 1.0}, git_commit="a" * 40)
    head = simple_map({"blocks.0/softmax#0": 0.0, "b|x/gelu#0": 2.0, "c/x#0": 2.0,
                       "new/x#0": 2.0}, git_commit="b" * 40)
    md = diff(base, head, max_drop=0.5).to_markdown()
    lines = md.splitlines()
    assert lines[0] == "<!-- fxstab-digit-map-diff -->"  # lets CI update its own comment
    assert lines[1].startswith("### fxstab digit map :x: FAIL: 1 operator(s) lost more than 0.5")
    assert "`base aaaaaaaaaa` → `head bbbbbbbbbb`" in md
    i = lines.index("| operator | kind | base | head | change |")
    assert lines[i + 1] == "|---|---|--:|--:|--:|"
    assert lines[i + 2] == "| `blocks.0/softmax#0` | softmax | 2.40 | 0.00 | **-2.40** |"
    for section in ("Gained digits (1)", "Added operators (1)", "Removed operators (1)"):
        assert f"<details><summary>{section}</summary>" in md
    assert md.count("<details>") == md.count("</details>") == 3
    assert lines[-1] == "1 operator(s) unchanged within ±0.5 digits."
    # a table cell never breaks on a | in a name
    ok = diff(base, base).to_markdown()
    assert ":white_check_mark: OK" in ok and "<details>" not in ok
    for row in (ln for ln in md.splitlines() if ln.startswith("| `b")):
        assert row.count(" | ") == 4


def test_diff_json_rendering():
    base = simple_map({"a/x#0": 2.0, "gone/x#0": 1.0})
    head = simple_map({"a/x#0": math.nan, "new/x#0": 2.0})
    doc = json.loads(diff(base, head).to_json())
    assert doc["failed"] is True and doc["metric"] == DEFAULT_METRIC and doc["max_drop"] == 0.5
    assert doc["drops"] == [{"name": "a/x#0", "kind": "x", "base": 2.0, "head": 0.0,
                             "delta": -2.0}]
    assert doc["added"][0]["name"] == "new/x#0" and doc["removed"][0]["name"] == "gone/x#0"
    assert doc["unchanged"] == 0


# --------------------------------------------------------------------------- localization
def test_localize_ranks_the_cancelling_operator_first():
    dm = chain_map()
    # by plain digits the last downstream operator looks worst ...
    assert dm.worst(1)[0].name == "head/softmax#0"
    # ... but the digits are lost at the cancelling linear
    ranked = dm.localize()
    assert ranked[0].name == "cancel/linear#0"
    assert ranked[0].worst_input == "l1/linear#0"
    assert ranked[0].local_loss == pytest.approx(2.3 - 0.4)
    first = ranked[[r.name for r in ranked].index("l1/linear#0")]
    assert first.worst_input is None and first.reference == pytest.approx(BF16_CAP)
    assert first.local_loss == pytest.approx(BF16_CAP - 2.3)
    assert [r.name for r in dm.localize(metric="min")][0] == "cancel/linear#0"
    text = dm.localize_table()
    assert text.splitlines()[2].split()[0] == "cancel/linear#0"


def test_localize_does_not_blame_a_residual_join():
    """A join of a clean skip path (a) and a damaged branch (b) is no culprit: against its
    least accurate input it loses nothing. Against its best input (the old rule) it looked
    like one."""
    dm = DigitMap.from_reports([
        rep("a/linear#0", 2.3, 2.3, 2.3), rep("b/linear#0", 0.2, 0.2, 0.2),
        rep("m/add#0", 1.0, 1.0, 1.0, inputs=["b/linear#0", "a/linear#0"]),
        rep("n/layer_norm#0", 1.8, 1.8, 1.8, inputs=["m/add#0"]),
        rep("o/linear#0", 0.5, 0.5, 0.5, inputs=["n/layer_norm#0"]),
    ])
    by = {r.name: r for r in dm.localize()}
    assert by["m/add#0"].worst_input == "b/linear#0"
    assert by["m/add#0"].local_loss == pytest.approx(-0.8)  # the join restores digits
    assert by["n/layer_norm#0"].local_loss == pytest.approx(-0.8)
    assert by["b/linear#0"].local_loss == pytest.approx(BF16_CAP - 0.2)
    assert [r.name for r in dm.localize()][:2] == ["b/linear#0", "o/linear#0"]


def test_localize_ranks_nonfinite_origins_first():
    dm = DigitMap.from_reports([
        rep("a/linear#0", 2.3, 2.3, 2.3), rep("c/sub#0", 0.1, 0.0, 0.3, inputs=["a/linear#0"]),
        rep("e/exp#0", 1.5, 0.0, 2.4, non_finite=4, inputs=["a/linear#0"]),
        rep("d/div#0", 0.0, 0.0, 0.0, non_finite=9, inputs=["e/exp#0", "c/sub#0"]),
    ])
    ranked = dm.localize()
    assert [r.name for r in ranked[:2]] == ["e/exp#0", "c/sub#0"]
    assert ranked[0].nonfinite_origin and not ranked[1].nonfinite_origin
    assert dm.nonfinite_sources() == ["e/exp#0"]  # d only propagates
    found = dm.findings()
    assert found[0].startswith("NaN/inf first appear at e/exp#0") and "overflow" in found[0]
    assert found[1].startswith("digits are lost at c/sub#0") and "cancellation" in found[1]
    assert "NaN/inf" in dm.localize_table().splitlines()[2]


def masked_attention_map(head_digits: float = 1.5) -> DigitMap:
    """An additive finfo.min mask rounded to -inf (mask/add), absorbed by the softmax."""
    return DigitMap.from_reports([
        rep("q/linear#0", 2.3, 2.0, 2.41),
        rep("attn/add#0", 1.2, 0.0, 2.41, non_finite=40, inputs=["q/linear#0"]),
        rep("attn/softmax#0", 2.2, 1.5, 2.41, inputs=["attn/add#0"]),
        rep("out/linear#0", head_digits, 1.5, 2.41, inputs=["attn/softmax#0"]),
    ])


def test_infinities_the_program_absorbs_are_a_note_not_an_origin():
    dm = masked_attention_map()
    assert dm.nonfinite_sources() == []
    assert dm.absorbed_nonfinite() == {"attn/add#0": (("attn/add#0",), ("attn/softmax#0",))}
    found = dm.findings()
    assert not any(f.startswith("NaN/inf first appear") for f in found)
    assert found[-1].startswith("note: NaN/inf appear at attn/add#0 (40 of 100 elements) and are "
                                "absorbed by attn/softmax#0 before any output")
    by = {r.name: r for r in dm.localize()}
    assert not by["attn/add#0"].nonfinite_origin and by["attn/add#0"].local_loss == 0.0
    # the masked elements count as 0 digits: the softmax is measured against the cap instead
    assert by["attn/softmax#0"].worst_input is None
    assert by["attn/softmax#0"].local_loss == pytest.approx(BF16_CAP - 2.2)
    assert dm.localize()[0].name == "out/linear#0"  # ranks where digits are really lost


def test_infinities_carried_on_then_absorbed_and_those_that_reach_an_output():
    # the arithmetic level's softmax: x - max keeps the -inf, exp turns it into 0
    carried = DigitMap.from_reports([
        rep("a/add#0", 1.2, 0.0, 2.41, non_finite=40),
        rep("s/amax#0", 2.41, 2.41, 2.41, inputs=["a/add#0"]),
        rep("s/sub#0", 1.0, 0.0, 2.41, non_finite=40, inputs=["a/add#0", "s/amax#0"]),
        rep("s/exp#0", 2.0, 1.0, 2.41, inputs=["s/sub#0"]),
        rep("s/div#0", 2.0, 1.0, 2.41, inputs=["s/exp#0"]),
    ])
    assert carried.absorbed_nonfinite() == {
        "a/add#0": (("a/add#0", "s/sub#0"), ("s/amax#0", "s/exp#0"))}
    assert carried.nonfinite_sources() == []
    assert {r.name: r.local_loss for r in carried.localize()}["s/sub#0"] == 0.0
    # a NaN born from the infinity (inf * 0) that flows to an output is no absorbed value
    leaks = DigitMap.from_reports([
        rep("a/add#0", 1.2, 0.0, 2.41, non_finite=40),
        rep("b/softmax#0", 2.0, 1.0, 2.41, inputs=["a/add#0"]),
        rep("c/mul#0", 0.0, 0.0, 0.0, non_finite=40, inputs=["a/add#0"]),
    ])
    assert leaks.absorbed_nonfinite() == {} and leaks.nonfinite_sources() == ["a/add#0"]
    assert leaks.findings()[0].startswith("NaN/inf first appear at a/add#0")
    # an origin no instrumented operator reads may be an output: not absorbed
    alone = DigitMap.from_reports([rep("a/add#0", 1.2, 0.0, 2.41, non_finite=40)])
    assert alone.nonfinite_sources() == ["a/add#0"]


def test_an_absorbed_mask_never_fails_the_gate_and_a_real_origin_does():
    base = DigitMap.from_reports([
        rep("q/linear#0", 2.3, 2.0, 2.41), rep("attn/add#0", 2.2, 2.0, 2.41, inputs=["q/linear#0"]),
        rep("attn/softmax#0", 2.2, 1.5, 2.41, inputs=["attn/add#0"]),
        rep("out/linear#0", 2.0, 1.5, 2.41, inputs=["attn/softmax#0"])])
    result = diff(base, masked_attention_map(), max_drop=5.0)
    assert not result.new_origins and not result.failed
    overflow = DigitMap.from_reports([
        rep("q/linear#0", 2.3, 2.0, 2.41),
        rep("attn/add#0", 1.2, 0.0, 2.41, non_finite=40, inputs=["q/linear#0"]),
        rep("attn/softmax#0", 0.0, 0.0, 0.0, non_finite=100, inputs=["attn/add#0"]),
        rep("out/linear#0", 0.0, 0.0, 0.0, non_finite=100, inputs=["attn/softmax#0"])])
    result = diff(base, overflow, max_drop=5.0)
    assert result.new_origins == ["attn/add#0"] and result.failed


def test_graph_has_edges_and_digit_attributes():
    g = chain_map().graph()
    assert set(g.edges) == {("l1/linear#0", "cancel/linear#0"),
                            ("cancel/linear#0", "act/gelu#0"), ("act/gelu#0", "head/softmax#0")}
    assert g.nodes["cancel/linear#0"]["avg_digits"] == 0.4
    assert g.nodes["cancel/linear#0"]["kind"] == "linear"


# --------------------------------------------------------------------------- time series (TensorBoard)
def series_map() -> DigitMap:
    reports = []
    for step in range(4):
        reports += [rep("l1/linear#0", 2.3, 2.0, 2.41, phase="train", step=step, call=step),
                    rep("cancel/linear#0", 1.5 - 0.4 * step, 1.0 - 0.3 * step, 2.0,
                        inputs=["l1/linear#0"], phase="train", step=step, call=step)]
    reports.append(rep("cancel/linear#0", 0.3, 0.1, 1.0, inputs=["l1/linear#0"], phase="eval",
                       step=3, call=4))
    return DigitMap.from_reports(reports)


def _has_tensorboard() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_tensorboard(), reason="tensorboard is not installed")
def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dm = series_map()
    n = dm.to_tensorboard(tmp_path)
    assert n == len(dm.steps) == 9
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    events = acc.Scalars("digits_min/train/cancel/linear#0")
    assert [e.step for e in events] == [0, 1, 2, 3]
    assert events[1].value == pytest.approx(0.7)


@pytest.mark.skipif(_has_tensorboard(), reason="tensorboard is installed")
def test_tensorboard_missing_is_a_clear_error(tmp_path):
    with pytest.raises(ModuleNotFoundError, match="pip install tensorboard"):
        series_map().to_tensorboard(tmp_path)
    assert not list(tmp_path.iterdir())


def test_diff_names_where_the_lost_digits_start():
    base = DigitMap.from_reports([
        rep("l1/linear#0", 2.3, 2.0, 2.41), rep("cancel/linear#0", 1.9, 1.5, 2.41,
                                                inputs=["l1/linear#0"]),
        rep("act/gelu#0", 2.2, 2.0, 2.41, inputs=["cancel/linear#0"]),
        rep("head/softmax#0", 2.3, 1.9, 2.41, inputs=["act/gelu#0"])])
    r = diff(base, chain_map(), max_drop=0.5, metric="avg")
    assert {c.name for c in r.drops} == {"cancel/linear#0", "act/gelu#0", "head/softmax#0"}
    assert r.drops[0].name == "head/softmax#0"  # the largest drop is downstream ...
    assert r.origins[0].name == "cancel/linear#0"  # ... the loss starts at the cancellation
    assert "digits are lost first at cancel/linear#0" in r.to_text()
    assert "Digits are lost first at `cancel/linear#0`" in r.to_markdown()
    assert json.loads(r.to_json())["origins"][0]["worst_input"] == "l1/linear#0"
    assert diff(base, base).origins == []


def test_difference_of_two_maps():
    from fxstab.records.report import OpReport

    def dm(avg, status="rounded"):
        r = OpReport(name="a/linear#0", kind="linear", module_path="a", format="bf16",
                     n_samples=3, avg_digits=avg, min_digits=0.5, max_digits=2.0, numel=4,
                     normwise_digits=float("nan"), status=status)
        return DigitMap.from_reports([r])

    assert dm(1.5).difference(dm(1.5)) == 0.0  # NaN normwise digits on both sides agree
    assert dm(1.5).difference(dm(1.25)) == 0.25
    assert dm(1.5).difference(dm(1.5, status="per_sample")) == float("inf")


# --------------------------------------------------------------------------- rewritten regions
class _SharpAttention(torch.nn.Module):
    """softmax(a), or the same module rewritten as e = exp(8a); e / e.sum(-1) (issue 30)."""

    def __init__(self, rewritten: bool) -> None:
        super().__init__()
        self.rewritten = rewritten
        self.qkv, self.proj = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = q @ k.transpose(-2, -1) / 32 ** 0.5
        if self.rewritten:
            e = torch.exp(8 * a)
            p = e / e.sum(-1, keepdim=True)
        else:
            p = torch.softmax(a, -1)
        return self.proj(p @ v)


class _Model(torch.nn.Module):
    def __init__(self, rewritten: bool) -> None:
        super().__init__()
        self.attn, self.head = _SharpAttention(rewritten), torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.head(self.attn(x))


def _analysed(rewritten: bool) -> DigitMap:
    import fxstab

    torch.manual_seed(0)
    model = _Model(rewritten)
    torch._dynamo.reset()
    be = fxstab.backend(format="bf16")
    torch.compile(model, backend=be)(torch.randn(4, 16, 32,
                                                 generator=torch.Generator().manual_seed(1)))
    return be.digit_map()


def test_a_rewritten_softmax_fails_the_default_gate_with_the_rewrite_named():
    """The rewrite renames every operator it touches, and the module's minimum is another
    operator's: only the comparison at the region's boundary sees the lost digits."""
    base, head = _analysed(False), _analysed(True)
    result = diff(base, head)
    assert not result.drops and not result.module_drops  # what the gate saw before
    assert result.failed and result.exit_code == 1
    (r,) = result.rewrite_drops
    assert (r.consumer, r.removed) == ("attn/matmul#1", ["attn/softmax#0"])
    assert r.added == ["attn/mul#0", "attn/exp#0", "attn/sum#0", "attn/div#1"]
    assert r.base == pytest.approx(base.operators["attn/softmax#0"].avg_digits)
    assert r.head == pytest.approx(head.operators["attn/div#1"].avg_digits)
    assert r.delta < -0.5
    said = f"rewritten: softmax#0 -> mul#0, exp#0, sum#0, div#1: {r.delta:+.2f} digits at the " \
           f"input of attn/matmul#1"
    assert said in result.to_text() and "1 rewritten region(s) lost" in result.summary()
    assert "rewritten: softmax#0" in result.to_markdown()
    doc = json.loads(result.to_json())
    assert doc["rewrites"][0]["consumer"] == "attn/matmul#1" and doc["rewrites"][0]["failed"]
    # the same rewrite kept to its own digits passes, listed as a rewrite
    same = diff(base, base)
    assert not same.rewrites and not same.failed


def test_rewrites_are_found_at_every_consumer_of_the_region():
    base = DigitMap.from_reports([
        rep("a/linear#0", 2.3, 2.0, 2.41), rep("a/softmax#0", 2.0, 1.5, 2.41, inputs=["a/linear#0"]),
        rep("b/linear#0", 2.0, 1.5, 2.41, inputs=["a/softmax#0"]),
        rep("c/linear#0", 2.0, 1.5, 2.41, inputs=["a/softmax#0", "a/linear#0"])])
    head = DigitMap.from_reports([
        rep("a/linear#0", 2.3, 2.0, 2.41), rep("a/exp#0", 1.9, 1.5, 2.41, inputs=["a/linear#0"]),
        rep("a/div#0", 1.8, 1.5, 2.41, inputs=["a/exp#0"]),
        rep("b/linear#0", 2.0, 1.5, 2.41, inputs=["a/div#0"]),
        rep("c/linear#0", 2.0, 1.5, 2.41, inputs=["a/div#0", "a/linear#0"])])
    result = diff(base, head)
    assert [(r.consumer, r.removed, r.added) for r in result.rewrites] == [
        ("b/linear#0", ["a/softmax#0"], ["a/exp#0", "a/div#0"]),
        ("c/linear#0", ["a/softmax#0"], ["a/exp#0", "a/div#0"])]
    assert all(r.delta == pytest.approx(-0.2) for r in result.rewrites)
    assert not result.failed  # within the threshold: listed, not failed
    assert "rewritten: a/softmax#0 -> a/exp#0, a/div#0: -0.20" in result.to_text()


# --------------------------------------------------------------------------- accumulator's digits
def test_the_accumulators_digits_aggregate_over_the_calls_that_measured_them():
    """numel-weighted average and minimum over the calls with the figure; a call without it
    (the trusted path) does not dilute it; a map with none has NaN and no keys."""
    rs = [rep("fc/linear#0", 2.0, 1.5, 2.41, numel=100, accumulator_digits=1.0,
              accumulator_min_digits=0.5),
          rep("fc/linear#0", 2.0, 1.5, 2.41, numel=300, accumulator_digits=2.0,
              accumulator_min_digits=0.25),
          rep("fc/linear#0", 2.0, 1.5, 2.41, numel=100)]
    op = DigitMap.from_reports(rs).operators["fc/linear#0"]
    assert op.accumulator_digits == pytest.approx(1.75) and op.accumulator_min_digits == 0.25
    plain = DigitMap.from_reports([rep("fc/linear#0", 2.0, 1.5, 2.41)])
    assert math.isnan(plain.operators["fc/linear#0"].accumulator_digits)
    assert "accumulator_digits" not in json.loads(plain.to_json())["operators"][0]


def test_the_accumulators_digits_are_validated_on_load():
    dm = DigitMap.from_reports([rep("fc/linear#0", 2.0, 1.5, 2.41, accumulator_digits=1.0,
                                    accumulator_min_digits=0.5)])
    doc = json.loads(dm.to_json())
    doc["operators"][0]["accumulator_digits"] = "two"
    with pytest.raises(DigitMapError, match="accumulator_digits.*must be a number"):
        DigitMap.from_json(json.dumps(doc))


def _biased(acc: float, cestac: float = 2.3) -> DigitMap:
    """l1 (a GEMM whose accumulator keeps ``acc`` digits) -> act, bf16."""
    return DigitMap.from_reports([
        rep("l1/linear#0", cestac, cestac - 0.3, 2.41, accumulator_digits=acc,
            accumulator_min_digits=acc - 0.5),
        rep("act/gelu#0", 2.2, 1.9, 2.41, inputs=["l1/linear#0"]),
    ], metadata={"seed": 0, "accumulate": {"*": "e8m13/b32/zero"}})


def test_an_accumulator_below_its_spread_is_a_finding_ranked_by_its_own_digits():
    dm = _biased(1.0)
    assert dm.findings()[0].startswith("the accumulator of l1/linear#0 keeps only 1.00 avg "
                                       "digits of its exact sum, against 2.30")
    assert dm.findings(metric="min")[0].startswith("the accumulator of l1/linear#0 keeps "
                                                   "only 0.50 min digits")
    first = dm.localize()[0]
    assert (first.name, first.digits, first.accumulator) == ("l1/linear#0", 1.0, True)
    assert "its accumulator's digits" in dm.localize_table().splitlines()[2]
    lines = dm.table().splitlines()
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert lines[1].split()[10] == "acc" and rows["l1/linear#0"][10] == "1.00"
    assert rows["act/gelu#0"][10] == "-"
    # within the margin (a quarter of the cap): no finding, the column still shows it
    close = _biased(2.0)
    assert not any(f.startswith("the accumulator") for f in close.findings())
    assert "2.00" in [line.split()[10] for line in close.table().splitlines()[2:4]]
    # above the spread (a random accumulator's usual case): the CESTAC digits rank
    assert not _biased(2.41).localize()[0].accumulator


def test_the_diff_counts_a_drop_of_the_accumulators_digits_as_a_drop():
    base, head = _biased(2.41), _biased(1.0)
    d = diff(base, head)
    assert d.failed and [(c.name, c.base, c.head, c.accumulator) for c in d.drops] == [
        ("l1/linear#0", 2.3, 1.0, True)]
    assert d.as_dict()["drops"][0]["accumulator"] is True
    assert not diff(head, base).drops and diff(head, base).gains[0].name == "l1/linear#0"


# --------------------------------------------------------------------------- fixes kept
def _fix(**kw):
    from fxstab.digitmap.fixrecord import Fix

    d = dict(operator="head/softmax#0", rewrite="log_softmax", source="/src/model.py:17",
             code="return torch.log(p) if x < 1 else p", replacement="F.log_softmax(z, 1)",
             before=0.0, after=2.5, real_before=0.0, real_after=3.25, nonfinite_before=6,
             nonfinite_after=0, verified=True, numel=6, format="fp16",
             findings=("head/softmax#0", "act/gelu#0"))
    d.update(kw)
    return Fix(**d)


def _with_fixes(fixes) -> DigitMap:
    dm = chain_map()
    return DigitMap(dm.operators.values(), dm.metadata, dm.steps, fixes)


def test_a_fix_round_trips_through_json():
    from fxstab.digitmap.fixrecord import Fix

    fix = _fix()
    d = fix.as_dict()
    assert d["findings"] == ["head/softmax#0", "act/gelu#0"] and d["verified"] is True
    assert Fix.from_dict(json.loads(json.dumps(d))) == fix
    # the optional keys take their defaults; a NaN digit (an analysis without a value) stays
    short = {k: v for k, v in d.items() if k not in ("numel", "format", "findings")}
    assert Fix.from_dict(short) == _fix(numel=0, format="", findings=())
    nan = Fix.from_dict({**d, "after": "NaN"})
    assert math.isnan(nan.after)
    with pytest.raises(DigitMapError, match="fix: key 'verified': must be a boolean"):
        Fix.from_dict({**d, "verified": "yes"})
    with pytest.raises(DigitMapError, match="missing") as e:
        Fix.from_dict({k: v for k, v in d.items() if k != "replacement"})
    assert e.value.key == "replacement"


def test_a_map_keeps_its_fixes_through_save_and_load(tmp_path):
    fixes = [_fix(), _fix(rewrite="xlogy", verified=False, nonfinite_after=5, real_after=0.55,
                          findings=())]
    dm = _with_fixes(fixes)
    assert dm.fixes() == fixes and chain_map().fixes() == []
    back = DigitMap.load(dm.save(tmp_path / "fixed.json"))
    assert back.fixes() == fixes and back == dm
    assert back != chain_map()  # the fixes are part of the map
    doc = json.loads(back.to_json())
    assert doc["fixes"][0]["code"] == "return torch.log(p) if x < 1 else p"
    assert doc["schema_version"] == SCHEMA_VERSION  # an optional key: no new version
    # a map made without fixes writes no key (its JSON is what it was before fixes)
    assert "fixes" not in json.loads(chain_map().to_json())


def test_a_map_without_the_fixes_key_loads_with_no_fixes():
    doc = _doc()
    assert "fixes" not in doc
    assert DigitMap.from_json(json.dumps(doc)).fixes() == []
    doc["schema_version"] = 2  # an older map too
    assert DigitMap.from_json(json.dumps(doc)).fixes() == []


@pytest.mark.parametrize("entry,message,key", [
    ({"nonfinite_after": -1}, "fixes[1]: key 'nonfinite_after': must be a non-negative "
                              "integer", "nonfinite_after"),
    ({"real_after": "high"}, "fixes[1]: key 'real_after': must be a number", "real_after"),
    ({"findings": ["log#0", 3]}, "fixes[1]: key 'findings': must be a string", "findings"),
    ({"code": None}, "fixes[1]: key 'code': must be a string", "code"),
], ids=["negative count", "digits text", "finding not a name", "code null"])
def test_a_malformed_fix_fails_with_the_schemas_error(tmp_path, entry, message, key):
    doc = json.loads(_with_fixes([_fix(), _fix()]).to_json())
    doc["fixes"][1].update(entry)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(DigitMapError) as e:
        DigitMap.load(path)
    assert str(e.value).startswith(f"{path}: {message}"), str(e.value)
    assert e.value.key == key
    doc["fixes"] = {"log#0": "log_softmax"}
    with pytest.raises(DigitMapError, match="key 'fixes': must be a list"):
        DigitMap.from_json(json.dumps(doc))
    doc["fixes"] = ["log_softmax"]
    with pytest.raises(DigitMapError, match=r"fixes\[0\]: must be an object"):
        DigitMap.from_json(json.dumps(doc))
