"""The accumulator's Triton kernel (fxstab.kernels.accumulate) against emulate_matmul, bit for bit.

Under TRITON_INTERPRET=1 on CPU tensors (make test), on a GPU when one is there. The operands
are bf16/fp16-valued (products of 8- or 11-bit significands in a bounded range): each block's
fp64 sum is exact in any order, so the kernel's sequential sum and the CPU's dgemm agree and
every rounding of the accumulator must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import fxstab
from fxstab.cpu import bindings
from fxstab.kernels.accumulate import emulate_matmul_triton
from fxstab.numerics.accumulation import Accumulation, Alignment, emulate_matmul
from fxstab import executors
from fxstab.rules.accumulation import fused_rounder, samples_rounder

from kernel_testutil import assert_bits_equal, cuda_ready, kernels_runnable

pytestmark = [
    pytest.mark.skipif(not (kernels_runnable() or cuda_ready()),
                       reason="Triton kernels need TRITON_INTERPRET=1 set before import (make "
                              "test) or a CUDA device"),
    pytest.mark.interpreter,
]
DEVICE = "cpu" if kernels_runnable() else "cuda"
MODES = ["nearest", "zero", "up", "down", "random", "stochastic"]
E8M13 = (8, 13)


def _operands(a_shape, b_shape, dtype=torch.bfloat16, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(a_shape, generator=g) * scale).to(dtype).float()
    b = torch.randn(b_shape, generator=g).to(dtype).float()
    return a.to(DEVICE), b.to(DEVICE)


def _same(acc, a, b, seed=11, **kw):
    got = emulate_matmul_triton(a, b, acc, seed=seed, **kw)
    want = emulate_matmul(a.cpu(), b.cpu(), acc, seed=seed)
    assert_bits_equal(got.cpu(), want)
    return got


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt,block,promote", [
    ("fp16", 1, None), ("bf16", 4, None), (E8M13, 16, None), (E8M13, 32, None),
    (E8M13, 4, 16), ("fp16", 32, 64),
], ids=["fp16-b1", "bf16-b4", "e8m13-b16", "e8m13-b32", "e8m13-b4-p16", "fp16-b32-p64"])
def test_every_mode_block_and_format_is_emulate_matmul_bit_for_bit(mode, fmt, block, promote):
    # M, N cross the 16 x 16 interpreter tile; K = 70 leaves a partial last block (70 % 4,
    # 70 % 16, 70 % 32) and a partial last promotion group (70 % 16, 70 % 64)
    a, b = _operands((2, 17, 70), (70, 19))
    _same(Accumulation(fmt, block, promote, mode), a, b)


@pytest.mark.parametrize("m,k,n,block", [(1, 1, 1, 4), (5, 3, 33, 16), (33, 9, 2, 4),
                                         (3, 32, 5, 32), (4, 33, 4, 32)], ids=str)
def test_odd_shapes_and_k_below_the_block(m, k, n, block):
    for mode in ("nearest", "random"):
        a, b = _operands((m, k), (k, n), seed=k)
        _same(Accumulation("fp16", block, rounding=mode), a, b)


def test_k_zero_and_empty_outputs_and_the_trusted_product():
    a, b = _operands((3, 0), (0, 4))
    got = emulate_matmul_triton(a, b, "fp16")
    assert got.shape == (3, 4) and not got.any()
    a, b = _operands((0, 5), (5, 4))
    assert emulate_matmul_triton(a, b, "fp16").shape == (0, 4)
    a, b = _operands((3, 5), (5, 4))
    assert_bits_equal(emulate_matmul_triton(a, b, "fp32").cpu(), emulate_matmul(a.cpu(), b.cpu()))


@pytest.mark.parametrize("a_shape,b_shape", [
    ((3, 1, 5, 12), (2, 12, 7)), ((12,), (2, 12, 3)), ((4, 12), (12,)), ((2, 3, 12), (12, 5)),
    ((2, 1, 3, 1, 4, 12), (5, 1, 2, 12, 3)),  # four batch dims that do not collapse: copied
], ids=str)
def test_broadcasting_like_matmul(a_shape, b_shape):
    a, b = _operands(a_shape, b_shape)
    for mode in ("zero", "stochastic"):
        got = _same(Accumulation("bf16", 4, 8, mode), a, b)
        assert got.shape == torch.matmul(a, b).shape


def test_operand_dtypes_give_the_output_dtype():
    a, b = _operands((6, 40), (40, 5), dtype=torch.float16)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        got = _same("fp8-promoted", a.to(dtype), b.to(dtype))
        assert got.dtype == dtype
    a32, b32 = _operands((6, 40), (40, 5), dtype=torch.float32)  # inexact block sums, see
    _same(Accumulation(E8M13, 8, rounding="random"), a32, b32)  # the module docstring


def test_fp8_operands_with_their_scaling():
    """inputs=/scaling= round the operands as emulate_matmul does (the shared prologue); MX's
    power-of-two scales keep every block sum exact, so the results agree bit for bit."""
    a, b = _operands((2, 9, 70), (70, 6), dtype=torch.float32)
    for mode in ("zero", "random"):
        got = emulate_matmul_triton(a, b, Accumulation(E8M13, 32, 64, mode), seed=2,
                                    inputs="fp8_e4m3", scaling="mx32")
        want = emulate_matmul(a.cpu(), b.cpu(), Accumulation(E8M13, 32, 64, mode), seed=2,
                              inputs="fp8_e4m3", scaling="mx32")
        assert_bits_equal(got.cpu(), want)


def test_subnormal_and_overflowing_accumulators():
    # fp16: sums of 2**-20-sized products stay in the subnormals (below 2**-14); positive sums
    # of 2**12-sized products pass 65504: nearest and up go to inf (IEEE), zero and down stop
    # at the largest value, the random modes do either
    for scale in (2.0 ** -10, 2.0 ** 6):
        a, b = _operands((9, 48), (48, 7), dtype=torch.float16, scale=scale, seed=3)
        a, b = a.abs(), b.abs() * scale
        for mode in MODES:
            got = _same(Accumulation("fp16", 4, rounding=mode), a, b)
            if scale < 1:
                assert ((got != 0) & (got.abs() < 2.0 ** -14)).any()
            elif mode in ("nearest", "up"):
                assert torch.isinf(got).any()
            elif mode in ("zero", "down"):
                assert torch.isfinite(got).all() and (got == 65504).any()
    # e8m13 below fp32's normals, into fp32 by promotion; a NaN operand stays NaN
    a, b = _operands((5, 20), (20, 6), scale=2.0 ** -70, seed=4)
    b = b * 2.0 ** -60
    a[0, 3] = float("nan")
    got = _same(Accumulation(E8M13, 4, 8, "random"), a, b)
    assert got[0].isnan().all() and ((got[1:] != 0) & (got[1:].abs() < 2.0 ** -126)).any()


@pytest.mark.parametrize("mode", ["random", "stochastic"])
@pytest.mark.parametrize("n", [3, 4, 5])
def test_stacked_samples_draw_as_the_analysis_cpu_path(mode, n):
    """samples=True: the draws of round_samples over the leading sample dim (the antithetic
    pairs of random, draw s of stochastic), what the fused C kernel rounds on the CPU."""
    a, _ = _operands((n, 2, 9, 40), (1,), seed=n)
    _, w = _operands((1,), (1, 1, 40, 6), seed=n + 1)  # a plain operand: one sample
    acc = Accumulation("fp16", 8, 16, mode)
    got = emulate_matmul_triton(a, w, acc, seed=5, samples=True).cpu()
    ref = emulate_matmul(a.cpu(), w.cpu(), acc, seed=5, rounder=samples_rounder(n))
    assert_bits_equal(got, ref)
    if bindings.available():
        fused = emulate_matmul(a.cpu(), w.cpu(), acc, seed=5, rounder=fused_rounder(a.cpu(), w))
        assert_bits_equal(got, fused)
    # the samples differ (each draws its own directions), and the layout is not quantize's
    assert not torch.equal(got[0], got[1])
    assert not torch.equal(got, emulate_matmul(a.cpu(), w.cpu(), acc, seed=5))


def test_bad_calls_are_clear_errors():
    a, b = _operands((3, 4), (4, 2))
    with pytest.raises(ValueError, match="sample dim"):
        emulate_matmul_triton(a, b, "fp16", samples=True)
    with pytest.raises(ValueError, match="inner dimensions"):
        emulate_matmul_triton(a, b.t(), "fp16")
    with pytest.raises(TypeError, match="floating"):
        emulate_matmul_triton(a.int(), b, "fp16")


def test_the_analysis_picks_the_kernel_by_the_kernels_option():
    t = torch.ones(2, 3)

    def chosen(kernels: str) -> str:
        return executors.choose(kernels, executors.ACCUMULATE, t, 3).name

    assert chosen("triton") == "triton"
    assert chosen("torch") == "torch"
    assert chosen("auto") == ("cpu" if bindings.available() else "torch")


@pytest.mark.parametrize("mode", ["random", "zero"])
def test_the_analysis_gemm_is_the_same_bits_with_every_kernel(mode):
    """accumulated_product (a modelled GEMM of the analysis) with kernels='triton', 'auto' (the
    fused C kernel on the CPU) and 'torch': the same samples, bit for bit."""
    from fxstab.rules.accumulation import accumulated_product
    from fxstab.rules.lifting import Stacked

    x, w = _operands((3, 4, 7, 24), (5, 24), seed=9)
    bias = torch.randn(5).to(DEVICE)
    acc = Accumulation("bf16", 8, 16, mode)
    outs = [accumulated_product((Stacked(x), w, bias), {}, "linear", acc, 77, lambda t: t.float(),
                                kernels=k).samples.cpu() for k in ("triton", "auto", "torch")]
    assert outs[0].shape == (3, 4, 7, 5)
    assert_bits_equal(outs[0], outs[1])
    assert_bits_equal(outs[0], outs[2])
    # a grouped convolution through its GEMM form (broadcast batch dims [N, B, groups])
    xc, wc = _operands((3, 2, 4, 6, 5), (6, 2, 3, 2), seed=10)
    call = (Stacked(xc), wc, None, (2, 1), (1, 2), (1, 2), 2)
    outs = [accumulated_product(call, {}, "conv2d", acc, 78, lambda t: t.float(),
                                kernels=k).samples.cpu() for k in ("triton", "auto", "torch")]
    assert outs[0].shape == (3, 2, 6, 3, 7)
    assert_bits_equal(outs[0], outs[1])
    assert_bits_equal(outs[0], outs[2])
    # attention's two products (a transposed key, a causal mask)
    q, kv = _operands((3, 2, 5, 8), (2, 9, 8), seed=11)
    call = (Stacked(q), kv, kv[..., :6])
    outs = [accumulated_product(call, {"is_causal": True}, "scaled_dot_product_attention", acc,
                                79, lambda t: t.float(), kernels=k).samples.cpu()
            for k in ("triton", "auto", "torch")]
    assert outs[0].shape == (3, 2, 5, 6)
    assert_bits_equal(outs[0], outs[1])
    assert_bits_equal(outs[0], outs[2])


@pytest.mark.skipif(DEVICE != "cpu", reason="compares the CPU kernels with the interpreter")
def test_an_analysed_linear_reads_the_same_digits_with_the_triton_kernel():
    """The analysis with kernels='triton' (the accumulator's kernel and the rounding kernel,
    interpreted) reads the digits of kernels='auto' (the fused C kernels) and 'torch': the
    same rounded samples, statistics within a few ulps (config.Kernels)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 12), torch.nn.Linear(12, 6))
    x = torch.randn(5, 40)
    digits = {}
    for kernels in ("triton", "auto", "torch"):
        torch._dynamo.reset()
        be = fxstab.backend(format="bf16", kernels=kernels,
                            accumulate=Accumulation("fp16", 8, rounding="random"))
        f = torch.compile(model, backend=be)
        for _ in range(2):
            assert torch.equal(f(x), model(x))
        ops = be.digit_map().operators
        digits[kernels] = {k: (v.avg_digits, v.min_digits) for k, v in ops.items()}
    assert {"0/linear#0", "1/linear#0"} <= set(digits["triton"])
    for other in ("auto", "torch"):
        assert digits[other].keys() == digits["triton"].keys()
        for key, got in digits["triton"].items():
            assert got == pytest.approx(digits[other][key], rel=1e-6, abs=1e-6), key


