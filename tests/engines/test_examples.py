"""The examples run as a newcomer runs them (one command each), and say they checked what they did."""

from __future__ import annotations

import os
import sys

import pytest

from triton_reshard.testing.launch import run_script

pytest.importorskip("vllm", reason="vLLM is not installed here: the engine tier runs in the env "
                                   "tests/engines/install.sh builds (bash .ci/run does both)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow


def test_refit_two_jobs_example():
    p = run_script([sys.executable, os.path.join(ROOT, "examples", "refit_two_jobs.py")], cwd=ROOT, timeout=400)
    out = p.stdout
    assert p.returncode == 0, f"{out[-3000:]}\n{p.stderr[-3000:]}"
    assert out.count("OK, every parameter as vLLM would load it") == 3 * 2, out
    last = out.rstrip().splitlines()[-1]  # the verdict is the last line, after vLLM's warnings (issue 22)
    assert last.startswith("done: 3 refits across two jobs") and "6 of 6 engine checks OK" in last, last
