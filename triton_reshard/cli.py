"""Command line: ``triton-reshard demo`` (and more subcommands as they land)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="triton-reshard", description=__doc__)
    sub = parser.add_subparsers(dest="cmd")
    from . import demo

    p_demo = sub.add_parser("demo", help="reshard a Llama-shaped model on a local world and check it")
    demo.add_args(p_demo)
    p_bench = sub.add_parser("bench", help="end-to-end refit benchmark vs all-gather, wire limit and DTensor")
    p_bench.add_argument("--cases", default="megatron-vllm,colocated,disaggregated,fsdp-tp",
                         help="comma list of: megatron-vllm, colocated, disaggregated, fsdp-tp")
    p_bench.add_argument("--sizes-gb", default="1.0", help="comma list of model sizes in GiB (default 1.0)")
    p_bench.add_argument("--dtype", default="float32")
    p_bench.add_argument("--bucket-mb", type=float, default=64)
    p_bench.add_argument("--repeats", type=int, default=3)
    p_bench.add_argument("--timeout", type=float, default=120.0)
    p_bench.add_argument("--out", default="perf/results", help="folder for bench_refit.json and .png")
    args = parser.parse_args(argv)
    if args.cmd == "bench":
        from .bench import run_bench

        run_bench([c for c in args.cases.split(",") if c], [float(x) for x in args.sizes_gb.split(",")],
                  dtype=args.dtype, bucket_mb=args.bucket_mb, repeats=args.repeats, timeout=args.timeout,
                  out_dir=args.out, progress=lambda s: print(s, flush=True))
        return 0
    if args.cmd is None:
        parser.print_help()
        return 2
    if args.cmd == "demo":
        return demo.run_demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
