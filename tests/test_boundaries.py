"""The typed boundaries between the analyses and the operator level's rules (issue 53, item 4):
what crosses them is named by the class below it, not ``Any``, and the operator level's tracer
provides what its rules may use of it (``registry.Tracer``)."""

from __future__ import annotations

import typing

import torch
import torch.nn as nn

import fxstab
from fxstab.config import AnalysisConfig
from fxstab.records.run import RunState
from fxstab.rules.accumulation import modelled_gemm
from fxstab.rules.lifting import NodePlan, OpGraph
from fxstab.rules.op.registry import OpCall, Tracer
from fxstab.rules.op.tracer import SampleTracer


def test_the_boundaries_name_their_classes():
    assert typing.get_type_hints(OpGraph)["state"] is RunState
    hints = typing.get_type_hints(OpCall)
    assert hints["tracer"] is Tracer and hints["plan"] is NodePlan
    hints = typing.get_type_hints(modelled_gemm)
    assert hints["plan"] is NodePlan and hints["cfg"] is AnalysisConfig


def test_the_tracer_has_what_its_rules_may_use():
    """Every member of ``Tracer`` is on a real tracer of an analysed graph (a rename in the
    tracer that the protocol misses fails here)."""
    torch._dynamo.reset()
    be = fxstab.backend(format="bf16", n_samples=3)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    torch.compile(model, backend=be)(torch.randn(2, 8))
    view = be.state.graphs[0].view
    assert isinstance(view, OpGraph) and isinstance(view.state, RunState)
    tracer = SampleTracer(view, 0)
    members = {name for name in dir(Tracer) if not name.startswith("_")} | \
        set(typing.get_type_hints(Tracer))
    assert members >= {"g", "state", "cfg", "fmt", "wdtype", "n", "acc_errors", "seed",
                       "to_working", "stack", "step", "det_dtype", "wrap_out"}
    missing = [name for name in sorted(members) if not hasattr(tracer, name)]
    assert not missing, missing
    hints = typing.get_type_hints(Tracer)
    for name, cls in hints.items():
        assert isinstance(getattr(tracer, name), cls), (name, type(getattr(tracer, name)))
    torch._dynamo.reset()
