"""End-to-end refit benchmark: the reshard collective against the alternatives, side by side in one run.

For each case (a pair of layouts of a Llama-shaped model on one spawned world) it times, with the same
tensors and the same ranks:
- ``reshard``: ``Resharder.run`` (overlap off), ``reshard+overlap`` (two staging slots), and
  ``reshard-staged`` (every message packed and unpacked through staging: no direct messages in place);
- ``allgather``: the all-gather-then-slice baseline (``triton_reshard.tools.baselines``);
- ``wire-limit``: per step of the reshard's schedule, the bytes each rank sends each peer as one plain
  isend/irecv, no pack or unpack, no local copies — what the transport alone costs;
- ``dtensor``: ``DTensor.redistribute`` where the two layouts live on one mesh (the ``fsdp-tp`` case);
- ``reshard-<method>`` (``dst_dtype``: a quantization format's name; its ``method``, e.g. ``reshard-fp8`` for
  block FP8): the same refit into quantized inference weights (every Linear weight; block FP8 in
  ``quant_block`` square blocks), checked against the reference quantization.
Wall time is the slowest rank's (barrier before and after), median over repeats. Every method's destination
tensors are poisoned first and checked bit-exactly afterwards.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..execute import Resharder
from ..layout import FP8_BLOCK, Layout, Replicate, Shard, quant_format
from ..plan import plan_reshard
from ..testing.launch import run_world
from .baselines import allgather_refit
from .demo import (
    QUANT_DST_DTYPES,
    current_rss,
    expected_quantized,
    expected_tensors,
    make_src,
    peak_rss,
    poison,
    quant_layout,
    reset_peak_rss,
    verify_tensors,
)
from .demo_report import quant_name
from .parallel import Parallelism, llama_for_bytes, llama_tensors, parallel_layout


@dataclass(frozen=True)
class Case:
    name: str
    src: str  # Parallelism text, or "fsdp-tp" (see _layouts)
    dst: str
    world: int


CASES = {
    "megatron-vllm": Case("megatron tp4xpp2 -> vllm tp2xdp4 (colocated)", "megatron:tp=4,pp=2", "vllm:tp=2,dp=4", 8),
    "colocated": Case("colocated tp4xpp2 -> tp2xdp4", "tp=4,pp=2", "tp=2,dp=4", 8),
    "disaggregated": Case("disaggregated tp2xpp2 (0-3) -> tp2xdp2 (4-7)", "tp=2,pp=2", "tp=2,dp=2,offset=4", 8),
    "fsdp-tp": Case("fsdp2(dp2)xtp4 -> dp2xtp4 (one mesh)", "fsdp-tp", "dp-tp", 8),
}


def _layouts(case: Case, size_bytes: int, dtype: torch.dtype):
    if case.src.startswith("megatron:"):
        from .demo import preset_layouts

        src, dst, cfg = preset_layouts(case.src.split(":", 1)[1], case.dst.split(":", 1)[1], size_bytes, dtype)
        return src, dst, cfg, None
    cfg = llama_for_bytes(size_bytes, dtype)
    tensors = llama_tensors(**cfg)
    if case.src == "fsdp-tp":
        mesh = [[0, 1, 2, 3], [4, 5, 6, 7]]
        shapes = {n: s for n, (s, _k, _l) in tensors.items()}
        tp_dim = {n: (0 if k == "col" else 1 if k == "row" else None) for n, (_s, k, _l) in tensors.items()}

        def pl(fsdp: bool):
            return {
                n: [Shard(0) if fsdp else Replicate(), Shard(d) if d is not None else Replicate()]
                for n, d in tp_dim.items()
            }

        src = Layout.from_placements(shapes, mesh, pl(True), dtype=dtype)
        dst = Layout.from_placements(shapes, mesh, pl(False), dtype=dtype)
        return src, dst, cfg, (mesh, pl(True), pl(False))
    src = parallel_layout(tensors, Parallelism.parse(case.src), cfg["layers"], dtype)
    dst = parallel_layout(tensors, Parallelism.parse(case.dst), cfg["layers"], dtype)
    return src, dst, cfg, None


def _wire_limit(bufs: list, timeout) -> None:
    """The same messages as the reshard, one isend/irecv each, into preallocated buffers, no copies.

    ``bufs``: per step of the reshard's schedule, ``(sends, recvs)`` lists of ``(peer, buffer)``."""
    for sends, recvs in bufs:
        p2p = [dist.P2POp(dist.irecv, b, peer) for peer, b in recvs] + [
            dist.P2POp(dist.isend, b, peer) for peer, b in sends
        ]
        for w in dist.batch_isend_irecv(p2p):
            w.wait(timeout=timeout)


