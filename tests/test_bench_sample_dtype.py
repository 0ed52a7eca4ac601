"""benchmarks/bench_sample_dtype.py on a tiny shape: its rows, its model row, its JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import bench_sample_dtype  # noqa: E402
from fxstab.cpu import bindings as native  # noqa: E402


@pytest.mark.skipif(not native.available(), reason="no C compiler for fxstab.cpu.bindings")
def test_sample_dtype_cost_model_on_a_small_shape(tmp_path, capsys):
    assert bench_sample_dtype.main(["--rows", "16", "--cols", "64", "--repeats", "2",
                                    "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_sample_dtype.json").read_text())
    assert [r["primitive"] for r in doc["rows"]] == ["binary", "unary", "reduction"]
    assert all(r["now_ms"] > 0 and r["fp32_best_ms"] > 0 for r in doc["rows"])
    assert doc["model_now_ratio"] > 0 and doc["model_fp32_best_ratio"] > 0
    assert "fp32 samples, best" in capsys.readouterr().out
