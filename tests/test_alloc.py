"""fxstab.alloc: glibc keeps the analysis's freed temporaries instead of refaulting them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import resource, sys, torch
import fxstab.alloc as alloc
print(alloc.tune())
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # warm: the heap grows to the working set once
    a = [torch.ones(1 << 20) for _ in range(6)]
    del a
f0 = faults()
for _ in range(10):  # 6 x 4 MiB allocated, touched and freed per round
    a = [torch.ones(1 << 20) for _ in range(6)]
    del a
print((faults() - f0) / 10)
"""


def _run(env_extra: dict) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True, env=env).stdout.split()
    return out[0], float(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_tuned_allocator_stops_refaulting_freed_temporaries():
    tuned, tuned_faults = _run({})
    if tuned != "True":
        pytest.skip("not glibc")
    off, off_faults = _run({"FXSTAB_MALLOC_TUNING": "0"})
    assert off == "False"
    # 24 MiB per round is 6144 pages: untuned, glibc mmaps and unmaps them every round
    assert off_faults > 3000
    assert tuned_faults < 100


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_user_malloc_settings_are_left_alone():
    tuned, _ = _run({"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert tuned == "False"
