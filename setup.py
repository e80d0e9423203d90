"""Package discovery only; all metadata is in pyproject.toml.

Every package under ``triton_reshard/`` is found, so a new subpackage cannot be left out of the wheel (a
hand-kept list in pyproject.toml once missed ``triton_reshard.layout``). The Triton kernels live at the top
level in ``kernels/`` and install as ``triton_reshard.kernels`` (with any subpackage they grow).
``tests/test_packaging.py`` and ``.ci/wheel_check.sh`` check the built wheel against the tree."""

from setuptools import find_packages, setup

KERNELS = "triton_reshard.kernels"

packages = find_packages(include=["triton_reshard", "triton_reshard.*"])
packages += [KERNELS] + [f"{KERNELS}.{p}" for p in find_packages("kernels")]

setup(packages=packages, package_dir={KERNELS: "kernels"})
