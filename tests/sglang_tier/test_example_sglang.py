"""``examples/refit_two_jobs.py --engine sglang`` runs as a newcomer runs it (one command) against the real
SGLang, and says it checked what it did."""

from __future__ import annotations

import os
import sys

import pytest

from triton_reshard.testing.launch import run_script

pytest.importorskip("sglang", reason="SGLang is not installed here: the SGLang tier runs in the env "
                                     "tests/engines/install_sglang.sh builds (bash .ci/run does both)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow


def test_refit_two_jobs_example_sglang():
    p = run_script([sys.executable, os.path.join(ROOT, "examples", "refit_two_jobs.py"), "--engine", "sglang"],
                   cwd=ROOT, timeout=400)
    out = p.stdout
    assert p.returncode == 0, f"{out[-3000:]}\n{p.stderr[-3000:]}"
    assert out.count("OK, every parameter as SGLang would load it") == 3 * 2, out
    assert out.count("recorded from SGLang's loader") == 2, out
    assert "done: 3 refits across two jobs" in out
