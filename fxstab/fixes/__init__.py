"""Stable rewrites of naive floating-point formulas (docs/fixes.md, issue 54).

* :mod:`.registry`: the table ``REWRITES[name]``, the :func:`~.registry.rewrite` decorator
  (pattern and precondition as one ``match(node)``, the docstring as documentation) and
  ``describe(name)``;
* the rewrites, by what the naive formula does: :mod:`.logs` (a logarithm of a value that
  rounds to 0 or 1), :mod:`.exps` (an exponential that over- or underflows or cancels),
  :mod:`.reductions` (statistics written with squares), :mod:`.normalization` (a layer or
  RMS normalization written by hand), :mod:`.cancellation` (a value
  added and subtracted again), :mod:`.attention` (an attention written by hand),
  :mod:`.branches` (a ``where`` whose unselected branch overflows in the backward),
  :mod:`.guards` (an ``eps`` the format erases: the one rewrite that sees the format);
* :mod:`.graph`: a rewrite applied to a captured graph, and the backend that applies them
  (:class:`~.graph.RewriteBackend`);
* :mod:`.verify`: :func:`~.verify.suggest_fixes`, each match near a finding applied, analysed
  again and run for real in the format against fp64 (:class:`~.verify.Fix`).
"""

# the rewrites join the table as their modules load (in this order: the order they are tried)
from . import (  # noqa: F401,I001
    logs, exps, reductions, normalization, cancellation, attention, branches, guards,
)
from .graph import RewriteBackend, Site, apply_match
from .registry import REWRITES, Call, Match, Rewrite, describe, find_matches, rewrite

__all__ = ["REWRITES", "Rewrite", "Match", "Call", "rewrite", "describe", "find_matches",
           "apply_match", "RewriteBackend", "Site"]
