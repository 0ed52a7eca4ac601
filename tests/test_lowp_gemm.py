"""The samples' linear layers in bf16 GEMMs (issue 46, item 2; fxstab.numerics.lowp_gemm).

Against oracles: the fp64 product decides which two bf16 neighbours a random rounding may
choose; the low-precision path must give the value the fp32 path gives (the same neighbours)
for all but a few elements, with and without a bias, for samples on the bf16 grid and for
samples the GEMM surrogate nudged off it; odd shapes, empty inputs, non-finite values; the
CUDA branch (``mm.dtype``) with its kernel emulated; and in a model, the output bit-identical and
the digit map within the estimator's resolution of the fp32 path's.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxstab
from fxstab.numerics import lowp_gemm
from fxstab.numerics.surrogate import perturb_samples

sys.path.insert(0, str(Path(__file__).parent))


def _weight(o, k, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w16 = (torch.randn(o, k, generator=g) * 0.05).bfloat16()
    b16 = (torch.randn(o, generator=g) * 0.1).bfloat16() if bias else None
    w, b = w16.float(), (b16.float() if bias else None)
    lowp_gemm.set_twin(w, w16)
    if bias:
        lowp_gemm.set_twin(b, b16)
    return w, b


def _neighbours(v: torch.Tensor) -> tuple:
    """The bf16 interval a random rounding of fp32 ``v`` chooses from: its truncation and
    whether it is exact."""
    t = (v.view(torch.int32) & ~0xFFFF).view(torch.float32)
    return t, v == t


def _same_neighbours(a, b) -> float:
    ta, ea = _neighbours(a)
    tb, eb = _neighbours(b)
    return ((ta == tb) & (ea == eb)).float().mean().item()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("nudged", [False, True])
def test_the_bf16_path_gives_the_fp32_paths_neighbours(bias, nudged):
    torch.manual_seed(1)
    w, b = _weight(96, 300, bias)  # K = 300 (not a multiple of 16), odd leading shape
    x = torch.randn(3, 5, 7, 300).bfloat16().float()
    if nudged:  # identical samples (close: the surrogate perturbs every element)
        x = x[:1].expand(3, 5, 7, 300).contiguous()  # the surrogate's perturbation: off the bf16 grid by up to 2^-8 |x|
        x, count = perturb_samples(x, 2.0 ** -8, seed=3)
        assert count > 0 and not torch.equal(x.bfloat16().float(), x)
    want = F.linear(x, w, b)
    got = lowp_gemm.linear(x, w, b, "bf16")
    assert got is not None and got.dtype == torch.float32 and got.shape == want.shape
    assert _same_neighbours(got, want) >= (0.99 if nudged else 0.999)
    # against the exact product: within 2^-15 of its magnitude (16 bits kept)
    exact = x.double() @ w.double().t() + (b.double() if bias else 0)
    scale = (x.double().abs() @ w.double().abs().t()).clamp_min(1e-30)
    assert ((got.double() - exact).abs() / scale).max() < 2.0 ** -15


def _accumulation_bound(x, w, b, k) -> torch.Tensor:
    """Twice fp32's accumulation bound ``gamma_K sum |terms|`` (two accumulations: ``hi``'s and
    the residual's) plus the 16 bits ``hi + r`` keeps, elementwise."""
    gamma = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
    terms = x.double().abs() @ w.double().abs().t() + b.double().abs()
    exact = x.double() @ w.double().t() + b.double()
    return 2 * gamma * terms + 2.0 ** -16 * exact.abs()


def test_a_bias_that_cancels_the_product_keeps_its_bits():
    # the bias inside the accumulator: S + b nearly zero keeps the accuracy of an fp32
    # accumulation of its terms, not 8 bits of S (a bias added to the rounded product)
    torch.manual_seed(2)
    w, _ = _weight(8, 64, bias=False)
    x = torch.randn(3, 4, 64).bfloat16().float()
    s = F.linear(x[0], w)  # make b = -S (rounded to bf16) for the first sample's rows
    b16 = (-s[0]).bfloat16()
    b = b16.float()
    lowp_gemm.set_twin(b, b16)
    want = F.linear(x, w, b)
    got = lowp_gemm.linear(x, w, b, "bf16")
    exact = x.double() @ w.double().t() + b.double()
    assert exact[0, 0].abs().max() < 0.01 * s[0].abs().max()  # it does cancel
    # the order of the sums is the platform's (on one CPU the fp32 path is exact here where
    # the bf16 GEMM is not, on another the other way round): both within the bound ...
    bound = _accumulation_bound(x, w, b, 64)
    assert ((got.double() - exact).abs() <= bound).all()
    assert ((want.double() - exact).abs() <= bound).all()
    # ... and far below the 2^-9 |S| a bias outside the accumulator would cost
    assert ((got[0, 0].double() - exact[0, 0]).abs() < 2.0 ** -14 * s[0].abs().double()).all()


