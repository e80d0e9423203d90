"""The fixed cost of one cached ``refit`` call (issue 32): a refit that moves one 64-byte tensor from the
trainer ranks to the engine ranks, after a warm-up call (plan, buffers and connections cached), so what is
timed is everything a call does besides moving bytes: the options and session lookup, the input checks, the
plan handshake, the step's round of messages and the report.

Per setting, in one run:

* ``span``: calls between barriers, each timed from the first rank entering it to the last rank leaving it
  (every rank's marks on the host's monotonic clock; median of ``--calls``);
* ``back_to_back``: ``--calls`` calls in a row with no barrier between them: the slowest rank's seconds per
  call (what a loop of small refits pays each time);
* ``cpu``: CPU seconds per call of every rank together, and of the busiest rank.

``--where loopback``: one process per rank on this machine, gloo over loopback. ``--where cluster``: the
emulated cluster (``triton_reshard.testing.cluster``, root): ``--nodes`` nodes of ``--ranks-per-node`` ranks,
trainer on node 0, engine on node 1, links of ``--rate``. ``--profile FILE``: rank 0's cProfile of the
back-to-back calls (loopback only), its top functions printed.

    python perf/bench_call.py --where loopback --calls 200 --out perf/results/bench_call.json
    python perf/bench_call.py --where cluster --nodes 2 --rate 1gbit --calls 50
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _layouts(rpn: int):
    from triton_reshard import Layout, Shard

    src = Layout.from_placements({"t": (2 * rpn, 16)}, list(range(rpn)), [Shard(0)], torch.bfloat16)
    dst = Layout.from_placements({"t": (2 * rpn, 16)}, list(range(rpn, 2 * rpn)), [Shard(1)], torch.bfloat16)
    return src, dst


def measure(rank: int, world: int, spec: dict) -> dict:
    """This rank's marks: ``spec['calls']`` calls between barriers, then as many back to back."""
    import torch.distributed as dist

    import triton_reshard
    from triton_reshard import refit
    from triton_reshard.execute import resharder

    rpn, calls, timeout = spec["rpn"], spec["calls"], spec.get("timeout", 60.0)
    src, dst = _layouts(rpn)
    g = torch.arange(src.tensors[0].shape[0] * 16, dtype=torch.float32).reshape(-1, 16).to(torch.bfloat16)
    s = src.shard({"t": g}, rank) if rank in src.ranks else {}
    d = dst.allocate(rank) if rank in dst.ranks else {}
    for t in d.values():
        t.view(torch.int16).fill_(-1)
    refit(s, d, src, dst, timeout=timeout)  # warm: plan, buffers, connections
    exact = all(torch.equal(t, dst.shard({"t": g}, rank)[n]) for n, t in d.items())
    enter, leave, cpu, wire, own = [], [], [], [], []
    for i in range(calls):
        if spec.get("ab"):  # odd calls without the receives posted with the handshake (what main did)
            resharder.PREPOST = i % 2 == 0
        dist.barrier()
        p0, t0 = time.process_time(), time.perf_counter()
        rep = refit(s, d, src, dst, timeout=timeout)
        t1, p1 = time.perf_counter(), time.process_time()
        wire.append(rep.wire_seconds)
        own.append(t1 - t0)
        enter.append(t0)
        leave.append(t1)
        cpu.append(p1 - p0)
    dist.barrier()
    resharder.PREPOST = True
    prof = None
    if spec.get("profile") and rank == 0:
        import cProfile

        prof = cProfile.Profile()
    p0, t0 = time.process_time(), time.perf_counter()
    if prof is not None:
        prof.enable()
    for _ in range(calls):
        refit(s, d, src, dst, timeout=timeout)
    if prof is not None:
        prof.disable()
        prof.dump_stats(spec["profile"])
    t1, p1 = time.perf_counter(), time.process_time()
    dist.barrier()
    rtt = _rtt(rank, rpn)
    return {"rank": rank, "package": str(Path(triton_reshard.__file__).parent), "rtt_s": rtt, "wire": wire, "own": own,
            "engine": rank in dst.ranks, "enter": enter, "leave": leave, "cpu": cpu, "exact": exact,
            "b2b_s": (t1 - t0) / calls, "b2b_cpu_s": (p1 - p0) / calls}


def _rtt(rank: int, rpn: int, n: int = 20) -> float | None:
    """The round trip of a 4-byte message between rank 0 (trainer) and rank ``rpn`` (engine), with the
    receive posted first (gloo sends only to a posted receive: one message costs one latency then)."""
    import torch.distributed as dist

    small = torch.zeros(1)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            dist.send(small, rpn)
            dist.recv(small, rpn)
        elif rank == rpn:
            dist.recv(small, 0)
            dist.send(small, 0)
    dt = time.perf_counter() - t0  # before the closing barrier, which is not part of a round trip
    dist.barrier()
    return dt / n if rank == 0 else None


