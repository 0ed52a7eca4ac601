"""What ``fxstab record`` and ``fxstab plan`` analyse: a TARGET, ``path/to/file.py:function``
or ``package.module:function``, whose function returns ``(model, example_inputs)``.

:func:`load_target` imports it, calls the function and checks the contract (the inputs a
tuple of positional arguments, a dict of keyword arguments or one tensor, fitting the
model's ``forward``) before anything is compiled; a broken contract is a
:class:`TargetError` that says what was wrong and what to give instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Iterator, Optional


class TargetError(ValueError):
    """A TARGET that does not follow the contract (the message names it and the fix)."""


class TargetBuildError(Exception):
    """The TARGET's build function (or its module's import) raised: the cause is chained
    (the CLI says "building the target failed", not "the model failed")."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        super().__init__(spec)


class Target:
    """What a TARGET builds: the model, its positional and its keyword example inputs."""

    def __init__(self, model: Any, args: tuple, kwargs: dict) -> None:
        self.model, self.args, self.kwargs = model, args, kwargs

    def __iter__(self):  # model, args = load_target(...) (positional inputs only)
        if self.kwargs:
            raise TargetError(f"this command takes positional example inputs; the target returns "
                           f"keyword inputs {sorted(self.kwargs)}: return a tuple instead")
        return iter((self.model, self.args))

    def __call__(self, model: Any) -> Any:
        """Run ``model`` (the target's model, compiled) on the example inputs."""
        return model(*self.args, **self.kwargs)


def _import_target_module(spec: str, where: str, root: Optional[Path] = None) -> Any:
    """The module part of a TARGET: a ``.py`` file (a path) or an importable module."""
    import importlib

    looks_like_file = where.endswith(".py") or "/" in where or os.sep in where
    if not looks_like_file:
        if not all(part.isidentifier() for part in where.split(".")):
            raise TargetError(f"TARGET must be 'path/to/file.py:function' or "
                           f"'package.module:function', got {spec!r}")
        for p in dict.fromkeys([os.getcwd(), *([str(root)] if root else [])]):
            if p not in sys.path:  # a module of the current project
                sys.path.insert(0, p)
        try:
            return importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name and where.startswith(e.name):  # the target itself, not one it imports
                raise TargetError(f"TARGET module {where!r} cannot be imported ({e}), and a file "
                               f"must be a .py file: give 'path/to/file.py:function', or "
                               f"'package.module:function' of an installed package (or run "
                               f"from the folder that holds it)") from None
            raise
    path = Path(where)
    if root is not None and not path.is_absolute():
        path = root / path
    if path.suffix != ".py":
        raise TargetError(f"TARGET file must be a .py file (or give 'package.module:function'), "
                       f"got {where!r}")
    if not path.is_file():
        raise TargetError(f"TARGET file {where!r} does not exist (from {root or os.getcwd()}); an "
                       f"installed module is given as 'package.module:function'")
    path = path.resolve()
    for p in (os.getcwd(), str(path.parent)):
        if p not in sys.path:
            sys.path.insert(0, p)
    mod_name = f"_fxstab_target_{path.stem}"
    mod_spec = importlib.util.spec_from_file_location(mod_name, path)
    if mod_spec is None or mod_spec.loader is None:  # pragma: no cover - .py files always load
        raise TargetError(f"cannot import {str(path)!r}")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look modules up by name
    mod_spec.loader.exec_module(module)
    return module


