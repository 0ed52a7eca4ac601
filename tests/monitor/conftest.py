import math

import pytest
import torch
import torch.nn as nn


class TinyAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.softmax = nn.Softmax(dim=-1)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        a = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
        return self.proj(self.softmax(a) @ v)


class Tiny(nn.Module):
    """ln -> attention -> ln -> mlp, bf16: 9 candidate operators."""

    def __init__(self, d: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = TinyAttention(d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.drop(torch.relu(self.fc1(self.ln2(x)))))


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return Tiny().to(torch.bfloat16)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 8, 16, generator=g).to(torch.bfloat16)


@pytest.fixture
def tiny_cls():
    return Tiny
