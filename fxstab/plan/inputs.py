"""A plan's example inputs as the search and the real run take them: positional arguments as a
tuple (one tensor is one input). Its own module: the search (``search.py``) runs the real run
(``apply.py``) to calibrate, and both read inputs."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["as_inputs"]


def as_inputs(example_inputs: Any) -> tuple:
    """Positional inputs as a tuple (one tensor is one input)."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    return tuple(example_inputs)
