"""Delta refits of ``perf/bench_cluster.py`` (split from it to keep files short; the versions, real AdamW
diffs of the preset's HF model, are ``perf/cluster_versions.py``'s): the rank side of dense / delta / cost-model
delta chains, the ``--big-model`` rank side (uniform flips), and their summary. Imported by ``bench_cluster``
(and by its ranks, ``perf`` on the path).
"""

from __future__ import annotations

import statistics

import cluster_common as cc  # the shared helpers (not bench_cluster itself: no import circle)
import torch


def _delta_rank(rank, spec, src, dst, full_dst, inst, rpn, timeout, relay=None) -> list:
    from safetensors import safe_open

    from triton_reshard import Resharder, plan_reshard
    from triton_reshard.execute.delta import DeltaRequest
    from triton_reshard.tools.topology import Topology

    versions = spec["delta"]["versions"]
    last: dict = {}

    def version(v: int) -> dict:  # one version read at a time (every rank holding all of a big model's: GBs)
        if v not in last:
            last.clear()
            with safe_open(spec["delta"]["path"], "pt") as f:
                last[v] = {n.split("/", 1)[1]: f.get_tensor(n) for n in f.keys()  # noqa: SIM118
                           if n.startswith(f"v{v}/")}
        return last[v]

    groups = dst.instance_groups(inst) if inst > 1 else None
    plan = plan_reshard(src, full_dst, False, rpn, relay, groups, rank=rank)  # relays as "ours" chose
    r_dense, r_delta, r_auto = (Resharder(plan, timeout=timeout) for _ in range(3))
    # auto: the delta request knows the cluster (nominal link rate, one link per node, loopback as NVLink):
    # a refit the last delta's measured costs predict slower than dense goes dense (execute/delta.py cost_row)
    topo = Topology(gpus_per_node=rpn, nvlink_GBps=1.0, net_GBps=spec["rate_bps"] / 8e9, shared_nic=True)
    pub = version(0)
    src_t = src.shard(pub, rank) if rank in src.ranks else {}
    d_dense = cc.poison(full_dst.allocate(rank)) if rank in full_dst.ranks else {}
    d_delta = cc.poison(full_dst.allocate(rank)) if rank in full_dst.ranks else {}
    d_auto = cc.poison(full_dst.allocate(rank)) if rank in full_dst.ranks else {}
    r_dense.run(src_t, d_dense)
    r_delta.run(src_t, d_delta, delta=DeltaRequest(0))  # the first is dense: it captures the snapshot
    auto = "topology" in DeltaRequest.__dataclass_fields__  # (a tree before the cost model: auto = delta)
    r_auto.run(src_t, d_auto, delta=DeltaRequest(0, topology=topo) if auto else DeltaRequest(0))
    # each method's chain of versions runs on its own: a refit follows its own kind (a dense refit right after
    # a delta one starts from the TCP congestion window the small delta messages left: seen ~1.5-2x slower
    # at 10 Gbit/s, which is the order, not the method)
    timed: dict = {}
    methods = (("dense", r_dense, d_dense, None), ("delta", r_delta, d_delta, {}),
               ("auto", r_auto, d_auto, {"topology": topo} if auto else {}))
    # --delta-order interleaved: per version every method in turn, the order rotated by one each version (each
    # method follows each other as often: a refit after a delta one starts from the TCP window the small delta
    # messages left), else each method's chain on its own
    order = [(methods[(i + k) % 3], row) for k, row in enumerate(versions) for i in range(3)] \
        if spec["delta"].get("interleaved") else [(m, row) for m in methods for row in versions]
    for (name, res, d, req), row in order:
        v = row["version"]
        for n, t in (src.shard(version(v), rank) if rank in src.ranks else {}).items():
            src_t[n].copy_(t)
        rep: dict = {}
        dr = None if req is None else DeltaRequest(v, held=v - 1, **req)
        t = cc.timed(lambda res=res, d=d, dr=dr, rep=rep: rep.setdefault("r", res.run(src_t, d, delta=dr)), 1)
        timed[name, v] = (t, rep["r"], cc.exact(full_dst, rank, d, version(v)))
    rows = []
    for row in versions:
        v = row["version"]
        (a, _ra, ea), (b, r, eb), (c, rc, ec) = (timed[k, v] for k in ("dense", "delta", "auto"))
        rows.append({**row, "dense": a, "delta": b, "auto": c, "mode": r.mode, "auto_mode": rc.mode,
                     "auto_why": rc.fallback, "sent": r.sent_bytes,
                     "dense_sent": r.dense_sent_bytes, "pack_s": r.pack_seconds, "wire_s": r.wire_seconds,
                     "unpack_s": r.unpack_seconds, "exact": ea and eb and ec})
    return rows


