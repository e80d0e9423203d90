"""Benchmark of the planner: layout construction, planning, digest, stats, schedule, one rank's share.

For each preset config (``triton_reshard.presets.CONFIGS``) and world size, a typical refit pair: a
Megatron-Core training layout (TP x PP x DP, experts EP x ETP=1 for MoE) to a vLLM inference layout on the
same ranks (TP x DP, expert parallel for MoE):

=======  ==================================  ==========================
ranks    Megatron (source)                   vLLM (destination)
=======  ==================================  ==========================
8        tp=2, pp=2, dp=2 (ep=2, etp=1)      tp=4, dp=2 (EP for MoE)
32       tp=4, pp=2, dp=4 (ep=8, etp=1)      tp=8, dp=4
128      tp=4, pp=2, dp=16 (ep=8, etp=1)     tp=8, dp=16
=======  ==================================  ==========================

``deepseek-v3`` (61 layers, 256 routed + 1 shared expert, MLA) runs at 128 ranks only, with the shape of a real
DeepSeek-V3 RL refit on 16 nodes of 8 GPUs:

* Megatron TP2 x PP8 x DP8, EP16 x ETP1: each stage's 16 ranks split the 256 experts (16 per rank, ~11 GB of
  bf16 experts per rank); 61 layers do not split evenly, so the first stage (embedding) gets 7 and the last
  (output layer, and the MTP layer in a real run) 6, like Megatron's ``decoder_first/last_pipeline_num_layers``.
* vLLM TP8 x DP16 with expert parallel (one TP8 replica per node, "wide EP" over all 128 workers: 2 experts per
  worker; the shared experts replicated under vLLM's sequence-parallel MoE).

Seconds of wall time per stage (best of ``--repeats``; each repeat builds everything again, nothing cached),
written as JSON plus a table.

    python perf/bench_planner.py --out perf/results/bench_planner.json
    python perf/bench_planner.py --models qwen3-235b-a22b --worlds 128
    python perf/bench_planner.py --models deepseek-v3 --worlds 128

``--scaling`` (issue 13): DeepSeek-V3 from 128 to 1,024 ranks, each measurement in a fresh process pinned to
one core, nothing cached:

* **rank share**: what one rank computes for itself, ``megatron_layout`` + ``vllm_layout`` + ``plan_reshard(...,
  rank=r)`` + its schedule, timed after ``import torch, triton_reshard``; its memory is the peak RSS of the
  process minus its RSS once those are imported (``VmHWM`` - ``VmRSS``). Targets: < 1 s and < 100 MB at 1,024
  ranks, < 0.3 s at 128 -> 128.
* **whole plan**: the layouts, ``plan_reshard`` of every rank, its stats, schedule and predicted refit time
  (``topology``, H100 preset). Targets: < 60 s at 1,024 ranks, < 5 s at 128 -> 128.

Cases (``SCALING``): ``w1024`` Megatron TP8 x PP16 (3, 14 x 4, 2 layers) x DP8, EP64 -> 8 instances of vLLM TP8 x
DP16 EP, and the same family at 128 / 256 / 512 ranks (DP1 / 2 / 4, EP8 / 16 / 32, 1 / 2 / 4 instances);
``t128`` the 128 -> 128 pair above (Megatron TP2 x PP8 x DP8 EP16 -> vLLM TP8 x DP16 EP).

    python perf/bench_planner.py --scaling --out perf/results/bench_planner_scaling.json \
        --plot perf/results/bench_planner_scaling.png
    python perf/bench_planner.py --scaling --cases t128,w1024 --ranks 0,-1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

import torch

from triton_reshard.plan import plan_reshard
from triton_reshard.presets import get_config, model_spec
from triton_reshard.tools.cli import timed_planning
from triton_reshard.tools.cliutil import UsageError, check_output_file

MODELS = ("llama-3-8b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")
WORLDS = (8, 32, 128)
PAIRS = {  # world -> (Megatron tp, pp, dp, ep), (vLLM tp, dp)
    8: ((2, 2, 2, 2), (4, 2)),
    32: ((4, 2, 4, 8), (8, 4)),
    128: ((4, 2, 16, 8), (8, 16)),
}
MODEL_PAIRS = {  # model -> world -> (Megatron kwargs, vLLM kwargs), instead of PAIRS (see the module doc)
    "deepseek-v3": {
        128: (dict(tp=2, pp=8, dp=8, ep=16, etp=1, layers_per_stage=(7, 8, 8, 8, 8, 8, 8, 6)),
              dict(tp=8, dp=16, enable_expert_parallel=True)),
    },
}
BUCKET = 1 << 30


def case_kwargs(model: str, world: int) -> tuple[dict, dict] | None:
    """(Megatron, vLLM) keyword arguments of the benchmark pair, None where the model is not run at ``world``."""
    if model in MODEL_PAIRS:
        pair = MODEL_PAIRS[model].get(world)
        return None if pair is None else (dict(pair[0]), dict(pair[1]))
    moe = any(model_spec(get_config(model)).moe_layers)
    (tp, pp, dp, ep), (vtp, vdp) = PAIRS[world]
    return (dict(tp=tp, pp=pp, dp=dp, ep=ep if moe else 1, etp=1 if moe else None),
            dict(tp=vtp, dp=vdp, enable_expert_parallel=moe))


def _describe(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items() if v not in (None, False) and k != "layers_per_stage")


def bench_case(model: str, world: int) -> dict:
    cfg = get_config(model)
    src_kw, dst_kw = case_kwargs(model, world)
    plan_reshard.cache_clear()
    src, dst, plan, st, sched, times = timed_planning(
        cfg,
        {**src_kw, "ranks": range(world)},
        {**dst_kw, "ranks": range(world)},
        BUCKET,
        torch.bfloat16,
        share_rank=world - 1,
    )
    times["total"] = sum(times.values())
    return {
        "model": model,
        "world": world,
        "src": "megatron " + _describe(src_kw),
        "dst": "vllm " + _describe(dst_kw).replace("enable_expert_parallel=True", "ep"),
        "src_fragments": len(src.fragments),
        "dst_fragments": len(dst.fragments),
        "wire_transfers": len(plan.transfers),
        "local_copies": len(plan.local_copies),
        "steps": len(sched.steps),
        "wire_bytes": st.wire_bytes,
        "lower_bound_bytes": st.lower_bound_bytes,
        "digest": plan.digest,
        "seconds": times,
    }


def table(rows: list[dict]) -> str:
    cols = ("src_layout", "dst_layout", "plan", "digest", "stats", "schedule", "one_rank_share", "total")
    head = f"{'model':16s} {'ranks':>5s} {'frags src/dst':>15s} {'transfers':>9s} " + " ".join(
        f"{c[:10]:>10s}" for c in cols)
    lines = [head, "-" * len(head)]
    for r in rows:
        frags = f"{r['src_fragments']}/{r['dst_fragments']}"
        lines.append(f"{r['model']:16s} {r['world']:5d} {frags:>15s} {r['wire_transfers'] + r['local_copies']:9d} "
                     + " ".join(f"{r['seconds'][c]:10.3f}" for c in cols))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# Scaling to 1,024 ranks (issue 13): each measurement in a fresh process
# --------------------------------------------------------------------------------------------------------

_DS_STAGES16 = (3,) + (4,) * 14 + (2,)
SCALING = {  # case -> (Megatron kwargs, vLLM kwargs incl. instances)
    **{f"w{128 * k}": (dict(tp=8, pp=16, dp=k, ep=8 * k, etp=1, layers_per_stage=_DS_STAGES16),
                       dict(tp=8, dp=16, enable_expert_parallel=True, instances=k)) for k in (1, 2, 4, 8)},
    "t128": (dict(MODEL_PAIRS["deepseek-v3"][128][0]), dict(MODEL_PAIRS["deepseek-v3"][128][1])),
}
SCALING_MODEL = "deepseek-v3"
SCALING_BUCKET = 1 << 30


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _process_age() -> float:
    """Seconds since this process started (interpreter start and imports included)."""
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        up = float(f.read().split()[0])
    return up - start / os.sysconf("SC_CLK_TCK")


def _layouts(case: str):
    from triton_reshard.presets import megatron_layout, vllm_layout

    cfg = get_config(SCALING_MODEL)
    src_kw, dst_kw = SCALING[case]
    world = src_kw["tp"] * src_kw["pp"] * src_kw["dp"]
    src = megatron_layout(cfg, **src_kw, ranks=range(world), dtype=torch.bfloat16)
    dst = vllm_layout(cfg, **dst_kw, ranks=0, dtype=torch.bfloat16)
    return src, dst


def child_share(case: str, rank: int) -> dict:
    """One rank's share, in this (fresh) process: layouts, rank plan, its schedule."""
    started = _process_age()
    rss0 = _status_mb("VmRSS")
    c0 = time.process_time()
    t0 = time.perf_counter()
    src, dst = _layouts(case)
    t1, c1 = time.perf_counter(), time.process_time()
    world = max(src.ranks[-1], dst.ranks[-1]) + 1
    r = rank % world
    rp = plan_reshard(src, dst, rank=r)
    t2, c2 = time.perf_counter(), time.process_time()
    sched = rp.schedule(SCALING_BUCKET)
    t3, c3 = time.perf_counter(), time.process_time()
    return {"kind": "share", "case": case, "world": world, "rank": r,
            "seconds": {"layouts": t1 - t0, "plan": t2 - t1, "schedule": t3 - t2, "total": t3 - t0,
                        "process_start_and_import": started},
            "cpu_seconds": c3 - c0, "cpu": {"layouts": c1 - c0, "plan": c2 - c1, "schedule": c3 - c2},
            "rss_after_import_mb": rss0, "peak_rss_mb": _status_mb("VmHWM"),
            "peak_above_import_mb": _status_mb("VmHWM") - rss0,
            "transfers": len(rp.transfers), "local_copies": len(rp.local_copies),
            "sent_bytes": rp.sent_bytes, "recv_bytes": rp.recv_bytes, "steps": len(sched.steps),
            "digest": rp.digest}


