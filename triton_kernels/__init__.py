"""Fused Triton kernels of fxstab with their plain-torch references (installed as fxstab.kernels)."""
