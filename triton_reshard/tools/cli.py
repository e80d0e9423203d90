"""triton-reshard: plan and run layout-aware reshards for RL weight refit.

  demo    reshard a ~0.5 GiB Llama-shaped model Megatron TP4xPP2 -> vLLM TP2xDP4 on 8 local ranks, check every
          element and compare with the all-gather baseline (~1-2 min on a laptop CPU)
  plan    plan a Megatron -> vLLM refit of a preset model or a config.json and predict its time (no ranks
          spawned: any size)
  bench   end-to-end refit benchmark vs all-gather, the wire limit and DTensor (writes JSON + PNG)
  verify  check that this machine's vLLM loads a checkpoint the way our layout says (needs vLLM)

Run 'triton-reshard <command> --help' for a command's options.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from .cliutil import (
    DTYPE_HELP,
    HelpFormatter,
    OneLineParser,
    UsageError,
    check_output_folder,
    check_outputs,
    parse_dtype,
    parse_sizes,
)
from .cliutil import fmt_bytes as _fmt_bytes
from .cliutil import fmt_seconds as _fmt_seconds


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("triton_reshard")
    except Exception:  # not installed (run from a source tree)
        from .. import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="triton-reshard", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="cmd", metavar="{demo,plan,bench,verify}")
    from . import demo, engine_check

    kw = dict(formatter_class=HelpFormatter)
    p_demo = sub.add_parser("demo", help="reshard a Llama-shaped model on a local world and check it",
                            description=demo.__doc__, **kw)
    demo.add_args(p_demo)
    p_plan = sub.add_parser("plan", help="plan a Megatron -> vLLM refit of a preset model and predict its time",
                            description="Plan a Megatron-Core -> vLLM refit of a preset model (or a HF config.json) "
                                        "for any world size without spawning anything: bytes per rank, busiest "
                                        "rank and link, network vs NVLink bytes, planning time and a predicted "
                                        "refit time from a topology model.", **kw)
    _add_plan_args(p_plan)
    p_bench = sub.add_parser("bench", help="end-to-end refit benchmark vs all-gather, wire limit and DTensor",
                             description="End-to-end refit benchmark: for each case, one spawned world of 8 ranks "
                                         "times ours, the all-gather baseline, the wire limit and DTensor, "
                                         "interleaved round by round; writes bench_refit.json and .png.", **kw)
    p_bench.add_argument("--cases", default="megatron-vllm,colocated,disaggregated,fsdp-tp",
                         help="comma list of: megatron-vllm, colocated, disaggregated, fsdp-tp (default: all)")
    p_bench.add_argument("--sizes-gb", default="1.0", help="comma list of model sizes in GiB (default 1.0)")
    p_bench.add_argument("--dtype", default="float32", help=f"weight dtype: {DTYPE_HELP} (default float32)")
    p_bench.add_argument("--bucket-mb", type=float, default=64,
                         help="staging memory per rank per step, MiB (default 64)")
    p_bench.add_argument("--repeats", type=int, default=3, help="timed rounds per case and size (default 3)")
    p_bench.add_argument("--timeout", type=float, default=120.0,
                         help="seconds before a missing peer is an error (default 120)")
    p_bench.add_argument("--out", default="perf/results", help="folder for bench_refit.json and .png (default perf/results)")
    p_bench.add_argument("--dst-dtype", choices=["same", *demo.QUANT_DST_DTYPES], default="same",
                         help="also time the refit into quantized inference weights (every Linear weight) in this "
                              f"format: {demo.dst_dtype_help()}; print its wire bytes and time beside the plain "
                              "refit's (default same)")
    p_bench.add_argument("--quant-block", type=int, default=128,
                         help="B, the block size of a --dst-dtype that takes it (default 128)")
    p_verify = sub.add_parser("verify", help="check that this machine's vLLM loads a checkpoint as our layout says",
                              description=engine_check.__doc__.replace("``", "'").replace(":func:`~", "").replace("`", ""),
                              **kw)
    engine_check.add_args(p_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``triton-reshard`` command. Returns the exit code: 0 ok, 1 a check failed, 2 a usage mistake
    (printed as one line on stderr)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or argparse's one-line mistake
        return e.code if isinstance(e.code, int) else 2
    if args.cmd is None:
        parser.print_help()
        return 2
    try:
        return _dispatch(args)
    except UsageError as e:
        print(f"triton-reshard {args.cmd}: error: {e}", file=sys.stderr)
        return 2


def _dispatch(args) -> int:
    if args.cmd == "verify":
        from . import engine_check

        return engine_check.run_verify(args)
    if args.cmd == "plan":
        return run_plan(args)
    if args.cmd == "bench":
        from .bench import CASES, run_bench

        cases = [c.strip() for c in args.cases.split(",") if c.strip()]
        bad = [c for c in cases if c not in CASES]
        if bad or not cases:
            raise UsageError(f"--cases {args.cases!r}: unknown case {bad[0] if bad else '(none)'!r}; expected a comma "
                             f"list of {', '.join(CASES)}")
        try:
            sizes = [float(x) for x in args.sizes_gb.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--sizes-gb {args.sizes_gb!r}: expected comma-separated numbers, e.g. 0.5,1.0") from None
        if not sizes or min(sizes) <= 0:
            raise UsageError(f"--sizes-gb {args.sizes_gb!r}: sizes must be > 0")
        dtype = parse_dtype(args.dtype)
        if args.bucket_mb <= 0 or args.repeats < 1 or args.timeout <= 0:
            raise UsageError("--bucket-mb and --timeout must be > 0 and --repeats >= 1")
        if args.quant_block < 1:
            raise UsageError(f"--quant-block {args.quant_block}: must be >= 1")
        check_output_folder(args.out, "--out")
        run_bench(cases, sizes, dtype=str(dtype).removeprefix("torch."), bucket_mb=args.bucket_mb,
                  repeats=args.repeats, timeout=args.timeout, out_dir=args.out,
                  progress=lambda s: print(s, flush=True), dst_dtype=args.dst_dtype, quant_block=args.quant_block)
        return 0
    from . import demo

    return demo.run_demo(args)


# --------------------------------------------------------------------------------------------------------
# triton-reshard plan
# --------------------------------------------------------------------------------------------------------

_SRC_KEYS = ("tp", "pp", "dp", "ep", "etp")
_DST_KEYS = ("tp", "dp", "ep")


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from ..presets import CONFIGS

    p.add_argument("--model", required=True,
                   help=f"a preset config ({', '.join(sorted(CONFIGS))}) or the path of a Hugging Face config.json")
    p.add_argument("--src", required=True,
                   help="Megatron training layout: comma-separated tp, pp, dp, ep, etp = N, no spaces, e.g. "
                        "'tp=4,pp=2,dp=16,ep=8,etp=1' (missing: 1; etp: tp)")
    p.add_argument("--dst", required=True,
                   help="vLLM inference layout: comma-separated tp, dp, ep = N, e.g. 'tp=8,dp=16,ep=1' (ep > 1: "
                        "enable_expert_parallel, experts split over all tp*dp workers)")
    p.add_argument("--src-layers-per-stage", default=None,
                   help="decoder layers of each pipeline stage when pp does not divide them, e.g. '7,8,8,8,8,8,8,6' "
                        "(Megatron's decoder_first/last_pipeline_num_layers)")
    p.add_argument("--src-offset", type=int, default=0, help="first rank of the training layout (default 0)")
    p.add_argument("--dst-offset", type=int, default=0, help="first rank of the inference layout (default 0)")
    p.add_argument("--instances", type=int, default=1,
                   help="independent inference engines, each a full copy of --dst on the next block of ranks "
                        "(engine i on --dst-offset + i * tp * dp ...); relays (on unless --no-relay) spread the "
                        "trainer's sends over them, and the report also gives the plan without relays (default 1)")
    p.add_argument("--preset", choices=["h100", "gb200"], default="gb200",
                   help="cluster figures (default gb200: 72 GPUs per NVLink domain, 900 GB/s NVLink, 50 GB/s "
                        "network per GPU; h100: 8 per node, 450 GB/s, 50 GB/s)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node / NVLink domain (overrides)")
    p.add_argument("--nvlink-GBps", type=float, default=None, help="NVLink GB/s per GPU and direction (overrides)")
    p.add_argument("--net-GBps", type=float, default=None, help="network GB/s per GPU and direction (overrides)")
    p.add_argument("--topology-aware", action="store_true",
                   help="route replicated boxes from a source in the destination's node when one holds them")
    p.add_argument("--relay", action=argparse.BooleanOptionalAction, default=None,
                   help="fan out inside a node: a box several ranks of a node need and no source there holds "
                        "crosses the network once and is relayed over NVLink (default: on with --topology-aware; "
                        "--relay implies --topology-aware). With relays the report also gives the plan without relays beside it")
    p.add_argument("--bucket-mb", type=float, default=1024,
                   help="staging memory per rank per step, MiB (default 1024: a GPU-sized bucket; the demo's "
                        "CPU default is 64)")
    p.add_argument("--dtype", default="bfloat16", help=f"weight dtype: {DTYPE_HELP} (default bfloat16)")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="also write a rank x rank heatmap of who sends how much to whom (PNG; needs matplotlib)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON to this path")
    p.add_argument("--rank", type=int, default=None, metavar="R",
                   help="plan only rank R's share (plan_reshard(..., rank=R): its transfers and schedule, without "
                        "planning the other ranks) and print its figures and timing: layouts, rank plan, schedule, "
                        "peak memory (default: the whole plan)")


def _parse_sizes(text: str, keys: tuple[str, ...], what: str) -> dict[str, int]:
    return parse_sizes(text, keys, f"--{what}", "tp=4,pp=2" if what == "src" else "tp=2,dp=4")


def _load_config(name: str) -> dict:
    from ..presets import CONFIGS, get_config

    if name in CONFIGS:
        return get_config(name)
    try:
        with open(name) as f:
            return json.load(f)
    except OSError:
        raise UsageError(f"--model {name!r}: not a preset ({', '.join(sorted(CONFIGS))}) nor a readable file") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"--model {name!r}: not a JSON config ({e})") from None


def timed_planning(cfg, src_kw: dict, dst_kw: dict, bucket: int, dtype, gpus_per_node: int | None = None,
                   share_rank: int | None = None, relay: bool | None = None, instances: int = 1):
    """Megatron-Core layout (``src_kw``) -> vLLM layout (``dst_kw``): build both, plan, digest, stats, schedule
    and one rank's share of the schedule, each timed. Returns ``(src, dst, plan, stats, schedule, times)``.
    ``gpus_per_node``/``relay``: as ``plan_reshard`` takes them; ``instances``: ``dst`` is that many copies of
    the vLLM layout (``Layout.instances``), their ``instance_groups`` the relay groups."""
    from ..plan import PlanOptions, plan_reshard
    from ..presets import megatron_layout, vllm_layout

    times: dict[str, float] = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        times[name] = time.perf_counter() - t0
        return out

    src = timed("src_layout", lambda: megatron_layout(cfg, **src_kw, dtype=dtype))
    one = timed("dst_layout", lambda: vllm_layout(cfg, **dst_kw, dtype=dtype))
    dst, opts = PlanOptions.for_instances(one, instances, False, gpus_per_node, relay)
    plan = timed("plan", lambda: plan_reshard(src, dst, options=opts))
    timed("digest", lambda: plan.digest)
    st = timed("stats", plan.stats)
    sched = timed("schedule", lambda: plan.schedule(bucket))
    rank = plan.ranks[0] if share_rank is None else share_rank
    timed("one_rank_share", lambda: sched.for_rank(rank))
    return src, dst, plan, st, sched, times


def routing_figures(plan, sched, topo) -> dict:
    """What the topology model says of ``plan`` and its schedule ``sched``: bytes over the network and over
    NVLink, the relays among them, and the predicted time unbucketed (the plan's phases one after the other)
    and scheduled (its steps one after the other, relay steps last)."""
    from .topology import plan_phase_pair_bytes, predict_seconds, schedule_pair_bytes

    st = plan.stats(topo.gpus_per_node)
    bound = predict_seconds(plan_phase_pair_bytes(plan), topo)
    stepped = predict_seconds(schedule_pair_bytes(sched), topo)
    return {
        "net_bytes": st.net_bytes,
        "nvlink_bytes": st.nvlink_bytes,
        "relay_bytes": st.relay_bytes,
        "num_relays": st.num_relays,
        "steps": len(sched.steps),
        "relay_steps": sum(sched.step_phase(i) == 1 for i in range(len(sched.steps))),  # (builds no message)
        "predicted_seconds": {"unbucketed": bound.seconds, "scheduled": stepped.seconds,
                              "bottleneck_rank": stepped.busiest_rank, "bottleneck_port": stepped.busiest_port},
    }


def plan_report(args) -> dict:
    """Build the layouts and the plan of ``triton-reshard plan`` and return the report (times in seconds).

    With relays on (``--relay``, or ``--topology-aware`` alone) it also plans without them (one more planning,
    same layouts) and reports that plan's figures under ``without_relay``.
    """
    from ..presets import model_nbytes
    from .topology import PRESETS, Topology

    cfg = _load_config(args.model)
    dtype = parse_dtype(args.dtype)
    s = _parse_sizes(args.src, _SRC_KEYS, "src")
    d = _parse_sizes(args.dst, _DST_KEYS, "dst")
    _check_plan_args(args, cfg, s)
    base = PRESETS[args.preset]
    topo = Topology(
        gpus_per_node=args.gpus_per_node or base.gpus_per_node,
        nvlink_GBps=args.nvlink_GBps or base.nvlink_GBps,
        net_GBps=args.net_GBps or base.net_GBps,
        step_latency_s=base.step_latency_s,
    )
    src_kw, dst_kw, bucket = _plan_kwargs(args, s, d)
    relay = args.relay
    node_aware = bool(args.topology_aware or relay)
    n_inst = args.instances
    if n_inst < 1:
        raise UsageError(f"--instances {n_inst}: must be >= 1")
    gpn = topo.gpus_per_node if node_aware else None
    if args.rank is not None:
        return rank_report(args, cfg, dtype, s, d, src_kw, dst_kw, bucket, gpn, relay, n_inst)
    src, dst, plan, st, sched, times = timed_planning(
        cfg, src_kw, dst_kw, bucket, dtype, gpus_per_node=gpn, relay=relay, instances=n_inst
    )
    relayed = (node_aware or n_inst > 1) and relay is not False
    figures = routing_figures(plan, sched, topo)
    figures["trainer_sent_bytes"] = _trainer_sent(st, src.ranks)
    without = _without_relay(src, dst, gpn, bucket, topo, times) if relayed else None
    if args.plot:
        from .plot import plot_traffic

        plot_traffic(plan, args.plot, f"triton-reshard plan --model {args.model}",
                     f"megatron {args.src} -> vllm {args.dst}" + (f" x {n_inst}" if n_inst > 1 else ""))
    head = {"model": args.model, "dtype": args.dtype, "model_bytes": model_nbytes(cfg, dtype),
            "src": {"layout": "megatron", **s, "offset": args.src_offset, "ranks": len(src.ranks),
                    "fragments": len(src.fragments)},
            "dst": {"layout": "vllm", **d, "offset": args.dst_offset, "ranks": len(dst.ranks),
                    "fragments": len(dst.fragments), "instances": n_inst},
            "plan_digest": plan.digest, "topology_aware": node_aware, "relay": relayed}
    tail = {**figures, "without_relay": without, "times": times}
    return _plan_figures(head, plan, st, {"bucket_bytes": bucket, "steps": len(sched.steps)}, topo, args.preset, tail)


def _check_plan_args(args, cfg: dict, s: dict) -> None:
    """``triton-reshard plan``'s option checks that need no planning (a UsageError naming the option)."""
    layers = cfg.get("num_hidden_layers")
    if isinstance(layers, int) and s.get("pp", 1) > layers:
        raise UsageError(f"--src {args.src}: pp={s['pp']} is more pipeline stages than the model's {layers} decoder "
                         f"layers (pp must be <= {layers})")
    if args.bucket_mb <= 0:
        raise UsageError(f"--bucket-mb {args.bucket_mb:g}: must be > 0")
    for opt in ("gpus_per_node", "nvlink_GBps", "net_GBps"):
        v = getattr(args, opt)
        if v is not None and v <= 0:
            raise UsageError(f"--{opt.replace('_', '-')} {v:g}: must be > 0")
    if args.src_offset < 0 or args.dst_offset < 0:
        raise UsageError("--src-offset and --dst-offset must be >= 0")
    if args.rank is not None and (args.plot or args.rank < 0):
        raise UsageError(f"--rank {args.rank}: " + ("--plot needs the whole plan (drop --rank)" if args.plot
                                                    else "must be >= 0"))
    check_outputs(args)


def _plan_kwargs(args, s: dict, d: dict) -> tuple[dict, dict, int]:
    """The keyword arguments of megatron_layout and vllm_layout, and the bucket bytes (checked against the
    executor's one minimum, a staging slot, before any planning)."""
    from ..plan import StepBudget

    src_kw = dict(tp=s.get("tp", 1), pp=s.get("pp", 1), dp=s.get("dp", 1), ep=s.get("ep", 1), etp=s.get("etp"),
                  ranks=args.src_offset)
    if args.src_layers_per_stage:
        try:
            src_kw["layers_per_stage"] = tuple(int(x) for x in args.src_layers_per_stage.split(","))
        except ValueError:
            raise UsageError(f"--src-layers-per-stage {args.src_layers_per_stage!r}: expected comma-separated "
                             f"whole numbers, one per pipeline stage, e.g. '7,8,8,9'") from None
    dst_kw = dict(tp=d.get("tp", 1), dp=d.get("dp", 1), enable_expert_parallel=d.get("ep", 1) > 1,
                  ranks=args.dst_offset)
    bucket = int(args.bucket_mb * (1 << 20))
    try:
        StepBudget.of(bucket, who=f"--bucket-mb {args.bucket_mb:g}")
    except ValueError as e:
        raise UsageError(str(e)) from None
    return src_kw, dst_kw, bucket


def _without_relay(src, dst, gpn: int | None, bucket: int, topo, times: dict) -> dict:
    """The figures of the same layouts planned without relays (``times["plan_without_relay"]`` is set)."""
    from ..plan import plan_reshard

    t0 = time.perf_counter()
    plain = plan_reshard(src, dst, False, gpn, False)
    times["plan_without_relay"] = time.perf_counter() - t0
    without = routing_figures(plain, plain.schedule(bucket), topo)
    without["plan_digest"] = plain.digest
    without["trainer_sent_bytes"] = _trainer_sent(plain.stats(), src.ranks)
    ps = plain.stats()
    without["max_sent_bytes"], without["max_recv_bytes"] = ps.max_sent_bytes, ps.max_recv_bytes
    return without


def _plan_figures(head: dict, plan, st, schedule: dict, topo, preset: str, tail: dict) -> dict:
    """The report: ``head`` (what was planned), the plan's traffic figures, then ``tail`` (routing figures,
    ``without_relay``, ``times``), in the order the JSON has always had."""
    from .topology import plan_pair_bytes

    pairs = plan_pair_bytes(plan)
    sent, recv = st.sent_bytes, st.recv_bytes
    busiest = sorted(plan.ranks, key=lambda r: (-max(sent.get(r, 0), recv.get(r, 0)), r))
    link = max(pairs.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]), default=((None, None), 0))
    return {
        **head,
        "wire_bytes": st.wire_bytes,
        "lower_bound_bytes": st.lower_bound_bytes,
        "local_bytes": st.local_bytes,
        "num_transfers": st.num_transfers,
        "num_local_copies": st.num_local_copies,
        "sent_bytes": sent,
        "recv_bytes": recv,
        "busiest_ranks": [{"rank": r, "sent": sent.get(r, 0), "recv": recv.get(r, 0)} for r in busiest[:5]],
        "busiest_link": {"src": link[0][0], "dst": link[0][1], "bytes": link[1]},
        "schedule": schedule,
        "topology": {"preset": preset, "gpus_per_node": topo.gpus_per_node, "nvlink_GBps": topo.nvlink_GBps,
                     "net_GBps": topo.net_GBps, "step_latency_s": topo.step_latency_s},
        **tail,
    }


