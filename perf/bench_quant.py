"""Benchmark of block-FP8 quantization: GB/s of ``quantize_views`` (Triton, one launch) vs the torch reference
per tensor vs a ceiling (one contiguous copy of the same number of bytes into a preallocated buffer).

Tensors: one decoder layer of Qwen3-8B (``Qwen/Qwen3-8B`` config.json: hidden 4096, 32 heads and 8 KV
heads of 128, intermediate 12288: fused qkv [6144, 4096], o [4096, 4096], gate_up [24576, 4096], down
[4096, 12288]) and the fused w13 expert stack of one Qwen3-30B-A3B layer (128 experts, moe_intermediate 768,
hidden 2048: [128, 1536, 2048], block (1, 128, 128)), bf16, quantized into one message buffer (each
tensor's fp8 bytes, then its float32 scales, 16-byte aligned) as the executor's pack does. Traffic = bf16
bytes read + fp8 and scale bytes written. Median of ``--repeats`` runs after warm-up, 20/80% quantiles.
Every Triton result is checked bit for bit against the reference before timing.

    python perf/bench_quant.py --device cuda --out perf/results/quant_cuda.json
    python perf/bench_quant.py --device cpu --scale 16      # CPU: torch only, plus the interpreter on
                                                            # the shapes divided by 16 (shows it runs)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import measure  # noqa: E402

from triton_reshard.ops import quantize as Q  # noqa: E402
from triton_reshard.tools.cliutil import UsageError, check_output_file  # noqa: E402

DENSE = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
EXPERTS = {"w13": (128, 1536, 2048)}
BLOCK = (128, 128)


def make_items(shapes: dict[str, tuple[int, ...]], device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    srcs = {n: torch.randn(s, generator=g).to(torch.bfloat16).to(device) for n, s in shapes.items()}
    align = lambda n: -(-n // 16) * 16  # noqa: E731
    sizes = [(x.numel(), Q.blocks_count(x.shape, BLOCK) * 4) for x in srcs.values()]
    buf = torch.empty(sum(align(a) + align(b) for a, b in sizes), dtype=torch.uint8, device=device)
    items, off = [], 0
    for x, (nq, ns) in zip(srcs.values(), sizes, strict=True):
        q = buf[off:off + nq].view(x.shape)
        off += align(nq)
        s = buf[off:off + ns].view(torch.float32).view(Q.scale_shape(x.shape, BLOCK))
        off += align(ns)
        items.append((x, q, s))
    return items


def traffic(items) -> int:
    return sum(x.numel() * x.element_size() + q.numel() + s.numel() * 4 for x, q, s in items)


def check(items) -> None:
    for x, q, s in items:
        rq, rs = Q.quantize_blocks(x, BLOCK)
        assert torch.equal(q, rq.view(torch.uint8)) and torch.equal(s, rs), "Triton differs from the reference"


def run(device: torch.device, scale: int, repeats: int, backends: list[str]) -> list[dict]:
    rows = []
    for name, shapes in (("qwen3-8b-layer", DENSE), ("qwen3-30b-a3b-w13", EXPERTS)):
        shapes = {n: tuple(max(1, d // scale) if i >= len(s) - 2 else d for i, d in enumerate(s))
                  for n, s in shapes.items()}
        items = make_items(shapes, device)
        nbytes = traffic(items)
        blocks = sum(Q.blocks_count(x.shape, BLOCK) for x, _, _ in items)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ceiling = measure(lambda d=dst, s=src: d.copy_(s), device, repeats, 2)
        row = {"case": name, "tensors": len(items), "blocks": blocks, "bytes": nbytes,
               "ceiling_GBps": nbytes / ceiling["median_ms"] / 1e6}
        for backend in backends:
            fn = lambda b=backend, it=items, k=("bench", name): Q.quantize_views(it, BLOCK, backend=b, key=k)  # noqa: E731
            fn()
            if backend == "triton":
                check(items)
            t = measure(fn, device, repeats, 1)
            row[f"{backend}_ms"] = t["median_ms"]
            row[f"{backend}_p20_ms"], row[f"{backend}_p80_ms"] = t["p20_ms"], t["p80_ms"]
            row[f"{backend}_GBps"] = nbytes / t["median_ms"] / 1e6
            row[f"{backend}_vs_ceiling"] = row[f"{backend}_GBps"] / row["ceiling_GBps"]
        rows.append(row)
        print(json.dumps(row))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", type=int, default=1, help="divide the two blocked dims by this")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    try:  # before any work: an output path that cannot be written is one line, exit 2
        check_output_file(args.out, '--out')
    except UsageError as e:
        p.error(str(e))
    device = torch.device(args.device)
    if device.type == "cpu":
        rows = run(device, args.scale, args.repeats, ["torch"])
        os.environ["TRITON_INTERPRET"] = "1"
        rows += run(device, max(args.scale, 16), 1, ["triton"])  # the interpreter: that it runs, not speed
    else:
        rows = run(device, args.scale, args.repeats, ["triton", "torch"])
    if args.out:
        meta = {"argv": ["perf/bench_quant.py", *(sys.argv[1:] if argv is None else argv)],
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": list(os.getloadavg()),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                "torch": torch.__version__}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