def test_cancelling_products_of_exact_sums_are_exact():
    # operands whose every partial sum is exact in fp32 (integers times powers of two): the
    # path's result is the exact value bit for bit, whatever the order of the sums, where
    # the bias cancels a row (to a few units) and elsewhere
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-4, 5, (3, 5, 1100), generator=g).float() / 8
    w16 = (torch.randint(-4, 5, (1024, 1100), generator=g).float() / 32).bfloat16()
    w = w16.float()
    lowp_gemm.set_twin(w, w16)
    s = x.double() @ w.double().t()
    b16 = (torch.randint(-64, 65, (1024,), generator=g).double() / 4).bfloat16()
    b16[:512] = (-s[0, 0, :512]).bfloat16()
    b = b16.float()
    lowp_gemm.set_twin(b, b16)
    exact = s + b.double()
    assert (exact[0, 0, :512].abs() <= 2 ** -6).all()  # cancelled to a few units
    assert (exact.bfloat16().double() != exact).float().mean() > 0.5  # (8 bits would not do)
    got = lowp_gemm.linear(x, w, b, "bf16")
    assert torch.equal(got.double(), exact)
    assert torch.equal(F.linear(x, w, b).double(), exact)


@pytest.fixture
def fresh_check():
    """The platform check run anew (its verdict is cached per process and device)."""
    lowp_gemm.check.cache_clear()
    yield
    lowp_gemm.check.cache_clear()


def _residual_outside_the_accumulator(hi, xa, wt):
    # a platform whose bf16 GEMM rounds its result to bf16 before adding beta * hi: the
    # residual keeps nothing of S - bf16(S)
    return ((xa @ wt).float() - hi.float()).bfloat16()


def _residual_exact(hi, xa, wt):
    # a platform with an exact accumulator
    return (xa.double() @ wt.double() - hi.double()).bfloat16()


def test_the_platform_check_accepts_this_platform_and_an_exact_one(fresh_check, monkeypatch):
    # the premise holds on the CPUs the suite runs on (AMD and Intel, with and without
    # AVX-512 BF16 / AMX); an exact accumulator passes it too
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        verdict = lowp_gemm.check("cpu")
    assert verdict.ok, verdict
    w = _weight(1024, 1100)[0]
    assert lowp_gemm.applies(w, "bf16")
    # the verdict where it decides a weight's products: a bf16 weight the path would take
    assert lowp_gemm.verdict_for(w.bfloat16(), "bf16") == verdict
    assert lowp_gemm.verdict_for(w, "bf16") is None  # (an fp32 weight)
    assert lowp_gemm.verdict_for(w[:64].bfloat16(), "bf16") is None  # (the fp32 GEMM's size)
    assert lowp_gemm.verdict_for(w.bfloat16(), "fp16") is None
    lowp_gemm.check.cache_clear()
    monkeypatch.setattr(lowp_gemm, "_residual", _residual_exact)
    assert lowp_gemm.check("cpu").ok


