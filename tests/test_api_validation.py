"""The API says what it skipped (issue 41, item 6): digit_map() warns once below 90% coverage
with the reasons and the fix, select= rejects names that would select nothing and takes
"all" as "*", and formats=/accumulate=/gemm_inputs= patterns that match no operator warn with
the closest names."""

from __future__ import annotations

import textwrap
import warnings

import pytest
import torch
import torch.nn as nn

import fxstab
from fxstab.backend import CoverageWarning, PatternWarning
from fxstab.capture.opsets import FAMILIES
from models import MLP

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Special(nn.Module):
    """MLP, then operators outside the families (cos, erfinv, logcumsumexp, fft): the default
    analyses them all (issue 54); a selection of the families leaves 4 of its 13 counted
    floating operators "not selected" (69%)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp(x)
        s = torch.erfinv(torch.tanh(h) * 0.5) + torch.logcumsumexp(h, -1)
        return torch.cos(s) + torch.fft.rfft(h, n=6).abs()


# the families alone (and custom operators): the default before issue 54
FAMILIES_ONLY = sorted(FAMILIES) + ["custom"]


def analyse(model, *inputs, **options):
    torch.manual_seed(0)
    be = fxstab.backend(**options)
    torch.compile(model, backend=be)(*inputs)
    return be


def caught(fn, category=Warning) -> list:
    """The warnings of ``category`` that ``fn()`` raises, every one (no 'once' filtering)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return [w for w in seen if issubclass(w.category, category)]


# --------------------------------------------------------------------------- coverage warning
def test_the_default_analyses_every_floating_function_that_does_arithmetic():
    be = analyse(Special(), torch.randn(4, 16))
    assert be.coverage().fraction == 1.0 and caught(be.digit_map) == []
    assert {"cos", "erfinv", "logcumsumexp", "fft_rfft"} <= {r.kind for r in be.reports}


def test_digit_map_warns_once_below_90_percent_with_the_reasons_and_the_fix():
    be = analyse(Special(), torch.randn(4, 16), select=FAMILIES_ONLY)
    # analysed: 3 linears, gelu, tanh, mul, 2 adds, and abs of the spectrum... (relu is exact)
    assert be.coverage().fraction == pytest.approx(9 / 13)
    first = caught(be.digit_map, CoverageWarning)
    assert len(first) == 1
    message = str(first[0].message)
    assert "\n" not in message  # one clean line
    assert message.startswith("fxstab: only 9 of the 13 floating operators (69%) were analysed")
    # the top reason, with the kinds it left out, and the fix
    assert "4 x not selected (cos, erfinv, fft_rfft, logcumsumexp)" in message
    assert 'Fix: select="*" analyses the operator kinds left "not selected"' in message
    assert first[0].filename == __file__  # points at the user's call, not at fxstab
    assert issubclass(CoverageWarning, UserWarning)
    # once per backend: neither a second map nor the table says it again
    assert caught(be.digit_map, CoverageWarning) == []
    assert caught(be.table, CoverageWarning) == []


def test_the_coverage_warning_points_at_the_users_line_through_table():
    be = analyse(Special(), torch.randn(4, 16), select=FAMILIES_ONLY)
    seen = caught(be.table, CoverageWarning)
    assert len(seen) == 1 and seen[0].filename == __file__


def test_the_fix_the_warning_names_analyses_everything_and_silences_it():
    be = analyse(Special(), torch.randn(4, 16), select="*")
    assert be.coverage().fraction == 1.0
    assert caught(be.digit_map) == []
    assert {"cos", "erfinv", "logcumsumexp", "fft_rfft"} <= {r.kind for r in be.reports}


def test_no_coverage_warning_at_or_above_90_percent():
    be = analyse(MLP(), torch.randn(4, 16))
    assert be.coverage().fraction == 1.0
    assert caught(be.digit_map) == []


def test_record_names_the_fix_and_says_the_coverage_once(tmp_path, monkeypatch, capsys):
    from fxstab.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text(textwrap.dedent("""
        import torch

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(8, 8)

            def forward(self, x):
                return torch.sinh(self.fc(x)) + 0 * torch.cos(x)  # linear, mul, add analysed

        def build():
            return Model(), (torch.randn(4, 8),)
    """))
    (tmp_path / "fxstab.toml").write_text(f"select = {FAMILIES_ONLY!r}\n".replace("'", '"'))
    seen = caught(lambda: main(["record", "t.py:build", "-o", "m.json"]))
    err = capsys.readouterr().err
    assert "warning: only 3 of the model's 5 floating operators (60%) were analysed" in err
    assert '  fix: select = "*" (the settings file' in err
    assert "analyses the operator kinds left \"not selected\"" in err
    # record's own lines say it: no Python warning besides
    assert [w for w in seen if issubclass(w.category, CoverageWarning)] == []


