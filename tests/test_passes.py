"""The compiled stochastic path (fxstab/passes): each pass alone, then the sampled graph
against the same rules run untraced, on the test models."""

from __future__ import annotations

import operator
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import fxstab
from fxstab.passes import (DirectBindings, DropDetach, EliminateDeadCode, LowerSteps, Step, emit,
                           is_step, tracing)
from fxstab.passes import steps as steps_mod
from fxstab.passes.steps import lowered

from models import (CNN, GPT, GPT2, MLP, CancellingLinear, DropoutMLP, NaiveSoftmax,
                    RecurrentStack, SpectralFilter, T5RelativeBias)


# --------------------------------------------------------------------------- the passes alone
def _double(xs):
    return [xs[0] * 2]


def test_a_step_is_one_opaque_node_and_lowers_to_a_direct_call():
    calls = []

    def body(xs):
        calls.append(len(xs))
        return [torch.exp(xs[0]) + xs[1]]  # not traced: inside the step

    def fn(x, y):
        return emit(Step("round", "fc/linear#0", body), [x + 1, y])[0].sum()

    x, y = torch.randn(4), torch.randn(4)
    with tracing():
        gm = make_fx(fn)(x, y)
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert sum(is_step(n) for n in gm.graph.nodes) == 1
        assert torch.ops.aten.exp.default not in targets  # the step's insides stay opaque
        assert LowerSteps()(gm).modified
    assert steps_mod.registered() == 0  # nothing kept by the registry once lowered
    step = next(n for n in gm.graph.nodes if lowered(n) is not None)
    assert step.name.startswith("round_fc_linear_0")
    assert "round_fc_linear_0" in gm.code
    calls.clear()
    want = (torch.exp(x + 1) + y).sum()
    assert torch.equal(gm(x, y), want) and calls == [2]


def test_a_single_output_step_lowers_to_its_output_itself():
    """A step with ``one`` (its output itself) whose readers take output 0 lowers without the
    list and the getitem node; a step with more outputs keeps both."""
    from fxstab.passes.steps import returns_one

    def one(xs):
        return xs[0] * 2

    def fn(x):
        a = emit(Step("round", "a", lambda xs: [one(xs)], one=one), [x + 1])[0]
        b = emit(Step("round", "b", lambda xs: [one(xs), xs[0] * 3], one=one), [a])
        return a + b[0] + b[1]

    x = torch.randn(3)
    with tracing():
        gm = make_fx(fn)(x)
        LowerSteps()(gm)
    nodes = [n for n in gm.graph.nodes if lowered(n) is not None]
    assert [returns_one(n) for n in nodes] == [True, False]
    assert all(u.target is not operator.getitem for u in nodes[0].users)
    assert torch.equal(gm(x), fn(x))


def test_without_tracing_a_step_runs_directly():
    assert torch.equal(emit(Step("round", "a", _double), [torch.ones(2)])[0], torch.full((2,), 2.))


def test_dead_code_goes_and_steps_stay_even_unused():
    def fn(x):
        dead = torch.sin(x)  # noqa: F841 - abandoned by a rule
        emit(Step("round", "kept", _double), [x])  # result unused: it records, so it stays
        return x + 1

    with tracing():
        gm = make_fx(fn)(torch.randn(3))
        assert EliminateDeadCode()(gm).modified
        kinds = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert torch.ops.aten.sin.default not in kinds
        assert sum(is_step(n) for n in gm.graph.nodes) == 1
        LowerSteps()(gm)


def test_a_step_that_raised_while_traced_is_removed():
    def failing(xs):
        raise RuntimeError("no batching rule")

    def fn(x):
        try:
            emit(Step("per_sample", "op", failing), [x])
        except RuntimeError:
            pass  # the rule does otherwise
        return emit(Step("round", "op", _double), [x])[0]

    with tracing():
        gm = make_fx(fn)(torch.randn(3))
        EliminateDeadCode()(gm)
        LowerSteps()(gm)
    names = [lowered(n).__name__ for n in gm.graph.nodes if lowered(n) is not None]
    assert names == ["round_op"]
    assert steps_mod.registered() == 0


def test_drop_detach_alone():
    gm = make_fx(lambda x: x.detach() * 2)(torch.randn(3))
    assert any(n.target is torch.ops.aten.detach.default for n in gm.graph.nodes)
    assert DropDetach()(gm).modified
    assert not any(n.target is torch.ops.aten.detach.default for n in gm.graph.nodes)
    x = torch.randn(3)
    assert torch.equal(gm(x), x * 2)


