"""Does ``run_digits`` read what a real run keeps? (issue 55, items 1-2)

For each model and format, the model is cast to the format and analysed at the operator level
(N = 3, random rounding, the defaults; ``format="auto"``: each operator in its dtype in the
program, as the real run computes it); then the captured graph is run for real in the format
(PyTorch's own kernels, round-to-nearest) and in fp64 on the same (low-precision) weights and
inputs, every node's value kept. Per analysed operator, the avg true digits of the real run's
output against fp64 (:func:`fxstab.numerics.digits.true_digits`, capped at the format's
digits) are set beside the map's ``run_digits`` (the estimate) and ``avg_digits`` (CESTAC's
95% bound). The outputs are the operators the graph returns.

Targets (docs/digit-maps.md): over every operator of every model, mean (run - true) within
+-0.15 and |run - true| <= 0.5 for >= 90% of the operators; per model the same mean within
+-0.15.

    .venv/bin/python benchmarks/exp_calibration.py                  # every model, bf16 and fp16
    .venv/bin/python benchmarks/exp_calibration.py --models mlp,gpt2 --formats bf16
    .venv/bin/python benchmarks/exp_calibration.py --full           # adds the 1.1B shape (2 layers)
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import save_json  # noqa: E402

import fxstab  # noqa: E402
from fxstab.numerics.digits import true_digits  # noqa: E402
from fxstab.numerics.formats import get_format, torch_dtype_of  # noqa: E402

TARGET_MEAN = 0.15  # |mean(run - true)| over the operators
TARGET_CLOSE = 0.5  # |run - true| per operator ...
TARGET_SHARE = 0.9  # ... for at least this share of them


# ============================================================================= the models
def _hf(name: str, **cfg: Any) -> Callable[[], tuple]:
    """A Hugging Face model of a tiny config (random weights, eager attention) returning its
    first output, on token ids [2, 32]."""
    def build() -> tuple:
        import transformers

        torch.manual_seed(0)
        config = getattr(transformers, name + "Config")(attn_implementation="eager", **cfg)
        auto = transformers.AutoModelForCausalLM if cfg.pop("_causal", True) else \
            transformers.AutoModel
        model = auto.from_config(config).eval()
        ids = torch.randint(0, config.vocab_size, (2, 32),
                            generator=torch.Generator().manual_seed(0))
        return _FirstOutput(model), (ids,)
    return build


class _FirstOutput(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, use_cache=False, return_dict=False)[0] \
            if "use_cache" in self.model.forward.__code__.co_varnames else \
            self.model(ids, return_dict=False)[0]


def _llm(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int,
         seq: int) -> Callable[[], tuple]:
    def build() -> tuple:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                          num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                          max_position_embeddings=max(seq, 64), attn_implementation="eager")
        model = LlamaForCausalLM(cfg).eval()
        ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
        return _FirstOutput(model), (ids,)
    return build


def mlp() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.SiLU(),
                          nn.Linear(256, 64), nn.LayerNorm(64), nn.Linear(64, 10),
                          nn.LogSoftmax(-1))
    return model, (torch.randn(32, 64),)


class _CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AvgPool2d(2))
        self.head = nn.Linear(32 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.head(self.body(x).flatten(1)), -1)


def cnn() -> tuple:
    torch.manual_seed(0)
    model = _CNN().eval()
    with torch.no_grad():  # running statistics of a trained net, not the identity
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(8, 1, 28, 28),)


class _MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.tok = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.ch = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.ch(self.n2(x))


class _Mixer(nn.Module):
    def __init__(self, tokens: int = 16, dim: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.patch = nn.Linear(49, dim)
        self.blocks = nn.Sequential(*[_MixerBlock(tokens, dim) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unfold(2, 7, 7).unfold(3, 7, 7).reshape(x.shape[0], 16, 49)
        return self.head(self.norm(self.blocks(self.patch(x))).mean(1))


def mixer() -> tuple:
    torch.manual_seed(0)
    return _Mixer().eval(), (torch.randn(8, 1, 28, 28),)


_TINY = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128)
MODELS: dict[str, Callable[[], tuple]] = {
    "mlp": mlp,
    "cnn": cnn,
    "mixer": mixer,
    "gpt2": _hf("GPT2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64),
    "llama": _hf("Llama", num_key_value_heads=2, max_position_embeddings=64, **_TINY),
    "qwen2": _hf("Qwen2", num_key_value_heads=2, max_position_embeddings=64, **_TINY),
    "opt": _hf("OPT", vocab_size=256, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, ffn_dim=128, max_position_embeddings=64,
               word_embed_proj_dim=64),
    "phi": _hf("Phi", max_position_embeddings=64, **_TINY),
    "bert": _hf("Bert", _causal=False, max_position_embeddings=64, **_TINY),
    "roberta": _hf("Roberta", _causal=False, max_position_embeddings=66, pad_token_id=1,
                   **_TINY),
}
FULL: dict[str, Callable[[], tuple]] = {
    # the 1.1B Llama shape (issue 46), two of its layers, one sequence of 128
    "llama-1.1b-2l": _llm(2, 2048, 5632, 32, 4, 32000, 128),
}


# ============================================================================= the real run
def _cast(v: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                           and t.is_floating_point() else t, v)


class _Recorder(torch.fx.Interpreter):
    """The graph run node by node, every node's value kept; with ``wide``, in fp64: floating
    arguments widened and every dtype argument of the low format (or fp32) read as fp64."""

    def __init__(self, gm: torch.fx.GraphModule, low: torch.dtype, wide: bool) -> None:
        super().__init__(gm)
        self.low, self.wide, self.values = low, wide, {}

    def run_node(self, n: torch.fx.Node) -> Any:
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if self.wide:
                def widen(v: Any) -> Any:
                    if isinstance(v, torch.dtype) and v in (self.low, torch.float32):
                        return torch.float64
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and \
                            v.dtype != torch.float64:
                        return v.double()
                    return v
                args, kwargs = pytree.tree_map(widen, (args, kwargs))
            out = getattr(self, n.op)(n.target, args, kwargs)
        if isinstance(out, torch.Tensor):
            self.values[n.name] = out.detach()
        return out


def calibrate(name: str, build: Callable[[], tuple], fmt: str, seed: int = 0,
              kernels: str = "auto", analysis: str = "auto") -> dict:
    """One model in one format: per analysed operator, the map's run and avg digits and the
    real run's true digits."""
    low = torch_dtype_of(fmt)
    model, inputs = build()
    model = copy.deepcopy(model).to(low).eval()
    xs = _cast(inputs, low)
    be = fxstab.backend(granularity="op", format=fmt if analysis == "same" else analysis,
                        seed=seed, kernels=kernels)
    graphs: list = []

    def capture(gm: torch.fx.GraphModule, example: list) -> Callable:
        compiled = be(gm, example)

        def run(*args: Any) -> Any:
            graphs.append((gm, args))
            return compiled(*args)
        return run

    torch._dynamo.reset()
    t0 = time.time()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(model, backend=capture)(*xs)
        dm = be.digit_map()
    seconds = time.time() - t0
    names = {}
    for g in be.graphs:
        names[id(g.gm)] = {p.node.name: p.name for p in g.plans if p.name}
    ops, outputs = [], set()
    with torch.no_grad():
        for gm, args in graphs:
            real = _Recorder(gm, low, wide=False)
            real.run(*args)
            ref = _Recorder(gm, low, wide=True)
            ref.run(*args)
            out_node = next(n for n in gm.graph.nodes if n.op == "output")
            analysed = names.get(id(gm), {})
            returned = _feeding(out_node, analysed)
            for node, op_name in analysed.items():
                if op_name not in dm.operators or node not in real.values:
                    continue
                y, r = real.values[node], ref.values.get(node)
                if r is None or not y.is_floating_point() or y.numel() == 0 or \
                        y.shape != r.shape:
                    continue
                op = dm.operators[op_name]
                true = float(true_digits(y, r, dm.cap_of(op)).mean())
                ops.append({"operator": op_name, "kind": op.kind, "numel": y.numel(),
                            "true": true, "run": op.run_digits, "avg": op.avg_digits})
                if node in returned:
                    outputs.add(op_name)
    for o in ops:
        o["output"] = o["operator"] in outputs
    return {"model": name, "format": fmt, "operators": ops, "analysis_seconds": seconds,
            **summary(ops)}