def child_whole(case: str) -> dict:
    """The whole plan, in this (fresh) process: layouts, plan, stats, schedule, predicted refit time."""
    from triton_reshard.tools.topology import PRESETS, predict_seconds, schedule_pair_bytes

    started = _process_age()
    rss0 = _status_mb("VmRSS")
    c0 = time.process_time()
    times, cpu = {}, {}

    def timed(name, fn):
        t, c = time.perf_counter(), time.process_time()
        out = fn()
        times[name], cpu[name] = time.perf_counter() - t, time.process_time() - c
        return out

    src, dst = timed("layouts", lambda: _layouts(case))
    plan = timed("plan", lambda: plan_reshard(src, dst))
    st = timed("stats", plan.stats)
    sched = timed("schedule", lambda: plan.schedule(SCALING_BUCKET))
    pred = timed("predict", lambda: predict_seconds(schedule_pair_bytes(sched), PRESETS["h100"]))
    times["total"] = sum(times.values())
    times["process_start_and_import"] = started
    world = max(src.ranks[-1], dst.ranks[-1]) + 1
    return {"kind": "whole", "case": case, "world": world, "seconds": times,
            "cpu_seconds": time.process_time() - c0, "cpu": cpu, "rss_after_import_mb": rss0,
            "peak_above_import_mb": _status_mb("VmHWM") - rss0,
            "transfers": len(plan.transfers), "local_copies": len(plan.local_copies), "steps": len(sched.steps),
            "wire_bytes": st.wire_bytes, "lower_bound_bytes": st.lower_bound_bytes,
            "predicted_seconds_h100": pred.seconds, "digest": plan.digest}


