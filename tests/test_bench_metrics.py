"""benchmarks/bench_metrics.py on a tiny slice: one hazard case and its healthy control."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_metrics  # noqa: E402


def test_metric_study_on_one_case(tmp_path, capsys):
    assert bench_metrics.main(["--cases", "offset_cancel/mixer/bf16/op", "--out",
                               str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "metrics.json").read_text())
    rows = {r["metric"]: r for r in doc["rows"]}
    assert set(rows) == set(bench_metrics.METRICS)
    # the cancellation damages its subtraction; every metric but min separates it from the
    # healthy model's operators, and the localization names it
    assert rows["avg"]["damaged_cases"] == 1 and rows["avg"]["top1"] == 1.0
    assert rows["avg"]["auc"] == 1.0 and rows["avg"]["healthy_at_zero"] == 0.0
    assert rows["min"]["healthy_at_zero"] > rows["avg"]["healthy_at_zero"]
    assert "avg" in capsys.readouterr().out
