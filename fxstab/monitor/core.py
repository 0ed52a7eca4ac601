"""The monitor's core: operator table, rotating schedule, replicas, scores, promotions.

Both front ends (``monitor.backend()`` for ``torch.compile`` and ``monitor.wrap(model)`` for
eager models) discover operators, name them ``module.path/kind#k`` and route every call of a
candidate through :meth:`StabilityMonitor.route`, which runs the operator's current mode and,
when the schedule says so, K perturbed replicas of it (docs/design.md §8).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch.utils._pytree import tree_flatten

from ..capture.flat import flatten_call, unflatten_call
from ..numerics.randbits import derive_seed
from .config import MonitorConfig, Mode
from .modes import CustomOp, implementations
from .ops import OpState, custom_op_of, op_family, register_op

# OpState, register_op, custom_op_of and op_family live in .ops (below the front ends); they
# stay importable from here.
__all__ = ["StabilityMonitor", "Promotion", "OpState", "register_op", "custom_op_of",
           "op_family"]

@dataclass
class Promotion:
    """One mode change: ``old -> new`` of ``op`` at ``step`` because of ``score`` (``reason``)."""

    step: int
    op: str
    old: str
    new: str
    score: float
    reason: str


def _perturbed(x: torch.Tensor, k: int, u: float, g: torch.Generator) -> torch.Tensor:
    """``k`` replicas of ``x`` (fp32), each element times its own factor 1 + u r, r uniform in
    [-1, 1) to 2^-15: ``[k, *x.shape]``."""
    n = k * x.numel()
    words = torch.randint(-2**63, 2**63 - 1, ((n + 3) // 4,), dtype=torch.int64,
                          generator=g, device=x.device)
    r = words.view(torch.int16)[:n].view(k, *x.shape).to(torch.float32)
    # the factor first: x + u r x would turn an infinite element (a mask's -inf) into NaN
    return r.mul_(u / 32768.0).add_(1.0).mul_(x)


def _floats_of(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):  # the usual operator: one tensor, no pytree walk
        return [out] if out.is_floating_point() else []
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


class StabilityMonitor:
    """Always-on stability monitor for low-precision training (docs/design.md §8).

    Example::

        mon = fxstab.StabilityMonitor(format="bf16", k=4, tau_warn=0.05, tau_safe=0.5)
        model = torch.compile(model, backend=mon.backend())   # or: model = mon.wrap(model)
        for batch in data:
            loss = model(batch); loss.backward(); opt.step(); opt.zero_grad()
            mon.step()
        print(mon.modes, mon.promotions)

    Each step one operator of a rotating schedule (plus every operator whose score is at least
    ``watch`` times the threshold that would promote it next, plus promoted operators due for
    a recheck) is checked: K replicas run under ``no_grad`` on inputs scaled by
    (1 + U(-u, u)) (``screen_k`` of them first, the rest only when their S could matter); the
    relative dispersion S of their outputs updates the operator's EMA score, which drives
    promotions. After a non-finite loss,
    ``sweep(targeted=True)`` checks only the operators that made the non-finite value.
    Replicas draw from their own generator, so the training computation (outputs, gradients,
    global RNG) is unchanged while no operator is promoted.

    Args:
        config: A :class:`MonitorConfig`; or pass its fields as keyword arguments.
    """

    def __init__(self, config: Optional[MonitorConfig] = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise ValueError("pass either a MonitorConfig or keyword arguments, not both")
        self.config = config if config is not None else MonitorConfig(**kwargs)
        self._ops: dict[str, OpState] = {}
        self._order: list[str] = []
        self._step = 0
        self._sweep: set[str] = set()
        self._sweep_all = False
        self._hunt = False  # a targeted sweep is on for the current step
        self._hunt_found = False  # ...and has found a culprit
        self._hunt_failed = False  # the last targeted sweep found none: sweep all next time
        self._paused = 0
        self._forced: Optional[Mode] = None
        self._promotions: list[Promotion] = []
        self._gens: dict[Any, torch.Generator] = {}
        self._signs: dict[Any, torch.Tensor] = {}
        self.monitor_time = 0.0
        self._t_start: Optional[float] = None
        self._t_last_step: Optional[float] = None
        self.step_time = 0.0
        self.checks_run = 0
        self.replicas_run = 0

    # -- front ends ----------------------------------------------------------------------------
    def backend(self):
        """A ``torch.compile`` backend that routes candidate operators through this monitor."""
        from .compile import MonitorBackend
        return MonitorBackend(self)

    def wrap(self, model: torch.nn.Module):
        """Wrap an eager model: candidate calls inside its forward go through this monitor."""
        from .wrap import MonitoredModule
        return MonitoredModule(model, self)

    def register(self, name: str, fn: Callable, fp32_fn: Optional[Callable] = None,
                 stable_fn: Optional[Callable] = None, family: Optional[str] = None
                 ) -> Callable:
        """Register a custom operator (see :func:`register_op`); returns the callable to use."""
        return register_op(name, fn, fp32_fn, stable_fn, family)

    # -- operator table ------------------------------------------------------------------------
    def discover(self, name: str, kind: str, fn: Callable,
                 custom: Optional[CustomOp] = None) -> OpState:
        """The operator ``name`` of ``kind`` that calls ``fn`` (a registered ``custom`` op's
        spec), added to the table on its first call: what a front end calls per operator."""
        op = self._ops.get(name)
        if op is None:
            stable = torch.float64 if self.config.stable_dtype == "fp64" else torch.float32
            family = (custom.family or custom.name) if custom is not None else op_family(kind)
            op = OpState(name=name, kind=kind, index=len(self._order), family=family,
                         impls=implementations(kind, fn, stable, custom))
            if self._forced is not None:
                op.mode, op.pinned = self._forced, True
                op.ever_promoted = self._forced > Mode.NORMAL
            self._ops[name] = op
            self._order.append(name)
        return op

    @property
    def operators(self) -> list[str]:
        """Candidate operator names in schedule order."""
        return list(self._order)

    # -- runtime -------------------------------------------------------------------------------
    def route(self, op: OpState, args: tuple, kwargs: dict) -> Any:
        """One call of ``op``: its current mode's implementation, checked (K replicas, score,
        promotion) when the schedule says so. Front ends route every candidate call here."""
        if self._t_start is None:
            self._t_start = time.perf_counter()
        out = op.impls[op.mode](args, kwargs)
        if self._paused or op.pinned or op.skip_reason:
            return out
        if self._hunt and op.mode != Mode.STABLE_KERNEL and self._suspect(out, args, kwargs):
            self._hunt_found = True
            return self._check(op, args, kwargs, out, culprit=True)
        if op.checked_step != self._step and self._due(op):
            out = self._check(op, args, kwargs, out)
        return out

    def _suspect(self, out: Any, args: tuple, kwargs: dict) -> bool:
        """Targeted sweep: whether this call may have made the non-finite value itself.

        Its output is non-finite and no floating input holds a NaN (an infinite input may be
        legitimate: the -inf of an attention mask before a softmax). One finiteness test per
        output, which is all a finite operator costs; a NaN input is inherited from upstream.
        """
        t0 = time.perf_counter()
        try:
            if all(bool(torch.isfinite(y).all()) for y in _floats_of(out)):
                return False
            leaves, _ = tree_flatten((args, kwargs))
            return not any(bool(torch.isnan(t).any()) for t in leaves
                           if isinstance(t, torch.Tensor) and t.is_floating_point())
        finally:
            self.monitor_time += time.perf_counter() - t0

    def _recheck_due(self, op: OpState) -> bool:
        return op.mode != Mode.NORMAL and self._step - op.last_recheck >= self.config.recheck

    def _due(self, op: OpState) -> bool:
        cfg = self.config
        if self._recheck_due(op):
            return True
        if op.mode == Mode.STABLE_KERNEL:
            # Nothing is safer than STABLE_KERNEL: measuring it could not change its mode (in
            # the naive-softmax run such checks were 70 of 261 checks). Only the recheck of
            # its NORMAL kernel, which can demote it, still runs.
            return False
        if self._sweep_all or op.name in self._sweep:
            return True
        if self._step % cfg.period:
            return False
        check = self._step // cfg.period
        if op.index == check % len(self._order):
            # a settled operator (score far below its threshold, checked several times) is
            # checked on one of its turns in settle_every: on a clean model most checks are
            # of such operators, and their measurements feed an EMA that nothing promotes
            return (not self._settled(op)
                    or (check // len(self._order)) % cfg.settle_every == 0)
        # Watched operators (score approaching the threshold that would promote them next)
        # are checked on one check step in watch_every, staggered by index so that they do
        # not all land on the same step.
        return (op.score >= cfg.watch * self._next_threshold(op)
                and (check + op.index) % cfg.watch_every == 0)

    def _next_threshold(self, op: OpState) -> float:
        """The score above which ``op``'s mode would rise: its family's tau_warn at NORMAL,
        tau_safe once at FP32_ACCUMULATION.

        Watching and screening are relative to it. A promoted operator's score stays above
        the tau_warn it crossed (the FP32 kernel has the same conditioning): measured against
        tau_warn it was watched, i.e. checked with all K replicas on every step, for good,
        although only a score above tau_safe could change its mode (issue 52: bench_monitor's
        promoted LayerNorm made 1.3 checks per step instead of 0.3, the step +12% over the
        same model with that LayerNorm written in fp32, against +3.5% now)."""
        warn, safe = self.config.thresholds_for(op.family)
        return warn if op.mode == Mode.NORMAL else safe

    def _settled(self, op: OpState) -> bool:
        cfg = self.config
        return (op.mode == Mode.NORMAL and op.n >= cfg.settle_after
                and op.score < cfg.settle * cfg.thresholds_for(op.family)[0])

    def _check(self, op: OpState, args: tuple, kwargs: dict, out: Any,
               culprit: bool = False) -> Any:
        t0 = time.perf_counter()
        cfg = self.config
        op.checked_step = self._step
        self._sweep.discard(op.name)
        # A culprit of a targeted sweep is measured in its current mode (the one that just
        # made the non-finite value), never by a recheck of its NORMAL kernel.
        recheck = cfg.promote and not culprit and self._recheck_due(op)
        probe = Mode.NORMAL if recheck else op.mode
        tau_warn, tau_safe = cfg.thresholds_for(op.family)
        # Screening (config.screen_k): K replicas only when the measurement could matter, i.e.
        # could bring the score near the threshold that would promote the operator next.
        screen = cfg.watch * self._next_threshold(op) if cfg.promote and not recheck else None
        s = self.dispersion(op, probe, args, kwargs, screen=screen)
        if s is not None and math.isinf(s) and self._inherited(op, args, kwargs):
            # The safer kernel is non-finite too: the inputs already carry the overflow (an
            # operator upstream), so promoting this one would not help. In the experiment a
            # clean qkv linear downstream of an overflowing softmax was promoted this way.
            op.inherited_nonfinite += 1
            s = None
        if s is None:
            self.monitor_time += time.perf_counter() - t0
            return out
        op.checks += 1
        self.checks_run += 1
        if recheck:
            op.last_recheck = self._step
            limit = cfg.hysteresis * tau_warn
            if s < limit:
                self._set_mode(op, Mode.NORMAL, s, f"recheck: NORMAL dispersion {s:.3g} < "
                               f"hysteresis*tau_warn = {limit:.3g}")
                op.score, op.n, op.scored_step = s, 1, self._step
        else:
            # EMA over check steps: a score last updated d check steps ago keeps weight
            # beta^d (beta per step, as when checked every step). A plain per-check EMA let a
            # rotation measurement 56 steps old hold 80% of the score: a naive softmax at
            # S = 0.0147 (tau_warn 0.007) scored 0.0049 and was not even watched.
            d = max(1, (self._step - op.scored_step) // cfg.period)
            w = cfg.beta ** d
            op.score = s if op.n == 0 else w * op.score + (1 - w) * s
            op.scored_step = self._step
            if not math.isfinite(s):
                op.score = math.inf
            op.n += 1
            if cfg.promote:
                new = op.mode
                if op.score > tau_safe:
                    new = Mode.STABLE_KERNEL
                elif op.score > tau_warn:
                    new = max(op.mode, Mode.FP32_ACCUMULATION)
                if new > op.mode:
                    bound = "tau_safe" if new == Mode.STABLE_KERNEL else "tau_warn"
                    value = tau_safe if new == Mode.STABLE_KERNEL else tau_warn
                    reason = (f"score {op.score:.3g} > {bound} = {value:.3g}"
                              + (" (non-finite replica)" if not math.isfinite(s) else ""))
                    self._set_mode(op, new, op.score, reason)
                    op.n = 0  # the EMA restarts on the new kernel
                    op.last_recheck = self._step
                    # This call's output is recomputed with the safer kernel, so the step that
                    # detected the problem already trains on the repaired operator.
                    out = op.impls[op.mode](args, kwargs)
        op.history.append((self._step, s, op.score, probe.name))
        self.monitor_time += time.perf_counter() - t0
        return out

    def _set_mode(self, op: OpState, new: Mode, score: float, reason: str) -> None:
        self._promotions.append(Promotion(self._step, op.name, op.mode.name, new.name,
                                          float(score), reason))
        if new > Mode.NORMAL:
            op.ever_promoted = True
        op.mode = new

    def _inherited(self, op: OpState, args: tuple, kwargs: dict) -> bool:
        """Whether STABLE_KERNEL on the unperturbed inputs is non-finite as well."""
        with torch.no_grad():
            ys = _floats_of(op.impls[Mode.STABLE_KERNEL](args, kwargs))
        return not all(bool(torch.isfinite(y).all()) for y in ys)

    # -- the dispersion estimate ---------------------------------------------------------------
    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        g = self._gens.get(key)
        if g is None:
            g = self._gens[key] = torch.Generator(device=device)
        return g

    def _sign_vector(self, rows: int, device: torch.device) -> torch.Tensor:
        key = (rows, str(device))
        a = self._signs.get(key)
        if a is None:
            g = torch.Generator().manual_seed(derive_seed(self.config.seed, 0x5167, rows))
            a = (torch.randint(0, 2, (rows,), generator=g) * 2 - 1).to(torch.float32)
            a = self._signs[key] = a.to(device)
        return a

    def reduce(self, y: torch.Tensor, salt: int = 0) -> torch.Tensor:
        """Reduce a flat fp32 output (or a batch ``[k, n]`` of them) to at most
        ``projection_dim`` coordinates each.

        ``projection``: z = a^T Y with Y the output folded into rows of ``projection_dim``
        and ``a`` a fixed random sign vector, i.e. a fixed sign matrix R with E||Ry||^2 =
        ||y||^2 (cross terms cancel in expectation); ``block``: a fixed, seeded block of
        ``projection_dim`` consecutive elements; ``full``: ``y`` itself.
        """
        d = self.config.projection_dim
        n = y.shape[-1]
        if n <= d or self.config.estimator == "full":
            return y
        if self.config.estimator == "block":
            off = derive_seed(self.config.seed, 0xB10C, salt, n) % (n - d + 1)
            return y[..., off:off + d]
        rows, tail = divmod(n, d)
        a = self._sign_vector(rows + 1, y.device)
        z = a[:rows] @ y[..., : rows * d].reshape(*y.shape[:-1], rows, d)
        if tail:
            z[..., :tail] += a[rows] * y[..., rows * d:]
        return z

    def dispersion(self, op: OpState, mode: Mode, args: tuple, kwargs: dict,
                   screen: Optional[float] = None) -> Optional[float]:
        """S of ``op`` run in ``mode`` on K perturbed replicas of ``(args, kwargs)``.

        S = sqrt(sum_k ||y_k - ybar||^2 / (K-1)) / (||ybar|| + eps), norms after
        :meth:`reduce`; ``inf`` when a replica is non-finite; ``None`` when the call has no
        floating input (nothing to perturb; the operator is then skipped for good). With
        ``screen``, the first ``screen_k`` replicas give S first, and the other replicas run
        only when that S is at least ``screen``; S is then taken over all K.
        """
        cfg = self.config
        leaves, spec = flatten_call(args, kwargs)
        idx = [i for i, t in enumerate(leaves)
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not idx:
            op.skip_reason = "no floating-point input"
            return None
        if op.kind == "scaled_dot_product_attention":
            p = args[5] if len(args) > 5 else kwargs.get("dropout_p", 0.0)
            if p:
                op.skip_reason = "dropout inside the operator: replicas would differ by masks"
                return None
        u, k = cfg.unit_roundoff, cfg.k
        g = self._generator(leaves[idx[0]].device)
        g.manual_seed(derive_seed(cfg.seed, op.index, self._step) & (2**63 - 1))

        zs: list[torch.Tensor] = []
        with torch.no_grad():
            # Each input is upcast once; a run of replicas of an input is one draw and its
            # factors: x (1 + u r), r = v / 2^15 for v uniform 16-bit integers, four of
            # them from each uniform 64-bit draw (half the time of a float draw per element
            # on CPU, where the draws were most of a check: 0.2-0.4 ms per input of 32k
            # elements), r uniform in [-1, 1) to 2^-15. Only the screening replicas' factors
            # are drawn when a screen is given.
            bases = [leaves[i].to(torch.float32) for i in idx]

            def replicas(lo: int, hi: int) -> bool:
                if hi <= lo:
                    return True
                inputs = [_perturbed(b, hi - lo, u, g).to(leaves[i].dtype)
                          for i, b in zip(idx, bases)]
                ys = []
                for j in range(hi - lo):
                    rep = list(leaves)
                    for i, x in zip(idx, inputs):
                        rep[i] = x[j]
                    a, kw = unflatten_call(rep, spec)
                    outs = _floats_of(op.impls[mode](a, kw))
                    y = (outs[0].reshape(-1).to(torch.float32) if len(outs) == 1 else
                         torch.cat([t.reshape(-1).to(torch.float32) for t in outs]))
                    # A sampled block can miss a non-finite element; the projection and the
                    # full output carry it into S (inf or nan), tested once per S instead.
                    if cfg.estimator == "block" and not bool(torch.isfinite(y).all()):
                        return False
                    ys.append(y)
                    self.replicas_run += 1
                zs.extend(self.reduce(torch.stack(ys), op.index).unbind(0))
                return True

            def spread() -> float:
                z = torch.stack(zs)
                zbar = z.mean(dim=0)
                d = torch.sqrt((z - zbar).pow_(2).sum() / (len(zs) - 1))
                s = float(d / (torch.linalg.vector_norm(zbar) + cfg.eps))
                return s if math.isfinite(s) else math.inf

            first = min(cfg.screen_k, k) if screen is not None else k
            if not replicas(0, first):
                return math.inf
            if first < k:
                s = spread()
                if s < screen or math.isinf(s):
                    return s
            if not replicas(first, k):
                return math.inf
            return spread()

    # -- control -------------------------------------------------------------------------------
    def step(self) -> None:
        """End the current training step (advances the schedule, accounts step time)."""
        now = time.perf_counter()
        start = self._t_last_step if self._t_last_step is not None else self._t_start
        if start is not None:
            self.step_time += now - start
        self._t_last_step = now
        self._step += 1
        self._sweep_all = False
        if self._hunt:
            self._hunt_failed = not self._hunt_found
        self._hunt = self._hunt_found = False

    @property
    def current_step(self) -> int:
        return self._step

    def sweep(self, targeted: bool = False) -> None:
        """Check operators on their next call, for the rest of this step.

        Args:
            targeted: ``False`` checks every operator (what calibration measures). ``True``,
                for a retry after a non-finite loss, checks only the culprits: operators whose
                output is non-finite although no input holds a NaN (an operator at
                STABLE_KERNEL excepted: nothing safer exists). Every other operator costs one
                finiteness test of its output, and once a culprit is repaired (in the same
                call) the operators downstream see finite inputs again. A targeted sweep that
                finds no culprit (the non-finite value came from an unmonitored operator or
                from the backward pass) makes the next targeted sweep a full one.
        """
        if targeted and not self._hunt_failed:
            self._hunt = True
            return
        self._hunt_failed = False
        self._sweep = set(self._order)
        self._sweep_all = True
        for op in self._ops.values():
            op.checked_step = -1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No checks inside (e.g. evaluation); modes still apply."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def force(self, mode: "Mode | str", names: Optional[Iterable[str]] = None) -> None:
        """Pin operators to ``mode`` (never checked or changed); ``None`` pins every operator,
        including ones discovered later (the all-fp32 baseline uses STABLE_KERNEL)."""
        mode = Mode.parse(mode)
        targets = list(self._order) if names is None else list(names)
        for name in targets:
            if name not in self._ops:
                raise ValueError(f"unknown operator {name!r}; known: {self._order}")
            op = self._ops[name]
            if op.mode != mode:
                self._set_mode(op, mode, op.score, "forced")
            op.pinned = True
        if names is None:
            self._forced = mode

    def calibrate(self, clean: Any, injected: Any, *, safe_ratio: float = 10.0,
                  margin: float = 2.0, per_family: bool = True):
        """Set thresholds from clean vs injected dispersions; returns the separation found.

        With ``per_family`` (and mappings operator name -> dispersions, as
        :meth:`measurements` returns) every family seen clean gets its own pair in
        ``config.thresholds``; ``tau_warn`` / ``tau_safe`` become the global pair for the
        others. See :func:`fxstab.monitor.calibrate.choose_thresholds`.
        """
        from .calibrate import choose_thresholds
        cal = choose_thresholds(clean, injected, safe_ratio=safe_ratio, margin=margin,
                                family=op_family if per_family else None)
        self.config = replace(self.config, tau_warn=cal.tau_warn, tau_safe=cal.tau_safe,
                              thresholds=cal.thresholds)
        return cal

    # -- reporting -----------------------------------------------------------------------------
    @property
    def modes(self) -> dict[str, str]:
        return {n: self._ops[n].mode.name for n in self._order}

    @property
    def scores(self) -> dict[str, float]:
        return {n: self._ops[n].score for n in self._order}

    @property
    def promotions(self) -> list[Promotion]:
        return list(self._promotions)

    @property
    def history(self) -> dict[str, list]:
        """Per operator: (step, S, score, probed mode) for every check."""
        return {n: list(self._ops[n].history) for n in self._order}

    def measurements(self) -> dict[str, list[float]]:
        """Per operator, every dispersion S measured so far (calibration input)."""
        return {n: [h[1] for h in self._ops[n].history] for n in self._order}

    @property
    def settled(self) -> list[str]:
        """Operators checked on one rotation turn in ``settle_every`` (config ``settle``)."""
        return [op.name for op in self._ops.values() if self._settled(op)]

    @property
    def promoted(self) -> list[str]:
        """Operators currently above NORMAL (pinned ones included)."""
        return [n for n in self._order if self._ops[n].mode != Mode.NORMAL]

    @property
    def ever_promoted(self) -> list[str]:
        return [n for n in self._order if self._ops[n].ever_promoted]

    @property
    def fraction_promoted(self) -> float:
        return len(self.promoted) / len(self._order) if self._order else 0.0

    @property
    def time_fraction(self) -> float:
        """Monitor time (replicas, scores) as a fraction of the steps' wall-clock time."""
        return self.monitor_time / self.step_time if self.step_time > 0 else 0.0

    def summary(self) -> dict:
        """JSON-ready state: config, modes, scores, promotions, overhead."""
        cfg = asdict(self.config)
        cfg["format"] = self.config.fmt.name
        return {
            "config": cfg, "step": self._step, "operators": len(self._order),
            "modes": self.modes, "scores": self.scores,
            "promotions": [asdict(p) for p in self._promotions],
            "promoted": self.promoted, "ever_promoted": self.ever_promoted,
            "fraction_promoted": self.fraction_promoted, "checks": self.checks_run,
            "replicas": self.replicas_run,
            "monitor_time_s": self.monitor_time, "step_time_s": self.step_time,
            "time_fraction": self.time_fraction,
        }

    def save_html(self, path: Any) -> Any:
        """The history as a self-contained page (:func:`fxstab.plots.html.monitor_page`):
        scores per operator and step against each family's thresholds, promotions."""
        from ..plots import html
        cut = {n: self.config.thresholds_for(self._ops[n].family) for n in self._order}
        return html.write_page(html.monitor_page(self.history, self.summary(), cut), path)

    def table(self) -> str:
        """Operators as text: name, mode, score, checks; an operator not checked yet says so
        (its score is no measurement, not 0)."""
        w = max([len(n) for n in self._order] + [8])
        lines = [f"{'operator':<{w}}  {'mode':<17}  {'score':>11}  checks"]
        for n in self._order:
            op = self._ops[n]
            score = f"{op.score:11.3g}" if op.checks else f"{'not checked':>11}"
            lines.append(f"{n:<{w}}  {op.mode.name:<17}  {score}  {op.checks}")
        return "\n".join(lines)