def quant_method(dst_dtype: str) -> str:
    """The method name of the refit into ``dst_dtype`` weights (the format's ``method``: ``reshard-fp8`` for
    block FP8, as before)."""
    return f"reshard-{quant_format(dst_dtype).method}"


def bench_worker(rank: int, world: int, case: Case, size_bytes: int, dtype_name: str, bucket: int, repeats: int,
                 timeout: float, dst_dtype: str = "same", quant_block: int = 128) -> dict:
    import logging
    from datetime import timedelta

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # its flatten-mesh hint
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    src, dst, _cfg, dt = _layouts(case, size_bytes, dtype)
    src_t = make_src(src, rank, device)
    dst_t = dst.allocate(rank, device=device)
    expected = expected_tensors(dst, rank, device)
    plan = plan_reshard(src, dst)
    methods = {
        "reshard": Resharder(plan, bucket_bytes=bucket, timeout=timeout),
        "reshard+overlap": Resharder(plan, bucket_bytes=bucket, timeout=timeout, overlap=True),
        "reshard-staged": Resharder(plan, bucket_bytes=bucket, timeout=timeout, direct_min_bytes=1 << 62),
    }
    wire_bufs = _wire_buffers(methods["reshard"], device)
    fns = {
        "reshard": lambda: methods["reshard"].run(src_t, dst_t),
        "reshard+overlap": lambda: methods["reshard+overlap"].run(src_t, dst_t),
        "reshard-staged": lambda: methods["reshard-staged"].run(src_t, dst_t),
        "allgather": lambda: allgather_refit(src_t, dst_t, src, dst, timeout=timeout),
        "wire-limit": lambda: _wire_limit(wire_bufs, timedelta(seconds=timeout)),
    }
    checked = {}  # method -> (its destination tensors, their expected bits), when not dst_t / expected
    if dst_dtype in QUANT_DST_DTYPES:
        dst_q = quant_layout(dst, dst_dtype, quant_block)
        rq = Resharder(plan_reshard(src, dst_q), bucket_bytes=bucket, timeout=timeout)
        dst_qt = dst_q.allocate(rank, device=device)
        mq = quant_method(dst_dtype)
        methods[mq] = rq
        fns[mq] = lambda: rq.run(src_t, dst_qt)
        checked[mq] = (dst_qt, expected_quantized(dst_q, src, rank, device))
    if dt is not None:
        fns["dtensor"] = _dtensor_fn(dt, src, src_t, dst_t, device)
    res: dict = {"rank": rank}
    acc = _timed_rounds(fns, checked, dst_t, expected, repeats, device)
    for name, (times, bad, peaks) in acc.items():
        res[name] = {"seconds": times, "bad": bad[0], "peak_extra_bytes": max(peaks)}
    res["staging_bytes"] = {k: r.staging_bytes for k, r in methods.items()}
    return res


def _wire_buffers(reshard: Resharder, device: torch.device) -> list:
    """The wire-limit buffers: per step of the reshard's own schedule, one buffer per peer and direction holding
    the bytes of all its messages to / from that peer."""

    def per_peer(entries) -> list:
        n: dict[int, int] = {}
        for peer, _at, m in entries:
            n[peer] = n.get(peer, 0) + m.payload
        return [(peer, torch.empty(b, dtype=torch.uint8, device=device)) for peer, b in n.items()]

    return [(per_peer(st.sends), per_peer(st.recvs)) for _i, st in reshard.steps]


