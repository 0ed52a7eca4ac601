"""The operator-level torch.compile backend (issue 3): structure, numbers, bit-identity."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxstab
from models import (
    CNN, GPT, MLP, Attention, CancellingLinear, DropoutMLP, LSTMClassifier, NaiveSoftmax,
    OffsetLayerNorm, RecurrentStack, T5RelativeBias,
)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def analyse(model, *inputs, **options):
    be = fxstab.backend(**options)
    out = torch.compile(model, backend=be)(*inputs)
    return be, out


def by_name(be):
    return {r.name: r for r in be.reports}


# --------------------------------------------------------------------------- structure
def test_default_selection_instruments_the_operator_families():
    torch.manual_seed(0)
    be, _ = analyse(GPT(layers=1), torch.randint(0, 50, (2, 8)))
    kinds = {kind for info in be.infos for _, kind, _ in info.instrumented}
    assert {"embedding", "layer_norm", "linear", "scaled_dot_product_attention", "gelu"} <= kinds
    # Views, splits, adds and the positional arange are not in the default families.
    assert "add" in kinds  # residual connections (cancellation happens in add/sub)
    assert not kinds & {"view", "transpose", "split", "arange", "getitem"}
    names = [name for info in be.infos for name, _, _ in info.instrumented]
    assert "blocks.0.qkv/linear#0" in names and "blocks.0.mlp.1/gelu#0" in names
    assert len(names) == len(set(names))


@pytest.mark.parametrize("select, expected", [
    ("softmax", {"softmax"}),
    (["linear", "gelu"], {"linear", "gelu"}),
    ("fc2*", {"linear"}),
])
def test_selection_by_kind_family_and_glob(select, expected):
    torch.manual_seed(0)
    m = nn.Sequential()
    m.add_module("fc1", nn.Linear(4, 4))
    m.add_module("act", nn.GELU())
    m.add_module("fc2", nn.Linear(4, 4))
    m.add_module("sm", nn.Softmax(-1))
    be, _ = analyse(m, torch.randn(3, 4), select=select)
    kinds = {r.kind for r in be.reports}
    assert kinds == expected
    if select == "fc2*":
        assert [r.name for r in be.reports] == ["fc2/linear#0"]


def test_selection_by_predicate_and_edges_skip_unselected_operators():
    torch.manual_seed(0)
    seen = []

    def pred(node, qualified_name):
        seen.append(qualified_name)
        return qualified_name in ("fc1/linear", "head/linear")

    be, _ = analyse(MLP(), torch.randn(4, 16), select=pred)
    assert "fc2/linear" in seen
    reports = by_name(be)
    assert set(reports) == {"fc1/linear#0", "head/linear#0"}
    # head's instrumented input is fc1 (through the unselected gelu, fc2, relu).
    assert reports["head/linear#0"].inputs == ("fc1/linear#0",)


def test_unselected_operators_run_unrounded():
    class Shift(nn.Module):
        def forward(self, x):
            return (x + 1000.0) - 1000.0

    x = torch.randn(64)
    # Default selection: the add is rounded into bf16 (spacing 4 at 1000), the sub cancels it.
    both = by_name(analyse(Shift(), x)[0])
    assert both["sub#0"].avg_digits < 0.5
    # Only the sub selected: the add runs unrounded on the samples, the sub sees exact values.
    only = by_name(analyse(Shift(), x, select="sub")[0])
    assert set(only) == {"sub#0"}
    assert only["sub#0"].avg_digits > 1.8


# --------------------------------------------------------------------------- numbers
def test_cancelling_linear_loses_its_digits_and_the_stable_one_keeps_them():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    bad = by_name(analyse(CancellingLinear(offset=1000.0), x)[0])["fc2/linear#0"]
    good = by_name(analyse(CancellingLinear(offset=0.0), x)[0])["fc2/linear#0"]
    assert bad.avg_digits < 0.5 and bad.min_digits == 0.0
    assert good.avg_digits > 1.5
    assert bad.surrogate and good.surrogate


def test_naive_softmax_overflows_in_fp16_and_torch_softmax_does_not():
    torch.manual_seed(0)
    results = {}
    for naive in (True, False):
        m = NaiveSoftmax(naive)
        with torch.no_grad():  # logits 5..13: exp(13) = 4.4e5 > fp16 max 65504
            m.fc.weight.zero_()
            m.fc.bias.copy_(torch.linspace(5, 13, 8))
        be, y = analyse(m, torch.randn(4, 8), format="fp16")
        assert torch.isfinite(y).all()  # the model itself (fp32) is fine
        results[naive] = by_name(be)
    assert results[True]["exp#0"].non_finite > 0
    assert results[True]["div#0"].min_digits == 0.0
    assert results[False]["softmax#0"].min_digits > 1.0
    assert results[False]["softmax#0"].non_finite == 0


def test_near_constant_layer_norm_has_no_digits():
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    bad = by_name(analyse(OffsetLayerNorm(offset=1000.0, spread=1e-2), x)[0])["ln/layer_norm#0"]
    good = by_name(analyse(OffsetLayerNorm(offset=0.0, spread=1.0), x)[0])["ln/layer_norm#0"]
    assert bad.avg_digits < 0.3
    assert good.avg_digits > 1.5


def test_near_tie_attention_loses_digits_and_separated_attention_keeps_them():
    torch.manual_seed(0)
    q, v = torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    k_tie = torch.randn(2, 2, 1, 16).expand(2, 2, 8, 16) + 1e-3 * torch.randn(2, 2, 8, 16)
    tie = by_name(analyse(Attention(100.0), q, k_tie, v)[0])["scaled_dot_product_attention#0"]
    sep = by_name(analyse(Attention(0.25), q, torch.randn(2, 2, 8, 16), v)[0])[
        "scaled_dot_product_attention#0"]
    assert tie.kind == "scaled_dot_product_attention" and tie.surrogate
    assert tie.avg_digits < 1.0
    assert sep.avg_digits > 1.5


def test_stable_network_reports_digits_near_the_cap():
    torch.manual_seed(0)
    be, _ = analyse(MLP(), torch.randn(32, 16), format="fp16")
    cap = fxstab.get_format("fp16").digit_cap
    for r in be.reports:
        assert r.max_digits == pytest.approx(cap)
        assert r.avg_digits > cap - 1.2, r


# --------------------------------------------------------------------------- bit identity
def _train_step(model, x, compiled):
    model = torch.compile(model, backend=compiled) if compiled is not None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outs = []
    for _ in range(2):
        opt.zero_grad()
        torch.manual_seed(123)
        y = model(x)
        y.float().pow(2).mean().backward()
        opt.step()
        outs.append(y.detach().clone())
    return outs


@pytest.mark.parametrize("make, x, mode", [
    (MLP, torch.randn(8, 16), "train"),
    (CNN, torch.randn(4, 3, 8, 8), "train"),
    (CNN, torch.randn(4, 3, 8, 8), "eval"),
    (lambda: GPT(layers=2), torch.randint(0, 50, (2, 12)), "train"),
    (LSTMClassifier, torch.randn(3, 5, 8), "train"),
    (DropoutMLP, torch.randn(8, 16), "train"),
    (lambda: RecurrentStack(nn.GRU, dropout=0.3), torch.randn(3, 5, 8), "train"),
    (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.2,
                                                              batch_first=True), 2,
                                   enable_nested_tensor=False),
     torch.randn(2, 5, 16), "train"),
    (T5RelativeBias, torch.randn(2, 16, 8), "train"),
])
def test_deterministic_output_is_bit_identical_to_eager(make, x, mode):
    torch.manual_seed(0)
    ref = make()
    getattr(ref, mode)()
    test = copy.deepcopy(ref)
    be = fxstab.backend(format="bf16")
    outs_ref = _train_step(ref, x, None)
    outs = _train_step(test, x, be)
    for a, b in zip(outs_ref, outs):
        assert torch.equal(a, b)
    for (n1, p1), (n2, p2) in zip(ref.named_parameters(), test.named_parameters()):
        assert torch.equal(p1, p2), n1
    for b1, b2 in zip(ref.buffers(), test.buffers()):
        assert torch.equal(b1, b2)
    assert be.reports, "the analysis ran"
    assert not any(info.failures for info in be.infos), [i.failures for i in be.infos]
    # the user's RNG stream continues as without fxstab
    torch.manual_seed(5)
    ref(x)
    r1 = torch.rand(4)
    torch.manual_seed(5)
    torch.compile(test, backend=be)(x)
    r2 = torch.rand(4)
    assert torch.equal(r1, r2)


@pytest.mark.parametrize("granularity", ["op", "aten"])
def test_dropout_masks_are_shared_by_all_samples(granularity):
    # output="mean": with a shared mask the sample mean is within rounding noise of the
    # deterministic output; a fresh mask per sample would move it by O(1).
    torch.manual_seed(0)
    m = DropoutMLP().train()
    x = torch.randn(64, 16)
    torch.manual_seed(7)
    det = m(x)
    be = fxstab.backend(granularity=granularity, format="bf16", output="mean")
    torch.manual_seed(7)
    mean = torch.compile(m, backend=be)(x)
    assert (mean - det).abs().max() < 0.05 * det.abs().max()
    assert not torch.equal(mean, det)


def test_batchnorm_training_does_not_mix_samples():
    # Per-sample BatchNorm: each sample normalises with its own batch statistics, so a
    # BatchNorm output keeps the digits of its input (mixing would average the noise away or
    # give different statistics to the samples).
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).train()
    be, _ = analyse(m, torch.randn(16, 8))
    r = by_name(be)
    assert r["1/batch_norm#0"].status == "rounded"
    assert not be.infos[0].unlifted
    assert r["1/batch_norm#0"].avg_digits > 1.5


def test_output_mean_has_straight_through_gradients():
    torch.manual_seed(0)
    m = MLP()
    x = torch.randn(8, 16)
    be = fxstab.backend(format="bf16", output="mean")
    y = torch.compile(m, backend=be)(x)
    y.sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m(x).sum().backward()
    for g, p in zip(grads, m.parameters()):
        assert torch.equal(g, p.grad)


# --------------------------------------------------------------------------- runs
def test_graph_breaks_all_report_with_unique_names():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            x = torch.softmax(self.a(x), -1)
            torch._dynamo.graph_break()
            return torch.softmax(self.b(x), -1)

    torch.manual_seed(0)
    be, _ = analyse(Broken(), torch.randn(4, 8))
    assert len(be.infos) == 2
    names = [r.name for r in be.reports]
    assert names == ["a/linear#0", "softmax#0", "b/linear#0", "softmax#1"]


def test_dynamic_shapes_keep_the_same_names():
    torch.manual_seed(0)
    m = MLP()
    be = fxstab.backend(format="bf16")
    cm = torch.compile(m, backend=be)
    cm(torch.randn(4, 16))
    first = [r.name for r in be.reports]
    be.clear()
    y = cm(torch.randn(7, 16))
    assert torch.equal(y, m(torch.randn(7, 16)) * 0 + y)
    assert [r.name for r in be.reports] == first
    assert {r.shape[0] for r in be.reports} == {7}


def test_every_k_analyses_one_call_in_k():
    torch.manual_seed(0)
    m = MLP()
    be = fxstab.backend(every=3)
    cm = torch.compile(m, backend=be)
    x = torch.randn(4, 16)
    for i in range(7):
        assert torch.equal(cm(x), m(x))
    info = be.infos[0]
    assert info.calls == 7 and info.analysed_calls == 3
    assert sorted({r.call for r in be.reports}) == [0, 3, 6]


def test_same_seed_same_reports_and_different_seed_differs():
    torch.manual_seed(0)
    m, x = GPT(layers=1), torch.randint(0, 50, (2, 8))
    runs = []
    for seed in (3, 3, 4):
        torch._dynamo.reset()
        torch.manual_seed(0)  # the same dropout masks (the model is in training mode)
        be, _ = analyse(m, x, seed=seed)
        runs.append([(r.name, r.avg_digits, r.min_digits, r.zero_fraction) for r in be.reports])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_phase_and_step_label_reports():
    torch.manual_seed(0)
    m = MLP()
    be = fxstab.backend()
    cm = torch.compile(m, backend=be)
    for step in range(2):
        with be.phase("train", step=step):
            cm(torch.randn(4, 16))
    cm(torch.randn(4, 16))
    labels = [(r.phase, r.step) for r in be.reports]
    n = len(be.reports) // 3
    assert labels == [("train", 0)] * n + [("train", 1)] * n + [("default", None)] * n


def test_backend_by_name_uses_defaults():
    torch.manual_seed(0)
    from fxstab.backend import get_default_backend

    be = get_default_backend()
    be.clear()
    m = MLP()
    x = torch.randn(4, 16)
    assert torch.equal(torch.compile(m, backend="fxstab")(x), m(x))
    assert {r.format for r in be.reports} == {"bf16"}


def test_a_failing_stochastic_path_never_breaks_the_model(monkeypatch):
    from fxstab.rules.op.tracer import SampleTracer

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure inside the stochastic path")

    monkeypatch.setattr(SampleTracer, "_round_and_record", broken)  # every rounding
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 16)
    be = fxstab.backend()
    with pytest.warns(RuntimeWarning, match="simulated failure"):
        y = torch.compile(m, backend=be)(x)
    assert torch.equal(y, m(x))
    assert be.infos[0].failures and not be.reports


def test_operators_that_cannot_be_lifted_run_per_sample_unrounded():
    class Sorter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)

        def forward(self, x):
            # torch.cumsum over a data-dependent permutation: lifted by vmap; the custom
            # autograd-free python op below is not batch-transparent.
            return torch.cumsum(_PerSampleOnly.apply(self.fc(x)), -1)

    torch.manual_seed(0)
    be, y = analyse(Sorter(), torch.randn(3, 6), select=["linear", "cumsum", "apply"])
    info = be.infos[0]
    r = by_name(be)
    assert any("apply" in key for key in info.unlifted), info.unlifted
    assert r["cumsum#0"].status == "rounded"


class _PerSampleOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.flip(-1) * 2

    @staticmethod
    def backward(ctx, g):
        return g.flip(-1) * 2


@pytest.mark.parametrize("kwargs, match", [
    ({"n_samples": 1}, "n_samples"),
    ({"n_samples": 2.5}, "n_samples"),
    ({"format": "bf17"}, "unknown format"),
    ({"format": (0, 3)}, "exp_bits"),
    ({"rounding": "sideways"}, "rounding"),
    ({"granularity": "layer"}, "granularity"),
    ({"every": 0}, "every"),
    ({"output": "median"}, "output"),
    ({"confidence": 1.5}, "confidence"),
    ({"kernels": "cuda"}, "kernels"),
    ({"select": 3}, "select"),
    ({"seed": -1}, "seed"),
    ({"colour": "red"}, "unknown fxstab option"),
])
def test_invalid_options_are_rejected_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fxstab.backend(**kwargs)


@pytest.mark.parametrize("kwargs, close", [
    ({"formt": "fp16"}, "format"),
    ({"zero_treshold": 0.4}, "zero_threshold"),
    ({"n_sample": 4}, "n_samples"),
    ({"lowp_gem": False}, "lowp_gemm"),
])
def test_a_misspelt_option_names_the_closest(kwargs, close):
    """Issue 56, item 13: `formt=` said only "unknown"; it says "did you mean 'format'?"."""
    with pytest.raises(ValueError) as info:
        fxstab.backend(**kwargs)
    (name,) = kwargs
    assert f"unknown fxstab option {name!r} (did you mean {close!r}?)" in str(info.value)
    with pytest.raises(ValueError, match=r"option 'colour'; the options"):  # nothing close
        fxstab.backend(colour="red")


def test_the_readme_option_table_lists_every_option():
    """Issue 56, item 13: every keyword fxstab.backend takes is a row of the README's table."""
    import inspect
    import re

    from fxstab.config import AnalysisConfig

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("| option | default | meaning |"):]
    table = table[:table.index("\n\n")]
    rows = {name for first in re.findall(r"^\| ([^|]+) \|", table, re.M)
            for name in re.findall(r"`(\w+)`", first)}
    options = ({*inspect.signature(fxstab.backend).parameters, *AnalysisConfig.__dataclass_fields__}
               - {"options"})
    assert not options - rows, f"missing from the README's option table: {sorted(options - rows)}"
    assert not rows - options, f"not options of fxstab.backend: {sorted(rows - options)}"


