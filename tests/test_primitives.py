"""The arithmetic level's primitives as one table (issue 53, item 1): one row per kind, what
apply_primitive does is the row's path, a new primitive is one entry, and no chain over kinds
is left in the rules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import fxstab.rules
from fxstab.records.report import OBSERVED, ROUNDED
from fxstab.rules.aten import (
    AtenContext, PRIMITIVES, Stacked, apply_primitive, describe_primitive, op_info, primitive,
    rule_of,
)
from fxstab.rules.aten import batching, kinds
from fxstab.rules.aten.primitives import ARITHMETIC, BINARY, COMPARE, EXACT, GEMM, LAYOUT
from fxstab.rules.lifting import DECISIONS

aten = torch.ops.aten


def test_each_primitive_has_one_row():
    assert rule_of("add").path == BINARY and rule_of("add").output_digits
    assert rule_of("add").counters is rule_of("rsub").counters  # one family, two paths
    assert rule_of("rsub").path == ARITHMETIC
    assert rule_of("view").path == LAYOUT and rule_of("view").exact
    assert rule_of("clamp").path == EXACT and rule_of("clamp").branch is not None
    assert rule_of("mm").path == GEMM and rule_of("mm").batcher is batching.BATCHERS["mm"]
    assert rule_of("lt").path == COMPARE and rule_of("less").relation.name == "lt"
    assert {k for k, r in PRIMITIVES.items() if r.path == "decide"} == set(DECISIONS)
    assert rule_of("exp").lookup and rule_of("sum").batcher is not None
    # a kind without a row: arithmetic, no counters of its own
    assert rule_of("softmax").path == ARITHMETIC and rule_of("softmax").counters is None
    # op_info reads the row
    info = op_info(aten.add.Tensor)
    assert info.rule is rule_of("add") and info.binary == "add" and not info.exact
    assert op_info(aten.add.Tensor).binary and op_info(aten.rsub.Scalar).binary is None


def test_describe_primitive_says_how_it_is_analysed():
    text = describe_primitive("add")
    assert text.startswith("add (cancellation): binary")
    assert "cancellation where the output keeps" in text and "anomaly" in text
    assert "per-element digits" in text
    assert "reads of its operands: zero masks" in describe_primitive("div")  # the divisor's
    assert "layout" in describe_primitive("view") and "batcher: reshape" in \
        describe_primitive("view")
    assert "counters: none" in describe_primitive("view")
    assert "CESTAC" in describe_primitive("eq")
    assert describe_primitive("softmax").startswith("softmax ((no row)): arithmetic")
    assert "mask (drawn once, on ones) times every sample" in describe_primitive("native_dropout")
    assert all(r.draw is not None for r in PRIMITIVES.values() if r.path == "random")


def test_registering_is_checked():
    with pytest.raises(ValueError, match="at least one"):
        primitive()
    with pytest.raises(ValueError, match="unknown path"):
        primitive("fxstab_nothing", path="fused")
    with pytest.raises(ValueError, match="unknown PrimitiveRule fields"):
        primitive("fxstab_nothing", paht=EXACT)
    with pytest.raises(ValueError, match="path registered twice"):
        primitive("add", path=EXACT)
    assert "fxstab_nothing" not in PRIMITIVES


# a primitive the package does not know: x * x * x, registered once for the tests below
@torch.library.custom_op("fxstab_test::cube", mutates_args=())
def _cube(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


@_cube.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.fixture
def registered():
    """Rows registered by a test are removed after it (and the op_info cache of the op)."""
    before = dict(PRIMITIVES)
    yield
    PRIMITIVES.clear()
    PRIMITIVES.update(before)
    kinds._OP_INFO.pop(torch.ops.fxstab_test.cube.default, None)


def _cube_records(**settings):
    recs = []
    ctx = AtenContext.of(format="fp32", n_samples=3, seed=0, recorder=recs.append,
                         diagnostics="summary", **settings)
    x = Stacked(torch.linspace(-1, 1, 8).expand(3, 8).clone())
    out = apply_primitive(torch.ops.fxstab_test.cube.default, (x,), {}, ctx)
    return out, recs, ctx


def test_a_new_primitive_is_one_entry(registered):
    """Without a row the primitive is arithmetic (rounded, recorded); one entry makes it
    exact with counters of its own, and the analysis follows the row."""
    out, recs, _ = _cube_records()
    assert [r.kind for r in recs] == ["cube"] and recs[0].status == ROUNDED

    seen = []

    @primitive("cube", path=EXACT)
    def _cube_sign(c):
        """intrinsic wherever the operand's samples are negative."""
        seen.append(c.args[0].samples.shape)
        return [("intrinsic", (c.args[0].samples < 0).any(0))]

    kinds._OP_INFO.pop(torch.ops.fxstab_test.cube.default, None)  # (decided once per overload)
    out, recs, ctx = _cube_records()
    x = torch.linspace(-1, 1, 8)
    assert torch.equal(out.samples, (x * x * x).expand(3, 8))  # exact: not rounded
    assert recs == [] and seen == [torch.Size([3, 8])]  # not recorded; its counters ran
    assert ctx.counters.counts["intrinsic"] == 4
    assert "intrinsic wherever the operand" in describe_primitive("cube")
    # recorded as observed where exact primitives are recorded
    recs = []
    ctx = AtenContext.of(format="fp32", n_samples=3, seed=0, recorder=recs.append,
                         record_exact=True)
    apply_primitive(torch.ops.fxstab_test.cube.default, (Stacked(x.expand(3, 8).clone()),), {},
                    ctx)
    assert [r.status for r in recs] == [OBSERVED]


# --------------------------------------------------------------------------- no chains
def _is_kind(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "kind" or \
        isinstance(node, ast.Attribute) and node.attr == "kind"


def _literal_kinds(node: ast.AST) -> bool:
    """A string, or a literal tuple/list/set of strings."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)


def _tests_kind(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Compare) and _is_kind(n.left) for n in ast.walk(node))


def kind_chains(source: str) -> list:
    """The inline tests of a kind against literal names (``kind == "mul"``, ``kind in ("relu",
    "threshold")``) and the if/elif (or ``a if ... else b if ...``) chains over kinds in
    ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and _is_kind(node.left) and \
                any(_literal_kinds(c) for c in node.comparators):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.If, ast.IfExp)) and _tests_kind(node.test):
            orelse = node.orelse[0] if isinstance(node, ast.If) and len(node.orelse) == 1 \
                else node.orelse
            if isinstance(orelse, (ast.If, ast.IfExp)) and _tests_kind(orelse.test):
                found.append(f"line {node.lineno}: chain from {ast.unparse(node.test)}")
    return found


def test_kind_chains_finds_chains():
    assert kind_chains('if kind == "mul":\n    pass\n')
    assert kind_chains('x = 1 if op.kind in ("a", "b") else 2\n')
    assert kind_chains('if kind in A:\n    pass\nelif kind in B:\n    pass\n')
    assert not kind_chains('if kind in A:\n    pass\n')
    assert not kind_chains('rule = PRIMITIVES.get(kind)\n')


def test_no_chain_over_kinds_remains_in_the_rules():
    root = Path(fxstab.rules.__file__).parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        chains = kind_chains(path.read_text())
        if chains:
            found[path.relative_to(root).as_posix()] = chains
    assert not found, found
