"""Stability monitor on a 6-layer Transformer LM trained in bf16 on WikiText-2 (issue 7).

Arms, each clean and with each injected instability (``fxstab.inject``):
  bf16      uninstrumented bf16 model (same execution path: dynamo + eager backend)
  fp32      every candidate operator pinned to STABLE_KERNEL with fp32 working precision
  monitor   selective monitoring (``StabilityMonitor``, per-family thresholds from
            ``monitor.calibrate`` on a clean pilot run with another seed; see ``calibrate``)

The injections switch on at a quarter of the run and ramp geometrically to their overflow
regime by three quarters. Measured: validation loss, NaN/Inf frequency (steps whose first
forward/backward was non-finite; the loop then asks the monitor for a targeted sweep, which
checks the operators whose output turns non-finite by themselves, retries the batch once, and
skips the update if it is still non-finite), detection precision
and recall (injected operator promoted vs any other operator promoted), overhead (train-step
wall clock relative to the bf16 arm of the same run), monitor time (time inside the monitor's
checks over the train-step time of the same steps of the same run, warm-up steps and
evaluations excluded), fraction of operators promoted.

    python benchmarks/exp_monitor_wikitext2.py                 # CPU defaults, a few minutes
    python benchmarks/exp_monitor_wikitext2.py --device cuda --d-model 256 --seq 128 \
        --batch 32 --vocab 20000 --steps 2000                  # GPU-sized run

Data: --data DIR (train.txt, valid.txt), else $FXSTAB_DATA/wikitext-2, else
../shared/data/wikitext-2 beside the repository root; never downloaded.

Writes results/monitor_wikitext2.json and results/monitor_wikitext2_loss.png (the loss per
arm, with non-finite steps, skipped updates and promotions marked: see ``loss_figure``).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxstab
from fxstab.monitor import inject
from fxstab.monitor import Mode, StabilityMonitor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import Progress  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The data sets ship beside the clone, in <clone>/../shared/data (docs/design.md §10); FXSTAB_DATA
# names another copy of that folder, --data the wikitext-2 folder itself. Nothing is downloaded.
DATA_ENV = "FXSTAB_DATA"
SPLITS = ("train.txt", "valid.txt")

# (injection, module path, strength at onset, strength at the end of the ramp, calibration
# strength). Ends: fp16 partial sums ~ c*|rowsum| pass 65504; logits x 256 pass exp's 88.7;
# a LayerNorm input x 2^100 squares past 3.4e38. fp16 accumulation calibrates at c = 256
# (S 0.05-0.2), not 64 (S ~0.02): clean up-projections (blocks.*.mlp.0) reach S = 0.031 (8u)
# early in the pilot run, so at c = 64 the hazard is not yet distinguishable from clean
# conditioning; c = 256 is still 2^9 below the overflow.
INJECTIONS = {
    "fp16_accumulation": ("blocks.2.mlp.0", 1.0, 2.0 ** 17, 256.0),
    "naive_softmax": ("blocks.1.attn.softmax", 1.0, 256.0, 32.0),
    "overflow_activation": ("blocks.4.ln2", 1.0, 2.0 ** 100, 2.0 ** 100),
}


# -- data ------------------------------------------------------------------------------------

def _master_step(opt, masters: list, params: list, clip: float, gnorm: float) -> None:
    """Clipped step on the fp32 master weights, then copy them back into the bf16 params."""
    scale = min(1.0, clip / (gnorm + 1e-6))
    for m, p in zip(masters, params):
        m.grad = p.grad.float() * scale
    opt.step()
    with torch.no_grad():
        for m, p in zip(masters, params):
            p.copy_(m)

def tokenize(path: Path) -> list[str]:
    words = []
    with open(path, encoding="utf8") as f:
        for line in f:
            words.extend(line.split() + ["<eos>"])
    return words


def data_dir(data: Optional[Path] = None) -> Path:
    """The WikiText-2 folder: ``data`` (--data), else ``$FXSTAB_DATA/wikitext-2``, else
    ``../shared/data/wikitext-2`` relative to the repository root.

    Raises:
        FileNotFoundError: the folder or one of its train/valid files is missing; the message
            says where it looked and how to point the script at a copy.
    """
    if data is not None:
        path, how = Path(data), "--data"
    elif os.environ.get(DATA_ENV):
        path, how = Path(os.environ[DATA_ENV]) / "wikitext-2", f"${DATA_ENV}/wikitext-2"
    else:
        path, how = ROOT.parent / "shared" / "data" / "wikitext-2", \
            "the default <repo>/../shared/data/wikitext-2"
    missing = [f for f in SPLITS if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"WikiText-2 not found: {path} ({how}) lacks {', '.join(missing)}. Pass --data DIR "
            f"(a folder with {' and '.join(SPLITS)}) or set {DATA_ENV} to the folder holding "
            f"wikitext-2/ (the shared/data folder beside the clone); this script never "
            f"downloads data.")
    return path


def load(vocab_cap: int, data: Optional[Path] = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    path = data_dir(data)
    train, valid = tokenize(path / "train.txt"), tokenize(path / "valid.txt")
    counts = collections.Counter(train)
    vocab = ["<unk>"] + [w for w, _ in counts.most_common() if w != "<unk>"][: vocab_cap - 1]
    index = {w: i for i, w in enumerate(vocab)}
    enc = lambda ws: torch.tensor([index.get(w, 0) for w in ws], dtype=torch.long)  # noqa: E731
    return enc(train), enc(valid), len(vocab)


# -- model -----------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.softmax = nn.Softmax(dim=-1)
        self.proj = nn.Linear(d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        a = a.masked_fill(mask, float("-inf"))
        return self.proj((self.softmax(a) @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1))

    def forward(self, idx):
        x = self.emb(idx) + self.pos
        for blk in self.blocks:
            x = blk(x, self.mask)
        return self.head(self.ln_f(x))


# -- training --------------------------------------------------------------------------------
Bar = Progress  # a line redrawn on a terminal, a line every 5% in a log (benchmarks/common.py)


def batches(data: torch.Tensor, seq: int, batch: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        i = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([data[j:j + seq] for j in i.tolist()])
        y = torch.stack([data[j + 1:j + seq + 1] for j in i.tolist()])
        yield x, y


def strength(t: int, steps: int, s0: float, s1: float) -> float:
    start, end = steps // 4, 3 * steps // 4
    if t < start:
        return 0.0
    frac = min(1.0, (t - start) / max(1, end - start))
    return s0 * (s1 / s0) ** frac


def make_model(args, vocab: int) -> LM:
    torch.manual_seed(args.seed)
    return LM(vocab, args.d_model, args.heads, args.layers, args.seq).to(args.device)


def evaluate(model, val: torch.Tensor, args) -> float:
    losses = []
    n = args.seq * args.batch
    with torch.no_grad():
        for b in range(args.val_batches):
            chunk = val[b * n: (b + 1) * n + 1]
            if chunk.numel() < n + 1:
                break
            x = chunk[:-1].view(args.batch, args.seq).to(args.device)
            y = chunk[1:].view(args.batch, args.seq).to(args.device)
            losses.append(float(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())))
    return sum(losses) / len(losses)


def run_arm(arm: str, scenario: str, args, data, vocab: int, cal) -> dict:
    train, val = data
    torch._dynamo.reset()  # the recompile limit is per code object, shared by all arms
    model = make_model(args, vocab).to(torch.bfloat16)
    handle = None
    if scenario != "clean":
        path, s0, s1, _ = INJECTIONS[scenario]
        handle = inject.INJECTIONS[scenario](model, path, 0.0 if scenario ==
                                             "fp16_accumulation" else 1.0)
    monitor = None
    if arm == "bf16":
        runner = torch.compile(model, backend="eager") if args.form == "compile" else model
    else:
        if arm == "fp32":
            monitor = StabilityMonitor(format="bf16", stable_dtype="fp32")
            monitor.force("STABLE_KERNEL")
        else:
            monitor = StabilityMonitor(format="bf16", k=args.k, screen_k=args.screen_k,
                                       period=args.period,
                                       tau_warn=cal.tau_warn, tau_safe=cal.tau_safe,
                                       thresholds=cal.thresholds if args.per_family else (),
                                       recheck=args.recheck, watch=args.watch,
                                       watch_every=args.watch_every, seed=args.seed)
        runner = (torch.compile(model, backend=monitor.backend()) if args.form == "compile"
                  else monitor.wrap(model))
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(False) for p in params]
    opt = torch.optim.AdamW(masters, lr=args.lr, weight_decay=0.01)

    def forward_backward(x, y):
        loss = F.cross_entropy(runner(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        gnorm = torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad.float()) for p in params]))
        return loss, gnorm

    curve, val_curve = [], []
    nonfinite_at, skipped_at = [], []  # steps whose first pass was non-finite / not applied
    times, mon_times = [], []
    bar = Bar(args.steps, f"{scenario}/{arm}")
    for t, (x, y) in enumerate(batches(train, args.seq, args.batch, args.steps, args.seed + 1)):
        if handle is not None:
            path, s0, s1, _ = INJECTIONS[scenario]
            handle.strength = strength(t, args.steps, s0, s1) if scenario == \
                "fp16_accumulation" else max(1.0, strength(t, args.steps, s0, s1))
        x, y = x.to(args.device), y.to(args.device)
        m0 = monitor.monitor_time if monitor is not None else 0.0
        t0 = time.perf_counter()
        loss, gnorm = forward_backward(x, y)
        if not (torch.isfinite(loss) and torch.isfinite(gnorm)):
            nonfinite_at.append(t)
            for p in params:
                p.grad = None
            if monitor is not None and arm == "monitor":
                # on the retry, check the operators that make a non-finite value themselves
                monitor.sweep(targeted=True)
                loss, gnorm = forward_backward(x, y)
        if torch.isfinite(loss) and torch.isfinite(gnorm):
            _master_step(opt, masters, params, args.clip, float(gnorm))
        else:
            skipped_at.append(t)
        for p in params:
            p.grad = None
        if monitor is not None:
            monitor.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        # Time inside the monitor's checks during this very step (same clock, same steps as
        # train_time_s: warm-up steps with compilation and evaluations are excluded below).
        mon_times.append((monitor.monitor_time if monitor is not None else 0.0) - m0)
        curve.append(float(loss))
        if (t + 1) % args.eval_every == 0 or t + 1 == args.steps:
            if monitor is not None:
                with monitor.paused():
                    val_curve.append((t + 1, evaluate(runner, val, args)))
            else:
                val_curve.append((t + 1, evaluate(runner, val, args)))
        bar.update(f"loss {float(loss):.3f}")
    warm = min(args.warmup, len(times) - 1)
    out = {
        "scenario": scenario, "arm": arm, "val_loss": val_curve[-1][1], "val_curve": val_curve,
        "train_loss": curve, "nonfinite_steps": len(nonfinite_at),
        "skipped_updates": len(skipped_at), "nonfinite_at": nonfinite_at,
        "skipped_at": skipped_at, "nonfinite_frequency": len(nonfinite_at) / args.steps,
        "train_time_s": sum(times[warm:]),
    }
    if monitor is not None:
        s = monitor.summary()
        out.update(operators=s["operators"], promoted=s["ever_promoted"],
                   fraction_promoted=len(s["ever_promoted"]) / max(1, s["operators"]),
                   promotions=s["promotions"], checks=s["checks"], replicas=s["replicas"],
                   monitor_time_s=sum(mon_times[warm:]),
                   monitor_time_fraction=sum(mon_times[warm:]) / sum(times[warm:]))
        if arm == "monitor":
            out["history"] = {n: h for n, h in monitor.history.items() if h}
        if handle is not None:
            out["injected_op"] = handle.op_name
            out["detected"] = any(handle.matches(n) for n in s["ever_promoted"])
            out["false_positives"] = [n for n in s["ever_promoted"] if not handle.matches(n)]
            first = [p["step"] for p in s["promotions"] if handle.matches(p["op"])]
            out["detection_step"] = first[0] if first else None
        else:
            out["false_positives"] = list(s["ever_promoted"])
    return out


def calibrate(args, vocab: int, train: torch.Tensor):
    """Clean vs injected dispersions along a pilot training run; returns the calibration.

    The pilot trains a clean bf16 model with another seed (``--calib-seed``: its own
    initialisation and batches, not the evaluated runs') under an observe-only monitor for
    ``--steps`` steps, and every ``--calib-every`` steps measures every operator (a sweep).
    Clean dispersions drift as training grows the weights and logits (attention-score matmuls
    went from 0.0045 on the initial model to 0.0059 at step 38), so the initial model alone
    under-states them. At the same steps a copy of the pilot model carries each injection at
    its calibration strength and only its injected operator is measured.
    """
    pargs = argparse.Namespace(**{**vars(args), "seed": args.calib_seed})
    model = make_model(pargs, vocab).to(torch.bfloat16)
    mon = StabilityMonitor(format="bf16", k=args.k, promote=False, seed=args.calib_seed)
    runner = mon.wrap(model)
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    opt = torch.optim.AdamW(masters, lr=args.lr, weight_decay=0.01)
    injected: dict[str, list[float]] = collections.defaultdict(list)
    bar = Bar(args.steps, "calibration (pilot run)")
    data = batches(train, args.seq, args.batch, args.steps, args.calib_seed + 1)
    for t, (x, y) in enumerate(data):
        x, y = x.to(args.device), y.to(args.device)
        probe = t % args.calib_every == 0 or t == args.steps - 1
        if probe:
            mon.sweep()
            for scenario in args.injections:
                path, _, _, s_cal = INJECTIONS[scenario]
                twin = make_model(pargs, vocab).to(torch.bfloat16)  # (the pilot has hooks)
                twin.load_state_dict(model.state_dict())
                handle = inject.INJECTIONS[scenario](twin, path, s_cal)
                imon = StabilityMonitor(format="bf16", k=args.k, promote=False,
                                        seed=args.calib_seed, families=())
                with torch.no_grad():
                    imon.sweep()
                    imon.wrap(twin)(x)
                for n, v in imon.measurements().items():
                    if handle.matches(n):
                        injected[n].extend(v)
        loss = F.cross_entropy(runner(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        gnorm = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad.float()) for p in params])))
        if math.isfinite(float(loss)) and math.isfinite(gnorm):
            _master_step(opt, masters, params, args.clip, gnorm)
        for p in params:
            p.grad = None
        mon.step()
        bar.update(f"loss {float(loss):.3f}")
    clean = {n: v for n, v in mon.measurements().items() if v}
    cal = StabilityMonitor(format="bf16").calibrate(clean, dict(injected),
                                                    per_family=args.per_family)
    return cal, clean, dict(injected)


def _smooth(values: list, k: int) -> list:
    """Trailing mean over ``k`` steps of the finite losses only (NaN where none is finite):
    a non-finite step neither erases the curve nor drags it to infinity."""
    out = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - k + 1):i + 1] if math.isfinite(v)]
        out.append(sum(window) / len(window) if window else math.nan)
    return out


def _steps_of(r: dict, key: str, fallback) -> list:
    """Steps listed under ``key``; results written before that key existed give ``fallback``."""
    return list(r[key]) if key in r else fallback


def loss_figure(results: list[dict]):
    """The training-loss picture: one panel per scenario, one smoothed curve per arm.

    Marks, in the arm's colour and on a line of the arm's own: x at the top of the panel for
    each step whose first forward/backward was non-finite (a square around it: the update
    was skipped, the retry too was non-finite), and a triangle at the bottom for each
    promotion of an operator by the monitor (a forced mode, the fp32 arm's set-up, is not a
    promotion; a demotion neither).
    Raw losses are drawn faintly behind the smoothed curve; non-finite losses are left out of
    both, so a NaN step shows as a mark, not as a vanished curve.

    Returns:
        The matplotlib figure (the caller saves and closes it).
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    if not results:
        raise ValueError("no results to plot")
    scenarios = list(dict.fromkeys(r["scenario"] for r in results))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.8 * len(scenarios), 3.8),
                             squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    arms = list(dict.fromkeys(r["arm"] for r in results))
    for ax, sc in zip(axes[0], scenarios):
        finite_max = 0.0
        for r in results:
            if r["scenario"] != sc:
                continue
            c = colours[arms.index(r["arm"]) % len(colours)]
            # marks of each arm on their own line, so that two arms' marks of a step both show
            lane = 0.045 * arms.index(r["arm"])
            top, bottom = 0.97 - lane, 0.03 + lane
            y = [float(v) for v in r["train_loss"]]
            steps = list(range(len(y)))
            finite = [v for v in y if math.isfinite(v)]
            finite_max = max([finite_max] + finite)
            ax.plot(steps, [v if math.isfinite(v) else math.nan for v in y], color=c,
                    alpha=0.25, linewidth=0.6)
            # each arm thinner than the one before: identical curves (the arms agree until an
            # injection bites) stay visible under each other
            ax.plot(steps, _smooth(y, max(1, len(y) // 40)), color=c, label=r["arm"],
                    linewidth=max(0.8, 2.4 - 0.7 * arms.index(r["arm"])))
            bad = _steps_of(r, "nonfinite_at", [t for t, v in enumerate(y)
                                                if not math.isfinite(v)])
            skipped = set(_steps_of(r, "skipped_at", []))
            if bad:
                ax.scatter(bad, [top] * len(bad), transform=ax.get_xaxis_transform(),
                           marker="x", color=c, s=30, zorder=4, clip_on=False,
                           gid=f"nonfinite:{r['arm']}")
            if skipped:
                ax.scatter(sorted(skipped), [top] * len(skipped), marker="s", s=60,
                           facecolor="none", edgecolor=c, transform=ax.get_xaxis_transform(),
                           zorder=4, clip_on=False, gid=f"skipped:{r['arm']}")
            promo = [p["step"] for p in r.get("promotions", [])
                     if p.get("reason") != "forced" and Mode[p["new"]] > Mode[p["old"]]]
            if promo:
                ax.scatter(promo, [bottom] * len(promo), transform=ax.get_xaxis_transform(),
                           marker="^", color=c, s=36, zorder=4, clip_on=False,
                           gid=f"promotion:{r['arm']}")
        ax.set_title(sc)
        ax.set_xlabel("step")
        ax.set_ylim(0, finite_max * 1.2 if finite_max > 0 else 1.0)  # room for the marks
        ax.set_ylabel("train loss (smoothed)")
        handles, _ = ax.get_legend_handles_labels()
        handles += [Line2D([], [], marker="x", color="grey", linestyle="none",
                           label="non-finite step (top)"),
                    Line2D([], [], marker="s", markerfacecolor="none", color="grey",
                           linestyle="none", label="update skipped (top)"),
                    Line2D([], [], marker="^", color="grey", linestyle="none",
                           label="promotion (bottom)")]
        ax.legend(handles=handles, fontsize=7)
    fig.tight_layout()
    return fig


def plot(results: list[dict], path: Path) -> None:
    """Save :func:`loss_figure` to ``path`` (a note instead when matplotlib is missing)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig = loss_figure(results)
    try:
        fig.savefig(path, dpi=120)
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=1000, help="vocabulary cap (train counts)")
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=40)
    ap.add_argument("--val-batches", type=int, default=10)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--screen-k", type=int, default=2,
                    help="replicas of a screening pass; all --k run only when its S reaches "
                         "watch * tau_warn (the calibration pilot always runs --k)")
    ap.add_argument("--period", type=int, default=1)
    ap.add_argument("--watch", type=float, default=0.8,
                    help="operators scoring >= watch * tau_warn are checked every period "
                         "(0.5 checked ~25 operators a step in the CPU run: 30-49%% overhead)")
    ap.add_argument("--recheck", type=int, default=50)
    ap.add_argument("--watch-every", type=int, default=2,
                    help="watched operators are checked on one check step in this many")
    ap.add_argument("--calib-every", type=int, default=10,
                    help="pilot-run steps between calibration sweeps")
    ap.add_argument("--calib-seed", type=int, default=1000,
                    help="seed of the calibration pilot run (init and batches)")
    ap.add_argument("--per-family", action=argparse.BooleanOptionalAction, default=True,
                    help="per-family thresholds from calibration (--no-per-family: one pair)")
    ap.add_argument("--warmup", type=int, default=3, help="steps excluded from timing")
    ap.add_argument("--form", choices=("compile", "wrap"), default="compile")
    ap.add_argument("--injections", nargs="*", default=list(INJECTIONS),
                    choices=list(INJECTIONS))
    ap.add_argument("--arms", nargs="*", default=["bf16", "fp32", "monitor"],
                    choices=["bf16", "fp32", "monitor"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    ap.add_argument("--data", type=Path, default=None,
                    help=f"WikiText-2 folder with train.txt and valid.txt (default: "
                         f"${DATA_ENV}/wikitext-2, else ../shared/data/wikitext-2 beside the "
                         f"repository)")
    ap.add_argument("--replot", type=Path, default=None, metavar="JSON",
                    help="only redraw the loss plot of a results JSON (written by this script) "
                         "into --out")
    args = ap.parse_args(argv)

    if args.replot is not None:
        try:
            results = json.loads(args.replot.read_text())["results"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"exp_monitor_wikitext2: error: --replot {args.replot}: not a results JSON "
                  f"of this script ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        args.out.mkdir(parents=True, exist_ok=True)
        plot(results, args.out / "monitor_wikitext2_loss.png")
        print(f"wrote {args.out / 'monitor_wikitext2_loss.png'}")
        return 0

    try:
        train, val, vocab = load(args.vocab, args.data)
    except FileNotFoundError as e:
        print(f"exp_monitor_wikitext2: error: {e}", file=sys.stderr)
        return 2
    print(f"WikiText-2: {train.numel()} train / {val.numel()} valid tokens, vocab {vocab}; "
          f"model d={args.d_model} heads={args.heads} layers={args.layers} seq={args.seq} "
          f"batch={args.batch}, {args.steps} steps on {args.device}")
    cal, clean, injected = calibrate(args, vocab, train)
    print(f"calibration: {cal}")

    results = []
    for scenario in ["clean"] + list(args.injections):
        for arm in args.arms:
            results.append(run_arm(arm, scenario, args, (train, val), vocab, cal))

    base = {r["scenario"]: r for r in results if r["arm"] == "bf16"}
    ref = {r["scenario"]: r for r in results if r["arm"] == "fp32"}
    rows = []
    for r in results:
        b, f = base.get(r["scenario"]), ref.get(r["scenario"])
        r["overhead"] = r["train_time_s"] / b["train_time_s"] - 1 if b else None
        r["val_vs_fp32"] = (r["val_loss"] / f["val_loss"] - 1 if f and math.isfinite(
            f["val_loss"]) else None)
    mon_runs = [r for r in results if r["arm"] == "monitor"]
    inj_runs = [r for r in mon_runs if r["scenario"] != "clean"]
    tp = sum(r["detected"] for r in inj_runs)
    fp = sum(len(r["false_positives"]) for r in mon_runs)
    precision = tp / (tp + fp) if tp + fp else float("nan")
    recall = tp / len(inj_runs) if inj_runs else float("nan")

    head = (f"{'scenario':<20} {'arm':<8} {'val loss':>8} {'vs fp32':>8} {'NaN/Inf':>7} "
            f"{'skipped':>7} {'promoted':>9} {'detected@':>9} {'FP':>3} {'overhead':>8} "
            f"{'mon time':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        pct = lambda v: "-" if v is None else f"{100 * v:+.1f}%"  # noqa: E731
        prom = (f"{len(r['promoted'])}/{r['operators']}" if "promoted" in r else "-")
        det = "-"
        if r["arm"] == "monitor" and r["scenario"] != "clean":
            det = str(r["detection_step"]) if r["detected"] else "missed"
        fps = str(len(r["false_positives"])) if r["arm"] == "monitor" else "-"
        mt = f"{100 * r['monitor_time_fraction']:.1f}%" if r["arm"] == "monitor" else "-"
        lines.append(f"{r['scenario']:<20} {r['arm']:<8} {r['val_loss']:8.3f} "
                     f"{pct(r['val_vs_fp32']):>8} {r['nonfinite_steps']:>7} "
                     f"{r['skipped_updates']:>7} {prom:>9} {det:>9} {fps:>3} "
                     f"{pct(r['overhead']):>8} {mt:>8}")
    lines.append(f"detection over {len(inj_runs)} injected runs: precision {precision:.2f}, "
                 f"recall {recall:.2f} (TP {tp}, FP {fp} incl. the clean run)")
    lines.append(f"calibration: {cal}")
    table = "\n".join(lines)
    print(table)

    args.out.mkdir(parents=True, exist_ok=True)
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    meta = {"torch": torch.__version__, "fxstab": fxstab.__version__, "python":
            platform.python_version(), "machine": platform.machine(), "cpu_threads":
            torch.get_num_threads(), "commit": commit, "args": {k: str(v) for k, v in
                                                                  vars(args).items()}}
    payload = {"meta": meta, "calibration": cal.as_dict(), "calibration_clean": clean,
               "calibration_injected": injected, "precision": precision,
               "recall": recall, "table": table, "results": results}
    jpath = args.out / "monitor_wikitext2.json"
    tmp = jpath.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, jpath)
    plot(results, args.out / "monitor_wikitext2_loss.png")
    print(f"wrote {jpath} and {args.out / 'monitor_wikitext2_loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
