"""Routing on a topology: network bytes and predicted refit time without a topology, with same-node replica
preference, and with relays (fan-out inside a node), for Megatron-Core -> vLLM refits of preset models.

For each model and layout pair, on each topology preset (``triton_reshard.tools.topology.PRESETS``: ``h100``, 8 GPUs
per node; ``gb200``, 72 per NVLink domain), three plans of the same layouts:

* ``none``: ``plan_reshard(src, dst)``: no topology (one plan, judged on each topology);
* ``near``: ``plan_reshard(src, dst, gpus_per_node=N, relay=False)``: a holder in the destination's node sends
  when there is one (within a fair share);
* ``relay``: ``plan_reshard(src, dst, gpus_per_node=N)``: the same, plus relays: a box several ranks of a node
  need and no source there holds crosses the network once per node, then NVLink: split into one part per rank
  of that group (parts of at least ``plan.RELAY_SPLIT_MIN_BYTES``), each part received over the network by one
  rank and relayed by it to the others (a scatter, then an all-gather over NVLink).

Reported per plan: bytes over the network and NVLink, the largest network receive of one rank, relays, schedule
steps (1 GiB staging per rank) and the predicted refit time (``topology.predict_seconds``: scheduled, and
unbucketed: the plan's phases one after the other). Layout pairs (128 ranks, colocated):

* ``tp8``: Megatron tp=4, pp=2, dp=16 (ep=8, etp=1) -> vLLM tp=8, dp=16 (expert parallel);
* ``tp4``: the same -> vLLM tp=4, dp=32 (two DP replicas per H100 node).

    python perf/bench_routing.py --out perf/results/bench_routing.json
    python perf/bench_routing.py --models qwen3-235b-a22b --pairs tp8 --topologies gb200

Each plan of a 235B model on 128 ranks takes ~10-30 s on one CPU core; plans are built one at a time and
dropped before the next (a plan holds ~10^5-10^6 transfers).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections import defaultdict

import torch

from triton_reshard.plan import plan_reshard
from triton_reshard.presets import get_config, megatron_layout, model_spec, vllm_layout
from triton_reshard.tools.cli import routing_figures
from triton_reshard.tools.cliutil import UsageError, check_output_file
from triton_reshard.tools.topology import PRESETS

MODELS = ("qwen3-235b-a22b", "deepseek-v3")
PAIRS = {  # name -> (Megatron tp, pp, dp, ep), (vLLM tp, dp)
    "tp8": ((4, 2, 16, 8), (8, 16)),
    "tp4": ((4, 2, 16, 8), (4, 32)),
}
BUCKET = 1 << 30


def _net_recv_max(plan, gpn: int) -> int:
    """The most bytes one rank receives over the network."""
    recv: dict[int, int] = defaultdict(int)
    for t in plan.transfers:
        if t.src_rank // gpn != t.dst_rank // gpn:
            recv[t.dst_rank] += t.nbytes
    return max(recv.values(), default=0)


def _row(model, pair, topo_name, mode, plan, sched, plan_s) -> dict:
    topo = PRESETS[topo_name]
    st = plan.stats()
    return {
        "model": model, "pair": pair, "topology": topo_name, "mode": mode, "digest": plan.digest,
        "wire_bytes": st.wire_bytes, "lower_bound_bytes": st.lower_bound_bytes,
        "max_net_recv_bytes": _net_recv_max(plan, topo.gpus_per_node), "plan_seconds": plan_s,
        **routing_figures(plan, sched, topo),
    }


def bench(model: str, pair: str, topologies: list[str], progress=print) -> list[dict]:
    cfg = get_config(model)
    moe = any(model_spec(cfg).moe_layers)
    (tp, pp, dp, ep), (vtp, vdp) = PAIRS[pair]
    world = tp * pp * dp
    n = model_spec(cfg).layers
    stages = [n // pp + (i < n % pp) for i in range(pp)]  # uneven (DeepSeek-V3's 61): the first stages get one more
    src = megatron_layout(cfg, tp=tp, pp=pp, dp=dp, ep=ep if moe else 1, etp=1 if moe else None, ranks=range(world),
                          dtype=torch.bfloat16, layers_per_stage=stages if n % pp else None)
    dst = vllm_layout(cfg, tp=vtp, dp=vdp, enable_expert_parallel=moe, ranks=range(world), dtype=torch.bfloat16)
    rows = []
    variants = [("none", None, None, topologies)]
    for name in topologies:
        variants += [("near", PRESETS[name].gpus_per_node, False, [name]),
                     ("relay", PRESETS[name].gpus_per_node, None, [name])]
    for mode, gpn, relay, judged_on in variants:
        plan_reshard.cache_clear()
        gc.collect()
        t0 = time.perf_counter()
        plan = plan_reshard(src, dst, False, gpn, relay)
        plan_s = time.perf_counter() - t0
        sched = plan.schedule(BUCKET)
        for name in judged_on:
            r = _row(model, pair, name, mode, plan, sched, plan_s)
            rows.append(r)
            p = r["predicted_seconds"]
            progress(f"{model} {pair} {name:5s} {mode:5s}: net {r['net_bytes'] / 2**30:7.1f} GiB, NVLink "
                     f"{r['nvlink_bytes'] / 2**30:7.1f} GiB, max net recv/rank {r['max_net_recv_bytes'] / 2**30:5.2f} "
                     f"GiB, {r['num_relays']} relays, {r['steps']} steps ({r['relay_steps']} relay); predicted "
                     f"{p['scheduled'] * 1e3:.1f} ms (unbucketed {p['unbucketed'] * 1e3:.1f} ms); plan {plan_s:.1f} s")
        del plan, sched
    return rows


def table(rows: list[dict]) -> str:
    head = ("| model | pair | topology | routing | network GiB | NVLink GiB | max net recv/rank GiB | relays | "
            "steps | predicted ms (scheduled) | predicted ms (unbucketed) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        p = r["predicted_seconds"]
        lines.append(f"| {r['model']} | {r['pair']} | {r['topology']} | {r['mode']} | {r['net_bytes'] / 2**30:.1f} | "
                     f"{r['nvlink_bytes'] / 2**30:.1f} | {r['max_net_recv_bytes'] / 2**30:.2f} | {r['num_relays']} | "
                     f"{r['steps']} | {p['scheduled'] * 1e3:.1f} | {p['unbucketed'] * 1e3:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma list of preset configs")
    p.add_argument("--pairs", default=",".join(PAIRS), help=f"comma list of {', '.join(PAIRS)}")
    p.add_argument("--topologies", default="h100,gb200", help="comma list of topology presets")
    p.add_argument("--out", default=None, help="write the results as JSON to this path")
    args = p.parse_args(argv)
    try:  # before any work: an output path that cannot be written is one line, exit 2
        check_output_file(args.out, '--out', make_folder=True)
    except UsageError as e:
        p.error(str(e))
    topologies = [t for t in args.topologies.split(",") if t]
    rows, skipped = [], []
    for model in filter(None, args.models.split(",")):
        for pair in filter(None, args.pairs.split(",")):
            try:
                rows += bench(model, pair, topologies, progress=lambda s: print(s, flush=True))
            except (ValueError, NotImplementedError) as e:  # a model the Megatron/vLLM presets cannot build yet
                skipped.append({"model": model, "pair": pair, "reason": f"{type(e).__name__}: {e}"})
                print(f"{model} {pair}: skipped ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    print(table(rows))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        meta = {"argv": ["perf/bench_routing.py", *sys.argv[1:]],
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": list(os.getloadavg()),
                "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                "bucket_bytes": BUCKET, "topologies": {t: repr(PRESETS[t]) for t in topologies}}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows, "skipped": skipped}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
