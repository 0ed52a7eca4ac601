"""The Makefile's set-up (issue 56, item 13): `make demo` installs what the demo needs (torch and
fxstab's own dependencies), `make test` adds the test extra; and the demo runs without any
package of that extra."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _dry_run(target: str, venv: Path) -> list:
    """The commands ``make TARGET`` would run for a new environment at ``venv``."""
    # (under `make test` the outer make's MAKELEVEL/MAKEFLAGS make the inner one print its
    # directory: "make[1]: Leaving directory ..." as the last line)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={venv}"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_the_runtime_and_make_test_the_test_extra(tmp_path):
    demo = _dry_run("demo", tmp_path / "env")
    installs = [ln for ln in demo if " pip install " in ln]
    assert installs[-2:] == [f"{tmp_path / 'env'}/bin/python -m pip install -q torch==2.13.0",
                             f"{tmp_path / 'env'}/bin/python -m pip install -q -e ."], demo
    assert not any("[test]" in ln for ln in demo), demo
    assert demo[-1] == f"{tmp_path / 'env'}/bin/fxstab demo"
    test = _dry_run("test", tmp_path / "env")
    assert any(ln.endswith("pip install -q -e '.[test]'") for ln in test), test
    assert test[-1].endswith("-m pytest -q -p no:cacheprovider")


# Every package of the test extra that the runtime does not itself require (its requirements'
# closure: sympy needs mpmath, say) is made unimportable, as in an environment without it.
_WITHOUT_THE_TEST_EXTRA = textwrap.dedent("""
    import importlib.metadata as md, re, sys
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    data = tomllib.load(open(sys.argv[1], "rb"))

    def name(req):
        return re.split(r"[<>=!~;\\\\[ ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")

    def closure(names):
        seen, todo = set(), list(names)
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                try:
                    todo += [name(r) for r in md.requires(n) or () if "extra ==" not in r]
                except md.PackageNotFoundError:
                    pass
        return seen

    runtime = closure({name(r) for r in data["project"]["dependencies"]} | {"torch"})
    extra = {name(r) for r in data["project"]["optional-dependencies"]["test"]} - runtime
    for mod, dists in md.packages_distributions().items():
        if any(d.lower().replace("_", "-") in extra for d in dists):
            sys.modules[mod] = None  # as if not installed: import fails, find_spec says None
    assert "triton" in extra and sys.modules["matplotlib"] is None
    from fxstab.cli import main
    sys.exit(main(["demo"]))
""")


def test_the_demo_runs_without_the_test_extra(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_THE_TEST_EXTRA,
                           str(REPO / "pyproject.toml")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NaN/inf first appear at" in proc.stdout, proc.stdout[-2000:]
