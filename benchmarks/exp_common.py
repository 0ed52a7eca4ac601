"""What the paper-reproduction experiments share (issue 18): data, the shadow-analysis loop, A_t.

The three scripts ``exp_pathology.py``, ``exp_activations.py`` and ``exp_normalization.py``
follow the seed paper's Section 4.1 set-up. The optimizer and the loss stay on the
deterministic path (the plain eager model); after every optimizer step the *shadow* analysis
evaluates the updated parameters on the same batch through fxstab's ``torch.compile`` backend
(N = 3 samples, confidence 0.95, ``output="deterministic"``), which needs no copy of the model:
the compiled module shares the parameters, and its deterministic pass returns exactly what eager
returns. Per step it yields the step's digit map and the decision-level metric A_t, the
fraction of the batch for which all N stochastic samples predict the class the deterministic
model predicts.

The samples of the model's output come from the backend's ``capture_samples()`` (the samples
of the outputs of the graphs analysed inside the block).

Data: ``--data DIR`` (the folder holding ``fashion-mnist/`` and ``ag_news/``), else
``$FXSTAB_DATA``, else ``../shared/data`` beside the repository root. Nothing is downloaded.
"""

from __future__ import annotations

import csv
import gzip
import math
import os
import re
import struct
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import ROOT, Progress  # noqa: E402

import fxstab  # noqa: E402
from fxstab import digitmap as _digitmap  # noqa: E402

DATA_ENV = "FXSTAB_DATA"
N_SAMPLES = 3          # the paper: N = 3 samples
CONFIDENCE = 0.95      # at confidence 0.95
FORMATS = ("fp32", "fp64", "bf16")  # the stated setting, the one the paper's digits imply, bf16


# ============================================================================= data
def data_root(data: "Optional[str | Path]" = None, need: Sequence[str] = ()) -> Path:
    """The folder of the offline data sets: ``data``, else ``$FXSTAB_DATA``, else
    ``<repo>/../shared/data``.

    Raises:
        FileNotFoundError: a file of ``need`` (paths relative to the folder) is missing; the
            message says where it looked and how to point the script elsewhere.
    """
    if data is not None:
        path, how = Path(data), "--data"
    elif os.environ.get(DATA_ENV):
        path, how = Path(os.environ[DATA_ENV]), f"${DATA_ENV}"
    else:
        path, how = ROOT.parent / "shared" / "data", "the default <repo>/../shared/data"
    missing = [f for f in need if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"data not found: {path} ({how}) lacks {', '.join(missing)}. Pass --data DIR (the "
            f"folder holding fashion-mnist/ and ag_news/) or set {DATA_ENV}; these scripts "
            f"never download data.")
    return path


FMNIST_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
                "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


def _idx(path: Path, limit: Optional[int]) -> torch.Tensor:
    """An idx file (gzip) as a uint8 tensor; only the first ``limit`` items are decoded."""
    with gzip.open(path, "rb") as f:
        magic, n = struct.unpack(">II", f.read(8))
        ndim = magic & 0xFF
        if magic >> 8 != 0x08 or ndim not in (1, 3):
            raise ValueError(f"{path}: not an idx file of unsigned bytes (magic {magic:#x})")
        dims = struct.unpack(">" + "I" * (ndim - 1), f.read(4 * (ndim - 1)))
        n = n if limit is None else min(n, limit)
        size = n * math.prod(dims)
        buf = f.read(size)
    if len(buf) != size:
        raise ValueError(f"{path}: truncated ({len(buf)} of {size} bytes)")
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).reshape(n, *dims)