def _bound(gm: torch.fx.GraphModule) -> dict:
    """node name -> what it calls (an OpOverload or a binding)."""
    return {n.name: n.target for n in gm.graph.nodes if n.op == "call_function"}


def test_direct_bindings_alone_call_the_same_overloads_bit_for_bit():
    """Elementwise, scalar, view, reduction, GEMM and normalisation calls move to torch's
    bindings; in-place, random and factory calls keep their overloads, and so does an overload
    that the binding would not pick (add.Scalar: torch.add takes add.Tensor); the outputs are
    the same bits."""
    A = torch.ops.aten

    def fn(x, w, b):
        y = A.tanh.default(A.add.Tensor(A.mul.Tensor(x, 1.01), 0.1))
        z = A.addmm.default(b, A.view.default(y, [12, 8]), A.t.default(w))
        z = A.native_layer_norm.default(z, [5], None, None, 1e-5)[0]
        s = A.sum.dim_IntList(A.transpose.int(A.view.default(z, [3, 4, 5]), 0, 1), [1], True)
        r = A.add.Scalar(s, 2.5)
        noise = A.rand_like.default(r)
        out = A.div.Tensor(r, A.exp.default(A.neg.default(r)))
        out = A.add_.Tensor(out, noise)
        return [out, A.zeros.default([2]), A._softmax.default(z, -1, False)]

    x, w, b = torch.randn(3, 4, 8), torch.randn(5, 8), torch.randn(5)
    gm = make_fx(fn)(x, w, b)
    before = _bound(gm)
    assert DirectBindings()(gm).modified
    after = _bound(gm)
    moved = {k for k in after if after[k] is not before[k]}
    kinds = {str(before[k]).split(".")[1] for k in moved}
    assert {"tanh", "add", "mul", "addmm", "view", "t", "native_layer_norm", "sum", "transpose",
            "div", "exp", "neg", "_softmax"} <= kinds, kinds
    for k in after:
        op = before[k]
        if op in (torch.ops.aten.add_.Tensor, torch.ops.aten.rand_like.default,
                  torch.ops.aten.zeros.default, torch.ops.aten.add.Scalar):
            assert after[k] is op, k
        if k in moved:  # a binding, not an overload
            assert not isinstance(after[k], torch._ops.OpOverload)
    assert "torch.tanh(" in gm.code and "torch.ops.aten.add_.Tensor(" in gm.code
    ref = make_fx(fn)(x, w, b)
    torch.manual_seed(1)
    want = ref(x, w, b)
    torch.manual_seed(1)
    got = gm(x, w, b)
    for a, c in zip(want, got):
        assert a.dtype == c.dtype and a.stride() == c.stride()
        assert torch.equal(a, c)


def test_a_graph_fed_a_tensor_subclass_keeps_its_overloads():
    """torch's bindings would call a subclass's __torch_function__ again (the trace already ran
    through it): such a graph keeps its OpOverloads; a plain input's graph calls bindings."""

    class Tagged(torch.Tensor):
        pass

    codes = []
    for x in (torch.randn(4, 8).as_subclass(Tagged), torch.randn(4, 8)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        be = fxstab.backend()
        f = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), backend=be)
        with torch.no_grad():
            for _ in range(3):
                f(x)
        codes.append(be.sampled_graphs()[0].code)
    assert "torch.ops.aten.addmm.default(" in codes[0] and "torch.addmm(" not in codes[0]
    assert "torch.addmm(" in codes[1] and "torch.ops.aten.addmm" not in codes[1]


# --------------------------------------------------------------------------- the sampled graph
def _compiled(model, *inputs, calls=3, **options):
    be = fxstab.backend(**options)
    f = torch.compile(model, backend=be)
    outs = []
    for _ in range(calls):
        torch.manual_seed(5)
        outs.append(f(*inputs))
    return be, outs


