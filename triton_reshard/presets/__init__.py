"""Layout presets for real models: Hugging Face (unsharded), Megatron-Core (training), vLLM and SGLang
(inference), and live DTensors (FSDP2 / torch TP).

Logical tensors are the Hugging Face checkpoint tensors (``logical_tensors(config)``); every preset maps
them onto the local tensors its framework really has (``named_parameters()`` names and shapes), fused QKV,
gate/up, padded vocab and stacked experts included, all as plain fragments::

    from triton_reshard import refit
    from triton_reshard.presets import get_config, megatron_layout, vllm_layout

    cfg = get_config("qwen3-30b-a3b")
    train = megatron_layout(cfg, tp=2, pp=2, dp=2, ep=4, etp=1, ranks=range(8))
    infer = vllm_layout(cfg, tp=4, dp=2, enable_expert_parallel=True, ranks=range(8))
    refit(dict(megatron_model.named_parameters()), dict(vllm_model.named_parameters()), train, infer)
"""

from .configs import CONFIGS, get_config
from .dtensor import layout_from_dtensors
from .hf import ModelSpec, hf_layout, logical_tensors, model_nbytes, model_numel, model_spec, tensor_dtypes
from .megatron import megatron_layout, padded_vocab_size, stage_layers
from .sglang import sglang_layout
from .vllm import expert_range, pad_vocab_size, vllm_layout

__all__ = [
    "CONFIGS",
    "ModelSpec",
    "expert_range",
    "get_config",
    "hf_layout",
    "layout_from_dtensors",
    "logical_tensors",
    "megatron_layout",
    "model_nbytes",
    "model_numel",
    "model_spec",
    "pad_vocab_size",
    "padded_vocab_size",
    "sglang_layout",
    "stage_layers",
    "tensor_dtypes",
    "vllm_layout",
]
