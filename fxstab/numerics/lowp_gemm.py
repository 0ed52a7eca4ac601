"""The samples' GEMMs in the program's own low-precision kernels (issue 46, item 2).

Samples of a bf16 format are held in a wider working dtype (fp32), so a plain ``linear`` of
them runs the fp32 GEMM: several times slower than the bf16 GEMM the program runs (4.4x on this
CPU's AMX for a 384 x 2048 x 5632 product; ~15x on an H200). Their values are bf16 values, and
the product CESTAC rounds is the fp32 sum of exact bf16 products: a bf16 GEMM with an fp32
accumulator computes it, if it can return it wider than bf16.

* CUDA: ``torch.mm(a, b, out_dtype=torch.float32)`` (``aten::mm.dtype``) returns the fp32
  accumulator: one GEMM, the fp32 path's product (the sums' order aside).
* CPU (no ``mm.dtype`` there): two bf16 GEMMs. ``hi = x @ w^T`` is the accumulator rounded
  to nearest in bf16; ``r = addmm(hi, x, w^T, beta=-1)`` adds ``-hi`` to the fp32 accumulator
  before its rounding, so ``r`` is ``S - hi`` to 8 bits and ``hi + r`` (exact in fp32) carries
  16 significant bits of the fp32 product S: enough for the rounding into bf16 to choose the
  same neighbours as from S itself, except where S lies within the sums' order noise of a
  rounding boundary (0.02% of the elements of a K = 2048 linear). A bias is a column of ones
  appended to ``x`` and a column of ``w`` (inside the fp32 accumulator, as the fp32 path's
  ``addmm`` adds it): a bias that cancels the product keeps its bits.
* Samples off the bf16 grid (data of another precision: an operand no selected operator
  rounded; the GEMM surrogate's perturbed values lie on the grid, issue 52) split into
  ``bf16(x) + d``, ``|d| <= 2^-9 |x|``: ``d``'s product is one more bf16 GEMM, whose error
  (2^-17 of the product) stays below what the rounding into bf16 resolves (0.4% of the
  elements take the other neighbour); where ``d`` is zero everywhere it is not run.

* On the CPU the products run in blocks of rows (a long prompt's vocabulary-wide ``hi``,
  ``r`` and ``d``'s product would each be a copy of the logits), and the conversions around
  them (``bf16(x)`` with ``d``; ``hi + r (+ d's product)``) are two fused C kernels where
  they built, bit for bit :func:`split_reference` and :func:`join_reference`.

* The premise (the residual formed in the bf16 GEMM's fp32 accumulator) is the platform's:
  :func:`check` tests it once per process and device on products whose exact values are
  known (issue 52: a CPU on which it failed would make maps from results of 8 bits,
  silently); a device that fails runs the samples' GEMMs in the working dtype, says so once,
  and the metadata of a map whose weights it decided records it (:func:`verdict_for`).

The weights: a bf16 model's weight read only by such products (and lookups) is its own twin,
never copied into fp32 (:func:`keeps`; ``GraphAnalysis._low_weights``); any other weight's
working copy remembers the model's bf16 tensor as its twin (:func:`set_twin`). A weight read
as ``x @ W`` (GPT-2's Conv1D) finds its twin transposed.

Measured (``python benchmarks/bench_scale.py``, the 1.1B model): the steady analysed call 8.1x
eager against 11.2x on the fp32 path, peak memory 1.17x against 2.75x; the digit maps equal the
previous revision's field for field (``benchmarks/maps_ab.py``) and move by at most 0.004
digits against the fp32 path's. :func:`linear` returns None where the path does not apply
(another format, fp64 samples, a weight without a low-precision twin), and the caller runs the
working-dtype GEMM; ``fxstab.backend(lowp_gemm=False)`` always runs that one.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from typing import Any, NamedTuple, Optional

import torch

__all__ = ["linear", "applies", "eligible", "keeps", "twin", "set_twin", "split_reference",
           "join_reference", "LOWP_DTYPES", "CPU_MIN_DIM", "path_name", "check", "Check",
           "verdict_for"]

# the formats whose samples' GEMMs can run in the format's own dtype
LOWP_DTYPES = {"bf16": torch.bfloat16}


# data pointer of a working-dtype weight -> (a weak reference to it, its low-precision twin,
# its version then).
# Keyed by memory, not by tensor object: the tracer reads weights through detach(), a new
# tensor object on the same memory (and the same version counter)
_TWINS: dict = {}


def set_twin(working: torch.Tensor, original: torch.Tensor) -> None:
    """Remember ``original`` (a bf16 weight) as the low-precision twin of ``working`` (its
    working-dtype copy, kept alive by its owner; or ``original`` itself, a weight the samples
    read in its own dtype: :func:`keeps`): the same values, read by :func:`linear` without a
    cast."""
    if original.dtype in LOWP_DTYPES.values() and working.numel():
        for key in [k for k, (ref, *_) in _TWINS.items() if ref() is None]:
            del _TWINS[key]  # copies replaced or gone
        try:
            version = working._version
        except RuntimeError:  # an inference tensor: no version to trust
            return
        _TWINS[working.data_ptr()] = (weakref.ref(working), original.detach(), version)


def twin(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The low-precision twin in ``dtype`` of weight ``t`` (or of a tensor on its memory: a
    detached view of it, or its transpose: ``t()`` of the twin) remembered by
    :func:`set_twin`, or None; a weight of ``dtype`` is its own (a backward graph's saved
    views of a bf16 model's weights, kept in their dtype)."""
    if t is None or not t.numel():
        return None
    if t.dtype == dtype:
        return t
    entry = _TWINS.get(t.data_ptr())
    if entry is None:
        return None
    working, low, version = entry[0](), entry[1], entry[2]
    if working is None or low.dtype != dtype:
        return None
    if working.shape == t.shape and working.stride() == t.stride():
        pass
    elif t.dim() == 2 and working.shape == t.shape[::-1] and \
            working.stride() == t.stride()[::-1]:
        low = low.t()  # (a weight read as x @ W: a GPT-2 Conv1D's addmm)
    else:
        return None
    try:  # (a detached view shares the version counter: a write to either changes it)
        same = t._version == version
    except RuntimeError:  # an inference tensor: no version to trust
        return None
    return low if same else None


