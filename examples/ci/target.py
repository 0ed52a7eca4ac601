"""A small `fxstab record` target: an MLP classifier with a hand-written input standardization.

`fxstab record examples/ci/target.py:build -o digits.json` imports this file, calls `build()`
with no arguments and analyses the returned `(model, example_inputs)`. `fxstab record` seeds
torch's default generator before the call, so the weights and inputs below are the same on
every run.

The standardization computes the variance in one pass, E[x^2] - E[x]^2. On centred features
that is harmless; on features with a large common offset the two means agree to the last bf16
bit and the subtraction cancels every digit, although fp32 still gets about three right.
`build_with_hazard()` is that change (the same model fed features offset by 100, as if a
preprocessing step stopped centring them), under the same operator names, so `fxstab diff`
reports the drop:

    fxstab record examples/ci/target.py:build -o base.json
    fxstab record examples/ci/target.py:build_with_hazard -o head.json
    fxstab diff base.json head.json --max-drop 0.5      # exit 1: the standardization lost digits
"""

from __future__ import annotations

import torch
from torch import nn

OFFSET = 0.0


class Standardize(nn.Module):
    """(x - mean) / std over the last dimension, variance as E[x^2] - E[x]^2 (one pass)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)
        mean_sq = (x * x).mean(dim=-1, keepdim=True)
        std = torch.sqrt((mean_sq - mean * mean).clamp_min(0.0) + 1e-5)
        return (x - mean) / std


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Classifier(nn.Module):
    def __init__(self, features: int = 16, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.standardize = Standardize()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(self.standardize(x)))
        return torch.softmax(self.head(h), dim=-1)


def build(offset: float = OFFSET) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model under analysis (eval mode) and one batch of example inputs."""
    model = Classifier().eval()
    x = torch.randn(8, 16) + offset
    return model, (x,)


def build_with_hazard() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The same model fed features with a common offset of 100: the variance cancels."""
    return build(offset=100.0)
