import pytest

from fxstab.monitor import Mode, MonitorConfig, StabilityMonitor


@pytest.mark.parametrize("kwargs, match", [
    ({"k": 1}, r"k \(replicas per check\) must be an integer >= 2, got 1"),
    ({"k": 2.5}, r"k .* got 2.5"),
    ({"screen_k": 1}, "screen_k must be an integer >= 2, got 1"),
    ({"k": 3, "screen_k": 4}, "screen_k must be at most k .* got screen_k=4 and k=3"),
    ({"period": 0}, "period must be an integer >= 1, got 0"),
    ({"beta": 1.0}, r"beta must be in \[0.0, 1.0\), got 1.0"),
    ({"beta": -0.1}, "beta must be in"),
    ({"tau_warn": 0.0}, "tau_warn must be in"),
    ({"tau_warn": 0.5, "tau_safe": 0.1}, "tau_safe must be larger than tau_warn"),
    ({"recheck": 0}, "recheck must be an integer >= 1"),
    ({"projection_dim": 0}, "projection_dim must be an integer >= 1"),
    ({"estimator": "sketch"}, "estimator must be one of"),
    ({"format": "bf17"}, "format: unknown format 'bf17'"),
    ({"families": ("linear", "gemm")}, r"unknown operator families \['gemm'\]"),
    ({"families": "linear"}, "families must be a sequence"),
    ({"stable_dtype": "fp16"}, "stable_dtype must be one of"),
    ({"hysteresis": 0.0}, "hysteresis must be in"),
    ({"seed": 1.5}, "seed must be an int"),
    ({"promote": "yes"}, "promote must be True or False"),
])
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MonitorConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        StabilityMonitor(**kwargs)


def test_config_is_frozen_and_resolves_format():
    cfg = MonitorConfig(format="bfloat16")
    assert cfg.fmt.name == "bf16" and cfg.unit_roundoff == 2.0 ** -8
    with pytest.raises(AttributeError):
        cfg.k = 8  # type: ignore[misc]


def test_mode_parse():
    assert Mode.parse("fp32") is Mode.FP32_ACCUMULATION
    assert Mode.parse("STABLE_KERNEL") is Mode.STABLE_KERNEL
    with pytest.raises(ValueError, match="unknown monitor mode 'fast'"):
        Mode.parse("fast")


@pytest.mark.parametrize("thresholds, match", [
    ({"linear": (0.1, 0.05)}, r"thresholds\['linear'\]: tau_safe must be larger than tau_warn"),
    ({"linear": (0.0, 0.05)}, r"thresholds\['linear'\] tau_warn must be in"),
    ({"linear": 0.1}, "thresholds entries must be family -> \\(tau_warn, tau_safe\\)"),
    ([("linear", 0.1, 1.0), ("linear", 0.2, 2.0)], "family 'linear' given twice"),
    ("linear", "thresholds must map family"),
])
def test_bad_family_thresholds_are_rejected(thresholds, match):
    with pytest.raises(ValueError, match=match):
        MonitorConfig(thresholds=thresholds)


def test_family_thresholds_override_the_global_pair():
    cfg = MonitorConfig(tau_warn=0.05, tau_safe=0.5,
                        thresholds={"softmax": (0.003, 0.03), "linear": [0.01, 0.1]})
    assert cfg.thresholds == (("linear", 0.01, 0.1), ("softmax", 0.003, 0.03))
    assert cfg.thresholds_for("softmax") == (0.003, 0.03)
    assert cfg.thresholds_for("norm") == (0.05, 0.5)
    with pytest.raises(ValueError, match="watch_every must be an integer >= 1"):
        MonitorConfig(watch_every=0)
