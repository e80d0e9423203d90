"""Every benchmark under perf/ runs small (perf/smoke.py), in the tier whose environment it needs: here the
main suite's; tests/engines and tests/sglang_tier run theirs. A new perf script without a smoke entry fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
import smoke  # noqa: E402


def test_every_perf_script_has_a_smoke_run():
    assert smoke.scripts_without_smoke() == []
    tiers = {t for t, _a, _s in smoke.SMOKE.values()}
    assert tiers <= {"main", "engines", "sglang", "cluster", "vllm-cpu", None}
    assert {"main", "engines", "sglang"} <= tiers


@pytest.mark.slow
@pytest.mark.parametrize("key", smoke.entries("main"))
def test_perf_script_runs_small(key, tmp_path):
    ok, tail, _secs = smoke.run_one(key, str(tmp_path))
    assert ok, tail