def _rss_mb(field: str = "VmRSS") -> float | None:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``) in MiB; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rank_report(args, cfg, dtype, s, d, src_kw, dst_kw, bucket, gpn, relay, n_inst) -> dict:
    """``triton-reshard plan --rank R``: rank R's share alone (layouts, rank plan, its schedule), timed."""
    from ..plan import PlanOptions, plan_reshard
    from ..presets import megatron_layout, vllm_layout

    rss0 = _rss_mb()
    times: dict[str, float] = {}
    t = time.perf_counter()
    src = megatron_layout(cfg, **src_kw, dtype=dtype)
    times["src_layout"] = time.perf_counter() - t
    t = time.perf_counter()
    one = vllm_layout(cfg, **dst_kw, dtype=dtype)
    # the engine copies (a virtual tiling of the columnar preset layout) and their relay groups
    dst, opts = PlanOptions.for_instances(one, n_inst, False, gpn, relay)
    times["dst_layout"] = time.perf_counter() - t
    world = max(src.ranks[-1], dst.ranks[-1]) + 1
    if args.rank >= world:
        raise UsageError(f"--rank {args.rank}: the layouts have ranks 0..{world - 1}")
    t = time.perf_counter()
    rp = plan_reshard(src, dst, options=opts, rank=args.rank)
    times["plan"] = time.perf_counter() - t
    t = time.perf_counter()
    sched = rp.schedule(bucket)
    times["schedule"] = time.perf_counter() - t
    times["total"] = sum(times.values())
    peak = _rss_mb("VmHWM")
    return {
        "model": args.model, "dtype": args.dtype, "rank": args.rank, "world": world,
        "src": {"layout": "megatron", **s, "offset": args.src_offset, "ranks": len(src.ranks)},
        "dst": {"layout": "vllm", **d, "offset": args.dst_offset, "ranks": len(dst.ranks), "instances": n_inst},
        "rank_plan_digest": rp.digest,
        "num_transfers": len(rp.transfers), "num_local_copies": len(rp.local_copies),
        "sent_bytes": rp.sent_bytes, "recv_bytes": rp.recv_bytes,
        "local_bytes": sum(x.nbytes for x in rp.local_copies),
        "schedule": {"bucket_bytes": bucket, "steps": len(sched.steps)},
        "rss_mb_before": rss0, "peak_rss_mb": peak,
        "peak_above_start_mb": None if rss0 is None or peak is None else peak - rss0,
        "times": times,
    }


