"""Which implementation computes each of fxstab's kernels, and the implementations themselves:
the one home of the kernel choice (the ``kernels`` option, :class:`fxstab.config.Kernels`), as
lightning-thunder's executors pair an operation with a checker and an implementation, and the
chosen implementation is what runs.

A function (:data:`ROUND`, :data:`PERTURB`...) has implementations, one per name (:data:`CPU`:
the fused C kernels of :mod:`fxstab.cpu.bindings`; :data:`TRITON`: the Triton kernels of
:mod:`fxstab.kernels`; :data:`TORCH`: the plain-torch references), each registered once with
:func:`implements` as a callable and its checker (``checker(t, n)``: whether it computes the
function on tensor ``t`` read as ``n`` samples). :func:`choose` returns the implementation to
call: the option orders the names, and the first whose checker accepts the tensor is chosen
(the reference where none does):

==========  ===============================
``auto``    CPU, then TRITON, then TORCH
``cpu``     CPU, then TORCH
``triton``  TRITON (forced: its launcher says why it cannot run)
``torch``   TORCH
==========  ===============================

A function without a Triton implementation takes ``triton`` as ``auto`` (the arithmetic
level's). A fused step (:data:`PREPARED_ROUND`, :data:`ROUND_PERTURB`; the arithmetic level's
:data:`ATEN_PREPARED`, :data:`ATEN_BINARY`) follows the choice of the function it fuses
(:data:`ROUND`, :data:`ATEN_ROUND`): it is that implementation's own, or None where that one
has none (the steps then run apart). Every implementation of a function draws the same Philox
bits: the rounded samples are the same, the statistics agree to the last few ulps.

The functions, and who calls them:

* :data:`ROUND`: N samples rounded into a format and their statistics row, in one pass (the
  operator level's outputs, :mod:`fxstab.rules.op.tracer`); :data:`PREPARED_ROUND`, its kernel
  with the settings bound once; :data:`ROUND_PERTURB`, the rounding and the consumer GEMM's
  surrogate in one pass;
* :data:`PERTURB`: the GEMM data-perturbation surrogate (operator level);
* :data:`ACCUMULATE`: a modelled GEMM's accumulator (``accumulate=``,
  :mod:`fxstab.rules.accumulation`);
* :data:`LOWP_CONVERT`: the samples' linear in the format's own GEMM, with the conversions
  around it (:mod:`fxstab.numerics.lowp_gemm`);
* the arithmetic level's (:mod:`fxstab.rules.aten`): :data:`ATEN_ROUND` (round and measure a
  primitive's result, registered in :mod:`fxstab.rules.aten.rounding`, whose implementations
  read the context) with its fused steps :data:`ATEN_PREPARED` (its kernel bound to one output
  of a sampled graph) and :data:`ATEN_BINARY` (an add, sub, mul or div computed inside its
  rounding), registered there too; :data:`ATEN_DIGITS` (per-element digits of samples,
  registered in :mod:`fxstab.rules.aten.measure`), :data:`ATEN_PERTURB`, :data:`ROUND_ONLY`
  (rounding without statistics), :data:`RANDOM_UP` (the directions of ``random`` rounding) and
  :data:`ATEN_LOOKUP` (unary math on bf16 values by a table of the op's own results).

Adding a kernel is one entry: ``@implements(FUNCTION, NAME, checker)`` on the callable, beside
its code (the adapters of the kernels below this layer are here; the arithmetic level's, which
read its context, are in :mod:`fxstab.rules.aten`). No caller names an implementation:
``tests/test_executors.py`` checks that.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .config import Kernels
from .cpu import bindings
from .numerics import lowp_gemm, randbits
from .numerics.accumulation import emulate_matmul
from .numerics.digits import digits_cap, extra_stats, stats_vector, student_t, underflow_count
from .numerics.formats import get_format
from .numerics.rounding import Rounding, quantize, round_samples, sample_draws
from .numerics.surrogate import perturb_samples

__all__ = ["CPU", "TRITON", "TORCH", "ROUND", "PREPARED_ROUND", "ROUND_PERTURB", "PERTURB",
           "ACCUMULATE", "LOWP_CONVERT", "ATEN_ROUND", "ATEN_DIGITS", "ATEN_PERTURB",
           "ATEN_PREPARED", "ATEN_BINARY", "ATEN_LOOKUP", "ROUND_ONLY", "RANDOM_UP",
           "Implementation", "implements", "choose", "reference",
           "native_possible", "NATIVE_DTYPES", "fused_cpu", "fused_gpu", "anywhere",
           "fused_rounder", "samples_rounder"]

CPU, TRITON, TORCH = "cpu", "triton", "torch"
ROUND, PERTURB, ACCUMULATE = "round", "perturb", "accumulate"
PREPARED_ROUND, ROUND_PERTURB = "prepared_round", "round_perturb"  # ROUND's fused steps
LOWP_CONVERT = "lowp_convert"  # the bf16 GEMM path's conversions (split, join)
ATEN_ROUND, ATEN_DIGITS, ATEN_PERTURB = "aten_round", "aten_digits", "aten_perturb"
ATEN_PREPARED, ATEN_BINARY = "aten_prepared", "aten_binary"  # ATEN_ROUND's fused steps
ATEN_LOOKUP = "aten_lookup"
ROUND_ONLY, RANDOM_UP = "round_only", "random_up"

# the dtypes the fused kernels (C and Triton) read and write
NATIVE_DTYPES = (torch.float32, torch.float64)

_ORDER = {Kernels.AUTO.value: (CPU, TRITON, TORCH), Kernels.CPU.value: (CPU, TORCH),
          Kernels.TRITON.value: (TRITON,), Kernels.TORCH.value: (TORCH,)}
# a fused step -> the function whose choice it follows
_FOLLOWS = {PREPARED_ROUND: ROUND, ROUND_PERTURB: ROUND, ATEN_PREPARED: ATEN_ROUND,
            ATEN_BINARY: ATEN_ROUND}


@dataclass(frozen=True)
class Implementation:
    """One implementation of a function: calling it runs ``fn``; ``checker(t, n)`` says
    whether it computes the function on ``t`` (read as ``n`` samples); ``fused``: a fused
    kernel (C or Triton), not the plain-torch reference."""

    function: str
    name: str
    checker: Callable[[torch.Tensor, int], bool]
    fn: Callable
    fused: bool

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


# function -> implementation name -> its entry (filled by @implements)
_TABLE: dict[str, dict[str, Implementation]] = {}


def implements(function: str, name: str,
               checker: Optional[Callable[[torch.Tensor, int], bool]] = None) -> Callable:
    """Register the decorated callable as the ``name`` implementation (:data:`CPU`,
    :data:`TRITON`, :data:`TORCH`) of ``function``, taken where ``checker(t, n)`` is true
    (default: everywhere, as a reference is). A second entry for the same pair replaces the
    first."""
    if name not in (CPU, TRITON, TORCH):
        raise ValueError(f"an implementation is named {CPU!r}, {TRITON!r} or {TORCH!r} (the "
                         f"kernels option orders them); got {name!r}")

    def register(fn: Callable) -> Callable:
        _TABLE.setdefault(function, {})[name] = Implementation(
            function, name, checker or anywhere, fn, name != TORCH)
        return fn

    return register


def choose(kernels: str, function: str, t: torch.Tensor, n: int) -> Optional[Implementation]:
    """The implementation that computes ``function`` on ``t`` (samples, or a plain operand read
    as ``n`` samples) under the ``kernels`` option (validated by
    :class:`fxstab.config.AnalysisConfig`). None only for a fused step the chosen
    implementation of its function does not have."""
    lead = _FOLLOWS.get(function)
    if lead is not None:
        return _table(function).get(choose(kernels, lead, t, n).name)
    have = _table(function)
    try:
        order = _ORDER[kernels]
    except KeyError:
        raise ValueError(f"kernels must be one of {', '.join(map(repr, _ORDER))}; got "
                         f"{kernels!r}") from None
    if len(order) == 1 and order[0] in have:  # the option names it: forced
        return have[order[0]]
    if TRITON not in have and order == (TRITON,):
        order = _ORDER[Kernels.AUTO.value]  # no Triton path for this function: as auto
    for name in order:
        impl = have.get(name)
        if impl is not None and impl.checker(t, n):
            return impl
    return have[TORCH]


def reference(function: str) -> Implementation:
    """The plain-torch reference of ``function`` (what every other implementation matches)."""
    return _table(function)[TORCH]


def _table(function: str) -> dict[str, Implementation]:
    have = _TABLE.get(function)
    if have is None:
        raise KeyError(f"no implementation of {function!r} is registered (known: "
                       f"{', '.join(sorted(_TABLE))}); register one with "
                       f"@fxstab.executors.implements({function!r}, ...)")
    return have


def native_possible(kernels: str) -> bool:
    """Whether the arithmetic level may run the fused CPU kernels under this option (they built
    and the option does not ask for the references; ``triton`` means ``auto`` there): its
    check once per context, before it asks :func:`choose` per tensor."""
    return kernels != Kernels.TORCH.value and bindings.available()


# -- checkers -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def anywhere(t: torch.Tensor, n: int) -> bool:
    """A reference's checker: any tensor."""
    return True


