"""Running one primitive on all N samples at once (docs/design.md §3).

Pointwise primitives run directly on the samples with ranks aligned (:func:`aligned`); hot
views, reductions, softmax and GEMMs have a batcher in their row of the table
:data:`fxstab.rules.aten.primitives.PRIMITIVES` (registered with :func:`batcher`: their
dimension arguments shifted past the sample dimension; :data:`BATCHERS` lists them); the rest go
through ``torch.vmap``; a primitive that cannot be batched runs once per sample
(:func:`run_batched` says whether it was lifted).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Callable, Optional

import torch
from torch.utils import _pytree as pytree

from .context import AtenContext
from .kinds import OpInfo, broadcast_in_dim, primitive_kind, prims_var
from .primitives import PRIMITIVES, PrimitiveRule, primitive
from ..lifting import Stacked

aten = torch.ops.aten

__all__ = ["aligned", "logical_ndim", "run_batched", "owned", "scan_args", "has_stacked",
           "PASS_THROUGH", "BATCHERS", "batcher"]

# Argument types that need no conversion to the working dtype: samples already are in it.
PASS_THROUGH = frozenset({Stacked, int, float, bool, type(None)})


def _norm_dim(d: int, ndim: int) -> int:
    return d + 1 if d >= 0 else d + ndim + 1


def _dims(dim, ndim: int):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(1, ndim + 1))
    if isinstance(dim, (list, tuple)):
        return [_norm_dim(d, ndim) for d in dim]
    return _norm_dim(dim, ndim)


def _samples_or(x, n: int):
    return x.samples if isinstance(x, Stacked) else x


def aligned(args: tuple, ndim_out: Optional[int] = None) -> tuple:
    """Stacked samples reshaped to [N, 1.., *shape] so they broadcast like their logical shapes
    (``ndim_out``: the logical rank of the result, by default the largest operand's)."""
    if ndim_out is None:
        ndim_out = logical_ndim(args)
    out = []
    for a in args:
        if type(a) is Stacked:
            s = a.samples
            k = ndim_out + 1 - s.dim()
            if k > 0:
                s = s.reshape(s.shape[:1] + (1,) * k + s.shape[1:])
            out.append(s)
        else:
            out.append(a)
    return tuple(out)


def logical_ndim(args) -> int:
    """The largest logical rank among the arguments (samples without their sample dim)."""
    nd = 0
    for a in args:
        if type(a) is Stacked:
            d = a.samples.dim() - 1
        elif isinstance(a, torch.Tensor):
            d = a.dim()
        else:
            continue
        nd = d if d > nd else nd
    return nd


# -- the batchers: hot non-pointwise primitives on all samples without vmap ---------------------
# batcher(op, args, kwargs): the outputs with their sample dim, or NotImplemented (then vmap,
# then once per sample), as JAX's primitive_batchers, in the primitive's row. A batcher meets no
# stacked keyword argument (_batched_special checks), and no keyword argument at all unless
# registered with ``kwargs=True``.
def batcher(*kinds: str, kwargs: bool = False) -> Callable:
    """Register the decorated ``batcher(op, args, kwargs)`` in the rows of ``kinds``."""
    def register(fn: Callable) -> Callable:
        primitive(*kinds, batcher=fn, batcher_kwargs=kwargs)
        return fn
    return register


class _Batchers(Mapping):
    """kind -> its batcher, read from the rows (a view: the table is the home)."""

    def __getitem__(self, kind: str) -> Callable:
        fn = PRIMITIVES[kind].batcher
        if fn is None:
            raise KeyError(kind)
        return fn

    def __iter__(self) -> Iterator[str]:
        return (k for k, r in PRIMITIVES.items() if r.batcher is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


BATCHERS: Mapping = _Batchers()


def _batched_special(op, rule: PrimitiveRule, args: tuple, kwargs: dict):
    """The batcher of ``rule`` on these arguments, or ``NotImplemented``."""
    fn = rule.batcher
    if fn is None or kwargs and not rule.batcher_kwargs:
        return NotImplemented
    if any(isinstance(v, Stacked) for v in kwargs.values()):
        return NotImplemented
    return fn(op, args, kwargs)


@batcher("mm", "bmm", "matmul")
def _products(op, args: tuple, kwargs: dict):
    a, b = (_samples_or(x, 0) for x in args[:2])
    if isinstance(args[0], Stacked) and isinstance(args[1], Stacked) and \
            primitive_kind(op) == "mm":
        return torch.bmm(a, b)
    return torch.matmul(a, b)


@batcher("_scaled_mm", kwargs=True)
def _scaled_mm(op, args: tuple, kwargs: dict):
    """``torch._scaled_mm`` of samples (their float8 casts rounded into the format, kept in the
    working dtype: apply.py): ``(mat1 * scale_a) @ (mat2 * scale_b) * scale_result + bias``
    (the product's sum exact, the output dtype the rounding's); NotImplemented for float8
    operands (the primitive itself runs)."""
    names = ("mat1", "mat2", "scale_a", "scale_b", "bias", "scale_result")
    v = dict(zip(names, args))
    v.update({k: kwargs[k] for k in names if k in kwargs})
    if not any(isinstance(v.get(k), Stacked) and v[k].samples.is_floating_point() and
               v[k].samples.element_size() > 1 for k in ("mat1", "mat2")):
        return NotImplemented
    a, b, sa, sb = aligned(tuple(v[k] for k in ("mat1", "mat2", "scale_a", "scale_b")), 2)
    wd = next(v[k].samples.dtype for k in ("mat1", "mat2") if isinstance(v.get(k), Stacked))
    out = (a.to(wd) * sa.to(wd)) @ (b.to(wd) * sb.to(wd))
    for key, combine in (("scale_result", torch.mul), ("bias", torch.add)):
        if v.get(key) is not None:
            out = combine(out, aligned((v[key],), 2)[0].to(wd))
    return out


@batcher("addmm", kwargs=True)
def _addmm(op, args: tuple, kwargs: dict):
    bias, m1, m2 = args[:3]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    alpha = kwargs.get("alpha", args[4] if len(args) > 4 else 1)
    if isinstance(m1, Stacked) and not isinstance(m2, Stacked) and \
            not isinstance(bias, Stacked) and m2.dim() == 2:
        # one GEMM over the samples' rows with the bias fused, as the plain addmm runs
        s = m1.samples
        out = torch.addmm(bias, s.reshape(-1, s.shape[-1]), m2, beta=beta, alpha=alpha)
        return out.view(s.shape[0], s.shape[1], m2.shape[1])
    prod = torch.matmul(_samples_or(m1, 0), _samples_or(m2, 0))
    if alpha != 1:
        prod = prod * alpha
    b = aligned((bias,), 2)[0]
    if beta != 1:
        b = b * beta
    return prod + b


def _on_samples(fn: Callable) -> Callable:
    """A batcher of a primitive whose first operand must carry samples: ``fn(op, s, nd, rest,
    kwargs)`` with ``s`` its samples, ``nd`` its logical rank, ``rest`` the other arguments."""
    def run(op, args: tuple, kwargs: dict):
        a0 = args[0] if args else None
        if not isinstance(a0, Stacked):
            return NotImplemented
        return fn(op, a0.samples, a0.ndim, args[1:], kwargs)
    run.__name__ = fn.__name__
    return run


@batcher("view", "_unsafe_view", "reshape", "expand")
@_on_samples
def _reshape(op, s, nd, rest, kwargs):
    if len(rest) != 1 or isinstance(rest[0], Stacked):
        return NotImplemented
    size = list(rest[0])
    if primitive_kind(op) != "expand":
        # a view of samples whose layout is not the deterministic pass's (a rounded output is
        # contiguous, a per-sample one stacked) may need a copy: reshape (a view when it can)
        return s.reshape([s.shape[0]] + size)
    if len(size) > nd:  # to a higher rank (pos.expand(B, -1, -1)): new dims after dim 0
        s = s.reshape(s.shape[:1] + (1,) * (len(size) - nd) + s.shape[1:])
    return s.expand([s.shape[0]] + size)


@batcher("permute")
@_on_samples
def _permute(op, s, nd, rest, kwargs):
    return s.permute([0] + [_norm_dim(d, nd) for d in rest[0]])


@batcher("transpose")
@_on_samples
def _transpose(op, s, nd, rest, kwargs):
    return s.transpose(_norm_dim(rest[0], nd), _norm_dim(rest[1], nd))


@batcher("t")
@_on_samples
def _t(op, s, nd, rest, kwargs):
    return s.transpose(1, 2) if nd == 2 else s


@batcher("unsqueeze")
@_on_samples
def _unsqueeze(op, s, nd, rest, kwargs):
    return s.unsqueeze(_norm_dim(rest[0], nd + 1))


@batcher("clone", "alias", "detach", "lift_fresh_copy", "contiguous")
@_on_samples
def _copy(op, s, nd, rest, kwargs):
    return s.clone()


@batcher("select")
@_on_samples
def _select(op, s, nd, rest, kwargs):
    return s.select(_norm_dim(rest[0], nd), rest[1])


@batcher("slice")
@_on_samples
def _slice(op, s, nd, rest, kwargs):
    if len(rest) < 1:
        return NotImplemented
    dim = _norm_dim(rest[0], nd)
    start = rest[1] if len(rest) > 1 else None
    end = rest[2] if len(rest) > 2 else None
    step = rest[3] if len(rest) > 3 else 1
    return op(s, dim, start, end, step)


# The batchers below take a dim argument, which a 0-d value reaches with dim 0 or -1 (torch
# wraps a scalar's dims), not a dim of its samples: on 0-d samples each runs over the only
# dim of ``s[:, None]`` (:func:`_on_scalar`).
@batcher("sum", "mean", kwargs=True)
@_on_samples
def _reduce(op, s, nd, rest, kwargs):
    fn = getattr(torch, primitive_kind(op))
    extra = {k: v for k, v in kwargs.items() if k == "dtype"}
    if nd == 0:
        if kwargs.get("output_dtype"):
            return NotImplemented
        return _on_scalar(s, rest, lambda col: fn(col, [1], False, **extra))
    if any(isinstance(r, Stacked) for r in rest) or kwargs.get("output_dtype"):
        return NotImplemented
    dim = rest[0] if rest else kwargs.get("dim", None)
    keepdim = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
    dims = _dims(dim, nd)
    if isinstance(dims, int):
        dims = [dims]
    if not dims:
        return s.clone()
    return fn(s, dims, keepdim, **extra)


@batcher("amax", "amin", kwargs=True)
@_on_samples
def _extreme(op, s, nd, rest, kwargs):
    fn = getattr(torch, primitive_kind(op))
    if nd == 0:
        if kwargs.get("output_dtype"):
            return NotImplemented
        return _on_scalar(s, rest, lambda col: fn(col, [1], False))
    if any(isinstance(r, Stacked) for r in rest) or kwargs.get("output_dtype"):
        return NotImplemented
    dim = rest[0] if rest else kwargs.get("dim", None)
    keepdim = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
    return fn(s, _dims(dim, nd), keepdim)


@batcher("var", kwargs=True)
@_on_samples
def _var(op, s, nd, rest, kwargs):
    if getattr(op, "namespace", None) != "prims" or kwargs.get("output_dtype"):
        return NotImplemented
    correction = rest[1] if len(rest) > 1 else kwargs.get("correction", 1)
    if nd == 0:
        return _on_scalar(s, rest, lambda col: prims_var(col, [1], correction).reshape(s.shape))
    dims = _dims(rest[0] if rest else None, nd)
    return prims_var(s, [dims] if isinstance(dims, int) else dims, correction)


@batcher("_softmax", "_log_softmax", kwargs=True)
@_on_samples
def _along_dim(op, s, nd, rest, kwargs):
    if len(rest) < 1:
        return NotImplemented
    if nd == 0:
        return _on_scalar(s, rest, lambda col: op(col, 1, *rest[1:], **kwargs).squeeze(1))
    return op(s, _norm_dim(rest[0], nd), *rest[1:], **kwargs)


batcher("cumsum")(_along_dim)  # (no keyword arguments)


@batcher("broadcast_in_dim")
@_on_samples
def _broadcast_in_dim(op, s, nd, rest, kwargs):
    if len(rest) != 2:  # prims: shape, broadcast_dimensions
        return NotImplemented
    return broadcast_in_dim(s, [s.shape[0]] + list(rest[0]), [0] + [d + 1 for d in rest[1]])


def _on_scalar(s: torch.Tensor, rest: tuple, run: Callable):
    """``run(col)`` over the only dim of 0-d samples ``s`` ([N]) as ``col = s[:, None]``
    ([N, 1], the reduction over dim 1, back to [N]: torch's own arithmetic, a sum of one
    value, a softmax of one value is 1)."""
    if any(isinstance(r, Stacked) for r in rest):
        return NotImplemented
    return run(s.unsqueeze(1))


def _run_per_sample(op, args, kwargs, n):
    def pick(k):
        return lambda x: x.samples[k] if isinstance(x, Stacked) else x
    # a random primitive (rrelu's noise) draws in every sample what the first sample drew
    seeded = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
    state = torch.random.get_rng_state() if seeded else None
    results = []
    for k in range(n):
        if seeded:
            torch.random.set_rng_state(state)
        a, kw = pytree.tree_map(pick(k), (args, kwargs), is_leaf=lambda x: isinstance(x, Stacked))
        results.append(op(*a, **kw))
    flat0, spec = pytree.tree_flatten(results[0])
    flats = [pytree.tree_flatten(r)[0] for r in results]
    out = []
    for j, v in enumerate(flat0):
        if isinstance(v, torch.Tensor) and all(f[j].shape == v.shape for f in flats):
            out.append(torch.stack([f[j] for f in flats]))
        else:
            out.append(v)
    return pytree.tree_unflatten(out, spec)


def run_batched(op, info: OpInfo, args: tuple, kwargs: dict, n: int, ctx: "AtenContext"):
    """Run ``op`` on all samples; returns (outputs with sample dim, lifted). A random primitive
    that ``vmap`` cannot batch runs once per sample from one RNG state: a step of the traced
    graph (:meth:`AtenContext.emit`)."""
    stacked_kw = bool(kwargs) and has_stacked((), kwargs)
    if (info.pointwise or info.prim is not None) and not stacked_kw:
        lined = aligned(args)
        if info.prim is aten.div.Tensor and not any(
                isinstance(a, torch.Tensor) and a.is_floating_point() or isinstance(a, float)
                for a in lined[:2]):
            return torch.div(*lined[:2], rounding_mode="trunc"), True  # prims.div of ints
        return info.call(*lined, **kwargs), True
    res = _batched_special(op, info.rule, args, kwargs)
    if res is not NotImplemented:
        return res, True
    if not stacked_kw:
        in_dims = tuple(pytree.tree_map(lambda x: 0 if isinstance(x, Stacked) else None, a,
                                        is_leaf=lambda x: isinstance(x, Stacked)) for a in args)
        plain = pytree.tree_map(lambda x: x.samples if isinstance(x, Stacked) else x, args,
                                is_leaf=lambda x: isinstance(x, Stacked))
        try:
            return torch.vmap(functools.partial(op, **kwargs), in_dims=in_dims)(*plain), True
        except Exception:  # noqa: BLE001 - any failure falls back to per-sample execution
            pass
    if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
        return ctx.emit("per_sample", None, functools.partial(_per_sample_step, op), (), args,
                        kwargs), False
    return _run_per_sample(op, args, kwargs, n), False


def _per_sample_step(op, ctx: "AtenContext", raw: list, args: tuple, kwargs: dict):
    return _run_per_sample(op, args, kwargs, ctx.n_samples)


def owned(v: torch.Tensor, args: tuple) -> bool:
    """Whether the primitive's result ``v`` is memory of its own (not a view, not an operand):
    then it is rounded in place instead of into a new buffer, one memory pass less."""
    if v._base is not None:
        return False
    ptr = v.data_ptr()
    for a in args:
        if type(a) is Stacked:
            if a.samples.data_ptr() == ptr:
                return False
        elif isinstance(a, torch.Tensor):
            if a.data_ptr() == ptr:
                return False
        elif isinstance(a, (list, tuple)):  # cat, stack: fresh results, but be sure
            return False
    return True


def scan_args(args: tuple) -> tuple[bool, bool, bool]:
    """(whether any argument carries samples, whether every stacked one is an expanded view of
    one value: identical samples, whether any is something else than samples or a Python
    number: what :func:`_working_args` may convert) in one pass; a list holding samples (cat,
    stack) counts as stacked, not identical (it runs batched)."""
    stacked, identical, other = False, True, False
    for a in args:
        t = type(a)
        if t is Stacked:
            stacked = True
            if identical:
                s = a.samples
                identical = s.dim() > 0 and s.stride(0) == 0
        elif t not in PASS_THROUGH:
            other = True
            if isinstance(a, (list, tuple)) and any(isinstance(b, Stacked) for b in a):
                stacked, identical = True, False
    return stacked, identical, other


def has_stacked(args: tuple, kwargs: dict) -> bool:
    """Whether any argument (or list element: cat, stack) carries samples."""
    for a in args:
        if isinstance(a, Stacked):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(b, Stacked) for b in a):
            return True
    for a in kwargs.values():
        if isinstance(a, Stacked):
            return True
        if isinstance(a, (list, tuple)) and any(isinstance(b, Stacked) for b in a):
            return True
    return False
