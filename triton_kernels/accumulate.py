"""A GEMM's accumulator as the hardware runs it, in one Triton kernel (issue 31, item 5).

:func:`emulate_matmul_triton` computes :func:`fxstab.numerics.accumulation.emulate_matmul` (the
plain-torch reference, beside it) for ``[..., M, K] @ [..., K, N]`` with the batch dims
broadcast and flattened into one grid dimension, so the analysis's N stacked samples are a
batch dimension of one launch (the operands read through their strides, up to three batch
dims after collapsing: a weight broadcast over the samples is not copied). One program owns a ``BM x BN`` tile of one batch element and
walks K in increasing order in blocks of ``block``:

* the block's products are summed in fp64 (the working dtype), one rank-1 update per k, from
  +0 (as the CPU's dgemm starts: a block of -0 products sums to +0);
* the sum is added to the accumulator (held in fp64, its values on the accumulator's grid) and
  rounded once into the accumulator's format with ``fxstab.kernels.round_digits.round_bits``
  (the same integer rounding as every kernel of this package) in its mode;
* with promotion, after every ``promote_every`` elements and after the last (partial) group the
  accumulator is added into the fp32 accumulator (rounded to nearest) and restarts from the
  next block's sum.

Random bits follow :mod:`fxstab.numerics.randbits` with one seed per block
(:func:`fxstab.numerics.accumulation.block_seeds`), element ``e`` counted within one sample:
``samples=True`` is the layout of ``round_samples`` (the leading dim is the samples: sample
``s`` takes draw ``sample_draws(N)`` with its antithetic flip in ``random``, draw ``s`` in
``stochastic``), what the CPU's fused C kernel draws in the analysis
(``fxstab.rules.accumulation.fused_rounder``); ``samples=False`` is the layout of
``fxstab.quantize`` (draw 0, ``e`` counted over the whole output), what ``emulate_matmul``'s
reference draws.

Bit for bit with the reference wherever each block's fp64 sum does not depend on the order of
its terms (a block of products of bf16, fp16 or fp8 values, or of fp32 values in a bounded
exponent range: each partial sum exact); otherwise the two fp64 sums may differ in their last
bit (the CPU's dgemm and this kernel add in different orders), which changes the rounded
accumulator only when that bit decides its rounding.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import triton
import triton.language as tl

from fxstab.numerics.accumulation import (Accumulation, AccumulationLike, block_seeds,
                                          matmul_operands, matmul_result)
from fxstab.numerics.formats import get_format
from fxstab.numerics.rounding import MODE_CODES, Rounding

from .round_digits import check_launchable, format_constants, interpreter_active, round_bits

__all__ = ["emulate_matmul_triton", "TILE_GPU", "TILE_INTERPRETER"]

# BM, BN, warps on a GPU: 8 output elements per thread. ptxas (sm_90a, compiled ahead of time
# here) gives the random modes with promotion 219 registers and no spill; 64 x 64 tiles on 4 or
# 8 warps spill (255 registers), the Philox counters and three fp64 tiles per element.
TILE_GPU = (32, 64, 8)
TILE_INTERPRETER = (16, 16, 1)  # small tiles: odd shapes cross tile edges in the tests


@triton.jit
def _nanmax(x, y):
    """max(x, y) that propagates NaN (torch's amax)."""
    return tl.where((x != x) | (x > y), x, y)


@triton.jit
def _quantum(big, bits):
    """2^(E - bits), torch.frexp(big) = (f, E) (f in [0.5, 1)), at least 2^-1074: E from the
    fp64 pattern, subnormals scaled by 2^64 first; 0, inf and NaN take E = 0 as torch's frexp
    gives them (their group's sum is 0, inf or NaN whatever the quantum)."""
    sub = big < 2.2250738585072014e-308
    scaled = tl.where(sub, big * 18446744073709551616.0, big)
    field = (scaled.to(tl.int64, bitcast=True) >> 52) & 0x7FF
    e = field - 1022 - tl.where(sub, 64, 0)
    special = (big == 0) | (big != big) | (field == 0x7FF)
    e = tl.where(special, 0, e) - bits
    e = tl.maximum(e, -1074)
    normal = (e + 1023).to(tl.int64) << 52
    tiny = tl.full(e.shape, 1, tl.int64) << tl.maximum(e + 1074, 0).to(tl.int64)
    return tl.where(e >= -1022, normal, tiny).to(tl.float64, bitcast=True)


@triton.jit
def _to_quantum(p, q, TRUNC: tl.constexpr):
    """p rounded to a multiple of the power of two q, toward zero or to nearest even, with
    p's sign (torch.trunc/torch.round: -0.4 gives -0.0); p / q is exact and below 2^52 in
    magnitude for finite p, non-finite p stays as it is."""
    y = p / q
    ay = tl.abs(y)
    if TRUNC:
        r = ay.to(tl.int64).to(tl.float64)  # the conversion truncates
    else:
        r = (ay + 4503599627370496.0) - 4503599627370496.0  # 2^52: round half to even
    r = tl.where(y.to(tl.int64, bitcast=True) < 0, -r, r)
    r = tl.where(ay < float("inf"), r, y)
    return r * q


@triton.jit
def _accumulate_kernel(
    a_ptr, b_ptr, out_ptr, seeds_ptr, M, N, K, block, promote, b_inner, n_samples, tiles_n,
    B1, B2, s_a0, s_a1, s_a2, s_am, s_ak, s_b0, s_b1, s_b2, s_bk, s_bn,
    group, bits,
    MODE: tl.constexpr, PROMOTE: tl.constexpr, ALIGN: tl.constexpr, ALIGN_ACC: tl.constexpr,
    ALIGN_TRUNC: tl.constexpr,
    A_WM: tl.constexpr, A_EXP_ONES: tl.constexpr, A_SHMAX: tl.constexpr, A_SHIFT0: tl.constexpr,
    A_EB: tl.constexpr, A_MAX_BITS: tl.constexpr, A_MINSUB_BITS: tl.constexpr,
    A_INF_BITS: tl.constexpr, A_NAN_BITS: tl.constexpr, A_BIG_BITS: tl.constexpr,
    A_FINITE_ONLY: tl.constexpr,
    P_WM: tl.constexpr, P_EXP_ONES: tl.constexpr, P_SHMAX: tl.constexpr, P_SHIFT0: tl.constexpr,
    P_EB: tl.constexpr, P_MAX_BITS: tl.constexpr, P_MINSUB_BITS: tl.constexpr,
    P_INF_BITS: tl.constexpr, P_NAN_BITS: tl.constexpr, P_BIG_BITS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):
    tiles_m = tl.cdiv(M, BM)
    pid = tl.program_id(0).to(tl.int64)
    per_batch = tiles_m * tiles_n
    pid_b = pid // per_batch
    t = pid % per_batch
    offs_m = (t // tiles_n) * BM + tl.arange(0, BM).to(tl.int64)
    offs_n = (t % tiles_n) * BN + tl.arange(0, BN).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # the batch element's three batch coordinates (the broadcast batch dims, collapsed)
    i2 = pid_b % B2
    i1 = (pid_b // B2) % B1
    i0 = pid_b // (B1 * B2)
    a_row = a_ptr + i0 * s_a0 + i1 * s_a1 + i2 * s_a2 + offs_m * s_am  # [BM]
    b_col = b_ptr + i0 * s_b0 + i1 * s_b1 + i2 * s_b2 + offs_n * s_bn  # [BN]

    # the random streams: element e counted within its sample, the sample's draw and flip
    s = pid_b // b_inner
    e = ((pid_b % b_inner) * M + offs_m[:, None]) * N + offs_n[None, :]  # [BM, BN] int64
    zero = tl.zeros([BM, BN], dtype=tl.uint32)
    if MODE == 0:  # random: bit e % 32 of word (e // 32) % 4 of philox(lo(e//128), d, hi(e//128))
        start = n_samples % 2
        draw = (s + start) // 2  # fxstab.numerics.rounding.sample_draws
        flip = ((s >= start) & ((s - start) % 2 == 1)).to(tl.uint32)
        grp = e >> 7
        c0 = (grp & 0xFFFFFFFF).to(tl.uint32)
        c2 = (grp >> 32).to(tl.uint32)
        word = (e >> 5) & 3
        shift = (e & 31).to(tl.uint32)
        c1 = zero + draw.to(tl.uint32)
    if MODE == 1:  # stochastic: word s % 4 of philox(lo(e), s // 4, hi(e))
        c0 = (e & 0xFFFFFFFF).to(tl.uint32)
        c2 = (e >> 32).to(tl.uint32)
        c1 = zero + (s // 4).to(tl.uint32)
        word = s % 4

    run = tl.zeros([BM, BN], dtype=tl.float64)  # the accumulator, on its format's grid
    total = tl.zeros([BM, BN], dtype=tl.float64)  # the fp32 accumulator (promotion)
    n_blocks = tl.cdiv(K, block)
    for i in range(0, n_blocks):
        k0 = i * block
        k1 = tl.minimum(k0 + block, K)
        if PROMOTE:
            fresh = k0 % promote == 0  # the first block of a promotion group
        else:
            fresh = i == 0
        if ALIGN:
            # each group's products (and the accumulator) aligned to the largest exponent
            # and rounded to its quantum, summed exactly, added in order (aligned_sum)
            cur = tl.where(fresh, tl.zeros([BM, BN], dtype=tl.float64), run)
            for g0 in range(k0, k1, group):
                g1 = tl.minimum(g0 + group, k1)
                big = tl.zeros([BM, BN], dtype=tl.float64)
                for k in range(g0, g1):
                    av = tl.load(a_row + k * s_ak, mask=mask_m, other=0.0).to(tl.float64)
                    bv = tl.load(b_col + k * s_bk, mask=mask_n, other=0.0).to(tl.float64)
                    big = _nanmax(big, tl.abs(av[:, None] * bv[None, :]))
                if ALIGN_ACC:
                    big = _nanmax(big, tl.abs(cur))
                q = _quantum(big, bits)
                s = tl.zeros([BM, BN], dtype=tl.float64)
                for k in range(g0, g1):
                    av = tl.load(a_row + k * s_ak, mask=mask_m, other=0.0).to(tl.float64)
                    bv = tl.load(b_col + k * s_bk, mask=mask_n, other=0.0).to(tl.float64)
                    s = s + _to_quantum(av[:, None] * bv[None, :], q, ALIGN_TRUNC)
                if ALIGN_ACC:
                    cur = _to_quantum(cur, q, ALIGN_TRUNC) + s
                else:
                    cur = cur + s
            run = cur
        else:
            part = tl.zeros([BM, BN], dtype=tl.float64)  # +0, as dgemm starts
            for k in range(k0, k1):
                av = tl.load(a_row + k * s_ak, mask=mask_m, other=0.0).to(tl.float64)
                bv = tl.load(b_col + k * s_bk, mask=mask_n, other=0.0).to(tl.float64)
                part = part + av[:, None] * bv[None, :]
            run = tl.where(fresh, part, run + part)
        rand = zero
        if MODE == 0:
            seed = tl.load(seeds_ptr + i)
            w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, zero)
            w = tl.where(word == 0, w0, tl.where(word == 1, w1, tl.where(word == 2, w2, w3)))
            rand = ((w >> shift) & 1) ^ flip
        if MODE == 1:
            seed = tl.load(seeds_ptr + i)
            w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, zero)
            rand = tl.where(word == 0, w0, tl.where(word == 1, w1, tl.where(word == 2, w2, w3)))
        run, _mag = round_bits(run, rand, MODE, True, A_WM, A_EXP_ONES, A_SHMAX, A_SHIFT0, A_EB,
                               A_MAX_BITS, A_MINSUB_BITS, A_INF_BITS, A_NAN_BITS, A_BIG_BITS,
                               A_FINITE_ONLY, False)
        if PROMOTE:
            if (k1 % promote == 0) | (k1 == K):
                total = tl.where(k0 < promote, run, total + run)
                total, _mag = round_bits(total, zero, 2, True, P_WM, P_EXP_ONES, P_SHMAX,
                                         P_SHIFT0, P_EB, P_MAX_BITS, P_MINSUB_BITS, P_INF_BITS,
                                         P_NAN_BITS, P_BIG_BITS, False, False)
    if PROMOTE:
        run = total
    ptrs = out_ptr + pid_b * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(ptrs, run, mask=mask_m[:, None] & mask_n[None, :])


def _constants(fmt: Any, prefix: str) -> dict:
    kw = format_constants(get_format(fmt), torch.float64)
    keys = ("WM", "EXP_ONES", "SHMAX", "SHIFT0", "EB", "MAX_BITS", "MINSUB_BITS", "INF_BITS",
            "NAN_BITS", "BIG_BITS") + (("FINITE_ONLY",) if prefix == "A_" else ())
    return {prefix + k: kw[k] for k in keys}


def _batch_dims(batch: tuple, sa: tuple, sb: tuple) -> Optional[list]:
    """The broadcast batch dims as at most three ``(size, a's stride, b's stride)``, outermost
    first: dims of size 1 dropped, a dim merged into the one outside it where both operands'
    strides allow (a weight broadcast over samples and batch keeps its stride 0, uncopied);
    None if more than three remain."""
    out: list = []
    for size, x, y in zip(batch, sa, sb):
        if size == 1:
            continue
        if out and out[-1][1] == x * size and out[-1][2] == y * size:
            out[-1] = (out[-1][0] * size, x, y)
        else:
            out.append((size, x, y))
    return out if len(out) <= 3 else None


def emulate_matmul_triton(a: torch.Tensor, b: torch.Tensor, accumulate: AccumulationLike = "fp32",
                          seed: Optional[int] = None, inputs: Any = None,
                          scaling: str = "tensor", samples: bool = False) -> torch.Tensor:
    """:func:`fxstab.numerics.accumulation.emulate_matmul` in one Triton kernel launch.

    Same arguments and result (broadcasting like :func:`torch.matmul`, 1-D operands included,
    the operands' result dtype), on CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``).
    ``samples``: the leading dim of the (broadcast) output holds the analysis's stacked
    samples, and the random modes draw as ``round_samples`` does (CESTAC's antithetic pairs
    across them), which is what the CPU path of the analysis draws; otherwise they draw as
    ``fxstab.quantize`` on the whole output, as the reference does (module docstring).
    """
    acc = Accumulation.parse(accumulate)
    a64, b64, squeeze, out_dtype = matmul_operands(a, b, inputs, scaling)
    check_launchable(a64, "emulate_matmul_triton")
    if b64.device != a64.device:
        raise ValueError(f"emulate_matmul_triton: operands on {a64.device} and {b64.device}")
    m, k = a64.shape[-2:]
    n = b64.shape[-1]
    if acc is None or k == 0:
        return matmul_result(a64 @ b64, squeeze, out_dtype)
    batch = torch.broadcast_shapes(a64.shape[:-2], b64.shape[:-2])
    if samples and not batch:
        raise ValueError("emulate_matmul_triton: samples=True needs a leading sample dim in "
                         f"the operands, got a {tuple(a.shape)} and b {tuple(b.shape)}")
    out = torch.empty((*batch, m, n), dtype=torch.float64, device=a64.device)
    if out.numel() == 0:
        return matmul_result(out, squeeze, out_dtype)
    nb = out.numel() // (m * n)
    a_x, b_x = a64.expand(*batch, m, k), b64.expand(*batch, k, n)
    dims = _batch_dims(batch, a_x.stride()[:-2], b_x.stride()[:-2])
    if dims is None:  # more than three batch dims that do not collapse: copies
        a_x, b_x = a_x.reshape(nb, m, k), b_x.reshape(nb, k, n)
        dims = [(nb, a_x.stride(0), b_x.stride(0))]
    dims = [(1, 0, 0)] * (3 - len(dims)) + dims
    n_samples = batch[0] if samples else 1
    b_inner = nb // n_samples
    mode = acc.rounding
    if mode in (Rounding.RANDOM, Rounding.STOCHASTIC):
        seeds = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s
                              for s in block_seeds(acc, seed, k)],
                             dtype=torch.int64, device=a64.device)
    else:
        seeds = torch.zeros(1, dtype=torch.int64, device=a64.device)
    bm, bn, warps = TILE_INTERPRETER if interpreter_active() else TILE_GPU
    tiles_n = triton.cdiv(n, bn)
    grid = (nb * triton.cdiv(m, bm) * tiles_n,)
    _accumulate_kernel[grid](
        a_x, b_x, out, seeds, m, n, k, acc.block, acc.promote_every or 1, b_inner, n_samples,
        tiles_n, dims[1][0], dims[2][0], dims[0][1], dims[1][1], dims[2][1], a_x.stride(-2),
        a_x.stride(-1), dims[0][2], dims[1][2], dims[2][2], b_x.stride(-2), b_x.stride(-1),
        acc.align.group if acc.align else 1, acc.align.bits if acc.align else 0,
        MODE=MODE_CODES[mode], PROMOTE=bool(acc.promote_every), ALIGN=acc.align is not None,
        ALIGN_ACC=bool(acc.align and acc.align.with_accumulator),
        ALIGN_TRUNC=bool(acc.align and acc.align.rounding is Rounding.ZERO),
        **_constants(acc.fmt, "A_"), **_constants("fp32", "P_"), BM=bm, BN=bn,
        num_warps=warps)
    return matmul_result(out, squeeze, out_dtype)
