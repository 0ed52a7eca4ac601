"""The entry points the backend calls, with the ``kernels="auto" | "triton" | "torch"`` option
(:class:`fxstab.config.Kernels`; ``"cpu"``, the fused C kernels of :mod:`fxstab.cpu`, is not
one of this package's).

``auto`` runs the fused Triton kernels on CUDA tensors and the plain-torch references
elsewhere; ``triton`` forces the kernels (on CPU tensors only under the Triton interpreter,
``TRITON_INTERPRET=1`` set before ``fxstab.kernels`` is imported); ``torch`` forces the
references (the unfused side of the ablation). Both paths draw the same Philox bits, so the
rounded samples are identical and the digit statistics agree to a few ulps.

The graph-visible functions are ``torch.library`` custom ops in the ``fxstab`` namespace
(``torch.ops.fxstab.round_digits``, ``torch.ops.fxstab.perturb``), registered on first use
(:func:`register_ops`), never when ``fxstab`` is imported. A node that calls one stays a
single node through torch.compile / AOTAutograd / make_fx.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch

from fxstab.config import Kernels
from fxstab.numerics import randbits
from fxstab.numerics.digits import DigitStats
from fxstab.numerics.formats import FORMATS, Format, FormatLike, get_format
from fxstab.numerics.rounding import Rounding

__all__ = ["round_and_stats", "perturb", "register_ops", "resolve_kernels", "KERNEL_OPTIONS"]

_OPTIONS = (Kernels.AUTO, Kernels.TRITON, Kernels.TORCH)
KERNEL_OPTIONS = Kernels.values(_OPTIONS)
"""The ``kernels`` strings this package takes: ``"auto"``, ``"triton"``, ``"torch"``."""


def resolve_kernels(kernels: "str | Kernels", t: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for tensor ``t`` under option ``kernels`` (validated)."""
    k = Kernels.parse(kernels, _OPTIONS, why="the fused CPU kernels are fxstab.cpu's, chosen by "
                      "fxstab.backend(kernels='cpu'); fxstab.kernels runs the Triton kernels "
                      "or the plain-torch references")
    if k is Kernels.AUTO:
        return "triton" if t.device.type == "cuda" and t.dtype in (torch.float32,
                                                                    torch.float64) else "torch"
    if k is Kernels.TRITON:
        from .round_digits import check_launchable

        check_launchable(t, "kernels='triton'")
    return k.value


def _signed64(seed: int) -> int:
    """Custom-op schemas carry int64: map a seed in [0, 2**64) to a signed value and back."""
    seed &= randbits.M64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _format_from(exp_bits: int, man_bits: int, finite_only: bool) -> Format:
    for f in FORMATS.values():
        if (f.exp_bits, f.man_bits, f.finite_only) == (exp_bits, man_bits, finite_only):
            return f
    return Format(exp_bits, man_bits, finite_only=finite_only)