def test_surrogate_perturbs_data_operands_not_weights(monkeypatch):
    """A GEMM that meets the model's inputs perturbs its data operands, never the weights."""
    from fxstab.cpu import bindings
    from fxstab import executors

    seen = []
    for mod, name in ((bindings, "perturb"), (executors, "perturb_samples")):
        original = getattr(mod, name)

        def spy(samples, *args, _original=original, **kwargs):
            seen.append(tuple(samples.shape[-2:]))
            return _original(samples, *args, **kwargs)

        monkeypatch.setattr(mod, name, spy)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8)

        def forward(self, x, a, b):
            return self.fc(x), a @ b

    torch.manual_seed(0)
    be = fxstab.backend()
    with torch.no_grad():
        torch.compile(Net(), backend=be)(torch.randn(4, 16), torch.randn(3, 5), torch.randn(5, 2))
    assert sorted(seen) == [(3, 5), (4, 16), (5, 2)]  # x, a and b; not fc.weight (8, 16)
    assert all(r.surrogate for r in be.reports if r.kind in ("linear", "matmul"))


def test_elementwise_operators_run_on_the_stacked_samples_where_broadcasting_allows(monkeypatch):
    """Elementwise operators skip vmap when the sample dim cannot meet another operand's dims;
    a plain operand with more dims, or stacked operands of different ranks, still go through
    vmap. Either way the samples' mean stays the model's output."""
    class Broadcasts(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 5)
            self.wide = nn.Parameter(torch.randn(2, 4, 5))

        def forward(self, x):
            h = torch.relu(self.fc(x))            # [4, 5] stacked: direct
            a = h + self.wide                     # plain operand of higher rank: vmap
            b = h.sum(0) * h                      # stacked [5] times stacked [4, 5]: vmap
            return torch.exp(a) + b               # stacked [2, 4, 5] + stacked [4, 5]: vmap

    calls = []
    real_vmap = torch.vmap

    def counting_vmap(fn, *a, **k):
        calls.append(fn)
        return real_vmap(fn, *a, **k)

    monkeypatch.setattr(torch, "vmap", counting_vmap)
    torch.manual_seed(0)
    m, x = Broadcasts(), torch.randn(4, 5)
    be, y = analyse(m, x, format="fp32", output="mean", select=["relu", "add", "mul", "exp"])
    assert y.shape == (2, 4, 5)
    # the mean of 3 samples rounded into fp32 (working dtype fp64, perturbed GEMM inputs)
    # against the fp32 eager result: a few fp32 ulps of exp(...) ~ 10, not a shape error
    torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)
    r = by_name(be)
    assert {"relu#0", "add#0", "mul#0", "exp#0", "add#1"} <= set(r)
    assert all(rep.status == "rounded" for rep in be.reports)
    assert len(calls) == 4  # sum (a reduction), add#0, mul#0, add#1; relu and exp ran directly


