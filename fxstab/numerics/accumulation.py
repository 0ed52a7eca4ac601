"""A GEMM's accumulator as the hardware runs it (docs/design.md §4b): its format, block, promotion
and rounding, and :func:`emulate_matmul`, the deterministic result of that accumulator.

Semantics, exactly. K is walked in increasing order in blocks of ``block`` elements; the
products of a block are summed in fp64 (the working dtype: a block of low-precision products
sums exactly, or to fp64's last bit), then added to the accumulator with **one** rounding into
``format`` in ``rounding`` mode. With ``promote_every=P`` (a multiple of ``block``), after
every P elements the accumulator is added into an fp32 accumulator (round to nearest) and reset
to 0, and the result is the fp32 accumulator after the last (partial) group; without it the
result is the accumulator. The output has the operands' dtype. With ``align`` (an
:class:`Alignment`) a block's products are not summed exactly: each group of them (and the
accumulator) is first aligned to the largest exponent and truncated, as tensor cores do.

Presets (``Accumulation.parse(name)``; sources in ``docs/accumulation.md``):

=================  ===========================================================================
``"fp32"``         nothing emulated: the product as the analysis has always trusted it (the
                   default); ``parse`` returns ``None``
``"fp16"``         fp16 accumulator, blocks of 16 (one HMMA k-step), nearest
``"bf16"``         bf16 accumulator, blocks of 16, nearest
``"fp8-fast"``     Hopper FP8 ``wgmma`` without promotion: e8m13 (a 14-bit significand),
                   blocks of 32 (one instruction's k) aligned with the accumulator to 16
                   bits and truncated, toward zero
``"fp8-promoted"`` the same, promoted into fp32 every 128 elements (DeepSeek-V3, §3.3)
=================  ===========================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .formats import Format, get_format
from .randbits import derive_seed
from .rounding import Rounding, default_seed, quantize

__all__ = ["Accumulation", "Alignment", "PRESETS", "RECIPES", "recipe", "aligned_sum",
           "operand_stats", "emulate_matmul", "AccumulationLike", "SCALINGS",
           "quantize_operand", "matmul_operands", "matmul_result", "block_seeds"]


@dataclass(frozen=True)
class Alignment:
    """How a tensor core lines up a group of products before it sums them (issue 43; the model
    of Fasi, Higham, Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ
    Comput. Sci. 7:e330, 2021, and its FP8 follow-ups).

    The products of ``group`` consecutive elements of K (exact, in fp64) and, with
    ``with_accumulator``, the accumulator's value are aligned to the largest exponent among
    them: with ``2^e`` the largest one's leading bit, each is rounded to a multiple of
    ``2^(e - bits + 1)`` (``bits`` significand bits of the largest kept) in ``rounding``
    (``"zero"``: the hardware's truncation of the bits shifted out; ``"nearest"``), then
    summed exactly. Groups lie inside a block (``block`` a multiple of ``group``); with the
    accumulator in the alignment a group is the block.

    Args:
        group: Products aligned together (>= 1).
        bits: Significand bits kept below the largest exponent (2..50).
        with_accumulator: Whether the accumulator takes part in the alignment.
        rounding: ``"zero"`` (truncation) or ``"nearest"``.
    """

    group: int
    bits: int
    with_accumulator: bool = False
    rounding: Any = Rounding.ZERO

    def __post_init__(self) -> None:
        for name, v, lo, hi in (("group", self.group, 1, 1 << 16), ("bits", self.bits, 2, 52)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"Alignment {name} must be an integer in [{lo}, {hi}], "
                                 f"got {v!r}")
        # a group's aligned values (below 2^(e+1), multiples of 2^(e - bits + 1)) and their
        # sum must stay exact in fp64: bits + log2(group) + 1 <= 53
        if self.bits + (self.group - 1).bit_length() + 1 > 53:
            raise ValueError(f"Alignment bits={self.bits} with group={self.group}: the group's "
                             f"sum would not be exact in fp64; keep bits + log2(group) <= 52")
        if not isinstance(self.with_accumulator, bool):
            raise ValueError(f"Alignment with_accumulator must be True or False, got "
                             f"{self.with_accumulator!r}")
        mode = Rounding.parse(self.rounding)
        if mode not in (Rounding.ZERO, Rounding.NEAREST):
            raise ValueError(f"Alignment rounding must be 'zero' (truncation) or 'nearest', "
                             f"got {self.rounding!r}")
        object.__setattr__(self, "rounding", mode)

    @property
    def label(self) -> str:
        """``a32x14+acc/zero``: group, bits, the accumulator included, rounding."""
        return (f"a{self.group}x{self.bits}{'+acc' if self.with_accumulator else ''}"
                f"/{self.rounding.value}")


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
        align: An :class:`Alignment` of each group's products before they are summed (the
            tensor cores' truncation), or None: each block summed exactly.
    """

    format: Any
    block: int = 1
    promote_every: Optional[int] = None
    rounding: Any = Rounding.NEAREST
    name: str = ""
    align: Optional[Alignment] = None

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
        al = self.align
        if al is not None:
            if not isinstance(al, Alignment):
                raise ValueError(f"Accumulation align must be an fxstab Alignment(group, bits, "
                                 f"with_accumulator, rounding) or None, got {al!r}")
            if self.block % al.group or (al.with_accumulator and al.group != self.block):
                raise ValueError(f"Accumulation align: the group ({al.group}) must divide the "
                                 f"block ({self.block}), and equal it when the accumulator is "
                                 f"aligned with the products")

    @property
    def fmt(self) -> Format:
        return self.format  # type: ignore[return-value]

    @property
    def label(self) -> str:
        """The preset's name, or a spelling of the settings (``e8m13/b32/p128/zero``)."""
        if self.name:
            return self.name
        p = f"/p{self.promote_every}" if self.promote_every else ""
        a = f"/{self.align.label}" if self.align is not None else ""
        return f"{self.fmt.name}/b{self.block}{p}/{self.rounding.value}{a}"

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

FP8_GROUP, FP8_BITS = 32, 16
_E8M13 = (8, 13)  # a 14-bit significand: what emulation studies of H100 wgmma find
# Hopper's FP8 wgmma as the emulation studies describe it: the products of a group and the
# accumulator aligned to the largest exponent, the bits shifted out truncated, the sum
# truncated into the 14-bit accumulator (the group and the bits: docs/accumulation.md, the
# alignment table, fitted to DeepSeek-V3's ~2% at K = 4096)
FP8_ALIGN = Alignment(group=FP8_GROUP, bits=FP8_BITS, with_accumulator=True)
PRESETS: dict[str, Optional[Accumulation]] = {
    "fp32": None,
    "fp16": Accumulation("fp16", block=16, name="fp16"),
    "bf16": Accumulation("bf16", block=16, name="bf16"),
    "fp8-fast": Accumulation(_E8M13, block=FP8_GROUP, rounding="zero", name="fp8-fast",
                             align=FP8_ALIGN),
    "fp8-promoted": Accumulation(_E8M13, block=FP8_GROUP, promote_every=128, rounding="zero",
                                 name="fp8-promoted", align=FP8_ALIGN),
}


# How a low-precision GEMM's operands are scaled before they are rounded into their format:
# one scale per tensor, per row of K (per token / per output channel), DeepSeek-V3's 1x128 tiles
# of the left operand and 128x128 blocks of the right one (fp32 scales: amax / the format's
# largest value), MX's 32 consecutive elements of K sharing a power-of-two (e8m0) scale, or
# NVFP4's 16 consecutive elements of K sharing an e4m3 scale under an fp32 per-tensor scale.
SCALINGS = ("tensor", "row", "block128", "mx32", "nvfp4")

# The recipes users name: element format and scaling (OCP MX v1.0; NVIDIA's NVFP4)
RECIPES: dict[str, tuple[str, str]] = {
    "nvfp4": ("fp4_e2m1", "nvfp4"),
    "mxfp4": ("fp4_e2m1", "mx32"),
    "mxfp6": ("fp6_e3m2", "mx32"),
    "mxfp6_e2m3": ("fp6_e2m3", "mx32"),
    "mxfp8": ("fp8_e4m3", "mx32"),
    "mxfp8_e5m2": ("fp8_e5m2", "mx32"),
}

_E4M3 = get_format("fp8_e4m3")
# MX's shared scale is e8m0: 2^-127 ... 2^127 (0xFF is its NaN, never produced from finite data)
_E8M0_MIN, _E8M0_MAX = -127, 127


def recipe(format: Any, scaling: str = "tensor") -> tuple[Format, str]:
    """``(element format, scaling)`` of an operand spec: a recipe name of :data:`RECIPES`
    (``"nvfp4"``, ``"mxfp4"``...; its own scaling) or a format with ``scaling``."""
    if isinstance(format, str) and format.strip().lower() in RECIPES:
        name, scaling = RECIPES[format.strip().lower()]
        return get_format(name), scaling
    if scaling not in SCALINGS:
        raise ValueError(f"gemm scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    return get_format(format), scaling


def quantize_operand(x: torch.Tensor, format: Any, scaling: str = "tensor", right: bool = False,
                     mode: Any = "nearest", seed: Optional[int] = None,
                     batch_dims: int = 0) -> torch.Tensor:
    """A GEMM operand as a low-precision recipe feeds it: scaled per group, rounded into
    ``format``, scaled back (the same dtype as ``x``).

    ``x`` is the left operand ``[..., M, K]`` or, with ``right``, the right one
    ``[..., K, N]``; groups lie along K (see :data:`SCALINGS`): ``tensor`` one scale for all
    of ``x``; ``row`` one per row of the left operand and per column of the right one;
    ``block128`` 1 x 128 tiles along K of the left operand and 128 x 128 blocks of the right
    one; ``mx32`` (OCP MX v1.0) 32 consecutive elements along K with an e8m0 scale
    2^(floor(log2 amax) - emax), clamped to 2^-127 ... 2^127, the group's largest element
    saturating at the format's largest value; ``nvfp4`` 16 consecutive elements along K with an
    e4m3 scale (amax / (6 s), rounded to nearest) times an fp32 per-tensor scale s = amax of the
    tensor / (448 x 6); a block whose e4m3 scale is 0 becomes zeros. A group of zeros keeps the
    scale 1. ``format`` may be a recipe of :data:`RECIPES` (which sets the scaling). ``mode``
    and ``seed`` round as :func:`fxstab.quantize` does (the scales are always computed as
    above). The first ``batch_dims`` dims are separate tensors (the analysis's samples: each
    has its own per-tensor scale).
    """
    fmt, scaling = recipe(format, scaling)
    t, scale, _ = _scaled(x, fmt, scaling, right, batch_dims)
    # the group's largest element lands on the format's largest value (up to an ulp of the
    # division above it; MX's power-of-two scale: up to twice it): the conversion saturates,
    # as the recipes' scaled casts and the OCP MX conversion do (an overshoot is not a NaN)
    q = quantize(t / scale, fmt, mode, seed=seed, saturate=True) * scale
    # an nvfp4 block whose scale flushed: zeros of the elements' signs
    q = torch.where(scale == 0, torch.copysign(torch.zeros_like(q), t), q)
    return q.transpose(-1, -2) if right else q


def operand_stats(x: torch.Tensor, format: Any, scaling: str = "tensor", right: bool = False,
                  batch_dims: int = 0) -> dict:
    """Per-block statistics of one operand as the recipe scales it and rounds it to nearest
    (the hardware's conversion), as Transformer Engine's precision-debug features log them:
    ``elements`` (non-zero elements of ``x``), ``underflow`` (of them, how many become 0:
    flushed below half the format's smallest subnormal, or in an nvfp4 block whose scale
    flushes), ``saturation`` (how many lie beyond the format's largest value after scaling,
    clamped to it), ``scale_min`` / ``scale_max`` (the smallest and largest scale of a group
    with a non-zero element; NaN without one)."""
    fmt, scaling = recipe(format, scaling)
    t, scale, live = _scaled(x, fmt, scaling, right, batch_dims)
    y = torch.where(scale == 0, torch.zeros_like(t), t / torch.where(scale == 0, 1, scale))
    q = quantize(y, fmt, "nearest", saturate=True)
    nz = (t != 0) & ~t.isnan()
    used = scale[live] if live is not None else scale[nz]
    return {"elements": int(nz.sum()), "underflow": int((nz & (q == 0)).sum()),
            "saturation": int((nz & (y.abs() > fmt.max_normal)).sum()),
            "scale_min": float(used.min()) if used.numel() else math.nan,
            "scale_max": float(used.max()) if used.numel() else math.nan}


def _scaled(x: torch.Tensor, fmt: Format, scaling: str, right: bool,
            batch_dims: int) -> tuple:
    """``(t, scale, live)``: the operand as ``[..., rows, K]``, each element's scale (the
    dequantization factor) and, for block scalings, a mask with one True per group holding a
    non-zero element (its scale an entry of ``scale[live]``; None for ``tensor``/``row``)."""
    if x.dim() < 2:
        raise ValueError(f"quantize_operand needs a matrix operand, got shape {tuple(x.shape)}")
    t = x.transpose(-1, -2) if right else x  # [..., rows, K]
    rows, k = t.shape[-2], t.shape[-1]
    dims = tuple(range(batch_dims, t.dim()))
    if scaling == "tensor":
        amax = t.abs().amax(dim=dims, keepdim=True) if t.numel() else t.new_zeros([1] * t.dim())
        scale = _scale(amax, fmt, pow2=False).expand_as(t)
        return t, scale, None
    if scaling == "row":
        amax = t.abs().amax(-1, keepdim=True) if k else t.new_zeros(*t.shape[:-1], 1)
        return t, _scale(amax, fmt, pow2=False).expand_as(t), None
    g = {"mx32": 32, "nvfp4": 16}.get(scaling, 128)
    gr = 128 if scaling == "block128" and right else 1  # weight blocks are 128 x 128
    pk, pr = -k % g, -rows % gr
    padded = torch.nn.functional.pad(t.abs(), (0, pk, 0, pr))
    blocks = padded.reshape(*t.shape[:-2], (rows + pr) // gr, gr, (k + pk) // g, g)
    amax = blocks.amax(dim=(-3, -1), keepdim=True)
    if scaling == "nvfp4":
        # NVFP4: a second-level fp32 scale per tensor maps the tensor's amax to 448 x 6, so
        # that each block's scale amax / 6 (in units of it) fits e4m3; that e4m3 value (round
        # to nearest, saturating) times the fp32 scale is the block's dequantization factor
        tmax = amax.amax(dim=tuple(range(batch_dims, amax.dim())), keepdim=True) \
            if amax.numel() else amax
        top = fmt.max_normal * _E4M3.max_normal
        glob = torch.where(tmax > 0, quantize(tmax / top, "fp32", "nearest"),
                           torch.ones_like(tmax))
        scale = quantize(amax / (fmt.max_normal * glob), _E4M3, "nearest", saturate=True) * glob
        scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    else:
        scale = _scale(amax, fmt, pow2=scaling == "mx32")
    live = (amax > 0).expand(*amax.shape[:-1], g)
    live = (live & (torch.arange(g, device=t.device) == 0)).expand_as(blocks)
    live = live.reshape(padded.shape)[..., :rows, :k]
    scale = scale.expand_as(blocks).reshape(padded.shape)[..., :rows, :k]
    if gr > 1:  # one entry per 128 x 128 block: its first row
        first = torch.arange(rows, device=t.device) % gr == 0
        live = live & first.unsqueeze(-1)
    return t, scale, live


def _scale(amax: torch.Tensor, fmt: Format, pow2: bool) -> torch.Tensor:
    if pow2:  # MX: the shared exponent floor(log2 amax) - emax of the element format, in e8m0
        # frexp: amax = f 2^E with f in [0.5, 1), so floor(log2 amax) = E - 1 exactly
        e = torch.frexp(amax).exponent.to(amax.dtype) - 1 - fmt.emax
        s = torch.exp2(e.clamp(_E8M0_MIN, _E8M0_MAX))
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
        inputs: The operands' format (``"fp8_e4m3"``...) or a recipe of :data:`RECIPES`
            (``"nvfp4"``, ``"mxfp4"``...): each is scaled as ``scaling`` (or the recipe) says
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
        if acc.align is not None:  # the block's groups aligned (with the accumulator)
            run = aligned_sum(a[..., start:stop], b[..., start:stop, :], acc.align, run)
        else:
            part = a[..., start:stop] @ b[..., start:stop, :]  # the block's products, in fp64
            run = part if run is None else run + part
        run = rounder(run, acc.fmt, mode, seeds[i])
        if acc.promote_every and (stop % acc.promote_every == 0 or stop == k):
            total = run if total is None else total + run
            total = rounder(total, fp32, Rounding.NEAREST, None)
            run = None
    return total if acc.promote_every else run


# elements of one aligned group's products held at once (a chunk of output rows)
_ALIGN_CHUNK = 1 << 22


def aligned_sum(a: torch.Tensor, b: torch.Tensor, align: Alignment,
                acc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``acc + a @ b`` of fp64 operands ``[..., M, g] @ [..., g, N]`` with the products
    aligned as ``align`` says (:class:`Alignment`): per output element, each group of
    ``align.group`` products (and ``acc``, with ``align.with_accumulator``) rounded to a
    multiple of ``2^(e - bits + 1)``, ``2^e`` the leading bit of the largest of them, and
    summed exactly; the groups' sums added to ``acc`` in order (fp64). ``acc`` None: 0."""
    k = a.shape[-1]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m, n = a.shape[-2], b.shape[-1]
    out = torch.zeros(*batch, m, n, dtype=torch.float64, device=a.device) if acc is None \
        else acc.expand(*batch, m, n).clone()
    per_row = max(1, math.prod(batch) * min(k, align.group) * n)
    step = max(1, _ALIGN_CHUNK // per_row)
    trunc = align.rounding is Rounding.ZERO
    for r0 in range(0, m, step):
        rows = slice(r0, min(r0 + step, m))
        part = out[..., rows, :]
        for g0 in range(0, k, align.group):
            g1 = min(g0 + align.group, k)
            p = a[..., rows, g0:g1].unsqueeze(-1) * b[..., g0:g1, :].unsqueeze(-3)  # exact
            big = p.abs().amax(-2)
            if align.with_accumulator:
                big = torch.maximum(big, part.abs())
            # 2^e the largest one's leading bit: big = f 2^(e+1), f in [0.5, 1); the quantum
            # 2^(e - bits + 1), kept in fp64's range (a zero group keeps any quantum)
            e = torch.frexp(big).exponent.to(torch.float64) - align.bits
            q = torch.exp2(e.clamp_(min=-1074)).unsqueeze(-2)
            p = torch.trunc(p / q) if trunc else torch.round(p / q)
            s = (p * q).sum(-2)
            if align.with_accumulator:
                a_q = q.squeeze(-2)
                part = (torch.trunc(part / a_q) if trunc else torch.round(part / a_q)) * a_q + s
            else:
                part = part + s
        out[..., rows, :] = part
    return out
