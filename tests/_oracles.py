"""Independent pure-Python oracles shared by the foundation tests.

Nothing here imports fxstab's rounding or random-bit code: the rounding oracle works on Python
floats (IEEE binary64) with ``math.frexp``/``ldexp``, exact for every format that fits fp64,
and the Philox oracle on Python integers.
"""

from __future__ import annotations

import math

import torch

M32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------- Philox
def mulhilo32(a: int, b: int) -> tuple[int, int]:
    p = a * b
    return (p >> 32) & M32, p & M32


def philox4x32(c: tuple[int, int, int, int], key: tuple[int, int], rounds: int = 10):
    """Philox4x32-R (Salmon et al. 2011, Random123's philox4x32) on Python integers."""
    c0, c1, c2, c3 = (v & M32 for v in c)
    k0, k1 = (v & M32 for v in key)
    for _ in range(rounds):
        hi0, lo0 = mulhilo32(0xD2511F53, c0)
        hi1, lo1 = mulhilo32(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + 0x9E3779B9) & M32
        k1 = (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


def philox_seeded(seed: int, c: tuple[int, int, int, int]):
    """Triton's convention: key = (low 32 bits of the seed, high 32 bits)."""
    seed &= (1 << 64) - 1
    return philox4x32(c, (seed & M32, seed >> 32))


# ----------------------------------------------------------------------------- rounding
def neighbours(x: float, exp_bits: int, man_bits: int) -> tuple[float, float]:
    """(lo, hi): the format-grid neighbours of finite ``x`` with lo <= x <= hi.

    The grid is unbounded above (no overflow here); below the smallest normal it is the
    subnormal grid. Exact: every step is a power-of-two scaling or an integer floor.
    """
    if x == 0.0:
        return x, x
    a = abs(x)
    bias = (1 << (exp_bits - 1)) - 1
    emin = 1 - bias
    e = math.frexp(a)[1] - 1  # a in [2**e, 2**(e+1))
    q = math.ldexp(1.0, max(e, emin) - man_bits)
    k = math.floor(a / q)
    lo = k * q
    hi = lo if lo == a else (k + 1) * q
    lo_s, hi_s = (lo, hi) if x > 0 else (-hi, -lo)
    if lo_s == 0.0:
        lo_s = math.copysign(0.0, x)  # -tiny rounds toward zero to -0
    if hi_s == 0.0:
        hi_s = math.copysign(0.0, x)
    return lo_s, hi_s


def quantum(x: float, exp_bits: int, man_bits: int) -> float:
    bias = (1 << (exp_bits - 1)) - 1
    e = math.frexp(abs(x))[1] - 1 if x != 0 else 1 - bias
    return math.ldexp(1.0, max(e, 1 - bias) - man_bits)


def oracle_round(x: float, fmt, mode: str, rand: int = 0, saturate: bool = False) -> float:
    """Reference rounding of one value; ``rand`` is the random bit (``random``) or the uint32
    word (``stochastic``) the implementation was given for this element."""
    big = fmt.max_normal
    if math.isnan(x):
        return x
    if math.isinf(x):
        if saturate:
            return math.copysign(big, x)
        return math.nan if fmt.finite_only else x
    lo, hi = neighbours(x, fmt.exp_bits, fmt.man_bits)
    a = abs(x)
    if lo == hi:
        r = x
        toward_zero = {"zero": True, "up": x < 0, "down": x > 0}.get(mode, False)
    else:
        small, large = (lo, hi) if x > 0 else (hi, lo)  # by magnitude
        q = quantum(x, fmt.exp_bits, fmt.man_bits)
        frac = (a - abs(small)) / q  # exact: Sterbenz or small == 0
        if mode == "nearest":
            k = round(abs(small) / q)
            go_up = frac > 0.5 or (frac == 0.5 and k % 2 == 1)
        elif mode == "up":
            go_up = x > 0
        elif mode == "down":
            go_up = x < 0
        elif mode == "zero":
            go_up = False
        elif mode == "random":
            go_up = rand != 0
        elif mode == "stochastic":
            go_up = rand < math.floor(frac * 2.0**32)
        else:
            raise AssertionError(mode)
        r = large if go_up else small
        # IEEE overflow: only a rounding *direction* toward zero yields max; to-nearest past
        # the threshold (the unbounded-grid result exceeds max) always gives inf.
        toward_zero = not go_up and mode != "nearest"
    if abs(r) > big:
        if saturate or toward_zero:
            return math.copysign(big, x)
        return math.nan if fmt.finite_only else math.copysign(math.inf, x)
    return r


# ----------------------------------------------------------------------------- comparison
_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
        torch.float64: torch.int64}


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, context=None) -> None:
    """Bitwise equality (signed zeros distinguished); NaNs match any NaN."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.flatten(), expected.flatten()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    bad = (nan_a != nan_e) | (~nan_a & (a.view(_INT[a.dtype]) != e.view(_INT[e.dtype])))
    if bad.any():
        i = torch.nonzero(bad)[:8].flatten().tolist()
        ctx = f" [{context}]" if context is not None else ""
        raise AssertionError(
            f"{int(bad.sum())} of {a.numel()} differ{ctx}; first at {i}: "
            f"actual {[float(a[j]) for j in i]} expected {[float(e[j]) for j in i]}"
        )