def _print_rank_report(r: dict) -> None:
    s, d, t = r["src"], r["dst"], r["times"]

    def lay(x):
        return ",".join(f"{k}={v}" for k, v in x.items() if k in _SRC_KEYS)

    inst = d.get("instances", 1)
    print(f"model {r['model']} ({r['dtype']}): rank {r['rank']} of {r['world']}; source megatron {lay(s)} on ranks "
          f"{s['offset']}..{s['offset'] + s['ranks'] - 1}, destination vllm {lay(d)}"
          f"{f' x {inst} instances' if inst > 1 else ''} on ranks {d['offset']}..{d['offset'] + d['ranks'] - 1}")
    print(f"rank plan {r['rank_plan_digest']}: {r['num_transfers']} wire transfers (sends "
          f"{_fmt_bytes(r['sent_bytes'])}, receives {_fmt_bytes(r['recv_bytes'])}), {r['num_local_copies']} local "
          f"copies ({_fmt_bytes(r['local_bytes'])}); {r['schedule']['steps']} steps of "
          f"{r['schedule']['bucket_bytes'] / (1 << 20):g} MiB staging")
    mem = (f"; peak memory {r['peak_above_start_mb']:.0f} MiB above the process's before the layouts"
           if r.get("peak_above_start_mb") is not None else "")
    print(f"rank share time:  {t['total']:.2f} s = layouts {t['src_layout'] + t['dst_layout']:.2f} s (src "
          f"{t['src_layout']:.2f}, dst {t['dst_layout']:.2f}), rank plan {t['plan']:.2f} s, its schedule "
          f"{t['schedule']:.2f} s{mem}")


