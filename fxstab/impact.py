"""Each operator's impact on the model's outputs (issue 42): the digits the outputs lose
because of that operator's own rounding, not what it inherits.

A digit map ranks operators by their *local* loss (digits against their inputs). The question
users ask is another: which operator's rounding costs *my outputs* their digits? The two
disagree where it matters: a computational zero (the row sum of a centred input before a
LayerNorm) loses every local digit and costs the outputs nothing.

Impact is measured by ablation: the same analysis (same seed: every other operator draws the
same rounding directions, common random numbers) with an operator's output left unrounded
(``fxstab.backend(unrounded=[...])``, measured but not rounded); its impact is the digits the
outputs gain, averaged over their floating elements. Groups of operators in graph order are
ablated together and bisected where they gain at least ``threshold``: the k operators that
matter cost about ``1 + 2 k log2(n)`` analysed calls, not ``n``; an operator in a group that
gains less than ``threshold`` has an impact below it (recorded as the group's gain, an upper
bound of its own in practice). The output digits are CESTAC's over the samples of the graph's
outputs (``capture_samples``).

For models where ablation's calls are too many, ``method="first_order"`` linearizes instead
(:func:`_first_order`): one analysed call (the outputs' samples), then in fp64 2P
Jacobian-vector products with the operators' rounding noise as tangents (each output element's
variance, sigma_i^2) and P vector-Jacobian products with random signs r_i / sigma_i at the outputs, which give
every operator's share of the outputs' relative variance at once:
F_k = mean_i S_ik / sigma_i^2 with S_ik = sum_j J_ik,j^2 v_k,j (Hutchinson's estimator; v_k,j the
variance of the random rounding of the operator's element j into the format). Removing the
operator's rounding leaves the others' shares, T - F_k of T = sum_k F_k: its impact is
-log10((T - F_k) / T) / 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from .backend import backend
from .progress import Progress
from .numerics.digits import cestac_digits

__all__ = ["Impact", "operator_impact"]


@dataclass
class Impact:
    """What :func:`operator_impact` measured.

    ``by_operator[name]``: the digits the outputs gain when the operator's output is left
    unrounded (its own rounding's cost to the outputs); for an operator in a group that gained
    less than ``threshold``, that group's gain. ``resolved``: the operators measured alone.
    ``output_digits``: the outputs' average digits with every operator rounded. ``calls``: the
    analysed calls spent."""

    output_digits: float
    by_operator: dict = field(default_factory=dict)
    resolved: set = field(default_factory=set)
    calls: int = 0
    threshold: float = 0.1
    # the digit map of the analysis with every operator rounded, its operators' impacts set
    # (annotate): its findings lead with what costs the outputs
    digit_map: Any = None
    # "ablation" (measured) or "first_order" (linearized, _first_order); for the latter the
    # share of the outputs' variance the operators' modelled roundings explain (about 1 where
    # the linear model holds)
    method: str = "ablation"
    explained: float = math.nan

    def annotate(self, dm: Any) -> Any:
        """Set each of ``dm``'s operators' ``impact`` (and the map's threshold): its findings
        then rank by impact and say which local losses are harmless. Returns ``dm``."""
        for name, op in dm.operators.items():
            if name in self.by_operator:
                op.impact = float(self.by_operator[name])
        dm.metadata["impact_threshold"] = self.threshold
        dm.metadata["impact_calls"] = self.calls
        dm.metadata["impact_output_digits"] = self.output_digits
        return dm

    def ranked(self) -> list:
        """(operator, impact), largest impact first (graph order among equals)."""
        order = {n: i for i, n in enumerate(self.by_operator)}
        return sorted(self.by_operator.items(), key=lambda kv: (-kv[1], order[kv[0]]))

    def matters(self, name: str) -> bool:
        """Whether the operator's own rounding costs the outputs ``threshold`` digits or
        more."""
        return self.by_operator.get(name, 0.0) >= self.threshold

    def __repr__(self) -> str:
        top = self.ranked()[:1]
        return (f"Impact({len(self.by_operator)} operators, "
                + (f"{len(self.resolved)} measured alone" if self.method == "ablation" else
                   f"first order, {self.explained:.2f} of the variance explained")
                + f"; outputs {self.output_digits:.2f} avg digits with every operator "
                f"rounded; {self.calls} analysed calls"
                + (f"; largest: {top[0][0]} {top[0][1]:.2f}" if top else "") + ")")

    def _repr_html_(self) -> str:
        """Jupyter's display: the operators whose rounding costs the outputs most
        (:func:`fxstab.plots.notebook.impact_fragment`)."""
        from .plots import notebook

        return notebook.impact_fragment(self)

    def table(self, top: Optional[int] = 10) -> str:
        rows = self.ranked()[:top]
        width = max([len(n) for n, _ in rows] + [8])
        lines = [f"impact on the outputs ({self.output_digits:.2f} avg digits with every "
                 f"operator rounded; {self.calls} analysed calls; below {self.threshold:g}: "
                 f"harmless here)",
                 f"{'operator':<{width}}  {'impact':>7}"]
        bound = False
        for name, gain in rows:
            mark = "" if name in self.resolved else "  (group bound)"
            bound = bound or bool(mark)
            lines.append(f"{name:<{width}}  {gain:7.2f}{mark}")
        if bound:  # (issue 56, item 11: the words were explained nowhere)
            lines.append(f"group bound: left unrounded with its group, which gained less than "
                         f"{self.threshold:g} and was not split further; each operator in it is "
                         f"given the group's gain, a bound on its own")
        return "\n".join(lines)


def _output_digits(outputs: Any, fmt: Any, confidence: float) -> float:
    """The average CESTAC digits over every floating element of the outputs' samples."""
    total, count = 0.0, 0
    for t in pytree.tree_leaves(outputs):
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 and \
                t.shape[0] >= 2 and t[0].numel():
            d = cestac_digits(t.detach().double(), fmt, confidence)
            total += float(d.sum())
            count += d.numel()
    return total / count if count else math.nan


class _Selected(torch.nn.Module):
    """The model followed by what counts of its output (``outputs=``): its operators are
    named ``model...`` here, the selection's own (a loss) at the root."""

    def __init__(self, model: torch.nn.Module, select: Any) -> None:
        super().__init__()
        self.model, self.select = model, select

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.select(self.model(*args, **kwargs))


def _selector(outputs: Any) -> Any:
    """``outputs=`` as a function of the model's output: a callable as it is; names (keys of a
    dict output, such as a ``transformers`` ModelOutput's ``"logits"``, or attributes)."""
    if callable(outputs):
        return outputs
    if isinstance(outputs, str):
        outputs = [outputs]
    if not isinstance(outputs, (list, tuple)) or not outputs or \
            not all(isinstance(k, str) for k in outputs):
        raise ValueError(f"outputs must be a callable of the model's output (a loss) or a list "
                         f"of its keys; got {outputs!r}")
    keys = list(outputs)

    def select(out: Any) -> Any:
        picked = []
        for k in keys:
            if isinstance(out, dict) and k in out:
                picked.append(out[k])
            elif hasattr(out, k):
                picked.append(getattr(out, k))
            else:
                raise ValueError(f"outputs: the model's output has no {k!r}")
        return picked
    return select


def _model_name(name: str) -> str:
    """An operator's name in the model's own map: ``model.fc/linear#0`` -> ``fc/linear#0``,
    ``model/mean#0`` -> ``mean#0``; the selection's (a loss's) -> ``(outputs)/...``."""
    for prefix in ("model.", "model/"):
        if name.startswith(prefix):
            return name[len(prefix):]
    return f"(outputs)/{name}"


def _renamed(dm: Any) -> Any:
    """``dm`` of a :class:`_Selected` run with the model's own operator names."""
    import dataclasses

    from .digitmap.map import DigitMap

    ops = [dataclasses.replace(
        op, name=_model_name(op.name), inputs=tuple(_model_name(i) for i in op.inputs),
        module_path="" if op.module_path == "model" else op.module_path.removeprefix("model."))
        for op in dm.operators.values()]
    steps = [dataclasses.replace(st, name=_model_name(st.name)) for st in dm.steps]
    return DigitMap(ops, dict(dm.metadata), steps)


def operator_impact(model: torch.nn.Module, inputs: Sequence, *, threshold: float = 0.1,
                    kwargs: Optional[dict] = None, bisect: bool = True,
                    outputs: Any = None, progress: Optional[bool] = None,
                    method: str = "ablation", probes: int = 2, **options: Any) -> Impact:
    """Each analysed operator's impact on ``model``'s outputs (see the module docstring).

    Args:
        model: The model, called as ``model(*inputs, **kwargs)`` (under ``torch.no_grad``).
        inputs: Its positional inputs.
        threshold: Digits below which a group of operators is harmless (not bisected).
        kwargs: Its keyword inputs.
        outputs: What counts (default: every floating output): a callable of the model's
            output (``lambda out: F.cross_entropy(out, y)``: the impact on the loss, as in
            training), or a list of its keys (``["logits"]``). The selection's own operators
            (the loss's) are ablated too, named ``(outputs)/...``.
        bisect: False: every operator ablated alone (n + 1 analysed calls; the reference the
            bisection is validated against, ``benchmarks/bench_impact.py --validate``).
        method: ``"ablation"`` (default: measured) or ``"first_order"`` (one analysed call,
            2 ``probes`` fp64 forward passes and ``probes`` vector-Jacobian products: the module
            docstring; the model must be one captured graph, at either level: at
            ``granularity="aten"`` the graph lowered to the primitives is linearized).
        probes: the first-order route's random probes.
        progress: a bar of the analysed calls on stderr (:class:`fxstab.progress.Progress`);
            None: where stderr is a terminal.
        **options: :func:`fxstab.backend`'s options (format, n_samples, seed, select...);
            at ``granularity="aten"`` the ablated operators are the arithmetic primitives.
    """
    if not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ValueError(f"threshold must be a positive number of digits, got {threshold!r}")
    if "unrounded" in options:
        raise ValueError("operator_impact sets unrounded= itself")
    if method not in ("ablation", "first_order"):
        raise ValueError(f"method must be 'ablation' or 'first_order', got {method!r}")
    if isinstance(probes, bool) or not isinstance(probes, int) or probes < 1:
        raise ValueError(f"probes must be an integer >= 1, got {probes!r}")
    kwargs = kwargs or {}
    calls = 0
    target = model if outputs is None else _Selected(model, _selector(outputs))
    bar = Progress("fxstab impact", enabled=progress)  # (quiet off a terminal)
    # the names the backend sees (model.fc/linear#0 under a selection) and the model's own
    own = (lambda n: n) if outputs is None else _model_name

    def run(unrounded: Sequence[str]) -> tuple:
        nonlocal calls
        torch._dynamo.reset()
        be = backend(unrounded=list(unrounded) or None, **options)
        compiled = torch.compile(target, backend=be)
        with torch.no_grad(), be.capture_samples() as cap:
            compiled(*inputs, **kwargs)
        calls += 1
        cfg = be.config
        digits = _output_digits(cap.graphs[-1] if cap.graphs else None, cfg.format,
                                cfg.confidence)
        bar.update(note=f"{len(unrounded)} unrounded: outputs {digits:.2f} digits")
        return digits, be

    if method == "first_order":
        return _first_order(target, inputs, kwargs, own, outputs, threshold, probes, options)
    with bar:
        return _ablate(run, own, outputs, bisect, threshold, calls_of=lambda: calls)


def _ablate(run: Any, own: Any, outputs: Any, bisect: bool, threshold: float,
            calls_of: Any) -> Impact:
    """operator_impact's ablations: ``run(unrounded)`` -> (output digits, backend)."""
    base, be = run(())
    names = [n for n, op in be.digit_map().operators.items() if op.direction == "forward"]
    result = Impact(output_digits=base, threshold=threshold)
    pending = ([names] if names else []) if bisect else [[n] for n in names]
    gains: dict = {}
    while pending:
        group = pending.pop(0)
        digits, _ = run(group)
        gain = digits - base
        if len(group) == 1:
            gains[group[0]] = gain
            result.resolved.add(group[0])
        elif gain < threshold:
            for name in group:
                gains[name] = max(gain, 0.0)
        else:
            half = len(group) // 2
            pending += [group[:half], group[half:]]
    result.by_operator = {own(n): gains.get(n, 0.0) for n in names}
    result.resolved = {own(n) for n in result.resolved}
    result.calls = calls_of()
    dm = be.digit_map()
    result.digit_map = result.annotate(dm if outputs is None else _renamed(dm))
    torch._dynamo.reset()
    return result


# ------------------------------------------------------------------ the first-order route
def _first_order(target: Any, inputs: Sequence, kwargs: dict, own: Any, outputs: Any,
                 threshold: float, probes: int, options: dict) -> Impact:
    """operator_impact's first-order route (the module docstring)."""
    aten = options.get("granularity", "op") == "aten"
    torch._dynamo.reset()
    be = backend(**options)
    graphs: list = []

    def capture(gm: torch.fx.GraphModule, example: list) -> Any:
        compiled = be(gm, example)

        def run(*args: Any) -> Any:
            graphs.append((gm, args))
            return compiled(*args)
        return run

    with torch.no_grad(), be.capture_samples() as cap:
        torch.compile(target, backend=capture)(*inputs, **kwargs)
    if len({id(g) for g, _ in graphs}) != 1:
        raise ValueError(f"method='first_order' needs the model as one captured graph; dynamo "
                         f"captured {len({id(g) for g, _ in graphs})} (graph breaks): use "
                         f"method='ablation'")
    cfg = be.config
    base = _output_digits(cap.graphs[-1] if cap.graphs else None, cfg.format, cfg.confidence)
    dm = be.digit_map()
    gm, args = graphs[-1]
    if aten:  # the graph lowered to the primitives the map names, on the same inputs
        lowered = [g.primitive_nodes() for g in be.graphs if hasattr(g, "primitive_nodes")]
        if len(lowered) != 1 or lowered[0] is None:
            raise ValueError("method='first_order' found no lowered graph at the arithmetic "
                             "level (a lowering that failed: the coverage says why): use "
                             "method='ablation'")
        gm, nodes = lowered[0]
    else:
        nodes = {p.node.name: p.name for g in be.graphs for p in g.plans}
    names = {node: name for node, name in nodes.items()
             if name in dm.operators and dm.operators[name].status == "rounded"
             and dm.operators[name].direction == "forward"}
    # output elements whose samples hold a NaN/inf gain nothing from any one rounding (the
    # fp64 linearization cannot see the overflow): left out of the shares and the gains
    finite = [torch.isfinite(t).all(0) for t in _float_leaves(cap.graphs[-1] if cap.graphs
                                                                 else ())]
    shares, dominant = _variance_shares(gm, args, names, cfg, probes, finite)
    explained = sum(shares.values())
    result = Impact(output_digits=base, threshold=threshold, calls=1, method="first_order",
                    explained=explained)
    # the variance left without operator k is the others' shares: its impact
    # -log10((T - F_k) / T) / 2 reads the small remainder directly (better conditioned than
    # 1 - F_k where one operator dominates), at most what the cap leaves the outputs
    room = max(cfg.format.digit_cap - base, 0.0) if math.isfinite(base) else 0.0

    def impact(name: str) -> float:
        f = shares.get(name, 0.0)
        if explained <= 0 or f <= 0:
            return 0.0
        rest = explained - f
        return room if rest <= 0 else min(room, -0.5 * math.log10(rest / explained))

    result.by_operator = {own(n): impact(n) for n, op in dm.operators.items()
                          if op.direction == "forward"}
    if dominant is not None:  # measured element by element (_variance_shares)
        result.by_operator[own(dominant[0])] = min(room, max(dominant[1], 0.0))
    result.resolved = set(result.by_operator)
    result.digit_map = result.annotate(dm if outputs is None else _renamed(dm))
    result.digit_map.metadata["impact_method"] = "first_order"
    torch._dynamo.reset()
    return result


class _Linearized(torch.fx.Interpreter):
    """The captured graph in fp64 (floating arguments widened, dtype arguments of 16- and
    32-bit floats read as fp64), with ``noise[name]`` added to the output of each analysed
    node (by the operator's name) and every such output kept. A graph lowered to primitives
    (the arithmetic level's) runs its ``prims`` through their ATen implementations, which
    autograd differentiates (the prims have no derivative formulas)."""

    def __init__(self, gm: torch.fx.GraphModule, names: dict, noise: dict) -> None:
        super().__init__(gm)
        self.names, self.noise, self.values = names, noise, {}

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "prims":
            target = getattr(target, "impl_aten", target)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: torch.fx.Node) -> Any:
        def widen(v: Any) -> Any:
            if isinstance(v, torch.dtype) and v in (torch.float16, torch.bfloat16, torch.float32):
                return torch.float64
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != torch.float64:
                return v.double()
            return v

        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            args, kwargs = pytree.tree_map(widen, (args, kwargs))
            out = getattr(self, n.op)(n.target, args, kwargs)
        name = self.names.get(n.name)
        if name is not None and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.values[name] = out.detach()
            if name in self.noise:
                out = out + self.noise[name]
        return out


def _rounding_variance(y: torch.Tensor, fmt: Any, mode: Any) -> torch.Tensor:
    """Per element, the variance of ``y``'s rounding into ``fmt`` in ``mode`` (0 on the grid):
    between the neighbours lo <= y <= hi, a = y - lo, u = hi - lo: random rounding (up or down
    with probability 1/2) u^2 / 4, stochastic rounding a (u - a)."""
    from .numerics.rounding import Rounding, quantize

    lo = quantize(y, fmt, "down", saturate=True)
    hi = quantize(y, fmt, "up", saturate=True)
    a, u = (y - lo), (hi - lo)
    v = a * (u - a) if Rounding.parse(mode) is Rounding.STOCHASTIC else u * u / 4
    return torch.where(torch.isfinite(v), v, torch.zeros_like(v))


def _output_variance(gm: torch.fx.GraphModule, args: tuple, names: dict, var: dict,
                     seed: int, passes: int, without: Optional[str] = None) -> list:
    """Per output element, the variance sigma_i^2 of the linear model (the module docstring):
    ``passes`` Jacobian-vector products (forward-mode AD) whose tangents are the operators'
    rounding noise (random signs times its standard deviation), the outputs' tangents squared
    and averaged; ``without``: that operator's noise left out (the same signs for the others:
    common random numbers)."""
    import torch.autograd.forward_ad as fwad

    gen = torch.Generator().manual_seed(seed)
    acc: Optional[list] = None
    with torch.no_grad():
        for _ in range(passes):
            signs = {n: _signs(v.shape, gen) for n, v in var.items()}
            with fwad.dual_level():
                noise = {n: fwad.make_dual(torch.zeros_like(v), signs[n] * v.sqrt())
                         for n, v in var.items() if n != without}
                y = _float_leaves(_Linearized(gm, names, noise).run(*args))
                tangents = [fwad.unpack_dual(t).tangent for t in y]
            squares = [torch.zeros_like(t) if g is None else g.square() / passes
                       for t, g in zip(y, tangents)]
            acc = squares if acc is None else [a + q for a, q in zip(acc, squares)]
    return acc or []


def _variance_shares(gm: torch.fx.GraphModule, args: tuple, names: dict, cfg: Any,
                     probes: int, finite: Sequence = ()) -> tuple:
    """(each analysed operator's share F_k of the outputs' relative variance to first order,
    the dominant operator's impact measured per element or None): sigma_i^2 from 2 ``probes``
    Jacobian-vector products (:func:`_output_variance`), then ``probes`` vector-Jacobian
    products with Rademacher signs r_i / sigma_i at the outputs. Both are the linear model's:
    the shares sum to about 1. An operator with more than half of the variance is measured
    element by element (sigma_i^2 without it, the digits of both clipped to [0, cap] as the
    samples' are): where one operator dominates, the outputs' elements differ in how much it
    dominates them, and a ratio of averages would overstate its impact."""
    with torch.no_grad():
        clean = _Linearized(gm, names, {})
        y0 = _float_leaves(clean.run(*args))
    var = {name: _rounding_variance(v, cfg.format_for(name), cfg.rounding)
           for name, v in clean.values.items()}
    count = sum(t.numel() for t in y0)
    if not count or not var:
        return {}, None
    # the analysis's finite output elements (1) where its outputs are these tensors
    if len(finite) == len(y0) and all(f.shape == t.shape for f, t in zip(finite, y0)):
        keep = [f.to(torch.float64) for f in finite]
    else:
        keep = [torch.ones_like(t) for t in y0]
    passes = 2 * probes
    acc = _output_variance(gm, args, names, var, cfg.seed, passes)
    # floored a digit past the cap: an element there reads the cap (its digits clipped) with
    # or without any one operator's rounding
    cap = cfg.format.digit_cap
    floor = [(t0.abs() * 10.0 ** -(cap + 1)) ** 2 for t0 in y0]
    sigma = [torch.maximum(a, f).sqrt() for a, f in zip(acc, floor)]
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    shares = dict.fromkeys(var, 0.0)
    zeros = {n: torch.zeros_like(v, requires_grad=True) for n, v in var.items()}
    with torch.enable_grad():
        y = _float_leaves(_Linearized(gm, names, zeros).run(*args))
        wrt = list(zeros.values())
        for p in range(probes):
            f = sum((_signs(t.shape, gen) * t / torch.where(s > 0, s, torch.ones_like(s))
                     * (s > 0) * k).sum() for t, s, k in zip(y, sigma, keep))
            grads = torch.autograd.grad(f, wrt, retain_graph=p + 1 < probes, allow_unused=True)
            for (name, v), g in zip(var.items(), grads):
                if g is not None:
                    shares[name] += float((g * g * v).sum()) / (probes * count)
    total = sum(shares.values())
    top = max(shares, key=shares.get)
    if total <= 0 or shares[top] <= total / 2:
        return shares, None
    rest = _output_variance(gm, args, names, var, cfg.seed, passes, without=top)

    # the samples' digits of an element of variance v: CESTAC's estimate of N samples, whose
    # s^2 reads v through a chi^2 of N - 1 degrees of freedom, clipped to [0, cap] as the
    # ablation's are (the expectation over 256 fixed draws of the chi^2)
    n = cfg.n_samples
    from .numerics.digits import student_t

    chi = torch.distributions.Chi2(torch.tensor(float(n - 1), dtype=torch.float64))
    with _fixed_rng(cfg.seed):
        noise = -0.5 * torch.log10(chi.sample((256,)) / (n - 1))
    k0 = math.log10(math.sqrt(n) / student_t(n, cfg.confidence))

    def digits(v: torch.Tensor, f: torch.Tensor, t0: torch.Tensor) -> torch.Tensor:
        d = (-0.5 * torch.log10(torch.maximum(v, f) / t0.square())).nan_to_num(
            nan=cap, posinf=cap)
        return sum(((d + k0 + e).clamp(0.0, cap) for e in noise.tolist()),
                   torch.zeros_like(d)) / len(noise)

    gain = sum(float(((digits(r, f, t0) - digits(a, f, t0)) * k).sum())
               for r, a, f, t0, k in zip(rest, acc, floor, y0, keep))
    return shares, (top, gain / count)


class _fixed_rng:
    """torch's global generator seeded inside the block and restored after it."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __enter__(self) -> None:
        self.state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: Any) -> None:
        torch.random.set_rng_state(self.state)


def _signs(shape: Any, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, tuple(shape), generator=gen, dtype=torch.float64) * 2 - 1


def _float_leaves(out: Any) -> list:
    return [t for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
