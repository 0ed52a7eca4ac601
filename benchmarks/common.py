"""What every benchmark script records beside its rows: versions, machine and commit."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """HEAD of the checkout, with ``-dirty`` when tracked files changed; ``unknown`` outside git."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    import fxstab

    return {
        "time": _dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "commit": git_commit(),
        "fxstab": fxstab.__version__, "torch": torch.__version__,
        "python": sys.version.split()[0],
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
    }


def save_json(path: "str | Path", payload: dict) -> Path:
    """Write ``payload`` plus :func:`environment` as JSON, atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"environment": environment(), **payload}, indent=1, default=str))
    tmp.replace(path)
    return path
