"""The ``torch.compile`` backend (docs/design.md §3, §4, §6).

``fxstab.backend(...)`` returns an :class:`FxstabBackend`. For every graph dynamo captures it
builds a :class:`GraphAnalysis`: the selection of instrumented operators, their stable names and
the edges between them, decided once at compile time. At run time an analysed call

1. runs the captured graph as is (the *deterministic path*: bit-identical to eager, autograd
   and optimizer unchanged), remembering the RNG state before and after;
2. runs the same graph on N stacked samples ``[N, ...]`` in the working dtype, without autograd
   (the *stochastic path*: the rules of :class:`SampleTracer`, traced once per input signature
   into generated code, :mod:`fxstab.passes`): each operator is lifted to the samples
   with ``torch.vmap`` (per sample where it cannot be), GEMM-like operators get the
   data-perturbation surrogate when their input samples are insufficiently separated, and the
   selected operators' outputs are rounded into the format (random rounding, one Philox stream
   per operator and call) and measured;
3. restores the RNG state, so the user's next random numbers are the ones they would have had.

Random operators see the deterministic pass's RNG state and dtype: dropout draws its mask once
(on ones) and multiplies every sample by it; other random operators, and every operator that
runs once per sample (no vmap rule: LSTM/GRU, custom kernels), start each sample from the state
the operator found, so all samples draw what the deterministic pass drew. Buffers the graph
mutates (BatchNorm running statistics, inputs updated in place) are cloned for the stochastic
path, and BatchNorm in training mode runs per sample so samples never mix statistics. Fused
fast paths (``torch._transformer_encoder_layer_fwd``) run their composite on the samples; how
each operator ran is :meth:`FxstabBackend.coverage` (``fxstab/records/coverage.py``).
"""

import contextlib
import inspect
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.fx

from . import executors
from .analysis.op_level import GraphAnalysis, GraphInfo, SampleCapture
from .capture.naming import NameRegistry
from .config import AnalysisConfig
from .cpu import bindings as native
from .records.coverage import Coverage
from .records.report import OpReport, ReportLog
from .records.run import RunState

__all__ = ["backend", "FxstabBackend", "default_backend", "get_default_backend", "NEVER_RAN",
           "NOT_CALLED", "CoverageWarning", "PatternWarning", "coverage_warning",
           "coverage_fix", "unmatched_pattern_warning"]

# What digit_map() says when torch.compile never handed this backend a graph.
NEVER_RAN = (
    "fxstab: this backend never ran: torch.compile handed it no graph, so the digit map is "
    "empty. Dynamo compiles no frame for DistributedDataParallel's forward nor for a torch.nn "
    "container it wraps (torch.compile(DDP(nn.Sequential(...)))): compile the inner module "
    "(torch.compile(ddp.module, backend=be), or a model class of your own inside DDP), and "
    "check that the compiled model was called.")

# What digit_map() says when the compiled model has not been called since the backend was made.
NOT_CALLED = (
    "fxstab: the model has not run: torch.compile compiles and analyses on the first call, and "
    "no compiled function or model was called since this backend was made, so the digit map "
    "is empty. Call the compiled model (compiled(*inputs)), then digit_map().")


