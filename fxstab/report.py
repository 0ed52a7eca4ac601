"""Per-operator reports: what one analysed call of one instrumented operator looked like.

An :class:`OpReport` is the unit every analysis produces (operator level, aten level, eager
driver); a digit map (``fxstab.digitmap``) aggregates them over calls. Field names here are the
JSON keys of digit maps, so renaming one is a schema change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

COUNTER_KEYS = (
    "cancellation",
    "division",
    "multiplication",
    "power",
    "math_function",
    "intrinsic",
    "branching",
    "anomaly",
)

# Status of an operator in one analysed call.
ROUNDED = "rounded"  # output rounded into the format and recorded
OBSERVED = "observed"  # recorded without rounding (an exact primitive, recorded on request)
UNLIFTED = "unlifted"  # could not run on stacked samples: ran per sample, unrounded
PER_SAMPLE = "per_sample"  # no batching rule: ran once per sample, rounded and recorded


_NO_COUNTS = {k: 0 for k in COUNTER_KEYS}


def empty_counters() -> dict[str, int]:
    return dict(_NO_COUNTS)


@dataclass
class OpReport:
    """Digits of one instrumented operator's output in one analysed call.

    ``name`` is stable across runs and unrelated edits: ``module.path/kind#k`` where ``k``
    counts the operators of that kind within that module, in graph order (DESIGN.md §7).
    ``inputs`` names the instrumented operators whose outputs feed this one (graph edges).
    """

    name: str
    kind: str
    module_path: str
    source: str = ""
    phase: str = "default"
    step: Optional[int] = None
    format: str = ""
    n_samples: int = 0
    avg_digits: float = 0.0
    min_digits: float = 0.0
    max_digits: float = 0.0
    numel: int = 0
    zero_fraction: float = 0.0
    non_finite: int = 0
    normwise_digits: float = 0.0
    p10_digits: float = 0.0
    p50_digits: float = 0.0
    underflow: int = 0
    surrogate: bool = False
    status: str = ROUNDED
    shape: tuple = ()
    counters: dict = field(default_factory=empty_counters)
    inputs: tuple = ()
    call: int = 0
    # "forward", or "backward": an operator of the backward graph (its name says the forward
    # operator it belongs to) or a parameter's gradient (kind "param_grad")
    direction: str = "forward"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["inputs"] = list(self.inputs)
        return d
