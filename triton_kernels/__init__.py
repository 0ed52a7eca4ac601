"""Fused Triton kernels of fxstab with their plain-torch references (installed as fxstab.kernels).

Importing this package does not import Triton or register anything; :func:`round_and_stats`,
:func:`perturb` and :func:`register_ops` do that on first use (docs/kernels.md).
"""

from .dispatch import KERNEL_OPTIONS, perturb, register_ops, resolve_kernels, round_and_stats

__all__ = ["round_and_stats", "perturb", "register_ops", "resolve_kernels", "KERNEL_OPTIONS"]
