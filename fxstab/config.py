"""Validated configuration of an fxstab analysis."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable, Optional, Union

from .numerics.formats import Format, get_format
from .numerics.rounding import Rounding

__all__ = ["AnalysisConfig", "Kernels", "KERNELS", "GRANULARITIES", "OUTPUTS", "DIAGNOSTICS",
           "accumulation_rules", "operand_rules", "format_rules", "rule_for", "ROLES"]


# A GEMM's role in training, as Transformer Engine names its GEMMs: the forward product
# (fprop), the backward product giving an activation's gradient (dgrad), the one giving a
# weight's gradient (wgrad; fxstab.analysis.backward tells them apart)
ROLES = ("fprop", "dgrad", "wgrad")


class Kernels(str, Enum):
    """The ``kernels`` option: which implementation rounds the samples, measures their digits and
    applies the GEMM surrogate. Every choice draws the same Philox bits, so the rounded samples
    are the same; they differ in speed (and the statistics in the last few ulps).

    * ``AUTO`` (``"auto"``): the Triton kernels on CUDA tensors, the fused CPU kernels on CPU
      tensors where they build, the plain-torch references otherwise.
    * ``TRITON`` (``"triton"``): the fused Triton kernels of :mod:`fxstab.kernels` (a GPU, or CPU
      tensors under ``TRITON_INTERPRET=1``). The arithmetic level has no Triton path yet: there
      it means ``auto``.
    * ``CPU`` (``"cpu"``): the fused C kernels of :mod:`fxstab.cpu` (CPU fp32/fp64 tensors).
    * ``TORCH`` (``"torch"``): the plain-torch references (the unfused side of the ablation).

    Users pass the strings; :meth:`parse` validates them (or a member) against the choices a
    caller takes.
    """

    AUTO = "auto"
    TRITON = "triton"
    CPU = "cpu"
    TORCH = "torch"

    @classmethod
    def values(cls, members: Iterable["Kernels"] = ()) -> tuple[str, ...]:
        """The option strings of ``members`` (default: every member), in declaration order."""
        chosen = set(members) or set(cls)
        return tuple(k.value for k in cls if k in chosen)

    @classmethod
    def parse(cls, value: Any, allowed: Iterable["Kernels"] = (), why: str = "") -> "Kernels":
        """The member ``value`` names (a member or its string), if it is in ``allowed`` (default:
        every member); otherwise a ValueError that lists the choices (and says ``why`` for a
        known option a caller does not take)."""
        choices = cls.values(allowed)
        if isinstance(value, str) and value in choices:
            return cls(value)
        known = isinstance(value, str) and value in cls.values()
        raise ValueError(f"kernels must be one of {', '.join(map(repr, choices))}; got {value!r}"
                         + (f" ({why})" if known and why else ""))


GRANULARITIES = ("op", "aten")
OUTPUTS = ("deterministic", "mean")
KERNELS = Kernels.values()
DIAGNOSTICS = ("off", "summary", "detailed")

Select = Union[None, str, Callable[..., bool], "list[str]", "tuple[str, ...]", "set[str]", "frozenset[str]"]


@dataclass(frozen=True)
class AnalysisConfig:
    """Options of :func:`fxstab.backend` (see its docstring for their meaning)."""

    granularity: str = "op"
    format: Format = field(default_factory=lambda: get_format("bf16"))
    n_samples: int = 3
    seed: int = 0
    rounding: Rounding = Rounding.RANDOM
    output: str = "deterministic"
    select: Any = None
    every: int = 1
    confidence: float = 0.95
    kernels: str = "auto"
    diagnostics: str = "summary"
    cancel_digits: float = 4.0
    zero_threshold: float = 0.5
    data_perturbation_threshold: Optional[float] = None
    saturate: bool = False
    trace_rnn: bool = True
    backward: bool = False
    # the GEMMs' accumulator (fxstab.numerics.accumulation): a spec for every modelled GEMM, or
    # {kind, role (ROLES) or glob over "module.path/kind": spec}; stored as ((pattern,
    # Accumulation), ...)
    accumulate: Any = None
    # the GEMMs' operands in a low-precision format with a recipe's scaling (fp8 training):
    # a format name (or None: the operands as the program gives them) and one of SCALINGS
    gemm_inputs: Any = None
    gemm_scaling: str = "tensor"
    # per-operator formats (a precision plan, fxstab.plan): {stable operator name or glob over
    # names: format}, first match wins; stored as ((pattern, Format), ...). An operator none
    # matches rounds into `format`; the samples' working dtype is the widest format's.
    formats: Any = None
    # operators whose outputs are left unrounded (an ablation: fxstab.impact): stable names or
    # globs over them (at granularity="aten" the primitives' names, module/op#k/aten.prim#j);
    # stored as a tuple of patterns. Their outputs are measured, not rounded.
    unrounded: Any = None
    # the samples' linear layers in the format's own GEMM kernels where their operands are
    # exact there (fxstab.numerics.lowp_gemm: a bf16 model analysed in bf16); False: in the
    # working dtype (fp32), the reference path
    lowp_gemm: bool = True

    def __post_init__(self) -> None:
        def choice(name: str, value: Any, options: tuple) -> None:
            if value not in options:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")

        choice("granularity", self.granularity, GRANULARITIES)
        choice("output", self.output, OUTPUTS)
        # stored as the plain string: the config's repr and JSON stay what users passed
        object.__setattr__(self, "kernels", Kernels.parse(self.kernels).value)
        choice("diagnostics", self.diagnostics, DIAGNOSTICS)
        if not isinstance(self.backward, bool):
            raise ValueError(f"backward must be True or False (analyse the backward graph too), "
                             f"got {self.backward!r}")
        # format="auto": each operator rounds into the dtype its output has in the program
        # (fxstab/backend.py); fp32 is the widest a model computes in, so the working dtype
        # is fp64 and the surrogate's threshold each GEMM's own format's unit roundoff
        auto = isinstance(self.format, str) and self.format.strip().lower() == "auto"
        object.__setattr__(self, "auto_format", auto)
        object.__setattr__(self, "format", get_format("fp32" if auto else self.format))
        if self.auto_format and self.granularity != "op":
            raise ValueError("format='auto' is supported at granularity='op' (the arithmetic "
                             "level rounds every primitive into one format)")
        object.__setattr__(self, "rounding", Rounding.parse(self.rounding))
        object.__setattr__(self, "accumulate", accumulation_rules(self.accumulate))
        if self.accumulate and self.granularity != "op":
            raise ValueError("accumulate= is modelled at granularity='op' (linear, matmul, mm, "
                             "bmm, addmm, baddbmm, conv1d, conv2d, scaled_dot_product_attention); the "
                             "arithmetic level keeps its GEMMs trusted for now")
        from .numerics.accumulation import SCALINGS

        if self.gemm_scaling not in SCALINGS:
            raise ValueError(f"gemm_scaling must be one of {', '.join(SCALINGS)}, got "
                             f"{self.gemm_scaling!r}")
        object.__setattr__(self, "gemm_inputs", operand_rules(self.gemm_inputs))
        if self.gemm_inputs:
            if self.granularity != "op":
                raise ValueError("gemm_inputs= is modelled at granularity='op' (linear, "
                                 "matmul, mm, bmm, addmm, baddbmm, conv1d, conv2d, "
                                 "scaled_dot_product_attention) for now")
        object.__setattr__(self, "unrounded", _patterns(self.unrounded, "unrounded"))
        object.__setattr__(self, "formats", format_rules(self.formats))
        if self.formats and (self.granularity != "op" or auto):
            raise ValueError("formats= (per-operator formats) is supported at granularity='op' "
                             "with one base format (not format='auto')")
        n = self.n_samples
        if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 64:
            raise ValueError(f"n_samples must be an integer in [2, 64] (CESTAC needs at least 2 "
                             f"samples; 3 is CADNA's choice), got {n!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.lowp_gemm, bool):
            raise ValueError(f"lowp_gemm must be True or False, got {self.lowp_gemm!r}")
        e = self.every
        if isinstance(e, bool) or not isinstance(e, int) or e < 1:
            raise ValueError(f"every must be a positive integer (analyse one call in `every`), got {e!r}")
        c = self.confidence
        if not isinstance(c, (int, float)) or not 0.0 < c < 1.0:
            raise ValueError(f"confidence must be in (0, 1), got {c!r}")
        if not isinstance(self.cancel_digits, (int, float)) or self.cancel_digits <= 0:
            raise ValueError(f"cancel_digits must be positive, got {self.cancel_digits!r}")
        if not isinstance(self.zero_threshold, (int, float)) or self.zero_threshold < 0:
            raise ValueError(f"zero_threshold must be >= 0, got {self.zero_threshold!r}")
        eta = self.data_perturbation_threshold
        if eta is None:
            # with per-operator formats each GEMM's threshold is its own format's unit roundoff
            if not auto and not self.formats:
                object.__setattr__(self, "data_perturbation_threshold",
                                   self.format.unit_roundoff)
        elif not isinstance(eta, (int, float)) or not 0 < eta < 1 or math.log2(eta) != int(math.log2(eta)):
            raise ValueError(f"data_perturbation_threshold must be a power of two in (0, 1) "
                             f"(default: the format's unit roundoff 2**-p), got {eta!r}")
        s = self.select
        if not (s is None or isinstance(s, str) or callable(s)
                or (isinstance(s, (list, tuple, set, frozenset)) and all(isinstance(i, str) for i in s))):
            raise ValueError(f"select must be None, a kind/family name or module-path glob, a list of "
                             f"them, or a predicate (node, qualified_name) -> bool; got {s!r}")
        if s is not None and not callable(s):
            for item in [s] if isinstance(s, str) else s:
                _check_select_name(item)


    @functools.cached_property
    def run_shift(self) -> float:
        """The shift of the expected digits of a real run (:func:`fxstab.numerics.digits.run_shift`)
        for this analysis's samples and rounding (computed once: the tracers read it per
        operator)."""
        from .numerics.digits import run_shift

        return run_shift(self.n_samples, self.rounding)

    @property
    def widest_format(self) -> Format:
        """The widest format an operator rounds into: it sets the samples' working dtype."""
        return max([self.format, *(f for _, f in self.formats)], key=lambda f: f.precision)

    def rounds(self, name: str) -> bool:
        """Whether operator ``name`` rounds its output (not one of ``unrounded=``)."""
        import fnmatch

        return not any(p == name or fnmatch.fnmatchcase(name, p) for p in self.unrounded)

    def format_for(self, name: str) -> Format:
        """The format operator ``name`` rounds into (``formats=``, else ``format``)."""
        import fnmatch

        for pattern, fmt in self.formats:
            if pattern == name or fnmatch.fnmatchcase(name, pattern):
                return fmt
        return self.format


