"""The project's fxstab settings in a file: ``[tool.fxstab]`` of ``pyproject.toml`` or the top
level of ``fxstab.toml`` (torchtitan keeps its float8 settings in TOML the same way).

One file holds what a project would otherwise repeat on every command line and in every CI
job: the analysis options (the keyword arguments of :func:`fxstab.backend`), the gate's
thresholds and the targets ``fxstab record`` analyses::

    [tool.fxstab]
    format = "bf16"              # or [5, 2] (exponent and significand bits), or "auto"
    n_samples = 3
    seed = 0
    select = ["linear", "blocks.*"]
    formats = { "head/softmax#0" = "fp32" }
    accumulate = "fp16"          # a preset; accumulate_rounding = "random" rounds it CESTAC's way
    gemm_inputs = "fp8_e4m3"
    gemm_scaling = "row"

    [tool.fxstab.gate]
    max_drop = 0.5
    metric = "avg"

    [tool.fxstab.targets.mlp]                  # paths relative to this file
    target = "examples/ci/target.py:build"     # or "package.module:function"
    output = "digits/mlp.json"
    kwargs = { width = 64 }                    # the build function's arguments
    format = "fp16"                            # any analysis option, for this target only

:func:`load` finds the file (``fxstab.toml`` first, then a ``pyproject.toml`` with a
``[tool.fxstab]`` table, in the folder given and its parents) and validates every value:
a wrong one raises :class:`ConfigError` naming the file, the key and the value. Command-line
flags override the file; :meth:`Config.backend_options` gives what ``fxstab.backend`` takes.
"""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML with tomli (a dependency there)
    import tomli as tomllib

PathLike = Union[str, "os.PathLike[str]"]

FILE_NAMES = ("fxstab.toml", "pyproject.toml")

# analysis options: the keyword arguments of fxstab.backend a file may set, and their types
# (checked here so the message names the key; the values are then checked by AnalysisConfig)
ANALYSIS_KEYS: dict[str, tuple] = {
    "granularity": (str,), "format": (str, list), "n_samples": (int,), "seed": (int,),
    "rounding": (str,), "select": (str, list), "every": (int,), "confidence": (float, int),
    "kernels": (str,), "diagnostics": (str,), "backward": (bool,), "saturate": (bool,),
    "accumulate": (str,), "accumulate_rounding": (str,), "gemm_inputs": (str, list),
    "gemm_scaling": (str,), "formats": (dict,),
}
GATE_KEYS: dict[str, tuple] = {"max_drop": (float, int), "metric": (str,)}
TARGET_KEYS: dict[str, tuple] = {"target": (str,), "output": (str,), "kwargs": (dict,),
                                 "calls": (int,)}


class ConfigWarning(UserWarning):
    """A ``pyproject.toml`` passed by while searching for the settings: it does not parse and
    shows no ``[tool.fxstab]`` (the message names the file, the line and the column)."""


class ConfigError(ValueError):
    """A settings file that cannot be used: the message names the file, the key and the value."""

    def __init__(self, path: PathLike, key: str, message: str) -> None:
        self.path, self.key = str(path), key
        super().__init__(f"{path}: {key}: {message}")


@dataclass(frozen=True)
class Target:
    """One ``[targets.NAME]`` table: what ``fxstab record`` analyses and where the map goes."""

    name: str
    target: str
    output: str
    kwargs: dict = field(default_factory=dict)
    calls: int = 1
    options: dict = field(default_factory=dict)  # analysis options for this target only
    root: Optional[Path] = None  # the settings file's folder: target and output are relative to it


@dataclass(frozen=True)
class Config:
    """The validated settings of one file (``path`` None: no file, every default)."""

    path: Optional[Path] = None
    analysis: dict = field(default_factory=dict)
    gate: dict = field(default_factory=dict)
    targets: dict = field(default_factory=dict)  # name -> Target, in the file's order

    def backend_options(self, **overrides: Any) -> dict:
        """``fxstab.backend`` keyword arguments: the file's, then ``overrides`` (those not
        None) on top; ``accumulate_rounding`` folded into ``accumulate``."""
        opts = dict(self.analysis)
        opts.update({k: v for k, v in overrides.items() if v is not None})
        return fold_accumulate(opts)

    def target(self, name: str) -> Target:
        """The configured target ``name``.

        Raises:
            ConfigError: no such target (the message lists those there are).
        """
        if name not in self.targets:
            known = ", ".join(self.targets) or "none"
            raise ConfigError(self.path or "(no settings file)", f"targets.{name}",
                              f"no such target; configured: {known}")
        return self.targets[name]


