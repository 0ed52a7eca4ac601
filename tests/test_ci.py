"""The generated CI (fxstab/ci.py): `fxstab ci init github|gitlab` writes files that are valid
workflows (YAML with the keys GitHub Actions and GitLab CI require, every shell step parses),
and their steps, run here on two commits of a sample repository, produce the pull-request
summary, the pages and the history page. The install step installs fxstab from where it is
installed here (a VCS URL, a wheel, a folder in the repository) and the project; the GitHub
workflow validates against GitHub's workflow schema (the one check-jsonschema ships)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fxstab import ci
from fxstab.cli import main
from fxstab.digitmap import DigitMap

yaml = pytest.importorskip("yaml", reason="the test extra installs pyyaml")

_MODEL = """
import torch
from torch import nn

OFFSET = {offset}


class Norm(nn.Module):
    def forward(self, x):
        m = x.mean(-1, keepdim=True)
        v = (x * x).mean(-1, keepdim=True) - m * m     # one pass: cancels on offset inputs
        return (x - m) / torch.sqrt(v + 1e-5)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Norm()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return torch.softmax(self.fc(self.norm(x + OFFSET)), -1)


def build():
    return Net(), (torch.randn(8, 16),)
"""

_SETTINGS = """
[project]
name = "sample"
version = "0.1"

[tool.setuptools]
py-modules = ["model"]

[tool.fxstab]
format = "bf16"
seed = 0

[tool.fxstab.gate]
max_drop = 0.5

