"""Where a real run in the format goes non-finite, the analysis names the origin and the
right remedy (issue 54: the misses and the two wrong backward hints)."""

from __future__ import annotations

import torch
import torch.nn as nn

import fxstab
from fxstab.digitmap.findings import ROOT_GRADIENT_HINT


def _trained_map(model: nn.Module, x: torch.Tensor, fmt: str = "fp16"):
    torch._dynamo.reset()
    be = fxstab.backend(format=fmt, seed=0, backward=True)
    torch.compile(model, backend=be)(x).backward()
    torch._dynamo.reset()
    return be.digit_map()


class _Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x):
        v = x * self.w
        return torch.pow((v * v).sum(-1), 0.5).sum()  # a norm by hand, at a zero row


class _Where(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, a):
        a = a * self.w
        return torch.where(a <= 0, torch.exp(a), 1 + a).sum()  # exp overflows where unused


def test_a_roots_gradient_at_zero_is_no_overflow():
    x = torch.cat([torch.zeros(2, 8), torch.randn(2, 8)])
    model = _Root()
    model(x).backward()
    assert not torch.isfinite(model.w.grad).all()  # the real run's gradient (fp32 already)
    first = _trained_map(_Root(), x).findings()[0]
    assert first.startswith("NaN/inf first appear at pow#0/grad/"), first
    assert first.endswith(ROOT_GRADIENT_HINT) and "subtract the max" not in first


def test_a_nan_gradient_from_the_unselected_branch_says_mask_the_argument():
    # an fp16 model, as trained: its saved exp holds the inf the gradient multiplies by 0
    a = (torch.randn(4, 8, generator=torch.Generator().manual_seed(0)) * 20 + 40).half()
    model = _Where().half()
    model(a).backward()
    assert torch.isnan(model.w.grad).any()  # the real fp16 run
    found = _trained_map(_Where().half(), a).findings()
    first = found[0]
    assert first.startswith("NaN/inf first appear at exp#0/grad/"), found
    assert "mask the argument before the function" in first and "exp#0 holds NaN/inf" in first
    assert "subtract the max" not in first
    assert any(f.startswith("note: NaN/inf appear at exp#0") and "torch.where" in f
               for f in found), found


class _InfOut(nn.Module):
    def forward(self, x):
        e = torch.exp(x)
        return e, 1 / e  # e is an output, and 1 / inf = 0 reads it


def test_an_inf_that_is_an_output_is_not_absorbed_by_its_reader():
    x = torch.randn(4, 8) + 14  # exp overflows fp16 past 11.1
    real = _InfOut()(x.half())
    assert torch.isinf(real[0]).any() and torch.isfinite(real[1]).all()
    torch._dynamo.reset()
    be = fxstab.backend(format="fp16", seed=0)
    with torch.no_grad():
        torch.compile(_InfOut(), backend=be)(x)
    torch._dynamo.reset()
    dm = be.digit_map()
    assert dm.metadata["outputs"] == ["exp#0"]  # an output read by div#0 too
    assert dm.absorbed_nonfinite() == {} and dm.nonfinite_sources() == ["exp#0"]
    found = dm.findings()
    assert found[0].startswith("NaN/inf first appear at exp#0"), found
    assert not any("absorbed" in f for f in found)


class _ClampLog(nn.Module):
    def forward(self, z):
        p = torch.clamp(torch.sigmoid(z), 1e-4, 1 - 1e-4)  # 1 - 1e-4 is 1.0 in fp16
        return -torch.log(1 - p).mean()


def test_a_clamp_bound_enters_as_the_format_holds_it():
    z = torch.full((4, 8), 12.0) + torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    assert torch.isinf(_ClampLog().half()(z.half()))  # the real fp16 run
    torch._dynamo.reset()
    be = fxstab.backend(format="fp16", seed=0)
    with torch.no_grad():
        torch.compile(_ClampLog(), backend=be)(z)
    torch._dynamo.reset()
    dm = be.digit_map()
    assert dm.nonfinite_sources() == ["log#0"]
    # bf16 holds 1 - 1e-4 as 1.0 too; fp32 holds it: no origin there
    from fxstab.rules.op.tracer import held_scalars

    fp16, fp32 = fxstab.get_format("fp16"), fxstab.get_format("fp32")
    assert held_scalars("clamp", [1 - 1e-4, 2, True, float("-inf"), -3.4e38], fp16) == \
        [1.0, 2, True, float("-inf"), -65504.0]
    assert held_scalars("clamp", [1 - 1e-4], fp32) == \
        [float(torch.tensor(1 - 1e-4, dtype=torch.float32))]
    assert held_scalars("mul", [1 - 1e-4], fp16) == [1 - 1e-4]  # (computed in fp32 there)
