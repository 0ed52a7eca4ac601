"""Pre/post normalization on trained Fashion-MNIST classifiers (the seed paper's Section 4.6;
issue 18).

Three otherwise identical MLPs, flatten -> fc1 (784 -> 256) -> norm -> ReLU -> fc2 (256 -> 10),
with BatchNorm (``batch``), LayerNorm (``layer``) or RMSNorm (``rms``) as ``norm``. Same seed,
same shuffled loader; Adam lr 1e-3, batch 128, 3 epochs; after every step the shadow analysis
of Section 4.1 (``benchmarks/exp_common.py``; BatchNorm runs in training mode on the batch, as
in the step, with its running statistics restored after the shadow call). Measured: the
average digits of the hidden linear output (``fc1``, before the normalization) and of the
normalization's output (after it), over the iterations, and the deterministic accuracy on
held-out test images. Arithmetic level by default (the normalization decomposes into its
primitives; its output is the last primitive recorded inside the module).

    .venv/bin/python benchmarks/exp_normalization.py --quick
    .venv/bin/python benchmarks/exp_normalization.py            # fp32 (--format fp32,fp64,bf16: all three)

Writes ``DIR/normalization.json`` (rows: one per format x norm) and
``DIR/normalization_digits_<format>.png`` (pre and post digits per step).
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
NORMS = {"batch": nn.BatchNorm1d, "layer": nn.LayerNorm, "rms": nn.RMSNorm}


class NormMLP(nn.Module):
    def __init__(self, norm: str, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, hidden)
        self.norm = NORMS[norm](hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x.flatten(1)))))


def build(norm: str, seed: int) -> NormMLP:
    torch.manual_seed(seed)
    return NormMLP(norm)


@dataclass
class Settings:
    train: int = 60000       # the whole training set: 468 steps per epoch
    eval: int = 2000
    batch: int = 128
    epochs: int = 3
    max_steps: Optional[int] = None
    lr: float = 1e-3


def quick_settings() -> Settings:
    return Settings(train=2048, eval=500)


def run_one(norm: str, fmt: str, level: str, st: Settings, data: tuple, seed: int,
            bar: Progress) -> dict:
    xtr, ytr, xte, yte = data
    model = build(norm, seed)
    fwd = lambda m, x: m(x)  # noqa: E731

    def keep(r: xc.StepResult) -> dict:
        pre, post = xc.module_output(r.dm, "fc1"), xc.module_output(r.dm, "norm")
        return {"epoch": r.epoch, "pre_op": pre, "post_op": post,
                "pre": xc.op_numbers(r.dm, pre), "post": xc.op_numbers(r.dm, post),
                "agreement": r.agreement, "batch_accuracy": r.batch_accuracy, "loss": r.loss}

    _, steps = xc.train_with_shadow(
        model, fwd, xtr, ytr, fmt=fmt, level=level, batch=st.batch, epochs=st.epochs,
        max_steps=st.max_steps, lr=st.lr, seed=seed, select=keep,
        on_step=lambda: bar.update(f"{fmt} {norm}"))
    acc = xc.accuracy(model, fwd, xte, yte)
    return {
        "format": fmt, "level": level, "norm": norm,
        "pre_operator": steps[-1]["pre_op"], "post_operator": steps[-1]["post_op"],
        "pre_avg_digits": xc.mean(s["pre"]["avg"] for s in steps),
        "post_avg_digits": xc.mean(s["post"]["avg"] for s in steps),
        "pre_min_digits": xc.mean(s["pre"]["min"] for s in steps),
        "post_min_digits": xc.mean(s["post"]["min"] for s in steps),
        "agreement": xc.mean(s["agreement"] for s in steps),
        "accuracy": acc, "steps": len(steps),
        "series": {"pre": [s["pre"]["avg"] for s in steps],
                   "post": [s["post"]["avg"] for s in steps],
                   "agreement": [s["agreement"] for s in steps],
                   "batch_accuracy": [s["batch_accuracy"] for s in steps],
                   "loss": [s["loss"] for s in steps]},
    }


def checks(rows: Sequence[dict]) -> list[str]:
    return [f"{r['format']} {r['norm']}: accuracy {r['accuracy']:.3f} <= 0.6"
            for r in rows if r["accuracy"] <= 0.6]


def table(rows: Sequence[dict]) -> str:
    head = f"{'format':<6} {'norm':<6} {'pre avg':>8} {'post avg':>8} {'loss':>6} {'A_t':>6} {'acc':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['format']:<6} {r['norm']:<6} {r['pre_avg_digits']:8.2f} "
                     f"{r['post_avg_digits']:8.2f} "
                     f"{r['pre_avg_digits'] - r['post_avg_digits']:6.2f} "
                     f"{r['agreement']:6.3f} {r['accuracy']:6.3f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = xc.study_parser(__doc__, "aten")
    p.add_argument("--norms", default=",".join(NORMS))
    a = p.parse_args(argv)
    st = xc.study_settings(a, quick_settings, Settings)
    norms = xc.choose(p, a.norms, NORMS, "norm")
    t0 = time.time()
    rows, formats, bad = xc.fmnist_study(a, st, norms, "normalization", run_one, table, checks)
    out = Path(a.out)
    path = save_json(out / "normalization.json", {
        "experiment": "exp_normalization", "quick": a.quick, "seconds": time.time() - t0,
        "settings": {**vars(st), "formats": formats, "level": a.level, "seed": a.seed,
                     "hidden": HIDDEN, "n_samples": xc.N_SAMPLES, "confidence": xc.CONFIDENCE,
                     "optimizer": "Adam"},
        "criteria_failures": bad, "rows": rows})
    figs = []
    for f in formats:
        series = {}
        for r in rows:
            if r["format"] == f:
                series[f"{r['norm']} pre (fc1)"] = r["series"]["pre"]
                series[f"{r['norm']} post"] = r["series"]["post"]
        figs.append(xc.plot_series(out / f"normalization_digits_{f}.png", series,
                                   "avg digits", f"before/after the normalization ({f}, N=3, "
                                   f"{a.level} level)"))
    print(f"\n{time.time() - t0:.0f} s; wrote {path}, " + ", ".join(str(f) for f in figs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