def _runs(model, inputs, granularity="op", untraced=False, monkeypatch=None, calls=3,
          **options):
    """``calls`` analysed calls on a copy of ``model`` (BatchNorm's running statistics move),
    with every instability event kept; ``untraced``: the same rules run directly on every call
    (every trace refused: the fallback path, what the stochastic path was before it was
    compiled)."""
    import copy

    from fxstab.analysis.sampled_graph import SampledGraph

    if untraced:
        def refuse(*a, **k):
            raise RuntimeError("not traced, for the comparison")
        monkeypatch.setattr(SampledGraph, "trace", refuse)
    torch._dynamo.reset()
    be = fxstab.backend(granularity=granularity, **options)
    f = torch.compile(copy.deepcopy(model), backend=be)
    outs = []
    with fxstab.instability_counters("detailed") as counters, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(calls):
            torch.manual_seed(5)
            outs.append(f(*inputs))
    if untraced:
        monkeypatch.undo()
    return be, outs, counters


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _check_same_runs(model, inputs, granularity, monkeypatch, **options):
    """The sampled graph against its rules run untraced, call for call: every field of every
    report, every instability event, the deterministic outputs."""
    be_c, out_c, cnt_c = _runs(model, inputs, granularity, **options)
    be_u, out_u, cnt_u = _runs(model, inputs, granularity, untraced=True,
                               monkeypatch=monkeypatch, **options)
    assert not any(g.info.failures for g in be_c.graphs + be_u.graphs)
    assert all(g.sampled.traces == 1 for g in be_c.graphs)  # untraced, traced, replayed
    assert not any(g.info.untraced for g in be_c.graphs)
    assert all(g.info.untraced for g in be_u.graphs)
    assert len(be_c.reports) == len(be_u.reports) > 0
    for a, b in zip(be_c.reports, be_u.reports):
        assert _same(a.as_dict(), b.as_dict()), (a.name, a.call)
    assert be_c.digit_map().difference(be_u.digit_map()) == 0.0
    assert cnt_c.counts == cnt_u.counts
    assert [e.as_dict() for e in cnt_c.events] == [e.as_dict() for e in cnt_u.events]
    for a, b in zip(torch.utils._pytree.tree_leaves(out_c), torch.utils._pytree.tree_leaves(out_u)):
        assert torch.equal(a, b)  # and the deterministic outputs are the model's


