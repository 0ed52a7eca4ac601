"""A GEMM's accumulator on the samples (``fxstab.backend(accumulate=...)``, issue 31).

The operator level runs a modelled GEMM (:data:`~fxstab.rules.lifting.ACCUMULATED_KINDS`) as
:func:`fxstab.numerics.accumulation.emulate_matmul` on the stacked samples: blocks of K summed
exactly, one rounding into the accumulator each; a random rounding draws per sample and
element (CESTAC inside the product), from the call's seed of that operator. A plain operand
broadcasts as one sample: its batch dims are aligned with the stacked operand's logical ones
(the sample dim leads), as ``torch.matmul`` aligns them on one sample.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch

from ..cpu import bindings
from ..numerics.accumulation import emulate_matmul, quantize_operand
from ..numerics.rounding import quantize, round_samples
from ..numerics.randbits import derive_seed
from .lifting import Stacked

__all__ = ["gemm_operands", "accumulable", "accumulated_product", "gemm_model_label",
           "fused_rounder", "samples_rounder", "product_kernel"]


def gemm_operands(a: tuple, kw: dict, kind: str) -> tuple:
    """(left, right, bias) of a modelled GEMM's arguments: right is ``weight.T`` for linear."""
    if kind == "linear":
        w = a[1] if len(a) > 1 else kw["weight"]
        bias = a[2] if len(a) > 2 else kw.get("bias")
        return a[0], w.transpose(-1, -2), bias
    other = a[1] if len(a) > 1 else kw.get("other", kw.get("mat2"))
    return a[0], other, None


def _logical_dim(v: Any) -> int:
    if isinstance(v, Stacked):
        return v.samples.dim() - 1
    return v.dim() if isinstance(v, torch.Tensor) else 0


def accumulable(a: tuple, kw: dict, kind: str) -> bool:
    """Whether the accumulator can be modelled for these arguments: both operands with two
    logical dims or more (a 1-D operand's product keeps the trusted path), no ``out=``."""
    if "out" in kw:
        return False
    try:
        x, w, _ = gemm_operands(a, kw, kind)
    except (IndexError, KeyError):
        return False
    return min(_logical_dim(x), _logical_dim(w)) >= 2


def gemm_model_label(acc: Any, inputs: Any, scaling: str) -> str:
    """How a modelled GEMM ran (coverage): its operands' format and scaling, its accumulator."""
    parts = []
    if inputs is not None:
        parts.append(f"operands {inputs.name} ({scaling} scaling)")
    parts.append(f"accumulator {acc.label}" if acc is not None else "exact sum")
    return ", ".join(parts) + " on the samples"


def fused_rounder(left: torch.Tensor, right: torch.Tensor) -> Any:
    """The fused CPU kernels as ``emulate_matmul``'s rounder for these operands' products
    (``[N, ...]`` samples in fp64, N the leading dim), or None where they do not apply (no C
    compiler, another device): each block's rounding of the output tile is then one kernel
    call instead of tens of tensor passes, with CESTAC's draws across the samples."""
    n = max(left.shape[0], right.shape[0])
    if not (left.is_cpu and bindings.available() and 1 <= n <= bindings.MAX_SAMPLES):
        return None

    def rounder(x: torch.Tensor, fmt: Any, mode: Any, seed: Any) -> torch.Tensor:
        x = x.contiguous()
        if x.dtype != torch.float64 or x.shape[0] != n:
            return quantize(x, fmt, mode, seed=seed)
        r = bindings.rounder(fmt, mode, torch.float64, n)
        return r(x, 0 if seed is None else seed, want_stats=False, in_place=True)[0]
    return rounder


def samples_rounder(n: int) -> Any:
    """The plain-torch reference of :func:`fused_rounder` (any device): each block's
    rounding of the ``[N, ...]`` output tile by ``round_samples``, the same draws."""

    def rounder(x: torch.Tensor, fmt: Any, mode: Any, seed: Any) -> torch.Tensor:
        if x.shape[0] != n:
            return quantize(x, fmt, mode, seed=seed)
        return round_samples(x, fmt, mode, seed=0 if seed is None else seed)
    return rounder


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def product_kernel(kernels: str, t: torch.Tensor, n: int) -> str:
    """Which implementation computes a modelled GEMM of ``n`` samples on ``t``'s device
    under the ``kernels`` option: ``"triton"`` (the Triton kernel of
    :mod:`fxstab.kernels.accumulate`: ``kernels="triton"``, or ``"auto"`` on a CUDA tensor
    where Triton is installed), ``"cpu"`` (blocked fp64 products with each block's rounding
    by the fused C kernel: ``"auto"`` or ``"cpu"`` on a CPU tensor where it builds) or
    ``"torch"`` (the same products, rounded by ``round_samples``). All three draw the same
    bits (``tests/kernels/test_accumulate_kernel.py``)."""
    if kernels == "triton" or (kernels == "auto" and t.is_cuda and _triton_importable()):
        return "triton"
    if kernels in ("auto", "cpu") and t.is_cpu and bindings.available() and \
            1 <= n <= bindings.MAX_SAMPLES:
        return "cpu"
    return "torch"


def accumulated_product(a: tuple, kw: dict, kind: str, acc: Any, seed: int,
                        to_working: Callable[[torch.Tensor], torch.Tensor], inputs: Any = None,
                        scaling: str = "tensor", mode: Any = "random",
                        kernels: str = "auto") -> Stacked:
    """The GEMM's samples with the accumulator ``acc`` (None: the exact sum); plain operands
    enter through ``to_working`` (the working dtype). With ``inputs``, each operand's samples
    are first scaled and rounded into that format (``scaling``; each sample its own scales,
    the analysis's rounding ``mode``: the samples draw their own directions). ``kernels``
    picks the implementation (:func:`product_kernel`)."""
    x, w, bias = gemm_operands(a, kw, kind)
    rank = max(_logical_dim(x), _logical_dim(w))

    def aligned(v: Any) -> torch.Tensor:
        t = v.samples if isinstance(v, Stacked) else to_working(v).unsqueeze(0)
        while t.dim() < rank + 1:  # logical batch dims padded after the sample dim
            t = t.unsqueeze(1)
        return t

    left, right = aligned(x), aligned(w)
    if inputs is not None:
        left = quantize_operand(left, inputs, scaling, mode=mode, seed=derive_seed(seed, 1),
                                batch_dims=1)
        right = quantize_operand(right, inputs, scaling, right=True, mode=mode,
                                 seed=derive_seed(seed, 2), batch_dims=1)
    n = max(left.shape[0], right.shape[0])
    impl = product_kernel(kernels, left, n) if acc is not None else "torch"
    if impl == "triton":
        from ..kernels.accumulate import emulate_matmul_triton

        y = emulate_matmul_triton(left, right, acc, seed=seed, samples=True)
    else:
        rounder = fused_rounder(left, right) if impl == "cpu" else None
        y = emulate_matmul(left, right, acc, seed=seed, rounder=rounder or samples_rounder(n))
    if bias is not None:
        b = bias.samples if isinstance(bias, Stacked) else to_working(bias)
        while isinstance(bias, Stacked) and b.dim() < y.dim():  # the sample dim leads
            b = b.unsqueeze(1)
        y = y + b
    return Stacked(to_working(y))
