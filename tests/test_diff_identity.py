"""The gate matches operators across commits by a stable identity (issue 56, item 2).

An edit that inserts operators into a module moves the ``#k`` of the operators after them; a
diff that matched by name compared base's ``xc * xc`` with head's ``x * x`` (both
``norm/mul#0``: "gained +1.84") and led with an operator that lost nothing. Here the edit is
the textbook one: a LayerNorm's two-pass variance made one-pass (``E[x^2] - E[x]^2``, a
cancellation in bf16 where the activations sit far from zero).
"""

from __future__ import annotations

import torch

import fxstab
from fxstab.digitmap import DigitMap, diff
from fxstab.digitmap.compare import match_operators


class TwoPass(torch.nn.Module):
    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        xc = x - m
        v = (xc * xc).mean(-1, keepdim=True)
        return xc * torch.rsqrt(v + 1e-5)


class OnePass(torch.nn.Module):  # the edit: the variance's line, with operators inserted
    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        v = (x * x).mean(-1, keepdim=True) - m * m
        xc = x - m
        return xc * torch.rsqrt(v + 1e-5)


class Model(torch.nn.Module):
    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.lin, self.norm, self.out = torch.nn.Linear(16, 16), norm, torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.norm(self.lin(x) + 4))


def _map(norm: torch.nn.Module, tmp_path) -> DigitMap:
    torch.manual_seed(0)
    model = Model(norm).eval()
    torch._dynamo.reset()
    be = fxstab.backend(format="bf16", seed=0)
    with torch.no_grad():
        torch.compile(model, backend=be)(torch.randn(32, 16))
    torch._dynamo.reset()
    path = tmp_path / f"{type(norm).__name__}.json"
    be.digit_map().save(path)  # (through the file, as the gate reads it)
    return DigitMap.load(path)


def test_operators_match_by_their_line_not_their_index(tmp_path):
    base, head = _map(TwoPass(), tmp_path), _map(OnePass(), tmp_path)
    assert base.operators["norm/sub#0"].code == "xc = x - m"
    match = match_operators(base, head)
    # the untouched lines' operators match whatever their index now
    assert match["norm/mean#0"] == "norm/mean#0"
    assert match["norm/sub#0"] == "norm/sub#1"  # xc = x - m
    assert match["norm/mul#1"] == "norm/mul#2"  # xc * rsqrt(...)
    assert match["norm/add#0"] == "norm/add#0" and match["norm/rsqrt#0"] == "norm/rsqrt#0"
    # the edited line's are base's removed and head's added: never compared with each other
    assert "norm/mul#0" not in match and "norm/mean#1" not in match
    result = diff(base, head)
    assert {r.name for r in result.added} == {"norm/mul#0", "norm/mean#1", "norm/mul#1",
                                             "norm/sub#0"}
    assert {r.name for r in result.removed} == {"norm/mul#0", "norm/mean#1"}
    assert not result.gains  # (by name: x * x "gained" against xc * xc)
    assert result.failed
    # the cause leads: the one-pass subtraction (a loss of its own), never an operator whose
    # local loss is not positive
    assert result.origins and all(o.local_loss > 0 for o in result.origins)
    assert result.origins[0].name == "norm/sub#0", result.origins
    text = result.to_text()
    lead = [ln for ln in text.splitlines() if ln.startswith("digits are lost first")]
    assert lead[0].startswith("digits are lost first at norm/sub#0 (local loss 1."), text
    assert text.index(lead[0]) < text.index("drops (")  # before what it cost
    # a row renamed by the edit says its base name
    renamed = [c for c in result.drops + result.gains if c.base_name]
    assert all(c.label == f"{c.name} (base: {c.base_name})" for c in renamed)
    assert "norm/mul#2 (base: norm/mul#1)" in text  # xc * rsqrt(...), inherited the loss
    assert "(base: `norm/mul#1`)" in result.to_markdown()


def test_maps_without_source_text_match_by_name(tmp_path):
    base, head = _map(TwoPass(), tmp_path), _map(OnePass(), tmp_path)
    for dm in (base, head):
        for op in dm.operators.values():
            op.code = ""
    match = match_operators(base, head)
    assert all(b == h for b, h in match.items()) and "norm/mul#0" in match
