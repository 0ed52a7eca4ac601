"""Gradient digit maps (backward=True, fxstab/analysis/backward.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxstab
from fxstab.digitmap import DigitMap
from fxstab.numerics.digits import cestac_digits

from models import GPT, MLP


def _steps(model, x, backend, steps=2):
    """SGD steps; returns the outputs and the gradients of each step."""
    f = torch.compile(model, backend=backend) if backend is not None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs, grads = [], []
    for _ in range(steps):
        opt.zero_grad()
        torch.manual_seed(11)
        y = f(x)
        y.float().pow(2).mean().backward()
        outs.append(y.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return outs, grads


@pytest.mark.parametrize("make,x", [
    (lambda: MLP(), torch.randn(8, 16)),
    (lambda: GPT().train(), torch.randint(0, 50, (2, 16))),
])
def test_training_is_unchanged_bit_for_bit(make, x):
    torch.manual_seed(0)
    a, b = make(), make()
    b.load_state_dict(a.state_dict())
    be = fxstab.backend(backward=True)
    out_a, grads_a = _steps(a, x, be)
    out_b, grads_b = _steps(b, x, None)
    for ya, yb in zip(out_a, out_b):
        assert torch.equal(ya, yb)
    for ga, gb in zip(grads_a, grads_b):
        assert all(torch.equal(u, v) for u, v in zip(ga, gb))
    assert not any(g.info.failures or g.info.untraced for g in be.graphs)
    backward = [r for r in be.reports if r.direction == "backward"]
    assert backward and {r.call for r in backward} == {0, 1}


def test_backward_operators_are_named_after_their_forward_operator():
    torch.manual_seed(0)
    m = MLP()
    be = fxstab.backend(backward=True)
    _steps(m, torch.randn(8, 16), be, steps=1)
    dm = be.digit_map()
    ops = dm.operators
    forward = {n for n, o in ops.items() if o.direction == "forward"}
    assert forward == {"fc1/linear#0", "gelu#0", "fc2/linear#0", "relu#0", "head/linear#0"}
    for name in ("fc1/linear#0/grad/mm#0", "gelu#0/grad/gelu_backward#0",
                 "relu#0/grad/threshold_backward#0", "head/linear#0/grad/mm#1",
                 "head/linear#0/grad/sum#0"):
        assert ops[name].direction == "backward", name
    assert ops["fc2/linear#0/grad/mm#0"].module_path == "fc2"
    # one entry per trainable parameter, measured as its gradient
    grads = {n: o for n, o in ops.items() if o.kind == "param_grad"}
    assert set(grads) == {f"{n}/grad" for n, _ in m.named_parameters()}
    for n, p in m.named_parameters():
        g = grads[f"{n}/grad"]
        assert g.numel == p.numel() and g.direction == "backward" and g.status == "observed"
    # the localization follows the backward graph's edges
    assert "fc1/linear#0/grad/mm#0" in grads["fc1.weight/grad"].inputs
    assert "gelu#0/grad/gelu_backward#0" in ops["fc1/linear#0/grad/mm#0"].inputs
    # and the map keeps the direction through JSON
    again = DigitMap.from_json(dm.to_json())
    assert again.operators["fc1.weight/grad"].direction == "backward"
    assert again.operators["fc1/linear#0"].direction == "forward"


def _fp16_first_layer(scale: float):
    torch.manual_seed(0)
    model = MLP(64, 128, 8)
    x = torch.randn(256, 64)
    target = model(x).detach() + 1e-3 * torch.randn(256, 8)
    be = fxstab.backend(format="fp16", backward=True)
    loss = ((torch.compile(model, backend=be)(x) - target) ** 2).mean()
    (loss * scale).backward()
    return be.digit_map().operators["fc1.weight/grad"]


def test_fp16_gradients_underflow_without_loss_scaling_and_not_with_it():
    plain = _fp16_first_layer(1.0)
    scaled = _fp16_first_layer(2.0 ** 12)  # what torch.amp.GradScaler starts with
    assert plain.underflow >= 0.9 * plain.numel and plain.avg_digits < 0.5
    assert scaled.underflow <= 0.05 * scaled.numel and scaled.avg_digits > 2.0


class LayerNormModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.ln = nn.LayerNorm(32)

    def forward(self, x):
        return self.ln(self.fc(x))


class SoftmaxAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 4.0, dim=-1)
        return a @ self.v(x)


@pytest.mark.parametrize("make,x", [
    (lambda: MLP(), lambda: torch.randn(32, 16)),
    (lambda: LayerNormModel(), lambda: torch.randn(32, 16)),
    (lambda: SoftmaxAttention(), lambda: torch.randn(4, 8, 16)),
])
def test_gradient_digits_against_exact_fp64_gradients(make, x):
    """The digits the samples claim against the digits their mean shares with the fp64
    gradient: overestimates by a digit or more in at most 2% of the elements."""
    torch.manual_seed(0)
    model, inputs = make(), x()
    exact_model = make().double()
    exact_model.load_state_dict(model.state_dict())
    target = torch.randn_like(model(inputs))
    be = fxstab.backend(format="bf16", backward=True, n_samples=3)
    f = torch.compile(model, backend=be)
    with be.capture_samples() as cap:
        F.mse_loss(f(inputs), target).backward()
    F.mse_loss(exact_model(inputs.double()), target.double()).backward()
    exact = dict(exact_model.named_parameters())
    over = total = 0
    for name, samples in cap.gradients.items():
        est = cestac_digits(samples.double(), "bf16")
        ref = exact[name].grad
        mean = samples.double().mean(0)
        keep = ref != 0
        actual = (-torch.log10((mean - ref).abs() / ref.abs())).clamp(min=0.0)
        actual = torch.where(torch.isfinite(actual), actual, torch.full_like(actual, 99.0))
        over += int(((est - actual >= 1.0) & keep).sum())
        total += int(keep.sum())
    assert set(cap.gradients) == {n for n, _ in model.named_parameters()}
    assert total > 0 and over / total <= 0.02, (over, total)


def test_backward_option_is_validated():
    with pytest.raises(ValueError, match="backward must be True or False"):
        fxstab.backend(backward="yes")


def test_arithmetic_level_backward_is_analysed_with_the_same_names():
    torch.manual_seed(0)
    a, b = MLP(), MLP()
    b.load_state_dict(a.state_dict())
    x = torch.randn(8, 16)
    be = fxstab.backend(granularity="aten", backward=True)
    out_a, grads_a = _steps(a, x, be, steps=1)
    out_b, grads_b = _steps(b, x, None, steps=1)
    assert torch.equal(out_a[0], out_b[0])
    assert all(torch.equal(u, v) for u, v in zip(grads_a[0], grads_b[0]))
    ops = be.digit_map().operators
    assert {"fc1.weight/grad", "fc1/linear#0/grad/mm#0", "gelu#0/grad/gelu_backward#0"} <= set(ops)
    assert all(o.direction == "backward" for n, o in ops.items() if "/grad" in n)


@pytest.mark.parametrize("pad", [-1, 3])
def test_embedding_gradients_fold_the_samples_into_the_rows(pad):
    """embedding_dense_backward of stacked gradients: the samples' rows summed as one
    [N * V, D] table give vmap's values bit for bit (repeated and padding indices), laid
    out sample-major, which the rounding reads without a vocabulary-wide copy."""
    from fxstab.rules.lifting import embedding_grad_folded

    fn = torch.ops.aten.embedding_dense_backward.default
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(3, 2, 9, 16, generator=g)
    idx = torch.randint(0, 40, (2, 9), generator=g)
    idx[0, :4] = 3  # repeated, and the padding row when pad == 3
    folded = embedding_grad_folded(fn, [grad, idx, 40, pad, False], {})
    lifted = torch.vmap(lambda x: fn(x, idx, 40, pad, False))(grad)
    assert folded.is_contiguous() and not lifted.is_contiguous()
    assert torch.equal(folded, lifted)
    # by frequency: per sample under vmap, as before
    scaled = embedding_grad_folded(fn, [grad, idx, 40, pad, True], {})
    assert torch.equal(scaled, torch.vmap(lambda x: fn(x, idx, 40, pad, True))(grad))


def test_a_training_steps_embedding_gradient_is_batched_and_maps_as_lifted(monkeypatch):
    from fxstab.rules.op import registry

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(500, 32, padding_idx=3)
            self.l = nn.Linear(32, 7)

        def forward(self, x):
            return self.l(self.e(x))

    def analysed():
        torch.manual_seed(0)
        model = Net().to(torch.bfloat16)
        x = torch.randint(0, 500, (4, 20))
        x[0, :3] = 3
        x[1, 2] = 7
        torch._dynamo.reset()
        be = fxstab.backend(format="bf16", backward=True, seed=0)
        torch.compile(model, backend=be)(x).float().sum().backward()
        return be

    be = analysed()
    name = "e/embedding#0/grad/embedding_dense_backward#0"
    entry = next(e for e in be.coverage().entries if e.operator == name)
    assert entry.reason == "batched over the samples"
    folded = be.digit_map()[name]
    monkeypatch.delitem(registry.OP_RULES, "embedding_dense_backward")
    lifted = analysed().digit_map()[name]
    assert (folded.avg_digits, folded.min_digits) == (lifted.avg_digits, lifted.min_digits)


def test_a_bf16_models_gradients_are_the_compiled_programs_bit_for_bit(monkeypatch):
    """backward=True compiles through AOTAutograd: the gradients are those of the program it
    compiles (torch.compile(backend="aot_eager")) bit for bit, with the backward's GEMMs of
    bf16 weights on the bf16 path; in bf16 that program may differ from eager mode in the
    last bits (torch's decompositions), which fxstab does not change."""
    from fxstab.numerics import lowp_gemm

    monkeypatch.setattr(lowp_gemm, "CPU_MIN_DIM", 0)  # the small weights take the path too
    torch.manual_seed(0)
    model = GPT(vocab=256, d=32, heads=4, layers=2, ctx=16).to(torch.bfloat16)
    x = torch.randint(0, 256, (2, 16))

    def grads(f):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(11)
        f(x).float().pow(2).mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    torch._dynamo.reset()
    want = grads(torch.compile(model, backend="aot_eager"))
    torch._dynamo.reset()
    be = fxstab.backend(backward=True, format="bf16", seed=0)
    f = torch.compile(model, backend=be)
    for _ in range(3):  # untraced, traced, the sampled graph
        assert all(torch.equal(a, b) for a, b in zip(grads(f), want))
    if lowp_gemm.check("cpu").ok:  # (a platform whose bf16 GEMMs fail it: the fp32 path)
        assert any("bf16 GEMM" in e.reason for e in be.coverage().entries
                   if e.operator.endswith("/grad/mm#0"))
    torch._dynamo.reset()