def summarize(per: list[dict], ab: bool = False) -> dict:
    calls = len(per[0]["enter"])
    spans = [max(p["leave"][i] for p in per) - min(p["enter"][i] for p in per) for i in range(calls)]
    cpus = [sum(p["cpu"][i] for p in per) for i in range(calls)]
    ab_rows = {}
    if ab:  # even calls: the first step's receives posted with the handshake; odd calls: after it
        for name, k in (("prepost", 0), ("no_prepost", 1)):
            ab_rows[name] = {"span_s": statistics.median(spans[k::2]), "cpu_all_ranks_s": statistics.median(cpus[k::2])}
            # the engine ranks' wait for the step after the handshake (RunReport.wire_seconds): what the
            # receives posted with the handshake shorten, whatever the arrival skew
            ab_rows[name]["engine_wire_s"] = statistics.median(w for p in per if p.get("engine")
                                                               for w in p["wire"][k::2])
        ab_rows["pairs_faster"] = sum(a < b for a, b in zip(spans[0::2], spans[1::2], strict=False))
        ab_rows["pairs"] = len(spans[1::2])
    enter_skew = [max(p["enter"][i] for p in per) - min(p["enter"][i] for p in per) for i in range(calls)]
    out = {
        "span_s": statistics.median(spans),
        # of the span: how far apart the ranks entered (the barrier's release, not the refit), and the slowest
        # rank's own time in the call
        "enter_skew_s": statistics.median(enter_skew),
        "slowest_rank_s": statistics.median(max(p["own"][i] for p in per) for i in range(calls)),
        "span_p90_s": sorted(spans)[int(0.9 * (calls - 1))],
        "back_to_back_s": max(p["b2b_s"] for p in per),
        "cpu_all_ranks_s": statistics.median(sum(p["cpu"][i] for p in per) for i in range(calls)),
        "cpu_busiest_rank_s": max(statistics.median(p["cpu"]) for p in per),
        "cpu_b2b_all_ranks_s": sum(p["b2b_cpu_s"] for p in per),
        "exact": all(p["exact"] for p in per),
        "rtt_s": per[0].get("rtt_s"),
        "package": per[0].get("package"),
    }
    if ab:
        out["ab"] = ab_rows
    return out


def _free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def _loopback_rank(rank: int, world: int, port: int, spec: dict, outdir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = measure(rank, world, spec)
    finally:
        dist.destroy_process_group()
    Path(outdir, f"{rank}.json").write_text(json.dumps(res))


def run_loopback(spec: dict) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    world = 2 * spec["rpn"]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_loopback_rank, args=(world, _free_port(), spec, tmp), nprocs=world, join=True)
        per = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world)]
    return summarize(per, spec.get("ab", False))


def run_cluster(spec: dict, nodes: int, rate) -> dict:
    from triton_reshard.testing.cluster import Cluster, available, parse_rate

    ok, why = available()
    if not ok:
        raise SystemExit(f"bench_call: {why}")
    # the ranks import triton_reshard as this interpreter does (an A/B of two installs runs this same script)
    env = {"PYTHONPATH": f"{ROOT / 'perf'}:{os.environ.get('PYTHONPATH', '')}"}
    with Cluster(nodes, spec["rpn"], rate=parse_rate(rate)) as c:
        r = c.run("bench_call:measure", spec, timeout=spec["timeout"] * 4, pg_timeout=spec["timeout"], env=env)
    return summarize(r.results, spec.get("ab", False))


def print_profile(path: str, top: int) -> None:
    import pstats

    st = pstats.Stats(path)
    st.sort_stats("tottime").print_stats(top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--where", choices=("loopback", "cluster"), default="loopback")
    ap.add_argument("--ranks-per-node", type=int, default=2, help="trainer ranks (= engine ranks)")
    ap.add_argument("--nodes", type=int, default=2, help="cluster: nodes (trainer on node 0, engine on node 1)")
    ap.add_argument("--rate", default="1gbit", help="cluster: each node's link rate")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--ab", action="store_true", help="alternate calls with and without the first step's receives "
                                                       "posted with the handshake (execute.resharder.PREPOST), "
                                                       "the same load on both")
    ap.add_argument("--profile", help="loopback: write rank 0's cProfile of the back-to-back calls here")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    spec = {"rpn": args.ranks_per_node, "calls": args.calls, "timeout": args.timeout, "profile": args.profile,
            "ab": args.ab}
    if args.where == "cluster":
        spec["profile"] = None
        res = run_cluster(spec, args.nodes, args.rate)
    else:
        res = run_loopback(spec)
    world = (args.nodes if args.where == "cluster" else 2) * args.ranks_per_node
    res.update(where=args.where, ranks=world, calls=args.calls, python=sys.version.split()[0])
    if args.where == "cluster":
        res.update(nodes=args.nodes, rate=args.rate)
    print(f"bench_call ({args.where}, {world} ranks): span {res['span_s'] * 1e3:.2f} ms "
          f"(p90 {res['span_p90_s'] * 1e3:.2f}), back to back {res['back_to_back_s'] * 1e3:.2f} ms/call, CPU "
          f"{res['cpu_all_ranks_s'] * 1e3:.2f} ms all ranks ({res['cpu_busiest_rank_s'] * 1e3:.2f} busiest), "
          f"exact {res['exact']}; entry skew {res['enter_skew_s'] * 1e3:.2f} ms, slowest rank's own time "
          f"{res['slowest_rank_s'] * 1e3:.2f} ms; small-message round trip {res['rtt_s'] * 1e3:.2f} ms; {res['package']}", flush=True)
    if args.ab:
        a = res["ab"]
        print(f"  alternate calls: with the receives posted with the handshake {a['prepost']['span_s'] * 1e3:.2f} ms "
              f"(CPU {a['prepost']['cpu_all_ranks_s'] * 1e3:.2f}), without {a['no_prepost']['span_s'] * 1e3:.2f} ms "
              f"(CPU {a['no_prepost']['cpu_all_ranks_s'] * 1e3:.2f}); faster in {a['pairs_faster']} of {a['pairs']} "
              f"pairs; engine ranks' wait for the step after the handshake {a['prepost']['engine_wire_s'] * 1e3:.2f} vs "
              f"{a['no_prepost']['engine_wire_s'] * 1e3:.2f} ms", flush=True)
    if args.profile and args.where == "loopback":
        print_profile(args.profile, args.top)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0 if res["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
