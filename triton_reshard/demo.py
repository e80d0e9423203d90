"""``triton-reshard demo``: reshard a Llama-shaped model between two layouts on a local world, check every
destination element, and compare with the all-gather baseline measured in the same run."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from .baselines import allgather_refit
from .execute import Resharder
from .launch import run_world
from .layout import Layout, box_slices
from .parallel import Parallelism, llama_for_bytes, llama_tensors, parallel_layout
from .plan import plan_reshard
from .testing import synthetic_box

POISON = float("nan")


def _peak_rss_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (peak RSS) on Linux
    except OSError:
        pass


def _proc_status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (``VmHWM``: peak RSS, ``VmRSS``: RSS) in bytes; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _peak_rss() -> int:
    return _proc_status_bytes("VmHWM")


def _rss() -> int:
    return _proc_status_bytes("VmRSS")


def preset_layouts(src_text: str, dst_text: str, size_bytes: int, dtype: torch.dtype,
                   config: str = "llama_demo") -> tuple[Layout, Layout, dict]:
    """Megatron-Core training layout (TP x PP x DP) -> vLLM inference layout (TP x DP) of a Llama-3-like
    preset config, with the layer count scaled to about ``size_bytes``."""
    from .presets import get_config, megatron_layout, model_nbytes, vllm_layout

    sp, dp_ = Parallelism.parse(src_text), Parallelism.parse(dst_text)
    if dp_.pp > 1:
        raise ValueError("the vLLM preset has no pipeline parallelism: use tp and dp on the inference side")
    cfg = get_config(config)
    one, two = ({**cfg, "num_hidden_layers": n} for n in (1, 2))
    per_layer = model_nbytes(two, dtype) - model_nbytes(one, dtype)
    fixed = model_nbytes(one, dtype) - per_layer
    layers = max(1, round((size_bytes - fixed) / per_layer / sp.pp)) * sp.pp
    cfg["num_hidden_layers"] = layers
    src = megatron_layout(cfg, tp=sp.tp, pp=sp.pp, dp=sp.dp, ranks=sp.offset, dtype=dtype)
    dst = vllm_layout(cfg, tp=dp_.tp, dp=dp_.dp, ranks=dp_.offset, dtype=dtype)
    return src, dst, cfg


def build_layouts(args) -> tuple[Layout, Layout, dict]:
    dtype = getattr(torch, args.dtype)
    if args.layouts == "megatron-vllm":
        return preset_layouts(args.src, args.dst, int(args.size_gb * (1 << 30)), dtype)
    cfg = llama_for_bytes(int(args.size_gb * (1 << 30)), dtype)
    tensors = llama_tensors(**cfg)
    src = parallel_layout(tensors, Parallelism.parse(args.src), cfg["layers"], dtype)
    dst = parallel_layout(tensors, Parallelism.parse(args.dst), cfg["layers"], dtype)
    return src, dst, cfg


def _make_src(layout: Layout, rank: int, device) -> dict[str, torch.Tensor]:
    out = layout.allocate(rank, device=device, fill=0)
    for f in layout.fragments:
        if f.rank != rank or not f.numel:
            continue
        spec = layout.specs[f.tensor]
        loff, lsize = f.local_box(f.offsets, f.sizes)
        view = out[f.local][box_slices(loff, lsize)]
        view.copy_(synthetic_box(f.tensor, spec.shape, spec.dtype, f.offsets, f.sizes, device=device).reshape(lsize))
    return out


def _expected(layout: Layout, rank: int, device) -> list[tuple[str, tuple, torch.Tensor]]:
    """Each destination fragment's expected contents, built once (as integer bit patterns)."""
    out = []
    for f in layout.fragments:
        if f.rank != rank or not f.numel:
            continue
        spec = layout.specs[f.tensor]
        loff, lsize = f.local_box(f.offsets, f.sizes)
        exp = synthetic_box(f.tensor, spec.shape, spec.dtype, f.offsets, f.sizes, device=device)
        out.append((f.local, box_slices(loff, lsize),
                    exp.reshape(lsize).view(_int_of(exp.dtype))))
    return out


def _verify(expected, tensors: dict[str, torch.Tensor]) -> int:
    """Number of destination elements that differ from the global tensor (bit-exact)."""
    bad = 0
    for local, sl, exp in expected:
        got = tensors[local][sl]
        got = got.view(_int_of(got.dtype))
        if not torch.equal(got, exp):
            bad += int((got != exp).sum())
    return bad


def _int_of(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]


