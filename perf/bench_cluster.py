"""Refit across an emulated cluster (``triton_reshard.testing.cluster``): nodes as network namespaces behind
``tbf``-shaped links, ranks inside them talking gloo over the node's link (between nodes) or loopback (inside).

Settings (each a fresh cluster; every ratio below comes from one run of one cluster):

* 2 nodes (trainer node 0 -> engine node 1), 3 nodes (trainer node 0 -> two engine instances on nodes 1 and
  2) and 4 nodes (trainer nodes 0-1 -> two engine instances on nodes 2 and 3), ``--ranks-per-node`` ranks each
  (default 2), links of ``--rates`` (default 1 and 10 Gbit/s).
  ``--latencies``: one-way delay added per link: netem where the kernel has it, else the userspace link
  emulator (``triton_reshard.testing.netdelay``: TAPs and a C forwarder; needs gcc and /dev/net/tun).
* models: the presets' ``small_llama`` (Megatron TP -> vLLM TP) and ``small_qwen3_moe`` (Megatron TPxEP ->
  vLLM TP with expert parallelism), bf16; 4 nodes add PP2 on the trainer.
* ``calibrated``: the time model fed with what the same cluster measured: the rate gloo reached over the links
  as a refit uses them (every trainer rank sending to every engine rank at once, 32 MiB into each engine node,
  median of 3 after a warm-up; until session 41 one 32 MiB stream, which behind a 1 ms link reached half of
  what a refit's concurrent streams do), the round trip of a small message as each step's latency, the time
  of a refit that moves 64 bytes (median of 15), less that round trip, as the fixed cost of a refit
  (``Topology.refit_latency_s``), and the host term of a CPU refit (``Topology.host_GBps``: the time of a
  16 MiB refit over the same links beyond the 64-byte refit's and beyond its wire time at the probed rate;
  ``host_cores``: this machine's cores, which every emulated node shares), for the plan ``ours`` ran (its
  relay choice). Per model the 64-byte and 16 MiB refits also run in turn with ``ours`` (a round: 64 bytes,
  16 MiB, ours, 64 bytes; ``perf/cluster_probe.py``), and the model is predicted from those (on a loaded
  machine the probes at a setting's start and the refit they predict see different load).

Methods, each called between barriers and timed from the first rank entering the call to the last rank leaving
it (every rank's marks on the host's monotonic clock, which the emulated nodes share; the barrier after a call
is not timed; median of ``--repeats``; until session 39 the slowest rank's time to the end of that barrier),
with the CPU seconds of all ranks together, each into poisoned destinations checked bit for bit once, each with
the bytes every node's interface counted:

* ``ours``: ``refit`` with ``gpus_per_node`` = ranks per node (topology-aware routing), relays (which spread
  the trainer's sends over two engine instances, or fan a replicated piece out inside one engine's node) only
  when the time model predicts them faster (``tools.topology.choose_relay`` with the nominal link rate, 1 ms
  per round, one link per node);
  ``ours-relay``: relays forced on; ``ours-no-topology``: neither (3 and 4 nodes: every byte from the
  trainer over its links, once per engine);
* ``allgather``: all-gather to full size on every rank, then slice (``tools.baselines.allgather_refit``);
* ``gather-bcast``: gather every tensor on trainer rank 0, broadcast it to every engine rank, slice
  (``tools.baselines.gather_broadcast_refit``: what SGLang's ``update_weights_from_distributed``, TRL and
  OpenRLHF do);
* ``link-limit``: the bytes the busiest node must receive from other nodes (each destination element once per
  node) over the link rate;
* ``delta`` (``--delta-model``: a Llama or Qwen3-MoE preset, e.g. small_llama, small_qwen3_moe, llama_demo): real
  AdamW diffs (``perf/cluster_versions.py``): the HF model of the preset's config trained as in
  ``perf/bench_delta.py`` (a Markov next-token task), its parameters mapped onto the preset's global tensors
  (the MoE's fused experts split per expert), then chains of ``--repeats`` optimizer steps at a learning
  rate calibrated (bisection) so one step changes ``--fractions`` of the bf16 elements; per step a dense
  refit, a delta refit and a delta refit that knows the cluster (``DeltaRequest(topology=...)``: dense when
  the cost model predicts that faster) of the same change on the same ranks (three Resharders, relays as
  ``ours`` chose), each checked bit for bit; each Resharder's chain of versions runs on its own;
* ``predicted``: the planner's time model (``tools.topology.predict_seconds``) for ``ours``, with the node's one
  link shared by its ranks (``shared_nic=True``, what the emulation is) and, to show what that fixes, with a
  NIC per rank; loopback bandwidth (inside a node) measured in the same run.

    python perf/bench_cluster.py --out perf/results/bench_cluster.json --plot perf/results/bench_cluster.png
    python perf/bench_cluster.py --smoke        # CI: 2 nodes, 1 Gbit/s, small_llama, one repeat (~1 min)

Needs root and iproute2 (``triton_reshard.testing.cluster.available()`` says why not, in one line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import cluster_common as cc  # layouts, timed calls, spans, exactness (shared with the parts)
import cluster_delta as cd  # the delta part
import cluster_probe as cp  # the time model's calibration: the probes and what they give
import cluster_versions as cv  # the versions of the delta refits: real AdamW steps of the preset's HF model
import torch

ROOT = Path(__file__).resolve().parents[1]
FRACTIONS = (0.005, 0.01, 0.02, 0.05)


# ---------------------------------------------------------------------------------------------------------
# layouts (the parent and every rank build the same ones)


def globals_for(model: str, src) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {s.name: (torch.randn(s.shape, generator=g) * 0.02).to(s.dtype) for s in src.tensors}


def framing(mtu: int) -> float:
    """Bytes the shaped link carries per byte of TCP payload at ``mtu``: every frame of ``mtu - 52`` payload
    bytes (20 of IP, 32 of TCP with Linux's default timestamps option) is ``mtu + 14`` bytes to ``tbf`` (which
    counts the Ethernet header): 1.046 at 1500, 1.0074 at 9000."""
    return (mtu + 14) / (mtu - 52)


def link_limit_bytes(dst_full, rpn: int) -> int:
    """The most bytes one node must receive from other nodes: every destination element its ranks hold, once
    per node (the source ranks are on other nodes)."""
    per_node: dict[int, int] = {}
    for spec in dst_full.tensors:
        masks: dict[int, torch.Tensor] = {}
        for f in dst_full.fragments_by_tensor.get(spec.name, ()):
            if not f.numel:
                continue
            m = masks.setdefault(f.rank // rpn, torch.zeros(spec.shape, dtype=torch.bool))
            m[tuple(slice(o, o + n) for o, n in zip(f.offsets, f.sizes, strict=True))] = True
        for node, m in masks.items():
            per_node[node] = per_node.get(node, 0) + int(m.sum()) * spec.dtype.itemsize
    return max(per_node.values())


# ---------------------------------------------------------------------------------------------------------
# rank side


def bench_rank(rank: int, world: int, spec: dict) -> dict:
    import torch.distributed as dist

    from triton_reshard import refit
    from triton_reshard.tools.baselines import allgather_refit, gather_broadcast_refit
    from triton_reshard.tools.topology import Topology, choose_relay

    nodes, rpn, reps, timeout = spec["nodes"], spec["rpn"], spec["repeats"], spec["timeout"]
    probes = {"tiny": cp.tiny(rank, world, rpn, timeout), "bulk": cp.bulk(rank, world, nodes, rpn, timeout)}
    out: dict = {"rank": rank, "probe": cp.probe(rank, rpn, nodes), "models": {},
                 "tiny": cc.timed(probes["tiny"], 15), "bulk": cc.timed(probes["bulk"], 5)}
    for model in spec["models"]:
        src, dst, inst = cc.layouts(model, nodes, rpn)
        full_dst = dst.instances(inst) if inst > 1 else dst
        pub = globals_for(model, src)
        src_t = src.shard(pub, rank) if rank in src.ranks else {}
        res: dict = {}
        methods = {"ours": dict(gpus_per_node=rpn, instances=inst)}
        # ours: relay or not as the time model predicts faster (tools.topology.choose_relay); with one engine
        # a relay fans a replicated piece out inside the engine node: a second phase that waits for the
        # slowest engine rank's first, to save a few KB of link (the norms of small_llama)
        topo = Topology(gpus_per_node=rpn, nvlink_GBps=1.0, net_GBps=spec["rate_bps"] / 8e9,
                        step_latency_s=1e-3, shared_nic=True)
        choice = choose_relay(src, dst, topo, instances=inst)
        res["relay_choice"] = {"relay": choice.relay, "with_relay_s": choice.with_relay_s,
                               "without_relay_s": choice.without_relay_s}
        methods["ours"]["relay"] = choice.relay
        if inst > 1:
            methods["ours-relay"] = dict(gpus_per_node=rpn, relay=True, instances=inst)
            methods["ours-no-topology"] = dict(gpus_per_node=None, relay=False, instances=inst)
        only = spec.get("methods")  # --methods: the methods to time (None: all)
        methods = {k: v for k, v in methods.items() if only is None or k in only}
        for name, kw in methods.items():
            d = cc.poison(full_dst.allocate(rank)) if rank in full_dst.ranks else {}
            refit(src_t, d, src, dst, timeout=timeout, **kw)  # warm: plan, buffers, connections
            ok = cc.exact(full_dst, rank, d, pub)
            def fn(d=d, kw=kw, s=src_t, a=src, b=dst):
                return refit(s, d, a, b, timeout=timeout, **kw)

            if name == "ours":  # with the calibration's refits in turn: the fixed cost twice, the 16 MiB once
                rot = cp.rotation({**probes, name: fn}, ["tiny", "bulk", name, "tiny"], reps)
                res["probe_refits"] = {"tiny": rot["tiny"], "bulk": rot["bulk"]}
                res[name] = {**rot[name], "exact": ok}
            else:
                res[name] = {**cc.timed(fn, reps), "exact": ok}
        for name, fn in (("allgather", allgather_refit), ("gather-bcast", gather_broadcast_refit)):
            if only is not None and name not in only:
                continue
            d = cc.poison(full_dst.allocate(rank)) if rank in full_dst.ranks else {}
            fn(src_t, d, src, full_dst, timeout=timeout)
            ok = cc.exact(full_dst, rank, d, pub)
            res[name] = {**cc.timed(lambda d=d, fn=fn, s=src_t, a=src, b=full_dst: fn(s, d, a, b, timeout=timeout),
                                  max(1, reps // 2)), "exact": ok}
        if spec.get("delta") and model == spec["delta"]["model"]:
            res["delta"] = cd._delta_rank(rank, spec, src, dst, full_dst, inst, rpn, timeout, choice.relay)
        out["models"][model] = res
        dist.barrier()
    return out


# ---------------------------------------------------------------------------------------------------------
# parent


def predicted(model: str, nodes: int, rpn: int, rate_bps: float, loopback_Bps: float, latency_s: float,
              calib: dict | None = None, relay: bool | None = None) -> dict:
    """The time model for ``ours``: the plan it ran (``relay``: the time model's choice it ran with; None, the
    planner's default, as until session 41, which predicted a relay phase where ``ours`` had none), nominal
    and, with ``calib`` (what the cluster's probes measured), calibrated."""
    from triton_reshard import plan_reshard
    from triton_reshard.tools.topology import Topology, plan_phase_pair_bytes, predict_seconds

    src, dst, inst = cc.layouts(model, nodes, rpn)
    groups = dst.instance_groups(inst) if inst > 1 else None
    full = dst.instances(inst) if inst > 1 else dst
    plan = plan_reshard(src, full, False, rpn, relay, groups)
    out = {}
    for name, shared in (("shared_link", True), ("nic_per_rank", False)):
        topo = Topology(gpus_per_node=rpn, nvlink_GBps=loopback_Bps / 1e9, net_GBps=rate_bps / 8 / 1e9,
                        step_latency_s=latency_s, shared_nic=shared)
        out[name] = predict_seconds(plan_phase_pair_bytes(plan), topo).seconds
    if calib:  # the link rate gloo reached and the measured cost of a refit step, from the same cluster
        topo = Topology(gpus_per_node=rpn, nvlink_GBps=loopback_Bps / 1e9, net_GBps=calib["link_Bps"] / 1e9,
                        step_latency_s=calib["rtt_s"], refit_latency_s=max(0.0, calib["step_s"] - calib["rtt_s"]),
                        shared_nic=True)
        # without the host term: with the concurrent link probe, and with the one-stream one (main until session 41)
        out["calibrated_wire"] = predict_seconds(plan_phase_pair_bytes(plan), topo).seconds
        one = dataclasses.replace(topo, net_GBps=calib.get("link_one_stream_Bps", calib["link_Bps"]) / 1e9)
        out["calibrated_one_stream"] = predict_seconds(plan_phase_pair_bytes(plan), one).seconds
        if calib["host_Bps"]:
            topo = dataclasses.replace(topo, host_GBps=calib["host_Bps"] / 1e9, host_cores=calib["host_cores"])
        out["calibrated"] = predict_seconds(plan_phase_pair_bytes(plan), topo).seconds
    if calib and "in_turn" in calib:
        out["calibration"] = calib["in_turn"]
    out["link_limit_bytes"] = link_limit_bytes(full, rpn)
    out["model_bytes"] = sum(math.prod(s.shape) * s.dtype.itemsize for s in src.tensors)
    return out


def summarize(setting: dict, results: list, preds: dict) -> dict:
    """Per model and method: the slowest rank's median seconds, per-node link bytes, exactness, ratios."""
    nodes, rpn = setting["nodes"], setting["rpn"]
    rate = setting["rate_bps"]
    out = {}
    for model in results[0]["models"]:
        per = [r["models"][model] for r in results]
        pr = preds[model]
        limit = pr["link_limit_bytes"] * 8 / rate
        row = {"link_limit_s": limit, "model_bytes": pr["model_bytes"], "link_limit_bytes": pr["link_limit_bytes"],
               "link_limit_framed_s": limit * framing(setting.get("mtu", 1500)),
               "predicted_s": pr["shared_link"], "predicted_nic_per_rank_s": pr["nic_per_rank"],
               "predicted_calibrated_s": pr.get("calibrated"),
               "predicted_calibrated_wire_s": pr.get("calibrated_wire"),
               "predicted_calibrated_one_stream_s": pr.get("calibrated_one_stream"),
               **({"calibration": pr["calibration"]} if "calibration" in pr else {}), "methods": {}}
        for m in per[0]:
            if m in ("delta", "relay_choice", "probe_refits"):
                continue
            secs, cpu = cc.median_span([p[m] for p in per]), cc.median_cpu([p[m] for p in per])
            row["methods"][m] = {
                "seconds": secs, "over_link_limit": secs / limit, "exact": all(p[m]["exact"] for p in per),
                "cpu_s": cpu,
                "node_tx": [per[n * rpn][m]["link"]["tx"] for n in range(nodes)],
                "node_rx": [per[n * rpn][m]["link"]["rx"] for n in range(nodes)]}
        if "delta" in per[0]:
            row["delta"] = cd.summarize_delta(per)
        if "relay_choice" in per[0]:
            row["relay_choice"] = per[0]["relay_choice"]
        out[model] = row
    return out


def print_setting(s: dict, summ: dict) -> None:
    print(f"== {s['nodes']} nodes x {s['rpn']} ranks, {s['rate_bps'] / 1e9:g} Gbit/s, latency "
          f"{s['latency_s'] * 1e6:g} us added ({s.get('emulator', 'veth')} links), MTU {s.get('mtu', 1500)} (link rtt {s['probe'].get('rtt_s', 0) * 1e6:.0f} us; link "
          f"{s['probe'].get('link', 0) * 8 / 1e9:.2f} Gbit/s, loopback {s['probe'].get('loopback', 0) / 1e9:.2f} GB/s, "
          f"a 64-byte refit {s['probe']['refit_step_s'] * 1e3:.1f} ms measured; one stream "
          f"{s['probe'].get('link_one_stream', 0) * 8 / 1e9:.2f} Gbit/s; a 16 MiB refit "
          f"{s['probe']['bulk_s'] * 1e3:.1f} ms, CPU {s['probe']['bulk_cpu_s'] * 1e3:.1f} ms (64 bytes: "
          f"{s['probe']['refit_step_cpu_s'] * 1e3:.1f}; its wire {s['probe']['bulk_wire_s'] * 1e3:.1f} ms): host "
          + (f"{s['probe']['host_Bps'] / 1e9:.2f} GB/s x {s['probe']['host_cores']} cores)" if s['probe']['host_Bps']
             else "term off: nothing beyond the wire)"), flush=True)
    for model, row in summ.items():
        print(f"  {model}: {row['model_bytes'] / 1e6:.1f} MB, link limit {row['link_limit_s'] * 1e3:.1f} ms "
              f"({row['link_limit_framed_s'] * 1e3:.1f} with TCP/IP framing), "
              f"predicted {row['predicted_s'] * 1e3:.1f} ms (NIC per rank: {row['predicted_nic_per_rank_s'] * 1e3:.1f}; "
              f"calibrated: {row['predicted_calibrated_s'] * 1e3:.1f}; without its host term "
              f"{row['predicted_calibrated_wire_s'] * 1e3:.1f}, and with the one-stream link "
              f"{row['predicted_calibrated_one_stream_s'] * 1e3:.1f})")
        if "relay_choice" in row:
            c = row["relay_choice"]
            print(f"    time model: relay {c['relay']} (predicted {c['with_relay_s'] * 1e3:.1f} ms with relays, "
                  f"{c['without_relay_s'] * 1e3:.1f} without)")
        for m, r in row["methods"].items():
            print(f"    {m:18s} {r['seconds'] * 1e3:8.1f} ms  {r['over_link_limit']:5.2f}x link limit  exact "
                  f"{r['exact']}  node tx {[round(x / 1e6, 2) for x in r['node_tx']]} MB  CPU "
                  f"{r.get('cpu_s', 0) * 1e3:.1f} ms (all ranks)")
        for f, d in row.get("delta", {}).get("by_fraction", {}).items():
            print(f"    delta {100 * float(f):4.1f} % (measured {100 * d['changed']:.2f} %): {d['delta_s'] * 1e3:.1f} ms vs "
                  f"dense {d['dense_s'] * 1e3:.1f} ms = {d['speedup']:.2f}x faster, bytes {d['bytes_ratio']:.3f} of "
                  f"dense, exact {d['exact']} {d['modes']}; CPU (all ranks) delta {d.get('delta_cpu_s', 0) * 1e3:.1f} "
                  f"ms, dense {d.get('dense_cpu_s', 0) * 1e3:.1f} ms", flush=True)
            if "auto_s" in d:
                print(f"          with the cost model: {d['auto_s'] * 1e3:.1f} ms = {d['auto_speedup']:.2f}x faster "
                      f"than dense {d['auto_modes']}", flush=True)


def _predict_all(results: list, probe: dict, nodes: int, args, rate_bps: float, lat: float) -> dict:
    """Per model, :func:`predicted` for the plan ``ours`` ran, calibrated by the setting's probes (into
    ``probe``: :func:`cluster_probe.host_probe`) and the model's probe refits in turn with it."""
    rpn = args.ranks_per_node
    probe.update(cp.host_probe(results, nodes, rpn, probe.get("link", rate_bps / 8), probe.get("loopback", 5e9)))
    calib = {"link_Bps": probe["link_calibrated"], "step_s": probe["refit_step_s"], "rtt_s": probe["rtt_s"],
             "host_Bps": probe["host_Bps"], "host_cores": probe["host_cores"],
             "link_one_stream_Bps": probe.get("link_one_stream", rate_bps / 8)}
    return {m: predicted(m, nodes, rpn, rate_bps, probe.get("loopback", 5e9), lat + 50e-6,
                         cp.model_calib(calib, probe, results, m, nodes, rpn),
                         results[0]["models"][m]["relay_choice"]["relay"]) for m in args.models}


def run(args) -> dict:
    from triton_reshard.testing.cluster import Cluster, available, capabilities, parse_rate, parse_seconds

    ok, why = available()
    if not ok:
        raise SystemExit(f"bench_cluster: {why}")
    lats = [parse_seconds(x) for x in args.latencies]
    if any(lats) and not capabilities()["netem"]:
        from triton_reshard.testing import netdelay

        emu, why = netdelay.available()
        if emu:  # Cluster picks it by itself for a link with a latency (emulator="auto")
            print("bench_cluster: no netem in this kernel: links with a latency run through the userspace link "
                  "emulator (testing.netdelay: TAPs and a C forwarder)", flush=True)
        else:
            print(f"bench_cluster: latencies {[x for x, v in zip(args.latencies, lats, strict=True) if v]} skipped: "
                  f"this kernel has no netem and {why}", flush=True)
            lats = [x for x in lats if not x] or [0.0]
    tmp = tempfile.mkdtemp(prefix="bench_cluster-")
    delta = None
    if args.delta_model:
        t0 = time.perf_counter()
        delta = cv.make_versions(args.delta_model, args.fractions, args.delta_repeats, args.warmup,
                              os.path.join(tmp, "versions.safetensors"))
        delta["model"] = args.delta_model
        delta["interleaved"] = args.delta_order == "interleaved"
        print(f"versions: {[(r['version'], round(100 * r['changed'], 2)) for r in delta['versions']]} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        for row in delta["versions"]:
            print("  " + cv.describe(row), flush=True)
    out = {"settings": [], "delta_versions": delta["versions"] if delta else None}
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'perf'}:{os.environ.get('PYTHONPATH', '')}"}
    for nodes in ([] if args.skip_settings else args.nodes):
        for rate in args.rates:
            for lat in lats:
                rate_bps = parse_rate(rate)
                spec = {"nodes": nodes, "rpn": args.ranks_per_node, "repeats": args.repeats, "rate_bps": rate_bps,
                        "timeout": args.timeout, "models": args.models, "delta": delta, "methods": args.methods}
                t0 = time.perf_counter()
                sysctls = ({} if args.tcp_slow_start_after_idle is None else
                           {"net.ipv4.tcp_slow_start_after_idle": args.tcp_slow_start_after_idle})
                with Cluster(nodes, args.ranks_per_node, rate=rate_bps, latency=lat, mtu=args.mtu,
                             emulator=args.emulator, sysctls=sysctls) as c:
                    fwd_cpu = c.forwarder.cpu_seconds() if c.forwarder else None
                    r = c.run("bench_cluster:bench_rank", spec, timeout=args.timeout * 6, pg_timeout=args.timeout,
                              env=env)
                    link = {"emulator": "tap" if c.forwarder else "veth", **({"sysctls": sysctls} if sysctls else {})}
                    if c.forwarder:  # the forwarder's CPU over the run, and per GB it carried (all nodes' uplinks)
                        carried = sum(b.tx for b in r.link_bytes)
                        link["forwarder_cpu_s"] = c.forwarder.cpu_seconds() - fwd_cpu
                        link["forwarder_cpu_s_per_GB"] = link["forwarder_cpu_s"] / max(carried / 1e9, 1e-9)
                probe = r.results[0]["probe"]
                probe.update({k: v for k, v in r.results[1]["probe"].items() if k not in probe})
                setting = {"nodes": nodes, "rpn": args.ranks_per_node, "rate_bps": rate_bps, "latency_s": lat,
                           "mtu": args.mtu, **link,
                           "probe": probe, "wall_s": time.perf_counter() - t0}
                preds = _predict_all(r.results, probe, nodes, args, rate_bps, lat)
                summ = summarize(setting, r.results, preds)
                print_setting(setting, summ)
                out["settings"].append({**setting, "models": summ})
    if args.big_model:
        spec = {"rpn": args.ranks_per_node, "timeout": args.timeout, "model": args.big_model,
                "fractions": args.fractions, "repeats": args.delta_repeats, "rate_bps": parse_rate(args.rates[0])}
        rate_bps = spec["rate_bps"]
        with Cluster(2, args.ranks_per_node, rate=rate_bps) as c:
            r = c.run("cluster_delta:big_rank", spec, timeout=args.timeout * 10, pg_timeout=args.timeout, env=env)
        src, _, _ = cc.layouts(args.big_model, 2, args.ranks_per_node)
        mbytes = sum(math.prod(t.shape) * t.dtype.itemsize for t in src.tensors)
        rows = cd.summarize_delta([{"delta": x["delta"]} for x in r.results])
        out["big"] = {"model": args.big_model, "model_bytes": mbytes, "rate_bps": rate_bps,
                      "link_limit_s": mbytes * 8 / rate_bps, **rows}
        print(f"== {args.big_model} ({mbytes / 1e6:.0f} MB), 2 nodes, {rate_bps / 1e9:g} Gbit/s, uniform flips:")
        for f, d in rows["by_fraction"].items():
            print(f"    delta {100 * float(f):4.1f} %: {d['delta_s'] * 1e3:.1f} ms vs dense {d['dense_s'] * 1e3:.1f} ms "
                  f"= {d['speedup']:.2f}x faster, bytes {d['bytes_ratio']:.3f} of dense, exact {d['exact']} "
                  f"{d['modes']}; CPU (all ranks) delta {d.get('delta_cpu_s', 0) * 1e3:.1f} ms, dense "
                  f"{d.get('dense_cpu_s', 0) * 1e3:.1f} ms", flush=True)
    return out


def plot(res: dict, path: str, extra_big: tuple = ()) -> None:
    """Per model, each method's time over the link limit per setting; a last panel: delta speed-ups (also of
    ``extra_big``, the ``big`` entries of other result files)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = res["settings"]
    models = list(sets[0]["models"])
    deltas = [(f"{s['nodes']}n {s['rate_bps'] / 1e9:g}G {m}", row["delta"]["by_fraction"]) for s in sets
              for m, row in s["models"].items() if "delta" in row]
    big = [res[k] for k in ("big",) if res.get(k)] + [b for b in extra_big if b]
    deltas += [(f"2n {b['rate_bps'] / 1e9:g}G {b['model']} ({b['model_bytes'] / 1e6:.0f} MB)", b["by_fraction"])
               for b in big]
    panels = len(models) + bool(deltas)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    if deltas:  # dense time / delta time against the changed fraction
        ax = axes[0][-1]
        for label, by in deltas:
            fs = sorted(by, key=float)
            ax.plot([100 * float(f) for f in fs], [by[f]["speedup"] for f in fs], marker="o", label=label)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xlabel("changed elements (%)")
        ax.set_ylabel("dense time / delta time")
        ax.set_title("delta vs dense refit")
        ax.legend(fontsize=6)
    methods = ["ours", "ours-relay", "ours-no-topology", "gather-bcast", "allgather"]
    for ax, model in zip(axes[0], models, strict=False):
        labels = [f"{s['nodes']}n {s['rate_bps'] / 1e9:g}G" + (f" +{s['latency_s'] * 1e3:g}ms" if s.get("latency_s") else "")
                  for s in sets]
        w = 0.8 / len(methods)
        for k, m in enumerate(methods):
            ys = [s["models"][model]["methods"].get(m, {}).get("over_link_limit", 0) for s in sets]
            ax.bar([i + k * w for i in range(len(sets))], ys, w, label=m)
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="link limit")
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(sets))], labels, rotation=40, ha="right", fontsize=7)
        ax.set_ylabel("refit time / link limit")
        ax.set_yscale("log")
        ax.set_title(model)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    ap.add_argument("--latencies", nargs="+", default=["0", "1ms"])
    ap.add_argument("--models", nargs="+", default=["small_llama", "small_qwen3_moe"])
    ap.add_argument("--delta-model", default="small_llama", help="'' for none")
    ap.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    ap.add_argument("--delta-repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--delta-order", choices=("chains", "interleaved"), default="chains",
                    help="chains: each method's versions in a row (default); interleaved: per version dense, delta "
                         "and the cost model in turn, the order rotated by one each version")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--methods", nargs="+", help="time only these methods (ours, ours-relay, ours-no-topology, "
                                                   "allgather, gather-bcast; default all), e.g. for an A/B of ours")
    ap.add_argument("--big-model", default="", help="also dense vs delta (uniform flips) of this preset on 2 nodes "
                                                     "at the first rate, e.g. llama_demo (~400 MB bf16)")
    ap.add_argument("--skip-settings", action="store_true", help="only --big-model")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--mtu", type=int, default=1500, help="every link's MTU (1500: Ethernet's; 9000: jumbo frames, "
                                                           "~0.7 %% TCP/IP framing instead of ~4.4 %%)")
    ap.add_argument("--emulator", choices=("auto", "veth", "tap"), default="auto",
                    help="the links: auto (veth + tc, the userspace TAP emulator for a latency without netem), veth, "
                         "or tap (testing.netdelay's TAPs and C forwarder for every setting)")
    ap.add_argument("--tcp-slow-start-after-idle", type=int, choices=(0, 1), default=None,
                    help="set net.ipv4.tcp_slow_start_after_idle in every node (Linux's default: 1, TCP restarts "
                         "from its initial window after an idle RTO, 200 ms)")
    ap.add_argument("--smoke", action="store_true", help="CI: 2 nodes, 1 Gbit/s, small_llama, 1 repeat")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--replot", type=Path, nargs="+", help="only draw --plot from these result files (the first "
                                                              "with the settings, others add their --big-model rows)")
    args = ap.parse_args(argv)
    if args.replot:
        if args.plot is None:
            ap.error("--replot needs --plot")
        first, *rest = [json.loads(p.read_text()) for p in args.replot]
        plot(first, str(args.plot), tuple(r.get("big") for r in rest))
        return 0
    for opt, path in (("--out", args.out), ("--plot", args.plot)):
        if path is not None and not path.resolve().parent.is_dir():
            print(f"bench_cluster: {opt} {path}: folder {path.resolve().parent} does not exist", file=sys.stderr)
            return 2
    if args.smoke:
        args.nodes, args.rates, args.latencies, args.models = [2], ["1gbit"], ["0"], ["small_llama"]
        args.fractions, args.delta_repeats, args.warmup, args.repeats = [0.02], 1, 3, 1
    res = run(args)
    res["meta"] = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "torch": torch.__version__, "platform": platform.platform(), "cpus": os.cpu_count(),
                   "machine": platform.machine(), "python": platform.python_version(),
                   "load_average": list(os.getloadavg())}
    if args.out:
        args.out.write_text(json.dumps(res, indent=1, default=str))
    if args.plot:
        plot(res, str(args.plot))
    bad = [(s["nodes"], s["rate_bps"], m, k) for s in res["settings"] for m, row in s["models"].items()
           for k, r in row["methods"].items() if not r["exact"]]
    bad += [(s["nodes"], s["rate_bps"], m, "delta") for s in res["settings"] for m, row in s["models"].items()
            if "delta" in row and not all(d["exact"] for d in row["delta"]["rows"])]
    if "big" in res and not all(d["exact"] for d in res["big"]["rows"]):
        bad.append(("big", res["big"]["model"]))
    if bad:
        print(f"bench_cluster: NOT bit-exact: {bad}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
