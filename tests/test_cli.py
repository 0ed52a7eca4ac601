"""The command line: diff exit codes, show, record (against a stand-in backend and, when it
exists, the real one), and the CI example script end to end."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fxstab
from fxstab.cli import main
from fxstab.digitmap import DEFAULT_METRIC, DigitMap
from fxstab.capture.opsets import node_kind
from fxstab.records.report import OpReport

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "examples" / "ci" / "target.py"
SCRIPT = ROOT / "examples" / "ci" / "record_and_diff.sh"
HAS_BACKEND = hasattr(fxstab, "backend") and not getattr(fxstab.backend, "_stand_in", False)


def rep(name, avg, mn, mx, inputs=(), **kw):
    kw.setdefault("format", "bf16")
    kw.setdefault("n_samples", 3)
    return OpReport(name=name, kind=name.split("/")[-1].split("#")[0],
                    module_path=name.split("/")[0], avg_digits=avg, min_digits=mn,
                    max_digits=mx, numel=64, inputs=tuple(inputs), **kw)


def write_map(path: Path, digits: dict, steps: bool = False) -> Path:
    reports = []
    prev = ()
    for name, d in digits.items():
        if steps:
            reports += [rep(name, d + 0.1 * s, d, 2.4, inputs=prev, phase="train", step=s,
                            call=s) for s in range(3)]
        else:
            reports.append(rep(name, d, d, 2.4, inputs=prev))
        prev = (name,)
    DigitMap.from_reports(reports, metadata={"seed": 0}).save(path)
    return path


BASE = {"embed/linear#0": 2.4, "norm/layer_norm#0": 2.2, "head/softmax#0": 2.0,
        "old/gelu#0": 1.0}
HEAD = {"embed/linear#0": 2.4, "norm/layer_norm#0": 0.3, "head/softmax#0": 2.3,
        "new/relu#0": 2.4}


# --------------------------------------------------------------------------- diff
def test_diff_exit_codes_and_output(tmp_path, capsys):
    base = write_map(tmp_path / "base.json", BASE)
    head = write_map(tmp_path / "head.json", HEAD)
    assert main(["diff", str(base), str(base)]) == 0
    assert "OK: no operator lost" in capsys.readouterr().out

    assert main(["diff", str(base), str(head), "--max-drop", "0.5"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL: 1 operator(s) lost more than 0.5 {DEFAULT_METRIC} digits" in out
    assert "norm/layer_norm#0" in out and "(-1.90)" in out
    assert "added (1):" in out and "new/relu#0" in out
    assert "removed (1):" in out and "old/gelu#0" in out
    assert "unchanged: 2 operator(s)" in out  # embed, and head's gain of 0.3 < 0.5

    assert main(["diff", str(base), str(head), "--max-drop", "2"]) == 0
    capsys.readouterr()
    assert main(["diff", str(base), str(head), "--max-drop", "0.2", "--metric", "avg",
                 "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in doc["drops"]] == ["norm/layer_norm#0"]
    assert [g["name"] for g in doc["gains"]] == ["head/softmax#0"]

    assert main(["diff", str(base), str(head), "--format", "markdown"]) == 1
    md = capsys.readouterr().out
    assert md.startswith("<!-- fxstab-digit-map-diff -->\n### fxstab digit map :x:")
    assert "| `norm/layer_norm#0` | layer_norm | 2.20 | 0.30 | **-1.90** |" in md


def _corrupt(tmp_path: Path) -> dict[str, Path]:
    good = json.loads(DigitMap.from_reports([rep("a/x#0", 1, 1, 1)]).to_json())
    files = {}
    files["missing"] = tmp_path / "absent.json"
    files["corrupt"] = tmp_path / "corrupt.json"
    files["corrupt"].write_text('{"schema": "fxstab-digit-map", "schema_versi')
    newer = dict(good, schema_version=99)
    files["schema"] = tmp_path / "newer.json"
    files["schema"].write_text(json.dumps(newer))
    wrong = json.loads(json.dumps(good))
    wrong["operators"][0]["min_digits"] = [1]
    files["types"] = tmp_path / "types.json"
    files["types"].write_text(json.dumps(wrong))
    return files


@pytest.mark.parametrize("which,message", [
    ("missing", "no such file"), ("corrupt", "not valid JSON"),
    ("schema", "schema version 99 is not supported"),
    ("types", "operators[0] 'a/x#0': key 'min_digits': must be a number"),
])
def test_diff_unusable_input_exits_2_with_one_line(tmp_path, capsys, which, message):
    good = write_map(tmp_path / "good.json", BASE)
    bad = _corrupt(tmp_path)[which]
    for args in ([str(bad), str(good)], [str(good), str(bad)]):
        assert main(["diff", *args]) == 2
        cap = capsys.readouterr()
        assert cap.out == ""
        lines = cap.err.strip().splitlines()
        assert len(lines) == 1, cap.err
        assert lines[0].startswith(f"fxstab diff: error: {bad}") and message in lines[0]


def test_diff_as_a_subprocess(tmp_path):
    base = write_map(tmp_path / "base.json", BASE)
    head = write_map(tmp_path / "head.json", HEAD)
    run = subprocess.run([sys.executable, "-m", "fxstab", "diff", str(base), str(head)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "norm/layer_norm#0" in run.stdout


def test_diff_writes_extra_renderings(tmp_path, capsys):
    base = write_map(tmp_path / "base.json", BASE)
    head = write_map(tmp_path / "head.json", HEAD)
    assert main(["diff", str(base), str(head), "--markdown-out", str(tmp_path / "o/d.md"),
                 "--json-out", str(tmp_path / "o/d.json"), "--text-out",
                 str(tmp_path / "o/d.txt")]) == 1
    stdout = capsys.readouterr().out
    assert (tmp_path / "o/d.txt").read_text() == stdout
    assert (tmp_path / "o/d.md").read_text().startswith("<!-- fxstab-digit-map-diff -->")
    assert json.loads((tmp_path / "o/d.json").read_text())["failed"] is True


@pytest.mark.parametrize("command", ["record", "diff", "show", "demo", "formats"])
def test_help_for_each_command(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: fxstab {command}" in out
    if command == "record":
        assert "TARGET contract" in out and "(model, example_inputs)" in out


def test_formats_still_works(capsys):
    assert main(["formats"]) == 0
    assert "bf16" in capsys.readouterr().out


# --------------------------------------------------------------------------- show
def test_show_prints_worst_and_localization_and_draws(tmp_path, capsys):
    path = write_map(tmp_path / "d.json", {"embed/linear#0": 2.3, "cancel/linear#0": 0.4,
                                            "act/gelu#0": 0.35, "head/softmax#0": 0.3},
                     steps=True)
    outs = {k: tmp_path / f"{k}.png" for k in ("plot", "graph", "series")}
    assert main(["show", str(path), "--top", "3", "--plot", str(outs["plot"]), "--graph",
                 str(outs["graph"]), "--series", str(outs["series"])]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "findings:" and "cancel/linear#0" in lines[1]  # the findings first
    t = next(k for k, ln in enumerate(lines) if ln.startswith("digit map:"))
    assert lines[t + 2].split()[0] == "head/softmax#0"  # worst by digits ...
    i = next(k for k, ln in enumerate(lines) if ln.startswith("where digits are lost"))
    assert lines[i + 2].split()[0] == "cancel/linear#0"  # ... but lost at the cancellation
    for p in outs.values():
        assert p.stat().st_size > 0 and p.read_bytes()[:4] == b"\x89PNG"
        assert f"wrote {p}" in out


def test_show_errors(tmp_path, capsys):
    path = write_map(tmp_path / "d.json", {"a/linear#0": 2.0})
    assert main(["show", str(path), "--plot", str(tmp_path / "s.jpg")]) == 2
    assert ".png" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err


# --------------------------------------------------------------------------- record
class ShadowBackend:
    """Stand-in for ``fxstab.backend`` in CLI tests (the lead's backend replaces it).

    Names each floating-point call node ``g<graph>/<kind>#k``, runs the graph once
    in fp32 and once with every such output rounded to bf16 (round to nearest), and reports the
    digits on which the two agree. Not CESTAC; enough for digits to depend on the model so a
    real hazard shows up in a diff.
    """

    _stand_in = True
    instances: list["ShadowBackend"] = []

    def __init__(self, granularity="op", format="bf16", n_samples=3, seed=0,
                 rounding="random", confidence=0.95):
        self.options = dict(granularity=granularity, format=format, n_samples=n_samples,
                            seed=seed, rounding=rounding, confidence=confidence)
        self.reports: list[OpReport] = []
        self._phase, self._step, self._calls, self._graphs = "default", None, 0, 0
        ShadowBackend.instances.append(self)

    @contextlib.contextmanager
    def phase(self, name, step=None):
        prev = (self._phase, self._step)
        self._phase, self._step = name, step
        try:
            yield
        finally:
            self._phase, self._step = prev

    def __call__(self, gm, example_inputs):
        gid = self._graphs
        self._graphs += 1
        names, counts = {}, {}
        for node in gm.graph.nodes:
            if node.op in ("call_function", "call_method"):
                kind = node_kind(node)
                k = counts.get(kind, 0)
                counts[kind] = k + 1
                names[node] = f"g{gid}/{kind}#{k}"

        def feeders(node, seen=None):
            out = []
            for a in node.all_input_nodes:
                out += [names[a]] if a in names else feeders(a)
            return list(dict.fromkeys(out))

        class Shadow(torch.fx.Interpreter):
            def __init__(self, rounded):
                super().__init__(gm)
                self.rounded, self.out = rounded, {}

            def run_node(self, n):
                r = super().run_node(n)
                if n in names and isinstance(r, torch.Tensor) and r.is_floating_point():
                    if self.rounded:
                        r = r.to(torch.bfloat16).to(r.dtype)
                    self.out[n] = r
                return r

        cap = 8 * math.log10(2)

        def run(*args):
            self._calls += 1
            exact, shadow = Shadow(False), Shadow(True)
            with torch.no_grad():
                exact.run(*args)
                shadow.run(*args)
            for node, e in exact.out.items():
                err = (shadow.out[node].double() - e.double()).abs()
                rel = err / e.double().abs()
                d = torch.where(err == 0, cap, (-torch.log10(rel)).nan_to_num(0.0)).clamp(0, cap)
                self.reports.append(OpReport(
                    name=names[node], kind=names[node].split("/")[1].split("#")[0],
                    module_path=f"g{gid}", phase=self._phase, step=self._step,
                    format=self.options["format"], n_samples=self.options["n_samples"],
                    avg_digits=float(d.mean()), min_digits=float(d.min()),
                    max_digits=float(d.max()), numel=e.numel(), shape=tuple(e.shape),
                    inputs=tuple(feeders(node)), call=self._calls))
            return gm.forward(*args)

        return run

    def digit_map(self):
        return DigitMap.from_reports(self.reports, metadata=dict(self.options))


@pytest.fixture
def stand_in_backend(monkeypatch):
    ShadowBackend.instances.clear()
    monkeypatch.setattr(fxstab, "backend", ShadowBackend, raising=False)
    yield ShadowBackend
    torch._dynamo.reset()


def test_record_with_stand_in_backend(tmp_path, monkeypatch, capsys, stand_in_backend):
    monkeypatch.chdir(tmp_path)
    args = ["record", f"{TARGET}:build", "-o", "out/d.json", "--calls", "2", "--seed", "3",
            "--format", "fp16", "--n-samples", "4", "--phase", "train"]
    assert main(args) == 0
    be = stand_in_backend.instances[-1]
    assert be.options == dict(granularity="op", format="fp16", n_samples=4, seed=3,
                              rounding="random", confidence=0.95)
    dm = DigitMap.load(tmp_path / "out" / "d.json")
    assert dm.metadata["target"] == f"{TARGET}:build"
    assert (dm.metadata["seed"], dm.metadata["format"], dm.metadata["n_samples"]) == (3, "fp16", 4)
    assert dm.step_keys() == [("train", 0), ("train", 1)]
    assert len(dm) > 5 and all(op.calls == 2 for op in dm.operators.values())
    out = capsys.readouterr().out
    table = out.index("digit map:")  # after the findings, if any
    assert all(ln.startswith("- ") for ln in out[:table].splitlines())
    assert f"saved {len(dm)} operators to out/d.json" in out
    first = (tmp_path / "out" / "d.json").read_bytes()
    assert main(args) == 0  # the same seed gives the same file
    assert (tmp_path / "out" / "d.json").read_bytes() == first


def test_record_target_contract(tmp_path, monkeypatch, capsys, stand_in_backend):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(textwrap.dedent("""
        import torch
        def single():
            return torch.nn.Linear(4, 4), torch.randn(2, 4)
        def wrong():
            return torch.nn.Linear(4, 4)
        def not_tuple():
            return torch.nn.Linear(4, 4), 3
        def wrong_keywords():
            return torch.nn.Linear(4, 4), {"x": torch.randn(2, 4)}
        def boom():
            raise RuntimeError("the target's own bug")
        value = 3
    """))
    assert main(["record", "t.py:single", "-o", "s.json"]) == 0  # a lone tensor is one input
    assert DigitMap.load(tmp_path / "s.json").metadata["target"] == "t.py:single"
    capsys.readouterr()
    cases = [("t.py", "must be 'path/to/file.py:function'"),
             ("t.py:1x", "not a Python identifier"),
             ("t.txt:f", "must be a .py file"),
             ("absent.py:f", "does not exist"),
             ("t.py:missing", "has no function 'missing'"),
             ("t.py:value", "has no function 'value'"),
             ("t.py:wrong", "must return (model, example_inputs)"),
             ("t.py:not_tuple", "example_inputs as a tuple"),
             ("t.py:wrong_keywords", "do not fit the model's call"),
             ("no_such_module:build", "cannot be imported"),
             ("t.py:boom", "RuntimeError: the target's own bug")]
    for target, message in cases:
        assert main(["record", target, "-o", "x.json"]) == 2, target
        err = capsys.readouterr().err
        assert "fxstab record: error: " in err and message in err, (target, err)
    assert main(["record", "t.py:single", "-o", "x.json", "--calls", "0"]) == 2
    assert not (tmp_path / "x.json").exists()


def _git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True, env=env).stdout


def _ci_repo(tmp_path: Path) -> Path:
    """A git repository whose second commit makes the CI target's input standardization
    cancel (the hazard of examples/ci/target.py)."""
    repo = tmp_path / "repo"
    (repo / "examples" / "ci").mkdir(parents=True)
    shutil.copy(TARGET, repo / "examples" / "ci" / "target.py")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "base")
    t = repo / "examples" / "ci" / "target.py"
    text = t.read_text()
    assert "\nOFFSET = 0.0\n" in text
    t.write_text(text.replace("\nOFFSET = 0.0\n", "\nOFFSET = 100.0\n"))
    _git(repo, "commit", "-qam", "uncentred features")
    return repo


def _run_script(repo: Path, fxstab_cmd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FXSTAB=fxstab_cmd, FXSTAB_OUT=str(repo.parent / "digits"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(["bash", str(SCRIPT), "HEAD~1", "HEAD"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_ci_script_with_stand_in_backend(tmp_path):
    repo = _ci_repo(tmp_path)
    wrapper = tmp_path / "fxstab-stand-in"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"exec '{sys.executable}' -c \"import sys; sys.path.insert(0, '{ROOT / 'tests'}'); "
        "import fxstab, test_cli; fxstab.backend = test_cli.ShadowBackend; "
        "from fxstab.cli import main; sys.exit(main(sys.argv[1:]))\" \"$@\"\n")
    wrapper.chmod(0o755)
    run = _run_script(repo, str(wrapper))
    assert run.returncode == 1, run.stdout + run.stderr
    out = tmp_path / "digits"
    md = (out / "diff.md").read_text()
    assert md.startswith("<!-- fxstab-digit-map-diff -->")
    assert ":x: FAIL" in md
    drops = json.loads((out / "diff.json").read_text())["drops"]
    # the one-pass variance cancels: sqrt of it is among the operators that lost digits
    assert "g0/sqrt#0" in {d["name"] for d in drops}, drops
    assert json.loads((out / "diff.json").read_text())["origins"], drops
    assert "FAIL" in (out / "diff.txt").read_text()
    # the pages the workflow uploads (tests/test_html_pages.py opens such pages in a browser)
    assert 'class="verdict fail"' in (out / "diff.html").read_text()
    assert 'data-name="g0/sqrt#0"' in (out / "head.html").read_text()
    base = DigitMap.load(out / "base.json")
    assert base.metadata["target"] == "examples/ci/target.py:build"
    assert not _git(repo, "worktree", "list").strip().count("\n")  # worktrees removed


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_ci_script_without_baseline(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README").write_text("x")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "base")
    (repo / "examples" / "ci").mkdir(parents=True)
    shutil.copy(TARGET, repo / "examples" / "ci" / "target.py")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "add target")
    run = _run_script(repo, "false")  # fxstab is never called
    assert run.returncode == 0, run.stderr
    assert "no baseline" in (tmp_path / "digits" / "diff.md").read_text()
    # the other way round: the head commit removed the target: an error, not a pass
    _git(repo, "rm", "-q", "examples/ci/target.py")
    _git(repo, "commit", "-qm", "remove target")
    run = subprocess.run(["bash", str(SCRIPT), "HEAD~1", "HEAD"], cwd=repo, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "FXSTAB": "false",
                                                      "FXSTAB_OUT": str(tmp_path / "d2")})
    assert run.returncode == 2 and "does not exist in the head commit" in run.stderr


# --------------------------------------------------------------------------- the real backend
needs_backend = pytest.mark.skipif(not HAS_BACKEND, reason="backend not available")


@needs_backend
def test_record_is_deterministic_and_names_are_stable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["record", f"{TARGET}:build", "-o", "a.json"]) == 0
    assert main(["record", f"{TARGET}:build", "-o", "b.json"]) == 0
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    dm = DigitMap.load(tmp_path / "a.json")
    names = set(dm.operators)
    assert any(n.startswith("standardize/") for n in names), names
    assert any(n.startswith("blocks.1.fc2/linear#") for n in names), names

    # an unrelated edit: an auxiliary head added next to the classifier's head
    edited = tmp_path / "edited.py"
    edited.write_text(TARGET.read_text().replace(
        "        self.head = nn.Linear(width, classes)\n",
        "        self.head = nn.Linear(width, classes)\n"
        "        self.aux = nn.Linear(width, 3)\n").replace(
        "        return torch.softmax(self.head(h), dim=-1)\n",
        "        return torch.softmax(self.head(h), dim=-1), self.aux(h)\n"))
    assert main(["record", f"{edited}:build", "-o", "c.json"]) == 0
    new = set(DigitMap.load(tmp_path / "c.json").operators)
    assert names <= new
    assert new - names and all(n.startswith("aux/") for n in new - names), new - names


@needs_backend
def test_diff_of_the_injected_hazard(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["record", f"{TARGET}:build", "-o", "base.json"]) == 0
    assert main(["record", f"{TARGET}:build_with_hazard", "-o", "head.json"]) == 0
    capsys.readouterr()
    assert main(["diff", "base.json", "head.json", "--max-drop", "0.5"]) == 1
    out = capsys.readouterr().out
    assert "standardize/" in out
    head = DigitMap.load(tmp_path / "head.json")
    assert head.localize()[0].name.startswith("standardize/")


@needs_backend
@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_ci_script_with_the_backend(tmp_path):
    repo = _ci_repo(tmp_path)
    fx = shutil.which("fxstab", path=str(Path(sys.executable).parent))
    if fx is None:
        pytest.skip("the fxstab console script is not installed next to this python")
    run = _run_script(repo, fx)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "standardize/" in (tmp_path / "digits" / "diff.md").read_text()


def test_show_tensorboard_writes_or_skips_cleanly(tmp_path, capsys):
    path = write_map(tmp_path / "d.json", {"a/linear#0": 2.0, "b/gelu#0": 1.0}, steps=True)
    logdir = tmp_path / "tb"
    assert main(["show", str(path), "--tensorboard", str(logdir)]) == 0
    cap = capsys.readouterr()
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        assert "skipped --tensorboard" in cap.err and "pip install tensorboard" in cap.err
        assert not logdir.exists()
    else:
        assert f"wrote 6 TensorBoard scalars to {logdir}" in cap.out
        assert any(p.name.startswith("events.out.tfevents") for p in logdir.iterdir())


# --------------------------------------------------------------------------- the gate
_ATTN_TARGET = '''
import math
import torch
import torch.nn as nn

NAIVE = {naive}


class Attn(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if NAIVE:  # the regression: no max subtraction, a sharper temperature
            e = torch.exp(8 * a)
            p = e / e.sum(-1, keepdim=True)
        else:
            p = torch.softmax(a, -1)
        return self.out(p @ v)


class Model(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.attn = Attn(d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.attn(h)
        return self.head(self.norm(h))


def build():
    torch.manual_seed(0)
    return Model(), (torch.randn(2, 24, 16) * 3,)
'''


def _record(tmp_path, name: str, naive: bool, *extra: str) -> str:
    target = tmp_path / f"{name}.py"
    target.write_text(_ATTN_TARGET.format(naive=naive))
    out = str(tmp_path / f"{name}.json")
    assert main(["record", f"{target}:build", "-o", out, *extra]) == 0
    torch._dynamo.reset()
    return out


def test_gate_fails_the_naive_softmax_regression_and_passes_an_unchanged_model(tmp_path,
                                                                               capsys):
    base = _record(tmp_path, "base", False)
    again = _record(tmp_path, "again", False)
    head = _record(tmp_path, "head", True)
    capsys.readouterr()
    assert main(["diff", base, again]) == 0  # unchanged model: same map, passes
    assert main(["diff", base, head]) == 1  # the default metric and threshold catch it
    out = capsys.readouterr().out
    # softmax became exp/sum/div: the module comparison catches the rewrite inside "attn"
    assert "FAIL" in out and "module drops" in out and "attn  module" in out


def test_gate_on_empty_maps_nonfinite_origins_and_vanished_operators(tmp_path, capsys):
    empty = tmp_path / "empty.json"
    DigitMap(metadata={"fxstab_version": "x", "torch_version": "y"}).save(empty)
    full = write_map(tmp_path / "full.json", BASE)
    for a, b in ((empty, full), (full, empty), (empty, empty)):
        assert main(["diff", str(a), str(b)]) == 2
        assert "no analysed operator" in capsys.readouterr().err
    # a new operator where NaN/inf first appear fails the gate, even with no digit drop
    ok = {"a/linear#0": 2.0, "b/exp#0": 2.0}
    base = DigitMap.from_reports([rep(n, d, d, 2.4) for n, d in ok.items()],
                                 metadata={"seed": 0})
    head = DigitMap.from_reports([rep("a/linear#0", 2.0, 2.0, 2.4),
                                  rep("b/exp#0", 2.0, 2.0, 2.4, non_finite=3,
                                      inputs=["a/linear#0"])], metadata={"seed": 0})
    base.save(tmp_path / "b.json")
    head.save(tmp_path / "h.json")
    assert main(["diff", str(tmp_path / "b.json"), str(tmp_path / "h.json")]) == 1
    out = capsys.readouterr().out
    assert "new NaN/inf origin" in out and "b/exp#0" in out
    # an operator no longer analysed while its module is still in the model fails
    head = DigitMap.from_reports([rep("a/linear#0", 2.0, 2.0, 2.4)],
                                 metadata={"seed": 0, "modules": ["a", "b"]})
    head.save(tmp_path / "h2.json")
    assert main(["diff", str(tmp_path / "b.json"), str(tmp_path / "h2.json")]) == 1
    assert "no longer analysed" in capsys.readouterr().out
    head.metadata["modules"] = ["a"]  # the module itself is gone: listed, not failed
    head.save(tmp_path / "h3.json")
    assert main(["diff", str(tmp_path / "b.json"), str(tmp_path / "h3.json")]) == 0


def test_record_refuses_a_model_with_nothing_analysed(tmp_path, capsys):
    target = tmp_path / "ints.py"
    target.write_text("import torch\n\ndef build():\n"
                      "    return (lambda x: x * 2 + 1), (torch.arange(6),)\n")
    out = tmp_path / "d.json"
    assert main(["record", f"{target}:build", "-o", str(out)]) == 2
    assert "no operator" in capsys.readouterr().err and not out.exists()
    torch._dynamo.reset()


def test_record_accepts_bit_counts_and_reports_the_models_error_in_one_line(tmp_path,
                                                                            capsys):
    path = _record(tmp_path, "bits", False, "--format", "5,2")
    assert DigitMap.load(path).metadata["format"] == "fp8_e5m2"
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\ndef build():\n"
                   "    return torch.nn.Linear(4, 3), (torch.randn(2, 5),)\n")
    capsys.readouterr()
    assert main(["record", f"{bad}:build", "-o", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "RuntimeError" in err and "[2, 5]" in err
    assert "--verbose" in err
    torch._dynamo.reset()


def test_a_failing_target_is_one_line_on_stderr_as_a_user_sees_it(tmp_path):
    """Issue 56, item 12, in a real process (torch's logs bypass pytest's capture): a shape
    error is fxstab's one line, without torch's 18-line fake-tensor log before it; a build
    function that raises is named as such, not as "the model failed"; plan says the same."""
    (tmp_path / "targets.py").write_text(textwrap.dedent("""
        import torch

        def mismatch():
            return torch.nn.Linear(16, 4), (torch.randn(8, 15),)

        def broken():
            raise FileNotFoundError("weights.pt")
    """))

    def fxstab_err(*args: str) -> list:
        proc = subprocess.run([sys.executable, "-m", "fxstab", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        return proc.stderr.strip().splitlines()

    for cmd in (["record", "-o", "a.json"], ["plan", "--format", "fp16", "-o", "p.json"]):
        err = fxstab_err(cmd[0], "targets.py:mismatch", *cmd[1:])
        assert len(err) == 1, "\n".join(err)
        assert err[0].startswith(f"fxstab {cmd[0]}: error: the model failed: RuntimeError: ")
        assert "[8, 15] X [16, 4]" in err[0]
        err = fxstab_err(cmd[0], "targets.py:broken", *cmd[1:])
        assert err == [f"fxstab {cmd[0]}: error: building the target failed: targets.py:broken "
                       f"raised: FileNotFoundError: weights.pt (at {tmp_path / 'targets.py'}:"
                       f"8); --verbose prints the traceback"], err
    # --verbose keeps everything
    err = fxstab_err("record", "targets.py:mismatch", "-o", "a.json", "--verbose")
    assert len(err) > 20 and any(ln.startswith("Traceback") for ln in err)


def test_show_into_a_closed_pipe_prints_no_traceback(tmp_path):
    import subprocess
    import sys

    path = write_map(tmp_path / "d.json", {f"m{i}/linear#0": 2.0 - i / 50 for i in range(80)})
    proc = subprocess.run(f"{sys.executable} -m fxstab show {path} --top 80 | head -n 2",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert len(proc.stdout.splitlines()) == 2
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_digit_maps_honour_the_umask(tmp_path):
    import os
    import stat

    old = os.umask(0o027)
    try:
        path = write_map(tmp_path / "d.json", {"a/linear#0": 2.0})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_schema_1_maps_still_load_and_diff_by_avg(tmp_path, capsys):
    import json

    path = write_map(tmp_path / "d.json", {"a/linear#0": 2.0})
    doc = json.loads(path.read_text())
    doc["schema_version"] = 1
    for op in doc["operators"]:
        for k in ("normwise_digits", "p10_digits", "p50_digits", "underflow"):
            op.pop(k)
    for st in doc["steps"]:
        for e in st["operators"].values():
            for k in ("normwise_digits", "p10_digits", "p50_digits", "underflow"):
                e.pop(k)
    old = tmp_path / "v1.json"
    old.write_text(json.dumps(doc))
    dm = DigitMap.load(old)
    assert dm["a/linear#0"].avg_digits == 2.0 and dm["a/linear#0"].underflow == 0
    assert main(["diff", str(old), str(path), "--metric", "avg"]) == 0


def test_show_of_the_demo_recorded_in_fp16_names_the_nan_origin_first(tmp_path, capsys):
    demo = Path(fxstab.__file__).parent / "demo.py"
    out = tmp_path / "demo.json"
    assert main(["record", f"{demo}:build", "-o", str(out), "--format", "fp16"]) == 0
    torch._dynamo.reset()
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "findings:"
    assert lines[1].startswith("  - NaN/inf first appear at blocks.1.attn/exp#0"), lines[:3]
    # the finite, subtle loss: the first block's layer norm cancels the embeddings' offset
    assert "digits are lost at blocks.0.ln1/layer_norm#0" in lines[2]


def test_demo_ends_with_what_to_fix_first(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert main(["demo", "-o", str(out)]) == 0
    torch._dynamo.reset()
    lines = capsys.readouterr().out.strip().splitlines()
    verdict = [ln for ln in lines if ln.startswith("=> ")]
    assert verdict[0].startswith("=> NaN/inf first appear at blocks.1.attn/exp#0: overflow")
    assert verdict[1].startswith("=> then blocks.0.ln1/layer_norm#0 loses")
    assert "near-constant normalization" in verdict[1]
    # each verdict names the user's line, and the next step names the rewrite command
    assert lines[lines.index(verdict[0]) + 1] == "   demo.py:50  e = torch.exp(scores)"
    assert lines[-1].startswith("Next: `fxstab fix fxstab.demo:build --format fp16`")
    assert DigitMap.load(out).metadata["format"] == "fp16"


def test_record_models_the_accumulator_it_is_given(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["record", f"{TARGET}:build", "-o", "acc.json", "--format", "fp32",
                 "--accumulate", "fp16", "--accumulate-rounding", "random"]) == 0
    dm = DigitMap.load(tmp_path / "acc.json")
    assert dm.metadata["accumulate"] == {"*": "fp16/b16/random"}
    assert main(["record", f"{TARGET}:build", "-o", "plain.json", "--format", "fp32"]) == 0
    plain = DigitMap.load(tmp_path / "plain.json")
    assert "accumulate" not in plain.metadata
    linears = [n for n, op in plain.operators.items() if op.kind == "linear"]
    assert linears and all(dm.operators[n].avg_digits < plain.operators[n].avg_digits
                           for n in linears)  # an fp16 accumulator costs every linear digits
    assert main(["diff", "plain.json", "acc.json"]) == 1
    assert "accumulate differs" in capsys.readouterr().out
    assert main(["record", f"{TARGET}:build", "-o", "x.json", "--accumulate-rounding",
                 "random"]) == 2
    assert "needs --accumulate" in capsys.readouterr().err
    assert main(["record", f"{TARGET}:build", "-o", "x.json", "--accumulate", "fp9"]) == 2
    assert "unknown accumulation 'fp9'" in capsys.readouterr().err
    assert main(["record", f"{TARGET}:build", "-o", "fp8.json", "--gemm-inputs", "fp8_e4m3",
                 "--gemm-scaling", "block128"]) == 0
    assert DigitMap.load(tmp_path / "fp8.json").metadata["gemm_inputs"] == "fp8_e4m3/block128"
    assert main(["record", f"{TARGET}:build", "-o", "x.json", "--gemm-scaling", "row"]) == 2
    assert "needs --gemm-inputs" in capsys.readouterr().err


# --------------------------------------------------------------------------- issue 45
_KW_TARGET = """
import torch
from torch import nn


class Tagger(nn.Module):
    \"\"\"A Hugging Face style model: keyword inputs, an optional mask.\"\"\"

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask[..., None]
        return torch.softmax(self.head(h), -1)


def build(width=8):
    ids = torch.randint(0, 16, (2, 5))
    return Tagger(), {"input_ids": ids, "attention_mask": torch.ones(2, 5)}
"""


def test_record_keyword_inputs_from_a_module_target(tmp_path, monkeypatch, capsys,
                                                    stand_in_backend):
    """`package.module:function` (imported from the current folder) and dict inputs, passed as
    keyword arguments (issue 45: "must return example_inputs as a tuple, got dict")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "tagging.py").write_text(_KW_TARGET)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["record", "proj.tagging:build", "-o", "kw.json"]) == 0
    dm = DigitMap.load(tmp_path / "kw.json")
    assert dm.metadata["target"] == "proj.tagging:build"
    # the mask's multiplication ran: the keyword input reached forward()
    assert any(op.kind == "mul" for op in dm.operators.values()), sorted(dm.operators)
    assert any(op.kind == "softmax" for op in dm.operators.values())
    capsys.readouterr()
    assert main(["record", "proj.tagging:missing", "-o", "x.json"]) == 2
    assert "'proj.tagging' has no function 'missing'" in capsys.readouterr().err
    assert main(["record", "proj.absent:build", "-o", "x.json"]) == 2
    assert "TARGET module 'proj.absent' cannot be imported" in capsys.readouterr().err


