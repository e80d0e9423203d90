"""The refit-time model of ``triton_reshard.topology``: hand-computed figures, and its plumbing from a plan."""

from __future__ import annotations

import pytest
import torch

from triton_reshard import Layout, Replicate, Shard, plan_reshard
from triton_reshard.topology import (
    GB,
    PRESETS,
    PortLoad,
    Topology,
    plan_pair_bytes,
    port_loads,
    predict_seconds,
    schedule_pair_bytes,
)

TOPO = Topology(gpus_per_node=4, nvlink_GBps=400.0, net_GBps=50.0, step_latency_s=1e-3)


def test_presets():
    assert PRESETS["h100"] == Topology(gpus_per_node=8, nvlink_GBps=450.0, net_GBps=50.0)
    assert PRESETS["gb200"] == Topology(gpus_per_node=72, nvlink_GBps=900.0, net_GBps=50.0)
    assert Topology() == PRESETS["gb200"]


@pytest.mark.parametrize("kwargs", [
    pytest.param({"gpus_per_node": 0}, id="no-gpus"),
    pytest.param({"nvlink_GBps": 0.0}, id="no-nvlink"),
    pytest.param({"net_GBps": -1.0}, id="negative-net"),
    pytest.param({"step_latency_s": -1e-6}, id="negative-latency"),
])
def test_bad_topology(kwargs):
    with pytest.raises(ValueError):
        Topology(**kwargs)


def test_nodes_are_consecutive_ranks():
    assert [TOPO.node(r) for r in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert TOPO.same_node(4, 7) and not TOPO.same_node(3, 4)


def test_port_loads_split_nvlink_and_network():
    loads = port_loads({(0, 1): 100, (0, 5): 30, (5, 0): 7, (2, 2): 1000, (3, 6): 0}, TOPO)
    assert loads == {
        0: PortLoad(nvlink_send=100, net_send=30, net_recv=7),
        1: PortLoad(nvlink_recv=100),
        5: PortLoad(net_send=7, net_recv=30),
    }  # local copies (2 -> 2) and empty pairs use no port


def test_one_step_is_its_busiest_port():
    # rank 0 sends 8 GB over NVLink (20 ms at 400 GB/s) and 1 GB over the network (20 ms at 50 GB/s);
    # rank 5 receives 2 GB over the network (40 ms): that sets the step
    pairs = {(0, 1): 8 * 10**9, (0, 4): 10**9, (6, 5): 10**9, (3, 5): 10**9, (2, 5): 10**9}
    p = predict_seconds([pairs], TOPO)
    assert p.seconds == pytest.approx(0.040 + 1e-3)
    assert (p.busiest_rank, p.busiest_port, p.steps) == (5, "net", 1)
    assert p.nvlink_bytes == 9 * 10**9 and p.net_bytes == 3 * 10**9


def test_steps_add_up_and_the_bound_is_lower():
    a, b = {(0, 1): 4 * 10**9}, {(0, 4): 10**9}
    both = predict_seconds([a, b], TOPO)
    assert both.seconds == pytest.approx(4 / 400 + 1 / 50 + 2e-3)
    merged = predict_seconds([{**a, **b}], TOPO)  # one step: NVLink and network overlap
    assert merged.seconds == pytest.approx(max(4 / 400, 1 / 50) + 1e-3)
    assert merged.seconds < both.seconds
    assert predict_seconds([], TOPO).seconds == 0.0


def test_nvlink_only_traffic_is_bound_by_nvlink():
    p = predict_seconds([{(0, 1): 45 * 10**9}], PRESETS["h100"])
    assert p.seconds == pytest.approx(0.1 + PRESETS["h100"].step_latency_s)
    assert p.busiest_port == "nvlink" and p.net_bytes == 0


def test_from_a_plan_and_its_schedule():
    """TP2 on ranks 0-1 -> replicated on ranks 2 and 5: the pair bytes add up to the wire bytes."""
    src = Layout.from_placements({"w": (64, 32)}, [0, 1], [Shard(0)], dtype=torch.float32)
    dst = Layout.from_placements({"w": (64, 32)}, [2, 5], [Replicate()], dtype=torch.float32)
    plan = plan_reshard(src, dst)
    pairs = plan_pair_bytes(plan)
    assert pairs == {(0, 2): 4096, (1, 2): 4096, (0, 5): 4096, (1, 5): 4096}
    assert sum(pairs.values()) == plan.stats().wire_bytes
    sched = plan.schedule(4096)  # 2 KiB per rank and direction: several steps
    steps = schedule_pair_bytes(sched)
    assert len(steps) == len(sched.steps) > 1
    total: dict = {}
    for st in steps:
        for k, n in st.items():
            total[k] = total.get(k, 0) + n
    assert total == pairs
    bound, stepped = predict_seconds([pairs], TOPO), predict_seconds(steps, TOPO)
    # ranks 0, 1 each send 4096 B to rank 5 in another node: 8192 B through rank 5's NIC
    assert bound.seconds == pytest.approx(8192 / (50 * GB) + 1e-3)
    assert stepped.seconds >= bound.seconds and stepped.steps == len(steps)
