"""The composite operators the arithmetic level lowers into primitives: one table for both
drivers (docs/design.md §3 ``aten``).

:data:`DECOMPOSED` names the composites (softmax, the norms, the activations, the losses...)
whose primitives the rules must see, so that the digits and counters are those of the
arithmetic (softmax becomes exp, sum, div; layer_norm its mean, variance, rsqrt...).
:func:`decompositions` is their table:

* ``decompositions()`` (the compiled path, :mod:`fxstab.analysis.aten_level`: ``make_fx``
  lowers every graph to core ATen) is torch's core ATen decompositions updated with those of
  :data:`DECOMPOSED`.
* ``decompositions(core=False)`` (the eager driver, :mod:`fxstab.eager.stochastic`, which meets
  operators one by one as the program dispatches them) is those of :data:`DECOMPOSED` only: an
  operator core ATen decomposes but that is one primitive of the rules (``dot``, ``mv``,
  ``baddbmm``: trusted GEMMs with the surrogate; ``sum``, ``heaviside``, views) stays one
  primitive there, as a torch program writes it (``np.dot`` of vectors is one ``dot``:
  tests/test_numpy.py). The named composites lower the same way on both paths.

Until this module the two drivers kept a list each. Compared on torch 2.13 (every entry of the
resulting tables, the functions included):

* the compiled list is kept whole, and its table is entry for entry what it was (so the
  compiled path's digit maps do not change);
* the eager list's extra names were ``std``, ``std_mean``, ``var``, ``_rms_norm``,
  ``log_sigmoid_forward``, ``softshrink``, ``hardshrink``, ``celu``, ``selu``, ``glu``,
  ``binary_cross_entropy``. Core ATen decomposes ``std.correction``,
  ``std_mean.correction``, ``log_sigmoid_forward``, ``softshrink``, ``hardshrink``, ``celu``,
  ``glu`` and ``binary_cross_entropy`` with the same functions, so they join the list as they
  are (the compiled table does not change; the eager driver keeps them). ``selu`` and the
  ``default``/``dim`` overloads of ``std``, ``std_mean`` and ``var`` are CompositeImplicit:
  they never reach a dispatcher (eager or ``make_fx``), so they are left out, as is
  ``_rms_norm`` (no such operator in torch 2.13). ``var.correction`` is left out: the eager
  driver decomposed it (``torch._refs.var``: prims.var), the compiled path runs it as one
  ``var`` primitive; both now run it as that one primitive (its value differs from prims.var's
  two-pass form by a few working-dtype ulps, before the rounding into the format);
* the compiled list's extra names, which the eager driver now decomposes too: ``rsub``
  (``1 - x`` becomes ``sub``) and BatchNorm's entry points of torch >= 2.4
  (``_batch_norm_with_update``, ``_batch_norm_with_update_functional``,
  ``_batch_norm_no_update``).
"""

from __future__ import annotations

import functools

import torch

aten = torch.ops.aten

__all__ = ["DECOMPOSED", "decompositions"]

# Decomposed beyond the core aten set, so the primitives the arithmetic level counts are seen.
DECOMPOSED = [
    aten._softmax, aten._log_softmax, aten.native_layer_norm, aten.native_group_norm,
    aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training, aten.gelu, aten.silu, aten.mish, aten.hardswish,
    aten.hardsigmoid, aten.elu, aten.leaky_relu, aten.softplus, aten.logsumexp, aten.var_mean,
    aten.mse_loss, aten.nll_loss_forward, aten.huber_loss, aten.smooth_l1_loss, aten.addcmul,
    aten.addcdiv, aten.lerp, aten.rsub, aten.norm, aten.linalg_vector_norm,
    aten.rms_norm if hasattr(aten, "rms_norm") else aten.native_layer_norm,
    # BatchNorm's entry points of torch >= 2.4 (training and eval)
    aten._batch_norm_with_update, aten._batch_norm_with_update_functional,
    aten._batch_norm_no_update,
    # what the eager driver meets of std/std_mean (their other overloads are CompositeImplicit)
    aten.std.correction, aten.std.correction_out, aten.std_mean.correction,
    aten.std_mean.correction_out,
    aten.log_sigmoid_forward, aten.softshrink, aten.hardshrink, aten.celu, aten.glu,
    aten.binary_cross_entropy,
]


def decompositions(core: bool = True) -> dict:
    """The decomposition table of the arithmetic level: operator overload -> its decomposition.

    Args:
        core: With torch's core ATen decompositions under those of :data:`DECOMPOSED` (the
            compiled path, which lowers to core ATen); ``False``: :data:`DECOMPOSED`'s only (the
            eager driver; module docstring).

    Returns:
        A fresh dict (the caller may keep or extend it; the named part is built once).
    """
    if not core:
        return dict(_named())
    from torch._decomp import core_aten_decompositions  # noqa: PLC0415 - a large table

    table = dict(core_aten_decompositions())
    table.update(_named())
    return table


@functools.lru_cache(maxsize=None)
def _named() -> dict:
    from torch._decomp import get_decompositions  # noqa: PLC0415

    return get_decompositions(DECOMPOSED)
