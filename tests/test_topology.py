"""The refit-time model of ``triton_reshard.tools.topology``: hand-computed figures, and its plumbing from a plan."""

from __future__ import annotations

import pytest
import torch

from triton_reshard import Layout, Replicate, Shard, plan_reshard
from triton_reshard.tools.topology import (
    GB,
    PRESETS,
    PortLoad,
    Topology,
    plan_pair_bytes,
    plan_phase_pair_bytes,
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


# --------------------------------------------------------------------------------------------------------
# Relays: a second phase
# --------------------------------------------------------------------------------------------------------


def _relay_plans():
    """TP2 on ranks 0-1 -> TP2 x DP3 on ranks 2-7, nodes of 4 (see tests/dist_cases.py): node 1 (ranks 4-7)
    gets each TP shard (w: 240 B, b: 24 B) once over the network, then relays it."""
    from . import dist_cases as dc

    case = dc.CASES["relay-disagg-tp2-to-tp2xdp3-gpn4"]
    src, dst = dc.side_layout(case.src), dc.side_layout(case.dst)
    from .oracles.greedy import greedy_plan

    return greedy_plan(src, dst, False, 4, False), greedy_plan(src, dst, False, 4, True)


def test_relay_phases_and_their_prediction():
    near, fan = _relay_plans()
    assert plan_phase_pair_bytes(near) == [plan_pair_bytes(near)]  # no relays: one phase, as before
    first, relays = plan_phase_pair_bytes(fan)
    assert first == {(0, 2): 264, (1, 3): 264, (0, 4): 240, (1, 5): 240, (0, 6): 24, (1, 7): 24}
    assert relays == {(4, 6): 240, (5, 7): 240, (6, 4): 24, (7, 5): 24}
    assert all(TOPO.same_node(s, d) for s, d in relays)
    total = dict(first)
    for k, n in relays.items():
        total[k] = total.get(k, 0) + n
    assert total == plan_pair_bytes(fan)
    no_latency = Topology(gpus_per_node=4, nvlink_GBps=400.0, net_GBps=50.0, step_latency_s=0.0)
    # without relays rank 0 sends w and b to ranks 4 and 6 over the network: 528 B through its NIC
    assert predict_seconds(plan_phase_pair_bytes(near), no_latency).seconds == pytest.approx(528 / (50 * GB))
    # with relays 264 B, then the relay phase: rank 4 sends 240 B over NVLink
    with_relay = predict_seconds(plan_phase_pair_bytes(fan), no_latency)
    assert with_relay.seconds == pytest.approx(264 / (50 * GB) + 240 / (400 * GB))
    assert (with_relay.steps, with_relay.net_bytes, with_relay.nvlink_bytes) == (2, 528, 1056)
    assert with_relay.net_bytes == fan.stats(4).net_bytes and with_relay.nvlink_bytes == fan.stats(4).nvlink_bytes
    # the price of the second phase: one more step's latency, which these tiny tensors do not repay
    assert predict_seconds(plan_phase_pair_bytes(fan), TOPO).seconds > predict_seconds(plan_phase_pair_bytes(near), TOPO).seconds


def test_relay_schedule_is_predicted_step_by_step():
    _near, fan = _relay_plans()
    sched = fan.schedule(256)  # 128 B per rank and direction: several steps per phase
    steps = schedule_pair_bytes(sched)
    relay_steps = [st for st, step in zip(steps, sched.steps, strict=True) if step.phase == 1]
    assert relay_steps and all(TOPO.same_node(s, d) for st in relay_steps for s, d in st)
    assert [step.phase for step in sched.steps] == sorted(step.phase for step in sched.steps)
    total: dict = {}
    for st in steps:
        for k, n in st.items():
            total[k] = total.get(k, 0) + n
    assert total == plan_pair_bytes(fan)
    no_latency = Topology(gpus_per_node=4, nvlink_GBps=400.0, net_GBps=50.0, step_latency_s=0.0)
    assert predict_seconds(steps, no_latency).seconds >= predict_seconds(plan_phase_pair_bytes(fan), no_latency).seconds


def test_plan_stats_split_network_and_nvlink():
    near, fan = _relay_plans()
    a, b = near.stats(4), fan.stats(4)
    assert (a.net_bytes, a.nvlink_bytes, a.relay_bytes, a.num_relays) == (1056, 528, 0, 0)
    assert (b.net_bytes, b.nvlink_bytes, b.relay_bytes, b.num_relays) == (528, 1056, 528, 4)
    assert fan.stats().net_bytes is None and fan.stats().relay_bytes == 528  # no node size: no split
    assert fan.stats(1).net_bytes == fan.stats().wire_bytes  # every rank its own node
    d = b.as_dict()
    assert (d["net_bytes"], d["nvlink_bytes"], d["gpus_per_node"], d["num_relays"]) == (528, 1056, 4, 4)


def test_cli_plan_reports_with_and_without_relay(tmp_path, capsys):
    """``triton-reshard plan`` on a small MoE: Megatron TP2 x PP2 x DP2 EP2 on ranks 0-7 -> vLLM TP2 x DP4 on
    ranks 8-15, nodes of 4: the replicas of each TP shard in a node share one network receive."""
    import json

    from triton_reshard.tools.cli import main

    common = ["plan", "--model", "small_qwen3_moe", "--src", "tp=2,pp=2,dp=2,ep=2,etp=1", "--dst", "tp=2,dp=4",
              "--dst-offset", "8", "--preset", "h100", "--gpus-per-node", "4", "--bucket-mb", "1"]
    assert main(common + ["--topology-aware", "--json", str(tmp_path / "relay.json")]) == 0
    out = capsys.readouterr().out
    assert "(topology-aware, relay)" in out and "without relay:" in out and "relays:" in out
    r = json.loads((tmp_path / "relay.json").read_text())
    w = r["without_relay"]
    assert r["relay"] and r["num_relays"] > 0 and r["relay_steps"] > 0
    assert r["wire_bytes"] == r["lower_bound_bytes"]
    assert r["net_bytes"] + r["nvlink_bytes"] == r["wire_bytes"] == w["net_bytes"] + w["nvlink_bytes"]
    assert r["net_bytes"] < w["net_bytes"] and w["num_relays"] == 0
    assert main(common + ["--no-relay", "--topology-aware", "--json", str(tmp_path / "near.json")]) == 0
    n = json.loads((tmp_path / "near.json").read_text())
    assert not n["relay"] and n["without_relay"] is None and n["num_relays"] == 0
    assert n["plan_digest"] == w["plan_digest"] and n["net_bytes"] == w["net_bytes"]
    assert "without relay:" not in capsys.readouterr().out


def test_cli_plan_uneven_pipeline_and_clear_errors(capsys):
    """4 layers over pp=3 need --src-layers-per-stage; an impossible expert split is an error message with exit
    code 2, not a traceback; with the stages given, the plan reaches the lower bound."""
    from triton_reshard.tools.cli import main

    base = ["plan", "--model", "tiny_deepseek_v3", "--dst", "tp=2,dp=2", "--preset", "h100", "--bucket-mb", "1"]
    assert main(base + ["--src", "tp=2,pp=3"]) == 2
    err = capsys.readouterr().err
    assert "do not split evenly over pp=3" in err and "--src-layers-per-stage" in err
    assert main(base + ["--src", "tp=1,pp=2,ep=4,etp=1"]) == 2
    assert "does not divide" in capsys.readouterr().err
    assert main(base + ["--src", "tp=2,pp=3", "--src-layers-per-stage", "2,x,1"]) == 2
    assert "comma-separated whole numbers" in capsys.readouterr().err
    assert main(base + ["--src", "tp=2,pp=3", "--src-layers-per-stage", "2,1,1"]) == 0
    assert "= 1.000 x the lower bound" in capsys.readouterr().out


def test_cli_plan_instances_spread_the_trainer_sends(tmp_path, capsys):
    """'plan --instances 3': three copies of vLLM TP2 after an 8-rank trainer; the trainer's busiest send drops
    ~3x against the plan without relays (reported beside it), wire bytes the lower bound either way."""
    import json

    from triton_reshard.tools.cli import main

    args = ["plan", "--model", "small_qwen3_moe", "--src", "tp=2,pp=2,dp=2,ep=2,etp=1", "--dst", "tp=2,ep=2",
            "--instances", "3", "--dst-offset", "8", "--preset", "h100", "--bucket-mb", "1"]
    assert main(args + ["--json", str(tmp_path / "inst.json")]) == 0
    out = capsys.readouterr().out
    assert "x 3 instances on ranks 8..13" in out and "trainer send:" in out and "without relay:" in out
    r = json.loads((tmp_path / "inst.json").read_text())
    w = r["without_relay"]
    assert r["relay"] and r["dst"]["instances"] == 3 and r["dst"]["ranks"] == 6 and r["num_relays"] > 0
    assert r["wire_bytes"] == r["lower_bound_bytes"]
    assert w["trainer_sent_bytes"]["total"] == 3 * r["trainer_sent_bytes"]["total"]
    assert w["trainer_sent_bytes"]["max"] >= 2.5 * r["trainer_sent_bytes"]["max"]
    assert main(args + ["--no-relay"]) == 0
    assert "without relay:" not in capsys.readouterr().out
    assert main(args[:-6] + ["--instances", "0"]) == 2
    assert "--instances 0" in capsys.readouterr().err


def test_shared_nic_adds_up_the_ranks_of_a_node():
    """One link per node (testing.cluster's nodes): two ranks of node 0 sending 1 GB each to node 1 take 2 s
    at 1 GB/s, not 1 s as with a NIC per GPU; NVLink (inside a node) stays per rank."""
    step = {(0, 2): 10**9, (1, 3): 10**9, (2, 3): 10**9}
    per_gpu = Topology(gpus_per_node=2, nvlink_GBps=10.0, net_GBps=1.0, step_latency_s=0.0)
    shared = Topology(gpus_per_node=2, nvlink_GBps=10.0, net_GBps=1.0, step_latency_s=0.0, shared_nic=True)
    assert predict_seconds([step], per_gpu).seconds == pytest.approx(1.0)
    p = predict_seconds([step], shared)
    assert p.seconds == pytest.approx(2.0) and p.busiest_port == "net" and p.net_bytes == 2 * 10**9
    assert predict_seconds([{(2, 3): 10**9}], shared).seconds == pytest.approx(0.1)


def test_refit_latency_is_paid_once():
    topo = Topology(gpus_per_node=2, nvlink_GBps=10.0, net_GBps=1.0, step_latency_s=0.001, refit_latency_s=0.01,
                    shared_nic=True)
    steps = [{(0, 2): 10**9}, {(2, 3): 10**9}]
    assert predict_seconds(steps, topo).seconds == pytest.approx(0.01 + 1.0 + 0.001 + 0.1 + 0.001)
    with pytest.raises(ValueError, match="refit_latency_s=-1"):
        Topology(refit_latency_s=-1)


def _cluster_layouts(nodes: int):
    """The emulated cluster's layouts (perf/bench_cluster.py): small_llama, Megatron TP2 over the first
    nodes // 2 nodes (PP = that many), one vLLM TP2 engine on each other node."""
    from triton_reshard.presets import get_config, megatron_layout, vllm_layout

    cfg = get_config("small_llama")
    tn = nodes // 2
    src = megatron_layout(cfg, tp=2, pp=tn, ranks=range(2 * tn), dtype=torch.bfloat16)
    dst = vllm_layout(cfg, tp=2, ranks=range(2 * tn, 2 * tn + 2), dtype=torch.bfloat16)
    return src, dst, nodes - tn


@pytest.mark.parametrize("nodes,want", [(3, True), (4, False)])
def test_choose_relay_by_the_time_model(nodes, want):
    """One trainer node feeding two engine nodes: relays halve the trainer link's bytes, chosen. Two trainer
    nodes feeding two engine nodes: each engine node's link carries the whole model either way, so a relay
    phase only adds a round: not chosen (measured slower on the emulated cluster, issue 32)."""
    from triton_reshard.tools.topology import choose_relay

    src, dst, inst = _cluster_layouts(nodes)
    topo = Topology(gpus_per_node=2, nvlink_GBps=1.0, net_GBps=0.125, step_latency_s=1e-3, shared_nic=True)
    c = choose_relay(src, dst, topo, instances=inst)
    assert c.relay is want, c
    assert (c.with_relay_s < 0.95 * c.without_relay_s) is want
    with pytest.raises(ValueError, match="margin"):
        choose_relay(src, dst, topo, instances=inst, margin=1.5)


def test_host_term_is_off_by_default_and_adds_per_step():
    """CPU refits (``host_GBps``): each rank's bytes sent plus received over the host rate, after the wire in the
    same step; with ``host_cores`` all ranks' bytes share those cores. Off (None), every prediction is the
    wire's alone, bit for bit."""
    steps = [{(0, 2): 10**9, (1, 3): 10**9, (0, 1): 5 * 10**8}, {(2, 3): 10**9}]
    wire = Topology(gpus_per_node=2, nvlink_GBps=10.0, net_GBps=1.0, step_latency_s=0.001, shared_nic=True)
    base = predict_seconds(steps, wire)
    assert base.seconds == pytest.approx(2.0 + 0.001 + 0.1 + 0.001)
    assert Topology().host_GBps is None and Topology().host_cores is None
    # step 0: ranks 0 and 1 each send plus receive 1.5 GB (the busiest hosts), step 1: ranks 2 and 3 1 GB;
    # at 4 GB/s per rank
    per_rank = predict_seconds(steps, Topology(**{**_fields(wire), "host_GBps": 4.0}))
    assert per_rank.seconds == pytest.approx(base.seconds + 1.5 / 4 + 1.0 / 4)
    # two cores shared by every rank: step 0 moves 2.5 GB, each counted at both ends (5 GB) over 2 x 4 GB/s,
    # more than its busiest rank alone; step 1 (2 GB over 8 GB/s) stays at its busiest rank's 1 GB over 4
    shared = predict_seconds(steps, Topology(**{**_fields(wire), "host_GBps": 4.0, "host_cores": 2}))
    assert shared.seconds == pytest.approx(base.seconds + 5 / 8 + 1.0 / 4)
    # ports, bytes and the busiest rank are the wire's whatever the host term adds
    assert (shared.busiest_rank, shared.busiest_port, shared.net_bytes, shared.nvlink_bytes) == (
        base.busiest_rank, base.busiest_port, base.net_bytes, base.nvlink_bytes)
    # local copies (src == dst) use no host time here, as they use no port
    assert predict_seconds([{(0, 0): 10**9}], Topology(host_GBps=1.0)).seconds == pytest.approx(
        Topology().step_latency_s)


def _fields(topo: Topology) -> dict:
    import dataclasses

    return {f.name: getattr(topo, f.name) for f in dataclasses.fields(topo)}


@pytest.mark.parametrize("kwargs,match", [
    pytest.param({"host_GBps": 0.0}, "host_GBps=0.0", id="zero-host"),
    pytest.param({"host_GBps": float("inf")}, "host_GBps=inf", id="inf-host"),
    pytest.param({"host_GBps": "fast"}, "host_GBps='fast'", id="str-host"),
    pytest.param({"host_GBps": 1.0, "host_cores": 0}, "host_cores=0", id="no-cores"),
    pytest.param({"host_GBps": 1.0, "host_cores": 2.0}, "host_cores=2.0", id="float-cores"),
    pytest.param({"host_GBps": 1.0, "host_cores": True}, "host_cores=True", id="bool-cores"),
    pytest.param({"host_cores": 2}, "needs host_GBps", id="cores-without-rate"),
])
def test_bad_host_term(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_host_term_leaves_the_relay_choice_and_presets_alone():
    """The defaults keep every existing prediction: the presets and choose_relay's figures are unchanged with
    the host fields spelled out as None."""
    from triton_reshard.tools.topology import choose_relay

    src, dst, inst = _cluster_layouts(3)
    topo = Topology(gpus_per_node=2, nvlink_GBps=1.0, net_GBps=0.125, step_latency_s=1e-3, shared_nic=True)
    spelled = Topology(**{**_fields(topo), "host_GBps": None, "host_cores": None})
    assert spelled == topo and choose_relay(src, dst, spelled, instances=inst) == choose_relay(src, dst, topo,
                                                                                               instances=inst)
