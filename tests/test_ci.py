"""The generated CI (fxstab/ci.py): `fxstab ci init github|gitlab` writes files that are valid
workflows (YAML with the keys GitHub Actions and GitLab CI require, every shell step parses),
and their steps, run here on two commits of a sample repository, produce the pull-request
summary, the pages and the history page."""

from __future__ import annotations

import os
import re
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


def _workflow(tmp_path: Path, kind: str) -> dict:
    (tmp_path / "pyproject.toml").write_text(_SETTINGS)
    assert main(["ci", "init", kind]) == 0
    return yaml.safe_load((tmp_path / ci.KINDS[kind]).read_text())


def _bash_parses(script: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert proc.returncode == 0, (script, proc.stderr)


def test_github_workflow_is_a_valid_workflow(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    wf = _workflow(tmp_path, "github")
    on = wf[True] if True in wf else wf["on"]  # YAML 1.1 reads the key `on` as True
    assert "pull_request" in on and on["push"]["branches"] == ["main"]
    assert wf["permissions"] == {"contents": "write", "pull-requests": "write"}
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
    wf = _workflow(tmp_path, "gitlab")
    assert wf["stages"] == ["digits"]
    for name in ("fxstab-digits", "fxstab-history"):
        job = wf[name]
        assert job["stage"] == "digits" and job["image"].startswith("python:")
        assert isinstance(job["script"], list) and job["rules"]
        assert job["before_script"][-1] == "python -m pip install fxstab"
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
        ci.workflow("jenkins")


@pytest.mark.slow
def test_the_workflows_steps_on_two_commits(tmp_path, monkeypatch):
    """Run the generated workflow's own shell steps on a sample repository: a push to main
    keeps the first commit's maps in the history branch; a pull request whose change feeds the
    standardization offset inputs fails the gate, says where in the summary, and writes the
    pages and the history page (the branch's commit and the change)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "model.py").write_text(_MODEL.format(offset=0.0))
    (repo / "pyproject.toml").write_text(_SETTINGS)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "first")
    base = _git(repo, "rev-parse", "HEAD")
    monkeypatch.chdir(repo)
    assert main(["ci", "init", "github"]) == 0
    wf = yaml.safe_load((repo / ci.KINDS["github"]).read_text())
    steps = {s.get("id"): s for job in wf["jobs"].values() for s in job["steps"]}

    # `fxstab` on PATH, as the workflow's install step leaves it
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "fxstab").write_text(f"#!/bin/sh\nexec {sys.executable} -m fxstab \"$@\"\n")
    (bindir / "fxstab").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}",
               GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GITHUB_OUTPUT=str(tmp_path / "gh_output"),
               GITHUB_STEP_SUMMARY=str(tmp_path / "gh_summary"))

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
