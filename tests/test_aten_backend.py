"""granularity="aten": lowering, names with operator context, counters, bit-identity."""

from __future__ import annotations

import copy

import pytest
import torch

import fxstab
from models import CNN, MLP, CancellingLinear, DropoutMLP, OffsetLayerNorm


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def analyse(model, *inputs, **options):
    be = fxstab.backend(granularity="aten", **options)
    out = torch.compile(model, backend=be)(*inputs)
    assert not any(info.failures for info in be.infos), [info.failures for info in be.infos]
    return be, out


def test_primitives_are_named_within_their_operator():
    torch.manual_seed(0)
    be, _ = analyse(OffsetLayerNorm(offset=0.0, spread=1.0), torch.randn(4, 32))
    names = [r.name for r in be.reports]
    assert names[0] == "fc/linear#0/aten.addmm#0"
    ln = [n for n in names if n.startswith("ln/layer_norm#0/aten.")]
    # layer_norm decomposes into its arithmetic: mean/var, rsqrt, sub, mul, add
    kinds = {n.split("aten.")[1].split("#")[0] for n in ln}
    assert {"rsqrt", "sub", "mul"} <= kinds
    assert all(r.module_path == ("fc" if r.name.startswith("fc") else "ln") for r in be.reports)
    # edges follow the data: the first layer_norm primitive reads the linear's output
    first_ln = next(r for r in be.reports if r.name in ln)
    assert first_ln.inputs == ("fc/linear#0/aten.addmm#0",)


def test_cancellation_is_located_at_the_primitive_and_counted():
    torch.manual_seed(0)
    be, _ = analyse(OffsetLayerNorm(offset=1000.0, spread=1e-2), torch.randn(8, 32))
    r = {x.name: x for x in be.reports}
    sub = r["ln/layer_norm#0/aten.sub#0"]
    assert sub.avg_digits < 0.3  # x - mean(x): the offset cancels
    assert r["fc/linear#0/aten.addmm#0"].avg_digits > 2.0
    total = {k: sum(x.counters[k] for x in be.reports) for k in sub.counters}
    assert total["cancellation"] + total["multiplication"] + total["math_function"] > 0


def test_gemm_primitives_use_the_surrogate():
    torch.manual_seed(0)
    bad, _ = analyse(CancellingLinear(offset=1000.0), torch.randn(8, 16))
    good, _ = analyse(CancellingLinear(offset=0.0), torch.randn(8, 16))
    b = {x.name: x for x in bad.reports}["fc2/linear#0/aten.mm#0"]
    g = {x.name: x for x in good.reports}["fc2/linear#0/aten.mm#0"]
    assert b.surrogate and g.surrogate
    assert b.avg_digits < 0.5 < 1.5 < g.avg_digits


@pytest.mark.parametrize("make, x, mode", [
    (MLP, torch.randn(8, 16), "train"),
    (CNN, torch.randn(4, 3, 8, 8), "train"),
    (DropoutMLP, torch.randn(8, 16), "train"),
])
def test_deterministic_output_and_gradients_unchanged(make, x, mode):
    torch.manual_seed(0)
    ref = make()
    getattr(ref, mode)()
    test = copy.deepcopy(ref)
    be = fxstab.backend(granularity="aten")
    compiled = torch.compile(test, backend=be)
    torch.manual_seed(3)
    y_ref = ref(x)
    y_ref.square().mean().backward()
    r_ref = torch.rand(3)
    torch.manual_seed(3)
    y = compiled(x)
    y.square().mean().backward()
    r = torch.rand(3)
    assert torch.equal(y, y_ref) and torch.equal(r, r_ref)
    for p1, p2 in zip(ref.parameters(), test.parameters()):
        assert torch.equal(p1.grad, p2.grad)
    for b1, b2 in zip(ref.buffers(), test.buffers()):
        assert torch.equal(b1, b2)
    assert be.reports


def test_every_k_and_same_seed_same_reports():
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 16)
    be = fxstab.backend(granularity="aten", every=2, seed=5)
    cm = torch.compile(m, backend=be)
    for _ in range(4):
        cm(x)
    assert be.infos[0].analysed_calls == 2
    calls = sorted({r.call for r in be.reports})
    assert calls == [0, 2]
    first = [(r.name, r.avg_digits) for r in be.reports if r.call == 0]
    torch._dynamo.reset()
    be2 = fxstab.backend(granularity="aten", seed=5)
    torch.compile(m, backend=be2)(x)
    assert [(r.name, r.avg_digits) for r in be2.reports] == first


