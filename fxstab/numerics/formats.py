"""Floating-point formats that fxstab simulates (docs/design.md §1).

A format is a pair (exp_bits, man_bits); ``man_bits`` excludes the implicit bit, so the
precision is ``p = man_bits + 1`` and the unit roundoff ``u = 2**-p``. Formats are IEEE-like
(the all-ones exponent encodes inf/NaN) except the ``fn`` ("finite, NaN only") variant used by
``fp8_e4m3``: it has no infinities, uses the all-ones exponent for finite values and keeps only
the all-ones pattern as NaN, so its largest value is 448 rather than 240. The OCP MX element
formats ``fp6_e3m2``, ``fp6_e2m3`` and ``fp4_e2m1`` (``all_finite``) have neither: every pattern
is a finite number (largest 28, 7.5 and 6); a rounding past the largest value is a NaN unless
it saturates (the recipes' conversions saturate).
"""

from __future__ import annotations

import math
import operator
import struct
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

__all__ = ["Format", "get_format", "FORMATS", "FormatLike", "working_dtype_for", "torch_dtype_of",
           "WorkingBits", "WORKING_DTYPES", "float_bits"]

_MIN_EXP_BITS, _MAX_EXP_BITS = 2, 11
_MIN_MAN_BITS, _MAX_MAN_BITS = 1, 52


@dataclass(frozen=True)
class Format:
    """A binary floating-point format.

    Args:
        exp_bits: Exponent field width, 2..11.
        man_bits: Stored mantissa bits (without the implicit bit), 1..52.
        name: Display name; defaults to ``e{exp_bits}m{man_bits}``.
        finite_only: ``True`` for the "fn" variant (no infinities, NaN is the all-ones
            pattern); only meaningful for formats that have spare encodings, like fp8_e4m3fn.
        all_finite: ``True`` for formats without inf and NaN encodings (the OCP MX element
            formats fp6 and fp4): the all-ones pattern is the largest value. Implies
            ``finite_only`` (what the rounding kernels read: no infinity).
    """

    exp_bits: int
    man_bits: int
    name: str = ""
    finite_only: bool = False
    all_finite: bool = False

    def __post_init__(self) -> None:
        for field, value, lo, hi in (
            ("exp_bits", self.exp_bits, _MIN_EXP_BITS, _MAX_EXP_BITS),
            ("man_bits", self.man_bits, _MIN_MAN_BITS, _MAX_MAN_BITS),
        ):
            if isinstance(value, bool) or not hasattr(type(value), "__index__"):
                raise ValueError(
                    f"{field} must be an integer in [{lo}, {hi}], got {value!r} "
                    f"({type(value).__name__})"
                )
            value = operator.index(value)  # numpy/torch integers become plain ints
            object.__setattr__(self, field, value)
            if not lo <= value <= hi:
                raise ValueError(f"{field} must be in [{lo}, {hi}], got {value}")
        if not self.name:
            object.__setattr__(self, "name", f"e{self.exp_bits}m{self.man_bits}")
        if self.all_finite:
            object.__setattr__(self, "finite_only", True)

    # -- derived constants -------------------------------------------------------------
    @property
    def precision(self) -> int:
        """Significand bits including the implicit one (p)."""
        return self.man_bits + 1

    @property
    def unit_roundoff(self) -> float:
        """u = 2**-p, the relative error bound of round-to-nearest."""
        return 2.0 ** -self.precision

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        top_field = (1 << self.exp_bits) - 1 if self.finite_only else (1 << self.exp_bits) - 2
        return top_field - self.bias

    @property
    def has_inf(self) -> bool:
        return not self.finite_only

    @property
    def max_normal(self) -> float:
        """Largest finite value."""
        # fn formats give up one mantissa pattern (all ones) at the top exponent for NaN.
        top_ulps = (1 << self.man_bits) - (2 if self.finite_only and not self.all_finite else 1)
        return math.ldexp(1.0 + top_ulps / (1 << self.man_bits), self.emax)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, self.emin - self.man_bits)

    @property
    def digit_cap(self) -> float:
        """Most decimal digits a value can carry, p·log10(2) (7.22 for fp32, 2.41 for bf16)."""
        return self.precision * math.log10(2.0)

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    def fits_in(self, dtype: torch.dtype) -> bool:
        """Whether every value of this format is exactly representable in ``dtype``."""
        d = get_format(dtype)
        return (
            self.man_bits <= d.man_bits
            and self.emin - self.man_bits >= d.emin - d.man_bits
            and self.max_normal <= d.max_normal
        )

    def __str__(self) -> str:
        return self.name


FormatLike = Union[str, Format, tuple, torch.dtype]

