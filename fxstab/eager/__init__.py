"""The eager driver: stochastic values that run the arithmetic-level rules primitive by
primitive as the program executes (docs/design.md §3).

:mod:`.stochastic` holds :class:`StochasticTensor`, :func:`stochastic` and :func:`analyze`, and
the registry other value types join through (:func:`register_value_type`); NumPy arrays join
it from :mod:`.arrays` (:class:`StochasticArray`), whose ufuncs (:mod:`.ufuncs`) and array
functions (:mod:`.array_functions`) fill its protocol tables. The core never imports the NumPy
side: this package imports it, so ``fxstab.stochastic(np_array)`` works once ``fxstab`` is
imported.
"""

from .stochastic import (
    AnalysisResult, StochasticTensor, ValueType, analyze, register_value_type, stochastic,
)
from .arrays import StochasticArray, as_numpy_value
from . import array_functions, ufuncs  # noqa: F401 - they fill the arrays' protocol tables

__all__ = ["StochasticTensor", "stochastic", "analyze", "AnalysisResult", "ValueType",
           "register_value_type", "StochasticArray", "as_numpy_value"]
