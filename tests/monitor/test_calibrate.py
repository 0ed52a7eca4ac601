"""Calibration (issue 7): per-family thresholds from clean vs injected dispersions."""

import dataclasses
import math

import pytest
import torch

from fxstab.monitor import inject
from fxstab.monitor import StabilityMonitor, choose_thresholds, op_family


def test_op_family_of_names_kinds_and_registered_ops():
    inject.naive_softmax(torch.nn.Sequential(torch.nn.Softmax(-1)), "0")  # registers it
    assert op_family("blocks.0.attn/matmul#1") == "matmul"
    assert op_family("linear") == "linear"
    assert op_family("blocks.1.attn.softmax/inject_naive_softmax#0") == "softmax"
    StabilityMonitor().register("calib_test_op", lambda x: x)
    assert op_family("m/calib_test_op#0") == "calib_test_op"  # no family: its own
    StabilityMonitor().register("calib_test_norm", lambda x: x, family="norm")
    assert op_family("m/calib_test_norm#0") == "norm"
    with pytest.raises(ValueError, match="family must be a non-empty string"):
        StabilityMonitor().register("calib_bad", lambda x: x, family="")


def test_per_family_rule():
    clean = {"a/matmul#0": [0.0045, 0.0059], "a/softmax#0": [0.0013, 0.0012],
             "a/linear#0": [0.0044], "a/layer_norm#0": [0.0036]}
    injected = {"b/softmax#0": [0.0068, 0.0085], "c/linear#0": [0.018],
                "d/layer_norm#0": [math.inf]}
    cal = choose_thresholds(clean, injected, family=op_family, margin=2.0, safe_ratio=10.0)
    # One global pair: the injected softmax (0.0068) sits x1.15 above the clean matmul.
    assert cal.separation == pytest.approx(0.0068 / 0.0059)
    fam = {f.family: f for f in cal.families}
    assert set(fam) == {"matmul", "softmax", "linear", "norm"} and cal.separated
    assert fam["softmax"].separation == pytest.approx(0.0068 / 0.0013)
    assert fam["softmax"].rule == "midpoint"
    assert fam["softmax"].tau_warn == pytest.approx(math.sqrt(0.0068 * 0.0013))
    assert fam["linear"].tau_warn == pytest.approx(math.sqrt(0.0044 * 0.018))
    # no injected operator (matmul) or only overflowing ones (norm): margin above clean
    assert (fam["matmul"].rule, fam["matmul"].tau_warn) == ("margin", pytest.approx(0.0118))
    assert (fam["norm"].rule, fam["norm"].tau_warn) == ("margin", pytest.approx(0.0072))
    assert fam["norm"].n_injected == 1 and math.isinf(fam["norm"].min_injected)
    assert cal.thresholds["softmax"] == (fam["softmax"].tau_warn, 10 * fam["softmax"].tau_warn)
    assert "softmax" in str(cal)
    # a quiet family with nothing injected of its own is never flagged below the mildest
    # instability seen anywhere (here the injected softmax at 0.0068)
    quiet = choose_thresholds({**clean, "a/matmul#0": [0.003]}, injected, family=op_family)
    qm = {f.family: f for f in quiet.families}["matmul"]
    assert (qm.rule, qm.tau_warn) == ("floor", pytest.approx(0.0068))
    # overlap inside a family is reported, and falls back to the margin rule
    bad = choose_thresholds(clean, {"b/softmax#0": [0.001]}, family=op_family)
    assert not bad.separated
    assert {f.family: f.rule for f in bad.families}["softmax"] == "margin"
    with pytest.raises(ValueError, match="needs clean scores as a mapping"):
        choose_thresholds([0.1], {"b/softmax#0": [0.2]}, family=op_family)


def _measure(tiny_cls, batch, setup=None, steps=3, seed=0):
    torch.manual_seed(0)
    model = tiny_cls().to(torch.bfloat16)
    h = setup(model) if setup else None
    mon = StabilityMonitor(promote=False, seed=seed)
    w = mon.wrap(model)
    for _ in range(steps):
        mon.sweep()
        w(batch)
        mon.step()
    ms = mon.measurements()
    return ms if h is None else {n: v for n, v in ms.items() if h.matches(n)}


def _softmax4(m):
    return inject.naive_softmax(m, "attn.softmax", 4.0)


def _fp16_64(m):
    return inject.fp16_accumulation(m, "fc1", 64.0)


def test_per_family_thresholds_detect_what_one_global_pair_cannot(tiny_cls, batch):
    clean = _measure(tiny_cls, batch)
    injected = {**_measure(tiny_cls, batch, _softmax4), **_measure(tiny_cls, batch, _fp16_64)}
    per_family = StabilityMonitor()
    cal = per_family.calibrate(clean, injected)
    # In this model a naive softmax at temperature 4 disperses less than a clean attention
    # matmul (S ~ 0.0048 vs 0.0052), so no single threshold separates them ...
    assert cal.separation < 1
    # ... while within the softmax family it is x2 above the clean softmax.
    fam = {f.family: f for f in cal.families}
    assert cal.separated and fam["softmax"].separation > 1.5 and fam["linear"].separation > 2
    assert per_family.config.thresholds_for("softmax") == (fam["softmax"].tau_warn,
                                                           fam["softmax"].tau_safe)
    single = StabilityMonitor()
    single.calibrate(clean, injected, per_family=False)
    assert single.config.thresholds == ()

    def promoted(cfg, setup):
        torch.manual_seed(0)
        model = tiny_cls().to(torch.bfloat16)
        if setup:
            setup(model)
        mon = StabilityMonitor(dataclasses.replace(cfg, seed=1))  # not calibration's draws
        w = mon.wrap(model)
        for _ in range(4):
            mon.sweep()
            w(batch)
            mon.step()
        return mon.ever_promoted

    assert promoted(per_family.config, None) == []
    assert promoted(per_family.config, _softmax4) == ["attn.softmax/inject_naive_softmax#0"]
    assert promoted(per_family.config, _fp16_64) == ["fc1/inject_fp16acc_linear#0"]
    assert promoted(single.config, None) == []
    assert promoted(single.config, _softmax4) == []  # the global pair misses it
