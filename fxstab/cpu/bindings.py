"""Fused CPU kernels: rounding + digit statistics and the GEMM surrogate in one pass each.

The plain-torch references (:func:`fxstab.numerics.rounding.round_samples`,
:func:`fxstab.numerics.digits.stats_vector`, :func:`fxstab.numerics.surrogate.perturb_samples`) make about thirty
passes over every element; on a CPU that costs more than the model's matmuls. The C source in
``fxstab/cpu/csrc/cpu_kernels.c`` does the same work in one pass per element, on all cores
(OpenMP, ``torch.get_num_threads()`` threads), with the same Philox streams: rounded and
perturbed samples are bit-identical to the references and the statistics agree to a few ulps.

This module holds the Python functions over the library (its ctypes declarations included);
:mod:`fxstab.cpu.build` compiles and loads it (on first use, into a cache directory). Without
a compiler, or with ``FXSTAB_NATIVE=0``, :func:`available` is False and callers use the
references (one warning).
"""

from __future__ import annotations

import ctypes
import functools
import math
import warnings
from typing import Optional

import torch

from ..numerics.digits import STATS_LEN, digits_cap, empty_stats, run_shift as _run_shift, \
    student_t
from ..numerics.formats import WORKING_DTYPES, Format, float_bits
from ..numerics.randbits import M64
from ..numerics.rounding import MODE_CODES, Rounding
from ..numerics.surrogate import grid_for
from . import build
from .build import library_path

__all__ = ["available", "supports", "round_stats", "round_perturb", "perturb", "library_path",
           "Rounder", "rounder", "lookup_bf16", "LOOKUP_OPS", "derive_seeds", "CallSeeds",
           "Prepared", "Binary", "BINARY_OPS", "binary_layout", "split_bf16", "join_bf16"]

MAX_SAMPLES = 256  # cpu_kernels.c: per-thread stack buffers


class _Params(ctypes.Structure):
    _fields_ = [
        ("man_bits", ctypes.c_int64), ("k", ctypes.c_int64), ("max_bits", ctypes.c_int64),
        ("min_sub_bits", ctypes.c_int64), ("finite_only", ctypes.c_int64),
        ("mode", ctypes.c_int64), ("saturate", ctypes.c_int64), ("seed", ctypes.c_uint64),
        ("t", ctypes.c_double), ("cap", ctypes.c_double), ("zero_threshold", ctypes.c_double),
        ("nthreads", ctypes.c_int64), ("zmask", ctypes.c_uint64), ("run_shift", ctypes.c_double),
        # derived by the kernel at entry
        ("kd", ctypes.c_double), ("vcap", ctypes.c_double), ("vzero", ctypes.c_double),
        ("vthr", ctypes.c_double), ("k0", ctypes.c_double), ("rv_cap", ctypes.c_double),
        ("rv_zero", ctypes.c_double), ("b_cap", ctypes.c_int64), ("nbins", ctypes.c_int64),
        ("rkd", ctypes.c_double), ("rvcap", ctypes.c_double), ("rvzero", ctypes.c_double),
    ]


@functools.lru_cache(maxsize=None)
def _lib() -> Optional[ctypes.CDLL]:
    if not build.enabled():
        return None
    try:
        lib = build.load_library()
    except (OSError, RuntimeError) as exc:
        warnings.warn(f"fxstab: the fused CPU kernels are unavailable ({exc}); using the "
                      f"plain-torch path, which is several times slower", RuntimeWarning,
                      stacklevel=3)
        return None
    p, i64, u64, dbl = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_double
    for name in ("fxstab_round_stats_f32", "fxstab_round_stats_f64"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, p, i64, i64, ctypes.POINTER(_Params), ctypes.POINTER(dbl), p,
                       ctypes.POINTER(_Fused)]
        fn.restype = None
    lib.fxstab_derive_seeds.argtypes = [u64, p, i64, u64, p, p]
    lib.fxstab_derive_seeds.restype = None
    lib.fxstab_call_seeds.argtypes = [p, p, i64, u64, p]
    lib.fxstab_call_seeds.restype = None
    lib.fxstab_prepare_params.argtypes = [ctypes.POINTER(_Params), i64]
    lib.fxstab_prepare_params.restype = None
    lib.fxstab_round_stats_prepared.argtypes = None  # a byref(_PreparedCall), as it is
    lib.fxstab_round_stats_prepared.restype = None
    lib.fxstab_lookup_bf16.argtypes = [p, p, i64, p, i64]
    lib.fxstab_lookup_bf16.restype = i64
    for name in ("fxstab_perturb_f32", "fxstab_perturb_f64"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, p, i64, i64, dbl, u64, p, i64, ctypes.POINTER(i64)]
        fn.restype = i64
    lib.fxstab_split_bf16.argtypes = [p, p, p, i64, i64]
    lib.fxstab_split_bf16.restype = i64
    lib.fxstab_join_bf16.argtypes = [p, p, p, p, i64, i64]
    lib.fxstab_join_bf16.restype = None
    return lib