def _trainer_sent(st, src_ranks) -> dict:
    """Bytes the training (source) ranks send: the busiest one's and all of them together."""
    sent = [st.sent_bytes.get(r, 0) for r in src_ranks]
    return {"max": max(sent, default=0), "total": sum(sent)}


def _print_report(r: dict) -> None:
    def summary(d: dict) -> str:
        v = sorted(d.values())
        return f"min {_fmt_bytes(v[0])}, median {_fmt_bytes(statistics.median(v))}, max {_fmt_bytes(v[-1])}"

    s, d, t, p = r["src"], r["dst"], r["times"], r["predicted_seconds"]
    def lay(x):
        return ",".join(f"{k}={v}" for k, v in x.items() if k in _SRC_KEYS)

    print(f"model {r['model']} ({r['dtype']}, {_fmt_bytes(r['model_bytes'])} of weights)")
    print(f"source      megatron {lay(s)} on ranks {s['offset']}..{s['offset'] + s['ranks'] - 1} "
          f"({s['fragments']} fragments)")
    inst = d.get("instances", 1)
    print(f"destination vllm {lay(d)}{f' x {inst} instances' if inst > 1 else ''} on ranks "
          f"{d['offset']}..{d['offset'] + d['ranks'] - 1} ({d['fragments']} fragments)")
    ratio = r["wire_bytes"] / max(1, r["lower_bound_bytes"])
    tag = (" (topology-aware, relay)" if r["relay"] and r["topology_aware"] else " (relay)" if r["relay"]
           else " (topology-aware)" if r["topology_aware"] else "")
    print(f"plan {r['plan_digest']}{tag}: "
          f"{r['num_transfers']} wire transfers, {_fmt_bytes(r['wire_bytes'])} on the wire = {ratio:.3f} x the "
          f"lower bound {_fmt_bytes(r['lower_bound_bytes'])}; {r['num_local_copies']} local copies "
          f"({_fmt_bytes(r['local_bytes'])})")
    print(f"per-rank send:    {summary(r['sent_bytes'])}")
    print(f"per-rank receive: {summary(r['recv_bytes'])}")
    print("busiest ranks:    " + "; ".join(
        f"{b['rank']} (send {_fmt_bytes(b['sent'])}, recv {_fmt_bytes(b['recv'])})" for b in r["busiest_ranks"]))
    ts = r["trainer_sent_bytes"]
    print(f"trainer send:     busiest rank {_fmt_bytes(ts['max'])}, all trainer ranks {_fmt_bytes(ts['total'])}")
    bl = r["busiest_link"]
    print(f"busiest link:     rank {bl['src']} -> rank {bl['dst']}: {_fmt_bytes(bl['bytes'])}")
    tp = r["topology"]
    print(f"topology {tp['preset']}: {tp['gpus_per_node']} GPUs per node, NVLink {tp['nvlink_GBps']:g} GB/s, "
          f"network {tp['net_GBps']:g} GB/s per GPU and direction, {tp['step_latency_s'] * 1e6:g} us per step; "
          f"{_fmt_bytes(r['nvlink_bytes'])} over NVLink, {_fmt_bytes(r['net_bytes'])} over the network")
    print(f"predicted refit:  {_fmt_seconds(p['scheduled'])} in {r['schedule']['steps']} steps of "
          f"{r['schedule']['bucket_bytes'] / (1 << 20):g} MiB staging (unbucketed {_fmt_seconds(p['unbucketed'])}); "
          f"bottleneck rank {p['bottleneck_rank']} ({p['bottleneck_port']})")
    if r["relay"]:
        print(f"relays:           {r['num_relays']} ({_fmt_bytes(r['relay_bytes'])}, in "
              f"{r['relay_steps']} steps after the others)")
    w = r.get("without_relay")
    if w:
        wp = w["predicted_seconds"]
        print(f"without relay:    {_fmt_bytes(w['net_bytes'])} over the network (with: "
              f"{_fmt_bytes(r['net_bytes'])}), {_fmt_bytes(w['nvlink_bytes'])} over NVLink (with: "
              f"{_fmt_bytes(r['nvlink_bytes'])}); predicted {_fmt_seconds(wp['scheduled'])} in {w['steps']} steps "
              f"(unbucketed {_fmt_seconds(wp['unbucketed'])}) vs {_fmt_seconds(p['scheduled'])} with relays")
        wt = w["trainer_sent_bytes"]
        print(f"                  trainer send: busiest rank {_fmt_bytes(wt['max'])} (with: {_fmt_bytes(ts['max'])}), "
              f"all {_fmt_bytes(wt['total'])} (with: {_fmt_bytes(ts['total'])}); busiest rank send "
              f"{_fmt_bytes(w['max_sent_bytes'])}, receive {_fmt_bytes(w['max_recv_bytes'])}")
    print(f"planning time:    layouts {t['src_layout'] + t['dst_layout']:.2f} s (src {t['src_layout']:.2f}, "
          f"dst {t['dst_layout']:.2f}), plan {t['plan']:.2f} s, stats {t['stats']:.2f} s, schedule "
          f"{t['schedule']:.2f} s, one rank's share of the schedule {t['one_rank_share'] * 1e3:.1f} ms")


def run_plan(args) -> int:
    import gc

    from ..layout import gc_paused

    try:
        with gc_paused():  # one command over millions of acyclic plan objects: the collector's passes only cost
            r = plan_report(args)
            gc.freeze()  # and once it is back on, its first full pass over them would cost ~0.7 s at 128 ranks
    except UsageError:
        raise
    except (ValueError, TypeError) as e:  # an impossible layout: say why, without a traceback
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "layers_per_stage" in text:  # the preset names its own argument: name the option instead
            text = text.split("; pass layers_per_stage")[0] + "; give each stage's layer count with --src-layers-per-stage"
        raise UsageError(text) from None
    if "rank_plan_digest" in r:
        _print_rank_report(r)
    else:
        _print_report(r)
    if args.plot:
        print(f"traffic heatmap written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