[tool.fxstab.targets.net]
target = "model.py:build"
output = "digits/net.json"
"""


def _git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True, env=env).stdout.strip()


# fxstab as a git install would record it (PEP 610): the test environment's own install is
# editable from the checkout, a folder no CI runner reaches
_VCS = {"url": "https://example.org/fxstab.git",
        "vcs_info": {"vcs": "git", "commit_id": "0123456789abcdef"}}


def _workflow(tmp_path: Path, kind: str, monkeypatch) -> dict:
    (tmp_path / "pyproject.toml").write_text(_SETTINGS)
    monkeypatch.setattr(ci, "_origin", lambda: _VCS)
    assert main(["ci", "init", kind]) == 0
    return yaml.safe_load((tmp_path / ci.KINDS[kind]).read_text())


def _schema_check(path: Path, schema: str) -> None:
    """``path`` against a schema vendored by check-jsonschema (no download)."""
    pytest.importorskip("check_jsonschema", reason="the test extra installs check-jsonschema")
    proc = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema",
                           f"vendor.{schema}", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _bash_parses(script: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert proc.returncode == 0, (script, proc.stderr)


def test_github_workflow_is_a_valid_workflow(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    wf = _workflow(tmp_path, "github", monkeypatch)
    _schema_check(tmp_path / ci.KINDS["github"], "github-workflows")
    on = wf[True] if True in wf else wf["on"]  # YAML 1.1 reads the key `on` as True
    assert "pull_request" in on and on["push"]["branches"] == ["main"]
    # least privilege: none by default; the pull request's job reads the code and comments,
    # only the push's job writes (the history branch)
    assert wf["permissions"] == {}
    assert wf["jobs"]["digits"]["permissions"] == {"contents": "read", "pull-requests": "write"}
    assert wf["jobs"]["history"]["permissions"] == {"contents": "write"}
    assert set(wf["jobs"]) == {"digits", "history"}
    for name, job in wf["jobs"].items():
        assert job["runs-on"] == "ubuntu-latest" and isinstance(job["steps"], list), name
        for step in job["steps"]:
            assert ("uses" in step) != ("run" in step), step  # exactly one of them
            if "uses" in step:
                assert re.fullmatch(r"[\w-]+/[\w-]+@v\d+", step["uses"]), step["uses"]
            else:
                _bash_parses(step["run"])
            for value in map(str, step.values()):
                assert value.count("${{") == value.count("}}"), value
    ids = [s.get("id") for s in wf["jobs"]["digits"]["steps"]]
    assert ids.index("diff") < ids.index("pages")
    # a second init does not overwrite; --force does
    assert main(["ci", "init", "github"]) == 2
    assert main(["ci", "init", "github", "--force", "--main", "trunk"]) == 0
    assert "branches: [trunk]" in (tmp_path / ci.KINDS["github"]).read_text()


def test_gitlab_ci_is_a_valid_pipeline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    wf = _workflow(tmp_path, "gitlab", monkeypatch)
    _schema_check(tmp_path / ci.KINDS["gitlab"], "gitlab-ci")
    assert wf["stages"] == ["digits"]
    for name in ("fxstab-digits", "fxstab-history"):
        job = wf[name]
        assert job["stage"] == "digits" and job["image"].startswith("python:")
        assert isinstance(job["script"], list) and job["rules"]
        assert job["before_script"] == [
            ci.TORCH_CPU, "python -m pip install 'fxstab @ git+https://example.org/fxstab.git"
                          "@0123456789abcdef'",
            "python -m pip install -e ."]  # the sample's pyproject.toml has a [project]
        _bash_parses("\n".join(job["before_script"] + job["script"]))
    assert "merge_request_event" in wf["fxstab-digits"]["rules"][0]["if"]
    assert wf["fxstab-digits"]["artifacts"]["paths"] == ["fxstab-ci/"]


def test_init_needs_configured_targets(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fxstab.toml").write_text('format = "bf16"\n')
    assert main(["ci", "init", "github"]) == 2
    assert "no [targets]" in capsys.readouterr().err
    assert not (tmp_path / ".github").exists()
    with pytest.raises(ValueError, match="unknown CI kind 'jenkins'"):
        ci.workflow("jenkins", (ci.TORCH_CPU,))


_WHEEL = "https://example.org/dist/fxstab-0.1.0-py3-none-any.whl"


@pytest.mark.parametrize("origin, expected", [
    (_VCS, "python -m pip install 'fxstab @ git+https://example.org/fxstab.git"
           "@0123456789abcdef'"),
    ({"url": _WHEEL, "archive_info": {"hashes": {"sha256": "ab12"}}},
     f"python -m pip install 'fxstab @ {_WHEEL}#sha256=ab12'"),
    ({"url": "file://{repo}/wheels/fxstab-0.1.0-py3-none-any.whl", "archive_info": {}},
     "python -m pip install ./wheels/fxstab-0.1.0-py3-none-any.whl"),
    ({"url": "file://{repo}/third_party/fxstab", "dir_info": {"editable": True}},
     "python -m pip install ./third_party/fxstab"),
    ({}, "python -m pip install fxstab==0.1.0"),   # from an index: that version
])
def test_install_step_installs_fxstab_as_it_is_installed_here(tmp_path, origin, expected):
    origin = {k: v.format(repo=tmp_path) if k == "url" else v for k, v in origin.items()}
    assert ci.install_commands(tmp_path, origin) == (ci.TORCH_CPU, expected)


def test_install_step_installs_the_project(tmp_path):
    (tmp_path / "pyproject.toml").write_text(_SETTINGS)  # a [project] table
    assert ci.project_install(tmp_path) == ["python -m pip install -e ."]
    (tmp_path / "pyproject.toml").write_text("[tool.fxstab]\nformat = 'bf16'\n")  # no package
    assert ci.project_install(tmp_path) == []
    (tmp_path / "requirements.txt").write_text("numpy\n")
    (tmp_path / "setup.py").write_text("from setuptools import setup\nsetup()\n")
    assert ci.project_install(tmp_path) == ["python -m pip install -r requirements.txt",
                                            "python -m pip install -e ."]
    # the repository is fxstab itself: its own install covers fxstab
    own = {"url": f"file://{tmp_path}", "dir_info": {"editable": True}}
    assert ci.install_commands(tmp_path, own) == (ci.TORCH_CPU, *ci.project_install(tmp_path))


def test_init_refuses_an_fxstab_ci_cannot_reach(tmp_path, monkeypatch, capsys):
    """A folder or a wheel outside the repository, a local clone, an uninstalled checkout:
    init says so, writes nothing, and gives the --install commands to pass instead."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text(_SETTINGS)
    for origin in ({"url": "file:///home/me/src/fxstab", "dir_info": {"editable": True}},
                   {"url": "file:///tmp/dist/fxstab-0.1.0-py3-none-any.whl",
                    "archive_info": {}},
                   {"url": "file:///home/me/src/fxstab", "vcs_info": {"vcs": "git",
                                                                     "commit_id": "abc"}},
                   None):
        monkeypatch.setattr(ci, "_origin", lambda: origin)
        assert main(["ci", "init", "github"]) == 2
        err = capsys.readouterr().err
        assert "cannot tell how CI should install fxstab" in err, err
        assert "--fxstab git+https://HOST/OWNER/fxstab@COMMIT" in err and "--install" in err
        if origin:
            assert origin["url"] in err
        assert not (tmp_path / ".github").exists()
    # --fxstab says where CI gets it; torch and the project are installed as before
    assert main(["ci", "init", "github", "--fxstab",
                 "git+https://example.org/fxstab.git@v0.1.0"]) == 0
    wf = yaml.safe_load((tmp_path / ci.KINDS["github"]).read_text())
    assert [s for s in wf["jobs"]["digits"]["steps"] if s.get("id") == "install"][0][
        "run"].splitlines() == [ci.TORCH_CPU, "python -m pip install 'fxstab @ git+https://"
                                              "example.org/fxstab.git@v0.1.0'",
                                "python -m pip install -e ."]
    # --install is the whole step
    assert main(["ci", "init", "github", "--force", "--install", "make ci-deps"]) == 0
    assert "          make ci-deps\n" in (tmp_path / ci.KINDS["github"]).read_text()
    assert main(["ci", "init", "github", "--force", "--install", "x", "--fxstab", "y"]) == 2
    assert "not both" in capsys.readouterr().err


