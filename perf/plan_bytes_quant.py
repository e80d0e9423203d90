"""Wire bytes of one refit per destination format (issue 33): a model's Megatron BF16 shards (TP4 x PP2, ranks 0-7)
into vLLM TP2 (ranks 8-9) from the preset of each ``quantization_config`` (none, block FP8 128x128, ModelOpt
MXFP8, ModelOpt NVFP4): the plan's wire bytes, its lower bound, the bytes the senders quantize and the bytes the
receivers quantize. Planning only (no processes).

    python perf/plan_bytes_quant.py llama-3-8b
"""

from __future__ import annotations

import sys
import time

import torch

from triton_reshard import plan_reshard
from triton_reshard.presets import get_config, megatron_layout, vllm_layout


def main(model: str = "llama-3-8b") -> None:
    cfg = get_config(model)
    src = megatron_layout(cfg, dtype=torch.bfloat16, tp=4, pp=2, ranks=range(8))
    for algo in (None, "fp8", "MXFP8", "NVFP4"):
        c = dict(cfg)
        if algo == "fp8":
            c["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}
        elif algo:
            c["quantization_config"] = {"quant_method": "modelopt", "quantization": {
                "quant_algo": algo, "group_size": 16, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}
        dst = vllm_layout(c, dtype=torch.bfloat16, tp=2, dp=1, ranks=range(8, 10), vllm_version="0.33.0")
        t = time.perf_counter()
        st = plan_reshard(src, dst).stats()
        g = 2 ** 30
        print(f"{model} {algo or 'bf16'}: wire {st.wire_bytes / g:.3f} GiB, lower bound {st.lower_bound_bytes / g:.3f}"
              f" GiB, sender-quantized {st.quant_src_bytes / g:.3f} GiB, receiver-quantized "
              f"{st.quant_dst_bytes / g:.3f} GiB (plan {time.perf_counter() - t:.1f} s)", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
