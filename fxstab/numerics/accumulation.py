"""A GEMM's accumulator as the hardware runs it (DESIGN.md §4b): its format, block, promotion and
rounding, and :func:`emulate_matmul`, the deterministic result of that accumulator.

Semantics, exactly. K is walked in increasing order in blocks of ``block`` elements; the
products of a block are summed in fp64 (the working dtype: a block of low-precision products
sums exactly, or to fp64's last bit), then added to the accumulator with **one** rounding into
``format`` in ``rounding`` mode. With ``promote_every=P`` (a multiple of ``block``), after
every P elements the accumulator is added into an fp32 accumulator (round to nearest) and reset
to 0, and the result is the fp32 accumulator after the last (partial) group; without it the
result is the accumulator. The output has the operands' dtype.

Presets (``Accumulation.parse(name)``; sources in ``docs/accumulation.md``):

=================  ===========================================================================
``"fp32"``         nothing emulated: the product as the analysis has always trusted it (the
                   default); ``parse`` returns ``None``
``"fp16"``         fp16 accumulator, blocks of 16 (one HMMA k-step), nearest
``"bf16"``         bf16 accumulator, blocks of 16, nearest
``"fp8-fast"``     Hopper FP8 ``wgmma`` without promotion: e8m13 (a 14-bit significand),
                   blocks of 32 (one instruction's k), toward zero
``"fp8-promoted"`` the same, promoted into fp32 every 128 elements (DeepSeek-V3, §3.3)
=================  ===========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .formats import Format, get_format
from .randbits import derive_seed
from .rounding import Rounding, default_seed, quantize

__all__ = ["Accumulation", "PRESETS", "emulate_matmul", "AccumulationLike", "SCALINGS",
           "quantize_operand", "matmul_operands", "matmul_result", "block_seeds"]


@dataclass(frozen=True)
class Accumulation:
    """The accumulator of a GEMM (see the module docstring for the exact semantics).

    Args:
        format: The accumulator's format (a name, ``(exp_bits, man_bits)`` or a Format).
        block: Products summed exactly before each rounding into the accumulator (>= 1).
        promote_every: Elements of K after which the accumulator is added into an fp32
            accumulator and reset (a multiple of ``block``); ``None``: never.
        rounding: The accumulator's rounding: ``nearest``, ``zero``, ``up``, ``down``,
            ``random`` or ``stochastic`` (the last two draw from a seed).
        name: The preset's name, if it is one (reports, metadata).
    """

    format: Any
    block: int = 1
    promote_every: Optional[int] = None
    rounding: Any = Rounding.NEAREST
    name: str = ""

    def __post_init__(self) -> None:
        try:
            fmt = get_format(self.format)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"Accumulation format: {exc}") from None
        object.__setattr__(self, "format", fmt)
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"Accumulation block must be an integer >= 1, got {self.block!r}")
        p = self.promote_every
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, int) or p < 1 or p % self.block:
                raise ValueError(f"Accumulation promote_every must be None or a positive "
                                 f"multiple of block={self.block}, got {p!r}")
        try:
            object.__setattr__(self, "rounding", Rounding.parse(self.rounding))
        except ValueError as exc:
            raise ValueError(f"Accumulation rounding: {exc}") from None

    @property
    def fmt(self) -> Format:
        return self.format  # type: ignore[return-value]

    @property
    def label(self) -> str:
        """The preset's name, or a spelling of the settings (``e8m13/b32/p128/zero``)."""
        if self.name:
            return self.name
        p = f"/p{self.promote_every}" if self.promote_every else ""
        return f"{self.fmt.name}/b{self.block}{p}/{self.rounding.value}"

    @classmethod
    def parse(cls, spec: "AccumulationLike") -> Optional["Accumulation"]:
        """An :class:`Accumulation` from a preset name, an Accumulation or ``None``; ``"fp32"``
        and ``None`` are the trusted product (nothing emulated): ``None``."""
        if spec is None or isinstance(spec, Accumulation):
            return spec
        if isinstance(spec, str):
            key = spec.strip().lower()
            if key in PRESETS:
                return PRESETS[key]
            raise ValueError(f"unknown accumulation {spec!r}; use one of "
                             f"{', '.join(sorted(PRESETS))} or fxstab.Accumulation(format, "
                             f"block, promote_every, rounding)")
        raise ValueError(f"accumulation must be a preset name, an fxstab.Accumulation or None, "
                         f"got {type(spec).__name__}")


AccumulationLike = Union[str, Accumulation, None]

_E8M13 = (8, 13)  # a 14-bit significand: what emulation studies of H100 wgmma find
PRESETS: dict[str, Optional[Accumulation]] = {
    "fp32": None,
    "fp16": Accumulation("fp16", block=16, name="fp16"),
    "bf16": Accumulation("bf16", block=16, name="bf16"),
    "fp8-fast": Accumulation(_E8M13, block=32, rounding="zero", name="fp8-fast"),
    "fp8-promoted": Accumulation(_E8M13, block=32, promote_every=128, rounding="zero",
                                 name="fp8-promoted"),
}


