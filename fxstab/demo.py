"""`fxstab demo`: the README's main job.

A small character-level transformer language model is trained for a few steps on an embedded
text, then analysed with the fxstab backend in a simulated fp16. It carries two classic bugs:
its embeddings carry a common offset of 64 (a bias folded into them), so the first block's
layer norms cancel it away and keep fewer digits than their inputs had (a finite, subtle loss);
and the second block's attention skips the 1/sqrt(d) scale and the max subtraction, so exp()
overflows fp16 although the fp32 model runs fine. The findings name both operators.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

TEXT = (
    "Deep learning programs now train and serve in bfloat16, float16 and even eight bit formats. "
    "They lose digits in ways that show up late, as a loss spike or a NaN many steps after the "
    "operator that caused it. Stochastic arithmetic makes the loss visible: run every operator "
    "on a few samples whose rounding errors are drawn at random, and count the digits the "
    "samples still share. Where the samples disagree, the digits were never there. A softmax "
    "that forgets to subtract the maximum overflows; a layer norm of values with a large common "
    "offset cancels; a near tie in attention flips with the noise. Each of these looks fine in "
    "float32 and fails quietly in a narrower format, and each shows up here as an operator whose "
    "significant digits fall to zero while its inputs still carry them."
)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, naive: bool) -> None:
        super().__init__()
        self.heads, self.naive = heads, naive
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        if self.naive:
            # The hazard: a sharpening temperature of 1/4 where 1/sqrt(d) was meant, and no max
            # subtraction before exp. Scores reach ~60: exp is finite in fp32, not in fp16.
            scores = ((q @ k.transpose(-2, -1)) * 4.0).masked_fill(mask, -1e4)
            e = torch.exp(scores)
            att = e / e.sum(-1, keepdim=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // h)
            att = torch.softmax(scores.masked_fill(mask, float("-inf")), -1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, naive: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, naive)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Character-level transformer LM; block ``hazard`` has the naive attention."""

    def __init__(self, vocab: int, d: int = 64, heads: int = 4, layers: int = 3, ctx: int = 48,
                 hazard: int = 1, offset: float = 64.0) -> None:
        super().__init__()
        self.offset = offset  # a common offset of the embeddings: the layer norms cancel it
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads, naive=(i == hazard)) for i in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device)) + self.offset
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.ln_f(x))


def build(seed: int = 0, steps: int = 40, ctx: int = 48) -> tuple[TinyLM, torch.Tensor]:
    """The demo model, trained for ``steps`` steps on TEXT, and a batch of contexts."""
    torch.manual_seed(seed)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT])
    model = TinyLM(len(chars), ctx=ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    starts = torch.arange(0, len(data) - ctx - 1, 7)
    for step in range(steps):
        i = starts[torch.randint(len(starts), (8,))]
        x = torch.stack([data[j:j + ctx] for j in i])
        y = torch.stack([data[j + 1:j + ctx + 1] for j in i])
        loss = F.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    batch = torch.stack([data[j:j + ctx] for j in starts[:8]])
    return model, batch


def run_demo(seed: int = 0, format: str = "fp16", output: Optional[str] = None) -> int:
    """Train, analyse and print the demo's digit map; save it to ``output`` when given."""
    import fxstab

    from .digitmap import DEFAULT_METRIC, mechanism_hint
    from .numerics.formats import torch_dtype_of

    t0 = time.perf_counter()
    model, batch = build(seed)
    be = fxstab.backend(format=format, n_samples=3, seed=seed)
    compiled = torch.compile(model, backend=be)
    with torch.no_grad():
        out = compiled(batch)
        assert torch.equal(out, model(batch)), "fxstab changed the model's output"
    dm = be.digit_map(target="fxstab.demo:TinyLM")
    name = fxstab.get_format(format).name
    print(f"fxstab demo: a 3-block character transformer LM, analysed in simulated {name} "
          f"(N=3 samples, random rounding, cap {dm.cap:.2f} digits).")
    print("Its embeddings carry a common offset of 64; block 1's attention sharpens its scores "
          "(x4, not 1/sqrt(d)) and its softmax skips the max subtraction.\n")
    print(dm.summary())
    print()
    print(dm.table(top=12))
    print()
    print(dm.localize_table(top=5))
    if output:
        dm.save(output)
        print(f"\nsaved {len(dm)} operators to {output}")
    # the verdict last, where a reader's eye lands: what to fix first, and how
    ranked = dm.localize()
    if ranked:
        first = ranked[0]
        what = "NaN/inf first appear" if first.nonfinite_origin else "digits are lost first"
        print(f"\n=> {what} at {first.name}: "
              f"{mechanism_hint(dm, dm[first.name], first.nonfinite_origin)}.")
        _say_line(dm[first.name])
        lost = next((r for r in ranked if not r.nonfinite_origin and r.local_loss > 0), None)
        if lost is not None and first.nonfinite_origin:
            print(f"=> then {lost.name} loses {lost.local_loss:.2f} {DEFAULT_METRIC} digits "
                  f"against its input: {mechanism_hint(dm, dm[lost.name])}.")
            _say_line(dm[lost.name])
    print(f"\nThe model's own output was unchanged; {DEFAULT_METRIC} digits rank the operators "
          f"[{time.perf_counter() - t0:.1f}s].")
    if torch_dtype_of(name) is None:  # a format torch does not compute in: no real run
        return 0
    print(f"Next: `fxstab fix fxstab.demo:build --format {name}` rewrites the code at those "
          f"lines into its stable form where one is known (the exp: a softmax) and checks it in "
          f"a real {name} run; `fxstab plan fxstab.demo:build --format {name} --keep 1.2 "
          f"--apply-check` finds a cheap set of operators to keep in fp32 and checks that.")
    return 0


def _say_line(op: object) -> None:
    """The user's line of operator ``op`` under a verdict (``   demo.py:50  e = ...``)."""
    from .digitmap.findings import at_line

    line = at_line(op, width=72)
    if line:
        print("   " + line.removeprefix(", ").replace(" `", "  ", 1).rstrip("`"))