def derive_seeds(seed: int, salts: list, then: int) -> Optional[tuple[list, list]]:
    """``[derive_seed(seed, s) for s in salts]`` and ``derive_seed`` of each of those with
    ``then`` (fxstab.numerics.randbits), in one C call; None without the kernels."""
    lib = _lib()
    if lib is None:
        return None
    n = len(salts)
    arr = ctypes.c_uint64 * n
    seeds, after = arr(), arr()
    lib.fxstab_derive_seeds(seed & M64, arr(*[s & M64 for s in salts]), n, then & M64,
                            seeds, after)
    return list(seeds), list(after)


class CallSeeds:
    """``derive_seed(base, call, purpose)`` of a fixed list of (base, purpose) pairs, for any
    ``call``, in one C call (the steps of a generated stochastic graph: one seed each per
    analysed call)."""

    def __init__(self, bases: list, purposes: list) -> None:
        arr = ctypes.c_uint64 * len(bases)
        self.n = len(bases)
        self._bases = arr(*[b & M64 for b in bases])
        self._purposes = arr(*[q & M64 for q in purposes])
        self._out = arr()

    def __call__(self, call: int) -> list:
        _lib().fxstab_call_seeds(self._bases, self._purposes, self.n, call & M64, self._out)
        return self._out[:]


def available() -> bool:
    """Whether the fused CPU kernels can run here (compiles them on the first call)."""
    return _lib() is not None


def supports(t: torch.Tensor, n_samples: Optional[int] = None) -> bool:
    """Whether ``t`` (a CPU fp32/fp64 tensor) can go through the kernels."""
    n = t.shape[0] if n_samples is None else n_samples
    return (t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)
            and 1 <= n <= MAX_SAMPLES and available())


def _checked(samples: torch.Tensor, n_samples: Optional[int], what: str):
    """The library and the layout of ``samples``, or a clear error."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("fxstab.cpu.bindings: the fused CPU kernels are unavailable")
    x, n, xs, shape = _layout(samples, n_samples)
    if not (x.is_cpu and x.dtype in WORKING_DTYPES and 1 <= n <= MAX_SAMPLES):
        raise ValueError(f"fxstab.cpu.bindings.{what}: CPU float32/float64 samples with "
                         f"1..{MAX_SAMPLES} samples, got {x.dtype} on {x.device}, N={n}")
    return lib, (x, n, xs, shape)


class _Grid(ctypes.Structure):
    """cpu_kernels.c grid_t: the grid the surrogate's perturbed values are rounded onto
    (:func:`fxstab.numerics.surrogate.grid_for`), its constants in the working dtype."""

    _fields_ = [(name, ctypes.c_int64) for name in
                ("on", "man_bits", "k", "max_bits", "min_sub_bits", "finite_only")]


def _grid(fmt: Optional[Format], dtype: torch.dtype) -> _Grid:
    """The :class:`_Grid` of ``fmt`` for samples of ``dtype`` (off where :func:`grid_for`
    gives None)."""
    fmt = grid_for(fmt, dtype)
    if fmt is None:
        return _Grid(on=0)
    return _Grid(on=1, man_bits=fmt.man_bits, k=fmt.emin + WORKING_DTYPES[dtype].bias,
                 max_bits=float_bits(fmt.max_normal, dtype),
                 min_sub_bits=float_bits(fmt.min_subnormal, dtype),
                 finite_only=int(fmt.finite_only))


class _Fused(ctypes.Structure):
    """cpu_kernels.c fused_t: the consumer GEMM's surrogate, fused into round_stats."""

    _fields_ = [("eta", ctypes.c_double), ("seed", ctypes.c_uint64), ("count", ctypes.c_int64),
                ("grid", _Grid)]


def _layout(x: torch.Tensor, n_samples: Optional[int]) -> tuple[torch.Tensor, int, int, tuple]:
    """(contiguous data, n, sample stride, sample shape) for stacked or broadcast samples."""
    if n_samples is None:
        n = x.shape[0]
        shape = tuple(x.shape[1:])
        if x.is_contiguous():  # the common case, first: this runs for every primitive
            return x, n, x.numel() // n if n else 0, shape
        if n and x.stride(0) == 0 and x[0].is_contiguous():  # expand()ed plain value
            return x[0], n, 0, shape
        x = x.contiguous()
        return x, n, x.numel() // n if n else 0, shape
    x = x.contiguous()
    return x, n_samples, 0, tuple(x.shape)