def calibrate_float8(recipe: str, seed: int = 0) -> dict:
    """A torchao float8 training MLP (bf16, its linears converted with ``recipe``: e4m3
    operands, torchao's fp32 emulation of the scaled GEMM) analysed with ``format="auto"``; the
    truth of each module's output is the unconverted model's in fp64, on the same (bf16)
    weights: what the float8 program approximates. Per module, its last analysed operator."""
    import dataclasses

    import torchao.float8 as f8

    torch.manual_seed(seed)
    ref = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    model = copy.deepcopy(ref).to(torch.bfloat16)
    config = dataclasses.replace(f8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    f8.convert_to_float8_training(model, config=config)
    x = torch.randn(32, 64).to(torch.bfloat16)
    be = fxstab.backend(granularity="op", format="auto", seed=seed)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(model, backend=be)(x)
        dm = be.digit_map()
        exact = _module_outputs(ref.to(torch.bfloat16).double(), x.double())
        real = _module_outputs(model, x)
    last: dict = {}
    for op in dm.operators.values():
        last[op.module_path] = op
    ops = []
    for path, op in last.items():
        if path in real:
            true = float(true_digits(real[path], exact[path], dm.cap_of(op)).mean())
            ops.append({"operator": op.name, "kind": op.kind, "numel": op.numel, "true": true,
                        "run": op.run_digits, "avg": op.avg_digits,
                        "output": path == str(len(ref) - 1)})
    return {"model": f"torchao-f8-{recipe}", "format": "e4m3", "operators": ops,
            "analysis_seconds": math.nan, **summary(ops)}


def _module_outputs(model: nn.Sequential, x: torch.Tensor) -> dict:
    """The output of each child of ``model`` (by its index, the map's module path)."""
    out = {}
    for i, child in enumerate(model):
        x = child(x)
        out[str(i)] = x.detach()
    return out


def _feeding(out_node: torch.fx.Node, analysed: dict) -> set:
    """The analysed nodes whose values the graph returns, through views and other operators
    the analysis does not record."""
    found, seen = set(), set()
    pending = [a for a in pytree.tree_leaves(out_node.args) if isinstance(a, torch.fx.Node)]
    while pending:
        n = pending.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if n.name in analysed:
            found.add(n.name)
        else:
            pending += n.all_input_nodes
    return found


def summary(ops: Sequence[dict]) -> dict:
    """The calibration figures of a set of operators."""
    if not ops:
        return {"n": 0}
    d = [o["run"] - o["true"] for o in ops]
    b = [o["avg"] - o["true"] for o in ops]
    outs = [o for o in ops if o.get("output")]
    return {"n": len(ops), "mean_run_minus_true": sum(d) / len(d),
            "mean_abs": sum(abs(x) for x in d) / len(d),
            "share_within": sum(abs(x) <= TARGET_CLOSE for x in d) / len(d),
            "worst": max(d, key=abs), "mean_avg_minus_true": sum(b) / len(b),
            "spearman_run": _spearman([o["run"] for o in ops], [o["true"] for o in ops]),
            "outputs_run": _mean(o["run"] for o in outs),
            "outputs_avg": _mean(o["avg"] for o in outs),
            "outputs_true": _mean(o["true"] for o in outs)}


def _mean(values: Any) -> float:
    v = list(values)
    return sum(v) / len(v) if v else math.nan


def _spearman(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) < 3:
        return math.nan
    ra, rb = (torch.tensor(x, dtype=torch.float64).argsort().argsort().double() for x in (a, b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / den if den else math.nan


# ============================================================================= reporting
def table(rows: Sequence[dict]) -> str:
    head = (f"{'model':<22} {'fmt':<4} {'ops':>4} | {'run-true':>8} {'|run-true|':>10} "
            f"{'<=0.5':>6} {'worst':>6} {'rho':>5} | {'avg-true':>8} | "
            f"{'out run':>7} {'out avg':>7} {'out true':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if not r["n"]:
            lines.append(f"{r['model']:<22} {r['format']:<4}    0 (no operator analysed)")
            continue
        lines.append(
            f"{r['model']:<22} {r['format']:<4} {r['n']:>4} | {r['mean_run_minus_true']:>+8.3f} "
            f"{r['mean_abs']:>10.3f} {100 * r['share_within']:>5.0f}% {r['worst']:>+6.2f} "
            f"{r['spearman_run']:>5.2f} | {r['mean_avg_minus_true']:>+8.3f} | "
            f"{r['outputs_run']:>7.2f} {r['outputs_avg']:>7.2f} {r['outputs_true']:>8.2f}")
    everything = summary([o for r in rows for o in r["operators"]])
    if everything["n"]:
        lines.append("-" * len(head))
        lines.append(
            f"{'all':<22} {'':<4} {everything['n']:>4} | "
            f"{everything['mean_run_minus_true']:>+8.3f} {everything['mean_abs']:>10.3f} "
            f"{100 * everything['share_within']:>5.0f}% {everything['worst']:>+6.2f} "
            f"{everything['spearman_run']:>5.2f} | {everything['mean_avg_minus_true']:>+8.3f} |")
    lines.append("run: the map's run_digits (expected digits of a round-to-nearest run); avg: "
                 "CESTAC's avg digits (the 95% bound); true: the real run's avg true digits "
                 "against fp64; rho: Spearman of run against true over the operators; out: "
                 "the operators the graph returns")
    return "\n".join(lines)


def by_kind(rows: Sequence[dict]) -> str:
    """mean(run - true) per kind of operator over every model: where the model of the run
    misses, if anywhere."""
    kinds: dict = {}
    for r in rows:
        for o in r["operators"]:
            kinds.setdefault(o["kind"], []).append(o["run"] - o["true"])
    lines = [f"{'kind':<24} {'ops':>4} {'mean':>7} {'worst':>7}"]
    for k, d in sorted(kinds.items(), key=lambda kv: -abs(sum(kv[1]) / len(kv[1]))):
        lines.append(f"{k:<24} {len(d):>4} {sum(d) / len(d):>+7.3f} {max(d, key=abs):>+7.2f}")
    return "\n".join(lines)


def checks(rows: Sequence[dict]) -> list[str]:
    bad = []
    for r in rows:
        if not r["n"]:
            bad.append(f"{r['model']} {r['format']}: no operator analysed")
        elif abs(r["mean_run_minus_true"]) > TARGET_MEAN:
            bad.append(f"{r['model']} {r['format']}: mean run - true "
                       f"{r['mean_run_minus_true']:+.3f} beyond +-{TARGET_MEAN}")
    everything = summary([o for r in rows for o in r["operators"]])
    if everything["n"]:
        if abs(everything["mean_run_minus_true"]) > TARGET_MEAN:
            bad.append(f"all: mean run - true {everything['mean_run_minus_true']:+.3f}")
        if everything["share_within"] < TARGET_SHARE:
            bad.append(f"all: {100 * everything['share_within']:.0f}% of the operators within "
                       f"{TARGET_CLOSE} (target {100 * TARGET_SHARE:.0f}%)")
    return bad


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated models")
    p.add_argument("--formats", default="bf16,fp16", help="comma-separated formats")
    p.add_argument("--full", action="store_true", help="add " + ", ".join(FULL))
    p.add_argument("--float8", default="tensorwise,rowwise",
                   help="torchao float8 recipes of the MLP case ('' for none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernels", default="auto", help="the analysis's kernels (auto, torch)")
    p.add_argument("--analysis-format", default="auto", choices=("auto", "same"),
                   help="the analysis's format: auto (each operator in its dtype in the "
                        "program, as the real run computes it: the program's fp32 islands, "
                        "such as HF Llama's rotary angles, stay fp32; default) or same (every "
                        "operator rounded into the run's format)")
    p.add_argument("--out", default="results/calibration", help="folder of calibration.json")
    a = p.parse_args(argv)
    known = {**MODELS, **FULL}
    names = [m for m in a.models.split(",") if m] + (list(FULL) if a.full else [])
    unknown = [m for m in names if m not in known]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {', '.join(known)}")
    formats = [f for f in a.formats.split(",") if f]
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    t0 = time.time()
    rows = []
    for name in names:
        for fmt in formats:
            rows.append(calibrate(name, known[name], fmt, a.seed, a.kernels,
                                  a.analysis_format))
            r = rows[-1]
            print(f"[{time.time() - t0:.0f} s] {name} {fmt}: {r['n']} operators, "
                  f"run - true {r.get('mean_run_minus_true', math.nan):+.3f}", flush=True)
    for recipe in [r for r in a.float8.split(",") if r]:
        rows.append(calibrate_float8(recipe, a.seed))
        print(f"[{time.time() - t0:.0f} s] torchao float8 {recipe}: {rows[-1]['n']} operators",
              flush=True)
    print(table(rows))
    print()
    print(by_kind(rows))
    bad = checks(rows)
    print("\ncriteria: " + ("all hold" if not bad else "FAILED\n  " + "\n  ".join(bad)))
    path = save_json(Path(a.out) / "calibration.json", {
        "experiment": "exp_calibration", "seconds": time.time() - t0, "seed": a.seed,
        "criteria_failures": bad, "rows": rows})
    print(f"\n{time.time() - t0:.0f} s; wrote {path}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