FORMATS: dict[str, Format] = {
    "fp64": Format(11, 52, "fp64"),
    "fp32": Format(8, 23, "fp32"),
    "tf32": Format(8, 10, "tf32"),
    "fp16": Format(5, 10, "fp16"),
    "bf16": Format(8, 7, "bf16"),
    "fp8_e5m2": Format(5, 2, "fp8_e5m2"),
    "fp8_e4m3": Format(4, 3, "fp8_e4m3", finite_only=True),
    # OCP MX v1.0 element formats (no inf, no NaN): MXFP6 and MXFP4, NVFP4's values
    "fp6_e3m2": Format(3, 2, "fp6_e3m2", all_finite=True),
    "fp6_e2m3": Format(2, 3, "fp6_e2m3", all_finite=True),
    "fp4_e2m1": Format(2, 1, "fp4_e2m1", all_finite=True),
}
_ALIASES = {
    "float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32",
    "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
    "fp8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2",
    "e3m2": "fp6_e3m2", "e2m3": "fp6_e2m3", "e2m1": "fp4_e2m1", "fp6_e3m2fn": "fp6_e3m2",
    "fp6_e2m3fn": "fp6_e2m3", "fp4_e2m1fn": "fp4_e2m1",
}
_DTYPE_NAMES = {
    torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
}


def get_format(spec: FormatLike) -> Format:
    """Resolve a format from a name, an ``(exp_bits, man_bits)`` pair, a dtype or a Format.

    Raises:
        ValueError: unknown name, or a pair outside 2 <= exp_bits <= 11, 1 <= man_bits <= 52.
    """
    if isinstance(spec, Format):
        return spec
    if isinstance(spec, torch.dtype):
        if spec not in _DTYPE_NAMES:
            raise ValueError(f"no fxstab format for dtype {spec}; floating dtypes: "
                             f"{sorted(str(d) for d in _DTYPE_NAMES)}")
        return FORMATS[_DTYPE_NAMES[spec]]
    if isinstance(spec, str):
        key = spec.strip().lower()
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
        raise ValueError(
            f"unknown format {spec!r}; known: {', '.join(FORMATS)} "
            f"or an (exp_bits, man_bits) pair with 2 <= exp_bits <= 11, 1 <= man_bits <= 52"
        )
    if isinstance(spec, (tuple, list)):
        if len(spec) != 2:
            raise ValueError(f"a format pair is (exp_bits, man_bits), got {spec!r}")
        fmt = Format(*spec)  # validates first: (5.0, 2) must not match fp8_e5m2 by equality
        for known in FORMATS.values():
            if (known.exp_bits, known.man_bits) == (fmt.exp_bits, fmt.man_bits) \
                    and not known.finite_only:
                return known
        return fmt
    raise ValueError(f"cannot make a format from {spec!r} ({type(spec).__name__}); pass a name "
                     f"such as 'bf16', an (exp_bits, man_bits) pair or a Format")


def torch_dtype_of(spec: FormatLike) -> Optional[torch.dtype]:
    """The torch dtype that computes in this format (bf16 -> ``torch.bfloat16``), or None for
    a format torch only stores (fp8) or does not have."""
    fmt = get_format(spec)
    for dtype, name in _DTYPE_NAMES.items():
        if FORMATS[name] == fmt:
            return dtype
    return None


def working_dtype_for(fmt: Format) -> torch.dtype:
    """The dtype the stochastic path computes in for ``fmt`` (docs/design.md §1, "Working dtype").

    fp32 holds 16-bit and 8-bit formats with room to spare (2p+2 <= 24 bits, so rounding an fp32
    result into the format is free of double-rounding artefacts); everything wider (tf32, fp32,
    custom formats with more exponent or mantissa) is computed in fp64.
    """
    if fmt.bits <= 16 and fmt.fits_in(torch.float32):
        return torch.float32
    return torch.float64


class WorkingBits(NamedTuple):
    """The bit layout of a working dtype, as the rounding reads it (every rounding path: the
    references of :mod:`fxstab.numerics.rounding`, the Triton kernel, the CPU kernels)."""

    int_dtype: torch.dtype  # the integer dtype of the same width (``x.view(int_dtype)``)
    man_bits: int
    bias: int  # exponent bias
    exp_ones: int  # the all-ones exponent field (inf/NaN)
    # The largest shift keeps ``1 << shift`` and ``half`` inside the int type; shifts beyond it
    # only occur for |x| < min_subnormal, where any half larger than the significand decides
    # the same (2**29 > 2**24 > an fp32 significand; 2**61 > 2**53 for fp64).
    max_shift: int


WORKING_DTYPES: dict[torch.dtype, WorkingBits] = {
    torch.float32: WorkingBits(torch.int32, 23, 127, 0xFF, 30),
    torch.float64: WorkingBits(torch.int64, 52, 1023, 0x7FF, 62),
}
"""The dtypes the rounding computes in (fp32, fp64) and their bit layouts."""


def float_bits(value: float, dtype: torch.dtype) -> int:
    """Bit pattern (as a Python int) of a finite non-negative float in ``dtype`` (fp32/fp64).

    Plain Python (struct), so no tensor is made and a torch.compile'd caller keeps one graph.
    """
    if dtype == torch.float32:
        return struct.unpack("<i", struct.pack("<f", value))[0]
    return struct.unpack("<q", struct.pack("<d", value))[0]