# select= names besides families, kinds and globs: "custom" (custom operators), "all" (= "*")
SELECT_WORDS = ("custom", "all")
def _check_select_name(item: str) -> None:
    """Reject a ``select=`` name that is no family, no word of :data:`SELECT_WORDS`, no glob
    (one of ``*?[/.``) and no operator kind (:func:`fxstab.capture.opsets.known_kind`): it
    would select nothing."""
    from .capture.opsets import DEFAULT_KINDS, FAMILIES, known_kind

    if item in FAMILIES or item in SELECT_WORDS or any(ch in item for ch in "*?[/.") \
            or known_kind(item):
        return
    import difflib

    close = difflib.get_close_matches(item, sorted(set(FAMILIES) | DEFAULT_KINDS), n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    raise ValueError(
        f"select: {item!r} is no operator kind, family or pattern{hint}; it would select "
        f"nothing. select= takes families ({', '.join(sorted(FAMILIES))}), 'custom' (custom "
        f"operators), 'all' or '*' (every operator), operator kinds (a torch function's name: "
        f"'softmax', 'erfinv'; torch.fft/linalg/special ones with their prefix: 'fft_rfft'), "
        f"globs over 'module.path/kind' ('blocks.*', '*/my_function') or a predicate "
        f"(node, qualified_name) -> bool")


def _patterns(spec: Any, option: str) -> tuple:
    """An option of operator-name patterns (one string or an iterable of them) as a tuple."""
    if spec is None:
        return ()
    items = (spec,) if isinstance(spec, str) else spec
    try:
        items = tuple(items)
    except TypeError:
        raise ValueError(f"{option} must be a stable operator name, a glob over names, or a "
                         f"list of them; got {spec!r}") from None
    bad = [i for i in items if not isinstance(i, str) or not i]
    if bad:
        raise ValueError(f"{option} takes non-empty strings (operator names or globs), got "
                         f"{bad[0]!r}")
    return items


def _pattern_rules(spec: Any, option: str, keys: str, parse: Callable[[Any], Any],
                   single: bool = True) -> tuple:
    """An option given as one value or ``{pattern: value}`` as ``((pattern, value), ...)``,
    each value through ``parse`` (its ValueError named with the option and key); one value is
    the rule ``("*", value)`` (``single=False``: only a mapping is accepted). None: no rule;
    a tuple of pairs reads as a mapping (the normalized form: a config copied with
    ``dataclasses.replace``; parsing a parsed value returns it)."""
    from collections.abc import Mapping

    if spec is None:
        return ()
    pairs = spec.items() if isinstance(spec, Mapping) else spec if (
        isinstance(spec, tuple) and all(isinstance(r, tuple) and len(r) == 2 for r in spec)) \
        else None

    def value(v: Any, where: str) -> Any:
        try:
            return parse(v)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    if pairs is not None:
        rules = []
        for key, v in pairs:
            if not isinstance(key, str) or not key:
                raise ValueError(f"{option} keys are {keys}, got {key!r}")
            rules.append((key, value(v, f"{option}[{key!r}]")))
        return tuple(rules)
    if not single:
        raise ValueError(f"{option} must be a mapping {{{keys}: value}}, got "
                         f"{type(spec).__name__}")
    return (("*", value(spec, option)),)


_GEMM_KEYS = (f"operator kinds, roles ({', '.join(ROLES)}), names or globs over "
              f"'module.path/kind'")


def format_rules(spec: Any) -> tuple:
    """``formats=`` as ``((pattern, Format), ...)``: keys are stable operator names
    (``"blocks.0.attn/exp#0"``) or globs over them; values format names, ``(e, m)`` or
    :class:`Format`. None or an empty mapping: no override."""
    return _pattern_rules(spec, "formats", "operator names or globs over them", get_format,
                          single=False)


def accumulation_rules(spec: Any) -> tuple:
    """``accumulate=`` as ``((pattern, Accumulation or None), ...)``: one spec applies to every
    modelled GEMM (``"*"``); a mapping's keys are operator kinds (``"linear"``), roles
    (:data:`ROLES`: ``"fprop"``, ``"dgrad"``, ``"wgrad"``, as Transformer Engine configures
    them), stable operator names or globs over qualified names (``"blocks.*.mlp.*/linear"``),
    first match wins (:func:`rule_for`); ``"fp32"`` (or None) is the trusted product. An empty
    tuple: nothing is modelled."""
    from .numerics.accumulation import Accumulation

    rules = _pattern_rules(spec, "accumulate", _GEMM_KEYS, Accumulation.parse)
    return () if rules == (("*", None),) else rules


def operand_rules(spec: Any) -> tuple:
    """``gemm_inputs=`` as ``((pattern, Format or None), ...)``: one format for every modelled
    GEMM (``"*"``), or ``{kind, role, glob over "module.path/kind" or operator name: format or
    None}`` (None: the operands as the program gives them), first match wins."""
    return _pattern_rules(spec, "gemm_inputs", _GEMM_KEYS,
                          lambda v: None if v is None else get_format(v))


def rule_for(rules: tuple, kind: str, qualified_name: str, name: Optional[str] = None,
             role: str = "fprop") -> Any:
    """The value of the first of ``rules`` (``((pattern, value), ...)``) that matches a GEMM:
    ``"*"``, its kind, its ``role`` (one of :data:`ROLES`; a forward graph's GEMMs are
    ``"fprop"``), its stable ``name``, or a glob over its ``"module.path/kind"``; None when
    none does (the trusted product, the program's operands). A role key matches its role
    only (never as a glob)."""
    import fnmatch

    for pattern, value in rules:
        if pattern in ROLES:
            if pattern == role:
                return value
        elif pattern in ("*", kind, name) or fnmatch.fnmatchcase(qualified_name, pattern):
            return value
    return None