def fused_cpu(t: torch.Tensor, n: int) -> bool:
    """The fused C kernels: CPU fp32/fp64 tensors, at most ``MAX_SAMPLES`` samples, where the C
    compiler built them."""
    return bindings.supports(t, n)


def fused_gpu(t: torch.Tensor, n: int) -> bool:
    """The Triton kernels (unforced): CUDA fp32/fp64 tensors where Triton is installed."""
    return t.device.type == "cuda" and t.dtype in NATIVE_DTYPES and _triton_installed()


def _accumulator_cpu(t: torch.Tensor, n: int) -> bool:
    # the products are summed in fp64 whatever the operands' dtype (fused_rounder)
    return t.is_cpu and bindings.available() and 1 <= n <= bindings.MAX_SAMPLES


def _accumulator_gpu(t: torch.Tensor, n: int) -> bool:
    return t.is_cuda and _triton_installed()


def _fp32_cpu(t: torch.Tensor, n: int) -> bool:
    # the tables read fp32 values, any number of samples
    return t.is_cpu and t.dtype == torch.float32 and bindings.available()


# -- ROUND: round N samples and measure them, one pass ----------------------------------------
# (samples [N, ...] with elements, fmt, mode or None: measure only, seed, settings) ->
# (samples, statistics row: a list, or a tensor the tracer reads back in one go)
@implements(ROUND, CPU, fused_cpu)
def _round_cpu(samples: torch.Tensor, fmt: Any, mode: Optional[Rounding], seed: int, *,
               saturate: bool, confidence: float, zero_threshold: float,
               in_place: bool, run_shift: Optional[float] = None) -> tuple:
    out, vec, _ = bindings.round_stats(samples, fmt, mode, seed, saturate=saturate,
                                       confidence=confidence, zero_threshold=zero_threshold,
                                       in_place=in_place, as_list=True, run_shift=run_shift)
    return out, vec


