"""Floating-point numerics, below everything else: what a format is, how a value is rounded into
it, where the random bits come from and how many digits N samples share.

- :mod:`~fxstab.numerics.formats`: :class:`Format`, :func:`get_format`, the working dtypes'
  bit layouts (:data:`WORKING_DTYPES`, :func:`float_bits`);
- :mod:`~fxstab.numerics.randbits`: the Philox streams every rounding path draws;
- :mod:`~fxstab.numerics.rounding`: :class:`Rounding`, :func:`quantize`, :func:`round_samples`
  (the plain-torch references of the kernels);
- :mod:`~fxstab.numerics.digits`: CESTAC digits and their statistics;
- :mod:`~fxstab.numerics.surrogate`: the GEMM data-perturbation surrogate;
- :mod:`~fxstab.numerics.accumulation`: a GEMM's accumulator (:class:`Accumulation`) and
  :func:`emulate_matmul`.
"""

from . import accumulation, digits, formats, randbits, rounding, surrogate
from .accumulation import Accumulation, emulate_matmul
from .formats import FORMATS, WORKING_DTYPES, Format, FormatLike, float_bits, get_format
from .rounding import Rounding, quantize, round_samples

__all__ = ["formats", "randbits", "rounding", "digits", "surrogate", "accumulation",
           "Accumulation", "emulate_matmul", "Format", "FormatLike",
           "FORMATS", "get_format", "WORKING_DTYPES", "float_bits", "Rounding", "quantize",
           "round_samples"]
