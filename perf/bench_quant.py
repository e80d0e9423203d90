"""Benchmark of block quantization (block FP8, MXFP8, NVFP4: ``--formats``): GB/s of ``quantize_views`` (Triton,
one launch) vs the torch reference per tensor vs a ceiling (one contiguous copy of the same number of bytes into
a preallocated buffer).

Tensors: one decoder layer of Qwen3-8B (``Qwen/Qwen3-8B`` config.json: hidden 4096, 32 heads and 8 KV
heads of 128, intermediate 12288: fused qkv [6144, 4096], o [4096, 4096], gate_up [24576, 4096], down
[4096, 12288]) and the fused w13 expert stack of one Qwen3-30B-A3B layer (128 experts, moe_intermediate 768,
hidden 2048: [128, 1536, 2048], block (1, 128, 128)), bf16, quantized into one message buffer (each
tensor's fp8 bytes, then its float32 scales, 16-byte aligned) as the executor's pack does. Traffic = bf16
bytes read + fp8 and scale bytes written. Median of ``--repeats`` runs after warm-up, 20/80% quantiles.
Every Triton result is checked bit for bit against the reference before timing. MXFP8 (1x32 blocks, E8M0 byte
scales) and NVFP4 (1x16 blocks, packed E2M1 bytes, e4m3 scales, one global scale per tensor) quantize the same
tensors (on CPU the interpreter runs them on the dense layer only, its shapes divided by 256; their kernel takes
many 1x32 / 1x16 blocks per program).

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
from bench_kernels import measure  # a sibling script (perf/ is sys.path[0] when a script here runs)

from triton_reshard.layout import quant_format
from triton_reshard.ops import quantize as Q
from triton_reshard.tools.cliutil import UsageError, check_output_file

DENSE = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
EXPERTS = {"w13": (128, 1536, 2048)}
BLOCK = (128, 128)
BLOCKS = {"fp8-block": BLOCK, "mxfp8": (32,), "nvfp4": (16,)}


def make_items(shapes: dict[str, tuple[int, ...]], device, seed=0, fmt: str = "fp8-block"):
    f = quant_format(fmt)
    block = BLOCKS[fmt]
    g = torch.Generator(device="cpu").manual_seed(seed)
    srcs = {n: torch.randn(s, generator=g).to(torch.bfloat16).to(device) for n, s in shapes.items()}
    align = lambda n: -(-n // 16) * 16  # noqa: E731
    sizes = [(f.value_bytes(x.numel()), Q.blocks_count(x.shape, block) * f.scale_bytes) for x in srcs.values()]
    buf = torch.empty(sum(align(a) + align(b) for a, b in sizes), dtype=torch.uint8, device=device)
    items, off = [], 0
    for x, (nq, ns) in zip(srcs.values(), sizes, strict=True):
        q = buf[off:off + nq].view(x.shape[:-1] + (x.shape[-1] // f.pack,))
        off += align(nq)
        s = buf[off:off + ns].view(f.scale_dtype).view(Q.scale_shape(x.shape, block))
        off += align(ns)
        if f.global_scale:
            items.append((x, q, s, Q.nvfp4_global_scale(x.abs().amax().float())[0].reshape(1)))
        else:
            items.append((x, q, s))
    return items


def traffic(items) -> int:
    return sum(it[0].numel() * it[0].element_size() + it[1].numel() + it[2].numel() * it[2].element_size()
               for it in items)


def check(items, fmt: str = "fp8-block") -> None:
    f = quant_format(fmt)
    for x, q, s, *g in items:
        rq, rs = Q.reference(f, x, BLOCKS[fmt], global_scale=g[0] if g else None)
        assert torch.equal(q, rq.view(torch.uint8)) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8)), \
            f"Triton differs from the {fmt} reference"


def run(device: torch.device, scale: int, repeats: int, backends: list[str], fmt: str = "fp8-block",
        experts: bool = True) -> list[dict]:
    rows = []
    block = BLOCKS[fmt]
    for name, shapes in (("qwen3-8b-layer", DENSE), ("qwen3-30b-a3b-w13", EXPERTS))[:2 if experts else 1]:
        shapes = {n: tuple(max(32, d // scale // 32 * 32) if i >= len(s) - 2 else d for i, d in enumerate(s))
                  for n, s in shapes.items()}
        items = make_items(shapes, device, fmt=fmt)
        nbytes = traffic(items)
        blocks = sum(Q.blocks_count(it[0].shape, block) for it in items)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ceiling = measure(lambda d=dst, s=src: d.copy_(s), device, repeats, 2)
        row = {"case": name, "format": fmt, "tensors": len(items), "blocks": blocks, "bytes": nbytes,
               "ceiling_GBps": nbytes / ceiling["median_ms"] / 1e6}
        for backend in backends:
            fn = lambda b=backend, it=items, k=("bench", name, fmt): Q.quantize_views(  # noqa: E731
                it, block, backend=b, key=k, fmt=fmt)
            fn()
            if backend == "triton":
                check(items, fmt)
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
    p.add_argument("--formats", default="fp8-block,mxfp8,nvfp4", help="comma-separated: fp8-block, mxfp8, nvfp4")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in BLOCKS]
    if bad:
        p.error(f"--formats: unknown format {bad[0]!r} (fp8-block, mxfp8, nvfp4)")
    try:  # before any work: an output path that cannot be written is one line, exit 2
        check_output_file(args.out, '--out')
    except UsageError as e:
        p.error(str(e))
    device = torch.device(args.device)
    rows = []
    for fmt in formats:
        if device.type == "cpu":
            rows += run(device, args.scale, args.repeats, ["torch"], fmt)
            os.environ["TRITON_INTERPRET"] = "1"
            # the interpreter: that it runs, not speed (MXFP8/NVFP4: one program per 32/16 values: the dense layer
            # only, its shapes / 256)
            fp8 = fmt == "fp8-block"
            rows += run(device, max(args.scale, 16 if fp8 else 256), 1, ["triton"], fmt, experts=fp8)
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            rows += run(device, args.scale, args.repeats, ["triton", "torch"], fmt)
    if args.out:
        meta = {"argv": ["perf/bench_quant.py", *(sys.argv[1:] if argv is None else argv)],
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": list(os.getloadavg()),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                "torch": torch.__version__}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
