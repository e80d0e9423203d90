"""The perf/ benchmarks that need this tier's environment, run small (perf/smoke.py, tier "sglang")."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed here: the SGLang tier runs in the env tests/engines/install_sglang.sh builds")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import smoke  # noqa: E402


@pytest.mark.parametrize("key", smoke.entries("sglang"))
def test_perf_script_runs_small(key, tmp_path):
    why = smoke.cluster_unavailable(key)  # emulated nodes need root + iproute2; CI runs as root
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the cluster harness cannot run: {why}")
        pytest.skip(why)
    ok, tail, _secs = smoke.run_one(key, str(tmp_path))
    assert ok, tail
