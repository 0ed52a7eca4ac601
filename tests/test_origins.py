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
    a = torch.randn(4, 8) * 20 + 40
    model = _Where().half()
    model(a.half()).backward()
    assert torch.isnan(model.w.grad).any()  # the real fp16 run
    found = _trained_map(_Where(), a).findings()
    first = found[0]
    assert first.startswith("NaN/inf first appear at exp#0/grad/"), found
    assert "mask the argument before the function" in first and "exp#0 holds NaN/inf" in first
    assert "subtract the max" not in first
    assert any(f.startswith("note: NaN/inf appear at exp#0") and "torch.where" in f
               for f in found), found
