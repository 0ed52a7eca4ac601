"""Operators inside a vmap region dynamo captured (``torch.vmap``, ``associative_scan``'s
generic combine, Mamba's selective scan) are rounded and measured like any other: the tracer
rounds a batched value's physical tensor and wraps the result back
(``fxstab/rules/op/structural.py``, ``unbatched``/``rebatched``; issue 41)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxstab
from fxstab.records.coverage import ANALYSED
from fxstab.rules.op.structural import in_vmap_region, rebatched, unbatched

CAP_BF16 = 2.41  # digits of a bf16 value (p = 8)


def _analyse(model: nn.Module, *xs: torch.Tensor):
    """Three calls (untraced, traced, replayed), each bit for bit the model's output; the
    backend and the last call's output samples."""
    torch._dynamo.reset()
    be = fxstab.backend(format="bf16", seed=0)
    f = torch.compile(model, backend=be)
    with torch.no_grad():
        ref = model(*xs)
        for _ in range(3):
            with be.capture_samples() as cap:
                y = f(*xs)
            assert torch.equal(y, ref)
    return be, cap.output


def _on_bf16_grid(t: torch.Tensor) -> bool:
    return torch.equal(t.to(torch.bfloat16).to(t.dtype), t)


def _in_region(be, kinds: set) -> list:
    """The coverage entries of ``kinds`` (every one of them is inside the region)."""
    found = [e for e in be.coverage().entries if e.kind in kinds]
    assert found
    return found


class Mapped(nn.Module):
    """``torch.vmap`` over rows of a linear's output: an elementwise operator, a reduction and
    a product inside the region, the product the last operator before the output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.vmap(lambda r: torch.tanh(r) * r.sum())(self.fc(x))


def test_operators_inside_a_vmap_region_are_rounded_and_measured():
    torch.manual_seed(0)
    be, samples = _analyse(Mapped(), torch.randn(5, 8))
    cov = be.coverage()
    assert cov.fraction == 1.0, cov
    for e in _in_region(be, {"tanh", "sum", "mul"}):
        assert e.how == ANALYSED and e.counted, e
    dm = be.digit_map()
    for name in ("tanh#0", "sum#0", "mul#0"):
        op = dm.operators[name]
        # rounded (the samples differ: below the cap) and measured (digits of a bf16 result)
        assert 1.0 < op.avg_digits < CAP_BF16, (name, op.avg_digits)
        assert op.status == "rounded"
    # the region's batch of 5 rows is in the shape measured
    assert tuple(dm.operators["tanh#0"].shape) == (5, 8)
    assert tuple(dm.operators["sum#0"].shape) == (5,)
    # the output is the product inside the region: bf16 values, different in every sample
    assert _on_bf16_grid(samples), "the product inside the region was not rounded"
    assert not torch.equal(samples[0], samples[1]) and not torch.equal(samples[1], samples[2])


class Scan(nn.Module):
    """A linear recurrence h_t = a_t * h_(t-1) + b_t as Mamba writes it: an associative scan
    whose combine runs under a vmap dynamo captures (generic mode, the CPU's)."""

    def __init__(self):
        super().__init__()
        self.fa, self.fb = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        from torch._higher_order_ops.associative_scan import associative_scan

        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]

        a, b = torch.sigmoid(self.fa(x)), self.fb(x)
        return associative_scan(combine, (a, b), dim=0, combine_mode="generic")[1]


def _recurrence(model: Scan, x: torch.Tensor) -> torch.Tensor:
    a, b = torch.sigmoid(model.fa(x)), model.fb(x)
    h, out = torch.zeros_like(b[0]), []
    for t in range(x.shape[0]):
        h = a[t] * h + b[t]
        out.append(h)
    return torch.stack(out)


def test_an_associative_scan_is_analysed():
    pytest.importorskip("torch._higher_order_ops.associative_scan")
    torch.manual_seed(0)
    model, x = Scan(), torch.randn(12, 8)
    with torch.no_grad():
        assert torch.allclose(model(x), _recurrence(model, x), atol=1e-5)
    be, samples = _analyse(model, x)
    cov = be.coverage()
    assert cov.fraction == 1.0, cov
    region = _in_region(be, {"mul", "add"})
    assert len(region) >= 6  # the combine of every level of the scan
    assert all(e.how == ANALYSED for e in region), region
    dm = be.digit_map()
    combined = [op for name, op in dm.operators.items()
                if name.startswith(("mul#", "add#")) and op.shape[0] > 0]
    assert all(0 < op.avg_digits < CAP_BF16 for op in combined)
    # every state is a result of a combine or a linear: rounded, and the samples differ
    assert _on_bf16_grid(samples)
    assert (samples[0] != samples[1]).float().mean() > 0.1


class Nested(nn.Module):
    """Two vmap regions, one in the other, fed by an input (no samples until the first
    operator inside rounds), with a product by a weight inside (the GEMM surrogate)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return torch.vmap(torch.vmap(lambda r: torch.exp(r) @ self.w))(x)


def test_nested_regions_and_a_product_inside():
    torch.manual_seed(0)
    be, samples = _analyse(Nested(), torch.randn(2, 5, 4))
    assert be.coverage().fraction == 1.0, be.coverage()
    dm = be.digit_map()
    for kind in ("exp", "matmul"):
        (name,) = [n for n in dm.operators if n.startswith(kind)]
        op = dm.operators[name]
        assert 1.0 < op.avg_digits < CAP_BF16, (name, op.avg_digits)
    assert tuple(dm.operators[next(n for n in dm.operators if n.startswith("exp"))].shape) \
        == (2, 5, 4)
    assert _on_bf16_grid(samples) and not torch.equal(samples[0], samples[1])


def test_unbatched_and_rebatched_are_inverse():
    """The physical tensor has the samples first, then the batch dims outer to inner,
    wherever the batching rules left them."""
    x = torch.randn(3, 4, 5, 6)  # [N, ...]

    def inner(r):  # r: [N, 6] at the inner level
        assert in_vmap_region(r)
        flat, levels = unbatched(r, 1)
        assert not in_vmap_region(flat) and len(levels) == 2
        assert torch.equal(flat, x.movedim(2, 1))  # [N, B_outer (5), B_inner (4), 6]
        back = rebatched(flat * 2, levels)
        assert in_vmap_region(back) and back.shape == r.shape
        return back

    # the outer region maps dim 2 of the samples, the inner one dim 1 of what is left
    out = torch.vmap(torch.vmap(inner, in_dims=1, out_dims=1), in_dims=2, out_dims=2)(x)
    assert torch.equal(out, x * 2)
    plain, levels = unbatched(x, 1)
    assert plain is x and levels == ()