def fold_accumulate(opts: dict) -> dict:
    """``accumulate`` (a preset) and ``accumulate_rounding`` as one ``accumulate=`` value."""
    import dataclasses

    from .numerics.accumulation import Accumulation

    opts = dict(opts)
    rounding = opts.pop("accumulate_rounding", None)
    if rounding is None:
        return opts
    acc = Accumulation.parse(opts.get("accumulate"))
    if acc is None:
        raise ValueError("accumulate_rounding needs an emulated accumulator (accumulate = "
                         "'fp16', 'bf16', 'fp8-fast' or 'fp8-promoted'): fp32 is the trusted "
                         "product")
    opts["accumulate"] = dataclasses.replace(acc, rounding=rounding, name="")
    return opts


def find(start: Optional[PathLike] = None) -> Optional[Path]:
    """The settings file that applies in ``start`` (default: the current folder): the nearest
    folder, going up, with an ``fxstab.toml`` or a ``pyproject.toml`` holding ``[tool.fxstab]``;
    None when there is none."""
    folder = Path(start or os.getcwd()).resolve()
    for d in (folder, *folder.parents):
        if (d / "fxstab.toml").is_file():
            return d / "fxstab.toml"
        py = d / "pyproject.toml"
        if py.is_file():
            try:
                text = py.read_text(encoding="utf-8")
                data = tomllib.loads(text)
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
                if isinstance(e, tomllib.TOMLDecodeError) and _FXSTAB_TABLE.search(text):
                    return py  # ours: load() says where it does not parse
                # another tool's file, perhaps: passed by, but never silently
                warnings.warn(f"{py}: skipped: {_unreadable(e)}; fxstab reads no settings "
                              f"from it (fix it, or give --config FILE)", ConfigWarning,
                              stacklevel=2)
                continue
            if isinstance(data.get("tool"), dict) and "fxstab" in data["tool"]:
                return py
    return None


# a [tool.fxstab] table (or a subtable, or a dotted key under [tool]) in a file's text
_FXSTAB_TABLE = re.compile(r"^\s*(\[+\s*tool\s*\.\s*[\"']?fxstab\b|fxstab\s*[.=])", re.M)


def _unreadable(e: Exception) -> str:
    """Why a settings file could not be read: for TOML, the parser's message with its line
    and column."""
    if isinstance(e, tomllib.TOMLDecodeError):
        return f"not valid TOML: {e}"
    return f"cannot read it ({e})"


def load(path: Optional[PathLike] = None, search: bool = True) -> Config:
    """Read and validate a settings file.

    Args:
        path: an ``fxstab.toml`` or ``pyproject.toml`` (or a folder to search from); None:
            search from the current folder (:func:`find`) when ``search``.
        search: look for a file when ``path`` is None; False gives the empty Config.

    Raises:
        ConfigError: the file is missing, not TOML, or holds an unknown key or a bad value.
    """
    if path is not None and Path(path).is_dir():
        found = find(path)
    elif path is None:
        found = find() if search else None
    else:
        found = Path(path)
    if found is None:
        return Config()
    if not found.is_file():
        raise ConfigError(found, "(file)", "no such file; give an fxstab.toml or a "
                                           "pyproject.toml with a [tool.fxstab] table")
    try:
        data = tomllib.loads(found.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(found, "(file)", _unreadable(e)) from None
    if found.name == "pyproject.toml" or "tool" in data:
        tool = data.get("tool", {})
        if not isinstance(tool, dict) or "fxstab" not in tool:
            raise ConfigError(found, "tool.fxstab", "the file has no [tool.fxstab] table")
        table, prefix = tool["fxstab"], "tool.fxstab."
    else:
        table, prefix = data, ""
    if not isinstance(table, dict):
        raise ConfigError(found, prefix.rstrip(".") or "(top level)", "must be a table")
    return _parse(found, table, prefix)


def _parse(path: Path, table: dict, prefix: str) -> Config:
    analysis: dict = {}
    gate: dict = {}
    targets: dict = {}
    for key, value in table.items():
        if key == "gate":
            gate = _section(path, value, f"{prefix}gate", GATE_KEYS)
            _check_gate(path, f"{prefix}gate", gate)
        elif key == "targets":
            if not isinstance(value, dict):
                raise ConfigError(path, f"{prefix}targets", f"must be a table of targets "
                                  f"([{prefix}targets.NAME]), got {value!r}")
            for name, spec in value.items():
                targets[name] = _target(path, f"{prefix}targets.{name}", name, spec)
        elif key in ANALYSIS_KEYS:
            analysis[key] = _value(path, f"{prefix}{key}", key, value, ANALYSIS_KEYS[key])
        else:
            raise ConfigError(path, f"{prefix}{key}", _unknown(key, value, ANALYSIS_KEYS,
                                                                 extra=("gate", "targets")))
    _check_analysis(path, prefix, analysis)
    return Config(path, analysis, gate, targets)


def _unknown(key: str, value: Any, known: dict, extra: tuple = ()) -> str:
    names = ", ".join(sorted([*known, *extra]))
    return f"unknown key (value {value!r}); known keys: {names}"


def _value(path: Path, where: str, key: str, value: Any, types: tuple) -> Any:
    if isinstance(value, bool) and bool not in types:
        ok = False  # TOML's true/false is no number or string here
    else:
        ok = isinstance(value, types)
    if not ok:
        names = " or ".join({"str": "a string", "int": "an integer", "float": "a number",
                             "list": "an array", "dict": "a table", "bool": "true or false"}
                            [t.__name__] for t in types)
        raise ConfigError(path, where, f"must be {names}, got {value!r}")
    if key in ("format", "gemm_inputs") and isinstance(value, list):
        if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                      for v in value):
            raise ConfigError(path, where, f"a format array is [exp_bits, man_bits], got "
                                           f"{value!r}")
        return tuple(value)
    if key == "select" and isinstance(value, list):
        if not all(isinstance(v, str) for v in value):
            raise ConfigError(path, where, f"must be operator kinds, families or globs "
                                           f"(strings), got {value!r}")
    if key == "formats":
        for name, fmt in value.items():
            if not isinstance(fmt, (str, list)):
                raise ConfigError(path, f"{where}.{name}", f"must be a format name, got {fmt!r}")
        return {n: tuple(f) if isinstance(f, list) else f for n, f in value.items()}
    return value


