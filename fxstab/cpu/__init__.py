"""The fused CPU kernels: their C source (``csrc/cpu_kernels.c``), its build
(:mod:`~fxstab.cpu.build`: compiled on first use, never at import), the Python functions over the
library (:mod:`~fxstab.cpu.bindings`) and the allocator tuning of an analysed call
(:mod:`~fxstab.cpu.alloc`)."""

from . import alloc, bindings, build

__all__ = ["alloc", "bindings", "build"]
