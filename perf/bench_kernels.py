"""Benchmark of the copy kernels: pack and unpack GB/s, Triton vs the per-slice torch path vs a ceiling.

Scenarios (sizes from public model configs, see ``MODELS``):

1. ``tp4->tp2``: one refit step of a Llama-3-8B-shaped model going from TP4 shards to TP2 shards (vLLM
   layout: fused ``qkv_proj`` = [q; k; v] and ``gate_up_proj`` = [gate; up] split over TP by rows,
   ``o_proj`` / ``down_proj`` split by columns, vocab-parallel embedding and head, replicated norms).
   ``pack``: what TP4 rank 0 puts into its send buffer; ``unpack``: what TP2 rank 0 takes out of the
   receive buffers of TP4 ranks 0 and 1 into its shards (column slices of o_proj / down_proj are strided).
2. ``tiny``: 10,000 regions of 1 to 512 bf16 elements.
3. ``huge``: a few huge regions (column halves of square bf16 matrices).

For each: GB/s (bytes read + bytes written) of ``triton_copy_views`` (CUDA; on CPU only the interpreter on a
tiny model, to show it runs), of ``ops.torch_copy_views`` (one ``copy_`` per slice), and of the ceiling: one
contiguous ``copy_`` of the same number of bytes into a preallocated buffer, measured in the same run.
Median of ``--repeats`` timed runs after warm-up, with the 20% and 80% quantiles.

    python perf/bench_kernels.py --device cpu --layers 2 --out perf/results/kernels_cpu.json
    python perf/bench_kernels.py --device cuda --out perf/results/kernels_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from triton_reshard import ops
from triton_reshard.tools.cliutil import UsageError, check_output_file

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ModelConfig:
    """The fields of a Hugging Face ``config.json`` that fix the weight shapes."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


MODELS = {
    # meta-llama/Meta-Llama-3-8B config.json
    "llama3-8b": ModelConfig("llama3-8b", 4096, 32, 32, 8, 128, 14336, 128256),
    # meta-llama/Meta-Llama-3-70B config.json
    "llama3-70b": ModelConfig("llama3-70b", 8192, 80, 64, 8, 128, 28672, 128256),
    # Qwen/Qwen2.5-7B config.json
    "qwen2.5-7b": ModelConfig("qwen2.5-7b", 3584, 28, 28, 4, 128, 18944, 152064),
    # Llama-shaped toy for the interpreter (same structure, tiny sizes)
    "tiny-llama": ModelConfig("tiny-llama", 256, 1, 8, 4, 32, 512, 1024),
}


# ---------------------------------------------------------------------------------------------------------
# scenarios: lists of (src_view, dst_view)