# --------------------------------------------------------------------------- alignment (issue 43)
ALIGNED = {
    "fp8-fast": "fp8-fast",
    "fp8-promoted": "fp8-promoted",
    "b16-g4-trunc": Accumulation(E8M13, 16, rounding="zero", align=Alignment(4, 14)),
    "b8-g8-acc-nearest-p32": Accumulation("fp16", 8, 32, "nearest",
                                          align=Alignment(8, 12, True, "nearest")),
    "b4-g2-random": Accumulation("bf16", 4, rounding="random", align=Alignment(2, 10)),
}


@pytest.mark.parametrize("name", list(ALIGNED))
def test_aligned_accumulators_are_emulate_matmul_bit_for_bit(name):
    # K = 70: partial last groups, blocks and promotion groups; rows over 12 decades, so the
    # alignment shifts whole products out; a NaN, an inf and negative zeros
    a, b = _operands((2, 17, 70), (70, 19))
    a = a * torch.logspace(-6, 6, 70, device=a.device)
    a[0, 3, 5] = float("nan")
    a[1, 4, 9] = float("inf")
    a[1, 6] = -0.0
    _same(ALIGNED[name], a, b)


def test_aligned_products_in_fp64_s_subnormals():
    # products near 2^-1060: the quantum clamps at 2^-1074, the subnormal exponents
    a, b = _operands((5, 40), (40, 6), dtype=torch.float64)
    a, b = a.double() * 2.0 ** -530, b.double() * 2.0 ** -530
    for acc in (Accumulation("fp64", 8, rounding="nearest", align=Alignment(8, 20)),
                Accumulation("fp64", 8, rounding="zero",
                             align=Alignment(8, 30, True, "nearest"))):
        _same(acc, a, b)


def test_aligned_accumulator_in_the_analysis_draws_the_same_as_the_cpu_path():
    """modelled_gemm's hardware product on the first sample (the bias) runs the kernel too."""
    from types import SimpleNamespace

    from fxstab.rules.accumulation import modelled_gemm
    from fxstab.rules.lifting import Stacked

    a, b = _operands((3, 9, 96), (24, 96), dtype=torch.float32)
    plan = SimpleNamespace(kind="linear", accumulate=Accumulation.parse("fp8-promoted"),
                           gemm_inputs=None, gemm_scaling=None)  # (a NodePlan's fields)
    outs = {}
    for kernels in ("triton", "torch"):
        cfg = SimpleNamespace(gemm_scaling="tensor", rounding="random", kernels=kernels)
        outs[kernels] = modelled_gemm((Stacked(a.double()), b.double()), {}, plan, cfg, 7,
                                      lambda t: t.double(), 7.0)
    assert_bits_equal(outs["triton"][0].samples.cpu(), outs["torch"][0].samples.cpu())
    assert tuple(outs["triton"][1]) == tuple(outs["torch"][1])
