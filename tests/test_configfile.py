"""The settings file (fxstab/configfile.py): ``[tool.fxstab]`` of pyproject.toml or
fxstab.toml, validated with errors that name the file, the key and the value; read by the CLI
(flags override it) and giving fxstab.backend its options."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch

import fxstab
from fxstab import configfile
from fxstab.cli import main
from fxstab.configfile import ConfigError
from fxstab.digitmap import DigitMap

from test_cli import ShadowBackend, write_map  # the stand-in backend of the CLI's tests

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "examples" / "ci" / "target.py"


@pytest.fixture
def stand_in_backend(monkeypatch):
    ShadowBackend.instances.clear()
    monkeypatch.setattr(fxstab, "backend", ShadowBackend, raising=False)
    yield ShadowBackend
    torch._dynamo.reset()


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def test_pyproject_table_is_found_from_a_subfolder_and_read(tmp_path):
    _write(tmp_path, "pyproject.toml", """
        [project]
        name = "mine"

        [tool.fxstab]
        format = "fp16"
        n_samples = 4
        seed = 7
        select = ["linear", "blocks.*"]
        formats = { "head/softmax#0" = "fp32" }
        accumulate = "fp16"
        accumulate_rounding = "random"
        gemm_inputs = [4, 3]
        gemm_scaling = "row"

        [tool.fxstab.gate]
        max_drop = 0.25
        metric = "p10"

        [tool.fxstab.targets.mlp]
        target = "examples/ci/target.py:build"
        output = "digits/mlp.json"
        kwargs = { width = 64 }
        format = "bf16"
        calls = 2
    """)
    sub = tmp_path / "src" / "deep"
    sub.mkdir(parents=True)
    assert configfile.find(sub) == tmp_path / "pyproject.toml"
    cfg = configfile.load(sub)
    assert cfg.path == tmp_path / "pyproject.toml"
    assert cfg.gate == {"max_drop": 0.25, "metric": "p10"}
    t = cfg.target("mlp")
    assert (t.target, t.output, t.kwargs, t.calls, t.options) == (
        "examples/ci/target.py:build", "digits/mlp.json", {"width": 64}, 2, {"format": "bf16"})
    opts = cfg.backend_options(seed=1, n_samples=None)  # None: not given, the file's stays
    assert opts["seed"] == 1 and opts["n_samples"] == 4 and opts["format"] == "fp16"
    assert opts["gemm_inputs"] == (4, 3) and "accumulate_rounding" not in opts
    acc = opts["accumulate"]
    assert isinstance(acc, fxstab.Accumulation) and acc.rounding.value == "random"
    # the options are fxstab.backend's own: it takes them as they are
    be = fxstab.backend(**opts)
    assert be.config.n_samples == 4 and be.config.seed == 1


def test_fxstab_toml_comes_first_and_a_pyproject_without_the_table_is_passed_by(tmp_path):
    _write(tmp_path, "pyproject.toml", '[project]\nname = "x"\n')
    assert configfile.find(tmp_path) is None and configfile.load(tmp_path).path is None
    _write(tmp_path, "fxstab.toml", 'format = "fp8_e4m3"\n')
    cfg = configfile.load(tmp_path)
    assert cfg.path == tmp_path / "fxstab.toml" and cfg.analysis == {"format": "fp8_e4m3"}
    assert configfile.load(search=False).path is None


@pytest.mark.parametrize("text, key, value", [
    ('format = "fp99"', "format", "'fp99'"),
    ("n_samples = 1", "n_samples", "1"),
    ('n_samples = "3"', "n_samples", "'3'"),
    ('rounding = "sideways"', "rounding", "'sideways'"),
    ("confidence = 1.5", "confidence", "1.5"),
    ("format = [5, 2, 1]", "format", "[5, 2, 1]"),
    ('colour = "red"', "colour", "'red'"),
    ('accumulate = "fp9"', "accumulate", "'fp9'"),
    ('accumulate_rounding = "random"', "accumulate_rounding", "'random'"),
    ("[gate]\nmax_drop = -1", "gate.max_drop", "-1"),
    ('[gate]\nmetric = "median"', "gate.metric", "'median'"),
    ('[gate]\nthreshold = 1', "gate.threshold", "1"),
    ('[targets.a]\noutput = "a.json"', "targets.a.target", "missing"),
    ('[targets.a]\ntarget = "a.py"\noutput = "a.json"', "targets.a.target", "'a.py'"),
    ('[targets.a]\ntarget = "a.py:f"\noutput = "a.txt"', "targets.a.output", "'a.txt'"),
    ('[targets.a]\ntarget = "a.py:f"\noutput = "a.json"\nformat = "fp99"',
     "targets.a.format", "'fp99'"),
    ('[targets.a]\ntarget = "a.py:f"\noutput = "a.json"\nkwargs = 3', "targets.a.kwargs", "3"),
])
def test_a_bad_value_names_the_file_the_key_and_the_value(tmp_path, text, key, value):
    path = _write(tmp_path, "fxstab.toml", text + "\n")
    with pytest.raises(ConfigError) as info:
        configfile.load(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: {key}: ") and value in msg, msg
    # in pyproject.toml the key is named with its table
    _write(tmp_path, "pyproject.toml", "[tool.fxstab]\n" + re.sub(r"^\[", "[tool.fxstab.", text,
                                                                flags=re.M) + "\n")
    with pytest.raises(ConfigError, match=rf"pyproject\.toml: tool\.fxstab\.{key}: "):
        configfile.load(tmp_path / "pyproject.toml")


def test_a_pyproject_that_does_not_parse_is_named_with_its_line_and_column(
        tmp_path, monkeypatch, capsys):
    """Issue 56, item 6: a broken pyproject.toml was passed by in silence and the run took the
    defaults. One with [tool.fxstab] is an error, one without a warning; both name the file,
    the line and the column."""
    py = _write(tmp_path, "pyproject.toml", """\
        [tool.fxstab]
        format = "fp16"
        seed = = 1
    """)
    with pytest.raises(ConfigError) as info:
        configfile.load(tmp_path)
    assert str(info.value).startswith(f"{py}: (file): not valid TOML: ")
    assert "line 3, column" in str(info.value)
    monkeypatch.chdir(tmp_path)
    assert main(["record"]) == 2  # as a user meets it: not "no [targets] configured"
    err = capsys.readouterr().err
    assert f"{py}: (file): not valid TOML" in err and "line 3" in err, err
    # another tool's broken file: passed by, with a warning that says where
    _write(tmp_path, "pyproject.toml", '[project]\nname = "x"\nversion = 1.0.0\n')
    with pytest.warns(configfile.ConfigWarning, match=r"pyproject\.toml: skipped: not valid "
                                                       r"TOML: .*line 3, column"):
        assert configfile.find(tmp_path) is None
    assert main(["record"]) == 2  # no target anywhere; the file passed by is said first
    err = capsys.readouterr().err
    assert err.startswith(f"fxstab record: warning: {py}: skipped: not valid TOML"), err


def test_unreadable_files_are_errors_too(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        configfile.load(tmp_path / "absent.toml")
    bad = _write(tmp_path, "fxstab.toml", "format = \n")
    with pytest.raises(ConfigError, match=r"fxstab\.toml: \(file\): not valid TOML"):
        configfile.load(bad)
    py = _write(tmp_path, "pyproject.toml", "[project]\nname = 'x'\n")
    with pytest.raises(ConfigError, match=r"no \[tool\.fxstab\] table"):
        configfile.load(py)
    with pytest.raises(ConfigError, match="no such target; configured: none"):
        configfile.load(search=False).target("x")


def test_record_reads_the_file_and_flags_override_it(tmp_path, monkeypatch, capsys,
                                                     stand_in_backend):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "fxstab.toml", """
        format = "fp16"
        n_samples = 4
        seed = 3
    """)
    assert main(["record", f"{TARGET}:build", "-o", "a.json"]) == 0
    assert stand_in_backend.instances[-1].options == dict(
        granularity="op", format="fp16", n_samples=4, seed=3, rounding="random",
        confidence=0.95)
    assert main(["record", f"{TARGET}:build", "-o", "b.json", "--n-samples", "5",
                 "--format", "bf16"]) == 0
    opts = stand_in_backend.instances[-1].options
    assert (opts["format"], opts["n_samples"], opts["seed"]) == ("bf16", 5, 3)
    assert DigitMap.load(tmp_path / "b.json").metadata["n_samples"] == 5
    # --config names another file; a broken one is exit 2 with file, key and value
    other = _write(tmp_path, "other.toml", "seed = 11\n")
    assert main(["record", f"{TARGET}:build", "-o", "c.json", "--config", str(other)]) == 0
    assert stand_in_backend.instances[-1].options["seed"] == 11
    capsys.readouterr()
    broken = _write(tmp_path, "broken.toml", 'rounding = "sideways"\n')
    assert main(["record", f"{TARGET}:build", "-o", "d.json", "--config", str(broken)]) == 2
    err = capsys.readouterr().err
    assert f"{broken}: rounding: bad value 'sideways'" in err and not Path("d.json").exists()


def test_record_without_a_target_records_every_configured_one(tmp_path, monkeypatch, capsys,
                                                              stand_in_backend):
    monkeypatch.chdir(tmp_path)
    # (not models.py: a target file's module stays imported, and tests/models.py is "models"
    # to the tests that run after this one, DDP's spawned workers included)
    (tmp_path / "toy_target.py").write_text(textwrap.dedent("""
        import torch

        def build(width=4, offset=0.0):
            return torch.nn.Linear(width, width), (torch.randn(2, width) + offset,)
    """))
    _write(tmp_path, "fxstab.toml", """
        seed = 1

        [targets.small]
        target = "toy_target.py:build"
        output = "maps/small.json"

        [targets.wide]
        target = "toy_target.py:build"
        output = "maps/wide.json"
        kwargs = { width = 16 }
        format = "fp16"
    """)
    sub = tmp_path / "elsewhere"
    sub.mkdir()
    monkeypatch.chdir(sub)  # outputs are relative to the file, not to the current folder
    assert main(["record", "--config", str(tmp_path / "fxstab.toml")]) == 0
    small, wide = (DigitMap.load(tmp_path / "maps" / f"{n}.json") for n in ("small", "wide"))
    assert small.metadata["format"] == "bf16" and wide.metadata["format"] == "fp16"
    assert small.metadata["target_name"] == "small"
    # the kwargs reached the build function: the wide target's linear is 16 wide
    assert {tuple(op.shape) for op in small.operators.values()} == {(2, 4)}
    assert {tuple(op.shape) for op in wide.operators.values()} == {(2, 16)}
    # one configured target by name, into --output-dir
    monkeypatch.chdir(tmp_path)
    assert main(["record", "wide", "--output-dir", "out"]) == 0
    assert DigitMap.load(tmp_path / "out" / "wide.json").metadata["target_name"] == "wide"
    capsys.readouterr()
    assert main(["record", "absent"]) == 2
    assert "targets.absent: no such target; configured: small, wide" in capsys.readouterr().err
    assert main(["record", "-o", "one.json"]) == 2
    assert "use --output-dir DIR" in capsys.readouterr().err


def test_diff_takes_its_gate_from_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = write_map(tmp_path / "base.json", {"a/linear#0": 2.4, "b/gelu#0": 2.0})
    head = write_map(tmp_path / "head.json", {"a/linear#0": 2.4, "b/gelu#0": 1.7})
    assert main(["diff", str(base), str(head)]) == 0  # 0.3 digits: within the default 0.5
    _write(tmp_path, "fxstab.toml", "[gate]\nmax_drop = 0.2\n")
    assert main(["diff", str(base), str(head)]) == 1  # the file's threshold
    assert main(["diff", str(base), str(head), "--max-drop", "0.5"]) == 0  # the flag wins
    assert "lost more than 0.2" in capsys.readouterr().out


def test_the_backend_reads_a_settings_file_under_its_arguments(tmp_path):
    import fxstab

    path = tmp_path / "fxstab.toml"
    path.write_text('format = "fp16"\nn_samples = 5\nseed = 3\n')
    be = fxstab.backend(config=path, seed=7)  # an argument given wins; the rest is the file's
    assert (be.config.format.name, be.config.n_samples, be.config.seed) == ("fp16", 5, 7)
    (tmp_path / "bad.toml").write_text('format = "fp99"\n')
    with pytest.raises(Exception, match="fp99"):
        fxstab.backend(config=tmp_path / "bad.toml")
