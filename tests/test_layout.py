"""The layout's rules (issue 29), checked on the sources as they are:

- the layer contract of pyproject.toml ([tool.importlinter]) holds: run here as `make lint` runs
  it, on a copy of the tree with triton_kernels/ in place as fxstab/kernels (the wheel's layout);
- no import circle between fxstab's modules, function-level imports included;
- no module imports another module's private name (``_x``; dunders such as ``__version__`` are
  public): a shared piece gets a public name in the layer below both;
- no module reads or writes a private attribute of an object another module owns
  (``analysis._context``, ``tracer._tensor_stats``): the boundary passes what is needed;
- no module over 800 lines (the C source excepted).

Each failure names the file, line and name (or the circle, or the modules) to change.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# (folder, the package it installs as): the kernels' folder installs as fxstab.kernels
SOURCES = ((REPO / "fxstab", "fxstab"), (REPO / "triton_kernels", "fxstab.kernels"))
MAX_LINES = 800


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]

    @property
    def where(self) -> str:
        return self.path.relative_to(REPO).as_posix()


def _modules() -> dict:
    found = {}
    for folder, package in SOURCES:
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join([package, *parts])
            found[name] = Module(name, path, is_package)
    return found


MODULES = _modules()


def _trees() -> dict:
    return {name: ast.parse(m.path.read_text(), filename=str(m.path)) for name, m in MODULES.items()}


def _absolute(mod: Module, node: ast.ImportFrom) -> str:
    """The module an ImportFrom names, made absolute."""
    if not node.level:
        return node.module or ""
    base = mod.package.split(".")
    if node.level > 1:
        base = base[:-(node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str) -> str | None:
    """The deepest fxstab module that ``name`` is or lies in (None outside fxstab)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


@dataclass(frozen=True)
class Import:
    importer: str
    line: int
    target: str        # the fxstab module that runs (the deepest known one)
    source: str        # the module named in the statement, absolute
    name: str | None   # the name imported from it (``from source import name``), else None


def _imports(trees: dict) -> list:
    """Every import of an fxstab module by an fxstab module, at any depth of the code."""
    found = []
    for importer, tree in trees.items():
        mod = MODULES[importer]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _known(alias.name)
                    if target:
                        found.append(Import(importer, node.lineno, target, alias.name, None))
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(mod, node)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    target = sub if sub in MODULES else _known(source)
                    if target:
                        found.append(Import(importer, node.lineno, target, source, alias.name))
    return found


# ---------------------------------------------------------------- the import-linter contract

