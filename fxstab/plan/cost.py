"""What a precision plan costs to run (issue 44 item 3): a roofline estimate per operator from
the digit map's shapes, and a table of the formats' relative speeds users can override.

An operator's time in a format is ``max(flops / (peak * speed[format]), bytes / bandwidth)``:
GEMMs (``linear``, ``matmul``, ``bmm``, ``conv``, attention) run on the matrix units, whose
throughput depends on the format; every other operator is a pass over memory (its output and
its operands, at the format's width). The default machine is an H100 SXM's datasheet (dense
tensor-core FLOP/s: fp8 1979 T, bf16/fp16 989 T, fp32 without TF32 67 T; 3.35 TB/s): a GEMM
promoted from bf16 to fp32 costs ~15x, an add 2x (its bytes). The figures are relative: the
report prints a plan's cost against the program all in ``format`` and all in ``higher``.

Shapes come from the map: an operator's output shape, and a GEMM's inner dimension from its
first operand's producer (its last dimension), or where the operand is a graph input, the
output's last dimension (a square layer: an estimate, said so here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..numerics.formats import get_format
from ..rules.lifting import ACCUMULATED_KINDS

__all__ = ["CostModel", "DEFAULT_SPEEDS"]

# dense matrix-unit throughput relative to bf16 (H100 SXM datasheet: 1979 / 989 / 67 TFLOP/s)
DEFAULT_SPEEDS: dict = {"fp8_e4m3": 2.0, "fp8_e4m3fn": 2.0, "fp8_e5m2": 2.0, "bf16": 1.0,
                        "fp16": 1.0, "tf32": 0.5, "fp32": 0.068, "fp64": 0.068}


@dataclass(frozen=True)
class CostModel:
    """The roofline cost of operators by format (see the module docstring).

    Args:
        speeds: format name -> matrix-unit throughput relative to ``peak`` (merged over
            :data:`DEFAULT_SPEEDS`; a format in neither runs at the speed of the narrowest
            listed format at least as wide).
        peak: FLOP/s of a format of speed 1 (bf16).
        bandwidth: bytes/s of memory.
    """

    speeds: Mapping = field(default_factory=dict)
    peak: float = 989e12
    bandwidth: float = 3.35e12

    def __post_init__(self) -> None:
        if not isinstance(self.speeds, Mapping):
            raise ValueError(f"speeds must be a mapping format -> relative speed, got "
                             f"{type(self.speeds).__name__}")
        merged = dict(DEFAULT_SPEEDS)
        for name, speed in self.speeds.items():
            get_format(name)  # names an unknown format with the known ones
            if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not speed > 0:
                raise ValueError(f"speeds[{name!r}] must be a positive number, got {speed!r}")
            merged[str(name)] = float(speed)
        object.__setattr__(self, "speeds", merged)
        for key in ("peak", "bandwidth"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{key} must be a positive number, got {v!r}")

    def speed(self, fmt: Any) -> float:
        f = get_format(fmt)
        if f.name in self.speeds:
            return self.speeds[f.name]
        bits = 1 + f.exp_bits + f.man_bits
        wider = [(1 + get_format(n).exp_bits + get_format(n).man_bits, s)
                 for n, s in self.speeds.items()]
        fits = sorted(w for w in wider if w[0] >= bits)
        return fits[0][1] if fits else min(s for _, s in wider)

    @staticmethod
    def _bytes(fmt: Any) -> int:
        f = get_format(fmt)
        return math.ceil((1 + f.exp_bits + f.man_bits) / 8)

    def work(self, op: Any, dmap: Any) -> tuple:
        """(FLOPs, elements moved) of one call of the map's operator ``op`` (the map's numel
        sums its calls)."""
        numel = max(int(op.numel // max(op.calls, 1)), 1) if op.numel else \
            max(math.prod(op.shape), 1)
        operands = [dmap[p] for p in op.inputs if p in dmap]
        moved = numel + sum(max(int(p.numel // max(p.calls, 1)), 1) for p in operands)
        if op.kind in ACCUMULATED_KINDS:
            first = operands[0].shape if operands and operands[0].shape else op.shape
            if op.kind == "scaled_dot_product_attention":
                seq = op.shape[-2] if len(op.shape) >= 2 else 1
                return 4.0 * numel * seq, moved
            inner = first[-1] if first else 1
            return 2.0 * numel * inner, moved
        return float(numel), moved

    def operator_cost(self, op: Any, dmap: Any, fmt: Any) -> float:
        """Seconds of ``op``'s calls in ``fmt`` (the roofline's estimate)."""
        flops, moved = self.work(op, dmap)
        flops, moved = flops * max(op.calls, 1), moved * max(op.calls, 1)
        memory = moved * self._bytes(fmt) / self.bandwidth
        if op.kind in ACCUMULATED_KINDS:
            return max(flops / (self.peak * self.speed(fmt)), memory)
        return memory

    def table(self, dmap: Any, names: Iterable[str], format: Any, higher: Any) -> dict:
        """name -> (cost in ``format``, cost in ``higher``) for the map's operators."""
        return {n: (self.operator_cost(dmap[n], dmap, format),
                    self.operator_cost(dmap[n], dmap, higher)) for n in names}
