"""benchmarks/maps_ab.py: two revisions' digit maps compared field for field."""

import math

from benchmarks import bench_ab, maps_ab


def test_compare_finds_every_field_that_differs():
    a = {"operators": [{"name": "fc/linear#0", "avg": 2.0, "counters": {"cancellation": 1},
                        "inputs": ["x"], "nan": math.nan}], "metadata": {"format": "bf16"}}
    n, bad, worst = maps_ab.compare(a, a)
    assert (n, bad, worst) == (6, [], 0.0)  # NaN equals NaN
    b = {"operators": [{"name": "fc/linear#0", "avg": 1.5, "counters": {"cancellation": 2},
                        "inputs": ["y"], "nan": math.nan}], "metadata": {"format": "fp16",
                                                                         "seed": 0}}
    n, bad, worst = maps_ab.compare(a, b)
    assert bad == ["/metadata/format", "/metadata/seed (only in head)",
                   "/operators[0]/avg", "/operators[0]/counters/cancellation",
                   "/operators[0]/inputs[0]"]
    assert math.isinf(worst)  # a string that differs has no size
    _, bad, worst = maps_ab.compare({"ops": [1.0, 2.0]}, {"ops": [1.0, 2.25]})
    assert bad == ["/ops[1]"] and worst == 0.25


def test_the_checkout_against_itself_is_equal(capsys):
    assert maps_ab.main(["--ref", str(bench_ab.ROOT), "--cases", "mlp/op"]) == 0
    out = capsys.readouterr().out
    assert "every map equal field for field" in out and "mlp/op/backward" in out
