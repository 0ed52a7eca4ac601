"""The CPU paths work in column chunks; the result must be the one-pass result bit for bit."""

from __future__ import annotations

import pytest
import torch

from fxstab.numerics import randbits
from fxstab.numerics.digits import stats_vector
from fxstab.numerics.rounding import round_samples
from fxstab.numerics.surrogate import perturb_samples


@pytest.mark.parametrize("mode", ["random", "stochastic", "nearest", "up"])
def test_chunked_rounding_equals_one_pass(monkeypatch, mode):
    torch.manual_seed(0)
    x = torch.randn(3, 1000) * torch.logspace(-40, 38, 1000)
    whole = round_samples(x, "fp16", mode, seed=9)
    monkeypatch.setattr(randbits, "CPU_CHUNK", 256)  # 4 chunks, the last one partial
    assert torch.equal(round_samples(x, "fp16", mode, seed=9).view(torch.int32),
                       whole.view(torch.int32))


def test_chunked_perturbation_and_statistics_equal_one_pass(monkeypatch):
    import fxstab.numerics.digits as digits
    import fxstab.numerics.surrogate as surrogate

    torch.manual_seed(0)
    x = torch.randn(1, 1000).repeat(3, 1)
    x[:, ::3] += 1e-3 * torch.randn(3, 334)  # some elements separated, some not
    whole, count = perturb_samples(x, 2.0 ** -8, 4)
    stats = stats_vector(whole, 4.303, 2.41)
    monkeypatch.setattr(surrogate, "CPU_CHUNK", 256)
    monkeypatch.setattr(digits, "CPU_CHUNK", 256)
    chunked, count2 = perturb_samples(x, 2.0 ** -8, 4)
    assert torch.equal(chunked, whole) and count2 == count
    chunked_stats = stats_vector(whole, 4.303, 2.41)
    assert chunked_stats[9:] == stats[9:]  # the quantile bins add up exactly
    assert torch.allclose(torch.tensor(chunked_stats, dtype=torch.float64),
                          torch.tensor(stats, dtype=torch.float64), rtol=1e-12, atol=0)


def test_stream_offsets_must_be_group_aligned():
    with pytest.raises(ValueError, match="multiple of 128"):
        randbits.random_bits(1, 10, [0], start=64)
    with pytest.raises(ValueError, match="multiple of 16"):
        randbits.random_bytes(1, 10, [0], start=8)