def load_target(spec: str, kwargs: Optional[dict] = None, root: Optional[Path] = None
                ) -> Target:
    """Import ``path/to/file.py:function`` or ``package.module:function``, call the function
    (with ``kwargs``, from a settings file's target, or none) and check what it returns.
    ``root`` (a settings file's folder) is where a relative file is found and a module is
    imported from (the current directory stays on ``sys.path`` too).

    The contract: the function returns ``(model, example_inputs)``; ``model`` is a
    ``torch.nn.Module`` (or any callable torch.compile accepts) and ``example_inputs`` a tuple
    (or list) of positional arguments, a dict of keyword arguments (a Hugging Face model's
    ``input_ids=..., attention_mask=...``), or a single tensor (a one-element tuple). A file's
    folder and the current directory are put in front of ``sys.path`` so the file can import
    its own project; a module is imported as Python imports it (installed, or under the current
    directory).

    Raises:
        TargetError: malformed spec, missing file, module or function, or a return value that does
            not follow the contract. Exceptions raised by the target's own code propagate.
    """
    import torch

    where, sep, func = spec.rpartition(":")
    if not sep or not where or not func:
        raise TargetError(f"TARGET must be 'path/to/file.py:function' or 'package.module:function', "
                       f"got {spec!r}")
    if not func.isidentifier():
        raise TargetError(f"TARGET function {func!r} is not a Python identifier (in {spec!r})")
    module = _import_target_module(spec, where, root)
    fn = getattr(module, func, None)
    if fn is None or not callable(fn):
        raise TargetError(f"{where!r} has no function {func!r}")
    result = fn(**(kwargs or {}))
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TargetError(f"{spec} must return (model, example_inputs), got "
                       f"{type(result).__name__}")
    model, inputs = result
    if not callable(model):
        raise TargetError(f"{spec} returned a model that is not callable: {type(model).__name__}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, dict):
        bad = [k for k in inputs if not (isinstance(k, str) and k.isidentifier())]
        if bad:
            raise TargetError(f"{spec} returned keyword inputs whose keys are not argument names: "
                           f"{bad!r}")
        target = Target(model, (), dict(inputs))
    elif isinstance(inputs, (tuple, list)):
        target = Target(model, tuple(inputs), {})
    else:
        raise TargetError(f"{spec} must return example_inputs as a tuple (positional) or a dict "
                       f"(keyword arguments), got {type(inputs).__name__}")
    _check_signature(spec, target)
    return target


def _check_signature(spec: str, target: Target) -> None:
    """The example inputs must fit the model's call (before anything is compiled)."""
    import inspect

    import torch

    fn = target.model.forward if isinstance(target.model, torch.nn.Module) else target.model
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return
    try:
        sig.bind(*target.args, **target.kwargs)
    except TypeError as e:
        given = ([f"{len(target.args)} positional"] if target.args else []) + \
            ([f"keywords {sorted(target.kwargs)}"] if target.kwargs else [])
        raise TargetError(f"{spec}: the example inputs ({', '.join(given) or 'none'}) do not fit "
                       f"the model's call{sig}: {e}") from None


# --------------------------------------------------------------------------- when it fails
# torch logs the failing meta kernel of a shape error at ERROR, with its whole traceback,
# before it raises the error the CLI reports in one line (18 lines for a linear's bad input)
_TORCH_NOISE = ("torch._subclasses.fake_tensor",)


class _DropRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


@contextlib.contextmanager
def quiet_torch_logs(verbose: bool = False) -> Iterator[None]:
    """Silence torch's internal error logs of a failing model, unless ``verbose``."""
    if verbose:
        yield
        return
    drop = _DropRecords()
    loggers = [logging.getLogger(name) for name in _TORCH_NOISE]
    for lg in loggers:
        lg.addFilter(drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(drop)


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a chain (dynamo wraps the model's own error)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        nxt = exc.__cause__ or exc.__context__  # dynamo re-raises the model's error
        if nxt is None:
            break
        exc = nxt
    return exc


def failure_line(exc: BaseException) -> str:
    """``Type: first line of the message (at file:line)``: the innermost cause of ``exc``,
    where the user's own code (not torch's, not fxstab's) raised it."""
    cause = root_cause(exc)
    first = (str(cause).strip().splitlines() or [""])[0]
    tb = traceback.extract_tb(cause.__traceback__) if cause.__traceback__ else []
    user = [f for f in tb if "site-packages" not in f.filename and "/torch/" not in f.filename
            and "/fxstab/" not in f.filename]
    where = f" (at {user[-1].filename}:{user[-1].lineno})" if user else ""
    return f"{type(cause).__name__}: {first}{where}"