def test_an_output_read_only_by_a_gemm_is_perturbed_in_its_rounding_pass(monkeypatch):
    """MLP: gelu feeds only fc2 and relu only head, so their rounding pass also applies the
    GEMM's surrogate (one pass, the GEMM's seed); fc1's output feeds gelu (not a GEMM) and the
    input meets fc1 unrounded: those keep separate passes. The reports match the torch path."""
    from fxstab.cpu import bindings as native

    if not native.available():
        pytest.skip("no C compiler for fxstab.cpu.bindings")
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(64, 16)
    fused_calls, perturb_calls = [], []
    real_rp, real_p, real_prepared = native.round_perturb, native.perturb, native.Prepared.__call__

    def prepared(self, x, seed):
        if self.fused is not None:  # the usual one-output step: its prepared kernel
            fused_calls.append(x.shape)
        return real_prepared(self, x, seed)

    monkeypatch.setattr(native.Prepared, "__call__", prepared)
    monkeypatch.setattr(native, "round_perturb",
                        lambda *a, **k: fused_calls.append(a[0].shape) or real_rp(*a, **k))
    monkeypatch.setattr(native, "perturb",
                        lambda *a, **k: perturb_calls.append(a[0].shape) or real_p(*a, **k))
    be, _ = analyse(m, x, seed=3)
    plans = {p.name: p for g in be.graphs for p in g.plans if p.name}
    assert plans["gelu#0"].fuse[0].name == "fc2/linear#0"
    assert plans["relu#0"].fuse[0].name == "head/linear#0"
    assert plans["fc1/linear#0"].fuse is None and plans["fc2/linear#0"].fuse is None
    assert len(fused_calls) == 2 and len(perturb_calls) == 1  # fc1's plain input only
    torch._dynamo.reset()
    ref, _ = analyse(m, x, seed=3, kernels="torch")
    got, want = by_name(be), by_name(ref)
    assert got.keys() == want.keys()
    for name, r in got.items():
        assert r.surrogate == want[name].surrogate, name
        assert abs(r.avg_digits - want[name].avg_digits) < 1e-5, name


