"""Which implementation computes each of fxstab's kernels: the one home of the kernel choice
(the ``kernels`` option, :class:`fxstab.config.Kernels`), as lightning-thunder's executors pair
an operation with a checker and an implementation.

Three functions have several implementations, all drawing the same Philox bits (the rounded
samples are the same; statistics agree to the last few ulps):

* :data:`ROUND`: rounding N samples into a format and their digit statistics, in one pass;
* :data:`PERTURB`: the GEMM data-perturbation surrogate;
* :data:`ACCUMULATE`: a modelled GEMM's accumulator (``accumulate=``);
* :data:`LOWP_CONVERT`: the conversions around the samples' bf16 GEMMs
  (:mod:`fxstab.numerics.lowp_gemm`; CPU or TORCH, bit for bit the same).

The implementations: :data:`CPU`, the fused C kernels of :mod:`fxstab.cpu.bindings` (CPU
fp32/fp64 tensors, at most ``MAX_SAMPLES`` samples, where the C compiler built them);
:data:`TRITON`, the Triton kernels of :mod:`fxstab.kernels` (CUDA fp32/fp64 tensors where
Triton is installed; any tensor with ``kernels="triton"``, which on the CPU needs
``TRITON_INTERPRET=1``); :data:`TORCH`, the plain-torch references. The option orders them,
and the first whose checker accepts the tensor computes it:

==========  ===============================
``auto``    CPU, then TRITON, then TORCH
``cpu``     CPU, then TORCH
``triton``  TRITON (forced: its launcher says why it cannot run)
``torch``   TORCH
==========  ===============================

The arithmetic level has no Triton path for its rounding and surrogate yet
(:data:`ATEN_ROUND`): there ``triton`` means ``auto``. The monitor rounds nothing (its replicas
are perturbed inputs run by the program's own kernels), so it has no choice to make.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from .config import Kernels
from .cpu import bindings

__all__ = ["CPU", "TRITON", "TORCH", "ROUND", "PERTURB", "ACCUMULATE", "ATEN_ROUND", "LOWP_CONVERT",
           "implementation", "native_possible", "NATIVE_DTYPES"]

CPU, TRITON, TORCH = "cpu", "triton", "torch"
ROUND, PERTURB, ACCUMULATE = "round", "perturb", "accumulate"
ATEN_ROUND = "aten_round"  # the arithmetic level's rounding and surrogate
LOWP_CONVERT = "lowp_convert"  # the bf16 GEMM path's conversions (split, join)

# the dtypes the fused kernels (C and Triton) read and write
NATIVE_DTYPES = (torch.float32, torch.float64)

# function -> the implementations it has
_IMPLEMENTED = {ROUND: (CPU, TRITON, TORCH), PERTURB: (CPU, TRITON, TORCH),
                ACCUMULATE: (CPU, TRITON, TORCH), ATEN_ROUND: (CPU, TORCH),
                LOWP_CONVERT: (CPU, TORCH)}
_ORDER = {Kernels.AUTO.value: (CPU, TRITON, TORCH), Kernels.CPU.value: (CPU, TORCH),
          Kernels.TRITON.value: (TRITON,), Kernels.TORCH.value: (TORCH,)}


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _accepts(impl: str, t: torch.Tensor, n: int, forced: bool) -> bool:
    if impl == CPU:
        return bindings.supports(t, n)
    if impl == TRITON:
        return forced or (t.device.type == "cuda" and t.dtype in NATIVE_DTYPES
                          and _triton_installed())
    return True


def implementation(kernels: str, function: str, t: torch.Tensor, n: int) -> str:
    """The implementation (:data:`CPU`, :data:`TRITON` or :data:`TORCH`) that computes
    ``function`` on ``t`` (samples, or a plain operand read as ``n`` samples) under the
    ``kernels`` option (validated by :class:`fxstab.config.AnalysisConfig`)."""
    have = _IMPLEMENTED[function]
    order = _ORDER[kernels]
    if TRITON not in have and order == (TRITON,):
        order = _ORDER[Kernels.AUTO.value]  # no Triton path for this function: as auto
    forced = order == (TRITON,)
    for impl in order:
        if impl in have and _accepts(impl, t, n, forced):
            return impl
    return TORCH


def native_possible(kernels: str) -> bool:
    """Whether :data:`ATEN_ROUND` may run the fused CPU kernels under this option (they built
    and the option does not ask for the references; ``triton`` means ``auto`` there): the
    arithmetic level's check once per context, before it asks per tensor (CPU fp32/fp64
    samples: :data:`NATIVE_DTYPES`)."""
    return kernels != Kernels.TORCH.value and bindings.available()
