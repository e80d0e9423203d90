"""Hypothesis profiles. ``TRITON_RESHARD_HYPOTHESIS=ci`` (set by ``.ci/run``) loads "ci": derandomized (the
same examples every run, so a CI failure reproduces locally with the same variable) and no deadline. Tests
with their own ``settings(max_examples=...)`` keep their count; ``tests/test_plan_scale.py`` reads the
variable to draw 3,000 layout pairs in CI instead of a few hundred."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
if os.environ.get("TRITON_RESHARD_HYPOTHESIS"):
    settings.load_profile(os.environ["TRITON_RESHARD_HYPOTHESIS"])


@pytest.fixture
def triton_mode(request, monkeypatch):
    """Interpreter for CPU tests, compiled kernels for ``gpu`` tests (skipped without a CUDA device); a fresh
    copy-table cache for each test. Modules of Triton tests use it for all their tests
    (``pytestmark = pytest.mark.usefixtures("triton_mode")``)."""
    import torch

    from triton_reshard.ops import copy as triton_copy

    if request.node.get_closest_marker("gpu"):
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_copy.clear_cache()
    yield
    triton_copy.clear_cache()


@pytest.fixture
def codec():
    """The delta codec a test body runs with: ``codec("numpy")`` or ``codec("native")`` (skipped where the native
    codec was not built); the previous choice restored after the test."""
    from triton_reshard.ops import delta_native

    prev = delta_native.set_native(True)

    def use(name: str) -> None:
        delta_native.set_native(name == "native")
        if name == "native" and delta_native.native() is None:
            pytest.skip("the native codec is not built (pip install -e . builds it)")

    yield use
    delta_native.set_native(prev)
