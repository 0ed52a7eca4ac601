"""The report log (``be.reports``): reports kept as their statistics until read, then built once,
in the order they were made, equal to the reports built at once."""

from __future__ import annotations

import pytest
import torch

import fxstab
from fxstab.records.report import OpReport, ReportLog, row_values, stats_row

from models import GPT2, MLP


def _report(name: str, call: int = 0) -> OpReport:
    return OpReport(name=name, kind="linear", module_path="fc", call=call)


def test_deferred_reports_are_built_once_when_read_in_order():
    log = ReportLog()
    built = []

    def build(row):
        built.append(row)
        return _report(*row)

    defer = log.defer()
    log.append(_report("a"))
    defer((build, ("b", 1)))
    defer((build, ("c", 2)))
    assert len(log) == 3 and not built  # counted, not built
    assert [r.name for r in log] == ["a", "b", "c"]
    assert built == [("b", 1), ("c", 2)]
    first = log[1]
    assert log[1] is first and len(built) == 2  # kept: built once
    log.append(_report("d"))
    defer((build, ("e", 3)))
    assert [r.name for r in log[-2:]] == ["d", "e"]  # an append after deferred ones: in order
    del log[1:3]
    assert [r.name for r in log] == ["a", "d", "e"]
    assert log == [_report("a"), _report("d"), _report("e", 3)]
    assert list(log) == log
    log.clear()
    assert len(log) == 0 and list(log) == []


def test_many_reports_deferred_in_one_entry_count_and_keep_their_place():
    log = ReportLog()
    defer = log.defer()
    built = []

    def build_many(rows):
        built.append(rows)
        return [_report(name) for name in rows]

    defer((lambda row: _report(row), "a"))
    log.defer_many(build_many, ("b", "c", "d"), 3)
    log.defer_many(build_many, (), 0)  # nothing: no entry
    defer((lambda row: _report(row), "e"))
    assert len(log) == 5 and not built
    assert [r.name for r in log] == ["a", "b", "c", "d", "e"] and built == [("b", "c", "d")]
    log.defer_many(build_many, ("f", "g"), 2)
    assert len(log) == 7 and [r.name for r in log[-3:]] == ["e", "f", "g"]
    log.defer_many(build_many, ("h",), 1)
    log.clear()
    assert len(log) == 0 and list(log) == []


def test_rows_copy_kernel_buffers_and_keep_every_value():
    """A CPU kernel's statistics buffer is overwritten by its next call: the row keeps a copy;
    a list row round-trips exactly (NaN, infinities, -0, numel as an int) and gives the same
    report as the list itself."""
    import ctypes
    import math

    buf = (ctypes.c_double * 12)(*range(12))
    row = stats_row(buf)
    buf[0] = 99.0
    assert row_values(row) == tuple(float(i) for i in range(12))
    v = [7.5, -0.0, math.inf, 3, 0, 1 << 40, math.nan, 2.5e-300, 1, 0.125, 2.0, 9.0]
    back = row_values(stats_row(v))
    assert [math.copysign(1, a) for a in back[:2]] == [1, -1]
    assert back[2] == math.inf and math.isnan(back[6]) and back[5] == 1 << 40
    fixed = OpReport.fixed_of({"name": "fc/linear#0", "kind": "linear", "module_path": "fc"})
    a = OpReport.from_stats(fixed, "train", 4, 2, True, {}, v, 3, 4.303, 2.4)
    b = OpReport.from_stats(fixed, "train", 4, 2, True, {}, back, 3, 4.303, 2.4)
    da, db = a.as_dict(), b.as_dict()
    assert math.isnan(da.pop("normwise_digits")) == math.isnan(db.pop("normwise_digits"))
    assert da == db and type(a.numel) is type(b.numel) is int


def _analyse(model, x, read_each_call: bool, calls: int = 4, **options):
    torch._dynamo.reset()
    be = fxstab.backend(seed=3, **options)
    f = torch.compile(model, backend=be)
    seen = []
    with torch.no_grad():
        for _ in range(calls):
            f(x)
            if read_each_call:
                seen = [r.as_dict() for r in be.reports]
    return be, seen


@pytest.mark.parametrize("granularity", ["op", "aten"])
def test_reports_read_at_the_end_equal_reports_read_after_every_call(granularity):
    """Four calls (untraced, traced, two replays of the generated graph, whose kernels reuse
    their statistics buffers): reading the log only at the end gives every call's own
    statistics, field for field what reading it after each call gives."""
    torch.manual_seed(0)
    model = GPT2(layers=1).eval() if granularity == "op" else MLP()
    x = torch.randint(0, 256, (2, 16)) if granularity == "op" else torch.randn(8, 16)
    be_each, each = _analyse(model, x, True, granularity=granularity)
    be_end, _ = _analyse(model, x, False, granularity=granularity)
    assert len(be_end.reports) == len(each) > 0
    end = [r.as_dict() for r in be_end.reports]
    assert end == each
    # the calls differ (fresh random rounding per call): a copy of the last call's buffer
    # everywhere would not
    by_call = {}
    for r in end:
        by_call.setdefault(r["name"], []).append(r["avg_digits"])
    assert any(len(set(v)) > 1 for v in by_call.values())


