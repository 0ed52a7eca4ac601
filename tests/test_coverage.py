"""Issue 17 at the operator level: every operator analysed, and a coverage report that says
how each one ran (fxstab/records/coverage.py, fxstab/backend.py, fxstab/capture/user_ops.py)."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxstab
from models import (DropoutMLP, ExpandUp, MLP, RecurrentStack, SpectralFilter,
                    T5RelativeBias)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def analyse(model, *inputs, grad=False, **options):
    be = fxstab.backend(**options)
    with torch.set_grad_enabled(grad):
        out = torch.compile(model, backend=be)(*inputs)
    return be, out


def by_name(be):
    return {r.name: r for r in be.reports}


def no_failures(be):
    assert not any(info.failures for info in be.infos), [i.failures for i in be.infos]


def encoder(dropout=0.0, norm_first=False):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=dropout, batch_first=True,
                                       norm_first=norm_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


# --------------------------------------------------------------------------- attention
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder_fast_path_is_analysed_with_the_unfused_names(norm_first):
    """eval + no_grad takes torch._transformer_encoder_layer_fwd (one fused call per layer):
    the deterministic path keeps it, the samples run its composite, named as the module names
    its operators without the fast path (grad enabled)."""
    enc = encoder(norm_first=norm_first).eval()
    x = torch.randn(2, 5, 16)
    fast, y = analyse(enc, x)
    with torch.no_grad():
        assert torch.equal(y, enc(x))  # the fused kernel's own bits
    fused = [n for g in fast.graphs for n in g.gm.graph.nodes
             if n.op == "call_function" and "transformer_encoder_layer_fwd" in str(n.target)]
    assert len(fused) == 2, "the fast path was taken"
    no_failures(fast)
    torch._dynamo.reset()
    slow, _ = analyse(enc, x, grad=True)
    assert [r.name for r in fast.reports] == [r.name for r in slow.reports]
    names = by_name(fast)
    for layer in (0, 1):
        mha = names[f"layers.{layer}.self_attn/multi_head_attention_forward#0"]
        assert mha.status == "rounded" and 1.0 < mha.avg_digits < 2.41
        assert f"layers.{layer}.norm2/layer_norm#0" in names
        assert f"layers.{layer}.linear1/linear#0" in names
    for name, r in names.items():  # the same analysis: digits agree within the noise
        assert abs(r.avg_digits - by_name(slow)[name].avg_digits) < 0.3, name
    cov = fast.coverage()
    assert cov.fraction == 1.0
    fused_entries = [e for e in cov.skipped if e.kind == "transformer_encoder_layer_fwd"]
    assert [e.operator for e in fused_entries] == ["layers.0/transformer_encoder_layer_fwd",
                                                   "layers.1/transformer_encoder_layer_fwd"]
    assert all("composite" in e.reason and not e.counted for e in fused_entries)


def test_transformer_encoder_with_a_padding_mask_on_the_fast_path():
    enc = encoder().eval()
    x = torch.randn(2, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    be, y = analyse(enc, x, None, pad)
    with torch.no_grad():
        assert torch.equal(y, enc(x, None, pad))
    no_failures(be)
    assert by_name(be)["layers.1.self_attn/multi_head_attention_forward#0"].avg_digits > 1.0


def test_transformer_encoder_in_training_is_bit_identical_and_its_attention_analysed():
    ref = encoder(dropout=0.1).train()
    test = copy.deepcopy(ref)
    x = torch.randn(2, 5, 16)
    be = fxstab.backend()
    outs = []
    for model, backend in ((ref, None), (test, be)):
        m = torch.compile(model, backend=backend) if backend else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(3)
        y = m(x)
        y.pow(2).mean().backward()
        opt.step()
        outs.append((y.detach(), torch.rand(3)))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])  # the RNG stream after the call
    for p1, p2 in zip(ref.parameters(), test.parameters()):
        assert torch.equal(p1, p2)
    no_failures(be)
    names = by_name(be)
    # attention dropout inside: vmap refuses the randomness, and the operator runs once per
    # sample from the deterministic pass's RNG state (its masks), rounded and recorded
    for layer in (0, 1):
        mha = names[f"layers.{layer}.self_attn/multi_head_attention_forward#0"]
        assert mha.status == "per_sample" and mha.avg_digits > 1.0
        assert "random" in be.infos[0].unlifted[mha.name]
    drops = [r for r in be.reports if r.kind == "dropout"]
    assert len(drops) == 6 and all(r.status == "rounded" for r in drops)


def test_transformer_encoder_in_training_samples_share_the_dropout_masks():
    """output="mean": with the deterministic pass's masks (attention dropout, the residual
    dropouts) the sample mean stays within rounding noise of the output."""
    enc = encoder(dropout=0.2).train()
    x = torch.randn(2, 5, 16)
    torch.manual_seed(4)
    det = enc(x)
    be = fxstab.backend(output="mean")
    torch.manual_seed(4)
    mean = torch.compile(enc, backend=be)(x)
    no_failures(be)
    assert (mean - det).abs().max() < 0.1 * det.abs().max()
    assert not torch.equal(mean, det)


@pytest.mark.parametrize("grad", [False, True])
def test_multihead_attention_is_one_analysed_operator(grad):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16))
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.mha = m, mha

        def forward(self, x):
            h = self.fc(x)
            return self.mha(h, h, h, need_weights=False)[0]

    net = Net().eval()
    x = torch.randn(2, 6, 16)
    be, y = analyse(net, x, grad=grad)
    with torch.set_grad_enabled(grad):
        # what torch.compile runs (under no_grad eager takes _native_multi_head_attention,
        # dynamo's graph the composite: torch.compile(backend="eager") differs from eager too)
        assert torch.equal(y, torch.compile(net, backend="eager")(x))
    no_failures(be)
    r = by_name(be)["mha/multi_head_attention_forward#0"]
    assert r.status == "rounded" and r.surrogate
    assert 1.0 < r.avg_digits < fxstab.get_format("bf16").digit_cap


# --------------------------------------------------------------------------- recurrent layers
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_recurrent_layers_are_rounded_with_the_deterministic_dropout_masks(cell):
    """Per sample, each from the deterministic pass's RNG state: inter-layer dropout is the
    same in every sample, so the digits are those of the dropout-free run (the fresh masks of
    one call per sample gave 0.60 instead of 2.08 at p=0.1)."""
    digits = {}
    for p in (0.0, 0.3):
        torch.manual_seed(0)
        m = RecurrentStack(cell, dropout=p).train()
        x = torch.randn(4, 6, 8)
        torch.manual_seed(11)
        want = m(x)
        after = torch.rand(2)
        torch._dynamo.reset()
        be = fxstab.backend()
        torch.manual_seed(11)
        got = torch.compile(m, backend=be)(x)
        assert torch.equal(got, want) and torch.equal(torch.rand(2), after)
        no_failures(be)
        r = by_name(be)[f"rnn/{cell.__name__.lower()}#0"]
        assert r.status == "rounded"
        entry = next(e for e in be.coverage().analysed if e.operator == r.name)
        assert entry.reason.startswith("per sample")
        digits[p] = r.avg_digits
    assert digits[0.0] > 1.5
    assert abs(digits[0.3] - digits[0.0]) < 0.25, digits


# --------------------------------------------------------------------------- in place, shapes
def test_in_place_update_of_a_plain_tensor_with_samples_keeps_the_graph():
    torch.manual_seed(0)
    m = T5RelativeBias()
    x = torch.randn(2, 16, 8)
    be, y = analyse(m, x)
    assert torch.equal(y, m(x))
    no_failures(be)
    names = by_name(be)
    assert {"bias/embedding#0", "q/linear#0", "matmul#0"} <= set(names)
    assert names["add#2"].shape == (2, 2, 16, 16)  # the bias joins the scores


def test_in_place_update_of_an_input_happens_once():
    class Accumulate(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            x += self.fc(x)
            return x * 2

    torch.manual_seed(0)
    m = Accumulate()
    x = torch.randn(3, 4)
    x_eager, x_fx = x.clone(), x.clone()
    with torch.no_grad():
        want = m(x_eager)
        be, got = analyse(m, x_fx)
    assert torch.equal(got, want) and torch.equal(x_fx, x_eager)
    no_failures(be)
    assert "add#0" in by_name(be)


def test_expand_to_a_higher_rank():
    torch.manual_seed(0)
    m = ExpandUp()
    x = torch.randn(3, 4)
    be, y = analyse(m, x, select="*")
    assert torch.equal(y, m(x))
    no_failures(be)
    assert by_name(be)["expand#0"].shape == (2, 5, 3, 4)
    assert be.coverage().fraction == 1.0


# --------------------------------------------------------------------------- dropout, complex
@pytest.mark.parametrize("p, exact", [(0.5, True), (0.1, False)])
def test_dropout_scaling_is_rounded(p, exact):
    """x * mask / (1 - p): by 2 an exact scaling of bf16 values, by 1/0.9 not."""
    class Drop(nn.Module):
        def forward(self, x):
            return F.dropout(x, p, training=True)

    x = torch.randn(64, 32).bfloat16().float()  # on the bf16 grid
    torch.manual_seed(0)
    be, y = analyse(Drop(), x)
    torch.manual_seed(0)
    assert torch.equal(y, F.dropout(x, p, training=True))
    r = by_name(be)["dropout#0"]
    cap = fxstab.get_format("bf16").digit_cap
    assert r.status == "rounded"
    if exact:
        assert r.avg_digits == pytest.approx(cap)
    else:
        assert r.avg_digits < cap - 0.2


def test_eval_dropout_is_skipped_as_the_identity():
    m = DropoutMLP().eval()
    be, _ = analyse(m, torch.randn(4, 16))
    assert "drop/dropout#0" not in by_name(be)
    entry = next(e for e in be.coverage().entries if e.kind == "dropout")
    assert entry.how == "skipped" and entry.reason.startswith("identity") and not entry.counted


def test_complex_operators_round_their_real_and_imaginary_parts():
    torch.manual_seed(0)
    m = SpectralFilter()
    x = torch.randn(3, 16)
    be, (y, mag) = analyse(m, x, output="mean", select="*")
    want, want_mag = m(x)
    torch.testing.assert_close(y, want, atol=0.05, rtol=0.05)  # the mean of bf16 samples
    no_failures(be)
    names = by_name(be)
    cap = fxstab.get_format("bf16").digit_cap
    for name in ("fft_rfft#0", "polar#0", "mul#0"):
        r = names[name]
        assert r.status == "rounded" and 1.0 < r.avg_digits < cap, (name, r.avg_digits)
        assert r.numel == 2 * 9 * (3 if name != "polar#0" else 1)  # real and imaginary parts
    assert names["fft_irfft#0"].shape == (3, 16)
    assert be.coverage().fraction == 1.0
    torch._dynamo.reset()
    be, (y, _) = analyse(m, x)
    assert torch.equal(y, want)


# --------------------------------------------------------------------------- custom operators
@torch.library.custom_op("fxstab_test::scaled_sin", mutates_args=())
def scaled_sin(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.sin(x) * scale


@scaled_sin.register_fake
def _(x, scale):
    return torch.empty_like(x)


@torch.library.custom_op("fxstab_test::batched_cos", mutates_args=())
def batched_cos(x: torch.Tensor) -> torch.Tensor:
    return torch.cos(x) / 3


@batched_cos.register_fake
def _(x):
    return torch.empty_like(x)


@batched_cos.register_vmap
def _(info, in_dims, x):
    return torch.cos(x) / 3, in_dims[0]


class CustomNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return batched_cos(scaled_sin(self.fc(x), 1.7))


def test_custom_operators_are_analysed_by_default():
    torch.manual_seed(0)
    m = CustomNet()
    x = torch.randn(4, 8)
    be, y = analyse(m, x)
    assert torch.equal(y, m(x))
    no_failures(be)
    names = by_name(be)
    cap = fxstab.get_format("bf16").digit_cap
    sin, cos = names["scaled_sin#0"], names["batched_cos#0"]
    assert sin.status == "per_sample"  # no vmap rule: once per sample, rounded
    assert cos.status == "rounded"  # its vmap rule
    assert 1.0 < sin.avg_digits < cap and 1.0 < cos.avg_digits < cap
    reasons = {e.operator: e.reason for e in be.coverage().analysed}
    assert reasons["scaled_sin#0"].startswith("per sample") and reasons["batched_cos#0"] == "vmap"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="a Triton kernel needs a GPU or TRITON_INTERPRET=1")
def test_a_triton_kernel_registered_as_an_operator_is_analysed():
    triton_square = _triton_square()
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return triton_square(self.fc(x))

    m = Net()
    x = torch.randn(4, 8)
    be, y = analyse(m, x)
    assert torch.equal(y, m(x)) and torch.equal(y, m.fc(x) ** 2)
    no_failures(be)
    r = by_name(be)["square_kernel_op#0"]
    assert r.status == "per_sample" and 1.0 < r.avg_digits < 2.41


_TRITON: dict = {}


def _triton_square():
    """A user Triton kernel (x * x) registered as a custom operator, STYLE.md's way: a
    torch.library.custom_op whose body launches the kernel (no vmap rule)."""
    if "op" in _TRITON:
        return _TRITON["op"]
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def square_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x * x, mask=mask)

    @torch.library.custom_op("fxstab_test::square_kernel_op", mutates_args=())
    def square_kernel_op(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        square_kernel[(triton.cdiv(n, 64),)](x, out, n, BLOCK=64)
        return out

    @square_kernel_op.register_fake
    def _(x):
        return torch.empty_like(x)

    _TRITON["op"] = square_kernel_op
    return square_kernel_op


# --------------------------------------------------------------------------- @fxstab.operator
@fxstab.operator(name="test_rms_block")
def rms_block(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class RMSNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return rms_block(self.fc(x), self.w)


def test_fxstab_operator_is_one_named_operator_under_compile():
    torch.manual_seed(0)
    m, x = RMSNet(), torch.randn(4, 8)
    be = fxstab.backend(select="*")  # even with every operator selected: the insides are hidden
    y = torch.compile(m, backend=be)(x)
    want = m.fc(x) * torch.rsqrt(m.fc(x).pow(2).mean(-1, keepdim=True) + 1e-6) * m.w
    assert torch.equal(y, want)
    no_failures(be)
    assert [r.name for r in be.reports] == ["fc/linear#0", "test_rms_block#0"]
    r = be.reports[1]
    assert r.status == "rounded" and 1.0 < r.avg_digits < 2.41
    # autograd through the operator: the gradients of the function itself
    y.sum().backward()
    got = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    want.sum().backward()
    for a, p in zip(got, m.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_fxstab_operator_gradients_match_the_function():
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    rms_block(x, w).pow(2).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    rms_block.__wrapped__(x, w).pow(2).sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)


def test_fxstab_operator_is_one_primitive_under_analyze():
    res = fxstab.analyze(lambda a: rms_block(a, torch.ones(8)), format="bf16", seed=0)(
        torch.randn(3, 8))
    assert [r.name.rsplit(".", 1)[-1] for r in res.reports] == ["test_rms_block#0"]
    assert res.reports[0].status == "rounded"
    assert 1.0 < float(res.digits.mean()) < 2.41


def test_fxstab_operator_rejects_bad_names():
    with pytest.raises(ValueError, match="identifier"):
        fxstab.operator(name="not a name")(lambda x: x + 1)
    with pytest.raises(ValueError, match="already used"):
        fxstab.operator(name="test_rms_block")(lambda x: x + 1)


# --------------------------------------------------------------------------- the report
def test_coverage_lists_every_operator_with_its_reason_and_goes_into_the_map(tmp_path):
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            i = h.argmax(-1)                       # integer output: skipped
            z = torch.sinh(h)                      # arithmetic, not selected: unrounded
            return torch.softmax(z.view(4, 8), -1), i

    torch.manual_seed(0)
    be, _ = analyse(Mixed(), torch.randn(4, 8), select=["linear", "softmax"])  # (not sinh)
    cov = be.coverage()
    how = {e.kind: (e.how, e.reason, e.counted) for e in cov.entries}
    assert how["linear"][:1] == ("analysed",) and how["softmax"][0] == "analysed"
    assert how["argmax"] == ("skipped", "no floating output", False)
    assert how["sinh"] == ("unrounded", "not selected", True)
    assert how["view"][0] == "unrounded" and how["view"][1].startswith("exact")
    assert not how["view"][2]  # exact: not counted
    assert cov.fraction == pytest.approx(2 / 3)
    table = cov.table()
    assert "66.7% of the 3 floating operators" in table and "not selected (sinh)" in table
    path = tmp_path / "m.json"
    be.digit_map().save(path)
    meta = fxstab.DigitMap.load(path).metadata["coverage"]
    assert meta["fraction"] == pytest.approx(2 / 3) and meta["counted"] == 3
    assert {o["kind"] for o in meta["operators"]} >= {"linear", "argmax", "sinh", "view"}


def test_a_failed_stochastic_path_shows_in_the_coverage(monkeypatch):
    from fxstab.rules.op.tracer import SampleTracer

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(SampleTracer, "_round_and_record", broken)  # every rounding
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning):
        be, _ = analyse(MLP(), torch.randn(4, 16))
    cov = be.coverage()
    assert cov.fraction == 0.0
    assert all(e.how == "skipped" and "simulated failure" in e.reason for e in cov.entries)


# --------------------------------------------------------------------------- OpInfo sweep
def _sweep():
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import bench_opinfo
    finally:
        sys.path.remove(str(bench))
    return bench_opinfo


@pytest.mark.parametrize("level", ["op", "aten"])
@pytest.mark.parametrize("offset", [0, 1])
def test_opinfo_sweep_stride(offset, level):
    """Every 40th OpInfo entry (two offsets), at both levels: no crash, the deterministic path
    bit-identical, every captured operator analysed (the whole sweep: the slow test below and
    benchmarks/bench_opinfo.py)."""
    bench = _sweep()
    rows = bench.sweep(level, stride=40, offset=offset)
    bad = [(r["op"], r["status"], r["reason"]) for r in rows
           if r["status"] in (bench.FAILED, bench.MISMATCH, bench.NOT_ANALYSED)]
    assert not bad, bad
    assert bench.summary(rows)["analysed"] >= 10


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FXSTAB_SLOW") != "1",
                    reason="the whole OpInfo sweep (~5 min a level on 2 cores): set FXSTAB_SLOW=1, "
                           "or run benchmarks/bench_opinfo.py")
@pytest.mark.parametrize("level", ["op", "aten"])
def test_opinfo_sweep_analyses_99_percent_of_the_operators(level):
    bench = _sweep()
    rows = bench.sweep(level)
    s = bench.summary(rows)
    assert not [r for r in rows if r["status"] == bench.MISMATCH], bench.table(rows, level)
    assert s["fraction"] >= 0.99, bench.table(rows, level)


# --------------------------------------------------------------------------- command line
_TARGETS = '''
import torch
import torch.nn as nn


def encoder():
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval(), torch.randn(2, 5, 16)


class Clamped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return torch.clamp(h, -1, 1).abs().clamp_min(0.1).hypot(h).sinh()


def clamped():
    return Clamped(), torch.randn(4, 8)
'''


def test_record_of_a_transformer_encoder_in_eval_maps_its_attention(tmp_path, monkeypatch,
                                                                   capsys):
    from fxstab.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(_TARGETS)
    assert main(["record", "t.py:encoder", "-o", "enc.json"]) == 0
    out, err = capsys.readouterr()
    dm = fxstab.DigitMap.load(tmp_path / "enc.json")
    assert {"layers.0.self_attn/multi_head_attention_forward#0",
            "layers.1.self_attn/multi_head_attention_forward#0"} <= set(dm.operators)
    assert f"saved {len(dm)} operators" in out and len(dm) == 16
    assert dm.metadata["coverage"]["fraction"] == 1.0
    assert "warning" not in err
    assert main(["show", "enc.json"]) == 0
    shown = capsys.readouterr().out
    assert "coverage: 16 operators analysed" in shown
    assert "fused: its composite ran on the samples" in shown


def test_record_warns_when_less_than_90_percent_was_analysed(tmp_path, monkeypatch, capsys):
    from fxstab.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(_TARGETS)
    # the families alone (the default analyses hypot and sinh too: issue 54)
    (tmp_path / "fxstab.toml").write_text('select = ["linear", "activation", "custom"]\n')
    assert main(["record", "t.py:clamped", "-o", "c.json"]) == 0
    err = capsys.readouterr().err
    # linear analysed; hypot and sinh not selected; clamp, abs and clamp_min are exact
    assert "warning: only 1 of the model's 3 floating operators (33%) were analysed" in err
    assert "unrounded: 2 x not selected (hypot, sinh)" in err
    dm = fxstab.DigitMap.load(tmp_path / "c.json")
    assert dm.metadata["coverage"]["fraction"] == pytest.approx(1 / 3)
    assert main(["record", "t.py:clamped", "-o", "c.json", "--format", "fp16"]) == 0


def test_arithmetic_level_coverage_comes_from_the_primitives_recorded():
    torch.manual_seed(0)
    be, _ = analyse(MLP(), torch.randn(4, 16), granularity="aten")
    cov = be.coverage()
    assert cov.fraction == 1.0
    assert {e.kind for e in cov.analysed} == {"linear", "gelu"}
    assert all(e.reason.startswith("aten level") for e in cov.analysed)
    relu = next(e for e in cov.entries if e.kind == "relu")  # max(x, 0): nothing to round
    assert relu.how == "skipped" and relu.reason.startswith("exact") and not relu.counted
    assert be.digit_map().metadata["coverage"]["counted"] == len(cov.counted) > 0