def _staged_tree(dest: Path) -> Path:
    """fxstab/ with triton_kernels/ as fxstab/kernels, as the wheel installs them."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "fxstab", dest / "fxstab", ignore=ignore)
    shutil.copytree(REPO / "triton_kernels", dest / "fxstab" / "kernels", ignore=ignore)
    return dest


def test_import_contract(tmp_path):
    try:
        import importlinter  # noqa: F401
    except ImportError:  # never skipped: the test extra installs it
        pytest.fail("import-linter is missing: pip install -e '.[test]'")
    stage = _staged_tree(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command;"
         " sys.exit(lint_imports_command())", str(REPO / "pyproject.toml"), "--no-cache"],
        cwd=stage, capture_output=True, text=True)
    report = proc.stdout.partition("Broken contracts")[2] or proc.stdout
    assert proc.returncode == 0, f"lint-imports: contracts broken\n{report}\n{proc.stderr[-2000:]}"


def _layer_contract() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return layers


def test_every_top_level_module_has_a_layer():
    """A module or package added under fxstab/ is checked only once the contract names it."""
    contract = _layer_contract()
    assert contract["containers"] == ["fxstab"]
    named = [part.strip() for layer in contract["layers"] for part in layer.split("|")]
    assert len(named) == len(set(named)), named
    top = {name.split(".")[1] for name in MODULES if name.count(".") >= 1}
    missing = sorted(top - set(named) - {"__main__"})
    assert not missing, f"top-level modules of fxstab in no layer of pyproject.toml: {missing}"
    stale = sorted(set(named) - top)
    assert not stale, f"layers of pyproject.toml that name no module of fxstab: {stale}"


# ---------------------------------------------------------------- import circles

def _cycles(edges: dict) -> list:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _shortest_cycle(start: str, comp: set, edges: dict) -> list:
    """A shortest circle through ``start`` inside one component (breadth first)."""
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(edges.get(node, ())):
                if child == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return list(reversed(path)) + [start]
                if child in comp and child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    return [start]


def import_circles() -> list:
    """Each circle as lines ``a (file:line) -> b``; one shortest circle per component."""
    imports = _imports(_trees())
    edges, where = {}, {}
    for imp in imports:
        if imp.target == imp.importer:
            continue
        edges.setdefault(imp.importer, set()).add(imp.target)
        where.setdefault((imp.importer, imp.target), f"{MODULES[imp.importer].where}:{imp.line}")
    found = []
    for comp in _cycles(edges):
        cycle = _shortest_cycle(comp[0], set(comp), edges)
        steps = [f"{a} ({where[a, b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
        found.append(f"circle of {len(comp)} modules {comp}:\n    " + "\n    ".join(steps))
    return found


def test_no_import_circle():
    circles = import_circles()
    assert not circles, "import circles (function-level imports count):\n" + "\n".join(circles)


# ---------------------------------------------------------------- private names

def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_module_allowed(importer: str, module: str) -> bool:
    """A private module (``pkg._x``) is for its own package: pkg and what lies in it."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            parent = ".".join(parts[:i])
            if not (importer == parent or importer.startswith(parent + ".")):
                return False
    return True