def test_init_names_the_commit_of_a_checkout_with_a_remote(tmp_path, monkeypatch, capsys):
    """fxstab installed from a git checkout outside the repository: the suggestion is that
    checkout's remote at its commit."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    _git(src, "init", "-q")
    _git(src, "add", ".")
    _git(src, "commit", "-q", "-m", "x")
    _git(src, "remote", "add", "origin", "https://example.org/me/fxstab.git")
    sha = _git(src, "rev-parse", "HEAD")
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "pyproject.toml").write_text(_SETTINGS)
    monkeypatch.chdir(proj)
    monkeypatch.setattr(ci, "_origin", lambda: {"url": f"file://{src}", "dir_info": {}})
    assert main(["ci", "init", "gitlab"]) == 2
    assert f"--fxstab git+https://example.org/me/fxstab.git@{sha}" in capsys.readouterr().err


def _vendor_fxstab(dest: Path) -> None:
    """The sources a build of fxstab needs, copied to ``dest``."""
    repo = Path(__file__).resolve().parents[1]
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("fxstab", "triton_kernels"):
        shutil.copytree(repo / name, dest / name, ignore=skip)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copyfile(repo / name, dest / name)


def test_a_bad_ref_or_no_repository_is_said_in_words(tmp_path, monkeypatch, capsys):
    """Issue 56, item 12: not git's own `rev-parse` output."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text(_SETTINGS)
    assert main(["ci", "run", "main"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"fxstab ci: error: {tmp_path} is not in a git repository: fxstab "
                           f"ci records commits; run it in a clone of the project"), err
    _git(tmp_path, "init", "-q", "-b", "main")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "first")
    assert main(["ci", "run", "nosuchref"]) == 2
    err = capsys.readouterr().err
    assert "rev-parse" not in err and "fatal" not in err, err
    assert f"no commit 'nosuchref' in {tmp_path}: give a branch, a tag or a SHA" in err, err


