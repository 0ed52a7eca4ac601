"""Localization benchmark (issue 15): does the ranking name the operator where digits are lost?

Thirteen hazards, each a small module with a known path (``blocks.1.hazard``), are planted one
at a time as an extra residual branch (``x = x + hazard(norm(x))``) in block 1 of three
architectures with residual streams: an MLP mixer, a pre-activation residual CNN and a GPT-style
language model. Everything else is a randomly initialised (fixed seed), healthy model at
realistic input scales, so a hazard's damage flows through the residual join into the blocks
after it and into the head: those downstream victims have few digits too, and only a ranking of
*where* digits are lost, not of where they are low, names the culprit.

Each hazard states its culprit before any ranking is looked at: the operator(s) where a
numerical analyst would say the digits are lost (the subtraction that cancels, the exp that
overflows, the normalization of a near-constant row...) and, where the damage turns into NaN or
inf, the operation that creates it from a computational zero (CADNA's unstable division or
mathematical function). At the aten level the culprit is a primitive under the culprit
operator (``blocks.1.hazard/sub#0/aten.sub#0``), optionally restricted to the primitives that do
the damage (a near-constant LayerNorm loses digits in its ``sub``, ``var`` and ``rsqrt``, not the
affine ``mul``/``add`` after them).

Every case (hazard x architecture x bf16/fp16 x op/aten granularity) runs the model once under
``fxstab.backend(granularity, format, n_samples=3, seed=0)`` and scores two rankings of the
digit map: :func:`rank` (NaN/inf origins first, then :meth:`DigitMap.localize` with its default
metric; whatever rule is current) and, for comparison, :meth:`DigitMap.sorted_worst_first`
(lowest digits first). A hit is the top-1 (top-3) of the ranking being a culprit.

The healthy model (no hazard) of each architecture, format and level runs first as a control:
its top-ranked operator and local loss are the noise floor of the ranking, and its lowest
digits (any operator) are the *healthy floor*. A case whose culprit keeps digits within
:data:`DAMAGE_MARGIN` of that floor, while nothing is non-finite, did no damage in that format
(an fp16-range hazard in bf16): it is listed apart and left out of the hit rates.
Target: top-1 >= 95%, top-3 100%.

    .venv/bin/python benchmarks/bench_localization.py --quick        # every hazard, one arch
    .venv/bin/python benchmarks/bench_localization.py                # the full grid
    .venv/bin/python benchmarks/bench_localization.py --cases 'near_tie*/gpt/*' --out /tmp/r
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import save_json  # noqa: E402

import fxstab  # noqa: E402
from fxstab import digitmap as _digitmap  # noqa: E402

D = 32            # model width (channels of the CNN)
SEQ = 16          # tokens of the mixer and the LM; the CNN's 4x4 map gives 16 positions too
BATCH = 2
VOCAB = 64
HEADS = 4
LAYERS = 3
HAZARD_BLOCK = 1  # the block that carries the hazard; blocks 2.. and the head are its victims
HAZARD_PATH = f"blocks.{HAZARD_BLOCK}.hazard"
FORMATS = ("bf16", "fp16")
LEVELS = ("op", "aten")
# A culprit with no fewer digits than the healthy model's lowest operator less this margin, while
# nothing is non-finite, has done no damage. The floor and not the format's cap: healthy GEMM
# outputs of these models sit 0.5-1.1 digits under the cap (avg metric: elements near zero), as
# does a GEMM that merely holds large values (fc1 of overflow_activation in bf16). Measured
# (seeds 0 and 1, full grid): that case lands within +-0.21 digit of the floor, every other case
# that stays finite 0.47-2.4 digits below it.
DAMAGE_MARGIN = 0.25


# ============================================================================= hazards
class HazardBranch(nn.Module):
    """A residual branch: ``out(formula(inp(x)))``; ``x`` comes from a LayerNorm (~N(0, 1)).

    ``inp`` is a default-initialised linear layer (outputs of std ~0.58); subclasses add their
    own layers and write the hazardous formula in :meth:`formula`, whose functional operators
    are named under the hazard's module path (``blocks.1.hazard/sub#0``).
    """

    def __init__(self, d: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def formula(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define formula()")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.formula(self.inp(x)))


class OffsetCancel(HazardBranch):
    """A large constant added and removed again: (h + 1e4) - 1e4. The add rounds h into the
    spacing of 1e4 (64 in bf16, 8 in fp16) and the subtraction cancels what is left."""

    def formula(self, h):
        return (h + 1e4) - 1e4


class NearConstantLayerNorm(HazardBranch):
    """LayerNorm of features with a large common offset: ``inp``'s bias is 1500 while the
    features spread by ~0.6, so each row is near-constant at the format's resolution (spacing
    8 in bf16, 1 in fp16 around 1500) and x - mean cancels. 1500 and not more: the aten
    decomposition's mean sums the 32 features in the format, and 32 x 1500 stays under fp16's
    65504 (at 3000 that sum overflows first, a different hazard)."""

    def __init__(self, d):
        super().__init__(d)
        self.ln = nn.LayerNorm(d)
        with torch.no_grad():
            self.inp.bias.add_(1500.0)

    def formula(self, h):
        return self.ln(h)


class NaiveSoftmaxGate(HazardBranch):
    """A softmax gate over channels at temperature 1/16, written exp(s) / sum(exp(s)) without
    the max subtraction: logits reach ~40, exp overflows fp16 (max 65504 = e^11.1); in bf16
    exp's condition number |s| costs about one digit."""

    def formula(self, h):
        e = torch.exp(16.0 * h)
        return h.shape[-1] * e / e.sum(-1, keepdim=True)