# The run shifts the kernels take: the clamps of the expected run digits stay normal floats
# (fxstab.numerics.digits.run_shift lies in [0, 0.6] for every N and mode)
_RUN_SHIFT_RANGE = (-4.0, 4.0)


def _check_run_shift(run_shift: Optional[float], n: int) -> float:
    """``run_shift``, or ``run_shift(n)`` of the digits (N samples of random rounding) when
    None; a ValueError outside :data:`_RUN_SHIFT_RANGE`."""
    if run_shift is None:
        return _run_shift(n) if n >= 2 else 0.0
    shift = float(run_shift)
    lo, hi = _RUN_SHIFT_RANGE
    if not lo <= shift <= hi:  # NaN too
        raise ValueError(f"fxstab.cpu.bindings: run_shift must lie in [{lo}, {hi}], got "
                         f"{run_shift!r}")
    return shift


def _base_params(fmt: Format, mode: Optional[Rounding], dtype: torch.dtype, saturate: bool,
                 n: int, confidence: float, zero_threshold: float,
                 run_shift: Optional[float] = None) -> _Params:
    """The constants of round_stats for these settings (a :class:`Rounder` sets the seed, the
    threads and the mask's address per call); ``run_shift`` None: ``run_shift(n)``."""
    if not fmt.fits_in(dtype):
        raise ValueError(f"format {fmt.name} does not fit in {dtype}")
    wbias = WORKING_DTYPES[dtype].bias
    return _Params(
        man_bits=fmt.man_bits, k=fmt.emin + wbias, max_bits=float_bits(fmt.max_normal, dtype),
        min_sub_bits=float_bits(fmt.min_subnormal, dtype), finite_only=int(fmt.finite_only),
        mode=-1 if mode is None else MODE_CODES[mode], saturate=int(saturate),
        t=student_t(n, confidence) if n >= 2 else 1.0, cap=digits_cap(fmt, dtype),
        zero_threshold=zero_threshold, run_shift=_check_run_shift(run_shift, n))


def round_stats(
    samples: torch.Tensor,
    fmt: Format,
    mode: Optional[Rounding],
    seed: int = 0,
    *,
    saturate: bool = False,
    confidence: float = 0.95,
    zero_threshold: float = 0.5,
    want_stats: bool = True,
    want_digits: bool = False,
    n_samples: Optional[int] = None,
    in_place: bool = False,
    as_list: bool = False,
    want_zero_mask: bool = False,
    run_shift: Optional[float] = None,
) -> tuple:
    """Round samples into ``fmt`` and measure their digits, in one pass.

    Args:
        samples: CPU fp32/fp64 tensor ``[N, ...]``; or, with ``n_samples``, one plain value
            ``[...]`` that every sample shares (read N times, never copied).
        fmt: Simulated format (must fit the samples' dtype).
        mode: Rounding mode, or ``None`` to measure without rounding.
        seed: Seed of the random streams (the same streams as ``round_samples``).
        want_stats: Return the statistics in the layout of :func:`fxstab.numerics.digits.stats_vector`
            (float64: sum of digits, min, max, computational zeros, non-finite, numel, then the
            extras of :data:`fxstab.numerics.digits.EXTRA_STATS`).
        want_digits: Return the per-element digits (shape ``[...]``, samples' dtype).
        in_place: Write the rounded samples over ``samples`` (contiguous stacked samples
            only; each element is read before it is written, so the bits are the same).
        as_list: Return the statistics as a Python list (no tensor to build and read back:
            the arithmetic level calls this for every primitive).
        want_zero_mask: Also return the computational-zero mask (bool ``[...]``: finite, not
            all samples 0, fewer digits than ``zero_threshold``), a byte per element: what the
            counters read of an operand, without its digits.
        run_shift: The :func:`fxstab.numerics.digits.run_shift` of the expected digits of a
            round-to-nearest run (the statistics' last entry, ``sum_run``); None: N samples of
            random rounding, ``run_shift(N)``.

    Returns:
        ``(rounded [N, ...], stats or None, digits or None)``, and the zero mask last with
        ``want_zero_mask``; without rounding the first item is the samples themselves (stacked
        as given).
    """
    out, stats, digits, _, zeros = _round_stats(samples, fmt, mode, seed, saturate, confidence,
                                                zero_threshold, want_stats, want_digits,
                                                n_samples, in_place, None, want_zero_mask,
                                                run_shift)
    if stats is not None and not as_list:
        stats = torch.tensor(stats, dtype=torch.float64)
    return (out, stats, digits, zeros) if want_zero_mask else (out, stats, digits)