def private_imports() -> list:
    """``file:line: name`` for each private name one fxstab module takes from another: in an
    import statement, or as an attribute of a module it imported (``steps._x``)."""
    trees = _trees()
    found = []
    for imp in _imports(trees):
        where = f"{MODULES[imp.importer].where}:{imp.line}"
        named = imp.target if imp.name is None else f"{imp.source}.{imp.name}"
        if named in MODULES:  # a module: private ones only inside their own package
            if not _private_module_allowed(imp.importer, named):
                found.append(f"{where}: private module {named}")
        elif imp.name is not None and _private(imp.name):
            found.append(f"{where}: {imp.name} from {imp.source}")
    for importer, tree in trees.items():
        aliases = _module_aliases(MODULES[importer], tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            dotted = _dotted(node.value)
            if dotted is None or dotted.split(".")[0] not in aliases:
                continue
            head, _, rest = dotted.partition(".")
            module = ".".join(filter(None, [aliases[head], rest]))
            if module in MODULES and module != importer:
                found.append(f"{MODULES[importer].where}:{node.lineno}: {node.attr} of "
                             f"{module} (as {dotted}.{node.attr})")
    return sorted(set(found), key=_by_file_line)


def _by_file_line(entry: str):
    path, line, _ = entry.split(":", 2)
    return path, int(line)


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _module_aliases(mod: Module, tree: ast.AST) -> dict:
    """Local names bound to fxstab modules: ``import fxstab.x as m`` (m), ``import fxstab.x``
    (fxstab), ``from . import x`` (x)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in MODULES:
                    aliases[alias.asname] = alias.name
                elif not alias.asname and alias.name.split(".")[0] in MODULES:
                    aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(mod, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
    return aliases


def test_no_private_name_imported_across_modules():
    found = private_imports()
    assert not found, ("private names taken from another module (give the shared piece a "
                       "public name in the layer below both):\n  " + "\n  ".join(found))


# ---------------------------------------------------------------- private attributes

# torch's own private members that fxstab reads (an OpOverload's schema, a view's base...):
# another library's, not another fxstab module's
_TORCH_PRIVATE = frozenset({"_base", "_schema", "_ops", "_overloadname", "_C", "_op"})


def _defined_private(tree: ast.AST) -> set:
    """The private names a module defines: its functions, classes, class-level names
    (``__slots__`` entries included) and the attributes it assigns (``self._x = ...``, and any
    object's inside ``__new__``: the instance it makes)."""
    names = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name == "__new__":
            names |= {n.attr for n in ast.walk(fn)
                      if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    names.add(t.id)
                    if t.id == "__slots__" and isinstance(node.value, (ast.Tuple, ast.List)):
                        names |= {e.value for e in node.value.elts
                                  if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "setattr" and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            names.add(node.args[1].value)
    return {n for n in names if _private(n)}


def private_attributes() -> list:
    """``file:line: obj._name`` for each private attribute a module reads or writes on an
    object it does not own (not ``self``/``cls``) where that name is defined by another fxstab
    module and not by this one: one module reaching into another's private members (the
    import contract cannot see it)."""
    trees = _trees()
    defined = {name: _defined_private(tree) for name, tree in trees.items()}
    elsewhere: dict = {}
    for name, attrs in defined.items():
        for attr in attrs:
            elsewhere.setdefault(attr, set()).add(name)
    found = []
    for name, tree in trees.items():
        own = defined[name]
        external = _external_modules(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and (root.id in ("self", "cls") and
                                               root is node.value or root.id in external):
                continue  # its own members, or another library's (torch._ops)
            if node.attr in own or node.attr in _TORCH_PRIVATE or \
                    not (elsewhere.get(node.attr, set()) - {name}):
                continue
            owners = ", ".join(sorted(elsewhere[node.attr] - {name}))
            found.append(f"{MODULES[name].where}:{node.lineno}: .{node.attr} (defined in "
                         f"{owners})")
    return sorted(set(found), key=_by_file_line)


def _external_modules(tree: ast.AST) -> set:
    """Local names bound to modules outside fxstab (``torch``, ``np``, ``fx_traceback``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "fxstab":
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and \
                (node.module or "").split(".")[0] != "fxstab":
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def test_no_private_attribute_of_another_module():
    found = private_attributes()
    assert not found, ("private attributes of another module's objects (give them a public "
                       "name, or pass what is needed across the boundary):\n  "
                       + "\n  ".join(found))


# ---------------------------------------------------------------- module size

def long_modules() -> list:
    found = []
    for mod in MODULES.values():
        lines = len(mod.path.read_text().splitlines())
        if lines > MAX_LINES:
            found.append(f"{mod.where}: {lines} lines")
    return sorted(found)


def test_no_module_over_800_lines():
    found = long_modules()
    assert not found, (f"modules over {MAX_LINES} lines (split along their banner comments):\n  "
                       + "\n  ".join(found))


# ---------------------------------------------------------------- the checks themselves

def test_the_checks_see_every_module_and_function_level_imports():
    assert "fxstab.kernels.dispatch" in MODULES and "fxstab.cpu.bindings" in MODULES
    edges = {(i.importer, i.target) for i in _imports(_trees())}
    # a function-level import (dispatch imports round_digits inside a function)
    assert ("fxstab.kernels.dispatch", "fxstab.kernels.round_digits") in edges
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _shortest_cycle("a", {"a", "b", "c"}, {"a": {"b", "c"}, "b": {"c"}, "c": {"a"}}) \
        == ["a", "c", "a"]
    assert _private("_round") and not _private("__version__") and not _private("round")
    assert _private_module_allowed("fxstab", "fxstab._version")
    assert not _private_module_allowed("fxstab.cli", "fxstab.cpu._impl")
    tree = ast.parse("import fxstab.cpu.bindings\nfrom fxstab.numerics import digits as d\n"
                     "fxstab.cpu.bindings._lib()\nd._t\nd.t\n")
    aliases = _module_aliases(MODULES["fxstab.cli"], tree)
    assert aliases == {"fxstab": "fxstab", "d": "fxstab.numerics.digits"}
    assert _dotted(ast.parse("a.b.c", mode="eval").body) == "a.b.c"
    tree = ast.parse("class A:\n    __slots__ = ('_s',)\n    def _m(self):\n        self._x = 1\n"
                     "def _f():\n    pass\n")
    assert _defined_private(tree) == {"_s", "_m", "_x", "_f"}
