"""What a user reads first (issue 56, item 11): findings name the source line and its code;
the table folds the operators that only carry an origin's NaN/inf into one line."""

from __future__ import annotations

from fxstab.digitmap import DigitMap
from fxstab.records.report import OpReport


def _rep(name: str, avg: float, inputs=(), non_finite: int = 0, source: str = "") -> OpReport:
    module, _, op = name.rpartition("/")
    return OpReport(name=name, kind=op.split("#")[0], module_path=module, avg_digits=avg,
                    min_digits=max(0.0, avg - 1), max_digits=2.41, inputs=tuple(inputs),
                    format="bf16", n_samples=3, numel=64, non_finite=non_finite, source=source)


def _overflowing(tmp_path) -> DigitMap:
    src = tmp_path / "model.py"
    src.write_text("def forward(self, z):\n    e = torch.exp(z * 64)\n    return e / e.sum()\n")
    reps = [_rep("a/linear#0", 2.2), _rep("a/exp#0", 1.7, ["a/linear#0"], 9, f"{src}:2")]
    prev = "a/exp#0"
    for k in range(6):  # everything after the overflow carries it
        reps.append(_rep(f"b/add#{k}", 0.0, [prev], 9, f"{src}:3"))
        prev = f"b/add#{k}"
    reps.append(_rep("c/sub#0", 0.3, ["a/linear#0"], 0, f"{src}:3"))  # a loss of its own
    return DigitMap.from_reports(reps, metadata={"format": "bf16"})


def test_findings_name_the_line_and_its_code(tmp_path):
    found = _overflowing(tmp_path).findings()
    assert found[0].startswith("NaN/inf first appear at a/exp#0, model.py:2 "
                               "`e = torch.exp(z * 64)` (9 of 64 elements)"), found
    assert found[1].startswith("digits are lost at c/sub#0, model.py:3 `return e / e.sum()`:")


def test_the_table_folds_what_only_carries_an_origins_nan(tmp_path):
    dm = _overflowing(tmp_path)
    assert set(dm.carried_nonfinite()) == {f"b/add#{k}" for k in range(6)}
    assert set(dm.carried_nonfinite().values()) == {("a/exp#0",)}
    rows = dm.table(top=2).splitlines()
    assert [r.split()[0] for r in rows[2:4]] == ["c/sub#0", "a/exp#0"]  # the origin stays
    assert not any(r.startswith("b/add#") for r in rows)
    assert "... 1 more operator(s)" in rows  # (of the 3 not folded)
    assert "... 6 operator(s) only carry the NaN/inf of a/exp#0: b/add#0, b/add#1, b/add#2 " \
           "and 3 more" in rows
