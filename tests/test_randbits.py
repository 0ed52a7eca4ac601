"""Philox random bits (fxstab.numerics.randbits) against a pure-Python Philox4x32-10."""

from __future__ import annotations

import random

import pytest
import torch

from _oracles import M32, philox4x32, philox_seeded
from fxstab.numerics import randbits

SEEDS = [0, 1, 12345, 2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**63 + 11, 2**64 - 1]


def test_oracle_known_answers():
    """Random123's published known-answer vectors for philox4x32_10 (kat_vectors)."""
    assert philox4x32((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox4x32((M32,) * 4, (M32, M32)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox4x32((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
                      (0xA4093822, 0x299F31D0)) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


@pytest.mark.parametrize("seed", SEEDS)
def test_torch_philox_equals_python(seed):
    rng = random.Random(seed % 1000)
    ctr = [[rng.getrandbits(32) for _ in range(64)] for _ in range(4)]
    ctr[0][:3] = [0, M32, 0x80000000]
    got = randbits.philox(seed, *(torch.tensor(c, dtype=torch.int64) for c in ctr))
    got = torch.stack(got, 1).tolist()
    want = [list(philox_seeded(seed, tuple(c[i] for c in ctr))) for i in range(64)]
    assert got == want
    assert all(0 <= v <= M32 for row in got for v in row)


def test_split_seed_and_scalar_counters():
    assert randbits.split_seed(2**40 + 5) == (5, 2**8)
    assert randbits.split_seed(-1) == (M32, M32)
    out = randbits.philox(7, torch.arange(5), 3, 0, 9)
    assert all(o.shape == (5,) for o in out)
    assert [int(o[2]) for o in out] == list(philox_seeded(7, (2, 3, 0, 9)))


@pytest.mark.parametrize("seed", [0, 2**32 + 1, 2**64 - 1])
def test_random_bits_layout(seed):
    """Bit e%32 of word (e//32)%4 of philox(seed, lo32(e//128), draw, hi32(e//128), 0)."""
    numel, draws = 300, [0, 3, 7]
    bits = randbits.random_bits(seed, numel, draws)
    assert bits.shape == (3, numel) and bits.dtype == torch.int64
    for di, d in enumerate(draws):
        want = []
        for e in range(numel):
            w = philox_seeded(seed, (e // 128, d, 0, 0))[(e // 32) % 4]
            want.append((w >> (e % 32)) & 1)
        assert bits[di].tolist() == want


@pytest.mark.parametrize("seed", [5, 2**33 + 9])
def test_uniform_words_layout(seed):
    """Word d%4 of philox(seed, lo32(e), d//4, hi32(e), 0)."""
    numel, draws = 37, [0, 1, 2, 5, 11]
    words = randbits.uniform_words(seed, numel, draws)
    assert words.shape == (5, numel) and words.dtype == torch.int64
    want = [[philox_seeded(seed, (e, d // 4, 0, 0))[d % 4] for e in range(numel)] for d in draws]
    assert words.tolist() == want


def test_high_counter_words():
    """Element offsets past 2**32 put their high half in c2 (not reachable through numel)."""
    g = torch.tensor([2**32 + 5, 2**35 + 1], dtype=torch.int64)
    out = randbits.philox(9, g & M32, 1, g >> 32, 0)
    for i, e in enumerate(g.tolist()):
        assert [int(o[i]) for o in out] == list(philox_seeded(9, (e & M32, 1, e >> 32, 0)))


@pytest.mark.parametrize("numel", [0, 1, 127, 128, 129, 311, 9999])
def test_shapes_and_reproducibility(numel):
    b = randbits.random_bits(3, numel, [0, 1])
    w = randbits.uniform_words(3, numel, [0, 1, 2])
    assert b.shape == (2, numel) and w.shape == (3, numel)
    assert torch.equal(b, randbits.random_bits(3, numel, [0, 1]))
    assert torch.equal(w, randbits.uniform_words(3, numel, [0, 1, 2]))
    if numel:
        assert set(b.unique().tolist()) <= {0, 1}
        assert int(w.min()) >= 0 and int(w.max()) <= M32
    if numel >= 128:
        assert not torch.equal(b[0], b[1]) and not torch.equal(b, randbits.random_bits(4, numel, [0, 1]))
        assert not torch.equal(w, randbits.uniform_words(4, numel, [0, 1, 2]))
    # a prefix of a longer stream is the shorter stream
    assert torch.equal(randbits.random_bits(3, numel + 200, [0, 1])[:, :numel], b)
    assert torch.equal(randbits.uniform_words(3, numel + 5, [0, 1, 2])[:, :numel], w)


def test_derive_seed():
    a = randbits.derive_seed(0, 1, 2)
    assert a == randbits.derive_seed(0, 1, 2)
    assert 0 <= a < 2**64
    assert a != randbits.derive_seed(0, 2, 1)  # salt order matters
    assert a != randbits.derive_seed(1, 1, 2)
    assert a != randbits.derive_seed(0, 1, 3)
    assert randbits.derive_seed(5) == 5  # no salt: the base seed
    seen = {randbits.derive_seed(42, op, call) for op in range(50) for call in range(20)}
    assert len(seen) == 1000
    assert randbits.derive_seed(2**70 + 3, 1) == randbits.derive_seed(3, 1)  # 64-bit seeds


def _triton_philox_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    import os
    return os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


@pytest.mark.interpreter
@pytest.mark.skipif(not _triton_philox_available(),
                    reason="needs triton with TRITON_INTERPRET=1 (CPU) or a CUDA device")
def test_matches_tl_philox():
    import triton
    import triton.language as tl

    @triton.jit
    def _k(out_ptr, seed, c1, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        c0 = offs.to(tl.uint32)
        z = c0 * 0
        a, b, c, d = tl.philox(seed, c0, z + c1, z, z)
        tl.store(out_ptr + offs * 4 + 0, a, mask=mask)
        tl.store(out_ptr + offs * 4 + 1, b, mask=mask)
        tl.store(out_ptr + offs * 4 + 2, c, mask=mask)
        tl.store(out_ptr + offs * 4 + 3, d, mask=mask)

    device = "cuda" if torch.cuda.is_available() and __import__("os").environ.get(
        "TRITON_INTERPRET") != "1" else "cpu"
    n = 200
    for seed in (0, 2**32 + 7, 2**63 + 11):
        out = torch.zeros(n * 4, dtype=torch.int32, device=device)
        _k[(triton.cdiv(n, 64),)](out, seed, 3, n, BLOCK=64)
        got = (out.cpu().to(torch.int64) & M32).reshape(n, 4)
        want = torch.stack(randbits.philox(seed, torch.arange(n), 3, 0, 0), 1)
        assert torch.equal(got, want)