@pytest.mark.slow
def test_the_workflows_steps_on_two_commits(tmp_path, monkeypatch):
    """Run the generated workflow's own shell steps on a sample repository: the install step
    installs fxstab (from a folder in the repository, as this test's origin says) and the
    project into a fresh environment; then a push to main keeps the first commit's maps in
    the history branch, and a pull request whose change feeds the standardization offset
    inputs fails the gate, says where in the summary, and writes the pages and the history
    page (the branch's commit and the change)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "model.py").write_text(_MODEL.format(offset=0.0))
    (repo / "pyproject.toml").write_text(_SETTINGS)
    _vendor_fxstab(repo / "third_party" / "fxstab")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "first")
    base = _git(repo, "rev-parse", "HEAD")
    monkeypatch.chdir(repo)
    monkeypatch.setattr(ci, "_origin", lambda: {"url": f"file://{repo}/third_party/fxstab",
                                                "dir_info": {}})
    assert main(["ci", "init", "github"]) == 0
    wf = yaml.safe_load((repo / ci.KINDS["github"]).read_text())
    steps = {s.get("id"): s for job in wf["jobs"].values() for s in job["steps"]}

    # the install step, into a fresh environment that sees this one's packages (torch, ...)
    # through a .pth file (tests/test_packaging.py's way). Offline, so pip gets --no-index
    # --no-deps --no-build-isolation: the step's commands and paths are what is tested, the
    # dependencies come from here. `python` on PATH is that environment's.
    import sysconfig

    env_dir = tmp_path / "ci-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    newpy = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(newpy), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    outer = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "00_test_environment.pth").write_text("".join(f"{p}\n" for p in outer))
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "python").write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; exec {sys.executable} -m pip '
        f'--python {newpy} "$@" --no-index --no-deps --no-build-isolation -q; fi\n'
        f'exec {newpy} "$@"\n')
    (shim / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{shim}{os.pathsep}{env_dir / 'bin'}{os.pathsep}"
                                f"{os.environ['PATH']}",
               GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GITHUB_OUTPUT=str(tmp_path / "gh_output"),
               GITHUB_STEP_SUMMARY=str(tmp_path / "gh_summary"))
    env.pop("PYTHONPATH", None)
    assert steps["install"]["run"].splitlines() == [
        ci.TORCH_CPU, "python -m pip install ./third_party/fxstab", "python -m pip install -e ."]

    def run_step(step_id: str, **expressions: str) -> subprocess.CompletedProcess:
        script = steps[step_id]["run"]
        for expr, value in expressions.items():
            script = script.replace("${{ " + expr + " }}", value)
        # no remote here: fetching and pushing the history branch are the CI's network steps
        script = "\n".join(ln for ln in script.splitlines()
                           if not ln.strip().startswith(("git push", "git fetch")))
        assert "${{" not in script, script
        return subprocess.run(["bash", "-e", "-c", script], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=900)

    proc = run_step("install")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (env_dir / "bin" / "fxstab").is_file()  # the console script the later steps run
    where = subprocess.run([str(newpy), "-c", "import fxstab, model; print(fxstab.__file__); "
                            "print(model.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True)
    assert where.returncode == 0, where.stderr
    fx_file, model_file = where.stdout.split()
    assert Path(fx_file).is_relative_to(site) and Path(model_file) == repo / "model.py"

    # the push to main: the history branch gets the first commit's maps
    proc = run_step("keep")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kept = _git(repo, "ls-tree", "-r", "--name-only", ci.HISTORY_BRANCH)
    assert re.fullmatch(rf"maps/\d{{8}}T\d{{6}}-{base[:10]}/net\.json", kept), kept
    assert (repo / "fxstab-ci" / "history.html").is_file()

    # the pull request: a change that feeds offset features to the one-pass variance
    _git(repo, "checkout", "-q", "-b", "change")
    (repo / "model.py").write_text(_MODEL.format(offset=100.0))
    _git(repo, "commit", "-q", "-am", "offset features")
    head = _git(repo, "rev-parse", "HEAD")
    proc = run_step("diff", **{"github.event.pull_request.base.sha": base,
                               "github.event.pull_request.head.sha": head})
    assert proc.returncode == 0, proc.stderr[-3000:]  # the step records rc; a later one fails
    assert (tmp_path / "gh_output").read_text().strip() == "rc=1"
    out = repo / "fxstab-ci"
    summary = (out / "summary.md").read_text()
    assert summary.startswith(ci.MARKER)
    assert "FAIL: the gate failed" in summary and "#### net" in summary
    assert f"base `{base[:10]}`" in summary and f"head `{head[:10]}`" in summary
    assert "norm/" in summary  # the lost digits are named at the standardization
    assert (tmp_path / "gh_summary").read_text() == summary
    for page in ("net.diff.html", "net.head.html", "history.html"):
        assert (out / page).is_file(), page
    history = (out / "history.html").read_text()
    assert base[:10] in history and f"{head[:10]} (this change)" in history
    base_map = DigitMap.load(out / "base" / "net.json")
    head_map = DigitMap.load(out / "head" / "net.json")
    assert base_map.metadata["target"] == head_map.metadata["target"] == "model.py:build"
    # the fail step runs on rc != 0
    fail = next(s for s in wf["jobs"]["digits"]["steps"] if s.get("name") == "Fail on the gate")
    assert fail["if"] == "steps.diff.outputs.rc != '0'"
