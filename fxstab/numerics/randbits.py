"""Counter-based random bits: Philox4x32 exactly as Triton's ``tl.philox`` computes it.

Randomness in fxstab is a function of (seed, counter), never a stored random tensor, so a
Triton kernel (which calls ``tl.philox``/``tl.randint``) and the plain-torch reference here
produce the same bits and can be compared with ``atol=0`` (docs/design.md §9).

The layout of the streams is part of the contract shared with ``fxstab.kernels``:

* ``random`` rounding needs one bit per (element ``e``, draw ``d``). Bit ``e % 32`` of word
  ``(e // 32) % 4`` of ``philox(seed, c0=lo32(e // 128), c1=d, c2=hi32(e // 128), c3=0)``.
  One Philox evaluation serves 128 consecutive elements.
* ``stochastic`` rounding needs 32 bits per (e, d): word ``d % 4`` of
  ``philox(seed, c0=lo32(e), c1=d // 4, c2=hi32(e), c3=0)``. One evaluation serves four draws.
* The GEMM perturbation needs 8 bits per (e, d): byte ``e % 4`` of word ``(e // 4) % 4`` of
  ``philox(seed, c0=lo32(e // 16), c1=d, c2=hi32(e // 16), c3=0)``. One evaluation serves 16
  elements: perturbing the weights of every GEMM for every sample must stay cheap.
* The perturbation's stochastic rounding onto the format's grid needs 16 bits per (e, d):
  half ``e % 2`` (the low one first) of word ``(e // 2) % 4`` of
  ``philox(seed, c0=lo32(e // 8), c1=d, c2=hi32(e // 8), c3=0)``. One evaluation serves 8
  elements.

Arithmetic is done on int64 tensors holding uint32 values; 32x32-bit products are split into
16-bit halves so no intermediate overflows int64 (signed overflow is undefined in the C++
that eager kernels and inductor emit). Draws are non-negative integers (< 2**32).
"""

from __future__ import annotations

import torch

__all__ = ["philox", "random_bits", "uniform_words", "random_bytes", "random_halves", "derive_seed", "split_seed",
           "PHILOX_KEY_A", "PHILOX_KEY_B", "PHILOX_ROUND_A", "PHILOX_ROUND_B", "N_ROUNDS", "M32",
           "M64", "CPU_CHUNK"]

PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
N_ROUNDS = 10  # tl.randint's default
M32 = 0xFFFFFFFF
# Elements per sample that the CPU paths (rounding, surrogate, digit statistics) process at
# once: a multiple of the 128-element random-bit group, so a chunk starts on a stream boundary;
# bounds their temporaries (int patterns, bits) to a few MB instead of ~20 bytes per element.
CPU_CHUNK = 1 << 16
M64 = (1 << 64) - 1


def split_seed(seed: int) -> tuple[int, int]:
    """(k0, k1) = (low, high) 32-bit halves of a 64-bit seed, as ``tl.philox`` splits it."""
    seed &= M64
    return seed & M32, (seed >> 32) & M32


