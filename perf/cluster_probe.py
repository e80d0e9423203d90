"""The calibration of ``perf/bench_cluster.py``'s time model (split from it to keep files short): the probes
each rank runs (the link one stream and as a refit uses it, the round trip, a 64-byte and a 16 MiB refit, the
last two also in turn with ``ours``) and what the parent makes of them (the fixed cost, the link rate, the host
rate of ``tools.topology.Topology.host_GBps``). Imported by ``bench_cluster`` (and by its ranks, ``perf`` on
the path).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import bench_call  # the round trip of a small message (its _rtt)
import cluster_common as cc  # the shared helpers (not bench_cluster itself: no import circle)
import torch


def probe(rank: int, rpn: int, nodes: int) -> dict:
    """Loopback (rank 0 -> 1, same node) and one-stream link (rank 0 -> rpn, next node) bandwidth, 32 MiB each;
    the link as a refit uses it (:func:`link_all`); the round trip of a small message."""
    import torch.distributed as dist

    out = {}
    buf = torch.zeros(8 << 20)
    for name, peer in (("loopback", 1), ("link_one_stream", rpn)):
        if peer >= dist.get_world_size() or (name == "loopback" and rpn < 2):
            continue
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, peer)
            dist.recv(buf[:1], peer)
        elif rank == peer:
            dist.recv(buf, 0)
            dist.send(buf[:1], 0)
        out[name] = buf.numel() * 4 / (time.perf_counter() - t0)
        dist.barrier()
    out.update(link_all(rank, rpn, nodes))
    out["rtt_s"] = bench_call._rtt(rank, rpn, 20)  # round trip of a small message over the link (rank 0's)
    return out


def link_all(rank: int, rpn: int, nodes: int, per_node: int = 32 << 20, repeats: int = 3) -> dict:
    """The link as a refit uses it: every trainer rank (the first ``nodes // 2`` nodes) sends to every engine
    rank at once (``batch_isend_irecv``: rpn x rpn streams per pair of nodes), ``per_node`` bytes into each
    engine node; after one warm-up round, the median of ``repeats`` rounds, each timed from the first rank
    entering it to the last leaving it. The rate: the busiest node's link bytes (either way) over that time."""
    import torch.distributed as dist

    trainers = range(rpn * (nodes // 2))
    engines = range(len(trainers), rpn * nodes)
    chunk = per_node // (rpn * len(trainers)) // 4  # float32 elements per (trainer, engine) pair
    peers = engines if rank in trainers else trainers if rank in engines else ()
    bufs = {p: torch.zeros(chunk) for p in peers}
    times, cpus = [], []
    for i in range(repeats + 1):
        dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        op = dist.isend if rank in trainers else dist.irecv
        reqs = dist.batch_isend_irecv([dist.P2POp(op, b, p) for p, b in bufs.items()]) if bufs else []
        for r in reqs:
            r.wait()
        t1, c1 = time.perf_counter(), time.process_time()
        marks = torch.tensor([-t0, t1], dtype=torch.float64)
        dist.all_reduce(marks, op=dist.ReduceOp.MAX)
        cpu = torch.tensor([c1 - c0], dtype=torch.float64)
        dist.all_reduce(cpu)  # every rank's CPU seconds of the round, summed
        if i:
            times.append(float(marks[0] + marks[1]))
            cpus.append(float(cpu[0]))
    tx = chunk * 4 * rpn * len(engines) // max(1, nodes // 2)  # a trainer node's bytes out
    busiest = max(tx, chunk * 4 * rpn * len(trainers))  # an engine node's bytes in: per_node (rounded down)
    moved = chunk * 4 * len(trainers) * len(engines)  # all links' payload
    return {"link": busiest / statistics.median(times), "link_rounds_s": times, "link_busiest_bytes": busiest,
            "link_cpu_s_per_byte": statistics.median(cpus) / moved}


def probe_layouts(senders: list[int], receivers: list[int], rows: int, cols: int):
    """One bf16 tensor of ``rows x cols`` (rounded down to whole shards), ``Shard(0)`` over ``senders`` to
    ``Shard(1)`` over ``receivers``: every sender sends to every receiver, nothing stays on a rank."""
    from triton_reshard import Layout, Shard

    shape = (rows // len(senders) * len(senders), cols // len(receivers) * len(receivers))
    return (Layout.from_placements({"t": shape}, senders, [Shard(0)], torch.bfloat16),
            Layout.from_placements({"t": shape}, receivers, [Shard(1)], torch.bfloat16))


def probe_refit(rank: int, src, dst, timeout: float):
    """A refit of one probe tensor (:func:`probe_layouts`), warmed: the call to time."""
    from triton_reshard import refit

    s = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in src.allocate(rank).items()} if rank in src.ranks else {}
    d = dst.allocate(rank) if rank in dst.ranks else {}
    refit(s, d, src, dst, timeout=timeout)
    return lambda: refit(s, d, src, dst, timeout=timeout)


def tiny(rank: int, world: int, rpn: int, timeout: float):
    """A refit that moves 64 bytes from node 0 to node 1 (every rank in the group): its time is the fixed cost
    of one refit (handshake, a round of messages, the barriers around it)."""
    src, dst = probe_layouts(list(range(rpn)), list(range(rpn, 2 * rpn)), 2 * rpn, 16)
    return probe_refit(rank, src, dst, timeout)


def rotation(fns: dict, order: list[str], repeats: int) -> dict:
    """``repeats`` rounds of the calls ``order`` names (each between barriers, :func:`bench_cluster._timed`), in that order
    every round: per name, the marks of all its calls, so that each name's median comes from the same
    stretch of time (on a loaded machine the probes and the refit they predict see the same load)."""
    out = {k: {"seconds": [], "enter": [], "leave": [], "cpu": [], "link": None} for k in fns}
    for _ in range(repeats):
        for k in order:
            one = cc.timed(fns[k], 1)
            for f in ("seconds", "enter", "leave", "cpu"):
                out[k][f] += one[f]
            out[k]["link"] = one["link"]
    return out


def bulk_layouts(nodes: int, rpn: int):
    """The 16 MiB refit of :func:`bulk`: every trainer rank (the first ``nodes // 2`` nodes) to every engine rank,
    as the link probe (:func:`link_all`) sends."""
    t = rpn * (nodes // 2)
    return probe_layouts(list(range(t)), list(range(t, rpn * nodes)), 4096, 2048)


def bulk(rank: int, world: int, nodes: int, rpn: int, timeout: float):
    """A refit of 16 MiB over the links as :func:`link_all` uses them: its time beyond the 64-byte refit's and
    beyond the wire's (at the probed rate) is the host's part (``Topology.host_GBps``: :func:`host_probe`)."""
    src, dst = bulk_layouts(nodes, rpn)
    return probe_refit(rank, src, dst, timeout)


def host_probe(results: list, nodes: int, rpn: int, link_Bps: float, loopback_Bps: float) -> dict:
    """:func:`host_probe_of` the setting's own 64-byte and 16 MiB refits (``results``: every rank's)."""
    return host_probe_of([x["tiny"] for x in results], [x["bulk"] for x in results], nodes, rpn, link_Bps,
                          loopback_Bps)


def host_probe_of(tiny: list, bulk: list, nodes: int, rpn: int, link_Bps: float, loopback_Bps: float) -> dict:
    """From every rank's 64-byte and 16 MiB refits (:func:`tiny`, :func:`bulk`): the fixed cost of a refit
    (median span of the 64-byte ones) and the host rate of a CPU refit (``Topology.host_GBps``): the 16 MiB
    refit's median span beyond the 64-byte refit's and beyond its wire time (``predict_seconds`` of its plan,
    host term off) is its host time; the rate is what gives the model that host time for that plan, with
    ``host_cores`` this machine's cores (every emulated node runs on them). None (no host term) where nothing
    is left beyond the wire. The wire's rate: the link probe's, or where that read lower, what the 16 MiB refit
    itself shows the links carried (``link_calibrated``). CPU seconds (all ranks) of both, for the record."""
    from triton_reshard import plan_reshard
    from triton_reshard.tools.topology import (
        Topology,
        node_link_bytes,
        plan_phase_pair_bytes,
        predict_seconds,
    )

    cores = len(os.sched_getaffinity(0))
    src, dst = bulk_layouts(nodes, rpn)
    phases = plan_phase_pair_bytes(plan_reshard(src, dst, False, rpn, False))
    tiny_s, bulk_s = cc.median_span(tiny), cc.median_span(bulk)
    # the links carried the busiest node's bytes within the 16 MiB refit's time beyond the fixed cost: a lower
    # bound of their rate, for a link probe that read lower (rounds of raw sends starved of the shared cores)
    busiest = max(x for tx_rx in node_link_bytes(phases[0], rpn, nodes) for x in tx_rx)
    link = max(link_Bps, busiest / max(bulk_s - tiny_s, 1e-9))
    wire = Topology(gpus_per_node=rpn, nvlink_GBps=loopback_Bps / 1e9, net_GBps=link / 1e9, step_latency_s=0.0,
                    shared_nic=True)
    wire_s = predict_seconds(phases, wire).seconds
    unit = predict_seconds(phases, dataclasses.replace(wire, host_GBps=1.0, host_cores=cores)).seconds - wire_s
    host_s = bulk_s - tiny_s - wire_s
    return {"refit_step_s": tiny_s, "refit_step_cpu_s": cc.median_cpu(tiny), "bulk_s": bulk_s,
            "bulk_cpu_s": cc.median_cpu(bulk), "bulk_bytes": sum(sum(p.values()) for p in phases),
            "link_calibrated": link, "bulk_wire_s": wire_s, "bulk_host_s": host_s,
            "host_Bps": unit / host_s * 1e9 if host_s > 1e-9 else None, "host_cores": cores}


def model_calib(calib: dict, probe: dict, results: list, model: str, nodes: int, rpn: int) -> dict:
    """The calibration for one model: the setting's, with the fixed cost, link rate and host rate from the
    probe refits that ran in turn with ``ours`` of this model (:func:`rotation`), where it ran."""
    per = [x["models"][model].get("probe_refits") for x in results]
    if not all(per):
        return calib
    got = host_probe_of([p["tiny"] for p in per], [p["bulk"] for p in per], nodes, rpn, probe.get("link", calib["link_Bps"]),
                         probe.get("loopback", 5e9))
    return {**calib, "link_Bps": got["link_calibrated"], "step_s": got["refit_step_s"], "host_Bps": got["host_Bps"],
            "in_turn": got}
