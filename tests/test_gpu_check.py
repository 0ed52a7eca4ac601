"""benchmarks/gpu_check.sh --dry-run: every step of the prepared GPU run, on CPU tensors at tiny
sizes, so the script cannot rot before a device is lent (issue 35, docs/gpu.md)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
E2E = ("op", "scale", "aten", "backward", "monitor", "inductor", "accumulate")
BUDGET_S = 540  # a run on the device: under 9 minutes, the rest of the 10 a command may take


@pytest.mark.slow
def test_the_dry_run_reaches_every_step_and_writes_the_summary(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = summary.splitlines()
    for step in ("env", *(f"e2e_{s}" for s in E2E), "bench_fused"):
        assert any(line.startswith(f"{step}: pass") for line in lines), (step, summary)
    for step in E2E:
        doc = json.loads((tmp_path / f"e2e_{step}.json").read_text())
        assert doc["pass"] and doc["dry_run"] and doc["device"] == "cpu" and doc["rows"], doc
        assert any(line.startswith(f"{step:<9} PASS ") for line in lines), (step, summary)
    op = json.loads((tmp_path / "e2e_op.json").read_text())["rows"]
    assert {r["format"] for r in op} == {"bf16", "fp16"}
    assert all(r["bit_identical"] and r["max_map_difference_vs_cpu"] == 0 for r in op)
    assert lines[-1].startswith("total ") and lines[-1].endswith("status 0")
    assert (tmp_path / "kernels_cpu_bf16_random_float32.json").exists()  # bench_kernels.py


def _gpu_step_limits() -> dict:
    """{step: limit in s} of the steps gpu_check.sh runs on the device: the shared ones and the
    `if [ $DRY -eq 0 ]` branches' (not the dry run's)."""
    limits, branch = {}, None
    for line in (ROOT / "benchmarks" / "gpu_check.sh").read_text().splitlines():
        if line.startswith("if [ $DRY -eq 0 ]"):
            branch = "gpu"
        elif line.startswith("else") and branch:
            branch = "dry"
        elif line.startswith("fi"):
            branch = None
        m = re.match(r"\s*step (\w+) (\d+) ", line)
        if m and branch != "dry":
            limits[m.group(1)] = int(m.group(2))
    return limits


def test_the_step_limits_fit_the_budget_and_the_header_says_their_sum():
    limits = _gpu_step_limits()
    assert {"env", "tests", "bench_fused", *(f"e2e_{s}" for s in E2E)} == set(limits), limits
    total = sum(limits.values())
    assert total <= BUDGET_S, limits
    assert f"step limits sum to {total} s" in (ROOT / "benchmarks" / "gpu_check.sh").read_text()


def test_e2e_refuses_cuda_without_a_device(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_e2e.py"), "--step",
                           "op", "--out", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "use --dry-run" in proc.stderr
