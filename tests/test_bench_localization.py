"""benchmarks/bench_localization.py: the scoring of rankings and a two-case slice of the grid."""

import json
from types import SimpleNamespace

import pytest

from benchmarks import bench_localization as bl


class _Map:
    """The three public DigitMap methods the rankings read, with fixed answers."""

    def __init__(self, sources, localized, lowest):
        self._sources, self._loc, self._low = sources, localized, lowest

    def nonfinite_sources(self):
        return list(self._sources)

    def localize(self):
        return [SimpleNamespace(name=n, local_loss=1.0) for n in self._loc]

    def sorted_worst_first(self):
        return [SimpleNamespace(name=n) for n in self._low]


def test_rank_puts_nonfinite_origins_first_once():
    m = _Map(["b"], ["a", "b", "c"], ["c", "a", "b"])
    assert bl.rank(m) == ["b", "a", "c"]
    assert bl.rank_lowest(m) == ["c", "a", "b"]
    assert bl.rank(_Map([], ["a", "c"], [])) == ["a", "c"]


def test_culprit_names_and_rank():
    c = bl.Culprit("ln", "layer_norm#0", "why", aten=("sub", "var"))
    assert c.op_name() == "blocks.1.hazard.ln/layer_norm#0"
    assert c.matches("blocks.1.hazard.ln/layer_norm#0", "op")
    assert not c.matches("blocks.1.hazard.ln/layer_norm#0/aten.sub#0", "op")
    assert c.matches("blocks.1.hazard.ln/layer_norm#0/aten.sub#1", "aten")
    assert c.matches("blocks.1.hazard.ln/layer_norm#0/aten.var#0", "aten")
    assert not c.matches("blocks.1.hazard.ln/layer_norm#0/aten.mul#0", "aten")
    assert not c.matches("blocks.1.hazard.ln/layer_norm#10/aten.sub#0", "aten")
    assert not c.matches("blocks.2.hazard.ln/layer_norm#0", "op")
    anyprim = bl.Culprit("", "sub#0", "why")
    assert anyprim.matches("blocks.1.hazard/sub#0/aten.sub#0", "aten")
    assert not anyprim.matches("blocks.1.hazard/sub#0", "aten")

    def is_c(n):
        return n.startswith("x")

    assert bl.culprit_rank(["x1", "y", "z"], is_c) == 1
    assert bl.culprit_rank(["y", "z", "x1", "x2"], is_c) == 3
    assert bl.culprit_rank(["y", "z"], is_c) is None


def test_grid_covers_the_spec():
    full = bl.all_cases(quick=False)
    assert len(bl.HAZARDS) >= 12 and len(bl.ARCHS) >= 3
    assert len(full) == len(bl.HAZARDS) * len(bl.ARCHS) * 2 * 2 == len({c.id for c in full})
    quick = bl.all_cases(quick=True)
    assert {c.hazard for c in quick} == set(bl.HAZARDS_BY_NAME)
    assert {c.arch for c in quick} == set(bl.ARCHS)
    assert {(c.format, c.level) for c in quick} == {(f, lv) for f in bl.FORMATS
                                                   for lv in bl.LEVELS}
    assert [c.id for c in bl.select(full, "offset_cancel/mixer/bf16/*,exp_gain/gpt/fp16/aten")
            ] == ["offset_cancel/mixer/bf16/op", "offset_cancel/mixer/bf16/aten",
                  "exp_gain/gpt/fp16/aten"]
    assert len(bl.select(bl.control_cases(list(bl.ARCHS)), "healthy/cnn")) == 4


def test_two_cases_write_scored_rows(tmp_path, capsys):
    cases = "offset_cancel/mixer/bf16/op,exp_gain/gpt/fp16/aten"
    assert bl.main(["--cases", cases, "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "localization.json").read_text())
    assert doc["benchmark"] == "bench_localization"
    assert {"commit", "torch", "fxstab", "machine"} <= set(doc["environment"])
    controls = {r["case"]: r for r in doc["rows"] if r["hazard"] == "healthy"}
    assert set(controls) == {"healthy/mixer/bf16/op", "healthy/gpt/fp16/aten"}
    assert all(isinstance(r["floor"], float) and not r["any_nonfinite"]
               for r in controls.values())
    rows = {r["case"]: r for r in doc["rows"] if r["hazard"] != "healthy"}
    assert set(rows) == set(cases.split(","))
    for r in rows.values():
        hz = bl.HAZARDS_BY_NAME[r["hazard"]]

        def is_culprit(name, r=r, hz=hz):
            return any(c.matches(name, r["level"]) for c in hz.culprits)

        for key, kind in (("cap", float), ("culprit_digits", float), ("operators", int),
                          ("damaged", bool), ("hit1", bool), ("hit3", bool),
                          ("hit1_lowest", bool), ("hit3_lowest", bool), ("culprits", list),
                          ("top3", list), ("top3_lowest", list), ("nonfinite_sources", list)):
            assert isinstance(r[key], kind), (key, r[key])
        assert r["healthy_floor"] == controls[f"healthy/{r['arch']}/{r['format']}/"
                                              f"{r['level']}"]["floor"]
        assert r["culprits"] and all(is_culprit(n) for n in r["culprits"])
        assert len(r["top3"]) == 3 and all(isinstance(e["digits"], float) for e in r["top3"])
        # a hit is read off the ranking: rank 1 <=> hit1 <=> the top-1 is a culprit
        for rk, h1, h3, top in (("rank_localize", "hit1", "hit3", "top3"),
                                ("rank_lowest", "hit1_lowest", "hit3_lowest", "top3_lowest")):
            assert r[h1] == (r[rk] == 1) == is_culprit(r[top][0]["name"])
            assert r[h3] == (r[rk] is not None and r[rk] <= 3) \
                == any(is_culprit(e["name"]) for e in r[top])
        assert r["damaged"] == (r["any_nonfinite"] or r["culprit_digits"]
                                < r["healthy_floor"] - bl.DAMAGE_MARGIN)
        assert r["damaged"] and r["fp32_finite"]
    # the two easiest cases of the grid: a 0-digit subtraction fed by a ~2-digit add, and an
    # exp that overflows fp16 (the NaN/inf origin) -- any usable rule names both first
    oc = rows["offset_cancel/mixer/bf16/op"]
    assert oc["culprit_digits"] < 0.5 and oc["rank_localize"] == 1
    eg = rows["exp_gain/gpt/fp16/aten"]
    assert eg["nonfinite_sources"][0] == "blocks.1.hazard/exp#0/aten.exp#0"
    assert eg["rank_localize"] == 1 and eg["hit1"]
    s = doc["summary"]["all"]
    assert s["cases"] == 2
    assert s["hit1"] == pytest.approx(sum(r["hit1"] for r in rows.values()) / 2)
    out = capsys.readouterr().out
    assert "top1" in out and "offset_cancel" in out
