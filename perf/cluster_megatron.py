"""``perf/bench_megatron.py --cluster 2xR``: Megatron-Core's own resharding against ours with trainer and engine on
two emulated nodes (root: ``triton_reshard.testing.cluster``). The command and what it reports are described in
``perf/bench_megatron.py`` (its ``--cluster`` option, which calls :func:`cluster_main`); this module is that half of
it: the per-rank body (:func:`cluster_rank`, run by each emulated node's processes as
``perf.cluster_megatron:cluster_rank``), the runs and the table. The models, the seeded global tensors and the
sides are ``bench_megatron``'s."""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # megatron_models, also when run as perf.cluster_megatron
from megatron_models import ROOT, SIDES, bench_config, check_params, global_tensors, gpt_model  # noqa: E402


def _grid_pgs(shape_tp: int, dp: int, offset: int):
    """A ``ProcessGroupCollection`` (TP ``shape_tp``, PP 1, DP ``dp``) over ranks ``[offset, offset + tp*dp)``,
    every group a new gloo group (all ranks call this, in the same order; ranks outside get ``None`` groups)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    grid = HyperCommGrid([shape_tp, 1, 1, 1, dp], ["tp", "cp", "ep", "pp", "dp"], rank_offset=offset)
    pp = grid.create_pg("pp")
    pp_ranks = grid.get_rank_enum("pp")
    embd = [dist.new_group(ranks=ps.default_embedding_ranks(r)) for r in pp_ranks]
    pos = [dist.new_group(ranks=ps.default_position_embedding_ranks(r)) for r in pp_ranks]
    mine = [i for i, r in enumerate(pp_ranks) if dist.get_rank() in r]
    return ProcessGroupCollection(
        tp=grid.create_pg("tp"), cp=grid.create_pg("cp"), pp=pp, ep=grid.create_pg("ep"),
        embd=embd[mine[0]] if mine else None, pos_embd=pos[mine[0]] if mine else None,
        dp=grid.create_pg("dp"), tp_cp=grid.create_pg(["tp", "cp"]), mp=grid.create_pg(["tp", "cp", "ep", "pp"]),
        expt_tp=grid.get_pg("tp"), expt_dp=grid.get_pg("dp"), tp_ep=grid.create_pg(["tp", "ep"]),
        tp_ep_pp=grid.create_pg(["tp", "ep", "pp"]), dp_cp=grid.create_pg(["cp", "dp"]),
        tp_dp_cp=grid.create_pg(["tp", "cp", "dp"]),
    ), bool(mine)


class _NoParams(torch.nn.Module):
    """The side a rank does not hold (the trainer's ranks hold no engine model and the engine's no trainer
    model): no parameters, only what ``swap_model_weights`` reads (``config``, ``pg_collection``)."""

    def __init__(self, config, pg_collection):
        super().__init__()
        self.config = config
        self.pg_collection = pg_collection


def cluster_layouts(cfg: dict, rpn: int, dst_tp: int):
    """(source, destination) layouts: Megatron TP ``rpn`` on node 0 (ranks ``[0, rpn)``), Megatron TP ``dst_tp``
    x DP ``rpn // dst_tp`` on node 1 (ranks ``[rpn, 2 rpn)``)."""
    from triton_reshard.presets import megatron_layout

    src = megatron_layout(cfg, tp=rpn, pp=1, dp=1, spec="local", dtype=torch.float32, ranks=range(rpn))
    dst = megatron_layout(cfg, tp=dst_tp, pp=1, dp=rpn // dst_tp, spec="local", dtype=torch.float32,
                          ranks=range(rpn, 2 * rpn))
    return src, dst


