"""Per-primitive rules of the arithmetic level (DESIGN.md §3 ``aten``, §4, §5).

One function, :func:`apply_primitive`, runs one aten primitive on stacked samples and applies
every rule of the arithmetic level to it; the eager driver (:mod:`fxstab.stochastic`) and the
graph interpreter (``granularity="aten"`` in the backend) both call it, node by node:

* Arguments that carry samples are :class:`Stacked` (a tensor ``[N, ...]`` plus cached per-element
  digits); everything else (plain tensors, numbers, lists, dtypes) is unstacked and broadcast
  across samples. Floating plain tensors are exact data: identical samples.
* The primitive runs on all samples at once: pointwise primitives directly (ranks aligned),
  common views, reductions and GEMMs by shifting their dimension arguments, the rest through
  ``torch.vmap``; a primitive that cannot be batched runs once per sample, unrounded, and its
  record says ``unlifted``. Integer and boolean results pass through unrounded.
* Every floating result of an arithmetic primitive is rounded into the format (``random``
  rounding by default, one seed per call from :func:`fxstab.randbits.derive_seed`) and its digit
  statistics are recorded. Data movement and selection primitives (views, cat, index, neg, abs,
  max/min, where...) are exact: not rounded, not recorded, but their counters run.
* GEMM-like primitives (mm, bmm, addmm, baddbmm, convolution, SDPA kernels) are trusted: stacked
  operands whose samples are insufficiently separated get the data-perturbation surrogate with
  eta = the format's unit roundoff, then the product is rounded; the record says ``surrogate``.
  Plain operands (weights, constants) are not perturbed: perturbing one operand of a product by a
  relative eta already moves each output by eta times its condition-weighted magnitude, which is
  what the surrogate exists to expose, and it halves the cost.
* Comparisons follow CESTAC (CADNA's semantics): they return one *plain* boolean tensor decided
  on the samples' mean difference, ``a == b`` when ``a - b`` is an exact or computational zero,
  ``a < b`` when the mean difference is negative and not a computational zero, ``a <= b`` when
  it is negative or a computational zero. Every sample then takes the same branch, as in CADNA's
  synchronous arithmetic, and a computational-zero difference counts as unstable branching.
* CADNA's counters (:mod:`fxstab.counters`) are computed from the per-element digits the rules
  already have.

Randomness: ``randomness="fast"`` (default) draws the rounding directions and surrogate factors
from a ``torch.Generator`` seeded per call (one uint8 per 8 elements; the CESTAC cross-sample
scheme of :func:`fxstab.rounding.sample_draws` is kept); ``randomness="philox"`` uses
:func:`fxstab.rounding.round_samples` and :func:`fxstab.surrogate.perturb_samples`, the plain-torch
references of the Triton kernels, bit for bit (about 50x slower on a CPU).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree

from . import randbits
from .counters import CounterEvent, Counters, active_collectors, check_diagnostics
from .digits import ZERO_THRESHOLD, DigitStats, student_t
from .formats import Format, FormatLike, get_format, working_dtype_for
from .report import OBSERVED, ROUNDED, UNLIFTED, OpReport, empty_counters
from .rounding import Rounding, _WORKING, round_samples, sample_draws
from .surrogate import perturb_samples

aten = torch.ops.aten

__all__ = ["Stacked", "AtenContext", "PrimitiveRecord", "apply_primitive", "round_stacked",
           "primitive_kind", "GEMM_PRIMITIVES", "EXACT_PRIMITIVES", "to_op_report"]


# --------------------------------------------------------------------------- op classes
def primitive_kind(op: Any) -> str:
    """Short name of an aten overload: ``aten.add.Tensor`` -> ``add``."""
    packet = getattr(op, "overloadpacket", None)
    name = packet.__name__ if packet is not None else getattr(op, "__name__", str(op))
    return name.split(".")[0]


GEMM_PRIMITIVES = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "convolution",
    "_convolution", "conv1d", "conv2d", "conv3d", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "scaled_dot_product_attention",
    "_scaled_dot_product_attention_math",
})
# Exact primitives: the result is (a selection of) input values, so rounding is the identity.
EXACT_PRIMITIVES = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "unsqueeze",
    "squeeze", "select", "slice", "clone", "contiguous", "alias", "detach", "lift_fresh_copy",
    "cat", "stack", "split", "split_with_sizes", "chunk", "unbind", "index", "index_select",
    "gather", "narrow", "flatten", "unflatten", "repeat", "roll", "flip", "diagonal", "as_strided",
    "_to_copy", "to", "copy", "convert_element_type", "neg", "abs", "maximum", "minimum", "max", "min", "amax", "amin",
    "clamp", "clamp_min", "clamp_max", "relu", "threshold", "hardtanh", "where", "masked_fill",
    "constant_pad_nd", "sort", "topk", "embedding", "scatter", "slice_scatter", "select_scatter",
    "index_put", "fill", "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros",
    "new_ones", "new_full", "new_empty", "floor", "ceil", "trunc", "round", "sign", "sgn",
    "_reshape_alias", "view_as", "expand_as", "movedim", "squeeze_copy", "unsqueeze_copy",
    "view_copy", "permute_copy", "t_copy", "transpose_copy", "expand_copy", "detach_copy",
    "pixel_shuffle", "broadcast_in_dim", "collapse_view", "split_dim", "squeeze_copy", "max_pool2d_with_indices", "max_pool1d", "max_pool2d", "repeat_interleave",
})
_ADD = frozenset({"add", "sub", "rsub"})
_DIV = frozenset({"div", "reciprocal", "remainder", "fmod", "floor_divide"})
_POW = frozenset({"pow", "float_power"})
_MATH = frozenset({
    "sqrt", "rsqrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan",
    "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc",
    "erfinv", "sigmoid", "lgamma", "digamma", "atan2", "logit", "special_erfcx", "xlogy",
})
_ROUNDING_INTRINSICS = frozenset({"floor", "ceil", "trunc", "round", "sign", "sgn", "frac"})
_COMPARE = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
            "less": "lt", "less_equal": "le", "greater": "gt", "greater_equal": "ge",
            "not_equal": "ne"}
_SELECT2 = frozenset({"maximum", "minimum", "fmax", "fmin"})
# Tensor factories (no arithmetic: their values are constants or uninitialised memory).
_FACTORY_PREFIXES = ("empty", "zeros", "ones", "full", "arange", "scalar_tensor", "new_",
                     "eye", "linspace", "logspace")
_REDUCE_SUM = frozenset({"sum", "mean", "nansum"})


# --------------------------------------------------------------------------- stacked values
class Stacked:
    """Samples ``[N, ...]`` of one value, with its per-element digits cached once computed.

    The graph interpreter keeps these in its environment so each primitive's output is analysed
    once and its digits serve as operand digits of the consumers (cancellation counters).
    """

    __slots__ = ("samples", "_an")

    def __init__(self, samples: torch.Tensor, analysis: Optional["_Analysis"] = None):
        self.samples = samples
        self._an = analysis

    @property
    def shape(self) -> torch.Size:
        """Logical shape (without the sample dimension)."""
        return self.samples.shape[1:]

    @property
    def ndim(self) -> int:
        return self.samples.dim() - 1

    def analysis(self, ctx: "AtenContext") -> "_Analysis":
        if self._an is None:
            self._an = _analyze(self.samples, ctx)
        return self._an

    def __repr__(self) -> str:
        return f"Stacked(shape={tuple(self.shape)}, n={self.samples.shape[0]}, dtype={self.samples.dtype})"


@dataclass
class _Analysis:
    digits: torch.Tensor  # [...] float
    zero: torch.Tensor  # computational zeros
    exact_zero: torch.Tensor
    finite: torch.Tensor
    identical: torch.Tensor


def _analyze(s: torch.Tensor, ctx: "AtenContext") -> _Analysis:
    """Per-element CESTAC digits (DESIGN.md §2) and the masks the counters need, in one go."""
    if not s.is_floating_point():
        shape = s.shape[1:]
        ident = (s == s[:1]).all(0)
        z = torch.zeros(shape, dtype=torch.bool, device=s.device)
        d = torch.where(ident, ctx.cap, 0.0).to(ctx.working_dtype)
        return _Analysis(d, z, (s == 0).all(0), ~z, ident)
    if s[0].numel() == 0:  # an empty output (e.g. a zero-size batch): nothing to measure
        e = torch.zeros(s.shape[1:], dtype=torch.bool, device=s.device)
        return _Analysis(torch.zeros(s.shape[1:], dtype=ctx.working_dtype, device=s.device),
                         e, e, ~e, ~e)
    mn, mx = torch.aminmax(s, dim=0)
    spread = mx - mn
    identical = spread == 0
    finite = (spread * 0) == 0  # x*0 == 0 exactly when x is finite (torch.isfinite is slower)
    mean = s.mean(0)
    rel = (s - mean) * (1.0 / mean.abs())
    var = (rel * rel).sum(0)
    # identical samples give var == 0 (or a rounding residue of the mean) -> +inf -> cap below
    d = torch.log10(var).mul_(-0.5).add_(ctx._dconst)
    d = torch.nan_to_num_(d, nan=0.0, posinf=ctx.cap, neginf=0.0).clamp_(0.0, ctx.cap)
    d = torch.where(identical & finite, ctx.cap, d)
    exact_zero = identical & (mx == 0)
    zero = finite & ~exact_zero & (d < ctx.zero_threshold)
    return _Analysis(d, zero, exact_zero, finite, identical)


# --------------------------------------------------------------------------- context
@dataclass
class PrimitiveRecord:
    """What one primitive call looked like: the unit a recorder receives."""

    name: str
    primitive: str
    kind: str
    stats: Optional[DigitStats]
    counters: dict
    surrogate: bool = False
    status: str = ROUNDED
    shape: tuple = ()
    events: list = field(default_factory=list)


@dataclass
class AtenContext:
    """Configuration and running state shared by the primitives of one analysed call.

    Args:
        format: Simulated format (name, pair, dtype or Format).
        n_samples: N >= 2 samples.
        seed: Base seed; call ``k`` of the context rounds with ``derive_seed(seed, k)`` unless the
            caller passes its own ``salt``.
        rounding: Rounding mode of every result (``random``: CESTAC).
        confidence: Student-t confidence of the digits.
        diagnostics: ``off`` | ``summary`` | ``detailed`` (counters, DESIGN.md §5).
        cancel_digits: Digits an add/sub must lose to count as a cancellation (CADNA: 4).
        zero_threshold: Digits below which a value is a computational zero (0.5).
        recorder: Called with a :class:`PrimitiveRecord` for every recorded primitive.
        randomness: ``fast`` (torch generator) or ``philox`` (bit-exact kernel references).
        record_exact: Also record digit statistics of exact primitives (views, selections).
    """

    format: FormatLike = "fp32"
    n_samples: int = 3
    seed: int = 0
    rounding: str | Rounding = "random"
    confidence: float = 0.95
    diagnostics: str = "summary"
    cancel_digits: float = 4.0
    zero_threshold: float = ZERO_THRESHOLD
    recorder: Optional[Callable[[PrimitiveRecord], None]] = None
    randomness: str = "fast"
    record_exact: bool = False
    counters: Counters = field(init=False)
    calls: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.fmt: Format = get_format(self.format)
        self.rounding = Rounding.parse(self.rounding)
        if isinstance(self.n_samples, bool) or not isinstance(self.n_samples, int) or self.n_samples < 2:
            raise ValueError(f"n_samples must be an integer >= 2, got {self.n_samples!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        check_diagnostics(self.diagnostics)
        if self.randomness not in ("fast", "philox"):
            raise ValueError(f"randomness must be 'fast' or 'philox', got {self.randomness!r}")
        if not self.cancel_digits > 0:
            raise ValueError(f"cancel_digits must be > 0, got {self.cancel_digits!r}")
        self.working_dtype = working_dtype_for(self.fmt)
        # fp64 format in fp64: rounding needs the exact result's side (error-free transforms)
        self.eft = (self.working_dtype == torch.float64 and self.fmt.man_bits == 52
                    and self.rounding is Rounding.RANDOM and self.randomness == "fast")
        self.cap = self.fmt.digit_cap
        t = student_t(self.n_samples, self.confidence)
        n = self.n_samples
        self._dconst = math.log10(math.sqrt(n * (n - 1)) / t)
        self.counters = Counters("detailed" if self.diagnostics == "detailed" else "summary")
        self._occurrence: dict[str, int] = {}

    def next_seed(self, salt: Optional[int] = None) -> int:
        self.calls += 1
        return randbits.derive_seed(self.seed, self.calls if salt is None else salt)

    def name_for(self, op: Any) -> str:
        kind = primitive_kind(op)
        k = self._occurrence.get(kind, 0)
        self._occurrence[kind] = k + 1
        return f"aten.{kind}#{k}"

    def stack(self, x: torch.Tensor) -> Stacked:
        """N identical samples of ``x`` (exact data), in the working dtype when floating."""
        if x.is_floating_point():
            x = x.to(self.working_dtype)
        return Stacked(x.unsqueeze(0).expand(self.n_samples, *x.shape).contiguous())


# --------------------------------------------------------------------------- rounding
def round_stacked(samples: torch.Tensor, fmt: Format, mode: Rounding, seed: int,
                  randomness: str = "fast") -> torch.Tensor:
    """Round stacked samples into ``fmt`` with the cross-sample scheme of DESIGN.md §1.

    The fast path (random mode) truncates the low bits of the working dtype to get the lower
    neighbour in magnitude and adds one quantum for the upper one; it is exact for values in the
    format's normal range (and for zeros), and hands any tensor holding subnormals, values near
    overflow, inf or NaN to :func:`fxstab.rounding.round_samples`, which models the whole range.
    """
    if randomness == "philox" or mode is not Rounding.RANDOM or samples.dtype not in _WORKING \
            or samples.numel() == 0:
        return round_samples(samples, fmt, mode, seed)
    int_dtype, wm, wbias, wones = _WORKING[samples.dtype][:4]
    n = samples.shape[0]
    x = samples.contiguous()
    bits = x.view(int_dtype)
    e = (bits >> wm) & wones
    lo_e, hi_e = fmt.emin + wbias, fmt.emax + wbias
    # zeros (e == 0 and no mantissa) are exact; count them as in range
    emin_seen, emax_seen = torch.aminmax(e)
    if int(emax_seen) >= hi_e:  # inf/NaN or the format's top binade (overflow): full model
        return round_samples(samples, fmt, mode, seed)
    shift = wm - fmt.man_bits
    mask = (1 << shift) - 1
    rem = bits & mask
    lo = bits - rem
    up = _random_up(n, x[0].numel(), seed, x.device).reshape(x.shape)
    out = torch.where(up & (rem != 0), lo + (1 << shift), lo).view(samples.dtype)
    if int(emin_seen) < lo_e and fmt.emin > 1 - wbias:
        # below the format's normal range the quantum is the fixed min_subnormal q: scale by
        # 1/q (exact, a power of two), truncate, step away from zero when rounding up. (A format
        # whose emin is the working dtype's, like bf16 in fp32, shares its subnormal grid: the
        # constant mask above is already right there.)
        q = fmt.min_subnormal
        y = x * (1.0 / q)
        t = torch.trunc(y)
        sub = torch.where(up & (t != y), t + torch.sign(y), t) * q
        out = torch.where(e < lo_e, sub, out)
    return out


def _random_up(n: int, numel: int, seed: int, device, extra_draws: int = 0) -> torch.Tensor:
    """Rounding directions [N (+extra), numel] (bool) with CADNA's cross-sample scheme.

    ``extra_draws`` appends that many independent rows (used by the fp64 path for a shared
    direction)."""
    draws, flips = sample_draws(n)
    ndraw = max(draws) + 1 + extra_draws
    gen = torch.Generator(device=device)
    gen.manual_seed(seed & ((1 << 63) - 1))
    nbytes = (numel + 7) // 8
    words = torch.randint(0, 256, (ndraw, nbytes), generator=gen, dtype=torch.uint8, device=device)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    rb = ((words.unsqueeze(-1) >> shifts) & 1).reshape(ndraw, nbytes * 8)[:, :numel]
    flip = torch.tensor(flips + [False] * extra_draws, dtype=torch.uint8, device=device).reshape(-1, 1)
    idx = torch.tensor(draws + list(range(max(draws) + 1, ndraw)), device=device)
    return (rb[idx] ^ flip).bool()


# Error-free transformations for the fp64 format (DESIGN.md §1): the working dtype is the
# format, so the side of the exact result must be computed, not read off extra bits.
_SPLIT = 134217729.0  # 2**27 + 1, Veltkamp's splitter for binary64


def _two_prod_err(a: torch.Tensor, b: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """a*b - p exactly (Dekker), p = fl(a*b); valid without overflow in the splitting."""
    ca = _SPLIT * a
    ah = ca - (ca - a)
    al = a - ah
    cb = _SPLIT * b
    bh = cb - (cb - b)
    bl = b - bh
    return al * bl - (((p - ah * bh) - al * bh) - ah * bl)


def _fp64_side(kind: str, op, args: tuple, kwargs: dict, y: torch.Tensor) -> Optional[torch.Tensor]:
    """Sign of (exact result - y) for add/sub/mul/div/sqrt in fp64, or None if unknown."""
    name = getattr(op, "_overloadname", "")
    if kind in ("add", "sub", "rsub"):
        if kwargs.get("alpha", args[2] if len(args) > 2 else 1) != 1:
            return None
        a, b = _aligned(args[:2], y.dim() - 1)
        a = torch.as_tensor(a, dtype=y.dtype, device=y.device)
        b = torch.as_tensor(b, dtype=y.dtype, device=y.device)
        if kind == "sub":
            b = -b
        elif kind == "rsub":
            a, b = b, -a
        bb = y - a
        err = (a - (y - bb)) + (b - bb)
        return torch.sign(err)
    if kind == "mul":
        a, b = (torch.as_tensor(v, dtype=y.dtype, device=y.device)
                for v in _aligned(args[:2], y.dim() - 1))
        return torch.sign(_two_prod_err(a, b, y))
    if kind == "div" and name in ("Tensor", "Scalar") and not kwargs.get("rounding_mode"):
        a, b = (torch.as_tensor(v, dtype=y.dtype, device=y.device)
                for v in _aligned(args[:2], y.dim() - 1))
        ph = y * b
        r = (a - ph) - _two_prod_err(y, b, ph)
        return torch.sign(r) * torch.sign(b)
    if kind == "reciprocal":
        b = args[0].samples
        ph = y * b
        return torch.sign((1.0 - ph) - _two_prod_err(y, b, ph)) * torch.sign(b)
    if kind == "sqrt":
        a = args[0].samples
        ph = y * y
        return torch.sign((a - ph) - _two_prod_err(y, y, ph))
    return None


def _round_fp64(kind: str, op, args: tuple, kwargs: dict, y: torch.Tensor, seed: int) -> torch.Tensor:
    """Random rounding in the fp64 format on fp64 results (already rounded to nearest).

    With the exact side known (TwoSum/TwoProd), a sample keeps y or moves to the neighbour on the
    exact result's side, each with probability 1/2 (exactly CESTAC's random rounding). For other
    primitives the side is unknown: one shared random side per element stands in for it, so a
    result moves by at most one unit in the last place, as a rounding error would.
    """
    n = y.shape[0]
    numel = y[0].numel()
    side = _fp64_side(kind, op, args, kwargs, y)
    rnd = _random_up(n, numel, seed, y.device, extra_draws=1 if side is None else 0)
    up = rnd[:n].reshape(y.shape)
    if side is None:
        shared = rnd[n:].reshape((1,) + y.shape[1:])
        side = torch.where(shared, 1.0, -1.0).to(y.dtype)
        moved = torch.nextafter(y, side * math.inf)
        return torch.where(up & torch.isfinite(y), moved, y)
    side = side.expand(y.shape) if side.shape != y.shape else side
    moved = torch.nextafter(y, side * math.inf)
    return torch.where(up & (side != 0) & torch.isfinite(y), moved, y)


def _perturb(samples: torch.Tensor, eta: float, seed: int, randomness: str) -> tuple[torch.Tensor, int]:
    if randomness == "philox":
        return perturb_samples(samples, eta, seed)
    mean = samples.mean(0)
    spread = (samples - mean).abs().amax(0)
    close = spread <= eta * mean.abs()
    count = int(close.sum())
    if count == 0:
        return samples, 0
    gen = torch.Generator(device=samples.device)
    gen.manual_seed(seed & ((1 << 63) - 1))
    # r uniform in [-1, 1) on a 2**-23 grid, as the reference draws it, so eta*r is exact
    r = torch.randint(0, 1 << 24, samples.shape, generator=gen, device=samples.device,
                      dtype=torch.int64).to(samples.dtype) * (2.0 ** -23) - 1.0
    return torch.where(close, samples * (1.0 + eta * r), samples), count


# --------------------------------------------------------------------------- batching
def _norm_dim(d: int, ndim: int) -> int:
    return d + 1 if d >= 0 else d + ndim + 1


def _dims(dim, ndim: int):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(1, ndim + 1))
    if isinstance(dim, (list, tuple)):
        return [_norm_dim(d, ndim) for d in dim]
    return _norm_dim(dim, ndim)


def _with(args: tuple, i: int, value) -> tuple:
    return args[:i] + (value,) + args[i + 1:]


def _samples_or(x, n: int):
    return x.samples if isinstance(x, Stacked) else x


def _aligned(args: tuple, ndim_out: int) -> tuple:
    """Stacked samples reshaped to [N, 1.., *shape] so they broadcast like their logical shapes."""
    out = []
    for a in args:
        if isinstance(a, Stacked):
            s = a.samples
            k = ndim_out - (s.dim() - 1)
            if k > 0:
                s = s.reshape(s.shape[:1] + (1,) * k + s.shape[1:])
            out.append(s)
        else:
            out.append(a)
    return tuple(out)


def _logical_ndim(args) -> int:
    nd = 0
    for a in args:
        if isinstance(a, Stacked):
            nd = max(nd, a.ndim)
        elif isinstance(a, torch.Tensor):
            nd = max(nd, a.dim())
    return nd


def _special(op, kind: str, args: tuple, kwargs: dict):
    """Batched evaluation of hot non-pointwise primitives without vmap, or ``NotImplemented``."""
    if kwargs and kind not in ("sum", "mean", "amax", "amin", "var", "_softmax", "_log_softmax"):
        return NotImplemented
    if any(isinstance(v, Stacked) for v in kwargs.values()):
        return NotImplemented
    a0 = args[0] if args else None
    if kind in ("mm", "bmm", "matmul"):
        a, b = (_samples_or(x, 0) for x in args[:2])
        if isinstance(args[0], Stacked) and isinstance(args[1], Stacked) and kind == "mm":
            return torch.bmm(a, b)
        return torch.matmul(a, b)
    if kind == "addmm":
        bias, m1, m2 = args[:3]
        beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
        alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
        prod = torch.matmul(_samples_or(m1, 0), _samples_or(m2, 0))
        if alpha != 1:
            prod = prod * alpha
        b = _aligned((bias,), 2)[0]
        if beta != 1:
            b = b * beta
        return prod + b
    if not isinstance(a0, Stacked):
        return NotImplemented
    nd = a0.ndim
    s = a0.samples
    rest = args[1:]
    if kind in ("view", "_unsafe_view", "reshape", "expand") and len(rest) == 1 and not isinstance(rest[0], Stacked):
        size = list(rest[0])
        return op(s, [s.shape[0]] + size) if kind != "expand" else s.expand([s.shape[0]] + size)
    if kind == "permute":
        return s.permute([0] + [_norm_dim(d, nd) for d in rest[0]])
    if kind == "transpose":
        return s.transpose(_norm_dim(rest[0], nd), _norm_dim(rest[1], nd))
    if kind == "t":
        return s.transpose(1, 2) if nd == 2 else s
    if kind == "unsqueeze":
        return s.unsqueeze(_norm_dim(rest[0], nd + 1))
    if kind in ("clone", "alias", "detach", "lift_fresh_copy", "contiguous"):
        return s.clone()
    if kind == "select":
        return s.select(_norm_dim(rest[0], nd), rest[1])
    if kind == "slice" and len(rest) >= 1:
        dim = _norm_dim(rest[0], nd)
        start = rest[1] if len(rest) > 1 else None
        end = rest[2] if len(rest) > 2 else None
        step = rest[3] if len(rest) > 3 else 1
        return op(s, dim, start, end, step)
    if kind in ("sum", "mean", "amax", "amin") and not any(isinstance(r, Stacked) for r in rest):
        dim = rest[0] if rest else kwargs.get("dim", None)
        keepdim = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
        extra = {k: v for k, v in kwargs.items() if k == "dtype"}
        dims = _dims(dim, nd)
        if kind in ("amax", "amin"):
            return getattr(torch, kind)(s, dims, keepdim)
        if isinstance(dims, int):
            dims = [dims]
        if not dims:
            return s.clone()
        return getattr(torch, kind)(s, dims, keepdim, **extra)
    if kind in ("_softmax", "_log_softmax", "cumsum") and len(rest) >= 1:
        return op(s, _norm_dim(rest[0], nd), *rest[1:], **kwargs)
    return NotImplemented


def _run_per_sample(op, args, kwargs, n):
    def pick(k):
        return lambda x: x.samples[k] if isinstance(x, Stacked) else x
    results = []
    for k in range(n):
        a, kw = pytree.tree_map(pick(k), (args, kwargs), is_leaf=lambda x: isinstance(x, Stacked))
        results.append(op(*a, **kw))
    flat0, spec = pytree.tree_flatten(results[0])
    flats = [pytree.tree_flatten(r)[0] for r in results]
    out = []
    for j, v in enumerate(flat0):
        if isinstance(v, torch.Tensor) and all(f[j].shape == v.shape for f in flats):
            out.append(torch.stack([f[j] for f in flats]))
        else:
            out.append(v)
    return pytree.tree_unflatten(out, spec)


def _run_batched(op, kind: str, args: tuple, kwargs: dict, n: int):
    """Run ``op`` on all samples; returns (outputs with sample dim, lifted)."""
    stacked_kw = any(isinstance(v, Stacked) for v in pytree.tree_leaves(
        kwargs, is_leaf=lambda x: isinstance(x, Stacked)))
    if torch.Tag.pointwise in getattr(op, "tags", ()) and not stacked_kw:
        nd = _logical_ndim(args)
        return op(*_aligned(args, nd), **kwargs), True
    res = _special(op, kind, args, kwargs)
    if res is not NotImplemented:
        return res, True
    if not stacked_kw:
        in_dims = tuple(pytree.tree_map(lambda x: 0 if isinstance(x, Stacked) else None, a,
                                        is_leaf=lambda x: isinstance(x, Stacked)) for a in args)
        plain = pytree.tree_map(lambda x: x.samples if isinstance(x, Stacked) else x, args,
                                is_leaf=lambda x: isinstance(x, Stacked))
        try:
            return torch.vmap(functools.partial(op, **kwargs), in_dims=in_dims)(*plain), True
        except Exception:  # noqa: BLE001 - any failure falls back to per-sample execution
            pass
    return _run_per_sample(op, args, kwargs, n), False


# --------------------------------------------------------------------------- counters
def _bcount(mask: torch.Tensor, out_numel: int) -> torch.Tensor:
    """Number of output elements a broadcast mask covers (each mask element repeats equally)."""
    m = mask.numel()
    f = out_numel // m if m else 0
    return mask.sum() * f


def _operand(x, ctx) -> Optional[_Analysis]:
    return x.analysis(ctx) if isinstance(x, Stacked) and x.samples.is_floating_point() else None


def _diff_analysis(a, b, ctx, nd) -> Optional[_Analysis]:
    """Analysis of a - b (unrounded, on the samples) for comparison-like primitives."""
    if not isinstance(a, Stacked) and not isinstance(b, Stacked):
        return None
    x, y = _aligned((a, b), nd)
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and \
            (not isinstance(y, torch.Tensor) or not y.is_floating_point()):
        return None
    return _analyze(torch.sub(x, y) if isinstance(x, torch.Tensor) else torch.rsub(y, x), ctx)


def _compute_counters(kind: str, args: tuple, kwargs: dict, out: Optional[Stacked],
                      out_numel: int, ctx: AtenContext, diff: Optional[_Analysis]):
    """Masks (or counts) of the counters this primitive triggers: list of (key, mask)."""
    found = []
    oa = out.analysis(ctx) if out is not None and out.samples.is_floating_point() else None
    if kind in _ADD and oa is not None:
        ops = [_operand(x, ctx) for x in args[:2]]
        ds = [o.digits for o in ops if o is not None]
        if ds:
            ref = ds[0] if len(ds) == 1 else torch.minimum(ds[0], ds[1])
            found.append(("cancellation", oa.digits <= ref - ctx.cancel_digits))
    elif kind in _REDUCE_SUM and oa is not None and isinstance(args[0], Stacked):
        a = args[0].analysis(ctx)
        nd = args[0].ndim
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        if dim is None or (isinstance(dim, (list, tuple)) and not dim):
            ref = a.digits.amin() if nd else a.digits
        else:
            dims = [d % nd for d in (dim if isinstance(dim, (list, tuple)) else [dim])] if nd else []
            ref = a.digits.amin(dim=dims, keepdim=bool(keepdim)) if dims else a.digits
        found.append(("cancellation", oa.digits <= ref - ctx.cancel_digits))
    elif kind in _DIV:
        if kind == "reciprocal":
            o = _operand(args[0], ctx)
        else:
            o = _operand(args[1], ctx) if len(args) > 1 else None
        if o is not None:
            found.append(("division", o.zero))
    elif kind == "mul":
        oa_, ob_ = (_operand(x, ctx) for x in args[:2])
        if oa_ is not None and ob_ is not None:
            found.append(("multiplication", oa_.zero & ob_.zero))
    elif kind in _POW:
        zs = [o.zero for o in (_operand(x, ctx) for x in args[:2]) if o is not None]
        if zs:
            found.append(("power", zs[0] if len(zs) == 1 else zs[0] | zs[1]))
    elif kind in _MATH:
        zs = [o.zero for o in (_operand(x, ctx) for x in args[:2]) if o is not None]
        if zs:
            found.append(("math_function", zs[0] if len(zs) == 1 else zs[0] | zs[1]))
    elif kind == "abs" and isinstance(args[0], Stacked) and args[0].samples.is_floating_point():
        s = args[0].samples
        found.append(("intrinsic", (s > 0).any(0) & (s < 0).any(0)))
    elif kind in _ROUNDING_INTRINSICS and out is not None:
        found.append(("intrinsic", ~out.analysis(ctx).identical))
    elif kind in ("_to_copy", "to") and out is not None and not out.samples.is_floating_point() \
            and isinstance(args[0], Stacked) and args[0].samples.is_floating_point():
        found.append(("intrinsic", ~out.analysis(ctx).identical))
    elif kind in _COMPARE or kind in _SELECT2 or kind in ("clamp", "clamp_min", "clamp_max"):
        if diff is not None:
            found.append(("branching", diff.zero))
    elif kind in ("relu", "threshold", "hardtanh") and isinstance(args[0], Stacked):
        if kind == "relu":
            found.append(("branching", args[0].analysis(ctx).zero))
        else:
            lim = args[1] if len(args) > 1 else (-1.0 if kind == "hardtanh" else 0.0)
            d = _diff_analysis(args[0], lim, ctx, args[0].ndim)
            if d is not None:
                found.append(("branching", d.zero))
    elif kind == "where" and isinstance(args[0], Stacked):
        c = args[0].samples
        found.append(("branching", c.any(0) & ~c.all(0)))
    if oa is not None and not bool(oa.finite.all()):
        bad = ~oa.finite
        for x in pytree.tree_leaves(args, is_leaf=lambda v: isinstance(v, Stacked)):
            o = _operand(x, ctx)
            if o is not None:
                fin = o.finite
            elif isinstance(x, torch.Tensor) and x.is_floating_point():
                fin = torch.isfinite(x)
            elif isinstance(x, float):
                fin = torch.tensor(math.isfinite(x))
            else:
                continue
            try:  # elementwise when the operand broadcasts to the output, else as a whole
                torch.broadcast_shapes(fin.shape, bad.shape)
            except RuntimeError:
                fin = fin.all()
            bad = bad & fin
        found.append(("anomaly", bad))
    return found


# --------------------------------------------------------------------------- the rule
def _cestac_compare(kind: str, diff: _Analysis, mean_diff: torch.Tensor) -> torch.Tensor:
    equal = diff.exact_zero | diff.zero
    c = _COMPARE[kind]
    if c == "eq":
        return equal
    if c == "ne":
        return ~equal
    if c == "lt":
        return (mean_diff < 0) & ~equal
    if c == "le":
        return (mean_diff < 0) | equal
    if c == "gt":
        return (mean_diff > 0) & ~equal
    return (mean_diff > 0) | equal


def _fix_dtype_kwargs(kind: str, kwargs: dict, ctx: AtenContext) -> dict:
    dt = kwargs.get("dtype")
    if isinstance(dt, torch.dtype) and dt.is_floating_point:
        kwargs = dict(kwargs)
        if kind in ("_to_copy", "to"):
            kwargs.pop("dtype")
        else:
            kwargs["dtype"] = ctx.working_dtype
    return kwargs


def _to_working(x, ctx):
    if isinstance(x, torch.dtype) and x.is_floating_point:
        return ctx.working_dtype
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != ctx.working_dtype:
        return x.to(ctx.working_dtype)
    return x


def apply_primitive(op: Any, args: tuple, kwargs: Optional[dict], ctx: AtenContext, *,
                    name: Optional[str] = None, salt: Optional[int] = None) -> Any:
    """Run one aten primitive on stacked samples and apply the arithmetic-level rules.

    Args:
        op: An aten ``OpOverload`` (``torch.ops.aten.exp.default``) or another callable.
        args: Positional arguments; :class:`Stacked` where the value carries samples.
        kwargs: Keyword arguments (plain).
        ctx: The :class:`AtenContext` of the analysed call.
        name: Stable name for the record (default ``aten.<kind>#k`` within ``ctx``).
        salt: Seed salt (default: the context's call counter).

    Returns:
        The primitive's outputs with the same structure as ``op``'s, each tensor computed from
        samples as :class:`Stacked` (floating results rounded into the format); comparisons
        return plain boolean tensors (CESTAC decisions); with no stacked argument the primitive
        runs once and returns plain results.
    """
    kwargs = kwargs or {}
    is_stacked = lambda x: isinstance(x, Stacked)  # noqa: E731
    leaves = pytree.tree_leaves((args, kwargs), is_leaf=is_stacked)
    n = ctx.n_samples
    kind = primitive_kind(op)
    from_plain = not any(is_stacked(x) for x in leaves)
    if from_plain:
        # Only plain operands (parameters, constants): run once. An arithmetic result is still
        # a result of the simulated arithmetic, so it enters the samples here (N identical
        # copies, then rounded below); a model whose data all come from parameters (token
        # embeddings) would otherwise never be analysed.
        out = op(*args, **kwargs)
        flat_out = pytree.tree_leaves(out)
        if kind in EXACT_PRIMITIVES or kind.startswith(_FACTORY_PREFIXES) or not any(
                isinstance(v, torch.Tensor) and v.is_floating_point() for v in flat_out):
            return out
    args = tuple(pytree.tree_map(lambda x: _to_working(x, ctx), a) if not is_stacked(a) else a
                 for a in args)
    kwargs = _fix_dtype_kwargs(kind, kwargs, ctx)
    counting = ctx.diagnostics != "off" or bool(active_collectors())
    detailed = ctx.diagnostics == "detailed" or any(c.diagnostics == "detailed" for c in active_collectors())

    # Comparisons: one plain boolean decision per element (CESTAC), branching on noise.
    if kind in _COMPARE and len(args) >= 2:
        nd = _logical_ndim(args[:2])
        diff = _diff_analysis(args[0], args[1], ctx, nd)
        if diff is not None:
            x, y = _aligned(args[:2], nd)
            md = (torch.sub(x, y) if isinstance(x, torch.Tensor) else torch.rsub(y, x)).mean(0)
            result = _cestac_compare(kind, diff, md)
            rec_name = name or ctx.name_for(op)
            if counting:
                _count(kind, [("branching", diff.zero)], result.numel(), None, ctx, rec_name, op,
                       detailed, diff)
            return result

    seed = ctx.next_seed(salt)
    surrogate = False
    if kind in GEMM_PRIMITIVES:
        eta = ctx.fmt.unit_roundoff
        new_args = []
        for i, a in enumerate(args):
            if is_stacked(a) and a.samples.is_floating_point():
                p, cnt = _perturb(a.samples, eta, randbits.derive_seed(seed, 1 + i), ctx.randomness)
                surrogate |= cnt > 0
                a = Stacked(p) if cnt else a
            new_args.append(a)
        args = tuple(new_args)

    if from_plain:
        raw = pytree.tree_map(
            lambda v: _to_working(v, ctx).unsqueeze(0).expand(n, *v.shape).contiguous()
            if isinstance(v, torch.Tensor) and v.is_floating_point() else v, out)
        lifted = True
    else:
        raw, lifted = _run_batched(op, kind, args, kwargs, n)
    exact = kind in EXACT_PRIMITIVES
    do_round = lifted and not exact and ctx.rounding is not None
    flat, spec = pytree.tree_flatten(raw)
    outs = []
    j = 0
    for v in flat:
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n:
            if v.is_floating_point() and do_round and ctx.eft:
                v = _round_fp64(kind, op, args, kwargs, v, randbits.derive_seed(seed, 100 + j))
                j += 1
            elif v.is_floating_point() and do_round:
                v = round_stacked(v, ctx.fmt, ctx.rounding, randbits.derive_seed(seed, 100 + j),
                                  ctx.randomness)
                j += 1
            outs.append(Stacked(v))
        else:
            outs.append(v)
    result = pytree.tree_unflatten(outs, spec)

    first = next((o for o in outs if isinstance(o, Stacked)), None)
    rec_name = None
    want_record = ctx.recorder is not None and first is not None and \
        first.samples.is_floating_point() and (not exact or ctx.record_exact)
    if want_record or counting:
        rec_name = name or ctx.name_for(op)
    found = []
    if counting:
        diff = None
        if kind in _SELECT2 or kind in ("clamp", "clamp_min", "clamp_max"):
            if kind in _SELECT2:
                diff = _diff_analysis(args[0], args[1], ctx, _logical_ndim(args[:2]))
            else:
                lo = args[1] if len(args) > 1 else kwargs.get("min")
                hi = args[2] if len(args) > 2 else kwargs.get("max")
                if kind == "clamp_max":
                    lo, hi = None, lo
                zs = []
                for lim in (lo, hi):
                    if lim is not None:
                        d = _diff_analysis(args[0], lim, ctx, args[0].ndim)
                        if d is not None:
                            zs.append(d.zero)
                if zs:
                    z = zs[0] if len(zs) == 1 else zs[0] | zs[1]
                    diff = _Analysis(z, z, z, z, z)
        out_numel = first.samples[0].numel() if first is not None else 0
        found = _compute_counters(kind, args, kwargs, first, out_numel, ctx, diff)
        counts = _count(kind, found, out_numel, first, ctx, rec_name, op, detailed, None)
    else:
        counts = empty_counters()
    if want_record:
        stats = _stats(first, ctx)
        status = ROUNDED if do_round else (UNLIFTED if not lifted else OBSERVED)
        ctx.recorder(PrimitiveRecord(rec_name, str(op), kind, stats, counts, surrogate, status,
                                     tuple(first.shape), list(getattr(ctx, "_last_events", []))))
    return result


def _count(kind, found, out_numel, out, ctx, rec_name, op, detailed, diff) -> dict:
    counts = empty_counters()
    ctx._last_events = []
    if not found:
        return counts
    vals = torch.stack([_bcount(m, out_numel) for _, m in found]).tolist()
    for (key, mask), v in zip(found, vals):
        v = int(v)
        if v <= 0:
            continue
        counts[key] += v
        ev = None
        if detailed:
            ev = _event(key, mask, v, out, ctx, rec_name, op, diff)
            ctx._last_events.append(ev)
        ctx.counters.add(key, v, ev)
        for c in active_collectors():
            c.add(key, v, ev)
    return counts


def _event(key, mask, count, out, ctx, rec_name, op, diff) -> CounterEvent:
    an = out.analysis(ctx) if out is not None and out.samples.is_floating_point() else diff
    if an is not None:
        shape = torch.broadcast_shapes(mask.shape, an.digits.shape)
        d = torch.where(mask.expand(shape), an.digits.expand(shape), math.inf).reshape(-1)
        idx = int(torch.argmin(d)) if d.numel() else 0
        digits = float(d[idx]) if d.numel() else 0.0
    else:
        m = mask.reshape(-1)
        idx = int(torch.nonzero(m)[0]) if m.any() else 0
        digits = 0.0
    value = math.nan
    if out is not None and out.samples.is_floating_point():
        flat = out.samples.reshape(out.samples.shape[0], -1)
        if idx < flat.shape[1]:
            value = float(flat[:, idx].mean())
    return CounterEvent(key, str(op), rec_name or "", count, idx, value, digits)


def _stats(out: Stacked, ctx: AtenContext) -> DigitStats:
    numel = out.samples[0].numel()
    if numel == 0:
        return DigitStats(ctx.cap, ctx.cap, ctx.cap, 0, 0.0, 0)
    an = out.analysis(ctx)
    d = an.digits
    dmin, dmax = torch.aminmax(d)
    vals = torch.stack([d.sum(dtype=torch.float64), dmin.double(), dmax.double(),
                        an.zero.sum().double(), an.finite.sum().double()]).tolist()
    return DigitStats(vals[0] / numel, vals[1], vals[2], numel, vals[3] / numel,
                      numel - int(vals[4]))


def to_op_report(record: PrimitiveRecord, ctx: AtenContext, *, module_path: str = "",
                 **fields) -> OpReport:
    """An :class:`~fxstab.report.OpReport` for one primitive record."""
    s = record.stats
    rep = OpReport(
        name=record.name if not module_path else f"{module_path}/{record.name}",
        kind=record.kind, module_path=module_path, format=ctx.fmt.name,
        n_samples=ctx.n_samples, surrogate=record.surrogate, status=record.status,
        shape=record.shape, counters=dict(record.counters), **fields)
    if s is not None:
        rep.avg_digits, rep.min_digits, rep.max_digits = s.avg, s.min, s.max
        rep.numel, rep.zero_fraction, rep.non_finite = s.numel, s.zero_fraction, s.non_finite
    return rep
