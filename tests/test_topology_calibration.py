"""perf/bench_cluster.py's calibration (perf/cluster_probe.py) of the time model (no cluster needed): the host rate it derives from the
probes' refits gives back, through ``predict_seconds``, the very refit it was measured on; the plan it
predicts is the one ``ours`` ran (its relay choice)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))


def _results(world: int, tiny_s: float, bulk_s: float) -> list[dict]:
    """What every rank's ``_tiny`` / ``_bulk`` report: enter/leave marks whose spans are ``tiny_s`` / ``bulk_s``
    (one rank enters last and leaves first, another enters first: the span is across ranks), CPU per rank."""
    def marks(secs, reps, r):
        enter = [10.0 * i + (0.0 if r == 0 else 1e-4) for i in range(reps)]
        leave = [e + secs - (0.0 if r == 0 else 2e-4) for e in enter]
        return {"seconds": [b - a for a, b in zip(enter, leave, strict=True)], "enter": enter, "leave": leave,
                "cpu": [1e-3] * reps}
    return [{"tiny": marks(tiny_s, 15, r), "bulk": marks(bulk_s, 5, r)} for r in range(world)]


@pytest.mark.parametrize("nodes", [2, 4])
def test_host_rate_gives_back_the_bulk_refit(nodes):
    import dataclasses

    import cluster_probe as cp

    from triton_reshard import plan_reshard
    from triton_reshard.tools.topology import Topology, plan_phase_pair_bytes, predict_seconds

    rpn, link, loop, tiny_s, bulk_s = 2, 1.1e9, 2e9, 0.004, 0.030
    got = cp.host_probe(_results(nodes * rpn, tiny_s, bulk_s), nodes, rpn, link, loop)
    assert got["refit_step_s"] == pytest.approx(tiny_s) and got["bulk_s"] == pytest.approx(bulk_s)
    assert got["bulk_bytes"] == 4096 * 2048 * 2 and got["host_cores"] >= 1
    # the model with the measured fixed cost, link and host rate predicts the bulk refit's measured span
    src, dst = cp.bulk_layouts(nodes, rpn)
    phases = plan_phase_pair_bytes(plan_reshard(src, dst, False, rpn, False))
    topo = Topology(gpus_per_node=rpn, nvlink_GBps=loop / 1e9, net_GBps=got["link_calibrated"] / 1e9,
                    step_latency_s=0.0, refit_latency_s=tiny_s, shared_nic=True, host_GBps=got["host_Bps"] / 1e9,
                    host_cores=got["host_cores"])
    assert predict_seconds(phases, topo).seconds == pytest.approx(bulk_s)
    wire = predict_seconds(phases, dataclasses.replace(topo, host_GBps=None, host_cores=None)).seconds - tiny_s
    assert got["bulk_host_s"] == pytest.approx(bulk_s - tiny_s - wire) and got["bulk_host_s"] > 0
    assert got["link_calibrated"] == link
    # a link probe that read lower than the refit shows the links carried (nothing left beyond the wire): the
    # refit's rate, and no host term (not a negative or infinite rate)
    none = cp.host_probe(_results(nodes * rpn, tiny_s, tiny_s + wire - 1e-3), nodes, rpn, link, loop)
    busiest = (16 << 20) // (nodes // 2)
    assert none["link_calibrated"] == pytest.approx(busiest / (wire - 1e-3)) and none["host_Bps"] is None


def test_bulk_layouts_cross_every_link():
    import cluster_probe as cp

    from triton_reshard import plan_reshard
    from triton_reshard.tools.topology import node_link_bytes, plan_pair_bytes

    src, dst = cp.bulk_layouts(4, 2)
    pairs = plan_pair_bytes(plan_reshard(src, dst, False, 2, False))
    assert set(pairs) == {(s, d) for s in range(4) for d in range(4, 8)}  # every trainer rank to every engine rank
    assert node_link_bytes(pairs, 2) == [(8 << 20, 0), (8 << 20, 0), (0, 8 << 20), (0, 8 << 20)]


@pytest.mark.parametrize("model,relay,phases", [("small_llama", False, 1), ("small_llama", True, 2)])
def test_predicted_is_for_the_plan_ours_ran(model, relay, phases):
    """Until session 41 ``predicted`` planned with the planner's default (relays on with ``gpus_per_node``) where
    ``ours`` ran without: one more phase (a round trip and a loopback fan-out) than the refit it predicted."""
    import bench_cluster as bc

    calib = {"link_Bps": 1.25e9, "step_s": 0.003, "rtt_s": 1e-3, "host_Bps": None, "host_cores": 2}
    with_relay = bc.predicted(model, 2, 2, 1e10, 2e9, 1e-3, calib, relay=True)
    got = bc.predicted(model, 2, 2, 1e10, 2e9, 1e-3, calib, relay=relay)
    assert got["calibrated"] == got["calibrated_wire"]  # no host rate: no host term
    if relay:
        assert got == with_relay
    else:  # one round trip less (the relay phase's loopback bytes are a few KB)
        assert with_relay["calibrated"] - got["calibrated"] == pytest.approx(1e-3, rel=0.05)
        assert with_relay["shared_link"] - got["shared_link"] == pytest.approx(1e-3, rel=0.05)


def test_a_model_is_calibrated_by_the_probe_refits_run_in_turn_with_it():
    """``model_calib``: where the ranks ran the 64-byte and 16 MiB refits in turn with ``ours`` of a model, the
    fixed cost and host rate come from those (the same stretch of time), else the setting's."""
    import cluster_probe as cp

    setting = _results(4, 0.004, 0.030)
    calib = {"link_Bps": 1.1e9, "step_s": 0.004, "rtt_s": 1e-3, "host_Bps": 5e9, "host_cores": 2}
    probe = {"link": 1.1e9, "loopback": 2e9}
    turn = _results(4, 0.008, 0.050)  # a loaded stretch: both slower
    results = [{"models": {"a": {"probe_refits": t}, "b": {}}} for t in turn]
    got = cp.model_calib(calib, probe, results, "a", 2, 2)
    want = cp.host_probe(turn, 2, 2, 1.1e9, 2e9)
    assert got["step_s"] == pytest.approx(0.008) and got["host_Bps"] == want["host_Bps"] != calib["host_Bps"]
    assert got["in_turn"] == want and got["rtt_s"] == calib["rtt_s"]
    assert cp.model_calib(calib, probe, results, "b", 2, 2) is calib
    assert cp.host_probe(setting, 2, 2, 1.1e9, 2e9)["refit_step_s"] == pytest.approx(0.004)
