"""Hypothesis profiles. ``TRITON_RESHARD_HYPOTHESIS=ci`` (set by ``.ci/run``) loads "ci": derandomized (the
same examples every run, so a CI failure reproduces locally with the same variable) and no deadline. Tests
with their own ``settings(max_examples=...)`` keep their count; ``tests/test_plan_scale.py`` reads the
variable to draw 3,000 layout pairs in CI instead of a few hundred."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
if os.environ.get("TRITON_RESHARD_HYPOTHESIS"):
    settings.load_profile(os.environ["TRITON_RESHARD_HYPOTHESIS"])