def test_eager_driver_and_compiled_aten_path_agree_on_digits():
    # The same per-primitive rules run in both; their random streams differ (per call salts),
    # so compare averages over many elements: within 0.15 digits of each other.
    torch.manual_seed(0)
    x = torch.randn(256, 64) * 3 + 100.0

    def f(t):
        return (t - t.mean(-1, keepdim=True)).exp().sum(-1)

    be = fxstab.backend(granularity="aten", format="bf16", seed=1)
    torch.compile(f, backend=be)(x)
    compiled = {r.name.split("/")[-1].split("#")[0]: r.avg_digits for r in be.reports}
    res = fxstab.analyze(f, format="bf16", seed=1)(x)
    eager = {r.name.split("/")[-1].split("#")[0]: r.avg_digits for r in res.reports}
    common = set(compiled) & set(eager)
    assert {"aten.sub", "aten.exp", "aten.sum"} <= common
    for k in common:
        assert abs(compiled[k] - eager[k]) < 0.15, (k, compiled[k], eager[k])


def test_models_fed_only_by_parameters_are_analysed():
    # A language model's floating data all come from its embedding tables (parameters): the
    # first arithmetic primitive on them brings the values into the samples.
    from models import GPT

    torch.manual_seed(0)
    be, _ = analyse(GPT(layers=1), torch.randint(0, 50, (2, 8)))
    names = [r.name for r in be.reports]
    assert names[0] == "add#0/aten.add#0"  # token + position embeddings
    assert any(n.startswith("blocks.0.attn") or "scaled_dot_product" in n for n in names) or \
        any(n.startswith("blocks.0.qkv") for n in names)
    assert len(names) > 20


def test_eval_batchnorm_with_empty_saved_statistics_is_analysed():
    # In eval mode the lowered batch_norm returns zero-size saved statistics: empty outputs
    # must pass through the rules (regression: aminmax over an empty tensor).
    torch.manual_seed(0)
    be, _ = analyse(CNN().eval(), torch.randn(2, 3, 8, 8))
    assert any("batch_norm" in r.name for r in be.reports)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32"])
