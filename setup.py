"""Package discovery: every package under fxstab/ (a subpackage added later ships without
editing a list), plus the Triton kernels' folder mapped to fxstab.kernels in pyproject.toml.
A hand-kept list once left out fxstab.passes, and the wheel could not be imported."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["fxstab", "fxstab.*"]) + ["fxstab.kernels"])
