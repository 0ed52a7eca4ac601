"""Small models shared by the backend tests (realistic layers, tiny sizes)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.head(x)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        x = self.drop(F.relu(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style language model using F.scaled_dot_product_attention."""

    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 4, layers: int = 2, ctx: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class LSTMClassifier(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d_in, hidden, batch_first=True)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o, _ = self.lstm(x)
        return self.out(o[:, -1])


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


class CancellingLinear(nn.Module):
    """fc1 adds a large offset to every feature, fc2 subtracts neighbouring features: the
    offset cancels exactly in real arithmetic but its rounding error stays (hazard), unless
    ``offset`` is 0 (the stable counterpart)."""

    def __init__(self, d: int = 16, offset: float = 1000.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d // 2, bias=False)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.eye(d))
            self.fc1.bias.fill_(offset)
            w = torch.zeros(d // 2, d)
            for i in range(d // 2):
                w[i, 2 * i], w[i, 2 * i + 1] = 1.0, -1.0
            self.fc2.weight.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


class NaiveSoftmax(nn.Module):
    """exp(x)/sum(exp(x)) without max subtraction (hazard) or torch.softmax (stable)."""

    def __init__(self, naive: bool = True) -> None:
        super().__init__()
        self.naive = naive
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc(x)
        if self.naive:
            e = torch.exp(z)
            return e / e.sum(-1, keepdim=True)
        return torch.softmax(z, -1)


class OffsetLayerNorm(nn.Module):
    """A linear layer that adds ``offset`` to inputs of spread ``spread``, then LayerNorm."""

    def __init__(self, d: int = 32, offset: float = 1000.0, spread: float = 1e-2) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(d) * spread)
            self.fc.bias.fill_(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc(x))


class Attention(nn.Module):
    """SDPA on q, k scaled by ``scale``: a large scale with near-equal keys gives near-ties
    whose order is decided by rounding noise."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q * self.scale, k, v)


class T5RelativeBias(nn.Module):
    """Attention scores plus a T5-style relative position bias: the bucket index tensor is
    built from plain tensors and then updated in place (``buckets += torch.where(...)``) with
    values computed in floating point (log of the distances)."""

    def __init__(self, d: int = 8, heads: int = 2, buckets: int = 8, max_distance: int = 16) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.bias = nn.Embedding(buckets, heads)
        self.buckets, self.max_distance = buckets, max_distance

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        rel = torch.arange(t)[None, :] - torch.arange(t)[:, None]
        half = self.buckets // 2
        buckets = (rel > 0).to(torch.long) * half
        rel = torch.abs(rel)
        exact = half // 2
        large = exact + (torch.log(rel.float() / exact) / math.log(self.max_distance / exact)
                         * (half - exact)).to(torch.long)
        large = torch.min(large, torch.full_like(large, half - 1))
        buckets += torch.where(rel < exact, rel, large)
        bias = self.bias(buckets).permute(2, 0, 1)  # [heads, T, T]
        h = self.q(x)
        return (h @ h.transpose(-1, -2)).unsqueeze(1) + bias


class RecurrentStack(nn.Module):
    """Linear, then a 2-layer LSTM/GRU/RNN with inter-layer dropout, then a head."""

    def __init__(self, cell: type = nn.LSTM, dropout: float = 0.0, d: int = 8,
                 hidden: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.rnn = cell(d, hidden, num_layers=2, dropout=dropout, batch_first=True)
        self.head = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o, _ = self.rnn(self.fc(x))
        return self.head(o)


class SpectralFilter(nn.Module):
    """A linear layer, then a filter in the frequency domain (rfft, a complex gain from
    torch.polar, irfft) and the spectrum's magnitude."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("phase", torch.linspace(0.0, 1.0, d // 2 + 1))

    def forward(self, x: torch.Tensor):
        f = torch.fft.rfft(self.fc(x), dim=-1)
        f = f * torch.polar(torch.ones_like(self.phase), self.phase)
        return torch.fft.irfft(f, n=x.shape[-1], dim=-1), f.abs()


class ExpandUp(nn.Module):
    """A stacked [3, 4] value expanded to rank 4 and 3, then reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return h.expand(2, 5, 3, 4).sum((0, 1)) + h[None].expand(6, -1, -1).mean(0)


class GPT2Block(nn.Module):
    """The usual GPT-2 block (as in nanoGPT without flash attention): pre-norm, one fused
    qkv projection, heads split by view/transpose, explicit attention with a causal mask
    (``masked_fill(-inf)``), softmax, attention dropout, tanh-GELU MLP, residual adds."""

    def __init__(self, d: int, heads: int, ctx: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)
        self.register_buffer("bias", torch.tril(torch.ones(ctx, ctx)).view(1, 1, ctx, ctx))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        x = x + self.resid_dropout(self.c_proj(y))
        h = F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.resid_dropout(self.mlp_proj(h))


class GPT2(nn.Module):
    """A GPT-2-style LM (token + position embeddings, GPT2Block x layers, final LayerNorm, a
    head tied to the token embedding). Defaults: the issue's "GPT-2-sized" benchmark shape
    (2 layers, d=64, 4 heads); call it on [batch 4, seq 64] token ids."""

    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 4, layers: int = 2,
                 ctx: int = 64, dropout: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPT2Block(d, heads, ctx, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for blk in self.h:
            x = blk(x)
        return self.lm_head(self.ln_f(x))