def test_cpu_kernels_match_the_torch_references(fmt):
    """kernels="cpu" (zero masks from the kernel, counters skipped where the statistics rule
    them out, statistics without per-element logarithms) against kernels="torch": the same
    samples bit for bit (the mean output), the same counters, the same digits."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(24, 24)
            self.scale = torch.nn.Parameter(torch.rand(24) + 0.5)

        def forward(self, x):
            h = torch.nn.functional.layer_norm(self.fc(x), (24,)) * self.scale + x
            h = h - h.mean(-1, keepdim=True) / 3.0
            cancelled = (x + 1e5) - 1e5  # a cancellation in every format
            return torch.softmax(h / 0.7, dim=-1) + 2 * h[:, :1] - (h.t() * 0.5).t() + cancelled

    from fxstab.cpu import bindings as native

    if not native.available():
        pytest.skip("no C compiler for fxstab.cpu.bindings")
    torch.manual_seed(0)
    m, x = Block(), torch.randn(6, 24)
    got = {}
    for kernels in ("cpu", "torch"):
        torch._dynamo.reset()
        be, y = analyse(m, x, format=fmt, output="mean", kernels=kernels, seed=4)
        got[kernels] = (y, {r.name: r for r in be.reports})
    (y_cpu, r_cpu), (y_torch, r_torch) = got["cpu"], got["torch"]
    assert torch.equal(y_cpu, y_torch)
    assert r_cpu.keys() == r_torch.keys() and len(r_cpu) > 15
    for name, r in r_cpu.items():
        t = r_torch[name]
        assert r.counters == t.counters, name
        assert r.non_finite == t.non_finite and r.zero_fraction == t.zero_fraction, name
        assert abs(r.avg_digits - t.avg_digits) < 1e-5 and abs(r.min_digits - t.min_digits) < 1e-4
    assert sum(sum(r.counters.values()) for r in r_cpu.values()) > 0  # some counter fired


def test_context_for_a_call_keeps_the_settings_and_starts_afresh():
    """The backend checks its settings once per graph (AtenContext) and analyses each call in
    a copy with fresh running state: its own seed, recorder, counters and occurrence counts."""
    from fxstab.rules.aten import AtenContext, apply_primitive

    proto = AtenContext.of(format="bf16", n_samples=3, diagnostics="summary")
    x = torch.tensor([1.0, 1.0 + 2.0 ** -7, 2.0])
    first: list = []
    a = proto.for_call(11, first.append)
    y = apply_primitive(torch.ops.aten.sub.Tensor, (a.stack(x), a.stack(x.flip(0))), {}, a)
    apply_primitive(torch.ops.aten.exp.default, (y,), {}, a)
    second: list = []
    b = proto.for_call(11, second.append)
    y = apply_primitive(torch.ops.aten.sub.Tensor, (b.stack(x), b.stack(x.flip(0))), {}, b)
    apply_primitive(torch.ops.aten.exp.default, (y,), {}, b)
    assert [r.name for r in second] == [r.name for r in first] == ["aten.sub#0", "aten.exp#0"]
    assert [r.stats for r in second] == [r.stats for r in first]
    assert b.counters.counts == a.counters.counts and b.counters is not a.counters
    assert b.calls == a.calls == 2 and proto.calls == 0 and proto.recorder is None
    assert (b.fmt, b.cap, b.n_samples, b._rounders) == (proto.fmt, proto.cap, 3, proto._rounders)


def test_operand_needs_says_what_counters_read():
    """The rounding pass writes an operand's digits only for consumers that can see a
    cancellation in them, and its zero mask only for consumers whose counters read one:
    divisors (not numerators), factors, math arguments."""
    from fxstab.rules.aten import op_info, operand_needs

    aten = torch.ops.aten
    a, b = object(), object()
    assert operand_needs(op_info(aten.sub.Tensor), (a, b), {}, a) == (True, False)
    assert operand_needs(op_info(aten.sum.dim_IntList), (a, [1]), {}, a) == (True, False)
    assert operand_needs(op_info(aten.div.Tensor), (a, b), {}, a) == (False, False)
    assert operand_needs(op_info(aten.div.Tensor), (a, b), {}, b) == (False, True)
    assert operand_needs(op_info(aten.div.Tensor), (a, a), {}, a) == (False, True)
    assert operand_needs(op_info(aten.reciprocal.default), (a,), {}, a) == (False, True)
    assert operand_needs(op_info(aten.mul.Tensor), (a, b), {}, b) == (False, True)
    assert operand_needs(op_info(aten.exp.default), (a,), {}, a) == (False, True)
    assert operand_needs(op_info(aten.amax.default), (a, [1], True), {}, a) == (False, False)
    assert operand_needs(op_info(aten.where.self), (b, a, 0.0), {}, a) == (False, False)
    assert operand_needs(op_info(aten.add.Tensor), (b,), {"other": a}, a) == (True, True)


def test_divisions_counted_with_the_planned_zero_masks():
    """Division counts at the arithmetic level are the same whether the divisor's zero mask
    was written in its rounding pass (the plan) or measured when the division read it."""
    from fxstab.rules.aten import AtenContext, apply_primitive

    aten = torch.ops.aten
    x = torch.linspace(-1, 1, 64)
    counts = []
    for need_digits, need_zeros, written in ((False, True, True), (False, False, False),
                                             (None, None, True)):  # None: assume a reader
        ctx = AtenContext.of(format="bf16", n_samples=3, seed=4)
        a = ctx.stack(x)
        y = apply_primitive(aten.mul.Tensor, (a, 1.0 + 2.0 ** -10), {}, ctx)
        d = apply_primitive(aten.sub.Tensor, (y, a), {}, ctx,  # rounding noise: zeros
                            need_digits=need_digits, need_zeros=need_zeros)
        assert (d._an._zero is not None) == written
        apply_primitive(aten.div.Tensor, (a, d), {}, ctx)
        counts.append(ctx.counters.counts["division"])
    assert counts[0] == counts[1] == counts[2] > 0


def test_an_attention_masks_infinities_are_no_nan_origin():
    """masked_fill(-inf) before a softmax writes its infinities by design: recorded (observed),
    it is no NaN/inf origin and neither is the softmax's x - max that reads them."""
    import math as _math

    class Masked(torch.nn.Module):
        def forward(self, q, k):
            s = q @ k.transpose(-1, -2) / _math.sqrt(q.shape[-1])
            mask = torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
            return torch.softmax(s.masked_fill(mask, float("-inf")), -1)

    torch._dynamo.reset()
    be = fxstab.backend(granularity="aten", format="bf16")
    q, k = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    with torch.no_grad():
        torch.compile(Masked(), backend=be)(q, k)
    dm = be.digit_map()
    fills = [op for op in dm.operators.values() if "masked_fill#0/" in op.name]
    assert fills and fills[0].status == "observed" and fills[0].non_finite > 0
    assert dm.nonfinite_sources() == [] and dm.findings() == []
    sub = next(op for op in dm.operators.values() if op.kind == "sub")
    assert sub.non_finite > 0 and fills[0].name in sub.inputs