def test_clear_resets_the_call_count_of_later_maps():
    torch._dynamo.reset()
    be = fxstab.backend(format="bf16")
    m = torch.compile(torch.nn.Linear(8, 4), backend=be)
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(2, 8))
        assert be.digit_map().metadata["analysed_calls"] == 3
        be.clear()
        m(torch.randn(2, 8))
    dm = be.digit_map()
    assert dm.metadata["analysed_calls"] == 1 and "1 analysed call(s)" in dm.table()


def test_compile_by_name_accepts_options():
    torch._dynamo.reset()
    m = torch.compile(torch.nn.Linear(8, 4), backend="fxstab",
                      options={"format": "fp16", "seed": 3})
    with torch.no_grad():
        m(torch.randn(2, 8))
    be = fxstab.get_default_backend(format="fp16", seed=3)
    assert be.config.format.name == "fp16" and be.reports
    assert be is not fxstab.get_default_backend()
    torch._dynamo.reset()


@pytest.mark.parametrize("granularity", ["op", "aten"])
def test_capture_samples_gives_the_outputs_samples(granularity):
    """capture_samples(): the samples of the model's output, whose mean is what output="mean"
    returns; nothing kept outside the block; a clear error when nothing was analysed."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 16)
    results = {}
    for output in ("deterministic", "mean"):
        torch._dynamo.reset()
        be = fxstab.backend(granularity=granularity, format="bf16", seed=3, output=output)
        f = torch.compile(model, backend=be)
        with torch.no_grad(), be.capture_samples() as cap:
            y = f(x)
        results[output] = (y, cap)
    y, cap = results["deterministic"]
    assert torch.equal(y, model(x))
    s = cap.output
    assert s.shape == (3, *y.shape) and len(cap.graphs) == 1
    assert not torch.equal(s[0], s[1])  # the samples differ
    assert torch.equal(s.mean(0).to(y.dtype), results["mean"][0])
    assert not be.state.captures
    with pytest.raises(RuntimeError, match="no graph was analysed"):
        with be.capture_samples() as empty, be.paused():
            f(x)
        empty.output


@pytest.mark.parametrize("mask", ["none", "causal", "2d", "4d batch", "4d broadcast", "positional"])
def test_attention_on_the_samples_is_n_calls_of_the_fused_kernel(mask):
    """SDPA of stacked q, k, v [N, B, H, L, E] runs as one call over N * B batches (five dims
    would take the CPU's math path): bit for bit the N per-sample calls, for every mask layout
    (a plain mask with a batch dim of its own is repeated per sample)."""
    import torch.nn.functional as F

    from fxstab.rules.lifting import attention_folded

    g = torch.Generator().manual_seed(3)
    n, b, h, length, e = 3, 2, 4, 16, 8
    q, k, v = (torch.randn(n, b, h, length, e, generator=g) for _ in range(3))
    args, kw = [], {}
    if mask == "causal":
        kw = {"is_causal": True}
    elif mask == "2d":
        kw = {"attn_mask": torch.randn(length, length, generator=g)}
    elif mask == "4d batch":
        kw = {"attn_mask": torch.randn(b, 1, length, length, generator=g) > 0}
    elif mask == "4d broadcast":
        kw = {"attn_mask": torch.randn(1, h, length, length, generator=g)}
    elif mask == "positional":
        args = [torch.randn(b, h, length, length, generator=g), 0.0]
    got = attention_folded(F.scaled_dot_product_attention, [q, k, v, *args], kw)
    want = torch.stack([F.scaled_dot_product_attention(q[i], k[i], v[i], *args, **kw)
                        for i in range(n)])
    assert got.shape == want.shape and torch.equal(got, want)


def test_a_model_s_attention_runs_the_fused_kernel_on_its_samples():
    """The test GPT's scaled_dot_product_attention reaches its sampled graph as the fused
    kernel the deterministic pass runs, not the math path's bmm and softmax."""
    model = GPT(vocab=64, d=32, heads=4, layers=1, ctx=16).eval()
    x = torch.randint(0, 64, (2, 16))
    be = fxstab.backend()
    f = torch.compile(model, backend=be)
    with torch.no_grad():
        for _ in range(2):
            f(x)
    code = be.sampled_graphs()[0].code
    assert "scaled_dot_product" in code and "bmm" not in code and "softmax" not in code


def test_attention_whose_folded_call_fails_runs_as_called():
    """A folded SDPA call that raises (a layout the fold does not suit) is made as the operator
    was called, on the five-dim samples."""
    import torch.nn.functional as F

    from fxstab.rules.lifting import attention_folded

    calls = []

    def sdpa(q, k, v, *args, **kwargs):
        calls.append(q.dim())
        if q.dim() == 4:
            raise RuntimeError("no folded batch here")
        return F.scaled_dot_product_attention(q, k, v, *args, **kwargs)

    q, k, v = (torch.randn(3, 2, 4, 8, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    got = attention_folded(sdpa, [q, k, v], {"is_causal": True})
    assert calls == [4, 5]
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    mask = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(5))  # repeated...
    for args, kw in (([mask], {}), ([], {"attn_mask": mask})):
        calls.clear()  # ...for the folded call only: the call as made gets the user's mask
        got = attention_folded(sdpa, [q, k, v, *args], kw)
        assert calls == [4, 5]
        assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, mask))
