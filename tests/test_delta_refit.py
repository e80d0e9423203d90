"""Delta refits end to end (issue 24) over real gloo worlds: bit-exact over many steps of a real optimizer for
the layouts of the gloo cases (TP/PP/DP/EP, casts, relays, engine instances, several steps), the fence on
``refit_state`` (wrong base, torn, restarted; strict), block-FP8 destinations (dense fallback), and a peer
failing or dying mid-delta (torn, then repaired by the next refit, dense). Workers: ``tests/delta_cases.py``."""

from __future__ import annotations

import pytest
import torch

from tests import delta_cases as dc
from triton_reshard import Layout, Resharder, Shard, plan_reshard, refit
from triton_reshard.execute.delta import DeltaRequest
from triton_reshard.testing.launch import run_world

WORLD2 = ["tp2-to-replicated-bf16", "small-bucket-steps", "per-expert-tp-to-stacked", "1d-int32", "fused-qkv"]
WORLD4 = ["pp2xtp2-to-tp4", "dp2xtp2-replicas-to-tp4", "cast-fp32-to-bf16", "relay-allgather-gpn2",
          "per-expert-tp4-to-ep-stacked", "small-bucket-w4"]
WORLD8 = ["instances-tp2-to-3x-tp2", "relay-uneven-bf16-dp2xtp3-gpn2", "relay-allgather-cast-gpn2",
          "int8-and-bool-tp8-to-tp2x4", "dp2xtp4-to-tp8", "pp4xtp2-to-tp8"]


def _check_cases(results) -> None:
    for rank, out in enumerate(results):
        for cid, o in out.items():
            assert not o["problems"], "\n".join(o["problems"][:5])
            rows = o["rows"]
            assert rows[0]["mode"] == "dense-fallback" and "no snapshot" in rows[0]["fallback"], (cid, rows[0])
            for row in rows[1:]:
                assert row["mode"] == "delta" and row["base"] is not None, (cid, rank, row)
                if row["kind"] == "same" and row["dense"] > 4096:  # nothing changed: framing only
                    assert row["sent"] < row["dense"] / 10, (cid, rank, row)
            # the snapshot holds the delta-able sends (not the widening casts, which go dense)
            assert o["snapshot_bytes"] <= rows[0]["dense"], (cid, rank, o["snapshot_bytes"])


def test_delta_cases_world2():
    _check_cases(run_world(dc.run_delta_cases, 2, WORLD2, backend="gloo", timeout=300))


@pytest.mark.slow
def test_delta_cases_world4():
    _check_cases(run_world(dc.run_delta_cases, 4, WORLD4, backend="gloo", timeout=300))


@pytest.mark.slow
def test_delta_cases_world8():
    res = run_world(dc.run_delta_cases, 8, WORLD8, backend="gloo", timeout=600)
    _check_cases(res)
    # the instances case is big enough to count: after the first optimizer steps, deltas are far below dense
    rows = [out["instances-tp2-to-3x-tp2"]["rows"] for out in res]
    for k, kind in enumerate(("first",) + dc.SCHEDULE):
        sent = sum(r[k]["sent"] for r in rows)
        dense = sum(r[k]["dense"] for r in rows)
        if kind == "same" or kind == "one":
            assert sent < dense / 100, (kind, sent, dense)
        elif kind == "all":
            assert sent >= dense
        elif kind == "adam":
            assert sent < dense / 4, (kind, sent, dense)


