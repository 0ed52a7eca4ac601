"""fxstab.executors: one choice of kernels for every function, and every production call through it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import fxstab
import fxstab.cpu.bindings
import fxstab.rules.aten  # noqa: F401 - registers the arithmetic level's implementations
from fxstab import executors
from fxstab.rules.aten.context import AtenContext
from fxstab.rules.aten.rounding import perturb_operand

SRC = Path(fxstab.__file__).parent
NAMES = {executors.CPU, executors.TRITON, executors.TORCH}
# the C kernels' entry points (fxstab.cpu.bindings): called only by a registered implementation
KERNEL_CALLS = {"round_stats", "round_perturb", "perturb", "rounder", "Prepared", "Binary",
                "lookup_bf16", "split_bf16", "join_bf16"}
# comparisons with an implementation's name that choose nothing: the backend checks the option's
# prerequisites before it compiles (Triton installed, the C kernels built)
OPTION_CHECKS = {("backend.py", "cfg.kernels == 'triton'"), ("backend.py", "cfg.kernels == 'cpu'")}
# calls of the C kernels outside an implementation, each with its reason
KERNEL_CALLERS = {
    # the C kernel with the context's settings, bound once per context and dtype (the cache
    # of bindings.rounder would hash the settings on every primitive): state of the context,
    # read only by the CPU implementations of ATEN_ROUND and its fused steps (checked below)
    ("rules/aten/context.py", "AtenContext.rounder"),
}


def _modules() -> list:
    return [(p, p.relative_to(SRC).as_posix(), ast.parse(p.read_text()))
            for p in sorted(SRC.rglob("*.py")) if p.name != "executors.py" or p.parent != SRC]


def _absolute(rel: str, node: ast.ImportFrom) -> str:
    """The module an ``from ... import`` in file ``rel`` (under fxstab/) names."""
    if not node.level:
        return node.module or ""
    package = ["fxstab", *rel.split("/")[:-1]]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _registered(fn: ast.AST) -> bool:
    """Whether a function is decorated ``@executors.implements(...)``."""
    for d in getattr(fn, "decorator_list", ()):
        call = d.func if isinstance(d, ast.Call) else d
        if isinstance(call, ast.Attribute) and call.attr == "implements" or \
                isinstance(call, ast.Name) and call.id == "implements":
            return True
    return False


def test_one_kernel_choice_for_every_function():
    x = torch.ones(3, 4)
    cpu = executors.CPU if fxstab.cpu.bindings.available() else executors.TORCH

    def chosen(kernels: str, fn: str, t: torch.Tensor, n: int = 3) -> str:
        return executors.choose(kernels, fn, t, n).name

    for fn in (executors.ROUND, executors.PERTURB, executors.ACCUMULATE, executors.ATEN_ROUND,
               executors.ATEN_PERTURB, executors.ATEN_DIGITS, executors.LOWP_CONVERT,
               executors.ATEN_LOOKUP):
        assert chosen("auto", fn, x) == cpu
        assert chosen("cpu", fn, x) == cpu
        assert chosen("torch", fn, x) == executors.TORCH
        # no fused kernel reads tensors on another device
        assert chosen("auto", fn, torch.empty(3, device="meta")) == executors.TORCH
        if fn != executors.ACCUMULATE:  # (its products sum in fp64 whatever the operands)
            assert chosen("auto", fn, x.half()) == executors.TORCH
    assert chosen("triton", executors.ROUND, x) == executors.TRITON
    assert chosen("triton", executors.ACCUMULATE, x) == executors.TRITON
    # the arithmetic level has no Triton path: there "triton" means "auto"
    assert chosen("triton", executors.ATEN_ROUND, x) == cpu
    assert chosen("auto", executors.ROUND, x, 10_000) == executors.TORCH
    # a fused step follows its function's choice, and the references have none
    assert executors.choose("torch", executors.ROUND_PERTURB, x, 3) is None
    assert executors.choose("triton", executors.PREPARED_ROUND, x, 3) is None
    assert (executors.choose("auto", executors.PREPARED_ROUND, x, 3) is None) == \
        (cpu == executors.TORCH)
    for fused in (executors.ATEN_PREPARED, executors.ATEN_BINARY):  # ATEN_ROUND's
        assert executors.choose("torch", fused, x, 3) is None
        assert executors.choose("auto", fused, x.half(), 3) is None
        assert (executors.choose("triton", fused, x, 3) is None) == (cpu == executors.TORCH)
    assert fxstab.backend(kernels="torch").kernels_for(x) == executors.TORCH
    with pytest.raises(ValueError, match="kernels must be one of"):
        executors.choose("fast", executors.ROUND, x, 3)
    with pytest.raises(KeyError, match="no implementation of 'nothing'"):
        executors.choose("auto", "nothing", x, 3)


def test_no_call_site_names_an_implementation():
    """The choice is executors.choose's alone: no module compares an implementation's name
    (executors.CPU, "triton"...), imports the Triton kernels or calls a C kernel but the
    implementations registered with @executors.implements."""
    found = []
    for path, rel, tree in _modules():
        registered = set()
        parents = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
            if _registered(node):
                registered.update(ast.walk(node))
        bindings_names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(rel, node)
                if module == "fxstab.kernels" or module.startswith("fxstab.kernels."):
                    found.append(f"{rel}:{node.lineno}: imports the Triton kernels ({module})")
                for a in node.names:
                    if f"{module}.{a.name}" == "fxstab.cpu.bindings":
                        bindings_names.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("fxstab.kernels"):
                        found.append(f"{rel}:{node.lineno}: imports {a.name}")
            elif isinstance(node, ast.Compare) and _names_implementation(rel, node):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id == "executors" and node.attr in ("CPU", "TRITON", "TORCH") and \
                    node not in registered and not _in_implements(node, parents):
                found.append(f"{rel}:{node.lineno}: names executors.{node.attr}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and \
                    node.func.value.id in bindings_names and node.func.attr in KERNEL_CALLS and \
                    node not in registered and \
                    (rel, _owner(node, parents)) not in KERNEL_CALLERS and \
                    (rel, "*") not in KERNEL_CALLERS:
                found.append(f"{rel}:{node.lineno}: calls {ast.unparse(node.func)} outside a "
                             f"registered implementation ({_owner(node, parents)})")
            # the context's bound C kernel (AtenContext.rounder): the implementations' alone
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "rounder" and node not in registered and \
                    not (isinstance(node.func.value, ast.Name) and
                         node.func.value.id in bindings_names):
                found.append(f"{rel}:{node.lineno}: calls {ast.unparse(node.func)} outside a "
                             f"registered implementation ({_owner(node, parents)})")
    assert not found, "\n".join(found)


def _names_implementation(rel: str, node: ast.Compare) -> bool:
    """Whether a comparison tests an implementation's name: ``executors.CPU``, or ``"cpu"``,
    ``"triton"``, ``"torch"`` against anything but a device's type (``x.device.type ==
    "cpu"``) or the option checks above."""
    sides = (node.left, *node.comparators)
    if any(isinstance(s, ast.Attribute) and s.attr in ("CPU", "TRITON", "TORCH") for s in sides):
        return True
    named = any(isinstance(s, ast.Constant) and s.value in NAMES for s in sides)
    device = any(isinstance(s, ast.Attribute) and s.attr == "type" for s in sides)
    return named and not device and (rel, ast.unparse(node)) not in OPTION_CHECKS


def _in_implements(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("implements"):
            return True
    return False


def _owner(node: ast.AST, parents: dict) -> str:
    """``Class.method`` or ``function`` holding ``node``."""
    names = []
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
    return ".".join(reversed(names))


def test_a_kernel_is_one_registry_entry(monkeypatch):
    """A Triton path for the arithmetic level's surrogate, added as one entry: chosen where
    the option asks for Triton (it meant "auto" there before), and what the production call
    runs."""
    monkeypatch.setitem(executors._TABLE, executors.ATEN_PERTURB,
                        dict(executors._TABLE[executors.ATEN_PERTURB]))
    ctx = AtenContext.of(format="bf16", n_samples=3, kernels="triton")
    samples = torch.ones(3, 8)  # identical samples: every element is perturbed
    before = perturb_operand(samples, ctx.eta, 7, ctx)
    assert ctx.kernel(executors.ATEN_PERTURB, samples).name != executors.TRITON
    calls = []

    @executors.implements(executors.ATEN_PERTURB, executors.TRITON,
                          lambda t, n: t.device.type == "cuda")
    def spy(samples: torch.Tensor, eta: float, seed: int, grid) -> tuple:
        calls.append(seed)
        return executors.reference(executors.ATEN_PERTURB)(samples, eta, seed, grid)

    chosen = ctx.kernel(executors.ATEN_PERTURB, samples)
    assert chosen.name == executors.TRITON and chosen.fn is spy  # forced by the option
    out, count = perturb_operand(samples, ctx.eta, 7, ctx)
    assert calls == [7] and count == before[1] == samples[0].numel()
    assert torch.equal(out, before[0])  # the same bits as the kernels it replaces
    # under "auto" its checker decides: a CPU tensor keeps the C kernels or the reference
    auto = AtenContext.of(format="bf16", n_samples=3)
    assert auto.kernel(executors.ATEN_PERTURB, samples).fn is not spy


def test_an_implementation_has_a_known_name():
    with pytest.raises(ValueError, match="'cpu', 'triton' or 'torch'"):
        executors.implements(executors.ROUND, "metal")


def test_the_arithmetic_levels_fused_steps_run_as_chosen(monkeypatch):
    """The binary operators computed inside their rounding, the bf16 lookups and a sampled
    graph's prepared rounding run what the registry chose for them: a spy registered in the
    C kernels' place is what runs, and nothing of it under ``kernels="torch"``."""
    if not fxstab.cpu.bindings.available():
        pytest.skip("the fused CPU kernels did not build here (no C compiler)")
    from fxstab.rules.aten import Stacked, apply, apply_primitive

    calls = []
    for fn in (executors.ATEN_BINARY, executors.ATEN_LOOKUP, executors.ATEN_PREPARED):
        monkeypatch.setitem(executors._TABLE, fn, dict(executors._TABLE[fn]))
        real = executors._TABLE[fn][executors.CPU]

        def spy(*args, _fn=fn, _real=real.fn):
            calls.append(_fn)
            return _real(*args)
        executors.implements(fn, executors.CPU, real.checker)(spy)
    monkeypatch.setattr(apply, "_BINARY_MIN_BYTES", 0)  # small operands take the step too
    x = Stacked(torch.randn(3, 8).bfloat16().float())  # bf16 values: the tables read them
    for kernels, want in (("torch", []), ("auto", [executors.ATEN_BINARY, executors.ATEN_LOOKUP])):
        ctx = AtenContext.of(format="bf16", n_samples=3, kernels=kernels)
        calls.clear()
        apply_primitive(torch.ops.aten.add.Tensor, (x, x), {}, ctx)
        apply_primitive(torch.ops.aten.exp.default, (x,), {}, ctx)
        assert calls == want
    calls.clear()
    torch._dynamo.reset()
    f = torch.compile(torch.nn.Linear(8, 8), backend=fxstab.backend(granularity="aten"))
    with torch.no_grad():
        for _ in range(3):  # untraced, traced, replayed: the replay's steps are prepared
            f(torch.randn(4, 8))
    assert executors.ATEN_PREPARED in calls