@implements(ROUND, TRITON, fused_gpu)
def _round_triton(samples: torch.Tensor, fmt: Any, mode: Optional[Rounding], seed: int, *,
                  saturate: bool, confidence: float, zero_threshold: float,
                  in_place: bool, run_shift: Optional[float] = None) -> tuple:
    if mode is None:  # measuring alone has no kernel of its own: the reference
        return _round_torch(samples, fmt, mode, seed, saturate=saturate, confidence=confidence,
                            zero_threshold=zero_threshold, in_place=in_place,
                            run_shift=run_shift)
    from .kernels.dispatch import round_and_stats

    n, numel = samples.shape[0], samples[0].numel()
    t, cap = student_t(n, confidence), digits_cap(fmt, samples.dtype)
    under = underflow_count(samples, fmt)
    out, st = round_and_stats(samples, fmt, mode, seed, saturate=saturate,
                              confidence=confidence, zero_threshold=zero_threshold,
                              kernels=TRITON)
    # the extras (norms, underflow, quantiles) with torch operations on the device
    return out, [st.avg * numel, st.min, st.max, st.zero_fraction * numel,
                 float(st.non_finite), float(numel)] + extra_stats(out, t, cap, under, run_shift)


@implements(ROUND, TORCH)
def _round_torch(samples: torch.Tensor, fmt: Any, mode: Optional[Rounding], seed: int, *,
                 saturate: bool, confidence: float, zero_threshold: float,
                 in_place: bool, run_shift: Optional[float] = None) -> tuple:
    t, cap = student_t(samples.shape[0], confidence), digits_cap(fmt, samples.dtype)
    under = underflow_count(samples, fmt) if mode is not None else 0
    if mode is not None:
        samples = round_samples(samples, fmt, mode, seed=seed, saturate=saturate)
    return samples, stats_vector(samples, t, cap, zero_threshold, under, run_shift)