def test_fence_fallbacks_and_failures():
    res = run_world(dc.fence_world, 4, backend="gloo", timeout=300, allow_errors=True)
    assert isinstance(res[1], str)  # rank 1 was SIGKILLed in the last scenario
    for rank in (0, 2, 3):
        o = res[rank]
        assert isinstance(o, dict), o
        # block-FP8: dense, said, bit-exact; strict refuses on every rank
        assert not o["fp8"]["problems"], o["fp8"]["problems"][:3]
        assert [m["mode"] for m in o["fp8"]["modes"]] == ["dense-fallback"] * 2
        assert "block-quantized" in o["fp8"]["modes"][1]["fallback"]
        assert "block-quantized" in o["fp8"]["strict"]
        # first dense, then a delta from version 0
        assert o["first"]["mode"] == "dense-fallback" and o["first_ok"]
        assert o["second"]["mode"] == "delta" and o["second"]["base"] == 0 and o["second_ok"]
        # rank 3 at the wrong base: strict raises on every rank naming it and the versions, nothing written
        assert o["strict"]["error"] == "DeltaRefusedError"
        assert "{2: 1, 3: 99}" in o["strict"]["message"] and "nothing was moved" in o["strict"]["message"]
        assert o["wrong_base"]["mode"] == "dense-fallback" and "versions differ" in o["wrong_base"]["fallback"]
        assert o["wrong_base_ok"] and o["after_wrong_base"]["mode"] == "delta" and o["after_wrong_base_ok"]
        assert o["after_wrong_base"]["base"] == 2
        assert o["torn"]["mode"] == "dense-fallback" and "torn" in o["torn"]["fallback"] and o["torn_ok"]
        assert "rank(s) [2]" in o["torn"]["fallback"]
        assert o["restarted"]["mode"] == "dense-fallback" and "[3] hold no refit version" in o["restarted"]["fallback"]
        assert o["restarted_ok"]
        assert o["plain"]["mode"] == "dense"
        assert o["after_plain"]["mode"] == "dense-fallback" and "no snapshot" in o["after_plain"]["fallback"]
        assert o["after_plain_ok"] and o["delta_again"]["mode"] == "delta" and o["delta_again_ok"]
        assert o["mixed"]["error"] == "ReshardError" and "different plans or options" in o["mixed"]["message"]
        assert o["mixed_state"]["version"] == (8 if rank in (2, 3) else o["mixed_state"]["version"])
        assert not o["mixed_state"]["torn"]
        # a failure mid-delta, then the repair: dense on a new group, then deltas again
        assert o["repair"]["mode"] == "dense-fallback" and o["repair_ok"] and not o["repair_state"]["torn"]
        assert o["after_repair"]["mode"] == "delta" and o["after_repair_ok"]
        assert o["small"]["mode"] == "dense-fallback" and o["small_delta"]["mode"] == "delta" and o["small_delta_ok"]
    assert res[2]["fail"]["error"] == "ReshardAbortedError" and res[2]["fail"]["torn"]
    assert res[2]["fail_state"]["torn"] and res[2]["fail_state"]["version"] == 8
    for rank in (2, 3):  # the engine ranks: a named transport error within the timeout, torn (step 1 landed)
        k = res[rank]["kill"]
        assert k["error"] in ("ReshardTimeoutError", "ReshardConnectionError", "ReshardTransportError"), k
        assert k["seconds"] < dc.TIMEOUT + 20
        assert res[rank]["kill_state"]["torn"] and res[rank]["kill_state"]["version"] == 12


def test_delta_request_validation():
    src = Layout.from_placements({"w": (4, 4)}, [0], [Shard(0)])
    t = {"w": torch.zeros(4, 4)}
    with pytest.raises(TypeError, match="needs an int version"):
        refit(t, {"w": torch.zeros(4, 4)}, src, src, delta=True)
    with pytest.raises(TypeError, match="needs an int version"):
        refit(t, {"w": torch.zeros(4, 4)}, src, src, delta=True, version="step-3")
    with pytest.raises(ValueError, match="delta must be False, True, 'strict' or 'auto'"):
        refit(t, {"w": torch.zeros(4, 4)}, src, src, delta="yes", version=1)


def test_local_only_plan_has_nothing_to_delta():
    """One process, no group: every copy is local (dense); the report says a delta had nothing to carry."""
    lay = Layout.from_placements({"w": (4, 4)}, [0], [Shard(0)], torch.bfloat16)
    r = Resharder(plan_reshard(lay, lay))
    src, dst = {"w": torch.randn(4, 4).bfloat16()}, {"w": torch.zeros(4, 4, dtype=torch.bfloat16)}
    rep = r.run(src, dst, delta=DeltaRequest(1, held=0))
    assert rep.mode == "dense-fallback" and "local copies" in rep.fallback and torch.equal(dst["w"], src["w"])
    assert r.run(src, dst).mode == "dense"


def test_refused_delta_after_diffing_during_the_handshake_moves_nothing():
    """The senders diff their first step while the handshake is in flight; a strict refusal and a handshake
    refusal afterwards write no destination and keep the snapshot, so the next delta from the old base lands
    every change bit for bit (a snapshot that took the refused diff would miss them)."""
    res = run_world(dc.refused_world, 4, backend="gloo", timeout=300)
    for rank, o in enumerate(res):
        assert o["v0"]["mode"] == "dense-fallback" and o["v1"]["mode"] == "delta" and o["v1_ok"], (rank, o)
        assert o["strict"]["error"] == "DeltaRefusedError" and "nothing was moved" in o["strict"]["message"]
        assert o["strict_untouched"] and o["mixed_untouched"]
        assert o["mixed"]["error"] == "ReshardError" and "different plans or options" in o["mixed"]["message"]
        if rank in (0, 1):  # the senders did diff before the refusals
            assert o["strict_prediffs"] > 0 and o["mixed_prediffs"] > 0, o
        assert o["v2"]["mode"] == "delta" and o["v2"]["base"] == 1 and o["v2_ok"], (rank, o["v2"])
        assert o["v3"]["mode"] == "delta" and o["v3"]["base"] == 2 and o["v3_ok"], (rank, o["v3"])