def _dynamo_frames() -> int:
    """The frames Dynamo has been handed in this process (compiled or not)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"])


class CoverageWarning(UserWarning):
    """Less than :data:`~fxstab.records.coverage.WARN_BELOW` of the floating operators were
    analysed (:meth:`FxstabBackend.digit_map` says which were not, why, and the fix)."""


class PatternWarning(UserWarning):
    """A ``formats=``, ``accumulate=`` or ``gemm_inputs=`` pattern matched no analysed
    operator (:meth:`FxstabBackend.digit_map` names the closest)."""


def coverage_fix(cov: dict) -> str:
    """What to do about the counted operators a coverage dict (``metadata["coverage"]``) left
    out: ``select="*"`` analyses the kinds left "not selected"; other reasons (an operator
    whose analysis failed) are in ``be.coverage()`` / ``fxstab show``."""
    missed = [o for o in cov.get("operators", ())
              if o.get("counted") and o.get("how") != "analysed"]
    unselected = [o for o in missed if str(o.get("reason", "")).startswith("not selected")]
    fix = []
    if unselected:
        fix.append('select="*" analyses the operator kinds left "not selected"')
    if len(unselected) < len(missed):
        fix.append("be.coverage().table() (fxstab show) lists every operator left out and why")
    return "; ".join(fix)


def coverage_warning(cov: dict) -> Optional[str]:
    """One line saying that less than :data:`WARN_BELOW` of the floating operators were
    analysed: the top reasons (each with the kinds and counts of its operators) and the fix;
    None at or above it (or when nothing is counted)."""
    from collections import Counter

    from .records.coverage import WARN_BELOW

    frac = cov.get("fraction") if isinstance(cov, dict) else None
    if frac is None or frac >= WARN_BELOW:
        return None
    missed = [o for o in cov.get("operators", ())
              if o.get("counted") and o.get("how") != "analysed"]
    by_reason: dict = {}
    for o in missed:
        reason = str(o.get("reason", "")).split(";")[0]
        reason = reason if len(reason) <= 100 else reason[:97] + "..."
        by_reason.setdefault(reason, Counter())[o.get("kind", "")] += 1
    top = sorted(by_reason.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
    parts = []
    for reason, kinds in top[:3]:
        shown = [f"{k} x{n}" if n > 1 else k
                 for k, n in sorted(kinds.items(), key=lambda kn: (-kn[1], kn[0]))]
        parts.append(f"{sum(kinds.values())} x {reason} ({', '.join(shown[:6])}"
                     f"{', ...' if len(shown) > 6 else ''})")
    if len(top) > 3:
        parts.append(f"{sum(sum(k.values()) for _, k in top[3:])} for other reasons")
    counted = cov.get("counted", 0)
    return (f"fxstab: only {round(frac * counted)} of the {counted} floating operators "
            f"({100 * frac:.0f}%) were analysed; the digit map leaves out: {'; '.join(parts)}. "
            f"Fix: {coverage_fix(cov)}")


def unmatched_pattern_warning(option: str, pattern: str, operators: list) -> Optional[str]:
    """The warning for an ``option`` (``formats``, ``accumulate``, ``gemm_inputs``) pattern that
    matches none of ``operators`` (``[(stable name, kind), ...]``, the analysed ones) as the
    option matches them (``formats``: a name or a glob over names,
    :meth:`AnalysisConfig.format_for`; the GEMM options also a kind or a glob over
    ``module.path/kind``, :func:`fxstab.config.rule_for`), with the closest names; None when
    it matches one, or is ``"*"`` or a role."""
    import difflib
    import fnmatch
    import re

    from .config import ROLES

    if pattern == "*" or (option != "formats" and pattern in ROLES):
        return None
    for name, kind in operators:
        if pattern == name or fnmatch.fnmatchcase(name, pattern):
            return None
        qn = name.rsplit("#", 1)[0]
        if option != "formats" and (pattern == kind or fnmatch.fnmatchcase(qn, pattern)):
            return None
    names = sorted({name for name, _ in operators})
    close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.5)
    if not close:  # a glob far from any name: the names holding its longest literal part
        word = max(re.split(r"[*?\[\]]+", pattern), key=len).strip("./#")
        close = [n for n in names if word and word in n][:3]
    hint = (f"; the closest: {', '.join(close)}" if close else
            f"; its operators are named like {', '.join(names[:3])}")
    if option == "formats" and pattern in {kind for _, kind in operators}:
        hint += f" (formats= keys are operator names: a kind as '*{pattern}#*')"
    return (f"fxstab: {option}={{{pattern!r}: ...}} matches no analysed operator of the "
            f"model, so it changes nothing{hint}")


def _user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, for the function calling this one, of the first
    frame outside fxstab: a warning points at the user's line (``be.digit_map()``,
    ``be.table()``), however deep inside fxstab it was raised."""
    import os
    import sys

    root = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return level


