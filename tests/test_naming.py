"""fxstab.capture.naming: the one module-path parser (the analysis and the monitor's compiled
front end both read dynamo's nn_module_stack through it) and the operator names."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fxstab.capture.naming import NameRegistry, module_path, normalize_module_path, op_name

# Every spelling torch versions have written, with what both former parsers got wrong:
# naming.py dropped "_modules" inside attribute names (sub_modules -> sub) and kept getattr(...);
# monitor/compile.py kept ['k'] subscripts, "_modules" right after the root, double quotes and
# the L['self'] of a getattr(...).
CASES = [
    ("L['self'].blocks.0.attn", "blocks.0.attn"),  # torch 2.13
    ("L['s'].blocks.0.sub_modules.0", "blocks.0.sub_modules.0"),
    ("L['self'].my_modules", "my_modules"),
    ("L['self']._modules['x_modules']", "x_modules"),
    ("L['self']._modules['blocks']._modules['0']._modules['attn']", "blocks.0.attn"),
    ("L['self'].blocks[0].attn", "blocks.0.attn"),
    ("L['self'].encoder.layer[11].attention", "encoder.layer.11.attention"),
    ("L['self'].d['k']", "d.k"),
    ('L["self"].d["k"]', "d.k"),
    ("getattr(L['self'].blocks, '0')", "blocks.0"),
    ("getattr(L['self'].blocks, '0').attn", "blocks.0.attn"),
    ("getattr(getattr(L['self'], 'blocks'), '0')", "blocks.0"),
    ("L['fn'].layers[3]._modules['mlp'].fc1", "layers.3.mlp.fc1"),
    ("blocks.0.attn", "blocks.0.attn"),
    ("L['self']", ""),
    # a decorator's wrapper as the outermost frame (Hugging Face's Llama): the model is its
    # first positional argument, or its keyword self
    ("L['args'][0].model.layers.0.self_attn", "model.layers.0.self_attn"),
    ('L["args"][0].model', "model"),
    ("L['kwargs']['self'].model.norm", "model.norm"),
    ("L['args'][0]", ""),
    # the compiled callable a bound method (operator_impact of a compiled model) or a compiled
    # module wrapping the model: the model's own names
    ("L['fn'].__self__.0", "0"),
    ("L['fn'].__self__", ""),
    ("L['self']._orig_mod.blocks.0", "blocks.0"),
    ("L['self'].blocks.__self__x", "blocks.__self__x"),
    ("", ""),
]


@pytest.mark.parametrize("raw,expected", CASES)
def test_every_spelling_parses_to_the_named_modules_form(raw, expected):
    assert normalize_module_path(raw) == expected


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.sub_modules = nn.ModuleList([nn.Linear(4, 4)])
        self.d = nn.ModuleDict({"k": nn.Linear(4, 4)})

    def forward(self, x):
        return self.d["k"](self.sub_modules[0](self.attn(x)))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return torch.softmax(x, -1)


def test_dynamo_paths_are_named_modules_and_both_front_ends_agree():
    import fxstab

    model = _Model()
    seen = []

    def capture(gm, example_inputs):
        seen.extend(module_path(n) for n in gm.graph.nodes if n.meta.get("nn_module_stack"))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=capture)(torch.randn(2, 4))
    names = dict(model.named_modules())
    assert seen and all(p in names for p in seen)
    assert "blocks.1.sub_modules.0" in seen

    # the monitor's compiled and eager front ends name the operators alike
    compiled, eager = fxstab.StabilityMonitor(), fxstab.StabilityMonitor()
    torch._dynamo.reset()
    torch.compile(model, backend=compiled.backend())(torch.randn(2, 4))
    eager.wrap(model)(torch.randn(2, 4))
    assert "blocks.0.sub_modules.0/linear#0" in compiled.operators
    assert compiled.operators == eager.operators


def test_op_name_and_registry():
    assert op_name("", "softmax", 0) == "softmax#0"
    assert op_name("blocks.0", "linear", 2) == "blocks.0/linear#2"
    reg = NameRegistry()
    assert reg.name("fc", "linear", "m.py:3", 0) == "fc/linear#0"
    assert reg.name("fc", "linear", "m.py:4", 0) == "fc/linear#1"
    assert reg.name("fc", "linear", "m.py:3", 0) == "fc/linear#0"  # same identity, same name


class _Rotate(nn.Module):  # a function made a module, as transformers 5 makes its helpers
    def forward(self, x):
        return x * 2 + 1


_ROTATE = _Rotate()  # held by a module-level global, not by the model


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(_ROTATE(x))


def test_a_module_held_by_a_global_is_named_inside_its_caller():
    # (transformers' apply_rotary_pos_emb: G['__import_..._llama'].apply_rotary_pos_emb named
    # no layer and numbered every layer's operators as one: mul#0..7)
    import fxstab

    model = nn.Sequential(_Attention(), _Attention())
    torch._dynamo.reset()
    be = fxstab.backend(format="bf16", seed=0)
    with torch.no_grad():
        torch.compile(model, backend=be)(torch.randn(2, 4))
    names = list(be.digit_map().operators)
    assert not [n for n in names if n.startswith("G.") or "__import" in n], names
    for layer in ("0", "1"):
        assert f"{layer}._ROTATE/mul#0" in names and f"{layer}._ROTATE/add#0" in names, names
    torch._dynamo.reset()
    raw = {"a": ("L['self'].layers.3.self_attn", nn.Module),
           "b": ("G['__import_transformers_dot_models_dot_llama_dot_modeling_llama']"
                 ".apply_rotary_pos_emb", nn.Module)}
    node = torch.fx.Graph().placeholder("x")
    node.meta["nn_module_stack"] = raw
    assert module_path(node) == "layers.3.self_attn.apply_rotary_pos_emb"
    node.meta["nn_module_stack"] = {"b": raw["b"]}  # called at the root
    assert module_path(node) == "apply_rotary_pos_emb"
    node.meta["nn_module_stack"] = {"b": ("G['__import_x_dot_rope']", nn.Module)}
    assert module_path(node) == "rope"
