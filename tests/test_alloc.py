"""fxstab.cpu.alloc: glibc keeps the analysis's freed temporaries instead of refaulting them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import resource, sys, torch
import fxstab.cpu.alloc as alloc
print(alloc.tune())
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # warm: the heap grows to the working set once
    a = [torch.ones(1 << 22) for _ in range(6)]
    del a
f0 = faults()
for _ in range(10):  # 6 x 16 MiB allocated, touched and freed per round
    a = [torch.ones(1 << 22) for _ in range(6)]
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
    assert tuned_faults < 100
    off, off_faults = _run({"FXSTAB_MALLOC_TUNING": "0"})
    assert off == "False"
    # 96 MiB per round is 24576 pages: untuned, glibc usually returns them to the kernel every
    # round (mmapped, or trimmed from the heap). Not always: on this machine some runs keep
    # them (the system's state, not fxstab's), and then there is nothing to compare.
    if off_faults < 1000:
        pytest.skip(f"untuned glibc kept the blocks in this run ({off_faults} faults per round)")
    assert off_faults > 12000


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_user_malloc_settings_are_left_alone():
    tuned, _ = _run({"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert tuned == "False"


_FRAGMENT = """
import sys, torch
import fxstab.cpu.alloc as alloc
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2 ** 20
alloc.tune()
big, small = [], []
for _ in range(40):  # 8 MiB activations with small long-lived blocks between them (a trace's;
    big.append(torch.ones(1 << 21))  # 512 KiB: no older hole takes them)
    small.append(torch.ones(1 << 17))
before = rss()
del big
kept = rss()
trimmed = alloc.trim()
print(trimmed, before - kept, kept - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_trim_returns_the_free_pages_a_fragmented_heap_keeps():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _FRAGMENT], capture_output=True, text=True,
                         check=True, env=env).stdout.split()
    if out[0] != "True":
        pytest.skip("not glibc")
    # freeing the activations returns (almost) nothing: small blocks sit between them
    assert float(out[1]) < 100
    assert float(out[2]) > 250  # trim hands back most of the 320 MiB
    off = subprocess.run([sys.executable, "-c", _FRAGMENT], capture_output=True, text=True,
                         check=True, env={**env, "FXSTAB_MALLOC_TUNING": "0"}).stdout.split()
    assert off[0] == "False"
