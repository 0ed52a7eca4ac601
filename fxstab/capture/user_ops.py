"""``@fxstab.operator(name=...)``: a user function analysed as one named operator (issue 17).

A kernel author who wants the digits of a kernel, or of a block of code, as a whole decorates it::

    @fxstab.operator(name="fused_rmsnorm")
    def fused_rmsnorm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

The function becomes a ``torch.library`` custom operator ``fxstab_op::fused_rmsnorm``:

* under ``torch.compile`` dynamo keeps it as one node (its insides are not traced), which the
  operator-level backend selects by default (custom operators always are), runs on the samples
  with ``torch.vmap`` of the function (once per sample where the function is not
  batch-transparent), and rounds and records as ``module.path/fused_rmsnorm#k``;
* under :func:`fxstab.analyze` and :func:`fxstab.stochastic` it reaches the arithmetic-level
  rules as one primitive (``fxstab_op.fused_rmsnorm``): computed on the samples in the working
  dtype, its output rounded once (the insides are not rounded operation by operation);
* without fxstab it is the function itself, with autograd (the backward differentiates the
  function with ``torch.func.vjp``, recomputing it from the saved inputs).

Parameters without annotations are tensors; a function returning several tensors says so in
its return annotation (``-> tuple[torch.Tensor, torch.Tensor]``). Outputs must be new tensors
(not views of the inputs, a custom-operator rule). A function that cannot run on fake tensors
(a Triton launch that reads data pointers) passes ``fake=`` (shapes and dtypes only).
"""

from __future__ import annotations

import inspect
import keyword
from typing import Any, Callable, Optional

import torch

NAMESPACE = "fxstab_op"

_REGISTERED: dict[str, Callable] = {}


def operator(fn: Optional[Callable] = None, *, name: Optional[str] = None,
             fake: Optional[Callable] = None) -> Any:
    """Make ``fn`` one named, instrumented operator (see the module docstring).

    Args:
        fn: The function (when used as ``@fxstab.operator`` without arguments; its
            ``__name__`` is then the name).
        name: The operator's kind in digit maps (``"my_kernel"`` gives
            ``module.path/my_kernel#0``): a Python identifier, unique per process.
        fake: Shapes-only implementation for tracing (default: the function itself run on fake
            tensors).

    Returns:
        The operator, callable like the function.

    Raises:
        ValueError: ``name`` is not an identifier, or is already used by another function.
    """
    def wrap(f: Callable) -> Any:
        return _make_operator(f, name or getattr(f, "__name__", ""), fake)

    return wrap(fn) if fn is not None else wrap


def _make_operator(fn: Callable, name: str, fake: Optional[Callable]) -> Any:
    if not callable(fn):
        raise ValueError(f"fxstab.operator decorates a function, got {type(fn).__name__}")
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) \
            or name.startswith("_"):
        raise ValueError(f"fxstab.operator name must be a Python identifier not starting with "
                         f"'_' (it becomes the operator kind), got {name!r}")
    if name in _REGISTERED and _REGISTERED[name] is not fn:
        raise ValueError(f"fxstab.operator name {name!r} is already used by "
                         f"{_REGISTERED[name].__qualname__}; pick another name")
    sig = inspect.signature(fn)
    params = []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"fxstab.operator {name!r}: *args/**kwargs cannot become an operator "
                             f"schema; list the parameters")
        ann = p.annotation if p.annotation is not p.empty else torch.Tensor
        params.append(p.replace(annotation=ann))
    ret = sig.return_annotation if sig.return_annotation is not sig.empty else torch.Tensor
    impl = _copy_function(fn, inspect.Signature(params, return_annotation=ret))

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(impl)
    op.register_fake(fake if fake is not None else fn)
    op.register_autograd(_backward(fn), setup_context=_setup_context)
    op.__wrapped__ = fn
    op.fxstab_name = name
    _REGISTERED[name] = fn
    return op


def _copy_function(fn: Callable, sig: inspect.Signature) -> Callable:
    """A function calling ``fn`` whose signature has every annotation custom_op needs."""
    def impl(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    impl.__name__ = getattr(fn, "__name__", "operator")
    impl.__qualname__ = getattr(fn, "__qualname__", impl.__name__)
    impl.__module__ = getattr(fn, "__module__", __name__)
    impl.__doc__ = fn.__doc__
    impl.__signature__ = sig  # type: ignore[attr-defined]
    impl.__annotations__ = {p.name: p.annotation for p in sig.parameters.values()}
    impl.__annotations__["return"] = sig.return_annotation
    return impl


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    where = [i for i, v in enumerate(inputs) if isinstance(v, torch.Tensor)]
    ctx.where = where
    ctx.others = [None if i in where else v for i, v in enumerate(inputs)]
    ctx.save_for_backward(*[inputs[i] for i in where])


def _backward(fn: Callable) -> Callable:
    def backward(ctx: Any, *grads: Any) -> tuple:
        saved = ctx.saved_tensors
        where = [i for i, t in zip(ctx.where, saved) if t.is_floating_point() or t.is_complex()]
        args = list(ctx.others)
        for i, t in zip(ctx.where, saved):
            args[i] = t

        def f(*ts: torch.Tensor) -> Any:
            a = list(args)
            for i, t in zip(where, ts):
                a[i] = t
            return fn(*a)

        with torch.enable_grad():
            _, vjp = torch.func.vjp(f, *[args[i] for i in where])
        gs = vjp(grads[0] if len(grads) == 1 else tuple(grads))
        out: list = [None] * len(args)
        for i, g in zip(where, gs):
            out[i] = g
        return tuple(out)

    return backward


def implementation(target: Any) -> Optional[Callable]:
    """The Python function behind an ``@fxstab.operator`` node target (an OpOverload of
    ``fxstab_op``), else None. The operator-level backend lifts that function with
    ``torch.vmap`` as a whole (one operator) rather than going through the custom op."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == NAMESPACE:
        return _REGISTERED.get(target._schema.name.split("::", 1)[1])
    return None


__all__ = ["operator", "implementation", "NAMESPACE"]