def test_the_platform_check_rejects_a_residual_outside_the_accumulator(fresh_check,
                                                                       monkeypatch):
    monkeypatch.setattr(lowp_gemm, "_residual", _residual_outside_the_accumulator)
    w, b = _weight(1024, 1100)
    with pytest.warns(UserWarning, match="run in fp32 on cpu.*accumulation bound"):
        assert not lowp_gemm.applies(w, "bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process and device
        assert not lowp_gemm.applies(w, "bf16")
        assert not lowp_gemm.keeps(w.bfloat16(), "bf16")
        assert lowp_gemm.linear(torch.randn(2, 1100), w, b, "bf16") is None
        assert lowp_gemm.path_name(torch.device("cpu")).startswith("fp32 GEMM (bf16 GEMMs "
                                                                   "fail the platform check")
    verdict = lowp_gemm.verdict_for(w.bfloat16(), "bf16")
    assert not verdict.ok and "accumulation bound" in verdict.reason


def test_a_platform_that_fails_the_check_gets_the_fp32_paths_maps(fresh_check, monkeypatch):
    from models import GPT

    monkeypatch.setattr(lowp_gemm, "CPU_MIN_DIM", 0)
    monkeypatch.setattr(lowp_gemm, "_residual", _residual_outside_the_accumulator)
    torch.manual_seed(0)
    model = GPT(vocab=64, d=64, heads=4, layers=2, ctx=16).to(torch.bfloat16).eval()
    x = torch.randint(0, 64, (2, 16))
    with pytest.warns(UserWarning, match="run in fp32 on cpu"):
        maps, how, copies = _both_paths(model, x, lambda out: out, ("linear",))
    assert how[True] == how[False] == {"batched over the samples"}
    # every weight a GEMM reads copied, as on the fp32 path (the embeddings' lookups, exact
    # in any dtype, read theirs as they are)
    lookups = sum(m.weight.numel() for m in model.modules()
                  if isinstance(m, torch.nn.Embedding))
    assert copies[True] == copies[False] - 4 * lookups
    a, b = maps[True], maps[False]
    assert a.operators == b.operators  # field for field
    assert a.metadata["lowp_gemm"]["cpu"]["ok"] is False
    assert "lowp_gemm" not in b.metadata  # (the path off: no verdict decided anything)


def test_where_the_path_does_not_apply_it_says_none():
    # on the CPU a small weight's products stay in fp32 (the bf16 path's fixed costs)
    assert lowp_gemm.applies(_weight(1024, 1100)[0], "bf16")
    assert not lowp_gemm.applies(_weight(768, 3072)[0], "bf16")  # (a GPT-2's: slower there)
    assert not lowp_gemm.applies(_weight(64, 600)[0], "bf16")
    assert not lowp_gemm.applies(_weight(1024, 1100)[0], "fp16")
    w, b = _weight(4, 8)
    x = torch.randn(3, 2, 8).bfloat16().float()
    assert lowp_gemm.linear(x, w, b, "fp16") is None  # another format
    plain = torch.randn(4, 8)  # a weight without a twin (an fp32 model's)
    assert lowp_gemm.linear(x, plain, None, "bf16") is None
    assert lowp_gemm.linear(x.double(), w, b, "bf16") is None
    assert lowp_gemm.linear(torch.empty(3, 0, 8), w, b, "bf16") is None
    # a weight changed in place after its twin was taken: the twin no longer applies
    w2, _ = _weight(4, 8, bias=False)
    w2.add_(1.0)
    assert lowp_gemm.twin(w2, torch.bfloat16) is None
    # a detached view of the weight (what the tracer reads) finds it
    w3, _ = _weight(4, 8, bias=False)
    assert lowp_gemm.twin(w3.detach(), torch.bfloat16) is not None


def test_non_finite_samples_propagate_as_in_fp32():
    w, b = _weight(6, 16)
    x = torch.randn(3, 2, 16).bfloat16().float()
    x[0, 0, 3] = float("nan")
    x[1, 1, 0] = float("inf")
    want = F.linear(x, w, b)
    got = lowp_gemm.linear(x, w, b, "bf16")
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want))


def test_the_cuda_branch_with_its_kernel_emulated(monkeypatch):
    # mm.dtype: one bf16 GEMM with an fp32 result (emulated here by the fp64 product)
    calls = []

    def mm(a, b, out_dtype=None):
        calls.append((a.dtype, b.dtype, out_dtype))
        return (a.double() @ b.double()).to(out_dtype)

    monkeypatch.setattr(lowp_gemm, "_mm_dtype", lambda device: True)
    monkeypatch.setattr(lowp_gemm.torch, "mm", mm)
    w, b = _weight(16, 32)
    x, _ = perturb_samples(torch.randn(1, 4, 32).bfloat16().float().expand(3, 4, 32), 2.0 ** -8,
                           seed=1)
    got = lowp_gemm.linear(x, w, b, "bf16")
    assert calls and all(c == (torch.bfloat16, torch.bfloat16, torch.float32) for c in calls)
    assert len(calls) == 2  # x's bf16 part, then d's
    assert _same_neighbours(got, F.linear(x, w, b)) >= 0.99