def load_fmnist(split: str, limit: Optional[int] = None, data: Any = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fashion-MNIST ``split`` ("train"/"test"): images ``[n, 1, 28, 28]`` float32 standardized
    with the training set's mean and std (0.2860, 0.3530), labels ``[n]`` int64."""
    img_f, lab_f = FMNIST_FILES[split]
    root = data_root(data, [f"fashion-mnist/{img_f}", f"fashion-mnist/{lab_f}"]) / "fashion-mnist"
    x = _idx(root / img_f, limit).float().div_(255.0).sub_(0.2860).div_(0.3530)
    y = _idx(root / lab_f, limit).long()
    return x.unsqueeze(1), y


_TOKEN = re.compile(r"[a-z0-9']+")


def tokenize(text: str) -> list[str]:
    """Lower-case words and numbers; AG News's literal ``\\`` line breaks and ``#36;``-style
    HTML entities are separators."""
    text = text.replace("\\", " ").replace("#39;", "'")
    return _TOKEN.findall(re.sub(r"#\d+;", " ", text.lower()))


@dataclass
class TextData:
    """AG News encoded: ``ids`` ``[n, seq]`` (0 = padding, 1 = unknown), ``mask`` ``[n, seq]``
    (1.0 on words), ``y`` ``[n]`` (classes 0-3)."""

    ids: torch.Tensor
    mask: torch.Tensor
    y: torch.Tensor
    vocab: int


def load_agnews(train_rows: int, eval_rows: int, seq: int = 32, vocab: int = 8000,
                data: Any = None, seed: int = 0) -> tuple[TextData, TextData]:
    """AG News as (train, held-out) splits of ``test.csv`` (the only complete split offline: the
    581-row train sample is unverified, see the data's README), shuffled with ``seed``; the
    vocabulary (``vocab`` most frequent words) comes from the training rows only. Each text is
    the title and the description, truncated or padded to ``seq`` words."""
    root = data_root(data, ["ag_news/test.csv"]) / "ag_news"
    with open(root / "test.csv", newline="", encoding="utf8") as f:
        rows = [(int(r[0]) - 1, tokenize(r[1] + " " + r[2])) for r in csv.reader(f)]
    if train_rows + eval_rows > len(rows):
        raise ValueError(f"AG News test.csv has {len(rows)} rows; asked for {train_rows} + "
                         f"{eval_rows}")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    train = [rows[i] for i in order[:train_rows]]
    held = [rows[i] for i in order[train_rows:train_rows + eval_rows]]
    counts = Counter(w for _, ws in train for w in ws)
    index = {w: i + 2 for i, (w, _) in enumerate(counts.most_common(vocab - 2))}

    def enc(part: list) -> TextData:
        ids = torch.zeros(len(part), seq, dtype=torch.long)
        for i, (_, ws) in enumerate(part):
            toks = [index.get(w, 1) for w in ws[:seq]] or [1]
            ids[i, :len(toks)] = torch.tensor(toks)
        return TextData(ids, (ids > 0).float(), torch.tensor([c for c, _ in part]), vocab)

    return enc(train), enc(held)


def batches(n: int, batch: int, epochs: int, max_steps: Optional[int], seed: int
            ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(epoch, step in epoch, indices) of a shuffled loader: one permutation per epoch from one
    generator seeded ``seed`` (so every model of a study sees the same batches), at most
    ``max_steps`` full batches per epoch."""
    g = torch.Generator().manual_seed(seed)
    per_epoch = n // batch if max_steps is None else min(n // batch, max_steps)
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=g)
        for s in range(per_epoch):
            yield epoch, s, perm[s * batch:(s + 1) * batch]


# ============================================================================= samples, A_t
class OutputSamples:
    """The deterministic output and the samples of the model's output of one call, through
    the backend's :meth:`~fxstab.backend.FxstabBackend.capture_samples`. The model must run as
    one analysed graph per call (no graph breaks: checked) returning one tensor."""

    def __init__(self, be: Any) -> None:
        self.be = be

    def call(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``fn()`` (a call of the compiled model) on a cleared backend; returns the
        deterministic output and its samples ``[N, *shape]``.

        Raises:
            RuntimeError: the call ran several graphs (graph breaks: the last graph's output
                need not be the model's) or none, or its output is not one tensor.
        """
        self.be.clear()
        with self.be.capture_samples() as cap:
            det = fn()
        if len(cap.graphs) != 1:
            raise RuntimeError(f"A_t needs the model to run as one analysed graph per call; "
                               f"this call ran {len(cap.graphs)} (graph breaks?)")
        samples = cap.output
        if not (isinstance(samples, torch.Tensor) and samples.shape[1:] == det.shape):
            raise RuntimeError(f"the graph's output is not the model's one tensor of shape "
                               f"{tuple(det.shape)}")
        return det, samples


def agreement(det: torch.Tensor, samples: torch.Tensor) -> float:
    """A_t: the fraction of rows for which every sample's argmax is the deterministic argmax."""
    ref = det.argmax(-1)
    return float((samples.argmax(-1) == ref.unsqueeze(0)).all(0).float().mean())


# ============================================================================= the loop
@dataclass
class StepResult:
    """One training step: loss, A_t, the accuracy of the deterministic prediction on the
    step's batch (after the update), the step's digit map."""

    epoch: int
    step: int
    loss: float
    agreement: float
    dm: Any
    batch_accuracy: float = float("nan")


def restore_buffers(model: nn.Module) -> Callable[[], None]:
    """Snapshot the buffers (BatchNorm's running statistics); the returned function puts them
    back, so the shadow call's deterministic pass does not update them a second time."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]

    def restore() -> None:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)
    return restore


def shadow_backend(fmt: str, level: str, seed: int = 0) -> Any:
    return fxstab.backend(granularity=level, format=fmt, n_samples=N_SAMPLES, seed=seed,
                          confidence=CONFIDENCE, output="deterministic")


def train_with_shadow(model: nn.Module, forward: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                      xs: Any, ys: torch.Tensor, *, fmt: str, level: str, batch: int,
                      epochs: int, max_steps: Optional[int], lr: float, seed: int,
                      select: Callable[[Any], Any], on_step: Optional[Callable] = None
                      ) -> tuple[Any, list]:
    """Adam training with a shadow analysis after every optimizer step (Section 4.1).

    Args:
        model: the model (trained in place, in fp32, on the deterministic path).
        forward: ``forward(module, batch_inputs)`` returns logits; called with the eager model
            for training and with the compiled one for the shadow analysis.
        xs: inputs indexable by a tensor of indices (a tensor, or a tuple of tensors).
        ys: labels.
        select: ``select(step_result)`` extracts what the caller keeps of each step (the digit
            maps are large; keep numbers).
        on_step: called after each step (a progress bar).

    Returns:
        ((the backend, the compiled model, its :class:`OutputSamples`): the shadow, for
        :func:`representative_accuracy`; the list of ``select`` results, one per step).
    """
    torch._dynamo.reset()
    be = shadow_backend(fmt, level, seed)
    compiled = torch.compile(model, backend=be, dynamic=False)
    rec = OutputSamples(be)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    take = (lambda idx: tuple(x[idx] for x in xs)) if isinstance(xs, tuple) else \
        (lambda idx: xs[idx])
    kept = []
    for epoch, s, idx in batches(len(ys), batch, epochs, max_steps, seed):
        xb, yb = take(idx), ys[idx]
        model.train()
        loss = F.cross_entropy(forward(model, xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        # the shadow analysis: updated parameters, same batch, N samples beside the
        # deterministic pass (train mode as in the step; buffers restored afterwards)
        restore = restore_buffers(model)
        with torch.no_grad():
            det, samples = rec.call(lambda: forward(compiled, xb))
        restore()
        a_t = agreement(det, samples)
        dm = _digitmap.DigitMap.from_reports(be.reports, metadata={"format": fmt})
        acc = float((det.argmax(-1) == yb).float().mean())
        kept.append(select(StepResult(epoch, s, float(loss.detach()), a_t, dm, acc)))
        if on_step is not None:
            on_step()
    return (be, compiled, rec), kept


@torch.no_grad()
def accuracy(model: nn.Module, forward: Callable, xs: Any, ys: torch.Tensor, batch: int = 500
             ) -> float:
    """Deterministic accuracy (eval mode)."""
    model.eval()
    hits = 0
    for i in range(0, len(ys), batch):
        sl = slice(i, i + batch)
        xb = tuple(x[sl] for x in xs) if isinstance(xs, tuple) else xs[sl]
        hits += int((forward(model, xb).argmax(-1) == ys[sl]).sum())
    return hits / max(len(ys), 1)


@torch.no_grad()
def representative_accuracy(shadow: tuple, model: nn.Module, forward: Callable, xs: Any,
                            ys: torch.Tensor, batch: int = 500) -> tuple[float, float]:
    """Accuracy of the sample mean's prediction (the representative stochastic sample: the
    mean of the N samples' logits, argmax) and of the deterministic prediction, on the same
    held-out inputs, through the shadow backend (eval mode). Returns (representative,
    deterministic)."""
    be, compiled, rec = shadow
    model.eval()
    hits = det_hits = 0
    for i in range(0, len(ys), batch):
        sl = slice(i, i + batch)
        xb = tuple(x[sl] for x in xs) if isinstance(xs, tuple) else xs[sl]
        det, samples = rec.call(lambda: forward(compiled, xb))
        mean = samples.double().mean(0)
        hits += int((mean.argmax(-1) == ys[sl]).sum())
        det_hits += int((det.argmax(-1) == ys[sl]).sum())
    be.clear()
    return hits / max(len(ys), 1), det_hits / max(len(ys), 1)


# ============================================================================= digit maps
def metric() -> str:
    return _digitmap.DEFAULT_METRIC


def digits(op: Any, which: Optional[str] = None) -> float:
    """An operator's digits under ``which`` (default: the default metric); NaN counts as 0."""
    d = op.digits(which or metric())
    return 0.0 if d is None or math.isnan(d) else float(d)


def module_operators(dm: Any, path: str) -> list[str]:
    """The digit-map names of the recorded operators inside module ``path`` (graph order)."""
    names = [n for n, op in dm.operators.items()
             if op.module_path == path or op.module_path.startswith(path + ".")]
    if not names:
        raise KeyError(f"no recorded operator inside module {path!r}; operators: "
                       f"{list(dm.operators)}")
    return names


def module_output(dm: Any, path: str) -> str:
    """The digit-map name of the last recorded operator (graph order) inside module ``path``:
    the module's output at the op level, its output primitive at the arithmetic level."""
    names = [n for n, op in dm.operators.items()
             if op.module_path == path or op.module_path.startswith(path + ".")]
    if not names:
        raise KeyError(f"no recorded operator inside module {path!r}; operators: "
                       f"{list(dm.operators)}")
    return names[-1]


def rank_lowest(dm: Any, name: str) -> int:
    """1 + the number of operators with strictly fewer digits (default metric) than ``name``:
    1 = the lowest. Ties share the better rank; :func:`ties` counts them."""
    own = digits(dm[name])
    return 1 + sum(digits(op) < own for op in dm.operators.values())


def ties(dm: Any, name: str) -> int:
    """Other operators with exactly ``name``'s digits (default metric)."""
    own = digits(dm[name])
    return sum(digits(op) == own for n, op in dm.operators.items() if n != name)


def op_numbers(dm: Any, name: str) -> dict:
    op = dm[name]
    return {"avg": digits(op, "avg"), "min": digits(op, "min"), "default": digits(op),
            "non_finite": int(op.non_finite)}


def study_parser(doc: str, level: str, data_help: str = "folder holding fashion-mnist/"
                 ) -> "argparse.ArgumentParser":
    """The options every study script takes: --quick, --format, --level, --out, --data,
    --seed and the settings' overrides (--train, --eval, --epochs, --max-steps)."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and examples, same code")
    p.add_argument("--format", default="fp32",
                   help="simulated format(s), comma-separated (default fp32, the paper's "
                        "setting; fp32,fp64,bf16 runs the three of docs/experiments.md)")
    p.add_argument("--level", default=level, choices=("aten", "op"),
                   help=f"granularity of the analysis (default {level}: see the module "
                        f"docstring)")
    p.add_argument("--out", default="results", help="output folder (default results/)")
    p.add_argument("--data", default=None, help=data_help)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=None, help="training examples (override)")
    p.add_argument("--eval", type=int, default=None, help="held-out examples (override)")
    p.add_argument("--epochs", type=int, default=None, help="epochs (override)")
    p.add_argument("--max-steps", type=int, default=None, help="steps per epoch (override)")
    return p


def study_settings(args: Any, quick: Callable[[], Any], full: Callable[[], Any]) -> Any:
    """The quick or full settings with the command line's overrides."""
    st = quick() if args.quick else full()
    for k in ("train", "eval", "epochs", "max_steps"):
        if getattr(args, k) is not None:
            setattr(st, k, getattr(args, k))
    return st


def choose(parser: Any, text: str, known: Sequence[str], what: str) -> list[str]:
    """The comma-separated names of ``text``, each one of ``known`` (a parser error if not)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = set(names) - set(known)
    if unknown:
        parser.error(f"unknown {what}(s) {sorted(unknown)}; known: {', '.join(known)}")
    return names


def fmnist_study_data(st: Any, data: Any) -> tuple:
    """(train images, train labels, test images, test labels, steps per epoch) of a
    Fashion-MNIST study's settings."""
    xtr, ytr = load_fmnist("train", st.train, data)
    xte, yte = load_fmnist("test", st.eval, data)
    per_epoch = len(ytr) // st.batch
    if st.max_steps is not None:
        per_epoch = min(st.max_steps, per_epoch)
    return xtr, ytr, xte, yte, per_epoch


def fmnist_study(args: Any, st: Any, names: Sequence[str], label: str, run_one: Callable,
                 table: Callable, checks: Callable) -> tuple[list, list, list]:
    """Run a Fashion-MNIST study (``run_one(name, format, level, settings, data, seed, bar)``
    for every format of ``--format`` and every name), print its table and criteria; returns
    (rows, formats, criteria failures)."""
    formats = format_list(args.format)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    xtr, ytr, xte, yte, per_epoch = fmnist_study_data(st, args.data)
    bar = Progress(len(formats) * len(names) * st.epochs * per_epoch, label)
    rows = [run_one(n, f, args.level, st, (xtr, ytr, xte, yte), args.seed, bar)
            for f in formats for n in names]
    print(table(rows))
    bad = checks(rows)
    print("\ncriteria: " + ("all hold" if not bad else "FAILED\n  " + "\n  ".join(bad)))
    return rows, formats, bad


def format_list(text: str) -> list[str]:
    """``--format fp32,bf16`` as a list (each checked by ``fxstab.backend``)."""
    out = [f.strip() for f in text.split(",") if f.strip()]
    if not out:
        raise ValueError(f"--format: no format in {text!r}")
    for f in out:
        shadow_backend(f, "op")
    return out


def mean(values: Iterable[float]) -> float:
    v = [float(x) for x in values]
    return sum(v) / len(v) if v else math.nan


def plot_series(path: Path, series: dict, ylabel: str, title: str, xlabel: str = "step",
                dashed: Iterable[str] = ()) -> Path:
    """One line per label of ``series`` ({label: [y per step]}), the labels in ``dashed``
    dashed; saved as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colours = plt.get_cmap("tab20" if len(series) > 10 else "tab10").colors
    dashed = set(dashed)
    for i, (label, ys) in enumerate(series.items()):
        ax.plot(range(len(ys)), ys, label=label, linewidth=1.0, color=colours[i % len(colours)],
                linestyle="--" if label in dashed else "-")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