class NaiveLogSumExp(HazardBranch):
    """A smooth-max (log-sum-exp) pooling over channels at temperature 1/16, written
    log(sum(exp(s))) without the max shift: exp and its sum overflow fp16."""

    def formula(self, h):
        lse = torch.log(torch.exp(16.0 * h).sum(-1, keepdim=True))
        return h * (lse / 16.0)


class NearTieAttention(HazardBranch):
    """Self-attention over tokens whose keys carry a large learned bias (1000 per feature):
    q.b is the same for every key (softmax-invariant in exact arithmetic) but puts the scores
    at ~400 while they differ by ~0.2, so s - max(s) cancels in both formats (spacing 2 in
    bf16, 0.25 in fp16 around 400) and the attention weights are decided by rounding noise."""

    def __init__(self, d):
        super().__init__(d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        with torch.no_grad():
            self.k.bias.fill_(1000.0)

    def formula(self, h):
        k, v = self.k(h), self.v(h)
        scores = (h @ k.transpose(-2, -1)) / math.sqrt(h.shape[-1])
        return torch.softmax(scores, -1) @ v


class OverflowMLP(HazardBranch):
    """An MLP whose hidden pre-activations live at ~1e5 (fc1's weights x3e5, fc2's x1/3e5, so
    the branch is O(1) in exact arithmetic): fine in fp32 and bf16, past fp16's 65504 at fc1."""

    def __init__(self, d):
        super().__init__(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        with torch.no_grad():
            self.fc1.weight.mul_(3e5)
            self.fc1.bias.mul_(3e5)
            self.fc2.weight.div_(3e5)

    def formula(self, h):
        return self.fc2(F.gelu(self.fc1(h)))


class ReciprocalGate(HazardBranch):
    """A reciprocal (odds-style) gate h / (1 - sigmoid(z)) with z ~ 8 (``gate``'s bias), its
    gain e^8 compensated by a constant: sigmoid(z) is within 3e-4 of 1, so 1 - g cancels to a
    computational zero (0 in some samples) and the division returns noise or inf."""

    def __init__(self, d):
        super().__init__(d)
        self.gate = nn.Linear(d, d)
        with torch.no_grad():
            self.gate.bias.add_(8.0)

    def formula(self, h):
        g = torch.sigmoid(self.gate(h))
        return h * math.exp(-8.0) / (1 - g)


class OnePassVarianceNorm(HazardBranch):
    """A hand-written normalization with the one-pass variance E[x^2] - E[x]^2 on features of
    mean 16 (``inp``'s bias) and spread ~0.6: the two moments (~256) agree to ~3 digits, so
    their difference cancels (negative in some samples: rsqrt returns NaN)."""

    def __init__(self, d):
        super().__init__(d)
        with torch.no_grad():
            self.inp.bias.add_(16.0)

    def formula(self, h):
        m = h.mean(-1, keepdim=True)
        var = (h * h).mean(-1, keepdim=True) - m * m
        return (h - m) * torch.rsqrt(var + 1e-5)


class ExpGain(HazardBranch):
    """A log-parameterised gain exp(s) with the log-scale s ~ 40 (``gate``'s bias), compensated
    by the constant e^-40: exp amplifies s's rounding error by |s| = 40 (bf16 keeps ~0.8 of its
    2.4 digits) and overflows fp16 (e^40 = 2.4e17)."""

    def __init__(self, d):
        super().__init__(d)
        self.gate = nn.Linear(d, d)
        with torch.no_grad():
            self.gate.bias.add_(40.0)

    def formula(self, h):
        return h * torch.exp(self.gate(h)) * math.exp(-40.0)


class NaiveSoftplus(HazardBranch):
    """softplus written log(1 + exp(s)) with s ~ -6 (``gate``'s bias), gain 400: 1 + e^s is
    within 3e-3 of 1, where log is ill-conditioned (condition 1/|log(1 + e^s)| ~ 400; log1p
    is the stable form), so log returns the rounding error of the add."""

    def __init__(self, d):
        super().__init__(d)
        self.gate = nn.Linear(d, d)
        with torch.no_grad():
            self.gate.bias.sub_(6.0)

    def formula(self, h):
        return 400.0 * torch.log(1 + torch.exp(self.gate(h)))


class NaiveLogSoftmax(HazardBranch):
    """log(softmax(s)) at temperature 1/16 instead of log_softmax: in fp16 the small
    probabilities (e^-30) underflow to 0 and log returns -inf; the top probability is near 1,
    where log is ill-conditioned."""

    def formula(self, h):
        return torch.log(torch.softmax(16.0 * h, -1)) / 16.0


class GramDistanceAttention(HazardBranch):
    """RBF attention with squared distances by the Gram expansion |q|^2 + |k|^2 - 2 q.k (as
    cdist's matmul path): q and k share a large bias (8 per feature), so |q|^2 ~ 2000 while
    |q - k|^2 ~ 20 and the subtraction cancels two digits."""

    def __init__(self, d):
        super().__init__(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        with torch.no_grad():
            self.q.bias.fill_(8.0)
            self.k.bias.fill_(8.0)

    def formula(self, h):
        q, k, v = self.q(h), self.k(h), self.v(h)
        qq = (q * q).sum(-1, keepdim=True)
        kk = (k * k).sum(-1, keepdim=True).transpose(-2, -1)
        d2 = qq + kk - 2.0 * (q @ k.transpose(-2, -1))
        return torch.softmax(-d2 / h.shape[-1], -1) @ v


class CancellingContrast(HazardBranch):
    """A contrast (high-pass) projection, weights with zero row sums, applied to features with a
    DC offset of 500 (``inp``'s bias): the offset cancels inside the GEMM's sums, which return
    the rounding error of the offset (spacing 4 in bf16, 0.25 in fp16 around 500)."""

    def __init__(self, d):
        super().__init__(d)
        self.contrast = nn.Linear(d, d)
        with torch.no_grad():
            self.inp.bias.add_(500.0)
            w = self.contrast.weight
            w.sub_(w.mean(1, keepdim=True))

    def formula(self, h):
        return self.contrast(h)


@dataclass(frozen=True)
class Culprit:
    """One operator where the hazard loses its digits, relative to the hazard's module.

    Attributes:
        module: submodule of the hazard ("" for the hazard's own functional calls, "ln" for
            ``blocks.1.hazard.ln``).
        op: ``kind#k`` of the operator in that module (``sub#0``: its first subtraction).
        aten: at the aten level, the primitive kinds under the operator that count (``("sub",
            "var")``); None: any primitive of the operator.
        why: one line: why the digits are lost there.
    """

    module: str
    op: str
    why: str
    aten: Optional[tuple[str, ...]] = None

    def op_name(self, hazard_path: str = HAZARD_PATH) -> str:
        path = f"{hazard_path}.{self.module}" if self.module else hazard_path
        return f"{path}/{self.op}"

    def matches(self, name: str, level: str, hazard_path: str = HAZARD_PATH) -> bool:
        base = self.op_name(hazard_path)
        if level == "op":
            return name == base
        prefix = base + "/aten."
        if not name.startswith(prefix):
            return False
        return self.aten is None or name[len(prefix):].split("#")[0] in self.aten


@dataclass(frozen=True)
class Hazard:
    name: str
    build: Callable[[int], nn.Module]
    culprits: tuple[Culprit, ...]


HAZARDS: tuple[Hazard, ...] = (
    Hazard("offset_cancel", OffsetCancel, (
        Culprit("", "sub#0", "(h + 1e4) - 1e4 cancels: the result is the add's rounding error"),)),
    Hazard("near_const_layernorm", NearConstantLayerNorm, (
        Culprit("ln", "layer_norm#0", "x - mean of a near-constant row cancels, its variance is "
                "rounding noise; rsqrt takes that noise", aten=("sub", "var", "var_mean",
                                                                 "rsqrt")),)),
    Hazard("naive_softmax", NaiveSoftmaxGate, (
        Culprit("", "exp#0", "unshifted exp of logits ~40: overflows fp16, |s| amplifies bf16"),
        Culprit("", "sum#0", "the sum of unshifted exponentials overflows fp16 by itself"))),
    Hazard("naive_logsumexp", NaiveLogSumExp, (
        Culprit("", "exp#0", "unshifted exp of logits ~40: overflows fp16, |s| amplifies bf16"),
        Culprit("", "sum#0", "the sum of unshifted exponentials overflows fp16 by itself"))),
    Hazard("near_tie_attention", NearTieAttention, (
        Culprit("", "softmax#0", "scores ~600 that differ by O(1): s - max(s) cancels",
                aten=("sub",)),)),
    Hazard("overflow_activation", OverflowMLP, (
        Culprit("fc1", "linear#0", "pre-activations ~1e5 overflow fp16 at fc1's output"),)),
    Hazard("reciprocal_gate", ReciprocalGate, (
        Culprit("", "sub#0", "1 - sigmoid(8) cancels to a computational zero"),
        Culprit("", "div#0", "division by that computational zero: noise or inf (CADNA's "
                "unstable division)"))),
    Hazard("one_pass_variance", OnePassVarianceNorm, (
        Culprit("", "sub#0", "E[x^2] - E[x]^2 of moments ~256 that agree to ~3 digits cancels"),
        Culprit("", "rsqrt#0", "rsqrt of that cancelled (sometimes negative) variance: NaN "
                "(CADNA's unstable math function)"))),
    Hazard("exp_gain", ExpGain, (
        Culprit("", "exp#0", "exp(s), s ~ 40: condition |s| = 40 in bf16, overflow in fp16"),)),
    Hazard("naive_softplus", NaiveSoftplus, (
        Culprit("", "log#0", "log(1 + e^s) near 1 is ill-conditioned (~400): log1p is stable"),)),
    Hazard("naive_log_softmax", NaiveLogSoftmax, (
        Culprit("", "softmax#0", "fp16: the small probabilities underflow to 0 here"),
        Culprit("", "log#0", "log of the underflowed 0 is -inf; log of p ~ 1 is ill-conditioned"))),
    Hazard("gram_distance", GramDistanceAttention, (
        Culprit("", "sub#0", "|q|^2 + |k|^2 - 2 q.k with |q|^2 ~ 100 |q - k|^2 cancels"),)),
    Hazard("cancelling_contrast", CancellingContrast, (
        Culprit("contrast", "linear#0", "zero-sum weights cancel the DC offset inside the "
                "GEMM's sums"),)),
)
HAZARDS_BY_NAME = {h.name: h for h in HAZARDS}


# ============================================================================= architectures
class MixerBlock(nn.Module):
    """MLP-mixer block: token mixing and channel mixing, each a pre-LN residual MLP."""

    def __init__(self, d: int, tokens: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(),
                                       nn.Linear(2 * tokens, tokens))
        self.ln2 = nn.LayerNorm(d)
        self.channel_mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ln_h = nn.LayerNorm(d)
        self.hazard: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mlp(self.ln1(x).transpose(1, 2)).transpose(1, 2)
        if self.hazard is not None:
            x = x + self.hazard(self.ln_h(x))
        return x + self.channel_mlp(self.ln2(x))


class Mixer(nn.Module):
    """MLP mixer on ``SEQ`` patches of 48 values (4x4x3), classifier head."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.embed = nn.Linear(48, d)
        self.blocks = nn.ModuleList(MixerBlock(d, SEQ) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x).mean(1))

    @staticmethod
    def example(g: torch.Generator) -> torch.Tensor:
        return torch.randn(BATCH, SEQ, 48, generator=g)


class ResBlock(nn.Module):
    """Pre-activation ResNet block; the hazard branch reads the map as ``H*W`` tokens through a
    channels-last LayerNorm (as ConvNeXt does) and is added back to the map."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.ln_h = nn.LayerNorm(c)
        self.hazard: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.conv2(F.relu(self.bn2(self.conv1(F.relu(self.bn1(x))))))
        if self.hazard is not None:
            b, c, hh, ww = x.shape
            t = x.flatten(2).transpose(1, 2)
            x = x + self.hazard(self.ln_h(t)).transpose(1, 2).reshape(b, c, hh, ww)
        return x


class ResCNN(nn.Module):
    """Residual CNN on 3x8x8 images: stem conv, pooling to 4x4, residual blocks, classifier."""

    def __init__(self, c: int = D) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList(ResBlock(c) for _ in range(LAYERS))
        self.bn_f = nn.BatchNorm2d(c)
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.stem(x), 2)
        for blk in self.blocks:
            x = blk(x)
        return self.head(F.relu(self.bn_f(x)).mean((2, 3)))

    @staticmethod
    def example(g: torch.Generator) -> torch.Tensor:
        return torch.randn(BATCH, 3, 8, 8, generator=g)


class Attention(nn.Module):
    """Causal multi-head attention written out (scores, softmax, weighted values)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        # -1e4, not -inf: finite in every simulated format, and exp(-1e4) is 0 anyway.
        scores = (q @ k.transpose(-2, -1) / math.sqrt(d // h)).masked_fill(mask, -1e4)
        att = torch.softmax(scores, -1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln_h = nn.LayerNorm(d)
        self.hazard: Optional[nn.Module] = None
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        if self.hazard is not None:
            x = x + self.hazard(self.ln_h(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-style LM: token + position embeddings, pre-LN blocks, final LN, LM head."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(GPTBlock(d, HEADS) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))

    @staticmethod
    def example(g: torch.Generator) -> torch.Tensor:
        return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


ARCHS: dict[str, type] = {"mixer": Mixer, "cnn": ResCNN, "gpt": GPT}


def build_model(arch: str, hazard: Optional[str], seed: int = 0
                ) -> tuple[nn.Module, torch.Tensor]:
    """The architecture (seeded) with ``hazard`` planted in block ``HAZARD_BLOCK``, and an input.

    The healthy part is initialised from ``seed`` and the hazard from ``seed + 1``, so every
    hazard sits in the same healthy model (the control run with ``hazard=None``).
    """
    cls = ARCHS[arch]
    torch.manual_seed(seed)
    model = cls()
    if hazard is not None:
        torch.manual_seed(seed + 1)
        model.blocks[HAZARD_BLOCK].hazard = HAZARDS_BY_NAME[hazard].build(D)
    x = cls.example(torch.Generator().manual_seed(seed))
    return model.eval(), x


# ============================================================================= ranking
def rank(dm: Any) -> list[str]:
    """The ranking scored: NaN/inf origins first (graph order), then ``dm.localize()``.

    ``localize`` runs with its default metric, so the benchmark measures whatever rule the
    digit map implements now. Swap this function to score another rule.
    """
    out = list(dm.nonfinite_sources())
    seen = set(out)
    out += [x.name for x in dm.localize() if x.name not in seen]
    return out


def rank_lowest(dm: Any) -> list[str]:
    """The comparison: operators with the fewest digits first (``sorted_worst_first``)."""
    return [op.name for op in dm.sorted_worst_first()]


def culprit_rank(ranking: Sequence[str], is_culprit: Callable[[str], bool]) -> Optional[int]:
    """1-based position of the first culprit in ``ranking``; None when none is ranked."""
    for i, name in enumerate(ranking, 1):
        if is_culprit(name):
            return i
    return None


def _metric() -> str:
    return getattr(_digitmap, "DEFAULT_METRIC", "avg")


def _digits(op: Any) -> float:
    d = op.digits(_metric())
    return 0.0 if d is None or math.isnan(d) else float(d)


def _loss_entry(x: Any) -> dict:
    """A localize() entry as a dict (its fields may change with the rule)."""
    d = dataclasses.asdict(x) if dataclasses.is_dataclass(x) else dict(vars(x))
    return {k: (round(v, 3) if isinstance(v, float) and math.isfinite(v) else v)
            for k, v in d.items()}


# ============================================================================= cases
@dataclass(frozen=True)
class Case:
    hazard: Optional[str]  # None: the healthy control
    arch: str
    format: str
    level: str

    @property
    def id(self) -> str:
        return f"{self.hazard or 'healthy'}/{self.arch}/{self.format}/{self.level}"


def all_cases(quick: bool) -> list[Case]:
    """The grid; ``quick``: every hazard on one architecture (rotating), both formats/levels."""
    archs = list(ARCHS)
    out = []
    for i, hz in enumerate(HAZARDS):
        for arch in ([archs[i % len(archs)]] if quick else archs):
            out += [Case(hz.name, arch, f, lv) for lv in LEVELS for f in FORMATS]
    return out


def control_cases(archs: Sequence[str]) -> list[Case]:
    return [Case(None, a, f, lv) for a in archs for lv in LEVELS for f in FORMATS]


def select(cases: Sequence[Case], pattern: Optional[str]) -> list[Case]:
    """Cases whose id (``hazard/arch/format/level``) matches ``pattern``: comma-separated
    globs, each without glob characters matching as a substring."""
    if not pattern:
        return list(cases)
    pats = [p if any(c in p for c in "*?[") else f"*{p}*"
            for p in (q.strip() for q in pattern.split(",")) if p]
    return [c for c in cases if any(fnmatch.fnmatchcase(c.id, p) for p in pats)]


def analyse(case: Case, seed: int = 0) -> tuple[Any, bool]:
    """One analysed forward call: the digit map and whether the fp32 output was finite."""
    model, x = build_model(case.arch, case.hazard, seed)
    torch._dynamo.reset()
    be = fxstab.backend(granularity=case.level, format=case.format, n_samples=3, seed=seed)
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        y = compiled(x)
    torch._dynamo.reset()
    return be.digit_map(), bool(torch.isfinite(y).all())


def run_case(case: Case, seed: int = 0, healthy_floor: Optional[float] = None) -> dict:
    """Analyse one case and score both rankings; the row written to the JSON.

    ``healthy_floor``: the lowest digits of the healthy model of the same architecture, format
    and level (the ``floor`` of its control row); needed for a hazard case.
    """
    dm, fp32_finite = analyse(case, seed)
    cap = float(dm.cap)
    ranked = rank(dm)
    lowest = rank_lowest(dm)
    losses = {x.name: x for x in dm.localize()}
    nonfinite = list(dm.nonfinite_sources())

    def brief(name: str) -> dict:
        op = dm[name]
        e = {"name": name, "digits": round(_digits(op), 3), "non_finite": int(op.non_finite)}
        if name in losses:
            e["localize"] = _loss_entry(losses[name])
        return e

    row: dict[str, Any] = {
        "case": case.id, "hazard": case.hazard or "healthy", "arch": case.arch,
        "format": case.format, "level": case.level, "cap": round(cap, 3),
        "metric": _metric(), "operators": len(dm), "fp32_finite": fp32_finite,
        "nonfinite_sources": nonfinite,
        "any_nonfinite": any(op.non_finite for op in dm.operators.values()),
        "top3": [brief(n) for n in ranked[:3]],
        "top3_lowest": [brief(n) for n in lowest[:3]],
    }
    if case.hazard is None:
        row["floor"] = round(min(_digits(op) for op in dm.operators.values()), 3)
        return row
    if healthy_floor is None:
        raise ValueError(f"{case.id}: a hazard case needs the healthy floor of its control")
    hz = HAZARDS_BY_NAME[case.hazard]

    def is_culprit(name: str) -> bool:
        return any(c.matches(name, case.level) for c in hz.culprits)

    culprits = [n for n in dm.operators if is_culprit(n)]
    if not culprits:
        raise RuntimeError(f"{case.id}: no operator of the digit map matches the culprits "
                           f"{[c.op_name() for c in hz.culprits]}; names are "
                           f"{list(dm.operators)}")
    worst = min(culprits, key=lambda n: _digits(dm[n]))
    culprit_digits = _digits(dm[worst])
    damaged = row["any_nonfinite"] or culprit_digits < healthy_floor - DAMAGE_MARGIN
    r_loc, r_low = culprit_rank(ranked, is_culprit), culprit_rank(lowest, is_culprit)
    row.update({
        "culprits": culprits, "culprit_digits": round(culprit_digits, 3),
        "healthy_floor": healthy_floor, "damaged": damaged,
        "rank_localize": r_loc, "rank_lowest": r_low,
        "hit1": r_loc == 1, "hit3": r_loc is not None and r_loc <= 3,
        "hit1_lowest": r_low == 1, "hit3_lowest": r_low is not None and r_low <= 3,
        "culprit_entries": [brief(n) for n in culprits],
    })
    return row


# ============================================================================= report
def _rate(rows: Sequence[dict], key: str) -> Optional[float]:
    return sum(bool(r[key]) for r in rows) / len(rows) if rows else None


def summarize(rows: Sequence[dict]) -> dict:
    """Hit rates over the damaged cases: overall, per level, per format, per level x format."""
    scored = [r for r in rows if r.get("damaged")]
    groups: dict[str, list[dict]] = {"all": scored}
    for lv in LEVELS:
        groups[lv] = [r for r in scored if r["level"] == lv]
    for f in FORMATS:
        groups[f] = [r for r in scored if r["format"] == f]
    for lv in LEVELS:
        for f in FORMATS:
            groups[f"{lv}/{f}"] = [r for r in scored if r["level"] == lv and r["format"] == f]
    for a in ARCHS:
        groups[a] = [r for r in scored if r["arch"] == a]
    return {g: {"cases": len(rs), **{k: _rate(rs, k) for k in
                                     ("hit1", "hit3", "hit1_lowest", "hit3_lowest")}}
            for g, rs in groups.items() if rs}


def _short(name: str) -> str:
    return name.replace(HAZARD_PATH, "H")


def _fmt_rank(r: Optional[int]) -> str:
    return "-" if r is None else str(r)


def case_table(rows: Sequence[dict]) -> str:
    head = (f"{'hazard':<21} {'arch':<5} {'fmt':<4} {'lvl':<4} {'dmg':<3} {'culp':>5} "
            f"{'floor':>5} {'loc':>4} {'low':>4}  top-3 by rank(), digits (H = {HAZARD_PATH})")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["hazard"] == "healthy":
            continue
        top = ", ".join(f"{_short(e['name'])}({e['digits']:.2f})" for e in r["top3"])
        lines.append(f"{r['hazard']:<21} {r['arch']:<5} {r['format']:<4} {r['level']:<4} "
                     f"{'yes' if r['damaged'] else 'NO':<3} {r['culprit_digits']:>5.2f} "
                     f"{r['healthy_floor']:>5.2f} {_fmt_rank(r['rank_localize']):>4} "
                     f"{_fmt_rank(r['rank_lowest']):>4}  {top}")
    return "\n".join(lines)


def control_table(rows: Sequence[dict]) -> str:
    ctl = [r for r in rows if r["hazard"] == "healthy"]
    if not ctl:
        return ""
    lines = ["healthy controls (no hazard): lowest digits (the floor), top of rank() with its "
             "digits and local loss"]
    for r in ctl:
        t = r["top3"][0] if r["top3"] else {}
        loss = t.get("localize", {}).get("local_loss")
        lines.append(f"  {r['arch']:<5} {r['format']:<4} {r['level']:<4} floor={r['floor']:.2f} "
                     f"nonfinite={len(r['nonfinite_sources'])} top={t.get('name')} "
                     f"digits={t.get('digits')} local_loss={loss}")
    return "\n".join(lines)


def summary_table(summary: dict) -> str:
    def pct(v: Optional[float]) -> str:
        return "   -" if v is None else f"{100 * v:4.0f}%"

    if not summary:
        return "(no damaged hazard case selected)"
    lines = [f"{'group':<10} {'cases':>5}  {'top1':>5} {'top3':>5}   {'top1 low':>8} "
             f"{'top3 low':>8}"]
    for g, s in summary.items():
        lines.append(f"{g:<10} {s['cases']:>5}  {pct(s['hit1']):>5} {pct(s['hit3']):>5}   "
                     f"{pct(s['hit1_lowest']):>8} {pct(s['hit3_lowest']):>8}")
    return "\n".join(lines)


def misses(rows: Sequence[dict]) -> str:
    out = []
    for r in rows:
        if r.get("damaged") and not r["hit1"]:
            t = r["top3"][0]
            c = max(r["culprit_entries"],
                    key=lambda e: e.get("localize", {}).get("local_loss", -math.inf))
            out.append(f"  {r['case']}: culprit rank {_fmt_rank(r['rank_localize'])}; top-1 "
                       f"{t['name']} digits {t['digits']} {t.get('localize', {})}; culprit "
                       f"{c['name']} digits {c['digits']} {c.get('localize', {})}")
    return ("misses of rank() at top-1:\n" + "\n".join(out)) if out else "no top-1 misses"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="every hazard on one architecture (rotating), both formats and levels")
    p.add_argument("--cases", default=None,
                   help="comma-separated globs (or substrings) over case ids "
                        "hazard/arch/format/level, e.g. 'near_tie*/gpt/*'; the healthy "
                        "controls are 'healthy/ARCH/FORMAT/LEVEL'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results", help="folder of localization.json")
    a = p.parse_args(argv)

    hazard_cases = select(all_cases(a.quick), a.cases)
    needed = {(c.arch, c.format, c.level) for c in hazard_cases}
    controls = [c for c in control_cases(list(ARCHS))
                if (c.arch, c.format, c.level) in needed or select([c], a.cases)]
    cases = controls + hazard_cases
    if not hazard_cases and not select(controls, a.cases):
        p.error(f"--cases {a.cases!r} matches no case; ids look like "
                f"'{HAZARDS[0].name}/mixer/bf16/op'")
    rows: list[dict] = []
    floor: dict[tuple, float] = {}
    for i, case in enumerate(cases, 1):
        key = (case.arch, case.format, case.level)
        rows.append(run_case(case, a.seed, floor.get(key)))
        if case.hazard is None:
            floor[key] = rows[-1]["floor"]
        r = rows[-1]
        tag = ("control" if case.hazard is None else
               f"dmg={'yes' if r['damaged'] else 'NO'} loc={_fmt_rank(r['rank_localize'])} "
               f"low={_fmt_rank(r['rank_lowest'])}")
        print(f"[{i}/{len(cases)}] {case.id}: {tag}", file=sys.stderr, flush=True)

    print(case_table(rows))
    undamaged = [r["case"] for r in rows if r["hazard"] != "healthy" and not r["damaged"]]
    print(f"\nno damage (culprit within {DAMAGE_MARGIN:g} digit of the healthy floor or above, "
          f"nothing non-finite; excluded): {', '.join(undamaged) if undamaged else 'none'}")
    ctl = control_table(rows)
    if ctl:
        print("\n" + ctl)
    summary = summarize(rows)
    print(f"\nhit rates over damaged cases (rank(): NaN/inf origins then localize(), metric "
          f"{_metric()!r}; 'low': sorted_worst_first()); target top-1 >= 95%, top-3 100%")
    print(summary_table(summary))
    print("\n" + misses(rows))
    path = save_json(Path(a.out) / "localization.json", {
        "benchmark": "bench_localization",
        "settings": {"quick": a.quick, "cases": a.cases, "seed": a.seed, "n_samples": 3,
                     "width": D, "seq": SEQ, "batch": BATCH, "layers": LAYERS,
                     "hazard_path": HAZARD_PATH, "damage_margin": DAMAGE_MARGIN,
                     "metric": _metric()},
        "hazards": {h.name: [{"operator": c.op_name(), "aten": list(c.aten) if c.aten else None,
                              "why": c.why} for c in h.culprits] for h in HAZARDS},
        "summary": summary, "rows": rows})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