# --------------------------------------------------------------------------- select=
@pytest.mark.parametrize("select", [
    "fft_rfft", "erfinv", "logcumsumexp", "linalg_solve", "grid_sample", "special_erfinv",
    "softmax", "add_", "apply", "custom", "all", "*", "blocks.*", "fc1/linear", "[ab]*",
    ["linear", "norm", "erfinv"], *sorted(FAMILIES),
])
def test_select_accepts_kinds_families_globs_and_torch_function_names(select):
    assert fxstab.backend(select=select).config.select == select


@pytest.mark.parametrize("select, bad", [
    ("bogus_kind", "bogus_kind"),
    (["linear", "bogus_kind"], "bogus_kind"),
    ("fc1", "fc1"),  # a module path without a glob: "fc1.*" or "fc1/*" selects its operators
])
def test_select_rejects_names_that_would_select_nothing(select, bad):
    with pytest.raises(ValueError, match=f"select: '{bad}' is no operator kind, family or "
                                         f"pattern") as info:
        fxstab.backend(select=select)
    message = str(info.value)
    assert all(family in message for family in FAMILIES)  # lists the families
    assert "'all' or '*' (every operator)" in message


def test_a_misspelt_kind_is_rejected_with_the_closest_names():
    with pytest.raises(ValueError, match=r"did you mean 'softmax'"):
        fxstab.backend(select="softmx")


def test_select_all_is_every_operator_as_star():
    star = analyse(Special(), torch.randn(4, 16), select="*")
    every = analyse(Special(), torch.randn(4, 16), select="all")
    assert [i.instrumented for i in every.infos] == [i.instrumented for i in star.infos]
    default = analyse(Special(), torch.randn(4, 16))
    assert len(every.infos[0].instrumented) > len(default.infos[0].instrumented)


def test_a_kind_fxstab_has_no_table_entry_for_is_analysed_when_selected():
    be = analyse(Special(), torch.randn(4, 16), select=["erfinv", "fft_rfft"])
    assert {r.kind for r in be.reports} == {"erfinv", "fft_rfft"}


# --------------------------------------------------------------------------- patterns
def test_a_formats_pattern_that_matches_no_operator_warns_once_with_the_closest_names():
    be = analyse(MLP(), torch.randn(4, 16), format="bf16",
                 formats={"fc1/linaer#0": "fp32", "fc2/linear#0": "fp32", "head/*": "fp16",
                          "nosuch/op#0": "fp32"})
    seen = caught(be.digit_map, PatternWarning)
    messages = [str(w.message) for w in seen]
    assert len(messages) == 2, messages  # the exact name and the glob that match are not
    assert messages[0].startswith("fxstab: formats={'fc1/linaer#0': ...} matches no analysed "
                                  "operator of the model")
    assert "the closest: fc1/linear#0" in messages[0]
    assert "formats={'nosuch/op#0': ...}" in messages[1]
    assert all(w.filename == __file__ and issubclass(w.category, UserWarning) for w in seen)
    assert caught(be.digit_map, PatternWarning) == []  # once per pattern


def test_a_kind_as_a_formats_key_warns_that_keys_are_names():
    be = analyse(MLP(), torch.randn(4, 16), formats={"linear": "fp32"})
    (w,) = caught(be.digit_map, PatternWarning)
    assert "formats= keys are operator names" in str(w.message)


def test_gemm_patterns_warn_unless_a_role_star_or_a_matching_kind_name_or_glob():
    acc = fxstab.Accumulation("fp16", 16, rounding="random")
    be = analyse(MLP(), torch.randn(4, 16),
                 accumulate={"fprop": acc, "dgrad": acc, "wgrad": acc, "linear": acc,
                             "fc2/linear": acc, "head/linear#0": acc, "conv2d": acc,
                             "fc3/linear": acc},
                 gemm_inputs={"fc1.*": "fp8_e4m3", "fc1/*": "fp8_e4m3", "*": None})
    messages = [str(w.message) for w in caught(be.digit_map, PatternWarning)]
    assert len(messages) == 3, messages
    assert messages[0].startswith("fxstab: accumulate={'conv2d': ...} matches no analysed")
    assert messages[1].startswith("fxstab: accumulate={'fc3/linear': ...}")
    assert "the closest: fc2/linear#0, fc1/linear#0, head/linear#0" in messages[1]
    assert "its operators are named like fc1/linear#0" in messages[0]  # nothing close
    # a glob over "module.path/kind": "fc1.*" matches no such name (fc1's is "fc1/linear")
    assert messages[2].startswith("fxstab: gemm_inputs={'fc1.*': ...}")
    assert "the closest: fc1/linear#0" in messages[2]


def test_one_accumulator_for_every_gemm_is_never_warned_about():
    be = analyse(MLP(), torch.randn(4, 16),
                 accumulate=fxstab.Accumulation("fp16", 16, rounding="random"))
    assert caught(be.digit_map) == []


def test_the_activation_family_holds_logsigmoid_as_dynamo_names_it():
    class LogSigmoid(nn.Module):  # F.logsigmoid is captured as kind "log_sigmoid"
        def forward(self, x):
            return torch.nn.functional.logsigmoid(x)

    be = analyse(LogSigmoid(), torch.randn(4, 8), select="activation")
    assert [r.kind for r in be.reports] == ["log_sigmoid"]
