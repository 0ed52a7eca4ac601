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
from fxstab.digitmap import DigitMap
from fxstab.opsets import node_kind
from fxstab.report import OpReport

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
    assert "FAIL: 1 operator(s) lost more than 0.5 min digits" in out
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
    assert lines[2].split()[0] == "head/softmax#0"  # worst by digits ...
    i = next(k for k, ln in enumerate(lines) if ln.startswith("where digits are lost"))
    assert lines[i + 2].split()[0] == "cancel/linear#0"  # ... but lost at the cancellation
    for p in outs.values():
        assert p.stat().st_size > 0 and p.read_bytes()[:4] == b"\x89PNG"
        assert f"wrote {p}" in out


def test_show_errors(tmp_path, capsys):
    path = write_map(tmp_path / "d.json", {"a/linear#0": 2.0})
    assert main(["show", str(path), "--series", str(tmp_path / "s.png")]) == 2
    assert "no per-step entries" in capsys.readouterr().err
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
    assert out.startswith("digit map:") and f"saved {len(dm)} operators to out/d.json" in out
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
            return torch.nn.Linear(4, 4), {"x": 1}
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