class FxstabBackend:
    """A ``torch.compile`` backend that records per-operator digits (see :func:`backend`)."""

    def __init__(self, config: AnalysisConfig) -> None:
        # what every analysis of this backend reads and writes (fxstab.records.run)
        self.state = RunState(config)
        # what digit_map() has warned about (each once per backend): "coverage", and
        # (option, pattern) for formats=/accumulate=/gemm_inputs= patterns matching nothing
        self._warned: set = set()
        # no graph and no frame since: the model was never called (NOT_CALLED), rather than
        # called with nothing compiled (NEVER_RAN)
        self._frames_at_start = _dynamo_frames()

    @property
    def config(self) -> AnalysisConfig:
        return self.state.config

    @property
    def graphs(self) -> list:
        """The analyses of the captured graphs (both levels, backward ones too), in order."""
        return self.state.graphs

    @property
    def names(self) -> NameRegistry:
        return self.state.names

    @property
    def modules(self) -> set:
        """Module paths of the captured graphs' operators."""
        return self.state.modules

    @property
    def enabled(self) -> bool:
        """Whether calls are analysed (False inside :meth:`paused`)."""
        return self.state.enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self.state.enabled = on

    def kernels_for(self, t: torch.Tensor) -> str:
        """Which kernels round the samples ``t`` and measure their digits: ``"cpu"`` (the
        fused C kernels), ``"triton"`` or ``"torch"`` (the references), as
        :mod:`fxstab.executors` chooses under the ``kernels`` option."""
        return self.state.kernel(executors.ROUND, t).name

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        state = self.state
        if self.config.granularity == "aten":
            from .analysis.aten_level import compile_aten  # arithmetic level

            analysis = compile_aten(state, gm, example_inputs)
        else:
            analysis = GraphAnalysis(gm, state, len(state.graphs))
            state.graphs.append(analysis)
        if self.config.backward:
            from .analysis.backward import through_autograd

            through_autograd(analysis, example_inputs)
        return analysis

    # -- reporting ------------------------------------------------------------------------
    @property
    def reports(self) -> ReportLog:
        """One ``OpReport`` per instrumented operator and analysed call, in order (a list to
        read; its reports are built when first read: ``fxstab.records.report.ReportLog``)."""
        return self.state.reports

    @reports.setter
    def reports(self, reports: Iterable[OpReport]) -> None:
        self.state.reports = reports

    @property
    def infos(self) -> list[GraphInfo]:
        return [g.info for g in self.graphs]

    def clear(self) -> None:
        """Forget the reports (compiled graphs and names stay); a digit map made after this
        counts only the calls analysed since (its ``analysed_calls`` comes from the reports)."""
        self.reports.clear()

    @contextlib.contextmanager
    def phase(self, name: str, step: Optional[int] = None) -> Iterator["FxstabBackend"]:
        """Label the reports of the calls inside: ``with be.phase("train", step=i): ...``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"phase name must be a non-empty string, got {name!r}")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise ValueError(f"step must be an int or None, got {step!r}")
        state = self.state
        old = (state.phase, state.step)
        state.phase, state.step = name, step
        try:
            yield self
        finally:
            state.phase, state.step = old

    @contextlib.contextmanager
    def capture_samples(self) -> Iterator[SampleCapture]:
        """Keep the output samples of the calls analysed inside the block (see
        :class:`SampleCapture`): ``with be.capture_samples() as cap: y = model(x)``, then
        ``cap.output`` is ``y``'s samples ``[N, *y.shape]``. Nothing is kept outside a block."""
        cap = SampleCapture()
        self.state.captures.append(cap)
        try:
            yield cap
        finally:
            self.state.captures.remove(cap)

    @contextlib.contextmanager
    def paused(self) -> Iterator["FxstabBackend"]:
        """Run without analysis inside the block (only the deterministic path)."""
        old = self.enabled
        self.enabled = False
        try:
            yield self
        finally:
            self.enabled = old

    def coverage(self) -> Coverage:
        """How every operator of the captured graphs ran in its latest analysed call:
        analysed (rounded and recorded; how: vmap, per sample, ...), run unrounded, or
        skipped, each with its reason (:mod:`fxstab.records.coverage`)."""
        entries: list = []
        for g in self.graphs:  # both levels fill GraphInfo.coverage
            entries += g.coverage_entries()
        return Coverage(entries)

    def sampled_graphs(self) -> list:
        """The generated stochastic paths (:class:`fxstab.analysis.sampled_graph.SampledGraph`), the
        latest signature of each captured graph first: ``print(be.sampled_graphs()[0].code)``
        shows the rewritten graph (both granularities)."""
        out: list = []
        for g in self.graphs:
            out += g.sampled_graphs()
        return out

    def metadata(self) -> dict:
        c = self.config
        meta = {
            "format": "auto" if c.auto_format else c.format.name, "n_samples": c.n_samples,
            "seed": c.seed,
            "granularity": c.granularity, "confidence": c.confidence,
            "rounding": c.rounding.value, "output": c.output, "every": c.every,
            "modules": sorted(self.modules), "coverage": self.coverage().as_dict(),
        }
        if c.accumulate:  # the GEMMs' accumulator: pattern -> its label ("fp32": trusted)
            meta["accumulate"] = {p: acc.label if acc is not None else "fp32"
                                  for p, acc in c.accumulate}
        # the bf16 GEMM path's platform checks where they decided a weight's products
        # (fxstab.numerics.lowp_gemm): device -> {"ok", "reason"}
        checked = {dev: {"ok": v.ok, "reason": v.reason} for g in self.graphs
                   for dev, v in getattr(g.info, "lowp_checks", {}).items()}
        if checked:
            meta["lowp_gemm"] = checked
        no_output = sorted(set().union(*(g.info.no_output for g in self.graphs)))
        if no_output:  # operators whose values reach only integer results (DigitMap's notes)
            meta["no_output"] = no_output
        # operators whose values are the graphs' outputs: read by other operators too, their
        # NaN/inf is no one's to absorb (DigitMap.absorbed_nonfinite)
        outputs = set().union(*(getattr(g.info, "outputs", set()) for g in self.graphs))
        read = {i for r in self.reports for i in r.inputs}
        if outputs & read:
            meta["outputs"] = sorted(outputs & read)
        if c.formats:  # per-operator formats (a precision plan): pattern -> format
            meta["formats"] = {p: f.name for p, f in c.formats}
        # the GEMMs whose low-precision recipe the program names (torchao's
        # float8 ones): operator -> "torchao float8 rowwise: fp8_e4m3 operands, row scaling"
        recipes = {name: label for g in self.graphs
                   for name, label in getattr(g.info, "recipes", {}).items()}
        if recipes:
            meta["gemm_recipes"] = recipes
        if c.gemm_inputs:  # the GEMMs' operand format: "fp8_e4m3/block128", or per pattern
            label = {p: f"{f.name}/{c.gemm_scaling}" if f is not None else "as given"
                     for p, f in c.gemm_inputs}
            meta["gemm_inputs"] = label["*"] if list(label) == ["*"] else label
        return meta

    def digit_map(self, target: str = "", gather: bool = False):
        """The reports aggregated per operator (a :class:`fxstab.digitmap.DigitMap`).

        ``gather=True`` (every rank of an initialised ``torch.distributed`` process group must
        call it): one map of every rank's reports, merged as calls are merged, the same on
        every rank; ``metadata["world_size"]``, and ``metadata["provenance"]``: per operator,
        the ranks that reported it and their calls (``{"fc1/linear#0": {"0": 2, "1": 2}}``).
        """
        from .digitmap import DigitMap

        if not self.graphs:
            called = _dynamo_frames() != self._frames_at_start
            warnings.warn(NEVER_RAN if called else NOT_CALLED, RuntimeWarning, stacklevel=2)
        meta = self.metadata()
        self._warn_what_was_skipped(meta["coverage"])
        if target:
            meta["target"] = target
        if not gather:
            return DigitMap.from_reports(self.reports, metadata=meta)
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("digit_map(gather=True) needs an initialised torch.distributed "
                             "process group (torch.distributed.init_process_group); without "
                             "one, call digit_map()")
        world = dist.get_world_size()
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, list(self.reports))
        provenance: dict = {}
        calls = 0
        for rank, reports in enumerate(per_rank):
            calls += len({(r.phase, r.step, r.call) for r in reports})
            for r in reports:
                where = provenance.setdefault(r.name, {})
                where[str(rank)] = where.get(str(rank), 0) + 1
        meta.update(world_size=world, provenance=provenance, analysed_calls=calls)
        return DigitMap.from_reports([r for reports in per_rank for r in reports], metadata=meta)

    def _warn_what_was_skipped(self, cov: dict) -> None:
        """Say, once per backend, what the digit map leaves out (called by :meth:`digit_map`).

        * A :class:`CoverageWarning` when less than :data:`WARN_BELOW` of the floating
          operators were analysed: the top reasons, with the kinds and counts of the operators
          left out, and the fix (:func:`coverage_fix`).
        * A :class:`PatternWarning` per ``formats=``, ``accumulate=`` or ``gemm_inputs=``
          pattern that matches no analysed operator, with the closest operator names. Checked
          here rather than when a graph is planned: a model compiles to several graphs (graph
          breaks, the backward), and a pattern is only unmatched if no graph has it; by the
          first ``digit_map()`` every graph the user ran has been planned. A role
          (``"fprop"``, ``"dgrad"``, ``"wgrad"``) and ``"*"`` are never warned about.
        """
        if "coverage" not in self._warned:
            message = coverage_warning(cov)
            if message:
                self._warned.add("coverage")
                warnings.warn(message, CoverageWarning, stacklevel=_user_stacklevel())
        c = self.config
        if not (c.formats or c.accumulate or c.gemm_inputs):
            return
        ops = {(o["operator"], o["kind"]) for o in cov.get("operators", ())
               if o.get("how") == "analysed"} | {(r.name, r.kind) for r in self.reports}
        for option, rules in (("formats", c.formats), ("accumulate", c.accumulate),
                              ("gemm_inputs", c.gemm_inputs)):
            for pattern, _ in rules:
                if (option, pattern) in self._warned or not ops:
                    continue
                message = unmatched_pattern_warning(option, pattern, sorted(ops))
                if message:
                    self._warned.add((option, pattern))
                    warnings.warn(message, PatternWarning, stacklevel=_user_stacklevel())

    def table(self, top: Optional[int] = None) -> str:
        return self.digit_map().table(top) if top is not None else self.digit_map().table()


