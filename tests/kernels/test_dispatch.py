"""The kernels option, the fxstab:: custom ops and their behaviour under graph capture."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fxstab.kernels as K
from fxstab.numerics.digits import digit_stats
from fxstab.numerics.rounding import round_samples

from kernel_testutil import adversarial_samples, assert_bits_equal, needs_cuda, needs_interpreter
from fxstab.numerics.formats import get_format


def test_kernels_option_validated():
    x = torch.randn(3, 10)
    with pytest.raises(ValueError, match="kernels must be one of"):
        K.round_and_stats(x, "bf16", "random", 0, kernels="cuda")
    with pytest.raises(ValueError, match="kernels must be one of"):
        K.perturb(x, 2.0**-8, 0, kernels="fast")
    assert K.resolve_kernels("auto", x) == "torch"
    assert K.resolve_kernels("torch", x) == "torch"


def test_one_kernels_enum_for_every_layer():
    """fxstab.config.Kernels lists the options once: the backend takes all four, this package
    "auto"/"triton"/"torch" (a "cpu" here says whose option it is), members or strings."""
    from fxstab.config import KERNELS, AnalysisConfig, Kernels

    assert KERNELS == ("auto", "triton", "cpu", "torch") == tuple(k.value for k in Kernels)
    assert K.KERNEL_OPTIONS == ("auto", "triton", "torch")
    x = torch.randn(3, 10)
    assert K.resolve_kernels(Kernels.TORCH, x) == "torch"
    with pytest.raises(ValueError, match="one of 'auto', 'triton', 'torch'; got 'cpu' "
                                         r"\(the fused CPU kernels are fxstab.cpu's"):
        K.round_and_stats(x, "bf16", "random", 0, kernels="cpu")
    for k in KERNELS:  # the config keeps the string users passed (its repr, its JSON)
        assert type(AnalysisConfig(kernels=k).kernels) is str
    assert AnalysisConfig(kernels=Kernels.CPU).kernels == "cpu"
    with pytest.raises(ValueError, match="kernels must be one of 'auto', 'triton', 'cpu', "
                                         "'torch'; got 'gpu'"):
        AnalysisConfig(kernels="gpu")


def test_no_import_side_effects_and_triton_on_cpu_says_why():
    # One subprocess (importing torch costs seconds here) checks three things: `import fxstab`
    # and `import fxstab.kernels` neither import Triton nor register the ops; kernels='triton'
    # on a CPU tensor without the interpreter says why; and setting TRITON_INTERPRET after the
    # import is reported as such.
    code = (
        "import os, sys, torch; os.environ.pop('TRITON_INTERPRET', None)\n"
        "import fxstab, fxstab.kernels as K\n"
        "assert 'triton' not in sys.modules, 'import fxstab.kernels imported triton'\n"
        "assert not hasattr(torch.ops.fxstab, 'round_digits'), 'registered at import'\n"
        "try:\n"
        "    K.round_and_stats(torch.randn(3, 10), 'bf16', 'random', 0, kernels='triton')\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "try:\n"
        "    K.round_and_stats(torch.randn(3, 10), 'bf16', 'random', 0, kernels='triton')\n"
        "except RuntimeError as e:\n"
        "    print(e)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    first, second = res.stdout.strip().splitlines()
    assert "need a CUDA tensor" in first and "TRITON_INTERPRET=1" in first
    assert "imported before it was set" in second


def test_torch_path_matches_reference_functions():
    fmt = get_format("bf16")
    x = adversarial_samples(3, (500,), torch.float32, fmt, seed=1)
    r, st, d = K.round_and_stats(x, fmt, "random", 42, kernels="torch", want_digits=True)
    ref = round_samples(x, fmt, "random", 42)
    assert_bits_equal(r, ref)
    ds = digit_stats(ref, fmt)
    assert st.numel == ds.numel and st.non_finite == ds.non_finite
    assert st.zero_fraction == ds.zero_fraction
    assert abs(st.avg - ds.avg) < 1e-12 and st.min == ds.min and st.max == ds.max


@needs_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_and_torch_paths_agree(dtype):
    fmt = get_format("fp8_e5m2")
    x = adversarial_samples(3, (777,), torch.float32, fmt, seed=2).to(dtype)
    r1, s1, d1 = K.round_and_stats(x, fmt, "random", 9, kernels="triton", want_digits=True)
    r2, s2, d2 = K.round_and_stats(x, fmt, "random", 9, kernels="torch", want_digits=True)
    assert r1.dtype == dtype
    assert_bits_equal(r1, r2)
    assert s1.numel == s2.numel == 777 and s1.non_finite == s2.non_finite > 0
    assert round(s1.zero_fraction * 777) == round(s2.zero_fraction * 777)
    # The rounded samples are bit-identical (same Philox bits); the digits differ only by the
    # float rounding of the estimator (log2*log10(2) vs log10, one reciprocal instead of N
    # divisions): a few fp32 ulps of values <= 7.23, far below 1e-5 digits.
    for f in ("avg", "min", "max"):
        assert abs(getattr(s1, f) - getattr(s2, f)) < 1e-5
    assert torch.allclose(d1, d2, atol=1e-5, rtol=0)
    for grid in (None, "bf16"):
        p1, n1 = K.perturb(x.float(), 2.0**-3, 5, kernels="triton", grid=grid)
        p2, n2 = K.perturb(x.float(), 2.0**-3, 5, kernels="torch", grid=grid)
        assert_bits_equal(p1, p2)
        assert n1 == n2 and isinstance(n1, int)


def _model(x):
    round_op, perturb_op = K.register_ops()
    p, _ = torch.ops.fxstab.perturb(x, 2.0**-8, 3, 8, 7, False, "torch")  # bf16 grid
    r, st, _ = torch.ops.fxstab.round_digits(p, 8, 7, False, "random", -5, False, 0.95, 0.5,
                                             False, "torch")
    return r * 2, st


def _op_nodes(gm):
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    return (sum("fxstab.round_digits" in s for s in names),
            sum("fxstab.perturb" in s for s in names))


def test_custom_ops_single_nodes_make_fx():
    from torch.fx.experimental.proxy_tensor import make_fx

    K.register_ops()
    x = torch.randn(3, 50)
    gm = make_fx(_model)(x)
    assert _op_nodes(gm) == (1, 1)
    r, st = gm(x)
    r_ref, st_ref = _model(x)
    assert torch.equal(r, r_ref) and torch.equal(st, st_ref)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_custom_ops_survive_torch_compile_aot(impl):
    from torch._dynamo.backends.common import aot_autograd

    if impl == "triton":
        from fxstab.kernels.round_digits import interpreter_active

        if not interpreter_active():
            pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (make test)")
    K.register_ops()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    def f(x):
        r, st, _ = torch.ops.fxstab.round_digits(torch.sin(x), 5, 10, False, "stochastic", 7,
                                                 False, 0.95, 0.5, False, impl)
        p, cnt = torch.ops.fxstab.perturb(r, 2.0**-11, 1, 5, 10, False, impl)  # fp16 grid
        return p + 1, st, cnt

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=aot_autograd(fw_compiler=capture), fullgraph=True)
    x = torch.randn(3, 40)
    out = compiled(x)
    ref = f(x)
    assert len(graphs) == 1 and _op_nodes(graphs[0]) == (1, 1)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)
    torch._dynamo.reset()


@needs_cuda
@pytest.mark.gpu
def test_auto_uses_triton_on_cuda_and_matches_torch():
    fmt = get_format("bf16")
    x = adversarial_samples(3, (100_003,), torch.float32, fmt, seed=4).cuda()
    assert K.resolve_kernels("auto", x) == "triton"
    r1, s1 = K.round_and_stats(x, fmt, "random", 1, kernels="auto")
    r2, s2 = K.round_and_stats(x, fmt, "random", 1, kernels="torch")
    assert_bits_equal(r1, r2)
    assert s1.non_finite == s2.non_finite
    assert round(s1.zero_fraction * s1.numel) == round(s2.zero_fraction * s2.numel)
    assert abs(s1.avg - s2.avg) < 1e-5 and abs(s1.min - s2.min) < 1e-5
