"""Activation functions on trained Fashion-MNIST MLPs (the seed paper's Section 4.5; issue 18).

Nine otherwise identical MLPs, flatten -> fc1 (784 -> 256) -> activation -> fc2 (256 -> 10),
one per activation: ReLU, LeakyReLU, PReLU, ELU, GELU, SiLU, Swish (x sigmoid(beta x) with a
trainable beta, initialised to 1; SiLU is the same function with beta fixed at 1), tanh and
sigmoid. Same seed (same initial fc1/fc2), same shuffled loader for each; Adam lr 1e-3,
batch 128, 3 epochs; after every step the shadow analysis of Section 4.1
(``benchmarks/exp_common.py``). Measured: the hidden activation's output digits over the
iterations (avg, min; per epoch), the deterministic accuracy and the representative accuracy
(the prediction of the mean of the N samples' logits) on held-out test images.

Level: the op level by default. At the arithmetic level fxstab records no digits for exact
primitives (``relu``, ``where``, ``maximum``: their outputs are a selection of their inputs), so
the ReLU model has no activation entry there and LeakyReLU/PReLU only the product of their
negative branch; at the op level each activation is one operator, rounded into the format
(``--level aten`` runs the arithmetic level; the activation is then the last primitive recorded
inside the activation's module).

    .venv/bin/python benchmarks/exp_activations.py --quick
    .venv/bin/python benchmarks/exp_activations.py              # fp32 (--format fp32,fp64,bf16: all three)

Writes ``DIR/activations.json`` (rows: one per format x activation) and
``DIR/activations_digits_<format>.png`` (the activation's digits per step).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import exp_common as xc  # noqa: E402
from benchmarks.common import Progress, save_json  # noqa: E402

HIDDEN = 256


class Swish(nn.Module):
    """x * sigmoid(beta x), beta trainable (Ramachandran et al.), initialised to 1."""

    def __init__(self) -> None:
        super().__init__()
        self.beta = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.beta * x)


ACTIVATIONS = {
    "relu": nn.ReLU, "leaky_relu": nn.LeakyReLU, "prelu": nn.PReLU, "elu": nn.ELU,
    "gelu": nn.GELU, "silu": nn.SiLU, "swish": Swish, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid,
}


class MLP(nn.Module):
    def __init__(self, act: nn.Module, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, hidden)
        self.act = act
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x.flatten(1))))


def build(name: str, seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP(ACTIVATIONS[name]())


@dataclass
class Settings:
    train: int = 16384       # 128 steps per epoch (the full 60,000 does not fit 20 minutes)
    eval: int = 2000
    batch: int = 128
    epochs: int = 3
    max_steps: Optional[int] = None
    lr: float = 1e-3


def quick_settings() -> Settings:
    return Settings(train=2048, eval=500)


def run_one(name: str, fmt: str, level: str, st: Settings, data: tuple, seed: int,
            bar: Progress) -> dict:
    xtr, ytr, xte, yte = data
    model = build(name, seed)
    fwd = lambda m, x: m(x)  # noqa: E731

    def keep(r: xc.StepResult) -> dict:
        op = xc.module_output(r.dm, "act")
        return {"epoch": r.epoch, "operator": op, **xc.op_numbers(r.dm, op),
                "agreement": r.agreement, "batch_accuracy": r.batch_accuracy, "loss": r.loss}

    shadow, steps = xc.train_with_shadow(
        model, fwd, xtr, ytr, fmt=fmt, level=level, batch=st.batch, epochs=st.epochs,
        max_steps=st.max_steps, lr=st.lr, seed=seed, select=keep,
        on_step=lambda: bar.update(f"{fmt} {name}"))
    rep, det = xc.representative_accuracy(shadow, model, fwd, xte, yte)
    epochs = sorted({s["epoch"] for s in steps})
    return {
        "format": fmt, "level": level, "activation": name, "operator": steps[-1]["operator"],
        "avg_digits": xc.mean(s["avg"] for s in steps),
        "min_digits": xc.mean(s["min"] for s in steps),
        "epoch_avg_digits": [xc.mean(s["avg"] for s in steps if s["epoch"] == e) for e in epochs],
        "last_avg_digits": steps[-1]["avg"],
        "agreement": xc.mean(s["agreement"] for s in steps),
        "accuracy": det, "representative_accuracy": rep, "steps": len(steps),
        "series": {k: [s[k] for s in steps] for k in ("avg", "min", "agreement", "batch_accuracy",
                                                   "loss")},
    }


def checks(rows: Sequence[dict]) -> list[str]:
    bad = [f"{r['format']} {r['activation']}: accuracy {r['accuracy']:.3f} <= 0.6"
           for r in rows if r["accuracy"] <= 0.6]
    for fmt in dict.fromkeys(r["format"] for r in rows):
        got = {r["activation"] for r in rows if r["format"] == fmt}
        if got != set(ACTIVATIONS):
            bad.append(f"{fmt}: activations missing: {sorted(set(ACTIVATIONS) - got)}")
    return bad


def table(rows: Sequence[dict]) -> str:
    head = (f"{'format':<6} {'activation':<11} {'avg':>6} {'min':>6} {'per epoch':<20} "
            f"{'A_t':>6} {'acc':>6} {'rep acc':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ep = " ".join(f"{v:.2f}" for v in r["epoch_avg_digits"])
        lines.append(f"{r['format']:<6} {r['activation']:<11} {r['avg_digits']:6.2f} "
                     f"{r['min_digits']:6.2f} {ep:<20} {r['agreement']:6.3f} "
                     f"{r['accuracy']:6.3f} {r['representative_accuracy']:7.3f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = xc.study_parser(__doc__, "op")
    p.add_argument("--activations", default=",".join(ACTIVATIONS))
    a = p.parse_args(argv)
    st = xc.study_settings(a, quick_settings, Settings)
    names = xc.choose(p, a.activations, ACTIVATIONS, "activation")
    t0 = time.time()

    def criteria(rows):
        return checks(rows) if set(names) == set(ACTIVATIONS) else \
            [b for b in checks(rows) if "missing" not in b]

    rows, formats, bad = xc.fmnist_study(a, st, names, "activations", run_one, table, criteria)
    out = Path(a.out)
    path = save_json(out / "activations.json", {
        "experiment": "exp_activations", "quick": a.quick, "seconds": time.time() - t0,
        "settings": {**vars(st), "formats": formats, "level": a.level, "seed": a.seed,
                     "hidden": HIDDEN, "n_samples": xc.N_SAMPLES, "confidence": xc.CONFIDENCE,
                     "optimizer": "Adam", "representative": "argmax of the mean of the N "
                     "samples' logits"},
        "criteria_failures": bad, "rows": rows})
    figs = [xc.plot_series(out / f"activations_digits_{f}.png",
                           {r["activation"]: r["series"]["avg"] for r in rows if r["format"] == f},
                           "avg digits of the hidden activation",
                           f"activations per step ({f}, N=3, {a.level} level)")
            for f in formats]
    print(f"\n{time.time() - t0:.0f} s; wrote {path}, " + ", ".join(str(f) for f in figs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
