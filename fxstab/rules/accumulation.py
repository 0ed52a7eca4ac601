"""A GEMM's accumulator on the samples (``fxstab.backend(accumulate=...)``, issue 31).

The operator level runs a modelled GEMM (:data:`~fxstab.rules.lifting.ACCUMULATED_KINDS`) as
:func:`fxstab.numerics.accumulation.emulate_matmul` on the stacked samples: blocks of K summed
exactly, one rounding into the accumulator each; a random rounding draws per sample and
element (CESTAC inside the product), from the call's seed of that operator. A plain operand
broadcasts as one sample: its batch dims are aligned with the stacked operand's logical ones
(the sample dim leads), as ``torch.matmul`` aligns them on one sample. ``conv1d`` and
``conv2d`` run through their GEMM form (im2col: each group's weight times the input's
patches), ``scaled_dot_product_attention`` as its two products around the softmax. On CUDA
the Triton kernel of :mod:`fxstab.kernels.accumulate` computes the product, on the CPU blocked
fp64 products with each block rounded by the fused C kernel (the implementations of
:data:`fxstab.executors.ACCUMULATE`, which chooses among them): the same bits. A nearest or
directed accumulator's samples round randomly and carry its bias (:func:`modelled_gemm`, issue
43).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional

import torch

from .. import executors
from ..executors import fused_rounder, samples_rounder  # noqa: F401 - kept importable here
from ..numerics.accumulation import operand_stats, quantize_operand
from ..numerics.digits import true_digits
from ..numerics.rounding import Rounding
from ..numerics.randbits import derive_seed
from ..config import AnalysisConfig
from .lifting import NodePlan, Stacked

__all__ = ["gemm_operands", "accumulable", "accumulated_product", "modelled_gemm",
           "accumulator_error", "biased_accumulator", "GemmFigures", "merge_operand_stats",
           "sample_accumulator", "bias_weights", "with_bias",
           "gemm_model_label", "fused_rounder", "samples_rounder", "CONV_KINDS",
           "conv_args", "SDPA", "sdpa_args", "BIASED_KINDS"]


# GEMMs that add a tensor to the product: kind -> the names of their two factors
BIASED_KINDS = {"addmm": ("mat1", "mat2"), "baddbmm": ("batch1", "batch2")}


def _linear_operands(a: tuple, kw: dict) -> tuple:
    """linear(x, weight, bias): right is ``weight.T``."""
    w = a[1] if len(a) > 1 else kw["weight"]
    bias = a[2] if len(a) > 2 else kw.get("bias")
    return a[0], w.transpose(-1, -2), bias


def _biased_operands(first: str, second: str) -> Callable[[tuple, dict], tuple]:
    """addmm(input, mat1, mat2): input + mat1 @ mat2 (HF's Conv1D), baddbmm alike."""
    def operands(a: tuple, kw: dict) -> tuple:
        bias = a[0] if a else kw["input"]
        left = a[1] if len(a) > 1 else kw[first]
        right = a[2] if len(a) > 2 else kw[second]
        return left, right, bias

    return operands


def _product_operands(a: tuple, kw: dict) -> tuple:
    """matmul, mm, bmm: the two factors, no bias."""
    other = a[1] if len(a) > 1 else kw.get("other", kw.get("mat2"))
    return a[0], other, None


# kind -> its (left, right, bias) from (args, kwargs); a kind without an entry: the product of
# its first two operands (_product_operands)
_OPERANDS: dict[str, Callable[[tuple, dict], tuple]] = {
    "linear": _linear_operands,
    **{kind: _biased_operands(*factors) for kind, factors in BIASED_KINDS.items()}}


def gemm_operands(a: tuple, kw: dict, kind: str) -> tuple:
    """(left, right, bias) of a modelled GEMM's arguments: right is ``weight.T`` for linear."""
    return _OPERANDS.get(kind, _product_operands)(a, kw)


def _logical_dim(v: Any) -> int:
    if isinstance(v, Stacked):
        return v.samples.dim() - 1
    return v.dim() if isinstance(v, torch.Tensor) else 0


# Convolutions modelled through their GEMM form (im2col): kind -> spatial dims
CONV_KINDS = {"conv1d": 1, "conv2d": 2}
_CONV_ARGS = (("bias", None), ("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1))


def conv_args(a: tuple, kw: dict) -> tuple:
    """(input, weight, bias, stride, padding, dilation, groups) of a ``conv1d``/``conv2d`` call,
    as ``torch.nn.functional`` takes them (defaults filled in)."""
    x = a[0] if a else kw["input"]
    w = a[1] if len(a) > 1 else kw["weight"]
    rest = [a[i + 2] if len(a) > i + 2 else kw.get(name, default)
            for i, (name, default) in enumerate(_CONV_ARGS)]
    return (x, w, *rest)


def _pair(v: Any, dims: int) -> Optional[tuple]:
    """``v`` as ``dims`` ints (an int, a sequence of ints; ``padding="valid"`` is 0), else None."""
    if v == "valid":
        v = 0
    if isinstance(v, int) and not isinstance(v, bool):
        return (v,) * dims
    if isinstance(v, (tuple, list)) and len(v) == dims and all(
            isinstance(i, int) and not isinstance(i, bool) for i in v):
        return tuple(v)
    return None


def _conv_accumulable(a: tuple, kw: dict, kind: str) -> bool:
    dims = CONV_KINDS[kind]
    try:
        x, w, _, stride, padding, dilation, groups = conv_args(a, kw)
    except (IndexError, KeyError):
        return False
    # a batched input (an unbatched one keeps the trusted path)
    return (_logical_dim(x) == dims + 2 and _logical_dim(w) == dims + 2
            and None not in (_pair(stride, dims), _pair(dilation, dims))
            and (padding == "same" or _pair(padding, dims) is not None)
            and isinstance(groups, int))


SDPA = "scaled_dot_product_attention"
_SDPA_ARGS = (("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None),
              ("enable_gqa", False))


def sdpa_args(a: tuple, kw: dict) -> tuple:
    """(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) of a
    ``scaled_dot_product_attention`` call (defaults filled in)."""
    q, k, v = (a[i] if len(a) > i else kw[name] for i, name in
               enumerate(("query", "key", "value")))
    rest = [a[i + 3] if len(a) > i + 3 else kw.get(name, default)
            for i, (name, default) in enumerate(_SDPA_ARGS)]
    return (q, k, v, *rest)


def _sdpa_accumulable(a: tuple, kw: dict, kind: str) -> bool:
    try:
        q, k, v, mask, dropout_p, is_causal, scale, gqa = sdpa_args(a, kw)
    except (IndexError, KeyError):
        return False
    # dropout draws from the RNG as the deterministic pass does: the trusted path keeps it
    return (min(_logical_dim(q), _logical_dim(k), _logical_dim(v)) >= 2
            and isinstance(dropout_p, (int, float)) and dropout_p == 0
            and isinstance(is_causal, bool) and not (is_causal and mask is not None)
            and (mask is None or isinstance(mask, (torch.Tensor, Stacked)))
            and (scale is None or isinstance(scale, (int, float))))


def accumulable(a: tuple, kw: dict, kind: str) -> bool:
    """Whether the accumulator can be modelled for these arguments: both operands with two
    logical dims or more (a 1-D operand's product keeps the trusted path), no ``out=``, no
    ``beta``/``alpha`` other than 1 (addmm, baddbmm); a convolution with a batched input and
    numeric stride, padding and dilation."""
    if "out" in kw or kw.get("beta", 1) != 1 or kw.get("alpha", 1) != 1:
        return False
    return _FORMS.get(kind, _MATMUL).accumulable(a, kw, kind)


def _matmul_accumulable(a: tuple, kw: dict, kind: str) -> bool:
    try:
        x, w, _ = gemm_operands(a, kw, kind)
    except (IndexError, KeyError):
        return False
    return min(_logical_dim(x), _logical_dim(w)) >= 2


def gemm_model_label(acc: Any, inputs: Any, scaling: str) -> str:
    """How a modelled GEMM ran (coverage): its operands' format and scaling, its accumulator."""
    parts = []
    if inputs is not None:
        parts.append(f"operands {inputs.name} ({scaling} scaling)")
    parts.append(f"accumulator {acc.label}" if acc is not None else "exact sum")
    return ", ".join(parts) + " on the samples"


def accumulated_product(a: tuple, kw: dict, kind: str, acc: Any, seed: int,
                        to_working: Callable[[torch.Tensor], torch.Tensor], inputs: Any = None,
                        scaling: str = "tensor", mode: Any = "random",
                        kernels: str = "auto", stats: Optional[list] = None) -> Stacked:
    """The GEMM's samples with the accumulator ``acc`` (None: the exact sum); plain operands
    enter through ``to_working`` (the working dtype). With ``inputs``, each operand's samples
    are first scaled and rounded into that format (``scaling``; each sample its own scales,
    the analysis's rounding ``mode``: the samples draw their own directions). ``kernels``
    picks the implementation (:data:`fxstab.executors.ACCUMULATE`). With ``inputs`` and a ``stats`` list,
    the operands' statistics in that recipe (:func:`~fxstab.numerics.accumulation.
    operand_stats`, of every product's two operands, the first sample's) are appended to it."""
    form = _FORMS.get(kind, _MATMUL)
    return form.product(a, kw, kind, acc, seed, to_working, inputs, scaling, mode, kernels, stats)


def _matmul_product(a: tuple, kw: dict, kind: str, acc: Any, seed: int,
                  to_working: Callable[[torch.Tensor], torch.Tensor], inputs: Any,
                  scaling: str, mode: Any, kernels: str,
                  stats: Optional[list] = None) -> Stacked:
    """A product of two operands (:func:`gemm_operands`: linear, matmul, mm, bmm; addmm and
    baddbmm with their bias added after it), their batch dims aligned."""
    x, w, bias = gemm_operands(a, kw, kind)
    rank = max(_logical_dim(x), _logical_dim(w))

    def aligned(v: Any) -> torch.Tensor:
        t = v.samples if isinstance(v, Stacked) else to_working(v).unsqueeze(0)
        while t.dim() < rank + 1:  # logical batch dims padded after the sample dim
            t = t.unsqueeze(1)
        return t

    left, right = aligned(x), aligned(w)
    y = _samples_product(left, right, acc, seed, inputs, scaling, mode, kernels, stats)
    if bias is not None:
        b = bias.samples if isinstance(bias, Stacked) else to_working(bias)
        while isinstance(bias, Stacked) and b.dim() < y.dim():  # the sample dim leads
            b = b.unsqueeze(1)
        y = y + b
    return Stacked(to_working(y))


def modelled_gemm(a: tuple, kw: dict, plan: NodePlan, cfg: AnalysisConfig, seed: int,
                  to_working: Callable[[torch.Tensor], torch.Tensor],
                  cap: Optional[float] = None) -> tuple[Stacked, Optional[tuple]]:
    """The operator level's modelled GEMM: :func:`accumulated_product` of a call's arguments
    with the accumulator and operand format of its plan (``plan.accumulate``,
    ``plan.gemm_inputs``; ``plan.gemm_scaling`` where the program gives its own) and the
    analysis's settings (``cfg``: the operands' scaling, the rounding mode, the kernels).

    What the samples carry, whatever the accumulator's rounding mode (issue 43):

    * its rounding error: the samples run the accumulator with *random* rounding in its
      format (CESTAC's model of any rounding: each sample draws its own directions in every
      block), whatever mode the hardware rounds in;
    * a nearest or directed mode's bias (and an alignment's truncation,
      ``Accumulation.align``), which no random rounding shows: ``b = D - E`` per output
      element, the hardware's accumulator (``D``, its own mode, aligned) against the exact sum
      (``E``) of the first sample's operands, moves every sample by ``b`` (the samples' mean
      is centred on the hardware's result);
    * the hardware's whole error in the spread: ``t_i (D - X)`` is added to sample ``i``,
      ``X`` the exact product of the first sample's operands as the program gives them (with
      ``gemm_inputs``: before the recipe rounds them, whose saturation rounds every sample
      alike; without, ``X = E``), ``t`` fixed, of mean 0 and sample standard deviation 1
      (:func:`bias_weights`). A sum of such errors downstream adds them sample by sample as
      the hardware's errors add (a fixed ``t``: coherent errors stay coherent, opposite ones
      cancel). Where ``D`` is not finite (an fp16 accumulator past 65504) every sample takes
      it. A random accumulator with ``gemm_inputs`` adds ``t_i (E - X)``, the recipe's part.

    Returns the samples and, with ``cap`` and an accumulator, the accumulator's own error
    (:func:`accumulator_error`): the hardware's accumulator (``D``; a random one: the first
    sample's) against the exact sum of the same operands, with the operands' statistics in
    their recipe and, with ``cap``, the digits the recipe's operands keep of the program's
    product (both exact sums; :class:`GemmFigures`). None without an accumulator and a recipe, or without
    ``cap`` and a recipe."""
    acc, inputs = plan.accumulate, plan.gemm_inputs
    # the operands' scaling: the program's own recipe (a torchao float8 GEMM), else the config's
    scaling = plan.gemm_scaling or cfg.gemm_scaling
    biased = acc is not None and biased_accumulator(acc)
    sampled = sample_accumulator(acc, cfg.rounding) if biased else acc
    stats: Optional[list] = [] if inputs is not None else None
    out = accumulated_product(a, kw, plan.kind, sampled, seed, to_working, inputs,
                              scaling, cfg.rounding, cfg.kernels, stats)
    figures = GemmFigures((math.nan, math.nan), merge_operand_stats(stats)) if stats else None
    figure = acc is not None and cap is not None
    if not (biased or inputs is not None or figure):
        return out, figures
    # the first sample's product, exactly and as the hardware runs it (the first sample's
    # operands alone are those of the stacked first sample: the same scales and draws)
    a, kw = _first_sample(a), _first_sample(kw)

    def product(accumulator: Any, operands: Any) -> torch.Tensor:
        return accumulated_product(a, kw, plan.kind, accumulator, seed, to_working, operands,
                                   scaling, cfg.rounding, cfg.kernels).samples

    exact = product(None, inputs)
    value = product(acc, inputs) if biased else out.samples[:1]
    if figure:
        figures = GemmFigures(accumulator_error(value, exact, cap),
                              figures.operands if figures else None)
    if biased or inputs is not None:
        # the recipe's own error as the spread's too: its saturation rounds every sample
        # alike (the exact product of the program's operands: the recipe's error around it)
        program = product(None, None) if inputs is not None else exact
        out = Stacked(with_bias(out.samples, value if biased else exact, exact, program))
        if inputs is not None and cap is not None and figures is not None:
            # where the digits go: the recipe's operands against the program's (the exact
            # sums of both), beside the accumulator's figure against the former
            figures.operands["digits"], figures.operands["min_digits"] = \
                accumulator_error(exact, program, cap)
    return out, figures


class GemmFigures(tuple):
    """A modelled GEMM's figures for its report: the accumulator's digits ``(avg, min)``
    (NaN: none modelled) and, as ``operands``, its operands' statistics in their recipe
    (:func:`merge_operand_stats`; empty without ``gemm_inputs``)."""

    operands: dict

    def __new__(cls, digits: tuple, operands: Optional[dict] = None) -> "GemmFigures":
        self = super().__new__(cls, digits)
        self.operands = dict(operands or {})
        return self


def merge_operand_stats(stats: list) -> dict:
    """The statistics of all of a GEMM's operands (:func:`~fxstab.numerics.accumulation.
    operand_stats`, one per operand) as the report's ``operand_*`` fields: the counts summed,
    the extreme scales."""
    lo = [s["scale_min"] for s in stats if not math.isnan(s["scale_min"])]
    hi = [s["scale_max"] for s in stats if not math.isnan(s["scale_max"])]
    return {"elements": sum(s["elements"] for s in stats),
            "underflow": sum(s["underflow"] for s in stats),
            "saturation": sum(s["saturation"] for s in stats),
            "scale_min": min(lo) if lo else math.nan, "scale_max": max(hi) if hi else math.nan}


def biased_accumulator(acc: Any) -> bool:
    """Whether ``acc``'s error has a part the samples' random rounding cannot show: a
    nearest or directed rounding (every sample alike; nearest stagnates on long sums of one
    sign) or an alignment's truncation."""
    return acc.rounding not in (Rounding.RANDOM, Rounding.STOCHASTIC) or acc.align is not None


def sample_accumulator(acc: Any, mode: Any) -> Any:
    """The accumulator the samples run for a biased ``acc``: the same format, block and
    promotion, rounding randomly (the analysis's ``mode`` where it is random or stochastic,
    else ``random``), without alignment (its truncation is in the bias term)."""
    mode = Rounding.parse(mode)
    if mode not in (Rounding.RANDOM, Rounding.STOCHASTIC):
        mode = Rounding.RANDOM
    return dataclasses.replace(acc, rounding=mode, align=None, name="")


def bias_weights(n: int, like: torch.Tensor) -> torch.Tensor:
    """``t`` of :func:`modelled_gemm`, shaped ``[n, 1, ...]`` like ``like``: +1, -1
    alternating (0 for an odd last sample), scaled to a sample standard deviation of 1
    (N = 3: (1, -1, 0)); zeros for one sample."""
    t = torch.tensor([(-1.0) ** i if i < n - n % 2 else 0.0 for i in range(n)],
                     dtype=like.dtype, device=like.device)
    if n > 1:
        t = t / t.std()
    return t.reshape(n, *(1,) * (like.dim() - 1))


def with_bias(samples: torch.Tensor, hardware: torch.Tensor, exact: torch.Tensor,
              program: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``samples + (hardware - exact) + t (hardware - program)`` (:func:`modelled_gemm`;
    ``program`` defaults to ``exact``): the samples' mean moves by the accumulator's bias, their
    spread takes the hardware's whole error against the program's exact product. Where
    ``hardware`` is not finite every sample takes it; where ``exact`` or ``program`` is not
    finite that term is 0."""
    def finite_diff(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ok = torch.isfinite(x) & torch.isfinite(y)
        return torch.where(ok, x - y, torch.zeros_like(x))

    shift = finite_diff(hardware, exact)
    spread = shift if program is None else finite_diff(hardware, program)
    out = samples + shift + bias_weights(samples.shape[0], samples) * spread
    return torch.where(torch.isfinite(hardware), out, hardware.expand_as(out))


def _first_sample(args: Any) -> Any:
    """``args`` (a call's arguments, nested) with every stacked operand cut to its first
    sample."""
    if isinstance(args, Stacked):
        return Stacked(args.samples[:1])
    if isinstance(args, (tuple, list)):
        return type(args)(_first_sample(v) for v in args)
    if isinstance(args, dict):
        return {k: _first_sample(v) for k, v in args.items()}
    return args


def accumulator_error(value: torch.Tensor, exact: torch.Tensor, cap: float) -> tuple:
    """(average, minimum) over the elements (and samples) of the digits ``value`` shares with
    ``exact``: ``-log10(|value - exact| / |exact|)`` clamped to ``[0, cap]``, ``cap`` where they
    are equal, 0 for a NaN/inf or a non-zero value against a zero (``true_digits``). Empty:
    ``(cap, cap)``."""
    if value.numel() == 0:
        return float(cap), float(cap)
    d = true_digits(value, exact, cap)
    avg, mn = torch.stack([d.mean(), d.min()]).tolist()
    return avg, mn


def _samples_product(left: torch.Tensor, right: torch.Tensor, acc: Any, seed: int, inputs: Any,
                     scaling: str, mode: Any, kernels: str,
                     stats: Optional[list] = None) -> torch.Tensor:
    """``left @ right`` of stacked operands ``[N or 1, ..., M, K]`` and ``[N or 1, ..., K, P]``
    with the accumulator ``acc`` (and the operands in ``inputs``), by the implementation
    ``kernels`` picks (:data:`fxstab.executors.ACCUMULATE`; the exact sum, ``acc`` None: the
    reference)."""
    if inputs is not None and stats is not None:
        stats.append(operand_stats(left[:1], inputs, scaling, batch_dims=1))
        stats.append(operand_stats(right[:1], inputs, scaling, right=True, batch_dims=1))
    if inputs is not None:
        left = quantize_operand(left, inputs, scaling, mode=mode, seed=derive_seed(seed, 1),
                                batch_dims=1)
        right = quantize_operand(right, inputs, scaling, right=True, mode=mode,
                                 seed=derive_seed(seed, 2), batch_dims=1)
    n = max(left.shape[0], right.shape[0])
    product = executors.choose(kernels, executors.ACCUMULATE, left, n) if acc is not None \
        else executors.reference(executors.ACCUMULATE)
    return product(left, right, acc, seed, n)


def _conv_product(a: tuple, kw: dict, kind: str, acc: Any, seed: int,
                  to_working: Callable[[torch.Tensor], torch.Tensor], inputs: Any,
                  scaling: str, mode: Any, kernels: str,
                  stats: Optional[list] = None) -> Stacked:
    """A convolution's samples through its GEMM form: the input unfolded into patches
    (im2col: K = in_channels/groups x kernel positions, in the order of ``weight.reshape(O,
    -1)``: channel, then kernel row, then column), each group's weight ``[O/g, K]`` times its
    patches ``[K, positions]`` with the accumulator, folded back to ``[N, B, O, *out]``."""
    dims = CONV_KINDS[kind]
    x, w, bias, stride, padding, dilation, groups = conv_args(a, kw)
    xs = x.samples if isinstance(x, Stacked) else to_working(x).unsqueeze(0)
    ws = w.samples if isinstance(w, Stacked) else to_working(w).unsqueeze(0)
    same = padding == "same"
    stride, dilation = _pair(stride, dims), _pair(dilation, dims)
    padding = (0,) * dims if same else _pair(padding, dims)
    if dims == 1:  # a 1-D convolution is a 2-D one of height 1
        xs, ws = xs.unsqueeze(-2), ws.unsqueeze(-2)
        stride, padding, dilation = ((1, *stride), (0, *padding), (1, *dilation))
    nw, o, cg, kh, kw_ = ws.shape
    flat = xs.reshape(-1, *xs.shape[-3:])
    if same:  # torch pads d (k - 1) in all, the odd one after (stride 1, its rule)
        tot = (dilation[0] * (kh - 1), dilation[1] * (kw_ - 1))
        flat = torch.nn.functional.pad(flat, (tot[1] // 2, tot[1] - tot[1] // 2,
                                              tot[0] // 2, tot[0] - tot[0] // 2))
    nx, b = xs.shape[:2]
    c, h, wd = flat.shape[-3:]
    cols = torch.nn.functional.unfold(flat, (kh, kw_), dilation=dilation, padding=padding,
                                      stride=stride)
    oh = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (wd + 2 * padding[1] - dilation[1] * (kw_ - 1) - 1) // stride[1] + 1
    k = cg * kh * kw_
    right = cols.reshape(nx, b, groups, k, oh * ow)
    left = ws.reshape(nw, 1, groups, o // groups, k)
    y = _samples_product(left, right, acc, seed, inputs, scaling, mode, kernels, stats)
    y = y.reshape(y.shape[0], b, o, *((ow,) if dims == 1 else (oh, ow)))
    if bias is not None:
        bs = bias.samples if isinstance(bias, Stacked) else to_working(bias).unsqueeze(0)
        y = y + bs.reshape(bs.shape[0], 1, o, *(1,) * dims)
    return Stacked(to_working(y))


def _sdpa_product(a: tuple, kw: dict, kind: str, acc: Any, seed: int,
                  to_working: Callable[[torch.Tensor], torch.Tensor], inputs: Any,
                  scaling: str, mode: Any, kernels: str,
                  stats: Optional[list] = None) -> Stacked:
    """Attention's samples with its two products modelled: ``S = (q @ k^T) * scale`` with the
    accumulator (the scale applied to the product, as fused kernels apply it), the mask
    (``is_causal``, boolean or additive), ``P = softmax(S)`` in the working dtype (not rounded
    into a format), then ``P @ v`` with the accumulator. ``enable_gqa`` repeats the key and
    value heads as torch does."""
    q, k, v, mask, _, is_causal, scale, gqa = sdpa_args(a, kw)
    rank = max(_logical_dim(t) for t in (q, k, v))

    def aligned(t: Any) -> torch.Tensor:
        s = t.samples if isinstance(t, Stacked) else to_working(t).unsqueeze(0)
        while s.dim() < rank + 1:  # logical batch dims padded after the sample dim
            s = s.unsqueeze(1)
        return s

    qs, ks, vs = aligned(q), aligned(k), aligned(v)
    if gqa and ks.shape[-3] != qs.shape[-3]:
        rep = qs.shape[-3] // ks.shape[-3]
        ks, vs = ks.repeat_interleave(rep, -3), vs.repeat_interleave(rep, -3)
    if scale is None:
        scale = 1.0 / math.sqrt(qs.shape[-1])
    s = _samples_product(qs, ks.transpose(-1, -2), acc, derive_seed(seed, 3), inputs, scaling,
                         mode, kernels, stats) * scale
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        m = mask.samples if isinstance(mask, Stacked) else mask.unsqueeze(0)
        while m.dim() < s.dim():  # the sample dim leads
            m = m.unsqueeze(1)
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(s.dtype)
    p = torch.softmax(s, dim=-1)
    out = _samples_product(p, vs, acc, derive_seed(seed, 4), inputs, scaling, mode, kernels,
                           stats)
    return Stacked(to_working(out))


class _Form(NamedTuple):
    """How a modelled GEMM of one kind runs: ``accumulable(a, kw, kind)``, whether its
    arguments suit the model, and ``product(a, kw, kind, acc, seed, to_working, inputs,
    scaling, mode, kernels, stats)``, its samples (:func:`accumulated_product`'s arguments)."""

    accumulable: Callable[[tuple, dict, str], bool]
    product: Callable[..., Stacked]


_MATMUL = _Form(_matmul_accumulable, _matmul_product)
# kind -> its form; a kind without an entry: a product of two operands (_MATMUL)
_FORMS: dict[str, _Form] = {**{kind: _Form(_conv_accumulable, _conv_product)
                               for kind in CONV_KINDS},
                            SDPA: _Form(_sdpa_accumulable, _sdpa_product)}
