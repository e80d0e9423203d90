"""Run the copy kernel's autotuning on the pack / unpack lists of model presets and print what it chose.

For each preset (``bench_kernels.MODELS``) the TP4 -> TP2 pack and unpack lists are copied once with
autotuning on (``TRITON_RESHARD_AUTOTUNE=1``): every dtype group benchmarks the configs that survive the
pruning for its shape class. The script prints, per autotune key, the time of every config and the chosen
one, then the GB/s of each list with the chosen configs.

Without a GPU there is nothing to tune: it says so, runs one interpreter launch (to show the kernel runs)
and exits 0.

    python perf/autotune.py --presets llama3-8b qwen2.5-7b --layers 8 --out perf/results/autotune.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import bench_kernels  # a sibling script (perf/ is sys.path[0] when a script here runs)
import torch

from triton_reshard import ops
from triton_reshard.ops import copy as triton_copy
from triton_reshard.tools.cliutil import UsageError, check_output_file


def interpreter_smoke() -> int:
    """One launch of the kernel in Triton's interpreter on CPU tensors, checked against torch."""
    os.environ["TRITON_INTERPRET"] = "1"
    tiny = bench_kernels.MODELS["tiny-llama"]
    lists = bench_kernels.tp_reshard(tiny, tiny.layers, torch.device("cpu"))
    pairs = lists["unpack"]
    t = time.perf_counter()
    triton_copy.triton_copy_views(pairs)
    seconds = time.perf_counter() - t
    out = [d.clone() for _, d in pairs]
    ops.torch_copy_views(pairs)
    same = all(torch.equal(a.view(torch.int16), d.view(torch.int16)) for a, (_, d) in zip(out, pairs, strict=True))
    print(f"interpreter: {len(pairs)} regions of {tiny.name} unpacked in one launch in {seconds:.2f}s, "
          f"{'same bytes as torch' if same else 'DIFFERENT from torch'}")
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["llama3-8b"], choices=sorted(bench_kernels.MODELS))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers per preset (default: all)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    try:  # before any work: an output path that cannot be written is one line, exit 2
        check_output_file(args.out, '--out', make_folder=True)
    except UsageError as e:
        parser.error(str(e))

    if not torch.cuda.is_available():
        print("no GPU: autotuning needs CUDA (the interpreter cannot time configs); one interpreter launch:")
        return interpreter_smoke()

    from triton import knobs

    os.environ.pop("TRITON_INTERPRET", None)
    os.environ[triton_copy.AUTOTUNE_ENV] = "1"
    device = torch.device("cuda")
    events: list[dict] = []

    def listener(fn, key, best_config, configs_timings, duration, cache_hit):
        if cache_hit:
            return
        events.append({
            "key": [str(k) for k in key],
            "best": str(best_config),
            "seconds": duration,
            "timings_ms": {str(c): (t[0] if isinstance(t, list | tuple) else t)
                           for c, t in (configs_timings or {}).items()},
        })

    knobs.autotuning.listener = listener
    rows = []
    for preset in args.presets:
        cfg = bench_kernels.MODELS[preset]
        layers = args.layers if args.layers is not None else cfg.layers
        for direction, pairs in bench_kernels.tp_reshard(cfg, layers, device).items():
            triton_copy.clear_cache()
            start = len(events)
            t = time.perf_counter()
            triton_copy.triton_copy_views(pairs, key=("autotune", preset, direction))
            torch.cuda.synchronize()
            tune_seconds = time.perf_counter() - t
            table = triton_copy.prepare(pairs)
            stats = bench_kernels.measure(
                lambda p=pairs, d=direction, n=preset: triton_copy.triton_copy_views(p, key=("autotune", n, d)),
                device, args.repeats, warmup=3)
            gbps = bench_kernels.traffic(pairs) / (stats["median_ms"] * 1e-3) / 1e9
            row = {"preset": preset, "layers": layers, "direction": direction, "regions": len(pairs),
                   "groups": table.summary(), "first_call_s": tune_seconds, "tuned": events[start:],
                   **stats, "gbps": gbps}
            rows.append(row)
            print(f"\n== {preset} ({layers} layers) {direction}: {len(pairs)} regions; {table.summary()}")
            for ev in row["tuned"]:
                print(f"  key {ev['key']}: best {ev['best']} (tuning {ev['seconds'] or 0:.2f}s)")
                for config, ms in sorted(ev["timings_ms"].items(), key=lambda kv: kv[1]):
                    print(f"      {ms * 1e3:9.1f} us  {config}")
            print(f"  -> {gbps:.0f} GB/s (median {stats['median_ms']:.3f} ms; first call incl. tuning "
                  f"{tune_seconds:.1f}s)")
    knobs.autotuning.listener = None
    kernel = triton_copy.get_kernel()
    print("\nchosen configs (autotune key -> config):")
    for key, config in kernel.cache.items():
        print(f"  {key} -> {config}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "rows": rows,
                                        "chosen": {str(k): str(v) for k, v in kernel.cache.items()}}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