@implements(PREPARED_ROUND, CPU)
def _prepared_cpu(fmt: Any, mode: Optional[Rounding], dtype: torch.dtype, n: int, *,
                  saturate: bool, confidence: float, zero_threshold: float, in_place: bool,
                  eta: Optional[float], run_shift: Optional[float] = None,
                  grid: Any = None) -> "bindings.Prepared":
    """The kernel with its settings bound once (a call sets the seed(s) and runs it); with
    ``eta``, its consumer GEMM's surrogate in the same pass (its values onto ``grid``)."""
    return bindings.Prepared(bindings.rounder(fmt, mode, dtype, n, saturate=saturate,
                                              confidence=confidence,
                                              zero_threshold=zero_threshold,
                                              run_shift=run_shift), in_place, eta, grid)


@implements(ROUND_PERTURB, CPU)
def _round_perturb_cpu(samples: torch.Tensor, fmt: Any, mode: Rounding, seed: int, eta: float,
                       perturb_seed: int, *, saturate: bool, confidence: float,
                       zero_threshold: float, in_place: bool,
                       run_shift: Optional[float] = None, grid: Any = None) -> tuple:
    """(rounded and perturbed samples, statistics row of the rounded ones, perturbed count)."""
    return bindings.round_perturb(samples, fmt, mode, seed, eta, perturb_seed,
                                  saturate=saturate, confidence=confidence,
                                  zero_threshold=zero_threshold, in_place=in_place,
                                  as_list=True, run_shift=run_shift, grid=grid)


# -- PERTURB: the GEMM surrogate ---------------------------------------------------------------
# (x: samples [N, ...], or with stacked False one plain operand read as n samples; grid: the
# format the perturbed values are rounded onto) -> (samples, perturbed count)
@implements(PERTURB, CPU, fused_cpu)
def _perturb_cpu(x: torch.Tensor, eta: float, seed: int, n: int, stacked: bool,
                 grid: Any) -> tuple:
    # a plain operand is read N times, never copied
    return bindings.perturb(x, eta, seed, n_samples=None if stacked else n, grid=grid)


@implements(PERTURB, TRITON, fused_gpu)
def _perturb_triton(x: torch.Tensor, eta: float, seed: int, n: int, stacked: bool,
                    grid: Any) -> tuple:
    from .kernels.dispatch import perturb

    samples = (x if stacked else x.unsqueeze(0).expand(n, *x.shape)).contiguous()
    return perturb(samples, eta, seed, kernels=TRITON, grid=grid)


@implements(PERTURB, TORCH)
def _perturb_torch(x: torch.Tensor, eta: float, seed: int, n: int, stacked: bool,
                   grid: Any) -> tuple:
    samples = (x if stacked else x.unsqueeze(0).expand(n, *x.shape)).contiguous()
    return perturb_samples(samples, eta, seed, grid)


# -- ACCUMULATE: a modelled GEMM of stacked operands with its accumulator ---------------------
# (left [N or 1, ..., M, K], right [N or 1, ..., K, P], accumulator, seed, n) -> samples
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


@implements(ACCUMULATE, CPU, _accumulator_cpu)
def _accumulate_cpu(left: torch.Tensor, right: torch.Tensor, acc: Any, seed: int,
                    n: int) -> torch.Tensor:
    """Blocked fp64 products, each block's rounding by the fused C kernel."""
    rounder = fused_rounder(left, right) or samples_rounder(n)
    return emulate_matmul(left, right, acc, seed=seed, rounder=rounder)


@implements(ACCUMULATE, TRITON, _accumulator_gpu)
def _accumulate_triton(left: torch.Tensor, right: torch.Tensor, acc: Any, seed: int,
                       n: int) -> torch.Tensor:
    """One Triton kernel for all blocks, the samples as a batch dimension."""
    from .kernels.accumulate import emulate_matmul_triton

    return emulate_matmul_triton(left, right, acc, seed=seed, samples=True)


