"""The arithmetic level's GEMMs of samples and a low-precision weight in the format's own GEMM
kernels (issue 52, item 3; the operator level's is ``rules/op/gemm.py``'s ``lowp``).

A bf16 model analysed in bf16 runs its linears as ``addmm(b, x, t(W))`` or ``mm(x, t(W))`` of
the samples ``x`` and plain bf16 operands; the samples' product of the working dtype (fp32) is
the fp32 sum of exact bf16 products, which :func:`fxstab.numerics.lowp_gemm.linear` computes in
bf16 GEMMs (their fp32 accumulator's residual on the CPU, ``mm(..., out_dtype=float32)`` on
CUDA) where the platform check passed and the shapes make it pay. The plain operands are read
as the program holds them, before the arithmetic level's conversion into the working dtype.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ... import executors
from ...numerics import lowp_gemm
from ..lifting import Stacked
from .context import AtenContext

__all__ = ["lowp_operands", "lowp_product"]

# primitive -> (the samples' position, the weight's, the bias's or None): F.linear's operands
_FORMS = {torch.ops.aten.mm.default: (0, 1, None),
          torch.ops.aten.addmm.default: (1, 2, 0)}


def lowp_operands(op: Any, args: tuple, kwargs: dict, original: tuple,
                  ctx: AtenContext) -> Optional[tuple]:
    """``(x, w, b)`` of a GEMM that the format's GEMMs compute (``w`` as F.linear reads it, in
    the program's dtype; ``b`` or None), or None: another primitive, a scaled ``addmm``, an
    operand not of the format's dtype, the samples not in fp32, a shape the path does not
    take here (:func:`fxstab.numerics.lowp_gemm.eligible`)."""
    form = _FORMS.get(op)
    cfg = ctx.config
    if form is None or not cfg.lowp_gemm or kwargs.get("beta", 1) != 1 or \
            kwargs.get("alpha", 1) != 1 or len(original) != len(args) or \
            ctx.working_dtype != torch.float32:
        return None
    fmt = cfg.format.name
    dtype = lowp_gemm.LOWP_DTYPES.get(fmt)
    xi, wi, bi = form
    x, mat2 = args[xi], original[wi]
    bias = original[bi] if bi is not None else None
    if type(x) is not Stacked or x.samples.dtype != torch.float32 or \
            not isinstance(mat2, torch.Tensor) or mat2.dtype != dtype or mat2.dim() != 2 or \
            (bias is not None and (not isinstance(bias, torch.Tensor) or bias.dtype != dtype
                                   or bias.dim() != 1)):
        return None
    w = mat2.t()
    if not lowp_gemm.eligible(w, fmt):
        return None
    return x, w, bias


def lowp_product(ctx: AtenContext, raw: list, args: tuple, kwargs: dict) -> torch.Tensor:
    """The product of :func:`lowp_operands`' ``(x, w, b)`` on the samples, fp32 (a step: the
    path decides at run time), or the working-dtype GEMM where the path declines."""
    x, w, b = args
    s = x.samples
    out = ctx.kernel(executors.LOWP_CONVERT, s)(s, w, b, ctx.config.format.name)
    if out is None:
        out = torch.nn.functional.linear(s, w.to(s.dtype), None if b is None else b.to(s.dtype))
    return out