def _dtensor_fn(dt, src, src_t: dict, dst_t: dict, device: torch.device):
    """DTensor's ``redistribute`` of every tensor from the source placements to the destination's, as a
    method: ``dt`` is ``(mesh ranks, source placements, destination placements)``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as DRep
    from torch.distributed.tensor import Shard as DShard

    mesh_ranks, pl_src, pl_dst = dt
    mesh = DeviceMesh(device.type, mesh_ranks)

    def conv(pls):
        return [DShard(p.dim) if isinstance(p, Shard) else DRep() for p in pls]

    dts = {
        n: DTensor.from_local(src_t[n], mesh, conv(pl_src[n]), run_check=False, shape=src.specs[n].shape,
                              stride=torch.empty(src.specs[n].shape, device="meta").stride())
        for n in src_t
    }

    def dtensor_run():
        for n, d in dts.items():
            dst_t[n].copy_(d.redistribute(mesh, conv(pl_dst[n])).to_local())

    return dtensor_run


def _timed_rounds(fns: dict, checked: dict, dst_t: dict, expected: dict, repeats: int,
                  device: torch.device) -> dict:
    """``repeats`` timed rounds of every method after one warm-up round, the methods interleaved round by
    round so a change of load on the shared machine hits them all alike; each call into poisoned destinations,
    checked bit-exact. Returns {method: (seconds, [bad elements], peak extra bytes)}."""
    acc = {name: ([], [0], []) for name in fns}  # times, bad elements, peaks
    for i in range(repeats + 1):  # the first round warms up (planning, buffers, page faults)
        for name, fn in fns.items():
            times, bad, peaks = acc[name]
            tensors, want = checked.get(name, (dst_t, expected))
            poison(tensors)
            reset_peak_rss()
            rss0 = current_rss()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                mem0 = torch.cuda.memory_allocated(device)
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            dt_s = time.perf_counter() - t0
            peak = (torch.cuda.max_memory_allocated(device) - mem0) if device.type == "cuda" else peak_rss() - rss0
            if name != "wire-limit":
                bad[0] += verify_tensors(want, tensors)
            if i:
                times.append(dt_s)
                peaks.append(peak)
    return acc


def run_bench(cases: list[str], sizes_gb: list[float], dtype: str = "float32", bucket_mb: float = 64,
              repeats: int = 3, timeout: float = 120.0, out_dir: str | None = None, progress=print,
              dst_dtype: str = "same", quant_block: int = 128) -> dict:
    """``dst_dtype`` a quantization format's name: also time the refit into inference weights of that format
    (:func:`quant_method`; block FP8 in ``quant_block`` square blocks). Each row then has ``stats_fp8`` (the quantized plan's stats, whatever the format) beside ``stats``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = []
    for cname in cases:
        case = CASES[cname]
        for gb in sizes_gb:
            size = int(gb * (1 << 30))
            src, dst, cfg, _ = _layouts(case, size, getattr(torch, dtype))
            t0 = time.perf_counter()
            plan = plan_reshard(src, dst)
            plan_s = time.perf_counter() - t0
            st = plan.stats()
            qst = None
            if dst_dtype in QUANT_DST_DTYPES:
                qst = plan_reshard(src, quant_layout(dst, dst_dtype, quant_block)).stats()
            progress(f"[{case.name}, {gb:g} GiB] plan: {st.num_transfers} transfers, wire "
                     f"{st.wire_bytes / 2**20:.0f} MiB (lower bound {st.lower_bound_bytes / 2**20:.0f} MiB), "
                     f"planned in {plan_s:.2f} s; running {case.world} ranks ...")
            per_rank = run_world(bench_worker, case.world, case, size, dtype, int(bucket_mb * 2**20), repeats,
                                 timeout, dst_dtype, quant_block, timeout=max(900.0, 10 * timeout))
            row = {"case": cname, "name": case.name, "size_gb": gb, "model": cfg, "dtype": dtype,
                   "bucket_mb": bucket_mb, "world": case.world, "plan_seconds": plan_s, "stats": st.as_dict(),
                   "methods": {}, "stats_fp8": qst.as_dict() if qst is not None else None,
                   "quant_block": quant_block if qst is not None else None,
                   "dst_dtype": dst_dtype if qst is not None else None}
            names = [k for k in per_rank[0] if isinstance(per_rank[0][k], dict) and "seconds" in per_rank[0][k]]
            walls = {m: [max(r[m]["seconds"][i] for r in per_rank) for i in range(repeats)] for m in names}
            for m in names:
                med = statistics.median(walls[m])
                row["methods"][m] = {
                    "median_s": med, "min_s": min(walls[m]), "max_s": max(walls[m]), "rounds_s": walls[m],
                    # ratios within each round (the methods of a round ran back to back), then the median
                    "speedup_vs_allgather": statistics.median(
                        a / b for a, b in zip(walls["allgather"], walls[m], strict=True)),
                    "vs_wire_limit": statistics.median(
                        b / a for a, b in zip(walls["wire-limit"], walls[m], strict=True)),
                    "bad_elements": sum(r[m]["bad"] for r in per_rank),
                    "peak_extra_bytes": max(r[m]["peak_extra_bytes"] for r in per_rank),
                    "lower_bound_GBps": st.lower_bound_bytes / med / 1e9,
                }
            row["staging_bytes"] = {k: max(r["staging_bytes"][k] for r in per_rank) for k in per_rank[0]["staging_bytes"]}
            for m, staging in row["staging_bytes"].items():  # our staging persists across runs: count it
                row["methods"][m]["peak_extra_bytes"] += staging
            results.append(row)
            progress(format_row(row))
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": _machine(), "results": results}
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench_refit.json"), "w") as f:
            json.dump(out, f, indent=1)
        try:
            plot(out, os.path.join(out_dir, "bench_refit.png"))
        except ImportError:
            progress("matplotlib is not installed: no plot")
    return out


def _machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"CPU, {os.cpu_count()} cores, gloo"


def format_row(row: dict) -> str:
    ms = row["methods"]
    lines = [f"  {'method':16s} {'median s':>9s} {'vs allgather':>12s} {'vs wire-limit':>13s} {'peak extra':>11s} "
             f"{'GB/s (lb)':>9s} {'bad':>4s}"]
    for m, v in ms.items():
        lines.append(
            f"  {m:16s} {v['median_s']:9.3f} {v['speedup_vs_allgather']:11.2f}x "
            f"{v['vs_wire_limit']:12.2f}x {v['peak_extra_bytes'] / 2**20:8.1f} MiB "
            f"{v['lower_bound_GBps']:9.2f} {v['bad_elements']:4d}"
        )
    s = row["stats"]
    lines.append(f"  wire {s['wire_bytes'] / 2**20:.1f} MiB = {s['wire_bytes'] / max(1, s['lower_bound_bytes']):.3f} "
                 f"x lower bound; staging allocated {max(row['staging_bytes'].values()) / 2**20:.1f} MiB "
                 f"(bucket {row['bucket_mb']:g} MiB)")
    q = row.get("stats_fp8")
    if q:
        qd = row.get("dst_dtype", FP8_BLOCK.name)  # rows written before other formats: block FP8
        t_plain, t_q = ms["reshard"]["median_s"], ms[quant_method(qd)]["median_s"]
        lines.append(f"  {quant_name(qd, row['quant_block'])}: wire {q['wire_bytes'] / 2**20:.1f} MiB = "
                     f"{q['wire_bytes'] / max(1, s['wire_bytes']):.3f} x the {row['dtype']} wire "
                     f"({q['quant_src_bytes'] / 2**20:.1f} MiB quantized by senders, {q['quant_dst_bytes'] / 2**20:.1f} "
                     f"MiB in {row['dtype']} for receivers to quantize) = {q['wire_bytes'] / max(1, q['lower_bound_bytes']):.3f}"
                     f" x its lower bound; time {t_q:.3f} s vs {t_plain:.3f} s")
    return "\n".join(lines)


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["results"]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['case']}\n{r['size_gb']:g} GiB" for r in rows]
    methods = list(dict.fromkeys(m for r in rows for m in r["methods"]))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        ax[0].bar([i + j * width for i in range(len(rows))], [r["methods"].get(m, {}).get("median_s", 0) for r in rows],
                  width, label=m)
        ax[1].bar([i + j * width for i in range(len(rows))],
                  [r["methods"].get(m, {}).get("peak_extra_bytes", 0) / 2**20 for r in rows], width, label=m)
    titles = ("wall time (s), median of repeats", "peak extra memory per rank (MiB): staging + transient")
    for a, title in zip(ax, titles, strict=True):
        a.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
        a.set_xticklabels(labels, fontsize=8)
        a.set_title(title)
    ax[0].legend(fontsize=8)
    fig.suptitle(f"refit benchmark — {out['machine']} — {out['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