def round_perturb(samples: torch.Tensor, fmt: Format, mode: Rounding, seed: int, eta: float,
                  perturb_seed: int, *, saturate: bool = False, confidence: float = 0.95,
                  zero_threshold: float = 0.5, n_samples: Optional[int] = None,
                  in_place: bool = False, as_list: bool = False,
                  run_shift: Optional[float] = None, grid: Optional[Format] = None) -> tuple:
    """:func:`round_stats` (statistics of the rounded samples) followed by the GEMM surrogate of
    :func:`perturb` on the rounded samples, in the same pass: each group of elements is
    perturbed while it is still in cache. The samples come back rounded *and* perturbed (bit
    for bit ``perturb(round_stats(...)[0], eta, perturb_seed, grid=grid)``), for an output
    whose only consumer is that GEMM. Returns (samples, stats, number of perturbed
    elements)."""
    out, stats, _, count, _ = _round_stats(samples, fmt, mode, seed, saturate, confidence,
                                           zero_threshold, True, False, n_samples, in_place,
                                           (eta, perturb_seed, grid), False, run_shift)
    return out, stats if as_list else torch.tensor(stats, dtype=torch.float64), count


def _round_stats(samples, fmt, mode, seed, saturate, confidence, zero_threshold, want_stats,
                 want_digits, n_samples, in_place, perturb_args, want_zero_mask, run_shift):
    lib, (x, n, xs, shape) = _checked(samples, n_samples, "round_stats")
    if (want_stats or want_digits or want_zero_mask) and n < 2:
        raise ValueError(f"digits need N >= 2 samples, got N={n}")
    r = rounder(fmt, mode, x.dtype, n, saturate=saturate, confidence=confidence,
                zero_threshold=zero_threshold, run_shift=run_shift)
    if mode is None:
        out = x.expand(n, *shape) if n_samples is not None else x
    elif xs and (in_place or x.data_ptr() != samples.data_ptr()):
        out = x  # in place: as asked, or over the contiguous copy _layout made (ours alone: a
        # wgrad's or an embedding gradient's samples laid out inside the rows, a vocabulary
        # wide copy that a second fresh output would double)
    elif xs:
        out = torch.empty_like(x)  # x is [n, *shape], contiguous
    else:
        out = torch.empty((n, *shape), dtype=x.dtype)
    fused = None
    if perturb_args is not None:
        if mode is None:
            raise ValueError("round_perturb needs a rounding mode")
        fused = _Fused(eta=float(perturb_args[0]), seed=perturb_args[1] & M64,
                       grid=_grid(perturb_args[2], x.dtype))
    stats, digits, zeros = r._run(x, xs, out, shape, seed, want_stats, want_digits,
                                  want_zero_mask, fused)
    return out, stats, digits, 0 if fused is None else int(fused.count), zeros


_Stats = ctypes.c_double * STATS_LEN


def stats_block(rows: int) -> ctypes.Array:
    """``rows`` statistics rows in one buffer (:meth:`Prepared.use_row`); ``bytes(block)``
    copies them all, each :data:`~fxstab.numerics.digits.STATS_LEN` doubles."""
    return (_Stats * rows)()


def empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape): sizes passed as separate arguments parse in half the time."""
    return torch.empty(*shape, dtype=dtype) if shape else torch.empty((), dtype=dtype)


class Rounder:
    """:func:`round_stats` with its settings bound once (format, mode, dtype, N, confidence,
    zero threshold, run shift): what a caller that rounds every primitive of a model with the same
    settings holds (the arithmetic level), so each call is the allocations and one C call.

    Call it with contiguous stacked samples ``[N, ...]`` (CPU, the bound dtype), or one
    contiguous value ``expand``ed along the sample dim (read N times, not copied):
    ``rounder(samples, seed, want_stats, want_digits, want_zero_mask)`` returns ``(rounded
    samples or the samples themselves without a mode, stats list or None, digits or None, zero
    mask or None)``, as :func:`round_stats` with ``as_list=True``.
    """

    __slots__ = ("_fn", "_base", "mode", "dtype", "n", "cap")

    def __init__(self, fn, base: _Params, mode: Optional[Rounding], dtype: torch.dtype, n: int):
        self._fn, self._base, self.mode, self.dtype, self.n = fn, base, mode, dtype, n
        self.cap = base.cap

    def __call__(self, x: torch.Tensor, seed: int, want_stats: bool = True,
                 want_digits: bool = False, want_zero_mask: bool = False,
                 in_place: bool = False) -> tuple:
        n = self.n
        if not (x.dtype is self.dtype and x.is_cpu and x.dim() and x.shape[0] == n):
            raise ValueError(f"fxstab.cpu.bindings.Rounder: CPU {self.dtype} samples [{n}, ...], "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        shape = tuple(x.shape[1:])
        if x.is_contiguous():
            out = x if self.mode is None or in_place else torch.empty_like(x)
            xs = x.numel() // n
        elif x.stride(0) == 0 and x[0].is_contiguous():  # identical samples: read N times
            x = x[0]
            out = x.expand(n, *shape) if self.mode is None else \
                torch.empty(n, *shape, dtype=self.dtype)
            xs = 0
        else:
            raise ValueError("fxstab.cpu.bindings.Rounder: contiguous samples, or one contiguous "
                             "value expanded along the sample dim")
        stats, digits, zeros = self._run(x, xs, out, shape, seed, want_stats, want_digits,
                                         want_zero_mask, None)
        return out, stats, digits, zeros

    def _run(self, x, xs, out, shape, seed, want_stats, want_digits, want_zero_mask, fused):
        p = _Params.from_buffer_copy(self._base)
        p.seed = seed & M64
        p.nthreads = torch.get_num_threads()
        stats = _Stats() if want_stats else None
        digits = empty(shape, x.dtype) if want_digits else None
        zeros = None
        if want_zero_mask:  # the kernel writes every byte (0 or 1: valid bools)
            zeros = empty(shape, torch.bool)
            p.zmask = zeros.data_ptr()
        numel = xs if xs else x.numel()  # xs: the sample stride, 0 for one expanded value
        if numel:
            self._fn(x.data_ptr(), xs, None if self.mode is None else out.data_ptr(), self.n,
                     numel, ctypes.byref(p), stats,
                     None if digits is None else digits.data_ptr(),
                     None if fused is None else ctypes.byref(fused))
            stats = None if stats is None else stats[:]
        elif stats is not None:
            stats = empty_stats(p.cap)
        return stats, digits, zeros


class _Binop(ctypes.Structure):
    """cpu_kernels.c ``binop_t``: the elementwise primitive a :class:`Binary` computes."""

    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("as_", ctypes.c_int64),
                ("bs", ctypes.c_int64), ("op", ctypes.c_int64), ("size1", ctypes.c_int64),
                ("size2", ctypes.c_int64), ("ast", ctypes.c_int64 * 3),
                ("bst", ctypes.c_int64 * 3)]


class _PreparedCall(ctypes.Structure):
    """cpu_kernels.c ``prepared_t``: one :class:`Prepared` call's arguments."""

    _fields_ = [("x", ctypes.c_void_p), ("xs", ctypes.c_int64), ("out", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("numel", ctypes.c_int64), ("f64", ctypes.c_int64),
                ("p", ctypes.POINTER(_Params)), ("stats", ctypes.POINTER(ctypes.c_double)),
                ("fused", ctypes.POINTER(_Fused)), ("bin", ctypes.POINTER(_Binop)),
                ("dig", ctypes.c_void_p)]


class Prepared:
    """A :class:`Rounder` bound to one output of a generated stochastic graph: its parameters
    (with the constants the kernel derives from them), its statistics buffer and the call's
    argument struct are set up once, so a call sets the seed, allocates the rounded samples
    (unless ``in_place``) and makes one C call with one argument. ``stats`` holds the latest
    call's statistics (read them before the next call). Returns None for a layout the kernel
    does not read (the caller takes the general path).

    With ``eta``, the call is :func:`round_perturb`'s: the consumer GEMM's surrogate in the
    same pass, whose seed the caller sets in ``fused.seed`` before each call and whose
    ``fused.count`` (elements insufficiently separated) it reads after."""

    __slots__ = ("_fn", "_p", "_c", "_cref", "stats", "n", "rounds", "in_place", "_numel",
                 "_nt", "fused", "_expanded")

    def __init__(self, r: Rounder, in_place: bool, eta: Optional[float] = None,
                 grid: Optional[Format] = None) -> None:
        lib = _lib()
        self.n, self.rounds, self.in_place = r.n, r.mode is not None, in_place
        if eta is not None and r.mode is None:
            raise ValueError("fxstab.cpu.bindings.Prepared: the fused surrogate needs a rounding mode")
        self._p = _Params.from_buffer_copy(r._base)
        lib.fxstab_prepare_params(ctypes.byref(self._p), r.n)
        self.stats = _Stats()
        self.fused = None if eta is None else _Fused(eta=float(eta),
                                                     grid=_grid(grid, r.dtype))
        self._c = _PreparedCall(n=r.n, f64=int(r.dtype == torch.float64),
                                p=ctypes.pointer(self._p),
                                stats=ctypes.cast(self.stats, ctypes.POINTER(ctypes.c_double)),
                                fused=None if eta is None else ctypes.pointer(self.fused))
        self._cref = ctypes.byref(self._c)
        self._fn = lib.fxstab_round_stats_prepared
        self._numel = self._nt = -1  # what the struct holds (a call sets what changed)
        self._expanded = None  # the expanded layout last found readable

    def write_zeros(self, mask: Optional[torch.Tensor]) -> None:
        """From the next call on, write the computational-zero mask of the output into
        ``mask`` (a contiguous bool tensor of one sample's shape), or nothing (None)."""
        self._p.zmask = 0 if mask is None else mask.data_ptr()

    def use_row(self, block: ctypes.Array, k: int) -> None:
        """From now on, write the statistics into row ``k`` of ``block`` (:func:`stats_block`),
        which ``stats`` then is (holding the latest call's statistics, copied): one copy of
        the block keeps the rows of many kernels."""
        row = block[k]
        ctypes.memmove(row, self.stats, ctypes.sizeof(row))
        self.stats = row
        self._c.stats = ctypes.cast(self.stats, ctypes.POINTER(ctypes.c_double))

    def __call__(self, x: torch.Tensor, seed: int) -> Optional[torch.Tensor]:
        c = self._c
        if x.is_contiguous():
            numel = x.numel() // self.n
            if numel != self._numel:
                c.xs = c.numel = self._numel = numel
            ptr = x.data_ptr()
            if not self.rounds:
                out, c.out = x, None
            elif self.in_place:
                out, c.out = x, ptr
            else:
                out = torch.empty_like(x)
                c.out = out.data_ptr()
        elif x.stride(0) == 0:  # identical samples: read N times, if one is contiguous
            layout = (x.shape, x.stride())
            if layout != self._expanded:  # (a step sees one layout: checked once)
                if not x[0].is_contiguous():
                    return None
                self._expanded = layout
            # (torch.empty(x.shape, dtype=...) parses its arguments in twice the time)
            out = torch.empty_like(x, memory_format=torch.contiguous_format) if self.rounds \
                else x
            c.xs, c.numel = 0, x.numel() // self.n
            self._numel = -1
            ptr = x.data_ptr()  # sample 0's: the same storage offset
            c.out = out.data_ptr() if self.rounds else None
        else:
            return None
        p = self._p
        p.seed = seed & M64
        nt = torch.get_num_threads()
        if nt != self._nt:
            p.nthreads = self._nt = nt
        c.x = ptr
        self._fn(self._cref)
        return out


_CONTIGUOUS = torch.contiguous_format

# cpu_kernels.c BIN_*: the primitives :class:`Binary` computes
BINARY_OPS = {"add": 0, "sub": 1, "mul": 2, "div": 3}


def binary_layout(a: torch.Tensor, b: torch.Tensor, n: int) -> Optional[tuple]:
    """How :class:`Binary` reads two operands that broadcast to ``[n, *shape]`` (samples first;
    a plain operand without the sample dim broadcasts along it): ``(shape, (size1, size2),
    (sample stride, strides) of a, of b)`` over the output collapsed to at most three dims, or
    None when it does not collapse that far."""
    try:
        full = torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        return None
    if not full or full[0] != n or a.dim() > len(full) or b.dim() > len(full):
        return None
    ea, eb = a.expand(full), b.expand(full)
    dims: list = []  # [size, a's stride, b's stride] from the outermost
    for size, sa, sb in zip(full[1:], ea.stride()[1:], eb.stride()[1:]):
        if size == 1:
            continue
        if dims and dims[-1][1] == sa * size and dims[-1][2] == sb * size:
            dims[-1] = [dims[-1][0] * size, sa, sb]  # contiguous with the previous dim
        else:
            dims.append([size, sa, sb])
    if len(dims) > 3:
        return None
    dims = [[1, 0, 0]] * (3 - len(dims)) + dims
    return (tuple(full[1:]), (dims[1][0], dims[2][0]),
            (ea.stride(0), tuple(d[1] for d in dims)), (eb.stride(0), tuple(d[2] for d in dims)))


class Binary:
    """The arithmetic level's usual primitive in one C call: an elementwise add, sub, mul or div
    of two operands in the samples' dtype (stacked ``[N, ...]``, or plain values every sample
    shares), computed by the kernel row by row straight into its rounding and statistics
    (cpu_kernels.c ``binop_t``): the same bits as torch's operator followed by
    :class:`Prepared`, without the operator's own pass over memory.

    ``binary.reads(a, b)`` says whether it reads ``a``, ``b`` (broadcastable to ``[N, ...]``,
    ranks aligned: :func:`fxstab.rules.aten.batching.aligned`; the samples' dtype, the CPU, a
    broadcast that collapses to three dims, a non-empty output); then ``binary(a, b, seed,
    want_digits, want_zeros)`` returns ``(rounded samples, statistics list, digits or None,
    zero mask or None)``."""

    __slots__ = ("_prep", "_bin", "dtype", "_layout", "_like")

    def __init__(self, r: Rounder, op: str) -> None:
        if r.mode is None:
            raise ValueError("fxstab.cpu.bindings.Binary: needs a rounding mode")
        self._prep = Prepared(r, False)
        self._bin = _Binop(op=BINARY_OPS[op])
        self._prep._c.bin = ctypes.pointer(self._bin)
        self.dtype = r.dtype
        self._layout: Optional[tuple] = None  # the strides and shapes of the latest operands
        self._like: tuple = ()  # the output's, the digits' and the zero mask's layouts

    def reads(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        key = (a.stride(), b.stride(), a.shape, b.shape, a.dtype, b.dtype, a.device, b.device)
        if key == self._layout:  # a step sees one layout: set up once
            return True
        dt = self.dtype
        if a.dtype is not dt or b.dtype is not dt or not (a.is_cpu and b.is_cpu):
            return False
        layout = binary_layout(a, b, self._prep.n)
        if layout is None or not all(layout[0]):
            self._layout = None
            return False
        self._layout = key
        # layouts to allocate from (empty_like parses its arguments in half the time of
        # torch.empty(shape, dtype=...)): one element each, expanded
        full = (self._prep.n, *layout[0])
        self._like = (torch.empty((), dtype=dt).expand(full),
                      torch.empty((), dtype=dt).expand(full[1:]),
                      torch.empty((), dtype=torch.bool).expand(full[1:]))
        bo, c = self._bin, self._prep._c
        bo.size1, bo.size2 = layout[1]
        bo.as_, bo.bs = layout[2][0], layout[3][0]
        bo.ast[:], bo.bst[:] = layout[2][1], layout[3][1]
        c.x, c.xs = None, 0
        c.numel = math.prod(layout[0])
        return True

    def __call__(self, a: torch.Tensor, b: torch.Tensor, seed: int, want_digits: bool = False,
                 want_zeros: bool = False) -> tuple:
        """The operands :meth:`reads` last said it reads (their layout)."""
        prep = self._prep
        c, p, bo = prep._c, prep._p, self._bin
        like = self._like
        out = torch.empty_like(like[0], memory_format=_CONTIGUOUS)
        c.out = out.data_ptr()
        bo.a = a.data_ptr()
        bo.b = b.data_ptr()
        digits = zeros = None
        if want_digits:
            digits = torch.empty_like(like[1], memory_format=_CONTIGUOUS)
            c.dig = digits.data_ptr()
        elif c.dig:
            c.dig = None
        if want_zeros:
            zeros = torch.empty_like(like[2], memory_format=_CONTIGUOUS)
            p.zmask = zeros.data_ptr()
        elif p.zmask:
            p.zmask = 0
        p.seed = seed & M64
        nt = torch.get_num_threads()
        if nt != prep._nt:
            p.nthreads = prep._nt = nt
        prep._fn(prep._cref)
        return out, prep.stats[:], digits, zeros


@functools.lru_cache(maxsize=256)
def rounder(fmt: Format, mode: Optional[Rounding], dtype: torch.dtype, n: int, *,
            saturate: bool = False, confidence: float = 0.95,
            zero_threshold: float = 0.5, run_shift: Optional[float] = None) -> Rounder:
    """The :class:`Rounder` of these settings (cached); ``run_shift``: that of the expected
    run digits (:func:`round_stats`), None for ``run_shift(n)``."""
    lib = _lib()
    if lib is None:
        raise RuntimeError("fxstab.cpu.bindings: the fused CPU kernels are unavailable")
    if dtype not in WORKING_DTYPES or not 1 <= n <= MAX_SAMPLES:
        raise ValueError(f"fxstab.cpu.bindings: float32/float64 samples with 1..{MAX_SAMPLES} "
                         f"samples, got {dtype}, N={n}")
    fn = lib.fxstab_round_stats_f32 if dtype == torch.float32 else lib.fxstab_round_stats_f64
    base = _base_params(fmt, mode, dtype, bool(saturate), n, float(confidence),
                        float(zero_threshold), run_shift)
    return Rounder(fn, base, mode, dtype, n)


# Unary functions whose torch CPU kernels give each element the same bits wherever it sits
# (vector body, scalar tail, strided): their tables are the op itself (tests/test_native.py
# checks every bf16 value at odd sizes and strides). torch's sigmoid is not one of them.
LOOKUP_OPS = frozenset({"exp", "log", "sqrt", "rsqrt", "tanh", "erf"})


@functools.lru_cache(maxsize=32)
def _bf16_table(fn) -> torch.Tensor:
    """``fn`` of every bf16 value (as fp32), indexed by the value's 16 bits."""
    values = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    table = fn(values)
    if table.dtype != torch.float32 or table.shape != values.shape:
        raise ValueError(f"fxstab.cpu.bindings.lookup_bf16: {fn} must map fp32 to fp32 elementwise")
    return table.contiguous()


def lookup_bf16(fn, x: torch.Tensor) -> Optional[torch.Tensor]:
    """``fn(x)`` for fp32 ``x`` whose values are all bf16 values (the rounded results of the
    arithmetic level in the bf16 format), as one table lookup per element: ``fn`` of all 65536
    bf16 values is computed once, so each element gets ``fn``'s own bits (for the functions of
    :data:`LOOKUP_OPS`). Returns None when a value is not a bf16 value (or ``x`` is not a
    contiguous CPU fp32 tensor): the caller computes ``fn(x)`` itself."""
    lib = _lib()
    if lib is None or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous():
        return None
    table = _bf16_table(fn)
    out = torch.empty_like(x)
    if not lib.fxstab_lookup_bf16(x.data_ptr(), out.data_ptr(), x.numel(), table.data_ptr(),
                                  torch.get_num_threads()):
        return None
    return out


def perturb(samples: torch.Tensor, eta: float, seed: int, *,
            n_samples: Optional[int] = None,
            grid: Optional[Format] = None) -> tuple[torch.Tensor, int]:
    """The GEMM surrogate of :func:`fxstab.numerics.surrogate.perturb_samples` (``grid``: the
    format its perturbed values are rounded onto), bit for bit.

    ``samples`` is ``[N, ...]``, or one plain value with ``n_samples`` (every sample identical:
    all elements are perturbed, the result is ``[N, ...]``). Returns the perturbed samples and
    the number of perturbed elements. Stacked samples that the perturbation would not change
    (every element separated or exactly zero) are returned as they are, not copied.
    """
    lib, (x, n, xs, shape) = _checked(samples, n_samples, "perturb")
    numel = math.prod(shape)
    out = torch.empty((n, *shape), dtype=x.dtype)
    if numel == 0:
        return out, 0
    fn = lib.fxstab_perturb_f32 if x.dtype == torch.float32 else lib.fxstab_perturb_f64
    moved = ctypes.c_int64(1)
    on = _grid(grid, x.dtype)
    count = fn(x.data_ptr(), xs, out.data_ptr(), n, numel, float(eta), seed & M64,
               ctypes.byref(on) if on.on else None, torch.get_num_threads(),
               ctypes.byref(moved))
    if not moved.value:  # nothing changes: keep the samples, write nothing
        return samples, int(count)
    return out, int(count)


def split_bf16(x: torch.Tensor) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``(bf16(x), bf16(x - bf16(x)))`` of a contiguous CPU fp32 tensor in one pass, the second
    None where ``x - bf16(x)`` is zero everywhere: bit for bit
    :func:`fxstab.numerics.lowp_gemm.split_reference`. None without the kernels."""
    lib = _lib()
    if lib is None or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous():
        return None
    hi = torch.empty(x.shape, dtype=torch.bfloat16)
    lo = torch.empty(x.shape, dtype=torch.bfloat16)
    nonzero = lib.fxstab_split_bf16(x.data_ptr(), hi.data_ptr(), lo.data_ptr(), x.numel(),
                                    torch.get_num_threads())
    return hi, (lo if nonzero else None)


def join_bf16(hi: torch.Tensor, r: torch.Tensor, dp: Optional[torch.Tensor] = None,
              out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``float(hi) + nan_to_num(float(r), nan=0) (+ float(dp))`` of contiguous CPU bf16 tensors
    of one shape in one pass (into ``out``, a contiguous fp32 tensor of that shape, where
    given): bit for bit :func:`fxstab.numerics.lowp_gemm.join_reference`. None without the
    kernels."""
    lib = _lib()
    parts = [hi, r] + ([dp] if dp is not None else [])
    if lib is None or any(t.dtype != torch.bfloat16 or not t.is_cpu or not t.is_contiguous()
                          or t.shape != hi.shape for t in parts) or \
            (out is not None and (out.dtype != torch.float32 or not out.is_cpu or
                                  not out.is_contiguous() or out.shape != hi.shape)):
        return None
    if out is None:
        out = torch.empty(hi.shape, dtype=torch.float32)
    lib.fxstab_join_bf16(hi.data_ptr(), r.data_ptr(), dp.data_ptr() if dp is not None else None,
                         out.data_ptr(), hi.numel(), torch.get_num_threads())
    return out