def _both_paths(model, x, logits, kinds) -> tuple:
    """The digit maps, the GEMMs' coverage reasons and the weights' working copies (bytes) of
    ``model`` analysed in bf16 with the bf16 GEMM path and without, by ``lowp_gemm``; every
    call's output the model's own, no stochastic path failed."""
    with torch.no_grad():
        want = logits(model(x))
    maps, how, copies = {}, {}, {}
    for lowp in (True, False):
        torch._dynamo.reset()
        be = fxstab.backend(format="bf16", seed=0, lowp_gemm=lowp)
        f = torch.compile(model, backend=be)
        with torch.no_grad():
            for _ in range(3):  # untraced, traced, replayed
                assert torch.equal(logits(f(x)), want)
        assert not any(i.failures for i in be.infos)
        maps[lowp] = be.digit_map()
        how[lowp] = {e.reason for e in be.coverage().entries if e.kind in kinds}
        copies[lowp] = sum(i.weight_copies for i in be.infos)
    torch._dynamo.reset()
    return maps, how, copies


def test_a_bf16_model_analysed_on_the_bf16_path_matches_the_fp32_path(monkeypatch):
    from models import GPT

    # (a model this small is faster on the fp32 path on the CPU: taken here all the same)
    monkeypatch.setattr(lowp_gemm, "CPU_MIN_DIM", 0)

    torch.manual_seed(0)
    model = GPT(vocab=64, d=64, heads=4, layers=2, ctx=16).to(torch.bfloat16).eval()
    x = torch.randint(0, 64, (2, 16))
    maps, how, copies = _both_paths(model, x, lambda out: out, ("linear",))
    # the linear layers' and embeddings' weights are read as they are (no fp32 copy: twice the
    # model's memory): only the norms and biases have working copies
    total = sum(p.numel() for p in model.parameters())
    kept = sum(m.weight.numel() for m in model.modules()
               if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)))
    assert copies == {False: 4 * total, True: 4 * (total - kept)}, (copies, total, kept)
    assert how[True] == {"batched over the samples (bf16 GEMMs with an fp32 residual)"}, how
    assert how[False] == {"batched over the samples"}
    a, b = maps[True], maps[False]
    assert a.metadata["lowp_gemm"]["cpu"]["ok"] is True and "lowp_gemm" not in b.metadata
    assert list(a.operators) == list(b.operators)
    diff = max(abs(a.operators[n].avg_digits - b.operators[n].avg_digits) for n in a.operators)
    assert diff < 0.05, diff
    with pytest.raises(ValueError, match="lowp_gemm"):
        fxstab.backend(lowp_gemm="yes")


def test_a_training_steps_gradient_gemms_take_the_bf16_path(monkeypatch):
    """issue 52, item 3: the backward graph's saved views of the weights (``t(W^T)``) are weights
    (not perturbed, kept in bf16), so its activation-gradient GEMMs ``mm(grad, W)`` run in the
    bf16 GEMMs; the gradients stay bit for bit the model's, the map within sampling noise of
    the fp32 path's (the same semantics: only the GEMMs' summation order differs)."""
    monkeypatch.setattr(lowp_gemm, "CPU_MIN_DIM", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(),
                                torch.nn.Linear(96, 32)).to(torch.bfloat16)
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    want = [p.grad.clone() for p in model.parameters()]
    maps, how, read = {}, {}, []
    linear = lowp_gemm.linear

    def spy(x, w, b, fmt, native=None):  # the weight operand each product reads
        read.append((w.dtype, w.data_ptr()))
        return linear(x, w, b, fmt, native)

    monkeypatch.setattr(lowp_gemm, "linear", spy)
    for lowp in (True, False):
        torch._dynamo.reset()
        be = fxstab.backend(format="bf16", seed=0, lowp_gemm=lowp, backward=True)
        f = torch.compile(model, backend=be)
        for _ in range(3):  # untraced, traced, replayed
            model.zero_grad()
            f(x).float().pow(2).mean().backward()
            assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want))
        assert not any(i.failures for i in be.infos)
        maps[lowp] = be.digit_map()
        how[lowp] = {e.operator: e.reason for e in be.coverage().entries if e.kind == "mm"}
    torch._dynamo.reset()
    path = "batched over the samples (bf16 GEMMs with an fp32 residual)"
    # the activation gradient of the second linear: its weight's saved view, on the bf16 path;
    # the weight gradients read saved activations (data, perturbed: samples on both sides)
    assert how[True]["2/linear#0/grad/mm#0"] == path, how[True]
    assert how[True]["2/linear#0/grad/mm#1"] != path
    assert path not in how[False].values()
    # read as it is: the parameter's own bf16 memory (no working copy, no perturbed samples)
    assert (torch.bfloat16, model[2].weight.data_ptr()) in read
    a, b = maps[True], maps[False]
    assert list(a.operators) == list(b.operators)
    diff = max(abs(a.operators[n].avg_digits - b.operators[n].avg_digits) for n in a.operators)
    assert diff < 0.05, diff