def test_a_list_assigned_to_the_backends_reports_becomes_its_log():
    """``be.reports = []`` (a reset, or reports of elsewhere): the next calls report into it."""
    torch._dynamo.reset()
    be = fxstab.backend()
    f = torch.compile(MLP(), backend=be)
    x = torch.randn(8, 16)
    with torch.no_grad():
        f(x)
        f(x)
        n = len(be.reports)
        be.reports = [be.reports[0]]
        assert isinstance(be.reports, ReportLog) and len(be.reports) == 1
        f(x)
    assert len(be.reports) == 1 + n // 2 and all(isinstance(r, OpReport) for r in be.reports)


def test_a_call_noted_as_one_block_gives_the_reports_noted_one_by_one(monkeypatch):
    """Once a call has noted only prepared one-output steps, later calls copy their statistics
    as one block: the reports (GEMM surrogate flags included) are field for field those of the
    same calls noted operator by operator."""
    from fxstab.rules.op.tracer import SampleTracer

    torch.manual_seed(0)
    # (a GEMM fed by a rounded operator carries its surrogate in that rounding: not one step
    # of one output, so only the first layer is a GEMM here)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Sigmoid())
    x = torch.randn(8, 16)
    be_block, _ = _analyse(model, x, False, calls=5)
    tracer = be_block.sampled_graphs()[0].tracer
    assert tracer._usual is not None and len(tracer._usual) == 3  # the block was used
    block = [r.as_dict() for r in be_block.reports]
    monkeypatch.setattr(SampleTracer, "_learn_block", lambda self, pending: None)
    be_each, _ = _analyse(model, x, False, calls=5)
    assert be_each.sampled_graphs()[0].tracer._usual is None
    assert block == [r.as_dict() for r in be_each.reports] and len(block) == 5 * 3
    assert any(r["surrogate"] for r in block) and not all(r["surrogate"] for r in block)


def test_a_report_row_names_its_parts():
    """Issue 53, item 4: a deferred report is a ReportRow built by keyword (the GEMM's figures
    a named field, not a sixth item found by its length)."""
    from fxstab.records.report import ReportRow, report_builder

    class Figures(tuple):  # a modelled GEMM's (avg, min), its operands' statistics beside
        operands = {"elements": 12, "scale_max": 4.0}

    fixed = OpReport.fixed_of({"name": "lin/linear#0", "kind": "linear", "module_path": "lin",
                               "format": "bf16", "n_samples": 3, "shape": (2, 4)})
    v = stats_row([16.0, 1.0, 3.0, 2.0, 0.0, 8.0, 1.0, 0.5, 1.0, 1.5, 2.0, 18.0])
    build = report_builder("train", 7, 2, 3, 4.3)
    gemm = Figures((2.5, 1.25))
    row = ReportRow(fixed=fixed, cap=2.4, surrogate=True, stats=v, gemm=gemm)
    r = build(row)
    assert (r.name, r.phase, r.step, r.call, r.surrogate) == ("lin/linear#0", "train", 7, 2, True)
    assert (r.avg_digits, r.min_digits, r.numel, r.zero_fraction) == (2.0, 1.0, 8, 0.25)
    assert r.run_digits == 18.0 / 8
    assert (r.accumulator_digits, r.accumulator_min_digits) == (2.5, 1.25)
    assert (r.operand_elements, r.operand_scale_max) == (12, 4.0)
    assert r.counters == {k: 0 for k in r.counters}  # none counted
    plain = build(ReportRow(fixed=fixed, cap=2.4, surrogate=False, stats=v,
                            counters={**r.counters, "cancellation": 3}))
    assert plain.counters["cancellation"] == 3 and plain.accumulator_digits != \
        plain.accumulator_digits  # NaN: no accumulator modelled


def test_a_report_of_nothing_measured_reads_the_cap():
    fixed = OpReport.fixed_of({"name": "add#0", "kind": "add", "module_path": ""})
    r = OpReport.from_stats(fixed, "default", None, 0, False, {}, [0.0] * 12, 3, 4.3, 2.4)
    assert (r.avg_digits, r.min_digits, r.max_digits, r.normwise_digits, r.p10_digits,
            r.p50_digits, r.run_digits, r.numel) == (2.4, 2.4, 2.4, 2.4, 2.4, 2.4, 2.4, 0)
