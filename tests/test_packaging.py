"""The wheel, not the checkout: build it from this tree, install it into a fresh virtual
environment and use it from a folder outside the repository.

The editable install of the test environment resolves ``fxstab`` to the checkout, so a package
missing from the wheel (as ``fxstab.passes`` once was, from a hand-kept list) never shows in the
other tests. Here the new environment sees the test environment's site-packages (torch, numpy,
triton, ...) through a ``.pth`` file, whose own ``.pth`` files, the editable finder among them,
are not run; ``fxstab.__file__`` is checked to lie in the new environment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# What the checkout holds besides the sources; never copied into the build.
_NOT_SOURCES = {".git", ".venv", "build", "dist", "results", ".pytest_cache", ".hypothesis",
                "__pycache__", ".whl", ".gl", ".import_linter_cache"}


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {proc.returncode}\n"
        f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def _ignore(folder: str, names: list) -> set:
    return {n for n in names if n in _NOT_SOURCES or n.endswith(".egg-info")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the tree (a stale build/ of the checkout never enters)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_ignore, symlinks=True)
    # setuptools' own build entry point, its output kept: what pip -q would hide
    proc = _run([sys.executable, "-c", "import setuptools.build_meta as b; "
                 f"b.build_wheel({str(tmp / 'dist')!r})"], cwd=src)
    # issue 45: no deprecation box (a license table, data folders outside `packages`)
    noise = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if any(w in ln for w in ("Deprecat", "SetuptoolsWarning", "_Warning",
                                      "absent from the `packages`"))]
    assert not noise, "\n".join(noise)
    wheels = list((tmp / "dist").glob("fxstab-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> tuple[Path, Path]:
    """A new environment with the wheel installed; returns (python, its site-packages)."""
    root = tmp_path_factory.mktemp("venv") / "env"
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)])
    python = root / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                      "['purelib'])"]).stdout.strip())
    # the test environment's dependencies, after the new site-packages (its .pth files unrun)
    outer = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "00_test_environment.pth").write_text("".join(f"{p}\n" for p in outer))
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "-q", str(wheel)])
    return python, site


def test_wheel_holds_every_package_and_the_c_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    # every module (so every package's __init__.py) of fxstab/ and of the kernels' folder
    expected = {f"fxstab/{p.relative_to(REPO / 'fxstab').as_posix()}"
                for p in (REPO / "fxstab").rglob("*.py") if "__pycache__" not in p.parts}
    expected |= {f"fxstab/kernels/{p.name}" for p in (REPO / "triton_kernels").glob("*.py")}
    expected.add("fxstab/cpu/csrc/cpu_kernels.c")
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}"
    assert not any(n.startswith("triton_kernels/") for n in names), \
        "the kernels' folder must install as fxstab.kernels, never as a top-level triton_kernels"
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)


_SMOKE = textwrap.dedent("""
    import sys
    from pathlib import Path

    import torch
    import torch.nn as nn

    import fxstab
    import fxstab.cpu
    import fxstab.kernels
    from fxstab.cpu import bindings

    site = Path(sys.argv[1]).resolve()
    for mod in (fxstab, fxstab.kernels, bindings):
        assert site in Path(mod.__file__).resolve().parents, (mod.__name__, mod.__file__)
    assert (Path(fxstab.cpu.__file__).parent / "csrc" / "cpu_kernels.c").is_file()
    # the C kernels build (or load from the cache, keyed by this copy's source) from the
    # installed package
    assert bindings.available(), "the fused CPU kernels are unavailable from the wheel"

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8)

        def forward(self, x):
            return torch.softmax(self.fc(x), dim=-1).sum(-1)

    torch.manual_seed(0)
    model, x = Small(), torch.randn(4, 16)
    be = fxstab.backend(format="bf16")
    y = torch.compile(model, backend=be)(x)
    assert torch.equal(y, model(x))
    dm = be.digit_map()
    assert len(dm) > 0, "no operator in the digit map"
    print("ok", len(dm), fxstab.__version__)
""")


def test_installed_wheel_analyses_and_runs_the_demo(venv, tmp_path):
    python, site = venv
    work = tmp_path / "elsewhere"  # outside the repository: the checkout is not importable
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    (work / "smoke.py").write_text(_SMOKE)
    out = _run([str(python), "smoke.py", str(site)], cwd=work, env=env, timeout=300).stdout
    assert out.splitlines()[-1].startswith("ok "), out

    demo = _run([str(python), "-m", "fxstab", "demo"], cwd=work, env=env, timeout=300).stdout
    origin = [line for line in demo.splitlines() if "NaN/inf first appear at" in line]
    assert origin and "/exp#" in origin[0], demo[-3000:]


# --------------------------------------------------------------------------- the README
def readme_steps(text: str) -> list:
    """The README's runnable steps, in order: ("file", name, text) for a ```toml block whose
    first line is ``# FILE`` (written where the commands run), ("sh", command) for each line of
    a ```bash block that starts with ``fxstab ``, and ("py", code) for a ```python block that
    starts with an import (a whole program; the other Python blocks are fragments that use a
    model of the reader's own)."""
    steps = []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", text, re.S):
        first = body.splitlines()[0] if body.strip() else ""
        if lang == "toml" and first.startswith("# "):
            steps.append(("file", first[2:].strip(), body))
        elif lang == "bash":
            steps += [("sh", ln.split("  #")[0].strip()) for ln in body.splitlines()
                      if ln.startswith("fxstab ")]
        elif lang == "python" and first.startswith(("import ", "from ")) and \
                "fxstab.integrations" not in body:
            steps.append(("py", body))
    return steps


def test_readme_steps_are_found():
    steps = readme_steps((REPO / "README.md").read_text())
    commands = [s[1] for s in steps if s[0] == "sh"]
    assert "fxstab plan fxstab.demo:build --format fp16 --keep 1.2 -o plan.json --apply-check" \
        in commands
    assert any(c.startswith("fxstab record fxstab.demo:build") for c in commands)
    assert any(c.startswith("fxstab ci init") for c in commands)
    assert ("file", "pyproject.toml") in [s[:2] for s in steps]
    assert any("backward=True" in s[1] for s in steps if s[0] == "py")
    assert not any("tests.models" in s[-1] or "fxstab/demo.py" in s[-1] for s in steps)


def test_every_readme_command_works_from_the_installed_wheel(venv, tmp_path):
    """Each README command, run as a user of the wheel runs it: in a fresh folder outside the
    checkout (a git repository, as `fxstab ci init` expects), with the wheel's `fxstab`."""
    python, site = venv
    work = tmp_path / "project"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    assert (python.parent / "fxstab").is_file()  # the wheel's console script
    for step in readme_steps((REPO / "README.md").read_text()):
        if step[0] == "file":
            (work / step[1]).write_text(step[2])
            continue
        if step[0] == "sh":
            cmd = ["bash", "-c", step[1]]
            ok = (0, 1) if step[1].startswith("fxstab diff") else (0,)  # 1: the gate failed
        else:
            (work / "snippet.py").write_text(step[1])
            cmd, ok = [str(python), "snippet.py"], (0,)
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode in ok, (f"{step[0]}: {step[1][:300]}\nexit {proc.returncode}\n"
                                       f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    for made in ("base.json", "head.json", "plan.json", "head.html", "diff.html",
                 "maps/demo.json", ".github/workflows/fxstab.yml", "history.html"):
        assert (work / made).is_file(), made
