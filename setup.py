"""Package discovery: every package under fxstab/ (a subpackage added later ships without
editing a list), its data folders (``cpu/csrc``, ``plots/pages``: namespace packages, listed so
setuptools installs their files without a deprecation warning), plus the Triton kernels' folder
mapped to fxstab.kernels in pyproject.toml. A hand-kept list once left out fxstab.passes, and
the wheel could not be imported."""

from setuptools import find_namespace_packages, setup

setup(packages=find_namespace_packages(include=["fxstab", "fxstab.*"],
                                       exclude=["*.__pycache__", "*.__pycache__.*"])
      + ["fxstab.kernels"])
