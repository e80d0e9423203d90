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
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys

import torch

from triton_reshard.plan import plan_reshard
from triton_reshard.presets import get_config, model_spec
from triton_reshard.tools.cli import timed_planning

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma list of preset configs")
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma list of 8, 32, 128")
    p.add_argument("--repeats", type=int, default=1, help="runs per case; the best is kept (default 1)")
    p.add_argument("--out", default=None, help="write the results as JSON to this path")
    args = p.parse_args(argv)
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
        meta = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
                "bucket_bytes": BUCKET}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
