"""Issue 42, item 2: hints chosen from the mechanism the statistics show, not from the kind.

Each hint's condition is exercised on a real analysis: a LayerNorm of a centred input (its
mean's row sum is a computational zero that ``x - mean`` recovers from: a note, no finding),
of an input with a large common offset (near-constant: the centring cancels), an RMSNorm of the
same offset input (no centring, no near-constant hint), and a computational zero a division
reads (the zero passes its loss on: a finding, named as a computational zero).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxstab
from fxstab.digitmap.hints import ZERO_HINT, hint


def _analyse(fn, x, granularity):
    torch._dynamo.reset()
    be = fxstab.backend(format="bf16", granularity=granularity, seed=0)
    with torch.no_grad():
        torch.compile(fn, backend=be)(x)
    torch._dynamo.reset()
    return be.digit_map()


def _centred(n=16, d=64):
    torch.manual_seed(0)
    x = torch.randn(n, d)
    return x - x.mean(-1, keepdim=True)


def test_the_mean_of_a_centred_input_is_a_note_not_a_finding():
    dm = _analyse(lambda x: F.layer_norm(x * 3.0, (64,)), _centred(), "aten")
    findings = dm.findings()
    zero = [n for n in dm.operators if n.endswith("aten.sum#0")]
    assert zero and dm.operators[zero[0]].zero_fraction >= 0.5, dm.table()
    assert not any(f.startswith("digits are lost") for f in findings), findings
    note = [f for f in findings if zero[0] in f]
    assert note and note[0].startswith("note:") and "computational zero" in note[0] \
        and "aten.sub#0" in note[0] and "harmless here" in note[0], findings
    # the hint alone, asked for the zero, names what it is (not a near-constant input)
    assert hint(dm.operators[zero[0]]) == ZERO_HINT
    assert dm.zero_readers(zero[0], 2.0) == [n for n in dm.operators if n.endswith("aten.sub#0")]


@pytest.mark.parametrize("granularity", ["op", "aten"])
def test_a_large_offset_is_a_near_constant_normalization(granularity):
    # the add rounds x + 20 into bf16 (2.4 digits of it); centring cancels the 20
    dm = _analyse(lambda x: F.layer_norm(x + 20.0, (64,)), _centred(), granularity)
    lost = [f for f in dm.findings() if f.startswith("digits are lost")]
    assert lost and "near-constant normalization" in lost[0], dm.findings()
    if granularity == "aten":  # named at the centring step, x - mean
        assert "aten.sub#0" in lost[0].split(":")[0], lost


def test_a_scale_only_normalization_is_never_called_near_constant():
    # an RMSNorm does not centre: the offset costs it nothing, whatever its kind's family
    dm = _analyse(lambda x: F.rms_norm(x + 20.0, (64,)), _centred(), "op")
    op = dm.operators["rms_norm#0"]
    assert "near-constant" not in hint(op)
    assert not any(f.startswith("digits are lost at rms_norm") for f in dm.findings())


def test_a_computational_zero_a_division_reads_stays_a_finding():
    class Zero(nn.Module):
        def forward(self, x):
            x = x * 3.0  # rounded into bf16: the samples part here
            s = x.sum(-1, keepdim=True)  # a computational zero: x is centred
            return x / (s + 0.01)  # ... and the division passes it on

    dm = _analyse(Zero(), _centred(), "op")
    assert dm.operators["sum#0"].zero_fraction >= 0.5, dm.table()
    assert dm.zero_readers("sum#0", 2.0) == []
    lost = [f for f in dm.findings() if f.startswith("digits are lost at sum#0")]
    assert lost and ZERO_HINT in lost[0], dm.findings()