@implements(ACCUMULATE, TORCH)
def _accumulate_torch(left: torch.Tensor, right: torch.Tensor, acc: Any, seed: int,
                      n: int) -> torch.Tensor:
    return emulate_matmul(left, right, acc, seed=seed, rounder=samples_rounder(n))


# -- LOWP_CONVERT: the samples' linear in the format's own GEMM -------------------------------
# (x, w, b, format name) -> the product in x's dtype, or None where that path does not apply
@implements(LOWP_CONVERT, CPU, fused_cpu)
def _lowp_linear_cpu(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                     fmt: str) -> Optional[torch.Tensor]:
    return lowp_gemm.linear(x, w, b, fmt, bindings)


@implements(LOWP_CONVERT, TORCH)
def _lowp_linear_torch(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                       fmt: str) -> Optional[torch.Tensor]:
    return lowp_gemm.linear(x, w, b, fmt, None)


# -- the arithmetic level's own (no Triton path yet: "triton" means "auto") --------------------
@implements(ATEN_PERTURB, CPU, fused_cpu)
def _aten_perturb_cpu(samples: torch.Tensor, eta: float, seed: int, grid: Any) -> tuple:
    return bindings.perturb(samples, eta, seed, grid=grid)


@implements(ATEN_PERTURB, TORCH)
def _aten_perturb_torch(samples: torch.Tensor, eta: float, seed: int, grid: Any) -> tuple:
    return perturb_samples(samples, eta, seed, grid)


# (samples [N, ...], fmt, mode, seed, saturate) -> the rounded samples
@implements(ROUND_ONLY, CPU, fused_cpu)
def _round_only_cpu(samples: torch.Tensor, fmt: Any, mode: Rounding, seed: int,
                    saturate: bool) -> torch.Tensor:
    return bindings.round_stats(samples, fmt, mode, seed, saturate=saturate,
                                want_stats=False)[0]


@implements(ROUND_ONLY, TORCH)
def _round_only_torch(samples: torch.Tensor, fmt: Any, mode: Rounding, seed: int,
                      saturate: bool) -> torch.Tensor:
    return round_samples(samples, fmt, mode, seed, saturate=saturate)


# (fn, x: fp32 samples whose values are all bf16 values) -> fn(x), or None where a value is not
# one (the caller runs the primitive its own way)
@implements(ATEN_LOOKUP, CPU, _fp32_cpu)
def _lookup_cpu(fn: Callable, x: torch.Tensor) -> Optional[torch.Tensor]:
    """One lookup per element in a table of ``fn``'s own results on every bf16 value (the same
    bits as ``fn``, for the functions of :data:`fxstab.cpu.bindings.LOOKUP_OPS`)."""
    return bindings.lookup_bf16(fn, x)


@implements(ATEN_LOOKUP, TORCH)
def _lookup_torch(fn: Callable, x: torch.Tensor) -> Optional[torch.Tensor]:
    return fn(x)


_PROBE = 1.0 + 2.0 ** -9  # between bf16's neighbours 1 and 1 + 2**-7
_PROBE_FORMAT = get_format("bf16")


# (n, numel, seed, device) -> directions [N, numel] (True: away from zero)
@implements(RANDOM_UP, CPU, fused_cpu)
def _random_up_cpu(n: int, numel: int, seed: int, device: torch.device) -> torch.Tensor:
    """Through the fused kernel: rounding a value halfway inside a bf16 interval reads the bit
    (it goes up exactly when the bit says so), the same bits as the reference."""
    probe = torch.full((numel,), _PROBE, dtype=torch.float32)
    out = bindings.round_stats(probe, _PROBE_FORMAT, Rounding.RANDOM, seed, n_samples=n,
                               want_stats=False)[0]
    return out > _PROBE


@implements(RANDOM_UP, TORCH)
def _random_up_torch(n: int, numel: int, seed: int, device: torch.device) -> torch.Tensor:
    """The Philox bits of ``round_samples`` with CADNA's cross-sample scheme."""
    draws, flips = sample_draws(n)
    bits = randbits.random_bits(seed, numel, sorted(set(draws)), device=device)
    flip = torch.tensor(flips, dtype=torch.int64, device=device).reshape(n, 1)
    return (bits[torch.tensor(draws, device=device)] ^ flip).bool()