def test_the_arithmetic_levels_gemms_of_bf16_weights_take_the_bf16_path(monkeypatch):
    """issue 52, item 3: at the arithmetic level a bf16 linear is ``addmm(b, x, t(W))`` (or
    ``mm`` without a bias) of the samples and the program's bf16 operands: the product runs in
    the bf16 GEMMs, reading the weight's own memory; the output is the model's, the map within
    noise of the fp32 path's; a scaled addmm and fp32 operands keep the working-dtype GEMM."""
    from fxstab.rules.aten import AtenContext
    from fxstab.rules.aten.lowp import lowp_operands
    from fxstab.rules.lifting import Stacked

    monkeypatch.setattr(lowp_gemm, "CPU_MIN_DIM", 0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(),
                                torch.nn.Linear(96, 32, bias=False)).to(torch.bfloat16).eval()
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
    read, maps = [], {}
    linear = lowp_gemm.linear

    def spy(x_, w, b, fmt, native=None):
        read.append((w.data_ptr(), None if b is None else b.data_ptr()))
        return linear(x_, w, b, fmt, native)

    monkeypatch.setattr(lowp_gemm, "linear", spy)
    for lowp in (True, False):
        torch._dynamo.reset()
        be = fxstab.backend(format="bf16", granularity="aten", seed=0, lowp_gemm=lowp)
        f = torch.compile(model, backend=be)
        with torch.no_grad():
            for _ in range(3):  # untraced, traced, replayed
                assert torch.equal(f(x), want)
        assert not any(i.failures for i in be.infos)
        maps[lowp] = be.digit_map()
    torch._dynamo.reset()
    assert (model[0].weight.data_ptr(), model[0].bias.data_ptr()) in read  # addmm, its bias
    assert (model[2].weight.data_ptr(), None) in read  # mm
    assert len(read) == 6  # both GEMMs at each of the three calls, none without the path
    a, b = maps[True], maps[False]
    assert list(a.operators) == list(b.operators)
    assert max(abs(a.operators[n].avg_digits - b.operators[n].avg_digits)
               for n in a.operators) < 0.05
    ctx = AtenContext.of(format="bf16", n_samples=3)
    xs = Stacked(torch.randn(3, 8, 64))
    w16 = model[0].weight.t()
    b16 = model[0].bias
    addmm = torch.ops.aten.addmm.default
    assert lowp_operands(addmm, (b16, xs, w16), {}, (b16, xs, w16), ctx) is not None
    assert lowp_operands(addmm, (b16, xs, w16), {"beta": 2}, (b16, xs, w16), ctx) is None
    w32 = w16.float()
    assert lowp_operands(addmm, (b16, xs, w32), {}, (b16, xs, w32), ctx) is None
    assert lowp_operands(addmm, (b16, xs, w16), {}, (b16, xs, w16),
                         AtenContext.of(format="fp16", n_samples=3)) is None