@functools.lru_cache(maxsize=None)
def _mm_dtype(device: str) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` runs on ``device`` for bf16."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


# On the CPU the bf16 path pays a residual GEMM (and the surrogate's d), their outputs and the
# conversions: it wins where the GEMM's work dominates, both dimensions of the weight at least
# this. Measured, 384 rows, with d, against the fp32 GEMM (session 19): 2048 x 5632 0.64-0.73x
# of its time, 2048 x 2048 0.74x, 1024 x 1024 0.88x; 768- and 512-wide weights 0.7-1.6x (a
# GPT-2 124M's steady call 8.1x eager with them, 7.3x without; its 50257 x 768 head 1.07x)
CPU_MIN_DIM = 1024


class Check(NamedTuple):
    """The platform check's verdict on a device: whether its bf16 GEMMs keep the bits the
    path states (``ok``), and what was measured (``reason``)."""

    ok: bool
    reason: str


# the probe's products: (rows, K, columns); the large one reaches the blocked kernels a
# model's GEMMs run (K past any block of the reduction, both weight dimensions >= CPU_MIN_DIM)
_PROBE_SHAPES = ((5, 65, 24), (256, 1025, 1024))


@functools.lru_cache(maxsize=None)
def check(device: str) -> Check:
    """Whether the bf16 path keeps on ``device`` the bits the module states, tested once per
    process and device on known products, the bias inside the accumulator included:

    * integer operands in [-4, 4] (every partial sum exact in fp32, ``|S + b| < 2^16``): the
      result must be the exact value, bit for bit, where the bias cancels a row and elsewhere;
    * fractional ones, a bias cancelling some rows to ~2^-9 of the terms: the error against
      fp64 within twice fp32's accumulation bound ``gamma_K sum |terms|`` (the fp32 path's own
      error is one such) plus ``2^-16 |S|`` (the 16 bits ``hi + r`` keeps).

    A platform whose bf16 GEMM does not return (or form the residual in) an fp32 accumulator
    fails it; there the samples' GEMMs run in the working dtype (:func:`eligible` is False:
    the maps are the fp32 path's), said once in a warning and in the metadata of the maps
    whose weights it decided (:func:`verdict_for`)."""
    from torch.utils._python_dispatch import _disable_current_modes

    dev = torch.device(device)
    cuda = _mm_dtype(device)
    if dev.type != "cpu" and not cuda:
        return Check(False, "no bf16 GEMM with a wide result here")
    with _disable_current_modes(), torch.no_grad():
        try:
            verdict = _probe(dev, cuda)
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            verdict = Check(False, f"the bf16 GEMMs failed: {exc}".splitlines()[0])
    if not verdict.ok:
        warnings.warn(f"fxstab: the samples' GEMMs of bf16 weights run in fp32 on {device}, "
                      f"not in its bf16 GEMMs: {verdict.reason} (lowp_gemm)", stacklevel=2)
    return verdict


def _probe(dev: torch.device, cuda: bool) -> Check:
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for m, k, n in _PROBE_SHAPES:
        for integer in (True, False):
            if integer:
                x = torch.randint(-4, 5, (m, k), generator=gen).float()
                w = torch.randint(-4, 5, (n, k), generator=gen).float()
            else:
                x = torch.randn(m, k, generator=gen).bfloat16().float()
                w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).bfloat16().float()
            s = x.double() @ w.double().t()
            b = (torch.randint(-64, 65, (n,), generator=gen) if integer else
                 torch.randn(n, generator=gen)).bfloat16().double()
            b[: n // 2] = -s[0, : n // 2]  # row 0's first half cancels
            b16 = b.to(torch.bfloat16)
            x, w16 = x.to(dev), w.to(dev, torch.bfloat16)
            got = _product(x, w16, b16.to(dev), cuda).cpu().double()
            exact = s + b16.double()
            if integer:
                wrong = int((got != exact).sum())
                if wrong:
                    return Check(False, f"{wrong} of {got.numel()} integer products of a "
                                        f"{m}x{k}x{n} GEMM inexact")
                continue
            terms = x.cpu().double().abs() @ w.double().abs().t() + b16.double().abs()
            gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
            ratio = ((got - exact).abs() / (2 * gamma * terms + 2.0 ** -16 * exact.abs()))
            worst = max(worst, float(ratio.max()))
            if not worst <= 1.0:  # (NaN fails)
                return Check(False, f"a {m}x{k}x{n} GEMM's error {worst:.3g} times twice "
                                    f"fp32's accumulation bound (where a bias cancels)")
    return Check(True, f"products within {worst:.2f} of twice fp32's accumulation bound, "
                       f"integer ones exact")


def verdict_for(w: Any, fmt_name: str) -> Optional[Check]:
    """The platform check's verdict where it decides weight ``w``'s products (a weight of the
    format's dtype the path would take: :func:`eligible` but for the check), else None; what
    the map's metadata ``lowp_gemm`` records, per device (``GraphInfo.lowp_checks``)."""
    if not _shaped(w, fmt_name) or w.dtype != LOWP_DTYPES[fmt_name]:
        return None
    return check(str(w.device))


def eligible(w: Any, fmt_name: str) -> bool:
    """Whether a weight's products can run in the format's GEMMs here, its dtype aside: a bf16
    format, a 2-D weight, on the CPU one of at least :data:`CPU_MIN_DIM` each way, elsewhere a
    device with a wide-result GEMM (``mm.dtype``); and the device passed :func:`check`."""
    return _shaped(w, fmt_name) and _passes(w.device)


def _shaped(w: Any, fmt_name: str) -> bool:
    if LOWP_DTYPES.get(fmt_name) is None or not isinstance(w, torch.Tensor) or w.dim() != 2 \
            or not w.numel():
        return False
    return w.device.type != "cpu" or min(w.shape) >= CPU_MIN_DIM


def _passes(device: torch.device) -> bool:
    return check(str(device)).ok


def keeps(w: Any, fmt_name: Optional[str]) -> bool:
    """Whether weight ``w`` can stay in its own dtype, not copied into the working one: it is
    the format's dtype and :func:`eligible` (its readers run :func:`linear`; register it with
    ``set_twin(w, w)``); with no format (read by lookups only), any of :data:`LOWP_DTYPES`."""
    if type(w) not in (torch.Tensor, torch.nn.Parameter):  # (a DTensor, a quantised weight:
        return False  # a subclass is copied as before)
    if fmt_name is None:
        return w.dtype in LOWP_DTYPES.values()
    return eligible(w, fmt_name) and w.dtype == LOWP_DTYPES[fmt_name]


def applies(w: Any, fmt_name: str) -> bool:
    """Whether :func:`linear` runs weight ``w``'s products in the format's GEMMs: it is
    :func:`eligible` and has a twin (:func:`set_twin`; a weight kept in its own dtype is its
    own)."""
    return eligible(w, fmt_name) and twin(w, LOWP_DTYPES[fmt_name]) is not None


def path_name(device: torch.device) -> str:
    """How :func:`linear` computes on ``device`` (the coverage's words)."""
    if not _passes(device):
        return f"fp32 GEMM (bf16 GEMMs fail the platform check: {check(str(device)).reason})"
    if _mm_dtype(str(device)):
        return "bf16 GEMM with an fp32 result"
    return "bf16 GEMMs with an fp32 residual" if device.type == "cpu" else \
        "fp32 GEMM (no bf16 GEMM with a wide result here)"


def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], fmt_name: str,
           native: Any = None) -> Optional[torch.Tensor]:
    """``x @ w^T + b`` of samples ``x`` (working dtype, ``[..., K]``) and a plain weight, in the
    format's own GEMM kernels, returned in ``x``'s dtype; None where that path does not apply
    (the caller runs the working-dtype GEMM). ``native``: the fused CPU kernels
    (:mod:`fxstab.cpu.bindings`: ``split_bf16``, ``join_bf16``) for the conversions, else
    :func:`split_reference` and :func:`join_reference`, which they equal bit for bit."""
    dtype = LOWP_DTYPES.get(fmt_name)
    if dtype is None or x.dtype != torch.float32 or w.dim() != 2 or not x.numel() or \
            x.device != w.device:
        return None
    if not _passes(x.device):
        return None
    cuda = _mm_dtype(str(x.device))
    w16 = twin(w, dtype)
    b16 = twin(b, dtype)
    if w16 is None or (b is not None and b16 is None):
        return None
    lead, k = x.shape[:-1], x.shape[-1]
    out = _product(x.reshape(-1, k), w16, b16, cuda, native)
    return out.reshape(*lead, w.shape[0])


def _product(x2: torch.Tensor, w16: torch.Tensor, b16: Optional[torch.Tensor], cuda: bool,
             native: Any = None) -> torch.Tensor:
    """``x2 @ w16^T + b16`` of fp32 samples ``x2`` (``[M, K]``) in bf16 GEMMs, fp32 (the
    module's account; :func:`linear` without its checks, and what :func:`check` probes)."""
    # what the samples hold beyond bf16 (data of another precision; none where every value is
    # a rounded sample or the surrogate's, on the grid): x - bf16(x), at most 2^-9 |x|, whose
    # own product in bf16 adds at most 2^-17 |x| |w| of error, below the 16 bits kept
    split = native.split_bf16(x2) if native is not None and not cuda else None
    x16, d16 = split if split is not None else split_reference(x2)
    wt = w16.t()
    if cuda:
        out = torch.mm(x16, wt, out_dtype=torch.float32)
        if d16 is not None:
            out += torch.mm(d16, wt, out_dtype=torch.float32)
        if b16 is not None:
            out += b16.float()
        return out
    if b16 is not None:  # the bias inside the accumulator: a column of ones, a column of w
        x16 = torch.cat([x16, x16.new_ones(x16.shape[0], 1)], 1)
        wt = _with_bias(w16, b16).t()
    out = torch.empty(x16.shape[0], w16.shape[0], dtype=torch.float32, device=x2.device)
    # in blocks of rows: a long sequence's vocabulary-wide products (hi, r, d's) would each be
    # a copy of the logits (benchmarks/bench_scale.py --seq 1024)
    rows = max(256, _GEMM_CHUNK_BYTES // (2 * w16.shape[0]))
    for a in range(0, out.shape[0], rows):
        xa = x16[a:a + rows]
        hi = xa @ wt
        r = _residual(hi, xa, wt)
        # (d's product: its own 8 bits; joined to the residual in bf16, 0.9% not 0.4% of the
        # elements took the other neighbour)
        dp = d16[a:a + rows] @ w16.t() if d16 is not None else None
        if native is None or native.join_bf16(hi, r, dp, out=out[a:a + rows]) is None:
            join_reference(hi, r, dp, out=out[a:a + rows])
    return out


def _residual(hi: torch.Tensor, xa: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """``S - hi`` rounded to bf16, ``S = xa @ wt`` in the bf16 GEMM's fp32 accumulator: the
    premise of the CPU path, which :func:`check` tests on the platform."""
    return torch.addmm(hi, xa, wt, beta=-1)


# the bf16 temporaries of one block of rows of the CPU path's products, at most (about)
_GEMM_CHUNK_BYTES = 64 << 20


def split_reference(x2: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(bf16(x), bf16(x - bf16(x)))`` of fp32 samples, the second None where it is zero
    everywhere (``x - bf16(x)``: NaN where x is, inf - inf, taken as 0)."""
    x16 = x2.to(torch.bfloat16)
    d = (x2 - x16.to(x2.dtype)).nan_to_num_(nan=0.0)  # (inf - inf: an infinite x is x16's)
    return x16, (d.to(torch.bfloat16) if bool(d.any()) else None)


def join_reference(hi: torch.Tensor, r: torch.Tensor, dp: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 product from the bf16 GEMMs' parts: ``hi + r (+ dp)``, in that order (``r`` is
    NaN only where ``hi`` is not finite, ``S - hi = inf - inf``: ``hi`` is the fp32 path's value
    there); into ``out`` where given."""
    if out is None:
        out = hi.float()
    else:
        out.copy_(hi)
    _add_widened(out, r, nan_to_zero=True)
    if dp is not None:
        _add_widened(out, dp)
    return out


# rows of an fp32 temporary of at most this many bytes: glibc serves larger blocks with fresh
# mmaps, page-faulted in at every call (a 32000-word vocabulary's logits of 384 rows: 49 MB)
_CHUNK_BYTES = 16 << 20


def _add_widened(out: torch.Tensor, part: torch.Tensor, nan_to_zero: bool = False) -> None:
    """``out += part`` (fp32 += bf16) through fp32 copies of row blocks (a bf16 operand in an
    fp32 ``add_`` takes a slow mixed-dtype loop; a whole copy of a vocabulary-wide product is
    an mmap faulted in at every call)."""
    rows = max(1, _CHUNK_BYTES // max(1, 4 * out.shape[1]))
    for a in range(0, out.shape[0], rows):
        wide = part[a:a + rows].float()
        if nan_to_zero:
            wide.nan_to_num_(nan=0.0)
        out[a:a + rows] += wide


def _with_bias(w16: torch.Tensor, b16: torch.Tensor) -> torch.Tensor:
    """``[w | b]``, kept on the twin ``w16`` is (or is a transpose of: a new view at every call)
    while ``b16`` is the same tensor (a weight's twin) at the same version."""
    try:
        version = b16._version
    except RuntimeError:  # an inference tensor: no version to trust
        return torch.cat([w16, b16.reshape(-1, 1)], 1)
    owner = w16 if w16._base is None else w16._base
    kept = getattr(owner, "_fxstab_with_bias", None)
    if kept is not None and kept[0] is b16 and kept[1] == version and \
            kept[2] == w16.stride():
        return kept[3]
    aug = torch.cat([w16, b16.reshape(-1, 1)], 1)
    owner._fxstab_with_bias = (b16, version, w16.stride(), aug)
    return aug
