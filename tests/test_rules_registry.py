"""The rules as tables (issue 40): the operator level's OP_RULES, the aten batchers, one config
for both levels, one kernel choice; the tracers look rules up instead of chaining over kinds."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch
import torch.nn as nn

import fxstab
from fxstab.config import AnalysisConfig
from fxstab.records.report import ROUNDED
from fxstab.rules.aten import batching
from fxstab.rules.aten.context import AtenContext
from fxstab.rules.lifting import Stacked
from fxstab.rules.op import registry
from fxstab.rules.op import tracer as op_tracer
from fxstab.rules.aten import tracer as aten_tracer
from models import MLP


def test_each_kind_finds_its_rules_in_one_lookup():
    names = lambda kind: [r.name for r in registry.rules_for(kind)]  # noqa: E731
    assert names("linear") == ["modelled", "batched"]
    assert names("scaled_dot_product_attention") == ["modelled", "batched"]
    assert names("dropout") == ["identity", "mask_dropout"]
    assert names("alpha_dropout") == ["random_draws", "identity"]
    assert names("batch_norm") == ["batch_statistics"] and names("lstm") == ["recurrent"]
    assert names("relu") == ["elementwise"] and names("getitem") == ["tuple_item"]
    assert names("size") == ["metadata"] and names("float") == ["floating_cast"]
    assert names("softmax") == []  # the default alone
    assert not registry.rules_for("rand")[0].samples  # asked with plain operands too
    text = registry.describe("softmax")
    assert text.startswith("default: lifted") and "vmap" in text
    assert "mask on every sample" in registry.describe("dropout")
    with pytest.raises(ValueError, match="at least one operator kind"):
        registry.op_rule()


def _kind_tests(cls) -> list:
    """Comparisons of a ``kind`` name or attribute with a string or a set inside a class's
    methods: an if/elif chain over kinds."""
    tree = ast.parse(inspect.getsource(cls))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            left = node.left
            name = left.id if isinstance(left, ast.Name) else \
                left.attr if isinstance(left, ast.Attribute) else ""
            if name == "kind":
                found.append(ast.unparse(node))
    return found


def test_no_chain_over_kinds_remains_in_the_tracers():
    assert _kind_tests(op_tracer.SampleTracer) == []
    assert _kind_tests(aten_tracer.AtenTracer) == []
    assert "_special" not in vars(batching)  # the aten batchers are a table
    assert {"mm", "bmm", "matmul", "addmm", "view", "sum", "_softmax", "cumsum",
            "broadcast_in_dim"} <= set(batching.BATCHERS)


def test_the_tracer_runs_what_the_table_says(monkeypatch):
    """A rule registered for a kind is what runs that kind: its outcome and its reason reach
    the coverage and the samples."""
    seen = []

    def doubled(call):
        seen.append(call.plan.kind)
        x = call.leaves[0]
        return registry.Outcome(Stacked(torch.sinh(x.samples) * 2), ROUNDED, "the test's rule")

    rule = registry.OpRule("doubled", doubled, True, "sinh, twice")
    monkeypatch.setitem(registry.OP_RULES, "sinh", (rule,))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.sinh(self.fc(x)) + 1

    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 8)
    be = fxstab.backend(format="fp32", select="*", seed=0)
    with be.capture_samples() as cap:
        y = torch.compile(net, backend=be)(x)
    assert torch.equal(y, net(x))  # the deterministic path is untouched
    assert seen == ["sinh"]
    sinh = next(e for e in be.coverage().entries if e.kind == "sinh")
    assert sinh.reason == "the test's rule"
    expected = 2 * torch.sinh(net.fc(x).double()) + 1
    assert (cap.output.mean(0) - expected).abs().max() < 1e-5 * expected.abs().max()


def test_the_arithmetic_level_takes_its_settings_from_the_one_config():
    cfg = AnalysisConfig(granularity="aten", format="fp16", n_samples=4, seed=3,
                         confidence=0.9, cancel_digits=3.0, data_perturbation_threshold=2.0 ** -6)
    ctx = AtenContext(cfg, round_per_sample=True)
    assert ctx.config is cfg and ctx.fmt.name == "fp16" and ctx.n_samples == 4
    assert ctx.eta == 2.0 ** -6 and ctx.cancel_digits == 3.0 and ctx.round_per_sample
    assert ctx.seed == 3 and ctx.confidence == 0.9
    # no second defaults: the keyword settings left out are the config's
    assert AtenContext.of().config == AnalysisConfig(granularity="aten")
    # the eager driver's keyword settings are validated by the same config (its messages)
    assert AtenContext.of(format="bf16").eta == 2.0 ** -8
    for bad, match in (({"n_samples": 1}, "n_samples"), ({"kernels": "os"}, "kernels"),
                       ({"confidence": 2.0}, "confidence"),
                       ({"data_perturbation_threshold": 0.3}, "power of two")):
        with pytest.raises(ValueError, match=match):
            AtenContext.of(format="fp32", **bad)
        with pytest.raises(ValueError, match=match):
            AnalysisConfig(granularity="aten", **bad)


def _surrogate_digits(eta):
    """The digits of a GEMM whose operand samples are identical (the surrogate fires) at the
    arithmetic level with threshold ``eta``."""
    torch.manual_seed(0)
    fc = nn.Linear(64, 16)
    be = fxstab.backend(granularity="aten", format="fp32", seed=0,
                        data_perturbation_threshold=eta)
    torch.compile(fc, backend=be)(torch.randn(8, 64))
    gemm = [r for r in be.reports if r.surrogate]
    assert gemm, [r.name for r in be.reports]
    return gemm[0].avg_digits


def test_the_arithmetic_level_honours_data_perturbation_threshold():
    """It was silently ignored at granularity='aten' (the format's unit roundoff hard-coded):
    a larger threshold perturbs more, so the GEMM keeps fewer digits."""
    torch._dynamo.reset()
    fine = _surrogate_digits(2.0 ** -24)
    torch._dynamo.reset()
    coarse = _surrogate_digits(2.0 ** -10)
    assert coarse < fine - 2  # ~14 bits more noise: ~4 digits fewer


def test_models_analyse_the_same_through_the_tables():
    """The MLP's map is the same whether the rules run untraced or traced (the table is read
    at trace time only)."""
    torch.manual_seed(0)
    m, x = MLP(), torch.randn(4, 16)
    be = fxstab.backend(seed=0)
    f = torch.compile(m, backend=be)
    for _ in range(3):
        f(x)
    by_call = {}
    for r in be.reports:
        by_call.setdefault(r.call, []).append((r.name, r.avg_digits))
    assert len(by_call) == 3
    assert [n for n, _ in by_call[0]] == [n for n, _ in by_call[1]] == [n for n, _ in by_call[2]]