def _mul32(const: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of const * x for uint32 values held in int64.

    Two 16x32-bit partial products (< 2**48 each), combined with in-place operations: on the
    CPU a fresh multi-megabyte temporary costs more than the arithmetic on it.
    """
    p_lo = x * (const & 0xFFFF)  # < 2**48
    p_hi = x * (const >> 16)  # < 2**48
    lo = (p_hi & 0xFFFF).bitwise_left_shift_(16).add_(p_lo).bitwise_and_(M32)
    hi = p_hi.add_(p_lo.bitwise_right_shift_(16)).bitwise_right_shift_(16)
    return hi, lo


def philox(seed: int, c0: torch.Tensor, c1, c2, c3, n_rounds: int = N_ROUNDS):
    """Philox4x32 of 32-bit counters (int64 tensors or ints); returns four int64 tensors."""
    k0, k1 = split_seed(seed)
    c0 = torch.as_tensor(c0, dtype=torch.int64)
    like = c0
    c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64, device=like.device) for c in (c1, c2, c3))
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape)
    for _ in range(n_rounds):
        hi_b, lo_b = _mul32(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul32(PHILOX_ROUND_A, c0)
        if hi_b.shape != shape:
            hi_b = hi_b.expand(shape).clone()
        if hi_a.shape != shape:
            hi_a = hi_a.expand(shape).clone()
        c0 = hi_b.bitwise_xor_(c1).bitwise_xor_(k0)
        c2 = hi_a.bitwise_xor_(c3).bitwise_xor_(k1)
        c1 = lo_b
        c3 = lo_a
        k0 = (k0 + PHILOX_KEY_A) & M32
        k1 = (k1 + PHILOX_KEY_B) & M32
    return tuple(c.expand(shape) for c in (c0, c1, c2, c3))


def _check_start(start: int, multiple: int) -> None:
    if start < 0 or start % multiple:
        raise ValueError(f"start must be a non-negative multiple of {multiple}, got {start}")


def random_bits(seed: int, numel: int, draws: torch.Tensor | list[int], device=None,
                start: int = 0) -> torch.Tensor:
    """Bits for ``random`` rounding: int64 tensor [len(draws), numel] of 0/1 (layout above),
    for elements ``start .. start + numel - 1`` (``start`` a multiple of 128)."""
    _check_start(start, 128)
    draws = torch.as_tensor(draws, dtype=torch.int64, device=device).reshape(-1, 1)
    groups = (numel + 127) // 128
    g = torch.arange(start // 128, start // 128 + groups, dtype=torch.int64,
                     device=draws.device).reshape(1, -1)
    words = philox(seed, g & M32, draws, g >> 32, 0)  # 4 x [D, G]
    w = torch.stack(words, dim=-1)  # [D, G, 4]
    shifts = torch.arange(32, dtype=torch.int64, device=draws.device)
    bits = (w.unsqueeze(-1) >> shifts).bitwise_and_(1)  # [D, G, 4, 32]
    return bits.reshape(draws.shape[0], groups * 128)[:, :numel]


def uniform_words(seed: int, numel: int, draws: torch.Tensor | list[int], device=None,
                  start: int = 0) -> torch.Tensor:
    """32-bit uniforms (int64 in [0, 2**32)) for draws x elements ``start ..``: tensor
    [len(draws), numel].

    One Philox evaluation per element serves the four draws 4b..4b+3, so it is computed once
    per block b that the draws touch (N=3 samples: one evaluation, not three).
    """
    _check_start(start, 1)
    draws = torch.as_tensor(draws, dtype=torch.int64, device=device).reshape(-1)
    dev = draws.device
    wanted = draws.tolist()
    blocks = sorted({d >> 2 for d in wanted})
    e = torch.arange(start, start + numel, dtype=torch.int64, device=dev)
    e_lo, e_hi = e & M32, e >> 32
    out = torch.empty((len(wanted), numel), dtype=torch.int64, device=dev)
    for b in blocks:
        words = philox(seed, e_lo, b, e_hi, 0)
        for i, d in enumerate(wanted):
            if d >> 2 == b:
                out[i] = words[d & 3]
    return out


def derive_seed(seed: int, *salt: int) -> int:
    """A 64-bit seed for a sub-stream (operator, call, purpose) from a base seed.

    SplitMix64 finalisation of the base seed mixed with each salt; plain Python integers, so it
    costs nothing on the device and the same value reaches a kernel and its reference.
    """
    z = seed & M64
    for s in salt:
        z = (z ^ ((s & M64) + 0x9E3779B97F4A7C15 + ((z << 6) & M64) + (z >> 2))) & M64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        z ^= z >> 31
    return z


def random_bytes(seed: int, numel: int, draws: torch.Tensor | list[int], device=None,
                 start: int = 0) -> torch.Tensor:
    """8-bit uniforms (int64 in [0, 256)) for draws x elements ``start ..`` (a multiple of
    16): tensor [len(draws), numel]."""
    _check_start(start, 16)
    draws = torch.as_tensor(draws, dtype=torch.int64, device=device).reshape(-1, 1)
    groups = (numel + 15) // 16
    g = torch.arange(start // 16, start // 16 + groups, dtype=torch.int64,
                     device=draws.device).reshape(1, -1)
    w = torch.stack(philox(seed, g & M32, draws, g >> 32, 0), dim=-1)  # [D, G, 4]
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=draws.device)
    b = (w.unsqueeze(-1) >> shifts) & 0xFF  # [D, G, 4 words, 4 bytes]
    return b.reshape(draws.shape[0], groups * 16)[:, :numel]


def random_halves(seed: int, numel: int, draws: torch.Tensor | list[int], device=None,
                  start: int = 0) -> torch.Tensor:
    """16-bit uniforms (int64 in [0, 65536)) for draws x elements ``start ..`` (a multiple of
    8): tensor [len(draws), numel]."""
    _check_start(start, 8)
    draws = torch.as_tensor(draws, dtype=torch.int64, device=device).reshape(-1, 1)
    groups = (numel + 7) // 8
    g = torch.arange(start // 8, start // 8 + groups, dtype=torch.int64,
                     device=draws.device).reshape(1, -1)
    w = torch.stack(philox(seed, g & M32, draws, g >> 32, 0), dim=-1)  # [D, G, 4]
    shifts = torch.tensor([0, 16], dtype=torch.int64, device=draws.device)
    h = (w.unsqueeze(-1) >> shifts) & 0xFFFF  # [D, G, 4 words, 2 halves]
    return h.reshape(draws.shape[0], groups * 8)[:, :numel]
