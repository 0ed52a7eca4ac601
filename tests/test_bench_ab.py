"""benchmarks/bench_ab.py: another revision of fxstab loaded beside the checkout's."""

import json
import sys

import pytest

from benchmarks import bench_ab


@pytest.fixture
def clean_ref_modules():
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == bench_ab.REF_PACKAGE]:
        del sys.modules[name]


def test_reference_is_a_separate_package(tmp_path, clean_ref_modules):
    import fxstab

    ref = bench_ab.load_ref(bench_ab.extract_ref(str(bench_ab.ROOT), tmp_path))
    assert ref is not fxstab and ref.backend is not fxstab.backend
    # its own modules, reading its own kernel source from the copy
    assert sys.modules["fxstab_ref.cpu.bindings"] is not sys.modules["fxstab.cpu.bindings"]
    ref_build = sys.modules["fxstab_ref.cpu.build"]
    assert ref_build is not sys.modules["fxstab.cpu.build"]
    assert str(ref_build.SOURCE).startswith(str(tmp_path))
    assert ref_build.SOURCE.read_bytes() == fxstab.cpu.build.SOURCE.read_bytes()


def test_times_both_and_writes_the_ratio(tmp_path, capsys, clean_ref_modules):
    out = tmp_path / "results"
    assert bench_ab.main(["--ref", str(bench_ab.ROOT), "--models", "lnsoftmax", "--quick",
                          "--repeats", "2", "--out", str(out)]) == 0
    rows = json.loads((out / "bench_ab_aten.json").read_text())["rows"]
    assert [r["model"] for r in rows] == ["lnsoftmax"]
    assert rows[0]["ref_ms"] > 0 and rows[0]["new_ms"] > 0
    assert rows[0]["new_over_ref"] == pytest.approx(rows[0]["new_ms"] / rows[0]["ref_ms"])
    assert "checkout/ref" in capsys.readouterr().out


def test_bad_reference_and_model_are_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit, match="cannot read fxstab/ at 'no-such-revision'"):
        bench_ab.extract_ref("no-such-revision", tmp_path)
    with pytest.raises(SystemExit, match="holds no fxstab package"):
        bench_ab.extract_ref(str(tmp_path), tmp_path / "x")
    with pytest.raises(SystemExit):
        bench_ab.main(["--ref", "HEAD", "--models", "nope"])
    assert "unknown model(s) nope" in capsys.readouterr().err