def cluster_rank(rank: int, world: int, cfg: dict, dst_tp: int, warmup: int, refits: int,
                 megatron_first: bool) -> dict:
    """One rank of a 2-node cluster run: node 0 holds the trainer's GPTModel (TP = ranks per node), node 1 the
    engine's (TP ``dst_tp`` x DP); each side's first call, then ``warmup`` + ``refits`` rounds, every call
    checked bit-exact on the engine's ranks, with the bytes this node's link counted per call."""
    warnings.filterwarnings("ignore", module="megatron")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.resharding import refit as mrefit

    from triton_reshard import refit
    from triton_reshard.testing.cluster import link_counters
    from triton_reshard.testing.megatron_cpu import DummyStream as _DummyStream
    from triton_reshard.testing.megatron_cpu import install_cpu_stubs as _install_stubs

    orefit = importlib.import_module("triton_reshard.refit")
    _install_stubs()
    torch.cuda.current_stream = lambda *a, **k: _DummyStream()
    rpn = world // 2
    trainer = rank < rpn
    ps.initialize_model_parallel(tensor_model_parallel_size=rpn, distributed_timeout_minutes=2)
    try:
        src_pgs, _ = _grid_pgs(rpn, 1, 0)
        dst_pgs, _ = _grid_pgs(dst_tp, rpn // dst_tp, rpn)
        src_layout, dst_layout = cluster_layouts(cfg, rpn, dst_tp)
        if trainer:
            src_model = gpt_model(cfg, rpn, 1, pg_collection=src_pgs)
            dst_model = _NoParams(src_model.config, dst_pgs)
        else:
            dst_model = gpt_model(cfg, dst_tp, 1, pg_collection=dst_pgs)
            src_model = _NoParams(dst_model.config, src_pgs)
        src_params, dst_params = dict(src_model.named_parameters()), dict(dst_model.named_parameters())
        check_params(rank, (("source", src_params, src_layout), ("destination", dst_params, dst_layout)))
        hf = global_tensors(cfg)
        with torch.no_grad():
            for n, t in src_layout.shard(hf, rank).items():
                src_params[n].copy_(t)
        expect = dst_layout.shard(hf, rank)
        del hf
        state: dict = {}

        def call_megatron() -> None:
            mrefit.swap_model_weights(src_model, dst_model, "gloo")

        def call_ours() -> None:
            if "group" not in state:
                state["group"] = dist.new_group(backend="gloo")
            state["report"] = refit(src_params, dst_params, src_layout, dst_layout, group=state["group"],
                                    gpus_per_node=rpn)

        calls = {"megatron": call_megatron, "ours": call_ours}

        def timed(side: str) -> tuple[float, dict]:
            with torch.no_grad():
                for p in dst_params.values():
                    p.fill_(float("nan"))
            c0 = link_counters()  # before the barrier: a peer that leaves it first may start sending at once
            dist.barrier()
            t = time.perf_counter()
            calls[side]()
            dist.barrier()
            dt = time.perf_counter() - t
            link = (link_counters() - c0).as_dict()
            bad = [n for n, p in dst_params.items() if not torch.equal(p, expect[n])]
            if bad:
                raise AssertionError(f"rank {rank}: {side}: {len(bad)} destination parameters differ from the "
                                     f"sliced global tensors, e.g. {bad[:3]}")
            return dt, link

        order = list(SIDES) if megatron_first else list(reversed(SIDES))
        first = {side: timed(side) for side in order}
        steady: dict[str, list[float]] = {s: [] for s in SIDES}
        link: dict[str, dict] = {s: first[s][1] for s in SIDES}
        for i in range(warmup + refits):
            for side in order if i % 2 == 0 else reversed(order):
                dt, lk = timed(side)
                if i >= warmup:
                    steady[side].append(dt)
                    link[side] = lk
        mplan = dst_model._cached_reshard_plan  # Megatron's plan of this rank (cached by its first call)
        msent = sum(src_params[op.param_name][op.my_slice].numel() * 4 for op in mplan.send_ops
                    if op.peer_rank // rpn != rank // rpn)
        ours_sent = state["report"].sent_bytes
        return {"first": {s: first[s][0] for s in SIDES}, "first_link": {s: first[s][1] for s in SIDES},
                "steady": steady, "link": link, "order": order,
                "cross_sent_bytes": {"megatron": msent, "ours": ours_sent},
                "dst_bytes": sum(t.numel() * t.element_size() for t in expect.values())}
    finally:
        mrefit.clear_service_cache()
        orefit.clear_cache()
        ps.destroy_model_parallel()


def run_cluster(args) -> dict:
    """``--cluster NxR``: each run a fresh 2-node cluster (trainer node 0 -> engine node 1) at ``--rate``."""
    from triton_reshard import plan_reshard
    from triton_reshard.testing.cluster import Cluster, parse_rate
    from triton_reshard.tools.topology import node_link_bytes, plan_pair_bytes

    nodes, rpn = (int(x) for x in args.cluster.lower().split("x"))
    cfg = {**bench_config(args.layers), "vocab_size": args.vocab}
    src, dst = cluster_layouts(cfg, rpn, args.dst_tp)
    plan = plan_reshard(src, dst, False, rpn)
    predicted = node_link_bytes(plan_pair_bytes(plan), rpn, nodes)  # [(tx, rx)] per node, payload only
    model_bytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in src.tensors)
    rate_bps = parse_rate(args.rate)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    runs = []
    for i in range(args.runs):
        t = time.perf_counter()
        with Cluster(nodes=nodes, ranks_per_node=rpn, rate=args.rate) as c:
            run = c.run("perf.cluster_megatron:cluster_rank", cfg, args.dst_tp, args.warmup, args.refits, i % 2 == 0,
                        timeout=1800, pg_timeout=300, env=env)
        res = run.results
        r0, e0 = res[0], res[rpn]
        out = {"order": r0["order"], "first": r0["first"], "steady": r0["steady"],
               "trainer_link": r0["link"], "engine_link": e0["link"],
               "first_trainer_link": r0["first_link"],
               "cross_sent_bytes": {s: sum(r["cross_sent_bytes"][s] for r in res[:rpn]) for s in SIDES},
               "dst_bytes": sum(r["dst_bytes"] for r in res)}
        runs.append(out)
        print(f"run {i} ({' then '.join(out['order'])}, {time.perf_counter() - t:.0f} s): first call "
              + ", ".join(f"{s} {out['first'][s]:.3f} s" for s in SIDES) + "; steady median "
              + ", ".join(f"{s} {statistics.median(out['steady'][s]):.3f} s" for s in SIDES), flush=True)
    limit_s = model_bytes * 8 / rate_bps  # node 1 must receive every destination element once: the whole model
    steady = {s: statistics.median([statistics.median(r["steady"][s]) for r in runs]) for s in SIDES}
    ratio = statistics.median([statistics.median([m / o for m, o in zip(r["steady"]["megatron"],
                                                                        r["steady"]["ours"], strict=True)])
                               for r in runs])
    summary = {"nodes": nodes, "ranks_per_node": rpn, "rate": args.rate, "rate_bps": rate_bps,
               "src": f"Megatron TP{rpn} (node 0)", "dst": f"Megatron TP{args.dst_tp} x DP{rpn // args.dst_tp} (node 1)",
               "layers": args.layers, "vocab": args.vocab, "model_bytes": model_bytes, "link_limit_s": limit_s,
               "predicted_node_bytes": {"ours": predicted[0][0]},
               "megatron_plan_cross_bytes": statistics.median(r["cross_sent_bytes"]["megatron"] for r in runs),
               "steady_s": steady, "megatron_over_ours": ratio,
               "over_link_limit": {s: steady[s] / limit_s for s in SIDES},
               "first_s": {s: statistics.median(r["first"][s] for r in runs) for s in SIDES},
               "trainer_tx_bytes": {s: runs[-1]["trainer_link"][s]["tx"] for s in SIDES},
               "engine_rx_bytes": {s: runs[-1]["engine_link"][s]["rx"] for s in SIDES}}
    print(f"\nMegatron-Core GPTModel {summary['src']} -> {summary['dst']}, {args.layers} layers, vocab {args.vocab}, "
          f"fp32 ({model_bytes / 1e6:.1f} MB); {nodes} nodes x {rpn} ranks, link {args.rate} "
          f"(limit {limit_s:.3f} s); {args.runs} fresh clusters")
    print("| | Megatron-Core swap_model_weights | ours (refit) | Megatron / ours |")
    print("|---|---|---|---|")
    print(f"| steady per refit (median) | {steady['megatron']:.3f} s | {steady['ours']:.3f} s | {ratio:.2f}× |")
    print(f"| first call (median) | {summary['first_s']['megatron']:.3f} s | {summary['first_s']['ours']:.3f} s | |")
    print(f"| × link limit | {summary['over_link_limit']['megatron']:.2f} | {summary['over_link_limit']['ours']:.2f} | |")
    print(f"| trainer link tx per refit | {summary['trainer_tx_bytes']['megatron'] / 1e6:.2f} MB | "
          f"{summary['trainer_tx_bytes']['ours'] / 1e6:.2f} MB | |")
    print(f"| predicted cross-node payload | {summary['megatron_plan_cross_bytes'] / 1e6:.2f} MB (its plan) | "
          f"{predicted[0][0] / 1e6:.2f} MB (our plan) | |")
    return {"summary": summary, "runs": runs}


def cluster_main(args, argv) -> int:
    """``--cluster``: the two sides on two emulated nodes; the JSON with its run metadata."""
    out = run_cluster(args)
    if args.json:
        with open(args.json, "w") as f:
            meta = {"argv": ["perf/bench_megatron.py", *(sys.argv[1:] if argv is None else argv)],
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "load_average": list(os.getloadavg()),
                    "machine": f"CPU, {os.cpu_count()} cores, {args.cluster} emulated nodes at {args.rate}"}
            json.dump({"args": vars(args), **out, "meta": meta}, f, indent=1)
    return 0
