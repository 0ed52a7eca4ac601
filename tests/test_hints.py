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
    else:  # the library kernel: the input's producer named, what to keep in fp32
        assert "its input, from add#0," in lost[0] and "keep add#0 in fp32" in lost[0], lost
        assert "in fp32 (test_hints.py:" in lost[0], lost  # where the user wrote the add


def test_the_near_constant_remedy_is_the_inputs_precision_not_the_normalizations():
    """What the op-level finding says, analysed: the add that rounds x + 20 kept in fp32
    gives the LayerNorm its digits back; the LayerNorm itself in fp32 (its statistics are fp32
    in PyTorch's kernel already) keeps no more."""
    def ln(formats):
        torch._dynamo.reset()
        be = fxstab.backend(format="bf16", seed=0, formats=formats)
        with torch.no_grad():
            torch.compile(lambda x: F.layer_norm(x + 20.0, (64,)), backend=be)(_centred())
        torch._dynamo.reset()
        return be.digit_map().operators["layer_norm#0"].avg_digits

    plain = ln(None)
    assert ln({"add#0": "fp32"}) > plain + 1.0
    assert abs(ln({"layer_norm#0": "fp32"}) - plain) < 0.3


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


# ----------------------------------------------------------- issue 54, item 5: by mechanism
def _fp16(fn, *xs):
    torch._dynamo.reset()
    be = fxstab.backend(format="fp16", seed=0)
    with torch.no_grad():
        torch.compile(fn, backend=be)(*xs)
    torch._dynamo.reset()
    return be.digit_map()


def _finding(dm, name):
    """The finding that names ``name`` as where NaN/inf appear or digits are lost."""
    return next(f for f in dm.findings(top=10)
                if f.startswith((f"digits are lost at {name}", f"NaN/inf first appear at {name}")))


def test_a_softmax_is_told_where_its_large_logits_come_from_not_to_subtract_the_max():
    torch.manual_seed(0)  # dot products near 64 that differ by tenths: bf16 keeps 0.5 of them
    q, k = 1 + 0.05 * torch.randn(64, 64), 1 + 0.05 * torch.randn(64, 64)
    dm = _analyse(lambda q: torch.softmax(q @ k.T, -1), q, "op")
    line = _finding(dm, "softmax#0")
    assert "matmul#0, a dot product nobody scaled" in line and "1/sqrt(d)" in line
    assert "subtract the max" not in line
    # scaled, but still large: the logits' producer is named, not an unscaled product
    dm = _analyse(lambda q: torch.softmax((q @ k.T) * 0.9, -1), q, "op")
    line = _finding(dm, "softmax#0")
    assert "rounding of its logits (mul#0)" in line and "subtract the max" not in line


def test_a_log_of_zeros_names_the_operator_that_underflowed():
    x = -torch.linspace(1, 30, 256)
    dm = _fp16(lambda x: torch.log(torch.exp(x * 2.0)), x)
    line = _finding(dm, "log#0")
    assert line.startswith("NaN/inf first appear at log#0")
    assert "exp#0 underflowed" in line and "log space" in line


def test_an_exp_that_overflows_names_its_argument():
    x = torch.linspace(1, 20, 256)
    dm = _fp16(lambda x: torch.exp(x * 1.5), x)
    line = _finding(dm, "exp#0")
    assert "its argument, from mul#0, is too large" in line


def test_a_verified_fix_in_the_map_is_named_by_its_finding():
    from fxstab.digitmap import DigitMap
    from fxstab.digitmap.fixrecord import Fix

    x = torch.linspace(1, 20, 256)
    dm = _fp16(lambda x: torch.exp(x * 1.5), x)
    fix = Fix(operator="exp#0", rewrite="softmax", source="model.py:7", code="torch.exp(s)",
              replacement="torch.softmax(s, -1)", before=0.0, after=3.0, real_before=0.0,
              real_after=3.0, nonfinite_before=10, nonfinite_after=0, verified=True,
              numel=256, format="fp16", findings=("exp#0",))
    with_fix = DigitMap(dm.operators.values(), dm.metadata, dm.steps, fixes=[fix])
    assert _finding(with_fix, "exp#0").endswith(
        "; verified fix at model.py:7: torch.softmax(s, -1)")
    assert "verified fix" not in _finding(dm, "exp#0")
