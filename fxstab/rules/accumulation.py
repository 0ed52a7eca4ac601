"""A GEMM's accumulator on the samples (``fxstab.backend(accumulate=...)``, issue 31).

The operator level runs a modelled GEMM (:data:`~fxstab.rules.lifting.ACCUMULATED_KINDS`) as
:func:`fxstab.numerics.accumulation.emulate_matmul` on the stacked samples: blocks of K summed
exactly, one rounding into the accumulator each; a random rounding draws per sample and
element (CESTAC inside the product), from the call's seed of that operator. A plain operand
broadcasts as one sample: its batch dims are aligned with the stacked operand's logical ones
(the sample dim leads), as ``torch.matmul`` aligns them on one sample.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..numerics.accumulation import Accumulation, emulate_matmul
from .lifting import Stacked

__all__ = ["gemm_operands", "accumulable", "accumulated_product"]


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


def accumulated_product(a: tuple, kw: dict, kind: str, acc: Accumulation, seed: int,
                        to_working: Callable[[torch.Tensor], torch.Tensor]) -> Stacked:
    """The GEMM's samples with the accumulator ``acc``; plain operands enter through
    ``to_working`` (the working dtype)."""
    x, w, bias = gemm_operands(a, kw, kind)
    rank = max(_logical_dim(x), _logical_dim(w))

    def aligned(v: Any) -> torch.Tensor:
        t = v.samples if isinstance(v, Stacked) else to_working(v).unsqueeze(0)
        while t.dim() < rank + 1:  # logical batch dims padded after the sample dim
            t = t.unsqueeze(1)
        return t

    y = emulate_matmul(aligned(x), aligned(w), acc, seed=seed)
    if bias is not None:
        b = bias.samples if isinstance(bias, Stacked) else to_working(bias)
        while isinstance(bias, Stacked) and b.dim() < y.dim():  # the sample dim leads
            b = b.unsqueeze(1)
        y = y + b
    return Stacked(to_working(y))
