"""``triton_reshard.testing.launch.run_script``: the engine tiers' way to run a job script. On its timeout the
script's whole session dies (an engine it started included), not just the script: ``subprocess.run`` kills only
the script, and the orphaned vLLM engines of a timed-out job (~3.5 GB, a core busy) slowed every later test of
the tier into timeouts of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from triton_reshard.testing.launch import run_script

# a script that starts a child of its own (as a job starts an engine), says its pid, then outlives any timeout
# (its output elsewhere, so the pipes close when the script dies)
_PARENT = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
           " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(c.pid, flush=True); time.sleep(120)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc to see the child")
def test_a_timeout_kills_the_scripts_children_too():
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run_script([sys.executable, "-c", _PARENT], timeout=5)
    child = int(e.value.output.split()[0])  # the output so far comes with the timeout
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the script's child outlived the timeout"


def test_output_and_exit_code_as_subprocess_run():
    r = run_script([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                   timeout=60, cwd=os.path.dirname(__file__), env=dict(os.environ, X_TEST="1"))
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