def test_weights_kept_in_bf16_reach_every_other_reader_in_fp32(monkeypatch):
    # a weight read by a linear of plain data (not selected: no samples), a weight tied to an
    # embedding, a weight read as x @ W, a weight read elementwise too: each runs as on the
    # fp32 path
    monkeypatch.setattr(lowp_gemm, "CPU_MIN_DIM", 0)

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(40, 24)
            self.first = torch.nn.Linear(24, 24)
            self.mid = torch.nn.Linear(24, 24, bias=False)
            self.conv1d = torch.nn.Parameter(torch.randn(24, 24) / 5)  # read as x @ W
            self.head = torch.nn.Linear(24, 40, bias=False)
            self.head.weight = self.emb.weight  # tied

        def forward(self, idx, x):
            h = torch.tanh(self.first(x)) + self.emb(idx)
            h = self.mid(h) + h * self.mid.weight[0] + h @ self.conv1d
            return self.head(h)

    torch.manual_seed(0)
    model = Mixed().to(torch.bfloat16).eval()
    idx, x = torch.randint(0, 40, (2, 6)), torch.randn(2, 6, 24).bfloat16()
    with torch.no_grad():
        want = model(idx, x)
    maps = {}
    for lowp in (True, False):
        torch._dynamo.reset()
        be = fxstab.backend(format="bf16", seed=0, lowp_gemm=lowp,
                            select=lambda node, qn: not qn.startswith("first/"))
        f = torch.compile(model, backend=be)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")  # no stochastic path failed
            for _ in range(3):  # untraced, traced, replayed
                assert torch.equal(f(idx, x), want)
        maps[lowp] = be.digit_map()
        if lowp:  # first's, conv1d's (x @ W) and the tied weight kept as they are (read by
            total = sum(p.numel() for p in model.parameters())  # GEMMs and a lookup); mid's
            kept = sum(p.numel() for p in (model.first.weight, model.emb.weight,  # copied (an
                                           model.conv1d))  # elementwise mul reads it)
            assert sum(i.weight_copies for i in be.infos) == 4 * (total - kept)
            assert not any(i.failures for i in be.infos)
    torch._dynamo.reset()
    assert list(maps[True].operators) == list(maps[False].operators)
    for n, op in maps[True].operators.items():
        assert abs(op.avg_digits - maps[False].operators[n].avg_digits) < 0.05, n


def _special(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-44, 38, shape[-1] or 1)[:shape[-1]]
    flat = x.view(-1)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.3961e38, -3.3961e38,
                             -0.0, 0.0, 1e-40, -1e-41, 1e-45, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -9])
    flat[:min(flat.numel(), len(specials))] = specials[:flat.numel()]
    return x


def _same_bits(a, b):  # NaN payloads aside (torch's vectorised conversions differ there)
    nan = torch.isnan(a.float())
    return torch.equal(nan, torch.isnan(b.float())) and \
        torch.equal(a[~nan].float(), b[~nan].float()) and \
        torch.equal(torch.signbit(a[~nan].float()), torch.signbit(b[~nan].float()))


@pytest.mark.parametrize("shape", [(0, 7), (1, 1), (5, 37), (384, 2048)])
def test_the_fused_conversions_equal_their_references(shape):
    import ml_dtypes
    import numpy as np

    from fxstab.cpu import bindings

    if not bindings.available():
        pytest.skip("the fused CPU kernels did not build")
    x = _special(shape, 0)
    got, want = bindings.split_bf16(x), lowp_gemm.split_reference(x)
    assert _same_bits(got[0], want[0])
    assert (got[1] is None) == (want[1] is None)
    if got[1] is not None:
        assert _same_bits(got[1], want[1])
    # the oracle: ml_dtypes' round-to-nearest-even into bfloat16
    oracle = torch.from_numpy(x.numpy().astype(ml_dtypes.bfloat16).astype(np.float32))
    assert _same_bits(got[0], oracle)
    if x.numel():  # x - bf16(x) is exact in fp32 (finite x): hi + lo recovers 16 bits of it
        fin = torch.isfinite(x) & torch.isfinite(got[0].float())
        lo = got[1].float() if got[1] is not None else torch.zeros_like(x)
        err = (got[0].float() + lo - x)[fin].abs()
        assert (err <= 2.0 ** -16 * x[fin].abs() + 2.0 ** -133).all()
    hi = (_special(shape, 1) * 1e3).bfloat16()
    r, dp = _special(shape, 2).bfloat16(), (_special(shape, 3) * 1e-3).bfloat16()
    for d in (None, dp):
        assert _same_bits(bindings.join_bf16(hi, r, d), lowp_gemm.join_reference(hi, r, d))
        into = torch.full(shape, 7.0)  # (into a given tensor: every element written)
        assert bindings.join_bf16(hi, r, d, out=into) is into
        assert _same_bits(into, lowp_gemm.join_reference(hi, r, d, out=torch.empty(shape)))


