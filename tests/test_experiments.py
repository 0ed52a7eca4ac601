"""The paper-reproduction experiments (issue 18): shared pieces, and each script's quick path on
a tiny slice of the offline data (seconds), checked through its JSON."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import exp_common as xc  # noqa: E402

import fxstab  # noqa: E402

try:
    xc.data_root(None, ["fashion-mnist/t10k-images-idx3-ubyte.gz", "ag_news/test.csv"])
    HAVE_DATA = True
except FileNotFoundError:
    HAVE_DATA = False
needs_data = pytest.mark.skipif(not HAVE_DATA, reason="../shared/data (or $FXSTAB_DATA) missing")

TINY = ["--quick", "--format", "fp32", "--train", "128", "--eval", "32", "--epochs", "1",
        "--max-steps", "1"]


def test_agreement_counts_rows_where_every_sample_agrees():
    det = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    s = det.expand(3, 3, 2).clone()
    assert xc.agreement(det, s) == 1.0
    s[2, 1] = torch.tensor([1.0, 0.0])  # one sample of row 1 flips its class
    assert xc.agreement(det, s) == pytest.approx(2 / 3)


@pytest.mark.parametrize("level", ["op", "aten"])
def test_output_samples_are_the_backends_samples(level):
    """The recorded samples' mean is what output="mean" returns for the same seed and call,
    and the deterministic output is eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x = torch.randn(5, 8)
    out = {}
    for mode in ("deterministic", "mean"):
        torch._dynamo.reset()
        be = fxstab.backend(granularity=level, format="bf16", seed=3, output=mode)
        compiled = torch.compile(model, backend=be)
        with torch.no_grad():
            if mode == "deterministic":
                out[mode] = xc.OutputSamples(be).call(lambda: compiled(x))
            else:
                out[mode] = compiled(x)  # the same call index, hence the same seeds
    det, samples = out["deterministic"]
    assert samples.shape == (3, 5, 3)
    assert torch.equal(det, model(x).detach())
    assert not torch.equal(samples[0], samples[1])  # bf16 rounding separates the samples
    torch.testing.assert_close(samples.mean(0).to(det.dtype), out["mean"], rtol=0, atol=0)
    torch._dynamo.reset()


def test_rank_lowest_and_module_operators():
    from fxstab.digitmap import DigitMap, OperatorDigits

    ops = [OperatorDigits(name=n, kind="add", module_path=p, calls=1, numel=1, avg_digits=d,
                          min_digits=d, max_digits=d)
           for n, p, d in [("a/add#0", "a", 5.0), ("hz/add#0", "hz", 1.0),
                           ("hz.ln/add#0", "hz.ln", 3.0), ("b/add#0", "b", 1.0)]]
    dm = DigitMap(ops)
    assert xc.rank_lowest(dm, "hz/add#0") == 1 and xc.ties(dm, "hz/add#0") == 1
    assert xc.rank_lowest(dm, "hz.ln/add#0") == 3
    assert xc.module_operators(dm, "hz") == ["hz/add#0", "hz.ln/add#0"]
    assert xc.module_output(dm, "hz") == "hz.ln/add#0"
    with pytest.raises(KeyError, match="no recorded operator inside module 'zz'"):
        xc.module_output(dm, "zz")


def _load(out: Path, name: str) -> dict:
    doc = json.loads((out / name).read_text())
    assert {"commit", "torch", "fxstab", "machine"} <= set(doc["environment"])
    assert doc["quick"] is True and doc["settings"]["n_samples"] == 3
    return doc


@needs_data
def test_pathology_quick_path(tmp_path):
    from benchmarks import exp_pathology

    assert exp_pathology.main(TINY + ["--tasks", "fmnist_mlp,agnews", "--out",
                                      str(tmp_path)]) == 0
    doc = _load(tmp_path, "pathology.json")
    rows = doc["rows"]
    keys = {"task", "family", "variant", "hazard", "operator", "avg_digits", "min_digits",
            "agreement", "rank", "accuracy"}
    assert all(keys <= set(r) for r in rows)
    assert {(r["task"], r["family"]) for r in rows} == {
        ("fmnist_mlp", "linear"), ("fmnist_mlp", "norm"), ("fmnist_mlp", "attention"),
        ("agnews", "attention"), ("agnews", "gate")}
    assert len(rows) == 10 and sum(r["hazard"] for r in rows) == 5
    for r in rows:
        assert r["operator"].startswith(("hazard", "attn", "gate"))
        assert 0.0 <= r["min_digits"] <= r["avg_digits"] <= 7.23
        assert 0.0 <= r["agreement"] <= 1.0 and 0.0 <= r["accuracy"] <= 1.0
        assert len(r["series"]["avg"]) == r["steps"] == 1
        assert 0.0 <= r["series"]["batch_accuracy"][0] <= 1.0
    # the localization criterion holds even after one step (digits are arithmetic, not
    # accuracy): every hazard among the 3 lowest and below its control
    assert doc["criteria_failures"] == []
    hz = [r for r in rows if r["hazard"]]
    assert all(r["rank"] <= 3 for r in hz)
    assert (tmp_path / "pathology_digits_fp32.png").is_file()
    assert (tmp_path / "pathology_scatter_fp32.png").is_file()


@needs_data
def test_activations_quick_path(tmp_path):
    from benchmarks import exp_activations

    assert exp_activations.main(TINY + ["--out", str(tmp_path)]) == 0
    rows = _load(tmp_path, "activations.json")["rows"]
    assert [r["activation"] for r in rows] == list(exp_activations.ACTIVATIONS)
    for r in rows:
        assert {"activation", "avg_digits", "min_digits", "accuracy",
                "representative_accuracy"} <= set(r)
        assert r["operator"].startswith("act/")
        assert 0.0 <= r["min_digits"] <= r["avg_digits"] <= 7.23
        assert 0.0 <= r["representative_accuracy"] <= 1.0
    assert (tmp_path / "activations_digits_fp32.png").is_file()


@needs_data
def test_normalization_quick_path(tmp_path):
    from benchmarks import exp_normalization

    assert exp_normalization.main(TINY + ["--out", str(tmp_path)]) == 0
    rows = _load(tmp_path, "normalization.json")["rows"]
    assert [r["norm"] for r in rows] == ["batch", "layer", "rms"]
    for r in rows:
        assert {"norm", "pre_avg_digits", "post_avg_digits", "accuracy"} <= set(r)
        assert r["pre_operator"].startswith("fc1/") and r["post_operator"].startswith("norm/")
        assert all(0.0 < r[k] <= 7.23 and math.isfinite(r[k])
                   for k in ("pre_avg_digits", "post_avg_digits"))
    assert (tmp_path / "normalization_digits_fp32.png").is_file()


def test_missing_data_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="never download"):
        xc.load_fmnist("test", 4, data=tmp_path)
