"""What reading the destination layout off vLLM's own loader costs, beside vLLM's own load of the weights.

    .venv-engines/bin/python perf/bench_record.py [--model llama_demo] [--tp 2]

Builds a random ``transformers`` checkpoint of a preset config, then in a world of ``--tp`` processes builds
vLLM's model class, times ``DefaultModelLoader.load_weights`` (vLLM reading and placing the real weights) and
``layout_from_vllm`` (vLLM's ``load_weights`` on id tensors under the recorder, plus the all-gather of the
records), and checks the recorded layout's digest against ``vllm_layout``. Prints a table and writes
``perf/results/bench_record.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _rank(rank: int, world: int, ckpt: str, cfg: dict) -> dict:
    import torch

    from triton_reshard.integrations import checkpoint_shapes
    from triton_reshard.integrations.vllm import layout_from_vllm, load_vllm_model
    from triton_reshard.presets import vllm_layout

    t0 = time.perf_counter()
    model, vc = load_vllm_model(ckpt, tensor_parallel_size=world)  # build + vLLM's own load
    t_build_load = time.perf_counter() - t0
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    t0 = time.perf_counter()
    with set_current_vllm_config(vc):
        DefaultModelLoader(vc.load_config).load_weights(model, vc.model_config)  # a second, timed load
    t_load = time.perf_counter() - t0
    shapes = checkpoint_shapes(ckpt)
    t0 = time.perf_counter()
    derived = layout_from_vllm(model, shapes)
    t_record = time.perf_counter() - t0
    preset = vllm_layout(cfg, tp=world, dtype=torch.float32)
    return {"build_and_load_s": t_build_load, "load_s": t_load, "record_s": t_record,
            "same_digest": derived.digest == preset.digest, "digest": derived.digest,
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama_demo")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_record.json"))
    args = ap.parse_args()
    from triton_reshard.tools.cliutil import UsageError, check_output_file

    try:  # before any work: an output path that cannot be written is one line, exit 2
        check_output_file(args.out, '--out', make_folder=True)
    except UsageError as e:
        ap.error(str(e))
    import torch
    import transformers

    from triton_reshard.presets import get_config
    from triton_reshard.testing.launch import run_world

    cfg = get_config(args.model)
    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "deepseek_v3": "DeepseekV3"}
    cls = names[cfg["model_type"]]
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        conf = getattr(transformers, f"{cls}Config")(**{k: v for k, v in cfg.items() if k != "model_type"})
        getattr(transformers, f"{cls}ForCausalLM")(conf).float().save_pretrained(d)
        ckpt_bytes = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))
        res = run_world(_rank, args.tp, d, cfg, backend="gloo", timeout=900)
    rows = {"model": args.model, "tp": args.tp, "checkpoint_bytes": ckpt_bytes, "ranks": res,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(["perf/bench_record.py", *sys.argv[1:]]),
            "meta": {"argv": ["perf/bench_record.py", *sys.argv[1:]],
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": list(os.getloadavg()),
                     "machine": f"CPU, {os.cpu_count()} cores, gloo", "torch": torch.__version__}}
    print(f"{args.model} ({ckpt_bytes / 2**30:.2f} GiB fp32 checkpoint), vLLM TP{args.tp}:")
    print("rank | vLLM load_weights (real weights) | layout_from_vllm (record + gather) | ratio | digest = preset")
    for r, x in enumerate(res):
        print(f"{r:4d} | {x['load_s']:8.2f} s | {x['record_s']:8.2f} s | {x['record_s'] / x['load_s']:.2f} | "
              f"{x['same_digest']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if all(x["same_digest"] for x in res) else 1


if __name__ == "__main__":
    sys.exit(main())
