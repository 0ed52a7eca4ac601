"""format="auto": each operator rounds into the dtype its output has in the program."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxstab
from fxstab.digitmap import DigitMap


class MixedNorm(nn.Module):
    """A bf16 model whose LayerNorm runs in fp32 (the usual mixed-precision recipe)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        return self.fc2(self.ln(h.float()).to(torch.bfloat16))


def test_a_bf16_model_with_fp32_norms_is_simulated_as_it_runs():
    torch.manual_seed(0)
    m = MixedNorm().to(torch.bfloat16)
    m.ln.float()
    x = torch.randn(8, 16).to(torch.bfloat16)
    be = fxstab.backend(format="auto")
    y = torch.compile(m, backend=be)(x)
    assert torch.equal(y, m(x))
    dm = be.digit_map()
    formats = {n: o.format for n, o in dm.operators.items()}
    assert formats == {"fc1/linear#0": "bf16", "gelu#0": "bf16", "ln/layer_norm#0": "fp32",
                       "fc2/linear#0": "bf16"}
    assert {r.format for r in be.reports} == {"bf16", "fp32"}  # each report its own
    assert dm.metadata["format"] == "auto"
    assert dm.cap_of(dm.operators["ln/layer_norm#0"]) == pytest.approx(
        fxstab.get_format("fp32").digit_cap)
    again = DigitMap.from_json(dm.to_json())
    assert {n: o.format for n, o in again.operators.items()} == formats
    # the fp32 norm keeps what its bf16 input carries, no more: it is not where digits go
    ranked = [r.name for r in dm.localize()]
    assert ranked[-1] in ("ln/layer_norm#0", "gelu#0")


class AutocastNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x)  # bf16 under autocast
        z = torch.softmax(x * 3.0, dim=-1)  # fp32: softmax of an fp32 input stays fp32
        return y.float() + z


def test_autocast_bfloat16_on_the_cpu():
    torch.manual_seed(0)
    m = AutocastNet()
    x = torch.randn(8, 16)
    be = fxstab.backend(format="auto")
    f = torch.compile(m, backend=be)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = f(x)
        want = m(x)
    assert torch.equal(y, want)
    ops = be.digit_map().operators
    assert ops["fc/linear#0"].format == "bf16"
    assert ops["softmax#0"].format == "fp32" and ops["mul#0"].format == "fp32"
    fp32_cap = fxstab.get_format("fp32").digit_cap
    # fp32 arithmetic on exact fp32 inputs, simulated in an fp64 working dtype: near its cap
    assert ops["softmax#0"].avg_digits > fp32_cap - 1.0
    assert ops["fc/linear#0"].avg_digits < fxstab.get_format("bf16").digit_cap + 1e-9


def test_auto_is_an_operator_level_format():
    with pytest.raises(ValueError, match="granularity='op'"):
        fxstab.backend(format="auto", granularity="aten")