def test_an_installed_package_target_from_another_folder(tmp_path, monkeypatch,
                                                         stand_in_backend):
    """The demo as a wheel user names it: a module of an installed package, from any folder."""
    monkeypatch.chdir(tmp_path)
    assert main(["record", "fxstab.demo:build", "-o", "demo.json", "--calls", "1"]) == 0
    assert DigitMap.load(tmp_path / "demo.json").metadata["target"] == "fxstab.demo:build"


@pytest.mark.parametrize("flags, message", [
    (["--format", "fp99"], "fp99"),
    (["--rounding", "sideways"], "sideways"),
    (["--n-samples", "1"], "n_samples"),
    (["--confidence", "1.5"], "confidence"),
    (["--gemm-scaling", "row"], "--gemm-scaling needs --gemm-inputs"),
    (["--accumulate", "fp9"], "fp9"),
])
def test_bad_options_are_refused_before_the_model_is_built(tmp_path, monkeypatch, capsys,
                                                           flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "slow.py").write_text(
        "from pathlib import Path\nimport torch\n\ndef build():\n"
        "    Path('built').write_text('the model was built')\n"
        "    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n")
    assert main(["record", "slow.py:build", "-o", "x.json", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxstab record: error: ") and message in err, err
    assert not (tmp_path / "built").exists(), "the model was built before the options' check"
    if flags[0] in ("--format", "--n-samples"):
        assert main(["plan", "slow.py:build", *flags]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "built").exists()


def _two_format_maps(tmp_path: Path) -> tuple[Path, Path]:
    """The same program in fp16 and in bf16: each operator keeps ~0.4 digits below its cap,
    one of them (loss#0) loses a whole digit more in bf16."""
    caps = {"fp16": 11 * math.log10(2), "bf16": 8 * math.log10(2)}
    paths = []
    for fmt in ("fp16", "bf16"):
        reps, prev = [], ()
        for k, name in enumerate(("a/linear#0", "b/gelu#0", "c/loss#0")):
            d = caps[fmt] - 0.4 - (1.0 if fmt == "bf16" and name == "c/loss#0" else 0.0)
            reps.append(rep(name, d, d, caps[fmt], inputs=prev, format=fmt))
            prev = (name,)
        path = tmp_path / f"{fmt}.json"
        DigitMap.from_reports(reps, metadata={"seed": 0, "format": fmt}).save(path)
        paths.append(path)
    return paths[0], paths[1]


def test_a_diff_across_formats_compares_digits_below_each_cap_and_says_so_first(
        tmp_path, capsys):
    fp16, bf16 = _two_format_maps(tmp_path)
    assert main(["diff", str(fp16), str(bf16)]) == 1
    out = capsys.readouterr().out.splitlines()
    # the first note, right under the verdict, says how the digits were compared
    assert out[1].startswith("note: formats differ: fp16 (base, cap 3.31 digits) vs bf16 "
                             "(head, cap 2.41)") and "relative to each map's cap" in out[1]
    assert not any("format differs" in ln for ln in out)
    # the caps' difference (0.90) is no drop; the one real loss (1.00 digit) is
    assert "FAIL: 1 operator(s) lost more than 0.5" in out[0]
    drop = next(ln for ln in out if ln.strip().startswith("c/loss#0"))
    assert "2.91 ->  1.01" in drop and "(-1.00)" in drop
    result = fxstab.diff(DigitMap.load(fp16), DigitMap.load(bf16))
    assert [c.name for c in result.drops] == ["c/loss#0"] and result.unchanged == 2
    assert math.isclose(result.cap_shift, -3 * math.log10(2))
    # the same formats: absolute digits, as before (no shift)
    same = fxstab.diff(DigitMap.load(bf16), DigitMap.load(bf16))
    assert same.cap_shift == 0.0 and not same.failed and not same.notes


def test_findings_are_empty_for_a_healthy_map_and_the_summary_says_none(tmp_path, capsys):
    from fxstab.digitmap.map import NO_FINDINGS

    healthy = DigitMap.from_reports([rep("a/linear#0", 2.3, 2.0, 2.41),
                                     rep("b/relu#0", 2.3, 2.0, 2.41, inputs=["a/linear#0"])],
                                    metadata={"seed": 0, "format": "bf16"})
    assert healthy.findings() == []
    assert healthy.summary() == f"findings: {NO_FINDINGS}"
    assert NO_FINDINGS.startswith("none (no NaN/inf origin")
    sick = DigitMap.from_reports([rep("a/linear#0", 2.3, 2.0, 2.41),
                                  rep("b/exp#0", 2.0, 2.0, 2.41, non_finite=3,
                                      inputs=["a/linear#0"])],
                                 metadata={"seed": 0, "format": "bf16"})
    lines = sick.summary().splitlines()
    assert lines[0] == "findings:" and lines[1].startswith("  - NaN/inf first appear at b/exp#0")
    healthy.save(tmp_path / "ok.json")
    assert main(["show", str(tmp_path / "ok.json")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"findings: {NO_FINDINGS}"