def _check_analysis(path: Path, prefix: str, opts: dict) -> None:
    """Each value against fxstab's own validation (AnalysisConfig), one key at a time, so the
    message names the key that is wrong."""
    from .config import AnalysisConfig

    for key, value in opts.items():
        if key == "accumulate_rounding":
            continue
        try:
            if key == "format" and value == "auto":
                continue
            if key == "format":
                from .numerics.formats import get_format

                get_format(value)
            else:
                AnalysisConfig(**{key: value})
        except (ValueError, TypeError) as e:
            raise ConfigError(path, f"{prefix}{key}", f"bad value {value!r}: {e}") from None
    if "accumulate_rounding" in opts:
        try:
            fold_accumulate({k: opts[k] for k in ("accumulate", "accumulate_rounding")
                             if k in opts})
        except (ValueError, TypeError) as e:
            raise ConfigError(path, f"{prefix}accumulate_rounding",
                              f"bad value {opts['accumulate_rounding']!r}: {e}") from None


def _section(path: Path, value: Any, where: str, keys: dict) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(path, where, f"must be a table, got {value!r}")
    out = {}
    for k, v in value.items():
        if k not in keys:
            raise ConfigError(path, f"{where}.{k}", _unknown(k, v, keys))
        out[k] = _value(path, f"{where}.{k}", k, v, keys[k])
    return out


def _check_gate(path: Path, where: str, gate: dict) -> None:
    from .digitmap import METRICS

    if "max_drop" in gate and not (math.isfinite(gate["max_drop"]) and gate["max_drop"] >= 0):
        raise ConfigError(path, f"{where}.max_drop",
                          f"must be a finite number >= 0, got {gate['max_drop']!r}")
    if "metric" in gate and gate["metric"] not in METRICS:
        raise ConfigError(path, f"{where}.metric", f"unknown metric {gate['metric']!r}; use "
                                                   f"one of {', '.join(METRICS)}")


def _target(path: Path, where: str, name: str, spec: Any) -> Target:
    if not isinstance(spec, dict):
        raise ConfigError(path, where, f"must be a table with target = 'module:function' and "
                                       f"output = 'FILE.json', got {spec!r}")
    own = {k: v for k, v in spec.items() if k in TARGET_KEYS}
    rest = {k: v for k, v in spec.items() if k not in TARGET_KEYS}
    for k, v in own.items():
        own[k] = _value(path, f"{where}.{k}", k, v, TARGET_KEYS[k])
    for k in ("target", "output"):
        if k not in own:
            raise ConfigError(path, f"{where}.{k}", "missing (a target needs target = "
                                                    "'path/file.py:function' or "
                                                    "'module:function', and output = 'FILE.json')")
    if ":" not in own["target"]:
        raise ConfigError(path, f"{where}.target", f"must be 'path/to/file.py:function' or "
                                                   f"'package.module:function', got "
                                                   f"{own['target']!r}")
    if not own["output"].endswith(".json"):
        raise ConfigError(path, f"{where}.output", f"must name a .json file, got "
                                                   f"{own['output']!r}")
    if own.get("calls", 1) < 1:
        raise ConfigError(path, f"{where}.calls", f"must be >= 1, got {own['calls']!r}")
    options = {}
    for k, v in rest.items():
        if k not in ANALYSIS_KEYS:
            raise ConfigError(path, f"{where}.{k}", _unknown(k, v, {**TARGET_KEYS,
                                                                   **ANALYSIS_KEYS}))
        options[k] = _value(path, f"{where}.{k}", k, v, ANALYSIS_KEYS[k])
    _check_analysis(path, f"{where}.", options)
    return Target(name, own["target"], own["output"], dict(own.get("kwargs", {})),
                  own.get("calls", 1), options, path.parent.resolve())