def big_rank(rank: int, world: int, spec: dict) -> dict:
    """``--big-model``: dense vs delta refits of a larger preset model on 2 nodes, the changes uniform low-bit
    flips of ``fraction`` of each source shard's elements (seeded per rank and version: part 1 of
    ``perf/bench_delta.py`` showed such masks give the bytes of real AdamW masks); the delta destination is
    compared bit for bit with the dense one after every refit."""
    from triton_reshard import Resharder, plan_reshard
    from triton_reshard.execute.delta import DeltaRequest
    from triton_reshard.tools.topology import Topology, choose_relay

    rpn, timeout = spec["rpn"], spec["timeout"]
    src, dst, _ = cc.layouts(spec["model"], 2, rpn)
    # relays as bench_cluster's "ours" chooses them (the time model with the nominal link rate)
    topo = Topology(gpus_per_node=rpn, nvlink_GBps=1.0, net_GBps=spec.get("rate_bps", 1e9) / 8e9,
                    step_latency_s=1e-3, shared_nic=True)
    plan = plan_reshard(src, dst, False, rpn, choose_relay(src, dst, topo).relay, None, rank=rank)
    r_dense, r_delta = Resharder(plan, timeout=timeout), Resharder(plan, timeout=timeout)
    g = torch.Generator().manual_seed(rank)
    src_t = {n: (torch.randn(t.shape, generator=g) * 0.02).to(t.dtype) for n, t in src.allocate(rank).items()} \
        if rank in src.ranks else {}
    d_dense = cc.poison(dst.allocate(rank)) if rank in dst.ranks else {}
    d_delta = cc.poison(dst.allocate(rank)) if rank in dst.ranks else {}
    r_dense.run(src_t, d_dense)
    r_delta.run(src_t, d_delta, delta=DeltaRequest(0))
    rows, v = [], 0
    for frac in spec["fractions"]:
        for _ in range(spec["repeats"]):
            v += 1
            gf = torch.Generator().manual_seed(1000 * v + rank)
            for t in src_t.values():
                t.view(torch.int16)[torch.rand(t.shape, generator=gf) < frac] ^= 1
            a = cc.timed(lambda: r_dense.run(src_t, d_dense), 1)
            rep: dict = {}
            b = cc.timed(lambda v=v, rep=rep: rep.setdefault("r", r_delta.run(src_t, d_delta,
                                                                           delta=DeltaRequest(v, held=v - 1))), 1)
            r = rep["r"]
            same = all(torch.equal(d_dense[n].view(torch.int16), d_delta[n].view(torch.int16)) for n in d_dense)
            rows.append({"target": frac, "changed": frac, "version": v, "dense": a, "delta": b, "mode": r.mode,
                         "sent": r.sent_bytes, "dense_sent": r.dense_sent_bytes, "pack_s": r.pack_seconds,
                         "wire_s": r.wire_seconds, "unpack_s": r.unpack_seconds, "exact": same})
    return {"rank": rank, "delta": rows}


def summarize_delta(per: list) -> dict:
    """Delta rows of every rank (``per[rank]["delta"]``) as the slowest rank's times per version, and per
    changed fraction the medians and the speed-up."""
    drows = []
    for i, d in enumerate(per[0]["delta"]):
        drows.append({"version": d["version"], "target": d["target"], "changed": d["changed"],
                      "dense_s": cc.span([p["delta"][i]["dense"] for p in per], 0),
                      "delta_s": cc.span([p["delta"][i]["delta"] for p in per], 0),
                      "dense_cpu_s": sum(p["delta"][i]["dense"].get("cpu", [0.0])[0] for p in per),
                      "delta_cpu_s": sum(p["delta"][i]["delta"].get("cpu", [0.0])[0] for p in per),
                      **({"auto_s": cc.span([p["delta"][i]["auto"] for p in per], 0),
                          "auto_modes": sorted({p["delta"][i]["auto_mode"] for p in per})}
                         if "auto" in per[0]["delta"][i] else {}),
                      "sent": sum(p["delta"][i]["sent"] for p in per),
                      "dense_sent": sum(p["delta"][i]["dense_sent"] for p in per),
                      "modes": sorted({p["delta"][i]["mode"] for p in per}),
                      "exact": all(p["delta"][i]["exact"] for p in per),
                      "pack_s": max(p["delta"][i]["pack_s"] for p in per),
                      "unpack_s": max(p["delta"][i]["unpack_s"] for p in per),
                      "wire_s": max(p["delta"][i]["wire_s"] for p in per)})
    by: dict = {}
    for d in drows:
        by.setdefault(d["target"], []).append(d)
    return {"rows": drows, "by_fraction": {
        str(f): {"changed": statistics.fmean(d["changed"] for d in ds),
                 "dense_s": statistics.median(d["dense_s"] for d in ds),
                 "delta_s": statistics.median(d["delta_s"] for d in ds),
                 "speedup": statistics.median(d["dense_s"] for d in ds) / statistics.median(d["delta_s"] for d in ds),
                 "bytes_ratio": statistics.fmean(d["sent"] / d["dense_sent"] for d in ds),
                 "dense_cpu_s": statistics.median(d["dense_cpu_s"] for d in ds),
                 "delta_cpu_s": statistics.median(d["delta_cpu_s"] for d in ds),
                 "exact": all(d["exact"] for d in ds), "modes": sorted({m for d in ds for m in d["modes"]}),
                 **({"auto_s": statistics.median(d["auto_s"] for d in ds),
                     "auto_speedup": statistics.median(d["dense_s"] for d in ds) / statistics.median(
                         d["auto_s"] for d in ds),
                     "auto_modes": [m for d in ds for m in d["auto_modes"]]} if "auto_s" in ds[0] else {})}
        for f, ds in by.items()}}