def _staging(pieces: list[torch.Tensor], dtype: torch.dtype, device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A uint8 staging buffer and one contiguous view per piece at 16-byte aligned offsets."""
    sizes = [-(-p.numel() * dtype.itemsize // 16) * 16 for p in pieces]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    views, off = [], 0
    for p, size in zip(pieces, sizes, strict=True):
        views.append(buffer[off:off + p.numel() * dtype.itemsize].view(dtype).view(p.shape))
        off += size
    return buffer, views


def tp_reshard(cfg: ModelConfig, layers: int, device, dtype=torch.bfloat16, src_tp: int = 4,
               dst_tp: int = 2) -> dict[str, list[Pair]]:
    """Pack list of source rank 0 and unpack list of destination rank 0 for a TP ``src_tp`` -> ``dst_tp``
    reshard of ``layers`` decoder layers plus embedding, head and final norm."""
    ratio = src_tp // dst_tp
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    # (name, kind, parts): "rows" = fused along dim 0, each part split over TP; "cols" = split along dim 1
    weights: list[tuple[str, str, list[int], int]] = []
    for i in range(layers):
        weights += [(f"l{i}.qkv", "rows", [q, kv, kv], cfg.hidden), (f"l{i}.o", "cols", [cfg.hidden], q),
                    (f"l{i}.gate_up", "rows", [cfg.intermediate] * 2, cfg.hidden),
                    (f"l{i}.down", "cols", [cfg.hidden], cfg.intermediate),
                    (f"l{i}.ln1", "rep", [cfg.hidden], 0), (f"l{i}.ln2", "rep", [cfg.hidden], 0)]
    weights += [("embed", "rows", [cfg.vocab], cfg.hidden), ("head", "rows", [cfg.vocab], cfg.hidden),
                ("norm", "rep", [cfg.hidden], 0)]

    def shard_shape(kind, parts, cols, tp):
        if kind == "rows":
            return (sum(p // tp for p in parts), cols)
        return (parts[0], cols // tp) if kind == "cols" else (parts[0],)

    def pieces(kind, parts, cols, src, dst, j):
        """(src piece, dst piece) of TP4 shard ``src`` going into TP2 shard ``dst`` at position ``j``."""
        if kind == "rows":
            out, s_off, d_off = [], 0, 0
            for p in parts:
                n = p // src_tp
                out.append((src[s_off:s_off + n], dst[d_off + j * n:d_off + (j + 1) * n]))
                s_off, d_off = s_off + n, d_off + p // dst_tp
            return out
        if kind == "cols":
            n = cols // src_tp
            return [(src, dst[:, j * n:(j + 1) * n])]
        return [(src, dst)] if j == 0 else []

    gen = torch.Generator(device=device).manual_seed(0)
    dst_shards = {name: torch.empty(shard_shape(kind, parts, cols, dst_tp), dtype=dtype, device=device)
                  for name, kind, parts, cols in weights}
    pack: list[Pair] = []
    unpack: list[Pair] = []
    for src_rank in range(ratio):  # the TP4 ranks that feed TP2 rank 0
        srcs = {name: torch.randn(shard_shape(kind, parts, cols, src_tp), generator=gen, device=device).to(dtype)
                for name, kind, parts, cols in weights}
        pairs = [pc for name, kind, parts, cols in weights
                 for pc in pieces(kind, parts, cols, srcs[name], dst_shards[name], src_rank)]
        _, staged = _staging([s for s, _ in pairs], dtype, device)
        ops.torch_copy_views([(s, b) for (s, _), b in zip(pairs, staged, strict=True)])  # what arrives
        if src_rank == 0:
            pack = [(s, b) for (s, _), b in zip(pairs, staged, strict=True)]
        unpack += [(b, d) for (_, d), b in zip(pairs, staged, strict=True)]
        del srcs
    return {"pack": pack, "unpack": unpack}


def tiny_regions(count: int, device, dtype=torch.bfloat16, seed: int = 1) -> dict[str, list[Pair]]:
    """``count`` regions of 1 to 512 elements, scattered over a pool, packed into one staging buffer."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 513, (count,), generator=gen).tolist()
    gaps = torch.randint(0, 64, (count,), generator=gen).tolist()
    starts = [0]
    for n, g in zip(sizes[:-1], gaps[:-1], strict=True):
        starts.append(starts[-1] + n + g)
    pool = torch.randn(starts[-1] + sizes[-1], generator=gen).to(dtype).to(device)
    back = torch.empty_like(pool)
    srcs = [pool[s:s + n] for s, n in zip(starts, sizes, strict=True)]
    _, staged = _staging(srcs, dtype, device)
    return {"pack": list(zip(srcs, staged, strict=True)),
            "unpack": [(b, back[s:s + n]) for b, s, n in zip(staged, starts, sizes, strict=True)]}


def huge_regions(count: int, side: int, device, dtype=torch.bfloat16) -> dict[str, list[Pair]]:
    """``count`` regions: the left column half of ``side x side`` matrices (packed), unpacked into the right
    column half of other matrices."""
    gen = torch.Generator(device=device).manual_seed(2)
    mats = [torch.randn(side, side, generator=gen, device=device).to(dtype) for _ in range(count)]
    outs = [torch.empty(side, side, dtype=dtype, device=device) for _ in range(count)]
    srcs = [m[:, :side // 2] for m in mats]
    _, staged = _staging(srcs, dtype, device)
    return {"pack": list(zip(srcs, staged, strict=True)),
            "unpack": [(b, o[:, side // 2:]) for b, o in zip(staged, outs, strict=True)]}


# ---------------------------------------------------------------------------------------------------------
# timing


def measure(fn: Callable[[], None], device: torch.device, repeats: int, warmup: int,
            min_seconds: float = 0.2, max_repeats: int = 2000) -> dict[str, float]:
    """Median and 20/80% quantiles of ``fn``'s time in ms (CUDA events on CUDA), after ``warmup`` calls;
    at least ``repeats`` runs, more (up to ``max_repeats``) until ``min_seconds`` of runs were timed."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    while len(times) < repeats or (sum(times) < min_seconds * 1e3 and len(times) < max_repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    # "inclusive": quantiles within the measured times (the default extrapolates: a negative p20 from two runs)
    q = statistics.quantiles(times, n=5, method="inclusive") if len(times) > 1 else [times[0]] * 4
    return {"median_ms": statistics.median(times), "p20_ms": q[0], "p80_ms": q[3], "repeats": len(times)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def traffic(pairs: list[Pair]) -> int:
    """Bytes read plus bytes written by copying ``pairs``."""
    return sum(s.numel() * s.element_size() + d.numel() * d.element_size() for s, d in pairs)


def run_case(name: str, direction: str, pairs: list[Pair], device: torch.device, backends: list[str],
             repeats: int, warmup: int) -> dict:
    """Time every backend on ``pairs`` plus the ceiling; check that Triton and torch wrote the same bits."""
    from triton_reshard.ops import copy as triton_copy

    moved = traffic(pairs)
    one_way = moved // 2
    ceil_src = torch.empty(one_way, dtype=torch.uint8, device=device)
    ceil_dst = torch.empty_like(ceil_src)
    results = {}
    key = ("bench", name, direction)
    for backend in backends:
        if backend == "triton":
            triton_copy.clear_cache()
            t = time.perf_counter()
            triton_copy.triton_copy_views(pairs, key=key)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first = (time.perf_counter() - t) * 1e3
            stats = measure(lambda: triton_copy.triton_copy_views(pairs, key=key), device, repeats, warmup)
            stats["first_call_ms"] = first
            triton_out = [d.clone() for _, d in pairs]
        else:
            stats = measure(lambda: ops.torch_copy_views(pairs), device, repeats, warmup)
        results[backend] = stats
    results["ceiling"] = measure(lambda: ceil_dst.copy_(ceil_src), device, repeats, warmup)
    if "triton" in backends:
        ops.torch_copy_views(pairs)  # the destinations now hold torch's result
        results["triton"]["matches_torch"] = all(
            torch.equal(_bits(a), _bits(d)) for a, (_, d) in zip(triton_out, pairs, strict=True))
    for stats in results.values():
        stats["gbps"] = moved / (stats["median_ms"] * 1e-3) / 1e9
    return {"scenario": name, "direction": direction, "regions": len(pairs), "bytes_moved": moved,
            "results": results}


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def print_table(rows: list[dict]) -> None:
    print(f"{'scenario':<24} {'dir':<7} {'regions':>8} {'MB moved':>9}   "
          f"{'triton GB/s':>11} {'torch GB/s':>10} {'ceiling GB/s':>12}  {'triton/ceil':>11}")
    for r in rows:
        res = r["results"]
        tri = res.get("triton", {}).get("gbps")
        ratio = f"{tri / res['ceiling']['gbps']:.0%}" if tri is not None else "-"
        print(f"{r['scenario']:<24} {r['direction']:<7} {r['regions']:>8} {r['bytes_moved'] / 1e6:>9.1f}   "
              f"{_fmt(tri):>11} {_fmt(res['torch']['gbps']):>10} {_fmt(res['ceiling']['gbps']):>12}  {ratio:>11}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers of the TP scenario (default: all on CUDA, 2 on CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case (default 20 CUDA, 5 CPU)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 gives steadier numbers on a shared, loaded machine)")
    args = parser.parse_args(argv)
    try:  # before any work: an output path that cannot be written is one line, exit 2
        check_output_file(args.out, '--out', make_folder=True)
    except UsageError as e:
        parser.error(str(e))
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    cfg = MODELS[args.model]
    layers = args.layers if args.layers is not None else (cfg.layers if cuda else 2)
    if args.quick:
        layers = min(layers, 2 if cuda else 1)
    repeats = args.repeats or (5 if args.quick else (20 if cuda else 5))
    warmup = 2 if args.quick else 3
    tiny_count = 2_000 if args.quick else 10_000
    huge = (4, 2048 if args.quick else 8192) if cuda else (4, 1024 if args.quick else 2048)

    scenarios: list[tuple[str, dict[str, list[Pair]]]] = [
        (f"{cfg.name}-tp4->tp2-{layers}L", tp_reshard(cfg, layers, device)),
        (f"tiny-{tiny_count}", tiny_regions(tiny_count, device)),
        (f"huge-{huge[0]}x{huge[1]}^2/2", huge_regions(*huge, device)),
    ]
    backends = ["triton", "torch"] if cuda else ["torch"]
    rows = [run_case(name, direction, pairs, device, backends, repeats, warmup)
            for name, lists in scenarios for direction, pairs in lists.items()]
    del scenarios

    if not cuda:
        # The interpreter on a tiny model, once: it runs, and gives the same bytes as torch.
        os.environ["TRITON_INTERPRET"] = "1"
        tiny = MODELS["tiny-llama"]
        for direction, pairs in tp_reshard(tiny, tiny.layers, device).items():
            rows.append(run_case(f"{tiny.name}-interpreter", direction, pairs, device, ["triton", "torch"],
                                 repeats=3, warmup=1))

    print_table(rows)
    bad = [r for r in rows if r["results"].get("triton", {}).get("matches_torch") is False]
    report = {
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "device_type": device.type,
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "model": asdict(cfg) | {"layers_used": layers},
        "quick": args.quick,
        "cases": rows,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "meta": {"argv": ["perf/bench_kernels.py", *(sys.argv[1:] if argv is None else argv)],
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": list(os.getloadavg())},
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    if bad:
        print(f"MISMATCH: Triton differs from torch in {[(r['scenario'], r['direction']) for r in bad]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