# How a low-precision GEMM's operands are scaled before they are rounded into their format:
# one scale per tensor, per row of K (per token / per output channel), DeepSeek-V3's 1x128 tiles
# of the left operand and 128x128 blocks of the right one (fp32 scales: amax / the format's
# largest value), or MX's 32 consecutive elements of K sharing a power-of-two scale.
SCALINGS = ("tensor", "row", "block128", "mx32")


def quantize_operand(x: torch.Tensor, format: Any, scaling: str = "tensor", right: bool = False,
                     mode: Any = "nearest", seed: Optional[int] = None,
                     batch_dims: int = 0) -> torch.Tensor:
    """A GEMM operand as a low-precision recipe feeds it: scaled per group, rounded into
    ``format``, scaled back (the same dtype as ``x``).

    ``x`` is the left operand ``[..., M, K]`` or, with ``right``, the right one
    ``[..., K, N]``; groups lie along K (see :data:`SCALINGS`): ``tensor`` one scale for all
    of ``x``; ``row`` one per row of the left operand and per column of the right one;
    ``block128`` 1 x 128 tiles along K of the left operand and 128 x 128 blocks of the right
    one; ``mx32`` 32 consecutive elements along K with a power-of-two scale
    (2^(floor(log2 amax) - emax), the group's largest element saturating at the format's
    largest value). A group of zeros keeps the scale 1. ``mode`` and ``seed`` round as
    :func:`fxstab.quantize` does. The first ``batch_dims`` dims are separate tensors (the
    analysis's samples: each has its own per-tensor scale).
    """
    fmt = get_format(format)
    if scaling not in SCALINGS:
        raise ValueError(f"gemm scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    if x.dim() < 2:
        raise ValueError(f"quantize_operand needs a matrix operand, got shape {tuple(x.shape)}")
    t = x.transpose(-1, -2) if right else x  # [..., rows, K]
    rows, k = t.shape[-2], t.shape[-1]
    if scaling == "tensor":
        dims = tuple(range(batch_dims, t.dim()))
        scale = _scale(t.abs().amax(dim=dims, keepdim=True), fmt, pow2=False)
    elif scaling == "row":
        scale = _scale(t.abs().amax(-1, keepdim=True), fmt, pow2=False)
    else:
        g = 32 if scaling == "mx32" else 128
        gr = 128 if scaling == "block128" and right else 1  # weight blocks are 128 x 128
        pk, pr = -k % g, -rows % gr
        padded = torch.nn.functional.pad(t.abs(), (0, pk, 0, pr))
        blocks = padded.reshape(*t.shape[:-2], (rows + pr) // gr, gr, (k + pk) // g, g)
        amax = blocks.amax(dim=(-3, -1), keepdim=True)
        scale = _scale(amax, fmt, pow2=scaling == "mx32").expand_as(blocks)
        scale = scale.reshape(padded.shape)[..., :rows, :k]
    # the group's largest element lands on the format's largest value (up to an ulp of the
    # division above it; MX's power-of-two scale: up to twice it): the conversion saturates,
    # as the recipes' scaled casts and the OCP MX conversion do (an overshoot is not a NaN)
    q = quantize(t / scale, fmt, mode, seed=seed, saturate=True) * scale
    return q.transpose(-1, -2) if right else q


def _scale(amax: torch.Tensor, fmt: Format, pow2: bool) -> torch.Tensor:
    if pow2:  # MX: the shared exponent floor(log2 amax) - emax of the element format
        e = torch.floor(torch.log2(amax.clamp_min(torch.finfo(amax.dtype).tiny))) - fmt.emax
        s = torch.exp2(e)
    else:
        s = amax / fmt.max_normal
    return torch.where(amax > 0, s, torch.ones_like(s))


def emulate_matmul(a: torch.Tensor, b: torch.Tensor, accumulate: AccumulationLike = "fp32",
                   seed: Optional[int] = None, inputs: Any = None,
                   scaling: str = "tensor", rounder: Any = None) -> torch.Tensor:
    """``a @ b`` as a GEMM with the accumulator ``accumulate`` computes it.

    Broadcasts like :func:`torch.matmul` (1-D operands included). Deterministic for
    ``nearest``, ``zero``, ``up`` and ``down``; ``random`` and ``stochastic`` draw from
    ``seed`` (``None``: one from torch's generator), each rounding of each output element its
    own draw. ``"fp32"`` (or ``None``) is the trusted product: ``a @ b`` computed in fp64 and
    returned in the operands' dtype.

    Args:
        a, b: Floating operands (their result dtype is the output's).
        accumulate: A preset name or an :class:`Accumulation`.
        seed: Seed of the random roundings.
        inputs: The operands' format (``"fp8_e4m3"``...): each is scaled as ``scaling`` says
            and rounded into it to nearest first (:func:`quantize_operand`); None: as given.
        scaling: One of :data:`SCALINGS`.
        rounder: ``rounder(x, format, mode, seed) -> x rounded``, instead of
            :func:`fxstab.quantize` (the analysis passes its fused kernels, which round
            stacked samples with CESTAC's draws across them); the default is the reference.

    The Triton kernel ``fxstab.kernels.accumulate.emulate_matmul_triton`` computes the same
    bits on a GPU (one kernel for all blocks, the samples as a batch dimension).
    """
    acc = Accumulation.parse(accumulate)
    a64, b64, squeeze, out_dtype = matmul_operands(a, b, inputs, scaling)
    if acc is None or a64.shape[-1] == 0:
        out = a64 @ b64
    else:
        out = _accumulate(a64, b64, acc, block_seeds(acc, seed, a64.shape[-1]),
                          rounder or _quantize)
    return matmul_result(out, squeeze, out_dtype)


def matmul_operands(a: torch.Tensor, b: torch.Tensor, inputs: Any = None,
                    scaling: str = "tensor") -> tuple:
    """The operands of :func:`emulate_matmul`, validated: ``(a64, b64, squeeze, out_dtype)``,
    fp64 matrices ``[..., M, K]`` and ``[..., K, N]`` (a 1-D operand made a matrix, its dim
    in ``squeeze``; with ``inputs``, scaled and rounded into that format), and the output's
    dtype (:func:`matmul_result` undoes the rest)."""
    for t, what in ((a, "a"), (b, "b")):
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point()):
            raise TypeError(f"emulate_matmul: {what} must be a floating tensor, got "
                            f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")
        if t.dim() == 0:
            raise ValueError(f"emulate_matmul: {what} must have at least one dimension")
    out_dtype = torch.result_type(a, b)
    squeeze = []
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    if a64.dim() == 1:
        a64, squeeze = a64.unsqueeze(0), squeeze + [-2]
    if b64.dim() == 1:
        b64, squeeze = b64.unsqueeze(-1), squeeze + [-1]
    k = a64.shape[-1]
    if b64.shape[-2] != k:
        raise ValueError(f"emulate_matmul: inner dimensions differ: a has {k}, b has "
                         f"{b64.shape[-2]} (a {tuple(a.shape)}, b {tuple(b.shape)})")
    if inputs is not None:
        a64 = quantize_operand(a64, inputs, scaling)
        b64 = quantize_operand(b64, inputs, scaling, right=True)
    return a64, b64, squeeze, out_dtype


def matmul_result(out: torch.Tensor, squeeze: list, out_dtype: torch.dtype) -> torch.Tensor:
    """The fp64 product of :func:`matmul_operands`' operands as :func:`emulate_matmul` returns
    it: the 1-D operands' dims squeezed, in the operands' dtype."""
    for d in sorted(squeeze):
        out = out.squeeze(d)
    return out.to(out_dtype)


def block_seeds(acc: Accumulation, seed: Optional[int], k: int) -> list:
    """The seed of each block's rounding into the accumulator over K = ``k``:
    ``derive_seed(default_seed(seed), i)`` for block ``i`` in the random modes (so ``None``
    draws the base seed from torch's generator), ``None`` in the others."""
    if acc.rounding not in (Rounding.RANDOM, Rounding.STOCHASTIC):
        return [None] * -(-k // acc.block)
    base = default_seed(seed)
    return [derive_seed(base, i) for i in range(-(-k // acc.block))]


def _quantize(x: torch.Tensor, fmt: Format, mode: Rounding, seed: Optional[int]) -> torch.Tensor:
    return quantize(x, fmt, mode, seed=seed)


def _accumulate(a: torch.Tensor, b: torch.Tensor, acc: Accumulation, seeds: list,
                rounder: Any) -> torch.Tensor:
    """The blocked accumulation of fp64 operands ``[..., M, K] @ [..., K, N]``, in fp64
    (``seeds``: one per block, :func:`block_seeds`)."""
    k = a.shape[-1]
    mode = acc.rounding
    fp32 = get_format("fp32")
    total: Optional[torch.Tensor] = None  # the fp32 accumulator (promotion)
    run: Optional[torch.Tensor] = None  # the accumulator in acc.format
    for i, start in enumerate(range(0, k, acc.block)):
        stop = min(start + acc.block, k)
        part = a[..., start:stop] @ b[..., start:stop, :]  # the block's products, in fp64
        run = part if run is None else run + part
        run = rounder(run, acc.fmt, mode, seeds[i])
        if acc.promote_every and (stop % acc.promote_every == 0 or stop == k):
            total = run if total is None else total + run
            total = rounder(total, fp32, Rounding.NEAREST, None)
            run = None
    return total if acc.promote_every else run
