"""`fxstab demo`: the README's main job."""

from __future__ import annotations

import torch

from .digits import cestac_digits, format_stochastic
from .formats import get_format
from .rounding import round_samples


def _worked_example(seed: int) -> None:
    """CESTAC by hand: a stable and a cancelling sum, 3 samples, random rounding into bf16."""
    fmt = get_format("bf16")
    n = 3
    print(f"Worked CESTAC example: {n} samples, random rounding into {fmt.name} "
          f"(cap {fmt.digit_cap:.2f} digits)")

    def op(samples: torch.Tensor, salt: int) -> torch.Tensor:
        return round_samples(samples, fmt, "random", seed=seed * 1000 + salt)

    a = torch.full((n,), 1.0 / 3.0)
    b = torch.full((n,), 256.0 + 1.0 / 7.0)
    # stable: a * 3 + 1
    s1 = op(op(a, 1) * 3.0, 2) + 1.0
    s1 = op(s1, 3)
    # cancelling: (b + a) - b, the true value is 1/3
    s2 = op(op(b, 4) + op(a, 5), 6) - op(b, 4)
    s2 = op(s2, 7)
    for label, s in (("(1/3)*3 + 1", s1), ("(256+1/7 + 1/3) - (256+1/7)", s2)):
        d = float(cestac_digits(s.reshape(n, 1), fmt)[0])
        vals = ", ".join(f"{v:.6g}" for v in s.tolist())
        print(f"  {label:<28} samples [{vals}]  digits {d:4.2f}  "
              f"-> {format_stochastic(float(s.double().mean()), d)}")


def run_demo(seed: int = 0) -> int:
    from .cli import main as cli_main

    cli_main(["formats"])
    print()
    _worked_example(seed)
    return 0
