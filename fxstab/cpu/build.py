"""The build of the fused CPU kernels: their C source, the compiler flags, the cache directory,
the compile and the load of the shared library (:mod:`fxstab.cpu.bindings` declares its
functions and calls them).

The library is compiled on first use with the system C compiler (``$CC``, else ``cc``; about
40 s on a 2-core machine, announced with one line on stderr) into a cache directory
(``$FXSTAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/fxstab``, else ``~/.cache/fxstab``), keyed by a
hash of the source, the flags and the CPU. ``FXSTAB_NATIVE=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["SOURCE", "FLAGS", "enabled", "cache_dir", "cpu_signature", "library_path",
           "compile_library", "load_library"]

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.c"
"""The C source of the kernels (shipped as package data: ``pyproject.toml``)."""

# -march=native: the element loops vectorise (variable shifts need AVX2 on x86); the cache key
# includes the CPU's feature flags, so a cache shared between machines never loads code built
# for another CPU. No -ffast-math: the rounding must follow IEEE arithmetic exactly
# (-fno-trapping-math only lets the vectoriser evaluate both sides of a select).
# -funroll-loops: 3-5% off round_stats (two builds alternated in one process, session 5); the
# build takes about 40 s on this 2-core machine, once per source version and CPU.
FLAGS = ("-O3", "-march=native", "-funroll-loops", "-fopenmp", "-ffp-contract=off",
         "-fno-trapping-math", "-fPIC", "-shared", "-std=gnu11")


def enabled() -> bool:
    """False when ``FXSTAB_NATIVE=0`` turns the fused CPU kernels off."""
    return os.environ.get("FXSTAB_NATIVE", "1") != "0"


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def cache_dir() -> Path:
    """Where compiled libraries are kept (``$FXSTAB_CACHE_DIR``, ``$XDG_CACHE_HOME/fxstab``,
    ``~/.cache/fxstab``)."""
    if os.environ.get("FXSTAB_CACHE_DIR"):
        return Path(os.environ["FXSTAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fxstab"


def cpu_signature() -> str:
    """The machine and its CPU's feature flags (what -march=native compiles for)."""
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    sig += line
    except OSError:
        sig += platform.processor()
    return sig


def library_path() -> Path:
    """Where the compiled library for this source and these flags lives (or will)."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([_compiler(), *FLAGS]).encode()
                         + cpu_signature().encode()).hexdigest()[:16]
    return cache_dir() / f"cpu_kernels-{key}.so"


def compile_library(path: Path) -> None:
    """Compile :data:`SOURCE` into ``path`` (atomically); RuntimeError without a compiler or
    when the compile fails."""
    cc = _compiler()
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found; set CC)")
    path.parent.mkdir(parents=True, exist_ok=True)
    # a first use can take half a minute: say why the program pauses (stderr, once)
    print(f"fxstab: compiling the CPU kernels into {path.parent} (once per version and CPU; "
          f"about 40 s on 2 cores)", file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, path)  # atomic: concurrent first uses never load a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library() -> ctypes.CDLL:
    """The library, compiled first if this source and these flags have no build yet
    (OSError or RuntimeError when it cannot be built or loaded)."""
    path = library_path()
    if not path.exists():
        compile_library(path)
    return ctypes.CDLL(str(path))