@functools.lru_cache(maxsize=None)
def register_ops() -> tuple:
    """Register ``fxstab::round_digits`` and ``fxstab::perturb`` (once); returns the ops."""
    from . import gemm_perturb as _perturb
    from . import round_digits as _rd

    @torch.library.custom_op("fxstab::round_digits", mutates_args=())
    def round_digits_op(
        samples: torch.Tensor, exp_bits: int, man_bits: int, finite_only: bool, mode: str,
        seed: int, saturate: bool, confidence: float, zero_threshold: float,
        want_digits: bool, impl: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rounded samples, stats [avg, min, max, zero fraction, non-finite] (float64) and
        per-element digits (empty unless ``want_digits``)."""
        fmt = _format_from(exp_bits, man_bits, finite_only)
        fn = _rd.round_digits if impl == "triton" else _rd.round_digits_torch
        rounded, stats, digits = fn(samples, fmt, mode, seed & randbits.M64, saturate=saturate,
                                    confidence=confidence, zero_threshold=zero_threshold,
                                    want_digits=want_digits)
        if digits is None:
            digits = samples.new_empty((0,))
        return rounded, stats, digits

    @round_digits_op.register_fake
    def _(samples, exp_bits, man_bits, finite_only, mode, seed, saturate, confidence,
          zero_threshold, want_digits, impl):
        digits_shape = samples.shape[1:] if want_digits else (0,)
        return (torch.empty_like(samples), samples.new_empty((5,), dtype=torch.float64),
                samples.new_empty(digits_shape))

    @torch.library.custom_op("fxstab::perturb", mutates_args=())
    def perturb_op(samples: torch.Tensor, eta: float, seed: int, exp_bits: int, man_bits: int,
                   finite_only: bool, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Perturbed samples (onto the grid of the format of ``exp_bits``, ``man_bits``,
        ``finite_only``; none where ``exp_bits`` is 0) and the number of perturbed elements
        (0-dim int64)."""
        fn = _perturb.perturb if impl == "triton" else _perturb.perturb_torch
        grid = _format_from(exp_bits, man_bits, finite_only) if exp_bits else None
        return fn(samples, eta, seed & randbits.M64, grid)

    @perturb_op.register_fake
    def _(samples, eta, seed, exp_bits, man_bits, finite_only, impl):
        return torch.empty_like(samples), samples.new_empty((), dtype=torch.int64)

    return round_digits_op, perturb_op


def _working_dtype(samples: torch.Tensor, fmt: Format) -> torch.dtype:
    if samples.dtype in (torch.float32, torch.float64):
        return samples.dtype
    if samples.dtype in (torch.float16, torch.bfloat16):
        return torch.float32 if fmt.fits_in(torch.float32) else torch.float64
    raise ValueError(f"round_and_stats: samples must be floating (fp16/bf16/fp32/fp64), got "
                     f"{samples.dtype}")


def round_and_stats(
    samples: torch.Tensor,
    fmt: FormatLike,
    mode: Union[str, Rounding],
    seed: int,
    *,
    saturate: bool = False,
    confidence: float = 0.95,
    zero_threshold: float = 0.5,
    kernels: str = "auto",
    want_digits: bool = False,
) -> Union[tuple[torch.Tensor, DigitStats], tuple[torch.Tensor, DigitStats, torch.Tensor]]:
    """Round stacked samples ``[N, ...]`` into ``fmt`` and measure their digits.

    Args:
        samples: Floating tensor with N >= 2 samples on dim 0 (fp16/bf16 are widened to the
            working dtype and the rounded samples returned in the input dtype).
        fmt: Simulated format.
        mode: Rounding mode.
        seed: Seed of the random streams (any integer, taken modulo 2**64).
        saturate: Clamp overflow to ±max.
        confidence: Student-t confidence of the digits.
        zero_threshold: Digits below which a non-zero element is a computational zero.
        kernels: ``"auto"``, ``"triton"`` or ``"torch"`` (module docstring).
        want_digits: Also return the per-element digits.

    Returns:
        ``(rounded, DigitStats)`` or ``(rounded, DigitStats, digits)``. The only host sync is
        one transfer of the five statistics.
    """
    fmt = get_format(fmt)
    mode = Rounding.parse(mode)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    impl = resolve_kernels(kernels, samples)
    wdtype = _working_dtype(samples, fmt)
    x = samples.to(wdtype).contiguous()
    round_op, _ = register_ops()
    rounded, stats, digits = round_op(x, fmt.exp_bits, fmt.man_bits, fmt.finite_only, mode.value,
                                      _signed64(seed), bool(saturate), float(confidence),
                                      float(zero_threshold), bool(want_digits), impl)
    avg, mn, mx, zf, nf = stats.tolist()
    st = DigitStats(avg, mn, mx, samples[0].numel(), zf, int(nf))
    rounded = rounded.to(samples.dtype)
    return (rounded, st, digits) if want_digits else (rounded, st)


def perturb(samples: torch.Tensor, eta: float, seed: int, *,
            kernels: str = "auto", grid: Optional[FormatLike] = None) -> tuple[torch.Tensor, int]:
    """GEMM data-perturbation surrogate on stacked samples ``[N, ...]`` (docs/design.md §4),
    its perturbed values rounded onto ``grid``'s (the format the GEMM rounds into) where given.

    Returns the perturbed samples and the number of perturbed elements (one host transfer).
    Non-floating tensors pass through unchanged.
    """
    if not samples.is_floating_point():
        return samples, 0
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    impl = resolve_kernels(kernels, samples)
    _, perturb_op = register_ops()
    if impl == "triton" and samples.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"kernels='triton': the perturbation kernel takes float32/float64 "
                         f"samples, got {samples.dtype}; use kernels='auto' or 'torch'")
    fmt = get_format(grid) if grid is not None else None
    out, count = perturb_op(samples.contiguous(), float(eta), _signed64(seed),
                            fmt.exp_bits if fmt else 0, fmt.man_bits if fmt else 0,
                            bool(fmt.finite_only) if fmt else False, impl)
    return out, int(count)