def _poison(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        if t.dtype.is_floating_point:
            t.fill_(POISON)
        else:
            t.fill_(-1)


def _timed(fn, device) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()  # wall time of the slowest rank
    return time.perf_counter() - t0


def demo_worker(rank: int, world: int, args) -> dict:
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    src, dst, _cfg = build_layouts(args)
    src_t = _make_src(src, rank, device)
    dst_t = dst.allocate(rank, device=device)
    bucket = int(args.bucket_mb * (1 << 20))
    t0 = time.perf_counter()
    plan = plan_reshard(src, dst)
    r = Resharder(plan, bucket_bytes=bucket, timeout=args.timeout, backend=args.backend)
    plan_s = time.perf_counter() - t0
    out: dict = {"rank": rank, "plan_seconds": plan_s}

    expected = _expected(dst, rank, device)
    rss_peaks = []

    def measured(fn):
        _poison(dst_t)
        _peak_rss_reset()
        rss0 = _rss()
        secs = _timed(fn, device)
        rss_peaks.append(_peak_rss() - rss0)
        return secs, _verify(expected, dst_t)

    out["ours_first_seconds"], out["ours_bad"] = measured(lambda: r.run(src_t, dst_t))
    times = []
    for _ in range(args.repeats):
        secs, bad = measured(lambda: r.run(src_t, dst_t))
        times.append(secs)
        out["ours_bad"] += bad
    out["ours_seconds"] = times
    out["ours_peak_extra_rss"] = max(rss_peaks)
    out["ours_staging_bytes"] = r.send_area_bytes + r.recv_area_bytes

    if not args.no_baseline:
        reports, btimes = [], []
        out["base_bad"] = 0
        rss_peaks.clear()
        for _ in range(max(1, args.repeats)):
            secs, bad = measured(lambda: reports.append(allgather_refit(src_t, dst_t, src, dst, timeout=args.timeout)))
            btimes.append(secs)
            out["base_bad"] += bad
        out["base_seconds"] = btimes
        out["base_recv_bytes"] = reports[-1].recv_bytes
        out["base_peak_extra_bytes"] = reports[-1].peak_extra_bytes
        out["base_peak_extra_rss"] = max(rss_peaks)
    return out


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=int, default=8, help="number of ranks to spawn (default 8)")
    p.add_argument("--src", default="tp=4,pp=2", help="training layout, e.g. 'tp=4,pp=2' (default)")
    p.add_argument("--dst", default="tp=2,dp=4", help="inference layout, e.g. 'tp=2,dp=4' (default)")
    p.add_argument("--layouts", choices=["megatron-vllm", "simple"], default="megatron-vllm",
                   help="'megatron-vllm' (default): Megatron-Core training -> vLLM inference formats of a "
                        "Llama-3-like preset; 'simple': DTensor-style shards on HF names")
    p.add_argument("--size-gb", type=float, default=0.5, help="model size in GiB (default 0.5)")
    p.add_argument("--dtype", default="float32", help="weight dtype (default float32)")
    p.add_argument("--bucket-mb", type=float, default=64, help="staging memory per rank per step, MiB (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after the first (default 3)")
    p.add_argument("--backend", choices=["torch", "triton"], default=None, help="copy backend (default: by device)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a missing peer is an error")
    p.add_argument("--no-baseline", action="store_true", help="skip the all-gather baseline")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")


def run_demo(args) -> int:
    need = max(Parallelism.parse(args.src).size + Parallelism.parse(args.src).offset,
               Parallelism.parse(args.dst).size + Parallelism.parse(args.dst).offset)
    if need > args.world:
        raise SystemExit(f"the layouts need {need} ranks; --world is {args.world}")
    src, dst, cfg = build_layouts(args)
    plan = plan_reshard(src, dst)
    st = plan.stats()
    sched = plan.schedule(int(args.bucket_mb * (1 << 20)))
    model_bytes = sum(t.itemsize * torch.Size(t.shape).numel() for t in src.tensors)
    print(f"model: {cfg} {args.dtype}, {_fmt_bytes(model_bytes)} of weights ({args.layouts} layouts)")
    print(f"layouts: {args.src} -> {args.dst} on {args.world} ranks; plan {plan.digest}: "
          f"{st.num_transfers} wire transfers, {st.num_local_copies} local copies, {len(sched.steps)} steps "
          f"of <= {args.bucket_mb:g} MiB")
    print("spawning the world ...", flush=True)
    t0 = time.perf_counter()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = run_world(demo_worker, args.world, args, timeout=max(600.0, 10 * args.timeout))
    elapsed = time.perf_counter() - t0
    ours = statistics.median(max(r["ours_seconds"][i] for r in res) for i in range(args.repeats)) if args.repeats else max(
        r["ours_first_seconds"] for r in res)
    rows = [
        ("reshard (ours)", ours, st.wire_bytes, st.max_recv_bytes,
         max(r["ours_staging_bytes"] for r in res), max(r["ours_peak_extra_rss"] for r in res),
         sum(r["ours_bad"] for r in res)),
    ]
    if not args.no_baseline:
        base = statistics.median(max(r["base_seconds"][i] for r in res) for i in range(max(1, args.repeats)))
        rows.append(("all-gather baseline", base, sum(r["base_recv_bytes"] for r in res),
                     max(r["base_recv_bytes"] for r in res), max(r["base_peak_extra_bytes"] for r in res),
                     max(r["base_peak_extra_rss"] for r in res), sum(r["base_bad"] for r in res)))
    print()
    print(f"{'method':22s} {'wall (s)':>9s} {'wire bytes':>12s} {'max recv/rank':>14s} {'peak staging':>13s} "
          f"{'peak RSS +':>11s} {'wrong elems':>11s}")
    for name, secs, wire, mrecv, staging, rss, bad in rows:
        print(f"{name:22s} {secs:9.3f} {_fmt_bytes(wire):>12s} {_fmt_bytes(mrecv):>14s} {_fmt_bytes(staging):>13s} "
              f"{_fmt_bytes(rss):>11s} {bad:>11d}")
    print(f"lower bound on wire bytes: {_fmt_bytes(st.lower_bound_bytes)} (ours/lower bound = "
          f"{st.wire_bytes / max(1, st.lower_bound_bytes):.3f}); local copies: {_fmt_bytes(st.local_bytes)}")
    if not args.no_baseline:
        print(f"speed-up over the all-gather baseline: {rows[1][1] / rows[0][1]:.2f}x; "
              f"first run (planning cached, buffers allocated): {max(r['ours_first_seconds'] for r in res):.3f} s")
    print(f"total demo time {elapsed:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "stats": st.as_dict(), "ranks": res}, f, indent=1, default=str)
    bad = sum(r[-1] for r in rows)
    if bad:
        print(f"FAILED: {bad} destination elements differ from the global tensor")
        return 1
    print("OK: every destination element equals the global tensor (bit-exact)")
    return 0