def _hf_model(name: str):
    transformers = pytest.importorskip("transformers")
    if name == "llama":  # RMSNorm, rotary, GQA, SwiGLU, untied head: the 256-wide k/v
        cfg = transformers.LlamaConfig(  # projections stay on the fp32 path (CPU_MIN_DIM)
            vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
        cls, copied = transformers.LlamaForCausalLM, ("norm", "k_proj", "v_proj")
    else:  # GPT-2: Conv1D's addmm(b, x, W), the head tied to the token embedding
        cfg = transformers.GPT2Config(n_embd=512, n_layer=2, n_head=8, vocab_size=1000,
                                      n_positions=64, bos_token_id=0, eos_token_id=0)
        cls, copied = transformers.GPT2LMHeadModel, ("ln_", "bias")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return cls(cfg).eval(), copied
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_hf_model_in_bf16_reads_its_weights_as_they_are(name, monkeypatch):
    # a transformers model wide enough for the CPU's bf16 path: every GEMM of a weight runs
    # there and its weights (and the embeddings') are not copied into fp32, the output is the
    # model's own, the digit map within the estimator's resolution of the fp32 path's
    monkeypatch.setattr(lowp_gemm, "CPU_MIN_DIM", 512)  # (the path at half the width)
    model, copied = _hf_model(name)
    x = torch.randint(0, 1000, (1, 24))
    maps, how, copies = _both_paths(model, x, lambda out: out.logits, ("linear", "addmm"))
    assert "batched over the samples (bf16 GEMMs with an fp32 residual)" in how[True]
    total = sum(p.numel() for p in model.parameters())
    small = sum(p.numel() for n, p in model.named_parameters() if any(c in n for c in copied))
    assert copies == {False: 4 * total, True: 4 * small}, (copies, total, small)
    a, b = maps[True].operators, maps[False].operators
    assert list(a) == list(b)
    diff = max(abs(a[n].avg_digits - b[n].avg_digits) for n in a)
    assert diff < 0.05, diff


def test_which_weights_stay_in_their_own_dtype():
    w = torch.zeros(1024, 1100, dtype=torch.bfloat16)
    assert lowp_gemm.keeps(w, "bf16") and lowp_gemm.keeps(torch.nn.Parameter(w), "bf16")
    assert not lowp_gemm.keeps(w.float(), "bf16")  # not the format's dtype
    assert not lowp_gemm.keeps(w[:64], "bf16")  # too small for the CPU's bf16 path
    assert not lowp_gemm.keeps(w.half(), "fp16")  # no such path for fp16
    assert lowp_gemm.keeps(w[:64], None)  # read by lookups only: any size

    class Sub(torch.Tensor):  # a tensor subclass (a DTensor, a quantised weight) is copied
        pass

    assert not lowp_gemm.keeps(w.as_subclass(Sub), "bf16")
    assert not lowp_gemm.keeps(w.as_subclass(Sub), None)


def test_fp64_samples_keep_their_working_copies(monkeypatch):
    # format="auto" computes fp64 samples: the bf16 path does not apply, so the GEMMs'
    # weights are converted once and kept (not at every call); the embeddings' lookups widen
    # their rows
    from models import GPT

    monkeypatch.setattr(lowp_gemm, "CPU_MIN_DIM", 0)
    torch.manual_seed(0)
    model = GPT(vocab=64, d=64, heads=4, layers=1, ctx=16).to(torch.bfloat16).eval()
    x = torch.randint(0, 64, (2, 16))
    torch._dynamo.reset()
    be = fxstab.backend(format="auto", seed=0)
    f = torch.compile(model, backend=be)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(f(x), model(x))
    torch._dynamo.reset()
    total = sum(p.numel() for p in model.parameters())
    lookups = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    assert sum(i.weight_copies for i in be.infos) == 8 * (total - lookups)


@pytest.mark.parametrize("bias", [False, True])
def test_products_in_blocks_of_rows_choose_the_same_neighbours(monkeypatch, bias):
    # a long sequence's vocabulary-wide product runs in blocks of rows (its bf16 temporaries
    # bounded): the values are the whole product's, up to the sums' order
    from fxstab.cpu import bindings

    torch.manual_seed(2)
    w, b = _weight(300, 128, bias)
    x, _ = perturb_samples(torch.randn(1, 700, 128).bfloat16().float().expand(3, 700, 128),
                           2.0 ** -8, seed=4)  # off the grid: d's product in blocks too
    whole = lowp_gemm.linear(x, w, b, "bf16", bindings)
    monkeypatch.setattr(lowp_gemm, "_GEMM_CHUNK_BYTES", 1)  # blocks of 256 of the 2100 rows
    for native in (bindings, None):
        blocks = lowp_gemm.linear(x, w, b, "bf16", native)
        assert _same_neighbours(blocks, whole) >= 0.999
        assert _same_neighbours(blocks, F.linear(x, w, b)) >= 0.99