def _run_child(args: list[str], timeout: float, core: int | None) -> dict:
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--child", *args]
    if core is not None and hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", str(core), *cmd] if _have_taskset() else cmd
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode or not lines:
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def _have_taskset() -> bool:
    import shutil

    return shutil.which("taskset") is not None


def scaling(cases: list[str], ranks: list[int], whole: bool, timeout: float, core: int | None) -> list[dict]:
    rows = []
    for case in cases:
        for r in ranks:
            row = _run_child(["share", case, str(r)], timeout, core)
            row.setdefault("case", case)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if whole:
            row = _run_child(["whole", case], timeout, core)
            row.setdefault("case", case)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def scaling_table(rows: list[dict]) -> str:
    """Markdown: per case the slower rank share and the whole plan, CPU seconds per phase (wall beside)."""
    def ph(r, keys):
        c = r.get("cpu") or {}
        return " / ".join(f"{c.get(k, r['seconds'].get(k, float('nan'))):.2f}" for k in keys)

    lines = ["| case | ranks | rank share CPU s (layouts / plan / schedule) | share wall s | share peak MB |"
             " whole plan CPU s (layouts / plan / stats / schedule / predict) | whole wall s | whole peak MB |"
             " steps, predicted refit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in dict.fromkeys(r["case"] for r in rows):
        share = [r for r in rows if r["case"] == case and r.get("kind") == "share"]
        whole = [r for r in rows if r["case"] == case and r.get("kind") == "whole"]
        err = [r["error"] for r in rows if r["case"] == case and "error" in r]
        w = (whole or [None])[0]
        if share:
            x = max(share, key=lambda r: r["cpu_seconds"])
            sh = (f"**{x['cpu_seconds']:.2f}** ({ph(x, ('layouts', 'plan', 'schedule'))}), rank {x['rank']} | "
                  f"{x['seconds']['total']:.2f} | {max(r['peak_above_import_mb'] for r in share):.0f}")
            world = x["world"]
        else:
            sh, world = "n/a | n/a | n/a", w["world"] if w else "?"
        if w:
            wh = (f"**{w['cpu_seconds']:.1f}** ({ph(w, ('layouts', 'plan', 'stats', 'schedule', 'predict'))}) | "
                  f"{w['seconds']['total']:.1f} | {w['peak_above_import_mb']:.0f} | {w['steps']}, "
                  f"{w['predicted_seconds_h100'] * 1e3:.0f} ms")
        else:
            wh = f"{err[-1] if err else 'not run'} | | | "
        lines.append(f"| {case} | {world} | {sh} | {wh} |")
    return "\n".join(lines)


def plot_scaling(rows: list[dict], path: str) -> str:
    """CPU seconds and peak MB of the rank share and of the whole plan against the world size (log-log); rows
    of kind "before" (the same measurements of an older version, if given) as a third series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fam = sorted((r for r in rows if r.get("case", "").startswith("w") and "cpu_seconds" in r), key=lambda r: r["world"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind, style, label in (("share", "o-", "one rank's share"), ("whole", "s--", "whole plan"),
                               ("before", "^:", "before issue 13: whole plan (= a rank's share then)")):
        pts = {}
        for r in fam:
            if r["kind"] == kind:
                prev = pts.get(r["world"])
                if prev is None or r["cpu_seconds"] > prev["cpu_seconds"]:
                    pts[r["world"]] = r
        xs = sorted(pts)
        if not xs:
            continue
        ax.plot(xs, [pts[x]["cpu_seconds"] for x in xs], style, label=label)
        bx.plot(xs, [pts[x]["peak_above_import_mb"] for x in xs], style, label=label)
    ax.axhline(1.0, color="tab:blue", lw=0.8, ls=":", label="share target 1 s")
    ax.axhline(60.0, color="tab:orange", lw=0.8, ls=":", label="whole target 60 s")
    bx.axhline(100.0, color="tab:blue", lw=0.8, ls=":", label="share target 100 MB")
    for a, yl in ((ax, "CPU seconds (one core)"), (bx, "peak RSS above post-import RSS, MB")):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("ranks (trainer = engines, colocated)")
        a.set_ylabel(yl)
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle("DeepSeek-V3 Megatron TP8xPP16xDP(k) EP(8k) -> k x vLLM TP8xDP16 EP, k = 1, 2, 4, 8", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _run_meta() -> dict:
    """The command, date and load of this run, for perf/results_page.py."""
    return {"argv": ["perf/bench_planner.py", *sys.argv[1:]], "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma list of preset configs")
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma list of 8, 32, 128")
    p.add_argument("--repeats", type=int, default=1, help="runs per case; the best is kept (default 1)")
    p.add_argument("--out", default=None, help="write the results as JSON to this path")
    p.add_argument("--scaling", action="store_true", help="DeepSeek-V3 128 -> 1,024 ranks, fresh processes (see above)")
    p.add_argument("--cases", default="w128,w256,w512,w1024,t128", help="--scaling cases (SCALING keys)")
    p.add_argument("--ranks", default="0,-1", help="--scaling: ranks whose share is measured (negative: from the end)")
    p.add_argument("--no-whole", action="store_true", help="--scaling: rank shares only")
    p.add_argument("--timeout", type=float, default=600, help="--scaling: seconds per measurement (default 600)")
    p.add_argument("--core", type=int, default=0, help="--scaling: pin each process to this core (taskset)")
    p.add_argument("--plot", default=None, help="--scaling: write the scaling plot (PNG) to this path")
    p.add_argument("--child", nargs="+", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:  # before any work: an output path that cannot be written is one line, exit 2
        check_output_file(args.out, '--out', make_folder=True)
        check_output_file(args.plot, '--plot')
    except UsageError as e:
        p.error(str(e))
    if args.child:
        kind, case, *rest = args.child
        out = child_share(case, int(rest[0])) if kind == "share" else child_whole(case)
        print(json.dumps(out))
        return 0
    if args.scaling:
        rows = scaling([c for c in args.cases.split(",") if c], [int(r) for r in args.ranks.split(",") if r],
                       not args.no_whole, args.timeout, args.core)
        print(scaling_table(rows))
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            meta = {**_run_meta(), "python": platform.python_version(), "machine": platform.machine(),
                    "cpus": os.cpu_count(), "bucket_bytes": SCALING_BUCKET, "model": SCALING_MODEL, "cases": {k: [repr(a), repr(b)] for k, (a, b)
                                                                                       in SCALING.items()}}
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "results": rows}, f, indent=1)
        if args.plot:
            print(f"plot written to {plot_scaling(rows, args.plot)}")
        return 0
    rows = []
    for model in filter(None, args.models.split(",")):
        for world in (int(w) for w in args.worlds.split(",") if w):
            if case_kwargs(model, world) is None:
                print(f"{model}: not run at {world} ranks (see MODEL_PAIRS)", file=sys.stderr)
                continue
            best = None
            for _ in range(max(1, args.repeats)):
                r = bench_case(model, world)
                gc.collect()
                if best is None or r["seconds"]["total"] < best["seconds"]["total"]:
                    best = r
            rows.append(best)
            s = best["seconds"]
            print(f"{model} x{world}: total {s['total']:.2f} s (layouts {s['src_layout'] + s['dst_layout']:.2f}, "
                  f"plan {s['plan']:.2f}, stats {s['stats']:.2f}, schedule {s['schedule']:.2f})", flush=True)
    print(table(rows))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        meta = {**_run_meta(), "python": platform.python_version(), "machine": platform.machine(),
                "cpus": os.cpu_count(), "bucket_bytes": BUCKET}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