def backend(
    granularity: str = "op",
    format: Any = "bf16",
    n_samples: int = 3,
    seed: int = 0,
    rounding: str = "random",
    output: str = "deterministic",
    select: Any = None,
    every: int = 1,
    confidence: float = 0.95,
    kernels: str = "auto",
    config: Any = None,
    **options: Any,
) -> FxstabBackend:
    """An fxstab ``torch.compile`` backend.

    Args:
        granularity: ``"op"`` (torch-level operators) or ``"aten"`` (aten primitives).
        format: Simulated format (``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``, ``(e, m)``...).
        n_samples: N synchronous samples (>= 2; 3 as in CADNA).
        seed: Seed of all random streams; the same seed gives the same digit map.
        rounding: ``random`` (CESTAC), ``stochastic``, ``nearest``, ``up``, ``down``, ``zero``.
        output: ``"deterministic"`` returns exactly what eager returns; ``"mean"`` returns the
            sample mean with straight-through gradients.
        select: Which operators to instrument: ``None`` (the default families of docs/design.md §3),
            a family/kind name (any torch function's name: ``"erfinv"``, ``"fft_rfft"``),
            ``"custom"``, ``"all"`` or ``"*"`` (every operator), a glob over
            ``module.path/kind``, a list of those, or a predicate ``(node, qualified_name) ->
            bool``; any other name is a ValueError (docs/backend.md, "Selection").
        every: Analyse one call in ``every``; the others only run the deterministic path.
        confidence: Confidence of the CESTAC estimator (Student t).
        kernels: Implementation of rounding, statistics and the surrogate: ``auto`` (Triton on
            CUDA tensors, the fused CPU kernels of :mod:`fxstab.cpu.bindings` on CPU tensors, the
            plain-torch references where neither applies), ``triton``, ``cpu`` or ``torch``.
        **options: ``diagnostics``, ``cancel_digits``, ``zero_threshold``,
            ``data_perturbation_threshold``, ``saturate``, ``trace_rnn``, ``backward``,
            ``accumulate`` (the GEMMs' accumulator: a preset name or an
            :class:`fxstab.Accumulation` for every linear/matmul/mm/bmm, or ``{kind or glob:
            spec}``; docs/accumulation.md), ``unrounded`` (operators measured, not rounded:
            an ablation, :func:`fxstab.operator_impact`), ``lowp_gemm`` (default True: a bf16
            model's linear layers of the samples in bf16 GEMMs, :mod:`fxstab.numerics.lowp_gemm`;
            False: in fp32) (see AnalysisConfig).
        config: A settings file (``fxstab.toml``, a ``pyproject.toml`` with ``[tool.fxstab]``,
            or a folder to search from; ``True``: search from the current folder), whose
            analysis options apply under the arguments given here (an argument left at its
            default takes the file's value; docs/config.md).
    """
    if config is not None and config is not False:
        from . import configfile

        given = dict(granularity=granularity, format=format, n_samples=n_samples, seed=seed,
                     rounding=rounding, output=output, select=select, every=every,
                     confidence=confidence, kernels=kernels)
        defaults = {k: p.default for k, p in inspect.signature(backend).parameters.items()
                    if k in given}
        explicit = {k: v for k, v in given.items() if v is not defaults[k] and v != defaults[k]}
        loaded = configfile.load(None if config is True else config)
        merged = {**loaded.backend_options(), **explicit, **options}
        return backend(**{**defaults, **merged})
    unknown = set(options) - set(AnalysisConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(unknown_options_message(sorted(unknown)))
    cfg = AnalysisConfig(granularity=granularity, format=format, n_samples=n_samples, seed=seed,
                         rounding=rounding, output=output, select=select, every=every,
                         confidence=confidence, kernels=kernels, **options)
    if cfg.kernels == "triton":
        _check_triton_usable()
    if cfg.kernels == "cpu" and not native.available():
        raise ValueError("kernels='cpu' needs the fused CPU kernels, which could not be built "
                         "here (a C compiler with OpenMP); use kernels='auto' or 'torch'")
    if cfg.trace_rnn:
        # Dynamo graph-breaks on nn.LSTM/GRU/RNN unless told to trace them.
        import torch._dynamo

        torch._dynamo.config.allow_rnn = True
    return FxstabBackend(cfg)


def unknown_options_message(names: list) -> str:
    """What :func:`backend` says of keyword arguments it does not take: each name, the known
    option closest to it (``formt`` -> ``format``: difflib's ratio >= 0.6), then every known
    option."""
    import difflib

    known = sorted({*inspect.signature(backend).parameters, *AnalysisConfig.__dataclass_fields__}
                   - {"options"})
    parts = []
    for name in names:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (f"unknown fxstab option{'s' if len(names) > 1 else ''} {', '.join(parts)}; the "
            f"options of fxstab.backend are {', '.join(known)} (the README's option table)")


def _check_triton_usable() -> None:
    """kernels="triton" needs Triton, and a GPU or the interpreter: say so before compiling."""
    import os

    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ValueError("kernels='triton' needs the triton package (pip install 'fxstab[kernels]'); "
                         "use kernels='torch' or 'auto'") from exc
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError("kernels='triton' without a CUDA device runs the kernels under the Triton "
                         "interpreter only: set TRITON_INTERPRET=1 before importing fxstab, or use "
                         "kernels='torch' / 'auto'")


_DEFAULTS: dict = {}


def default_backend(gm: torch.fx.GraphModule, example_inputs: list,
                    options: Optional[dict] = None) -> Callable:
    """``torch.compile(model, backend="fxstab", options={...})``: a shared backend per set of
    options (the keyword arguments of :func:`backend`; none: the defaults).

    Its reports are at ``fxstab.get_default_backend(**options).reports``.
    """
    return get_default_backend(**(options or {}))(gm, example_inputs)


def get_default_backend(**options: Any) -> FxstabBackend:
    """The shared backend of ``torch.compile(..., backend="fxstab", options=options)``."""
    key = repr(sorted(options.items()))
    if key not in _DEFAULTS:
        _DEFAULTS[key] = backend(**options)
    return _DEFAULTS[key]