CASES = {
    "mlp": (lambda: MLP(), lambda: (torch.randn(16, 16),), {}),
    "cnn-train": (lambda: CNN().train(), lambda: (torch.randn(4, 3, 12, 12),), {}),
    "gpt-train": (lambda: GPT().train(), lambda: (torch.randint(0, 50, (2, 16)),), {}),
    "gpt2": (lambda: GPT2(layers=1).eval(), lambda: (torch.randint(0, 256, (2, 32)),), {}),
    "gpt2-fp16-train": (lambda: GPT2(layers=1).train(), lambda: (torch.randint(0, 256, (2, 32)),),
                        {"format": "fp16"}),
    "dropout-mlp": (lambda: DropoutMLP().train(), lambda: (torch.randn(64, 16),), {}),
    "t5-bias": (lambda: T5RelativeBias(), lambda: (torch.randn(2, 16, 8),), {}),
    "lstm-dropout": (lambda: RecurrentStack(nn.LSTM, dropout=0.3).train(),
                     lambda: (torch.randn(4, 6, 8),), {}),
    "complex": (lambda: SpectralFilter(), lambda: (torch.randn(3, 16),), {"select": "*"}),
    "mlp-fp32-torch": (lambda: MLP(), lambda: (torch.randn(16, 16),),
                       {"format": "fp32", "kernels": "torch"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_graph_gives_the_reports_of_the_untraced_rules(case, monkeypatch):
    make_model, make_inputs, options = CASES[case]
    torch.manual_seed(0)
    _check_same_runs(make_model(), make_inputs(), "op", monkeypatch, **options)


def test_a_new_signature_is_traced_and_the_old_one_replayed():
    torch._dynamo.reset()
    be = fxstab.backend()
    f = torch.compile(MLP(), backend=be, dynamic=True)  # one graph for every batch size
    f(torch.randn(8, 16))
    assert [g.sampled.traces for g in be.graphs] == [0]  # first sight: untraced
    f(torch.randn(8, 16))
    assert [g.sampled.traces for g in be.graphs] == [1]
    f(torch.randn(12, 16))
    assert [g.sampled.traces for g in be.graphs] == [1]
    f(torch.randn(12, 16))
    assert [g.sampled.traces for g in be.graphs] == [2]
    f(torch.randn(8, 16))
    assert [g.sampled.traces for g in be.graphs] == [2]
    for rows in (13, 14, 15):  # shapes that never come back cost no trace
        f(torch.randn(rows, 16))
    assert [g.sampled.traces for g in be.graphs] == [2]
    assert len(be.reports) == 8 * 5
    assert {r.shape for r in be.reports if r.name == "head/linear#0"} == \
        {(8, 4), (12, 4), (13, 4), (14, 4), (15, 4)}


def test_replayed_reports_hold_every_field_and_their_own_call():
    """Reports of a replayed call are built from per-operator templates: each must still hold
    every OpReport field, the call's own phase, step and call index, and a counters dict of
    its own."""
    import dataclasses

    from fxstab.records.report import OpReport

    be = fxstab.backend()
    f = torch.compile(MLP(), backend=be)
    x = torch.randn(8, 16)
    f(x)
    with be.phase("train", step=7):
        f(x)
    names = {fl.name for fl in dataclasses.fields(OpReport)}
    first, second = be.reports[:5], be.reports[5:]
    assert len(second) == 5
    for a, b in zip(first, second):
        assert all(hasattr(b, k) and hasattr(a, k) for k in names)
        assert (a.name, a.kind, a.module_path, a.shape, a.format) == \
            (b.name, b.kind, b.module_path, b.shape, b.format)
        assert (b.phase, b.step, b.call) == ("train", 7, 1) and a.call == 0
        assert b.counters == a.counters and b.counters is not a.counters
        assert b.as_dict()["name"] == b.name
    assert {r.surrogate for r in second if r.kind == "linear"} == {True}


def test_the_generated_graph_can_be_printed():
    be = fxstab.backend()
    f = torch.compile(MLP(), backend=be)
    x = torch.randn(8, 16)
    f(x)
    assert be.sampled_graphs() == []  # traced on the second call with these shapes
    f(x)
    sg = be.sampled_graphs()[0]
    code = sg.code
    for name in ("round_fc1_linear_0", "perturb_fc1_linear_0", "addmm", "gelu"):
        assert name in code, code
    assert "fxstab_step" not in code  # every step lowered to a direct call
    assert 0 < sg.n_nodes < 80


def test_a_trace_notes_its_values_as_meta_tensors():
    """The trace's values are noted as meta tensors (shape, strides, dtype: what the passes
    read), not fake snapshots, which cost ~100x more per value (issue 52, item 4); the torch
    hook it wraps exists in this torch (otherwise the trace would quietly note fake values)."""
    from torch.fx.experimental import proxy_tensor

    assert callable(getattr(proxy_tensor, "extract_val", None))
    before = proxy_tensor.extract_val
    be = fxstab.backend()
    f = torch.compile(MLP(), backend=be)
    x = torch.randn(8, 16)
    f(x)
    f(x)
    assert proxy_tensor.extract_val is before  # put back after the trace
    vals = [n.meta.get("val") for n in be.sampled_graphs()[0].gm.graph.nodes]
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    assert tensors and all(v.device.type == "meta" for v in tensors)
    assert any(tuple(v.shape) == (3, 8, 32) for v in tensors)  # N samples of fc1's output


def test_an_untraceable_graph_runs_its_rules_untraced_with_a_warning():
    class DataDependent(nn.Module):
        def forward(self, x):
            return F.gelu(x) * x.abs().max().item()  # a value the trace cannot keep

    torch._dynamo.reset()
    torch._dynamo.config.capture_scalar_outputs = True
    try:
        be = fxstab.backend()
        f = torch.compile(DataDependent(), backend=be)
        x = torch.randn(8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = f(x)
            f(x)
    finally:
        torch._dynamo.config.capture_scalar_outputs = False
        torch._dynamo.reset()
    assert torch.equal(y, DataDependent()(x))
    assert any("could not be traced" in str(w.message) for w in caught)
    assert any(g.info.untraced for g in be.graphs)
    assert not any(g.info.failures for g in be.graphs)
    assert {r.kind for r in be.reports} >= {"gelu"} and len(be.reports) >= 4


def test_replay_keeps_the_rng_stream_and_dropout_masks():
    torch.manual_seed(0)
    m = DropoutMLP().train()
    x = torch.randn(64, 16)
    be = fxstab.backend(output="mean")
    f = torch.compile(m, backend=be)
    for _ in range(3):  # the first call traces, the others replay
        torch.manual_seed(7)
        got = f(x)
        after = torch.rand(3)
        torch.manual_seed(7)
        want = m(x)
        assert torch.equal(after, torch.rand(3))  # the user's next numbers are unchanged
        # the samples used the deterministic pass's masks: their mean is that output, within
        # rounding noise (fresh masks would move it by O(1))
        assert (got - want).abs().max() < 0.1
    assert be.graphs[0].sampled.traces == 1


# --------------------------------------------------------------------------- the arithmetic level
ATEN_CASES = {
    **CASES,  # and what the arithmetic level alone has: counters, fp64 in fp64, comparisons
    "gpt2-detailed": (lambda: GPT2(layers=1).eval(), lambda: (torch.randint(0, 256, (2, 32)),),
                      {"diagnostics": "detailed"}),
    "gpt2-fp64": (lambda: GPT2(layers=1).eval(), lambda: (torch.randint(0, 256, (2, 32)),),
                  {"format": "fp64"}),
    "cancelling-fp32": (lambda: CancellingLinear(), lambda: (torch.randn(8, 16),),
                        {"format": "fp32", "diagnostics": "detailed"}),
    "naive-softmax": (lambda: NaiveSoftmax(), lambda: (torch.randn(4, 8) * 30,), {}),
}


@pytest.mark.parametrize("case", sorted(ATEN_CASES))
def test_aten_sampled_graph_gives_the_reports_and_counters_of_the_untraced_rules(case,
                                                                                 monkeypatch):
    """The arithmetic level's sampled graph against its rules run directly (the interpreter it
    replaced)."""
    make_model, make_inputs, options = ATEN_CASES[case]
    torch.manual_seed(0)
    _check_same_runs(make_model(), make_inputs(), "aten", monkeypatch, **options)


def test_aten_sampled_graph_is_aten_nodes_and_one_step_per_primitive(monkeypatch):
    from fxstab.passes.steps import lowered as lowered_step
    from fxstab.rules.aten import apply

    monkeypatch.setattr(apply, "_BINARY_MIN_BYTES", 0)  # small outputs: fused all the same
    torch._dynamo.reset()
    be = fxstab.backend(granularity="aten")
    f = torch.compile(MLP(), backend=be)
    x = torch.randn(8, 16)
    f(x)
    f(x)
    sg = be.sampled_graphs()[0]
    code = sg.code
    assert "fxstab_step" not in code  # every step lowered to a direct call
    for name in ("perturb_fc1_linear_0_aten_addmm_0", "round_fc1_linear_0_aten_addmm_0",
                 "torch.addmm(", "torch.relu(",  # aten calls through torch's bindings
                 # GELU's products and sum: computed by the kernel inside their rounding
                 "binary_gelu_0_aten_mul_0", "binary_gelu_0_aten_add_0"):
        assert name in code, code
    assert "torch.mul(" not in code and "torch.add(" not in code
    # what reads values is a step; the samples' arithmetic is aten calls between them
    steps_ = [n for n in sg.gm.graph.nodes if lowered_step(n) is not None]
    aten_ = [n for n in sg.gm.graph.nodes if n.op == "call_function" and
             lowered_step(n) is None and n.target is not operator.getitem]
    per_call = len(be.reports) // 2
    assert len(steps_) >= per_call > 0 and len(aten_) >= per_call
    assert {lowered_step(n).what for n in steps_} <= {"round", "binary", "perturb", "lookup",
                                                      "compare", "observe", "random",
                                                      "per_sample"}


class MaskedExp(nn.Module):
    """Boolean-mask indexing: the output's size follows the values (and a cancellation, for the
    counters)."""

    def forward(self, x):
        y = (x + 1e4) - 1e4
        return torch.exp(y[x > 0]).sum() + x.nonzero().shape[0]


def test_refuse_dynamic_shapes_alone():
    from fxstab.passes import RefuseDynamicShapes

    gm = make_fx(lambda x: x[x > 0].sum(), tracing_mode="real")(torch.randn(8))
    with pytest.raises(RuntimeError, match="depends on the values"):
        RefuseDynamicShapes()(gm)
    gather = make_fx(lambda x, i: x[i].sum(), tracing_mode="real")(torch.randn(8),
                                                                   torch.tensor([1, 5]))
    assert not RefuseDynamicShapes()(gather).modified  # integer indices keep their shape


def test_the_pipeline_runs_every_pass_and_names_the_one_that_refused():
    from fxstab.passes import SampledGraphPasses, run_sampled_graph_passes

    assert [type(p).__name__ for p in SampledGraphPasses().passes] == [
        "RefuseDynamicShapes", "EliminateDeadCode", "DropDetach", "LowerSteps", "DirectBindings"]
    assert "DirectBindings" not in [type(p).__name__
                                    for p in SampledGraphPasses(bindings=False).passes]
    gm = make_fx(lambda x: (x.exp() + 1, x.detach().sin())[0], tracing_mode="real")(torch.randn(4))
    before = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    generated = []
    recompile = torch.fx.GraphModule.recompile

    def counted(self):
        generated.append(self)
        return recompile(self)

    torch.fx.GraphModule.recompile = counted
    try:
        run_sampled_graph_passes(gm)
    finally:
        torch.fx.GraphModule.recompile = recompile
    assert generated == [gm]  # the code generated once, after the passes
    after = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.sin.default in before and len(after) == 2  # dead code gone
    assert after == [torch.exp, torch.add]  # torch's own bindings
    x = torch.randn(4)
    assert torch.equal(gm(x), x.exp() + 1)
    masked = make_fx(lambda x: x[x > 0].sum(), tracing_mode="real")(torch.randn(8))
    with pytest.raises(RuntimeError, match="'RefuseDynamicShapes' pass.*depends on the values"):
        run_sampled_graph_passes(masked)


@pytest.mark.parametrize("granularity", ["op", "aten"])
def test_value_dependent_shapes_run_untraced_with_the_shapes_of_each_call(granularity):
    """A sampled graph would keep the traced call's sizes: such a graph runs its rules
    untraced, with a warning, and the reports (and counters) are each call's, once."""
    torch._dynamo.reset()
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    try:
        be = fxstab.backend(granularity=granularity, format="fp32")
        f = torch.compile(MaskedExp(), backend=be)
        want = []
        with warnings.catch_warnings(record=True) as caught, \
                fxstab.instability_counters() as counters:
            warnings.simplefilter("always")
            for seed in range(3):
                torch.manual_seed(seed)
                x = torch.randn(16)
                want.append((int((x > 0).sum()),))
                assert torch.equal(f(x), MaskedExp()(x))
    finally:
        torch._dynamo.config.capture_dynamic_output_shape_ops = False
        torch._dynamo.reset()
    assert want[0] != want[1]  # the sizes do move between these calls
    assert any("could not be traced" in str(w.message) for w in caught)
    assert all(g.info.untraced for g in be.graphs)
    assert not any(g.info.failures for g in be.graphs)
    exps = [r for r in be.reports if r.kind == "exp"]
    assert [r.shape for r in exps] == want and [r.call for r in exps] == [0, 1, 2]
    if granularity == "aten":  # the refused trace's counts are not kept: once per call
        per_call = [sum(r.counters["cancellation"] for r in be.reports if r.call == c)
                    for c in range(3)]
        assert min(per_call) > 0 and counters.counts["cancellation"] == sum(per_call)


def test_aten_views_no_reader_measures_through_are_no_steps():
    """A view whose readers' counters read neither its digits nor its zero mask (a GEMM's
    operand) is a plain aten call of the sampled graph; one whose reader reads its digits (a
    sum's cancellation, fp32) stays a step that carries them. The map is the same either way
    (benchmarks/maps_ab.py compares them on every configuration)."""

    class ViewsThen(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 3))

        def forward(self, x):
            y = torch.exp(x)
            return y.reshape(4, 8) @ self.w, y.reshape(-1).sum()

    torch._dynamo.reset()
    be = fxstab.backend(granularity="aten", format="fp32")
    f = torch.compile(ViewsThen(), backend=be)
    x = torch.randn(2, 16)
    with torch.no_grad():
        for _ in range(3):
            f(x)
    code = be.sampled_graphs()[0].code
    steps_ = re.findall(r"(\w+) = fxstab_round_\w*aten_(?:view|_unsafe_view)_\d+\(", code)
    assert len(steps_) == 1, code  # the sum's operand
    assert "torch_Tensor_view(" in code or "torch.ops.aten.view" in code, code


def test_aten_small_adds_and_products_stay_the_operator_and_its_rounding():
    """Below _BINARY_MIN_BYTES of output samples the operator's result stays in cache until
    the rounding reads it: the operator then its rounding step (computing it in the kernel
    pays only when it would go to memory); above, one binary step."""
    from fxstab.rules.aten import apply

    codes = []
    for n in (16, apply._BINARY_MIN_BYTES // 4 // 3 + 1):
        torch._dynamo.reset()
        be = fxstab.backend(granularity="aten")
        f = torch.compile(lambda x: x * 1.5 + x, backend=be)
        x = torch.randn(n)
        for _ in range(3):
            f(x)
        codes.append(be.sampled_graphs()[0].code)
    # (x * 1.5 of identical samples runs once, before its rounding, at every size)
    assert "fxstab_binary_" not in codes[0] and "torch.add(" in codes[0], codes[0]
    assert codes[1].count("fxstab_binary_") == 1 and "torch.add(" not in codes[1], codes[1]
